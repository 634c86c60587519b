/* The CUDA backend's device memory: one arena per comm, made at epx_comm_init (plain
 * cudaMalloc'd memory, which its transport makes reachable by the peers: transport_*.c) and
 * carved by the range allocator (core/suballoc.c). Every device buffer of the comm's handles
 * comes from it: what peers read and write (plans, staging, partials, send buffers) and what
 * only this rank uses. Nothing is allocated from the device once the arena is made, except
 * where that cannot stall a peer (arena_extend), and in one process nothing is freed before
 * the world goes: a destroyed comm's memory is kept for the next comm (world_block_*). */
#include <stdio.h>
#include <stdlib.h>

#include "cuda/backend.h"

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

#define ARENA_ALIGN 256             /* every buffer: enough for 16-byte vectors and cudaMalloc's own */
#define ARENA_FLOOR ((size_t)1 << 30) /* the smallest default arena: shapes past max_tokens_per_rank fit */
#define ARENA_GRAIN ((size_t)2 << 20)

/* The arena's default size, the README's formula: two handles' worth of every buffer at its
 * largest for T = max(max_tokens_per_rank, 32) tokens on every rank, rows in float32 (the
 * widest type), at least ARENA_FLOOR, at most half the GPU's memory shared by the ranks of
 * this process on it. EPX_ARENA_MB sets it instead. */
size_t arena_size(const epx_comm_t *c, int sharing, size_t device_bytes) {
  if (epxi_env()->arena_mb) return (size_t)epxi_env()->arena_mb << 20;
  const size_t T = c->cfg.max_tokens_per_rank > 32 ? (size_t)c->cfg.max_tokens_per_rank : 32;
  const size_t R = c->nranks, E = c->cfg.num_experts, K = c->cfg.topk, H = c->cfg.hidden, L = c->num_local_experts;
  const size_t B = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK, W = (T + 31) / 32;
  /* one plan: struct, routing, bitmaps and prefixes, counts and bases, each rounded up */
  const size_t plan = sizeof(epxc_plan_t) + 8 * T * K + 8 * (R + E) * W + 4 * (R + E) + 8 * L * R + 12 * L + 8 * E +
                      16 * ARENA_ALIGN;
  /* high-throughput: x (across processes), the combine rows (partials or y) and weight gradients */
  const size_t ht = plan + 4 * T * H + 4 * R * T * (H + K);
  /* all-to-all: send, staging, pulled-back and partial rows, T * K of each, scales and weights */
  const size_t a2a = plan + T * K * (16 * H + 8 * B + 12);
  /* low-latency: the routing per half, and two inboxes per half and source, each row float32
   * at its widest, with a record per token (epxc_ll_layout) */
  const epxc_ll_layout_t y = epxc_ll_layout((int)L, (int)K, (int64_t)T, (int)H);
  const size_t ll = 2 * (8 * T * K + 4 * R * W + 4 * L * R + 2 * ARENA_ALIGN) + 2 * R * (y.region + y.combine_region) +
                    ARENA_ALIGN;
  const size_t largest = ht > a2a ? (ht > ll ? ht : ll) : (a2a > ll ? a2a : ll);
  const size_t need = round_up(sizeof(epxc_state_t), ARENA_ALIGN) + 2 * largest;
  const size_t cap = device_bytes / (2 * (size_t)(sharing > 0 ? sharing : 1));
  const size_t floor = ARENA_FLOOR < cap ? ARENA_FLOOR : cap;
  return round_up(need < floor ? floor : need > cap ? cap : need, ARENA_GRAIN);
}

/* ---- the world's kept blocks ---------------------------------------------------------------- */

void *world_block_take(cuda_world_t *cw, int device, size_t bytes, size_t *got, cudaError_t *err) {
  pthread_mutex_lock(&cw->kept_lock);
  int best = -1;
  for (int i = 0; i < cw->num_kept; i++) {
    const kept_block_t *k = &cw->kept[i];
    if (k->device == device && k->bytes >= bytes && k->bytes / 2 <= bytes && (best < 0 || k->bytes < cw->kept[best].bytes))
      best = i;
  }
  char *p = NULL;
  if (best >= 0) {
    p = cw->kept[best].base;
    *got = cw->kept[best].bytes;
    cw->kept[best] = cw->kept[--cw->num_kept];
  }
  pthread_mutex_unlock(&cw->kept_lock);
  *err = cudaSuccess;
  if (p) return p;
  *got = bytes;
  *err = cudaMalloc((void **)&p, bytes);
  return *err == cudaSuccess ? p : NULL;
}

