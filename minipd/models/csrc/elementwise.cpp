// The element-wise steps of a Llama layer in one pass each, float32 or bfloat16 (float32 inside;
// the compiler vectorizes the plain float32 loops; SiLU is over vec.h): RMSNorm, SiLU(gate) * up,
// and rotary embedding of q and k in place. In eager PyTorch each of these is 3 to 8 operators,
// each a pass over the activations.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>
#include "elements.h"
#include "ops.h"
#include "vec.h"

namespace {

using minipd_elements::data;
using minipd_elements::with_elements;
using minipd_vec::from_float;
using minipd_vec::to_float;
using minipd_vec::Vec;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": (rows, columns) with contiguous rows");
}

// v rounded to E and back: what an eager operator in E hands the next one
template <typename E>
inline float rounded(float v) {
  E e;
  from_float(v, &e);
  return to_float(e);
}

// weight * (x / sqrt(mean(x^2) + eps)), in the order transformers' LlamaRMSNorm rounds it: the
// normalized x in E, then the product with the weight
template <typename E>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y) {
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  const E* xp = data<E>(x);
  const E* wp = data<E>(weight);
  E* yp = data<E>(y);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const E* xr = xp + t * ld;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
      const float inv = 1.f / std::sqrt(ss / H + static_cast<float>(eps));
      E* yr = yp + t * H;
      for (int64_t i = 0; i < H; ++i) from_float(to_float(wp[i]) * rounded<E>(to_float(xr[i]) * inv), yr + i);
    }
  });
}

}  // namespace

at::Tensor minipd_ops::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight (H,) of x's dtype");
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  with_elements(x.scalar_type(), [&](auto e) { rms_norm_rows<decltype(e)>(x, weight, eps, y); });
  return y;
}

namespace {

// silu(gate) * up, rounded to E between the two as eager F.silu(gate) * up is
template <typename E>
void silu_and_mul_rows(const at::Tensor& gate, const at::Tensor& up, at::Tensor& y) {
  const int64_t T = gate.size(0), N = gate.size(1), lg = gate.stride(0), lu = up.stride(0);
  const E* gp = data<E>(gate);
  const E* up_ = data<E>(up);
  E* yp = data<E>(y);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const E* g = gp + t * lg;
      const E* u = up_ + t * lu;
      E* o = yp + t * N;
      int64_t i = 0;
      const Vec one = Vec::set1(1.f);
      if constexpr (std::is_same_v<E, float>) {
        for (; i + Vec::L <= N; i += Vec::L) {
          const Vec gv = Vec::load(g + i);
          const Vec e = minipd_vec::exp(Vec::zero() - gv);
          ((gv / (one + e)) * Vec::load(u + i)).store(o + i);
        }
      } else {
        for (; i + Vec::L <= N; i += Vec::L) {
          const Vec gv = Vec::load(g + i);
          const Vec silu = minipd_vec::rounded_bf16(gv / (one + minipd_vec::exp(Vec::zero() - gv)));
          minipd_vec::store(silu * Vec::load(u + i), o + i);
        }
      }
      for (; i < N; ++i) {
        const float gi = to_float(g[i]);
        from_float(rounded<E>(gi / (1.f + std::exp(-gi))) * to_float(u[i]), o + i);
      }
    }
  });
}

}  // namespace

at::Tensor minipd_ops::silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "silu_and_mul");
  check_rows(up, "silu_and_mul");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "silu_and_mul: gate and up of one shape and dtype");
  auto y = at::empty({gate.size(0), gate.size(1)}, gate.options());
  with_elements(gate.scalar_type(), [&](auto e) { silu_and_mul_rows<decltype(e)>(gate, up, y); });
  return y;
}

namespace {

// x = x * cos + rotate_half(x) * sin for q (T, Hq, D) and k (T, Hkv, D), in place; cos, sin (T, D).
// In bfloat16 the sum is rounded once (eager rounds each product too).
template <typename E>
void rope_rows(at::Tensor& q, at::Tensor& k, const at::Tensor& c, const at::Tensor& s) {
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  const E* cp = data<E>(c);
  const E* sp = data<E>(s);
  for (at::Tensor* x : {&q, &k}) {
    const int64_t H = x->size(1), ld = x->stride(0);
    E* xp = data<E>(*x);
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const E* cr = cp + t * D;
        const E* sr = sp + t * D;
        for (int64_t h = 0; h < H; ++h) {
          E* v = xp + t * ld + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float a = to_float(v[i]), b = to_float(v[i + half]);
            from_float(a * to_float(cr[i]) - b * to_float(sr[i]), v + i);
            from_float(b * to_float(cr[i + half]) + a * to_float(sr[i + half]), v + i + half);
          }
        }
      }
    });
  }
}

}  // namespace

void minipd_ops::rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
              cos.scalar_type() == dtype && sin.scalar_type() == dtype, "rope_: float32 or bfloat16, all of one dtype");
  for (const at::Tensor* x : {&q, &k})  // rows may be strided (q and k are views of one qkv product)
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2), "rope_: (T, H, D), each row's heads contiguous");
  const int64_t T = q.size(0), D = q.size(2);
  auto c = cos.contiguous().view({T, D}), s = sin.contiguous().view({T, D});
  with_elements(dtype, [&](auto e) { rope_rows<decltype(e)>(q, k, c, s); });
}

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) {
  m.impl("rms_norm", &minipd_ops::rms_norm);
  m.impl("silu_and_mul", &minipd_ops::silu_and_mul);
  m.impl("rope_", &minipd_ops::rope_);
}
