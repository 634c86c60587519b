/* Low-latency dispatch and combine for decode: one launch per operation, fixed shapes, no
 * host synchronisation, graph-capturable and replayable with new routings.
 *
 * Sources push (cuda_shared.h, "The low-latency path"). Dispatch, in one kernel: every block
 * builds this rank's whole routing as bitmaps in its shared memory (a decode step's are a few
 * words a row), so each warp knows where its token's slots land without waiting for another
 * block. Warps write their tokens' rows once per destination rank into that rank's inbox, with
 * the token's record (its local experts there, its place among this rank's tokens of each);
 * block 0 writes the headers (counts); the last block to finish posts this rank's exchange.
 * Then every block waits for every peer's post itself, reads the counts from its own inbox and
 * copies the rows that came into their final slots, fanning each out to its local experts.
 * Combine: every block reduces the rows of the tokens that came here into partials, written
 * straight into each source's combine inbox; the last block posts; every block then sums its
 * own tokens' partials, in rank order, from its own inbox.
 *
 * Block 0 runs the full exchange wait (stamps, verdicts, errors: exchange.cuh); the other
 * blocks take the posts as they are when every peer posted in step and reported success, and
 * otherwise wait for block 0's verdict, which comes later: the walks over rows give block 0's
 * warps the last items (ll_warp). A step has fewer rows than the launch has warps, so
 * pushes, copies, partials and sums each cut rows into slices of whole 256-channel chunks. */
#include "cuda/exchange.cuh"
#include "cuda/rows.cuh"

static_assert(EPXC_MAX_TOPK <= EPXC_LL_SLOTS, "a token's record holds every slot");
static_assert(EPX_MAX_RANKS <= EPXC_WARP * 2, "a block's first two warps read every rank's post");

/* Build with -DEPX_LL_TRACE to have every rank's block 1 print when each phase of every launch
 * ended (trace.cuh: the launch's start, then ns since it; the rank where a line names the
 * block): where a decode step's latency goes, and how late each rank started. Block 1 comes
 * first in the walks over rows (ll_warp) and meets its peers by their posts (posts_fine), so
 * its phases are a small step's own; block 0's exchange has a trace of its own
 * (-DEPX_EXCHANGE_TRACE). */
#ifdef EPX_LL_TRACE
#include "cuda/trace.cuh"
#define LL_TRACE_DECL epxc_trace_t trace_store_ = {{0}, 0}, *trace_ = &trace_store_
#define LL_TRACE() trace_mark(trace_, threadIdx.x == 0 && blockIdx.x == 1)
#define LL_TRACE_PRINT(what) \
  trace_print(trace_, threadIdx.x == 0 && blockIdx.x == 1, "lltrace " what, s.rank)
#define LL_TRACE_PARAM , epxc_trace_t *trace_ /* a function that marks phases of its own */
#define LL_TRACE_ARG , trace_
#else
#define LL_TRACE_DECL
#define LL_TRACE() EPXC_NO_TRACE
#define LL_TRACE_PRINT(what) EPXC_NO_TRACE
#define LL_TRACE_PARAM
#define LL_TRACE_ARG
#endif

/* ---- shapes and places --------------------------------------------------------------------- */

typedef struct {
  epxc_ll_layout_t y;
  int W;                /* bitmap words a row: max_tokens / 32, rounded up */
  int blocks;           /* fp8 scale blocks a row */
  epxc_divisor_t local; /* expert e is local expert e % L of rank e / L (e * L < 2^24) */
  bool route_shared;    /* the dispatch keeps the routing in shared memory (route_smem) */
} ll_geom_t;

/* The dispatch's shared memory: the routing as bitmaps ([E + R, W] words), then, when it fits
 * too, the routing itself (each token's K normalised slots: their weights, then their experts
 * as int16), so the warps that push a token take its slots from there rather than loading and
 * checking the caller's arrays a second time. */
static __host__ __device__ __forceinline__ size_t bitmap_smem(int R, int E, int64_t max_tokens) {
  return sizeof(uint32_t) * (size_t)(R + E) * (size_t)((max_tokens + 31) / 32);
}
static __host__ __device__ __forceinline__ size_t route_smem(int R, int E, int K, int64_t max_tokens) {
  const size_t bytes = (sizeof(float) + sizeof(int16_t)) * (size_t)K * (size_t)max_tokens;
  return bitmap_smem(R, E, max_tokens) + bytes <= EPXC_LL_SMEM_MAX ? bytes : 0;
}

/* Where the dispatch keeps the routing (route_shared), after the bitmaps: slot k of token t
 * has its weight at w[t * K + k] and its expert at e[t * K + k]. */
typedef struct {
  float *w;
  int16_t *e;
} ll_slots_t;
static __device__ __forceinline__ ll_slots_t slots_of(const epxc_shape_t *s, int W, const uint32_t *bits) {
  float *const w = (float *)(bits + (int64_t)(s->num_experts + s->nranks) * W);
  return (ll_slots_t){w, (int16_t *)(w + (int64_t)s->topk * s->max_tokens)};
}

