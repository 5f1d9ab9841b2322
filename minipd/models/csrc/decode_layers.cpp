// Every layer of a Llama decode step (a few rows, each one sequence's next token) in one call: the
// same kernels, in the same order, as LlamaForCausalLM's layer loop with the kernels on, so the
// result is the same bit for bit; what it saves is the ~20 Python-level operator calls per layer
// (dispatch, views, allocations), 6-8 ms of a 45 ms step at batch 1 on one core.
#include <torch/library.h>
#include <ATen/ATen.h>
#include "ops.h"

namespace {

// a weight as Linear holds it: plain rows (N, K), or column blocks (N / NB, K, NB)
at::Tensor any_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return w.dim() == 3 ? minipd_ops::blocked_linear(x, w, bias) : minipd_ops::small_linear(x, w, bias);
}

at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList input_norms, at::TensorList qkv_weights,
                         at::TensorList qkv_biases, at::TensorList o_weights, at::TensorList post_norms,
                         at::TensorList gate_up_weights, at::TensorList down_weights, const at::Tensor& kv_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_of_token,
                         const at::Tensor& pos_of_token, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t num_heads, int64_t block_size, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(input_norms.size());
  for (auto list : {qkv_weights, o_weights, post_norms, gate_up_weights, down_weights})
    TORCH_CHECK(static_cast<int64_t>(list.size()) == layers, "decode_layers: one weight of each kind per layer");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == layers,
              "decode_layers: no qkv bias, or one per layer");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(1) == layers,
              "decode_layers: kv_cache (2, layers, slots, kv heads, head dim)");
  const int64_t T = x_in.size(0), Hkv = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t q_size = num_heads * D, kv_size = Hkv * D;
  at::Tensor x = x_in;
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor k_cache = kv_cache.select(0, 0).select(0, i), v_cache = kv_cache.select(0, 1).select(0, i);
    c10::optional<at::Tensor> bias;
    if (!qkv_biases.empty()) bias = qkv_biases[i];
    at::Tensor qkv = any_linear(minipd_ops::rms_norm(x, input_norms[i], eps), qkv_weights[i], bias);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
    minipd_ops::rope_(q, k, cos, sin);
    k_cache.index_copy_(0, slot_mapping, k);
    v_cache.index_copy_(0, slot_mapping, v);
    at::Tensor attn = minipd_ops::paged_attention(q, k_cache, v_cache, block_tables, seq_of_token, pos_of_token,
                                                  block_size, scale);
    x = x + any_linear(attn.view({T, q_size}), o_weights[i], c10::nullopt);
    at::Tensor gate_up = any_linear(minipd_ops::rms_norm(x, post_norms[i], eps), gate_up_weights[i],
                                                  c10::nullopt);
    const int64_t inter = gate_up.size(1) / 2;
    at::Tensor mlp = minipd_ops::silu_and_mul(gate_up.narrow(1, 0, inter), gate_up.narrow(1, inter, inter));
    x = x + any_linear(mlp, down_weights[i], c10::nullopt);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minipd, m) {
  m.def("decode_layers(Tensor x, Tensor[] input_norms, Tensor[] qkv_weights, Tensor[] qkv_biases, "
        "Tensor[] o_weights, Tensor[] post_norms, Tensor[] gate_up_weights, Tensor[] down_weights, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_of_token, Tensor pos_of_token, Tensor cos, Tensor sin, "
        "int num_heads, int block_size, float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(minipd, CPU, m) { m.impl("decode_layers", &decode_layers); }
