/* test_combine: dispatch -> stand-in experts on the received rows -> combine, compared bit for
 * bit with dense_moe, for both layouts and every dtype combination; determinism; re-plans. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

typedef struct {
  epx_layout_t layout;
  epx_dtype_t x, recv, y, out;
} combo_t;

/* One pipeline run compared with dense_moe using the given weights (rows of the dense input). */
static void run_and_compare(const char *what, tu_world_t *w, epx_handle_t **h, const tu_moe_t *m, const tu_pipe_t *p,
                            const float *const *dense_w, void **keep_out) {
  tu_pipe_res_t res;
  const int R = m->R;
  if (tu_pipe_check(what, w, h, m, p, dense_w, &res) == 0 && keep_out)
    for (int r = 0; r < R; r++) {
      if (keep_out[r]) {
        char ww[640];
        snprintf(ww, sizeof ww, "%s rank %d out vs the previous run (determinism)", what, r);
        CHECK_BITS(ww, p->out_dtype, res.out[r], keep_out[r], m->T[r] * m->H, m->H);
      } else {
        keep_out[r] = res.out[r];
        res.out[r] = NULL;
      }
    }
  tu_pipe_free(&res, R);
}

static void random_tokens(int R, int64_t *T) {
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 10, 70);
  T[tu_int(&tu_rng, 0, R - 1)] = 0;
}

static void run_combo(const combo_t *c) {
  const int R = 4, L = 4, E = R * L, K = 4;
  const int H = c->recv == EPX_FP8_E4M3 ? 208 : 64; /* fp8: a partial last scale block */
  const int expert = c->layout == EPX_LAYOUT_EXPERT;
  char what[200];
  snprintf(what, sizeof what, "[%s x=%s recv=%s y=%s out=%s H=%d]", expert ? "expert" : "token", tu_dtype(c->x),
           tu_dtype(c->recv), tu_dtype(c->y), tu_dtype(c->out), H);

  tu_world_t w;
  epx_config_t cfg = tu_config(E, H, K, 128);
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s world", what)) {
    tu_world_destroy(&w);
    return;
  }
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, c->layout, expert ? 16 : 1);
  if (tu_handles_create(&w, &hc, h) == EPX_SUCCESS) {
    tu_pipe_t p = tu_pipe_default();
    p.layout = c->layout, p.align = hc.align, p.recv_dtype = c->recv, p.y_dtype = c->y, p.out_dtype = c->out;
    p.weighted = 1;

    int64_t T[TU_MAX_RANKS];
    random_tokens(R, T);
    tu_route_opts_t o = tu_route_default();
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, R, E, H, K, c->x, T, &o, 1);
    const float *const *mw = (const float *const *)m.w;

    /* Routing A, twice (the second time planned through epx_notify): same bits. */
    void *first[TU_MAX_RANKS] = {0};
    run_and_compare(what, &w, h, &m, &p, mw, first);
    p.notify_first = 1;
    run_and_compare(what, &w, h, &m, &p, mw, first);
    p.notify_first = 0;
    tu_free_all(first, R);

    if (expert) {
      /* Unweighted: every p = 1. */
      const float *ones[TU_MAX_RANKS] = {0};
      char w2[640];
      snprintf(w2, sizeof w2, "%s weighted=0", what);
      p.weighted = 0;
      run_and_compare(w2, &w, h, &m, &p, ones, NULL);
      /* Caller's row_probs (half of the delivered ones, exact). */
      float *half[TU_MAX_RANKS];
      for (int r = 0; r < R; r++) {
        half[r] = malloc(sizeof(float) * (size_t)(T[r] * K) + 1);
        for (int64_t i = 0; i < T[r] * K; i++) half[r][i] = m.w[r][i] * 0.5f;
      }
      snprintf(w2, sizeof w2, "%s row_probs = recv_probs / 2", what);
      p.weighted = 1, p.row_probs_mul = 0.5f;
      run_and_compare(w2, &w, h, &m, &p, (const float *const *)half, NULL);
      p.row_probs_mul = 0.0f;
      for (int r = 0; r < R; r++) free(half[r]);
    } else {
      /* weighted only concerns the expert layout: the token layout ignores it. */
      char w2[640];
      snprintf(w2, sizeof w2, "%s weighted=0", what);
      p.weighted = 0;
      run_and_compare(w2, &w, h, &m, &p, mw, NULL);
      p.weighted = 1;
    }
    tu_moe_free(&m);

    /* Routing B on the same handles: a re-plan with other token counts. */
    random_tokens(R, T);
    o.p_none = 0.6;
    tu_moe_random(&m, &tu_rng, R, E, H, K, c->x, T, &o, 1);
    char w3[640];
    snprintf(w3, sizeof w3, "%s re-planned", what);
    run_and_compare(w3, &w, h, &m, &p, (const float *const *)m.w, NULL);
    tu_moe_free(&m);
  }
  tu_handles_destroy(&w, h);
  tu_world_destroy(&w);
}

