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

// f(std::integral_constant<int, R>{}) for R = m clamped to [LO, HI]: a run-time row count to a tile's template.
template <int LO, int HI, class F>
inline void with_rows(int64_t m, const F& f) {
  if constexpr (LO < HI) {
    if (m > LO) return with_rows<LO + 1, HI>(m, f);
  }
  f(std::integral_constant<int, LO>{});
}

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
          // One or two rows consume a block fast: the next tile's bytes into L2 only (measured faster
          // from DRAM than into L1); more rows into L1.
          if constexpr (MR <= 2) {
            src[b] = shifted.gathered(src[b]);
            _mm_prefetch(reinterpret_cast<const char*>(q + (b + NB) * qstride + 8 * i), _MM_HINT_T1);
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
        if (i % 8 == 0)
          for (int b = 0; b < NB; ++b)
            _mm_prefetch(reinterpret_cast<const char*>(q + (b + NB) * qstride + 8 * i), _MM_HINT_T0);
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

// Row-major bf16 weights with bf16 activations (an int4 model's tied head): lane j of the chunk c
// accumulates k = 32c + 2j + 1 then 32c + 2j (one vdpbf16ps), chunks in order; then the fp32 paths'
// fixed tree over the 16 lanes. Up to 9 rows per pass (a verification's); from kPairRows rows on, two
// weight rows per pass (each x load then feeds two vdpbf16ps: a pass of one is bound by its loads).
// The weights stream from DRAM; a pass of two weight rows computes long enough per weight row that
// the hardware prefetcher falls behind, so it prefetches them KVB_NK_AHEAD_L2 rows ahead into L2 and
// KVB_NK_AHEAD_L1 into L1 (one-weight-row passes, 1-3 rows, are at the bandwidth limit and measured
// slower with it). Measured on the 262k x 640 head (2 threads, ~11 ms for one row): 9 rows 25 -> 12.7
// ms, 4 rows 14.3 -> 11.4 ms (Zen 4). With `one_row_passes` (the caller's choice by host, ops.cpp) every pass takes
// one weight row: on Zen 5, whose 512-bit loads and vdpbf16ps run at full width, such passes with their
// non-temporal prefetch read the head at the one-row speed up to 9 rows while memory is slow, where the pairs' two
// prefetches into L2 and L1 fall behind. Alternated in one process against the pairs (9 rounds, one row 6.7 ms):
// 4 rows 8.89 -> 6.67 ms, 6 rows 8.25 -> 6.69, 9 rows 8.62 -> 6.84. In a spell of faster memory (one row 4.2 ms)
// 4 and 6 rows still gained 1.31x / 1.16x, but 9 rows lost (5.35 -> 5.76 ms: there the extra activation loads
// bound the passes). From 12 rows (two passes over each chunk) the pairs stay ahead: 12 rows 0.97x, 17 rows 0.95x.
constexpr int kPairRows = 4;
// Into L1 8 weight rows ahead here, not KVB_NK_AHEAD_L1's 4: the 262k x 640 head at 9 rows on Zen 5, alternated in
// one process (10 rounds): 1.057x (12 ahead 1.049x; 2 or 4 ahead into L1 with 8-64 into L2 0.95-1.04x).
constexpr int64_t kL1Ahead = 8;
// One-row passes (a decode step's head) fetch the weight rows 4 ahead as non-temporal: the 335 MB head then
// leaves more of the L3 to what the next decoder call reads (its int4 weights, the interpreter's objects). On Zen 5
// (32 MB L3), alternated in one process, three runs of 10-12 rounds: the head itself 1.00-1.06x, the decoder call
// after it 1.03-1.11x, the decode step 1.03-1.05x; 2, 8 and 16 ahead about the same, 1 ahead no gain. (The same for
// the two-row passes, 8 ahead non-temporal only: 1.08x on a verification then a step in one run, 0.97-0.99x in
// another; not kept.)
constexpr int64_t kNtaAhead = 4;

inline float tree(__m512 v) {
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}

template <int MR, int NW>
inline void tile_rows(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* w, float* out, int64_t ldo) {
  __m512 acc[NW][MR];
  for (int c = 0; c < NW; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    if constexpr (NW == 1) _mm_prefetch(reinterpret_cast<const char*>(w + kNtaAhead * k + i), _MM_HINT_NTA);
    __m512bh wv[NW];
    for (int c = 0; c < NW; ++c) {
      if constexpr (NW > 1) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (KVB_NK_AHEAD_L2 + c) * k + i), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + (kL1Ahead + c) * k + i), _MM_HINT_T0);
      }
      wv[c] = (__m512bh)_mm512_loadu_si512(w + c * k + i);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + i);
      for (int c = 0; c < NW; ++c) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], xv, wv[c]);
    }
  }
  for (int c = 0; c < NW; ++c)
    for (int r = 0; r < MR; ++r) out[r * ldo + c] = tree(acc[c][r]);
}

// A pass of one weight row, out of line: inlined into bf16_rows beside the pair passes, GCC 12 ran short of registers
// at 9 rows (the row pointers reloaded from the stack and each weight vector bounced through it, every step), and
// the head's 9 rows took 10.8 ms in one-row passes against 9.2 in pairs (the same process); out of line, 6.8-7.1.
template <int MR>
__attribute__((noinline)) void one_row_pass(const uint16_t* x, int64_t k, const uint16_t* w, float* out, int64_t ldo) {
  tile_rows<MR, 1>(x, k, k, w, out, ldo);
}

template <int NW>
inline void rows_pass(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, float* out, int64_t ldo) {
  with_rows<1, 9>(rows, [&](auto r) {
    if constexpr (NW == 1)
      one_row_pass<decltype(r)::value>(x, k, w, out, ldo);
    else
      tile_rows<decltype(r)::value, NW>(x, k, k, w, out, ldo);
  });
}

}  // namespace

void bf16_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n0, int64_t n1, float* out,
               uint16_t* rounded, int64_t ldo, bool one_row_passes) {
  float chunk[9 * 32];  // with `rounded`: a pass's sums, rounded into it once its 32 columns are done
  for (int64_t c0 = n0; c0 < n1; c0 += 32) {
    const int64_t c1 = c0 + 32 < n1 ? c0 + 32 : n1;
    for (int64_t r0 = 0; r0 < m; r0 += 9) {
      const int64_t rows = m - r0 < 9 ? m - r0 : 9;
      const uint16_t* xr = x + r0 * k;
      float* o = rounded != nullptr ? chunk : out + r0 * ldo + c0;  // column n at o[n - c0]
      const int64_t ld = rounded != nullptr ? 32 : ldo;
      int64_t n = c0;
      if (rows >= kPairRows && !one_row_passes)
        for (; n + 2 <= c1; n += 2) rows_pass<2>(xr, rows, k, w + n * k, o + (n - c0), ld);
      for (; n < c1; ++n) rows_pass<1>(xr, rows, k, w + n * k, o + (n - c0), ld);
      if (rounded != nullptr)
        for (int64_t r = 0; r < rows; ++r)
          kvb_avx512::round_to_bf16(chunk + r * 32, c1 - c0, rounded + (r0 + r) * ldo + c0);
    }
  }
}

namespace {

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
