// A small fixed pool: parallel_for hands out contiguous ranges; the calling thread takes one range itself.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>

#include "cpu_ops.h"

namespace lily::cpu {

struct ThreadPool::Shared {
  std::mutex mutex;
  std::condition_variable wake, done;
  const std::function<void(size_t, size_t)>* fn = nullptr;
  size_t n = 0, ranges = 0;
  std::atomic<size_t> next{0};
  size_t finished = 0;
  uint64_t generation = 0;
  bool stopping = false;

  // Run ranges until none is left; returns how many this thread ran.
  size_t run_ranges() {
    size_t ran = 0;
    for (size_t r; (r = next.fetch_add(1)) < ranges; ++ran) (*fn)(n * r / ranges, n * (r + 1) / ranges);
    return ran;
  }
};

ThreadPool::ThreadPool(size_t threads) : shared_(new Shared) {
  for (size_t i = 1; i < threads; ++i) {
    workers_.emplace_back([s = shared_] {
      uint64_t seen = 0;
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(s->mutex);
          s->wake.wait(lock, [&] { return s->stopping || s->generation != seen; });
          if (s->stopping) return;
          seen = s->generation;
        }
        size_t ran = s->run_ranges();
        std::lock_guard<std::mutex> lock(s->mutex);
        s->finished += ran;
        if (s->finished == s->ranges) s->done.notify_all();
      }
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stopping = true;
  }
  shared_->wake.notify_all();
  for (std::thread& t : workers_) t.join();
  delete shared_;
}

void ThreadPool::parallel_for(size_t n, size_t min_items, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  // Up to 4 ranges per thread, taken in turn, so uneven ranges (experts with more tokens) even out.
  const size_t most = (n + std::max<size_t>(min_items, 1) - 1) / std::max<size_t>(min_items, 1);
  const size_t ranges = std::min(4 * size(), most);
  if (workers_.empty() || ranges <= 1) {
    fn(0, n);
    return;
  }
  Shared& s = *shared_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.fn = &fn;
    s.n = n;
    s.ranges = ranges;
    s.next = 0;
    s.finished = 0;
    ++s.generation;
  }
  s.wake.notify_all();
  size_t ran = s.run_ranges();
  std::unique_lock<std::mutex> lock(s.mutex);
  s.finished += ran;
  s.done.wait(lock, [&] { return s.finished == s.ranges; });
}

}  // namespace lily::cpu
