// The kernels' entry points, for one kernel to call another without the dispatcher (decode_layers.cpp);
// each is also registered as torch.ops.minipd.<name> in its own file.
#pragma once
#include <ATen/ATen.h>
#include <string>

namespace minipd_ops {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
std::string kernel_isa();
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool blocked_bfloat16();
bool blocked_bfloat16_dot();
bool bfloat16_dot();
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_of_token,
                           const at::Tensor& pos_of_token, int64_t block_size, double scale);

}  // namespace minipd_ops
