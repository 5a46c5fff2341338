// Fiber runtime of the MSL CPU harness: runs one dispatch, one fiber per GPU thread.
//
// A threadgroup runs on one OS thread; its fibers switch only at threadgroup_barrier, SIMD collectives
// and atomic polls, in FIFO or seeded random order. Whole threadgroups are spread over worker threads.
// Faults (barrier divergence, divergent collectives, deadlock, out-of-bounds writes) stop the dispatch
// and are raised as KernelError naming the kernel, threadgroup and thread.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "fibers.h"
#include "msl_rt.h"
#include "registry.h"

namespace msl_rt {
namespace {

constexpr size_t kStackBytes = 128 << 10;     // per GPU thread; kernels keep small register-like locals
constexpr size_t kPageBytes = 4096;           // PROT_NONE page under every stack: overflow faults at once
constexpr uint32_t kMaxThreadsPerTg = 1024;   // Apple GPUs: maxTotalThreadsPerThreadgroup
constexpr size_t kThreadgroupLimit = 32768;   // Apple GPUs: maxThreadgroupMemoryLength
constexpr size_t kTgGuardBytes = 64;          // guard after every threadgroup array
constexpr size_t kBufferGuardBytes = 256;     // guard before and after every device buffer
constexpr uint64_t kSpinLimit = 1u << 20;     // scheduler picks without progress before reporting a deadlock

// Guard byte i: distinctive, position dependent, unlikely to be written by accident.
inline unsigned char guard_byte(size_t i) { return static_cast<unsigned char>(0xA5 ^ (i * 29)); }

std::atomic<uint64_t> g_atomic_writes{0};  // progress made by atomic writes on any worker

// ---- stacks: blocks of mmap'd stacks with guard pages, reused across dispatches ----
struct StackBlock {
  char* base = nullptr;
  size_t count = 0;
  char* stack(size_t i) const { return base + i * (kStackBytes + kPageBytes) + kPageBytes; }
};
std::mutex g_stack_mutex;
std::vector<StackBlock> g_free_stacks;

StackBlock acquire_stacks(size_t count) {
  {
    std::lock_guard<std::mutex> lock(g_stack_mutex);
    for (size_t i = 0; i < g_free_stacks.size(); ++i) {
      if (g_free_stacks[i].count >= count) {
        StackBlock b = g_free_stacks[i];
        g_free_stacks.erase(g_free_stacks.begin() + long(i));
        return b;
      }
    }
  }
  StackBlock b;
  b.count = std::max<size_t>(count, 64);
  size_t bytes = b.count * (kStackBytes + kPageBytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("MSL harness: cannot map fiber stacks");
  b.base = static_cast<char*>(p);
  for (size_t i = 0; i < b.count; ++i) mprotect(b.base + i * (kStackBytes + kPageBytes), kPageBytes, PROT_NONE);
  return b;
}

void release_stacks(StackBlock b) {
  std::lock_guard<std::mutex> lock(g_stack_mutex);
  g_free_stacks.push_back(b);
}

// ---- one dispatch ----
struct Dispatch {
  std::string name;
  const KernelVariant* variant;
  std::vector<void*> buffers;
  uint32_t tgs[3], tpt[3];
  uint32_t n_threads;  // per threadgroup
  uint64_t n_tgs;
  DispatchOptions opts;
  std::vector<std::string> tg_param_keys;
  std::atomic<uint64_t> next_tg{0};
  std::atomic<bool> stop{false};
  std::mutex error_mutex;
  std::string error;
};

enum class State : uint8_t { ready, barrier, simd, done };

struct Worker;

struct Fiber {
  FiberContext ctx;
  Worker* worker;
  State state;
  uint32_t index;  // thread_index_in_threadgroup
  uint32_t tid[3];
  uint32_t lane, simd;
  // while waiting: where, and for collectives what was posted
  const char* site;
  const char* what;
  CombineFn combine;
  void* in;
  void* out;
};

struct SimdGroup {
  uint32_t active = 0;   // lanes that have not returned
  uint32_t arrived = 0;  // lanes waiting in a collective
};

struct TgAlloc {
  const char* key;
  size_t offset, size;
};

struct Worker {
  Dispatch* d;
  FiberContext scheduler;
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simdgroups;
  std::vector<uint32_t> ready;
  size_t ready_head = 0;
  Fiber* current = nullptr;
  uint64_t rng = 0;
  uint32_t at_barrier = 0, done = 0;
  uint32_t greedy_simd = 0;  // DispatchOptions::greedy_simdgroups: the simdgroup whose threads run while ready
  const char* barrier_site = nullptr;
  uint64_t progress = 0;
  bool faulted = false;
  std::string fault;
  uint32_t tg[3];
  StackBlock stacks;
  std::vector<unsigned char> arena;
  size_t arena_used = 0, arena_payload = 0;
  // The arena as the last barrier with mem_threadgroup left it: a barrier without it must find it unchanged.
  std::vector<unsigned char> arena_fenced;
  bool barrier_orders_threadgroup = true;
  std::vector<TgAlloc> allocs;
  std::vector<void*> tg_params;
};

thread_local Worker* tls_worker = nullptr;

uint64_t next_random(uint64_t& s) {  // splitmix64
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string triple(const uint32_t v[3]) {
  return "(" + std::to_string(v[0]) + "," + std::to_string(v[1]) + "," + std::to_string(v[2]) + ")";
}

std::string where(const Worker& w, const Fiber* f) {
  std::string s = "kernel '" + w.d->name + "' threadgroup " + triple(w.tg);
  if (f) s += " thread " + triple(f->tid);
  return s;
}

std::string lane_list(uint32_t mask) {
  std::string s;
  for (uint32_t m = mask; m; m &= m - 1) s += (s.empty() ? "" : ",") + std::to_string(__builtin_ctz(m));
  return "[" + s + "]";
}

// Records a fault and leaves the fiber for good: the scheduler stops the threadgroup.
[[noreturn]] void fault_and_leave(Worker& w, Fiber* f, const std::string& msg) {
  if (!w.faulted) {
    w.faulted = true;
    w.fault = where(w, f) + ": " + msg;
  }
  if (w.current) fiber_switch(w.current->ctx, w.scheduler);
  throw KernelError(w.fault);  // only reached outside a fiber
}

void make_ready(Worker& w, uint32_t i) {
  w.fibers[i].state = State::ready;
  w.ready.push_back(i);
}

void yield(Worker& w) { fiber_switch(w.current->ctx, w.scheduler); }

void complete_collective(Worker& w, uint32_t s) {
  SimdGroup& sg = w.simdgroups[s];
  Fiber* first = &w.fibers[s * kSimdWidth + __builtin_ctz(sg.arrived)];
  void* in[kSimdWidth] = {};
  void* out[kSimdWidth] = {};
  for (uint32_t m = sg.arrived; m; m &= m - 1) {
    Fiber& f = w.fibers[s * kSimdWidth + __builtin_ctz(m)];
    if (f.combine != first->combine || std::strcmp(f.site, first->site) != 0) {
      std::ostringstream msg;
      msg << "divergent SIMD collective in simdgroup " << s << ": lane " << first->lane << " is in " << first->what
          << " at " << first->site << " while lane " << f.lane << " is in " << f.what << " at " << f.site
          << "; lanes of a simdgroup must meet the same collective";
      fault_and_leave(w, &f, msg.str());
    }
    in[f.lane] = f.in;
    out[f.lane] = f.out;
  }
  uint32_t mask = sg.arrived;
  sg.arrived = 0;
  first->combine(in, out, mask);
  for (uint32_t m = mask; m; m &= m - 1) make_ready(w, s * kSimdWidth + __builtin_ctz(m));
  ++w.progress;
}

void release_barrier(Worker& w) {
  if (w.barrier_orders_threadgroup) {
    std::memcpy(w.arena_fenced.data(), w.arena.data(), w.arena_used);
  } else if (std::memcmp(w.arena_fenced.data(), w.arena.data(), w.arena_used) != 0) {
    fault_and_leave(w, w.current,
                    std::string("threadgroup memory was written before the threadgroup_barrier at ") + w.barrier_site +
                        ", whose mem_flags lack mem_threadgroup: other threads may not see the writes on a GPU "
                        "(use mem_flags::mem_threadgroup)");
  }
  for (uint32_t i = 0; i < w.fibers.size(); ++i)
    if (w.fibers[i].state == State::barrier) make_ready(w, i);
  w.at_barrier = 0;
  ++w.progress;
}

Fiber* first_in_state(Worker& w, State s) {
  for (Fiber& f : w.fibers)
    if (f.state == s) return &f;
  return nullptr;
}

void report_returned_while_waiting(Worker& w, Fiber* returned, Fiber* waiting) {
  fault_and_leave(w, returned,
                  "barrier divergence: this thread returned while thread " + triple(waiting->tid) +
                      " waits at threadgroup_barrier (every thread of a threadgroup must reach each barrier)");
}

void fiber_done(Worker& w, Fiber& f) {
  f.state = State::done;
  ++w.done;
  SimdGroup& sg = w.simdgroups[f.simd];
  sg.active &= ~(1u << f.lane);
  ++w.progress;
  if (w.at_barrier) report_returned_while_waiting(w, &f, first_in_state(w, State::barrier));
  if (sg.arrived && sg.arrived == sg.active) complete_collective(w, f.simd);
}

void fiber_main(void* arg) {
  Fiber& f = *static_cast<Fiber*>(arg);
  Worker& w = *f.worker;
  const Dispatch& d = *w.d;
  LaunchArgs L;
  L.buffers = d.buffers.data();
  L.tg_memory = w.tg_params.data();
  for (int k = 0; k < 3; ++k) {
    L.thread_in_tg[k] = f.tid[k];
    L.tg_in_grid[k] = w.tg[k];
    L.threads_per_tg[k] = d.tpt[k];
    L.tgs_per_grid[k] = d.tgs[k];
    L.threads_per_grid[k] = d.tgs[k] * d.tpt[k];
    L.thread_in_grid[k] = w.tg[k] * d.tpt[k] + f.tid[k];
  }
  L.index_in_tg = f.index;
  L.lane = f.lane;
  L.simdgroup = f.simd;
  L.simdgroups_per_tg = (d.n_threads + kSimdWidth - 1) / kSimdWidth;
  d.variant->launch(d.variant->attrs, L);
  fiber_done(w, f);
  fiber_switch(f.ctx, w.scheduler);
  __builtin_trap();  // a finished fiber is never resumed
}

// Nothing is ready and not everyone is done: name what the threads wait for.
void report_stall(Worker& w) {
  for (uint32_t s = 0; s < w.simdgroups.size(); ++s) {
    SimdGroup& sg = w.simdgroups[s];
    if (!sg.arrived) continue;
    Fiber& waiting = w.fibers[s * kSimdWidth + __builtin_ctz(sg.arrived)];
    uint32_t elsewhere = sg.active & ~sg.arrived;
    std::string msg = "divergent SIMD collective in simdgroup " + std::to_string(s) + ": lanes " +
                      lane_list(sg.arrived) + " wait in " + waiting.what + " while lanes " + lane_list(elsewhere) +
                      " wait at threadgroup_barrier";
    fault_and_leave(w, &waiting, msg);
  }
  fault_and_leave(w, first_in_state(w, State::barrier), "deadlock: no thread can make progress");
}

// Runs the threadgroup's fibers until all return or one faults. Faults found here (stall, deadlock) throw.
void schedule(Worker& w) {
  const Dispatch& d = *w.d;
  uint64_t spins = 0, last_progress = 0, last_writes = g_atomic_writes.load(std::memory_order_relaxed);
  while (!w.faulted) {
    if (w.ready_head == w.ready.size()) {
      if (w.done == d.n_threads) break;
      report_stall(w);
    }
    size_t pick = w.ready_head;
    if (d.opts.greedy_simdgroups) {
      while (pick < w.ready.size() && w.fibers[w.ready[pick]].simd != w.greedy_simd) ++pick;
      if (pick == w.ready.size()) {
        pick = w.ready_head + (d.opts.random_schedule ? next_random(w.rng) % (w.ready.size() - w.ready_head) : 0);
        w.greedy_simd = w.fibers[w.ready[pick]].simd;
      }
    } else if (d.opts.random_schedule) {
      pick += next_random(w.rng) % (w.ready.size() - w.ready_head);
    }
    std::swap(w.ready[pick], w.ready[w.ready_head]);
    Fiber& f = w.fibers[w.ready[w.ready_head++]];
    if (w.ready_head > 4096 && w.ready_head * 2 > w.ready.size()) {
      w.ready.erase(w.ready.begin(), w.ready.begin() + long(w.ready_head));
      w.ready_head = 0;
    }
    w.current = &f;
    fiber_switch(w.scheduler, f.ctx);
    w.current = nullptr;
    uint64_t writes = g_atomic_writes.load(std::memory_order_relaxed);
    if (w.progress != last_progress || writes != last_writes) {
      last_progress = w.progress;
      last_writes = writes;
      spins = 0;
    } else if (++spins > kSpinLimit) {
      Fiber* spinner = &f;
      Fiber* waiter = first_in_state(w, State::barrier);
      fault_and_leave(w, spinner,
                      "deadlock: this thread keeps polling an atomic with no progress anywhere" +
                          (waiter ? " while thread " + triple(waiter->tid) + " waits at threadgroup_barrier"
                                  : std::string()));
    }
  }
}

void run_threadgroup(Worker& w, uint64_t linear) {
  Dispatch& d = *w.d;
  w.tg[0] = uint32_t(linear % d.tgs[0]);
  w.tg[1] = uint32_t((linear / d.tgs[0]) % d.tgs[1]);
  w.tg[2] = uint32_t(linear / (uint64_t(d.tgs[0]) * d.tgs[1]));
  w.rng = d.opts.seed * 0x100000001B3ull ^ (linear + 1) * 0x9E3779B97F4A7C15ull;
  w.ready.clear();
  w.ready_head = 0;
  w.at_barrier = w.done = 0;
  w.progress = 0;
  for (auto& sg : w.simdgroups) sg = SimdGroup{};
  for (uint32_t i = 0; i < d.n_threads; ++i) {
    Fiber& f = w.fibers[i];
    f.worker = &w;
    f.index = i;
    f.tid[0] = i % d.tpt[0];
    f.tid[1] = (i / d.tpt[0]) % d.tpt[1];
    f.tid[2] = i / (d.tpt[0] * d.tpt[1]);
    f.lane = i % kSimdWidth;
    f.simd = i / kSimdWidth;
    w.simdgroups[f.simd].active |= 1u << f.lane;
    fiber_init(f.ctx, w.stacks.stack(i), kStackBytes, &fiber_main, &f);
    make_ready(w, i);
  }
  // Threadgroup memory: poisoned (NaN for every float type) or zeroed; [[threadgroup(i)]] parameters first.
  w.allocs.clear();
  w.arena_used = w.arena_payload = 0;
  w.tg_params.assign(d.tg_param_keys.size(), nullptr);
  w.current = nullptr;
  try {
    for (size_t i = 0; i < d.tg_param_keys.size(); ++i)
      if (d.opts.threadgroup_memory_lengths[i])
        w.tg_params[i] = threadgroup_alloc(d.tg_param_keys[i].c_str(), d.opts.threadgroup_memory_lengths[i]);
  } catch (const KernelError&) {
    return;  // w.fault holds the message
  }

  try {
    schedule(w);
  } catch (const KernelError&) {
    return;  // a fault found by the scheduler itself; w.fault holds the message
  }
  if (w.faulted) return;
  for (const TgAlloc& a : w.allocs) {
    for (size_t k = 0; k < kTgGuardBytes; ++k) {
      if (w.arena[a.offset + a.size + k] != guard_byte(k)) {
        w.faulted = true;
        w.fault = where(w, nullptr) + ": out-of-bounds write past the end of threadgroup array '" + a.key + "' (" +
                  std::to_string(a.size) + " bytes), at byte " + std::to_string(a.size + k);
        return;
      }
    }
  }
}

void run_worker(Dispatch& d) {
  Worker w;
  w.d = &d;
  w.fibers.resize(d.n_threads);
  w.simdgroups.resize((d.n_threads + kSimdWidth - 1) / kSimdWidth);
  w.ready.reserve(d.n_threads * 2);
  w.arena.resize(kThreadgroupLimit + 64 * kTgGuardBytes + 64 * 16);
  w.arena_fenced.resize(w.arena.size());
  w.stacks = acquire_stacks(d.n_threads);
  tls_worker = &w;
  while (!d.stop.load()) {
    uint64_t tg = d.next_tg.fetch_add(1);
    if (tg >= d.n_tgs) break;
    run_threadgroup(w, tg);
    if (w.faulted) {
      std::lock_guard<std::mutex> lock(d.error_mutex);
      if (d.error.empty()) d.error = w.fault;
      d.stop = true;
    }
  }
  tls_worker = nullptr;
  release_stacks(w.stacks);
}

Worker& worker_or_die() {
  if (!tls_worker || !tls_worker->current) {
    std::fputs("MSL harness: a kernel function was called outside a dispatch\n", stderr);
    std::abort();
  }
  return *tls_worker;
}

}  // namespace

// ---- kernel-side entry points (msl_rt_kernel.h) ----

void simd_collective(CombineFn combine, void* in, void* out, const char* site, const char* what) {
  Worker& w = worker_or_die();
  Fiber& f = *w.current;
  f.combine = combine;
  f.in = in;
  f.out = out;
  f.site = site;
  f.what = what;
  f.state = State::simd;
  SimdGroup& sg = w.simdgroups[f.simd];
  sg.arrived |= 1u << f.lane;
  for (uint32_t m = sg.active & ~sg.arrived; w.at_barrier && m; m &= m - 1) {
    Fiber& other = w.fibers[f.simd * kSimdWidth + __builtin_ctz(m)];
    if (other.state == State::barrier)
      fault_and_leave(w, &f, std::string("divergent SIMD collective: this thread is in ") + what + " while thread " +
                                 triple(other.tid) + " of the same simdgroup waits at threadgroup_barrier");
  }
  if (sg.arrived == sg.active) complete_collective(w, f.simd);
  yield(w);
}

void threadgroup_barrier(const char* site, bool orders_threadgroup) {
  Worker& w = worker_or_die();
  Fiber& f = *w.current;
  if (w.done) {
    Fiber* returned = first_in_state(w, State::done);
    fault_and_leave(w, &f, "barrier divergence: this thread waits at threadgroup_barrier while thread " +
                               triple(returned->tid) + " has returned");
  }
  if (w.at_barrier && std::strcmp(site, w.barrier_site) != 0) {
    Fiber* other = first_in_state(w, State::barrier);
    fault_and_leave(w, &f, std::string("barrier divergence: this thread waits at the threadgroup_barrier at ") + site +
                               " while thread " + triple(other->tid) + " waits at the one at " + w.barrier_site);
  }
  SimdGroup& sg = w.simdgroups[f.simd];
  if (sg.arrived) {
    Fiber& in_collective = w.fibers[f.simd * kSimdWidth + __builtin_ctz(sg.arrived)];
    fault_and_leave(w, &in_collective,
                    std::string("divergent SIMD collective: this thread is in ") + in_collective.what +
                        " while thread " + triple(f.tid) + " of the same simdgroup waits at threadgroup_barrier");
  }
  f.state = State::barrier;
  f.site = site;
  w.barrier_site = site;
  w.barrier_orders_threadgroup = orders_threadgroup;  // one site, one set of flags
  if (++w.at_barrier == w.fibers.size()) release_barrier(w);
  yield(w);
}

void yield_for_atomic() {
  Worker& w = worker_or_die();
  w.ready.push_back(w.current->index);
  yield(w);
}

void note_progress() { g_atomic_writes.fetch_add(1, std::memory_order_relaxed); }

uint32_t current_lane() { return worker_or_die().current->lane; }

void* threadgroup_alloc(const char* key, size_t size) {
  Worker& w = *tls_worker;
  for (const TgAlloc& a : w.allocs)
    if (std::strcmp(a.key, key) == 0) return w.arena.data() + a.offset;
  size_t offset = (w.arena_used + 15) & ~size_t(15);
  w.arena_payload += size;
  if (w.arena_payload > kThreadgroupLimit || offset + size + kTgGuardBytes > w.arena.size())
    fault_and_leave(w, w.current,
                    "threadgroup memory of " + std::to_string(w.arena_payload) + " bytes exceeds the 32 KB limit");
  std::memset(w.arena.data() + offset, w.d->opts.poison_threadgroup_memory ? 0xFF : 0, size);
  for (size_t k = 0; k < kTgGuardBytes; ++k) w.arena[offset + size + k] = guard_byte(k);
  std::memcpy(w.arena_fenced.data() + offset, w.arena.data() + offset, size + kTgGuardBytes);
  w.allocs.push_back(TgAlloc{key, offset, size});
  w.arena_used = offset + size + kTgGuardBytes;
  return w.arena.data() + offset;
}

void kernel_fault(const char* what) {
  Worker& w = *tls_worker;
  fault_and_leave(w, w.current, what);
}

// ---- dispatch ----
namespace {

std::string kernel_desc(const std::string& name) { return "kernel '" + name + "'"; }

const KernelVariant& select_variant(const std::string& name, const std::vector<KernelVariant>& variants,
                                    const std::map<int, int64_t>& constants) {
  const std::vector<FcState>& declared = variants.front().constants;
  for (auto& [index, value] : constants) {
    bool known = false;
    for (const FcState& fc : declared) known |= fc.index == index;
    if (!known) {
      std::string list;
      for (const FcState& fc : declared) list += (list.empty() ? "" : ", ") + std::to_string(fc.index);
      throw std::invalid_argument(kernel_desc(name) + " has no function constant with index " +
                                  std::to_string(index) + " (declared: " + (list.empty() ? "none" : list) + ")");
    }
    if (value != 0 && value != 1)
      throw std::invalid_argument(kernel_desc(name) + ": function constant " + std::to_string(index) +
                                  " is a bool; got " + std::to_string(value));
  }
  for (const KernelVariant& v : variants) {
    bool match = true;
    for (const FcState& fc : v.constants) {
      auto it = constants.find(fc.index);
      bool defined = it != constants.end();
      match &= fc.defined == defined && (!defined || fc.value == (it->second != 0));
    }
    if (match) return v;
  }
  throw std::logic_error(kernel_desc(name) + ": no compiled variant for these function constants");
}

void check_geometry(const std::string& name, const uint32_t tgs[3], const uint32_t tpt[3]) {
  for (int k = 0; k < 3; ++k) {
    if (tgs[k] == 0 || tpt[k] == 0)
      throw std::invalid_argument(kernel_desc(name) + ": threadgroups " + triple(tgs) +
                                  " and threads_per_threadgroup " + triple(tpt) + " must all be >= 1");
  }
  uint64_t n = uint64_t(tpt[0]) * tpt[1] * tpt[2];
  if (n > kMaxThreadsPerTg)
    throw std::invalid_argument(kernel_desc(name) + ": threads_per_threadgroup " + triple(tpt) + " has " +
                                std::to_string(n) + " threads; the limit is 1024");
}

void check_bindings(const std::string& name, const KernelVariant& v, const std::vector<Binding>& buffers,
                    const DispatchOptions& opts) {
  for (size_t p = 0; p < v.params.size(); ++p) {
    const ParamAttr& a = v.attrs[p];
    const ParamInfo& info = v.params[p];
    std::string param = kernel_desc(name) + " parameter " + std::to_string(p);
    if (a.kind == Attr::buffer) {
      std::string slot = param + " [[buffer(" + std::to_string(a.index) + ")]]";
      if (info.kind == ParamKind::value) throw std::invalid_argument(slot + " must be a pointer or reference");
      if (size_t(a.index) >= buffers.size())
        throw std::invalid_argument(slot + " is not bound: only " + std::to_string(buffers.size()) +
                                    " args were given");
      const Binding& b = buffers[size_t(a.index)];
      // setBytes data for a struct must be exactly the struct; a buffer bound to it may be longer.
      if (info.kind == ParamKind::reference &&
          (b.is_bytes ? b.size != info.pointee_size : b.size < info.pointee_size))
        throw std::invalid_argument(slot + " expects " + std::to_string(info.pointee_size) +
                                    " bytes (one struct from metal/lily.h); got " + std::to_string(b.size));
      // A GPU faults on a load through a pointer not aligned to its pointee (setBytes data: the copy is aligned).
      const size_t alignment = buffer_alignment(info);
      if (!b.is_bytes && reinterpret_cast<uintptr_t>(b.data) % alignment)
        throw std::invalid_argument(slot + " is not aligned to its " + std::to_string(alignment) +
                                    "-byte elements (a GPU faults on such a load)");
    } else if (a.kind == Attr::threadgroup_memory) {
      std::string slot = param + " [[threadgroup(" + std::to_string(a.index) + ")]]";
      if (info.kind != ParamKind::pointer) throw std::invalid_argument(slot + " must be a pointer");
      if (size_t(a.index) >= opts.threadgroup_memory_lengths.size() ||
          opts.threadgroup_memory_lengths[size_t(a.index)] == 0)
        throw std::invalid_argument(slot + " needs a threadgroup memory length");
      if (opts.threadgroup_memory_lengths[size_t(a.index)] % 16)
        throw std::invalid_argument(slot + ": threadgroup memory lengths must be multiples of 16 bytes");
    } else if (info.kind != ParamKind::value) {
      throw std::invalid_argument(param + ": a position attribute on a pointer or reference parameter");
    }
  }
}

// The pointers a kernel gets after GuardedBuffers copied them keep the alignment check_bindings checked (the copies
// keep each address modulo 64; this is what shows if not).
void check_copied_alignment(const std::string& name, const KernelVariant& v, const std::vector<void*>& bound) {
  for (size_t p = 0; p < v.params.size(); ++p) {
    if (v.attrs[p].kind != Attr::buffer) continue;
    const size_t i = size_t(v.attrs[p].index), alignment = buffer_alignment(v.params[p]);
    if (reinterpret_cast<uintptr_t>(bound[i]) % alignment)
      throw std::logic_error(kernel_desc(name) + " [[buffer(" + std::to_string(i) + ")]]: the harness's guarded copy " +
                             "moved an aligned buffer off its " + std::to_string(alignment) + "-byte alignment");
  }
}

// Device buffers copied between guard regions (and setBytes data copied, as Metal does at encode time).
// Bindings whose byte ranges overlap (one array bound twice, or one Metal buffer bound at several
// offsets) share one copy, so writes through one are seen through the others.
struct GuardedBuffers {
  struct Region {
    unsigned char* source;  // start of the merged range in the caller's memory
    size_t size;
    size_t last_binding;    // the binding whose range ends last: named when the guard after it changed
    size_t first_binding;   // the binding whose range starts first
    bool is_bytes;
    std::unique_ptr<unsigned char[]> storage;
    unsigned char* data;
  };
  std::vector<Region> regions;

  GuardedBuffers(const std::vector<Binding>& buffers, bool guard, std::vector<void*>& bound) {
    bound.assign(buffers.size(), nullptr);
    std::vector<size_t> order;
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (buffers[i].is_bytes || guard) order.push_back(i);
      else bound[i] = buffers[i].data;
    }
    auto lo = [&](size_t i) { return static_cast<unsigned char*>(buffers[i].data); };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lo(a) < lo(b); });
    std::vector<size_t> region_of(buffers.size());
    size_t open = SIZE_MAX;  // the device region that later (higher) ranges may still overlap
    for (size_t i : order) {
      const Binding& b = buffers[i];
      Region* r = open == SIZE_MAX ? nullptr : &regions[open];
      if (!b.is_bytes && b.size && r && lo(i) < r->source + r->size) {
        if (lo(i) + b.size >= r->source + r->size) {
          r->size = size_t(lo(i) + b.size - r->source);
          r->last_binding = i;
        }
        region_of[i] = open;
        continue;
      }
      regions.push_back(Region{lo(i), b.size, i, i, b.is_bytes, nullptr, nullptr});
      region_of[i] = regions.size() - 1;
      if (!b.is_bytes && b.size) open = regions.size() - 1;
    }
    for (Region& r : regions) {
      // The copy keeps the source's address modulo 64, so every bound pointer keeps the alignment the caller gave
      // it: a 16-byte load that is aligned on the GPU stays aligned here (an optimised build's aligned vector load
      // faulted on a copy that had moved a 16-byte-aligned code tensor to 12 past 16). setBytes data starts on 64,
      // as a GPU driver's copy of it does.
      r.storage.reset(new unsigned char[r.size + 2 * kBufferGuardBytes + 128]);
      auto base = reinterpret_cast<uintptr_t>(r.storage.get());
      const uintptr_t phase = r.is_bytes ? 0 : reinterpret_cast<uintptr_t>(r.source) % 64;
      r.data = reinterpret_cast<unsigned char*>(((base + 63) & ~uintptr_t(63)) + kBufferGuardBytes + phase);
      for (size_t k = 0; k < kBufferGuardBytes; ++k) {
        r.data[-1 - long(k)] = guard_byte(k);
        r.data[r.size + k] = guard_byte(k);
      }
      if (r.size) std::memcpy(r.data, r.source, r.size);
    }
    for (size_t i : order) {
      Region& r = regions[region_of[i]];
      bound[i] = r.data + (lo(i) - r.source);
    }
  }

