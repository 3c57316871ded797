// torch custom ops (namespace `kvboost`) over the per-ISA kernels of kvboost_kernels.h: the library's schemas, the
// ISA in effect, and the linear ops: argument checks and threads over chunks of output columns (balanced_for over
// at::parallel_for, so torch.set_num_threads applies). A thread count never changes a result: columns are
// independent. Attention and RMSNorm: row_ops.cpp; the decoder layer ops: layer.cpp, decoder.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "ops.h"
#include "threads.h"

namespace {

int64_t host_level() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return !__builtin_cpu_supports("avx512bf16") ? kAvx512 : kvb_amx::tiles_granted() ? kAmx : kAvx512Bf16;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kScalar;
}

std::atomic<int64_t> g_level{host_level()};

// Whether the AVX-512 BF16 path may decode int4 with VBMI (set_vbmi(false): as on a CPU with BF16 but no VBMI,
// Cooper Lake; the same bits, for tests and benchmarks of that decoding on this host).
std::atomic<bool> g_vbmi_allowed{true};

bool host_vbmi() {  // read once: vbmi_decoding runs on every int4 call
  static const bool vbmi = [] {
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_supports("avx512vbmi"));
  }();
  return vbmi;
}

bool set_vbmi(bool allowed) {
  g_vbmi_allowed.store(allowed);
  return allowed && host_vbmi();
}

// Up to how many rows the row-major bf16 kernel of the avx512_bf16 path passes over one weight row at a time rather
// than two (head_avx512bf16.cpp, bf16_rows): up to a verification's 9 on AMD Zen 5 and later (family 26 on), where
// that was measured faster than the pairs as they were before their activations were interleaved (session 30; not
// measured since on Zen 5); never elsewhere (the pairs were measured faster on Zen 4). The same bits either way.
int64_t host_one_row_passes() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const unsigned base = (eax >> 8) & 0xF, family = base + (base == 0xF ? (eax >> 20) & 0xFF : 0);
  return family >= 0x1A ? 9 : 0;
}

std::atomic<int64_t> g_one_row_passes{host_one_row_passes()};

// rows < 0: the host's choice again. Returns the value in effect.
int64_t set_one_row_passes(int64_t rows) {
  const int64_t value = rows < 0 ? host_one_row_passes() : rows;
  g_one_row_passes.store(value);
  return value;
}

bool vbmi_decoding(int64_t group) { return g_vbmi_allowed.load() && host_vbmi() && group % 8 == 0; }

// Selects the ISA path: the wanted level, lowered to what this CPU has. Returns the level in effect.
int64_t set_level(int64_t wanted) {
  const int64_t level = std::max<int64_t>(kScalar, std::min(wanted, host_level()));
  g_level.store(level);
  return level;
}

int64_t get_level() { return g_level.load(); }
int64_t get_host_level() { return host_level(); }

void check_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu(), "kvboost kernels run on CPU tensors, got ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
}

// x [M, K] as the float32 rows the kernels read; `round_bf16`: each value first rounded to bfloat16, the
// activations an AWQ linear takes (x.to(bfloat16).to(float32), the same bits). A copy only where needed.
at::Tensor gemm_rows(const at::Tensor& x, bool round_bf16) {
  const at::ScalarType dtype = x.scalar_type();
  if (x.numel() > kKvbLoopElements || !x.is_contiguous() || (dtype != at::kBFloat16 && dtype != at::kFloat))
    return (round_bf16 ? x.to(at::kBFloat16) : x).to(at::kFloat).contiguous();
  if (dtype == at::kFloat && !round_bf16) return x;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t count = x.numel();
  if (dtype == at::kBFloat16) {
    const c10::BFloat16* p = x.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < count; ++i) o[i] = static_cast<float>(p[i]);
  } else {
    const float* p = x.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) o[i] = static_cast<float>(c10::BFloat16(p[i]));
  }
  return out;
}

at::Tensor rows_f32(const at::Tensor& x, int64_t k) {
  check_rows(x, k);
  return gemm_rows(x, false);
}

