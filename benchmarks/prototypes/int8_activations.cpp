// Prototype, timing only (not wired into the package): int4 weights times int8 activations on AVX2 with
// vpmaddubsw, against the float int4 kernel (csrc/gemm_avx2.cpp's int4_blocks), over Gemma-3-270M's 72 int4
// linears as a decode step reads them (56 MB, from DRAM), on 1 and 2 OpenMP threads, interleaved, medians of 15.
// A measured basis for an int8-activation numerics mode (docs/kernels.md), which would need its own layout, a
// scalar and AVX-512 (VNNI) path of the same bits, and quality figures against float activations.
//
//   g++ -std=c++17 -O3 -fno-tree-vectorize -fopenmp -ffp-contract=off -fno-math-errno -Icsrc \
//       benchmarks/prototypes/int8_activations.cpp -o /tmp/int8_activations && /tmp/int8_activations 1   # rows
//
// Its layout: blocks of 8 output columns, K/8 steps of 32 bytes each: byte 4c + j of step p holds column c's code
// of k = 8p + j (low nibble) and of k = 8p + 4 + j (high). x is quantized per row and group (absmax / 127), and a
// group closes as acc + s * dx * (sum q xq - z * sum xq). The first lines check it against scalar loops over the
// same layout. AMD EPYC Zen 3 VM, 2026-11-29 16:05-16:11 UTC: one row 1.20-1.34x, nine rows 1.52-1.71x.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gemm_avx2.cpp"
// weights: [NB8 blocks of 8 columns][K/8 steps][32 bytes]: byte 4c+j of step p: column c, low nibble k=8p+j, high
// k=8p+4+j x: int8 [M][K], per row and group: scale dx (float) and xsum (int)
template <int MR>
static inline void tile_i8(const int8_t* x, int64_t ldx, int64_t k, const uint8_t* q, const float* s, const float* z,
                           int64_t group, const float* dx, const int32_t* xsum, float* out, int64_t ldo) {
  const int64_t groups = k / group;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i a32[MR];
    for (int r = 0; r < MR; ++r) a32[r] = _mm256_setzero_si256();
    for (int64_t p0 = g * group / 8; p0 < (g + 1) * group / 8; p0 += 4) {
      __m256i a16[MR];
      for (int r = 0; r < MR; ++r) a16[r] = _mm256_setzero_si256();
      for (int64_t p = p0; p < p0 + 4; ++p) {
        if (p % 2 == 0) __builtin_prefetch(q + 32 * p + 1024);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int r = 0; r < MR; ++r) {
          int32_t b0, b1;
          std::memcpy(&b0, x + r * ldx + 8 * p, 4);
          std::memcpy(&b1, x + r * ldx + 8 * p + 4, 4);
          a16[r] = _mm256_add_epi16(a16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(b0)));
          a16[r] = _mm256_add_epi16(a16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b1)));
        }
      }
      for (int r = 0; r < MR; ++r) a32[r] = _mm256_add_epi32(a32[r], _mm256_madd_epi16(a16[r], ones));
    }
    const __m256 sv = _mm256_loadu_ps(s + 8 * g), zv = _mm256_loadu_ps(z + 8 * g);
    for (int r = 0; r < MR; ++r) {
      const __m256 t =
          _mm256_sub_ps(_mm256_cvtepi32_ps(a32[r]), _mm256_mul_ps(zv, _mm256_set1_ps(float(xsum[r * groups + g]))));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_set1_ps(dx[r * groups + g])), t, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
