// A work-sharing thread pool for the decode kernels, built so that one slow
// thread on a shared host does not stall the call.
//
// An OpenMP region ends at a barrier that every thread of its team must reach:
// a team thread whose core another process holds delays the whole region by a
// scheduler time slice (milliseconds), even under dynamic scheduling. Here the
// caller publishes a job of `n` independent chunks and starts claiming them
// itself; helper threads that are running (spinning briefly after their last
// job, then asleep on a futex) claim chunks too. A helper that wakes late finds
// nothing left and never touches the job, so the call waits only for chunks
// actually taken, and with several chunks per thread one stalled helper delays
// at most the chunk it holds.
//
// Claims are a compare-and-swap on one word (generation << 32 | next chunk):
// a helper reads the job fields of the generation it saw, and its claim
// succeeds only if that generation is still current, so a stale helper cannot
// run a chunk of the wrong job. Helpers are not pinned to CPUs (a pinned thread
// whose core is busy cannot move); `pr_pool_start` may restrict them to a set
// of CPUs (one per physical core). One job at a time: a second concurrent
// caller runs its chunks inline.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <ctime>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "thread_pool.h"   // ChunkFn, parallel_for, pool_helpers

#ifdef __linux__
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PR_PAUSE() _mm_pause()
#else
#define PR_PAUSE() std::this_thread::yield()
#endif

namespace pr {

namespace {
struct Job {
  std::atomic<ChunkFn> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<int64_t> n{0};
};

struct Pool {
  alignas(64) std::atomic<uint64_t> state{0};  // generation << 32 | next chunk
  alignas(64) std::atomic<uint32_t> gen32{0};  // futex word: the latest generation
  std::atomic<int> sleepers{0};
  alignas(64) std::atomic<int64_t> done[2];
  Job jobs[2];
  std::atomic<bool> stop{false};
  std::atomic<int64_t> spin_ns{200000};
  std::atomic<int> active{1};  // threads that take part (caller included): helpers 1 .. active - 1
  std::vector<std::thread> workers;
  std::mutex busy;     // held by the one caller running a job
  std::mutex control;  // start/stop
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: helpers may outlive static destructors
  return *p;
}

// Sleep while *w == expected (at most timeout_ms when > 0), or until woken.
inline void futex_wait(std::atomic<uint32_t>* w, uint32_t expected, int timeout_ms = 0) {
#ifdef __linux__
  struct timespec ts = {timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAIT_PRIVATE, expected, timeout_ms > 0 ? &ts : nullptr,
          nullptr, 0);
#else
  (void)w, (void)expected, (void)timeout_ms;
  std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>* w) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)w;
#endif
}

// Claim and run chunks of generation g until none is left (or g is over).
void work(Pool& p, uint32_t g, int worker) {
  Job& job = p.jobs[g & 1];
  uint64_t s = p.state.load(std::memory_order_acquire);
  while (uint32_t(s >> 32) == g) {
    const ChunkFn fn = job.fn.load(std::memory_order_relaxed);
    void* ctx = job.ctx.load(std::memory_order_relaxed);
    const int64_t n = job.n.load(std::memory_order_relaxed);
    const int64_t idx = int64_t(s & 0xffffffffu);
    if (idx >= n) return;
    if (!p.state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    fn(ctx, idx, worker);
    p.done[g & 1].fetch_add(1, std::memory_order_acq_rel);
    s = p.state.load(std::memory_order_acquire);
  }
}

void helper_main(int worker, std::vector<int> cpus) {
#ifdef __linux__
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : cpus) CPU_SET(c, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
#else
  (void)cpus;
#endif
  Pool& p = pool();
  uint32_t seen = p.gen32.load(std::memory_order_acquire);
  while (!p.stop.load(std::memory_order_acquire)) {
    uint32_t g = p.gen32.load(std::memory_order_acquire);
    if (worker >= p.active.load(std::memory_order_relaxed)) {  // not taking part: sleep, skipping jobs
      seen = g;
      futex_wait(&p.gen32, seen, 20);  // (a wake from pr_pool_set_active may come just before)
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t spin = p.spin_ns.load(std::memory_order_relaxed);
    for (int i = 0; g == seen; ++i) {  // spin a while for the next job
      PR_PAUSE();
      g = p.gen32.load(std::memory_order_acquire);
      if ((i & 63) == 63 && std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - t0).count() > spin) break;
    }
    if (g == seen) {  // idle: sleep until the next job
      p.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (p.gen32.load(std::memory_order_seq_cst) == seen && !p.stop.load()) futex_wait(&p.gen32, seen);
      p.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      continue;
    }
    seen = g;
    work(p, g, worker);
  }
}
}  // namespace