void check_blocks(const at::Tensor& w, at::ScalarType dtype, int64_t width, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(w.scalar_type() == dtype, name, " must be ", dtype, ", got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.size(2) == width, name, " must be [blocks, rows, ", width, "], got ", w.sizes());
}

// The [rows, n] result in the activation's dtype, from the [rows, 16 * blocks] float buffer.
at::Tensor finish(const at::Tensor& out, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(n > 0 && n <= out.size(1), "n must be in 1..", out.size(1), ", got ", n);
  at::Tensor result = n == out.size(1) ? out : out.narrow(1, 0, n).contiguous();
  return result.scalar_type() == dtype ? result : result.to(dtype);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros,
                       int64_t group, int64_t n) {
  check_blocks(q, at::kByte, 8, "qweight");
  const int64_t blocks = q.size(0), k = q.size(1);
  TORCH_CHECK(group > 0 && k % group == 0, "group_size ", group, " must divide in_features ", k);
  check_blocks(scales, at::kFloat, 16, "scales");
  check_blocks(zeros, at::kFloat, 16, "zeros");
  TORCH_CHECK(scales.size(0) == blocks && scales.size(1) == k / group && zeros.sizes() == scales.sizes(),
              "scales and zeros must be [", blocks, ", ", k / group, ", 16], got ", scales.sizes(), " and ",
              zeros.sizes());
  check_rows(x, k);
  std::vector<int64_t> offsets;
  const KvbInt4Weight w{q.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), blocks, group};
  return finish(kvb_int4_columns(x, {w}, offsets), n, x.scalar_type());
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n) {
  check_blocks(q, at::kChar, 16, "qweight");
  const int64_t blocks = q.size(0), k = q.size(1);
  TORCH_CHECK(scales.device().is_cpu() && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.dim() == 1 && scales.size(0) == 16 * blocks,
              "scales must be a contiguous float32 CPU tensor [", 16 * blocks, "], got ", scales.sizes());
  const at::Tensor xf = rows_f32(x, k);
  const int64_t m = xf.size(0);
  at::Tensor out = at::empty({m, 16 * blocks}, xf.options());
  const int64_t level = get_level();
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  balanced_for(blocks, chunk_of(blocks, 4), [&](const auto& take) {
    for (int64_t b0, b1; take(b0, b1);) KVB_BY_LEVEL(level, int8_blocks, xp, m, k, qp, sp, b0, b1, op, 16 * blocks);
  });
  return finish(out, n, x.scalar_type());
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "weight must be bfloat16 or float32, got ", w.scalar_type());
  check_blocks(w, w.scalar_type(), 16, "weight");
  const int64_t blocks = w.size(0), k = w.size(1);
  const at::Tensor xf = rows_f32(x, k);
  const int64_t m = xf.size(0);
  at::Tensor out = at::empty({m, 16 * blocks}, xf.options());
  const int64_t level = get_level();
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const void* wp = w.data_ptr();
  balanced_for(blocks, chunk_of(blocks, 4), [&](const auto& take) {
    for (int64_t b0, b1; take(b0, b1);) {
      if (bf16)
        KVB_BY_LEVEL(level, bf16_blocks, xp, m, k, static_cast<const uint16_t*>(wp), b0, b1, op, 16 * blocks);
      else
        KVB_BY_LEVEL(level, f32_blocks, xp, m, k, static_cast<const float*>(wp), b0, b1, op, 16 * blocks);
    }
  });
  return finish(out, n, x.scalar_type());
}