static void quantize(const float* x, int64_t m, int64_t k, int64_t group, int8_t* xq, float* dx, int32_t* xsum) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      float amax = 0;
      for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[r * k + g * group + i]));
      const float d = amax / 127.f, inv = d > 0 ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < group; ++i) {
        int v = (int)std::lrintf(x[r * k + g * group + i] * inv);
        xq[r * k + g * group + i] = (int8_t)v;
        sum += v;
      }
      dx[r * (k / group) + g] = d;
      xsum[r * (k / group) + g] = sum;
    }
}
struct L {
  int64_t n, k;
  uint8_t* q;
  float* s;
  float* z;
  uint8_t* q8;
  float* s8;
  float* z8;
};
template <class F>
void chunks(int64_t n, int64_t chunk, const F& f) {
  std::atomic<int64_t> next{0};
#pragma omp parallel
  for (int64_t c; (c = next.fetch_add(1)) * chunk < n;) f(c * chunk, std::min(n, (c + 1) * chunk));
}
int main(int argc, char** argv) {
  const int64_t m = atoi(argv[1]), group = 128;
  const int rounds = 15;
  std::vector<L> ls;
  int64_t shapes[4][2] = {{1536, 640}, {640, 1024}, {4096, 640}, {640, 2048}};
  srand(1);
  for (int l = 0; l < 18; ++l)
    for (auto& sh : shapes) {
      L w{sh[0], sh[1]};
      int64_t nb = w.n / 16, g = w.k / group;
      w.q = (uint8_t*)aligned_alloc(64, nb * w.k * 8);
      w.s = (float*)aligned_alloc(64, nb * g * 64);
      w.z = (float*)aligned_alloc(64, nb * g * 64);
      w.q8 = (uint8_t*)aligned_alloc(64, nb * w.k * 8);
      w.s8 = (float*)aligned_alloc(64, nb * g * 64);
      w.z8 = (float*)aligned_alloc(64, nb * g * 64);
      for (int64_t i = 0; i < nb * w.k * 8; ++i) w.q[i] = w.q8[i] = rand();
      for (int64_t i = 0; i < nb * g * 16; ++i)
        w.s[i] = w.s8[i] = 0.001f * (1 + rand() % 9), w.z[i] = w.z8[i] = rand() % 16;
      ls.push_back(w);
    }
  float* x = (float*)aligned_alloc(64, m * 2048 * 4);
  for (int64_t i = 0; i < m * 2048; ++i) x[i] = (rand() % 2001 - 1000) / 700.f;
  std::vector<float> out(m * 4096 + 64), xs(m * 16, 1.f);
  {  // check the prototype on the first linear, row 0, against scalar loops over the same layout
    const L& w = ls[0];
    const int64_t g = w.k / group, nb8 = w.n / 8;
    std::vector<int8_t> xq(m * w.k);
    std::vector<float> dx(m * g);
    std::vector<int32_t> xsum(m * g), xk(0);
    std::vector<float> xf(m * w.k);
    for (int64_t r = 0; r < m; ++r) std::memcpy(&xf[r * w.k], x + r * 2048, w.k * 4);
    quantize(xf.data(), m, w.k, group, xq.data(), dx.data(), xsum.data());
    std::vector<float> o(m * w.n);
    for (int64_t b = 0; b < nb8; ++b)
      tile_i8<1>(xq.data(), w.k, w.k, w.q8 + b * w.k * 4, w.s8 + b * g * 8, w.z8 + b * g * 8, group, dx.data(),
                 xsum.data(), o.data() + 8 * b, w.n);
    double worst = 0;
    for (int64_t c = 0; c < w.n; ++c) {
      const int64_t b = c / 8, cc = c % 8;
      double want = 0;
      for (int64_t gg = 0; gg < g; ++gg) {
        long isum = 0;
        for (int64_t kk = gg * group; kk < (gg + 1) * group; ++kk) {
          const int64_t p = kk / 8, j = kk % 8;
          const uint8_t byte = w.q8[b * w.k * 4 + 32 * p + 4 * cc + (j % 4)];
          const int code = j < 4 ? (byte & 15) : (byte >> 4);
          isum += code * xq[kk];
        }
        want +=
            (double)w.s8[b * g * 8 + 8 * gg + cc] * dx[gg] * (isum - (double)w.z8[b * g * 8 + 8 * gg + cc] * xsum[gg]);
      }
      worst = std::max(worst, std::fabs(want - o[c]) / (std::fabs(want) + 1e-3));
    }
    std::printf("prototype check: worst relative error %.2e over %ld columns\n", worst, (long)w.n);
  }
  std::vector<double> t[2];
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    t[0].clear();
    t[1].clear();
    for (int round = 0; round < rounds; ++round)
      for (int v = 0; v < 2; ++v) {
        auto a = std::chrono::steady_clock::now();
        for (const L& w : ls) {
          if (v == 0) {
            std::vector<float> xk(m * w.k);
            for (int64_t r = 0; r < m; ++r) std::memcpy(&xk[r * w.k], x + r * 2048, w.k * 4);
            chunks(w.n / 16, 4, [&](int64_t b0, int64_t b1) {
              static thread_local std::vector<float> st(2048 * 16);
              kvb_avx2::int4_blocks(xk.data(), m, w.k, w.q, w.s, w.z, group, xs.data(), b0, b1, out.data(), w.n,
                                    st.data());
            });
          } else {
            std::vector<float> xk(m * w.k);
            for (int64_t r = 0; r < m; ++r) std::memcpy(&xk[r * w.k], x + r * 2048, w.k * 4);
            std::vector<int8_t> xq(m * w.k);
            std::vector<float> dx(m * w.k / group);
            std::vector<int32_t> xsum(m * w.k / group);
            quantize(xk.data(), m, w.k, group, xq.data(), dx.data(), xsum.data());
            const int64_t nb8 = w.n / 8, g = w.k / group;
            chunks(nb8, 8, [&](int64_t b0, int64_t b1) {
              for (int64_t b = b0; b < b1; ++b) {
                const uint8_t* qb = w.q8 + b * w.k * 4;
                const float* sb = w.s8 + b * g * 8;
                const float* zb = w.z8 + b * g * 8;
                for (int64_t r0 = 0; r0 < m; r0 += 5) {
                  const int64_t rows = std::min<int64_t>(5, m - r0);
                  const int8_t* xr = xq.data() + r0 * w.k;
                  const float* d = dx.data() + r0 * g;
                  const int32_t* xsr = xsum.data() + r0 * g;
                  float* o = out.data() + r0 * w.n + 8 * b;
#define I8_CALL(R) tile_i8<R>(xr, w.k, w.k, qb, sb, zb, group, d, xsr, o, w.n)
                  KVB_TILE_SWITCH(rows, I8_CALL)  // (its cases above 5 never come: rows <= 5)
#undef I8_CALL
                }
              }
            });
          }
        }
        t[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count() * 1e3);
      }
    for (auto& s : t) std::sort(s.begin(), s.end());
    std::printf("M=%ld threads=%d: float int4 kernel %.2f ms, int8-activation prototype %.2f ms (%.2fx)\n", (long)m,
                threads, t[0][rounds / 2], t[1][rounds / 2], t[0][rounds / 2] / t[1][rounds / 2]);
  }
}