  // Reports the first out-of-bounds write (by buffer index), then copies results back.
  void check_and_copy_back(const std::string& name, bool copy_back) {
    for (const Region& r : regions) {
      for (size_t k = 0; k < kBufferGuardBytes; ++k) {
        if (r.data[r.size + k] != guard_byte(k))
          throw KernelError("kernel '" + name + "': out-of-bounds write to buffer(" + std::to_string(r.last_binding) +
                            ") (" + std::to_string(r.size) + " bytes): byte " + std::to_string(k) +
                            " past its end changed");
        if (r.data[-1 - long(k)] != guard_byte(k))
          throw KernelError("kernel '" + name + "': out-of-bounds write to buffer(" +
                            std::to_string(r.first_binding) + "): byte " + std::to_string(k + 1) +
                            " before its start changed");
      }
    }
    if (!copy_back) return;
    for (const Region& r : regions)
      if (!r.is_bytes && r.size) std::memcpy(r.source, r.data, r.size);
  }
};

}  // namespace

// Kernels run to completion, by host name, since the process started (tests/kernels/test_registry.py: a kernel
// counts as tested only when a test ran it).
std::mutex& execution_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<std::string, uint64_t>& execution_counts() {
  static std::map<std::string, uint64_t> counts;
  return counts;
}

