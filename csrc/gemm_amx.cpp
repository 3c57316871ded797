// AMX path (amx_bf16): int4 weights with bf16 activations on AMX tiles, with numerics of their own.
// Per output element, per group g in order:
//   t = the group's dot product of x with the codes q (0..15, exact in bf16) as TDPBF16PS computes it,
//       32 k per instruction, the group's instructions in order, from 0;
//   acc = acc + s * (t - z * xs[g])   (each operation rounded; xs the avx512_bf16 path's pair sums).
// TDPBF16PS does not round like a chain of fp32 fmas or like vdpbf16ps (measured on Sapphire Rapids: ~2% of
// sums differ from either), so this is a path of its own, used for every M: a tile of 1 to 16 rows computes
// each row with the same instructions on the same data, so rows are bit-independent here too. How it rounds
// is the hardware's, undocumented: the store namespace carries a fingerprint of it (amx_fingerprint).
// Groups must be multiples of 32 (one instruction's k): ops.cpp runs others on the avx512_bf16 path.
// Compiled for AMX, called only where the CPU has it (and VBMI, which the decoding uses) and Linux granted
// this process the tile state.
// Standard headers come before the target pragma: under it, GCC 13 compiled <vector>'s members with the AMX
// target and then refused to inline the always_inline allocator into them ("target specific option mismatch").
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "kvboost_kernels.h"

#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c")
#include <immintrin.h>

