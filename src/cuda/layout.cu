/* Layout and notify: from a routing (topk ids or a multi-hot map) to counts, per-token bitmaps
 * and, once every rank's counts are known, where each row lands. */
#include "cuda/exchange.cuh"

/* Build with -DEPX_NOTIFY_TRACE to have every block of every rank's notify print when its
 * phases ended (trace.cuh): a build ticket ("notifytrace build") started, built, scanned; the
 * closing block ("notifytrace close") started, met the peers, saw every ticket built, pushed
 * its counts, gathered the peers', derived the receive side (tools/trace_phases.py sums them
 * up). The block field is rank * EPXC_TRACE_RANK_BLOCKS + ticket. The marks live in shared
 * memory, so the functions a block calls can mark too. */
#ifdef EPX_NOTIFY_TRACE
#include "cuda/trace.cuh"
static_assert(EPXC_NOTIFY_THREADS < EPXC_TRACE_RANK_BLOCKS, "a rank's tickets fit its block numbers");
static __shared__ epxc_trace_t notify_trace_;
#define NOTIFY_TRACE_START()                  \
  do {                                        \
    if (threadIdx.x == 0) notify_trace_.n = 0; \
    NOTIFY_TRACE();                           \
  } while (0)
#define NOTIFY_TRACE() trace_mark(&notify_trace_, threadIdx.x == 0)
#define NOTIFY_TRACE_PRINT(what, ticket) \
  trace_print(&notify_trace_, threadIdx.x == 0, "notifytrace " what, g.rank * EPXC_TRACE_RANK_BLOCKS + (ticket))
#else
#define NOTIFY_TRACE_START() EPXC_NO_TRACE
#define NOTIFY_TRACE() EPXC_NO_TRACE
#define NOTIFY_TRACE_PRINT(what, ticket) EPXC_NO_TRACE
#endif

/* A token whose routing is refused counts nowhere and is in no rank; the refusal is this
 * rank's recoverable error, reported by epx_comm_synchronize. A block counts its tokens in
 * shared memory and adds each of its nonzero counts to the output once: a global atomic per
 * (token, expert) made every expert's counter a queue at its L2 slice. */
static __global__ void layout_kernel(epxc_shape_t s, epxc_group_t g, int64_t T, const void *topk_idx,
                                     epx_dtype_t idx_dtype, const uint8_t *map, int32_t *tokens_per_rank,
                                     int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  extern __shared__ int32_t layout_counts[]; /* [E] pairs per expert, then [R] tokens per rank */
  int32_t *const per_expert = layout_counts, *const per_rank = layout_counts + s.num_experts;
  const int counters = s.num_experts + s.nranks;
  for (int i = threadIdx.x; i < counters; i += blockDim.x) layout_counts[i] = 0;
  __syncthreads();
  int32_t ids[EPXC_MAX_TOPK];
  float ws[EPXC_MAX_TOPK];
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < T; t += (int64_t)gridDim.x * blockDim.x) {
    int bad;
    const int st = read_route(&s, t, topk_idx, idx_dtype, NULL, map, NULL, ids, ws, &bad);
    if (st != EPX_SUCCESS) {
      record_error(&g, st, EPXC_PH_LAYOUT, g.rank, t);
      for (int d = 0; d < s.nranks && is_token_in_rank; d++) is_token_in_rank[t * s.nranks + d] = 0;
      continue;
    }
    uint64_t ranks = 0;
#pragma unroll
    for (int k = 0; k < EPXC_MAX_TOPK; k++) { /* compile-time slots: ids stay in registers */
      if (k >= s.topk || ids[k] < 0) continue;
      ranks |= 1ull << (ids[k] / s.num_local);
      atomicAdd(&per_expert[ids[k]], 1);
    }
    /* the lanes here count their tokens per rank together: one atomic per rank, not per token */
    const unsigned mates = __activemask();
    const bool leader = lane_id() == __ffs(mates) - 1;
    for (int d = 0; d < s.nranks; d++) {
      const bool in = (ranks >> d) & 1;
      const unsigned n = __reduce_add_sync(mates, in ? 1u : 0u);
      if (leader && n) atomicAdd(&per_rank[d], (int32_t)n);
      if (is_token_in_rank) is_token_in_rank[t * s.nranks + d] = in;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; tokens_per_expert && e < s.num_experts; e += blockDim.x)
    if (per_expert[e]) atomicAdd(&tokens_per_expert[e], per_expert[e]);
  for (int d = threadIdx.x; tokens_per_rank && d < s.nranks; d += blockDim.x)
    if (per_rank[d]) atomicAdd(&tokens_per_rank[d], per_rank[d]);
}

