// The two halves of a decoder layer of an int4 model on kvboost_hf's kernels, one op call each:
// `layer_attention_inputs` (input RMSNorm, q/k/v projections, q/k head norms, RoPE) and `layer_output`
// (o projection, the branch norms and residual adds, the gated MLP). On a CPU decode step a layer's ~40
// small ATen ops and module calls cost more than its arithmetic; here they are C++ calls.
//
// The contract: each op computes exactly the bits the layer's modules compute one after another
// (AWQInt4Linear on the kvboost int4 kernel, KernelRMSNorm, transformers' RoPE and activation), so a
// model gives the same outputs with or without them: the same kernels over the same rows, the int4
// results rounded to bf16 and then to the model's dtype as AWQInt4Linear does, torch's own ops for the
// activation, product and residual adds, and RoPE rounded after each product and the sum, as torch's
// elementwise ops on the model's dtype round.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace {

// One int4 linear of the layer: its weight, and its out_features (up to 16 * blocks).
struct Int4Proj {
  KvbInt4Weight w;
  int64_t out;
};

// side is AWQInt4Linear's [2, NB, K/G, 16] (scales, zeros), each half contiguous (a fused group's member
// views a slice of the group's).
Int4Proj int4_proj(const at::Tensor& q, const at::Tensor& side, int64_t out, int64_t group, int64_t k) {
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && q.scalar_type() == at::kByte && q.dim() == 3 &&
                  q.size(1) == k && q.size(2) == 8,
              "an int4 weight must be a contiguous uint8 [blocks, ", k, ", 8] CPU tensor, got ", q.sizes());
  TORCH_CHECK(group > 0 && k % group == 0, "group_size ", group, " must divide in_features ", k);
  const int64_t blocks = q.size(0);
  TORCH_CHECK(side.device().is_cpu() && side.scalar_type() == at::kFloat && side.dim() == 4 && side.size(0) == 2 &&
                  side.size(1) == blocks && side.size(2) == k / group && side.size(3) == 16 && side.stride(3) == 1 &&
                  side.stride(2) == 16 && side.stride(1) == 16 * (k / group),
              "scales/zeros must be float32 [2, ", blocks, ", ", k / group, ", 16], each half contiguous, got ",
              side.scalar_type(), " ", side.sizes(), " (an int4 model's dtype is chosen at load: from_pretrained(..., "
              "dtype=...), not by .to(dtype))");
  TORCH_CHECK(out > 0 && out <= 16 * blocks, "out_features must be in 1..", 16 * blocks, ", got ", out);
  const float* s = side.data_ptr<float>();
  return {{q.data_ptr<uint8_t>(), s, s + side.stride(0), blocks, group}, out};
}

// x [M, K] through the projections `ps` in one call, with the bf16 activations AWQ linears take.
at::Tensor int4_columns(const at::Tensor& x, const std::vector<Int4Proj>& ps, std::vector<int64_t>& offsets) {
  std::vector<KvbInt4Weight> ws;
  for (const Int4Proj& p : ps) ws.push_back(p.w);
  return kvb_int4_columns(x, ws, offsets, /*bf16_inputs=*/true);
}

// Projection i's output as AWQInt4Linear returns it: rounded to bf16, then to `dtype`, plus its bias.
at::Tensor projection(const at::Tensor& columns, int64_t offset, const Int4Proj& p, const std::optional<at::Tensor>& bias,
                      at::ScalarType dtype, at::IntArrayRef lead) {
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == p.out,
                "a bias must be a ", dtype, " CPU tensor [", p.out, "], got ", bias->scalar_type(), " ",
                bias->device(), " ", bias->sizes());
  std::vector<int64_t> shape(lead.begin(), lead.end());
  shape.push_back(p.out);
  const int64_t rows = columns.size(0), ld = columns.size(1);
  at::Tensor y;
  if (rows * p.out > kvb_loop_elements(dtype)) {  // torch's vectorized casts, the same roundings
    y = columns.narrow(1, offset, p.out).to(at::kBFloat16).to(dtype).reshape(shape);
  } else {
    y = at::empty(shape, columns.options().dtype(dtype));
    const float* c = columns.data_ptr<float>() + offset;
    if (dtype == at::kBFloat16) {
      auto* o = y.data_ptr<c10::BFloat16>();
      for (int64_t r = 0; r < rows; ++r) kvb_round_to_bf16(c + r * ld, p.out, o + r * p.out);
    } else {
      float* o = y.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < p.out; ++j) o[r * p.out + j] = static_cast<float>(c10::BFloat16(c[r * ld + j]));
    }
  }
  return bias.has_value() && bias->defined() ? at::add(y, *bias) : y;
}

