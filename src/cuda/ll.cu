/* Low-latency dispatch and combine for decode: one launch per operation, fixed shapes, no
 * host synchronisation, graph-capturable and replayable with new routings.
 *
 * Dispatch, in one kernel: block 0 plans this rank's routing (bitmaps and counts, as notify
 * does) while every block stages this rank's tokens in the receive type (fp8 is quantised
 * here, once per token); when all blocks have arrived, block 0 meets the peers in one
 * exchange (plan, staging), derives where every row lands and releases the other blocks,
 * which pull the rows that come to this rank straight into their final slots. Combine, in one
 * kernel: every block reduces the rows of the tokens this rank received into partials (row
 * (source, token)), block 0 meets the peers, then every block sums its tokens' partials in
 * rank order. A step has fewer rows than the launch has warps, so staging, pulls, partials and
 * sums each cut rows into slices of whole 256-channel chunks. Nothing waits for the peers to
 * finish reading: what they read is double-buffered by the parity of device-side call counts,
 * and the next operation's exchange proves they are done with the older copy. */
#include "cuda/exchange.cuh"
#include "cuda/rows.cuh"

/* Build with -DEPX_LL_TRACE to have rank 0's block 0 print when each phase of every launch
 * ended (trace.cuh: the launch's start, then ns since it): where a decode step's latency goes. */
#ifdef EPX_LL_TRACE
#include "cuda/trace.cuh"
#define LL_TRACE_DECL epxc_trace_t trace_ = {{0}, 0}
#define LL_TRACE() trace_mark(&trace_, threadIdx.x == 0 && blockIdx.x == 0)
#define LL_TRACE_PRINT(what) \
  trace_print(&trace_, threadIdx.x == 0 && blockIdx.x == 0 && s.rank == 0, "lltrace " what, 0)
#else
#define LL_TRACE_DECL
#define LL_TRACE() EPXC_NO_TRACE
#define LL_TRACE_PRINT(what) EPXC_NO_TRACE
#endif

/* Waits until *p >= target, on this rank's own memory (the blocks of one launch). */
static __device__ bool wait_local(const epxc_group_t *g, const uint64_t *p, uint64_t target, int phase) {
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 0;; spin++) {
    if (ld_acquire(p) >= target) return true;
    if ((spin & EPXC_POLL_MASK) == EPXC_POLL_MASK && globaltimer_ns() - start > g->timeout_ns) {
      record_error(g, EPX_ERR_TIMEOUT, phase, g->rank, (int64_t)(g->timeout_ns / 1000000));
      return false;
    }
  }
}

/* Every block announces it is done with its first part; block 0 waits for all of them. The
 * launch's round r was read by every block before it arrived, so block 0 may then advance it. */
static __device__ bool arrive_all(const epxc_group_t *g, epxc_state_t *st, uint64_t r, int phase) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    atomicAdd((unsigned long long *)&st->ll_arrived, 1ull);
  }
  if (blockIdx.x != 0) return true;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = wait_local(g, &st->ll_arrived, r * gridDim.x, phase);
    st->ll_rounds = r;
  }
  __syncthreads();
  return ok;
}

/* Block 0 lets the other blocks go on (also when it failed: they then see why and stop). */
static __device__ void release_all(epxc_state_t *st, uint64_t r) {
  __syncthreads();
  if (threadIdx.x == 0) st_release(&st->ll_ready, r);
}

/* The other blocks wait for that, polled by one thread so a warp never splits on the outcome.
 * Block 0 itself waits on the peers for up to the timeout, so these wait twice as long. */
static __device__ bool wait_ready(const epxc_group_t *g, epxc_state_t *st, uint64_t epoch, int phase) {
  __shared__ int ready;
  if (threadIdx.x == 0) {
    epxc_group_t twice = *g;
    twice.timeout_ns = 2 * g->timeout_ns;
    ready = wait_local(&twice, &st->ll_ready, epoch, phase);
  }
  __syncthreads();
  return ready;
}

/* A decode step has fewer rows than the launch has warps: rows that one warp would move alone
 * are cut into slices of whole 256-channel chunks (so fp8 blocks of 128 stay whole), as many
 * as keep every warp busy. Slice i of a row covers channels [i * width, min(H, (i+1) * width)). */
typedef struct {
  int width;
  int count;
} slicing_t;