extern "C" int epxc_layout(const epxc_shape_t *s, const epxc_group_t *g, int64_t T, const void *topk_idx,
                           epx_dtype_t idx_dtype, const uint8_t *map, int32_t *tokens_per_rank,
                           int32_t *tokens_per_expert, uint8_t *is_token_in_rank, void *stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (tokens_per_rank) cudaMemsetAsync(tokens_per_rank, 0, sizeof(int32_t) * s->nranks, st);
  if (tokens_per_expert) cudaMemsetAsync(tokens_per_expert, 0, sizeof(int32_t) * s->num_experts, st);
  const size_t counts = sizeof(int32_t) * (s->num_experts + s->nranks); /* at most 16.6 KB */
  if (T > 0)
    layout_kernel<<<s->num_sms, EPXC_LAYOUT_THREADS, counts, st>>>(*s, *g, T, topk_idx, idx_dtype, map, tokens_per_rank,
                                                                   tokens_per_expert, is_token_in_rank);
  return (int)cudaGetLastError();
}

/* ---- notify ------------------------------------------------------------------------------ */

/* Notify is one launch of build blocks and one closing block, the SM budget's blocks. Blocks take
 * tickets in the order they start. Build ticket i builds bitmap words [i * per, (i + 1) * per)
 * of every row (R rank rows, then E expert rows), a warp per word (32 tokens, a lane each), and
 * publishes its rows' popcounts over those words. Its prefix popcounts then need only the sums
 * of the tickets before it: a block waits only for blocks that started before it, so no
 * launch-wide barrier, and nothing depends on how many blocks are resident. The last ticket
 * closes (close_notify): it meets the peers while the others build, so the exchange's round
 * trips and code are off the critical path; once every build ticket is done it pushes each
 * peer the counts that peer needs and derives the receive side from what the peers pushed
 * here. Nothing is cleared beforehand: every word in use is written whole. */

/* What follows a scan header (epxc_scan_t): the tickets' ready flags, then their sums. */
static __device__ __forceinline__ uint64_t *scan_ready(epxc_scan_t *scan) { return (uint64_t *)(scan + 1); }
static __device__ __forceinline__ int32_t *scan_sums(epxc_scan_t *scan, int blocks) {
  return (int32_t *)(scan_ready(scan) + blocks);
}

/* Bitmap word `tw` of every row into col[rows] (shared memory), from the warp's 32 tokens, a
 * lane each, whose routings are normalised into the plan on the way. A refused token sets no
 * bit; the first one's key (token << 16 | slot << 8 | status) is kept in *bad_key. SLOTS
 * (>= topk) is how many slots the code unrolls (read_route_in). */
template <int SLOTS>
static __device__ void build_word(const epxc_shape_t *s, epxc_plan_t *plan, const epxc_route_t *r, int64_t tw,
                                  uint32_t *col, unsigned long long *bad_key) {
  const int K = s->topk, R = s->nranks, L = s->num_local, rows = R + s->num_experts, lane = lane_id();
  for (int i = lane; i < rows; i += EPXC_WARP) col[i] = 0;
  __syncwarp();
  const int64_t t = tw * EPXC_WARP + lane;
  uint64_t ranks = 0;
  if (t < r->num_tokens) {
    int32_t ids[SLOTS];
    float ws[SLOTS];
    int bad = 0;
    const int st =
        read_route_in<SLOTS>(s, t, r->topk_idx, r->idx_dtype, r->topk_weights, r->routing_map, r->probs, ids, ws, &bad);
    if (st != EPX_SUCCESS)
      atomicMin(bad_key, bad_route_key(t, bad, st));
    int32_t *const idx = plan->idx; /* read once: the stores below could otherwise be to *plan */
    float *const weight = plan->weight;
#pragma unroll
    for (int k = 0; k < SLOTS; k++) { /* compile-time slots: ids and ws stay in registers */
      if (k >= K || st != EPX_SUCCESS) continue;
      idx[t * K + k] = ids[k];
      weight[t * K + k] = ws[k];
      if (ids[k] < 0) continue;
      ranks |= 1ull << (ids[k] / L);
      atomicOr(&col[R + ids[k]], 1u << lane);
    }
  }
  for (int d = 0; d < R; d++) {
    const uint32_t word = __ballot_sync(0xffffffffu, (ranks >> d) & 1);
    if (lane == 0) col[d] = word;
  }
  __syncwarp();
}

/* A pass's `ncols` words of every row, from its columns in shared memory (cols[j * rows + row]
 * holds word w0 + j): the bits, and the prefix popcounts counted from this ticket's first
 * word (carry[row], advanced), into the plan or, where pend is given, into pend[j * rows + row]
 * (see scan_ticket). A half-warp a row, a lane a word: a row's words go out as one
 * run of 64 bytes, not as 16 stores each to a different row (which cost the store pipe a
 * sector per lane), and their prefix is a scan across the 16 lanes. */