namespace kvb_amx {
namespace {

#include "int4_codes.inc"
#include "bf16_round.inc"

constexpr int kRows = 16;  // rows of an A and a C tile
constexpr int64_t kChunk = 32;  // k per TDPBF16PS
constexpr int64_t kMaxGroup = 256;  // groups up to this size are decoded one at a time for one row tile

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-1: C of two column blocks (rows x 16 fp32); 2: A (rows x 32 bf16); 3-4: B of the two blocks
// (16 k-pairs x 16 columns, the pair of a column in one dword: the strip's layout).
void configure(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 3; ++t) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;
  for (int t = 3; t < 5; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  // GCC 12 at -O3 may not see that ldtilecfg reads the whole struct and drop these stores (a variant of this
  // function, built with the kernels' flags in a harness, loaded a config of zero rows: SIGILL at the first
  // tile instruction); the empty asm that may read the struct keeps them.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

inline void close_rows(float* acc, const float* t, int rows, const float* s, const float* z, const float* xs,
                       int64_t groups) {
  const __m512 sv = _mm512_loadu_ps(s), zv = _mm512_loadu_ps(z);
  for (int r = 0; r < rows; ++r) {
    const __m512 u = _mm512_sub_ps(_mm512_loadu_ps(t + 16 * r), _mm512_mul_ps(zv, _mm512_set1_ps(xs[r * groups])));
    _mm512_storeu_ps(acc + 16 * r, _mm512_add_ps(_mm512_loadu_ps(acc + 16 * r), _mm512_mul_ps(sv, u)));
  }
}

// Rows [r0, r0 + rows) of k of a block's codes (rows a multiple of 8) into strip + 8 * r0 as bf16 pairs,
// decoded with VBMI as the avx512_bf16 path decodes for one or two rows (three instructions a pair). With `ahead`,
// each 64 bytes read also fetches the line `ahead` bytes on into L2, one prefetch per line decoded: issued all
// at once before the decoding (16 a block a group), they stalled on the core's fill buffers, and a one-row pass
// read from DRAM ~1.25x slower than the avx512_bf16 path (4096 x 640, 2 threads, weights cycling through 1 GB:
// 114 against 90 us; 90 us with the prefetches spread).
inline void decode_rows(const uint8_t* q, int64_t r0, int64_t rows, uint32_t* strip, int64_t ahead = 0) {
  static const VbmiCodes codes;
  const MultishiftCodes& shifted = multishift_codes();
  for (int64_t i = r0; i < r0 + rows; i += 8) {  // 64 bytes: 8 rows, 4 pairs
    if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(q + ahead + 8 * i), _MM_HINT_T1);
    const __m512i src = shifted.gathered(_mm512_loadu_si512(q + 8 * i));
    for (int c = 0; c < 4; ++c) _mm512_storeu_si512(strip + 8 * (i + 2 * c), shifted.pair(src, c, codes));
  }
}

// Rows [0, rows) of x against NB (1 or 2) blocks, into acc [NB][rows][16] (which holds the sum so far). The
// blocks' codes are in strips[] (every row tile of a call reads them), or, with NOW (one row tile), are
// decoded there a group at a time just before its instructions read them from L1: the same words. NOW also
// prefetches the same rows of the next pass's blocks (`next` bytes on) into L2 as it decodes: a block's K x 8
// bytes are too short a stream for the hardware prefetcher when a decode step reads the weights from DRAM.
template <int NB, bool NOW>
void row_tile(const uint16_t* x, int64_t k, int rows, const uint32_t* const* strips, const uint8_t* const* qb,
              int64_t next, const float* const* sb, const float* const* zb, int64_t group, const float* xs,
              int64_t groups, float* acc) {
  alignas(64) float t[NB][kRows * 16];
  alignas(64) uint32_t now[NOW ? NB : 1][NOW ? kMaxGroup * 8 : 16];  // a group's words, rows from g0
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    const uint32_t* words[NB];
    for (int b = 0; b < NB; ++b) words[b] = strips[b] + 8 * g0;
    if constexpr (NOW)
      for (int b = 0; b < NB; ++b) {
        decode_rows(qb[b] + 8 * g0, 0, group, now[b], next);
        words[b] = now[b];
      }
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    for (int64_t c = 0; c < group; c += kChunk) {
      _tile_loadd(2, x + g0 + c, k * 2);
      _tile_loadd(3, words[0] + 8 * c, 64);
      _tile_dpbf16ps(0, 2, 3);
      if constexpr (NB > 1) {
        _tile_loadd(4, words[NB - 1] + 8 * c, 64);
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    _tile_stored(0, t[0], 64);
    if (NB > 1) _tile_stored(1, t[NB - 1], 64);
    for (int b = 0; b < NB; ++b)
      close_rows(acc + b * kRows * 16, t[b], rows, sb[b] + 16 * gi, zb[b] + 16 * gi, xs + gi, groups);
  }
}

}  // namespace

bool tiles_granted() {
  static const bool granted = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512vbmi"))  // every AMX CPU so far has it; the decoding needs it
      return false;
    // Linux hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return granted;
}

int64_t fingerprint() {
  if (!tiles_granted()) return 0;
  // 16 rows x 32 columns over K = 512 in one group, scale 1 and zero 0 (so the outputs are the sums t), of
  // activations spread over 2^-20 .. 2^20 with both signs: sums whose rounding shows how the instructions
  // round and in what order they add. FNV-1a over the float bits.
  constexpr int64_t m = 16, k = 512, blocks = 2;
  std::vector<uint16_t> x(m * k);
  std::vector<uint8_t> q(blocks * k * 8);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&state] { return (state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
  for (uint16_t& v : x) {
    const uint64_t r = next();
    v = static_cast<uint16_t>(((r & 1) << 15) | ((127 - 20 + (r >> 1) % 41) << 7) | ((r >> 8) & 0x7F));
  }
  for (uint8_t& b : q) b = static_cast<uint8_t>(next());
  std::vector<float> scales(blocks * 16, 1.0f), zeros(blocks * 16, 0.0f), xs(m, 0.0f), out(m * blocks * 16);
  std::vector<uint32_t> strip(strip_words(m, k, k));
  int4_blocks(x.data(), m, k, q.data(), scales.data(), zeros.data(), k, xs.data(), 0, blocks, out.data(),
              blocks * 16, strip.data());
  uint64_t hash = 0xCBF29CE484222325ull;
  for (float f : out) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    for (int i = 0; i < 4; ++i) hash = (hash ^ ((bits >> (8 * i)) & 0xFF)) * 0x100000001B3ull;
  }
  return static_cast<int64_t>(hash >> 1);  // a non-negative int64
}

int64_t strip_words(int64_t m, int64_t k, int64_t group) { return m > kRows || group > kMaxGroup ? 2 * k * 8 : 0; }

void int4_blocks(const uint16_t* x, int64_t m, int64_t k, const uint8_t* q, const float* scales, const float* zeros,
                 int64_t group, const float* xs, int64_t b0, int64_t b1, float* out, int64_t ldo, uint32_t* strip) {
  if (m <= 0 || b0 >= b1) return;
  const int64_t groups = k / group, qstride = k * 8, sstride = groups * 16;
  const bool now = m <= kRows && group <= kMaxGroup;  // one row tile: a group's codes decoded as it is used
  alignas(64) float acc[2 * kRows * 16];
  int configured = 0;
  for (int64_t b = b0; b < b1; b += 2) {
    const int nb = b + 1 < b1 ? 2 : 1;
    uint32_t* strips[2] = {strip, strip + k * 8};  // unused (none given) where `now`
    const uint8_t* qb[2] = {q + b * qstride, q + (b + nb - 1) * qstride};
    const float *sb[2], *zb[2];
    for (int i = 0; i < nb; ++i) {
      if (!now) decode_rows(qb[i], 0, k, strips[i]);
      sb[i] = scales + (b + i) * sstride;
      zb[i] = zeros + (b + i) * sstride;
    }
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int rows = static_cast<int>(m - r0 < kRows ? m - r0 : kRows);
      if (rows != configured) configure(configured = rows);
      std::memset(acc, 0, sizeof acc);
      const uint16_t* xr = x + r0 * k;
      const float* xsr = xs + r0 * groups;
      if (now && nb == 2)
        row_tile<2, true>(xr, k, rows, strips, qb, 2 * qstride, sb, zb, group, xsr, groups, acc);
      else if (now)
        row_tile<1, true>(xr, k, rows, strips, qb, 2 * qstride, sb, zb, group, xsr, groups, acc);
      else if (nb == 2)
        row_tile<2, false>(xr, k, rows, strips, qb, 2 * qstride, sb, zb, group, xsr, groups, acc);
      else
        row_tile<1, false>(xr, k, rows, strips, qb, 2 * qstride, sb, zb, group, xsr, groups, acc);
      for (int i = 0; i < nb; ++i)
        for (int r = 0; r < rows; ++r)
          std::memcpy(out + (r0 + r) * ldo + 16 * (b + i), acc + (i * kRows + r) * 16, 16 * sizeof(float));
    }
  }
  _tile_release();
}

// The head (a bf16 [N, K] weight repacked by kernels.tile_layout): x's rows as A tiles, the weight as B tiles read
// in address order (a plain stream for the hardware prefetcher, unlike the weight's own rows as A tiles: 16 rows
// read 64 bytes at a time in turn made a decode step's head slower than vdpbf16ps). Per output element: one
// TDPBF16PS chain over K, 32 k per instruction in order, from 0. Rows past the first 16 are computed 16 at a time
// (the last tile zero-padded), each block pair's 40 KB read from DRAM once for all of them.
//
// With `rounded` (a bf16 model's head), each tile pair goes through a 2 KB buffer and is rounded into it: torch's cast
// after a float output wrote 4 bytes an element to memory and read them back (a 9-row forward's 262k-column head: 9.4
// MB each way, ~0.75 ms of the cast alone).
void bf16_tiles(const uint16_t* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t b0, int64_t b1, float* out,
                uint16_t* rounded, int64_t ldo, uint16_t* pad) {
  if (m <= 0 || b0 >= b1) return;
  const int64_t chunks = k / kChunk, bstride = k * 16;  // a block: chunks x 16 k-pairs x 16 columns x 2
  const int rows = static_cast<int>(m < kRows ? m : kRows);
  configure(rows);
  const int64_t tail = m > kRows ? m % kRows : 0;  // the last row tile's rows, zero-padded to 16 in `pad`
  if (tail) {
    std::memset(pad, 0, kRows * k * sizeof(uint16_t));
    std::memcpy(pad, x + (m - tail) * k, tail * k * sizeof(uint16_t));
  }
  alignas(64) float t[2][kRows * 16];
  for (int64_t b = b0; b < b1; b += 2) {
    const uint16_t* w0 = tiles + b * bstride;
    const uint16_t* w1 = w0 + bstride;
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const bool padded = tail && r0 + kRows > m;
      const uint16_t* xr = padded ? pad : x + r0 * k;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(2, xr + kChunk * c, k * 2);
        _tile_loadd(3, w0 + 512 * c, 64);
        _tile_loadd(4, w1 + 512 * c, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      if (rounded == nullptr && !padded) {
        float* o = out + r0 * ldo + 16 * b;
        _tile_stored(0, o, ldo * 4);
        _tile_stored(1, o + 16, ldo * 4);
        continue;
      }
      _tile_stored(0, t[0], 64);
      _tile_stored(1, t[1], 64);
      const int64_t live = padded ? tail : rows;
      for (int64_t r = 0; r < live; ++r)
        for (int h = 0; h < 2; ++h) {
          const int64_t at = (r0 + r) * ldo + 16 * (b + h);
          if (rounded != nullptr)  // (inline: a call per 16 sums cost ~0.3 ms of a 9-row head)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + at), round_bf16(_mm512_load_ps(t[h] + 16 * r)));
          else
            std::memcpy(out + at, t[h] + 16 * r, 16 * sizeof(float));
        }
    }
  }
  _tile_release();
}

}  // namespace kvb_amx
