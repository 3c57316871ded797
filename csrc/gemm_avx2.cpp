// AVX2 + FMA path: a 16-column block is two 8-lane registers; row tiles of 6 rows (12 accumulators).
// Everything in this file is compiled for AVX2 and called only when the CPU has it; it includes no
// C++ library templates, whose AVX2 instances could otherwise be picked by the linker for other code.
#include "kvboost_kernels.h"

#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace kvb_avx2 {
namespace {

constexpr int64_t kRowTile = 6;
constexpr int64_t kNkRowTile = kRowTile;
constexpr bool kKvbWide = false;  // 16 registers
constexpr int64_t kNkPairRows = 0;  // two weight rows per pass spill (a V16 is 2 of 16 registers): 1.4x slower
// Every pass (at most kNkRowTile rows) prefetches its weight rows into L2: the 262k x 640 bf16 head from DRAM,
// two threads, Zen 3, ABBA processes over 6 rounds (kernel_sources_ab.py --head): 6 rows 1.27x (1.17-1.63),
// 9 rows (6 + 3) 1.08x (1.01-1.25), 12 rows 1.11x; 1 and 4 rows prefetched already.
constexpr int kNkPrefetchBelow = kNkRowTile + 1;
constexpr int kSmallBlocks = 2;

struct V16 {
  __m256 lo, hi;
  static inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static inline V16 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  // The codes (0..15, as floats) of rows k and k + 1 of a block, each byte widened once to a 32-bit lane: its
  // low nibble is row k's code, bits 4..7 row k + 1's (one load-and-widen per 8 columns instead of two
  // shuffles and a widen per row).
  static inline void int4_codes(const uint8_t* p, V16& c0, V16& c1) {
    const __m256i a = widened(p), b = widened(p + 8), mask = _mm256_set1_epi32(0x0F);
    c0 = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
    c1 = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
  }
  static inline __m256i widened(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static inline V16 i8(const int8_t* p) {
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
  }
  static inline V16 bf16(const uint16_t* p) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16))};
  }
  static inline V16 fma(float a, const V16& w, const V16& acc) {
    const __m256 x = _mm256_set1_ps(a);
    return {_mm256_fmadd_ps(x, w.lo, acc.lo), _mm256_fmadd_ps(x, w.hi, acc.hi)};
  }
  static inline V16 weights(const float* p) { return load(p); }
  static inline V16 weights(const Bf16* p) { return bf16(reinterpret_cast<const uint16_t*>(p)); }
  static inline V16 fmav(const V16& a, const V16& w, const V16& acc) {
    return {_mm256_fmadd_ps(a.lo, w.lo, acc.lo), _mm256_fmadd_ps(a.hi, w.hi, acc.hi)};
  }
  inline float sum() const {  // the scalar path's tree (gemm_scalar.cpp)
    const __m256 t = _mm256_add_ps(lo, hi);
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
  }
  static inline V16 mul(const V16& a, const V16& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static inline V16 add(const V16& a, const V16& b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static inline V16 sub(const V16& a, const V16& b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  inline void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  // The softmax's lane operations (attention_body.inc): each lane as the scalar code computes it.
  static inline V16 max(const V16& a, const V16& b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  inline float max_lane() const {
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_max_ps(lo, hi));
    float m = t[0];
    for (int j = 1; j < 8; ++j) m = t[j] > m ? t[j] : m;
    return m;
  }
  inline bool any_nan() const {
    return _mm256_movemask_ps(_mm256_cmp_ps(lo, lo, _CMP_UNORD_Q)) != 0 ||
           _mm256_movemask_ps(_mm256_cmp_ps(hi, hi, _CMP_UNORD_Q)) != 0;
  }
  // 2^n for integral n in [-126, 127]: (n + 127) << 23 as float bits
  static inline V16 pow2(const V16& n) {
    const __m256i b = _mm256_set1_epi32(127);
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n.lo), b), 23)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n.hi), b), 23))};
  }
  // y where x >= bound, else 0 (x NaN: 0)
  static inline V16 where_at_least(const V16& x, float bound, const V16& y) {
    const __m256 b = _mm256_set1_ps(bound);
    return {_mm256_and_ps(_mm256_cmp_ps(x.lo, b, _CMP_GE_OQ), y.lo),
            _mm256_and_ps(_mm256_cmp_ps(x.hi, b, _CMP_GE_OQ), y.hi)};
  }
};

}  // namespace

#include "gemm_body.inc"
#include "attention_body.inc"
#include "norm_body.inc"

}  // namespace kvb_avx2
