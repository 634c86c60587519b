/* test_errors: one case per kind of bad input. Each checks the exact status, that
 * epx_last_error() says something relevant, that nothing was written, and (for collective
 * calls) that the comms still work afterwards. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* ---- one collective call on every rank ------------------------------------------------ */
enum { OP_NOTIFY, OP_DISPATCH };

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
  const tu_moe_t *m;
  int op, form;
  epx_dtype_t recv_dtype;
  int expert;                   /* expert layout buffers */
  int64_t cap[TU_MAX_RANKS];    /* recv_capacity (rows allocated: cap + 2) */
  int null_x_rank, null_recv_rank;
  int shift_x_rank, shift_recv_rank; /* this rank's x / recv_x start 8 bytes into their buffers */
  size_t rb;
  void *recv_x[TU_MAX_RANKS];
  int32_t *recv_idx[TU_MAX_RANKS];
  float *recv_w[TU_MAX_RANKS], *recv_p[TU_MAX_RANKS];
  epx_status_t st[TU_MAX_RANKS];
  char err[TU_MAX_RANKS][256];
  double secs[TU_MAX_RANKS];
} call_t;

static size_t dsize(epx_dtype_t t) { return t == EPX_FLOAT32 ? 4 : t == EPX_BFLOAT16 ? 2 : 1; }

static epx_status_t call_rank(int r, void *arg) {
  call_t *c = arg;
  const tu_moe_t *m = c->m;
  const int64_t rows = c->cap[r] + 2;
  c->recv_x[r] = tu_alloc_poison((size_t)rows * c->rb);
  c->recv_idx[r] = tu_alloc_poison(sizeof(int32_t) * (size_t)(rows * m->K));
  c->recv_w[r] = tu_alloc_poison(sizeof(float) * (size_t)(rows * m->K));
  c->recv_p[r] = tu_alloc_poison(sizeof(float) * (size_t)rows);
  epx_routing_t rt = tu_routing(m, r, c->form);
  const size_t x_bytes = (size_t)m->T[r] * m->H * dsize(m->x_dtype);
  char *x_shifted = c->shift_x_rank == r ? malloc(x_bytes + 16) : NULL;
  if (x_shifted) memcpy(x_shifted + 8, m->x[r], x_bytes);
  const double t0 = tu_now();
  if (c->op == OP_NOTIFY) {
    c->st[r] = epx_notify(c->w->comm[r], c->h[r], &rt);
  } else {
    epx_dispatch_args_t a;
    epx_dispatch_args_init(&a);
    a.x = c->null_x_rank == r ? NULL : x_shifted ? (const void *)(x_shifted + 8) : m->x[r];
    a.x_dtype = m->x_dtype;
    a.recv_dtype = c->recv_dtype;
    a.recv_x = c->null_recv_rank == r ? NULL : (char *)c->recv_x[r] + (c->shift_recv_rank == r ? 8 : 0);
    a.recv_capacity = c->cap[r];
    if (c->expert)
      a.recv_probs = c->recv_p[r];
    else
      a.recv_topk_idx = c->recv_idx[r], a.recv_topk_weights = c->recv_w[r];
    c->st[r] = epx_dispatch(c->w->comm[r], c->h[r], &rt, &a);
  }
  c->secs[r] = tu_now() - t0;
  free(x_shifted);
  snprintf(c->err[r], sizeof c->err[r], "%s", c->st[r] != EPX_SUCCESS ? epx_last_error() : "");
  return c->st[r];
}

static void call_init(call_t *c, tu_world_t *w, epx_handle_t **h, const tu_moe_t *m, int op) {
  memset(c, 0, sizeof *c);
  c->w = w, c->h = h, c->m = m, c->op = op, c->form = TU_FORM_TOPK32, c->recv_dtype = m->x_dtype;
  c->null_x_rank = c->null_recv_rank = c->shift_x_rank = c->shift_recv_rank = -1;
  int64_t total = 0;
  for (int r = 0; r < m->R; r++) total += m->T[r] * m->K;
  for (int r = 0; r < m->R; r++) c->cap[r] = total + 256; /* room for any plan, padding included */
}

static void call_run(call_t *c) {
  c->rb = (size_t)c->m->H * dsize(c->recv_dtype);
  epx_run_ranks(c->m->R, call_rank, c, NULL);
}

/* Nothing of rank r's receive buffers was written. */
static int call_untouched(const call_t *c, int r) {
  const int64_t rows = c->cap[r] + 2;
  return tu_is_poison(c->recv_x[r], (size_t)rows * c->rb) &&
         tu_is_poison(c->recv_idx[r], sizeof(int32_t) * (size_t)(rows * c->m->K)) &&
         tu_is_poison(c->recv_w[r], sizeof(float) * (size_t)(rows * c->m->K)) &&
         tu_is_poison(c->recv_p[r], sizeof(float) * (size_t)rows);
}