#define EPXC_PASS_LANES 16
static_assert(EPXC_NOTIFY_THREADS / EPXC_WARP <= EPXC_PASS_LANES, "a pass's words are a half-warp's lanes");
static __device__ void store_pass(const epxc_shape_t *s, epxc_plan_t *plan, const uint32_t *cols, int64_t w0,
                                  int ncols, int32_t *carry, int32_t *pend) {
  const int R = s->nranks, rows = R + s->num_experts, j = lane_id() % EPXC_PASS_LANES;
  const int half = threadIdx.x / EPXC_PASS_LANES, halves = blockDim.x / EPXC_PASS_LANES;
  const int64_t W = plan->words;
  for (int first = 0; first < rows; first += halves) { /* the same trips in every lane: shuffles below */
    const int row = first + half;
    const bool live = row < rows && j < ncols;
    const uint32_t word = live ? cols[j * rows + row] : 0u;
    int32_t upto = __popc(word); /* this lane's word and the ones before it in the row */
#pragma unroll
    for (int o = 1; o < EPXC_PASS_LANES; o <<= 1) {
      const int32_t u = __shfl_up_sync(0xffffffffu, upto, o, EPXC_PASS_LANES);
      if (j >= o) upto += u;
    }
    const int32_t total = __shfl_sync(0xffffffffu, upto, EPXC_PASS_LANES - 1, EPXC_PASS_LANES);
    const int32_t c = row < rows ? carry[row] : 0;
    if (live) {
      const int32_t pre = c + upto - __popc(word);
      plan_bits_row(plan, R, W, row)[w0 + j] = word;
      if (pend)
        pend[j * rows + row] = pre;
      else
        plan_pre_row(plan, R, W, row)[w0 + j] = pre;
    }
    __syncwarp(); /* the row's lanes have read carry[row] */
    if (row < rows && j == 0) carry[row] = c + total;
  }
}

/* This ticket's words, `ncols` at a time (a warp each): carry[row] ends as the ticket's popcount
 * of every row. pend: NULL, or room for the ticket's prefix popcounts (see scan_ticket). */
static __device__ void build_ticket(const epxc_shape_t *s, epxc_plan_t *plan, const epxc_route_t *r,
                                    epxc_scan_t *scan, int64_t first, int64_t last, int ncols, uint32_t *cols,
                                    int32_t *carry, int32_t *pend) {
  const int rows = s->nranks + s->num_experts, warp = threadIdx.x / EPXC_WARP;
  for (int row = threadIdx.x; row < rows; row += blockDim.x) carry[row] = 0;
  for (int64_t w0 = first; w0 < last; w0 += ncols) {
    const int n = last - w0 < ncols ? (int)(last - w0) : ncols;
    unsigned long long *const bad_key = (unsigned long long *)&scan->bad_key;
    if (warp < n && s->topk <= EPXC_FEW_SLOTS)
      build_word<EPXC_FEW_SLOTS>(s, plan, r, w0 + warp, cols + warp * rows, bad_key);
    else if (warp < n)
      build_word<EPXC_MAX_TOPK>(s, plan, r, w0 + warp, cols + warp * rows, bad_key);
    __syncthreads();
    store_pass(s, plan, cols, w0, n, carry, pend ? pend + (w0 - first) * rows : NULL);
    __syncthreads();
  }
}

/* Publishes build ticket i's popcounts, waits (bounded) for every earlier ticket's, and adds
 * their sum to this ticket's prefix popcounts; the last of the `builds` tickets writes the
 * counts (the rows' totals) into the plan. Where shared memory holds them, the
 * ticket's prefix popcounts waited there (pend, [word, row]): they then go out once, whole,
 * instead of being read back from the plan (a round trip) and written again.
 * Tickets before i were taken by blocks already running, which wait for none after them. */
