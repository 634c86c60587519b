/* High-throughput dispatch and combine: the fused path for prefill and training.
 *
 * Dispatch: each destination reads every token that comes to it once from its source and
 * writes it to its final rows: its token row, or one row per local expert it chose (the extra
 * copies are made here, on the receiving side, so a token crosses the link once per rank).
 * Combine: each destination first reduces its rows of a token into one partial (expert
 * layout), then each source reads its tokens' rows back and sums them in rank order.
 *
 * Dispatch has four kernels, picked by one rule (ht_bulk_dispatch, ht_staged and ht_converts, at the end):
 *  - pipelined (bulk.cuh): rows move by bulk asynchronous copies through each warp's ring of
 *    shared-memory stages; a warp describes a bitmap word's 32 tokens at once, then streams
 *    them. Every dispatch whose rows arrive as they were sent (same type, no scaling).
 *  - staged fp8 (staged.cuh), a warp per token: bf16 rows quantised to fp8 from chunks the
 *    copy engine brings into the warp's stages, stored by the lanes to every row of the token
 *    (ht_staged says where: sm_90, not scaled, rows of more than 1024 channels).
 *  - converting (ring.cuh), a warp per token: the other dispatches that convert (fp8, quantised
 *    per 128 channels on the fly; scaled by the routing weight), each row read through its
 *    lanes' rings of asynchronous copies.
 *  - per token, 16-byte vectors through registers: rows as they were sent, on devices without
 *    the bulk-copy engine.
 * Combine goes a warp per token. */
#include "cuda/bulk.cuh"
#include "cuda/ring.cuh"
#include "cuda/staged.cuh"

/* ---- dispatch, a warp per token ----------------------------------------------------------- */

/* Where token t of src_rank (which comes here) goes: lane j < the return value gets its
 * destination row j (*dst), that row's fp8 scales (*dscale) and its factor (the routing
 * weight, applied when the dispatch scales). Writes the token's routing (recv_topk_* in the
 * token layout, recv_probs in the expert layout). */
static __device__ __forceinline__ int token_dests(const epxc_shape_t *s, const epxc_plan_t *plan, int src_rank,
                                                  const epxc_peer_t *src, int64_t t, const epxc_dispatch_t *a,
                                                  void **dst, float **dscale, float *factor) {
  const int K = s->topk, L = s->num_local, me = s->rank, H = s->hidden, lane = lane_id();
  const bool fp8 = a->recv_dtype == EPX_FP8_E4M3;
  const int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  *dst = NULL;
  *dscale = NULL;
  *factor = 1.0f;
  if (!s->expert_layout) {
    const int64_t W = src->words;
    const int64_t n =
        plan->tok_base[src_rank] + bit_rank(src->rank_bits + (int64_t)me * W, src->rank_pre + (int64_t)me * W, t);
    if (lane == 0) {
      *dst = row_at_mut(a->recv_x, a->recv_dtype, n, H);
      *dscale = fp8 ? a->recv_scales + n * blocks : NULL;
    }
    if (lane < K) {
      const int e = src->idx[t * K + lane];
      const bool here = e >= 0 && e / L == me;
      if (a->recv_topk_idx) a->recv_topk_idx[n * K + lane] = here ? e % L : -1;
      if (a->recv_topk_weights) a->recv_topk_weights[n * K + lane] = here ? src->weight[t * K + lane] : 0.0f;
    }
    return 1;
  }
  int64_t row;
  float w;
  const int m = local_slot_lanes(s, plan, src_rank, src, t, &row, &w);
  if (lane < m) {
    *dst = row_at_mut(a->recv_x, a->recv_dtype, row, H);
    *dscale = fp8 ? a->recv_scales + row * blocks : NULL;
    *factor = w;
    if (a->recv_probs) a->recv_probs[row] = w;
  }
  return m;
}

/* Every launch of the dispatch: nothing when the plan is void or the output too small;
 * otherwise the counts, the expert layout's padding. False: nothing more to do. */