// The amx_bf16 path's head: bf16 x [m, K] against the weight's tile layout (kvb_amx::bf16_tiles), [m, n] bf16 with
// each float result rounded as .to(bfloat16) rounds.
at::Tensor tile_linear(const at::Tensor& xb, const at::Tensor& tiles, int64_t n) {
  const int64_t m = xb.size(0), k = xb.size(1), blocks = tiles.dim() == 5 ? tiles.size(0) : 0;
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.device().is_cpu() && tiles.is_contiguous() &&
                  tiles.dim() == 5 && blocks % 2 == 0 && blocks * 16 >= n && blocks * 16 < n + 32 &&
                  tiles.size(1) * 32 == k && tiles.size(2) == 16 && tiles.size(3) == 16 && tiles.size(4) == 2,
              "tiles must be the weight's contiguous bf16 tile layout [", (n + 31) / 32 * 2, ", ", k / 32,
              ", 16, 16, 2] (kernels.tile_layout), got ", tiles.scalar_type(), " ", tiles.sizes());
  at::Tensor out = at::empty({m, 16 * blocks}, xb.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const auto* tp = reinterpret_cast<const uint16_t*>(tiles.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const bool padded = m > 16 && m % 16 != 0;
  balanced_for(blocks / 2, chunk_of(blocks / 2, 1), [&](const auto& take) {
    uint16_t* pad = padded ? thread_scratch<uint16_t>(16 * k) : nullptr;
    for (int64_t p0, p1; take(p0, p1);)
      kvb_amx::bf16_tiles(xp, m, k, tp, 2 * p0, 2 * p1, nullptr, op, 16 * blocks, pad);
  });
  return 16 * blocks == n ? out : out.narrow(1, 0, n).contiguous();
}

// x @ weight.T for nn.Linear's own [N, K] weight (bf16 or fp32), threads over output columns. With `tiles` (the
// weight's tile layout), the amx_bf16 path computes a bf16 x on tiles; every other path ignores them.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& tiles) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "weight must be bfloat16 or float32, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 2, "weight must be a contiguous CPU [N, K] tensor");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 16 == 0, "in_features must be a multiple of 16, got ", k);
  const int64_t level = get_level();
  if (level >= kAvx512Bf16 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
      k % 32 == 0 && x.device().is_cpu() && x.dim() == 2 && x.size(1) == k) {
    const at::Tensor xb = x.contiguous();
    if (tiles.has_value() && level == kAmx) return tile_linear(xb, *tiles, n);
    const int64_t m = xb.size(0);
    at::Tensor out = at::empty({m, n}, xb.options());  // bf16: each sum rounded in the kernel (see tile_linear)
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    at::Tensor interleaved;  // for passes over two weight rows: x laid out once per call, read by every thread
    if (m >= KVB_HEAD_PAIR_ROWS && m > g_one_row_passes.load()) {
      interleaved = at::empty_like(xb);
      kvb_interleave_rows(xp, m, k * int64_t{sizeof(uint16_t)}, KVB_HEAD_PASS_ROWS, interleaved.data_ptr());
    }
    const auto* xi = interleaved.defined() ? reinterpret_cast<const uint16_t*>(interleaved.data_ptr()) : nullptr;
    balanced_for(n, chunk_of(n, 64), [&](const auto& take) {
      for (int64_t n0, n1; take(n0, n1);) kvb_avx512bf16::bf16_rows(xp, xi, m, k, wp, n0, n1, nullptr, op, n);
    });
    return out;
  }
  const at::Tensor xf = rows_f32(x, k);
  const int64_t m = xf.size(0);
  at::Tensor out = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const void* wp = w.data_ptr();
  balanced_for(n, chunk_of(n, 64), [&](const auto& take) {
    for (int64_t n0, n1; take(n0, n1);) {
      if (bf16)
        KVB_BY_LEVEL(level, bf16_rows, xp, m, k, static_cast<const uint16_t*>(wp), n0, n1, op, n);
      else
        KVB_BY_LEVEL(level, f32_rows, xp, m, k, static_cast<const float*>(wp), n0, n1, op, n);
    }
  });
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

}  // namespace

int64_t kvb_level() { return get_level(); }

