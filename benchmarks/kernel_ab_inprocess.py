"""Two kernel sources in one process, interleaved call by call: a small C++ driver that includes both.

``benchmarks/kernel_sources_ab.py`` runs one process per source tree; on a shared 2-vCPU VM whose speed moves
by a third within the hour, its per-round ratios spread over 0.6-2.0 (2026-11-29), wider than the 5-20% a kernel
change is worth. Here both trees' GEMM loops (one ISA unit, e.g. ``gemm_avx2.cpp`` with the ``.inc`` bodies it
includes) are compiled into one driver, each in its own namespace, with the extension's flags, and the driver
alternates them call by call over the same buffers: a drift of the host falls on both alike. It times
Gemma-3-270M's 72 int4 linears as a decode step reads them (18 layers of q/k/v fused 1536x640, o 640x1024,
gate+up 4096x640, down 640x2048; group 128; 56 MB, so from DRAM) and the 262144x640 bf16 head in nn.Linear's
[N, K] layout (335 MB), at the given row counts, on 1 and 2 OpenMP threads, the output blocks or rows split as the
op's ``balanced_for`` splits them (``chunk_of``'s chunks, each thread a contiguous run of them in address order,
stealing from the back of another's when done), and checks that both trees give the same bits. (Until session 32
the driver handed out chunks of 4 blocks or 64 head rows in turn, so each thread's stream jumped every 82 KB and
the one-row int4 linears on two threads took 5.1-5.4 ms against 3.5-4.0 split as the op splits them.)

    git archive HEAD csrc | tar -x -C /tmp/base    # the sources to compare against
    python benchmarks/kernel_ab_inprocess.py --base /tmp/base/csrc [--new csrc] [--rows 1 9] [--rounds 15]

Needs g++ with OpenMP (what builds the extension). ``--isa`` picks the unit (avx2 by default; avx512 on a host
that has it). The ratio column is base / new per round (above 1: new faster), its median and range. Run it once
with ``--base csrc`` (the same sources twice) for the noise floor: on the AVX2 Zen 3 VM (2026-11-29, 15 rounds)
the medians of identical code were 0.92-1.03, so a change under ~8% does not show here either.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from kvboost_hf.kernels.build import CFLAGS  # noqa: E402  (the extension's own flags)

UNITS = {"avx2": ("gemm_avx2.cpp", "kvb_avx2"), "avx512": ("gemm_avx512.cpp", "kvb_avx512"),
         "scalar": ("gemm_scalar.cpp", "kvb_scalar")}

# The library headers first: a unit's target pragma (avx2, avx512) would otherwise apply to their first inclusion,
# which GCC 12 then rejects as a second declaration when the driver includes them again under its own target.
DRIVER = r"""
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "a/UNIT"
#include "b/UNIT"

struct Linear { int64_t n, k; uint8_t* q; float* s; float* z; };
typedef void (*Int4Fn)(const float*, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t,
                       const float*, int64_t, int64_t, float*, int64_t, float*);
typedef void (*HeadFn)(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);

// What the op gives a thread at a time (threads.h's chunk_of): about 8 chunks per thread, a multiple of `unit`.
static int64_t chunk_of(int64_t n, int64_t unit) {
  const int64_t parts = 8 * omp_get_max_threads(), per = (n + parts - 1) / parts;
  return std::max<int64_t>(unit, (per + unit - 1) / unit * unit);
}

// Chunks of `chunk` out of n as the op's balanced_for (threads.h) hands them out: each thread owns a contiguous run
// and takes it in address order (the hardware prefetcher follows it across chunks); one that finishes its run takes
// chunks from the back of the others'. A run is [front, back) in one word, so that its owner and a thief never both
// get (or both miss) its last chunk.
template <class F> void chunks(int64_t n, int64_t chunk, const F& f) {
  const int64_t count = (n + chunk - 1) / chunk;
  const int tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(count, omp_get_max_threads())));
  std::vector<std::atomic<uint64_t>> runs(tasks);
  for (int t = 0; t < tasks; ++t) runs[t] = uint64_t(t * count / tasks) | uint64_t((t + 1) * count / tasks) << 32;
  auto take = [&](int t, bool from_back) -> int64_t {
    uint64_t v = runs[t].load();
    for (;;) {
      const uint64_t front = v & 0xFFFFFFFFu, back = v >> 32;
      if (front >= back) return -1;
      if (runs[t].compare_exchange_weak(v, from_back ? v - (uint64_t{1} << 32) : v + 1))
        return int64_t(from_back ? back - 1 : front);
    }
  };
