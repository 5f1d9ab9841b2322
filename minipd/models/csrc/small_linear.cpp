// y = x @ w^T (+ bias) for the few rows of a decode step (M <= 8), float32 or bfloat16 (float32
// sums), over vec.h (AVX-512, AVX2, NEON): each row of w is streamed from memory once, prefetched
// ahead, and meets all M rows of x (as float32) while in registers. At batch 1 to 8 this reads the
// weights at close to the memory's speed, where a general GEMM falls well short; bfloat16 weights
// are half the bytes, widened in registers (exact), so no CPU needs bfloat16 instructions for it;
// where the CPU has AVX512-BF16 or ARM's BF16 they are multiplied with its dot-product instruction.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <string>
#include "elements.h"
#include "ops.h"
#include "vec.h"

namespace {

using minipd_vec::Vec;
constexpr int64_t MAX_ROWS = 8;
constexpr int L = Vec::L;

// M rows of x against R rows of w at a time, U independent sums per pair (FMAs in flight), and a
// software prefetch AHEAD ahead in each row of w: bytes if positive, whole rows if negative, none if
// 0 (the hardware's prefetcher alone). Each ISA's shape per M is the best of a sweep over R, U and
// AHEAD on the default model's weights in step order, one thread: AVX-512 on a 2-core AMD EPYC with
// it; AVX2 on a 2-core AMD EPYC without it, where a software prefetch cost up to 20% at 1-6 rows
// (15.5 against 12.8 GB/s at one row). With 16 registers (AVX2) M x R x U accumulators must leave
// room for R weight vectors and one of x. scripts/bench_small_linear.py measures them.
// Columns ka..kb of x and w (rows K apart): y = the sums (+ bias), or y += them when `add`.
template <int M, int R, int U, int AHEAD, typename W>
void rows_of(const float* x, const W* w, const float* bias, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1,
             int64_t ka, int64_t kb, bool add) {
  using minipd_vec::to_float;
  constexpr int LINE = 64 / sizeof(W);  // elements of w in a cache line
  const int64_t ahead = AHEAD > 0 ? AHEAD / static_cast<int64_t>(sizeof(W)) : -AHEAD * K;  // in elements
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    Vec acc[M][R][U];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) acc[m][r][u] = Vec::zero();
    int64_t k = ka;
    for (; k + L * U <= kb; k += L * U) {
      for (int u = 0; u < U; ++u) {
        Vec wv[R];
        for (int r = 0; r < R; ++r) {
          const W* p = w + (n + r) * K + k + L * u;
          if (AHEAD != 0 && (L * u) % LINE == 0) minipd_vec::prefetch(p + ahead);  // about once per line
          wv[r] = Vec::load(p);
        }
        for (int m = 0; m < M; ++m) {
          const Vec xv = Vec::load(x + m * K + k + L * u);
          for (int r = 0; r < R; ++r) acc[m][r][u] = minipd_vec::fmadd(xv, wv[r], acc[m][r][u]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) {
        Vec total = acc[m][r][0];
        for (int u = 1; u < U; ++u) total = total + acc[m][r][u];
        float s = minipd_vec::reduce_add(total);
        for (int64_t kk = k; kk < kb; ++kk) s += x[m * K + kk] * to_float(w[(n + r) * K + kk]);
        float& out = y[m * N + n + r];
        out = add ? out + s : s + (bias ? bias[n + r] : 0.f);
      }
  }
  for (; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t kk = ka; kk < kb; ++kk) s += x[m * K + kk] * to_float(w[n * K + kk]);
      float& out = y[m * N + n];
      out = add ? out + s : s + (bias ? bias[n] : 0.f);
    }
}

// Where the M rows of x outgrow the L1 cache (the MLP's down projection: 8 x 1,536 floats, 48 KB),
// each FMA's x comes from L2, and on AVX2 that halved the rate. There w is read in column tiles
// that keep x's tile in L1, the partial sums added into y. Tiles break the hardware prefetcher's
// stream along each row, so only shapes that prefetch whole rows ahead themselves (AHEAD < 0) are
// tiled: over the default model's weights on the AVX2 machine, 8 rows read 1.10-1.15x faster, 7
// the same, and 5-6 rows (hardware prefetch only) 0.8x, so they are not tiled. Not measured on
// the other ISAs: off there.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool TILE_X = true;
#else
constexpr bool TILE_X = false;
#endif
constexpr int64_t X_TILE_BYTES = 12 * 1024;
constexpr int64_t X_UNTILED_BYTES = 24 * 1024;

template <int M, int R, int U, int AHEAD, typename W>
void tiles_of(const float* x, const W* w, const float* b, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if constexpr (TILE_X && AHEAD < 0) {
    const int64_t x_bytes = M * K * static_cast<int64_t>(sizeof(float));
    if (x_bytes > X_UNTILED_BYTES) {
      const int64_t tiles = (x_bytes + X_TILE_BYTES - 1) / X_TILE_BYTES, step = L * U;
      const int64_t width = ((K + tiles - 1) / tiles + step - 1) / step * step;
      for (int64_t ka = 0; ka < K; ka += width)
        rows_of<M, R, U, AHEAD>(x, w, b, y, N, K, n0, n1, ka, std::min(K, ka + width), ka > 0);
      return;
    }
  }
  rows_of<M, R, U, AHEAD>(x, w, b, y, N, K, n0, n1, 0, K, false);
}

template <int M, int R, int U, int AHEAD, typename W>
void run(const float* x, const W* w, const float* b, float* y, int64_t N, int64_t K) {
  // called directly on one thread: through parallel_for's lambda the compiler keeps less in
  // registers (measured 1.8x slower at 8 rows)
  if (at::get_num_threads() == 1) return tiles_of<M, R, U, AHEAD>(x, w, b, y, N, K, 0, N);
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) { tiles_of<M, R, U, AHEAD>(x, w, b, y, N, K, n0, n1); });
}