std::map<std::string, uint64_t> executions() {
  std::lock_guard<std::mutex> lock(execution_mutex());
  return execution_counts();
}

void dispatch(const std::string& name, const std::vector<Binding>& buffers, const uint32_t tgs[3],
              const uint32_t tpt[3], const std::map<int, int64_t>& constants, const DispatchOptions& opts) {
  if (!registration_errors().empty()) throw std::logic_error("MSL harness: " + registration_errors().front());
  const std::vector<KernelVariant>* variants = find_kernel(name);
  if (!variants)
    throw std::invalid_argument("unknown kernel '" + name + "' (see lily._ext.msl.kernel_names() for the " +
                                std::to_string(kernel_names().size()) + " instantiated host names)");
  check_geometry(name, tgs, tpt);
  const KernelVariant& variant = select_variant(name, *variants, constants);
  check_bindings(name, variant, buffers, opts);

  Dispatch d;
  d.name = name;
  d.variant = &variant;
  d.opts = opts;
  for (int k = 0; k < 3; ++k) {
    d.tgs[k] = tgs[k];
    d.tpt[k] = tpt[k];
  }
  d.n_threads = tpt[0] * tpt[1] * tpt[2];
  d.n_tgs = uint64_t(tgs[0]) * tgs[1] * tgs[2];
  for (size_t i = 0; i < opts.threadgroup_memory_lengths.size(); ++i)
    d.tg_param_keys.push_back("[[threadgroup(" + std::to_string(i) + ")]]");
  GuardedBuffers guarded(buffers, opts.guard, d.buffers);
  check_copied_alignment(name, variant, d.buffers);

  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  uint64_t n_workers = std::min<uint64_t>(opts.workers ? opts.workers : hw, d.n_tgs);
  std::vector<std::thread> threads;
  for (uint64_t i = 1; i < n_workers; ++i) threads.emplace_back(run_worker, std::ref(d));
  run_worker(d);  // the calling thread is worker 0
  for (auto& t : threads) t.join();

  guarded.check_and_copy_back(name, d.error.empty());
  if (!d.error.empty()) throw KernelError(d.error);
  std::lock_guard<std::mutex> lock(execution_mutex());
  ++execution_counts()[name];
}

}  // namespace msl_rt