static __device__ bool dispatch_begins(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan,
                                       const epxc_dispatch_t *a) {
  if (plan_void(g, plan) || !output_fits(s, g, plan, a)) return false;
  write_counts(s, plan, a);
  zero_padding(s, plan, a);
  return true;
}

/* CONVERT: rows of X converted on the way, read through the lanes' rings (ring.cuh), launched
 * with their shared memory. Otherwise rows as they were sent, 16-byte vectors through
 * registers (devices without the bulk-copy engine; X does not matter). */
template <epx_dtype_t X, bool CONVERT>
static __global__ void __launch_bounds__(EPXC_THREADS) dispatch_token_kernel(epxc_shape_t s, epxc_group_t g,
                                                                      const epxc_plan_t *plan, epxc_dispatch_t a) {
  if (!dispatch_begins(&s, &g, plan, &a)) return;
  const bool scaled = a.scale_by_probs && s.expert_layout;
  const int64_t row_bytes = (int64_t)s.hidden * dtype_bytes(a.recv_dtype);
  uint4 *ring = lane_ring();
  for (int src_rank = 0; src_rank < s.nranks; src_rank++) {
    const epxc_peer_t *src = &plan->peer[src_rank];
    const void *x = peer_ptr(&g, src_rank, posted(&g, src_rank)->ht_dispatch.x);
    const uint32_t *bits = src->rank_bits + (int64_t)s.rank * src->words;
    for (int64_t t = warp_global(); t < src->num_tokens; t += warp_count()) {
      if (!bit_set(bits, t)) continue;
      void *dst;
      float *dscale, factor;
      const int m = token_dests(&s, plan, src_rank, src, t, &a, &dst, &dscale, &factor);
      const void *in = row_at(x, CONVERT ? X : a.x_dtype, t, s.hidden);
      if (CONVERT) {
        convert_row_ring<X>(ring, in, a.recv_dtype, s.hidden, dst, dscale, factor, scaled, m);
      } else {
        copy_row_raw(in, dst, m, row_bytes);
      }
    }
  }
}

/* ---- dispatch, staged fp8 ----------------------------------------------------------------- */

/* A token of a source for this rank. */
typedef struct {
  int src_rank;
  int64_t t;
} token_at_t;

/* The warp's next token for this rank after *at (its first when at->src_rank < 0), in the
 * per-token kernels' order: false past its last. */
static __device__ bool next_token_here(const epxc_shape_t *s, const epxc_plan_t *plan, token_at_t *at) {
  int64_t t = at->src_rank < 0 ? warp_global() : at->t + warp_count();
  for (int r = at->src_rank < 0 ? 0 : at->src_rank; r < s->nranks; r++, t = warp_global()) {
    const epxc_peer_t *src = &plan->peer[r];
    const uint32_t *bits = src->rank_bits + (int64_t)s->rank * src->words;
    for (; t < src->num_tokens; t += warp_count())
      if (bit_set(bits, t)) {
        at->src_rank = r, at->t = t;
        return true;
      }
  }
  return false;
}

static __device__ staged_row_t staged_row_of(const epxc_shape_t *s, const epxc_group_t *g, const token_at_t *at,
                                             bool any) {
  const int chunks = (s->hidden + EPXC_STAGED_CHUNK - 1) / EPXC_STAGED_CHUNK;
  if (!any) return (staged_row_t){NULL, 0, 0};
  const void *x = peer_ptr(g, at->src_rank, posted(g, at->src_rank)->ht_dispatch.x);
  return (staged_row_t){(const uint16_t *)row_at(x, EPX_BFLOAT16, at->t, s->hidden), chunks, 0};
}

/* bf16 rows quantised to fp8 through the warps' stages (staged.cuh), a warp per token as in
 * the per-token kernels: while a token's last chunks are quantised, the next one's first are
 * already loading, and its destinations are looked up while its own first chunk lands. */
