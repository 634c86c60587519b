/* test_split: an operation issued as SEND then COMPLETE gives the bits of the whole
 * operation (the host backend does all its work in SEND), COMPLETE reuses what SEND was
 * given (its own arguments are not read), and calls out of order are refused without harm. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { R = 3, E = 12, K = 3, H = 32 };

typedef struct {
  tu_world_t w;
  tu_moe_t m;
  void *out_whole[R], *out_split[R], *out_after[R];
  int refusals[R];
  epx_status_t st[R];
} split_t;

/* dispatch + identity expert + combine on one handle, whole or in halves */
static epx_status_t layer(epx_comm_t *comm, epx_handle_t *h, const epx_routing_t *rt, const void *x, void *out, int halves) {
  const int64_t cap = (int64_t)R * 64 * K;
  float *recv = calloc((size_t)cap * H, sizeof(float)), *probs = calloc((size_t)cap, sizeof(float));
  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = x, d.x_dtype = d.recv_dtype = EPX_FLOAT32, d.recv_x = recv, d.recv_capacity = cap, d.recv_probs = probs;
  d.part = halves ? EPX_PART_SEND : EPX_PART_ALL;
  epx_status_t s = epx_dispatch(comm, h, rt, &d);
  epx_dispatch_args_t complete; /* COMPLETE reads only its part */
  epx_dispatch_args_init(&complete);
  complete.part = EPX_PART_COMPLETE;
  if (s == EPX_SUCCESS && halves) s = epx_dispatch(comm, h, NULL, &complete);
  epx_combine_args_t c;
  epx_combine_args_init(&c);
  c.y = recv, c.y_dtype = c.out_dtype = EPX_FLOAT32, c.out = out;
  c.part = halves ? EPX_PART_SEND : EPX_PART_ALL;
  if (s == EPX_SUCCESS) s = epx_combine(comm, h, &c);
  epx_combine_args_t ccomplete;
  epx_combine_args_init(&ccomplete);
  ccomplete.part = EPX_PART_COMPLETE;
  if (s == EPX_SUCCESS && halves) s = epx_combine(comm, h, &ccomplete);
  free(recv);
  free(probs);
  return s;
}

/* Between a SEND and its COMPLETE nothing else may run, and a COMPLETE needs its SEND:
 * refused locally on every rank alike, the outstanding SEND unharmed. */
static int order_refusals(epx_comm_t *comm, epx_handle_t *h, const epx_routing_t *rt, const void *x) {
  epx_combine_args_t c;
  epx_combine_args_init(&c);
  c.part = EPX_PART_COMPLETE;
  int refused = epx_combine(comm, h, &c) == EPX_ERR_INVALID_ARGUMENT; /* COMPLETE with no SEND */
  const int64_t cap = (int64_t)R * 64 * K;
  float *recv = calloc((size_t)cap * H, sizeof(float));
  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = x, d.x_dtype = d.recv_dtype = EPX_FLOAT32, d.recv_x = recv, d.recv_capacity = cap;
  d.part = EPX_PART_SEND;
  int sent = epx_dispatch(comm, h, rt, &d) == EPX_SUCCESS;
  refused += epx_notify(comm, h, rt) == EPX_ERR_INVALID_ARGUMENT;         /* another op in between */
  epx_combine_args_init(&c);
  c.y = recv, c.y_dtype = c.out_dtype = EPX_FLOAT32, c.out = recv;
  refused += epx_combine(comm, h, &c) == EPX_ERR_INVALID_ARGUMENT;        /* not the half pending */
  d.part = EPX_PART_COMPLETE;
  int completed = epx_dispatch(comm, h, NULL, &d) == EPX_SUCCESS;
  free(recv);
  return sent && completed ? refused : -1;
}

static epx_status_t rank_main(int r, void *arg) {
  split_t *t = arg;
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 4);
  epx_handle_t *h = NULL;
  epx_status_t s = epx_handle_create(t->w.comm[r], &hc, &h);
  epx_routing_t rt = tu_routing(&t->m, r, TU_FORM_TOPK32);
  if (s == EPX_SUCCESS) s = layer(t->w.comm[r], h, &rt, t->m.x[r], t->out_whole[r], 0);
  if (s == EPX_SUCCESS) s = layer(t->w.comm[r], h, &rt, t->m.x[r], t->out_split[r], 1);
  if (s == EPX_SUCCESS) t->refusals[r] = order_refusals(t->w.comm[r], h, &rt, t->m.x[r]);
  if (s == EPX_SUCCESS) s = layer(t->w.comm[r], h, &rt, t->m.x[r], t->out_after[r], 1); /* still works */
  epx_handle_destroy(h);
  t->st[r] = s;
  return s;
}

int main(void) {
  tu_begin("test_split");
  static split_t t;
  int64_t T[TU_MAX_RANKS] = {40, 0, 64};
  tu_route_opts_t o = tu_route_default();
  tu_moe_random(&t.m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
  epx_config_t cfg = tu_config(E, H, K, 64);
  CHECK_STATUS(tu_world_create(&t.w, R, &cfg, NULL, NULL), EPX_SUCCESS, "world");
  for (int r = 0; r < R; r++) {
    t.out_whole[r] = tu_alloc_poison(sizeof(float) * (size_t)(T[r] * H + 1));
    t.out_split[r] = tu_alloc_poison(sizeof(float) * (size_t)(T[r] * H + 1));
    t.out_after[r] = tu_alloc_poison(sizeof(float) * (size_t)(T[r] * H + 1));
  }
  epx_run_ranks(R, rank_main, &t, NULL);
  for (int r = 0; r < R; r++) {
    CHECK_STATUS(t.st[r], EPX_SUCCESS, "rank %d", r);
    CHECK_BITS("SEND + COMPLETE against the whole operation", EPX_FLOAT32, t.out_split[r], t.out_whole[r], T[r] * H, H);
    CHECK(t.refusals[r] == 3, "rank %d: %d of 3 out-of-order calls refused (-1: the SEND/COMPLETE pair failed)", r,
          t.refusals[r]);
    CHECK_BITS("the layer after the refusals", EPX_FLOAT32, t.out_after[r], t.out_whole[r], T[r] * H, H);
    free(t.out_whole[r]);
    free(t.out_split[r]);
    free(t.out_after[r]);
  }
  tu_world_destroy(&t.w);
  tu_moe_free(&t.m);
  return tu_end();
}
