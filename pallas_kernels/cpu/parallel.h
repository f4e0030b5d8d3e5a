// Work sharing for the native CPU kernels: the calling thread plus this library's helper threads.
//
// Why not XLA's intra-op pool: its idle threads park between one step's kernels, and a parked thread on a
// virtual machine wakes 25-60 us after it is signalled. In profiles of the 0.5B shape's decode steps the
// helpers of q, attention, gate/up and down started that late, after the single-threaded norm between them
// (q took 130 us where o, the same product, took 85). The helpers here keep spinning for `kSpinMicros` after
// their last job, so within a step they start at once; a spinning helper yields its CPU on every turn, so any
// other thread that can run there (XLA's own, Python's) runs first.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace paged {

namespace detail {

// How long an idle helper spins before it parks. Longer than the gaps between one step's kernels (tens of
// microseconds) and short enough that an idle engine does not hold a CPU.
constexpr int64_t kSpinMicros = 2000;

// fn(i) for i in [0, n), handed out `chunk` items at a time to whoever asks.
struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> joined{0};  // helpers that have asked to join (those past max_helpers do not)
  int64_t n = 0, chunk = 1, max_helpers = 0;
  void (*call)(const void* fn, int64_t i) = nullptr;
  const void* fn = nullptr;

  void work() {
    for (int64_t first; (first = next.fetch_add(chunk)) < n;)
      for (int64_t i = first; i < std::min(first + chunk, n); ++i) call(fn, i);
  }
};

// One job at a time is posted; a caller that finds one posted (another kernel running on another XLA thread)
// does its work alone.
class Helpers {
 public:
  // The process's helpers (threads - 1 of them, started on first use and never stopped).
  static Helpers& get(int64_t threads) {
    static Helpers* helpers = [&] {
      // A child process forked from this one has none of the threads: there, post() finds none.
      pthread_atfork(nullptr, nullptr, [] { forked_child() = true; });
      return new Helpers(std::max<int64_t>(0, threads - 1));  // never destroyed: its threads run to exit
    }();
    return *helpers;
  }
  // Offers `job` to the helpers; false if another job holds the slot.
  bool post(Job* job) {
    Job* expected = nullptr;
    if (threads_.empty() || forked_child() || !slot_.compare_exchange_strong(expected, job)) return false;
    posts_.fetch_add(1);
    if (parked_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    return true;
  }

  // Takes the posted job back and waits for the helpers inside it. A helper counts itself active before it
  // looks at the slot again, so one that finds the job still posted is waited for, and one that comes later
  // finds the slot empty and never touches the job (which lives on the caller's stack).
  void withdraw() {
    slot_.store(nullptr);
    while (active_.load() > 0) std::this_thread::yield();
  }

 private:
  explicit Helpers(int64_t count) {
    try {
      for (int64_t h = 0; h < count; ++h) threads_.emplace_back([this] { serve(); });
    } catch (const std::system_error&) {  // fewer threads than asked for: the callers share what there is
    }
    for (auto& thread : threads_) thread.detach();
  }

  static bool& forked_child() {
    static bool forked = false;
    return forked;
  }

  void serve() {
    uint64_t seen = 0;
    for (;;) {
      seen = wait_for_post(seen);
      active_.fetch_add(1);
      if (Job* job = slot_.load(); job != nullptr && job->joined.fetch_add(1) < job->max_helpers) job->work();
      active_.fetch_sub(1);
    }
  }

  // The post count once it differs from `seen`: spinning (yielding the CPU each turn) for kSpinMicros, then
  // parked until a post wakes it.
  uint64_t wait_for_post(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int turn = 0;; ++turn) {
      if (const uint64_t posts = posts_.load(); posts != seen) return posts;
      sched_yield();
      if (turn % 64 == 63 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    parked_.fetch_add(1);
    wake_.wait(lock, [&] { return posts_.load() != seen; });
    parked_.fetch_sub(1);
    return posts_.load();
  }

  alignas(64) std::atomic<Job*> slot_{nullptr};
  std::atomic<uint64_t> posts_{0};
  alignas(64) std::atomic<int64_t> active_{0};
  std::atomic<int64_t> parked_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
};

}  // namespace detail

// Runs fn(i) for i in [0, n), chunk items at a time, on this thread plus up to max_helpers helpers (no more
// than XLA's pool has threads, less one). Helpers that join after the work is gone return at once, and the
// caller waits only for helpers already inside its job.
template <typename Fn>
void run_parallel(xla::ffi::ThreadPool* pool, int64_t n, int64_t chunk, int64_t max_helpers, const Fn& fn) {
  detail::Job job;
  job.n = n;
  job.chunk = chunk;
  job.call = [](const void* f, int64_t i) { (*static_cast<const Fn*>(f))(i); };
  job.fn = &fn;
  const int64_t threads = pool ? pool->num_threads() : 1;
  job.max_helpers = std::min<int64_t>(threads - 1, max_helpers);
  detail::Helpers* helpers = job.max_helpers > 0 && n > chunk ? &detail::Helpers::get(threads) : nullptr;
  const bool posted = helpers && helpers->post(&job);
  job.work();
  if (posted) helpers->withdraw();
}

}  // namespace paged
