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

// A run of chunk indices [front, back) in one word (front in the low half), so that its owner taking from the front
// and another thread taking from the back never both get its last chunk.
struct alignas(64) ChunkRun {
  std::atomic<uint64_t> word{0};

  void set(uint64_t front, uint64_t back) { word.store(front | back << 32, std::memory_order_relaxed); }
  int64_t left() const {
    const uint64_t v = word.load(std::memory_order_relaxed);
    return static_cast<int64_t>(v >> 32) - static_cast<int64_t>(v & 0xFFFFFFFFu);
  }
  // The front chunk (from_back: the back one), or -1 once none is left.
  int64_t take(bool from_back) {
    uint64_t v = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = v & 0xFFFFFFFFu, back = v >> 32;
      if (front >= back) return -1;
      const uint64_t taken = from_back ? v - (uint64_t{1} << 32) : v + 1;
      if (word.compare_exchange_weak(v, taken, std::memory_order_relaxed)) return from_back ? back - 1 : front;
    }
  }
};

// Runs per_thread(take) on each thread of a parallel region over [0, n) in chunks of `chunk`; take(c0, c1) gives
// the thread its next chunk, false once none is left. Each thread owns a contiguous run of chunks and takes them in
// order: its weights stream in address order, which the hardware prefetcher follows across chunks (chunks handed out
// in turn, as before, made each thread's stream jump at every chunk: one-row int4 GEMMs 3-20% slower, a one-row
// Gemma-3-270M decoder call 1.11x slower). A thread that finishes its run takes chunks from the back of the run with
// the most left, so a thread that starts late or runs slower (a hypervisor's other tenants) computes fewer, rather
// than the others waiting for its half at the region's end (a plain static split left the main thread waiting ~12%
// of a decode step on a 2-vCPU VM). Which thread computes a chunk changes no bit: the chunks are independent.
template <class F>
void balanced_for(int64_t n, int64_t chunk, const F& per_thread) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(chunks, at::get_num_threads()));
  std::vector<ChunkRun> runs(tasks);
  for (int64_t t = 0; t < tasks; ++t) runs[t].set(t * chunks / tasks, (t + 1) * chunks / tasks);
  auto steal = [&]() -> int64_t {
    for (;;) {
      ChunkRun* most = nullptr;
      int64_t left = 0;
      for (ChunkRun& run : runs)
        if (const int64_t l = run.left(); l > left) most = &run, left = l;
      if (most == nullptr) return -1;
      if (const int64_t c = most->take(true); c >= 0) return c;
    }
  };
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      auto take = [&, t](int64_t& c0, int64_t& c1) {
        int64_t c = runs[t].take(false);
        if (c < 0) c = steal();
        if (c < 0) return false;
        c0 = c * chunk, c1 = std::min(n, c0 + chunk);
        return true;
      };
      per_thread(take);
    }
  });
}

// What a thread takes at a time out of n blocks or weight rows: about 8 chunks per thread, a multiple of `unit`.
inline int64_t chunk_of(int64_t n, int64_t unit) {
  const int64_t parts = 8 * at::get_num_threads(), per = (n + parts - 1) / parts;
  return std::max<int64_t>(unit, (per + unit - 1) / unit * unit);
}