static __device__ bool scan_ticket(const epxc_shape_t *s, const epxc_group_t *g, epxc_plan_t *plan, epxc_scan_t *scan,
                                   uint64_t launch, int i, int builds, int64_t first, int64_t last,
                                   int32_t *carry, int32_t *off, const int32_t *pend) {
  const int R = s->nranks, rows = R + s->num_experts, tid = threadIdx.x;
  uint64_t *ready = scan_ready(scan);
  int32_t *sums = scan_sums(scan, builds);
  for (int row = tid; row < rows; row += blockDim.x) sums[(int64_t)i * rows + row] = carry[row];
  __syncthreads();
  /* the barrier orders the block's sums before the release (as block_arrives_last's) */
  if (tid == 0) st_release_gpu(&ready[i], launch);
  __shared__ int late;
  if (tid == 0) late = 0;
  __syncthreads();
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 0; tid < i && !reached_gpu(&ready[tid], launch, spin); spin++)
    if ((spin & EPXC_POLL_MASK) == EPXC_POLL_MASK && globaltimer_ns() - start > g->timeout_ns) {
      late = 1;
      break;
    }
  __syncthreads();
  if (late) return false;
  for (int row = tid; row < rows; row += blockDim.x) {
    int32_t o = 0;
    for (int j0 = 0; j0 < i; j0 += EPXC_SCAN_BATCH) { /* that many tickets' sums in one round trip */
      int32_t v[EPXC_SCAN_BATCH];
#pragma unroll
      for (int u = 0; u < EPXC_SCAN_BATCH; u++)
        v[u] = j0 + u < i ? ((volatile int32_t *)sums)[(int64_t)(j0 + u) * rows + row] : 0;
#pragma unroll
      for (int u = 0; u < EPXC_SCAN_BATCH; u++) o += v[u];
    }
    off[row] = o;
    if (i == builds - 1) plan->counts[row] = o + carry[row];
  }
  __syncthreads();
  /* the earlier tickets' sums into this ticket's words: EPXC_SCAN_BATCH words a thread loaded
     before any is written back, so a pass costs one round trip for that many words */
  const int64_t W = plan->words;
  const int n = (int)(last - first), total = rows * n;
  if (pend) {
    for (int k = tid; k < total; k += blockDim.x) { /* a row's words side by side */
      const int row = k / n, j = k - row * n;
      plan_pre_row(plan, R, W, row)[first + j] = pend[j * rows + row] + off[row];
    }
    return true;
  }
  for (int base = 0; i > 0 && base < total; base += EPXC_SCAN_BATCH * (int)blockDim.x) {
    int32_t *pre[EPXC_SCAN_BATCH];
    int32_t v[EPXC_SCAN_BATCH], add[EPXC_SCAN_BATCH];
#pragma unroll
    for (int u = 0; u < EPXC_SCAN_BATCH; u++) {
      const int k = base + u * (int)blockDim.x + tid, row = k < total ? k / n : 0;
      pre[u] = k < total ? plan_pre_row(plan, R, W, row) + first + (k - row * n) : NULL;
      v[u] = pre[u] ? *pre[u] : 0;
      add[u] = off[row];
    }
#pragma unroll
    for (int u = 0; u < EPXC_SCAN_BATCH; u++)
      if (pre[u]) *pre[u] = v[u] + add[u];
  }
  return true;
}

/* A build ticket is done: its plan writes (every thread's, through the barrier) are released
 * to the closing block, which waits for all of them (builds_done). */
static __device__ void build_arrives(epxc_scan_t *scan) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(&scan->built) : "memory");
}

/* The closing block waits until every build ticket is done, then records the plan's send side
 * summary and resets the scan for the next launch: every ticket has been taken by then (the
 * closer holds the last). A build ticket's own waits end within the timeout, so this one is
 * bounded by twice that; should it run out, the rank stops all the same. Returns the
 * routing's status (plan_status), or EPX_ERR_BROKEN when this rank stopped: a ticket or this
 * wait timed out. */
static __device__ int32_t builds_done(const epxc_group_t *g, epxc_plan_t *plan, epxc_scan_t *scan, uint64_t launch,
                                      int builds, int64_t T) {
  __shared__ int32_t status;
  if (threadIdx.x == 0) {
    const uint64_t start = globaltimer_ns();
    bool late = false;
    for (uint32_t spin = 0; !late && !reached_gpu(&scan->built, (uint64_t)builds, spin); spin++)
      late = (spin & EPXC_POLL_MASK) == EPXC_POLL_MASK && globaltimer_ns() - start > 2 * g->timeout_ns;
    if (late) {
      record_error(g, EPX_ERR_TIMEOUT, EPXC_PH_NOTIFY, g->rank, (int64_t)(g->timeout_ns / 1000000));
      g->state[g->rank]->aborted = 1;
    }
    const uint64_t bad = *(volatile uint64_t *)&scan->bad_key;
    const int aborted = ((volatile epxc_state_t *)g->state[g->rank])->aborted; /* a ticket that timed out set it */
    plan->num_tokens = T;
    plan->refused = EPX_SUCCESS;
    plan->bad_key = bad;
    plan->status = plan_status(bad);
    status = aborted ? EPX_ERR_BROKEN : plan_status(bad);
    scan->bad_key = ~0ull;
    scan->built = 0;
    scan->ticket = 0;
    scan->epoch = launch;
  }
  __syncthreads();
  return status;
}

/* One exclusive prefix sum for warp_scans: of round_up(in[i], align), i < n, into starts
 * (unless NULL). */
typedef struct {
  const int32_t *in;
  int64_t *starts;
  int n, align;
} scan_job_t;

#define EPXC_SCAN_JOBS 4
static_assert(EPXC_SCAN_JOBS <= EPXC_NOTIFY_THREADS / EPXC_WARP, "a warp for each job");

/* x (a count, >= 0) rounded up to a multiple of align (>= 1), in 32-bit arithmetic: both are
 * below 2^31, so x + align - 1 fits 32 bits unsigned, and a 64-bit division is a long routine. */
static __device__ __forceinline__ int64_t round_up_count(int32_t x, int align) {
  if (align <= 1) return x;
  const uint32_t a = (uint32_t)align;
  return (int64_t)(((uint32_t)x + a - 1u) / a) * a;
}

