/* Row movers and checks shared by the dispatch/combine kernel families (ht.cu, a2a.cu, ll.cu). */
#ifndef EPX_CUDA_ROWS_CUH
#define EPX_CUDA_ROWS_CUH

#include "cuda/common.cuh"

/* What rank s published in the exchange that opened the current operation. Its addresses are
 * s's: read them through peer_ptr. */
static __device__ __forceinline__ const epxc_words_t *posted(const epxc_group_t *g, int s) {
  return &g->state[g->rank]->got[s];
}

/* Nothing to do when this rank stopped, the plan was refused, or a rank failed the exchange
 * that opened this operation. */
static __device__ __forceinline__ bool plan_void(const epxc_group_t *g, const epxc_plan_t *plan) {
  return rank_stopped(g) || plan->group_status != EPX_SUCCESS ||
         ((volatile epxc_state_t *)g->state[g->rank])->group_status != EPX_SUCCESS;
}

/* The slots of token t of `src` that land on rank `me` (and are kept there: a receive budget
 * drops the others), sorted by local expert (ties in slot order): lane j < the return value
 * gets the j-th one's receive row (*row) and routing weight (*weight).
 * Called by a whole warp. The source's routing is usually a peer's memory, across the link:
 * lane k reads slot k, so the K slots cost one round trip (then one more for the expert
 * bitmaps), not K. */
static_assert(EPXC_MAX_TOPK <= 32, "local_slot_lanes gives each routing slot a lane of its own");
static __device__ int local_slot_lanes(const epxc_shape_t *s, const epxc_plan_t *plan, int src_rank,
                                       const epxc_peer_t *src, int64_t t, int64_t *row, float *weight) {
  const int K = s->topk, L = s->num_local, R = s->nranks, me = s->rank, lane = lane_id();
  const int64_t W = src->words;
  int my_l = 0;
  int64_t my_row = 0;
  float my_w = 0.0f;
  bool mine = false;
  if (lane < K) {
    const int e = src->idx[t * K + lane];
    mine = e >= 0 && e / L == me;
    if (mine) {
      my_l = e % L;
      my_w = src->weight[t * K + lane];
      const int64_t at = bit_rank(src->exp_bits + (int64_t)e * W, src->exp_pre + (int64_t)e * W, t);
      my_row = plan->pair_base[(int64_t)my_l * R + src_rank] + at;
      mine = !plan->kept || at < plan->kept[(int64_t)my_l * R + src_rank]; /* past a receive budget: dropped */
    }
  }
  const unsigned here = __ballot_sync(0xffffffffu, mine);
  int pos = 0; /* this lane's place among the slots here */
  for (unsigned rest = here; rest; rest &= rest - 1) {
    const int k = __ffs(rest) - 1;
    const int lk = __shfl_sync(0xffffffffu, my_l, k);
    pos += lk < my_l || (lk == my_l && k < lane);
  }
  *row = 0;
  *weight = 0.0f;
  for (unsigned rest = here; rest; rest &= rest - 1) {
    const int k = __ffs(rest) - 1;
    const int p = __shfl_sync(0xffffffffu, pos, k);
    const int64_t rk = __shfl_sync(0xffffffffu, my_row, k);
    const float wk = __shfl_sync(0xffffffffu, my_w, k);
    if (p == lane) *row = rk, *weight = wk;
  }
  return __popc(here);
}

/* local_slot_lanes' rows and weights as arrays: row[j], weight[j], j < the return value. */
static __device__ int local_slots(const epxc_shape_t *s, const epxc_plan_t *plan, int src_rank, const epxc_peer_t *src,
                                  int64_t t, int64_t *row, float *weight) {
  int64_t my_row;
  float my_w;
  const int m = local_slot_lanes(s, plan, src_rank, src, t, &my_row, &my_w);
  for (int j = 0; j < m; j++) {
    row[j] = __shfl_sync(0xffffffffu, my_row, j);
    weight[j] = __shfl_sync(0xffffffffu, my_w, j);
  }
  return m;
}

/* Four channels to e4m3, the first in the lowest byte. */
static __device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

