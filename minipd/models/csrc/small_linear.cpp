// y = x @ w^T (+ bias) for the few rows of a decode step (M <= 8), float32, AVX-512: each row of w
// is streamed from memory once, prefetched ahead, and meets all M rows of x while in registers.
// At batch 1 to 8 this reads the weights at close to the memory's speed, where a general GEMM
// falls well short.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MAX_ROWS = 8;

#ifdef __AVX512F__
// M rows of x against R rows of w at a time, U independent sums per pair (FMAs in flight), and a
// software prefetch AHEAD ahead in each row of w: bytes if positive, whole rows if negative.
// The shape per M is the best of a sweep over R, U and AHEAD on the default model's weights in
// step order (one thread, this 2-core AMD EPYC); scripts/bench_small_linear.py measures the result.
template <int M, int R, int U, int AHEAD>
void rows_of(const float* x, const float* w, const float* bias, float* y, int64_t N, int64_t K, int64_t n0,
             int64_t n1) {
  const int64_t ahead = AHEAD > 0 ? AHEAD / 4 : -AHEAD * K;  // in floats
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[M][R][U];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) acc[m][r][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U) {
      for (int u = 0; u < U; ++u) {
        __m512 wv[R];
        for (int r = 0; r < R; ++r) {
          const float* p = w + (n + r) * K + k + 16 * u;
          _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
          wv[r] = _mm512_loadu_ps(p);
        }
        for (int m = 0; m < M; ++m) {
          const __m512 xv = _mm512_loadu_ps(x + m * K + k + 16 * u);
          for (int r = 0; r < R; ++r) acc[m][r][u] = _mm512_fmadd_ps(xv, wv[r], acc[m][r][u]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) {
        __m512 total = acc[m][r][0];
        for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][r][u]);
        float s = _mm512_reduce_add_ps(total);
        for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * w[(n + r) * K + kk];
        y[m * N + n + r] = s + (bias ? bias[n + r] : 0.f);
      }
  }
  for (; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t kk = 0; kk < K; ++kk) s += x[m * K + kk] * w[n * K + kk];
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
}

template <int M, int R, int U, int AHEAD>
void run(const float* x, const float* w, const float* b, float* y, int64_t N, int64_t K) {
  // called directly on one thread: through parallel_for's lambda the compiler keeps less in
  // registers (measured 1.8x slower at 8 rows)
  if (at::get_num_threads() == 1) return rows_of<M, R, U, AHEAD>(x, w, b, y, N, K, 0, N);
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) { rows_of<M, R, U, AHEAD>(x, w, b, y, N, K, n0, n1); });
}
#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "1 to 8 rows");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), N = w.size(0), K = w.size(1);
  auto y = at::empty({M, N}, xc.options());
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
#ifdef __AVX512F__
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
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
#else
  TORCH_CHECK(false, "small_linear needs AVX-512 (check small_linear_supported first)");
#endif
  return y;
}

bool small_linear_supported() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_linear_supported() -> bool");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) { m.impl("small_linear", &small_linear); }
TORCH_LIBRARY_IMPL(minipd, CompositeExplicitAutograd, m) { m.impl("small_linear_supported", &small_linear_supported); }
