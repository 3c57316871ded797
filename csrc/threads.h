// How the ops spread work over torch's threads (ops.cpp, row_ops.cpp): chunks of independent output columns taken as
// each thread finishes its last, and per-thread scratch kept across calls. Which thread computes what changes no bit.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

// A buffer of at least n T's for this thread, kept for its later calls: the int4 strips are 32-64 bytes per k
// (128 KB at K = 2048), and a fresh vector each call zeroed them, and from 128 KB on glibc maps and unmaps them
// (page faults every call: on AMX that made a one-row 2048 x 640 projection 1.6x slower than after the change).
template <class T>
T* thread_scratch(size_t n) {
  static thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// Runs per_thread(take) on each thread of a parallel region over [0, n) in chunks of `chunk`; take(c0, c1)
// gives a thread the next chunk not yet taken, false once none is left. Threads take chunks as they finish
// them, so a thread that starts late or runs slower (a hypervisor's other tenants) computes fewer, rather
// than the others waiting for its half at the region's end (a static split left the main thread waiting ~12%
// of a decode step on a 2-vCPU VM). Which thread computes a chunk changes no bit: the chunks are independent.
template <class F>
void balanced_for(int64_t n, int64_t chunk, const F& per_thread) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  auto take = [&](int64_t& c0, int64_t& c1) {
    const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
    if (c >= chunks) return false;
    c0 = c * chunk, c1 = std::min(n, c0 + chunk);
    return true;
  };
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1,
                   [&](int64_t, int64_t) { per_thread(take); });
}

// What a thread takes at a time out of n blocks or weight rows: about 8 chunks per thread, a multiple of `unit`.
inline int64_t chunk_of(int64_t n, int64_t unit) {
  const int64_t parts = 8 * at::get_num_threads(), per = (n + parts - 1) / parts;
  return std::max<int64_t>(unit, (per + unit - 1) / unit * unit);
}
