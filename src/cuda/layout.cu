/* Layout and notify: from a routing (topk ids or a multi-hot map) to counts, per-token bitmaps
 * and, once every rank's counts are known, where each row lands. */
#include "cuda/common.cuh"

/* A token whose routing is refused counts nowhere and is in no rank; the refusal is this
 * rank's recoverable error, reported by epx_comm_synchronize. */
static __global__ void layout_kernel(epxc_shape_t s, epxc_group_t g, int64_t T, const void *topk_idx,
                                     epx_dtype_t idx_dtype, const uint8_t *map, int32_t *tokens_per_rank,
                                     int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
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
    for (int k = 0; k < s.topk; k++) {
      if (ids[k] < 0) continue;
      ranks |= 1ull << (ids[k] / s.num_local);
      if (tokens_per_expert) atomicAdd(&tokens_per_expert[ids[k]], 1);
    }
    /* the lanes here count their tokens per rank together: one atomic per rank, not per token */
    const unsigned mates = __activemask();
    const bool leader = lane_id() == __ffs(mates) - 1;
    for (int d = 0; d < s.nranks; d++) {
      const bool in = (ranks >> d) & 1;
      const unsigned n = __reduce_add_sync(mates, in ? 1u : 0u);
      if (tokens_per_rank && leader && n) atomicAdd(&tokens_per_rank[d], (int32_t)n);
      if (is_token_in_rank) is_token_in_rank[t * s.nranks + d] = in;
    }
  }
}

extern "C" int epxc_layout(const epxc_shape_t *s, const epxc_group_t *g, int64_t T, const void *topk_idx,
                           epx_dtype_t idx_dtype, const uint8_t *map, int32_t *tokens_per_rank,
                           int32_t *tokens_per_expert, uint8_t *is_token_in_rank, void *stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (tokens_per_rank) cudaMemsetAsync(tokens_per_rank, 0, sizeof(int32_t) * s->nranks, st);
  if (tokens_per_expert) cudaMemsetAsync(tokens_per_expert, 0, sizeof(int32_t) * s->num_experts, st);
  if (T > 0)
    layout_kernel<<<s->num_sms, EPXC_LAYOUT_THREADS, 0, st>>>(*s, *g, T, topk_idx, idx_dtype, map, tokens_per_rank,
                                                              tokens_per_expert, is_token_in_rank);
  return (int)cudaGetLastError();
}

/* ---- notify ------------------------------------------------------------------------------ */

/* One thread per token: normalise, validate, set bits (which start zeroed; the prefix kernel
 * counts them). */
static __global__ void build_kernel(epxc_shape_t s, epxc_plan_t *plan, int64_t T, const void *topk_idx,
                                    epx_dtype_t idx_dtype, const float *topk_weights, const uint8_t *map,
                                    const float *probs) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    plan->num_tokens = T;
    plan->refused = EPX_SUCCESS;
  }
  int32_t ids[EPXC_MAX_TOPK];
  float ws[EPXC_MAX_TOPK];
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < T; t += (int64_t)gridDim.x * blockDim.x) {
    int bad = 0;
    int st = read_route(&s, t, topk_idx, idx_dtype, topk_weights, map, probs, ids, ws, &bad);
    if (st != EPX_SUCCESS)
      atomicMin((unsigned long long *)&plan->bad_key, ((unsigned long long)t << 16) | ((unsigned)bad << 8) | (unsigned)st);
    else
      plan_token(&s, plan, plan_bits(plan), t, ids, ws);
  }
}

/* Prefix popcounts and counts of every bitmap row, a warp per row; the bad-token key the
 * build left becomes this rank's status for the exchange. */
static __global__ void prefix_kernel(epxc_shape_t s, epxc_plan_t *plan) {
  if (blockIdx.x == 0 && threadIdx.x == 0) plan->status = plan_status(plan->bad_key);
  plan_prefix(&s, plan, plan_bits(plan), warp_global(), warp_count());
}

