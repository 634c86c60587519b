/* Bulk asynchronous copies (Hopper's cp.async.bulk: the TMA engine without a tensor map)
 * through a ring of shared-memory stages that each warp owns: a row read once into a stage,
 * then written from the stage to each of its destination rows (the expert layout's fan-out:
 * a token crosses once). ht.cu's dispatch runs on it.
 *
 * Why: one SM moves ~97 GB/s (read + written) only with ~100 KB in flight. A lane's 16-byte
 * loads keep a few KB in flight per warp and stall on every round trip; here one lane issues
 * copies of kilobytes, EPXC_BULK_STAGES - 1 of them ahead of the one being stored, so each
 * warp keeps ~14 KB in flight and a block of EPXC_BULK_WARPS about 112 KB, while the warp's
 * other lanes work out where the next batch goes.
 *
 * A warp works in batches: up to 32 jobs (a bitmap word's tokens), described in its shared
 * memory by the whole warp (where they come from and go, in ht.cu), then streamed by the ring.
 * The ring's count of units runs on across batches: a stage's barrier phase is its use count's
 * parity. The waits here are on the copy engine, not on peers: they end when the bytes land.
 *
 * Measured and left out (bench/RESULTS.md, 2026-12-01), both bit for bit right: a combine on
 * the same ring, its rows' chunks staged by bulk or per-lane asynchronous copies and summed
 * from shared memory, ran at 36-38 GB/s per SM against the per-token kernels' 68-78; an fp8
 * dispatch quantising from the staged chunk, at 10.6 GB/s per SM against 22.5. With one
 * 8-warp block per SM (the stages fill shared memory) the lanes' arithmetic, not memory,
 * bound both: the ring pays where the bytes pass through untouched. Nor did more warps pay
 * (2026-12-04): 16 or 32 a block, each with its own ring (three or six stages of 1 or 2 KB)
 * and the next token's rows looked up while the current one's landed, summed at 37-55 GB/s
 * per SM in the expert layout and 21-63 in the token layout, against 67-69 and 82-83. The
 * profile put it in instruction issue (3.0 warp instructions a cycle, ~300 per 2 KB staged
 * against the ~100 its sums need): the ring's bookkeeping, one lane's work but issued by the
 * whole warp, costs more than the loads it hides. Nor did roles pay (2026-12-06, 1 x H100):
 * a planner warp, a loader lane filling 13 stages of 14 KB and 16 reduce warps summed at 47
 * and 58 GB/s per SM against 65 and 80, and 4 loader warps did no better. epx-sm-reads showed
 * why: one SM's bulk loads complete about one per 300 ns whatever their size up to 32 KB and
 * whoever issues them (45 GB/s for 14 KB, 103 for 32 KB), where 16-byte loads through
 * registers, 8 in flight a thread, read 118. A bulk load pays only where it moves 32 KB or
 * more, or where reads are a small part of the bytes (the dispatch: a row read once, written
 * to several ranks). */
#ifndef EPX_CUDA_BULK_CUH
#define EPX_CUDA_BULK_CUH

#include "cuda/rows.cuh"
#include "cuda/tma.cuh"

/* ---- a warp's shared memory --------------------------------------------------------------- */

typedef struct {
  const void *src;            /* the row read */
  void *dst[EPXC_MAX_TOPK];   /* the rows written, m of them */
} bulk_copy_job_t;

typedef struct {
  __align__(128) uint8_t stage[EPXC_BULK_STAGES][EPXC_BULK_STAGE_BYTES];
  uint64_t full[EPXC_BULK_STAGES]; /* a stage's bytes have landed */
  int8_t m[EPXC_BULK_BATCH];       /* rows of each job; 0: none */
  bulk_copy_job_t job[EPXC_BULK_BATCH];
} bulk_warp_t;

static_assert(EPXC_BULK_BATCH == EPXC_WARP, "a batch is a bitmap word: a lane describes each job");
static_assert(EPXC_BULK_STAGE_BYTES % 16 == 0, "bulk copies move whole 16-byte units");
static_assert(EPXC_BULK_STAGES >= 2, "the ring loads ahead of the stage it consumes");

static size_t bulk_smem_bytes(void) { return sizeof(bulk_warp_t) * EPXC_BULK_WARPS; }

