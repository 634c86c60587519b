/* The all-to-all baseline: what Megatron's alltoall dispatcher does, on the same API and
 * with the same bits as the fused path, as a fallback and a yardstick.
 *
 * Dispatch: the source permutes its tokens into a send buffer grouped by destination (token
 * layout: a row per (token, rank)) or by expert (expert layout: a row per (token, expert), so
 * a token crosses once per expert, not once per rank); every destination then pulls whole
 * chunks; in the expert layout it sorts them from (source, expert) to (expert, source) order.
 * Combine: destinations reduce their rows per token (the contract's partials), every source
 * pulls its chunks back whole, then sums them per token from its staging copy. */
#include "cuda/rows.cuh"

/* Rows of the send buffer before rank d's (token layout) or expert e's (expert layout). */
static __device__ __forceinline__ int64_t chunk_start(const epxc_shape_t *s, const epxc_peer_t *src, int d) {
  return s->expert_layout ? src->pair_send_base[d * s->num_local] : src->send_base[d];
}

static __device__ __forceinline__ int64_t chunk_rows(const epxc_shape_t *s, const epxc_peer_t *src, int d) {
  return s->expert_layout ? src->pair_send_base[(d + 1) * s->num_local] - src->pair_send_base[d * s->num_local]
                          : src->counts[d];
}

/* Copies rows [0, n) of a chunk, as 16-byte vectors over the whole grid. */
static __device__ void copy_chunk(const void *src, void *dst, int64_t n, size_t row_bytes) {
  const uint4 *in = (const uint4 *)src;
  uint4 *out = (uint4 *)dst;
  const int64_t v = n * (int64_t)(row_bytes / 16);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < v; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = in[i];
}

static __device__ void copy_floats(const float *src, float *dst, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

/* ---- dispatch -------------------------------------------------------------------------- */

static __global__ void __launch_bounds__(EPXC_THREADS) permute_kernel(epxc_shape_t s, epxc_group_t g,
                                                                     const epxc_plan_t *plan, epxc_a2a_t b,
                                                                     epxc_dispatch_t a) {
  if (plan_void(&g, plan)) return;
  const int K = s.topk, R = s.nranks, H = s.hidden, lane = lane_id();
  const int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const bool fp8 = a.recv_dtype == EPX_FP8_E4M3;
  const bool scaled = a.scale_by_probs && s.expert_layout, raw = a.recv_dtype == a.x_dtype && !scaled;
  const int64_t T = plan->num_tokens, W = plan->words;
  for (int64_t t = warp_global(); t < T; t += warp_count()) {
    void *dst = NULL; /* lane j < m: the j-th send row, its scales and factor (copy_row_raw) */
    float *dscale = NULL, factor = 0.0f;
    int m = 0;
    /* token layout: a row per rank j the token goes to; expert layout: a row per slot j */
    for (int j = 0; j < (s.expert_layout ? K : R); j++) {
      int64_t row;
      float f = 1.0f;
      if (!s.expert_layout) {
        const uint32_t *bits = plan->rank_bits + (int64_t)j * W;
        if (!bit_set(bits, t)) continue;
        row = plan->send_base[j] + bit_rank(bits, plan->rank_pre + (int64_t)j * W, t);
        if (lane == 0) b.send_token[row] = (int32_t)t;
      } else {
        const int e = plan->idx[t * K + j];
        if (e < 0) continue;
        row = plan->pair_send_base[e] + bit_rank(plan->exp_bits + (int64_t)e * W, plan->exp_pre + (int64_t)e * W, t);
        f = plan->weight[t * K + j];
        if (lane == 0) b.send_weight[row] = f;
      }
      if (lane == m) {
        dst = row_at_mut(b.send_x, a.recv_dtype, row, H);
        dscale = fp8 ? b.send_scales + row * blocks : NULL;
        factor = f;
      }
      m++;
    }
    const void *in = row_at(a.x, a.x_dtype, t, H);
    if (raw)
      copy_row_raw(in, dst, m, (int64_t)H * dtype_bytes(a.x_dtype));
    else
      convert_row(in, a.x_dtype, a.recv_dtype, H, dst, dscale, factor, scaled, m);
  }
}

/* The destination pulls each source's chunk whole: into recv_x directly (token layout, whose
 * order the chunks already have) or into the staging buffer (expert layout), from
 * the send buffers each source published. */
static __global__ void __launch_bounds__(EPXC_THREADS) gather_kernel(epxc_shape_t s, epxc_group_t g,
                                                                    const epxc_plan_t *plan, epxc_a2a_t b,
                                                                    epxc_dispatch_t a) {
  if (plan_void(&g, plan) || !output_fits(&s, &g, plan, &a)) return;
  const int K = s.topk, L = s.num_local, R = s.nranks, me = s.rank, H = s.hidden;
  const int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const bool fp8 = a.recv_dtype == EPX_FP8_E4M3;
  const size_t row_bytes = (size_t)H * dtype_bytes(a.recv_dtype);
  if (!s.expert_layout) write_counts(&s, plan, &a);
  int64_t staged = 0;
  for (int src_rank = 0; src_rank < R; src_rank++) {
    const epxc_peer_t *src = &plan->peer[src_rank];
    const int64_t first = chunk_start(&s, src, me), n = chunk_rows(&s, src, me);
    const int64_t at = s.expert_layout ? staged : plan->tok_base[src_rank];
    void *dst_x = s.expert_layout ? b.stage_x : a.recv_x;
    float *dst_scales = s.expert_layout ? b.stage_scales : a.recv_scales;
    const epxc_a2a_dispatch_words_t *sent = &posted(&g, src_rank)->a2a_dispatch;
    const char *send_x = (const char *)peer_ptr(&g, src_rank, sent->send_x);
    copy_chunk(send_x + first * row_bytes, (char *)dst_x + at * row_bytes, n, row_bytes);
    if (fp8) {
      const float *send_scales = (const float *)peer_ptr(&g, src_rank, sent->send_scales);
      copy_floats(send_scales + first * blocks, dst_scales + at * blocks, n * blocks);
    }
    if (s.expert_layout) {
      copy_floats((const float *)peer_ptr(&g, src_rank, sent->send_weight) + first, b.stage_weight + at, n);
    } else {
      const int32_t *tokens = (const int32_t *)peer_ptr(&g, src_rank, sent->send_token) + first;
      for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * K; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = i / K, t = tokens[j];
        const int k = (int)(i % K), e = src->idx[t * K + k];
        const bool here = e >= 0 && e / L == me;
        if (a.recv_topk_idx) a.recv_topk_idx[(at + j) * K + k] = here ? e % L : -1;
        if (a.recv_topk_weights) a.recv_topk_weights[(at + j) * K + k] = here ? src->weight[t * K + k] : 0.0f;
      }
    }
    staged += n;
  }
}

