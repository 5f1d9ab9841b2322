// Prefill attention read in place from the paged KV cache, flash-attention style (online softmax,
// nothing of size T x T is ever stored), float32 or bfloat16 (float32 inside), over vec.h (AVX-512,
// AVX2, NEON). One sequence's T new tokens, at positions [ctx - T, ctx), attend causally to its keys [0, position] found through its block
// table; their own K and V are already in the cache. The same call serves a whole prompt and one
// chunk of it (a cached prefix is read where it lies, not gathered).
//
// Per kv head: its keys are copied once per call into K^T (head_dim x keys, keys along the vector
// lanes; V is read in place), then tiles of ROWS query rows (query position x query head of
// the group, which share the kv head) sweep the keys KEYS at a time: scores by broadcasting each
// query element against two vectors of K^T, then p * V into the tile's output (on AVX2, BAND tiles
// take each block of keys in turn, so that it is read from memory once for them). The tile shapes
// follow the registers the ISA has (32 vectors on AVX-512 and NEON, 16 on AVX2).
//
// bfloat16 on a CPU with AVX512-BF16 multiplies in vdpbf16ps instead (two products of bfloat16 into
// each float32 sum, twice float32 FMA's work per instruction): K^T is held in pairs of dimensions,
// V in pairs of keys, and each tile's softmax weights p are rounded to bfloat16 for p * V, as
// flash attention does on GPUs (the sums, the max and the normalizer stay float32).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include "elements.h"
#include "vec.h"

