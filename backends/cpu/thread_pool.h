// The work-sharing pool of thread_pool.cpp, as the other kernel sources call it:
// `parallel_for(n, fn, ctx)` runs fn(ctx, chunk, worker) for chunk in [0, n) on the
// caller and the pool's running helpers (each chunk once; returns when all are done).
#pragma once
#include <cstdint>

namespace pr {
using ChunkFn = void (*)(void* ctx, int64_t chunk, int worker);
void parallel_for(int64_t n, ChunkFn fn, void* ctx);
int pool_helpers();
}  // namespace pr