// a + b (or a * b) of one shape, dtype and contiguous layout, as torch's add (mul) computes it on that dtype: in
// float32, rounded once to the dtype. A loop up to kvb_loop_elements(dtype) elements, torch's op beyond or for other
// layouts.
at::Tensor elementwise(const at::Tensor& a, const at::Tensor& b, bool product) {
  if (a.numel() > kvb_loop_elements(a.scalar_type()) || a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type() ||
      !a.is_contiguous() || !b.is_contiguous() ||
      (a.scalar_type() != at::kBFloat16 && a.scalar_type() != at::kFloat))
    return product ? at::mul(a, b) : at::add(a, b);
  at::Tensor out = at::empty_like(a);
  const int64_t count = a.numel();
  if (a.scalar_type() == at::kBFloat16 && kvb_avx512_loops()) {
    const auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
    kvb_avx512::bf16_combine(bits(a), bits(b), count, product, reinterpret_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
  auto run = [&](auto* o, const auto* x, const auto* y) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(o)>>;
    for (int64_t i = 0; i < count; ++i) {
      const float u = static_cast<float>(x[i]), v = static_cast<float>(y[i]);
      o[i] = static_cast<T>(product ? u * v : u + v);
    }
  };
  if (a.scalar_type() == at::kBFloat16)
    run(out.data_ptr<c10::BFloat16>(), a.data_ptr<c10::BFloat16>(), b.data_ptr<c10::BFloat16>());
  else
    run(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>());
  return out;
}

std::vector<Int4Proj> int4_projs(at::TensorList qs, at::TensorList sides, at::IntArrayRef outs, at::IntArrayRef groups,
                                 size_t first, size_t count, int64_t k) {
  std::vector<Int4Proj> ps;
  for (size_t i = first; i < first + count; ++i) ps.push_back(int4_proj(qs[i], sides[i], outs[i], groups[i], k));
  return ps;
}

void check_lists(at::TensorList qs, at::TensorList sides, at::IntArrayRef outs, at::IntArrayRef groups,
                 const c10::List<std::optional<at::Tensor>>& biases, size_t count) {
  TORCH_CHECK(qs.size() == count && sides.size() == count && outs.size() == count && groups.size() == count &&
                  biases.size() == count,
              "expected ", count, " projections (weights, sides, outs, groups, biases)");
}

template <class T>
inline float widen(T v) {
  return static_cast<float>(v);
}
template <class T>
inline T narrow_to(float v) {
  return static_cast<T>(v);  // c10::BFloat16: round to nearest even, as torch's ops
}

// transformers' apply_rotary_pos_emb on x [B, H, M, D] (contiguous): x * cos + rotate_half(x) * sin, cos and
// sin [B or 1, M, D]; each product and the sum rounded to T, the order torch's three ops give.
template <class T>
void rope_rows(const T* x, const T* cos, const T* sin, int64_t cb, int64_t cm, int64_t batch, int64_t heads, int64_t rows,
               int64_t dim, T* out) {
  const int64_t half = dim / 2;
  const bool vector = std::is_same_v<T, c10::BFloat16> && kvb_avx512_loops();
  at::parallel_for(0, batch * heads * rows, std::max<int64_t>(1, 16384 / dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (heads * rows), i = r % rows;
      const T* xr = x + r * dim;
      const T* c = cos + b * cb + i * cm;
      const T* s = sin + b * cb + i * cm;
      T* o = out + r * dim;
      if (vector) {
        const auto bits = [](const T* p) { return reinterpret_cast<const uint16_t*>(p); };
        kvb_avx512::bf16_rope(bits(xr), bits(c), bits(s), dim, reinterpret_cast<uint16_t*>(o));
        continue;
      }
      for (int64_t d = 0; d < dim; ++d) {
        const float rotated = d < half ? -widen(xr[d + half]) : widen(xr[d - half]);
        const T a = narrow_to<T>(widen(xr[d]) * widen(c[d]));
        const T e = narrow_to<T>(rotated * widen(s[d]));
        o[d] = narrow_to<T>(widen(a) + widen(e));
      }
    }
  });
}

