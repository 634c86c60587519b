/* The high-throughput algorithm's host side: dispatch publishes where its x is and every
 * destination pulls its rows (ht.cu); combine publishes the rows peers pull back. Notify and
 * the closing exchanges are the framed ones (op_framed.c). */
#include "cuda/backend.h"

static epx_status_t ht_dispatch(epx_comm_t *c, epx_handle_t *h, const epx_dispatch_args_t *a, const epxc_shape_t *s,
                                epxc_dispatch_t *d, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  ch->recv_capacity = a->recv_capacity;
  const void *x = a->x;
  if (!cc->transport->caller_memory) { /* across processes peers reach x only in the arena */
    const size_t bytes = (size_t)ch->num_tokens * c->cfg.hidden * epx_dtype_size(a->x_dtype);
    epx_status_t grown = ensure_bytes(cc, ch, st, &ch->ipc_x, &ch->ipc_x_bytes, bytes, "dispatch staging buffer");
    if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_DISPATCH, grown);
    if (bytes) CUDA_TRY(cudaMemcpyAsync(ch->ipc_x, a->x, bytes, cudaMemcpyDeviceToDevice, st), "dispatch staging");
    x = ch->ipc_x;
  }
  epxc_words_t words = {{0}};
  words.ht_dispatch.x = (uint64_t)(uintptr_t)x;
  const epxc_stamp_t stamp = stamp_of(c);
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, &words, NULL, &stamp, st), "dispatch exchange");
  LAUNCH_TRY(epxc_dispatch(s, &cc->group, ch->dev, d, st), "dispatch kernel");
  return framed_dispatch_close(c, ch, a, st);
}

static epx_status_t ht_combine(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a, const epxc_shape_t *s,
                               epxc_combine_t *k, cudaStream_t st) {
  EPX_CHECK(framed_combine_open(c, h, a, s, k, st));
  return framed_combine_close(c, ch_of(h), s, k, st);
}

const cuda_algo_t epxc_algo_ht = {
    .name = "high-throughput",
    .notify = framed_notify,
    .dispatch = ht_dispatch,
    .combine = ht_combine,
    .abort = framed_abort,
};
