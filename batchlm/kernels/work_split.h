// batchlm::for_each_item: runs body(state, i, next) once for every item i in [0, n) over torch's intra-op
// threads, each thread on its own contiguous share first, and a thread that has finished its share takes
// the items still left at the far end of another's.
//
// Why not at::parallel_for's fixed split: on the 2 cores this project serves from, every wake-up of a server
// or client thread preempts one of the engine's two threads for a while, and with a fixed split the other
// finishes its half and waits at the end of the region for the preempted one to do all of its half. Here
// it takes the rest of that half instead, an item at a time, and keeps its core busy. (The item the
// preempted thread holds still waits for it, and so does a region shorter than the preemption;
// `batchlm-bench forward --interfere` times steps under such wake-ups.) Uneven items
// (attention over contexts of different lengths) even out the same way.
//
// Contract:
//   - every i in [0, n) is run exactly once, by one thread; which thread, and in what order the items
//     run, varies from call to call. Callers make each item's result independent of both (each item
//     writes its own outputs, with sums in an order fixed by the item alone), so results are bit-identical
//     to a serial loop.
//   - next is the item the same thread will most likely run after i (i + 1 in its own share, i - 1 when it
//     takes from another's end), or -1: a prefetch hint only. It may turn out to be run by another thread.
//   - state is what init() returned on the running thread, made once per thread that runs items (scratch
//     buffers, what the thread prefetched last), never shared between threads.
//   - inside a parallel region, or with one thread, the items run in order on the calling thread.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace batchlm {

// The unclaimed items [lo, hi) of one thread's share, packed in one word so that the owner (from the front)
// and a thief (from the back) claim with one compare-and-swap each and never take the same item.
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};

  static uint64_t pack(int64_t lo, int64_t hi) { return (static_cast<uint64_t>(hi) << 32) | static_cast<uint32_t>(lo); }
  static int64_t lo_of(uint64_t r) { return static_cast<int64_t>(r & 0xffffffffu); }
  static int64_t hi_of(uint64_t r) { return static_cast<int64_t>(r >> 32); }

  // The front item, or -1 if none is left.
  int64_t take_front() {
    uint64_t r = range.load(std::memory_order_relaxed);
    while (lo_of(r) < hi_of(r))
      if (range.compare_exchange_weak(r, pack(lo_of(r) + 1, hi_of(r)), std::memory_order_relaxed)) return lo_of(r);
    return -1;
  }
  // The back item, or -1 if none is left.
  int64_t take_back() {
    uint64_t r = range.load(std::memory_order_relaxed);
    while (lo_of(r) < hi_of(r))
      if (range.compare_exchange_weak(r, pack(lo_of(r), hi_of(r) - 1), std::memory_order_relaxed)) return hi_of(r) - 1;
    return -1;
  }
  // Whether item i is still unclaimed (for a hint only: it may be claimed a moment later).
  bool holds(int64_t i) const {
    const uint64_t r = range.load(std::memory_order_relaxed);
    return lo_of(r) <= i && i < hi_of(r);
  }
};

template <typename Init, typename Body>
void for_each_item(int64_t n, const Init& init, const Body& body) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::in_parallel_region() ? 1 : at::get_num_threads(), n);
  if (threads <= 1) {
    auto state = init();
    for (int64_t i = 0; i < n; ++i) body(state, i, i + 1 < n ? i + 1 : -1);
    return;
  }
  // NOTE: items are counted in 32 bits in a Share; every caller's n (column groups, sequence x KV head) is far below.
  TORCH_CHECK(n < (int64_t{1} << 31), "for_each_item: too many items (", n, ")");
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t) shares[t].range.store(Share::pack(n * t / threads, n * (t + 1) / threads));
  // One task per thread: at::parallel_for gives each of `threads` threads one index (and runs them in turn
  // on one thread if it cannot go parallel, which the claims make correct all the same).
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    auto state = init();
    for (int64_t t = begin; t < end; ++t) {
      Share& own = shares[t];
      for (int64_t i = own.take_front(); i >= 0; i = own.take_front())
        body(state, i, own.holds(i + 1) ? i + 1 : -1);
      for (int64_t k = 1; k < threads; ++k) {  // then the far ends of the others' shares, the next thread's first
        Share& other = shares[(t + k) % threads];
        for (int64_t i = other.take_back(); i >= 0; i = other.take_back())
          body(state, i, other.holds(i - 1) ? i - 1 : -1);
      }
    }
  });
}

}  // namespace batchlm
