/* Handles and the backend's entry points: each operation does what every algorithm does
 * first (device, stream, the checks that need the handle), then goes to the handle's
 * algorithm (op_ht.c, op_a2a.c, op_ll.c). */
#include <stdlib.h>
#include <string.h>

#include "cuda/backend.h"

static const cuda_algo_t *algo_of(epx_algo_t algo) {
  return algo == EPX_ALGO_LL ? &epxc_algo_ll : algo == EPX_ALGO_ALLTOALL ? &epxc_algo_a2a : &epxc_algo_ht;
}

/* ---- handles ------------------------------------------------------------------------------ */

/* Handles are made while peers may already wait on this rank in an exchange: nothing here may
 * synchronise the device, so every buffer is carved from the comm's arena. */
static epx_status_t handle_make(epx_handle_t *h) {
  cuda_handle_t *ch = calloc(1, sizeof *ch);
  const epx_comm_t *c = h->comm;
  cuda_comm_t *cc = CC(c);
  const int L = c->num_local_experts, R = c->nranks, E = c->cfg.num_experts;
  if (ch) ch->summary = calloc(1, sizeof *ch->summary);
  if (ch) ch->pairs_local_host = calloc(L, sizeof(int32_t));
  if (ch) ch->algo = algo_of(h->hc.algo);
  h->impl = ch;
  if (!ch || !ch->summary || !ch->pairs_local_host) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda handle");
  cudaStream_t st = stream_of(c);
  const char *what = "handle buffers";
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  EPX_CHECK(dev_alloc(cc, (void **)&ch->dev, sizeof(epxc_plan_t), st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->host.pair_base, sizeof(int64_t) * L * R, st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->host.kept, sizeof(int32_t) * L * R, st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->host.block, sizeof(int64_t) * (L + 1), st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->host.pairs_local, sizeof(int32_t) * L, st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->host.counts, sizeof(int32_t) * (R + E), st, what));
  EPX_CHECK(dev_alloc(cc, (void **)&ch->host.pair_send_base, sizeof(int64_t) * (E + 1), st, what));
  CUDA_TRY(cudaMemsetAsync(ch->dev, 0, sizeof(epxc_plan_t), st), what);
  if (ch->algo->create) EPX_CHECK(ch->algo->create(h, ch, st));
  return EPX_SUCCESS;
}

static void cuda_handle_destroy(epx_handle_t *h);

/* A handle that could not be made gives back what it took of the arena. */
static epx_status_t cuda_handle_create(epx_handle_t *h) {
  const epx_status_t s = handle_make(h);
  if (s != EPX_SUCCESS) {
    cuda_handle_destroy(h);
    h->impl = NULL;
  }
  return s;
}

static void cuda_handle_destroy(epx_handle_t *h) {
  cuda_handle_t *ch = h->impl;
  if (!ch) return;
  cuda_comm_t *cc = CC(h->comm);
  cudaStream_t st = stream_of(h->comm);
  cudaSetDevice(cc->device);
  /* arena memory is reused at once: nothing queued may still use it (nor the peers reading
   * it, which the closing exchange of an operation already waited for) */
  wait_stream(h->comm, st);
  if (cc->last_stream && cc->last_stream != st) wait_stream(h->comm, cc->last_stream);
  void *bufs[] = {ch->dev, ch->host.pair_base, ch->host.kept, ch->host.block, ch->host.pairs_local,
                  ch->host.counts, ch->host.idx, ch->host.weight, ch->host.rank_bits, ch->host.rank_pre, ch->host.exp_bits, ch->host.exp_pre,
                  ch->host.pair_send_base, ch->scan, ch->partials, ch->a2a.send_x, ch->a2a.stage_x, ch->a2a_back,
                  ch->ipc_x, ch->ipc_wgrad};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) dev_free(cc, bufs[i]);
  if (ch->algo && ch->algo->destroy) ch->algo->destroy(h, ch, st);
  free(ch->summary);
  free(ch->pairs_local_host);
  free(ch);
}


_Static_assert(sizeof(epxi_stamp_t) == sizeof(epxc_stamp_t), "a stamp crosses word for word");

epxc_stamp_t stamp_of(const epx_comm_t *c) {
  epxi_stamp_t s = c->stamp;
  s.status = 0; /* the payload's status word carries it: the stamps of a failing rank and its peers still agree */
  epxc_stamp_t w;
  memcpy(&w, &s, sizeof w);
  return w;
}