static __device__ slicing_t slicing(int64_t rows, int hidden) {
  const int chunks = (hidden + EPXC_CHUNK_CHANNELS - 1) / EPXC_CHUNK_CHANNELS;
  int64_t want = rows > 0 ? (warp_count() + rows - 1) / rows : 1;
  want = want < 1 ? 1 : want > chunks ? chunks : want;
  const int width = (chunks + (int)want - 1) / (int)want * EPXC_CHUNK_CHANNELS;
  return (slicing_t){width, (hidden + width - 1) / width};
}

/* Byte offset of channel c of row t in a [*, hidden] array of type dt (where a slice starts). */
static __device__ __forceinline__ size_t slice_offset(epx_dtype_t dt, int64_t t, int hidden, int64_t c) {
  return ((size_t)t * hidden + (size_t)c) * dtype_bytes(dt);
}

/* Pair i of the (source rank, source token) walk both kernels spread over every warp (a source
 * alone has fewer tokens than the launch has warps): whether that token came to this rank. */
static __device__ __forceinline__ bool pair_arrived(const epxc_shape_t *s, const epxc_plan_t *plan, int64_t i,
                                                    int *src_rank, int64_t *t) {
  *src_rank = (int)(i / s->max_tokens);
  *t = i % s->max_tokens;
  const epxc_peer_t *src = &plan->peer[*src_rank];
  return *t < src->num_tokens && bit_set(src->rank_bits + (int64_t)s->rank * src->words, *t);
}

/* ---- planning (block 0) -------------------------------------------------------------------- */

/* Bitmaps, prefix popcounts and counts of this rank's routing, as notify's build does. A
 * decode step's bitmaps are a few words per row: they are built in shared memory, where
 * clearing them and setting bits cost no round trip to memory, and written out once, with
 * the prefix pass reading them from there. Larger ones are built in the plan itself. Inlined:
 * out of line, the kernel spilled 120 bytes instead of 700, and the EP2 decode dispatch took
 * 2-3 us longer (bench/RESULTS.md, 2026-12-02). */
static __device__ void plan_block(const epxc_shape_t *s, epxc_plan_t *plan, const epxc_plan_t *prev,
                                  const epxc_route_t *r) {
  const int K = s->topk, R = s->nranks, E = s->num_experts;
  const int64_t W = plan->words, T = r->num_tokens, words = (int64_t)(R + E) * W;
  __shared__ uint32_t staged_bits[EPXC_LL_PLAN_WORDS];
  const bool staged = words <= EPXC_LL_PLAN_WORDS;
  const epxc_bits_t b = staged ? (epxc_bits_t){staged_bits, staged_bits + (int64_t)R * W} : plan_bits(plan);
  for (int64_t i = threadIdx.x; i < (int64_t)R * W; i += blockDim.x) b.rank_bits[i] = 0;
  for (int64_t i = threadIdx.x; i < (int64_t)E * W; i += blockDim.x) b.exp_bits[i] = 0;
  const bool fits = T <= s->max_tokens;
  if (threadIdx.x == 0) {
    plan->num_tokens = fits ? T : 0; /* too many tokens: nothing of this rank is read */
    plan->bad_key = fits ? ~0ull : (uint64_t)EPX_ERR_LL_OVERFLOW;
  }
  __syncthreads();
  if (fits) {
    const bool replay = r->replay != 0;
    if (replay && (prev->status != EPX_SUCCESS || prev->group_status != EPX_SUCCESS) && threadIdx.x == 0)
      plan->bad_key = (uint64_t)EPX_ERR_INVALID_ARGUMENT; /* nothing valid to replay */
    int32_t ids[EPXC_MAX_TOPK];
    float ws[EPXC_MAX_TOPK];
    for (int64_t t = threadIdx.x; t < T && !(replay && (prev->status || prev->group_status)); t += blockDim.x) {
      int bad = 0, st = EPX_SUCCESS;
      if (replay)
#pragma unroll
        for (int k = 0; k < EPXC_MAX_TOPK; k++) /* compile-time slots: ids and ws stay in registers */
          ids[k] = k < K ? prev->idx[t * K + k] : -1, ws[k] = k < K ? prev->weight[t * K + k] : 0.0f;
      else
        st = read_route(s, t, r->topk_idx, r->idx_dtype, r->topk_weights, r->routing_map, r->probs, ids, ws, &bad);
      if (st != EPX_SUCCESS)
        atomicMin((unsigned long long *)&plan->bad_key, bad_route_key(t, bad, st));
      else
        plan_token(s, plan, b, t, ids, ws);
    }
  }
  __syncthreads();
  plan_prefix(s, plan, b, threadIdx.x / EPXC_WARP, blockDim.x / EPXC_WARP);
  /* the rank rows, then the expert rows: the plan's layout of both */
  for (int64_t i = threadIdx.x; staged && i < words; i += blockDim.x)
    (i < (int64_t)R * W ? plan->rank_bits[i] : plan->exp_bits[i - (int64_t)R * W]) = staged_bits[i];
  __syncthreads();
  if (threadIdx.x == 0) plan->status = plan_status(plan->bad_key);
  __syncthreads();
}