template <typename W>
void rows(int64_t M, const float* xp, const W* wp, const float* bp, float* yp, int64_t N, int64_t K) {
  if (Vec::REGISTERS >= 32) {
    switch (M) {
      case 1: run<1, 1, 4, 4096>(xp, wp, bp, yp, N, K); break;
      case 2: run<2, 1, 4, 4096>(xp, wp, bp, yp, N, K); break;
      case 3: run<3, 2, 2, 4096>(xp, wp, bp, yp, N, K); break;
      case 4: run<4, 1, 2, -4>(xp, wp, bp, yp, N, K); break;
      case 5: run<5, 1, 1, -4>(xp, wp, bp, yp, N, K); break;
      case 6: run<6, 1, 1, -4>(xp, wp, bp, yp, N, K); break;
      case 7: run<7, 1, 2, -4>(xp, wp, bp, yp, N, K); break;
      default: run<8, 2, 1, -4>(xp, wp, bp, yp, N, K); break;
    }
  } else {
    switch (M) {
      case 1: run<1, 1, 4, 0>(xp, wp, bp, yp, N, K); break;
      case 2: run<2, 1, 4, 0>(xp, wp, bp, yp, N, K); break;
      case 3: run<3, 1, 2, 0>(xp, wp, bp, yp, N, K); break;
      case 4: run<4, 1, 2, 0>(xp, wp, bp, yp, N, K); break;
      case 5: run<5, 1, 2, 0>(xp, wp, bp, yp, N, K); break;
      case 6: run<6, 1, 2, 0>(xp, wp, bp, yp, N, K); break;
      case 7: run<7, 1, 1, -4>(xp, wp, bp, yp, N, K); break;
      default: run<8, 1, 1, -4>(xp, wp, bp, yp, N, K); break;
    }
  }
}

