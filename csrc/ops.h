// What ops.cpp and row_ops.cpp share with the other torch-facing translation units (layer.cpp, decoder.cpp): the ISA
// in effect and the ops a decoder layer composes.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kvboost_kernels.h"

// Up to this many elements, the elementwise steps of the ops (casts of GEMM inputs, rounding projections, RoPE,
// residual adds) run as plain loops, which cost less than torch's ops for a decode step's few rows; beyond it, as
// torch's ops, which vectorize (the loops are scalar: -fno-tree-vectorize; a 256-token prefill was 15% slower on
// them). Both give the same bits (tested).
constexpr int64_t kKvbLoopElements = 16384;

// The ISA paths (ops.py's ISA_LEVELS) and the one in effect (set_isa_level; ops.cpp).
enum KvbLevel : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
int64_t kvb_level();

// Calls fn of the path for `level` (AVX-512 BF16 runs the AVX-512 kernels except where ops say otherwise).
#define KVB_BY_LEVEL(level, fn, ...)      \
  ((level) >= kAvx512 ? kvb_avx512::fn(__VA_ARGS__) \
   : (level) == kAvx2 ? kvb_avx2::fn(__VA_ARGS__)   \
                      : kvb_scalar::fn(__VA_ARGS__))

// Whether the ISA path in effect has AVX-512: the elementwise loops then run kvb_avx512's (the same bits).
inline bool kvb_avx512_loops() { return kvb_level() >= kAvx512; }

// Up to how many elements an elementwise step on `dtype` runs as our loop: bf16 on kvb_avx512's vectorized loops up to
// 32768, below which torch's ops run on one thread too (their grain), so the loops cost less at every such size (a
// 9-row forward's gate/up rounding, gated product and residual adds, whose 9 x 2048 went to torch's ops);
// kKvbLoopElements for the scalar loops.
inline int64_t kvb_loop_elements(at::ScalarType dtype) {
  return dtype == at::kBFloat16 && kvb_avx512_loops() ? 32768 : kKvbLoopElements;
}

// x[0, n) rounded to bf16 as .to(bfloat16) rounds (to nearest even, NaN to 0x7FC0): kvb_avx512's loop where the ISA
// in effect has AVX-512, else c10::BFloat16's rounding one element at a time (the same bits).
inline void kvb_round_to_bf16(const float* x, int64_t n, c10::BFloat16* out) {
  if (kvb_avx512_loops())
    kvb_avx512::round_to_bf16(x, n, reinterpret_cast<uint16_t*>(out));
  else
    for (int64_t i = 0; i < n; ++i) out[i] = c10::BFloat16(x[i]);
}

// An int4 weight in the kernels' layout (kvboost_kernels.h): NB = `blocks` column blocks, group size `group`.
struct KvbInt4Weight {
  const uint8_t* q;
  const float* scales;
  const float* zeros;
  int64_t blocks, group;
};

// x [M, K] (CPU, checked by the caller) through int4 weights sharing K and group size, as
// torch.ops.kvboost.int4_linear computes each column (columns are independent: which weights share a call
// changes no bit): float [M, sum of 16 * blocks], weight i from column offsets[i]; threads over all blocks.
// `bf16_inputs`: x's values rounded to bfloat16 first, as int4_linear(x.to(bfloat16)) computes.
at::Tensor kvb_int4_columns(const at::Tensor& x, const std::vector<KvbInt4Weight>& ws, std::vector<int64_t>& offsets,
                            bool bf16_inputs = false);

// torch.ops.kvboost.rms_norm: the result in x's dtype.
at::Tensor kvb_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps);

// torch.ops.kvboost.attention(query, key[:, :, first:first + count], value[...], None, scale, True, window), reading
// the range in place: the result in query's dtype.
at::Tensor kvb_causal_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t first,
                                int64_t count, double scale, int64_t window);

// Entries [first, first + count) of an optional-tensor list argument (layer.cpp).
c10::List<std::optional<at::Tensor>> kvb_sublist(const c10::List<std::optional<at::Tensor>>& list, int64_t first,
                                                 int64_t count);

// torch.ops.kvboost.layer_step's kernel signature (layer.cpp), for typed calls through the dispatcher.
using KvbLayerStep = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, at::TensorList, at::TensorList, at::IntArrayRef, at::IntArrayRef,
    const c10::List<std::optional<at::Tensor>>&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
    const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
    const at::Tensor&, const at::Tensor&, int64_t, c10::string_view, const at::Tensor&, const at::Tensor&, int64_t,
    int64_t, double, int64_t);

// torch.ops.kvboost.decoder_step's kernel signature (decoder.cpp), for typed calls through the dispatcher.
using KvbDecoderStep = std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>(
    const at::Tensor&, at::TensorList, at::TensorList, at::IntArrayRef, at::IntArrayRef,
    const c10::List<std::optional<at::Tensor>>&, const c10::List<std::optional<at::Tensor>>&, at::ArrayRef<double>,
    const c10::List<std::optional<at::Tensor>>&, at::ArrayRef<double>, at::IntArrayRef, const std::vector<std::string>&,
    at::ArrayRef<double>, at::IntArrayRef, at::IntArrayRef, at::TensorList, at::TensorList, at::TensorList,
    at::TensorList, at::IntArrayRef, at::IntArrayRef);
