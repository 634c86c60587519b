/* What the exchange-framed algorithms (high-throughput, all-to-all) share. Notify builds this
 * rank's plan, meets the peers in one exchange (plan pointers, counts and statuses) and
 * derives the receive side; dispatch and combine each open with an exchange of what peers
 * pull and close with one that tells the peers this rank has finished reading theirs. */
#include <stdio.h>
#include <string.h>

#include "cuda/backend.h"

/* Send-side buffers sized for `cap` tokens. */
static epx_status_t ensure_tokens(epx_comm_t *c, cuda_handle_t *ch, int64_t cap, cudaStream_t st) {
  if (cap <= ch->token_cap && ch->host.idx) return EPX_SUCCESS;
  cap = cap < 32 ? 32 : cap;
  const int64_t W = (cap + 31) / 32, K = c->cfg.topk, R = c->nranks, E = c->cfg.num_experts;
  epxc_plan_t *p = &ch->host;
  cuda_comm_t *cc = CC(c);
  ch->token_cap = 0; /* until every buffer below has grown: a failure grows them all next time */
  EPX_CHECK(grow(cc, ch, st, (void **)&p->idx, sizeof(int32_t) * cap * K, "routing buffer"));
  EPX_CHECK(grow(cc, ch, st, (void **)&p->weight, sizeof(float) * cap * K, "weight buffer"));
  EPX_CHECK(grow(cc, ch, st, (void **)&p->rank_bits, sizeof(uint32_t) * R * W, "rank bitmap"));
  EPX_CHECK(grow(cc, ch, st, (void **)&p->rank_pre, sizeof(int32_t) * R * W, "rank prefix"));
  EPX_CHECK(grow(cc, ch, st, (void **)&p->exp_bits, sizeof(uint32_t) * E * W, "expert bitmap"));
  EPX_CHECK(grow(cc, ch, st, (void **)&p->exp_pre, sizeof(int32_t) * E * W, "expert prefix"));
  p->words = W;
  if (!ch->scan) { /* how notify's blocks meet: made once, zero but for an all-ones bad_key */
    const size_t bytes = epxc_scan_bytes(cc->shape.num_sms, (int)(R + E));
    EPX_CHECK(grow(cc, ch, st, (void **)&ch->scan, bytes, "notify scan"));
    CUDA_TRY(cudaMemsetAsync(ch->scan, 0, bytes, st), "notify scan");
    CUDA_TRY(cudaMemsetAsync(&ch->scan->bad_key, 0xff, sizeof ch->scan->bad_key, st), "notify scan");
  }
  ch->token_cap = cap;
  CUDA_TRY(cudaMemcpyAsync(ch->dev, p, sizeof *p, cudaMemcpyHostToDevice, st), "plan upload");
  /* the upload reads `p` when the stream gets there: keep it still until then */
  CUDA_TRY(wait_stream(c, st), "plan upload");
  return EPX_SUCCESS;
}