static __device__ __forceinline__ ll_geom_t geom_of(const epxc_shape_t *s) {
  ll_geom_t g;
  g.y = epxc_ll_layout(s->num_local, s->topk, s->max_tokens, s->hidden);
  g.W = (int)((s->max_tokens + 31) / 32);
  g.blocks = (s->hidden + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  g.local = divisor((uint32_t)s->num_local);
  g.route_shared = route_smem(s->nranks, s->num_experts, s->topk, s->max_tokens) != 0;
  return g;
}

/* Rank q's region in one half of an inbox. */
static __device__ __forceinline__ char *region_of(char *inbox, size_t region, int R, int half, int q) {
  return inbox + ((size_t)half * R + q) * region;
}

/* A block's place in the walks over rows: block 0 comes last. Block 0 writes the headers
 * before it pushes and runs the exchange's full wait while the other blocks go on (meet), so
 * a step with fewer items than the other blocks have warps leaves it none. */
static __device__ __forceinline__ int64_t ll_block_order(void) {
  return blockIdx.x == 0 ? gridDim.x - 1 : blockIdx.x - 1;
}

/* A warp's place in those walks: its block's warps in ll_block_order. */
static __device__ __forceinline__ int64_t ll_warp(void) {
  return ll_block_order() * (blockDim.x / EPXC_WARP) + threadIdx.x / EPXC_WARP;
}

/* Whether this block comes first in that order (block 1, or block 0 when it is alone). */
static __device__ __forceinline__ bool ll_first_block(void) { return blockIdx.x == (gridDim.x > 1 ? 1 : 0); }

/* A step has fewer rows than the launch has warps: rows that one warp would move alone
 * are cut into slices of whole 256-channel chunks (so fp8 blocks of 128 stay whole), as many
 * as keep every warp busy with per_warp items (more than one: the claimed walk, below).
 * Slice i of a row covers channels [i * width, min(H, (i+1) * width)).
 * Rows are cut only when fewer than the warps (at most 2^15), so a walk that cuts has fewer
 * than 2^30 items and divides in 32 bits: a 64-bit division is a routine of about a hundred
 * instructions, on the critical path of every warp of a decode step. */
typedef struct {
  int width;
  int count;
} slicing_t;

static __device__ slicing_t slicing(int64_t rows, int hidden, int per_warp) {
  const uint32_t chunks = ((uint32_t)hidden + EPXC_CHUNK_CHANNELS - 1) / EPXC_CHUNK_CHANNELS;
  const uint32_t warps = (uint32_t)warp_count() * (uint32_t)per_warp;
  uint32_t want = rows <= 0 || rows >= warps ? 1 : (warps + (uint32_t)rows - 1) / (uint32_t)rows;
  want = want > chunks ? chunks : want;
  if (want <= 1) return (slicing_t){(int)(chunks * EPXC_CHUNK_CHANNELS), 1}; /* a slice is its row */
  const uint32_t width = (chunks + want - 1) / want * EPXC_CHUNK_CHANNELS;
  return (slicing_t){(int)width, (int)(((uint32_t)hidden + width - 1) / width)};
}

/* Item i of a walk over rows in slices: its row and its channels [c, c + w). */
typedef struct {
  int64_t row;
  int c, w;
} slice_t;

static __device__ __forceinline__ slice_t slice_at(slicing_t sl, int hidden, int64_t i) {
  if (sl.count == 1) return (slice_t){i, 0, hidden};
  const uint32_t row = (uint32_t)i / (uint32_t)sl.count;
  const int c = (int)((uint32_t)i - row * (uint32_t)sl.count) * sl.width;
  return (slice_t){(int64_t)row, c, min(sl.width, hidden - c)};
}

/* A claimed walk (the combine's partials): block b takes a contiguous run of the items, in
 * ll_block_order (a short walk leaves block 0, which runs the exchange's full
 * wait, none), and its warps take them one at a time from a counter in shared memory, zeroed
 * before a barrier that precedes the walk. The partials walk every (source, token) that may
 * have come here, and at 8 ranks only about two in three did: dealt out beforehand, some
 * warps got two rows and others none, and each block waited for its busiest warp. Claimed,
 * in slices that give a warp about EPXC_LL_CLAIMS items, the 8-rank combine of 128 tokens
 * took 11% less and the 2-rank one 6% (bench/RESULTS.md, 2026-12-07). The sums on the
 * source, where every token has work, and the dispatch's placing stay dealt out: claimed,
 * the sums lost 2-4 us at 2 ranks x 128 tokens and the placing 2-6 us. */
typedef struct {
  int64_t first, end;
} item_run_t;

static __device__ __forceinline__ item_run_t block_run(int64_t items) {
  const int64_t order = ll_block_order();
  return (item_run_t){run_first(items, gridDim.x, order), run_first(items, gridDim.x, order + 1)};
}

/* The warp's next item of run (>= run.end: none left). */
static __device__ __forceinline__ int64_t claim_item(unsigned int *taken, item_run_t run) {
  unsigned int k = 0;
  if (lane_id() == 0) k = atomicAdd(taken, 1u);
  return run.first + __shfl_sync(0xffffffffu, k, 0);
}

/* Byte offset of channel c of row t in a [*, hidden] array of type dt (where a slice starts). */
static __device__ __forceinline__ size_t slice_offset(epx_dtype_t dt, int64_t t, int hidden, int64_t c) {
  return ((size_t)t * hidden + (size_t)c) * dtype_bytes(dt);
}

/* ---- meeting ------------------------------------------------------------------------------- */

/* Waits until *p >= target, on this rank's own memory, written by another block of this launch. */
static __device__ bool wait_local(const epxc_group_t *g, const uint64_t *p, uint64_t target, int phase) {
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 0;; spin++) {
    if (reached_gpu(p, target, spin)) return true;
    if ((spin & EPXC_POLL_MASK) == EPXC_POLL_MASK && globaltimer_ns() - start > g->timeout_ns) {
      record_error(g, EPX_ERR_TIMEOUT, phase, g->rank, (int64_t)(g->timeout_ns / 1000000));
      return false;
    }
  }
}

/* Where this rank pushes on each rank d (to[d]): d's inbox of this handle, found in d's state
 * and translated. NULL when d has no such inbox, which d's post of this exchange shows (d is
 * in it with another kind of handle: the exchange then says why), when d has failed (its
 * error stops the exchange too), or when d makes none within the timeout: then this rank
 * records the timeout, for a rank that pushed nothing to a peer that came late must not let
 * that peer read its inbox as if it had. The block's last R threads, the last one for rank 0:
 * the first threads load the routing (plan_shared) at the same time. why[d] (after the block's
 * next barrier) is what d's inbox makes of this rank's call (inbox_status).
 *
 * One round trip when the entry is there: its words and d's post flag are loaded together.
 * The owner writes the entry in one copy whose words land in no set order, over a slot that
 * was all zero, and no word of a live entry is zero: an entry with the key and a zero word is
 * still being written, and is read again. Only "no such inbox" needs the order: d wrote its
 * key before it posted, so the key is read once more after the post is seen (acquire). */
