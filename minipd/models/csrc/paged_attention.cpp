// Attention read in place from a paged KV cache: each query token attends to positions
// [0, pos] of its sequence, found through the sequence's block table. Nothing is gathered:
// each K and V slot (every kv head of one position) is read once per query token.
// (Prefill, many tokens of one sequence, has its own kernel: paged_prefill.cpp.)
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>
#include "elements.h"
#include "ops.h"
#include "vec.h"

// bfloat16 keys on a CPU with AVX512-BF16: each query head's dot products with vdpbf16ps (pairs of
// bfloat16 products into float32 sums), with no widening of the keys (once per query head otherwise)
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MINIPD_ATTENTION_BF16_DOT 1
#else
#define MINIPD_ATTENTION_BF16_DOT 0
#endif

namespace {

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename scalar_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_of_token, const at::Tensor& pos_of_token,
         int64_t block_size, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), G = Hq / Hkv, W = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* seq = seq_of_token.data_ptr<int64_t>();
  const int64_t* pos = pos_of_token.data_ptr<int64_t>();
  const int64_t row = Hkv * D;  // one cache slot: every kv head of one position
  const float s = static_cast<float>(scale);

  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(Hq * D), scores, kf(row);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t L = pos[t] + 1;
      const int64_t* table = bt + seq[t] * W;
      auto as_float = [&](const scalar_t* slot) -> const float* {  // one K or V row, as float
        if constexpr (std::is_same_v<scalar_t, float>) {
          return slot;
        } else {
          for (int64_t i = 0; i < row; ++i) kf[i] = load(slot, i);
          return kf.data();
        }
      };
      for (int64_t i = 0; i < Hq * D; ++i) qf[i] = load(qp, t * Hq * D + i) * s;
      scores.resize(Hq * L);
      for (int64_t p = 0; p < L; ++p) {  // each K slot read once, for every query head
        const scalar_t* k = kp + (table[p / block_size] * block_size + p % block_size) * row;
        const float* kr = as_float(k);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* qh = qf.data() + hq * D;
          const float* kh = kr + (hq / G) * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
          scores[hq * L + p] = dot;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {  // softmax per query head
        float* sc = scores.data() + hq * L;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < L; ++p) mx = sc[p] > mx ? sc[p] : mx;
        float sum = 0.f;
        for (int64_t p = 0; p < L; ++p) {
          sc[p] = std::exp(sc[p] - mx);
          sum += sc[p];
        }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < L; ++p) sc[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < L; ++p) {  // each V slot read once
        const scalar_t* v = vp + (table[p / block_size] * block_size + p % block_size) * row;
        const float* vr = as_float(v);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float w = scores[hq * L + p];
          const float* vh = vr + (hq / G) * D;
          float* a = acc.data() + hq * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * vh[d];
        }
      }
      for (int64_t i = 0; i < Hq * D; ++i) op[t * Hq * D + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

// The values of positions slot[0..n-1] added, each weighted by its score, into the sums (acc) of H query
// heads that share their kv head (v: its first element in position 0's slot): each value vector is
// loaded once for all H heads, and the H x X sums are that many independent chains of FMAs (one head
// alone has X = D / L, 4 at D 64 on AVX-512, too few to hide an FMA's latency). Each sum adds the
// positions in the same order as one head alone would (the same bits). On a Zen 5 EPYC with AVX-512
// (docs/figures/decode_attention_values_zen5_avx512.txt): hot 1.07-1.38x, from memory float32 the
// same and bfloat16 1.07-1.10x, at head_dim 64 (128 is tested, not timed). AVX2 and NEON keep one
// head at a time (their X sums fill the share).
template <int H, int X, typename E>
void add_values(float* acc, int64_t D, const float* sc, int64_t Lp, const E* v, const int64_t* slot, int64_t n,
                int64_t row) {
  using minipd_vec::Vec;
  constexpr int L = Vec::L;
  Vec s[H][X];
  for (int h = 0; h < H; ++h)
    for (int x = 0; x < X; ++x) s[h][x] = Vec::load(acc + h * D + L * x);
  for (int64_t i = 0; i < n; ++i) {
    const E* vr = v + slot[i] * row;
    Vec vv[X];
    for (int x = 0; x < X; ++x) vv[x] = Vec::load(vr + L * x);
    for (int h = 0; h < H; ++h) {
      const Vec w = Vec::set1(sc[h * Lp + i]);
      for (int x = 0; x < X; ++x) s[h][x] = minipd_vec::fmadd(w, vv[x], s[h][x]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int x = 0; x < X; ++x) s[h][x].store(acc + h * D + L * x);
}

// add_values for h (1 to H) heads
template <int H, int X, typename E>
void add_values(int h, float* acc, int64_t D, const float* sc, int64_t Lp, const E* v, const int64_t* slot, int64_t n,
                int64_t row) {
  if constexpr (H > 1)
    if (h < H) return add_values<H - 1, X>(h, acc, D, sc, Lp, v, slot, n, row);
  add_values<H, X>(acc, D, sc, Lp, v, slot, n, row);
}

// The vector path over vec.h, float32 or bfloat16 (E: q, caches and output; float32 sums), head_dim
// D a multiple of the lanes L. Positions go L at a time, each found through the block table once
// (its slot: every kv head of one position), with the lines of two groups ahead asked for meanwhile
// (ask_for). Keys: each query head, held in registers, meets the L keys, and the L dot products are
// summed across lanes together (lane_sums); then the softmax; then the values, added into D / L
// accumulators per query head.
template <int D, typename E>
void run_vec(const E* qp, const E* kp, const E* vp, const int64_t* bt, const int64_t* seq, const int64_t* pos,
             int64_t T, int64_t Hq, int64_t Hkv, int64_t W, int64_t bs, float scale, E* op) {
  using minipd_vec::Vec;
  constexpr int L = Vec::L, X = D / L;
  constexpr int LINE = 64 / sizeof(E);  // elements in a cache line
  const int64_t G = Hq / Hkv, row = Hkv * D;
  constexpr int HEADS = std::max(1, Vec::REGISTERS * 3 / 4 / X);  // query heads whose values' sums fit in registers
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(Hq * D), acc(Hq * D), inv(Hq);
    std::vector<int64_t> slot;
    const int64_t lines = (row + LINE - 1) / LINE;  // per slot
    // into L2, lines j0..j1-1 of positions p0..p0+L-1 (line j: position p0 + j / lines). Asked two groups
    // of L ahead, and a group's lines shared among the query heads' work: on the AVX-512 EPYC, 1.5-1.6x
    // faster from memory than asking each next block into L1 (scripts/bench_decode_attention.py).
    auto ask_for = [&](const E* cache, int64_t p0, int64_t Lk, int64_t j0, int64_t j1) {
      j1 = std::min(j1, std::max<int64_t>(0, Lk - p0) * lines);
      if (j0 >= j1) return;
      int64_t p = p0 + j0 / lines, i = j0 % lines;  // one division a call, not one a line
      const E* r = cache + slot[p] * row;
      for (int64_t j = j0; j < j1; ++j) {
        minipd_vec::prefetch_l2(r + i * LINE);
        if (++i == lines && j + 1 < j1) {
          i = 0;
          r = cache + slot[++p] * row;
        }
      }
    };
    constexpr int64_t AHEAD = 2;  // groups of L positions
    const int64_t share = (L * lines + Hq - 1) / Hq;  // of a group's lines, per query head
    for (int64_t t = begin; t < end; ++t) {
      const int64_t Lk = pos[t] + 1, Lp = (Lk + L - 1) / L * L;
      const int64_t* table = bt + seq[t] * W;
      scores.resize(Hq * Lp);
      slot.resize(Lp);
      for (int64_t p = 0; p < Lp; ++p) {
        const int64_t q = std::min(p, Lk - 1);  // past the end: the last slot again, its score padded below
        slot[p] = table[q / bs] * bs + q % bs;
      }
      if (!(MINIPD_ATTENTION_BF16_DOT && std::is_same_v<E, uint16_t>))  // the dot products there take q as it is
        for (int64_t i = 0; i < Hq * D; i += L) (Vec::load(qp + t * Hq * D + i) * Vec::set1(scale)).store(qf.data() + i);
      ask_for(kp, 0, Lk, 0, AHEAD * L * lines);
      for (int64_t p0 = 0; p0 < Lk; p0 += L) {  // keys
        const E* rows[L];
        for (int i = 0; i < L; ++i) rows[i] = kp + slot[p0 + i] * row;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const int64_t off = (hq / G) * D;
          ask_for(kp, p0 + AHEAD * L, Lk, hq * share, (hq + 1) * share);
#if MINIPD_ATTENTION_BF16_DOT
          if constexpr (std::is_same_v<E, uint16_t>) {  // q as it is (bfloat16), the scale applied to the sums
            constexpr int P = D / 32;                    // vectors of 32 bfloat16
            __m512bh qv[P];
            for (int x = 0; x < P; ++x) qv[x] = (__m512bh)_mm512_loadu_si512(qp + (t * Hq + hq) * D + 32 * x);
            Vec dots[L];
            for (int i = 0; i < L; ++i) {
              __m512 c = _mm512_setzero_ps();
              for (int x = 0; x < P; ++x) c = _mm512_dpbf16_ps(c, qv[x], (__m512bh)_mm512_loadu_si512(rows[i] + off + 32 * x));
              dots[i] = {c};
            }
            (minipd_vec::lane_sums(dots) * Vec::set1(scale)).store(scores.data() + hq * Lp + p0);
            continue;
          }
#endif
          Vec qv[X], dots[L];
          for (int x = 0; x < X; ++x) qv[x] = Vec::load(qf.data() + hq * D + L * x);
          for (int i = 0; i < L; ++i) {
            Vec k[X];  // widened first, so that the sums are the same code for every E (and in two chains)
            for (int x = 0; x < X; ++x) k[x] = Vec::load(rows[i] + off + L * x);
            Vec c0 = qv[0] * k[0], c1 = qv[1] * k[1];
            for (int x = 2; x < X; x += 2) {
              c0 = minipd_vec::fmadd(qv[x], k[x], c0);
              c1 = minipd_vec::fmadd(qv[x + 1], k[x + 1], c1);
            }
            dots[i] = c0 + c1;
          }
          minipd_vec::lane_sums(dots).store(scores.data() + hq * Lp + p0);
        }
      }
      ask_for(vp, 0, Lk, 0, AHEAD * L * lines);
      for (int64_t hq = 0; hq < Hq; ++hq) {  // softmax per query head
        float* sc = scores.data() + hq * Lp;
        for (int64_t p = Lk; p < Lp; ++p) sc[p] = -1e30f;  // padding: e^(-1e30 - max) is 0
        Vec mx = Vec::set1(-1e30f);
        for (int64_t p = 0; p < Lp; p += L) mx = minipd_vec::max(mx, Vec::load(sc + p));
        const Vec m = Vec::set1(minipd_vec::reduce_max(mx));
        Vec sum = Vec::zero();
        for (int64_t p = 0; p < Lp; p += L) {
          const Vec e = minipd_vec::exp(Vec::load(sc + p) - m);
          e.store(sc + p);
          sum = sum + e;
        }
        inv[hq] = 1.f / minipd_vec::reduce_add(sum);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = 0; p0 < Lk; p0 += L) {  // values
        const int64_t n = std::min<int64_t>(L, Lk - p0);
        for (int64_t hq = 0; hq < Hq;) {  // the query heads of one kv head together, up to HEADS of them
          const int64_t heads = std::min<int64_t>(HEADS, G - hq % G);
          ask_for(vp, p0 + AHEAD * L, Lk, hq * share, (hq + heads) * share);
          add_values<HEADS, X>(static_cast<int>(heads), acc.data() + hq * D, D, scores.data() + hq * Lp + p0, Lp,
                               vp + (hq / G) * D, slot.data() + p0, n, row);
          hq += heads;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq)
        for (int x = 0; x < X; ++x)
          minipd_vec::store(Vec::load(acc.data() + hq * D + L * x) * Vec::set1(inv[hq]), op + (t * Hq + hq) * D + L * x);
    }
  });
}

}  // namespace