/* Exact sizes: wait for the counts, and fail on every rank alike when a routing was refused. */
static epx_status_t wait_counts(epx_comm_t *c, cuda_handle_t *ch, const epx_routing_t *r, cudaStream_t st) {
  plan_summary_t *sum = ch->summary;
  CUDA_TRY(cudaMemcpyAsync(&sum->status, &ch->dev->status, sizeof(int32_t) * 2, cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(&sum->bad_key, &ch->dev->bad_key, sizeof(uint64_t), cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(&sum->num_recv, &ch->dev->num_recv, sizeof(int64_t) * 4, cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(ch->pairs_local_host, ch->host.pairs_local, sizeof(int32_t) * c->num_local_experts,
                           cudaMemcpyDeviceToHost, st),
           "counts");
  CUDA_TRY(wait_stream(c, st), "cudaStreamSynchronize (notify)");
  sum->num_tokens = r->num_tokens;
  /* Every rank decides from the statuses the exchange agreed on; a recoverable record left
   * from an earlier call must not make this one fail on one rank only. */
  EPX_CHECK(report(c, false));
  /* the ranks' calls differ: the record names the field and the ranks (unless an earlier,
   * unreported record of this rank stands in its place) */
  if (sum->group_status == EPX_ERR_CONFIG_MISMATCH) {
    const epx_status_t s = report(c, true);
    if (s == EPX_ERR_CONFIG_MISMATCH) return s;
    char earlier[512];
    snprintf(earlier, sizeof earlier, "%s", epx_last_error());
    return epxi_fail(EPX_ERR_CONFIG_MISMATCH, "rank %d: notify: the ranks' calls differ in their settings or "
                     "arguments (this rank's record held an earlier failure: %s)", c->rank, earlier);
  }
  if (sum->group_status) {
    volatile epxc_error_t *e = &((cuda_world_t *)c->world->impl)->errors_host[c->rank];
    const int who = e->peer;
    if (!fatal_status(e->status)) e->status = 0;
    if (sum->status) { /* this rank's own routing: name the token */
      const uint64_t key = sum->bad_key;
      return epxi_fail((epx_status_t)sum->status, "rank %d: token %llu slot %u: %s", c->rank,
                       (unsigned long long)(key >> 16), (unsigned)((key >> 8) & 0xff),
                       epx_status_string((epx_status_t)sum->status));
    }
    return epxi_fail((epx_status_t)sum->group_status, "rank %d: notify: rank %d's routing was refused (%s)", c->rank,
                     who, epx_status_string((epx_status_t)sum->group_status));
  }
  ch->known = true;
  return EPX_SUCCESS;
}

epx_status_t framed_notify(epx_comm_t *c, epx_handle_t *h, const epx_routing_t *r) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  if (h->hc.exact && capturing(op_stream(c)))
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: an exact notify waits for the counts, which a CUDA graph "
                     "capture cannot: create the handle with exact = 0", c->rank);
  cudaStream_t st;
  EPX_CHECK(op_begin(c, ch, &st));
  ch->known = false;
  ch->num_tokens = r->num_tokens;
  epx_status_t grown = ensure_tokens(c, ch, r->num_tokens, st);
  if (grown != EPX_SUCCESS) return cuda_abort(c, h, h->dispatch_follows ? EPXI_OP_NOTIFY_DISPATCH : EPXI_OP_NOTIFY, grown);
  epxc_shape_t s = shape_of(c, h);
  const epxc_route_t route = route_of(r);
  const epxc_stamp_t stamp = stamp_of(c);
  LAUNCH_TRY(epxc_notify(&s, &cc->group, ch->dev, ch->scan, &route, &stamp, st), "notify kernel");
  if (!h->hc.exact) return EPX_SUCCESS;
  return wait_counts(c, ch, r, st);
}

/* The closing exchange of a dispatch; in exact mode the host already knows whether the rows fit. */
epx_status_t framed_dispatch_close(epx_comm_t *c, cuda_handle_t *ch, const epx_dispatch_args_t *a, cudaStream_t st) {
  LAUNCH_TRY(epxc_exchange(&CC(c)->group, EPXC_PH_DISPATCH_DONE, NULL, NULL, NULL, st), "dispatch closing exchange");
  if (ch->known && a->recv_capacity < ch->summary->num_rows)
    return epxi_fail(EPX_ERR_OUTPUT_TOO_SMALL, "dispatch on rank %d: %lld rows arrive but recv_capacity is %lld",
                     c->rank, (long long)ch->summary->num_rows, (long long)a->recv_capacity);
  return EPX_SUCCESS;
}

/* Everything up to the combine exchange: the rows peers pull back (and their weight
 * gradients) where peers reach them, then the exchange that publishes them. Buffers first: a
 * failure after the first exchange would leave the peers waiting. */
epx_status_t framed_combine_open(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a, const epxc_shape_t *sp,
                                 epxc_combine_t *kp, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  const epxc_shape_t s = *sp;
  epxc_combine_t k = *kp;
  /* What arrived here, as the host knows it, or at most what the last dispatch could write. */
  const int64_t recv_tokens = ch->known ? ch->summary->num_recv : ch->recv_capacity;
  const int64_t recv_rows = ch->known ? ch->summary->num_rows : ch->recv_capacity;
  const size_t row_bytes = (size_t)c->cfg.hidden * epx_dtype_size(a->y_dtype);
  const void *rows = a->y;
  if (s.expert_layout || !cc->transport->caller_memory) {
    /* The rows peers pull back, one per arrived token: the partials (expert layout), or across
     * processes y copied where the peers reach it (token layout). */
    const size_t bytes = (size_t)recv_tokens * row_bytes;
    if (!ch->partials || bytes > ch->partial_bytes) {
      epx_status_t grown = grow(cc, ch, st, &ch->partials, bytes, "combine partials");
      if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
      ch->partial_bytes = bytes;
    }
    k.partials = ch->partials;
    k.partial_rows = (int64_t)(ch->partial_bytes / row_bytes);
    rows = ch->partials;
  }
  /* Across processes the row weight gradients are copied too: [rows] or [tokens, K]. */
  const float *wgrad = a->row_weight_grad;
  const int64_t wgrad_rows = s.expert_layout ? recv_rows : recv_tokens, wgrad_row_bytes =
                             (int64_t)sizeof(float) * (s.expert_layout ? 1 : c->cfg.topk);
  if (!cc->transport->caller_memory && wgrad) {
    epx_status_t grown = ensure_bytes(cc, ch, st, (void **)&ch->ipc_wgrad, &ch->ipc_wgrad_bytes,
                                      (size_t)(wgrad_rows * wgrad_row_bytes), "combine weight gradient buffer");
    if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
  }
  if (s.expert_layout)
    LAUNCH_TRY(epxc_combine_partials(&s, &cc->group, ch->dev, &k, st), "combine partials");
  else if (!cc->transport->caller_memory)
    LAUNCH_TRY(epxc_stage_rows(&cc->group, ch->dev, EPXC_STAGE_RECV, a->y, ch->partials, (int64_t)row_bytes,
                               k.partial_rows, s.num_sms, st),
               "combine staging");
  if (!cc->transport->caller_memory && wgrad) {
    LAUNCH_TRY(epxc_stage_rows(&cc->group, ch->dev, s.expert_layout ? EPXC_STAGE_ROWS : EPXC_STAGE_RECV, wgrad,
                               ch->ipc_wgrad, wgrad_row_bytes, wgrad_rows, s.num_sms, st),
               "combine staging");
    wgrad = ch->ipc_wgrad;
  }
  epxc_words_t words = {{0}};
  words.combine.rows = (uint64_t)(uintptr_t)rows;
  words.combine.row_weight_grad = (uint64_t)(uintptr_t)wgrad;
  /* a rank whose dispatch wrote nothing makes every rank skip this combine */
  const epxc_stamp_t stamp = stamp_of(c);
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_COMBINE, &words, &ch->dev->refused, &stamp, st), "combine exchange");
  *kp = k;
  return EPX_SUCCESS;
}