epxc_route_t route_of(const epx_routing_t *r) {
  return (epxc_route_t){.num_tokens = r->num_tokens, .topk_idx = r->topk_idx, .idx_dtype = r->idx_dtype,
                        .topk_weights = r->topk_idx ? r->topk_weights : NULL,
                        .routing_map = r->topk_idx ? NULL : r->routing_map,
                        .probs = r->topk_idx ? NULL : r->probs};
}

epxc_shape_t shape_of(const epx_comm_t *c, const epx_handle_t *h) {
  epxc_shape_t s = CC(c)->shape;
  s.align = h->hc.align;
  s.recv_budget = h->hc.recv_budget;
  s.ll = h->hc.algo == EPX_ALGO_LL;
  s.expert_layout = h->hc.layout == EPX_LAYOUT_EXPERT;
  return s;
}

static epx_status_t cuda_get_layout(epx_comm_t *c, const epx_routing_t *r, int32_t *tokens_per_rank,
                                    int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  LAUNCH_TRY(epxc_layout(&CC(c)->shape, &CC(c)->group, r->num_tokens, r->topk_idx, r->idx_dtype, r->topk_idx ? NULL : r->routing_map,
                         tokens_per_rank, tokens_per_expert, is_token_in_rank, op_stream(c)),
             "layout kernel");
  return EPX_SUCCESS;
}

/* What notify, dispatch and combine start with: the rank's device, and the stream the operation
 * runs on, noting whether a graph captures it (the handle's buffers must not move then: grow). */
epx_status_t op_begin(epx_comm_t *c, cuda_handle_t *ch, cudaStream_t *st) {
  *st = op_stream(c);
  ch->captured |= capturing(*st);
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  return EPX_SUCCESS;
}

/* What every collective call on a handle notes for a later refusal without one (cuda_abort):
 * the handle's algorithm and mode, and a SEND half's call number. */
static void note_call(epx_comm_t *c, const epx_handle_t *h) {
  cuda_comm_t *cc = CC(c);
  if (h) {
    cc->last_algo = ch_of(h)->algo;
    cc->last_sync_free = !h->hc.exact;
  }
  if (epxi_stamp_part(&c->stamp) == EPX_PART_SEND) cc->last_send = c->stamp.call;
}

static epx_status_t cuda_notify(epx_comm_t *c, epx_handle_t *h, const epx_routing_t *r) {
  note_call(c, h);
  return ch_of(h)->algo->notify(c, h, r);
}

static epx_status_t cuda_handle_info(const epx_handle_t *h, epx_handle_info_t *info, int32_t *per_expert) {
  const cuda_handle_t *ch = h->impl;
  if (!ch->known)
    return epxi_fail(EPX_ERR_UNSUPPORTED,
                     "the handle's sizes live on the device (sync-free or low-latency mode): read them from the "
                     "dispatch's outputs, or create the handle with exact = 1");
  info->num_send_tokens = ch->summary->num_tokens;
  info->num_recv_tokens = ch->summary->num_recv;
  info->num_recv_rows = ch->summary->num_rows;
  info->num_recv_pairs = ch->summary->num_pairs;
  info->num_sent_copies = ch->summary->sent_copies;
  if (per_expert) memcpy(per_expert, ch->pairs_local_host, sizeof(int32_t) * h->comm->num_local_experts);
  return EPX_SUCCESS;
}

/* ---- dispatch and combine ------------------------------------------------------------------ */

/* Where a dispatch or combine runs: its stream (op_begin) and the handle's shape. */
typedef struct {
  cudaStream_t st;
  epxc_shape_t s;
} op_place_t;

static epx_status_t op_place(epx_comm_t *c, epx_handle_t *h, op_place_t *at) {
  EPX_CHECK(op_begin(c, ch_of(h), &at->st));
  at->s = shape_of(c, h);
  return EPX_SUCCESS;
}