namespace {

using minipd_vec::from_float;
using minipd_vec::to_float;
using minipd_vec::Vec;
constexpr int L = Vec::L;
constexpr bool WIDE = Vec::REGISTERS >= 32;
constexpr int ROWS = WIDE ? 12 : 6;  // query rows per tile: 2 x ROWS score accumulators + 2 K^T vectors + 1 broadcast
constexpr int GROUP = WIDE ? 4 : 6;  // rows of o updated together: GROUP x COLS accumulators + COLS V vectors + 1
constexpr int COLS = WIDE ? 4 : 2;  // vectors of o's columns updated together
// query tiles that sweep the keys together, a block of keys at a time (the block's K^T and V stay in L1
// and L2 from one tile to the next, where one tile after another read them all from L3 at 1,024 keys
// and more): on the Zen 3 AVX2 EPYC 1.05-1.16x at 2,048 tokens, even at 512
// (scripts/bench_prefill_attention.py). Not measured with AVX-512 or NEON: one tile there.
constexpr int BAND = Vec::L == 8 ? 4 : 1;
constexpr int KEYS = 128;  // keys per step of the online softmax (its reductions and rescales amortized)
constexpr int VEC = KEYS / L;
constexpr int MAX_D = 256;
constexpr int KEY_PAD = 32;  // keys are padded to a multiple of this (>= 2 vectors on every ISA)
// K^T's rows one cache line further apart than its keys: at a stride of a multiple of 4 KB (1,024 keys
// or more) the D rows a score block reads fall in one set of L1 and evict each other
constexpr int ROW_SKEW = 16;
constexpr float NONE = -1e30f;  // the running max before any key; finite, as -ffast-math assumes
static_assert(ROWS % GROUP == 0 && KEY_PAD % (2 * L) == 0 && KEYS % KEY_PAD == 0, "tile shapes");
static_assert(2 * ROWS + 3 <= Vec::REGISTERS && GROUP * COLS + COLS + 1 <= Vec::REGISTERS, "tiles held in registers");
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MINIPD_PREFILL_BF16_DOT 1
#else
#define MINIPD_PREFILL_BF16_DOT 0
#endif

// s[r][c:c+2L] = q[r] . keys c..c+2L-1 of kt, K^T of one head with row stride ld
template <int D>
inline void scores(const float* q, const float* kt, int64_t ld, float s[ROWS][KEYS], int c) {
  Vec acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = Vec::zero();
#if defined(__AVX2__) && !defined(__AVX512F__)  // measured there: unrolled, K^T came from memory for each FMA
#pragma GCC unroll 1
#endif
  for (int d = 0; d < D; ++d) {
    const Vec k0 = Vec::load(kt + d * ld), k1 = Vec::load(kt + d * ld + L);
    for (int r = 0; r < ROWS; ++r) {
      const Vec qv = Vec::set1(q[r * MAX_D + d]);
      acc[r][0] = minipd_vec::fmadd(qv, k0, acc[r][0]);
      acc[r][1] = minipd_vec::fmadd(qv, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    acc[r][0].store(s[r] + c);
    acc[r][1].store(s[r] + c + L);
  }
}

// columns [c, c + W * L) of o[r] = o[r] * corr[r] + sum_j<n p[r][j] v[j], GROUP rows at a time
template <int W, typename E>
inline void accumulate_columns(float* o, const float* corr, const float p[ROWS][KEYS], const E* const* v, int n, int c) {
  for (int r0 = 0; r0 < ROWS; r0 += GROUP) {
    Vec acc[GROUP][W];
    for (int r = 0; r < GROUP; ++r)
      for (int x = 0; x < W; ++x) acc[r][x] = Vec::load(o + (r0 + r) * MAX_D + c + L * x) * Vec::set1(corr[r0 + r]);
    for (int j = 0; j < n; ++j) {
      Vec vv[W];
      for (int x = 0; x < W; ++x) vv[x] = Vec::load(v[j] + c + L * x);
      for (int r = 0; r < GROUP; ++r) {
        const Vec pv = Vec::set1(p[r0 + r][j]);
        for (int x = 0; x < W; ++x) acc[r][x] = minipd_vec::fmadd(pv, vv[x], acc[r][x]);
      }
    }
    for (int r = 0; r < GROUP; ++r)
      for (int x = 0; x < W; ++x) acc[r][x].store(o + (r0 + r) * MAX_D + c + L * x);
  }
}

template <int D, typename E>
inline void accumulate(float* o, const float* corr, const float p[ROWS][KEYS], const E* const* v, int n) {
  constexpr int V = D / L, FULL = V / COLS, REST = V % COLS;
  for (int i = 0; i < FULL; ++i) accumulate_columns<COLS>(o, corr, p, v, n, i * COLS * L);
  if constexpr (REST > 0) accumulate_columns<REST>(o, corr, p, v, n, FULL * COLS * L);
}

inline uint32_t pair_at(const uint16_t* p) {  // two consecutive bfloat16, the first in the low half
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

#if MINIPD_PREFILL_BF16_DOT

// s[r][c:c+32] = scale * q[r] . keys c..c+31, from K^T in pairs (D / 2 x keys, each lane a pair of
// consecutive dimensions of one key) and q's rows as they are (bfloat16, pairs side by side)
template <int D>
inline void scores_dot(const uint16_t* q, const uint32_t* kt, int64_t ld, float scale, float s[ROWS][KEYS], int c) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int d = 0; d < D / 2; ++d) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + d * ld), k1 = (__m512bh)_mm512_loadu_si512(kt + d * ld + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(q + r * MAX_D + 2 * d)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(s[r] + c, _mm512_mul_ps(acc[r][0], sc));
    _mm512_storeu_ps(s[r] + c + 16, _mm512_mul_ps(acc[r][1], sc));
  }
}

// columns [c, c + W * 16) of o[r] = o[r] * corr[r] + sum_j<2 pairs p[r][j] v[j], from p in bfloat16
// (pairs of keys side by side) and V in pairs of keys (keys / 2 x D, each lane one dimension of two keys)
template <int D, int W>
inline void accumulate_columns_dot(float* o, const float* corr, const uint16_t p[ROWS][KEYS], const uint32_t* v,
                                   int pairs, int c) {
  for (int r0 = 0; r0 < ROWS; r0 += GROUP) {
    __m512 acc[GROUP][W];
    for (int r = 0; r < GROUP; ++r)
      for (int x = 0; x < W; ++x)
        acc[r][x] = _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + r) * MAX_D + c + 16 * x), _mm512_set1_ps(corr[r0 + r]));
    for (int j = 0; j < pairs; ++j) {
      __m512bh vv[W];
      for (int x = 0; x < W; ++x) vv[x] = (__m512bh)_mm512_loadu_si512(v + j * D + c + 16 * x);
      for (int r = 0; r < GROUP; ++r) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(p[r0 + r] + 2 * j)));
        for (int x = 0; x < W; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pv, vv[x]);
      }
    }
    for (int r = 0; r < GROUP; ++r)
      for (int x = 0; x < W; ++x) _mm512_storeu_ps(o + (r0 + r) * MAX_D + c + 16 * x, acc[r][x]);
  }
}

