// A small fixed pool: parallel_for hands out contiguous ranges; the calling thread takes ranges itself.
//
// A forward pass runs about 15 parallel_for calls per layer, some of a few microseconds, so a futex wake-up and
// wait per call (tens of microseconds on a busy machine) cost more than the work. Workers therefore spin on the
// job word for a while after each job before they sleep, and the caller spins while the last ranges finish.
//
// Ranges are claimed by a compare-and-swap on one word that holds the job id and the next range: a worker that
// wakes late can never take a range of another job. Before the caller rewrites the job's fields it closes the
// word (next = kClosed, which no range count reaches), so a worker holding stale fields fails its swap.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "cpu_ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace lily::cpu {

namespace {

constexpr uint64_t kRangeBits = 16, kClosed = (uint64_t(1) << kRangeBits) - 1;
// How long an idle worker spins before it sleeps: longer than the serial gaps inside a forward pass, short
// enough that a worker does not hold a CPU for long between decode steps.
constexpr auto kSpin = std::chrono::microseconds(20);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

struct ThreadPool::Shared {
  std::atomic<uint64_t> claim{kClosed};  // job id << kRangeBits | next range (kClosed: being set up)
  std::atomic<const std::function<void(size_t, size_t)>*> fn{nullptr};
  std::atomic<size_t> n{0}, ranges{0}, sleepers{0};
  alignas(64) std::atomic<size_t> finished{0};  // apart from the words the spinning workers read
  std::atomic<bool> stopping{false};
  std::mutex mutex;
  std::condition_variable wake;

  // Run ranges of job `job` until none is left (or another job started).
  void run_ranges(uint64_t job) {
    uint64_t word = claim.load(std::memory_order_acquire);
    for (;;) {
      if (word >> kRangeBits != job) return;
      const size_t r = size_t(word & kClosed), total = ranges.load(std::memory_order_acquire);
      if (r >= total) return;
      const size_t count = n.load(std::memory_order_acquire);
      const auto* f = fn.load(std::memory_order_acquire);
      if (!claim.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) continue;
      (*f)(count * r / total, count * (r + 1) / total);
      finished.fetch_add(1, std::memory_order_release);
      word = claim.load(std::memory_order_acquire);
    }
  }

  // The id of a job newer than `seen`, spinning first, then sleeping; 0 when the pool stops.
  uint64_t next_job(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 1;; ++i) {
      const uint64_t job = claim.load(std::memory_order_acquire) >> kRangeBits;
      if (job != seen) return job;
      if (stopping.load(std::memory_order_acquire)) return 0;
      cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() - start > kSpin) break;
    }
    std::unique_lock<std::mutex> lock(mutex);
    sleepers.fetch_add(1);  // seq_cst: the caller's publish then sleepers load sees this, or we see the job
    uint64_t job = seen;
    wake.wait(lock, [&] {
      job = claim.load() >> kRangeBits;
      return job != seen || stopping.load();
    });
    sleepers.fetch_sub(1);
    return stopping.load() ? 0 : job;
  }
};

ThreadPool::ThreadPool(size_t threads) : shared_(new Shared) {
  for (size_t i = 1; i < threads; ++i) {
    workers_.emplace_back([s = shared_] {
      for (uint64_t seen = 0;;) {
        seen = s->next_job(seen);
        if (seen == 0) return;
        s->run_ranges(seen);
      }
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stopping.store(true);
  }
  shared_->wake.notify_all();
  for (std::thread& t : workers_) t.join();
  delete shared_;
}

void ThreadPool::parallel_for(size_t n, size_t min_items, const std::function<void(size_t, size_t)>& fn,
                              size_t per_thread) {
  if (n == 0) return;
  // More ranges than threads, taken in turn, even out uneven ranges; each range moves the job's cache lines between
  // cores twice.
  const size_t most = (n + std::max<size_t>(min_items, 1) - 1) / std::max<size_t>(min_items, 1);
  const size_t ranges = std::min({std::max<size_t>(per_thread, 1) * size(), most, size_t(kClosed - 1)});
  if (workers_.empty() || ranges <= 1) {
    fn(0, n);
    return;
  }
  Shared& s = *shared_;
  const uint64_t job = ++job_;
  s.claim.store((job - 1) << kRangeBits | kClosed);
  s.fn.store(&fn, std::memory_order_release);
  s.n.store(n, std::memory_order_release);
  s.ranges.store(ranges, std::memory_order_release);
  s.finished.store(0, std::memory_order_release);
  s.claim.store(job << kRangeBits);  // seq_cst, before the sleepers load below
  if (s.sleepers.load() > 0) {
    { std::lock_guard<std::mutex> lock(s.mutex); }  // a worker between its check and its wait gets the notify
    s.wake.notify_all();
  }
  s.run_ranges(job);
  for (size_t i = 1; s.finished.load(std::memory_order_acquire) != ranges; ++i) {
    if (i % 64 == 0) std::this_thread::yield();  // the worker may have lost its CPU
    else cpu_relax();
  }
}

}  // namespace lily::cpu
