// A head draft's greedy round as one op call: `draft_round` runs up to `steps` one-token forwards of a fused decoder
// (the embedding, `decoder_step` over every layer, the final RMSNorm), each followed by the draft's int8 head and the
// argmax that picks the next token, and stops after an end token. The same ops in the same order as the Python loop
// it stands for (kvboost_hf.kernels.draft_round: a decoder forward per token, then the head), each through the
// dispatcher: the same bits, without the interpreter between them (~0.4 ms a token on Gemma-3-270M, 2 cores).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

using Int8Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);

const c10::TypedOperatorHandle<KvbDecoderStep>& decoder_step_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvboost::decoder_step", "").typed<KvbDecoderStep>();
  return op;
}

const c10::TypedOperatorHandle<Int8Linear>& int8_linear_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvboost::int8_linear", "").typed<Int8Linear>();
  return op;
}

// Returns (the drafted tokens [n], the normed decoder output of each forwarded token [B, n, E], each layer's new keys
// and values [B, Hkv, n, D]). Token j (the `first` token, then each drafted one) is embedded (embedding row, times
// embed_scale where given, as Gemma's scaled embedding), runs through the layers with its keys and values written at
// ends[i] + j, is normed by final_norm, and the head (int8 blocks, `head_n` columns) scores it; the argmax (first of
// equal scores, as torch.argmax), mapped through head_tokens where given, is the next token. It stops after `steps`
// tokens or after one in `ends_at`. cos[r] / sin[r] hold the rows of the `steps` positions; the other arguments are
// decoder_step's.
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> draft_round(
    int64_t first, int64_t steps, const at::Tensor& embedding, const std::optional<at::Tensor>& embed_scale,
    const at::Tensor& final_norm, double final_eps, const at::Tensor& head_q, const at::Tensor& head_scales,
    int64_t head_n, const std::optional<at::Tensor>& head_tokens, at::IntArrayRef ends_at, at::TensorList qweights,
    at::TensorList sides, at::IntArrayRef outs, at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& biases,
    const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
    const c10::List<std::optional<at::Tensor>>& head_norms, at::ArrayRef<double> head_eps, at::IntArrayRef head_dims,
    const std::vector<std::string>& activations, at::ArrayRef<double> scales, at::IntArrayRef windows,
    at::IntArrayRef ropes, at::TensorList cos, at::TensorList sin, at::TensorList key_buffers,
    at::TensorList value_buffers, at::IntArrayRef firsts, at::IntArrayRef ends) {
  TORCH_CHECK(steps >= 1, "steps must be >= 1, got ", steps);
  TORCH_CHECK(embedding.device().is_cpu() && embedding.dim() == 2, "embedding must be a 2-d CPU tensor, got ",
              embedding.sizes());
  TORCH_CHECK(0 <= first && first < embedding.size(0), "token ", first, " is not a row of the embedding");
  for (const at::Tensor& t : cos)
    TORCH_CHECK(t.dim() == 3 && t.size(1) >= steps, "cos and sin must hold the rows of ", steps, " positions");
  TORCH_CHECK(cos.size() == sin.size(), "give as many cos as sin tensors");
  if (head_tokens.has_value())
    TORCH_CHECK(head_tokens->scalar_type() == at::kLong && head_tokens->dim() == 1 && head_tokens->size(0) == head_n,
                "head_tokens must be an int64 tensor of the head's ", head_n, " tokens");
  const int64_t n_layers = static_cast<int64_t>(key_buffers.size());
  const auto& decoder = decoder_step_op();
  const auto& head = int8_linear_op();
  std::vector<at::Tensor> rows, step_cos(cos.size()), step_sin(sin.size());
  std::vector<std::vector<at::Tensor>> keys(n_layers), values(n_layers);
  std::vector<int64_t> at_ends(ends.begin(), ends.end()), drafted;
  int64_t token = first;
  for (int64_t j = 0; j < steps; ++j) {
    at::Tensor hidden = at::embedding(embedding, at::full({1, 1}, token, embedding.options().dtype(at::kLong)));
    if (embed_scale.has_value()) hidden = at::mul(hidden, *embed_scale);
    for (size_t r = 0; r < cos.size(); ++r) step_cos[r] = cos[r].narrow(1, j, 1), step_sin[r] = sin[r].narrow(1, j, 1);
    auto [out, k, v] = decoder.call(hidden, qweights, sides, outs, groups, biases, norms, eps, head_norms, head_eps,
                                    head_dims, activations, scales, windows, ropes, step_cos, step_sin, key_buffers,
                                    value_buffers, firsts, at_ends);
    for (int64_t i = 0; i < n_layers; ++i) {
      keys[i].push_back(std::move(k[i]));
      values[i].push_back(std::move(v[i]));
      ++at_ends[i];
    }
    const at::Tensor normed = kvb_rms_norm(out, final_norm, final_eps);
    rows.push_back(normed);
    const at::Tensor scores = head.call(normed.reshape({1, -1}), head_q, head_scales, head_n);
    const int64_t index = at::argmax(scores, -1).item<int64_t>();
    token = head_tokens.has_value() ? (*head_tokens)[index].item<int64_t>() : index;
    drafted.push_back(token);
    if (std::find(ends_at.begin(), ends_at.end(), token) != ends_at.end()) break;
  }
  std::vector<at::Tensor> layer_keys, layer_values;
  for (int64_t i = 0; i < n_layers; ++i) {
    layer_keys.push_back(at::cat(keys[i], 2));
    layer_values.push_back(at::cat(values[i], 2));
  }
  return {at::tensor(drafted, at::kLong), at::cat(rows, 1), layer_keys, layer_values};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvboost, m) {
  m.def(
      "draft_round(int first, int steps, Tensor embedding, Tensor? embed_scale, Tensor final_norm, float final_eps, "
      "Tensor head_q, Tensor head_scales, int head_n, Tensor? head_tokens, int[] ends_at, Tensor[] qweights, "
      "Tensor[] sides, int[] outs, int[] groups, Tensor?[] biases, Tensor?[] norms, float[] eps, Tensor?[] head_norms, "
      "float[] head_eps, int[] head_dims, str[] activations, float[] scales, int[] windows, int[] ropes, Tensor[] cos, "
      "Tensor[] sin, Tensor(a!)[] key_buffers, Tensor(b!)[] value_buffers, int[] firsts, int[] ends) "
      "-> (Tensor, Tensor, Tensor[], Tensor[])");
}

TORCH_LIBRARY_IMPL(kvboost, CPU, m) { m.impl("draft_round", &draft_round); }
