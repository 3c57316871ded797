#pragma once
#include <cstdint>
#include <cstring>

// Weight-only GEMM kernels for the models kvboost_hf owns: out[m, n] = sum_k x[m, k] * w[k, n].
//
// One contract for every ISA path (scalar, AVX2, AVX-512): each output element is accumulated in
// fp32 as acc = fma(x[m, k], w[k, n], acc) for k = 0, 1, ..., K-1, starting from 0, and nothing else
// (int8 then multiplies by the column's scale; int4: below). The order depends neither on how many rows
// are computed together nor on the thread count (threads split output columns), so a row's result is
// bit-identical for every M; and as fma is exactly rounded, every ISA path gives the same bits.
// int4 applies its scale and zero once per group g (G rows of k) instead of per weight:
//   t = fma chain of x[m, k] * q[k, n] over the group's k in order, from 0 (q the code, exact as a float);
//   acc = acc + s[g, n] * (t - z[g, n] * xs[m, g])   (each operation rounded; acc from 0, groups in order)
// where xs[m, g] = x[m, g0] + x[m, g0 + 1] + ... in order from 0 (kvb_group_sums, one function for every
// path). That is (q - z) * s summed, with ~7 vector ops per 16 weights instead of ~11 (AVX2, one row).
// Version 1 decoded each weight as (q - z) * s into one fma chain over K. The version is part of the store
// namespace (kernels.int4_numerics(), from the op int4_numerics_version): change it with the bits.
constexpr int64_t KVB_INT4_NUMERICS_VERSION = 2;
// Weight layouts: output columns in blocks of 16, block b holding columns 16b..16b+15, K rows each.
//   int4:  uint8 [NB, K, 8] (K even): the 16 bytes of rows 2p and 2p+1 hold, in byte j, column j
//          of row 2p (low nibble) and column j of row 2p+1 (high nibble);
//          scales, zeros float [NB, K/G, 16] (G even); w = (q - zero) * scale.
//   int8:  int8  [NB, K, 16]; per-column float scale [NB * 16], applied once after the sum.
//   bf16:  uint16 [NB, K, 16] (bf16 bits); fp32: float [NB, K, 16].
//   row-major (nn.Linear's [N, K], bf16 or fp32, K a multiple of 16): a second order, for weights we
//   do not repack (a tied LM head): 16 interleaved partial sums over k, then a fixed tree (gemm_body.inc).
// Activations x: float [M, K] contiguous. Output: float [M, ldo], block b at columns 16b.
// This header is plain C++ (no torch), shared by the per-ISA translation units.
struct Bf16 {  // the bits of one bfloat16 (tags a row-major bf16 weight for the kernels' overloads)
  uint16_t bits;
};

// One attention call (attention_body.inc): queries [batch, heads, rows, dim], keys and values
// [batch, kv_heads, keys, dim] (heads a multiple of kv_heads), all float or all bf16 bits, the last
// dimension contiguous (strides in elements for the others). Row i sits at position keys - rows + i:
// with `causal` it reads keys up to that position, with window > 0 only the last `window` of them;
// a mask (bool bytes, or float values added to the scores; strides, 0 to broadcast) removes more.
// Output: float [batch, rows, heads, dim]. Work items t = ((b * kv_heads + g) * rows + i) * parts + part: row i
// of the `heads_per_item` query heads from g * group + part * heads_per_item (group = heads / kv_heads, parts =
// ceil(group / heads_per_item)), which read each key and value row once for all of them; a head's result is the
// same whichever heads share its item.
struct KvbAttention {
  const void* q;
  const void* k;
  const void* v;
  bool bf16;
  int64_t batch, heads, kv_heads, rows, keys, dim;
  int64_t q_strides[3], k_strides[3], v_strides[3];
  const uint8_t* bool_mask;
  const float* float_mask;
  int64_t m_strides[4];
  float scale;
  bool causal;
  int64_t window;
  float* out;
  int64_t heads_per_item;  // 1 .. KVB_MAX_HEADS_PER_ITEM
};

constexpr int64_t KVB_MAX_HEADS_PER_ITEM = 8;

// Floats of scratch one thread of an attention call needs: per head of an item, the query and the output
// accumulator, each padded to whole 16-lane vectors; a 16-float tail buffer; per head, one score per key
// (attention_body.inc carves it in that order). Static: every translation unit has its own copy.
static inline int64_t kvb_attention_scratch(int64_t dim, int64_t keys, int64_t heads_per_item) {
  return heads_per_item * (2 * ((dim + 15) / 16 * 16) + keys) + 16;
}

