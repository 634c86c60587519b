/* Device helpers every kernel family shares: flag ordering, bounded waits, the group's error
 * words, and rows of any element type moved eight channels at a time. C style: functions
 * and structs only. */
#ifndef EPX_CUDA_COMMON_CUH
#define EPX_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "cuda/config.cuh"
#include "cuda/cuda_shared.h"

/* Host side of the epxc_preload_* functions: loads the kernels, keeps the largest stack. */
static cudaError_t preload_kernels(const void *const *kernels, size_t n, size_t *stack) {
  for (size_t i = 0; i < n; i++) {
    struct cudaFuncAttributes a;
    const cudaError_t e = cudaFuncGetAttributes(&a, kernels[i]);
    if (e != cudaSuccess) return e;
    if (a.localSizeBytes > *stack) *stack = a.localSizeBytes;
  }
  return cudaSuccess;
}

/* ---- ordering ------------------------------------------------------------------------- */

/* System scope: a peer may sit on another GPU behind NVLink, or share this one. */
static __device__ __forceinline__ void st_release(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ uint64_t ld_acquire(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ uint64_t ld_relaxed(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

/* GPU scope: for flags between the blocks of one rank's launch, which share its GPU. A release
 * at system scope waits for this thread's writes to be visible to every device and the host
 * (765 ns for a fence after a store against 444-455 at GPU scope: bench/RESULTS.md,
 * 2026-12-06); what such a flag orders is read by blocks of the same GPU only, and what they
 * then release at system scope to peers carries it along (causality is transitive). */
static __device__ __forceinline__ void st_release_gpu(uint64_t *p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ bool reached_gpu(const uint64_t *p, uint64_t target, uint32_t spin) {
  uint64_t v;
  if (spin > 0) {
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    if (v < target) return false;
  }
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v >= target;
}

/* Whether *p >= target, read with acquire semantics when it is; `spin` counts the wait's earlier
 * looks. An acquire load at system scope is a load and an invalidation of the SM's whole L1
 * (CCTL.IVALL in the SASS, nvcc 13.0, sm_90), so a waiter polling by acquires empties the L1
 * of every block that shares its SM, whose stacks and cached loads then come from L2: a load
 * that hits L1 took 135 ns instead of 16 beside such a poller (epx-latency, bench/RESULTS.md,
 * 2026-12-06). The first look is an acquire (a flag already there costs one round trip);
 * later ones are relaxed, and the one that finds the target is followed by an acquire. */
static __device__ __forceinline__ bool reached(const uint64_t *p, uint64_t target, uint32_t spin) {
  if (spin == 0) return ld_acquire(p) >= target;
  return ld_relaxed(p) >= target && ld_acquire(p) >= target;
}

/* Every block of the launch arrives at *counter once; true in the last one to arrive. The
 * arrival is one read-modify-write with release and acquire semantics at system scope: its
 * release orders the block's writes (every thread's, through the barrier) before it, its
 * acquire in the last block orders every earlier arrival (each itself a release) before what
 * that block does next, a post to the peers included. One fence's cost, where a fence before
 * the add and one after it in the last block were two. The counter wraps to 0 on the last
 * arrival, ready for the next launch. */
static __device__ bool block_arrives_last(uint32_t *counter) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int before;
    asm volatile("atom.acq_rel.sys.global.inc.u32 %0, [%1], %2;"
                 : "=r"(before)
                 : "l"(counter), "r"(gridDim.x - 1)
                 : "memory");
    last = before == gridDim.x - 1;
  }
  __syncthreads();
  return last;
}

/* What a trace macro (trace.cuh) stands for in a build without its flag: a statement that does
 * nothing. */
#define EPXC_NO_TRACE \
  do {                \
  } while (0)

static __device__ __forceinline__ uint64_t globaltimer_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* Statuses after which a rank does nothing more (the others are recoverable: a refused
 * routing, an output too small, settings that differ). Ranks out of step stop too: every later
 * exchange would pair the wrong calls. */
static __device__ __forceinline__ bool fatal_status(int s) {
  return s == EPX_ERR_TIMEOUT || s == EPX_ERR_BROKEN || s == EPX_ERR_PEER_LOST || s == EPX_ERR_OUT_OF_STEP;
}

/* This rank's error word, when `status` may be recorded there: the first failure, or a fatal
 * one over a recoverable one. NULL when an earlier record stands. */
static __device__ epxc_error_t *claim_error(const epxc_group_t *g, int status) {
  epxc_error_t *e = &g->errors[g->rank];
  int old = *(volatile int32_t *)&e->status;
  while (old == 0 || (fatal_status(status) && !fatal_status(old))) {
    const int seen = atomicCAS(&e->status, old, status);
    if (seen == old) return e;
    old = seen;
  }
  return NULL;
}

/* Records this rank's failure where the host and every peer can see it (see claim_error). Out
 * of line: a path that fails only, kept out of the code a decode step fetches as it runs. */
static __device__ __noinline__ void record_error(const epxc_group_t *g, int status, int phase, int peer,
                                                 int64_t detail) {
  epxc_error_t *e = claim_error(g, status);
  if (!e) return;
  e->phase = phase;
  e->peer = peer;
  e->detail = detail;
  for (int i = 0; i < 4; i++) e->about[i] = 0; /* no stamps: see record_stamp_error */
  __threadfence_system();
}

/* A sequentially consistent fence at system scope: a store before it and a load after it are
 * never both missed by a peer doing the same the other way round (see exchange_wait). */
static __device__ __forceinline__ void fence_sc(void) { asm volatile("fence.sc.sys;" ::: "memory"); }

/* What a bounded wait on a peer's flag found. */
enum { WAIT_LATE = -1, WAIT_FAILED = 0, WAIT_ARRIVED = 1 };

/* Waits until *flag >= epoch: WAIT_ARRIVED. Gives up when the peer stopped for good
 * (WAIT_FAILED, recorded; a recoverable failure on its side leaves it in the protocol) or the
 * deadline passes (WAIT_LATE, not recorded yet: the caller decides, see exchange_wait). */
static __device__ int wait_flag(const epxc_group_t *g, const uint64_t *flag, uint64_t epoch, int peer, int phase) {
  uint64_t start = globaltimer_ns();
  volatile epxc_error_t *peer_err = &g->errors[peer];
  for (uint32_t spin = 0;; spin++) {
    if (reached(flag, epoch, spin)) return WAIT_ARRIVED;
    if ((spin & EPXC_POLL_MASK) == EPXC_POLL_MASK) {
      const int ps = peer_err->status;
      if (fatal_status(ps)) {
        record_error(g, EPX_ERR_BROKEN, phase, peer, ps);
        return WAIT_FAILED;
      }
      if (globaltimer_ns() - start > g->timeout_ns) return WAIT_LATE;
    }
  }
}

/* True when this rank must not do any more work: an exchange failed or the plan is bad. */
static __device__ __forceinline__ bool rank_stopped(const epxc_group_t *g) {
  return ((volatile epxc_state_t *)g->state[g->rank])->aborted != 0;
}

/* ---- peers' addresses ---------------------------------------------------------------------- */

/* An address rank r published (one of its process), where this rank reaches it: the same in
 * one process, shifted by where this process mapped r's arena across processes. NULL stays
 * NULL: an optional buffer the peer did not pass. */
static __device__ __forceinline__ const void *peer_ptr(const epxc_group_t *g, int r, uint64_t p) {
  return p ? (const void *)(uintptr_t)(p + (uint64_t)g->delta[r]) : NULL;
}

/* Rank r's plan, published at p with its token count, as this rank reads it from now on (see
 * epxc_peer_t). Only fields the host wrote before rank r's notify started are read here: rank r
 * may still be building the rest. */
static __device__ void peer_view(const epxc_group_t *g, int r, uint64_t p, int64_t num_tokens, epxc_peer_t *v) {
  const epxc_plan_t *src = (const epxc_plan_t *)peer_ptr(g, r, p);
  v->num_tokens = num_tokens;
  v->words = src->words;
  v->idx = (const int32_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->idx);
  v->weight = (const float *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->weight);
  v->rank_bits = (const uint32_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->rank_bits);
  v->rank_pre = (const int32_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->rank_pre);
  v->exp_bits = (const uint32_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->exp_bits);
  v->exp_pre = (const int32_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->exp_pre);
  v->counts = (const int32_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->counts);
  v->send_base = src->send_base; /* inside the struct: already reached through src */
  v->pair_send_base = (const int64_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->pair_send_base);
  v->pair_base = (const int64_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->pair_base);
  v->kept = (const int32_t *)peer_ptr(g, r, (uint64_t)(uintptr_t)src->kept);
  v->dropped = &src->dropped; /* inside the struct, as send_base */
}

/* ---- elements ------------------------------------------------------------------------- */

static __device__ __forceinline__ float bf16_to_float(uint16_t v) { return __uint_as_float((uint32_t)v << 16); }

static __device__ __forceinline__ uint16_t float_to_bf16(float v) {
  __nv_bfloat16 b = __float2bfloat16_rn(v);
  return *(uint16_t *)&b;
}

static __device__ __forceinline__ uint8_t float_to_e4m3(float v) {
  return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

static __device__ __forceinline__ float e4m3_to_float(uint8_t v) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)v, __NV_E4M3);
  return __half2float(*(__half *)&h);
}