static __device__ void find_inboxes(const epxc_shape_t *s, const epxc_group_t *g, uint64_t id, uint64_t epoch,
                                    bool combine, int phase, char **to, int32_t *why) {
  const int d = (int)(blockDim.x - 1 - threadIdx.x);
  if (d >= s->nranks) return;
  const volatile epxc_ll_inbox_t *e = &g->state[d]->ll_inbox[id % EPXC_LL_INBOXES];
  const volatile uint64_t *posted = &g->state[g->rank]->post[epoch & 1][d].flag;
  uint64_t want[2];
  epxc_ll_shape_key(s->nranks, s->num_local, s->topk, s->max_tokens, s->hidden, want);
  char *at = NULL;
  bool late = false, keyed = false;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 0;; spin++) {
    const uint64_t flag = *posted, key = e->key, s0 = e->shape[0], s1 = e->shape[1];
    const uint64_t where = combine ? e->combine_inbox : e->dispatch_inbox;
    if (key == id && s0 && s1 && where) { /* whole */
      keyed = true;
      if (s0 == want[0] && s1 == want[1]) at = (char *)peer_ptr(g, d, where);
      break;
    }
    if (key != id && flag >= epoch && ld_acquire((const uint64_t *)posted) >= epoch && e->key != id) break;
    if ((spin & EPXC_POLL_MASK) == EPXC_POLL_MASK) {
      if (fatal_status(((volatile epxc_error_t *)&g->errors[d])->status)) break;
      late = globaltimer_ns() - start > g->timeout_ns;
      if (late) break;
    }
  }
  to[d] = at;
  why[d] = late ? EPX_ERR_TIMEOUT : keyed && !at ? EPX_ERR_CONFIG_MISMATCH : EPX_SUCCESS;
  if (late) record_error(g, EPX_ERR_TIMEOUT, phase, d, (int64_t)(g->timeout_ns / 1000000));
}

/* This rank's call as the inboxes found make it: refused for a peer that made none in time
 * (EPX_ERR_TIMEOUT), else for one whose inbox has another shape (its max_tokens_per_rank
 * differs: EPX_ERR_CONFIG_MISMATCH), else fine. */
static __device__ __forceinline__ int32_t inbox_status(const int32_t *why, int n) {
  int32_t st = EPX_SUCCESS;
  for (int i = 0; i < n; i++)
    if (why[i] == EPX_ERR_TIMEOUT || (why[i] != EPX_SUCCESS && st == EPX_SUCCESS)) st = why[i];
  return st;
}

/* Block 0 lets the other blocks go on (also when it failed: they then see why and stop). */
static __device__ void release_all(epxc_state_t *st, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) st_release_gpu(&st->ll_ready, epoch);
}

/* A block other than 0 reads the posts of exchange `epoch` itself (the parity of each in
 * parity[]): true when every rank has posted, in step with rank 0 (phase tag, stamp) and
 * reporting success, none having given up on this exchange. Anything else is block 0's to
 * decide: false once block 0 has recorded its verdict, or (block 0 itself waits up to the
 * timeout) after twice the timeout. */
static __device__ bool posts_fine(const epxc_group_t *g, uint64_t epoch, int phase, int *parity LL_TRACE_PARAM) {
  epxc_state_t *me = g->state[g->rank];
  __shared__ int fine;
  __shared__ uint64_t tag[EPX_MAX_RANKS];
  __shared__ epxc_stamp_t stamp[EPX_MAX_RANKS];
  const int R = g->nranks, r = threadIdx.x;
  if (r == 0) fine = 1;
  __syncthreads();
  if (r < R) {
    const volatile epxc_slot_t *in = &me->post[epoch & 1][r];
    const uint64_t start = globaltimer_ns();
    bool came = false;
    for (uint32_t spin = 0;; spin++) {
      if (reached((const uint64_t *)&in->flag, epoch, spin)) {
        came = true;
        break;
      }
      if (reached_gpu(&me->ll_ready, epoch, spin)) break; /* block 0 decided first */
      if ((spin & EPXC_POLL_MASK) == EPXC_POLL_MASK && globaltimer_ns() - start > 2 * g->timeout_ns) break;
    }
    LL_TRACE(); /* rank 0's flag seen */
    if (came) {
      const uint64_t status = in->words.ll.status, v = in->verdict;
      parity[r] = (int)in->words.ll.parity;
      tag[r] = in->phase_tag;
#pragma unroll
      for (int i = 0; i < EPXC_STAMP_WORDS; i++) stamp[r].word[i] = in->stamp.word[i];
      if (status != EPX_SUCCESS || v == EPXC_VERDICT(epoch, EPXC_VERDICT_DECIDING) ||
          v == EPXC_VERDICT(epoch, EPXC_VERDICT_GAVE_UP))
        fine = 0;
    } else {
      fine = 0;
    }
  }
  __syncthreads();
  if (fine && r < R && tag[r] != EPXC_PHASE_TAG + (uint64_t)phase) fine = 0;
  if (fine && r < R)
    for (int i = 0; i < EPXC_STAMP_WORDS; i++)
      if (stamp[r].word[i] != stamp[0].word[i]) fine = 0;
  __syncthreads();
  LL_TRACE(); /* every post checked */
  return fine;
}

/* Every block learns the verdict of exchange `epoch` and where each rank pushed (parity[]):
 * block 0 from the full wait (exchange_wait: it records the verdict, then releases the other
 * blocks), the others from the posts when posts_fine, else from block 0's record. Its own
 * rank's post was made by the last block to arrive: block 0 sees it before its wait fences
 * (see exchange_wait). Returns whether the operation goes on. */
static __device__ bool meet(const epxc_group_t *g, int phase, uint64_t epoch, int *parity LL_TRACE_PARAM) {
  epxc_state_t *st = g->state[g->rank];
  __shared__ int go;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) wait_local(g, &st->post[epoch & 1][g->rank].flag, epoch, phase);
    __syncthreads();
    epxc_met_t m;
    const bool met = exchange_wait(g, phase, epoch, &m);
    if (threadIdx.x == 0) go = met && m.status == EPX_SUCCESS;
    if (threadIdx.x < g->nranks) parity[threadIdx.x] = (int)m.words.ll.parity;
    release_all(st, epoch);
    __syncthreads();
    return go;
  }
  if (posts_fine(g, epoch, phase, parity LL_TRACE_ARG)) return true;
  if (threadIdx.x == 0) {
    epxc_group_t twice = *g;
    twice.timeout_ns = 2 * g->timeout_ns;
    go = wait_local(&twice, &st->ll_ready, epoch, phase);
    go = go && !((volatile epxc_state_t *)st)->aborted && ((volatile epxc_state_t *)st)->group_status == EPX_SUCCESS;
  }
  if (threadIdx.x < g->nranks) parity[threadIdx.x] = (int)((volatile epxc_words_t *)&st->got[threadIdx.x])->ll.parity;
  __syncthreads();
  return go;
}

