/* The low-latency algorithm's host side: every buffer made with the handle, notify only
 * records the routing, and dispatch and combine are one launch each (ll.cu), in two halves
 * when the caller asks (EPX_PART_SEND, then EPX_PART_COMPLETE with the same arguments). */
#include "cuda/backend.h"

/* Low-latency handles have every buffer at its final size from the start: two plans for
 * max_tokens_per_rank tokens, staging and partials for any element type (and, across
 * processes, the row weight gradients peers read). */
static epx_status_t ll_create(const epx_comm_t *c, cuda_handle_t *ch, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  const int64_t T = c->cfg.max_tokens_per_rank > 0 ? c->cfg.max_tokens_per_rank : 1, H = c->cfg.hidden;
  const int64_t blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK, R = c->nranks, L = c->num_local_experts;
  const char *what = "low-latency buffers";
  for (int i = 0; i < 2; i++) {
    EPX_CHECK(plan_arrays(c, &ch->ll_plan[i], T, st));
    EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.plan[i], sizeof(epxc_plan_t), st, what));
    CUDA_TRY(cudaMemcpyAsync(ch->ll.plan[i], &ch->ll_plan[i], sizeof(epxc_plan_t), cudaMemcpyHostToDevice, st), what);
    EPX_CHECK(dev_alloc(cc, &ch->ll.stage[i], sizeof(float) * T * H, st, what));
    EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.stage_scales[i], sizeof(float) * T * blocks, st, what));
    EPX_CHECK(dev_alloc(cc, &ch->ll.partials[i], sizeof(float) * R * T * H, st, what));
    if (!cc->transport->caller_memory)
      EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.wgrad[i], sizeof(float) * L * R * T, st, what));
  }
  EPX_CHECK(dev_alloc(cc, (void **)&ch->ll_dev, sizeof(epxc_ll_t), st, what));
  CUDA_TRY(cudaMemcpyAsync(ch->ll_dev, &ch->ll, sizeof(epxc_ll_t), cudaMemcpyHostToDevice, st), what);
  CUDA_TRY(wait_stream(c, st), what); /* the uploads read ch's memory */
  return EPX_SUCCESS;
}

/* Planned inside the dispatch that follows, in the same launch. */
static epx_status_t ll_notify(epx_comm_t *c, epx_handle_t *h, const epx_routing_t *r) {
  cuda_handle_t *ch = h->impl;
  cudaStream_t st;
  EPX_CHECK(op_begin(c, ch, &st));
  ch->known = false;
  ch->num_tokens = r->num_tokens;
  ch->ll_route = *r;
  ch->ll_route_pending = true;
  return EPX_SUCCESS;
}

static epx_status_t ll_dispatch(epx_comm_t *c, epx_handle_t *h, const epx_dispatch_args_t *a, const epxc_shape_t *s,
                                epxc_dispatch_t *d, cudaStream_t st) {
  (void)a;
  cuda_handle_t *ch = h->impl;
  ch->recv_capacity = (int64_t)c->nranks * c->cfg.max_tokens_per_rank;
  /* the recorded routing, or (a replay) the last plan's own copy of it */
  const epxc_route_t route = ch->ll_route_pending ? route_of(&ch->ll_route)
                                                  : (epxc_route_t){.num_tokens = ch->num_tokens, .replay = 1};
  ch->ll_route_pending = false;
  ch->ll_dispatched = true;
  ch->ll_send_dispatch = *d;
  const epxc_stamp_t stamp = stamp_of(c);
  LAUNCH_TRY(epxc_ll_dispatch(s, &CC(c)->group, ch->ll_dev, &route, d, &stamp, st), "low-latency dispatch");
  return EPX_SUCCESS;
}

/* COMPLETE: what the SEND half left, with its arguments. */
static epx_status_t ll_dispatch_complete(epx_comm_t *c, epx_handle_t *h, const epxc_shape_t *s, cudaStream_t st) {
  cuda_handle_t *ch = h->impl;
  epxc_dispatch_t d = ch->ll_send_dispatch;
  d.part = EPX_PART_COMPLETE;
  epxc_route_t none = {.num_tokens = ch->num_tokens, .replay = 1};
  const epxc_stamp_t unposted = {{0}}; /* a COMPLETE waits on what its SEND posted */
  LAUNCH_TRY(epxc_ll_dispatch(s, &CC(c)->group, ch->ll_dev, &none, &d, &unposted, st), "low-latency dispatch");
  return EPX_SUCCESS;
}

static epx_status_t ll_combine(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a, const epxc_shape_t *s,
                               epxc_combine_t *k, cudaStream_t st) {
  (void)a;
  cuda_handle_t *ch = h->impl;
  if (!ch->ll_dispatched)
    return cuda_abort(c, h, EPXI_OP_COMBINE,
                      epxi_fail(EPX_ERR_INVALID_ARGUMENT, "low-latency combine on rank %d: no dispatch on this "
                                "handle to invert", c->rank));
  ch->ll_send_combine = *k;
  const epxc_stamp_t stamp = stamp_of(c);
  LAUNCH_TRY(epxc_ll_combine(s, &CC(c)->group, ch->ll_dev, k, &stamp, st), "low-latency combine");
  return EPX_SUCCESS;
}

static epx_status_t ll_combine_complete(epx_comm_t *c, epx_handle_t *h, const epxc_shape_t *s, cudaStream_t st) {
  cuda_handle_t *ch = h->impl;
  epxc_combine_t k = ch->ll_send_combine;
  k.part = EPX_PART_COMPLETE;
  const epxc_stamp_t unposted = {{0}}; /* a COMPLETE waits on what its SEND posted */
  LAUNCH_TRY(epxc_ll_combine(s, &CC(c)->group, ch->ll_dev, &k, &unposted, st), "low-latency combine");
  return EPX_SUCCESS;
}

/* One exchange per operation, none in notify: post this rank's status in it (h may be NULL:
 * the call has no usable handle). */
static epx_status_t ll_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status, cudaStream_t st) {
  epxc_words_t words = {{0}};
  words.status = (uint64_t)(uint32_t)status;
  const epxc_stamp_t stamp = stamp_of(c);
  if (op != EPXI_OP_NOTIFY)
    LAUNCH_TRY(epxc_exchange(&CC(c)->group, op == EPXI_OP_COMBINE ? EPXC_PH_LL_COMBINE : EPXC_PH_LL_DISPATCH, &words,
                             NULL, &stamp, st),
               "exchange");
  if (h && (op == EPXI_OP_DISPATCH || op == EPXI_OP_NOTIFY_DISPATCH)) ch_of(h)->ll_dispatched = false;
  forget_own_report(c, status, st);
  return status;
}

const cuda_algo_t epxc_algo_ll = {
    .name = "low-latency",
    .create = ll_create,
    .notify = ll_notify,
    .dispatch = ll_dispatch,
    .dispatch_complete = ll_dispatch_complete,
    .combine = ll_combine,
    .combine_complete = ll_combine_complete,
    .abort = ll_abort,
};