/* EPXC_SCAN_JOBS prefix sums at once, job j by warp j: each lane sums a run of consecutive
 * elements, one shuffle scan over the lanes' sums gives each run its start, and the lane
 * writes its run's starts. The totals (job j's in totals[j]) go to every thread. The closing
 * block runs this once per notify, on its critical path: a scan by the whole block in chunks
 * of its size costs a chain of shuffles and barriers per chunk, and its four jobs' shuffles
 * kept all 16 warps issuing, where here four warps work and the others wait at one barrier. */
static __device__ void warp_scans(const scan_job_t *jobs, int64_t *totals) {
  __shared__ int64_t total[EPXC_SCAN_JOBS];
  const int lane = lane_id(), wid = threadIdx.x / EPXC_WARP;
  if (wid < EPXC_SCAN_JOBS) {
    const scan_job_t job = jobs[wid];
    const int per = (job.n + EPXC_WARP - 1) / EPXC_WARP, lo = min(job.n, lane * per), hi = min(job.n, lo + per);
    int64_t run = 0;
#pragma unroll 1
    for (int i = lo; i < hi; i++) run += round_up_count(job.in[i], job.align);
    int64_t through = run;
#pragma unroll
    for (int o = 1; o < EPXC_WARP; o <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, through, o);
      if (lane >= o) through += u;
    }
    if (job.starts) {
      int64_t at = through - run;
#pragma unroll 1
      for (int i = lo; i < hi; i++) {
        job.starts[i] = at;
        at += round_up_count(job.in[i], job.align);
      }
    }
    if (lane == EPXC_WARP - 1) total[wid] = through;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < EPXC_SCAN_JOBS; j++) totals[j] = total[j];
  __syncthreads(); /* before a next call sets total again */
}

/* This rank's receive budget over its local experts in ascending order (docs/design.md,
 * "Receive budget"): expert l keeps keep_l = min(n_l, floor(max(B - start_l, 0) / align) *
 * align) of its n_l pairs (local[l], shared memory, on entry; keep_l on return), start_l being
 * the rows of the blocks before it: the first keep_l in (source, token) order, so source q
 * keeps clamp(keep_l - base_{l,q}, 0, pairs_{l,q}) of its own (see derive_receive_side). Without a
 * budget every pair is kept. Returns the pairs dropped. */
static __device__ int64_t apply_budget(const epxc_shape_t *s, int32_t *local) {
  const int L = s->num_local;
  const int64_t B = s->recv_budget, align = s->align;
  __shared__ int64_t dropped;
  if (B <= 0) return 0; /* no budget (the same for every thread) */
  if (threadIdx.x == 0) {
    int64_t used = 0, lost = 0;
#pragma unroll 1
    for (int l = 0; l < L; l++) { /* a prefix over the experts: one thread */
      const int64_t want = local[l], room = B - used > 0 ? (B - used) / align * align : 0;
      const int64_t keep = want < room ? want : room;
      used += (keep + align - 1) / align * align;
      lost += want - keep;
      local[l] = (int32_t)keep;
    }
    dropped = lost;
  }
  __syncthreads();
  return dropped;
}

/* Shared memory the closing block takes for the receive side (it builds nothing):
 * block[L + 1] (int64), then tokens[R * R], pairs[L * R], own[R + E] and local[L] (int32). */
static __host__ __device__ size_t finish_smem_bytes(int R, int E) {
  const int L = E / R;
  return sizeof(int64_t) * (L + 1) + sizeof(int32_t) * ((size_t)R * R + (size_t)L * R + R + E + L);
}

/* The closing block's arrays in its shared memory (finish_smem_bytes). */
typedef struct {
  int64_t *block;  /* [L + 1]: first row of local expert l's block */
  int32_t *tokens; /* [q * R + d]: q's tokens for d */
  int32_t *pairs;  /* [l * R + q]: q's pairs of local expert l */
  int32_t *own;    /* [R + E]: this rank's counts */
  int32_t *local;  /* [L]: local expert l's pairs, then those kept */
} finish_arrays_t;

static __device__ finish_arrays_t finish_arrays(const epxc_shape_t *s, void *smem) {
  const int R = s->nranks, L = s->num_local;
  finish_arrays_t a;
  a.block = (int64_t *)smem;
  a.tokens = (int32_t *)(a.block + L + 1);
  a.pairs = a.tokens + R * R;
  a.own = a.pairs + L * R;
  a.local = a.own + R + s->num_experts;
  return a;
}

/* Pushes every peer q what it needs of this rank's counts (own) into q's notify inbox: the
 * routing's status, the tokens for each rank, the pairs of each of q's local experts
 * (epxc_state_t.notify_in); then flags q with the notify's exchange epoch. Posted writes: a
 * peer reads what was pushed to it from its own memory, no round trip. */