/* Copies a row unchanged to m destinations (the common case: same type, no scaling); lane j < m
 * holds destination j. Destinations travel by shuffles, not in a local array: a generic store
 * may alias local memory, so a row's address read from one waits behind the stores before it,
 * and an acquiring fence empties L1, which sends such reads on to L2. */
static __device__ void copy_row_raw(const void *src, void *dst, int m, int64_t bytes) {
  const uint4 *in = (const uint4 *)src;
  const int64_t n = bytes / 16;
  const int lane = lane_id();
  for (int64_t base = 0; base < n; base += EPXC_WARP * EPXC_UNROLL) {
    uint4 v[EPXC_UNROLL];
#pragma unroll
    for (int u = 0; u < EPXC_UNROLL; u++) {
      int64_t i = base + u * EPXC_WARP + lane;
      if (i < n) v[u] = in[i];
    }
    for (int j = 0; j < m; j++) {
      uint4 *const out = (uint4 *)lane_ptr(dst, j);
#pragma unroll
      for (int u = 0; u < EPXC_UNROLL; u++) {
        int64_t i = base + u * EPXC_WARP + lane;
        if (i < n) out[i] = v[u];
      }
    }
  }
}

/* Converts a row to m destinations, each scaled by its factor (1 leaves it as is), in the
 * receive type; fp8 rows get one scale per 128 channels. Lane j < m holds destination j, its
 * scales and its factor (as copy_row_raw). Otherwise a lane loads two 8-channel chunks before
 * it converts either, so two loads are in flight. */
static __device__ void convert_row(const void *src, epx_dtype_t x_dtype, epx_dtype_t recv_dtype, int hidden,
                                   void *dst, float *scales, float factor, int scaled, int m) {
  const int lane = lane_id();
  if (recv_dtype == EPX_FP8_E4M3) {
    /* 16 lanes x 8 channels = one 128-channel block; a warp covers two. One chunk at a time:
     * holding two costs spills that lose more than the second load gains. */
    for (int64_t c0 = 0; c0 < hidden; c0 += EPXC_CHUNK_CHANNELS) {
      const int64_t c = c0 + EPXC_LANE_CHANNELS * lane;
      const bool live = c < hidden;
      float x[8];
      if (live) load8(src, x_dtype, c, x);
      for (int j = 0; j < m; j++) {
        const float fj = __shfl_sync(0xffffffffu, factor, j);
        uint8_t *const dj = (uint8_t *)lane_ptr(dst, j);
        float *const sj = lane_ptr(scales, j);
        float v[8], amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
          v[i] = live ? (scaled ? __fmul_rn(fj, x[i]) : x[i]) : 0.0f;
          amax = fmaxf(amax, fabsf(v[i]));
        }
#pragma unroll
        for (int o = EPXC_FP8_BLOCK_LANES / 2; o >= 1; o >>= 1)
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float a = fmaxf(amax, EPXC_FP8_AMAX_FLOOR), sc = __fdiv_rn(EPXC_FP8_MAX, a);
        if (live) {
          uint32_t q[2] = {0, 0};
#pragma unroll
          for (int i = 0; i < 8; i++) q[i / 4] |= (uint32_t)float_to_e4m3(__fmul_rn(v[i], sc)) << (8 * (i % 4));
          *(uint2 *)(dj + c) = make_uint2(q[0], q[1]);
          if ((lane & (EPXC_FP8_BLOCK_LANES - 1)) == 0) sj[c / EPX_FP8_BLOCK] = __fdiv_rn(a, EPXC_FP8_MAX);
        }
      }
    }
    return;
  }
  /* the whole warp runs every pass (the shuffles), a lane's channels guarded */
  const int64_t vec_end = hidden / EPXC_LANE_CHANNELS * EPXC_LANE_CHANNELS;
  for (int64_t base = 0; base < vec_end; base += 2 * EPXC_CHUNK_CHANNELS) {
    const int64_t c0 = base + EPXC_LANE_CHANNELS * lane;
    const bool live[2] = {c0 < vec_end, c0 + EPXC_CHUNK_CHANNELS < vec_end};
    raw8_t raw[2];
    if (live[0]) raw[0] = load_raw8(src, x_dtype, c0);
    if (live[1]) raw[1] = load_raw8(src, x_dtype, c0 + EPXC_CHUNK_CHANNELS);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      if (h == 1 && base + EPXC_CHUNK_CHANNELS >= vec_end) break; /* no lane has a second chunk */
      float x[8];
      if (live[h]) widen8(raw[h], x_dtype, x);
      for (int j = 0; j < m; j++) {
        const float fj = __shfl_sync(0xffffffffu, factor, j);
        void *const dj = lane_ptr(dst, j);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = scaled ? __fmul_rn(fj, x[i]) : x[i];
        if (live[h]) store8(dj, recv_dtype, c0 + EPXC_CHUNK_CHANNELS * h, v);
      }
    }
  }
  for (int64_t c0 = vec_end; c0 < hidden; c0 += EPXC_WARP) {
    const int64_t c = c0 + lane;
    const float x = c < hidden ? load1(src, x_dtype, c) : 0.0f;
    for (int j = 0; j < m; j++) {
      const float fj = __shfl_sync(0xffffffffu, factor, j);
      void *const dj = lane_ptr(dst, j);
      if (c < hidden) store1(dj, recv_dtype, c, scaled ? __fmul_rn(fj, x) : x);
    }
  }
}

