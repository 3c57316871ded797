// AVX-512 (F/BW/VL/DQ) path: a 16-column block is one register; row tiles of 8 rows.
// Compiled for AVX-512 and called only when the CPU has it (see gemm_avx2.cpp on library templates).
#include "kvboost_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

namespace kvb_avx512 {
namespace {

constexpr int64_t kRowTile = KVB_MAX_ROW_TILE;
constexpr int64_t kNkRowTile = 9;  // a 9-row verification in one pass
constexpr bool kKvbWide = true;  // 32 registers: wider attention chains (attention_body.inc)
constexpr int64_t kNkPairRows = 6;  // 2 weight rows: 18 accumulators + 2 weights + x in 32 registers
constexpr int kNkPrefetchBelow = 6;  // passes of 6+ rows take two weight rows, which prefetch
constexpr int kSmallBlocks = 4;

struct V16 {
  __m512 v;
  static inline V16 zero() { return {_mm512_setzero_ps()}; }
  static inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static inline V16 set1(float a) { return {_mm512_set1_ps(a)}; }
  static inline void int4_codes(const uint8_t* p, V16& c0, V16& c1) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    c0 = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)))};
    c1 = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)))};
  }
  static inline V16 i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static inline V16 bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static inline V16 fma(float a, const V16& w, const V16& acc) { return {_mm512_fmadd_ps(_mm512_set1_ps(a), w.v, acc.v)}; }
  static inline V16 weights(const float* p) { return load(p); }
  static inline V16 weights(const Bf16* p) { return bf16(reinterpret_cast<const uint16_t*>(p)); }
  static inline V16 fmav(const V16& a, const V16& w, const V16& acc) { return {_mm512_fmadd_ps(a.v, w.v, acc.v)}; }
  inline float sum() const {  // the scalar path's tree (gemm_scalar.cpp)
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
  }
  static inline V16 mul(const V16& a, const V16& b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static inline V16 add(const V16& a, const V16& b) { return {_mm512_add_ps(a.v, b.v)}; }
  static inline V16 sub(const V16& a, const V16& b) { return {_mm512_sub_ps(a.v, b.v)}; }
  inline void store(float* p) const { _mm512_storeu_ps(p, v); }
  // The softmax's lane operations (attention_body.inc): each lane as the scalar code computes it.
  static inline V16 max(const V16& a, const V16& b) { return {_mm512_max_ps(a.v, b.v)}; }
  inline float max_lane() const { return _mm512_reduce_max_ps(v); }
  inline bool any_nan() const { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
  // 2^n for integral n in [-126, 127]: (n + 127) << 23 as float bits
  static inline V16 pow2(const V16& n) {
    const __m512i biased = _mm512_add_epi32(_mm512_cvttps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(biased, 23))};
  }
  // y where x >= bound, else 0 (x NaN: 0)
  static inline V16 where_at_least(const V16& x, float bound, const V16& y) {
    return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(bound), _CMP_GE_OQ), y.v)};
  }
};

}  // namespace

#include "gemm_body.inc"
#include "attention_body.inc"
#include "norm_body.inc"

}  // namespace kvb_avx512