/* The last block to arrive posts this rank's words (status, the half it pushed into) as
 * exchange `epoch`, which the kernel read at its start. */
static __device__ uint64_t post_ll(const epxc_group_t *g, int phase, int32_t status, int half,
                                   const epxc_stamp_t stamp, uint64_t epoch) {
  epxc_words_t w = {};
  w.ll.status = (uint64_t)(uint32_t)status;
  w.ll.parity = (uint64_t)half;
  return exchange_post(g, phase, &w, stamp, epoch);
}

/* ---- dispatch: planning (every block) ------------------------------------------------------- */

/* Token t's normalised routing: the caller's, checked (a status), or on a replay the last
 * dispatch's own copy. Slots are compile-time indices (SLOTS of them, at least topk): ids
 * and ws stay in registers. */
template <int SLOTS>
static __device__ __forceinline__ int token_route(const epxc_shape_t *s, const epxc_ll_bufs_t *b, const epxc_route_t *r,
                                                  int half, int64_t t, int32_t *ids, float *ws, int *bad) {
  const int K = s->topk;
  if (!r->replay)
    return read_route_in<SLOTS>(s, t, r->topk_idx, r->idx_dtype, r->topk_weights, r->routing_map, r->probs, ids, ws,
                                bad);
  const int32_t *pi = b->idx[half ^ 1] + t * K;
  const float *pw = b->weight[half ^ 1] + t * K;
#pragma unroll
  for (int k = 0; k < SLOTS; k++) ids[k] = k < K ? pi[k] : -1, ws[k] = k < K ? pw[k] : 0.0f;
  return EPX_SUCCESS;
}

/* This rank's routing as bitmaps in this block's shared memory: bit t of expert row e says
 * token t chose e, of rank row d (after the E expert rows) that it goes to rank d; and, where
 * it fits (route_shared), each good token's slots after them. Returns this
 * rank's status: an overflow, a replay with nothing valid to replay, or the first bad token's. */
template <int SLOTS>
static __device__ int32_t plan_shared(const epxc_shape_t *s, const epxc_ll_bufs_t *b, const epxc_route_t *r,
                                      const epxc_ll_step_t *prev, int half, uint32_t *bits, const ll_geom_t *gm) {
  const int K = s->topk, E = s->num_experts, W = gm->W;
  const int64_t T = r->num_tokens;
  __shared__ unsigned long long bad_key;
  /* this thread's first token is read before the bitmaps are cleared: its round trip to memory
   * overlaps the clearing and the barrier (a decode step has a token a thread, or none) */
  int32_t ids[SLOTS];
  float ws[SLOTS];
  int bad = 0, st = EPX_SUCCESS;
  int64_t t = threadIdx.x;
  if (t < T && T <= s->max_tokens) st = token_route<SLOTS>(s, b, r, half, t, ids, ws, &bad);
  for (int i = threadIdx.x; i < (E + s->nranks) * W; i += blockDim.x) bits[i] = 0;
  if (threadIdx.x == 0) {
    const bool void_replay = r->replay && (prev->status != EPX_SUCCESS || prev->group_status != EPX_SUCCESS);
    bad_key = T > s->max_tokens ? (unsigned long long)EPX_ERR_LL_OVERFLOW
              : void_replay     ? (unsigned long long)EPX_ERR_INVALID_ARGUMENT
                                : ~0ull;
  }
  __syncthreads();
  const bool go = bad_key == ~0ull;
  for (; go && t < T; t += blockDim.x) {
    if (t != threadIdx.x) st = token_route<SLOTS>(s, b, r, half, t, ids, ws, &bad);
    if (st != EPX_SUCCESS) {
      atomicMin(&bad_key, bad_route_key(t, bad, st));
      continue;
    }
    if (gm->route_shared) {
      const ll_slots_t slots = slots_of(s, W, bits);
#pragma unroll
      for (int k = 0; k < SLOTS; k++)
        if (k < K) slots.w[t * K + k] = ws[k], slots.e[t * K + k] = (int16_t)ids[k];
    }
    const uint32_t bit = 1u << (t & 31);
#pragma unroll
    for (int k = 0; k < SLOTS; k++)
      if (k < K && ids[k] >= 0) {
        atomicOr(&bits[(int64_t)ids[k] * W + (t >> 5)], bit);
        atomicOr(&bits[(int64_t)(E + quotient(gm->local, ids[k])) * W + (t >> 5)], bit);
      }
  }
  __syncthreads();
  return plan_status(bad_key);
}

/* ---- dispatch: pushing ---------------------------------------------------------------------- */

/* Block 0: this rank's header in every destination's inbox (its token count, its pairs per
 * local expert there, which of its tokens go there), and its rank bitmaps for the combine. */
static __device__ void push_headers(const epxc_shape_t *s, const ll_geom_t *gm, const epxc_ll_bufs_t *b, int half,
                                    int64_t T, const uint32_t *bits, char *const *to) {
  const int R = s->nranks, L = s->num_local, E = s->num_experts, W = gm->W, used = (int)((T + 31) / 32);
  const int per = 1 + L + W;
  for (int i = threadIdx.x; i < R * per; i += blockDim.x) {
    const int d = i / per, j = i - d * per;
    if (j > L) b->rank_bits[half][(int64_t)d * W + (j - 1 - L)] = bits[(int64_t)(E + d) * W + (j - 1 - L)];
    if (!to[d]) continue;
    char *region = region_of(to[d], gm->y.region, R, half, s->rank);
    if (j == 0) {
      *(int32_t *)(region + gm->y.tokens) = (int32_t)T;
    } else if (j <= L) {
      const uint32_t *row = bits + (int64_t)(d * L + j - 1) * W;
      int32_t n = 0;
      for (int w = 0; w < used; w++) n += __popc(row[w]);
      ((int32_t *)(region + gm->y.counts))[j - 1] = n;
    } else {
      ((uint32_t *)(region + gm->y.rbits))[j - 1 - L] = bits[(int64_t)(E + d) * W + (j - 1 - L)];
    }
  }
}

/* Tokens before t that chose expert e (its bitmap row in shared memory). */
static __device__ __forceinline__ int32_t rank_in_row(const uint32_t *row, int64_t t) {
  int32_t n = __popc(row[t >> 5] & ((1u << (t & 31)) - 1u));
  for (int64_t w = 0; w < (t >> 5); w++) n += __popc(row[w]);
  return n;
}