#define KVB_DECLARE_ISA(ns)                                                                          \
  namespace ns {                                                                                     \
  void int4_blocks(const float* x, int64_t m, int64_t k, const uint8_t* q, const float* scales,      \
                   const float* zeros, int64_t group, const float* xs, int64_t b0, int64_t b1,       \
                   float* out, int64_t ldo, float* strip);                                           \
  void int8_blocks(const float* x, int64_t m, int64_t k, const int8_t* q, const float* scales,       \
                   int64_t b0, int64_t b1, float* out, int64_t ldo);                                 \
  void bf16_blocks(const float* x, int64_t m, int64_t k, const uint16_t* w, int64_t b0, int64_t b1,  \
                   float* out, int64_t ldo);                                                         \
  void f32_blocks(const float* x, int64_t m, int64_t k, const float* w, int64_t b0, int64_t b1,      \
                  float* out, int64_t ldo);                                                          \
  void bf16_rows(const float* x, int64_t m, int64_t k, const uint16_t* w, int64_t n0, int64_t n1,    \
                 float* out, int64_t ldo);                                                           \
  void f32_rows(const float* x, int64_t m, int64_t k, const float* w, int64_t n0, int64_t n1,        \
                float* out, int64_t ldo);                                                            \
  void attention_rows(const KvbAttention& a, int64_t t0, int64_t t1, float* scratch);                \
  void rms_rows(const void* x, bool bf16, int64_t ldx, int64_t n, const float* scale, float eps,      \
                int64_t r0, int64_t r1, float* out);                                                 \
  }

KVB_DECLARE_ISA(kvb_scalar)
KVB_DECLARE_ISA(kvb_avx2)
KVB_DECLARE_ISA(kvb_avx512)

// The AVX-512 BF16 path: bf16 activations (bits as uint16), its own numerics (int4: gemm_avx512bf16.cpp; the
// row-major head: head_avx512bf16.cpp);
// `strip` holds strip_words(m, k, vbmi) uint32 (four blocks' K x 16 codes as bf16 pairs, or none where
// the rows are few enough to decode the codes in registers).
namespace kvb_avx512bf16 {
// `vbmi`: decode the int4 codes with AVX-512 VBMI (only where the CPU has it and the group size is a multiple of
// 8; decided once per call by the caller and passed to both functions): the two decodings give the same bits.
int64_t strip_words(int64_t m, int64_t k, bool vbmi);
// xs: per row and group, the pair sum of x (group_sums), computed once per call.
void group_sums(const uint16_t* x, int64_t m, int64_t k, int64_t group, float* xs);
void int4_blocks(const uint16_t* x, int64_t m, int64_t k, const uint8_t* q, const float* scales, const float* zeros,
                 int64_t group, const float* xs, int64_t b0, int64_t b1, float* out, int64_t ldo, uint32_t* strip,
                 bool vbmi);
// Row-major bf16 weight [N, K] (K a multiple of 32) with bf16 activations (head_avx512bf16.cpp): 16 lanes of k-pairs, then
// the fixed tree. With `rounded` the results go to it as bf16 (rounded as .to(bfloat16) rounds, NaN as 0x7FC0;
// `out` unused), else to `out` as float. `xi`: x as kvb_interleave_rows lays it out in blocks of KVB_HEAD_PASS_ROWS,
// for passes over two weight rows from KVB_HEAD_PAIR_ROWS rows on; nullptr: one weight row a pass at every row count
// (the same bits).
void bf16_rows(const uint16_t* x, const uint16_t* xi, int64_t m, int64_t k, const uint16_t* w, int64_t n0,
               int64_t n1, float* out, uint16_t* rounded, int64_t ldo);
}