// The strides of t (cos or sin) expanded to [batch, rows, dim], as expand() gives them (0 where a size 1 is
// broadcast), without its op call; refused where expand() would refuse.
std::array<int64_t, 3> broadcast_strides(const at::Tensor& t, int64_t batch, int64_t rows, int64_t dim) {
  const int64_t target[3] = {batch, rows, dim};
  TORCH_CHECK(t.dim() <= 3, "cos and sin must have at most 3 dimensions, got ", t.sizes());
  std::array<int64_t, 3> strides{0, 0, 0};
  for (int64_t d = 0; d < 3; ++d) {
    const int64_t own = d - (3 - t.dim());  // t's dimension aligned with d from the right, or < 0
    const int64_t size = own < 0 ? 1 : t.size(own);
    TORCH_CHECK(size == target[d] || size == 1, "cos and sin of shape ", t.sizes(), " do not broadcast to [", batch,
                ", ", rows, ", ", dim, "]");
    strides[d] = own < 0 || (size == 1 && target[d] != 1) ? 0 : t.stride(own);
    if (target[d] == 1) strides[d] = d == 2 ? 1 : 0;  // (a stride of a size-1 dimension is never read)
  }
  return strides;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.size(3) % 2 == 0, "RoPE needs an even head_dim, got ", x.size(3));
  if (x.numel() > kvb_loop_elements(x.scalar_type())) {  // transformers' apply_rotary_pos_emb, op for op
    const int64_t half = x.size(3) / 2;
    const at::Tensor rotated = at::cat({at::neg(x.narrow(3, half, half)), x.narrow(3, 0, half)}, 3);
    return at::add(at::mul(x, cos.unsqueeze(1)), at::mul(rotated, sin.unsqueeze(1))).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  const int64_t batch = xc.size(0), heads = xc.size(1), rows = xc.size(2), dim = xc.size(3);
  const std::array<int64_t, 3> c = broadcast_strides(cos, batch, rows, dim);
  const std::array<int64_t, 3> s = broadcast_strides(sin, batch, rows, dim);
  TORCH_CHECK(c[2] == 1 && s[2] == 1 && c == s, "cos and sin must have one layout, contiguous in the last dimension");
  const int64_t cb = c[0], cm = c[1];
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  if (xc.scalar_type() == at::kBFloat16)
    rope_rows(xc.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), cb, cm,
              batch, heads, rows, dim, out.data_ptr<c10::BFloat16>());
  else
    rope_rows(xc.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), cb, cm, batch, heads, rows, dim,
              out.data_ptr<float>());
  return out;
}