template <int D>
inline void accumulate_dot(float* o, const float* corr, const float p[ROWS][KEYS], const uint32_t* v, int n) {
  alignas(64) uint16_t pb[ROWS][KEYS];
  for (int r = 0; r < ROWS; ++r)
    for (int x = 0; x < KEYS; x += 32)
      _mm512_storeu_si512(pb[r] + x, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p[r] + x + 16), _mm512_loadu_ps(p[r] + x)));
  constexpr int V = D / 16, FULL = V / COLS, REST = V % COLS;
  const int pairs = (n + 1) / 2;  // an odd n's last pair: p is 0 past n, and V's keys are padded with zeros
  for (int i = 0; i < FULL; ++i) accumulate_columns_dot<D, COLS>(o, corr, pb, v, pairs, i * COLS * 16);
  if constexpr (REST > 0) accumulate_columns_dot<D, REST>(o, corr, pb, v, pairs, FULL * COLS * 16);
}
#else  // not called in a build without AVX512-BF16 (run's DOT is false)
template <int D>
inline void scores_dot(const uint16_t*, const uint32_t*, int64_t, float, float[ROWS][KEYS], int) {}
template <int D>
inline void accumulate_dot(float*, const float*, const float[ROWS][KEYS], const uint32_t*, int) {}
#endif