/* ---- two handles on one comm, interleaved ------------------------------------------- */
/* Handle A (token layout) and handle B (expert layout) plan different routings; their
 * dispatches and combines are interleaved. Each must keep its own plan. */
enum { IR = 3, IL = 3, IE = IR * IL, IK = 3, IH = 32, IALIGN = 4 };

typedef struct {
  tu_world_t *w;
  epx_handle_t *ha[TU_MAX_RANKS], *hb[TU_MAX_RANKS];
  tu_moe_t *ma, *mb;
  void *out_a[TU_MAX_RANKS], *out_b[TU_MAX_RANKS];
  epx_status_t st[TU_MAX_RANKS];
  const char *where[TU_MAX_RANKS];
  char err[TU_MAX_RANKS][256];
} inter_t;

static int inter_step(inter_t *c, int r, const char *where, epx_status_t s) {
  if (s != EPX_SUCCESS && c->st[r] == EPX_SUCCESS) {
    c->st[r] = s, c->where[r] = where;
    snprintf(c->err[r], sizeof c->err[r], "%s", epx_last_error());
  }
  return tu_barrier_vote(c->st[r] != EPX_SUCCESS);
}

static epx_status_t inter_rank(int r, void *arg) {
  inter_t *c = arg;
  epx_comm_t *comm = c->w->comm[r];
  epx_routing_t ra = tu_routing(c->ma, r, TU_FORM_TOPK32), rb = tu_routing(c->mb, r, TU_FORM_TOPK64);
  if (inter_step(c, r, "notify A", epx_notify(comm, c->ha[r], &ra))) return c->st[r];
  if (inter_step(c, r, "notify B", epx_notify(comm, c->hb[r], &rb))) return c->st[r];
  epx_handle_info_t ia, ib;
  int32_t cnt_b[IL];
  if (inter_step(c, r, "info A", epx_handle_info(c->ha[r], &ia, NULL))) return c->st[r];
  if (inter_step(c, r, "info B", epx_handle_info(c->hb[r], &ib, cnt_b))) return c->st[r];
  const int64_t na = ia.num_recv_tokens, nb = ib.num_recv_rows;
  float *xa = tu_alloc_poison(sizeof(float) * (size_t)(na * IH)), *xb = tu_alloc_poison(sizeof(float) * (size_t)(nb * IH));
  float *ya = tu_alloc_poison(sizeof(float) * (size_t)(na * IH)), *yb = tu_alloc_poison(sizeof(float) * (size_t)(nb * IH));
  int32_t *ida = tu_alloc_poison(sizeof(int32_t) * (size_t)(na * IK));
  float *wa = tu_alloc_poison(sizeof(float) * (size_t)(na * IK));
  c->out_a[r] = tu_alloc_poison(sizeof(float) * (size_t)(c->ma->T[r] * IH));
  c->out_b[r] = tu_alloc_poison(sizeof(float) * (size_t)(c->mb->T[r] * IH));

  epx_dispatch_args_t da, db;
  epx_dispatch_args_init(&da);
  da.x = c->ma->x[r], da.x_dtype = EPX_FLOAT32, da.recv_dtype = EPX_FLOAT32, da.recv_x = xa, da.recv_capacity = na;
  da.recv_topk_idx = ida, da.recv_topk_weights = wa;
  epx_dispatch_args_init(&db);
  db.x = c->mb->x[r], db.x_dtype = EPX_FLOAT32, db.recv_dtype = EPX_FLOAT32, db.recv_x = xb, db.recv_capacity = nb;
  epx_combine_args_t ca, cb;
  epx_combine_args_init(&ca);
  ca.y = ya, ca.y_dtype = EPX_FLOAT32, ca.out = c->out_a[r], ca.out_dtype = EPX_FLOAT32;
  epx_combine_args_init(&cb);
  cb.y = yb, cb.y_dtype = EPX_FLOAT32, cb.out = c->out_b[r], cb.out_dtype = EPX_FLOAT32, cb.weighted = 1;

  if (!inter_step(c, r, "dispatch B", epx_dispatch(comm, c->hb[r], NULL, &db)) &&
      !inter_step(c, r, "dispatch A", epx_dispatch(comm, c->ha[r], NULL, &da))) {
    tu_expert_token_layout(r, IL, IH, IK, na, EPX_FLOAT32, xa, NULL, ida, wa, EPX_FLOAT32, ya);
    tu_expert_rows(r, IL, IH, EPX_FLOAT32, xb, NULL, cnt_b, IALIGN, 0, nb, EPX_FLOAT32, yb);
    if (!inter_step(c, r, "combine A", epx_combine(comm, c->ha[r], &ca)))
      inter_step(c, r, "combine B", epx_combine(comm, c->hb[r], &cb));
  }
  free(xa), free(xb), free(ya), free(yb), free(ida), free(wa);
  return c->st[r];
}

