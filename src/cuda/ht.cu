/* High-throughput dispatch and combine: the fused path for prefill and training.
 *
 * Dispatch: each destination reads every token that comes to it once from its source (a
 * warp per token, 16-byte vectors) and writes it to its final rows: its token row, or one row
 * per local expert it chose (the extra copies are made here, on the receiving side, so a
 * token crosses the link once per rank). fp8 is quantised on the fly, per 128 channels.
 * Combine: each destination first reduces its rows of a token into one partial (expert
 * layout), then each source reads its tokens' rows back and sums them in rank order. */
#include "cuda/rows.cuh"

/* ---- dispatch --------------------------------------------------------------------------- */

static __global__ void __launch_bounds__(EPXC_THREADS) dispatch_kernel(epxc_shape_t s, epxc_group_t g,
                                                                      const epxc_plan_t *plan, epxc_dispatch_t a) {
  if (plan_void(&g, plan)) return;
  const int K = s.topk, L = s.num_local, R = s.nranks, me = s.rank, H = s.hidden, lane = lane_id();
  const bool fp8 = a.recv_dtype == EPX_FP8_E4M3;
  const int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const size_t recv_row_bytes = (size_t)H * dtype_bytes(a.recv_dtype);
  if (!output_fits(&s, &g, plan, &a)) return;
  write_counts(&s, plan, &a);
  zero_padding(&s, plan, &a);

  const bool raw = a.recv_dtype == a.x_dtype && !(a.scale_by_probs && s.expert_layout);
  for (int src_rank = 0; src_rank < R; src_rank++) {
    const epxc_peer_t *src = &plan->peer[src_rank];
    const void *x = peer_ptr(&g, src_rank, posted(&g, src_rank)->ht_dispatch.x);
    const int64_t T = src->num_tokens, W = src->words;
    const uint32_t *bits = src->rank_bits + (int64_t)me * W;
    const int32_t *pre = src->rank_pre + (int64_t)me * W;
    for (int64_t t = warp_global(); t < T; t += warp_count()) {
      if (!bit_set(bits, t)) continue;
      const void *in = row_at(x, a.x_dtype, t, H);
      void *dst[EPXC_MAX_TOPK];
      float *dscale[EPXC_MAX_TOPK];
      float factor[EPXC_MAX_TOPK];
      int m;
      if (!s.expert_layout) {
        const int64_t n = plan->tok_base[src_rank] + bit_rank(bits, pre, t);
        m = 1;
        dst[0] = row_at_mut(a.recv_x, a.recv_dtype, n, H);
        dscale[0] = fp8 ? a.recv_scales + n * blocks : NULL;
        factor[0] = 1.0f;
        if (lane < K) {
          int e = src->idx[t * K + lane];
          bool here = e >= 0 && e / L == me;
          if (a.recv_topk_idx) a.recv_topk_idx[n * K + lane] = here ? e % L : -1;
          if (a.recv_topk_weights) a.recv_topk_weights[n * K + lane] = here ? src->weight[t * K + lane] : 0.0f;
        }
      } else {
        m = expert_rows(&s, plan, src_rank, src, t, &a, dst, dscale, factor);
      }
      if (raw)
        copy_row_raw(in, dst, m, (int64_t)recv_row_bytes);
      else
        convert_row(in, a.x_dtype, a.recv_dtype, H, dst, dscale, factor, a.scale_by_probs && s.expert_layout, m);
    }
  }
}

extern "C" int epxc_dispatch(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                             const epxc_dispatch_t *a, void *stream) {
  dispatch_kernel<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *a);
  return (int)cudaGetLastError();
}

/* ---- combine ---------------------------------------------------------------------------- */

/* Expert layout, on the destination: partial[n] = round(sum over local experts ascending of
 * w * y[row]), one per arrived token. */
static __global__ void __launch_bounds__(EPXC_THREADS) partials_kernel(epxc_shape_t s, epxc_group_t g,
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
  for (int src_rank = 0; src_rank < R; src_rank++) {
    const epxc_peer_t *src = &plan->peer[src_rank];
    const int64_t T = src->num_tokens, W = src->words;
    const uint32_t *bits = src->rank_bits + (int64_t)me * W;
    const int32_t *pre = src->rank_pre + (int64_t)me * W;
    for (int64_t t = warp_global(); t < T; t += warp_count()) {
      if (!bit_set(bits, t)) continue;
      const int64_t n = plan->tok_base[src_rank] + bit_rank(bits, pre, t);
      partial_of_token(&s, plan, src_rank, src, t, &a, row_at_mut(a.partials, a.y_dtype, n, H));
    }
  }
}

extern "C" int epxc_combine_partials(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                                     const epxc_combine_t *a, void *stream) {
  partials_kernel<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *a);
  return (int)cudaGetLastError();
}

/* On the source: out[t] = round(sum over destinations d ascending of rows_d[row of t on d]),
 * where rows_d is d's y (token layout) or d's partials (expert layout), as d published them in
 * the combine exchange (or this rank's staged copy of them, all-to-all). */
static __global__ void __launch_bounds__(EPXC_THREADS) reduce_kernel(epxc_shape_t s, epxc_group_t g,
                                                                    const epxc_plan_t *plan, epxc_combine_t a) {
  if (plan_void(&g, plan)) return;
  const int R = s.nranks, H = s.hidden;
  const int64_t T = plan->num_tokens, W = plan->words;
  for (int64_t t = warp_global(); t < T; t += warp_count()) {
    const void *rows[EPX_MAX_RANKS];
    int m = 0;
    for (int d = 0; d < R; d++) {
      const uint32_t *bits = plan->rank_bits + (int64_t)d * W;
      if (!bit_set(bits, t)) continue;
      const int64_t rank = bit_rank(bits, plan->rank_pre + (int64_t)d * W, t);
      rows[m++] = a.staged ? row_at(a.staged, a.y_dtype, plan->send_base[d] + rank, H)
                           : row_at(peer_ptr(&g, d, posted(&g, d)->combine.rows), a.y_dtype, plan->dest_base[d] + rank, H);
    }
    reduce_rows(rows, NULL, m, a.y_dtype, row_at_mut(a.out, a.out_dtype, t, H), a.out_dtype, H);
    slot_weight_grad(&s, &g, plan, t, a.topk_weight_grad);
  }
}

extern "C" int epxc_combine_reduce(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                                   const epxc_combine_t *a, void *stream) {
  reduce_kernel<<<s->num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*s, *g, plan_dev, *a);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_ht(size_t *stack) {
  const void *const kernels[] = {
      (const void *)dispatch_kernel, (const void *)partials_kernel, (const void *)reduce_kernel};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}