static __device__ void push_counts(const epxc_shape_t *s, const epxc_group_t *g, const int32_t *own, int32_t status,
                                   uint64_t epoch) {
  const int R = s->nranks, L = s->num_local, n = 1 + R + L, me = s->rank;
#pragma unroll 1
  for (int i = threadIdx.x; i < R * n; i += blockDim.x) {
    const int q = i / n, j = i - q * n;
    g->state[q]->notify_in[me * n + j] = j == 0 ? status : j <= R ? own[j - 1] : own[R + q * L + j - 1 - R];
  }
  __syncthreads(); /* orders the block's stores before each flag's release (as block_arrives_last) */
  if (threadIdx.x < R) st_release(&g->state[threadIdx.x]->notify_flag[me], epoch);
}

/* Waits (bounded) for every peer's push of the notify of exchange `epoch` and reads them into
 * a.tokens and a.pairs. Returns the group's status as an exchange would decide it: the first
 * failure a rank reported, in rank order (recorded here, as the exchange records it), or
 * EPX_ERR_BROKEN when a wait failed (this rank then stops). */
static __device__ int32_t gather_counts(const epxc_shape_t *s, const epxc_group_t *g, uint64_t epoch,
                                        const finish_arrays_t *a) {
  const int R = s->nranks, L = s->num_local, n = 1 + R + L, tid = threadIdx.x, nt = blockDim.x;
  epxc_state_t *me = g->state[s->rank];
  __shared__ int failed;
  __shared__ int32_t decided;
  __shared__ int32_t status[EPX_MAX_RANKS];
  if (tid == 0) failed = 0;
  __syncthreads();
  if (tid < R) {
    const int got = wait_flag(g, &me->notify_flag[tid], epoch, tid, EPXC_PH_NOTIFY);
    if (got == WAIT_LATE) record_error(g, EPX_ERR_TIMEOUT, EPXC_PH_NOTIFY, tid, (int64_t)(g->timeout_ns / 1000000));
    if (got != WAIT_ARRIVED) failed = 1;
  }
  __syncthreads();
  if (failed) {
    if (tid == 0) me->aborted = 1;
    return EPX_ERR_BROKEN;
  }
  const volatile int32_t *in = me->notify_in;
#pragma unroll 1
  for (int i = tid; i < R * R; i += nt) a->tokens[i] = in[(i / R) * n + 1 + i % R];
#pragma unroll 1
  for (int i = tid; i < L * R; i += nt) a->pairs[i] = in[(i % R) * n + 1 + R + i / R];
  if (tid < R) status[tid] = in[tid * n];
  __syncthreads();
  if (tid == 0) {
    int32_t first = EPX_SUCCESS;
    int who = 0;
#pragma unroll 1
    for (int q = 0; q < R && first == EPX_SUCCESS; q++) first = status[q], who = q;
    if (first != EPX_SUCCESS) {
      record_error(g, first, EPXC_PH_NOTIFY, who, 0);
      me->group_status = first;
    }
    decided = first;
  }
  __syncthreads();
  return decided;
}

/* The receive side, from every rank's counts in shared memory (a): every sum over ranks,
 * experts and rows is made there (the four prefix sums at once, warp_scans), and the
 * plan's arrays are written once at the end. */