extern "C" int epxc_notify_build(const epxc_shape_t *s, epxc_plan_t *plan_dev, const epxc_plan_t *plan_host,
                                 int64_t T, const void *topk_idx, epx_dtype_t idx_dtype, const float *topk_weights,
                                 const uint8_t *map, const float *probs, void *stream) {
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t W = plan_host->words, R = s->nranks, E = s->num_experts;
  cudaMemsetAsync(plan_host->rank_bits, 0, sizeof(uint32_t) * R * W, st);
  cudaMemsetAsync(plan_host->exp_bits, 0, sizeof(uint32_t) * E * W, st);
  cudaMemsetAsync(&plan_dev->bad_key, 0xff, sizeof(uint64_t), st);
  build_kernel<<<s->num_sms, EPXC_NOTIFY_THREADS, 0, st>>>(*s, plan_dev, T, topk_idx, idx_dtype, topk_weights, map, probs);
  prefix_kernel<<<s->num_sms, EPXC_NOTIFY_THREADS, 0, st>>>(*s, plan_dev);
  return (int)cudaGetLastError();
}

/* Exclusive prefix sums of round_up(in[i], align), i < n, into starts (unless NULL), by the
 * whole block in chunks of its size; returns the sum to every thread. */
static __device__ int64_t block_scan(const int32_t *in, int n, int align, int64_t *starts) {
  __shared__ int64_t warp_base[EPXC_FINISH_THREADS / EPXC_WARP];
  __shared__ int64_t carry;
  const int lane = lane_id(), wid = threadIdx.x / EPXC_WARP, warps = blockDim.x / EPXC_WARP;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int64_t v = i < n ? ((int64_t)in[i] + align - 1) / align * align : 0;
    int64_t inc = v;
    for (int o = 1; o < EPXC_WARP; o <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, inc, o);
      if (lane >= o) inc += u;
    }
    if (lane == EPXC_WARP - 1) warp_base[wid] = inc;
    __syncthreads();
    if (wid == 0) {
      const int64_t x = lane < warps ? warp_base[lane] : 0;
      int64_t xi = x;
      for (int o = 1; o < EPXC_WARP; o <<= 1) {
        const int64_t u = __shfl_up_sync(0xffffffffu, xi, o);
        if (lane >= o) xi += u;
      }
      if (lane < warps) warp_base[lane] = xi - x;
    }
    __syncthreads();
    const int64_t before = carry + warp_base[wid] + inc - v;
    if (i < n && starts) starts[i] = before;
    __syncthreads(); /* every thread has read carry */
    if (threadIdx.x == blockDim.x - 1) carry = before + v;
    __syncthreads();
  }
  const int64_t total = carry;
  __syncthreads(); /* before a next call sets carry again */
  return total;
}

/* This rank's receive budget over its local experts in ascending order (docs/design.md,
 * "Receive budget"): expert l keeps keep_l = min(n_l, floor(max(B - start_l, 0) / align) *
 * align) of its n_l pairs (pairs_local on entry, keep_l on return), start_l being the rows of
 * the blocks before it: the first keep_l in (source, token) order, so source q keeps
 * clamp(keep_l - base_{l,q}, 0, pairs_{l,q}) of its own (kept). Without a budget every pair
 * is kept. On entry pair_base holds base_{l,q}, not yet the block start. */
static __device__ void apply_budget(const epxc_shape_t *s, epxc_plan_t *plan, const int32_t *pairs) {
  const int R = s->nranks, L = s->num_local, tid = threadIdx.x;
  const int64_t B = s->recv_budget, align = s->align;
  if (tid == 0) {
    int64_t used = 0, dropped = 0;
    for (int l = 0; l < L && B > 0; l++) { /* a prefix over the experts: one thread, and only with a budget */
      const int64_t want = plan->pairs_local[l], room = B - used > 0 ? (B - used) / align * align : 0;
      const int64_t keep = want < room ? want : room;
      used += (keep + align - 1) / align * align;
      dropped += want - keep;
      plan->pairs_local[l] = (int32_t)keep;
    }
    plan->dropped = dropped;
  }
  __syncthreads();
  for (int i = tid; i < L * R && plan->kept; i += blockDim.x) {
    const int64_t k = plan->pairs_local[i / R] - plan->pair_base[i];
    plan->kept[i] = k <= 0 ? 0 : k < pairs[i] ? (int32_t)k : pairs[i];
  }
}

