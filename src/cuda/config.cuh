/* The kernels' compile-time constants, in one place. Block sizes, unrolling and chunking
 * change how work is spread, never the bits: every sum's order is fixed by the data, not by
 * the launch. The fp8 constants are part of the arithmetic and do change bits. */
#ifndef EPX_CUDA_CONFIG_CUH
#define EPX_CUDA_CONFIG_CUH

#include "epx.h"

/* ---- launches --------------------------------------------------------------------------- */

#define EPXC_WARP 32                /* lanes of a warp */
/* Routing slots a kernel holds per token in registers. The CUDA backend takes topk up to
 * this (src/core refuses more: EPXI_NARROW_TOPK), so per-thread arrays stay sized for 16, not
 * for EPX_MAX_TOPK (32), which would double their stack frames at every topk. */
#define EPXC_MAX_TOPK 16
/* Where the code is long per slot (reading and checking a routing: notify's build, the
 * low-latency dispatch's plan), routings of at most this topk (most models') run a copy
 * unrolled to this many slots. */
#define EPXC_FEW_SLOTS 8
#define EPXC_THREADS 1024           /* work kernels: ht.cu, a2a.cu, stage.cu */
#define EPXC_WARPS (EPXC_THREADS / EPXC_WARP)
/* Low-latency kernels wait on their own first block, so all blocks of every rank sharing a
 * GPU must be resident at once: two blocks per SM of the budget. The combine's blocks have
 * 512 threads at up to 64 registers each (two fill an SM): its sums want many loads in flight,
 * and with 256 threads it took 11-19 us more. The dispatch's have 256 at up to 128: at 64 it
 * spills (ptxas: a 392-byte frame, 3208 bytes of spill stores, against 96 and 124), and every
 * block's arrival is an acquire, which empties L1, so the reloads went to L2 (H100: 1.5 us less
 * at 2 ranks x 1 token, 3 at 2 x 128, 10 at 8 x 128; bench/RESULTS.md, 2026-12-07). */
#define EPXC_LL_COMBINE_THREADS 512  /* the combine */
#define EPXC_LL_DISPATCH_THREADS 256 /* the dispatch */
#define EPXC_LL_BLOCKS_PER_SM 2
/* Items a warp takes, on average, in the low-latency combine's claimed walk (ll.cu; 1, 2, 4
 * and 8 measured with the sums claimed too: 4 was fastest at 8 ranks, 8 slowest at 2) */
#define EPXC_LL_CLAIMS 4
#define EPXC_EXCHANGE_THREADS 64    /* the one-block exchange kernel: thread r talks to rank r */
#define EPXC_LAYOUT_THREADS 256     /* layout: a thread per token */
#define EPXC_NOTIFY_THREADS 512     /* notify: a warp builds a bitmap word (32 tokens); its last block
                                       meets the peers (thread r talks to rank r) */
#define EPXC_NOTIFY_SMEM (96 * 1024) /* notify's dynamic shared memory: the words a pass builds */
#define EPXC_SCAN_BATCH 8           /* words a notify thread reads at once (prefix words, earlier
                                       tickets' sums): one round trip */

static_assert(EPX_MAX_RANKS <= EPXC_EXCHANGE_THREADS, "the exchange gives every rank a thread");
static_assert(EPX_MAX_RANKS <= EPXC_NOTIFY_THREADS, "notify's exchange gives every rank a thread");
static_assert(EPX_MAX_RANKS <= EPXC_LL_COMBINE_THREADS && EPX_MAX_RANKS <= EPXC_LL_DISPATCH_THREADS,
              "the low-latency exchange and placement give every rank a thread");

/* ---- rows ------------------------------------------------------------------------------- */

#define EPXC_LANE_CHANNELS 8        /* channels a lane moves at once (one 16-byte bf16 vector) */
#define EPXC_CHUNK_CHANNELS (EPXC_LANE_CHANNELS * EPXC_WARP) /* 256: channels a warp moves at once */
#define EPXC_UNROLL 4               /* 16-byte vectors a lane loads before it stores any (copy_row_raw) */

/* ---- bulk copies (bulk.cuh) -------------------------------------------------------------- */

/* A block of the pipelined kernels: warps that each own a ring of stages. 8 warps, each
 * loading 2 of its 3 stages of 7 KB ahead, keep about 112 KB of loads in flight per SM (the
 * ~100 KB one SM needs to reach its limit); with the warps' job tables they fill the 227 KB of
 * shared memory: one block per SM. 7 KB is half a DeepSeek-V3 bf16 row (H 7168). */
#define EPXC_BULK_WARPS 8
#define EPXC_BULK_STAGES 3
#define EPXC_BULK_STAGE_BYTES 7168
#define EPXC_BULK_BATCH 32          /* jobs a warp describes at once: a bitmap word's tokens */
#define EPXC_SMEM_MAX (227 * 1024)  /* sm_90's dynamic shared memory per block */

/* ---- converting rows (ring.cuh) ------------------------------------------------------- */

/* A lane converts 16 channels at once: one 16-byte fp8 vector, 8 lanes to a 128-channel scale
 * block, so a block's amax takes 3 shuffles and its scale one division per 16 channels. */
#define EPXC_UNIT_CHANNELS 16
#define EPXC_UNIT_SPAN (EPXC_UNIT_CHANNELS * EPXC_WARP) /* 512: channels a warp converts at once */
/* A lane's ring of asynchronous copies: 128 bytes, 4 bf16 units or 2 float32 ones; 128 KB of
 * loads in flight per 1024-thread block. */
#define EPXC_RING_LANE_BYTES 128

/* ---- staged fp8 rows (staged.cuh) ---------------------------------------------------- */

/* A warp's chunk: 1024 channels, 2 KB of bf16 in, 1 KB of fp8 and 32 bytes of scales out,
 * stored straight from registers. Two input stages (one being quantised, one landing):
 * 4.4 KB a warp with its destination table, 32 warps to an SM (140 KB), 128 KB of loads in
 * flight. A third stage measured no faster (bench/RESULTS.md, 2026-12-02). */
#define EPXC_STAGED_CHUNK 1024
#define EPXC_STAGED_IN 2

/* ---- waits ------------------------------------------------------------------------------ */

#define EPXC_POLL_MASK 63           /* a wait checks the clock and the peer's error word every 64 spins */

/* ---- fp8 (part of the arithmetic) --------------------------------------------------------- */

#define EPXC_FP8_MAX 448.0f         /* e4m3's largest finite value: a block's amax maps to it */
#define EPXC_FP8_AMAX_FLOOR 1e-4f   /* amax below this (a block of zeros) scales as this */
#define EPXC_FP8_BLOCK_LANES (EPX_FP8_BLOCK / EPXC_LANE_CHANNELS) /* 16 lanes share one scale */

/* ---- tracing (-DEPX_LL_TRACE, -DEPX_NOTIFY_TRACE: trace.cuh) --------------------------------- */

#define EPXC_TRACE_POINTS 12        /* phase times a traced launch keeps */
#define EPXC_TRACE_RANK_BLOCKS 1000 /* a notify trace line's block field: rank * this + ticket */

#endif