static epx_status_t cuda_dispatch(epx_comm_t *c, epx_handle_t *h, const epx_dispatch_args_t *a) {
  cuda_handle_t *ch = h->impl;
  note_call(c, h);
  op_place_t at;
  EPX_CHECK(op_place(c, h, &at));
  epxc_dispatch_t d = {.x = a->x, .x_dtype = a->x_dtype, .recv_dtype = a->recv_dtype, .recv_x = a->recv_x,
                       .recv_scales = a->recv_scales, .recv_capacity = a->recv_capacity,
                       .recv_topk_idx = a->recv_topk_idx, .recv_topk_weights = a->recv_topk_weights,
                       .recv_probs = a->recv_probs, .tokens_per_local_expert = a->tokens_per_local_expert,
                       .num_recv_rows = a->num_recv_rows, .dropped = a->dropped, .scale_by_probs = a->scale_by_probs};
  d.report_capacity = !ch->known;
  d.part = a->part;
  if (a->part == EPX_PART_COMPLETE) /* SEND did it all, or (low-latency) left the rest */
    return ch->algo->dispatch_complete ? ch->algo->dispatch_complete(c, h, &at.s, at.st) : EPX_SUCCESS;
  if (!a->x && ch->num_tokens > 0)
    return cuda_abort(c, h, EPXI_OP_DISPATCH,
                      epxi_fail(EPX_ERR_NULL_POINTER, "dispatch on rank %d: x is NULL with %lld tokens", c->rank,
                                (long long)ch->num_tokens));
  return ch->algo->dispatch(c, h, a, &at.s, &d, at.st);
}

static epx_status_t cuda_combine(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a) {
  cuda_handle_t *ch = h->impl;
  note_call(c, h);
  op_place_t at;
  EPX_CHECK(op_place(c, h, &at));
  epxc_combine_t k = {.y = a->y, .y_dtype = a->y_dtype, .out = a->out, .out_dtype = a->out_dtype,
                      .weighted = a->weighted, .row_probs = a->row_probs, .row_weight_grad = a->row_weight_grad,
                      .topk_weight_grad = a->topk_weight_grad};
  k.part = a->part;
  if (a->part == EPX_PART_COMPLETE) /* SEND did it all, or (low-latency) left the rest */
    return ch->algo->combine_complete ? ch->algo->combine_complete(c, h, &at.s, at.st) : EPX_SUCCESS;
  if ((!a->out && ch->num_tokens > 0) || !a->y)
    return cuda_abort(c, h, EPXI_OP_COMBINE,
                      epxi_fail(EPX_ERR_NULL_POINTER, "combine on rank %d: %s is NULL", c->rank, a->y ? "out" : "y"));
  return ch->algo->combine(c, h, a, &at.s, &k, at.st);
}

/* Takes part in `op` as far as the peers need, as the handle's algorithm frames it. Without
 * a usable handle (NULL, another comm's, destroyed: h is NULL) this rank cannot know the
 * peers' algorithm: it takes part as the comm's last handle did (high-throughput and exact
 * before any), which is right whenever the ranks keep to one algorithm, and when it is not,
 * the first exchange's phase tags differ and every rank stops with EPX_ERR_OUT_OF_STEP at
 * once. A refused COMPLETE half right after this rank's SEND (made, or refused itself: then
 * that refusal already reached the peers in the SEND's exchange) takes part in nothing: on
 * this backend a COMPLETE makes no exchange of its own (it waits on its SEND's, or its SEND
 * did everything). Any other refused COMPLETE meets the peers where they are, in a SEND this
 * rank did not make or in another call: as the operation's first exchange. */
epx_status_t cuda_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status) {
  cuda_comm_t *cc = CC(c);
  const epx_part_t part = epxi_stamp_part(&c->stamp);
  if (part == EPX_PART_COMPLETE && cc->last_send && cc->last_send + 1 == c->stamp.call) return status;
  note_call(c, h);
  cudaStream_t st = op_stream(c);
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  const cuda_algo_t *algo = h ? ch_of(h)->algo : cc->last_algo ? cc->last_algo : &epxc_algo_ht;
  return algo->abort(c, h, op, status, st);
}

const epxi_backend_t epxi_cuda_backend = {
    .name = "cuda",
    .world_create = cuda_world_create,
    .world_destroy = cuda_world_destroy,
    .comm_init = cuda_comm_init,
    .comm_destroy = cuda_comm_destroy,
    .handle_create = cuda_handle_create,
    .handle_destroy = cuda_handle_destroy,
    .get_layout = cuda_get_layout,
    .notify = cuda_notify,
    .handle_info = cuda_handle_info,
    .dispatch = cuda_dispatch,
    .combine = cuda_combine,
    .poll = cuda_poll,
    .synchronize = cuda_synchronize,
    .abort = cuda_abort,
    .comm_abort = cuda_comm_abort,
    .async_error = cuda_async_error,
    .stamped = true,
    .recv_budget = true,
};