static __device__ __forceinline__ size_t dtype_bytes(epx_dtype_t t) {
  return t == EPX_FLOAT32 ? 4 : t == EPX_BFLOAT16 ? 2 : 1;
}

/* Eight channels starting at `c` (a multiple of 8) of a float32 or bf16 row, as stored: bf16
 * fills `lo` only. Loading and widening are apart so a lane can have several loads in flight. */
typedef struct {
  uint4 lo, hi;
} raw8_t;

static __device__ __forceinline__ raw8_t load_raw8(const void *row, epx_dtype_t t, int64_t c) {
  raw8_t r;
  if (t == EPX_FLOAT32) {
    const uint4 *p = (const uint4 *)((const float *)row + c);
    r.lo = p[0], r.hi = p[1];
  } else {
    r.lo = *(const uint4 *)((const uint16_t *)row + c), r.hi = make_uint4(0, 0, 0, 0);
  }
  return r;
}

static __device__ __forceinline__ void widen8(raw8_t r, epx_dtype_t t, float *v) {
  const uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  if (t == EPX_FLOAT32) {
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __uint_as_float(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

static __device__ __forceinline__ void load8(const void *row, epx_dtype_t t, int64_t c, float *v) {
  widen8(load_raw8(row, t, c), t, v);
}

static __device__ __forceinline__ void store8(void *row, epx_dtype_t t, int64_t c, const float *v) {
  if (t == EPX_FLOAT32) {
    float4 *p = (float4 *)((float *)row + c);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)float_to_bf16(v[2 * i]) | ((uint32_t)float_to_bf16(v[2 * i + 1]) << 16);
    *(uint4 *)((uint16_t *)row + c) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

/* One channel, for rows whose width is not a multiple of 8 (float32 only: every other type's
 * 16-byte rows hold whole groups of 8). */
static __device__ __forceinline__ float load1(const void *row, epx_dtype_t t, int64_t c) {
  return t == EPX_FLOAT32 ? ((const float *)row)[c] : bf16_to_float(((const uint16_t *)row)[c]);
}

static __device__ __forceinline__ void store1(void *row, epx_dtype_t t, int64_t c, float v) {
  if (t == EPX_FLOAT32)
    ((float *)row)[c] = v;
  else
    ((uint16_t *)row)[c] = float_to_bf16(v);
}

static __device__ __forceinline__ const void *row_at(const void *base, epx_dtype_t t, int64_t row, int hidden) {
  return (const char *)base + (size_t)row * hidden * dtype_bytes(t);
}

static __device__ __forceinline__ void *row_at_mut(void *base, epx_dtype_t t, int64_t row, int hidden) {
  return (char *)base + (size_t)row * hidden * dtype_bytes(t);
}

/* ---- bitmaps ---------------------------------------------------------------------------- */

static __device__ __forceinline__ bool bit_set(const uint32_t *bits, int64_t t) {
  return (bits[t >> 5] >> (t & 31)) & 1u;
}

/* Tokens before t that have the bit set (row of `pre` holds per-word prefix popcounts). */
static __device__ __forceinline__ int64_t bit_rank(const uint32_t *bits, const int32_t *pre, int64_t t) {
  uint32_t below = bits[t >> 5] & ((1u << (t & 31)) - 1u);
  return (int64_t)pre[t >> 5] + __popc(below);
}

/* ---- division by a divisor fixed for a launch --------------------------------------------- */

/* n / d as one multiply-high by ceil(2^32 / d), exact when n * d <= 2^32: the magic exceeds
 * 2^32 / d by r / d with r < d, which adds n * r / (d * 2^32) < 1 / d to n / d, too little to
 * reach the next integer. A 32-bit division by a value known only at run time is a chain of
 * about twenty instructions, a 64-bit one a routine of about a hundred. */
typedef struct {
  uint32_t d, magic; /* magic 0: d is 1 */
} epxc_divisor_t;

static __device__ __forceinline__ epxc_divisor_t divisor(uint32_t d) {
  return (epxc_divisor_t){d, d == 1 ? 0u : 0xffffffffu / d + 1u};
}
static __device__ __forceinline__ uint32_t quotient(epxc_divisor_t v, uint32_t n) {
  return v.magic ? __umulhi(n, v.magic) : n;
}

/* Where part i of `parts` starts when n items are cut into contiguous runs of ceil(n / parts)
 * (n when the runs end before it): part i owns [run_first(n, parts, i), run_first(n, parts, i + 1)). */
static __device__ __forceinline__ int64_t run_first(int64_t n, int64_t parts, int64_t i) {
  const int64_t per = (n + parts - 1) / parts, first = i * per;
  return first < n ? first : n;
}

/* ---- warp helpers ------------------------------------------------------------------------ */

static __device__ __forceinline__ int lane_id(void) { return threadIdx.x & (EPXC_WARP - 1); }

/* Global warp index and count of a grid-stride loop over warps. */
static __device__ __forceinline__ int64_t warp_global(void) {
  return (int64_t)blockIdx.x * (blockDim.x / EPXC_WARP) + (threadIdx.x / EPXC_WARP);
}
static __device__ __forceinline__ int64_t warp_count(void) { return (int64_t)gridDim.x * (blockDim.x / EPXC_WARP); }

/* The pointer lane j holds (the whole warp calls). */
template <typename P>
static __device__ __forceinline__ P *lane_ptr(P *p, int j) {
  return (P *)__shfl_sync(0xffffffffu, (uintptr_t)p, j);
}

/* ---- routing ----------------------------------------------------------------------------- */

/* Reads token t's routing into ids/ws (K slots, -1 / 0 padded). Returns a status: a bad id, a
 * repeated expert, or a map row with more than K experts; *bad_slot names the first bad slot.
 * Every slot's id and weight are loaded before any is checked, so a token costs two memory
 * round trips, not two a slot (a notify's build waited on little else). The slots are
 * compile-time indices (loops unrolled to SLOTS, at least K, slots from K on idle): ids and
 * ws stay in registers where the caller indexes them the same way. The check for repeated
 * experts compares every pair of slots, so a caller that knows K <= 8 (most models) runs a
 * quarter of those comparisons with SLOTS = 8. */
template <int SLOTS>
static __device__ __forceinline__ int read_route_in(const epxc_shape_t *s, int64_t t, const void *topk_idx,
                                                    epx_dtype_t idx_dtype, const float *topk_weights,
                                                    const uint8_t *map, const float *probs, int32_t *ids, float *ws,
                                                    int *bad_slot) {
  static_assert(SLOTS <= EPXC_MAX_TOPK, "the slots fit the widest routing");
  const int K = s->topk, E = s->num_experts;
  if (map) {
    int k = 0;
    for (int e = 0; e < E; e++) {
      if (!map[t * E + e]) continue;
      if (k == K) {
        *bad_slot = K;
        return EPX_ERR_TOPK_RANGE;
      }
      const float w = probs ? probs[t * E + e] : 1.0f;
#pragma unroll
      for (int j = 0; j < SLOTS; j++)
        if (j == k) ids[j] = e, ws[j] = w;
      k++;
    }
#pragma unroll
    for (int j = 0; j < SLOTS; j++)
      if (j >= k) ids[j] = -1, ws[j] = 0.0f;
    return EPX_SUCCESS;
  }
  uint32_t out_of_range = 0; /* a bit a slot */
#pragma unroll
  for (int k = 0; k < SLOTS; k++) {
    const int64_t e = k >= K                      ? -1
                      : idx_dtype == EPX_INT64 ? ((const int64_t *)topk_idx)[t * K + k]
                                               : ((const int32_t *)topk_idx)[t * K + k];
    if (e < -1 || e >= E) out_of_range |= 1u << k;
    ids[k] = (int32_t)e;
    ws[k] = k < K && topk_weights ? topk_weights[t * K + k] : 1.0f;
  }
  int bad = -1, st = EPX_SUCCESS;
#pragma unroll
  for (int k = SLOTS - 1; k >= 0; k--) { /* from the last slot down: the first bad one stays */
    bool repeated = false;
#pragma unroll
    for (int j = 0; j < k; j++) repeated |= ids[j] == ids[k];
    const bool range = (out_of_range >> k) & 1;
    if (k < K && (range || (ids[k] >= 0 && repeated)))
      bad = k, st = range ? EPX_ERR_EXPERT_OUT_OF_RANGE : EPX_ERR_INVALID_ARGUMENT;
  }
#pragma unroll
  for (int k = 0; k < SLOTS; k++)
    if (ids[k] < 0) ws[k] = 0.0f;
  if (bad >= 0) *bad_slot = bad;
  return st;
}

/* read_route_in over every slot the library takes (EPXC_MAX_TOPK). */
static __device__ __forceinline__ int read_route(const epxc_shape_t *s, int64_t t, const void *topk_idx,
                                                 epx_dtype_t idx_dtype, const float *topk_weights, const uint8_t *map,
                                                 const float *probs, int32_t *ids, float *ws, int *bad_slot) {
  return read_route_in<EPXC_MAX_TOPK>(s, t, topk_idx, idx_dtype, topk_weights, map, probs, ids, ws, bad_slot);
}

/* ---- plans -------------------------------------------------------------------------------- */

/* Bitmap row `row` of a plan (R rank rows, then E expert rows, W words each) and its prefix
 * popcounts. */
static __device__ __forceinline__ uint32_t *plan_bits_row(const epxc_plan_t *plan, int R, int64_t W, int row) {
  return row < R ? plan->rank_bits + (int64_t)row * W : plan->exp_bits + (int64_t)(row - R) * W;
}
static __device__ __forceinline__ int32_t *plan_pre_row(const epxc_plan_t *plan, int R, int64_t W, int row) {
  return row < R ? plan->rank_pre + (int64_t)row * W : plan->exp_pre + (int64_t)(row - R) * W;
}

/* The key a plan's build keeps of refused token t (slot `slot`, status `st`): the smallest
 * key, atomicMin, is the first bad token's. */
static __device__ __forceinline__ unsigned long long bad_route_key(int64_t t, int slot, int st) {
  return ((unsigned long long)t << 16) | ((unsigned)slot << 8) | (unsigned)st;
}

/* A plan's status from the key its build left (the first bad token's, all ones: none). */
static __device__ __forceinline__ int32_t plan_status(uint64_t bad_key) {
  return bad_key == ~0ull ? EPX_SUCCESS : (int32_t)(bad_key & 0xff);
}

#endif