/* The expert layout's padding rows: zero data, zero scales, zero weight. */
static __device__ void zero_padding(const epxc_shape_t *s, const epxc_plan_t *plan, const epxc_dispatch_t *a) {
  if (!s->expert_layout || s->ll) return;
  const int lane = lane_id(), blocks = (s->hidden + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const size_t row_bytes = (size_t)s->hidden * dtype_bytes(a->recv_dtype);
  for (int l = 0; l < s->num_local; l++) {
    const int64_t lo = plan->block[l] + plan->pairs_local[l], hi = plan->block[l + 1];
    for (int64_t r = lo + warp_global(); r < hi; r += warp_count()) {
      uint4 *p = (uint4 *)((char *)a->recv_x + r * row_bytes);
      for (int64_t i = lane; i < (int64_t)(row_bytes / 16); i += EPXC_WARP) p[i] = make_uint4(0, 0, 0, 0);
      if (a->recv_dtype == EPX_FP8_E4M3)
        for (int b = lane; b < blocks; b += EPXC_WARP) a->recv_scales[r * blocks + b] = 0.0f;
      if (lane == 0 && a->recv_probs) a->recv_probs[r] = 0.0f;
    }
  }
}

/* Counts and rows written, for the caller (block 0 of a dispatch writes them). */
static __device__ void write_counts(const epxc_shape_t *s, const epxc_plan_t *plan, const epxc_dispatch_t *a) {
  if (blockIdx.x != 0) return;
  for (int l = threadIdx.x; l < s->num_local; l += blockDim.x)
    if (a->tokens_per_local_expert) a->tokens_per_local_expert[l] = plan->pairs_local[l];
  if (threadIdx.x == 0 && a->num_recv_rows) *a->num_recv_rows = s->ll ? plan->num_pairs : plan->num_rows;
  if (threadIdx.x == 0 && a->dropped && !s->ll) { /* every rank's finished with its notify: peers' are read */
    int64_t dropped = 0;
    for (int d = 0; d < s->nranks; d++) dropped += *plan->peer[d].dropped;
    *a->dropped = dropped > INT32_MAX ? INT32_MAX : (int32_t)dropped;
  }
}

/* Sync-free capacity: a receive buffer too small gets nothing, the rank a status (unless the
 * host, knowing the sizes, returned it already), and the plan is marked so the combine that
 * would invert this dispatch is skipped by every rank. */
static __device__ bool output_fits(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan,
                                   const epxc_dispatch_t *a) {
  const bool fits = s->ll || a->recv_capacity >= plan->num_rows;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    ((epxc_plan_t *)plan)->refused = fits ? EPX_SUCCESS : EPX_ERR_OUTPUT_TOO_SMALL;
    if (!fits && a->report_capacity) record_error(g, EPX_ERR_OUTPUT_TOO_SMALL, EPXC_PH_DISPATCH, s->rank, plan->num_rows);
  }
  return fits;
}

