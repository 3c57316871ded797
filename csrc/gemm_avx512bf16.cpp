// AVX-512 BF16 path (vdpbf16ps), int4 weights with bf16 activations only. Its own numerics, not
// the fp32 paths' bits: weights are rounded to bf16, w = bf16((q - zero) * scale), and each output
// accumulates, for k-pairs p = 0, 1, ... in order, acc += x[2p+1] * w[2p+1] then acc += x[2p] * w[2p]
// (each product exact in fp32, each sum rounded to nearest even; denormals flushed), which is what
// one vdpbf16ps lane does. The order depends neither on M nor on threads, so rows stay
// bit-independent on this path too. Compiled for AVX-512 BF16, called only when the CPU has it.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

#include "kvboost_kernels.h"

namespace kvb_avx512bf16 {
namespace {

constexpr int kRowTile = 8;

// Rows 2p and 2p + 1 of a block decoded and rounded to bf16, interleaved: 32-bit lane j holds column
// j of row 2p (low half) and of row 2p + 1 (high half), as vdpbf16ps pairs them.
inline __m512i decode_pair(const uint8_t* p, __m512 z, __m512 s) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  const __m256bh w0 = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(q0, z), s));
  const __m256bh w1 = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(q1, z), s));
  const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(w0));
  const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(w1)), 16);
  return _mm512_or_si512(lo, hi);
}

// Few rows: decode in registers (no buffer), NB blocks' chains at once; the same bits as `tile`.
template <int MR, int NB>
inline void tile_fused(const uint16_t* x, int64_t ldx, int64_t k, const uint8_t* q, int64_t qstride,
                       const float* scales, const float* zeros, int64_t sstride, int64_t group, float* out,
                       int64_t ldo) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    __m512 s[NB], z[NB];
    for (int b = 0; b < NB; ++b) {
      s[b] = _mm512_loadu_ps(scales + b * sstride + 16 * gi);
      z[b] = _mm512_loadu_ps(zeros + b * sstride + 16 * gi);
    }
    for (int64_t i = g0; i < g0 + group; i += 2) {
      __m512i pair[MR];
      for (int r = 0; r < MR; ++r) {
        int32_t bits;
        __builtin_memcpy(&bits, x + r * ldx + i, sizeof bits);
        pair[r] = _mm512_set1_epi32(bits);
      }
      for (int b = 0; b < NB; ++b) {
        const __m512bh w = (__m512bh)decode_pair(q + b * qstride + 8 * i, z[b], s[b]);
        for (int r = 0; r < MR; ++r) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)pair[r], w);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + r * ldo + 16 * b, acc[r][b]);
}

template <int MR>
inline void tile(const uint16_t* x, int64_t ldx, int64_t k, const uint32_t* strip, float* out, int64_t ldo) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(strip + 16 * p);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// Row-major bf16 weights with bf16 activations (an int4 model's tied head): lane j of the chunk c
// accumulates k = 32c + 2j + 1 then 32c + 2j (one vdpbf16ps), chunks in order; then the fp32 paths'
// fixed tree over the 16 lanes. Up to 9 rows per pass (a verification's), one weight row at a time:
// two weight rows per pass were measured slower (M = 2: 20 ms against 11 ms on the 262k x 640 head).
inline float tree(__m512 v) {
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}

template <int MR>
inline void tile_rows(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* w, float* out, int64_t ldo) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * ldx + i), wv);
  }
  for (int r = 0; r < MR; ++r) out[r * ldo] = tree(acc[r]);
}

inline void rows_pass(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, float* out, int64_t ldo) {
  switch (rows) {
    case 1: tile_rows<1>(x, k, k, w, out, ldo); break;
    case 2: tile_rows<2>(x, k, k, w, out, ldo); break;
    case 3: tile_rows<3>(x, k, k, w, out, ldo); break;
    case 4: tile_rows<4>(x, k, k, w, out, ldo); break;
    case 5: tile_rows<5>(x, k, k, w, out, ldo); break;
    case 6: tile_rows<6>(x, k, k, w, out, ldo); break;
    case 7: tile_rows<7>(x, k, k, w, out, ldo); break;
    case 8: tile_rows<8>(x, k, k, w, out, ldo); break;
    default: tile_rows<9>(x, k, k, w, out, ldo); break;
  }
}

}  // namespace

void bf16_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n0, int64_t n1, float* out,
               int64_t ldo) {
  for (int64_t c0 = n0; c0 < n1; c0 += 32) {
    const int64_t c1 = c0 + 32 < n1 ? c0 + 32 : n1;
    for (int64_t r0 = 0; r0 < m; r0 += 9) {
      const int64_t rows = m - r0 < 9 ? m - r0 : 9;
      for (int64_t n = c0; n < c1; ++n) rows_pass(x + r0 * k, rows, k, w + n * k, out + r0 * ldo + n, ldo);
    }
  }
}

void int4_blocks(const uint16_t* x, int64_t m, int64_t k, const uint8_t* q, const float* scales, const float* zeros,
                 int64_t group, int64_t b0, int64_t b1, float* out, int64_t ldo, uint32_t* strip) {
  const int64_t groups = k / group, qstride = k * 8, sstride = groups * 16;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* qb = q + b * qstride;
    const float* sb = scales + b * sstride;
    const float* zb = zeros + b * sstride;
    float* ob = out + 16 * b;
    if (m <= 2 && b + 4 <= b1) {
      if (m == 1)
        tile_fused<1, 4>(x, k, k, qb, qstride, sb, zb, sstride, group, ob, ldo);
      else
        tile_fused<2, 4>(x, k, k, qb, qstride, sb, zb, sstride, group, ob, ldo);
      b += 3;
      continue;
    }
    if (m <= 4) {
      switch (m) {
        case 1: tile_fused<1, 1>(x, k, k, qb, qstride, sb, zb, sstride, group, ob, ldo); break;
        case 2: tile_fused<2, 1>(x, k, k, qb, qstride, sb, zb, sstride, group, ob, ldo); break;
        case 3: tile_fused<3, 1>(x, k, k, qb, qstride, sb, zb, sstride, group, ob, ldo); break;
        default: tile_fused<4, 1>(x, k, k, qb, qstride, sb, zb, sstride, group, ob, ldo); break;
      }
      continue;
    }
    for (int64_t gi = 0; gi < groups; ++gi) {  // decode the block once, for every row
      const __m512 s = _mm512_loadu_ps(scales + (b * groups + gi) * 16);
      const __m512 z = _mm512_loadu_ps(zeros + (b * groups + gi) * 16);
      for (int64_t i = gi * group; i < (gi + 1) * group; i += 2)
        _mm512_storeu_si512(strip + 8 * i, decode_pair(qb + 8 * i, z, s));
    }
    for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
      const int64_t rows = m - r0 < kRowTile ? m - r0 : kRowTile;
      const uint16_t* xr = x + r0 * k;
      float* o = out + r0 * ldo + 16 * b;
      switch (rows) {
        case 1: tile<1>(xr, k, k, strip, o, ldo); break;
        case 2: tile<2>(xr, k, k, strip, o, ldo); break;
        case 3: tile<3>(xr, k, k, strip, o, ldo); break;
        case 4: tile<4>(xr, k, k, strip, o, ldo); break;
        case 5: tile<5>(xr, k, k, strip, o, ldo); break;
        case 6: tile<6>(xr, k, k, strip, o, ldo); break;
        case 7: tile<7>(xr, k, k, strip, o, ldo); break;
        default: tile<8>(xr, k, k, strip, o, ldo); break;
      }
    }
  }
}

}  // namespace kvb_avx512bf16