static __global__ void __launch_bounds__(EPXC_THREADS) dispatch_staged_kernel(epxc_shape_t s, epxc_group_t g,
                                                                       const epxc_plan_t *plan, epxc_dispatch_t a) {
  /* lane 0's answer for the warp: lanes that parted here would wait on barriers lane 0 arms */
  if (!__shfl_sync(0xffffffffu, (int)dispatch_begins(&s, &g, plan, &a), 0)) return;
  staged_warp_t *w = staged_warp_setup();
  staged_ring_t ring = {0, 0};
  const bool lead = lane_id() == 0;
  token_at_t cur = {-1, 0};
  bool more = next_token_here(&s, plan, &cur);
  staged_row_t row = staged_row_of(&s, &g, &cur, more);
  for (int i = 0; lead && i < EPXC_STAGED_IN; i++) staged_load_next(w, &ring, &row, NULL, s.hidden);
  while (more) {
    token_at_t at = cur;
    const bool then = next_token_here(&s, plan, &at);
    staged_row_t next = staged_row_of(&s, &g, &at, then);
    void *dst;
    float *dscale, factor;
    const int m = token_dests(&s, plan, cur.src_rank, &plan->peer[cur.src_rank], cur.t, &a, &dst, &dscale, &factor);
    staged_set_dests(w, m, dst, dscale);
    for (int k = 0; k < row.chunks; k++) {
      staged_convert_next(w, &ring, s.hidden, k, m);
      if (lead) staged_load_next(w, &ring, &row, &next, s.hidden);
    }
    cur = at, more = then, row = next;
  }
}

/* ---- dispatch, pipelined: where a batch's rows come from and go ------------------------- */

/* A batch of the pipelined kernels: word `word` of source `src_rank`'s bitmaps. Items are
 * dealt to the warps source-fastest, so a block's warps read from every peer at once; false
 * past every source's last word. */
static __device__ bool batch_of(const epxc_shape_t *s, const epxc_plan_t *plan, int64_t item, int *src_rank,
                                int64_t *word) {
  int64_t words = 0;
  for (int r = 0; r < s->nranks; r++) words = max(words, (plan->peer[r].num_tokens + 31) / 32);
  *src_rank = (int)(item % s->nranks);
  *word = item / s->nranks;
  return *word < words;
}

/* Word `word` of src's bitmap row for this rank: 0 past src's own tokens (the row's stride is
 * src's capacity, and a source with fewer tokens than another has fewer words). */
static __device__ uint32_t bits_here(const epxc_shape_t *s, const epxc_peer_t *src, int64_t word) {
  return word * EPXC_WARP < src->num_tokens ? src->rank_bits[(int64_t)s->rank * src->words + word] : 0u;
}

/* Lane i, token t = 32 word + i of src, expert layout: its slots that land (and are kept)
 * here, in local_slots' order (ascending local expert, ties in slot order): slot k goes to place
 * pos[k] (-1: not here), receive row row[k], routing weight w[k]. One round trip for the
 * slots, one for the expert bitmaps and weights of those here. */
typedef struct {
  int m;
  int pos[EPXC_MAX_TOPK];
  int64_t row[EPXC_MAX_TOPK];
  float w[EPXC_MAX_TOPK];
} lane_slots_t;

static __device__ void lane_local_slots(const epxc_shape_t *s, const epxc_plan_t *plan, int src_rank,
                                        const epxc_peer_t *src, int64_t t, lane_slots_t *o) {
  const int K = s->topk, L = s->num_local, R = s->nranks, me = s->rank;
  const int64_t W = src->words, word = t >> 5;
  const uint32_t below = (1u << (t & 31)) - 1u;
  int lk[EPXC_MAX_TOPK];
  int32_t at[EPXC_MAX_TOPK]; /* the slot's place among src's pairs of its expert */
#pragma unroll
  for (int k = 0; k < EPXC_MAX_TOPK; k++) {
    const int e = k < K ? src->idx[t * K + k] : -1;
    lk[k] = e >= 0 && e / L == me ? e % L : -1;
  }
#pragma unroll
  for (int k = 0; k < EPXC_MAX_TOPK; k++) {
    if (lk[k] < 0) continue;
    const int64_t e = (int64_t)me * L + lk[k];
    at[k] = src->exp_pre[e * W + word] + __popc(src->exp_bits[e * W + word] & below);
    if (plan->kept && at[k] >= plan->kept[(int64_t)lk[k] * R + src_rank]) lk[k] = -1; /* dropped: budget */
  }
  o->m = 0;
#pragma unroll
  for (int k = 0; k < EPXC_MAX_TOPK; k++) {
    o->pos[k] = -1;
    if (lk[k] < 0) continue;
    int p = 0;
#pragma unroll
    for (int q = 0; q < EPXC_MAX_TOPK; q++) p += lk[q] >= 0 && (lk[q] < lk[k] || (lk[q] == lk[k] && q < k));
    o->pos[k] = p;
    o->row[k] = plan->pair_base[(int64_t)lk[k] * R + src_rank] + at[k];
    o->w[k] = src->weight[t * K + k];
    o->m++;
  }
}

