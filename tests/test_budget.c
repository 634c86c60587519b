/* test_budget: the expert layout's receive budget against the rule of docs/design.md, worked
 * out here from the routing alone (which pairs each destination keeps, where they land, what
 * combine and the weight gradients give back); and ranks passing different
 * max_tokens_per_rank (the group takes the largest). */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define R 3
#define L 2
#define E (R * L)
#define H 8
#define K 3

typedef struct {
  tu_world_t *w;
  const tu_moe_t *m;
  int align;
  int64_t budget[R];
  int64_t kept_row[R][64 * K]; /* per source token slot: its row on the destination, -1 dropped */
  int64_t rows[R];             /* rows in use on each destination */
  int64_t dropped;
  epx_status_t st[R];
} budget_case_t;

/* The rule, from the routing: destination d fills its experts in ascending order; expert l
 * keeps the first pairs (by source rank, then token) that fit whole aligned blocks. */
static void expected_cut(budget_case_t *c) {
  const tu_moe_t *m = c->m;
  c->dropped = 0;
  for (int s = 0; s < R; s++)
    for (int64_t i = 0; i < m->T[s] * K; i++) c->kept_row[s][i] = -1;
  for (int d = 0; d < R; d++) {
    int64_t used = 0;
    for (int l = 0; l < L; l++) {
      int64_t n = 0;
      for (int s = 0; s < R; s++)
        for (int64_t t = 0; t < m->T[s]; t++)
          for (int k = 0; k < K; k++) n += m->idx[s][t * K + k] == d * L + l;
      int64_t room = c->budget[d] ? (c->budget[d] - used > 0 ? (c->budget[d] - used) / c->align * c->align : 0) : n;
      int64_t keep = n < room ? n : room, j = 0;
      for (int s = 0; s < R; s++)
        for (int64_t t = 0; t < m->T[s]; t++)
          for (int k = 0; k < K; k++)
            if (m->idx[s][t * K + k] == d * L + l && j++ < keep) c->kept_row[s][t * K + k] = used + j - 1;
      c->dropped += n - keep;
      used += (keep + c->align - 1) / c->align * c->align;
    }
    c->rows[d] = used;
  }
}

/* One rank: dispatch under its budget, check its rows, then combine its rows straight back
 * with each row's number + 1 as its weight gradient. */
static epx_status_t rank_fn(int r, void *arg) {
  budget_case_t *c = arg;
  const tu_moe_t *m = c->m;
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_EXPERT, c->align);
  hc.recv_budget = c->budget[r];
  epx_handle_t *h = NULL;
  epx_status_t s = epx_handle_create(c->w->comm[r], &hc, &h);
  if (s != EPX_SUCCESS) return c->st[r] = s;
  const int64_t cap = c->rows[r] + 1;
  float *rx = calloc((size_t)cap * H, sizeof(float)), *probs = calloc((size_t)cap, sizeof(float));
  float *gw = calloc((size_t)cap, sizeof(float)), *out = calloc((size_t)m->T[r] * H + 1, sizeof(float));
  float *twg = calloc((size_t)m->T[r] * K + 1, sizeof(float));
  int32_t cnt[L], dropped = -1;
  int64_t nrows = -1;
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = m->x[r], a.x_dtype = EPX_FLOAT32, a.recv_dtype = EPX_FLOAT32, a.recv_x = rx, a.recv_capacity = cap;
  a.recv_probs = probs, a.tokens_per_local_expert = cnt, a.num_recv_rows = &nrows, a.dropped = &dropped;
  epx_routing_t rt = tu_routing(m, r, TU_FORM_TOPK32);
  s = epx_dispatch(c->w->comm[r], h, &rt, &a);
  if (s == EPX_SUCCESS) {
    CHECK(nrows == c->rows[r], "rank %d: %lld rows, want %lld", r, (long long)nrows, (long long)c->rows[r]);
    CHECK(dropped == c->dropped, "rank %d: dropped %d, want %lld", r, dropped, (long long)c->dropped);
    for (int64_t i = 0; i < cap; i++) gw[i] = (float)(i + 1);
    epx_combine_args_t ca;
    epx_combine_args_init(&ca);
    ca.y = rx, ca.y_dtype = EPX_FLOAT32, ca.out = out, ca.out_dtype = EPX_FLOAT32, ca.weighted = 0;
    ca.row_weight_grad = gw, ca.topk_weight_grad = twg;
    s = epx_combine(c->w->comm[r], h, &ca);
  }
  for (int64_t t = 0; s == EPX_SUCCESS && t < m->T[r]; t++) {
    int kept = 0; /* out[t] = x[t] once per kept pair (every partial is a sum of copies of x[t]) */
    for (int k = 0; k < K; k++) {
      int64_t row = c->kept_row[r][t * K + k];
      kept += row >= 0;
      CHECK(twg[t * K + k] == (row >= 0 ? (float)(row + 1) : 0.0f), "rank %d token %lld slot %d: weight grad %g", r,
            (long long)t, k, twg[t * K + k]);
    }
    for (int ch = 0; ch < H; ch++) {
      float x = ((const float *)m->x[r])[t * H + ch], want = 0.0f;
      for (int i = 0; i < kept; i++) want += x;
      CHECK(out[t * H + ch] == want, "rank %d token %lld: out %g, want %g", r, (long long)t, out[t * H + ch], want);
    }
  }
  free(rx), free(probs), free(gw), free(out), free(twg);
  epx_handle_destroy(h);
  return c->st[r] = s;
}