void world_block_give(cuda_world_t *cw, int device, void *p, size_t bytes) {
  if (!p) return;
  pthread_mutex_lock(&cw->kept_lock);
  if (cw->num_kept == cw->kept_cap) {
    const int cap = cw->kept_cap ? 2 * cw->kept_cap : 16;
    kept_block_t *more = realloc(cw->kept, sizeof *more * (size_t)cap);
    if (more) cw->kept = more, cw->kept_cap = cap;
  }
  const bool room = cw->num_kept < cw->kept_cap;
  if (room) cw->kept[cw->num_kept++] = (kept_block_t){device, p, bytes};
  pthread_mutex_unlock(&cw->kept_lock);
  if (!room) EPX_WARN("device %d: %zu bytes of a destroyed comm not kept (no host memory): lost until exit", device, bytes);
}

/* At world destroy: nothing of the world runs any more. The caller's device stays current. */
void world_blocks_free(cuda_world_t *cw) {
  int current = -1;
  if (cw->num_kept) cudaGetDevice(&current);
  for (int i = 0; i < cw->num_kept; i++) {
    cudaSetDevice(cw->kept[i].device);
    cudaFree(cw->kept[i].base);
  }
  if (current >= 0) cudaSetDevice(current);
  free(cw->kept);
  cw->kept = NULL;
  cw->num_kept = cw->kept_cap = 0;
}

/* ---- arenas ---------------------------------------------------------------------------------- */

static epx_status_t chunk_make(const arena_t *a, arena_chunk_t *k, size_t bytes, const char *who) {
  cudaError_t e = cudaSuccess;
  size_t got = bytes;
  if (a->keep) {
    k->base = world_block_take(a->keep, a->device, bytes, &got, &e);
  } else {
    e = cudaMalloc((void **)&k->base, bytes);
    if (e != cudaSuccess) k->base = NULL;
  }
  if (!k->base) {
    cudaGetLastError();
    return epxi_fail(e == cudaErrorMemoryAllocation ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_CUDA,
                     "%s: an arena of %zu MiB: %s (EPX_ARENA_MB sets the size)", who, bytes >> 20, cudaGetErrorString(e));
  }
  k->bytes = got;
  if (epxi_suballoc_init(&k->heap, got, ARENA_ALIGN) != 0) {
    if (a->keep)
      world_block_give(a->keep, a->device, k->base, got);
    else
      cudaFree(k->base);
    k->base = NULL;
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "%s: arena bookkeeping", who);
  }
  return EPX_SUCCESS;
}

epx_status_t arena_make(arena_t *a, size_t bytes, bool growable, cuda_world_t *keep, int device, const char *who) {
  *a = (arena_t){.growable = growable, .keep = keep, .device = device};
  EPX_CHECK(chunk_make(a, &a->chunk[0], bytes, who));
  a->chunks = 1;
  return EPX_SUCCESS;
}

void arena_free(arena_t *a) {
  for (int i = 0; i < a->chunks; i++) {
    if (a->keep)
      world_block_give(a->keep, a->device, a->chunk[i].base, a->chunk[i].bytes);
    else
      cudaFree(a->chunk[i].base);
    epxi_suballoc_destroy(&a->chunk[i].heap);
  }
  *a = (arena_t){0};
}

size_t arena_in_use(const arena_t *a) {
  size_t n = 0;
  for (int i = 0; i < a->chunks; i++) n += a->chunk[i].heap.in_use;
  return n;
}

size_t arena_bytes(const arena_t *a) {
  size_t n = 0;
  for (int i = 0; i < a->chunks; i++) n += a->chunk[i].bytes;
  return n;
}