/* After the exchange (the plan each rank published): every rank's send side as this rank reads it, and
 * where every source's pairs land here. Fixed blocks of R * max_tokens rows per local expert,
 * packed by (source rank, source token). */
static __device__ void place_block(const epxc_shape_t *s, const epxc_group_t *g, epxc_plan_t *plan) {
  const int R = s->nranks, L = s->num_local, me = s->rank;
  const epxc_state_t *st = g->state[g->rank];
  if (threadIdx.x < R) peer_view(g, threadIdx.x, st->got[threadIdx.x].ll_dispatch.plan, &plan->peer[threadIdx.x]);
  __syncthreads();
  /* every (expert, source) count read at once: one round trip to the peers, not R */
  __shared__ int32_t count[EPX_MAX_EXPERTS]; /* [L, R] */
  for (int i = threadIdx.x; i < L * R; i += blockDim.x) count[i] = plan->peer[i % R].counts[R + me * L + i / R];
  __syncthreads();
  /* the total is summed as the counts are placed (a warp sum, then one shared add per warp),
   * not read back from memory by one thread */
  __shared__ unsigned int pairs;
  if (threadIdx.x == 0) pairs = 0;
  __syncthreads();
  unsigned int mine = 0;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int64_t n = 0;
    const int64_t block = (int64_t)l * R * s->max_tokens;
    for (int q = 0; q < R; q++) {
      plan->pair_base[(int64_t)l * R + q] = block + n;
      n += count[l * R + q];
    }
    plan->pairs_local[l] = (int32_t)n;
    plan->block[l] = block;
    mine += (unsigned int)n;
  }
  mine = __reduce_add_sync(0xffffffffu, mine);
  if (lane_id() == 0 && mine) atomicAdd(&pairs, mine);
  __syncthreads();
  if (threadIdx.x == 0) {
    plan->block[L] = (int64_t)L * R * s->max_tokens;
    plan->num_pairs = (int64_t)pairs;
    plan->num_rows = plan->block[L];
  }
  __syncthreads();
}

/* ---- dispatch ------------------------------------------------------------------------------ */

/* The rows that come to this rank, pulled from their sources' staging into their final rows:
 * (source, token) pairs in slices, as the staging, since a step has fewer rows than warps. The
 * first slice of a row writes its weights (recv_probs), the others leave them. */