/* out = round(sum over j < m, in order, of fl(w[j] * float(rows[j]))), one row by a warp;
 * w NULL sums the rows as they are. Every product is rounded before it is added, the sum is
 * float32 from 0, rounded once: the contract's arithmetic. A lane takes two 8-channel chunks
 * and loads AHEAD rows of each before adding, so 2 x AHEAD loads are in flight: a peer's
 * memory is far away, and the loads in flight per SM set how fast it comes. Called with
 * constant types it folds to them, and a bf16 load takes 4 registers rather than a float32's
 * 8: four bf16 rows ahead then fit a 1024-thread block's 64 registers (EPXC_AHEAD). */
#define EPXC_AHEAD(in) ((in) == EPX_BFLOAT16 ? 4 : 2)

/* reduce_rows_ahead's sum, one channel a lane from vec_end on: the channels past the last whole
 * 8-channel group (float32 rows whose width is not a multiple of 8). */
static __device__ __forceinline__ void reduce_rows_tail(const void *const *rows, const float *w, int m,
                                                        epx_dtype_t in_dtype, void *out, epx_dtype_t out_dtype,
                                                        int64_t vec_end, int hidden) {
  for (int64_t c = vec_end + lane_id(); c < hidden; c += EPXC_WARP) {
    float acc = 0.0f;
    for (int j = 0; j < m; j++) {
      const float v = load1(rows[j], in_dtype, c);
      acc = __fadd_rn(acc, w ? __fmul_rn(w[j], v) : v);
    }
    store1(out, out_dtype, c, acc);
  }
}

template <int AHEAD>
static __device__ __forceinline__ void reduce_rows_ahead(const void *const *rows, const float *w, int m,
                                                         epx_dtype_t in_dtype, void *out, epx_dtype_t out_dtype,
                                                         int hidden) {
  const int lane = lane_id();
  const int64_t vec_end = hidden / EPXC_LANE_CHANNELS * EPXC_LANE_CHANNELS;
  for (int64_t c0 = EPXC_LANE_CHANNELS * lane; c0 < vec_end; c0 += 2 * EPXC_CHUNK_CHANNELS) {
    const bool second = c0 + EPXC_CHUNK_CHANNELS < vec_end;
    float acc[2][8];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    for (int j0 = 0; j0 < m; j0 += AHEAD) {
      raw8_t r[AHEAD][2];
#pragma unroll
      for (int u = 0; u < AHEAD; u++)
        if (j0 + u < m) {
          r[u][0] = load_raw8(rows[j0 + u], in_dtype, c0);
          if (second) r[u][1] = load_raw8(rows[j0 + u], in_dtype, c0 + EPXC_CHUNK_CHANNELS);
        }
#pragma unroll
      for (int u = 0; u < AHEAD; u++) {
        if (j0 + u >= m) break;
        const float wj = w ? w[j0 + u] : 1.0f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
          if (h == 1 && !second) break;
          float v[8];
          widen8(r[u][h], in_dtype, v);
#pragma unroll
          for (int i = 0; i < 8; i++) acc[h][i] = __fadd_rn(acc[h][i], w ? __fmul_rn(wj, v[i]) : v[i]);
        }
      }
    }
    store8(out, out_dtype, c0, acc[0]);
    if (second) store8(out, out_dtype, c0 + EPXC_CHUNK_CHANNELS, acc[1]);
  }
  reduce_rows_tail(rows, w, m, in_dtype, out, out_dtype, vec_end, hidden);
}

/* The rows a warp sums, listed in shared memory for the high-throughput sums: every 8-channel
 * group of a sum reads its rows' addresses again. From a local array those reads went to L1,
 * where the rows streaming through evicted them, so each group first waited on L2 for its
 * addresses (the token layout's sums at 8 ranks, 2 SMs a rank, on an H100: 79-80 GB/s per SM
 * from a local array, 97 from a shared list). The token sums list addresses only, a plain
 * array a warp (append_rows); the expert layout's partials of more than four rows list
 * addresses and weights (warp_rows_t, list_lane_rows). A warp fills its list between two
 * __syncwarp, the first so that its previous sum has read it. The low-latency combine keeps
 * local arrays (ll.cu says why). */
typedef struct {
  const void *row[EPXC_MAX_TOPK];
  float w[EPXC_MAX_TOPK];
} warp_rows_t;