/* Lane i: token t = 32 word + i of src_rank, if it comes here: where it is read and the rows
 * it is written to (with its routing: recv_topk_* in the token layout, recv_probs in the
 * expert layout). */
static __device__ void describe_dispatch(const epxc_shape_t *s, const epxc_plan_t *plan, const epxc_group_t *g,
                                         int src_rank, int64_t word, const epxc_dispatch_t *a, bulk_warp_t *w) {
  const int K = s->topk, L = s->num_local, me = s->rank, lane = lane_id();
  const epxc_peer_t *src = &plan->peer[src_rank];
  const int64_t W = src->words, t = word * EPXC_WARP + lane;
  const size_t rb = (size_t)s->hidden * dtype_bytes(a->recv_dtype);
  const uint32_t bits = bits_here(s, src, word);
  bulk_copy_job_t *j = &w->job[lane];
  int m = 0;
  if ((bits >> lane) & 1) {
    j->src = (const uint8_t *)peer_ptr(g, src_rank, posted(g, src_rank)->ht_dispatch.x) + t * rb;
    if (!s->expert_layout) {
      const int64_t n = plan->tok_base[src_rank] + src->rank_pre[(int64_t)me * W + word] + __popc(bits & ((1u << lane) - 1u));
      j->dst[0] = (uint8_t *)a->recv_x + n * rb;
      m = 1;
      for (int k = 0; k < K; k++) {
        const int e = src->idx[t * K + k];
        const bool here = e >= 0 && e / L == me;
        if (a->recv_topk_idx) a->recv_topk_idx[n * K + k] = here ? e % L : -1;
        if (a->recv_topk_weights) a->recv_topk_weights[n * K + k] = here ? src->weight[t * K + k] : 0.0f;
      }
    } else {
      lane_slots_t o;
      lane_local_slots(s, plan, src_rank, src, t, &o);
#pragma unroll
      for (int k = 0; k < EPXC_MAX_TOPK; k++) {
        if (o.pos[k] < 0) continue;
        j->dst[o.pos[k]] = (uint8_t *)a->recv_x + o.row[k] * rb;
        if (a->recv_probs) a->recv_probs[o.row[k]] = o.w[k];
      }
      m = o.m;
    }
  }
  w->m[lane] = (int8_t)m;
  __syncwarp();
}

static __global__ void __launch_bounds__(EPXC_BULK_WARPS * EPXC_WARP) dispatch_bulk_kernel(epxc_shape_t s, epxc_group_t g,
                                                                                        const epxc_plan_t *plan,
                                                                                        epxc_dispatch_t a) {
  if (plan_void(&g, plan)) return;
  if (!output_fits(&s, &g, plan, &a)) return;
  write_counts(&s, plan, &a);
  zero_padding(&s, plan, &a);
  bulk_warp_t *w = bulk_warp_setup();
  bulk_ring_t ring = {0, 0};
  const int32_t row_bytes = (int32_t)(s.hidden * dtype_bytes(a.recv_dtype));
  int src_rank;
  int64_t word;
  for (int64_t item = warp_global(); batch_of(&s, plan, item, &src_rank, &word); item += warp_count()) {
    describe_dispatch(&s, plan, &g, src_rank, word, &a, w);
    bulk_copy_batch(w, &ring, row_bytes);
  }
  bulk_copy_finish();
}