static __device__ __forceinline__ void pull_rows(const epxc_shape_t *s, const epxc_group_t *g,
                                                 const epxc_plan_t *plan, const epxc_dispatch_t *a) {
  const int H = s->hidden, R = s->nranks, lane = lane_id();
  const int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const bool fp8 = a->recv_dtype == EPX_FP8_E4M3, scaled = a->scale_by_probs != 0;
  const int candidates = R * s->max_tokens;
  const slicing_t sl = slicing(candidates, H);
  for (int i = (int)warp_global(); i < candidates * sl.count; i += (int)warp_count()) {
    int src_rank;
    int64_t t;
    const int pair = i / sl.count, c = (i - pair * sl.count) * sl.width, w = min(sl.width, H - c);
    if (!pair_arrived(s, plan, pair, &src_rank, &t)) continue;
    const epxc_peer_t *src = &plan->peer[src_rank];
    const epxc_ll_dispatch_words_t *sent = &posted(g, src_rank)->ll_dispatch;
    const void *stage = peer_ptr(g, src_rank, sent->stage);
    const float *stage_scales = (const float *)peer_ptr(g, src_rank, sent->stage_scales);
    const epx_dtype_t src_dtype = (epx_dtype_t)sent->stage_dtype; /* as the source staged it */
    void *dst[EPXC_MAX_TOPK];
    float *dscale[EPXC_MAX_TOPK];
    float factor[EPXC_MAX_TOPK];
    const int m = expert_rows(s, plan, src_rank, src, t, a, c, dst, dscale, factor);
    const void *in = (const char *)stage + slice_offset(src_dtype, t, H, c);
    if (scaled || src_dtype != a->recv_dtype) { /* scaled copies, or staged in x's type */
      convert_row(in, src_dtype, a->recv_dtype, w, dst, dscale, factor, scaled, m);
    } else {
      copy_row_raw(in, dst, m, (int64_t)w * dtype_bytes(a->recv_dtype));
      const int first = (int)t * blocks + c / EPX_FP8_BLOCK, n = (w + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
      for (int j = 0; fp8 && j < m; j++)
        for (int b = lane; b < n; b += EPXC_WARP) dscale[j][b] = stage_scales[first + b];
    }
  }
}

/* Two half-size blocks per SM of the budget: the SM's 1024 threads, as a work kernel's one
 * block has, while the ranks x num_sms <= SM count rule still makes every block of every rank
 * on the GPU resident at once. */
static int ll_blocks(const epxc_shape_t *s) { return EPXC_LL_BLOCKS_PER_SM * s->num_sms; }

static __global__ void __launch_bounds__(EPXC_LL_THREADS, EPXC_LL_BLOCKS_PER_SM)
    ll_dispatch_kernel(epxc_shape_t s, epxc_group_t g, epxc_ll_t *ll, epxc_route_t route, epxc_dispatch_t a,
                       epxc_stamp_t stamp) {
  LL_TRACE_DECL;
  LL_TRACE();
  epxc_state_t *st = g.state[g.rank];
  if (((volatile epxc_state_t *)st)->aborted) return;
  /* read before block 0 can move them (it does so only after every block has arrived) */
  const uint64_t seq0 = st->seq, r = st->ll_rounds + 1, calls = ll->dispatches;
  const bool complete = a.part == EPX_PART_COMPLETE;
  /* a COMPLETE finishes what its SEND started: that exchange, that plan */
  const int p = complete ? ll->dispatch_plan : (int)(calls & 1);
  const uint64_t epoch = complete ? ll->dispatch_epoch : seq0 + 1;
  epxc_plan_t *plan = ll->plan[p];
  const int H = s.hidden;
  const int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const bool fp8 = a.recv_dtype == EPX_FP8_E4M3, scaled = a.scale_by_probs != 0;
  /* staged in the receive type, unless every pair scales its copy: then in x's */
  const epx_dtype_t stage_dtype = scaled ? a.x_dtype : a.recv_dtype;

  if (!complete) {
    const int64_t T = route.num_tokens;
    if (blockIdx.x == 0) plan_block(&s, plan, ll->plan[p ^ 1], &route);
    LL_TRACE(); /* 1: planned */
    /* the other blocks stage while block 0 plans: its share would come only after its plan */
    const int block_warps = blockDim.x / EPXC_WARP;
    const slicing_t sl = slicing(T, H);
    for (int i = (int)warp_global() - block_warps; blockIdx.x != 0 && T <= s.max_tokens && i < (int)T * sl.count;
         i += (int)warp_count() - block_warps) {
      const int t = i / sl.count, c = (i - t * sl.count) * sl.width, w = min(sl.width, H - c);
      const void *in = (const char *)a.x + slice_offset(a.x_dtype, t, H, c);
      void *dst = (char *)ll->stage[p] + slice_offset(stage_dtype, t, H, c);
      float *dscale = fp8 && !scaled ? ll->stage_scales[p] + t * blocks + c / EPX_FP8_BLOCK : NULL;
      const float one = 1.0f;
      if (stage_dtype == a.x_dtype)
        copy_row_raw(in, &dst, 1, w * (int64_t)dtype_bytes(a.x_dtype));
      else
        convert_row(in, a.x_dtype, stage_dtype, (int)w, &dst, &dscale, &one, 0, 1);
    }
    const bool arrived = arrive_all(&g, st, r, EPXC_PH_LL_DISPATCH);
    LL_TRACE(); /* 2: staged, every block arrived */
    if (blockIdx.x != 0 && a.part == EPX_PART_SEND) return;
    if (blockIdx.x == 0) {
      if (!arrived && threadIdx.x == 0) st->aborted = 1;
      __syncthreads();
      epxc_words_t w = {};
      w.ll_dispatch.status = (uint64_t)(uint32_t)plan->status;
      w.ll_dispatch.plan = (uint64_t)(uintptr_t)plan;
      w.ll_dispatch.stage = (uint64_t)(uintptr_t)ll->stage[p];
      w.ll_dispatch.stage_scales = (uint64_t)(uintptr_t)ll->stage_scales[p];
      w.ll_dispatch.stage_dtype = (uint64_t)stage_dtype;
      const uint64_t posted = exchange_post(&g, EPXC_PH_LL_DISPATCH, &w, stamp);
      if (threadIdx.x == 0) {
        ll->dispatches = calls + 1;
        ll->dispatch_epoch = posted;
        ll->dispatch_plan = p;
      }
      if (a.part == EPX_PART_SEND) return;
    }
  }
  if (blockIdx.x == 0) {
    LL_TRACE(); /* 3: posted */
    const bool met = exchange_wait(&g, EPXC_PH_LL_DISPATCH, st->aborted ? 0 : epoch);
    LL_TRACE(); /* 4: every peer posted */
    if (met && st->group_status == EPX_SUCCESS) place_block(&s, &g, plan);
    if (threadIdx.x == 0) plan->group_status = st->aborted ? EPX_ERR_BROKEN : st->group_status;
    release_all(st, epoch);
    LL_TRACE(); /* 5: placed, released */
  } else if (!wait_ready(&g, st, epoch, EPXC_PH_LL_DISPATCH)) {
    return;
  }
  if (((volatile epxc_plan_t *)plan)->group_status != EPX_SUCCESS) return;
  write_counts(&s, plan, &a);

  pull_rows(&s, &g, plan, &a);
  LL_TRACE(); /* 6: block 0's rows copied */
  LL_TRACE_PRINT("dispatch plan stage post wait place copy");
}

extern "C" int epxc_ll_dispatch(const epxc_shape_t *s, const epxc_group_t *g, epxc_ll_t *ll_dev, const epxc_route_t *r,
                                const epxc_dispatch_t *a, const epxc_stamp_t *stamp, void *stream) {
  ll_dispatch_kernel<<<ll_blocks(s), EPXC_LL_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, ll_dev, *r, *a, *stamp);
  return (int)cudaGetLastError();
}