/* Slice [c, c + w) of token t, pushed to every rank its slots go to (lowest rank first): its
 * row, staged in the receive type (fp8 quantised here, once) or in x's when the destination
 * scales it; and from the first slice's warp the token's record there (its slots there sorted
 * by local expert) and its normalised routing here. Lane k takes slot k. */
static __device__ void push_token(const epxc_shape_t *s, const ll_geom_t *gm, const epxc_ll_bufs_t *b,
                                  const epxc_route_t *r, const epxc_dispatch_t *a, int half, int64_t t, int c, int w,
                                  const uint32_t *bits, char *const *to) {
  const int K = s->topk, L = s->num_local, R = s->nranks, H = s->hidden, lane = lane_id();
  const bool scaled = a->scale_by_probs != 0, fp8 = a->recv_dtype == EPX_FP8_E4M3;
  const epx_dtype_t stage_dtype = scaled ? a->x_dtype : a->recv_dtype;
  int e = -1;
  float wt = 0.0f;
  if (gm->route_shared) { /* as plan_shared left it */
    const ll_slots_t slots = slots_of(s, gm->W, bits);
    if (lane < K) e = slots.e[t * K + lane], wt = slots.w[t * K + lane];
  } else {
    int32_t ids[EPXC_MAX_TOPK];
    float ws[EPXC_MAX_TOPK];
    int bad = 0;
    token_route<EPXC_MAX_TOPK>(s, b, r, half, t, ids, ws, &bad); /* checked by plan_shared */
#pragma unroll
    for (int k = 0; k < EPXC_MAX_TOPK; k++)
      if (lane == k) e = ids[k], wt = ws[k];
  }
  if (c == 0 && lane < K) b->idx[half][t * K + lane] = e, b->weight[half][t * K + lane] = wt;
  const int d = e >= 0 ? (int)quotient(gm->local, e) : -1, l = e >= 0 ? e - d * L : 0;
  const int32_t ord = e >= 0 ? rank_in_row(bits + (int64_t)e * gm->W, t) : 0;
  void *dst = NULL; /* lane j < m: the j-th destination's slice and scales (copy_row_raw) */
  float *dscale = NULL;
  int m = 0;
  for (unsigned todo = __ballot_sync(0xffffffffu, e >= 0); todo;) {
    const int dd = __shfl_sync(0xffffffffu, d, __ffs(todo) - 1);
    const unsigned group = __ballot_sync(0xffffffffu, e >= 0 && d == dd);
    todo &= ~group;
    int pos = 0; /* this lane's place among the slots on rank dd */
    for (unsigned rest = group; rest; rest &= rest - 1) pos += __shfl_sync(0xffffffffu, l, __ffs(rest) - 1) < l;
    if (!to[dd]) continue;
    char *region = region_of(to[dd], gm->y.region, R, half, s->rank);
    epxc_ll_meta_t *meta = (epxc_ll_meta_t *)(region + gm->y.meta) + t;
    if (c == 0 && ((group >> lane) & 1)) {
      meta->slot[pos] = l | lane << 16;
      meta->ord[pos] = ord;
      meta->weight[pos] = wt;
    }
    if (c == 0 && lane == 0) meta->n = __popc(group);
    if (lane == m) {
      dst = region + gm->y.rows + slice_offset(stage_dtype, t, H, c);
      dscale = fp8 && !scaled ? (float *)(region + gm->y.scales) + t * gm->blocks + c / EPX_FP8_BLOCK : NULL;
    }
    m++;
  }
  const void *in = (const char *)a->x + slice_offset(a->x_dtype, t, H, c);
  if (stage_dtype == a->x_dtype)
    copy_row_raw(in, dst, m, w * (int64_t)dtype_bytes(a->x_dtype));
  else
    convert_row(in, a->x_dtype, stage_dtype, w, dst, dscale, 1.0f, 0, m);
}

/* ---- dispatch: placing (every block, after the exchange) ------------------------------------ */

/* Where each source's pairs land here (base[l * R + q]): local expert l's block at
 * l * R * max_tokens, sources in rank order, from the counts in this rank's inbox. The first
 * block of the walks (ll_warp: not block 0, which may still be in the exchange) also writes
 * them for the combine, with the counts the caller asked for. */
static __device__ void place_shared(const epxc_shape_t *s, const ll_geom_t *gm, const epxc_ll_bufs_t *b, int half,
                                    const epxc_dispatch_t *a, const int *parity, int32_t *base) {
  const int R = s->nranks, L = s->num_local;
  const bool lead = ll_first_block();
  for (int i = threadIdx.x; i < L * R; i += blockDim.x) {
    const int l = i / R, q = i - l * R;
    base[i] = ((const int32_t *)(region_of(b->dispatch_inbox, gm->y.region, R, parity[q], q) + gm->y.counts))[l];
  }
  __syncthreads();
  __shared__ unsigned int pairs;
  if (threadIdx.x == 0) pairs = 0;
  __syncthreads();
  unsigned int mine = 0;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int32_t n = 0;
    const int32_t block = l * R * s->max_tokens;
    for (int q = 0; q < R; q++) {
      const int32_t count = base[l * R + q];
      base[l * R + q] = block + n;
      n += count;
    }
    if (lead && a->tokens_per_local_expert) a->tokens_per_local_expert[l] = n;
    mine += (unsigned int)n;
  }
  mine = __reduce_add_sync(0xffffffffu, mine);
  if (lane_id() == 0 && mine) atomicAdd(&pairs, mine);
  __syncthreads();
  if (lead) {
    for (int i = threadIdx.x; i < L * R; i += blockDim.x) b->recv_base[half][i] = base[i];
    if (threadIdx.x == 0 && a->num_recv_rows) *a->num_recv_rows = (int64_t)pairs;
  }
}

/* One item of the walk both the dispatch's placing and the combine's partials make: every
 * (source q, token t) that may have come here, in slices. */
typedef struct {
  const char *region; /* q's region in this rank's dispatch inbox (the half q pushed into) */
  int q, c, w;        /* the source, the slice's channels [c, c + w) */
  int64_t t;
  int m;              /* the token's slots here; lane j < m holds the j-th one (local experts
                         ascending): the source's slot k, its row here and its weight */
  int k;
  int64_t row;
  float weight;
} arrival_t;