at::Tensor kvb_int4_columns(const at::Tensor& x, const std::vector<KvbInt4Weight>& ws, std::vector<int64_t>& offsets,
                            bool bf16_inputs) {
  const int64_t k = x.size(1), group = ws.at(0).group, level = get_level();
  TORCH_CHECK(group % 2 == 0, "int4 group_size must be even (rows k and k + 1 share a byte), got ", group);
  std::vector<int64_t> starts{0};
  offsets.clear();
  for (const KvbInt4Weight& w : ws) {
    TORCH_CHECK(w.group == group, "int4 weights computed together must share a group size");
    offsets.push_back(16 * starts.back());
    starts.push_back(starts.back() + w.blocks);
  }
  const int64_t blocks = starts.back(), ldo = 16 * blocks;
  // bf16 activations on the AVX-512 BF16 and AMX paths: numerics of their own (gemm_avx512bf16.cpp,
  // gemm_amx.cpp; AMX for groups of whole tiles' k); else float32 fmas
  const bool bf16 = level >= kAvx512Bf16 && (bf16_inputs || x.scalar_type() == at::kBFloat16);
  const bool amx = bf16 && level == kAmx && group % 32 == 0;
  // (a bfloat16 x as it is: a no-op .to() is still a dispatched op call, one of ~85 a layer of a decode step)
  const at::Tensor xc = !bf16 ? gemm_rows(x, bf16_inputs)
                        : x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kBFloat16).contiguous();
  const int64_t m = xc.size(0);
  at::Tensor out = at::empty({m, ldo}, xc.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  std::vector<float> xs(m * (k / group));  // per row and group: the bf16 path's pair sums, else in-order sums
  if (bf16)
    kvb_avx512bf16::group_sums(reinterpret_cast<const uint16_t*>(xc.data_ptr()), m, k, group, xs.data());
  else
    kvb_group_sums(xc.data_ptr<float>(), m, k, group, xs.data());
  const bool vbmi = bf16 && vbmi_decoding(group);  // once: the strip's size depends on it
  balanced_for(blocks, chunk_of(blocks, 4), [&](const auto& take) {
    uint32_t* strip_bf16 = thread_scratch<uint32_t>(amx    ? kvb_amx::strip_words(m, k, group)
                                                    : bf16 ? kvb_avx512bf16::strip_words(m, k, vbmi)
                                                           : 0);
    float* strip = thread_scratch<float>(!bf16 && m > KVB_MIN_ROW_TILE ? k * 16 : 0);
    for (int64_t g0, g1; take(g0, g1);) {
      for (size_t i = 0; i < ws.size(); ++i) {  // the blocks of [g0, g1) that belong to weight i
        const int64_t b0 = std::max(g0, starts[i]) - starts[i], b1 = std::min(g1, starts[i + 1]) - starts[i];
        if (b0 >= b1) continue;
        const KvbInt4Weight& w = ws[i];
        if (amx)
          kvb_amx::int4_blocks(reinterpret_cast<const uint16_t*>(xc.data_ptr()), m, k, w.q, w.scales, w.zeros, group,
                               xs.data(), b0, b1, op + offsets[i], ldo, strip_bf16);
        else if (bf16)
          kvb_avx512bf16::int4_blocks(reinterpret_cast<const uint16_t*>(xc.data_ptr()), m, k, w.q, w.scales,
                                      w.zeros, group, xs.data(), b0, b1, op + offsets[i], ldo, strip_bf16,
                                      vbmi);
        else
          KVB_BY_LEVEL(level, int4_blocks, xc.data_ptr<float>(), m, k, w.q, w.scales, w.zeros, group, xs.data(),
                       b0, b1, op + offsets[i], ldo, strip);
      }
    }
  });
  return out;
}

TORCH_LIBRARY(kvboost, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, int n) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, int n) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight, int n) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? tiles=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor scale, float eps) -> Tensor");
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, bool causal, int window) -> Tensor");
  m.def("set_isa_level(int level) -> int", &set_level);
  m.def("isa_level() -> int", &get_level);
  m.def("host_isa_level() -> int", &get_host_level);
  m.def("set_vbmi(bool allowed) -> bool", &set_vbmi);
  m.def("set_one_row_passes(int rows) -> int", &set_one_row_passes);
  m.def("int4_numerics_version() -> int", [] { return KVB_INT4_NUMERICS_VERSION; });
  // How many tensors share t's memory, any device (c10's use count of its storage): kvboost_hf.cache.buffer reuses a
  // KV buffer's rows after a crop only where no other view of them is alive.
  m.def("storage_users(Tensor t) -> int",
        [](const at::Tensor& t) { return static_cast<int64_t>(t.storage().use_count()); });
  m.def("amx_fingerprint() -> int", [] {
    static const int64_t fingerprint = kvb_amx::fingerprint();
    return fingerprint;
  });
}

TORCH_LIBRARY_IMPL(kvboost, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("dense_linear", &dense_linear);
  m.impl("linear", &linear);
}

// Inference-only ops: a backward through them raises ("... is not implemented"), rather than leaving gradients
// silently None. In C++: a Python autograd registration cost ~4.5 us on every call, grad or not.
TORCH_LIBRARY_IMPL(kvboost, Autograd, m) {
  for (const char* name : {"attention", "rms_norm", "layer_attention_inputs", "layer_output", "layer_step",
                           "decoder_step"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
}
