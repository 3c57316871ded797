// A fused decoder's forward over in-place cache layers as one op call: `decoder_step` runs `layer_step` (layer.cpp)
// for every layer in order, through the dispatcher (a profiler sees each), so the bits are those of a Python loop of
// layer_step calls. What it saves is the interpreter between the calls (kvboost_hf.kernels.decoder).
//
// The layers' arguments come as flat lists, layer after layer, on every call: the decoder's plan keeps the lists
// (Python references to the modules' tensors), and nothing here outlives the call. A C++ object holding the weights
// across calls was tried first: its references raised the tensors' use counts, so torch.utils.swap_tensors (and with
// it Module.to or load_state_dict under torch.__future__.set_swap_module_params_on_conversion) refused them, and
// a swap would have left it reading the old tensors.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kProjections = 7;  // q, k, v, o, gate, up, down
constexpr int64_t kNorms = 4;        // input, post-attention (or None), feed-forward, post-feed-forward (or None)

const c10::TypedOperatorHandle<KvbLayerStep>& layer_step_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvboost::layer_step", "").typed<KvbLayerStep>();
  return op;
}

// hidden [B, M, E] through n layers: layer i takes projections [7i, 7i + 7) of qweights, sides, outs, groups and
// biases, norms [4i, 4i + 4), head norms [2i, 2i + 2) (q, k; both None without), eps[i], head_eps[i], head_dims[i],
// activations[i], scales[i], windows[i] and the ropes[i]-th cos/sin, writes its new keys and values at
// [ends[i], ends[i] + M) of key_buffers[i] / value_buffers[i] and attends over [firsts[i], ends[i] + M) of them
// (layer_step). Returns the last layer's output and each layer's new keys and values.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decoder_step(
    const at::Tensor& hidden, at::TensorList qweights, at::TensorList sides, at::IntArrayRef outs,
    at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& biases,
    const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
    const c10::List<std::optional<at::Tensor>>& head_norms, at::ArrayRef<double> head_eps, at::IntArrayRef head_dims,
    const std::vector<std::string>& activations, at::ArrayRef<double> scales, at::IntArrayRef windows,
    at::IntArrayRef ropes, at::TensorList cos, at::TensorList sin, at::TensorList key_buffers,
    at::TensorList value_buffers, at::IntArrayRef firsts, at::IntArrayRef ends) {
  const int64_t n = static_cast<int64_t>(key_buffers.size());
  auto sized = [n](size_t size, int64_t per) { return static_cast<int64_t>(size) == n * per; };
  TORCH_CHECK(sized(qweights.size(), kProjections) && sized(sides.size(), kProjections) &&
                  sized(outs.size(), kProjections) && sized(groups.size(), kProjections) &&
                  sized(biases.size(), kProjections),
              "expected ", kProjections, " projections (weights, sides, outs, groups, biases) for each of ", n,
              " layers");
  TORCH_CHECK(sized(norms.size(), kNorms) && sized(head_norms.size(), 2), "expected ", kNorms, " norms and 2 head ",
              "norms for each of ", n, " layers");
  TORCH_CHECK(sized(value_buffers.size(), 1) && sized(firsts.size(), 1) && sized(ends.size(), 1) &&
                  sized(eps.size(), 1) && sized(head_eps.size(), 1) && sized(head_dims.size(), 1) &&
                  sized(activations.size(), 1) && sized(scales.size(), 1) && sized(windows.size(), 1) &&
                  sized(ropes.size(), 1),
              "expected ", n, " key buffers, value buffers, firsts, ends, eps, head eps, head dims, activations, ",
              "scales, windows and ropes (one per layer)");
  TORCH_CHECK(cos.size() == sin.size(), "give as many cos as sin tensors");
  for (int64_t i = 0; i < n; ++i) {  // before any layer writes its buffers
    TORCH_CHECK(0 <= ropes[i] && ropes[i] < static_cast<int64_t>(cos.size()), "layer ", i, " takes cos/sin ",
                ropes[i], " of ", cos.size());
    TORCH_CHECK(norms.get(kNorms * i).has_value() && norms.get(kNorms * i + 2).has_value(), "layer ", i,
                " needs its input and feed-forward norms");
  }
  const auto& step = layer_step_op();
  // Below autograd (this op's own Autograd kernel is the not-implemented fallback, as layer_step's): each layer
  // call goes to its CPU kernel without boxing its arguments for that fallback again.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor h = hidden;
  std::vector<at::Tensor> keys, values;
  keys.reserve(n), values.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = kProjections * i, r = kNorms * i;
    auto [next, k, v] = step.call(
        h, qweights.slice(p, kProjections), sides.slice(p, kProjections), outs.slice(p, kProjections),
        groups.slice(p, kProjections), kvb_sublist(biases, p, kProjections), *norms.get(r), norms.get(r + 1),
        *norms.get(r + 2), norms.get(r + 3), eps[i], head_norms.get(2 * i), head_norms.get(2 * i + 1), head_eps[i],
        cos[ropes[i]], sin[ropes[i]], head_dims[i], activations[i], key_buffers[i], value_buffers[i], firsts[i],
        ends[i], scales[i], windows[i]);
    h = std::move(next);
    keys.push_back(std::move(k));
    values.push_back(std::move(v));
  }
  return {h, keys, values};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvboost, m) {
  m.def(
      "decoder_step(Tensor hidden, Tensor[] qweights, Tensor[] sides, int[] outs, int[] groups, Tensor?[] biases, "
      "Tensor?[] norms, float[] eps, Tensor?[] head_norms, float[] head_eps, int[] head_dims, str[] activations, "
      "float[] scales, int[] windows, int[] ropes, Tensor[] cos, Tensor[] sin, Tensor(a!)[] key_buffers, "
      "Tensor(b!)[] value_buffers, int[] firsts, int[] ends) -> (Tensor, Tensor[], Tensor[])");
}

TORCH_LIBRARY_IMPL(kvboost, CPU, m) { m.impl("decoder_step", &decoder_step); }