static __device__ __forceinline__ warp_rows_t *warp_rows_of(warp_rows_t *lists) {
  return &lists[threadIdx.x / EPXC_WARP];
}

/* The lanes with in set append their row p to the list of m rows, in lane order, one lane
 * after another; returns the new count (the whole warp calls). Lane by lane rather than each
 * lane at its prefix count into a list with weights beside it: with the same summing loop, the
 * token sums at 8 ranks, 2 SMs a rank, went from 93 to 97 GB/s per SM (H100; why was not
 * isolated). */
static __device__ __forceinline__ int append_rows(const void **rows, int m, bool in, const void *p) {
  for (unsigned rest = __ballot_sync(0xffffffffu, in); rest; rest &= rest - 1, m++)
    if (lane_id() == __ffs(rest) - 1) rows[m] = p;
  return m;
}

/* Lanes j < m list their row and weight as the list's row j (the whole warp calls). */
static __device__ __forceinline__ void list_lane_rows(warp_rows_t *list, int m, const void *row, float w) {
  __syncwarp(); /* the warp's previous sum has read the list */
  if (lane_id() < m) list->row[lane_id()] = row, list->w[lane_id()] = w;
  __syncwarp();
}

/* Two rows ahead, the types known at run time: the low-latency kernels' blocks must stay small. */
static __device__ void reduce_rows(const void *const *rows, const float *w, int m, epx_dtype_t in_dtype, void *out,
                                   epx_dtype_t out_dtype, int hidden) {
  reduce_rows_ahead<2>(rows, w, m, in_dtype, out, out_dtype, hidden);
}

/* Destination side of an expert-layout combine: the rows of token t of src_rank here, from
 * channel c on, in ascending local expert: lane j < the return value gets the j-th one's
 * address (*row) and weight (*w). */
static __device__ int partial_row_lanes(const epxc_shape_t *s, const epxc_plan_t *plan, int src_rank,
                                        const epxc_peer_t *src, int64_t t, const epxc_combine_t *a, int64_t c,
                                        const void **row, float *w) {
  int64_t r;
  const int m = local_slot_lanes(s, plan, src_rank, src, t, &r, w);
  *row = NULL;
  if (lane_id() < m) {
    *w = !a->weighted ? 1.0f : a->row_probs ? a->row_probs[r] : *w;
    *row = (const char *)row_at(a->y, a->y_dtype, r, s->hidden) + (size_t)c * dtype_bytes(a->y_dtype);
  }
  return m;
}

/* CH 8-channel groups, 256 channels apart from c0, of the weighted sum of N rows of type Y:
 * every load goes out before the first is added. */
template <epx_dtype_t Y, int N, int CH>
static __device__ __forceinline__ void few_groups(const void *const *rows, const float *w, void *out, int64_t c0) {
  raw8_t r[CH][N];
#pragma unroll
  for (int k = 0; k < CH; k++)
#pragma unroll
    for (int j = 0; j < N; j++) r[k][j] = load_raw8(rows[j], Y, c0 + k * EPXC_CHUNK_CHANNELS);
#pragma unroll
  for (int k = 0; k < CH; k++) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < N; j++) {
      float v[8];
      widen8(r[k][j], Y, v);
#pragma unroll
      for (int i = 0; i < 8; i++) acc[i] = __fadd_rn(acc[i], __fmul_rn(w[j], v[i]));
    }
    store8(out, Y, c0 + k * EPXC_CHUNK_CHANNELS, acc);
  }
}

/* reduce_rows' weighted sum of N rows, N (1 to 4) and the type Y fixed at compile time: the
 * rows' addresses and weights stay in registers for the whole row, and a lane keeps N x CH
 * 16-byte loads in flight, CH = LOADS / N groups at once (at least 1; LOADS 4 for bf16, 2 for
 * float32: 4 bf16 loads for one, two or four rows, 3 for three). Most tokens bring one to four rows
 * to a rank (1.5 on average at 8 ranks of 256 experts, top-8; 4 at 2 ranks); there
 * reduce_rows' loop, which takes any number of rows of types known at run time, issues 202
 * instructions for two 8-channel groups of two rows, where this issues 125. */
