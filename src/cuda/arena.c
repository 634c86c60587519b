/* The CUDA backend's device memory. Across processes (one rank per process,
 * epx_world_create_rank*), a peer can only reach memory it mapped, once, at comm init: so each
 * rank makes one arena (cudaMalloc, exported with CUDA IPC: transport_ipc.c) and carves from it
 * everything a peer reads. In one process, memory comes from the world's stream-ordered pools. */
#include <stdlib.h>

#include "cuda/backend.h"

static size_t round256(size_t n) { return (n + 255) / 256 * 256; }

/* The arena's default size: two handles' worth of everything a peer may read, each buffer at
 * its largest for T = max(max_tokens_per_rank, 32) tokens on every rank, rows in float32 (the
 * widest type); the README gives the formula. EPX_IPC_ARENA_MB sets it instead. */
size_t ipc_arena_bytes(const epx_comm_t *c) {
  if (epxi_env()->ipc_arena_mb) return (size_t)epxi_env()->ipc_arena_mb << 20;
  const size_t T = c->cfg.max_tokens_per_rank > 32 ? (size_t)c->cfg.max_tokens_per_rank : 32;
  const size_t R = c->nranks, E = c->cfg.num_experts, K = c->cfg.topk, H = c->cfg.hidden, L = c->num_local_experts;
  const size_t B = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK, W = (T + 31) / 32;
  /* one plan: struct, routing, bitmaps and prefixes, counts and bases, each rounded up */
  const size_t plan = sizeof(epxc_plan_t) + 8 * T * K + 8 * (R + E) * W + 4 * (R + E) + 8 * L * R + 12 * L + 8 * E +
                      16 * 256;
  /* high-throughput or all-to-all: x, the combine rows and weight gradients, the send buffer */
  const size_t ht = plan + 4 * T * H + 4 * R * T * (H + K) + T * K * (4 * H + 4 * B + 8);
  /* low-latency: its own plan and two of everything else */
  const size_t ll = plan + 2 * (plan + 4 * T * (H + B) + 4 * R * T * H + 4 * L * R * T);
  const size_t bytes = round256(sizeof(epxc_state_t)) + 2 * (ht > ll ? ht : ll);
  const size_t floor = (size_t)64 << 20;
  return bytes > floor ? bytes : floor;
}

static bool in_arena(const cuda_comm_t *cc, const void *p) {
  return cc->arena && (const char *)p >= cc->arena && (const char *)p < cc->arena + cc->arena_bytes;
}

/* Memory peers read (`peers`): carved from the arena across processes, stream-ordered pool
 * memory otherwise (and for what only this rank reads). */
epx_status_t dev_alloc(cuda_comm_t *cc, bool peers, void **p, size_t bytes, cudaStream_t st, const char *what) {
  *p = NULL;
  if (!peers || !cc->arena) {
    CUDA_TRY(cudaMallocFromPoolAsync(p, bytes ? bytes : 16, cc->pool, st), what);
    return EPX_SUCCESS;
  }
  const size_t off = epxi_suballoc_alloc(&cc->heap, bytes);
  if (off == EPXI_SUBALLOC_FULL)
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY,
                     "%s: %zu bytes do not fit in the cross-process arena (%zu of %zu MiB in use; set "
                     "EPX_IPC_ARENA_MB, or a max_tokens_per_rank that covers the shapes you run)",
                     what, bytes, cc->heap.in_use >> 20, cc->arena_bytes >> 20);
  *p = cc->arena + off;
  return EPX_SUCCESS;
}

/* Arena memory is reused at once, by work this rank orders after what used it (cc's streams
 * are chained by op_stream; handle_destroy waits for them). */
void dev_free(cuda_comm_t *cc, void *p, cudaStream_t st) {
  if (!p) return;
  if (in_arena(cc, p))
    epxi_suballoc_free(&cc->heap, (size_t)((char *)p - cc->arena));
  else
    cudaFreeAsync(p, st);
}

/* (Re)allocates a buffer (see dev_alloc) to hold `bytes`. Refused while the stream is being
 * captured, and for a handle a captured graph uses (grow_frozen, set by the caller): the
 * graph holds the old addresses. */
static _Thread_local bool grow_frozen;
epx_status_t grow(cuda_comm_t *cc, bool peers, cudaStream_t st, void **p, size_t bytes, const char *what) {
  if (capturing(st) || grow_frozen)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "%s must grow to %zu bytes inside a CUDA graph capture; run the largest shape once before "
                     "capturing",
                     what, bytes);
  dev_free(cc, *p, st);
  *p = NULL;
  return dev_alloc(cc, peers, p, bytes, st, what);
}

/* Grows a buffer kept with its size in bytes. */
epx_status_t ensure_bytes(cuda_comm_t *cc, bool peers, cudaStream_t st, void **p, size_t *have, size_t need,
                                 const char *what) {
  if (*p && need <= *have) return EPX_SUCCESS;
  EPX_CHECK(grow(cc, peers, st, p, need, what));
  *have = need;
  return EPX_SUCCESS;
}

/* One allocation carved into consecutive 256-byte aligned pieces. */
size_t carve(char **base, size_t bytes) {
  size_t at = (size_t)(uintptr_t)*base;
  *base += (bytes + 255) / 256 * 256;
  return at;
}

void grow_freeze(bool frozen) { grow_frozen = frozen; }