// bfloat16 x and w on a CPU with bfloat16 dot-product instructions: each multiplies pairs of
// bfloat16 and adds each pair's two products into one float32 sum, where the widening path needs
// two widenings and two FMAs for the same values. Per ISA: the instruction, and E, the bfloat16
// values it takes per vector.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MINIPD_BF16_DOT 1
namespace bf16_dot {
constexpr int E = 32;  // vdpbf16ps: 32 pairs into 16 sums
using Sums = __m512;
using Pairs = __m512bh;
inline Pairs load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline Sums zero() { return _mm512_setzero_ps(); }
inline Sums dot(Sums acc, Pairs x, Pairs w) { return _mm512_dpbf16_ps(acc, x, w); }
inline float total(Sums a, Sums b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
}  // namespace bf16_dot
#elif defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC) && defined(__aarch64__)
#define MINIPD_BF16_DOT 1
namespace bf16_dot {  // Armv8.6 BF16 (Neoverse V1 and later, Apple M2 and later): built with -march=native
constexpr int E = 8;  // BFDOT: 8 pairs into 4 sums
using Sums = float32x4_t;
using Pairs = bfloat16x8_t;
inline Pairs load(const uint16_t* p) { return vreinterpretq_bf16_u16(vld1q_u16(p)); }
inline Sums zero() { return vdupq_n_f32(0.f); }
inline Sums dot(Sums acc, Pairs x, Pairs w) { return vbfdotq_f32(acc, x, w); }
inline float total(Sums a, Sums b) { return vaddvq_f32(vaddq_f32(a, b)); }
}  // namespace bf16_dot
#else
#define MINIPD_BF16_DOT 0
#endif

#if MINIPD_BF16_DOT
// Two sums per pair of rows in flight, the prefetch of the 32-register float32 shapes above (tuned
// on AVX-512; the ARM path is checked for results under emulation, its speed unmeasured).
namespace bf16_dot {

template <int M, int AHEAD>
void rows_of(const uint16_t* x, const uint16_t* w, const float* bias, float* y, int64_t N, int64_t K, int64_t n0,
             int64_t n1) {
  using minipd_vec::to_float;
  const int64_t ahead = AHEAD > 0 ? AHEAD / 2 : -AHEAD * K;  // in elements
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    Sums acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
    int64_t k = 0;
    for (; k + 2 * E <= K; k += 2 * E)
      for (int u = 0; u < 2; ++u) {
        if (AHEAD != 0 && (E * u * 2) % 64 == 0) minipd_vec::prefetch(row + k + E * u + ahead);
        const Pairs wv = load(row + k + E * u);
        for (int m = 0; m < M; ++m) acc[m][u] = dot(acc[m][u], load(x + m * K + k + E * u), wv);
      }
    for (; k + E <= K; k += E) {
      const Pairs wv = load(row + k);
      for (int m = 0; m < M; ++m) acc[m][0] = dot(acc[m][0], load(x + m * K + k), wv);
    }
    for (int m = 0; m < M; ++m) {
      float s = total(acc[m][0], acc[m][1]);
      for (int64_t kk = k; kk < K; ++kk) s += to_float(x[m * K + kk]) * to_float(row[kk]);
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
  }
}

template <int M, int AHEAD>
void run(const uint16_t* x, const uint16_t* w, const float* b, float* y, int64_t N, int64_t K) {
  if (at::get_num_threads() == 1) return rows_of<M, AHEAD>(x, w, b, y, N, K, 0, N);
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) { rows_of<M, AHEAD>(x, w, b, y, N, K, n0, n1); });
}

void rows(int64_t M, const uint16_t* x, const uint16_t* w, const float* b, float* y, int64_t N, int64_t K) {
  switch (M) {
    case 1: run<1, 4096>(x, w, b, y, N, K); break;
    case 2: run<2, 4096>(x, w, b, y, N, K); break;
    case 3: run<3, 4096>(x, w, b, y, N, K); break;
    case 4: run<4, -4>(x, w, b, y, N, K); break;
    case 5: run<5, -4>(x, w, b, y, N, K); break;
    case 6: run<6, -4>(x, w, b, y, N, K); break;
    case 7: run<7, -4>(x, w, b, y, N, K); break;
    default: run<8, -4>(x, w, b, y, N, K); break;
  }
}

}  // namespace bf16_dot
#endif

}  // namespace

at::Tensor minipd_ops::small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K), w (N, K)");
  const auto dtype = w.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(x.scalar_type() == dtype, "x and w of one dtype");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "1 to 8 rows");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  // x and the bias are small: read as float32 (exact for bfloat16); y rounds once, at the end
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  at::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
#if MINIPD_BF16_DOT
  if (dtype == at::kBFloat16) {
    auto xb = x.contiguous();
    bf16_dot::rows(M, minipd_elements::data<uint16_t>(xb), minipd_elements::data<uint16_t>(w), bp,
                   y.data_ptr<float>(), N, K);
    return y.to(dtype);
  }
#endif
  auto xf = x.to(at::kFloat).contiguous();
  minipd_elements::with_elements(dtype, [&](auto e) {
    rows(M, xf.data_ptr<float>(), minipd_elements::data<decltype(e)>(w), bp, y.data_ptr<float>(), N, K);
  });
  return y.to(dtype);
}

// the instruction set the kernels were built for (vec.h): "avx512", "avx2", "neon" or "scalar"
std::string minipd_ops::kernel_isa() { return MINIPD_VEC_ISA; }

// whether small_linear multiplies bfloat16 with the CPU's bfloat16 dot-product instructions
bool minipd_ops::bfloat16_dot() { return MINIPD_BF16_DOT; }

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("kernel_isa() -> str");
  m.def("bfloat16_dot() -> bool");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) { m.impl("small_linear", &minipd_ops::small_linear); }
TORCH_LIBRARY_IMPL(minipd, CompositeExplicitAutograd, m) {
  m.impl("kernel_isa", &minipd_ops::kernel_isa);
  m.impl("bfloat16_dot", &minipd_ops::bfloat16_dot);
}