template <epx_dtype_t Y, int N>
static __device__ __forceinline__ void reduce_few(const void *const *rows, const float *w, void *out, int hidden) {
  constexpr int LOADS = Y == EPX_BFLOAT16 ? 4 : 2, CH = LOADS / N > 1 ? LOADS / N : 1;
  const int lane = lane_id();
  const int64_t vec_end = hidden / EPXC_LANE_CHANNELS * EPXC_LANE_CHANNELS;
  int64_t c0 = EPXC_LANE_CHANNELS * lane;
  for (; c0 + (CH - 1) * EPXC_CHUNK_CHANNELS < vec_end; c0 += CH * EPXC_CHUNK_CHANNELS)
    few_groups<Y, N, CH>(rows, w, out, c0);
  for (; c0 < vec_end; c0 += EPXC_CHUNK_CHANNELS) few_groups<Y, N, 1>(rows, w, out, c0);
  reduce_rows_tail(rows, w, N, Y, out, Y, vec_end, hidden);
}

/* Channels [c, c + width) of token t of src_rank's partial (out points at its channel c): its
 * rows weighted and summed in ascending local expert. Each channel's sum is the same whatever
 * the range. Y is the rows' type (a->y_dtype). */
template <epx_dtype_t Y>
static __device__ void partial_of_token(const epxc_shape_t *s, const epxc_plan_t *plan, int src_rank,
                                        const epxc_peer_t *src, int64_t t, const epxc_combine_t *a, void *out,
                                        int64_t c, int width, warp_rows_t *list) {
  const void *my_row;
  float my_w;
  const int m = partial_row_lanes(s, plan, src_rank, src, t, a, c, &my_row, &my_w);
  if (m >= 1 && m <= 4) {
    const void *few[4];
    float few_w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) few[j] = lane_ptr(my_row, j), few_w[j] = __shfl_sync(0xffffffffu, my_w, j);
    switch (m) {
    case 1: reduce_few<Y, 1>(few, few_w, out, width); return;
    case 2: reduce_few<Y, 2>(few, few_w, out, width); return;
    case 3: reduce_few<Y, 3>(few, few_w, out, width); return;
    default: reduce_few<Y, 4>(few, few_w, out, width); return;
    }
  }
  list_lane_rows(list, m, my_row, my_w);
  /* the type as a run-time value: given Y, the compiler unrolls this sum for 16 rows and spills */
  reduce_rows(list->row, list->w, m, a->y_dtype, out, a->y_dtype, width);
}

/* Source side of a combine: the weight gradient of token t's slot k, from the row gradients
 * its destination published (0 for a slot that routed nowhere or was dropped there). */
static __device__ float slot_weight_grad_of(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan,
                                            int64_t t, int k) {
  const int K = s->topk, L = s->num_local, R = s->nranks;
  const int64_t W = plan->words;
  const int e = plan->idx[t * K + k];
  if (e < 0) return 0.0f;
  const int d = e / L;
  const float *wg = (const float *)peer_ptr(g, d, posted(g, d)->combine.row_weight_grad);
  int64_t row;
  if (s->expert_layout) {
    const int64_t at = bit_rank(plan->exp_bits + (int64_t)e * W, plan->exp_pre + (int64_t)e * W, t);
    const int32_t *kept = plan->peer[d].kept;
    if (kept && at >= kept[(int64_t)(e % L) * R + s->rank]) return 0.0f; /* dropped there: no row */
    row = plan->peer[d].pair_base[(int64_t)(e % L) * R + s->rank] + at;
  } else {
    const uint32_t *bits = plan->rank_bits + (int64_t)d * W;
    row = (plan->dest_base[d] + bit_rank(bits, plan->rank_pre + (int64_t)d * W, t)) * K + k;
  }
  return wg ? wg[row] : 0.0f;
}

/* The same, lanes < K taking a slot each. */
static __device__ void slot_weight_grad(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan, int64_t t,
                                        float *topk_weight_grad) {
  const int lane = lane_id();
  if (topk_weight_grad && lane < s->topk) topk_weight_grad[t * s->topk + lane] = slot_weight_grad_of(s, g, plan, t, lane);
}

#endif