// hidden [B, M, E] -> (q [B, H, M, D], k and v [B, Hkv, M, D]), contiguous: input norm, the q/k/v int4
// projections (qweights etc. list q, k, v), the optional per-head norms, RoPE with cos/sin [B or 1, M, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_attention_inputs(
    const at::Tensor& hidden, const at::Tensor& norm, double eps, at::TensorList qweights, at::TensorList sides,
    at::IntArrayRef outs, at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& biases,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double head_eps,
    const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  const at::ScalarType dtype = hidden.scalar_type();
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 3 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "hidden must be a bfloat16 or float32 CPU tensor [batch, rows, hidden], got ", hidden.sizes());
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "cos and sin must be ", dtype);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both head norms or neither");
  check_lists(qweights, sides, outs, groups, biases, 3);
  const int64_t batch = hidden.size(0), rows = hidden.size(1), width = hidden.size(2);
  const std::vector<Int4Proj> ps = int4_projs(qweights, sides, outs, groups, 0, 3, width);
  TORCH_CHECK(head_dim > 0 && outs[0] % head_dim == 0 && outs[1] % head_dim == 0 && outs[2] == outs[1],
              "q/k/v widths must be multiples of head_dim ", head_dim, ", k and v alike");
  std::vector<int64_t> offsets;
  const at::Tensor columns = int4_columns(kvb_rms_norm(hidden, norm, eps).reshape({-1, width}), ps, offsets);
  at::Tensor qkv[3];
  for (int i = 0; i < 3; ++i)
    qkv[i] = projection(columns, offsets[i], ps[i], biases.get(i), dtype, {batch, rows})
                 .view({batch, rows, -1, head_dim})
                 .transpose(1, 2);
  if (q_norm.has_value()) {
    qkv[0] = kvb_rms_norm(qkv[0], *q_norm, head_eps);
    qkv[1] = kvb_rms_norm(qkv[1], *k_norm, head_eps);
  }
  return {rope(qkv[0], cos, sin), rope(qkv[1], cos, sin), qkv[2].contiguous()};
}

// The rest of the layer: attn [B, M, H, D] through o_proj (qweights etc. list o, gate, up, down), the
// optional post-attention norm, the residual add, the feed-forward norm, act(gate) * up, down_proj, the
// optional post-feed-forward norm and the second residual add. Returns [B, M, E] in residual's dtype.
at::Tensor layer_output(const at::Tensor& residual, const at::Tensor& attn, at::TensorList qweights,
                        at::TensorList sides, at::IntArrayRef outs, at::IntArrayRef groups,
                        const c10::List<std::optional<at::Tensor>>& biases,
                        const std::optional<at::Tensor>& post_attention_norm, const at::Tensor& ffn_norm,
                        const std::optional<at::Tensor>& post_ffn_norm, double eps, c10::string_view activation) {
  const at::ScalarType dtype = residual.scalar_type();
  TORCH_CHECK(residual.device().is_cpu() && residual.dim() == 3 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "residual must be a bfloat16 or float32 CPU tensor [batch, rows, hidden], got ", residual.sizes());
  TORCH_CHECK(attn.dim() == 4 && attn.size(0) == residual.size(0) && attn.size(1) == residual.size(1) &&
                  attn.scalar_type() == dtype,
              "attn must be [batch, rows, heads, head_dim] in the residual's dtype, got ", attn.sizes());
  const std::string act(activation);
  TORCH_CHECK(act == "gelu_tanh" || act == "gelu" || act == "silu", "activation must be gelu_tanh, gelu or silu");
  check_lists(qweights, sides, outs, groups, biases, 4);
  const int64_t batch = residual.size(0), rows = residual.size(1), width = residual.size(2);
  const at::Tensor a = attn.reshape({batch * rows, -1}).contiguous();
  std::vector<int64_t> offsets;
  const std::vector<Int4Proj> o = int4_projs(qweights, sides, outs, groups, 0, 1, a.size(1));
  const at::Tensor o_columns = int4_columns(a, o, offsets);  // (fills offsets: not inside the call below)
  at::Tensor branch = projection(o_columns, offsets[0], o[0], biases.get(0), dtype, {batch, rows});
  if (post_attention_norm.has_value()) branch = kvb_rms_norm(branch, *post_attention_norm, eps);
  const at::Tensor h = elementwise(residual, branch, false);
  const std::vector<Int4Proj> gate_up = int4_projs(qweights, sides, outs, groups, 1, 2, width);
  const at::Tensor columns = int4_columns(kvb_rms_norm(h, ffn_norm, eps).reshape({-1, width}), gate_up, offsets);
  const at::Tensor gate = projection(columns, offsets[0], gate_up[0], biases.get(1), dtype, {batch, rows});
  const at::Tensor up = projection(columns, offsets[1], gate_up[1], biases.get(2), dtype, {batch, rows});
  const at::Tensor gated = act == "silu" ? at::silu(gate) : at::gelu(gate, act == "gelu_tanh" ? "tanh" : "none");
  const at::Tensor product = elementwise(gated, up, true).reshape({batch * rows, -1});
  const std::vector<Int4Proj> down = int4_projs(qweights, sides, outs, groups, 3, 1, product.size(1));
  const at::Tensor down_columns = int4_columns(product, down, offsets);
  at::Tensor ffn = projection(down_columns, offsets[0], down[0], biases.get(3), dtype, {batch, rows});
  if (post_ffn_norm.has_value()) ffn = kvb_rms_norm(ffn, *post_ffn_norm, eps);
  return elementwise(h, ffn, false);
}