/* ---- combine, a warp per token ------------------------------------------------------------ */

/* Expert layout, on the destination: partial[n] = round(sum over local experts ascending of
 * w * y[row]), one per arrived token. (Reading its rows through the lanes' rings, ring.cuh,
 * was measured at half this kernel's speed.) */
template <epx_dtype_t Y>
static __global__ void __launch_bounds__(EPXC_THREADS) partials_token_kernel(epxc_shape_t s, epxc_group_t g,
                                                                            const epxc_plan_t *plan, epxc_combine_t a) {
  if (plan_void(&g, plan) || plan->refused) return;
  if (plan->num_recv > a.partial_rows) { /* the dispatch this inverts never ran with these sizes */
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      ((epxc_plan_t *)plan)->refused = EPX_ERR_OUTPUT_TOO_SMALL;
      record_error(&g, EPX_ERR_OUTPUT_TOO_SMALL, EPXC_PH_COMBINE, s.rank, plan->num_recv);
    }
    return;
  }
  const int R = s.nranks, me = s.rank, H = s.hidden;
  __shared__ warp_rows_t lists[EPXC_WARPS];
  for (int src_rank = 0; src_rank < R; src_rank++) {
    const epxc_peer_t *src = &plan->peer[src_rank];
    const int64_t T = src->num_tokens, W = src->words;
    const uint32_t *bits = src->rank_bits + (int64_t)me * W;
    const int32_t *pre = src->rank_pre + (int64_t)me * W;
    for (int64_t t = warp_global(); t < T; t += warp_count()) {
      if (!bit_set(bits, t)) continue;
      const int64_t n = plan->tok_base[src_rank] + bit_rank(bits, pre, t);
      partial_of_token<Y>(&s, plan, src_rank, src, t, &a, row_at_mut(a.partials, Y, n, H), 0, H, warp_rows_of(lists));
    }
  }
}

/* On the source: out[t] = round(sum over destinations d ascending of rows_d[row of t on d]),
 * where rows_d is d's y (token layout) or d's partials (expert layout), as d published them in
 * the combine exchange (or this rank's staged copy of them, all-to-all); rows of type Y, out
 * of type OUT. A token reaches at most K ranks. */
/* Lane d of the warp on token t (and lane d - 32, for ranks past 32): where t's row on
 * destination d is, if t went there. Every destination's bitmap word, prefix and published
 * rows are loaded at once, a lane each: one round trip for the token, not two per rank. */
template <epx_dtype_t Y>
static __device__ const void *source_row_of(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan,
                                            const epxc_combine_t *a, int64_t t, int d, bool *in) {
  *in = false;
  if (d >= s->nranks) return NULL;
  const int64_t W = plan->words, word = t >> 5;
  const uint32_t bits = plan->rank_bits[(int64_t)d * W + word];
  const int32_t pre = plan->rank_pre[(int64_t)d * W + word];
  const void *base = a->staged ? row_at(a->staged, Y, plan->send_base[d], s->hidden)
                               : row_at(peer_ptr(g, d, posted(g, d)->combine.rows), Y, plan->dest_base[d], s->hidden);
  *in = (bits >> (t & 31)) & 1u;
  return row_at(base, Y, (int64_t)pre + __popc(bits & ((1u << (t & 31)) - 1u)), s->hidden);
}

template <epx_dtype_t Y, epx_dtype_t OUT>
static __global__ void __launch_bounds__(EPXC_THREADS) reduce_token_kernel(epxc_shape_t s, epxc_group_t g,
                                                                          const epxc_plan_t *plan, epxc_combine_t a) {
  if (plan_void(&g, plan)) return;
  const int H = s.hidden, lane = lane_id();
  const int64_t T = plan->num_tokens;
  static_assert(EPX_MAX_RANKS <= 2 * EPXC_WARP, "a lane looks up at most two destinations");
  __shared__ const void *warp_rows[EPXC_WARPS][EPXC_MAX_TOPK];
  const void **rows = warp_rows[threadIdx.x / EPXC_WARP];
  for (int64_t t = warp_global(); t < T; t += warp_count()) {
    bool in_lo, in_hi;
    const void *lo = source_row_of<Y>(&s, &g, plan, &a, t, lane, &in_lo);
    const void *hi = source_row_of<Y>(&s, &g, plan, &a, t, lane + EPXC_WARP, &in_hi);
    __syncwarp(); /* the previous token's sum has read the rows */
    const int m = append_rows(rows, append_rows(rows, 0, in_lo, lo), in_hi, hi); /* ascending destinations */
    __syncwarp();
    reduce_rows_ahead<EPXC_AHEAD(Y)>(rows, NULL, m, Y, row_at_mut(a.out, OUT, t, H), OUT, H);
    slot_weight_grad(&s, &g, plan, t, a.topk_weight_grad);
  }
}