static __device__ void derive_receive_side(const epxc_shape_t *sp, epxc_plan_t *plan, const finish_arrays_t *a) {
  const epxc_shape_t s = *sp;
  const int R = s.nranks, L = s.num_local, E = s.num_experts, me = s.rank, tid = threadIdx.x, nt = blockDim.x;
  int64_t *const block = a->block;
  const int32_t *const tokens = a->tokens, *const pairs = a->pairs;
  int32_t *const own = a->own, *const local = a->local;
  /* the plan's arrays, read once: a store through one could otherwise be to *plan */
  int64_t *const pair_base = plan->pair_base, *const block_out = plan->block, *const pair_send_base = plan->pair_send_base;
  int32_t *const pairs_local = plan->pairs_local, *const kept = plan->kept;
  if (tid < R) {
    int64_t tb = 0, db = 0;
#pragma unroll 1
    for (int q = 0; q < tid; q++) tb += tokens[q * R + me];
#pragma unroll 1
    for (int q = 0; q < me; q++) db += tokens[q * R + tid];
    plan->tok_base[tid] = tb;
    plan->dest_base[tid] = db;
  }
  for (int l = tid; l < L; l += nt) {
    int32_t n = 0;
#pragma unroll 1
    for (int q = 0; q < R; q++) n += pairs[l * R + q];
    local[l] = n;
  }
  __syncthreads();
  const int64_t dropped = apply_budget(&s, local);
  if (s.ll) /* fixed blocks; warp_scans' barrier publishes them */
    for (int l = tid; l < L; l += nt) block[l] = (int64_t)l * R * s.max_tokens;
  /* the rows' blocks (but in low-latency mode), the pairs here, the copies and the pairs sent */
  const scan_job_t jobs[EPXC_SCAN_JOBS] = {{local, block, s.ll ? 0 : L, s.align},
                                           {local, NULL, L, 1},
                                           {own, plan->send_base, R, 1},
                                           {own + R, pair_send_base, E, 1}};
  int64_t totals[EPXC_SCAN_JOBS];
  warp_scans(jobs, totals);
  const int64_t rows = totals[0], num_pairs = totals[1], sent = totals[2], pairs_sent = totals[3];
  if (tid == 0) {
    int64_t recv = 0;
#pragma unroll 1
    for (int q = 0; q < R; q++) recv += tokens[q * R + me];
    const int64_t all_rows = s.ll ? (int64_t)L * R * s.max_tokens : rows;
    block_out[L] = all_rows;
    pair_send_base[E] = pairs_sent;
    plan->dropped = dropped;
    plan->num_recv = recv;
    plan->num_pairs = num_pairs;
    plan->num_rows = s.expert_layout ? all_rows : recv;
    plan->sent_copies = sent;
  }
  for (int l = tid; l < L; l += nt) {
    pairs_local[l] = local[l];
    block_out[l] = block[l];
  }
  /* source q's pairs of local expert l start at base_{l,q} = its predecessors' in the block */
  for (int i = tid; i < L * R; i += nt) {
    const int l = i / R, q = i % R;
    int64_t base = 0;
#pragma unroll 1
    for (int p = 0; p < q; p++) base += pairs[l * R + p];
    pair_base[i] = block[l] + base;
    if (kept) {
      const int64_t k = local[l] - base;
      kept[i] = k <= 0 ? 0 : k < pairs[i] ? (int32_t)k : pairs[i];
    }
  }
  __syncthreads();
}

/* The closing block (see above): it meets the peers (stamps, plan pointers and token counts)
 * while the build tickets work, takes in the peers' send sides, waits for the build, then
 * trades counts with the peers and derives the receive side. */
static __device__ void close_notify(const epxc_shape_t *s, const epxc_group_t *g, epxc_plan_t *plan,
                                    epxc_scan_t *scan, int64_t T, const epxc_stamp_t stamp, uint64_t launch,
                                    void *smem) {
  const int R = s->nranks, E = s->num_experts, tid = threadIdx.x;
  const finish_arrays_t a = finish_arrays(s, smem);
  __shared__ int32_t group;
  epxc_words_t words = {{0}};
  words.notify.plan = (uint64_t)(uintptr_t)plan;
  words.notify.num_tokens = (uint64_t)T;
  epxc_met_t met;
  const uint64_t epoch = next_epoch(g);
  const bool met_ok = exchange_block(g, EPXC_PH_NOTIFY, &words, stamp, epoch, &met);
  if (tid == 0) group = met_ok ? met.status : EPX_ERR_BROKEN; /* thread 0 holds the status */
  __syncthreads();
  /* Before this rank's push: a rank's notify ends only after every peer has read its plan. A
     failed exchange's words may be an earlier one's, or a refusing rank's (no plan): unread. */
  if (group == EPX_SUCCESS && tid < R)
    peer_view(g, tid, met.words.notify.plan, (int64_t)met.words.notify.num_tokens, &plan->peer[tid]);
  NOTIFY_TRACE(); /* 1: met the peers */
  const int32_t routing = builds_done(g, plan, scan, launch, (int)gridDim.x - 1, T);
  NOTIFY_TRACE(); /* 2: built */
  if (tid == 0 && group == EPX_SUCCESS && routing == EPX_ERR_BROKEN) group = EPX_ERR_BROKEN; /* this rank stopped */
  __syncthreads();
  if (group == EPX_SUCCESS) {
    const volatile int32_t *counts = plan->counts; /* the last build ticket's, released to builds_done */
#pragma unroll 1
    for (int i = tid; i < R + E; i += blockDim.x) a.own[i] = counts[i];
    __syncthreads();
    push_counts(s, g, a.own, routing, epoch);
    NOTIFY_TRACE(); /* 3: pushed */
    const int32_t got = gather_counts(s, g, epoch, &a);
    if (tid == 0) group = got;
    NOTIFY_TRACE(); /* 4: gathered */
  }
  __syncthreads();
  if (tid == 0) {
    plan->group_status = group;
    if (group) plan->num_recv = plan->num_rows = plan->num_pairs = 0;
  }
  if (group != EPX_SUCCESS) return; /* the same in every thread: read after the barrier */
  derive_receive_side(s, plan, &a);
  NOTIFY_TRACE(); /* 5: receive side */
}