static void call_free(call_t *c) {
  for (int r = 0; r < c->m->R; r++) free(c->recv_x[r]), free(c->recv_idx[r]), free(c->recv_w[r]), free(c->recv_p[r]);
}

/* After a bad call the group still works: a valid dispatch + combine on the same handles. */
static void check_still_works(const char *what, tu_world_t *w, epx_handle_t **h, const tu_moe_t *shape, epx_layout_t layout,
                              int align) {
  int64_t T[TU_MAX_RANKS];
  for (int r = 0; r < shape->R; r++) T[r] = tu_int(&tu_rng, 1, 20);
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, shape->R, shape->E, shape->H, shape->K, EPX_FLOAT32, T, &o, 1);
  tu_pipe_t p = tu_pipe_default();
  p.layout = layout, p.align = align;
  tu_pipe_res_t res;
  int rc = tu_pipe_run(w, h, &m, &p, &res);
  for (int r = 0; r < m.R; r++)
    CHECK(rc == 0, "%s: a valid dispatch + combine afterwards fails on rank %d: dispatch %s, combine %s (%s)", what, r,
          epx_status_string(res.dispatch_st[r]), epx_status_string(res.combine_st[r]), res.err[r]);
  if (rc == 0) {
    void *want[TU_MAX_RANKS];
    tu_dense(&m, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, layout == EPX_LAYOUT_EXPERT, (const float *const *)m.w, want);
    for (int r = 0; r < m.R; r++) CHECK_BITS(what, EPX_FLOAT32, res.out[r], want[r], m.T[r] * m.H, m.H);
    tu_free_all(want, m.R);
  }
  tu_pipe_free(&res, m.R);
  tu_moe_free(&m);
}

/* A world with handles, for the collective cases. */
typedef struct {
  tu_world_t w;
  epx_handle_t *h[TU_MAX_RANKS];
  int ok;
} setup_t;

static void setup(setup_t *s, int R, int E, int H, int K, int maxT, epx_algo_t algo, epx_layout_t layout, int align) {
  memset(s, 0, sizeof *s);
  epx_config_t cfg = tu_config(E, H, K, maxT);
  s->ok = CHECK_STATUS(tu_world_create(&s->w, R, &cfg, NULL, NULL), EPX_SUCCESS, "setup R=%d E=%d H=%d K=%d", R, E, H, K);
  if (s->ok) {
    epx_handle_config_t hc = tu_handle_config(algo, layout, align);
    s->ok = tu_handles_create(&s->w, &hc, s->h) == EPX_SUCCESS;
  }
}

static void teardown(setup_t *s) {
  tu_handles_destroy(&s->w, s->h);
  tu_world_destroy(&s->w);
}

