// A fused decoder's forward over in-place cache layers as one op call: `decoder_step` runs `layer_step` (layer.cpp)
// for every layer in order, with the layers' weights held by a `DecoderLayers` object built once per plan
// (kvboost_hf.kernels.decoder). The same op calls in the same order as a Python loop of layer_step calls, through
// the dispatcher (a profiler sees each): the same bits. What it saves is the interpreter: a loop of 18 calls built
// and converted ~24 arguments a layer (7-tensor lists among them) on every decode step.
//
// The object holds the weights' tensors, not their data pointers: each call reads the pointers again, as a layer_step
// call from Python does, so a weight repointed in place (Tensor.set_, huge pages) is read where it is now.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// One layer's layer_step arguments up to the hidden states (cos and sin are the call's `rope`-th).
struct DecoderLayer {
  std::vector<at::Tensor> qweights, sides;
  std::vector<int64_t> outs, groups;
  c10::List<std::optional<at::Tensor>> biases;
  at::Tensor input_norm, ffn_norm;
  std::optional<at::Tensor> post_attention_norm, post_ffn_norm, q_norm, k_norm;
  double eps, head_eps, scale;
  int64_t head_dim, window, rope;
  std::string activation;
};

struct DecoderLayers : torch::CustomClassHolder {
  std::vector<DecoderLayer> layers;

  // Appends a layer (the arguments of layer_step in its order, then its attention's scale and window and which of
  // the call's cos/sin it takes). Checked as layer_step checks them, at each call.
  void add(std::vector<at::Tensor> qweights, std::vector<at::Tensor> sides, std::vector<int64_t> outs,
           std::vector<int64_t> groups, c10::List<std::optional<at::Tensor>> biases, at::Tensor input_norm,
           std::optional<at::Tensor> post_attention_norm, at::Tensor ffn_norm, std::optional<at::Tensor> post_ffn_norm,
           double eps, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, double head_eps,
           int64_t head_dim, std::string activation, double scale, int64_t window, int64_t rope) {
    TORCH_CHECK(qweights.size() == 7 && sides.size() == 7 && outs.size() == 7 && groups.size() == 7 &&
                    biases.size() == 7,
                "a decoder layer has 7 projections (q, k, v, o, gate, up, down), got ", qweights.size());
    TORCH_CHECK(rope >= 0, "rope must be an index into the call's cos/sin, got ", rope);
    layers.push_back({std::move(qweights), std::move(sides), std::move(outs), std::move(groups), std::move(biases),
                      std::move(input_norm), std::move(ffn_norm), std::move(post_attention_norm),
                      std::move(post_ffn_norm), std::move(q_norm), std::move(k_norm), eps, head_eps, scale, head_dim,
                      window, rope, std::move(activation)});
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

const c10::TypedOperatorHandle<KvbLayerStep>& layer_step_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvboost::layer_step", "").typed<KvbLayerStep>();
  return op;
}

// hidden [B, M, E] through every layer: layer i writes its new keys and values at [ends[i], ends[i] + M) of
// key_buffers[i] / value_buffers[i] and attends over [firsts[i], ends[i] + M) of them (layer_step). Returns the last
// layer's output and each layer's new keys and values.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decoder_step(
    const c10::intrusive_ptr<DecoderLayers>& decoder, const at::Tensor& hidden, at::TensorList cos, at::TensorList sin,
    at::TensorList key_buffers, at::TensorList value_buffers, at::IntArrayRef firsts, at::IntArrayRef ends) {
  const size_t n = decoder->layers.size();
  TORCH_CHECK(key_buffers.size() == n && value_buffers.size() == n && firsts.size() == n && ends.size() == n,
              "expected ", n, " key buffers, value buffers, firsts and ends (one per layer)");
  TORCH_CHECK(cos.size() == sin.size(), "give as many cos as sin tensors");
  for (size_t i = 0; i < n; ++i)  // before any layer writes its buffers
    TORCH_CHECK(decoder->layers[i].rope < static_cast<int64_t>(cos.size()), "layer ", i, " takes cos/sin ",
                decoder->layers[i].rope, " of ", cos.size());
  const auto& step = layer_step_op();
  // Below autograd (this op's own Autograd kernel is the not-implemented fallback, as layer_step's): each layer
  // call goes to its CPU kernel without boxing its arguments for that fallback again.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor h = hidden;
  std::vector<at::Tensor> keys, values;
  keys.reserve(n), values.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const DecoderLayer& l = decoder->layers[i];
    auto [next, k, v] =
        step.call(h, l.qweights, l.sides, l.outs, l.groups, l.biases, l.input_norm, l.post_attention_norm, l.ffn_norm,
                  l.post_ffn_norm, l.eps, l.q_norm, l.k_norm, l.head_eps, cos[l.rope], sin[l.rope], l.head_dim,
                  l.activation, key_buffers[i], value_buffers[i], firsts[i], ends[i], l.scale, l.window);
    h = std::move(next);
    keys.push_back(std::move(k));
    values.push_back(std::move(v));
  }
  return {h, keys, values};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvboost, m) {
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<>())
      .def("add", &DecoderLayers::add)
      .def("size", &DecoderLayers::size);
  m.def(
      "decoder_step(__torch__.torch.classes.kvboost.DecoderLayers decoder, Tensor hidden, Tensor[] cos, Tensor[] sin, "
      "Tensor(a!)[] key_buffers, Tensor(b!)[] value_buffers, int[] firsts, int[] ends) -> (Tensor, Tensor[], Tensor[])");
}

TORCH_LIBRARY_IMPL(kvboost, CPU, m) { m.impl("decoder_step", &decoder_step); }
