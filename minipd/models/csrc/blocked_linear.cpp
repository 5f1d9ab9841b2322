// y = x @ w^T (+ bias), float32, for any number of rows, on w held in column blocks: (N / NB, K, NB),
// NB = 2 vectors of output columns. Each step k loads the block's two weight vectors once and
// multiplies them with x[m, k] broadcast for MB rows at a time (MB x 2 sums in registers), the
// outer-product form of a GEMM's micro-kernel: a weight read from memory meets every row while in
// registers, and the block's rows of w, NB x K floats, are read in order, which the hardware
// prefetcher follows. small_linear's dot-product form on plain rows needs an x load per FMA and a
// horizontal sum per output; on a 2-core AMD EPYC Zen 4 with AVX-512 (one thread, the default
// model's weights from memory; scripts/bench_small_linear.py) this reads them 1.7x faster than
// oneDNN's product on its own prepacked weights at 8 rows, 1.1x at 32, and multiplies as fast from
// 64 rows to 2,048 (at the core's FLOP rate).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include "elements.h"
#include "ops.h"
#include "vec.h"

namespace {

using minipd_vec::Vec;
constexpr int NV = 2;                                   // weight vectors per block
constexpr int NB = NV * Vec::L;                         // output columns per block
constexpr int MB = Vec::REGISTERS >= 32 ? 8 : 6;        // rows at a time: MB x NV sums, NV weights, one x
constexpr int64_t ROWS_PER_PASS = 128;                  // x's rows met by one pass over w (kept in L2)
// A group of rows asks AHEAD k steps into its block (2 KB, 32 lines; past its end, into the next
// block), so a lone group streams from memory without a pause. Where a pass meets 7-10 rows in two
// groups (on AVX2), the second group read its block again from L2 while memory sat idle: there each
// group asks half of the NEXT block instead (NEXT), spread over its k steps, so memory streams while
// the rows are multiplied. On the Zen 3 AVX2 EPYC (scripts/bench_small_linear.py --against, the same
// weights) 8 rows read 1.17-1.23x faster with it and 10 rows 1.12-1.22x; at 11-12 rows (groups of 6,
// bound by arithmetic) it was 0.86x, so they, and three groups or more, ask AHEAD as before, as do
// blocks past MAX_NEXT_LINES (two of them must sit in L2 beside x; not measured). 1-2 rows
// ask for nothing (the hardware's prefetcher alone keeps up there). Not measured with AVX-512 or NEON:
// off there (and in the scalar build).
constexpr bool ASK_AHEAD = Vec::L == 8 && Vec::REGISTERS == 16;  // AVX2
constexpr int64_t AHEAD = 32;
constexpr int64_t MAX_NEXT_LINES = 2048;  // NEXT only for blocks up to 128 KB (measured to 96 KB; Zen 3's L2: 512 KB)

struct Ahead {
  const char* next = nullptr;  // this group's share of the next block (NEXT)
  uint64_t rate = 0;           // lines of it asked for per k step, in 1/65,536ths (the same line again between)
};

// W: float, or bfloat16's bits (uint16_t) widened exactly in registers where the CPU has no bfloat16
// product instruction (x and y in float32 then; blocked_linear converts them)
template <int M, bool NEXT, typename W>
void block(const float* x, int64_t K, const W* wb, const float* bias, float* y, int64_t N, Ahead ahead) {
  Vec acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (ASK_AHEAD && M >= 3) {
      if constexpr (NEXT) {
        minipd_vec::prefetch_l2(ahead.next + ((k * ahead.rate) >> 16) * 64);
      } else {
        const char* p = reinterpret_cast<const char*>(wb + (k + AHEAD) * NB);
        for (int64_t i = 0; i < static_cast<int64_t>(NB * sizeof(W)); i += 64) minipd_vec::prefetch_l2(p + i);
      }
    }
    Vec w[NV];
    for (int v = 0; v < NV; ++v) w[v] = Vec::load(wb + k * NB + v * Vec::L);
    for (int m = 0; m < M; ++m) {
      const Vec xv = Vec::set1(x[m * K + k]);
      for (int v = 0; v < NV; ++v) acc[m][v] = minipd_vec::fmadd(xv, w[v], acc[m][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const Vec b = bias ? Vec::load(bias + v * Vec::L) : Vec::zero();
    for (int m = 0; m < M; ++m) (acc[m][v] + b).store(y + m * N + v * Vec::L);
  }
}

// bfloat16 on a CPU with AVX512-BF16: w in blocks of NB columns whose K is taken in pairs,
// (N / NB, K / 2, NB, 2), as vdpbf16ps multiplies them: each instruction adds two products (a pair
// of x's bfloat16 values, broadcast, times each column's pair) into each column's float32 sum,
// 32 products where a float32 FMA makes 16, from half the bytes.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MINIPD_BLOCKED_BF16 1
template <int M, bool NEXT, typename W>
void block(const uint16_t* x, int64_t K, const W* wb, const float* bias, uint16_t* y, int64_t N, Ahead) {
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wb + k * NB + v * 32);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + v * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m)  // rounded once, to nearest even, as at::BFloat16 rounds
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], b)));
  }
}

#else
#define MINIPD_BLOCKED_BF16 0
#endif

// block<M> for the `left` (1 to M) rows that remain
template <int M, bool NEXT, typename T, typename W>
void rows_left(int left, const T* x, int64_t K, const W* wb, const float* bias, T* y, int64_t N, Ahead ahead) {
  if constexpr (M > 0) {
    if (left == M) return block<M, NEXT>(x, K, wb, bias, y, N, ahead);
    rows_left<M - 1, NEXT>(left, x, K, wb, bias, y, N, ahead);
  }
}