template <int D, typename E>
void run(const E* q, const E* k_cache, const E* v_cache, const int64_t* table, int64_t block_size, int64_t T,
         int64_t ctx, int64_t Hq, int64_t Hkv, float scale, E* out) {
  const int64_t G = Hq / Hkv, first = ctx - T;  // position of the first query
  const int64_t Lk = (ctx + KEY_PAD - 1) / KEY_PAD * KEY_PAD;  // keys, padded with zeros to whole score blocks
  const int64_t ld = Lk + ROW_SKEW;  // K^T's row stride
  static const E zeros[MAX_D] = {};
  constexpr bool DOT = MINIPD_PREFILL_BF16_DOT && std::is_same_v<E, uint16_t>;
  using KT = std::conditional_t<DOT, uint32_t, float>;  // K^T's element: a float, or a pair of bfloat16
  constexpr int KT_ROWS = DOT ? D / 2 : D;
  auto kt_all = at::empty({Hkv, KT_ROWS, ld}, DOT ? at::kInt : at::kFloat);
  KT* ktp = reinterpret_cast<KT*>(kt_all.data_ptr());
  std::vector<const E*> v_rows(Hkv * ctx);  // V is read where it lies, a row per key
  auto v_pairs = at::empty({DOT ? Hkv : 0, Lk / 2, D}, at::kInt);  // or, for vdpbf16ps, in pairs of keys
  uint32_t* vpp = reinterpret_cast<uint32_t*>(v_pairs.data_ptr());
  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t j0 = 0; j0 < Lk; j0 += 16) {  // 16 keys at a time: each K^T write is one cache line
        const E* k[16];
        for (int jj = 0; jj < 16; ++jj) {
          const int64_t j = j0 + jj;
          k[jj] = j < ctx ? k_cache + ((table[j / block_size] * block_size + j % block_size) * Hkv + h) * D : zeros;
        }
        for (int d = 0; d < KT_ROWS; ++d) {
          KT* dst = ktp + (h * KT_ROWS + d) * ld + j0;
          if constexpr (DOT)
            for (int jj = 0; jj < 16; ++jj) dst[jj] = pair_at(k[jj] + 2 * d);
          else
            for (int jj = 0; jj < 16; ++jj) dst[jj] = to_float(k[jj][d]);
        }
      }
      for (int64_t j = 0; j < ctx; ++j)
        v_rows[h * ctx + j] = v_cache + ((table[j / block_size] * block_size + j % block_size) * Hkv + h) * D;
      if constexpr (DOT)
        for (int64_t j = 0; j < Lk; j += 2) {
          const uint16_t* v0 = j < ctx ? v_rows[h * ctx + j] : zeros;
          const uint16_t* v1 = j + 1 < ctx ? v_rows[h * ctx + j + 1] : zeros;
          uint32_t* dst = vpp + (h * Lk + j) / 2 * D;
          for (int d = 0; d < D; ++d) dst[d] = v0[d] | static_cast<uint32_t>(v1[d]) << 16;
        }
    }
  });
  const int64_t rows = T * G, tiles = (rows + ROWS - 1) / ROWS;  // rows of one kv head: (position, g)
  const int64_t bands = (tiles + BAND - 1) / BAND;
  at::parallel_for(0, Hkv * bands, 1, [&](int64_t w0, int64_t w1) {
    alignas(64) std::conditional_t<DOT, uint16_t, float> qt[BAND][ROWS * MAX_D];  // bfloat16 as it is for vdpbf16ps
    alignas(64) float o[BAND][ROWS * MAX_D], s[ROWS][KEYS], p[ROWS][KEYS];
    float m[BAND][ROWS], l[BAND][ROWS], corr[ROWS];
    int64_t pos[BAND][ROWS];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t h = w / bands, tile0 = (w % bands) * BAND;
      const int in_band = static_cast<int>(std::min<int64_t>(BAND, tiles - tile0));
      for (int t = 0; t < in_band; ++t) {
        const int64_t row0 = (tile0 + t) * ROWS;
        const int n = static_cast<int>(std::min<int64_t>(ROWS, rows - row0));
        for (int r = 0; r < ROWS; ++r) {  // scaled queries (vdpbf16ps: scaled scores); rows past the end are zeros, never stored
          const int64_t i = (row0 + std::min(r, n - 1)) / G, g = (row0 + std::min(r, n - 1)) % G;
          const E* src = q + (i * Hq + h * G + g) * D;
          if constexpr (DOT)
            for (int64_t d = 0; d < D; ++d) qt[t][r * MAX_D + d] = r < n ? src[d] : 0;
          else
            for (int64_t d = 0; d < D; ++d) qt[t][r * MAX_D + d] = r < n ? to_float(src[d]) * scale : 0.f;
          std::fill(o[t] + r * MAX_D, o[t] + r * MAX_D + D, 0.f);
          pos[t][r] = first + i;
          m[t][r] = NONE;
          l[t][r] = 0.f;
        }
      }
      const KT* kt = ktp + h * KT_ROWS * ld;
      const E* const* vh = v_rows.data() + h * ctx;
      // key blocks outside, the band's tiles inside: a block's K^T and V, read from memory for the
      // first tile, stay in L1 and L2 for the others
      for (int64_t k0 = 0; k0 < pos[in_band - 1][ROWS - 1] + 1; k0 += KEYS) {
        for (int t = 0; t < in_band; ++t) {
          const int64_t end = pos[t][ROWS - 1] + 1;  // the tile's last row sees the most keys
          if (k0 >= end) continue;
          const int n = static_cast<int>(std::min<int64_t>(KEYS, end - k0));
          for (int c = 0; c < n; c += 2 * L)
            if constexpr (DOT) scores_dot<D>(qt[t], kt + k0 + c, ld, scale, s, c);
            else scores<D>(qt[t], kt + k0 + c, ld, s, c);
          for (int r = 0; r < ROWS; ++r) {
            const int64_t seen = std::clamp<int64_t>(pos[t][r] + 1 - k0, 0, KEYS);  // keys this row may see
            if (seen == 0) {
              corr[r] = 1.f;
              std::fill(p[r], p[r] + KEYS, 0.f);
              continue;
            }
            std::fill(s[r] + seen, s[r] + KEYS, NONE);  // keys it may not see (causal, or past the end)
            Vec mv = Vec::set1(m[t][r]);
            for (int x = 0; x < VEC; ++x) mv = minipd_vec::max(mv, Vec::load(s[r] + L * x));
            const float mx = minipd_vec::reduce_max(mv);
            mv = Vec::set1(mx);
            Vec sum = Vec::zero();
            for (int x = 0; x < VEC; ++x) minipd_vec::exp(Vec::load(s[r] + L * x) - mv).store(p[r] + L * x);
            if (seen < KEYS) std::fill(p[r] + seen, p[r] + KEYS, 0.f);  // exactly 0, not e^-104
            for (int x = 0; x < VEC; ++x) sum = sum + Vec::load(p[r] + L * x);
            corr[r] = std::exp(m[t][r] - mx);  // 0 on the first keys (m = NONE)
            l[t][r] = l[t][r] * corr[r] + minipd_vec::reduce_add(sum);
            m[t][r] = mx;
          }
          if constexpr (DOT) accumulate_dot<D>(o[t], corr, p, vpp + (h * Lk + k0) / 2 * D, n);
          else accumulate<D>(o[t], corr, p, vh + k0, n);
        }
      }
      for (int t = 0; t < in_band; ++t) {
        const int64_t row0 = (tile0 + t) * ROWS;
        const int n = static_cast<int>(std::min<int64_t>(ROWS, rows - row0));
        for (int r = 0; r < n; ++r) {
          const int64_t i = (row0 + r) / G, g = (row0 + r) % G;
          E* dst = out + (i * Hq + h * G + g) * D;
          const float inv = 1.f / l[t][r];
          for (int64_t d = 0; d < D; ++d) from_float(o[t][r * MAX_D + d] * inv, dst + d);
        }
      }
    }
  });
}