at::Tensor minipd_ops::paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_of_token,
                                       const at::Tensor& pos_of_token, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q (T, Hq, D), caches (S, Hkv, D)");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto qc = q.contiguous();
  auto bt = block_tables.to(at::kLong).contiguous();
  auto sq = seq_of_token.to(at::kLong).contiguous();
  auto ps = pos_of_token.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  const int64_t D = qc.size(2);
  const auto dtype = qc.scalar_type();
  const bool vec = (dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
                   v_cache.scalar_type() == dtype && (D == 64 || D == 128);
  if (vec) {
    minipd_elements::with_elements(dtype, [&](auto e) {
      using E = decltype(e);
      using minipd_elements::data;
      auto go = [&](auto d) {
        run_vec<decltype(d)::value, E>(data<E>(qc), data<E>(k_cache), data<E>(v_cache), bt.data_ptr<int64_t>(),
                                       sq.data_ptr<int64_t>(), ps.data_ptr<int64_t>(), qc.size(0), qc.size(1),
                                       k_cache.size(1), bt.size(1), block_size, static_cast<float>(scale), data<E>(out));
      };
      if (D == 64) go(std::integral_constant<int, 64>());
      else go(std::integral_constant<int, 128>());
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(qc, k_cache, v_cache, bt, sq, ps, block_size, scale, out);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_of_token, "
        "Tensor pos_of_token, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) { m.impl("paged_attention", &minipd_ops::paged_attention); }