/* ---- cases ------------------------------------------------------------------------------ */
static void expert_out_of_range(void) {
  const int R = 3, E = 6, K = 2, H = 16;
  static const struct {
    int64_t bad_id;
    int op, form;
    const char *what;
  } cases[] = {
      {6, OP_DISPATCH, TU_FORM_TOPK32, "id == E (dispatch)"},
      {-2, OP_DISPATCH, TU_FORM_TOPK32, "id -2 (dispatch)"},
      {6, OP_NOTIFY, TU_FORM_TOPK32, "id == E (notify)"},
      {1000, OP_NOTIFY, TU_FORM_TOPK64, "int64 id 1000 (notify)"},
      {((int64_t)1 << 32) + 1, OP_DISPATCH, TU_FORM_TOPK64, "int64 id 2^32 + 1 (dispatch; 1 if truncated)"},
      {-((int64_t)1 << 32) - 1, OP_DISPATCH, TU_FORM_TOPK64, "int64 id -2^32 - 1 (dispatch; -1 if truncated)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setup_t s;
    setup(&s, R, E, H, K, 64, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
    if (!s.ok) {
      teardown(&s);
      continue;
    }
    int64_t T[3] = {7, 9, 5};
    tu_route_opts_t o = tu_route_default();
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
    m.idx[1][4 * K + 1] = (int32_t)cases[i].bad_id; /* rank 1, token 4, slot 1 */
    m.idx64[1][4 * K + 1] = cases[i].bad_id;
    call_t c;
    call_init(&c, &s.w, s.h, &m, cases[i].op);
    c.form = cases[i].form;
    call_run(&c);
    for (int r = 0; r < R; r++) {
      CHECK_STATUS(c.st[r], EPX_ERR_EXPERT_OUT_OF_RANGE, "%s: rank %d", cases[i].what, r);
      CHECK(c.err[r][0], "%s: rank %d has no message", cases[i].what, r);
      CHECK(call_untouched(&c, r), "%s: rank %d's receive buffers were written", cases[i].what, r);
    }
    CHECK(tu_contains(c.err[1], "expert"), "%s: the message does not mention the expert: \"%s\"", cases[i].what, c.err[1]);
    printf("  %s: \"%s\"\n", cases[i].what, c.err[1]);
    call_free(&c);
    check_still_works(cases[i].what, &s.w, s.h, &m, EPX_LAYOUT_TOKEN, 1);
    tu_moe_free(&m);
    teardown(&s);
  }
}

typedef struct {
  const epx_config_t *cfgs;
  tu_world_t *w;
  epx_status_t st[TU_MAX_RANKS];
  char err[TU_MAX_RANKS][256];
} init_t;

static epx_status_t init_rank(int r, void *arg) {
  init_t *c = arg;
  c->w->comm[r] = NULL;
  c->st[r] = epx_comm_init(c->w->world, r, &c->cfgs[r], &c->w->comm[r]);
  snprintf(c->err[r], sizeof c->err[r], "%s", c->st[r] != EPX_SUCCESS ? epx_last_error() : "");
  if (c->st[r] != EPX_SUCCESS) c->w->comm[r] = NULL;
  return c->st[r];
}

/* Runs epx_comm_init on every rank with per-rank configs and checks every status and message. */
static void check_init(const char *what, int R, const epx_config_t *cfgs, epx_status_t want, const char *word1,
                       const char *word2) {
  tu_world_t w;
  memset(&w, 0, sizeof w);
  w.R = R;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST, wc.nranks = R;
  if (!CHECK_STATUS(epx_world_create(&wc, &w.world), EPX_SUCCESS, "%s: world", what)) return;
  init_t c;
  memset(&c, 0, sizeof c);
  c.cfgs = cfgs, c.w = &w;
  const double t0 = tu_now();
  epx_run_ranks(R, init_rank, &c, NULL);
  const double secs = tu_now() - t0;
  for (int r = 0; r < R; r++) {
    CHECK_STATUS(c.st[r], want, "%s: rank %d", what, r);
    if (want == EPX_SUCCESS) continue;
    CHECK(c.err[r][0], "%s: rank %d has no message", what, r);
    if (word1) CHECK(tu_contains(c.err[r], word1), "%s: rank %d message lacks \"%s\": \"%s\"", what, r, word1, c.err[r]);
    if (word2) CHECK(tu_contains(c.err[r], word2), "%s: rank %d message lacks \"%s\": \"%s\"", what, r, word2, c.err[r]);
  }
  CHECK(secs < 5.0, "%s: the failing init took %.1f s", what, secs);
  if (want != EPX_SUCCESS) printf("  %s: \"%s\"\n", what, c.err[R - 1]);
  tu_world_destroy(&w);
}

static void config_errors(void) {
  epx_config_t cfgs[4];
  const epx_config_t good = tu_config(8, 32, 2, 16);
  for (int r = 0; r < 4; r++) cfgs[r] = good, cfgs[r].num_experts = 10;
  check_init("num_experts 10 over 4 ranks", 4, cfgs, EPX_ERR_EXPERTS_NOT_DIVISIBLE, "expert", NULL);
  for (int r = 0; r < 4; r++) cfgs[r] = good, cfgs[r].topk = 0;
  check_init("topk 0", 4, cfgs, EPX_ERR_TOPK_RANGE, "topk", NULL);
  for (int r = 0; r < 4; r++) cfgs[r] = good, cfgs[r].topk = EPX_MAX_TOPK + 1;
  check_init("topk 17", 4, cfgs, EPX_ERR_TOPK_RANGE, "topk", NULL);
  for (int r = 0; r < 4; r++) cfgs[r] = good, cfgs[r].hidden = 0;
  check_init("hidden 0", 4, cfgs, EPX_ERR_HIDDEN_RANGE, "hidden", NULL);
  for (int r = 0; r < 4; r++) cfgs[r] = good, cfgs[r].hidden = EPX_MAX_HIDDEN + 1;
  check_init("hidden 65537", 4, cfgs, EPX_ERR_HIDDEN_RANGE, "hidden", NULL);
  /* Mismatched configs (each valid alone): every rank fails, the message names the field
   * and the ranks. */
  const epx_config_t good3 = tu_config(12, 32, 2, 16);
  for (int r = 0; r < 3; r++) cfgs[r] = good3;
  cfgs[1].hidden = 64;
  check_init("rank 1 passes hidden 64, the others 32", 3, cfgs, EPX_ERR_CONFIG_MISMATCH, "hidden", "rank 1");
  for (int r = 0; r < 3; r++) cfgs[r] = good3;
  cfgs[2].num_experts = 24;
  check_init("rank 2 passes num_experts 24, the others 12", 3, cfgs, EPX_ERR_CONFIG_MISMATCH, "num_experts", "rank 2");
  for (int r = 0; r < 3; r++) cfgs[r] = good3;
  cfgs[0].topk = 3;
  check_init("rank 0 passes topk 3, the others 2", 3, cfgs, EPX_ERR_CONFIG_MISMATCH, "topk", "rank 0");
  /* A good config right after works. */
  for (int r = 0; r < 3; r++) cfgs[r] = good3;
  check_init("the same config everywhere", 3, cfgs, EPX_SUCCESS, NULL, NULL);
}

static void row_alignment(void) {
  /* bf16 with H = 12 is 24 bytes a row: refused at dispatch on every rank. */
  setup_t s;
  setup(&s, 2, 4, 12, 2, 64, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  if (s.ok) {
    int64_t T[2] = {5, 6};
    tu_route_opts_t o = tu_route_default();
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, 2, 4, 12, 2, EPX_BFLOAT16, T, &o, 1);
    call_t c;
    call_init(&c, &s.w, s.h, &m, OP_DISPATCH);
    call_run(&c);
    for (int r = 0; r < 2; r++) {
      CHECK_STATUS(c.st[r], EPX_ERR_ROW_ALIGNMENT, "bf16 H=12: rank %d", r);
      CHECK(tu_contains(c.err[r], "16") || tu_contains(c.err[r], "align"), "bf16 H=12: rank %d message: \"%s\"", r, c.err[r]);
      CHECK(call_untouched(&c, r), "bf16 H=12: rank %d's buffers were written", r);
    }
    printf("  bf16 H=12: \"%s\"\n", c.err[0]);
    call_free(&c);
    /* f32 with the same H (48 bytes) is fine on these comms. */
    tu_moe_free(&m);
    tu_moe_random(&m, &tu_rng, 2, 4, 12, 2, EPX_FLOAT32, T, &o, 1);
    call_init(&c, &s.w, s.h, &m, OP_DISPATCH);
    call_run(&c);
    for (int r = 0; r < 2; r++) CHECK_STATUS(c.st[r], EPX_SUCCESS, "f32 H=12: rank %d (%s)", r, c.err[r]);
    call_free(&c);
    tu_moe_free(&m);
  }
  teardown(&s);
  /* Whole rows, but one rank's x or recv_x starts 8 bytes off a 16-byte boundary: refused on
     every rank, nothing written. */
  setup(&s, 3, 6, 16, 2, 64, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  for (int which = 0; s.ok && which < 2; which++) {
    int64_t T[3] = {tu_int(&tu_rng, 1, 9), tu_int(&tu_rng, 1, 9), tu_int(&tu_rng, 1, 9)};
    tu_route_opts_t o = tu_route_default();
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, 3, 6, 16, 2, EPX_BFLOAT16, T, &o, 1);
    call_t c;
    call_init(&c, &s.w, s.h, &m, OP_DISPATCH);
    const int odd = tu_int(&tu_rng, 0, 2);
    const char *what = which ? "recv_x" : "x";
    if (which) c.shift_recv_rank = odd; else c.shift_x_rank = odd;
    call_run(&c);
    for (int r = 0; r < 3; r++) {
      CHECK_STATUS(c.st[r], EPX_ERR_ROW_ALIGNMENT, "rank %d's %s 8 bytes off: rank %d", odd, what, r);
      CHECK(call_untouched(&c, r), "rank %d's %s 8 bytes off: rank %d's buffers were written", odd, what, r);
    }
    CHECK(tu_contains(c.err[odd], what) && tu_contains(c.err[odd], "16-byte boundary"),
          "rank %d's message names %s and the boundary: \"%s\"", odd, what, c.err[odd]);
    printf("  %s 8 bytes off on rank %d: \"%s\"\n", what, odd, c.err[odd]);
    call_free(&c);
    tu_moe_free(&m);
  }
  teardown(&s);
  /* bf16 tokens with H = 24 are 48 bytes, but quantised to fp8 a row is 24 bytes: refused. */
  setup(&s, 2, 4, 24, 2, 64, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  if (s.ok) {
    int64_t T[2] = {4, 3};
    tu_route_opts_t o = tu_route_default();
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, 2, 4, 24, 2, EPX_BFLOAT16, T, &o, 1);
    call_t c;
    call_init(&c, &s.w, s.h, &m, OP_DISPATCH);
    c.recv_dtype = EPX_FP8_E4M3;
    call_run(&c);
    for (int r = 0; r < 2; r++) CHECK_STATUS(c.st[r], EPX_ERR_ROW_ALIGNMENT, "fp8 rows of 24 bytes: rank %d", r);
    call_free(&c);
    tu_moe_free(&m);
  }
  teardown(&s);
  /* f32 with H = 4: 16 bytes, fine. */
  setup(&s, 2, 4, 4, 2, 64, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  if (s.ok) {
    tu_moe_t shape;
    memset(&shape, 0, sizeof shape);
    shape.R = 2, shape.E = 4, shape.H = 4, shape.K = 2;
    check_still_works("f32 H=4", &s.w, s.h, &shape, EPX_LAYOUT_TOKEN, 1);
  }
  teardown(&s);
}

static void output_too_small(epx_layout_t layout, int align) {
  const int R = 3, E = 6, K = 3, H = 16;
  const char *what = layout == EPX_LAYOUT_EXPERT ? "capacity one row short (expert layout, padding counted)"
                                                 : "capacity one row short (token layout)";
  setup_t s;
  setup(&s, R, E, H, K, 64, EPX_ALGO_HT, layout, align);
  if (s.ok) {
    int64_t T[3] = {12, 10, 14};
    tu_route_opts_t o = tu_route_default();
    o.p_none = 0.0;
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
    tu_expect_t ex;
    tu_expect(&m, 1, layout == EPX_LAYOUT_EXPERT ? align : 1, &ex);
    const int64_t need = layout == EPX_LAYOUT_EXPERT ? ex.nrows : ex.ntok;
    tu_expect_free(&ex);
    call_t c;
    call_init(&c, &s.w, s.h, &m, OP_DISPATCH);
    c.expert = layout == EPX_LAYOUT_EXPERT;
    c.cap[1] = need - 1;
    call_run(&c);
    CHECK_STATUS(c.st[1], EPX_ERR_OUTPUT_TOO_SMALL, "%s: rank 1 (needs %lld rows, has %lld)", what, (long long)need,
                 (long long)c.cap[1]);
    CHECK(call_untouched(&c, 1), "%s: rank 1's buffers were written", what);
    CHECK(tu_contains(c.err[1], "capacity"), "%s: rank 1's message does not mention the capacity: \"%s\"", what, c.err[1]);
    printf("  %s: \"%s\"\n", what, c.err[1]);
    for (int r = 0; r < R; r += 2)
      CHECK(c.st[r] == EPX_SUCCESS || c.st[r] == EPX_ERR_OUTPUT_TOO_SMALL,
            "%s: rank %d (capacity fine) returns %s (%s), want success or the same error", what, r,
            epx_status_string(c.st[r]), c.err[r]);
    call_free(&c);
    check_still_works(what, &s.w, s.h, &m, layout, align);
    tu_moe_free(&m);
  }
  teardown(&s);
}

/* Bad input on one rank only: that rank names it, no rank hangs or times out, and the
 * group still works afterwards. */
static void one_bad_rank(void) {
  const int R = 3, E = 6, K = 2, H = 16;
  static const struct {
    int null_x, null_recv, overfull_map;
    epx_status_t want;
    const char *word, *what;
  } cases[] = {
      {1, -1, -1, EPX_ERR_NULL_POINTER, "x", "rank 1 passes x NULL"},
      {-1, 2, -1, EPX_ERR_NULL_POINTER, "recv_x", "rank 2 passes recv_x NULL"},
      {-1, -1, 0, EPX_ERR_TOPK_RANGE, "topk", "rank 0's routing map has a row with 3 experts, K = 2"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setup_t s;
    setup(&s, R, E, H, K, 64, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
    if (!s.ok) {
      teardown(&s);
      continue;
    }
    int64_t T[3] = {8, 6, 9};
    tu_route_opts_t o = tu_route_default();
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
    tu_moe_make_map(&m);
    call_t c;
    call_init(&c, &s.w, s.h, &m, OP_DISPATCH);
    c.null_x_rank = cases[i].null_x, c.null_recv_rank = cases[i].null_recv;
    int bad = cases[i].null_x >= 0 ? cases[i].null_x : cases[i].null_recv;
    if (cases[i].overfull_map >= 0) {
      bad = cases[i].overfull_map;
      c.form = TU_FORM_MAP;
      memset(m.map[bad] + 3 * E, 0, (size_t)E);
      m.map[bad][3 * E + 0] = m.map[bad][3 * E + 2] = m.map[bad][3 * E + 5] = 1;
    }
    call_run(&c);
    CHECK_STATUS(c.st[bad], cases[i].want, "%s: rank %d", cases[i].what, bad);
    CHECK(tu_contains(c.err[bad], cases[i].word), "%s: the message does not mention %s: \"%s\"", cases[i].what,
          cases[i].word, c.err[bad]);
    for (int r = 0; r < R; r++) {
      CHECK(c.st[r] != EPX_ERR_TIMEOUT && c.st[r] != EPX_ERR_BROKEN && c.secs[r] < 5.0,
            "%s: rank %d returns %s after %.2f s (%s)", cases[i].what, r, epx_status_string(c.st[r]), c.secs[r], c.err[r]);
      if (c.st[r] != EPX_SUCCESS) CHECK(call_untouched(&c, r), "%s: rank %d failed but wrote its buffers", cases[i].what, r);
    }
    printf("  %s: \"%s\" (others: %s)\n", cases[i].what, c.err[bad], epx_status_string(c.st[(bad + 1) % R]));
    call_free(&c);
    check_still_works(cases[i].what, &s.w, s.h, &m, EPX_LAYOUT_TOKEN, 1);
    tu_moe_free(&m);
    teardown(&s);
  }
}

static void ll_overflow(void) {
  const int R = 2, E = 4, K = 2, H = 16, maxT = 8;
  setup_t s;
  setup(&s, R, E, H, K, maxT, EPX_ALGO_LL, EPX_LAYOUT_EXPERT, 1);
  if (s.ok) {
    int64_t T[2] = {maxT + 1, 3};
    tu_route_opts_t o = tu_route_default();
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
    call_t c;
    call_init(&c, &s.w, s.h, &m, OP_DISPATCH);
    c.expert = 1;
    for (int r = 0; r < R; r++) c.cap[r] = (int64_t)(E / R) * R * maxT;
    call_run(&c);
    for (int r = 0; r < R; r++) {
      CHECK_STATUS(c.st[r], EPX_ERR_LL_OVERFLOW, "LL: rank 0 sends %d tokens, capacity %d: rank %d", maxT + 1, maxT, r);
      CHECK(c.err[r][0], "LL overflow: rank %d has no message", r);
      CHECK(call_untouched(&c, r), "LL overflow: rank %d's buffers were written", r);
    }
    printf("  LL overflow: \"%s\"\n", c.err[0]);
    call_free(&c);
    tu_moe_free(&m);
  }
  teardown(&s);
}

/* World configs refused. */
static void bad_world_configs(void) {
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST, wc.nranks = 1;
  epx_world_t *world = NULL;
  CHECK_STATUS(epx_world_create(NULL, &world), EPX_ERR_NULL_POINTER, "world config NULL");
  CHECK_STATUS(epx_world_create(&wc, NULL), EPX_ERR_NULL_POINTER, "world out-pointer NULL");
  wc.nranks = 0;
  CHECK_STATUS(epx_world_create(&wc, &world), EPX_ERR_INVALID_ARGUMENT, "nranks 0");
  wc.nranks = EPX_MAX_RANKS + 1;
  CHECK_STATUS(epx_world_create(&wc, &world), EPX_ERR_INVALID_ARGUMENT, "nranks 65");
  CHECK(tu_contains(epx_last_error(), "nranks") || tu_contains(epx_last_error(), "rank"), "nranks 65 message: \"%s\"",
        epx_last_error());
}

/* A fresh handle has no plan to replay, and nothing to combine; recv_x ([64, 16] float32)
 * stays as it was. */
static void fresh_handle_refuses(epx_comm_t *comm, const epx_dispatch_args_t *a, float *recv) {
  epx_handle_t *fresh = NULL;
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  if (!CHECK_STATUS(epx_handle_create(comm, &hc, &fresh), EPX_SUCCESS, "a fresh handle")) return;
  epx_status_t st = epx_dispatch(comm, fresh, NULL, a);
  CHECK(st != EPX_SUCCESS && *epx_last_error(), "dispatch(routing NULL) on a handle never planned: %s",
        epx_status_string(st));
  float *o = tu_alloc_poison(sizeof(float) * 6 * 16);
  epx_combine_args_t cc;
  epx_combine_args_init(&cc);
  cc.y = recv, cc.y_dtype = EPX_FLOAT32, cc.out = o, cc.out_dtype = EPX_FLOAT32;
  st = epx_combine(comm, fresh, &cc);
  CHECK(st != EPX_SUCCESS && *epx_last_error(), "combine on a handle never planned: %s", epx_status_string(st));
  CHECK(tu_is_poison(recv, sizeof(float) * 64 * 16) && tu_is_poison(o, sizeof(float) * 6 * 16),
        "a refused replay or combine wrote its outputs");
  free(o);
  epx_handle_destroy(fresh);
}

/* Single-rank calls that must fail before any collective step. */
static void null_and_invalid(void) {
  bad_world_configs();
  setup_t s;
  setup(&s, 1, 4, 16, 2, 32, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  if (!s.ok) {
    teardown(&s);
    return;
  }
  epx_comm_t *comm = s.w.comm[0], *c2 = NULL;
  epx_handle_t *h = s.h[0], *h2 = NULL;
  CHECK_STATUS(epx_comm_init(s.w.world, 0, NULL, &c2), EPX_ERR_NULL_POINTER, "comm_init config NULL");
  CHECK(tu_contains(epx_last_error(), "config") || tu_contains(epx_last_error(), "cfg"), "config NULL message: \"%s\"",
        epx_last_error());
  epx_config_t cfg = tu_config(4, 16, 2, 32);
  CHECK_STATUS(epx_comm_init(s.w.world, 1, &cfg, &c2), EPX_ERR_INVALID_ARGUMENT, "comm_init rank 1 of 1");
  CHECK_STATUS(epx_comm_init(NULL, 0, &cfg, &c2), EPX_ERR_NULL_POINTER, "comm_init world NULL");
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  CHECK_STATUS(epx_handle_create(NULL, &hc, &h2), EPX_ERR_NULL_POINTER, "handle_create comm NULL");
  CHECK_STATUS(epx_handle_create(comm, &hc, NULL), EPX_ERR_NULL_POINTER, "handle_create out-pointer NULL");
  hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 0);
  CHECK_STATUS(epx_handle_create(comm, &hc, &h2), EPX_ERR_INVALID_ARGUMENT, "expert layout, align 0");
  CHECK(tu_contains(epx_last_error(), "align"), "align 0 message: \"%s\"", epx_last_error());

  int64_t T[1] = {6};
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, 1, 4, 16, 2, EPX_FLOAT32, T, &o, 1);
  epx_routing_t rt = tu_routing(&m, 0, TU_FORM_TOPK32);
  float *recv = tu_alloc_poison(sizeof(float) * 64 * 16);
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = m.x[0], a.x_dtype = EPX_FLOAT32, a.recv_dtype = EPX_FLOAT32, a.recv_x = recv, a.recv_capacity = 64;

  CHECK_STATUS(epx_dispatch(NULL, h, &rt, &a), EPX_ERR_NULL_POINTER, "dispatch comm NULL");
  CHECK(tu_contains(epx_last_error(), "comm"), "comm NULL message: \"%s\"", epx_last_error());
  CHECK_STATUS(epx_dispatch(comm, NULL, &rt, &a), EPX_ERR_NULL_POINTER, "dispatch handle NULL");
  CHECK(tu_contains(epx_last_error(), "handle"), "handle NULL message: \"%s\"", epx_last_error());
  CHECK_STATUS(epx_dispatch(comm, h, &rt, NULL), EPX_ERR_NULL_POINTER, "dispatch args NULL");
  CHECK_STATUS(epx_notify(comm, h, NULL), EPX_ERR_NULL_POINTER, "notify routing NULL");
  CHECK_STATUS(epx_notify(NULL, h, &rt), EPX_ERR_NULL_POINTER, "notify comm NULL");
  CHECK_STATUS(epx_get_layout(comm, NULL, NULL, NULL, NULL), EPX_ERR_NULL_POINTER, "get_layout routing NULL");
  epx_routing_t empty = rt;
  empty.topk_idx = NULL, empty.routing_map = NULL;
  CHECK_STATUS(epx_notify(comm, h, &empty), EPX_ERR_NULL_POINTER, "routing without topk_idx or routing_map");

  a.x = NULL;
  CHECK_STATUS(epx_dispatch(comm, h, &rt, &a), EPX_ERR_NULL_POINTER, "dispatch x NULL");
  CHECK(*epx_last_error(), "x NULL: a message");
  a.x = m.x[0], a.recv_x = NULL;
  CHECK_STATUS(epx_dispatch(comm, h, &rt, &a), EPX_ERR_NULL_POINTER, "dispatch recv_x NULL");
  CHECK(tu_contains(epx_last_error(), "recv_x"), "recv_x NULL message: \"%s\"", epx_last_error());
  a.recv_x = recv;
  CHECK(tu_is_poison(recv, sizeof(float) * 64 * 16), "a failed dispatch wrote recv_x");

  fresh_handle_refuses(comm, &a, recv);

  /* Values out of their documented domain. */
  epx_routing_t neg = rt;
  neg.num_tokens = -1;
  CHECK_STATUS(epx_dispatch(comm, h, &neg, &a), EPX_ERR_INVALID_ARGUMENT, "num_tokens -1");
  epx_routing_t bad_idx = rt;
  bad_idx.idx_dtype = EPX_FLOAT32;
  CHECK_STATUS(epx_dispatch(comm, h, &bad_idx, &a), EPX_ERR_INVALID_ARGUMENT, "idx_dtype float32");
  a.x_dtype = EPX_INT32, a.recv_dtype = EPX_INT32;
  CHECK_STATUS(epx_dispatch(comm, h, &rt, &a), EPX_ERR_INVALID_ARGUMENT, "x_dtype int32");
  a.x_dtype = EPX_FLOAT32, a.recv_dtype = EPX_BFLOAT16;
  CHECK_STATUS(epx_dispatch(comm, h, &rt, &a), EPX_ERR_INVALID_ARGUMENT, "recv_dtype bf16 for f32 tokens");
  a.recv_dtype = EPX_FLOAT32;
  CHECK(tu_is_poison(recv, sizeof(float) * 64 * 16), "a failed dispatch wrote recv_x");

  /* The comm is fine after all that. */
  CHECK_STATUS(epx_dispatch(comm, h, &rt, &a), EPX_SUCCESS, "a valid dispatch after the bad ones");
  float *out = tu_alloc_poison(sizeof(float) * 6 * 16);
  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = recv, ca.y_dtype = EPX_FLOAT32, ca.out = out, ca.out_dtype = EPX_FLOAT32;
  CHECK_STATUS(epx_combine(comm, h, NULL), EPX_ERR_NULL_POINTER, "combine args NULL");
  CHECK_STATUS(epx_combine(NULL, h, &ca), EPX_ERR_NULL_POINTER, "combine comm NULL");
  CHECK_STATUS(epx_combine(comm, NULL, &ca), EPX_ERR_NULL_POINTER, "combine handle NULL");
  ca.y = NULL;
  CHECK_STATUS(epx_combine(comm, h, &ca), EPX_ERR_NULL_POINTER, "combine y NULL");
  ca.y = recv, ca.out = NULL;
  CHECK_STATUS(epx_combine(comm, h, &ca), EPX_ERR_NULL_POINTER, "combine out NULL");
  ca.out = out;
  CHECK(tu_is_poison(out, sizeof(float) * 6 * 16), "a failed combine wrote out");
  CHECK_STATUS(epx_combine(comm, h, &ca), EPX_SUCCESS, "a valid combine after the bad ones");
  CHECK_STATUS(epx_comm_synchronize(comm), EPX_SUCCESS, "the host backend reports at each call: synchronize succeeds");
  CHECK_STATUS(epx_comm_set_stream(comm, NULL), EPX_SUCCESS, "the host backend ignores streams");
  free(out);
  free(recv);
  tu_moe_free(&m);
  teardown(&s);
}

static epx_status_t fresh_thread(int r, void *arg) {
  (void)r, (void)arg;
  const char *e = epx_last_error();
  CHECK(e && e[0] == '\0', "epx_last_error() on a fresh thread is \"%s\", want \"\"", e ? e : "(null)");
  return EPX_SUCCESS;
}

static void status_strings(void) {
  static const char *names[EPX_NUM_STATUS] = {
      "EPX_SUCCESS",          "EPX_ERR_INVALID_ARGUMENT", "EPX_ERR_NULL_POINTER",     "EPX_ERR_EXPERT_OUT_OF_RANGE",
      "EPX_ERR_EXPERTS_NOT_DIVISIBLE", "EPX_ERR_TOPK_RANGE", "EPX_ERR_HIDDEN_RANGE", "EPX_ERR_ROW_ALIGNMENT",
      "EPX_ERR_OUTPUT_TOO_SMALL", "EPX_ERR_LL_OVERFLOW",   "EPX_ERR_CONFIG_MISMATCH",  "EPX_ERR_TIMEOUT",
      "EPX_ERR_PEER_LOST",    "EPX_ERR_UNSUPPORTED",      "EPX_ERR_OUT_OF_MEMORY",    "EPX_ERR_SYSTEM",
      "EPX_ERR_CUDA",         "EPX_ERR_BROKEN",           "EPX_ERR_INTERNAL",         "EPX_ERR_OUT_OF_STEP",
      "EPX_ERR_BUSY"};
  for (int i = 0; i < EPX_NUM_STATUS; i++) {
    const char *s = epx_status_string((epx_status_t)i);
    CHECK(s != NULL, "epx_status_string(%d) is NULL", i);
    if (!s) continue;
    CHECK(strncmp(s, names[i], strlen(names[i])) == 0 &&
              (s[strlen(names[i])] == '\0' || s[strlen(names[i])] == ':'),
          "epx_status_string(%d) = \"%s\" does not name %s", i, s, names[i]);
    for (int j = 0; j < i; j++) {
      const char *o = epx_status_string((epx_status_t)j);
      CHECK(!o || strcmp(s, o) != 0, "statuses %d and %d share the string \"%s\"", i, j, s);
    }
  }
  CHECK(epx_status_string(EPX_NUM_STATUS) != NULL, "epx_status_string(EPX_NUM_STATUS) is NULL");
  CHECK(epx_status_string((epx_status_t)12345) != NULL, "epx_status_string(12345) is NULL");
  CHECK(epx_status_string((epx_status_t)-1) != NULL, "epx_status_string(-1) is NULL");
  epx_run_ranks(1, fresh_thread, NULL, NULL);
}

int main(void) {
  tu_begin("test_errors");
  status_strings();
  null_and_invalid();
  expert_out_of_range();
  config_errors();
  row_alignment();
  output_too_small(EPX_LAYOUT_TOKEN, 1);
  output_too_small(EPX_LAYOUT_EXPERT, 16);
  ll_overflow();
  one_bad_rank();
  return tu_end();
}