/* The partials by their element type, the sums on the source by theirs (float32 or bf16 each). */
typedef void (*combine_kernel_t)(epxc_shape_t, epxc_group_t, const epxc_plan_t *, epxc_combine_t);
static combine_kernel_t partials_of(epx_dtype_t y) {
  return y == EPX_FLOAT32 ? partials_token_kernel<EPX_FLOAT32> : partials_token_kernel<EPX_BFLOAT16>;
}
static combine_kernel_t reduce_token_of(epx_dtype_t y, epx_dtype_t out) {
  if (y == EPX_FLOAT32) return out == EPX_FLOAT32 ? reduce_token_kernel<EPX_FLOAT32, EPX_FLOAT32> : reduce_token_kernel<EPX_FLOAT32, EPX_BFLOAT16>;
  return out == EPX_FLOAT32 ? reduce_token_kernel<EPX_BFLOAT16, EPX_FLOAT32> : reduce_token_kernel<EPX_BFLOAT16, EPX_BFLOAT16>;
}

/* ---- launches --------------------------------------------------------------------------- */

/* Each row is scaled by its routing weight (scale_by_probs applies to the expert layout only). */
static bool ht_scales(const epxc_shape_t *s, const epxc_dispatch_t *a) { return a->scale_by_probs && s->expert_layout; }

/* Rows change on the way (fp8, scaled by the routing weight): the per-token kernel converts
 * them, its rings in dynamic shared memory. */
static bool ht_converts(const epxc_shape_t *s, const epxc_dispatch_t *a) {
  return a->recv_dtype != a->x_dtype || ht_scales(s, a);
}

/* The rule. Dispatch: on devices with the bulk-copy engine (sm_90), rows that arrive as they
 * were sent move by bulk copies (every row is a multiple of 16 bytes: src/core refuses others);
 * rows converted on the way go a warp per token. Combine: a warp per token, its element types
 * fixed at compile time (staged and pipelined combines were measured slower: bulk.cuh). */
static bool ht_bulk_dispatch(const epxc_shape_t *s, const epxc_dispatch_t *a) {
  return s->bulk_copies && !ht_converts(s, a);
}

/* fp8 from bf16 goes staged where its bulk copies pay: the copy engine, no factor per
 * destination, and rows of more than one chunk (a row of one keeps a single chunk in flight
 * per warp: the loads look one token ahead). Elsewhere the lanes' rings convert. */
static bool ht_staged(const epxc_shape_t *s, const epxc_dispatch_t *a) {
  return s->bulk_copies && a->x_dtype == EPX_BFLOAT16 && a->recv_dtype == EPX_FP8_E4M3 && !ht_scales(s, a) &&
         s->hidden > EPXC_STAGED_CHUNK;
}

typedef void (*dispatch_kernel_t)(epxc_shape_t, epxc_group_t, const epxc_plan_t *, epxc_dispatch_t);
static dispatch_kernel_t dispatch_convert_of(epx_dtype_t x) {
  return x == EPX_FLOAT32 ? dispatch_token_kernel<EPX_FLOAT32, true> : dispatch_token_kernel<EPX_BFLOAT16, true>;
}
static const dispatch_kernel_t dispatch_raw = dispatch_token_kernel<EPX_BFLOAT16, false>;

/* A launch on lanes' rings: each of its lanes' ring. */
static size_t ring_launch_smem(const epxc_shape_t *s) { return (size_t)s->ring_threads * EPXC_RING_LANE_BYTES; }