/* This warp's part of the block's dynamic shared memory, its barriers initialised. */
static __device__ bulk_warp_t *bulk_warp_setup(void) {
  extern __shared__ __align__(128) uint8_t bulk_smem[];
  bulk_warp_t *w = (bulk_warp_t *)bulk_smem + threadIdx.x / EPXC_WARP;
  if (lane_id() == 0) mbar_init_stages(w->full, EPXC_BULK_STAGES);
  __syncwarp();
  return w;
}

/* The ring's position: units loaded into it over the kernel's life, and units consumed. */
typedef struct {
  uint32_t loaded, consumed;
} bulk_ring_t;

/* A walk over a batch's units: job `job` (of m > 0), bytes from `off` of its row (32 bits: a
 * row is far below 2 GB). */
typedef struct {
  int job;
  int32_t off;
} bulk_cursor_t;

static __device__ void cursor_seek(const bulk_warp_t *w, bulk_cursor_t *c, int from) {
  c->off = 0;
  for (c->job = from; c->job < EPXC_BULK_BATCH && w->m[c->job] <= 0; c->job++) {
  }
}

static __device__ __forceinline__ void cursor_step(const bulk_warp_t *w, bulk_cursor_t *c, int32_t chunk, int32_t row) {
  c->off += chunk;
  if (c->off >= row) cursor_seek(w, c, c->job + 1);
}

/* ---- copy ------------------------------------------------------------------------------- */

/* Lane 0: unit `c` of the batch (a stage's worth of its row) into the next stage. */
static __device__ void copy_load_next(bulk_warp_t *w, bulk_ring_t *r, bulk_cursor_t *c, int32_t row_bytes) {
  const int s = r->loaded % EPXC_BULK_STAGES;
  const uint32_t bytes = (uint32_t)min(EPXC_BULK_STAGE_BYTES, row_bytes - c->off);
  mbar_expect(&w->full[s], bytes);
  bulk_load(w->stage[s], (const uint8_t *)w->job[c->job].src + c->off, bytes, &w->full[s]);
  r->loaded++;
  cursor_step(w, c, EPXC_BULK_STAGE_BYTES, row_bytes);
}

/* Moves every job of the batch: lane 0 drives the ring, the other lanes wait at the end. A
 * stage is loaded again only once the stores that read it last have read it. */
static __device__ void bulk_copy_batch(bulk_warp_t *w, bulk_ring_t *r, int32_t row_bytes) {
  if (lane_id() == 0) {
    bulk_cursor_t ld, st;
    cursor_seek(w, &ld, 0);
    st = ld;
    bulk_wait_read_all(); /* the previous batch's stores are done with every stage */
    for (int ahead = 0; ld.job < EPXC_BULK_BATCH && ahead < EPXC_BULK_STAGES - 1; ahead++)
      copy_load_next(w, r, &ld, row_bytes);
    while (st.job < EPXC_BULK_BATCH) {
      const int s = r->consumed % EPXC_BULK_STAGES;
      mbar_wait(&w->full[s], (r->consumed / EPXC_BULK_STAGES) & 1);
      const bulk_copy_job_t *j = &w->job[st.job];
      const uint32_t bytes = (uint32_t)min(EPXC_BULK_STAGE_BYTES, row_bytes - st.off);
      for (int k = 0; k < w->m[st.job]; k++) bulk_store((uint8_t *)j->dst[k] + st.off, w->stage[s], bytes);
      bulk_commit();
      r->consumed++;
      cursor_step(w, &st, EPXC_BULK_STAGE_BYTES, row_bytes);
      if (ld.job < EPXC_BULK_BATCH) { /* into the stage the previous unit's stores read */
        bulk_wait_read_but_one();
        copy_load_next(w, r, &ld, row_bytes);
      }
    }
  }
  __syncwarp();
  /* every lane keeps the same count */
  r->loaded = __shfl_sync(0xffffffffu, r->loaded, 0);
  r->consumed = __shfl_sync(0xffffffffu, r->consumed, 0);
}

/* Before the warp's stages go away with the kernel: its stores have written. */
static __device__ void bulk_copy_finish(void) {
  if (lane_id() == 0) bulk_wait_all();
  __syncwarp();
}

#endif
