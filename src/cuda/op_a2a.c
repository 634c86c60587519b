/* The all-to-all baseline's host side: the source permutes its tokens into a send buffer,
 * every destination pulls whole chunks and (expert layout) sorts them (a2a.cu); combine pulls
 * the chunks back whole before summing. Notify and the closing exchanges are the framed ones
 * (op_framed.c). */
#include "cuda/backend.h"


/* The all-to-all baseline's send and staging buffers, sized for this dispatch. */
static epx_status_t ensure_a2a(epx_comm_t *c, cuda_handle_t *ch, const epx_dispatch_args_t *a, bool expert,
                               cudaStream_t st) {
  const int64_t H = c->cfg.hidden, blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const size_t row = (size_t)H * epx_dtype_size(a->recv_dtype);
  /* a row per (token, expert) at most, in either layout */
  const int64_t send_rows = (ch->num_tokens > 0 ? ch->num_tokens : 1) * c->cfg.topk;
  char *at = NULL;
  carve(&at, row * send_rows), carve(&at, sizeof(float) * blocks * send_rows), carve(&at, sizeof(int32_t) * send_rows);
  carve(&at, sizeof(float) * send_rows);
  EPX_CHECK(ensure_bytes(CC(c), ch, st, &ch->a2a.send_x, &ch->a2a_send_bytes, (size_t)(uintptr_t)at,
                         "all-to-all send buffer"));
  char *base = ch->a2a.send_x;
  carve(&base, row * send_rows);
  ch->a2a.send_scales = (float *)carve(&base, sizeof(float) * blocks * send_rows);
  ch->a2a.send_token = (int32_t *)carve(&base, sizeof(int32_t) * send_rows);
  ch->a2a.send_weight = (float *)carve(&base, sizeof(float) * send_rows);
  if (!expert) return EPX_SUCCESS;
  const int64_t stage_rows = a->recv_capacity > 0 ? a->recv_capacity : 1;
  at = NULL;
  carve(&at, row * stage_rows), carve(&at, sizeof(float) * blocks * stage_rows), carve(&at, sizeof(float) * stage_rows);
  EPX_CHECK(ensure_bytes(CC(c), ch, st, &ch->a2a.stage_x, &ch->a2a_stage_bytes, (size_t)(uintptr_t)at,
                         "all-to-all staging buffer"));
  base = ch->a2a.stage_x;
  carve(&base, row * stage_rows);
  ch->a2a.stage_scales = (float *)carve(&base, sizeof(float) * blocks * stage_rows);
  ch->a2a.stage_weight = (float *)carve(&base, sizeof(float) * stage_rows);
  return EPX_SUCCESS;
}

static epx_status_t a2a_dispatch(epx_comm_t *c, epx_handle_t *h, const epx_dispatch_args_t *a, const epxc_shape_t *s,
                                 epxc_dispatch_t *d, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  ch->recv_capacity = a->recv_capacity;
  /* permute here, then every destination pulls whole chunks (and sorts them) */
  epx_status_t grown = ensure_a2a(c, ch, a, s->expert_layout, st);
  if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_DISPATCH, grown);
  const epxc_a2a_t *b = &ch->a2a;
  epxc_words_t words = {{0}};
  words.a2a_dispatch.send_x = (uint64_t)(uintptr_t)b->send_x;
  words.a2a_dispatch.send_scales = (uint64_t)(uintptr_t)b->send_scales;
  words.a2a_dispatch.send_token = (uint64_t)(uintptr_t)b->send_token;
  words.a2a_dispatch.send_weight = (uint64_t)(uintptr_t)b->send_weight;
  LAUNCH_TRY(epxc_a2a_permute(s, &cc->group, ch->dev, b, d, st), "all-to-all permute");
  const epxc_stamp_t stamp = stamp_of(c);
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, &words, NULL, &stamp, st), "dispatch exchange");
  LAUNCH_TRY(epxc_a2a_gather(s, &cc->group, ch->dev, b, d, st), "all-to-all gather");
  return framed_dispatch_close(c, ch, a, st);
}

static epx_status_t a2a_combine(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a, const epxc_shape_t *s,
                                epxc_combine_t *k, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  const size_t back = (size_t)(ch->num_tokens > 0 ? ch->num_tokens : 1) * c->cfg.topk * c->cfg.hidden *
                      epx_dtype_size(a->y_dtype);
  epx_status_t grown =
      ensure_bytes(cc, ch, st, &ch->a2a_back, &ch->a2a_back_bytes, back, "all-to-all combine buffer");
  if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
  k->staged = ch->a2a_back;
  EPX_CHECK(framed_combine_open(c, h, a, s, k, st));
  /* the rows for this rank's tokens come back whole */
  LAUNCH_TRY(epxc_a2a_pull_back(s, &cc->group, ch->dev, k, st), "all-to-all pull back");
  return framed_combine_close(c, ch, s, k, st);
}

const cuda_algo_t epxc_algo_a2a = {
    .name = "all-to-all",
    .notify = framed_notify,
    .dispatch = a2a_dispatch,
    .combine = a2a_combine,
    .abort = framed_abort,
};
