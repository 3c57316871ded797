// The bf16 elementwise loops of the layer ops on AVX-512 (F/BW): the bits of their scalar loops in layer.cpp and
// row_ops.cpp, which round each float result to bf16 as c10::BFloat16 does (to nearest even, NaN to 0x7FC0), 16 at a
// time. A decode step's few rows ran these scalar (layer.cpp builds without auto-vectorization): RoPE, the
// projections' rounding and the residual adds took ~1.9 ms of a 9-row forward of Gemma-3-270M, on one thread.
// Compiled for AVX-512 and called only where the ISA in effect has it.
#include "kvboost_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

namespace kvb_avx512 {
namespace {

inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

#include "bf16_round.inc"

inline __m256i load_bf16(const uint16_t* p, __mmask16 m) { return _mm256_maskz_loadu_epi16(m, p); }
inline void store_bf16(uint16_t* p, __m256i v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, v); }
inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// out[0, n) = bf16(op(a, b)) over 16 lanes at a time; op sees float lanes.
template <class Op>
inline void each(int64_t n, uint16_t* out, const Op& op) {
  for (int64_t i = 0; i < n; i += 16) store_bf16(out + i, round_bf16(op(i, lanes(n - i))), lanes(n - i));
}

}  // namespace

void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  each(n, out, [&](int64_t i, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x + i); });
}

void bf16_combine(const uint16_t* a, const uint16_t* b, int64_t n, bool product, uint16_t* out) {
  if (product)
    each(n, out, [&](int64_t i, __mmask16 m) {
      return _mm512_mul_ps(widen(load_bf16(a + i, m)), widen(load_bf16(b + i, m)));
    });
  else
    each(n, out, [&](int64_t i, __mmask16 m) {
      return _mm512_add_ps(widen(load_bf16(a + i, m)), widen(load_bf16(b + i, m)));
    });
}

void bf16_rope(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim, uint16_t* out) {
  const int64_t half = dim / 2;
  // x * cos + rotate_half(x) * sin, each product and the sum rounded: rotate_half(x) = (-x[half:], x[:half])
  auto lane = [&](int64_t d, int64_t partner, bool negate, __mmask16 m) {
    const __m512 a = widen(round_bf16(_mm512_mul_ps(widen(load_bf16(x + d, m)), widen(load_bf16(cos + d, m)))));
    __m512 rotated = widen(load_bf16(x + partner, m));
    if (negate) rotated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(rotated),
                                                               _mm512_set1_epi32(static_cast<int>(0x80000000u))));
    const __m512 e = widen(round_bf16(_mm512_mul_ps(rotated, widen(load_bf16(sin + d, m)))));
    return _mm512_add_ps(a, e);
  };
  each(half, out, [&](int64_t i, __mmask16 m) { return lane(i, i + half, true, m); });
  each(dim - half, out + half, [&](int64_t i, __mmask16 m) { return lane(half + i, i, false, m); });
}

}  // namespace kvb_avx512
