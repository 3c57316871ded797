// The ops that compute each row alone, attention and RMSNorm, over the per-ISA kernels (attention_body.inc,
// norm_body.inc): argument checks, the ISA in effect (ops.cpp) and threads over rows or work items. A thread
// count never changes a result.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "threads.h"

namespace {

// float [.., n] rounded to bf16 as .to(bfloat16) rounds (to nearest even, NaN to 0x7FC0): a loop up to
// kKvbLoopElements elements (a decode step's attention output: the cast op cost ~12 us of ~60 a layer), torch's cast
// beyond.
at::Tensor rounded_to_bf16(const at::Tensor& x) {
  if (x.numel() > kKvbLoopElements) return x.to(at::kBFloat16);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  kvb_round_to_bf16(x.data_ptr<float>(), x.numel(), out.data_ptr<c10::BFloat16>());
  return out;
}

// Attention of q [B, H, M, D] over keys [first, first + count) of k, v [B, Hkv, N, D] (count -1: to N) (see
// KvbAttention): [B, M, H, D] in q's dtype. float16 is computed from float32 copies; threads split query rows (each
// row computed alone). The key range reads a cache's buffers in place (a decode step's narrow() calls cost ~7 us).
at::Tensor attention_over(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& mask, double scale, bool causal, int64_t window,
                          int64_t first, int64_t count) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "kvboost attention runs on CPU tensors, got ", query.device());
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "query, key and value must be [batch, heads, rows, head_dim], got ", query.sizes(), ", ", key.sizes(),
              ", ", value.sizes());
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value must have one dtype, got ", query.scalar_type(), ", ", key.scalar_type(), ", ",
              value.scalar_type());
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "attention inputs must be float32, bfloat16 or float16, got ", dtype);
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), keys = count < 0 ? key.size(2) : count;
  TORCH_CHECK(key.size(0) == batch && value.sizes() == key.sizes() && key.size(3) == dim,
              "key and value must be [", batch, ", kv_heads, keys, ", dim, "], got ", key.sizes(), " and ",
              value.sizes());
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads (", heads, ") must be a multiple of key heads (",
              kv_heads, ")");
  TORCH_CHECK(!causal || keys >= rows, "a causal call needs at least as many keys (", keys, ") as rows (", rows, ")");
  TORCH_CHECK(window >= 0 && (window == 0 || causal), "window must be >= 0, and only given with causal, got ", window);
  TORCH_CHECK(first >= 0 && (count < 0 ? first == 0 : first + count <= key.size(2)), "keys [", first, ", ",
              first + count, ") must lie in the key tensor's ", key.size(2), " positions");
  if (count >= 0 && dtype == at::kHalf)  // (float16 is copied to float32 below: the range first)
    return attention_over(query, key.narrow(2, first, count), value.narrow(2, first, count), mask, scale, causal, window,
                          0, -1);
  const bool half = dtype == at::kHalf;
  auto prepared = [&](const at::Tensor& t) {
    const at::Tensor u = half ? t.to(at::kFloat) : t;
    return u.stride(3) == 1 ? u : u.contiguous();
  };
  const at::Tensor q = prepared(query), k = prepared(key), v = prepared(value);
  KvbAttention a{};
  a.q = q.data_ptr();
  a.k = static_cast<const char*>(k.data_ptr()) + first * k.stride(2) * k.element_size();
  a.v = static_cast<const char*>(v.data_ptr()) + first * v.stride(2) * v.element_size();
  a.bf16 = dtype == at::kBFloat16;
  a.batch = batch, a.heads = heads, a.kv_heads = kv_heads, a.rows = rows, a.keys = keys, a.dim = dim;
  for (int d = 0; d < 3; ++d) {
    a.q_strides[d] = q.stride(d), a.k_strides[d] = k.stride(d), a.v_strides[d] = v.stride(d);
  }
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->device().is_cpu() && mask->dim() == 4, "mask must be a 4-d CPU tensor, got ", mask->sizes());
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->is_floating_point(),
                "mask must be bool (True: read the key) or float (added to the scores), got ", mask->scalar_type());
    m = mask->scalar_type() == at::kBool ? *mask : mask->to(at::kFloat);
    m = m.expand({batch, heads, rows, keys});  // broadcast dimensions get stride 0: nothing is copied
    for (int d = 0; d < 4; ++d) a.m_strides[d] = m.stride(d);
    if (m.scalar_type() == at::kBool)
      a.bool_mask = reinterpret_cast<const uint8_t*>(m.data_ptr());
    else
      a.float_mask = m.data_ptr<float>();
  }
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.window = window;
  at::Tensor out = at::empty({batch, rows, heads, dim}, q.options().dtype(at::kFloat));
  a.out = out.data_ptr<float>();
  const int64_t level = kvb_level();
  // The query heads of a key head share an item (each key and value row read once for all of them), split where
  // that would leave a thread without one (a decode step of a model with one key head, on two threads). Which heads
  // share an item changes no bit.
  const int64_t group = heads / kv_heads, items = batch * kv_heads * rows, threads = at::get_num_threads();
  int64_t per = std::max<int64_t>(1, std::min<int64_t>(group, KVB_MAX_HEADS_PER_ITEM));  // (no heads: no items)
  while (per > 1 && items * ((group + per - 1) / per) < threads) per = (per + 1) / 2;
  a.heads_per_item = per;
  const int64_t per_item = std::max<int64_t>(1, per * keys * dim);
  const int64_t grain = std::max<int64_t>(1, 32768 / per_item);  // items small enough stay on one thread
  const int64_t scratch = kvb_attention_scratch(dim, keys, per), total = items * ((group + per - 1) / per);
  // taken as threads finish (a causal prompt's later rows read more keys: a static split of rows is uneven)
  balanced_for(total, std::max(grain, chunk_of(total, 1)), [&](const auto& take) {
    float* buffer = thread_scratch<float>(scratch);
    for (int64_t t0, t1; take(t0, t1);) KVB_BY_LEVEL(level, attention_rows, a, t0, t1, buffer);
  });
  return dtype == at::kBFloat16 ? rounded_to_bf16(out) : out.scalar_type() == dtype ? out : out.to(dtype);
}

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& mask, double scale, bool causal, int64_t window) {
  return attention_over(query, key, value, mask, scale, causal, window, 0, -1);
}