/* Expert layout: staged rows, in (source, expert, token) order, to their final rows in
 * (expert, source, token) order, padding zeroed. */
static __global__ void __launch_bounds__(EPXC_THREADS) sort_kernel(epxc_shape_t s, epxc_group_t g,
                                                                  const epxc_plan_t *plan, epxc_a2a_t b,
                                                                  epxc_dispatch_t a) {
  if (plan_void(&g, plan) || !output_fits(&s, &g, plan, &a)) return;
  const int L = s.num_local, R = s.nranks, me = s.rank, H = s.hidden;
  const int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const bool fp8 = a.recv_dtype == EPX_FP8_E4M3;
  const size_t row_bytes = (size_t)H * dtype_bytes(a.recv_dtype);
  write_counts(&s, plan, &a);
  zero_padding(&s, plan, &a);
  int64_t staged = 0;
  for (int src_rank = 0; src_rank < R; src_rank++) {
    const epxc_peer_t *src = &plan->peer[src_rank];
    for (int l = 0; l < L; l++) {
      const int64_t n = src->counts[R + me * L + l], to = plan->pair_base[(int64_t)l * R + src_rank];
      copy_chunk((const char *)b.stage_x + staged * row_bytes, (char *)a.recv_x + to * row_bytes, n, row_bytes);
      if (fp8) copy_floats(b.stage_scales + staged * blocks, a.recv_scales + to * blocks, n * blocks);
      if (a.recv_probs) copy_floats(b.stage_weight + staged, a.recv_probs + to, n);
      staged += n;
    }
  }
}

extern "C" int epxc_a2a_permute(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                                const epxc_a2a_t *b, const epxc_dispatch_t *a, void *stream) {
  permute_kernel<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *b, *a);
  return (int)cudaGetLastError();
}

extern "C" int epxc_a2a_gather(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                               const epxc_a2a_t *b, const epxc_dispatch_t *a, void *stream) {
  gather_kernel<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *b, *a);
  if (s->expert_layout) sort_kernel<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *b, *a);
  return (int)cudaGetLastError();
}

/* ---- combine --------------------------------------------------------------------------- */

/* The source pulls, from every destination, the chunk of rows that belong to its tokens
 * (they are contiguous there, in token order), into its staging buffer. */
static __global__ void __launch_bounds__(EPXC_THREADS) pull_back_kernel(epxc_shape_t s, epxc_group_t g,
                                                                       const epxc_plan_t *plan, epxc_combine_t a) {
  if (plan_void(&g, plan)) return;
  const size_t row_bytes = (size_t)s.hidden * dtype_bytes(a.y_dtype);
  for (int d = 0; d < s.nranks; d++)
    copy_chunk((const char *)peer_ptr(&g, d, posted(&g, d)->combine.rows) + plan->dest_base[d] * row_bytes,
               (char *)a.staged + plan->send_base[d] * row_bytes, plan->counts[d], row_bytes);
}

extern "C" int epxc_a2a_pull_back(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                                  const epxc_combine_t *a, void *stream) {
  pull_back_kernel<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *a);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_a2a(size_t *stack) {
  const void *const kernels[] = {
      (const void *)permute_kernel, (const void *)gather_kernel, (const void *)sort_kernel,
      (const void *)pull_back_kernel};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}
