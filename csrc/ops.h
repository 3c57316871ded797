// What ops.cpp shares with the other torch-facing translation unit (layer.cpp): the ISA level in effect,
// the call of a level's kernel, and the ops a decoder layer composes.
#pragma once
#include <ATen/ATen.h>

#include "kvboost_kernels.h"

enum KvbLevel : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// Calls fn of the path for `level` (AVX-512 BF16 runs the AVX-512 kernels except where ops say otherwise).
#define KVB_BY_LEVEL(level, fn, ...)      \
  ((level) >= kAvx512 ? kvb_avx512::fn(__VA_ARGS__) \
   : (level) == kAvx2 ? kvb_avx2::fn(__VA_ARGS__)   \
                      : kvb_scalar::fn(__VA_ARGS__))

int64_t kvb_level();  // the ISA path in effect (set_isa_level)

// torch.ops.kvboost.rms_norm: the result in x's dtype.
at::Tensor kvb_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps);