static void interleaved_handles(void) {
  tu_world_t w;
  epx_config_t cfg = tu_config(IE, IH, IK, 64);
  if (!CHECK_STATUS(tu_world_create(&w, IR, &cfg, NULL, NULL), EPX_SUCCESS, "interleaved: world")) {
    tu_world_destroy(&w);
    return;
  }
  inter_t c;
  memset(&c, 0, sizeof c);
  c.w = &w;
  epx_handle_config_t hca = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  epx_handle_config_t hcb = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_EXPERT, IALIGN);
  if (tu_handles_create(&w, &hca, c.ha) == EPX_SUCCESS && tu_handles_create(&w, &hcb, c.hb) == EPX_SUCCESS) {
    int64_t ta[IR], tb[IR];
    for (int r = 0; r < IR; r++) ta[r] = tu_int(&tu_rng, 5, 40), tb[r] = tu_int(&tu_rng, 5, 40);
    tu_route_opts_t o = tu_route_default();
    tu_moe_t ma, mb;
    tu_moe_random(&ma, &tu_rng, IR, IE, IH, IK, EPX_FLOAT32, ta, &o, 1);
    tu_moe_random(&mb, &tu_rng, IR, IE, IH, IK, EPX_FLOAT32, tb, &o, 1);
    c.ma = &ma, c.mb = &mb;
    tu_barrier_init(IR);
    epx_run_ranks(IR, inter_rank, &c, NULL);
    int ok = 1;
    for (int r = 0; r < IR; r++)
      if (c.st[r] != EPX_SUCCESS) {
        ok = 0;
        CHECK(0, "interleaved handles, rank %d: %s: %s (%s)", r, c.where[r], epx_status_string(c.st[r]), c.err[r]);
      }
    if (ok) {
      void *want_a[TU_MAX_RANKS], *want_b[TU_MAX_RANKS];
      tu_dense(&ma, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, 0, (const float *const *)ma.w, want_a);
      tu_dense(&mb, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, 1, (const float *const *)mb.w, want_b);
      for (int r = 0; r < IR; r++) {
        CHECK_BITS("interleaved handles: A (token layout)", EPX_FLOAT32, c.out_a[r], want_a[r], ma.T[r] * IH, IH);
        CHECK_BITS("interleaved handles: B (expert layout)", EPX_FLOAT32, c.out_b[r], want_b[r], mb.T[r] * IH, IH);
      }
      tu_free_all(want_a, IR);
      tu_free_all(want_b, IR);
    }
    tu_free_all(c.out_a, IR);
    tu_free_all(c.out_b, IR);
    tu_moe_free(&ma);
    tu_moe_free(&mb);
  }
  tu_handles_destroy(&w, c.ha);
  tu_handles_destroy(&w, c.hb);
  tu_world_destroy(&w);
}

/* ---- two worlds at once --------------------------------------------------------------- */
/* Two independent groups of 2 ranks run in the same process at the same time (threads 0, 1
 * drive world A, threads 2, 3 world B): nothing may leak between them. */
typedef struct {
  tu_world_t *w[2];
  epx_handle_t *h[2][TU_MAX_RANKS];
  tu_moe_t *m[2];
  void *out[2][TU_MAX_RANKS];
  epx_status_t st[4];
  char err[4][256];
} twin_t;

