// The AVX-512 BF16 path's row-major bf16 GEMM (vdpbf16ps), bf16 activations: an int4 model's tied LM head (ops.cpp,
// the bf16 weight in nn.Linear's own [N, K] layout). Compiled for AVX-512 BF16, called only when the CPU has it; the
// int4 kernels of this path are in gemm_avx512bf16.cpp.
#include "kvboost_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

#include <type_traits>

namespace kvb_avx512bf16 {
namespace {

#include "with_rows.inc"

// Row-major bf16 weights with bf16 activations (an int4 model's tied head): lane j of the chunk c
// accumulates k = 32c + 2j + 1 then 32c + 2j (one vdpbf16ps), chunks in order; then the fp32 paths'
// fixed tree over the 16 lanes. Up to kPassRows rows per pass (a verification's 9); from kPairRows rows on, two
// weight rows per pass over x interleaved (each x load then feeds two vdpbf16ps: a pass of one is bound by its loads).
// The weights stream from DRAM; a pass of two weight rows computes long enough per weight row that
// the hardware prefetcher falls behind, so it prefetches them KVB_NK_AHEAD_L2 rows ahead into L2 and
// KVB_NK_AHEAD_L1 into L1 (one-weight-row passes, 1-3 rows, are at the bandwidth limit and measured
// slower with it). Measured on the 262k x 640 head (2 threads, ~11 ms for one row): 9 rows 25 -> 12.7
// ms, 4 rows 14.3 -> 11.4 ms (Zen 4); with x interleaved (pair_tile), alternated in one process on a Zen 4 (family
// 25 model 17): 9 rows 17.2 -> 12.9 ms, 4 rows 9.6 -> 8.2 from DRAM. Without interleaved x (the caller's choice by
// host, ops.cpp) every pass takes one weight row: on Zen 5, whose 512-bit loads and vdpbf16ps run at full width, such
// passes with their non-temporal prefetch read the head at the one-row speed up to 9 rows while memory is slow, where
// the pairs' two prefetches into L2 and L1 fall behind. Alternated in one process against the pairs as they were before
// x was interleaved (9 rounds, one row 6.7 ms):
// 4 rows 8.89 -> 6.67 ms, 6 rows 8.25 -> 6.69, 9 rows 8.62 -> 6.84. In a spell of faster memory (one row 4.2 ms)
// 4 and 6 rows still gained 1.31x / 1.16x, but 9 rows lost (5.35 -> 5.76 ms: there the extra activation loads
// bound the passes). From 12 rows (two passes over each chunk) the pairs stay ahead: 12 rows 0.97x, 17 rows 0.95x.
constexpr int kPairRows = KVB_HEAD_PAIR_ROWS;
constexpr int64_t kPassRows = KVB_HEAD_PASS_ROWS;
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

// One weight row over MR rows of x (row stride k), out of line: inlined into bf16_rows beside the pair passes, GCC 12
// ran short of registers at 9 rows (the row pointers reloaded from the stack and each weight vector bounced through
// it, every step), and the head's 9 rows took 10.8 ms in one-row passes against 9.2 in pairs (the same process); out
// of line, 6.8-7.1.
template <int MR>
__attribute__((noinline)) void one_row_pass(const uint16_t* x, int64_t k, const uint16_t* w, float* out, int64_t ldo) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kNtaAhead * k + i), _MM_HINT_NTA);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * k + i), wv);
  }
  for (int r = 0; r < MR; ++r) out[r * ldo] = tree(acc[r]);
}

// NW weight rows over MR rows of x interleaved (kvb_interleave_rows: each 32-element chunk's MR rows side by side), so
// that one pointer reaches every row's activations at a fixed offset. With a pointer per row (x's own layout), GCC 12
// ran out of registers at 9 rows and two weight rows: it reloaded row pointers from the stack and bounced three
// activation vectors through one stack slot every chunk (a 512-bit store and load each), and the 262k x 640 head at 9
// rows ran at 95 GMAC/s in cache on two Zen 4 threads (vdpbf16ps alone: 230). The same operations in the same order
// either way.
template <int MR, int NW>
inline void pair_tile(const uint16_t* xi, int64_t k, const uint16_t* w, float* out, int64_t ldo) {
  __m512 acc[NW][MR];
  for (int c = 0; c < NW; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32, xi += 32 * MR) {
    __m512bh wv[NW];
    for (int c = 0; c < NW; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (KVB_NK_AHEAD_L2 + c) * k + i), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kL1Ahead + c) * k + i), _MM_HINT_T0);
      wv[c] = (__m512bh)_mm512_loadu_si512(w + c * k + i);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xi + 32 * r);
      for (int c = 0; c < NW; ++c) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], xv, wv[c]);
    }
  }
  for (int c = 0; c < NW; ++c)
    for (int r = 0; r < MR; ++r) out[r * ldo + c] = tree(acc[c][r]);
}

}  // namespace

void bf16_rows(const uint16_t* x, const uint16_t* xi, int64_t m, int64_t k, const uint16_t* w, int64_t n0, int64_t n1,
               float* out, uint16_t* rounded, int64_t ldo) {
  float chunk[kPassRows * 32];  // with `rounded`: a pass's sums, rounded into it once its 32 columns are done
  for (int64_t c0 = n0; c0 < n1; c0 += 32) {
    const int64_t c1 = c0 + 32 < n1 ? c0 + 32 : n1;
    for (int64_t r0 = 0; r0 < m; r0 += kPassRows) {
      const int64_t rows = m - r0 < kPassRows ? m - r0 : kPassRows;
      const uint16_t* xr = x + r0 * k;
      float* o = rounded != nullptr ? chunk : out + r0 * ldo + c0;  // column n at o[n - c0]
      const int64_t ld = rounded != nullptr ? 32 : ldo;
      int64_t n = c0;
      if (rows >= kPairRows && xi != nullptr)
        for (; n + 2 <= c1; n += 2)
          with_rows<kPairRows, kPassRows>(rows, [&](auto r) {
            pair_tile<decltype(r)::value, 2>(xi + r0 * k, k, w + n * k, o + (n - c0), ld);
          });
      for (; n < c1; ++n)
        with_rows<1, kPassRows>(rows, [&](auto r) {
          one_row_pass<decltype(r)::value>(xr, k, w + n * k, o + (n - c0), ld);
        });
      if (rounded != nullptr)
        for (int64_t r = 0; r < rows; ++r)
          kvb_avx512::round_to_bf16(chunk + r * 32, c1 - c0, rounded + (r0 + r) * ldo + c0);
    }
  }
}

}  // namespace kvb_avx512bf16
