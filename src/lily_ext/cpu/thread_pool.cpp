// A small fixed pool: parallel_for hands out contiguous ranges; the calling thread takes ranges itself. Ranges are
// taken and counted under the lock, each tagged with its job's generation, so a worker that wakes late can never run
// or count a range of another job.
#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "cpu_ops.h"

namespace lily::cpu {

struct ThreadPool::Shared {
  std::mutex mutex;
  std::condition_variable wake, done;
  const std::function<void(size_t, size_t)>* fn = nullptr;
  size_t n = 0, ranges = 0, next = 0, finished = 0;
  uint64_t generation = 0;
  bool stopping = false;

  // Run ranges of job `job` until none is left (or another job started).
  void run_ranges(uint64_t job) {
    for (;;) {
      size_t r, count, total;
      const std::function<void(size_t, size_t)>* f;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (generation != job || next >= ranges) return;
        r = next++;
        count = n;
        total = ranges;
        f = fn;
      }
      (*f)(count * r / total, count * (r + 1) / total);
      std::lock_guard<std::mutex> lock(mutex);
      if (++finished == ranges) done.notify_all();
    }
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
        s->run_ranges(seen);
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
  uint64_t job;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.fn = &fn;
    s.n = n;
    s.ranges = ranges;
    s.next = 0;
    s.finished = 0;
    job = ++s.generation;
  }
  s.wake.notify_all();
  s.run_ranges(job);
  std::unique_lock<std::mutex> lock(s.mutex);
  s.done.wait(lock, [&] { return s.finished == s.ranges; });
}

}  // namespace lily::cpu