/* Sums this rank's tokens from the rows the peers published, then the closing exchange. */
epx_status_t framed_combine_close(epx_comm_t *c, cuda_handle_t *ch, const epxc_shape_t *s, const epxc_combine_t *k,
                                  cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  LAUNCH_TRY(epxc_combine_reduce(s, &cc->group, ch->dev, k, st), "combine kernel");
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_COMBINE_DONE, NULL, NULL, NULL, st), "combine closing exchange");
  return EPX_SUCCESS;
}

/* The peers' operations are exchange-framed: post this rank's status in the opening exchange
 * (the peers then skip their work) and join the closing one, where there is one. A sync-free notify + dispatch
 * is two operations to the peers; an exact notify already stops them after the first.
 * Without a handle (h NULL) the peers' mode is taken to be the comm's last handle's. */
epx_status_t framed_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  enum { NONE = -1 }; /* notify has no closing exchange */
  static const int phases[][2] = {[EPXI_OP_NOTIFY] = {EPXC_PH_NOTIFY, NONE},
                                  [EPXI_OP_DISPATCH] = {EPXC_PH_DISPATCH, EPXC_PH_DISPATCH_DONE},
                                  [EPXI_OP_NOTIFY_DISPATCH] = {EPXC_PH_NOTIFY, NONE},
                                  [EPXI_OP_COMBINE] = {EPXC_PH_COMBINE, EPXC_PH_COMBINE_DONE}};
  epxc_words_t words = {{0}};
  words.status = (uint64_t)(uint32_t)status;
  const epxc_stamp_t stamp = stamp_of(c);
  LAUNCH_TRY(epxc_exchange(&cc->group, phases[op][0], &words, NULL, &stamp, st), "exchange");
  if (phases[op][1] != NONE) LAUNCH_TRY(epxc_exchange(&cc->group, phases[op][1], NULL, NULL, NULL, st), "exchange");
  const bool sync_free = h ? !h->hc.exact : cc->last_sync_free;
  if (op == EPXI_OP_NOTIFY_DISPATCH && sync_free) {
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, &words, NULL, &stamp, st), "exchange");
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH_DONE, NULL, NULL, NULL, st), "exchange");
  }
  forget_own_report(c, status, st);
  return status;
}