static __device__ __forceinline__ slicing_t arrivals(const epxc_shape_t *s, int per_warp) {
  return slicing((int64_t)s->nranks * s->max_tokens, s->hidden, per_warp);
}

/* Item i: false when its token did not come here. The record is read with lane j taking
 * slot j, its row the base of (local expert, q) plus the token's place. Whether the token came
 * and its record are loaded together, one round trip: the record lies inside q's region
 * whether or not it was written this step, and is used only when it was. */
static __device__ __forceinline__ bool arrival_at(const epxc_shape_t *s, const ll_geom_t *gm, const epxc_ll_bufs_t *b,
                                                  const int *parity, const int32_t *base, slicing_t sl, int64_t i,
                                                  arrival_t *x) {
  const slice_t sc = slice_at(sl, s->hidden, i);
  x->c = sc.c, x->w = sc.w;
  /* 32 bits: the bitmaps' shared-memory bound (op_ll.c) keeps R * max_tokens under 2^25 */
  x->q = (int)((uint32_t)sc.row / (uint32_t)s->max_tokens);
  x->t = sc.row - (int64_t)x->q * s->max_tokens;
  x->region = region_of(b->dispatch_inbox, gm->y.region, s->nranks, parity[x->q], x->q);
  const epxc_ll_meta_t *meta = (const epxc_ll_meta_t *)(x->region + gm->y.meta) + x->t;
  const int lane = lane_id(), j = lane < EPXC_LL_SLOTS ? lane : 0;
  const int32_t tokens = *(const int32_t *)(x->region + gm->y.tokens);
  const uint32_t word = ((const uint32_t *)(x->region + gm->y.rbits))[x->t >> 5];
  const int32_t m = meta->n, slot = meta->slot[j], ord = meta->ord[j];
  const float weight = meta->weight[j];
  if (x->t >= tokens || !((word >> (x->t & 31)) & 1u)) return false;
  x->m = m;
  x->k = 0, x->row = 0, x->weight = 0.0f;
  if (lane < m) {
    x->k = slot >> 16;
    x->row = (int64_t)base[(int64_t)(slot & 0xffff) * s->nranks + x->q] + ord;
    x->weight = weight;
  }
  return true;
}

/* The rows that came to this rank, from its inbox into their final rows: (source, token)
 * pairs in slices. The first slice of a row writes its weights (recv_probs), the others leave them. */