static void budget_run(int align, const int64_t *budget, int expect_drop) {
  int64_t T[R];
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 3, 64);
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
  epx_config_t cfg = tu_config(E, H, K, 64);
  tu_world_t w;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "world")) return;
  budget_case_t c = {.w = &w, .m = &m, .align = align};
  memcpy(c.budget, budget, sizeof c.budget);
  expected_cut(&c);
  CHECK((c.dropped > 0) == expect_drop, "align %d: the rule drops %lld pairs here", align, (long long)c.dropped);
  epx_run_ranks(R, rank_fn, &c, NULL);
  for (int r = 0; r < R; r++) CHECK(c.st[r] == EPX_SUCCESS, "align %d rank %d: %s", align, r, epx_status_string(c.st[r]));
  tu_world_destroy(&w);
  tu_moe_free(&m);
}

static epx_status_t max_tokens_fn(int r, void *arg) {
  tu_world_t *w = arg;
  CHECK(epx_comm_config(w->comm[r])->max_tokens_per_rank == 40, "rank %d: max_tokens_per_rank %d", r,
        epx_comm_config(w->comm[r])->max_tokens_per_rank);
  return EPX_SUCCESS;
}

int main(void) {
  tu_begin("test_budget");
  const int64_t none[R] = {0, 0, 0}, tight[R] = {5, 12, 0}, roomy[R] = {1000, 1000, 1000};
  budget_run(1, none, 0);
  budget_run(1, tight, 1);
  budget_run(4, tight, 1);
  budget_run(2, roomy, 0);

  epx_config_t cfgs[R];
  for (int r = 0; r < R; r++) cfgs[r] = tu_config(E, H, K, 20 + 10 * r);
  tu_world_t w;
  if (CHECK_STATUS(tu_world_create(&w, R, NULL, cfgs, NULL), EPX_SUCCESS, "different max_tokens_per_rank")) {
    epx_run_ranks(R, max_tokens_fn, &w, NULL);
    epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
    epx_handle_t *h = NULL;
    hc.recv_budget = 8;
    CHECK_STATUS(epx_handle_create(w.comm[0], &hc, &h), EPX_ERR_INVALID_ARGUMENT, "budget on the token layout");
    hc.layout = EPX_LAYOUT_EXPERT, hc.recv_budget = -1;
    CHECK_STATUS(epx_handle_create(w.comm[0], &hc, &h), EPX_ERR_INVALID_ARGUMENT, "negative budget");
    tu_world_destroy(&w);
  }
  return tu_end();
}
