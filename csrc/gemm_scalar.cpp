// The portable path: plain C++ with std::fma, for hosts without AVX2 and as the reference that the
// vector paths must equal bit for bit (tests/kernels).
#include <cmath>

#include "kvboost_kernels.h"

namespace kvb_scalar {
namespace {

constexpr int64_t kRowTile = KVB_MIN_ROW_TILE;
constexpr int64_t kNkRowTile = kRowTile;
constexpr bool kKvbWide = false;  // no vector registers
constexpr int64_t kNkPairRows = 0;  // one weight row per pass
constexpr int kNkPrefetchBelow = 6;
constexpr int kSmallBlocks = 1;

struct V16 {
  float v[16];
  static inline V16 zero() {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = 0.0f;
    return r;
  }
  static inline V16 load(const float* p) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = p[j];
    return r;
  }
  static inline V16 set1(float a) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = a;
    return r;
  }
  // The codes (0..15, as floats) of rows k and k + 1 of a block: byte j holds column j of row k (low
  // nibble) and of row k + 1 (high).
  static inline void int4_codes(const uint8_t* p, V16& c0, V16& c1) {
    for (int j = 0; j < 16; ++j) {
      c0.v[j] = static_cast<float>(p[j] & 0x0F);
      c1.v[j] = static_cast<float>(p[j] >> 4);
    }
  }
  static inline V16 i8(const int8_t* p) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = static_cast<float>(p[j]);
    return r;
  }
  static inline V16 bf16(const uint16_t* p) {
    V16 r;
    for (int j = 0; j < 16; ++j) {
      const uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
      float f;
      __builtin_memcpy(&f, &bits, sizeof f);
      r.v[j] = f;
    }
    return r;
  }
  static inline V16 fma(float a, const V16& w, const V16& acc) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = std::fma(a, w.v[j], acc.v[j]);
    return r;
  }
  static inline V16 weights(const float* p) { return load(p); }
  static inline V16 weights(const Bf16* p) { return bf16(reinterpret_cast<const uint16_t*>(p)); }
  static inline V16 fmav(const V16& a, const V16& w, const V16& acc) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = std::fma(a.v[j], w.v[j], acc.v[j]);
    return r;
  }
  // The fixed tree: lanes j + j+8, then j + j+4, then j + j+2, then 0 + 1.
  inline float sum() const {
    float t[8];
    for (int j = 0; j < 8; ++j) t[j] = v[j] + v[j + 8];
    for (int j = 0; j < 4; ++j) t[j] = t[j] + t[j + 4];
    for (int j = 0; j < 2; ++j) t[j] = t[j] + t[j + 2];
    return t[0] + t[1];
  }
  static inline V16 mul(const V16& a, const V16& b) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = a.v[j] * b.v[j];
    return r;
  }
  static inline V16 add(const V16& a, const V16& b) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = a.v[j] + b.v[j];
    return r;
  }
  static inline V16 sub(const V16& a, const V16& b) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = a.v[j] - b.v[j];
    return r;
  }
  inline void store(float* p) const {
    for (int j = 0; j < 16; ++j) p[j] = v[j];
  }
  // The softmax's lane operations (attention_body.inc), as its vector paths compute them.
  static inline V16 max(const V16& a, const V16& b) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = a.v[j] > b.v[j] ? a.v[j] : b.v[j];
    return r;
  }
  inline float max_lane() const {
    float m = v[0];
    for (int j = 1; j < 16; ++j) m = v[j] > m ? v[j] : m;
    return m;
  }
  inline bool any_nan() const {
    bool nan = false;
    for (int j = 0; j < 16; ++j) nan = nan || v[j] != v[j];
    return nan;
  }
  // 2^n for integral n in [-126, 127]: (n + 127) << 23 as float bits (lanes outside: any value, never UB)
  static inline V16 pow2(const V16& n) {
    V16 r;
    for (int j = 0; j < 16; ++j) {
      const float c = n.v[j] >= -126.0f && n.v[j] <= 127.0f ? n.v[j] : 0.0f;
      const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(c) + 127) << 23;
      __builtin_memcpy(&r.v[j], &bits, sizeof bits);
    }
    return r;
  }
  // y where x >= bound, else 0 (x NaN: 0)
  static inline V16 where_at_least(const V16& x, float bound, const V16& y) {
    V16 r;
    for (int j = 0; j < 16; ++j) r.v[j] = x.v[j] >= bound ? y.v[j] : 0.0f;
    return r;
  }
};

}  // namespace

#include "gemm_body.inc"
#include "attention_body.inc"
#include "norm_body.inc"

}  // namespace kvb_scalar