static __device__ void place_rows(const epxc_shape_t *s, const ll_geom_t *gm, const epxc_ll_bufs_t *b,
                                  const epxc_dispatch_t *a, const int *parity, const int32_t *base) {
  const int H = s->hidden, lane = lane_id();
  const bool fp8 = a->recv_dtype == EPX_FP8_E4M3, scaled = a->scale_by_probs != 0;
  const epx_dtype_t stage_dtype = scaled ? a->x_dtype : a->recv_dtype;
  const slicing_t sl = arrivals(s, 1);
  for (int64_t i = ll_warp(); i < (int64_t)s->nranks * s->max_tokens * sl.count; i += warp_count()) {
    arrival_t x;
    if (!arrival_at(s, gm, b, parity, base, sl, i, &x)) continue;
    const int c = x.c, w = x.w, m = x.m;
    const int64_t t = x.t, my_row = x.row;
    const float my_w = x.weight;
    const char *region = x.region;
    /* lane j < m: the j-th slot's slice and scales here (copy_row_raw) */
    void *const dst = row_at_mut(a->recv_x, a->recv_dtype, my_row * H + c, 1);
    float *const dscale = fp8 ? a->recv_scales + my_row * gm->blocks + c / EPX_FP8_BLOCK : NULL;
    if (c == 0 && lane < m && a->recv_probs) a->recv_probs[my_row] = my_w;
    const void *in = region + gm->y.rows + slice_offset(stage_dtype, t, H, c);
    if (scaled || stage_dtype != a->recv_dtype) { /* scaled copies, staged in x's type */
      convert_row(in, stage_dtype, a->recv_dtype, w, dst, dscale, my_w, scaled, m);
    } else {
      copy_row_raw(in, dst, m, (int64_t)w * dtype_bytes(a->recv_dtype));
      const float *scales = (const float *)(region + gm->y.scales) + t * gm->blocks + c / EPX_FP8_BLOCK;
      const int n = (w + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
      for (int j = 0; fp8 && j < m; j++) {
        float *const sj = lane_ptr(dscale, j);
        for (int x = lane; x < n; x += EPXC_WARP) sj[x] = scales[x];
      }
    }
  }
}

/* ---- dispatch ------------------------------------------------------------------------------ */

/* Two blocks per SM of the budget (config.cuh: 512 threads for the combine, filling the SM as a
 * work kernel's one block does, 256 for the dispatch), while the ranks x num_sms <= SM count
 * rule still makes every block of every rank on the GPU resident at once. */
static int ll_blocks(const epxc_shape_t *s) { return EPXC_LL_BLOCKS_PER_SM * s->num_sms; }

extern "C" size_t epxc_ll_smem(int R, int E, int64_t max_tokens) { return bitmap_smem(R, E, max_tokens); }

/* SEND: plan, push, and (the last block) post. */
static __device__ void dispatch_send(const epxc_shape_t *s, const epxc_group_t *g, const epxc_ll_bufs_t *b,
                                     const epxc_route_t *r, const epxc_dispatch_t *a, const epxc_stamp_t stamp,
                                     int half, uint64_t epoch, uint64_t calls LL_TRACE_PARAM) {
  extern __shared__ uint32_t bits[]; /* [E + R, W], then the routing when it fits (route_smem) */
  __shared__ char *to[EPX_MAX_RANKS];
  __shared__ int32_t why[EPX_MAX_RANKS];
  epxc_ll_t *ll = b->dev;
  const ll_geom_t gm = geom_of(s);
  find_inboxes(s, g, b->id, epoch, false, EPXC_PH_LL_DISPATCH, to, why);
  LL_TRACE(); /* 1: thread 0 past the inbox search (the last threads') */
  const epxc_ll_step_t *prev = &ll->step[half ^ 1];
  const int32_t planned = s->topk <= EPXC_FEW_SLOTS ? plan_shared<EPXC_FEW_SLOTS>(s, b, r, prev, half, bits, &gm)
                                                    : plan_shared<EPXC_MAX_TOPK>(s, b, r, prev, half, bits, &gm);
  const int32_t found = inbox_status(why, s->nranks), status = found != EPX_SUCCESS ? found : planned;
  LL_TRACE(); /* 2: planned */
  const int64_t T = status == EPX_SUCCESS ? r->num_tokens : 0; /* refused: nothing of this rank is pushed */
  if (blockIdx.x == 0) {
    push_headers(s, &gm, b, half, T, bits, to);
    if (threadIdx.x == 0) ll->step[half].num_tokens = T, ll->step[half].status = status;
  }
  const slicing_t sl = slicing(T, s->hidden, 1);
  for (int64_t i = ll_warp(); i < T * sl.count; i += warp_count()) {
    const slice_t x = slice_at(sl, s->hidden, i);
    push_token(s, &gm, b, r, a, half, x.row, x.c, x.w, bits, to);
  }
  LL_TRACE(); /* 3: rows pushed */
  if (block_arrives_last(&g->state[g->rank]->ll_arrivals)) {
    const uint64_t posted = post_ll(g, EPXC_PH_LL_DISPATCH, status, half, stamp, epoch);
    if (threadIdx.x == 0) ll->dispatches = calls + 1, ll->dispatch_epoch = posted, ll->dispatch_half = half;
  }
}

static __global__ void __launch_bounds__(EPXC_LL_DISPATCH_THREADS, EPXC_LL_BLOCKS_PER_SM)
    ll_dispatch_kernel(const __grid_constant__ epxc_shape_t s, const __grid_constant__ epxc_group_t g,
                       const __grid_constant__ epxc_ll_bufs_t b, epxc_route_t route, epxc_dispatch_t a,
                       epxc_stamp_t stamp) {
  LL_TRACE_DECL;
  LL_TRACE();
  epxc_state_t *st = g.state[g.rank];
  epxc_ll_t *ll = b.dev;
  /* every load at once: one round trip */
  const int aborted = ((volatile epxc_state_t *)st)->aborted;
  const uint64_t seq0 = st->seq, calls = ll->dispatches, sent_epoch = ll->dispatch_epoch;
  const int sent_half = ll->dispatch_half;
  if (aborted) return;
  const bool complete = a.part == EPX_PART_COMPLETE;
  /* a COMPLETE finishes what its SEND started: that exchange, that step */
  const int half = complete ? sent_half : (int)(calls & 1);
  const uint64_t epoch = complete ? sent_epoch : seq0 + 1;
  if (!complete) {
    dispatch_send(&s, &g, &b, &route, &a, stamp, half, epoch, calls LL_TRACE_ARG);
    LL_TRACE(); /* 4: arrived */
    if (a.part == EPX_PART_SEND) return;
  }
  __shared__ int parity[EPX_MAX_RANKS];
  const bool go = meet(&g, EPXC_PH_LL_DISPATCH, epoch, parity LL_TRACE_ARG);
  LL_TRACE(); /* 7: met (5, 6: posts_fine's own) */
  if (blockIdx.x == 0 && threadIdx.x < s.nranks) ll->step[half].parity[threadIdx.x] = parity[threadIdx.x];
  if (blockIdx.x == 0 && threadIdx.x == 0)
    ll->step[half].group_status = go ? EPX_SUCCESS : st->aborted ? EPX_ERR_BROKEN : st->group_status;
  if (!go) return;
  const ll_geom_t gm = geom_of(&s);
  __shared__ int32_t base[EPX_MAX_EXPERTS]; /* [L, R] */
  place_shared(&s, &gm, &b, half, &a, parity, base);
  __syncthreads();
  LL_TRACE(); /* 8: placed */
  place_rows(&s, &gm, &b, &a, parity, base);
  LL_TRACE(); /* 9: rows copied */
  LL_TRACE_PRINT("dispatch found plan push arrive flags checked met place copy");
}

extern "C" int epxc_ll_dispatch(const epxc_shape_t *s, const epxc_group_t *g, const epxc_ll_bufs_t *b,
                                const epxc_route_t *r, const epxc_dispatch_t *a, const epxc_stamp_t *stamp,
                                void *stream) {
  const size_t smem = bitmap_smem(s->nranks, s->num_experts, s->max_tokens) +
                      route_smem(s->nranks, s->num_experts, s->topk, s->max_tokens);
  ll_dispatch_kernel<<<ll_blocks(s), EPXC_LL_DISPATCH_THREADS, smem, (cudaStream_t)stream>>>(*s, *g, *b, *r, *a, *stamp);
  return (int)cudaGetLastError();
}

/* ---- combine ------------------------------------------------------------------------------- */

/* The partials of the tokens that came here, each written straight into its source's combine
 * inbox (row t of this rank's region there): its rows here weighted and summed in ascending
 * local expert, as the contract orders them; the first slice's warp also writes the row
 * weight gradients of its slots there. */
static __device__ void push_partials(const epxc_shape_t *s, const ll_geom_t *gm, const epxc_ll_bufs_t *b, int pd,
                                     int half, const epxc_combine_t *a, const int *parity, char *const *to,
                                     unsigned int *taken) {
  const int H = s->hidden, R = s->nranks, K = s->topk, lane = lane_id();
  const slicing_t sl = arrivals(s, EPXC_LL_CLAIMS);
  const item_run_t run = block_run((int64_t)R * s->max_tokens * sl.count);
  for (int64_t i = claim_item(taken, run); i < run.end; i = claim_item(taken, run)) {
    arrival_t x;
    if (!arrival_at(s, gm, b, parity, b->recv_base[pd], sl, i, &x) || !to[x.q]) continue;
    const int c = x.c, w = x.w, m = x.m, k = x.k;
    const int64_t t = x.t, row = x.row;
    float my_w = x.weight;
    if (lane < m) my_w = !a->weighted ? 1.0f : a->row_probs ? a->row_probs[row] : my_w;
    /* local arrays, not rows.cuh's shared lists: with the lists here and in sum_tokens, the
       combine at 8 ranks of 128 tokens took 136-139 us against 124-125 (H100; not profiled) */
    const void *rows[EPXC_MAX_TOPK];
    float wj[EPXC_MAX_TOPK];
    for (int j = 0; j < m; j++) {
      rows[j] = (const char *)a->y + slice_offset(a->y_dtype, __shfl_sync(0xffffffffu, row, j), H, c);
      wj[j] = __shfl_sync(0xffffffffu, my_w, j);
    }
    char *out = region_of(to[x.q], gm->y.combine_region, R, half, s->rank);
    reduce_rows(rows, wj, m, a->y_dtype, out + slice_offset(a->y_dtype, t, H, c), a->y_dtype, w);
    if (c == 0 && lane < m && a->row_weight_grad)
      ((float *)(out + gm->y.wgrad))[t * K + k] = a->row_weight_grad[row];
  }
}

/* This rank's tokens: their partials summed in rank order from this rank's combine inbox, and
 * the weight gradient of every slot (0 for a slot that routed nowhere). */
static __device__ void sum_tokens(const epxc_shape_t *s, const ll_geom_t *gm, const epxc_ll_bufs_t *b, int pd,
                                  const epxc_combine_t *a, const int *parity) {
  const int H = s->hidden, R = s->nranks, K = s->topk, lane = lane_id();
  const int64_t T = b->dev->step[pd].num_tokens;
  const uint32_t *rank_bits = b->rank_bits[pd];
  const slicing_t sl = slicing(T, H, 1);
  for (int64_t i = ll_warp(); i < T * sl.count; i += warp_count()) {
    const slice_t x = slice_at(sl, H, i);
    const int64_t t = x.row;
    const int c = x.c, w = x.w;
    const void *rows[EPX_MAX_RANKS];
    int m = 0;
    for (int d = 0; d < R; d++)
      if (bit_set(rank_bits + (int64_t)d * gm->W, t))
        rows[m++] = region_of(b->combine_inbox, gm->y.combine_region, R, parity[d], d) +
                    slice_offset(a->y_dtype, t, H, c);
    reduce_rows(rows, NULL, m, a->y_dtype, (char *)a->out + slice_offset(a->out_dtype, t, H, c), a->out_dtype, w);
    if (c == 0 && lane < K && a->topk_weight_grad) {
      const int e = b->idx[pd][t * K + lane];
      const int d = e < 0 ? 0 : (int)quotient(gm->local, e);
      const char *from = e < 0 ? NULL : region_of(b->combine_inbox, gm->y.combine_region, R, parity[d], d);
      a->topk_weight_grad[t * K + lane] = from ? ((const float *)(from + gm->y.wgrad))[t * K + lane] : 0.0f;
    }
  }
}

static __global__ void __launch_bounds__(EPXC_LL_COMBINE_THREADS, EPXC_LL_BLOCKS_PER_SM)
    ll_combine_kernel(const __grid_constant__ epxc_shape_t s, const __grid_constant__ epxc_group_t g,
                      const __grid_constant__ epxc_ll_bufs_t b, epxc_combine_t a, epxc_stamp_t stamp) {
  LL_TRACE_DECL;
  LL_TRACE();
  epxc_state_t *st = g.state[g.rank];
  epxc_ll_t *ll = b.dev;
  /* every load at once: one round trip */
  const int aborted = ((volatile epxc_state_t *)st)->aborted;
  const uint64_t seq0 = st->seq, calls = ll->combines, dispatches = ll->dispatches, sent_epoch = ll->combine_epoch;
  const int sent_half = ll->combine_half;
  if (aborted) return;
  const bool complete = a.part == EPX_PART_COMPLETE;
  const int pd = complete ? sent_half : (int)((dispatches - 1) & 1); /* the dispatch it inverts */
  const uint64_t epoch = complete ? sent_epoch : seq0 + 1;
  const ll_geom_t gm = geom_of(&s);
  __shared__ int parity[EPX_MAX_RANKS];
  __shared__ unsigned int taken; /* the partials' items claimed (zeroed before the barrier below) */
  if (threadIdx.x == 0) taken = 0;
  if (!complete) {
    /* A refused dispatch is refused on every rank: all skip the work but still meet, so a rank
     * that fails its arguments (and only posts) meets them too. */
    const int32_t dispatched = ll->step[pd].group_status;
    __shared__ char *to[EPX_MAX_RANKS];
    __shared__ int32_t why[EPX_MAX_RANKS];
    if (threadIdx.x < s.nranks) parity[threadIdx.x] = ll->step[pd].parity[threadIdx.x];
    find_inboxes(&s, &g, b.id, epoch, true, EPXC_PH_LL_COMBINE, to, why);
    LL_TRACE(); /* 1: thread 0 past the inbox search (the last threads') */
    __syncthreads();
    const int32_t found = inbox_status(why, s.nranks), refused = found != EPX_SUCCESS ? found : dispatched;
    if (refused == EPX_SUCCESS) push_partials(&s, &gm, &b, pd, (int)(calls & 1), &a, parity, to, &taken);
    LL_TRACE(); /* 2: partials pushed */
    if (block_arrives_last(&st->ll_arrivals)) {
      const uint64_t posted = post_ll(&g, EPXC_PH_LL_COMBINE, refused, (int)(calls & 1), stamp, epoch);
      if (threadIdx.x == 0) ll->combines = calls + 1, ll->combine_epoch = posted, ll->combine_half = pd;
    }
    LL_TRACE(); /* 3: arrived */
    if (a.part == EPX_PART_SEND) return; /* block_arrives_last synchronised the block: parity[] may be rewritten */
  }
  const bool go = meet(&g, EPXC_PH_LL_COMBINE, epoch, parity LL_TRACE_ARG);
  LL_TRACE(); /* 6: met (4, 5: posts_fine's own) */
  if (!go) return;
  sum_tokens(&s, &gm, &b, pd, &a, parity);
  LL_TRACE(); /* 7: sums */
  LL_TRACE_PRINT("combine found push arrive flags checked met sum");
}

extern "C" int epxc_ll_combine(const epxc_shape_t *s, const epxc_group_t *g, const epxc_ll_bufs_t *b,
                               const epxc_combine_t *a, const epxc_stamp_t *stamp, void *stream) {
  ll_combine_kernel<<<ll_blocks(s), EPXC_LL_COMBINE_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, *b, *a, *stamp);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_ll(size_t *stack) {
  const cudaError_t e = cudaFuncSetAttribute((const void *)ll_dispatch_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, EPXC_LL_SMEM_MAX);
  if (e != cudaSuccess) return (int)e;
  const void *const kernels[] = {(const void *)ll_dispatch_kernel, (const void *)ll_combine_kernel};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}