static_assert(sizeof(bulk_warp_t) * EPXC_BULK_WARPS <= EPXC_SMEM_MAX, "a pipelined block fits shared memory");
static_assert(sizeof(staged_warp_t) * EPXC_WARPS <= EPXC_SMEM_MAX, "a staged block fits shared memory");

extern "C" int epxc_dispatch(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                             const epxc_dispatch_t *a, void *stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (ht_bulk_dispatch(s, a))
    dispatch_bulk_kernel<<<s->num_sms, EPXC_BULK_WARPS * EPXC_WARP, bulk_smem_bytes(), st>>>(*s, *g, plan_dev, *a);
  else if (ht_staged(s, a))
    dispatch_staged_kernel<<<s->num_sms, EPXC_THREADS, staged_smem_bytes(), st>>>(*s, *g, plan_dev, *a);
  else if (ht_converts(s, a))
    dispatch_convert_of(a->x_dtype)<<<s->num_sms, s->ring_threads, ring_launch_smem(s), st>>>(*s, *g, plan_dev, *a);
  else
    dispatch_raw<<<s->num_sms, EPXC_THREADS, 0, st>>>(*s, *g, plan_dev, *a);
  return (int)cudaGetLastError();
}

extern "C" int epxc_combine_partials(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                                     const epxc_combine_t *a, void *stream) {
  partials_of(a->y_dtype)<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *a);
  return (int)cudaGetLastError();
}

extern "C" int epxc_combine_reduce(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                                   const epxc_combine_t *a, void *stream) {
  reduce_token_of(a->y_dtype, a->out_dtype)<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *a);
  return (int)cudaGetLastError();
}

/* Loads the kernels (on the current device); the pipelined one is allowed its shared memory
 * here, once per device, on the devices that run it (an sm_80 GPU has less to give), and the
 * kernels on lanes' rings their shared memory (epxc_ring_threads' lanes). */
extern "C" int epxc_preload_ht(size_t *stack) {
  int dev = 0, major = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  const bool bulk = major >= 9 && (size_t)optin >= epxc_bulk_smem_need(); /* as epxc_shape_t.bulk_copies */
  if (e == cudaSuccess && bulk)
    e = cudaFuncSetAttribute((const void *)dispatch_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)bulk_smem_bytes());
  if (e == cudaSuccess && bulk)
    e = cudaFuncSetAttribute((const void *)dispatch_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)staged_smem_bytes());
  const void *const rings[] = {(const void *)dispatch_convert_of(EPX_FLOAT32),
                               (const void *)dispatch_convert_of(EPX_BFLOAT16)};
  for (size_t i = 0; e == cudaSuccess && i < sizeof rings / sizeof *rings; i++)
    e = cudaFuncSetAttribute(rings[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                             ring_threads(optin) * EPXC_RING_LANE_BYTES);
  if (e != cudaSuccess) return (int)e;
  const void *const kernels[] = {
      (const void *)dispatch_bulk_kernel,
      (const void *)dispatch_staged_kernel,
      (const void *)dispatch_raw,
      (const void *)dispatch_convert_of(EPX_FLOAT32),
      (const void *)dispatch_convert_of(EPX_BFLOAT16),
      (const void *)partials_of(EPX_FLOAT32),
      (const void *)partials_of(EPX_BFLOAT16),
      (const void *)reduce_token_of(EPX_FLOAT32, EPX_FLOAT32),
      (const void *)reduce_token_of(EPX_FLOAT32, EPX_BFLOAT16),
      (const void *)reduce_token_of(EPX_BFLOAT16, EPX_FLOAT32),
      (const void *)reduce_token_of(EPX_BFLOAT16, EPX_BFLOAT16)};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}

extern "C" int epxc_ring_threads(int optin_bytes) { return ring_threads(optin_bytes); }

extern "C" size_t epxc_bulk_smem_need(void) {
  return bulk_smem_bytes() > staged_smem_bytes() ? bulk_smem_bytes() : staged_smem_bytes();
}
