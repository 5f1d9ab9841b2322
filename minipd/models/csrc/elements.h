// The element types the kernels read and write: float32 as float, bfloat16 as its bits (uint16_t,
// what vec.h loads and stores). A tensor's data as E*, and a call made for a tensor's dtype.
#pragma once
#include <ATen/ATen.h>
#include <cstdint>

namespace minipd_elements {

template <typename E>
E* data(const at::Tensor& x) {
  return reinterpret_cast<E*>(x.data_ptr());
}

// f(E{}): E is float for float32, uint16_t for bfloat16 (the caller has checked it is one of them)
template <typename F>
void with_elements(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) f(float{});
  else f(uint16_t{});
}

}  // namespace minipd_elements