static epx_status_t twin_rank(int thread, void *arg) {
  twin_t *c = arg;
  const int g = thread / 2, r = thread % 2;
  const tu_moe_t *m = c->m[g];
  const int L = m->L, H = m->H, K = m->K;
  epx_comm_t *comm = c->w[g]->comm[r];
  epx_handle_t *h = c->h[g][r];
  epx_routing_t rt = tu_routing(m, r, TU_FORM_TOPK32);
  const int64_t cap = (m->T[0] + m->T[1]);
  float *x = tu_alloc_poison(sizeof(float) * (size_t)(cap * H)), *y = tu_alloc_poison(sizeof(float) * (size_t)(cap * H));
  int32_t *idx = tu_alloc_poison(sizeof(int32_t) * (size_t)(cap * K));
  float *w = tu_alloc_poison(sizeof(float) * (size_t)(cap * K));
  int64_t n = -1;
  c->out[g][r] = tu_alloc_poison(sizeof(float) * (size_t)(m->T[r] * H));
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = m->x[r], a.x_dtype = EPX_FLOAT32, a.recv_dtype = EPX_FLOAT32, a.recv_x = x, a.recv_capacity = cap;
  a.recv_topk_idx = idx, a.recv_topk_weights = w, a.num_recv_rows = &n;
  epx_status_t s = epx_dispatch(comm, h, &rt, &a);
  if (s == EPX_SUCCESS) {
    tu_expert_token_layout(r, L, H, K, n, EPX_FLOAT32, x, NULL, idx, w, EPX_FLOAT32, y);
    epx_combine_args_t ca;
    epx_combine_args_init(&ca);
    ca.y = y, ca.y_dtype = EPX_FLOAT32, ca.out = c->out[g][r], ca.out_dtype = EPX_FLOAT32;
    s = epx_combine(comm, h, &ca);
  }
  c->st[thread] = s;
  snprintf(c->err[thread], sizeof c->err[thread], "%s", s ? epx_last_error() : "");
  free(x), free(y), free(idx), free(w);
  return s;
}

static void two_worlds_at_once(void) {
  tu_world_t wa, wb;
  twin_t c;
  memset(&c, 0, sizeof c);
  epx_config_t cfg[2] = {tu_config(4, 32, 2, 64), tu_config(6, 48, 3, 64)};
  int ok = CHECK_STATUS(tu_world_create(&wa, 2, &cfg[0], NULL, NULL), EPX_SUCCESS, "world A");
  ok &= CHECK_STATUS(tu_world_create(&wb, 2, &cfg[1], NULL, NULL), EPX_SUCCESS, "world B");
  c.w[0] = &wa, c.w[1] = &wb;
  tu_moe_t m[2];
  memset(m, 0, sizeof m);
  if (ok) {
    epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
    ok = tu_handles_create(&wa, &hc, c.h[0]) == EPX_SUCCESS && tu_handles_create(&wb, &hc, c.h[1]) == EPX_SUCCESS;
  }
  if (ok) {
    tu_route_opts_t o = tu_route_default();
    for (int g = 0; g < 2; g++) {
      int64_t T[2] = {tu_int(&tu_rng, 5, 40), tu_int(&tu_rng, 5, 40)};
      tu_moe_random(&m[g], &tu_rng, 2, cfg[g].num_experts, cfg[g].hidden, cfg[g].topk, EPX_FLOAT32, T, &o, 1);
      c.m[g] = &m[g];
    }
    epx_run_ranks(4, twin_rank, &c, NULL);
    for (int t = 0; t < 4; t++)
      CHECK_STATUS(c.st[t], EPX_SUCCESS, "two worlds: world %c rank %d (%s)", 'A' + t / 2, t % 2, c.err[t]);
    for (int g = 0; g < 2; g++) {
      if (c.st[2 * g] || c.st[2 * g + 1]) continue;
      void *want[TU_MAX_RANKS];
      tu_dense(&m[g], EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, 0, (const float *const *)m[g].w, want);
      for (int r = 0; r < 2; r++)
        CHECK_BITS(g ? "two worlds: B" : "two worlds: A", EPX_FLOAT32, c.out[g][r], want[r], m[g].T[r] * m[g].H,
                   m[g].H);
      tu_free_all(want, 2);
    }
    for (int g = 0; g < 2; g++) tu_free_all(c.out[g], 2), tu_moe_free(&m[g]);
  }
  tu_handles_destroy(&wa, c.h[0]);
  tu_handles_destroy(&wb, c.h[1]);
  tu_world_destroy(&wa);
  tu_world_destroy(&wb);
}

int main(void) {
  tu_begin("test_combine");
  const epx_dtype_t dt[2] = {EPX_FLOAT32, EPX_BFLOAT16};
  for (int layout = 0; layout < 2; layout++)
    for (int xi = 0; xi < 2; xi++)
      for (int fp8 = 0; fp8 < 2; fp8++)
        for (int yi = 0; yi < 2; yi++)
          for (int oi = 0; oi < 2; oi++) {
            combo_t c = {layout ? EPX_LAYOUT_EXPERT : EPX_LAYOUT_TOKEN, dt[xi], fp8 ? EPX_FP8_E4M3 : dt[xi], dt[yi],
                         dt[oi]};
            run_combo(&c);
          }
  interleaved_handles();
  for (int i = 0; i < 3; i++) two_worlds_at_once();
  return tu_end();
}