#pragma omp parallel num_threads(tasks)
  {
    const int t = omp_get_thread_num();
    for (int64_t c; (c = take(t, false)) >= 0;) f(c * chunk, std::min(n, (c + 1) * chunk));
    for (int o = 0; o < tasks; ++o)
      for (int64_t c; (c = take(o, true)) >= 0;) f(c * chunk, std::min(n, (c + 1) * chunk));
  }
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const int rounds = atoi(argv[1]);
  std::vector<int64_t> rows;
  for (int i = 2; i < argc; ++i) rows.push_back(atol(argv[i]));
  const int64_t most = *std::max_element(rows.begin(), rows.end()), group = 128;
  srand(1);
  std::vector<Linear> linears;
  const int64_t shapes[4][2] = {{1536, 640}, {640, 1024}, {4096, 640}, {640, 2048}};
  for (int l = 0; l < 18; ++l)
    for (auto& sh : shapes) {
      Linear w{sh[0], sh[1]};
      const int64_t blocks = w.n / 16, groups = w.k / group;
      w.q = static_cast<uint8_t*>(aligned_alloc(64, blocks * w.k * 8));
      w.s = static_cast<float*>(aligned_alloc(64, blocks * groups * 16 * 4));
      w.z = static_cast<float*>(aligned_alloc(64, blocks * groups * 16 * 4));
      for (int64_t i = 0; i < blocks * w.k * 8; ++i) w.q[i] = rand();
      for (int64_t i = 0; i < blocks * groups * 16; ++i) w.s[i] = 0.001f * (1 + rand() % 20), w.z[i] = rand() % 16;
      linears.push_back(w);
    }
  const int64_t vocab = 262144, width = 640;
  uint16_t* head = static_cast<uint16_t*>(aligned_alloc(64, vocab * width * 2));
  for (int64_t i = 0; i < vocab * width; ++i) head[i] = 0x3c00 + rand() % 0x800 + (rand() % 2 ? 0x8000 : 0);
  float* x = static_cast<float*>(aligned_alloc(64, most * 2048 * 4));
  for (int64_t i = 0; i < most * 2048; ++i) x[i] = (rand() % 2001 - 1000) / 700.0f;
  std::vector<float> xs(most * 16);
  for (int64_t r = 0; r < most; ++r)
    for (int64_t g = 0; g < 16; ++g) {
      float t = 0.0f;
      for (int64_t i = 0; i < group; ++i) t += x[r * 2048 + g * group + i];
      xs[r * 16 + g] = t;
    }
  std::vector<float> out[2] = {std::vector<float>(most * vocab), std::vector<float>(most * vocab)};
  const Int4Fn int4[2] = {kvb_a::int4_blocks, kvb_b::int4_blocks};
  const HeadFn heads[2] = {kvb_a::bf16_rows, kvb_b::bf16_rows};
  // Each in_features' activations, [m, k] as the kernel reads them: the first k columns of x's m rows (stride 2048),
  // made once per row count, outside the timed calls.
  std::vector<float> xk[3], xsk[3];
  auto slot = [](int64_t k) { return k == 640 ? 0 : k == 1024 ? 1 : 2; };
  auto activations = [&](int64_t m) {
    for (int64_t k : {640, 1024, 2048}) {
      std::vector<float>&a = xk[slot(k)], &sums = xsk[slot(k)];
      a.resize(m * k), sums.resize(m * (k / group));
      for (int64_t r = 0; r < m; ++r) {
        std::memcpy(&a[r * k], x + r * 2048, k * 4);
        std::memcpy(&sums[r * (k / group)], &xs[r * 16], (k / group) * 4);
      }
    }
  };
  auto stream = [&](int v, int64_t m) {
    for (const Linear& w : linears) {
      const float* a = xk[slot(w.k)].data();
      const float* sums = xsk[slot(w.k)].data();
      chunks(w.n / 16, chunk_of(w.n / 16, 4), [&](int64_t b0, int64_t b1) {
        static thread_local std::vector<float> strip(2048 * 16);
        int4[v](a, m, w.k, w.q, w.s, w.z, group, sums, b0, b1, out[v].data(), w.n, strip.data());
      });
    }
  };
  auto lm_head = [&](int v, int64_t m) {
    chunks(vocab, chunk_of(vocab, 64), [&](int64_t n0, int64_t n1) { heads[v](x, m, width, head, n0, n1, out[v].data(), vocab); });
  };
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (int64_t m : rows) {
      activations(m);
      for (int what = 0; what < 2; ++what) {
        std::vector<double> t[2], ratio;
        for (int round = 0; round < rounds; ++round) {
          double took[2];
          for (int i = 0; i < 2; ++i) {
            const int v = round % 2 ? 1 - i : i;  // ABBA
            const double start = now();
            if (what == 0) stream(v, m); else lm_head(v, m);
            took[v] = now() - start;
            t[v].push_back(took[v] * 1e3);
          }
          ratio.push_back(took[0] / took[1]);
        }
        const bool same = std::memcmp(out[0].data(), out[1].data(), m * (what ? vocab : 4096) * 4) == 0;
        for (auto* s : {&t[0], &t[1], &ratio}) std::sort(s->begin(), s->end());
        std::printf("%-26s M=%-3ld threads=%d %9.2f %9.2f %9.2f %5.2f-%.2f  %s\n",
                    what ? "head 262144x640 bf16" : "int4 linears (72, 56 MB)", long(m), threads, t[0][rounds / 2],
                    t[1][rounds / 2], ratio[rounds / 2], ratio.front(), ratio.back(),
                    same ? "same bits" : "BITS DIFFER");
      }
    }
  }
}
"""


def copy_unit(csrc: Path, to: Path, unit: str, namespace: str, label: str) -> None:
    """``csrc``'s unit and the bodies it includes, its namespace renamed to kvb_<label>."""
    to.mkdir(parents=True)
    for path in csrc.glob("*.inc"):
        shutil.copy(path, to)
    source = (csrc / unit).read_text()
    renamed, count = re.subn(rf"\bnamespace {namespace}\b", f"namespace kvb_{label}", source)
    if not count:
        raise SystemExit(f"{csrc / unit} has no namespace {namespace}")
    (to / unit).write_text(renamed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="csrc directory of the sources to compare against")
    parser.add_argument("--new", default=str(REPO / "csrc"))
    parser.add_argument("--isa", choices=sorted(UNITS), default="avx2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 9])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    unit, namespace = UNITS[args.isa]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        copy_unit(Path(args.base), work / "a", unit, namespace, "a")
        copy_unit(Path(args.new), work / "b", unit, namespace, "b")
        (work / "driver.cpp").write_text(DRIVER.replace("UNIT", unit))
        # The header comes from the new tree (the units share it; a change to it is the new tree's).
        command = ["g++", "-std=c++17", *CFLAGS, f"-I{Path(args.new).resolve()}", str(work / "driver.cpp"),
                   "-o", str(work / "driver")]
        subprocess.run(command, check=True)
        print(f"{'what':26s} {'rows':5s} {'threads':9s} {'base ms':>9s} {'new ms':>9s} {'base/new':>9s} range")
        sys.stdout.flush()
        subprocess.run([str(work / "driver"), str(args.rounds), *map(str, args.rows)], check=True)


if __name__ == "__main__":
    main()