/* Notify in one launch (see above): the build tickets, then the closing block. */
static __global__ void __launch_bounds__(EPXC_NOTIFY_THREADS)
    notify_kernel(epxc_shape_t s, const __grid_constant__ epxc_group_t g, epxc_plan_t *plan, epxc_scan_t *scan,
                  epxc_route_t r, epxc_stamp_t stamp, int ncols, bool keep_pre) {
  extern __shared__ __align__(16) uint32_t notify_smem[];
  __shared__ int ticket;
  __shared__ uint64_t launch;
  NOTIFY_TRACE_START(); /* 0: started */
  if (threadIdx.x == 0) {
    ticket = (int)atomicAdd(&scan->ticket, 1u);
    launch = *(volatile uint64_t *)&scan->epoch + 1;
  }
  __syncthreads();
  const int builds = (int)gridDim.x - 1;
  if (ticket == builds) {
    close_notify(&s, &g, plan, scan, r.num_tokens, stamp, launch, notify_smem);
    NOTIFY_TRACE_PRINT("close", ticket);
    return;
  }
  const int rows = s.nranks + s.num_experts;
  uint32_t *cols = notify_smem;                               /* [ncols, rows]: a pass's words, a column per warp */
  int32_t *carry = (int32_t *)(cols + (int64_t)ncols * rows); /* [rows]: this ticket's popcounts */
  int32_t *off = carry + rows;                                /* [rows]: the earlier tickets' */
  int32_t *const pend = keep_pre ? off + rows : NULL;         /* [words, rows]: the ticket's prefix popcounts */
  const int64_t used = (r.num_tokens + EPXC_WARP - 1) / EPXC_WARP;
  const int64_t first = run_first(used, builds, ticket), last = run_first(used, builds, ticket + 1);
  build_ticket(&s, plan, &r, scan, first, last, ncols, cols, carry, pend);
  NOTIFY_TRACE(); /* 1: built */
  if (!scan_ticket(&s, &g, plan, scan, launch, ticket, builds, first, last, carry, off, pend) && threadIdx.x == 0) {
    record_error(&g, EPX_ERR_TIMEOUT, EPXC_PH_NOTIFY, g.rank, (int64_t)(g.timeout_ns / 1000000));
    g.state[g.rank]->aborted = 1; /* this rank stops: the closing block pushes nothing */
  }
  build_arrives(scan);
  NOTIFY_TRACE(); /* 2: scanned */
  NOTIFY_TRACE_PRINT("build", ticket);
}

/* Columns a notify pass builds at once: a warp each, as many as shared memory holds. */
static int notify_columns(int rows) {
  const int fit = (int)((EPXC_NOTIFY_SMEM - 2 * sizeof(int32_t) * rows) / (sizeof(uint32_t) * rows));
  return fit < EPXC_NOTIFY_THREADS / EPXC_WARP ? fit : EPXC_NOTIFY_THREADS / EPXC_WARP;
}

extern "C" int epxc_notify(const epxc_shape_t *s, const epxc_group_t *g, epxc_plan_t *plan_dev, epxc_scan_t *scan,
                           const epxc_route_t *r, const epxc_stamp_t *stamp, void *stream) {
  const int rows = s->nranks + s->num_experts, ncols = notify_columns(rows);
  /* The closing block is one of the budget's blocks: ranks sharing a GPU within the
     ranks x num_sms <= SM count rule then have every block resident at once (a budget of one
     SM gets a build block and the closing block). A build ticket's look-back gives each
     earlier ticket a thread: no more of them than threads. */
  const int budget = s->num_sms > 1 ? s->num_sms - 1 : 1;
  const int blocks = budget < EPXC_NOTIFY_THREADS ? budget : EPXC_NOTIFY_THREADS;
  /* a ticket's prefix popcounts wait in shared memory for its scan where they fit (scan_ticket) */
  const int64_t used = (r->num_tokens + EPXC_WARP - 1) / EPXC_WARP, per = (used + blocks - 1) / blocks;
  const size_t words = sizeof(uint32_t) * (size_t)ncols * rows + 2 * sizeof(int32_t) * rows,
               pend = sizeof(int32_t) * (size_t)per * rows;
  const bool keep_pre = words + pend <= EPXC_NOTIFY_SMEM;
  const size_t build = words + (keep_pre ? pend : 0), finish = finish_smem_bytes(s->nranks, s->num_experts),
               smem = build > finish ? build : finish;
  /* finish's need is largest at one rank with EPX_MAX_EXPERTS experts: 82 KB, within EPXC_NOTIFY_SMEM */
  notify_kernel<<<blocks + 1, EPXC_NOTIFY_THREADS, smem, (cudaStream_t)stream>>>(*s, *g, plan_dev, scan, *r, *stamp, ncols,
                                                                               keep_pre);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_layout(size_t *stack) {
  const void *const kernels[] = {(const void *)layout_kernel, (const void *)notify_kernel};
  const cudaError_t e = preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
  if (e != cudaSuccess) return (int)e;
  return (int)cudaFuncSetAttribute((const void *)notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   EPXC_NOTIFY_SMEM);
}