/* ---- combine ------------------------------------------------------------------------------- */

/* Across processes: the row weight gradients of the rows in use, copied where peers reach
 * them (every block takes a share). */
static __device__ void stage_wgrad(const epxc_shape_t *s, const epxc_plan_t *plan, const float *from, float *to) {
  const int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, step = (int64_t)gridDim.x * blockDim.x;
  for (int l = 0; l < s->num_local; l++)
    for (int64_t i = i0; i < plan->pairs_local[l]; i += step) to[plan->block[l] + i] = from[plan->block[l] + i];
}

static __global__ void __launch_bounds__(EPXC_LL_THREADS, EPXC_LL_BLOCKS_PER_SM)
    ll_combine_kernel(epxc_shape_t s, epxc_group_t g, epxc_ll_t *ll, epxc_combine_t a, epxc_stamp_t stamp) {
  LL_TRACE_DECL;
  LL_TRACE();
  epxc_state_t *st = g.state[g.rank];
  if (((volatile epxc_state_t *)st)->aborted) return;
  const uint64_t seq0 = st->seq, r = st->ll_rounds + 1, calls = ll->combines;
  const bool complete = a.part == EPX_PART_COMPLETE;
  const epxc_plan_t *plan = ll->plan[complete ? ll->combine_plan : (int)((ll->dispatches - 1) & 1)];
  const uint64_t epoch = complete ? ll->combine_epoch : seq0 + 1;
  /* A refused plan is refused on every rank: all skip the work but still meet, so a rank that
   * fails its arguments (and only posts) meets them too. */
  const bool live = plan->group_status == EPX_SUCCESS;
  const int H = s.hidden, R = s.nranks, me = s.rank;

  if (!complete) {
    /* partials of the tokens that came here: row (source, token), local experts ascending */
    void *partials = ll->partials[calls & 1];
    const int candidates = R * s.max_tokens;
    const slicing_t sl = slicing(candidates, H);
    for (int i = (int)warp_global(); live && i < candidates * sl.count; i += (int)warp_count()) {
      int src_rank;
      int64_t t;
      const int pair = i / sl.count, c = (i - pair * sl.count) * sl.width, w = min(sl.width, H - c);
      if (!pair_arrived(&s, plan, pair, &src_rank, &t)) continue;
      partial_of_token(&s, plan, src_rank, &plan->peer[src_rank], t, &a,
                       (char *)partials + slice_offset(a.y_dtype, pair, H, c), c, w);
    }
    /* Across processes peers reach only this rank's arena: the weight gradients go there first
     * (double-buffered like the partials, for the same reason). */
    const float *wgrad = a.row_weight_grad;
    if (wgrad && ll->wgrad[0]) {
      if (live) stage_wgrad(&s, plan, wgrad, ll->wgrad[calls & 1]);
      wgrad = ll->wgrad[calls & 1];
    }
    LL_TRACE(); /* 1: partials */
    const bool arrived = arrive_all(&g, st, r, EPXC_PH_LL_COMBINE);
    LL_TRACE(); /* 2: every block arrived */
    if (blockIdx.x != 0 && a.part == EPX_PART_SEND) return;
    if (blockIdx.x == 0) {
      if (!arrived && threadIdx.x == 0) st->aborted = 1;
      __syncthreads();
      epxc_words_t w = {};
      w.combine.status = (uint64_t)(uint32_t)plan->group_status;
      w.combine.rows = (uint64_t)(uintptr_t)partials;
      w.combine.row_weight_grad = (uint64_t)(uintptr_t)wgrad;
      const uint64_t posted = exchange_post(&g, EPXC_PH_LL_COMBINE, &w, stamp);
      if (threadIdx.x == 0) {
        ll->combines = calls + 1;
        ll->combine_epoch = posted;
        ll->combine_plan = (int)((ll->dispatches - 1) & 1);
      }
      if (a.part == EPX_PART_SEND) return;
    }
  }
  if (blockIdx.x == 0) {
    LL_TRACE(); /* 3: posted */
    exchange_wait(&g, EPXC_PH_LL_COMBINE, st->aborted ? 0 : epoch);
    release_all(st, epoch);
    LL_TRACE(); /* 4: every peer posted, released */
  } else if (!wait_ready(&g, st, epoch, EPXC_PH_LL_COMBINE)) {
    return;
  }
  if (((volatile epxc_state_t *)st)->aborted || ((volatile epxc_state_t *)st)->group_status != EPX_SUCCESS) return;

  /* this rank's tokens: partials summed in destination order */
  const int64_t T = plan->num_tokens, W = plan->words;
  const slicing_t sl = slicing(T, H);
  for (int i = (int)warp_global(); i < (int)T * sl.count; i += (int)warp_count()) {
    const int t = i / sl.count, c = (i - t * sl.count) * sl.width, w = min(sl.width, H - c);
    const void *rows[EPX_MAX_RANKS];
    int m = 0;
    for (int d = 0; d < R; d++)
      if (bit_set(plan->rank_bits + (int64_t)d * W, t))
        rows[m++] = (const char *)peer_ptr(&g, d, posted(&g, d)->combine.rows) +
                    slice_offset(a.y_dtype, (int64_t)me * s.max_tokens + t, H, c);
    reduce_rows(rows, NULL, m, a.y_dtype, (char *)a.out + slice_offset(a.out_dtype, t, H, c), a.out_dtype, (int)w);
    if (c == 0) slot_weight_grad(&s, &g, plan, t, a.topk_weight_grad);
  }
  LL_TRACE(); /* 5: block 0's sums */
  LL_TRACE_PRINT("combine partials arrive post wait sum");
}

extern "C" int epxc_ll_combine(const epxc_shape_t *s, const epxc_group_t *g, epxc_ll_t *ll_dev, const epxc_combine_t *a,
                               const epxc_stamp_t *stamp, void *stream) {
  ll_combine_kernel<<<ll_blocks(s), EPXC_LL_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, ll_dev, *a, *stamp);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_ll(size_t *stack) {
  const void *const kernels[] = {(const void *)ll_dispatch_kernel, (const void *)ll_combine_kernel};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}
