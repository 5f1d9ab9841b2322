// The element-wise steps of a Llama layer in one pass each, float32 (the compiler vectorizes the
// plain loops; SiLU is over vec.h): RMSNorm, SiLU(gate) * up, and rotary embedding of q and k
// in place. In eager PyTorch each of these is 3 to 8 operators, each a pass over the activations.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include "vec.h"

namespace {

void check_float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": (rows, columns) with contiguous rows");
}

// weight * (x / sqrt(mean(x^2) + eps)), in the order transformers' LlamaRMSNorm rounds it
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_rows(x, "rms_norm");
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  TORCH_CHECK(weight.numel() == H && weight.is_contiguous() && weight.scalar_type() == at::kFloat, "rms_norm: weight (H,)");
  auto y = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * ld;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / H + static_cast<float>(eps));
      float* yr = yp + t * H;
      for (int64_t i = 0; i < H; ++i) yr[i] = wp[i] * (xr[i] * inv);
    }
  });
  return y;
}

// silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float_rows(gate, "silu_and_mul");
  check_float_rows(up, "silu_and_mul");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_and_mul: gate and up of one shape");
  const int64_t T = gate.size(0), N = gate.size(1), lg = gate.stride(0), lu = up.stride(0);
  auto y = at::empty({T, N}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* up_ = up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * lg;
      const float* u = up_ + t * lu;
      float* o = yp + t * N;
      int64_t i = 0;
      using minipd_vec::Vec;
      const Vec one = Vec::set1(1.f);
      for (; i + Vec::L <= N; i += Vec::L) {
        const Vec gv = Vec::load(g + i);
        const Vec e = minipd_vec::exp(Vec::zero() - gv);
        ((gv / (one + e)) * Vec::load(u + i)).store(o + i);
      }
      for (; i < N; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

// x = x * cos + rotate_half(x) * sin for q (T, Hq, D) and k (T, Hkv, D), in place; cos, sin (T, D)
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "rope_: float32 only");
  for (const at::Tensor* x : {&q, &k})  // rows may be strided (q and k are views of one qkv product)
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2), "rope_: (T, H, D), each row's heads contiguous");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  auto c = cos.contiguous().view({T, D}), s = sin.contiguous().view({T, D});
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  for (at::Tensor* x : {&q, &k}) {
    const int64_t H = x->size(1), ld = x->stride(0);
    float* xp = x->data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* cr = cp + t * D;
        const float* sr = sp + t * D;
        for (int64_t h = 0; h < H; ++h) {
          float* v = xp + t * ld + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cr[i] - b * sr[i];
            v[i + half] = b * cr[i + half] + a * sr[i + half];
          }
        }
      }
    });
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_", &rope_);
}