// RMSNorm over the last dimension (see norm_body.inc): x float32, bfloat16 or float16 (computed from a
// float32 copy), scale float32 [n]; the result in x's dtype. Threads split rows.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "x must be a CPU tensor with at least one dimension, got ",
              x.device(), " ", x.sizes());
  const int64_t n = x.size(-1);
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  scale.dim() == 1 && scale.size(0) == n,
              "scale must be a contiguous float32 CPU tensor [", n, "], got ", scale.scalar_type(), " ", scale.sizes());
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", dtype);
  const at::Tensor xc = (dtype == at::kHalf ? x.to(at::kFloat) : x).contiguous();
  const int64_t rows = n == 0 ? 0 : xc.numel() / n;
  const bool bf16 = dtype == at::kBFloat16;
  // bfloat16 rows are rounded from a thread's float scratch into the result (the bits .to(bfloat16) gives,
  // without a float32 tensor and a cast per call); float16 through a float32 result, as before.
  at::Tensor out = at::empty(x.sizes(), xc.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t level = kvb_level();
  const auto* xp = static_cast<const char*>(xc.data_ptr());
  const int64_t row_bytes = n * xc.element_size();
  const float* sp = scale.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    if (!bf16) {
      KVB_BY_LEVEL(level, rms_rows, xp, false, n, n, sp, e, r0, r1, out.data_ptr<float>());
      return;
    }
    std::vector<float> scratch((r1 - r0) * n);
    KVB_BY_LEVEL(level, rms_rows, xp + r0 * row_bytes, true, n, n, sp, e, 0, r1 - r0, scratch.data());
    kvb_round_to_bf16(scratch.data(), static_cast<int64_t>(scratch.size()), out.data_ptr<c10::BFloat16>() + r0 * n);
  });
  return out.scalar_type() == dtype ? out : out.to(dtype);
}

}  // namespace

at::Tensor kvb_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) { return rms_norm(x, scale, eps); }

at::Tensor kvb_causal_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t first,
                                int64_t count, double scale, int64_t window) {
  return attention_over(query, key, value, std::nullopt, scale, true, window, first, count);
}

TORCH_LIBRARY_IMPL(kvboost, CPU, m) {
  m.impl("attention", &attention);
  m.impl("rms_norm", &rms_norm);
}