bool supported_head_dim(int64_t D) {
  return D == 16 || D == 32 || D == 48 || D == 64 || D == 128 || D == 192 || D == 256;
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, int64_t ctx_len, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q (T, Hq, D), caches (S, Hkv, D)");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "float32 or bfloat16, q and caches of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(2) == D, "query heads must be a multiple of kv heads");
  TORCH_CHECK(supported_head_dim(D), "head_dim must be 16, 32, 48, 64, 128, 192 or 256");
  TORCH_CHECK(T >= 1 && ctx_len >= T, "ctx_len counts the T new tokens and the prefix before them");
  auto bt = block_table.to(at::kLong).contiguous();
  TORCH_CHECK(bt.dim() == 1 && bt.size(0) * block_size >= ctx_len, "block table too short for ctx_len");
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  auto go = [&](auto d) {
    minipd_elements::with_elements(dtype, [&](auto e) {
      using E = decltype(e);
      using minipd_elements::data;
      run<decltype(d)::value, E>(data<E>(qc), data<E>(k_cache), data<E>(v_cache), bt.data_ptr<int64_t>(), block_size,
                                 T, ctx_len, Hq, Hkv, static_cast<float>(scale), data<E>(out));
    });
  };
  switch (D) {
    case 16: go(std::integral_constant<int, 16>()); break;
    case 32: go(std::integral_constant<int, 32>()); break;
    case 48: go(std::integral_constant<int, 48>()); break;
    case 64: go(std::integral_constant<int, 64>()); break;
    case 128: go(std::integral_constant<int, 128>()); break;
    case 192: go(std::integral_constant<int, 192>()); break;
    case 256: go(std::integral_constant<int, 256>()); break;
  }
  return out;
}

bool prefill_bfloat16_dot() { return MINIPD_PREFILL_BF16_DOT; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int ctx_len, int block_size, "
        "float scale) -> Tensor");
  m.def("prefill_bfloat16_dot() -> bool");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
TORCH_LIBRARY_IMPL(minipd, CompositeExplicitAutograd, m) { m.impl("prefill_bfloat16_dot", &prefill_bfloat16_dot); }
