// The work-sharing pool of thread_pool.cpp, as the other kernel sources call it:
// `parallel_for(n, fn, ctx)` runs fn(ctx, chunk, worker) for chunk in [0, n) on the
// caller and the pool's running helpers (each chunk once; returns when all are done);
// `for_rows` splits rows between the pool and OpenMP's team, whichever the step runs;
// `run_items` does the same for separately costed work items.
#pragma once
#include <algorithm>
#include <cstdint>

#include <omp.h>

namespace pr {
using ChunkFn = void (*)(void* ctx, int64_t chunk, int worker);
void parallel_for(int64_t n, ChunkFn fn, void* ctx);
int pool_helpers();

// body(begin, end) over row ranges covering [0, rows), in parallel when `worth` it: on the pool
// in decode-sized steps (the executor gives torch's OpenMP one thread there and the pool's helpers
// spin between kernels), else on the OpenMP team (prefill: the helpers sleep, OpenMP's threads spin).
template <class Body>
void for_rows(int64_t rows, bool worth, const Body& body) {
  const int team = omp_get_max_threads();
  const int64_t threads = !worth ? 1 : team > 1 ? team : pool_helpers() + 1;
  const int64_t n = std::min<int64_t>(rows, threads);
  if (n <= 1) {
    body(int64_t(0), rows);
  } else if (team > 1) {
#pragma omp parallel for schedule(static) num_threads(n)
    for (int64_t i = 0; i < n; ++i) body(rows * i / n, rows * (i + 1) / n);
  } else {
    struct Ctx {
      const Body* body;
      int64_t rows, n;
    } ctx{&body, rows, n};
    parallel_for(n, [](void* c, int64_t i, int) {
      const Ctx& x = *static_cast<const Ctx*>(c);
      (*x.body)(x.rows * i / x.n, x.rows * (i + 1) / x.n);
    }, &ctx);
  }
}

// body(i) for items [0, n) (dynamic: items may differ in cost) on the pool in decode-sized steps
// (torch's OpenMP has one thread) or on the OpenMP team.
template <class Body>
void run_items(int64_t n, const Body& body) {
  if (n <= 0) return;
  const int team = omp_get_max_threads();
  if (n == 1) {
    body(int64_t(0));
  } else if (team > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    parallel_for(n, [](void* c, int64_t i, int) { (*static_cast<const Body*>(c))(i); },
                 const_cast<Body*>(&body));
  }
}
}  // namespace pr