/* A chunk more, where cudaMalloc cannot stall a peer: CUDA serialises streams around a device
 * allocation, so a peer on this GPU whose kernel waits for this rank would wait for ever.
 * Only where no other rank of this process shares the GPU (peers in other processes could
 * not reach the chunk anyway), and never while a graph is being captured. */
static epx_status_t arena_extend(cuda_comm_t *cc, size_t bytes, cudaStream_t st, const char *what) {
  arena_t *a = &cc->arena;
  const char *why = !a->growable ? (cc->transport->caller_memory ? "other ranks of this process share the GPU"
                                                                  : "peers in other processes map it once")
                    : capturing(st)                  ? "a CUDA graph is being captured"
                    : a->chunks == EPXC_ARENA_CHUNKS ? "it has grown as often as it may"
                                                     : NULL;
  if (why)
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY,
                     "%s: %zu bytes do not fit in rank %d's arena (%zu of %zu MiB in use) and it cannot grow (%s): set "
                     "EPX_ARENA_MB, or a max_tokens_per_rank that covers the shapes you run",
                     what, bytes, cc->group.rank, arena_in_use(a) >> 20, arena_bytes(a) >> 20, why);
  const size_t half = a->chunk[0].bytes / 2;
  char who[64];
  snprintf(who, sizeof who, "rank %d", cc->group.rank);
  EPX_CHECK(chunk_make(a, &a->chunk[a->chunks], round_up(bytes > half ? bytes : half, ARENA_GRAIN), who));
  a->chunks++;
  return EPX_SUCCESS;
}

epx_status_t dev_alloc(cuda_comm_t *cc, void **p, size_t bytes, cudaStream_t st, const char *what) {
  *p = NULL;
  arena_t *a = &cc->arena;
  for (int pass = 0; pass < 2; pass++) {
    for (int i = 0; i < a->chunks; i++) {
      const size_t off = epxi_suballoc_alloc(&a->chunk[i].heap, bytes);
      if (off == EPXI_SUBALLOC_FULL) continue;
      *p = a->chunk[i].base + off;
      return EPX_SUCCESS;
    }
    if (pass == 0) EPX_CHECK(arena_extend(cc, bytes, st, what));
  }
  return epxi_fail(EPX_ERR_INTERNAL, "%s: %zu bytes do not fit in a chunk made for them", what, bytes);
}

/* Arena memory is reused at once, by work this rank orders after what used it (the comm's
 * streams are chained by op_stream; handle_destroy waits for them). */
void dev_free(cuda_comm_t *cc, void *p) {
  if (!p) return;
  arena_t *a = &cc->arena;
  for (int i = 0; i < a->chunks; i++)
    if ((char *)p >= a->chunk[i].base && (char *)p < a->chunk[i].base + a->chunk[i].bytes) {
      epxi_suballoc_free(&a->chunk[i].heap, (size_t)((char *)p - a->chunk[i].base));
      return;
    }
}

/* (Re)carves a buffer to hold `bytes`. Refused while the stream is being captured, and for a
 * handle a captured graph uses: the graph holds the old addresses. */
epx_status_t grow(cuda_comm_t *cc, const cuda_handle_t *ch, cudaStream_t st, void **p, size_t bytes, const char *what) {
  if (ch->captured || capturing(st))
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "%s must grow to %zu bytes inside a CUDA graph capture; run the largest shape once before "
                     "capturing",
                     what, bytes);
  dev_free(cc, *p);
  *p = NULL;
  return dev_alloc(cc, p, bytes, st, what);
}

/* Grows a buffer kept with its size in bytes. */
epx_status_t ensure_bytes(cuda_comm_t *cc, const cuda_handle_t *ch, cudaStream_t st, void **p, size_t *have,
                          size_t need, const char *what) {
  if (*p && need <= *have) return EPX_SUCCESS;
  EPX_CHECK(grow(cc, ch, st, p, need, what));
  *have = need;
  return EPX_SUCCESS;
}

/* One allocation carved into consecutive 256-byte aligned pieces. */
size_t carve(char **base, size_t bytes) {
  size_t at = (size_t)(uintptr_t)*base;
  *base += round_up(bytes, ARENA_ALIGN);
  return at;
}
