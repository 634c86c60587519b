/* The low-latency algorithm's host side: every buffer made with the handle, notify only
 * records the routing, and dispatch and combine are one launch each (ll.cu), in two halves
 * when the caller asks (EPX_PART_SEND, then EPX_PART_COMPLETE with the same arguments). */
#include "cuda/backend.h"

/* Low-latency handles have every buffer at its final size from the start: per dispatch half
 * the normalised routing and what the combine needs of it, and the two inboxes peers push
 * into (cuda_shared.h, "The low-latency path"), which the comm's state then publishes under
 * the handle's id. Shapes whose routing bitmaps do not fit a block's shared memory are refused. */
static epx_status_t ll_create(const epx_handle_t *h, cuda_handle_t *ch, cudaStream_t st) {
  const epx_comm_t *c = h->comm;
  cuda_comm_t *cc = CC(c);
  const int64_t T = c->cfg.max_tokens_per_rank > 0 ? c->cfg.max_tokens_per_rank : 1, H = c->cfg.hidden;
  const int64_t R = c->nranks, L = c->num_local_experts, K = c->cfg.topk, W = (T + 31) / 32;
  const int E = c->cfg.num_experts;
  const char *what = "low-latency buffers";
  const size_t smem = epxc_ll_smem((int)R, E, T);
  if (smem > EPXC_LL_SMEM_MAX)
    return epxi_fail(EPX_ERR_UNSUPPORTED,
                     "low-latency handle: max_tokens_per_rank %lld with %d experts and %lld ranks needs %zu bytes of "
                     "routing bitmaps per block, more than the %d a block may take: use fewer tokens per step",
                     (long long)T, E, (long long)R, smem, EPXC_LL_SMEM_MAX);
  const int slot = (int)(h->id % EPXC_LL_INBOXES);
  if (cc->ll_inbox_key[slot])
    return epxi_fail(EPX_ERR_UNSUPPORTED,
                     "low-latency handle %llu: handle %llu still holds its inbox entry (ids equal modulo %d): at most "
                     "%d low-latency handles of a comm live at once, made in a row",
                     (unsigned long long)h->id, (unsigned long long)cc->ll_inbox_key[slot], EPXC_LL_INBOXES,
                     EPXC_LL_INBOXES);
  const epxc_ll_layout_t y = epxc_ll_layout((int)L, (int)K, T, (int)H);
  ch->ll.id = h->id;
  for (int i = 0; i < 2; i++) {
    EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.idx[i], sizeof(int32_t) * T * K, st, what));
    EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.weight[i], sizeof(float) * T * K, st, what));
    EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.rank_bits[i], sizeof(uint32_t) * R * W, st, what));
    EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.recv_base[i], sizeof(int32_t) * L * R, st, what));
  }
  EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.dispatch_inbox, 2 * R * y.region, st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.combine_inbox, 2 * R * y.combine_region, st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->ll.dev, sizeof(epxc_ll_t), st, what));
  CUDA_TRY(cudaMemsetAsync(ch->ll.dev, 0, sizeof(epxc_ll_t), st), what);
  epxc_ll_inbox_t entry = {.key = h->id,
                           .dispatch_inbox = (uint64_t)(uintptr_t)ch->ll.dispatch_inbox,
                           .combine_inbox = (uint64_t)(uintptr_t)ch->ll.combine_inbox};
  epxc_ll_shape_key((int)R, (int)L, (int)K, T, (int)H, entry.shape);
  ch->ll_entry = entry;
  CUDA_TRY(cudaMemcpyAsync(&cc->state->ll_inbox[slot], &ch->ll_entry, sizeof entry, cudaMemcpyHostToDevice, st), what);
  cc->ll_inbox_key[slot] = h->id;
  return EPX_SUCCESS;
}

/* The inbox entry goes first: a peer that still looks for it finds nothing, not freed memory.
 * A handle whose create stopped before it published its entry has none (the slot is free or
 * another handle's). */
static void ll_destroy(const epx_handle_t *h, cuda_handle_t *ch, cudaStream_t st) {
  cuda_comm_t *cc = CC(h->comm);
  const int slot = (int)(ch->ll.id % EPXC_LL_INBOXES);
  if (ch->ll.id && cc->ll_inbox_key[slot] == ch->ll.id) {
    cudaMemsetAsync(&cc->state->ll_inbox[slot], 0, sizeof(epxc_ll_inbox_t), st);
    wait_stream(h->comm, st);
    cc->ll_inbox_key[slot] = 0;
  }
  void *bufs[] = {ch->ll.dispatch_inbox, ch->ll.combine_inbox, ch->ll.dev};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) dev_free(cc, bufs[i]);
  for (int i = 0; i < 2; i++) {
    void *half[] = {ch->ll.idx[i], ch->ll.weight[i], ch->ll.rank_bits[i], ch->ll.recv_base[i]};
    for (size_t j = 0; j < sizeof half / sizeof *half; j++) dev_free(cc, half[j]);
  }
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
  LAUNCH_TRY(epxc_ll_dispatch(s, &CC(c)->group, &ch->ll, &route, d, &stamp, st), "low-latency dispatch");
  return EPX_SUCCESS;
}

/* COMPLETE: what the SEND half left, with its arguments. */
static epx_status_t ll_dispatch_complete(epx_comm_t *c, epx_handle_t *h, const epxc_shape_t *s, cudaStream_t st) {
  cuda_handle_t *ch = h->impl;
  epxc_dispatch_t d = ch->ll_send_dispatch;
  d.part = EPX_PART_COMPLETE;
  epxc_route_t none = {.num_tokens = ch->num_tokens, .replay = 1};
  const epxc_stamp_t unposted = {{0}}; /* a COMPLETE waits on what its SEND posted */
  LAUNCH_TRY(epxc_ll_dispatch(s, &CC(c)->group, &ch->ll, &none, &d, &unposted, st), "low-latency dispatch");
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
  LAUNCH_TRY(epxc_ll_combine(s, &CC(c)->group, &ch->ll, k, &stamp, st), "low-latency combine");
  return EPX_SUCCESS;
}

static epx_status_t ll_combine_complete(epx_comm_t *c, epx_handle_t *h, const epxc_shape_t *s, cudaStream_t st) {
  cuda_handle_t *ch = h->impl;
  epxc_combine_t k = ch->ll_send_combine;
  k.part = EPX_PART_COMPLETE;
  const epxc_stamp_t unposted = {{0}}; /* a COMPLETE waits on what its SEND posted */
  LAUNCH_TRY(epxc_ll_combine(s, &CC(c)->group, &ch->ll, &k, &unposted, st), "low-latency combine");
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
    .destroy = ll_destroy,
    .notify = ll_notify,
    .dispatch = ll_dispatch,
    .dispatch_complete = ll_dispatch_complete,
    .combine = ll_combine,
    .combine_complete = ll_combine_complete,
    .abort = ll_abort,
};
