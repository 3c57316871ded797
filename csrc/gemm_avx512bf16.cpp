// AVX-512 BF16 path (vdpbf16ps), bf16 activations only, with numerics of its own (not the fp32
// paths' bits). int4: the codes q (0..15, exact in bf16) meet x in vdpbf16ps, and the scale and zero
// are applied once per group. Per output element, per group g in order:
//   t = 0; for each k-pair p of the group in order: t += x[2p+1] q[2p+1]; t += x[2p] q[2p]
//   (each product exact in fp32, each sum rounded: one vdpbf16ps lane; denormals flushed);
//   acc = acc + s * (t - z * xs[g])   (each operation rounded), xs[g] = the same pair sum of x alone.
// Nothing depends on M or on threads, so rows are bit-independent on this path too. Compiled for
// AVX-512 BF16, called only when the CPU has it; the VBMI decoding below runs only where the CPU has
// that too (Cooper Lake has BF16 without VBMI). No auto-vectorization (build flags): the compiler emits
// VBMI instructions only where the intrinsics below ask for them.
#include "kvboost_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c")
#include <immintrin.h>

#include <type_traits>

namespace kvb_avx512bf16 {
namespace {

#include "int4_codes.inc"

#include "with_rows.inc"

inline __m512i x_pair(const uint16_t* x) {
  int32_t bits;
  __builtin_memcpy(&bits, x, sizeof bits);
  return _mm512_set1_epi32(bits);
}

// acc + s * (t - z * xs): the group's scale and zero, once per group.
inline __m512 close_group(__m512 acc, __m512 t, __m512 s, __m512 z, float xs) {
  const __m512 u = _mm512_sub_ps(t, _mm512_mul_ps(z, _mm512_set1_ps(xs)));
  return _mm512_add_ps(acc, _mm512_mul_ps(s, u));
}

// Few rows: codes decoded in registers, NB blocks' chains at once; the same bits as `tile`. VBMI: the
// codes decoded by VbmiCodes (the group size a multiple of 8). Each 64 bytes read of a block prefetches
// the same bytes of the block NB further on (the next tile's): a block's K x 8 bytes are too short a
// stream for the hardware prefetcher to get ahead when the weights come from DRAM (a decode step).
// SUMS_OUT: the running sums kept in the output between groups rather than in registers (see few_rows).
template <int MR, int NB, bool VBMI, bool SUMS_OUT = false>
inline void tile_fused(const uint16_t* x, int64_t ldx, int64_t k, const uint8_t* q, int64_t qstride,
                       const float* scales, const float* zeros, int64_t sstride, int64_t group, const float* xs,
                       int64_t groups, float* out, int64_t ldo, const VbmiCodes& codes) {
  static_assert(!SUMS_OUT || (VBMI && MR > 2), "SUMS_OUT decodes with VbmiCodes, from raw (not gathered) codes");
  const __m512i table = code_table();
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    __m512 t[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) t[r][b] = _mm512_setzero_ps();
    for (int b = 0; b < NB; ++b) {  // the next tile's scales and zeros for this group (read once per group)
      _mm_prefetch(reinterpret_cast<const char*>(scales + (b + NB) * sstride + 16 * gi), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(zeros + (b + NB) * sstride + 16 * gi), _MM_HINT_T0);
    }
    if constexpr (VBMI) {
      const MultishiftCodes& shifted = multishift_codes();
      for (int64_t i = g0; i < g0 + group; i += 8) {
        __m512i src[NB];
        for (int b = 0; b < NB; ++b) {
          src[b] = _mm512_loadu_si512(q + b * qstride + 8 * i);
          // One or two rows (a decode step, a draft token) consume a block fast: the next tile's bytes
          // non-temporal, so that weights read once a forward stay out of the L3 that holds what the
          // next calls read (the KV cache, norms, the interpreter's objects). Alternated in one process on
          // Zen 5 against into L2 (_MM_HINT_T1, itself measured faster than into L1): right after a prefill
          // (benchmarks/kernels.py's samples) a 32k-head draft token 1.09-1.13x, a decode step 1.06-1.07x;
          // in whole greedy generate calls (64 tokens, 24 back-to-back pairs) plain 1.013x, head-draft
          // speculation 1.019x, a draft token in a steady loop 1.02-1.05x. More rows into L1 (non-temporal
          // there too: 0.99x of that; the int8 draft head's blocks non-temporal too lost part of the gain).
          if constexpr (MR <= 2) {
            src[b] = shifted.gathered(src[b]);
            _mm_prefetch(reinterpret_cast<const char*>(q + (b + NB) * qstride + 8 * i), _MM_HINT_NTA);
          } else {
            _mm_prefetch(reinterpret_cast<const char*>(q + (b + NB) * qstride + 8 * i), _MM_HINT_T0);
          }
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          if constexpr (SUMS_OUT) {  // many rows: each block's pair decoded once, then a row's activations at a time
            __m512bh w[NB];
#pragma GCC unroll 4
            for (int b = 0; b < NB; ++b) w[b] = (__m512bh)codes.pair(src[b], c);
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
              const __m512bh xv = (__m512bh)x_pair(x + r * ldx + i + 2 * c);
#pragma GCC unroll 4
              for (int b = 0; b < NB; ++b) t[r][b] = _mm512_dpbf16_ps(t[r][b], xv, w[b]);
            }
            continue;
          }
          __m512i pair[MR];
          for (int r = 0; r < MR; ++r) pair[r] = x_pair(x + r * ldx + i + 2 * c);
          for (int b = 0; b < NB; ++b) {
            __m512bh w;
            if constexpr (MR <= 2)
              w = (__m512bh)shifted.pair(src[b], c, codes);
            else
              w = (__m512bh)codes.pair(src[b], c);
            for (int r = 0; r < MR; ++r) t[r][b] = _mm512_dpbf16_ps(t[r][b], (__m512bh)pair[r], w);
          }
        }
      }
    } else {
      for (int64_t i = g0; i < g0 + group; i += 2) {
        __m512i pair[MR];
        for (int r = 0; r < MR; ++r) pair[r] = x_pair(x + r * ldx + i);
        if (i % 8 == 0)  // as above: one or two rows non-temporal (without VBMI on Zen 5: 1.07x / 1.05x)
          for (int b = 0; b < NB; ++b) {
            const char* next = reinterpret_cast<const char*>(q + (b + NB) * qstride + 8 * i);
            if constexpr (MR <= 2)
              _mm_prefetch(next, _MM_HINT_NTA);
            else
              _mm_prefetch(next, _MM_HINT_T0);
          }
        for (int b = 0; b < NB; ++b) {
          const __m512bh w = (__m512bh)code_pair(q + b * qstride + 8 * i, table);
          for (int r = 0; r < MR; ++r) t[r][b] = _mm512_dpbf16_ps(t[r][b], (__m512bh)pair[r], w);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(scales + b * sstride + 16 * gi);
      const __m512 z = _mm512_loadu_ps(zeros + b * sstride + 16 * gi);
      for (int r = 0; r < MR; ++r) {
        if constexpr (SUMS_OUT) {  // the running sums through the output, as in `tile` (0 + -0 is +0 there too)
          float* o = out + r * ldo + 16 * b;
          const __m512 sum = gi == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
          _mm512_storeu_ps(o, close_group(sum, t[r][b], s, z, xs[r * groups + gi]));
        } else {
          acc[r][b] = close_group(acc[r][b], t[r][b], s, z, xs[r * groups + gi]);
        }
      }
    }
  }
  if constexpr (!SUMS_OUT)
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + r * ldo + 16 * b, acc[r][b]);
}

// Many rows: NB blocks' codes decoded once into `strip` (block b's at strip + 8 K b), then every tile of MR rows
// over them. Each tile keeps MR x NB chains in registers (the group's t; acc goes through `out`, read back at each
// group's end, so that the registers hold only the chains): one code vector loaded serves MR rows and one activation
// pair NB blocks, and enough independent vdpbf16ps chains are in flight to cover the instruction's latency. Measured
// on Zen 5 (2 threads, Gemma-3-270M's shapes, the same bits): 4 x 4 against the former 8 rows x 1 block with acc in
// registers, 1.25-1.40x at M = 16, 64 and 256; 6 x 4, 8 x 2, 5 x 4 with acc in memory, 6 x 2 in registers, 3 x 8
// and 2 x 8 were all slower (3 x 8 and 2 x 8: 0.7x, their strips leave L1).
template <int MR, int NB>
inline void tile(const uint16_t* x, int64_t ldx, int64_t k, const uint32_t* strip, const float* scales,
                 const float* zeros, int64_t sstride, int64_t group, const float* xs, int64_t groups, float* out,
                 int64_t ldo) {
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    __m512 t[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) t[r][b] = _mm512_setzero_ps();
    for (int64_t i = g0; i < g0 + group; i += 2) {
      __m512bh w[NB];
      for (int b = 0; b < NB; ++b) w[b] = (__m512bh)_mm512_loadu_si512(strip + 8 * k * b + 8 * i);
      for (int r = 0; r < MR; ++r) {
        const __m512bh xv = (__m512bh)x_pair(x + r * ldx + i);
        for (int b = 0; b < NB; ++b) t[r][b] = _mm512_dpbf16_ps(t[r][b], xv, w[b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(scales + b * sstride + 16 * gi);
      const __m512 z = _mm512_loadu_ps(zeros + b * sstride + 16 * gi);
      for (int r = 0; r < MR; ++r) {  // acc from 0, as in registers (0 + -0 is +0: the first group adds too)
        float* o = out + r * ldo + 16 * b;
        const __m512 acc = gi == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
        _mm512_storeu_ps(o, close_group(acc, t[r][b], s, z, xs[r * groups + gi]));
      }
    }
  }
}

// Every row of x through NB blocks already decoded into `strip`, MR rows at a time.
template <int MR, int NB>
void row_tiles(const uint16_t* x, int64_t m, int64_t k, const uint32_t* strip, const float* sb, const float* zb,
               int64_t sstride, int64_t group, const float* xs, int64_t groups, float* ob, int64_t ldo) {
  for (int64_t r0 = 0; r0 < m; r0 += MR) {
    const uint16_t* xr = x + r0 * k;
    const float* xsr = xs + r0 * groups;
    float* o = ob + r0 * ldo;
    with_rows<1, MR>(m - r0, [&](auto rows) {
      tile<decltype(rows)::value, NB>(xr, k, k, strip, sb, zb, sstride, group, xsr, groups, o, ldo);
    });
  }
}

inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  __builtin_memcpy(&f, &wide, sizeof f);
  return f;
}

// The pair sums of N (row, group) spans at once: N independent chains (one sum each, in its own order),
// so the adds overlap instead of waiting on one another (a chain alone: one add per add latency).
template <int N>
inline void span_sums(const uint16_t* const* spans, int64_t group, float* sums) {
  float acc[N];
  for (int j = 0; j < N; ++j) acc[j] = 0.0f;
  for (int64_t i = 0; i < group; i += 2)
    for (int j = 0; j < N; ++j) {  // the pair order of vdpbf16ps: odd element first
      acc[j] = acc[j] + bf16_value(spans[j][i + 1]);
      acc[j] = acc[j] + bf16_value(spans[j][i]);
    }
  for (int j = 0; j < N; ++j) sums[j] = acc[j];
}

}  // namespace

void group_sums(const uint16_t* x, int64_t m, int64_t k, int64_t group, float* xs) {
  const int64_t groups = k / group, spans = m * groups;  // span s: row s / groups, group s % groups (xs's order)
  const uint16_t* starts[8];
  for (int64_t s = 0; s < spans;) {
    const int64_t n = spans - s >= 8 ? 8 : spans - s >= 4 ? 4 : spans - s >= 2 ? 2 : 1;
    for (int64_t j = 0; j < n; ++j) starts[j] = x + (s + j) / groups * k + (s + j) % groups * group;
    switch (n) {
      case 8: span_sums<8>(starts, group, xs + s); break;
      case 4: span_sums<4>(starts, group, xs + s); break;
      case 2: span_sums<2>(starts, group, xs + s); break;
      default: span_sums<1>(starts, group, xs + s); break;
    }
    s += n;
  }
}

// Up to kFusedRows[VBMI] rows: the codes decoded in registers (tile_fused), no strip. With VBMI the
// decoding is cheap enough to repeat per block for a verification's 9 rows (Gemma's 18 layers' gate,
// up and down projections at 9 rows from DRAM: 8.2 -> 5.7 ms against the strip); without it, 4.
constexpr int64_t kFusedRows[2] = {4, 12};

int64_t strip_words(int64_t m, int64_t k, bool vbmi) { return m > kFusedRows[vbmi] ? 4 * k * 8 : 0; }

// One block (four for one or two rows, two for 3 to 11), `b` advanced past all but the last; m <= kFusedRows[VBMI].
// Each tile's chains, rows x blocks, are what hides vdpbf16ps's latency: 3 to 8 rows on two blocks against one,
// alternated in one process on Zen 5 (Gemma-3-270M's shapes, in cache, the same bits): 1.22-1.50x, with VBMI or
// without. From 9 rows on, two blocks' chains and running sums no longer fit the 32 registers (9 rows: 0.83-0.88x),
// and splitting the rows into two tiles of two blocks decodes the codes twice (1.0-1.03x); with the running sums
// kept in the output between groups (SUMS_OUT, as `tile` does) and each block's pair decoded before the rows'
// activations are read, two blocks at 9 to 11 rows (VBMI) take Gemma's 72 GEMMs from 3.52 / 3.68 / 4.16 ms to
// 3.07 / 3.36 / 3.75 (Zen 5, alternated in one process, 15 rounds; 3.24 -> 2.75 ms at 9 rows in cache: bound by
// the arithmetic); at 12 rows 0.97x, and three blocks at 9 rows 0.89x.
template <bool VBMI>
void few_rows(const uint16_t* x, int64_t m, int64_t k, const uint8_t* qb, int64_t qstride, const float* sb,
              const float* zb, int64_t sstride, int64_t group, const float* xs, int64_t groups, float* ob, int64_t ldo,
              int64_t& b, int64_t b1, const VbmiCodes& codes) {
  const int64_t blocks = m <= 2 && b + 4 <= b1 ? 4 : m >= 3 && m <= 11 && b + 2 <= b1 ? 2 : 1;
  auto fused = [&](auto rows, auto nb) {
    tile_fused<decltype(rows)::value, decltype(nb)::value, VBMI>(x, k, k, qb, qstride, sb, zb, sstride, group, xs,
                                                                  groups, ob, ldo, codes);
  };
  if (blocks == 4) {
    with_rows<1, 2>(m, [&](auto rows) { fused(rows, std::integral_constant<int, 4>{}); });
  } else if (blocks == 2 && m <= 8) {
    with_rows<3, 8>(m, [&](auto rows) { fused(rows, std::integral_constant<int, 2>{}); });
  } else if (blocks == 2) {  // 9 to 11 rows: VBMI only (kFusedRows[false] is 4)
    if constexpr (VBMI)
      with_rows<9, 11>(m, [&](auto rows) {
        tile_fused<decltype(rows)::value, 2, VBMI, true>(x, k, k, qb, qstride, sb, zb, sstride, group, xs, groups, ob,
                                                         ldo, codes);
      });
  } else {
    with_rows<1, kFusedRows[VBMI]>(m, [&](auto rows) { fused(rows, std::integral_constant<int, 1>{}); });
  }
  b += blocks - 1;
}

void int4_blocks(const uint16_t* x, int64_t m, int64_t k, const uint8_t* q, const float* scales, const float* zeros,
                 int64_t group, const float* xs, int64_t b0, int64_t b1, float* out, int64_t ldo, uint32_t* strip,
                 bool vbmi) {
  if (m <= 0) return;  // no rows: the row tiles below assume at least one
  static const VbmiCodes codes;
  const int64_t groups = k / group, qstride = k * 8, sstride = groups * 16;
  const __m512i table = code_table();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* qb = q + b * qstride;
    const float* sb = scales + b * sstride;
    const float* zb = zeros + b * sstride;
    float* ob = out + 16 * b;
    if (m <= kFusedRows[vbmi]) {
      if (vbmi)
        few_rows<true>(x, m, k, qb, qstride, sb, zb, sstride, group, xs, groups, ob, ldo, b, b1, codes);
      else
        few_rows<false>(x, m, k, qb, qstride, sb, zb, sstride, group, xs, groups, ob, ldo, b, b1, codes);
      continue;
    }
    // Four blocks at a time where four are left, else one (8 rows a tile: its 8 chains are what one block allows)
    const int64_t nb = b + 4 <= b1 ? 4 : 1;
    for (int64_t j = 0; j < nb; ++j)
      for (int64_t i = 0; i < k; i += 2)
        _mm512_storeu_si512(strip + 8 * k * j + 8 * i, code_pair(qb + j * qstride + 8 * i, table));
    if (nb == 4)
      row_tiles<4, 4>(x, m, k, strip, sb, zb, sstride, group, xs, groups, ob, ldo);
    else
      row_tiles<8, 1>(x, m, k, strip, sb, zb, sstride, group, xs, groups, ob, ldo);
    b += nb - 1;
  }
}

}  // namespace kvb_avx512bf16