/* After the exchange of plan pointers (notify words): every rank's send side as this rank reads it,
 * then the receive side, from every rank's counts. The peers' counts are read once, by all the
 * threads at once, into shared memory; the sums over ranks, experts and rows are block scans:
 * a decode step's whole notify is a few round trips. */
static __global__ void __launch_bounds__(EPXC_FINISH_THREADS) finish_kernel(epxc_shape_t s, epxc_group_t g,
                                                                           epxc_plan_t *plan) {
  const epxc_state_t *st = g.state[g.rank];
  const int R = s.nranks, L = s.num_local, me = s.rank, tid = threadIdx.x, nt = blockDim.x;
  __shared__ int stop;
  __shared__ int32_t tokens[EPX_MAX_RANKS * EPX_MAX_RANKS]; /* [q * R + d]: q's tokens for d */
  __shared__ int32_t pairs[EPX_MAX_EXPERTS];                /* [l * R + q]: q's pairs of local expert l */
  if (tid == 0) {
    stop = st->aborted;
    plan->group_status = st->aborted ? EPX_ERR_BROKEN : st->group_status;
    if (plan->group_status) plan->num_recv = plan->num_rows = plan->num_pairs = 0;
  }
  __syncthreads();
  if (stop || plan->group_status) return;
  if (tid < R) peer_view(&g, tid, st->got[tid].notify.plan, &plan->peer[tid]);
  __syncthreads();
  for (int i = tid; i < R * R; i += nt) tokens[i] = plan->peer[i / R].counts[i % R];
  for (int i = tid; i < L * R; i += nt) pairs[i] = plan->peer[i % R].counts[R + me * L + i / R];
  __syncthreads();
  if (tid < R) {
    int64_t tb = 0, db = 0;
    for (int q = 0; q < tid; q++) tb += tokens[q * R + me];
    for (int q = 0; q < me; q++) db += tokens[q * R + tid];
    plan->tok_base[tid] = tb;
    plan->dest_base[tid] = db;
  }
  for (int l = tid; l < L; l += nt) {
    int64_t n = 0;
    for (int q = 0; q < R; q++) {
      plan->pair_base[(int64_t)l * R + q] = n; /* block start added below */
      n += pairs[l * R + q];
    }
    plan->pairs_local[l] = (int32_t)n;
  }
  __syncthreads();
  apply_budget(&s, plan, pairs);
  __syncthreads();
  const int64_t rows = s.ll ? 0 : block_scan(plan->pairs_local, L, s.align, plan->block);
  if (s.ll)
    for (int l = tid; l < L; l += nt) plan->block[l] = (int64_t)l * R * s.max_tokens;
  const int64_t num_pairs = block_scan(plan->pairs_local, L, 1, NULL);
  const int64_t sent = block_scan(plan->counts, R, 1, plan->send_base);
  const int64_t pairs_sent = block_scan(plan->counts + R, s.num_experts, 1, plan->pair_send_base);
  if (tid == 0) {
    int64_t recv = 0;
    for (int q = 0; q < R; q++) recv += tokens[q * R + me];
    plan->block[L] = s.ll ? (int64_t)L * R * s.max_tokens : rows;
    plan->pair_send_base[s.num_experts] = pairs_sent;
    plan->num_recv = recv;
    plan->num_pairs = num_pairs;
    plan->num_rows = s.expert_layout ? plan->block[L] : recv;
    plan->sent_copies = sent;
  }
  __syncthreads();
  for (int i = tid; i < L * R; i += nt) plan->pair_base[i] += plan->block[i / R];
}

extern "C" int epxc_notify_finish(const epxc_shape_t *s, const epxc_group_t *g, epxc_plan_t *plan_dev, void *stream) {
  finish_kernel<<<1, EPXC_FINISH_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_layout(size_t *stack) {
  const void *const kernels[] = {
      (const void *)layout_kernel, (const void *)build_kernel, (const void *)prefix_kernel,
      (const void *)finish_kernel};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}