// column blocks b0..b1 of y, for all M rows; T (x and y): float, or bfloat16's bits where block<M>
// takes them; W (w): T, or bfloat16's bits beside float x and y (widened); the sums are float32
template <typename T, typename W>
void blocks(const T* x, int64_t M, int64_t K, const W* w, const float* bias, T* y, int64_t N, int64_t b0,
            int64_t b1) {
  for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
    const int64_t m1 = std::min(M, m0 + ROWS_PER_PASS);
    for (int64_t b = b0; b < b1; ++b) {
      const W* wb = w + b * K * NB;
      const float* bb = bias ? bias + b * NB : nullptr;
      // the rows in as few groups as MB allows, of even size (each sum's order along k is the same
      // either way): 16 rows on AVX2 as 6 + 5 + 5, not 6 + 6 + 4 (measured faster)
      const int64_t groups = (m1 - m0 + MB - 1) / MB;
      const int64_t lines = K * NB * static_cast<int64_t>(sizeof(W)) / 64;  // of a block
      const bool next = b + 1 < b1 && groups == 2 && m1 - m0 <= 10 && K > 0 && lines <= MAX_NEXT_LINES;  // NEXT
      const int64_t share = next ? (lines + 1) / 2 : 0;  // the next block's lines asked for by each group
      for (int64_t g = 0, m = m0; g < groups; ++g) {
        const int64_t take = (m1 - m + (groups - g) - 1) / (groups - g);
        const Ahead ahead{reinterpret_cast<const char*>(wb + K * NB) + g * share * 64, next ? uint64_t(share << 16) / K : 0};
        auto rows = next ? rows_left<MB, true, T, W> : rows_left<MB, false, T, W>;
        rows(static_cast<int>(take), x + m * K, K, wb, bb, y + m * N + b * NB, N, ahead);
        m += take;
      }
    }
  }
}

// every column block of y: on one thread called directly (through parallel_for's lambda the compiler
// may keep less in registers), else the blocks split among the threads
template <typename T, typename W>
void all_blocks(const T* x, int64_t M, int64_t K, const W* w, const float* bias, T* y, int64_t N) {
  if (at::get_num_threads() == 1 || M == 0) return blocks(x, M, K, w, bias, y, N, 0, N / NB);
  at::parallel_for(0, N / NB, 1, [&](int64_t b0, int64_t b1) { blocks(x, M, K, w, bias, y, N, b0, b1); });
}

at::Tensor blocked_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "w (N, K), float32 or bfloat16");
  TORCH_CHECK(w.size(0) % NB == 0, "blocked_weight: N (", w.size(0), ") must be a multiple of ", NB);
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == at::kFloat || !MINIPD_BLOCKED_BF16)  // bfloat16 without vdpbf16ps: widened, float32's layout
    return w.reshape({N / NB, NB, K}).transpose(1, 2).contiguous();
  TORCH_CHECK(K % 2 == 0, "blocked_weight: bfloat16 K (", K, ") must be even");
  return w.reshape({N / NB, NB, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / NB, K, NB});
}

int64_t block_columns() { return NB; }

}  // namespace

at::Tensor minipd_ops::blocked_linear(const at::Tensor& x_in, const at::Tensor& w,
                                      const c10::optional<at::Tensor>& bias) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(w.dim() == 3 && w.size(2) == NB && w.is_contiguous() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "blocked_linear: w as blocked_weight gives it (N / ", NB, ", K, ", NB, "), float32 or bfloat16");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.size(1) && x_in.scalar_type() == dtype,
              "blocked_linear: x (M, K), of w's dtype");
  const int64_t M = x_in.size(0), K = w.size(1), N = w.size(0) * NB;
  TORCH_CHECK(dtype == at::kFloat || K % 2 == 0 || !MINIPD_BLOCKED_BF16, "blocked_linear: bfloat16 K (", K,
              ") must be even");
  const at::Tensor x = x_in.contiguous();
  at::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "blocked_linear: bias (N,)");
    bf = bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
#if MINIPD_BLOCKED_BF16
  if (dtype == at::kBFloat16) {
    using minipd_elements::data;
    auto y = at::empty({M, N}, x.options());
    all_blocks(data<uint16_t>(x), M, K, data<uint16_t>(w), bp, data<uint16_t>(y), N);
    return y;
  }
#else
  if (dtype == at::kBFloat16) {  // widened: x and y in float32 (exact, and one rounding of y as eager's)
    using minipd_elements::data;
    const at::Tensor xf = x.to(at::kFloat);
    at::Tensor yf = at::empty({M, N}, xf.options());
    all_blocks(xf.data_ptr<float>(), M, K, data<uint16_t>(w), bp, yf.data_ptr<float>(), N);
    return yf.to(at::kBFloat16);
  }
#endif
  auto y = at::empty({M, N}, x.options());
  all_blocks(x.data_ptr<float>(), M, K, w.data_ptr<float>(), bp, y.data_ptr<float>(), N);
  return y;
}

bool minipd_ops::blocked_bfloat16() { return true; }
bool minipd_ops::blocked_bfloat16_dot() { return MINIPD_BLOCKED_BF16; }

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("blocked_weight(Tensor w) -> Tensor");
  m.def("blocked_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("block_columns() -> int");
  m.def("blocked_bfloat16() -> bool");
  m.def("blocked_bfloat16_dot() -> bool");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) {
  m.impl("blocked_weight", &blocked_weight);
  m.impl("blocked_linear", &minipd_ops::blocked_linear);
}
TORCH_LIBRARY_IMPL(minipd, CompositeExplicitAutograd, m) {
  m.impl("block_columns", &block_columns);
  m.impl("blocked_bfloat16", &minipd_ops::blocked_bfloat16);
  m.impl("blocked_bfloat16_dot", &minipd_ops::blocked_bfloat16_dot);
}
