// Work sharing over XLA's intra-op thread pool for the native CPU kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace paged {

// Runs fn(i) for i in [0, n), chunk items at a time, on this thread plus up to (pool threads - 1) helpers.
// Helpers that start after the work is gone return at once without touching it, so the caller waits only
// for helpers already running, never for a queued task: two custom calls running on both pool threads
// would otherwise each wait for a helper that can never start.
template <typename Fn>
void run_parallel(xla::ffi::ThreadPool* pool, int64_t n, int64_t chunk, int64_t max_helpers, const Fn& fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, chunk, &fn]() {
    for (int64_t first; (first = state->next.fetch_add(chunk)) < n;)
      for (int64_t i = first; i < std::min(first + chunk, n); ++i) fn(i);
  };
  const int64_t helpers = pool ? std::min<int64_t>(pool->num_threads() - 1, max_helpers) : 0;
  for (int64_t h = 0; h < helpers; ++h) {
    pool->Schedule([state, n, work]() {
      state->active.fetch_add(1);
      if (state->next.load() < n) work();
      state->active.fetch_sub(1);
    });
  }
  work();
  while (state->active.load() > 0) std::this_thread::yield();
}

// Each thread's contiguous run of a table's 32-row blocks (N rows): fn(part, n_begin, n_end); returns the parts.
template <typename Fn>
int64_t split_table(xla::ffi::ThreadPool& pool, int64_t N, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t blocks = (N + 31) / 32, parts = std::min(blocks, threads);
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    fn(part, part * blocks / parts * 32, std::min(N, (part + 1) * blocks / parts * 32));
  });
  return parts;
}

}  // namespace paged