// Run fn(ctx, i, worker) for i in [0, n), sharing the chunks with the pool's helpers;
// `worker` in [0, pool size] identifies the thread (0: the caller) for scratch buffers.
void parallel_for(int64_t n, ChunkFn fn, void* ctx) {
  Pool& p = pool();
  if (n <= 0) return;
  std::unique_lock<std::mutex> lock(p.busy, std::try_to_lock);
  if (n == 1 || p.active.load(std::memory_order_relaxed) <= 1 || !lock.owns_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i, 0);
    return;
  }
  const uint32_t g = uint32_t(p.state.load(std::memory_order_relaxed) >> 32) + 1;
  Job& job = p.jobs[g & 1];
  job.fn.store(fn, std::memory_order_relaxed);
  job.ctx.store(ctx, std::memory_order_relaxed);
  job.n.store(n, std::memory_order_relaxed);
  p.done[g & 1].store(0, std::memory_order_relaxed);
  p.state.store(uint64_t(g) << 32, std::memory_order_release);
  p.gen32.store(g, std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&p.gen32);
  work(p, g, 0);
  for (int i = 0; p.done[g & 1].load(std::memory_order_acquire) < n; ++i) {
    if (i < 4096) PR_PAUSE();
    else std::this_thread::yield();  // a helper holds a chunk: let it run if it shares our CPU
  }
}

// Helpers taking part in jobs now (not counting the caller).
int pool_helpers() { return pool().active.load(std::memory_order_relaxed) - 1; }
}  // namespace pr

extern "C" {

// (Re)start the pool with `threads` - 1 helpers (threads counts the caller), each
// allowed on `cpus` (ncpus of them; 0: no restriction); helpers spin `spin_us`
// microseconds after a job before sleeping. Returns the number of helpers.
int pr_pool_start(int threads, const int* cpus, int ncpus, int spin_us) {
  pr::Pool& p = pr::pool();
  std::lock_guard<std::mutex> ctl(p.control);
  std::lock_guard<std::mutex> job(p.busy);
  // stop: an empty generation wakes every helper (spinning or asleep); they see `stop` and exit
  p.stop.store(true);
  const uint32_t g = uint32_t(p.state.load() >> 32) + 1;
  p.jobs[g & 1].n.store(0);
  p.state.store(uint64_t(g) << 32);
  p.gen32.store(g);
  pr::futex_wake_all(&p.gen32);
  for (auto& t : p.workers) t.join();
  p.workers.clear();
  p.stop.store(false);
  p.spin_ns.store(int64_t(std::max(0, spin_us)) * 1000);
  std::vector<int> set(cpus, cpus + std::max(0, ncpus));
  for (int w = 1; w < threads; ++w) p.workers.emplace_back(pr::helper_main, w, set);
  p.active.store(int(p.workers.size()) + 1);
  return int(p.workers.size());
}

// Let only `threads` threads (the caller and helpers 1 .. threads - 1) take part
// from the next job on, e.g. fewer while other processes keep cores busy; the
// others sleep. Clamped to [1, helpers + 1]; returns the value set.
int pr_pool_set_active(int threads) {
  pr::Pool& p = pr::pool();
  const int n = std::max(1, std::min(threads, int(p.workers.size()) + 1));
  if (p.active.exchange(n) < n) pr::futex_wake_all(&p.gen32);  // sleepers that now take part
  return n;
}

// How long idle helpers spin after a job before sleeping (0: sleep at once), from
// the next job on: a spinning helper holds a core the caller's OpenMP team may need.
void pr_pool_set_spin(int spin_us) { pr::pool().spin_ns.store(int64_t(std::max(0, spin_us)) * 1000); }

int pr_pool_helpers() { return pr::pool_helpers(); }
}