// Whether the address ranges a and b span intersect (conservative: two interleaved views of one buffer count).
bool spans_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (!a.storage().is_alias_of(b.storage()) || a.numel() == 0 || b.numel() == 0) return false;
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto* first = static_cast<const char*>(t.data_ptr());
    return std::make_pair(first, first + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

// new [B, H, M, D] (contiguous) written at [end, end + M) of buffer [B, H, capacity, D], same dtype: a copy of each
// head's rows where the buffer's rows are contiguous within a head (the same bytes as narrow + copy_, without their
// op calls), else narrow + copy_.
void write_rows(const at::Tensor& buffer, int64_t end, const at::Tensor& rows_new) {
  const int64_t batch = rows_new.size(0), heads = rows_new.size(1), rows = rows_new.size(2), dim = rows_new.size(3);
  if (!rows_new.is_contiguous() || buffer.stride(3) != 1 || buffer.stride(2) != dim) {
    buffer.narrow(2, end, rows).copy_(rows_new);
    return;
  }
  const int64_t bytes = rows * dim * buffer.element_size(), size = buffer.element_size();
  const auto* src = static_cast<const char*>(rows_new.data_ptr());
  auto* dst = static_cast<char*>(buffer.data_ptr());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (b * buffer.stride(0) + h * buffer.stride(1) + end * dim) * size,
                  src + (b * heads + h) * bytes, bytes);
}

