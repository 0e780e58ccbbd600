// The int8 kernel's own fork-join thread pool: parallel_for(n, grain, fn) runs fn(i0, i1) over chunks of 0 .. n - 1
// on the calling thread and up to at::get_num_threads() - 1 workers.
//
// Why not OpenMP (at::parallel_for): its loop gives each thread one fixed share and waits at the end for every
// share. On a machine whose cores are shared with other processes a descheduled thread holds its share, and every
// region of a forward (about six per layer) waits out a scheduler time slice: at 2 threads beside three busy
// processes a forward of 16 tokens took twice as long as on one thread. Here
//   - each thread owns a contiguous share of the chunks (one stream of weights per thread, as a static split
//     reads them) and claims them one at a time from its share's counter; a thread whose share is done takes
//     chunks from the other shares' counters. A worker that is not running claims nothing: the caller does its
//     share too, and waits only for chunks already claimed;
//   - idle workers spin for a bounded time (SPIN_US, longer than the gaps between the regions of one forward),
//     then sleep on a condition variable, so a pool between forwards uses no CPU.
// Which thread computes a chunk never changes its result: callers give each chunk outputs of its own and compute
// every output in a fixed order, so a token's bits do not depend on the split.
#pragma once

#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace leaplm_pool {

constexpr int SPIN_US = 200;     // an idle worker's spin before it sleeps; the gaps inside a forward are shorter

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

class Pool {
 public:
  explicit Pool(int threads) : pid_(getpid()), shares_(threads) {
    for (int i = 1; i < threads; ++i) threads_.emplace_back([this, i] { work(i); });
  }

  int size() const { return int(shares_.size()); }
  pid_t pid() const { return pid_; }

  // fn(i0, i1) over chunks [c * grain, min(n, (c + 1) * grain)), on this thread and the workers; returns when
  // every chunk is done. Not reentrant: the caller holds `busy`.
  template <typename F>
  void run(int64_t n, int64_t grain, const F& fn) {
    fn_ = [](const void* f, int64_t a, int64_t b) { (*static_cast<const F*>(f))(a, b); };
    ctx_ = &fn;
    n_ = n;
    grain_ = grain;
    const int64_t chunks = (n + grain - 1) / grain, P = size();
    for (int64_t i = 0; i < P; ++i) {
      shares_[i].next.store(chunks * i / P, std::memory_order_relaxed);
      shares_[i].end = chunks * (i + 1) / P;
    }
    open_.store(true, std::memory_order_seq_cst);            // the job's fields above are visible to a worker that
    gen_.fetch_add(1, std::memory_order_seq_cst);             // sees the job open
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    std::exception_ptr mine;
    try {
      claim(0);
    } catch (...) {
      mine = std::current_exception();
      stop_all();
    }
    open_.store(false, std::memory_order_seq_cst);            // no worker enters after this ...
    for (int spin = 0; inside_.load(std::memory_order_seq_cst) > 0; ++spin) {   // ... and those inside finish
      if (spin < 4096) cpu_relax();
      else std::this_thread::yield();                         // a descheduled worker holds a chunk: let it run
    }
    std::exception_ptr theirs = error_;
    error_ = nullptr;
    if (mine) std::rethrow_exception(mine);
    if (theirs) std::rethrow_exception(theirs);
  }

  std::atomic_flag busy = ATOMIC_FLAG_INIT;                   // one caller at a time; others run serially

 private:
  struct alignas(64) Share {                                  // one thread's chunks [next, end), a line of its own
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  using Trampoline = void (*)(const void*, int64_t, int64_t);
  Trampoline fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
  std::atomic<bool> open_{false};                             // a job is running: workers may enter
  std::atomic<int> inside_{0};                                // workers inside the job's chunks
  std::atomic<uint64_t> gen_{0};                              // bumped per job: wakes the workers
  std::atomic<int> sleeping_{0};
  std::exception_ptr error_;                                  // a worker's exception (the first), for the caller
  std::mutex error_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  pid_t pid_;
  std::vector<Share> shares_;                                 // one per thread: 0 the caller, i worker i
  std::vector<std::thread> threads_;

  // thread `me`'s share, then the others' in turn
  void claim(int me) {
    const int P = size();
    for (int k = 0; k < P; ++k) {
      Share& s = shares_[(me + k) % P];
      for (;;) {
        const int64_t c = s.next.fetch_add(1, std::memory_order_relaxed);
        if (c >= s.end) break;
        const int64_t i0 = c * grain_;
        fn_(ctx_, i0, std::min(n_, i0 + grain_));
      }
    }
  }

  void stop_all() {                                           // nobody starts another chunk
    for (auto& s : shares_) s.next.store(s.end, std::memory_order_relaxed);
  }

  void work(int me) {
    uint64_t seen = gen_.load();
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int spin = 0; gen_.load(std::memory_order_acquire) == seen; ++spin) {
        cpu_relax();
        if ((spin & 63) == 63 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(SPIN_US)) {
          std::unique_lock<std::mutex> lk(mu_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lk, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
          break;
        }
      }
      seen = gen_.load(std::memory_order_acquire);
      inside_.fetch_add(1, std::memory_order_seq_cst);        // registered first, then the job checked: the caller
      if (open_.load(std::memory_order_seq_cst)) {            // waits for this worker, or the worker sees it closed
        try {
          claim(me);
        } catch (...) {
          std::lock_guard<std::mutex> lk(error_mu_);
          if (!error_) error_ = std::current_exception();
          stop_all();
        }
      }
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
};

// The process's pool for `threads` threads, one per thread count, made on first use (a pool made before a fork
// has no threads in the child: the child makes its own). Pools are never destroyed: their threads sleep when idle
// and end with the process.
inline Pool* pool_for(int threads) {
  constexpr int MAX_THREADS = 256;
  static std::mutex mu;
  static std::atomic<Pool*> pools[MAX_THREADS + 1] = {};
  if (threads > MAX_THREADS) return nullptr;
  Pool* p = pools[threads].load(std::memory_order_acquire);
  if (p != nullptr && p->pid() == getpid()) return p;
  std::lock_guard<std::mutex> lk(mu);
  p = pools[threads].load(std::memory_order_acquire);
  if (p == nullptr || p->pid() != getpid()) {
    p = new Pool(threads);
    pools[threads].store(p, std::memory_order_release);
  }
  return p;
}

// fn(i0, i1) over 0 .. n - 1 in chunks of `grain`, split across torch's threads when there are two chunks or more;
// on the calling thread alone when torch has one thread or the pool is in use by another caller.
template <typename F>
void parallel_for(int64_t n, int64_t grain, const F& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int threads = at::get_num_threads();
  if (threads < 2 || n <= grain) return fn(0, n);
  Pool* p = pool_for(threads);
  if (p == nullptr || p->busy.test_and_set(std::memory_order_acquire)) return fn(0, n);
  struct Release {
    Pool* p;
    ~Release() { p->busy.clear(std::memory_order_release); }
  } release{p};
  p->run(n, grain, fn);
}

}  // namespace leaplm_pool