// The AMX path (gemm_amx.cpp): int4 weights with bf16 activations on tiles, group sizes a multiple of 32,
// numerics of its own; everything else as the AVX-512 BF16 path. `strip` holds strip_words(m, k, group) uint32
// (none for one row tile: its codes are decoded a group at a time into a buffer of its own).
namespace kvb_amx {
bool tiles_granted();  // the CPU has AMX-BF16 and Linux gave this process the tile state (asked once)
int64_t strip_words(int64_t m, int64_t k, int64_t group);
// A hash of the bits int4_blocks computes on fixed inputs that expose TDPBF16PS's rounding (0 without AMX):
// how it rounds is undocumented and may differ between CPU generations, so the store namespace names it.
int64_t fingerprint();
void int4_blocks(const uint16_t* x, int64_t m, int64_t k, const uint8_t* q, const float* scales, const float* zeros,
                 int64_t group, const float* xs, int64_t b0, int64_t b1, float* out, int64_t ldo, uint32_t* strip);
// A bf16 [N, K] weight in the tile layout (kernels.tile_layout: uint16 [NB, K / 32, 16, 16, 2], NB even, K a
// multiple of 32; element [b, c, p, j, e] is w[16 b + j, 32 c + 2 p + e]) against bf16 x [m, K]: out[m, 16 b ..]
// for the block pairs from b0 (even) to b1, each element one TDPBF16PS chain over K (its own numerics). `pad`
// holds 16 x K uint16 where m > 16 is not a multiple of 16 (its last rows, zero-padded), else may be null. With
// `rounded` the results go to it as bf16 (rounded as .to(bfloat16) rounds; `out` unused), else to `out` as float.
void bf16_tiles(const uint16_t* x, int64_t m, int64_t k, const uint16_t* tiles, int64_t b0, int64_t b1, float* out,
                uint16_t* rounded, int64_t ldo, uint16_t* pad);
}

// The layer ops' bf16 elementwise loops on AVX-512 (bf16_avx512.cpp), each result rounded to bf16 as
// c10::BFloat16 rounds (nearest even, NaN to 0x7FC0): the bits of their scalar loops.
namespace kvb_avx512 {
void round_to_bf16(const float* x, int64_t n, uint16_t* out);
void bf16_combine(const uint16_t* a, const uint16_t* b, int64_t n, bool product, uint16_t* out);  // a + b or a * b
// One row of transformers' RoPE on bf16 (dim even): x * cos + rotate_half(x) * sin, each product and the sum rounded.
void bf16_rope(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim, uint16_t* out);
}

// xs [m, K / group]: per row and group, the in-order sum of x over the group (the int4 contract above).
void kvb_group_sums(const float* x, int64_t m, int64_t k, int64_t group, float* xs);

// The int4 kernels decode a block's K x 16 codes into `strip` (K * 16 floats, from the caller)
// when the rows span more than one row tile; no path uses more rows per tile than this.
constexpr int64_t KVB_MAX_ROW_TILE = 8;
constexpr int64_t KVB_MIN_ROW_TILE = 4;

// Row-major weights stream from DRAM: the passes that prefetch them (gemm_body.inc's tile_nk,
// head_avx512bf16.cpp's pair_tile) fetch the weight row this many rows ahead into L2 and into L1.
constexpr int64_t KVB_NK_AHEAD_L2 = 16;
constexpr int64_t KVB_NK_AHEAD_L1 = 4;
// The avx512_bf16 row-major bf16 kernel (bf16_rows): up to this many rows a pass, and from this many over two weight
// rows at a time.
constexpr int64_t KVB_HEAD_PASS_ROWS = 9;
constexpr int64_t KVB_HEAD_PAIR_ROWS = 4;

// x's m rows (row_bytes each, a multiple of 64) into xi in blocks of `block` rows (the last may be fewer), each
// block's 64-byte chunks with the block's rows side by side: chunk c of row r0 + r at byte
// r0 * row_bytes + (c * rows + r) * 64. The row-major kernels' passes over two weight rows read x so
// (head_avx512bf16.cpp, gemm_body.inc): one pointer reaches every row's chunk, where a pointer per row ran GCC 12 out
// of registers at 9 rows.
inline void kvb_interleave_rows(const void* x, int64_t m, int64_t row_bytes, int64_t block, void* xi) {
  const auto* src = static_cast<const char*>(x);
  auto* dst = static_cast<char*>(xi);
  for (int64_t r0 = 0; r0 < m; r0 += block) {
    const int64_t rows = m - r0 < block ? m - r0 : block;
    for (int64_t c = 0; c < row_bytes / 64; ++c)
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(dst + r0 * row_bytes + (c * rows + r) * 64, src + (r0 + r) * row_bytes + c * 64, 64);
  }
}