// A whole decoder layer over a cache layer's buffers, in one call where a decode step made four (the two ops above,
// the cache's update, attention): layer_attention_inputs, the new keys and values written at [end, end + rows) of
// key_buffer and value_buffer ([B, Hkv, capacity, D], the cache's own), causal attention over [first, end + rows)
// of them, layer_output. The same functions in the same order as those calls: the same bits. The seven projections
// are q, k, v, o, gate, up, down; norms are the input, post-attention (or None), feed-forward and post-feed-forward
// (or None) ones. Returns the layer's output and the new keys and values (for a cache that also keeps them).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_step(
    const at::Tensor& hidden, at::TensorList qweights, at::TensorList sides, at::IntArrayRef outs,
    at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& input_norm,
    const std::optional<at::Tensor>& post_attention_norm, const at::Tensor& ffn_norm,
    const std::optional<at::Tensor>& post_ffn_norm, double eps, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double head_eps, const at::Tensor& cos, const at::Tensor& sin,
    int64_t head_dim, c10::string_view activation, const at::Tensor& key_buffer, const at::Tensor& value_buffer,
    int64_t first, int64_t end, double scale, int64_t window) {
  check_lists(qweights, sides, outs, groups, biases, 7);
  TORCH_CHECK(window >= 0, "window must be >= 0, got ", window);
  TORCH_CHECK(!key_buffer.is_inference() || c10::InferenceMode::is_enabled(),
              "the key and value buffers were made under inference mode: they cannot be written outside it");
  TORCH_CHECK(!spans_overlap(key_buffer, value_buffer),
              "the key and value buffers must not share memory: each write would land in the other's rows");
  auto [q, k, v] = layer_attention_inputs(hidden, input_norm, eps, qweights.slice(0, 3), sides.slice(0, 3),
                                          outs.slice(0, 3), groups.slice(0, 3), kvb_sublist(biases, 0, 3), q_norm,
                                          k_norm, head_eps, cos, sin, head_dim);
  const int64_t rows = k.size(2);
  TORCH_CHECK(key_buffer.device().is_cpu() && key_buffer.dim() == 4 && key_buffer.scalar_type() == k.scalar_type() &&
                  key_buffer.size(0) == k.size(0) && key_buffer.size(1) == k.size(1) &&
                  key_buffer.size(3) == k.size(3) && value_buffer.sizes() == key_buffer.sizes() &&
                  value_buffer.scalar_type() == key_buffer.scalar_type() && value_buffer.device().is_cpu(),
              "key and value buffers must be ", k.scalar_type(), " CPU tensors [", k.size(0), ", ", k.size(1),
              ", capacity, ", k.size(3), "] alike, got ", key_buffer.sizes(), " and ", value_buffer.sizes());
  TORCH_CHECK(0 <= first && first <= end && end + rows <= key_buffer.size(2), "the live keys [", first, ", ",
              end + rows, ") must lie in the buffers' ", key_buffer.size(2), " positions");
  write_rows(key_buffer, end, k);
  write_rows(value_buffer, end, v);
  // written below autograd (the op's Autograd kernel is the not-implemented fallback): the version counters move
  // here, as a Python write's do
  key_buffer.unsafeGetTensorImpl()->bump_version();
  value_buffer.unsafeGetTensorImpl()->bump_version();
  const at::Tensor out = kvb_causal_attention(q, key_buffer, value_buffer, first, end + rows - first, scale, window);
  at::Tensor next = layer_output(hidden, out, qweights.slice(3, 4), sides.slice(3, 4), outs.slice(3, 4),
                                 groups.slice(3, 4), kvb_sublist(biases, 3, 4), post_attention_norm, ffn_norm,
                                 post_ffn_norm, eps, activation);
  return {next, k, v};
}

}  // namespace

c10::List<std::optional<at::Tensor>> kvb_sublist(const c10::List<std::optional<at::Tensor>>& list, int64_t first,
                                                 int64_t count) {
  c10::List<std::optional<at::Tensor>> out;
  out.reserve(count);
  for (int64_t i = first; i < first + count; ++i) out.push_back(list.get(i));
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvboost, m) {
  m.def(
      "layer_attention_inputs(Tensor hidden, Tensor norm, float eps, Tensor[] qweights, Tensor[] sides, int[] outs, "
      "int[] groups, Tensor?[] biases, Tensor? q_norm, Tensor? k_norm, float head_eps, Tensor cos, Tensor sin, "
      "int head_dim) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_output(Tensor residual, Tensor attn, Tensor[] qweights, Tensor[] sides, int[] outs, int[] groups, "
      "Tensor?[] biases, Tensor? post_attention_norm, Tensor ffn_norm, Tensor? post_ffn_norm, float eps, "
      "str activation) -> Tensor");
  m.def(
      "layer_step(Tensor hidden, Tensor[] qweights, Tensor[] sides, int[] outs, int[] groups, Tensor?[] biases, "
      "Tensor input_norm, Tensor? post_attention_norm, Tensor ffn_norm, Tensor? post_ffn_norm, float eps, "
      "Tensor? q_norm, Tensor? k_norm, float head_eps, Tensor cos, Tensor sin, int head_dim, str activation, "
      "Tensor(a!) key_buffer, Tensor(b!) value_buffer, int first, int end, float scale, int window) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvboost, CPU, m) {
  m.impl("layer_attention_inputs", &layer_attention_inputs);
  m.impl("layer_output", &layer_output);
  m.impl("layer_step", &layer_step);
}
