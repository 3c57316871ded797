// AVX2 + FMA path: a 16-column block is two 8-lane registers; row tiles of 6 rows (12 accumulators).
// Everything in this file is compiled for AVX2 and called only when the CPU has it; it includes no
// C++ library templates, whose AVX2 instances could otherwise be picked by the linker for other code.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "kvboost_kernels.h"

namespace kvb_avx2 {
namespace {

constexpr int64_t kRowTile = 6;
constexpr int64_t kNkRowTile = kRowTile;
constexpr int64_t kNkPairRows = 0;  // two weight rows per pass spill (a V16 is 2 of 16 registers): 1.4x slower
constexpr int kSmallBlocks = 2;

struct V16 {
  __m256 lo, hi;
  static inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  // Rows k and k + 1 of a block, each byte widened once to a 32-bit lane: its low nibble is row k's code, bits
  // 4..7 row k + 1's (one load-and-widen per 8 columns instead of two shuffles and a widen per row).
  static inline void int4x2(const uint8_t* p, const V16& z, const V16& s, V16& w0, V16& w1) {
    pair<false>(p, z, s, w0, w1);
  }
  // The same bits with `zb` = 2^23 + zero (biased_zeros): a code q becomes the float 2^23 + q by setting its
  // exponent bits, so (2^23 + q) - zb is q - zero exactly, without a conversion (M = 1: 1.2x on Zen 3).
  static constexpr bool kBiasedCodes = true;
  static inline void int4x2_biased(const uint8_t* p, const V16& zb, const V16& s, V16& w0, V16& w1) {
    pair<true>(p, zb, s, w0, w1);
  }
  // With 16 registers, a group's scales and zeros held in registers for two blocks made GCC spill the accumulators
  // (a store and a load in every fma chain); read from memory each step instead (M = 1: 1.2x on Zen 3).
  static constexpr bool kSidesFromMemory = true;
  // Whether every lane of z is an integer of magnitude at most 2^22 (then 2^23 + z is exact); NaN and inf are not.
  static inline bool integral(const V16& z) {
    return _mm256_movemask_ps(_mm256_and_ps(integral(z.lo), integral(z.hi))) == 0xFF;
  }
  static inline V16 biased(const V16& z) {
    const __m256 bias = _mm256_set1_ps(8388608.0f);
    return {_mm256_add_ps(z.lo, bias), _mm256_add_ps(z.hi, bias)};
  }
  template <bool Biased>
  static inline void pair(const uint8_t* p, const V16& z, const V16& s, V16& w0, V16& w1) {
    const __m256i a = widened(p), b = widened(p + 8), mask = _mm256_set1_epi32(0x0F);
    w0 = {code(codes<Biased>(_mm256_and_si256(a, mask)), z.lo, s.lo),
          code(codes<Biased>(_mm256_and_si256(b, mask)), z.hi, s.hi)};
    w1 = {code(codes<Biased>(_mm256_srli_epi32(a, 4)), z.lo, s.lo),
          code(codes<Biased>(_mm256_srli_epi32(b, 4)), z.hi, s.hi)};
  }
  static inline __m256 integral(__m256 z) {  // lanes: all ones where z is such an integer
    const __m256 whole = _mm256_cmp_ps(_mm256_round_ps(z, _MM_FROUND_TO_NEG_INF), z, _CMP_EQ_OQ);
    const __m256 small = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), z), _mm256_set1_ps(4194304.0f),
                                       _CMP_LE_OQ);
    return _mm256_and_ps(whole, small);
  }
  static inline __m256i widened(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // Codes 0..15 as floats: q itself, or 2^23 + q (its exponent bits set) for the biased decoding.
  template <bool Biased>
  static inline __m256 codes(__m256i q) {
    if constexpr (Biased)
      return _mm256_castsi256_ps(_mm256_or_si256(q, _mm256_set1_epi32(0x4B000000)));
    else
      return _mm256_cvtepi32_ps(q);
  }
  static inline __m256 code(__m256 q, __m256 z, __m256 s) { return _mm256_mul_ps(_mm256_sub_ps(q, z), s); }
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
  inline void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
};

}  // namespace

#include "gemm_body.inc"
#include "attention_body.inc"
#include "norm_body.inc"

}  // namespace kvb_avx2
