/* test_nodes: groups of several nodes (config.ranks_per_node) on the host backend.
 *
 *   forward   notify / dispatch / stand-in experts / combine for (R, ranks_per_node) in
 *             (4, 2), (8, 4), (16, 4), (6, 3), uneven token counts (one rank without tokens),
 *             token and expert layouts, the all-to-all baseline, low-latency mode, fp8
 *             dispatch: the output bit for bit against dense_moe in the node-aware order
 *             (low-latency mode: the flat order), and the node traffic against a count made
 *             here from the routing.
 *   one node  ranks_per_node = R and = 0 give today's (flat) dense_moe bits; with several
 *             nodes a bf16 partial combined into float32 differs from the flat order somewhere
 *             (so the node order is really what runs).
 *   backward  combine's backward (the dispatch replayed on a gradient, scale_by_probs in the
 *             expert layout) is a copy, and dispatch's backward (combine unweighted of row
 *             gradients, with weight gradients) follows the node-aware order; both checked
 *             against sums written out here from the contract.
 *   config    ranks_per_node that does not divide R, negative, above R, or different on two
 *             ranks is refused on every rank. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { L = 3, K = 4, H = 32 };

typedef struct {
  int R, P;
} nodes_t;

static const nodes_t kLayouts[] = {{4, 2}, {8, 4}, {16, 4}, {6, 3}};
#define NLAYOUTS ((int)(sizeof kLayouts / sizeof kLayouts[0]))

typedef struct {
  const char *name;
  struct {
    epx_algo_t algo;
    epx_layout_t layout;
    int align;
  } path;
  epx_dtype_t x, recv, y, out;
} scenario_t;

static const scenario_t kScenarios[] = {
    {"HT token f32", {EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1}, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32},
    {"HT token bf16", {EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1}, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16},
    {"HT token bf16 -> f32 out", {EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1}, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16,
     EPX_FLOAT32},
    {"HT expert bf16 align 4", {EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 4}, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16,
     EPX_BFLOAT16},
    {"HT expert fp8 -> f32 out", {EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 1}, EPX_BFLOAT16, EPX_FP8_E4M3, EPX_BFLOAT16,
     EPX_FLOAT32},
    {"HT token fp8", {EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1}, EPX_BFLOAT16, EPX_FP8_E4M3, EPX_BFLOAT16, EPX_BFLOAT16},
    {"all-to-all token bf16", {EPX_ALGO_ALLTOALL, EPX_LAYOUT_TOKEN, 1}, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16,
     EPX_FLOAT32},
    {"LL bf16", {EPX_ALGO_LL, EPX_LAYOUT_EXPERT, 1}, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, EPX_FLOAT32},
    {"LL fp8", {EPX_ALGO_LL, EPX_LAYOUT_EXPERT, 1}, EPX_BFLOAT16, EPX_FP8_E4M3, EPX_BFLOAT16, EPX_BFLOAT16},
};
#define NSCEN ((int)(sizeof kScenarios / sizeof kScenarios[0]))

static const int kMaxTokens = 24;

/* Uneven token counts, one rank with none. */
static void random_input(tu_moe_t *m, int R, epx_dtype_t x) {
  int64_t T[TU_MAX_RANKS];
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 1, kMaxTokens);
  T[tu_int(&tu_rng, 0, R - 1)] = 0;
  tu_route_opts_t o = tu_route_default();
  tu_moe_random(m, &tu_rng, R, R * L, H, K, x, T, &o, 1);
}

static epx_status_t world_for(tu_world_t *w, int R, int ranks_per_node) {
  epx_config_t cfg = tu_config(R * L, H, K, kMaxTokens);
  cfg.ranks_per_node = ranks_per_node;
  return tu_world_create(w, R, &cfg, NULL, NULL);
}

/* dense_moe's output for the pipeline `p` in the order of `ranks_per_node`. */
static void dense_for(const tu_moe_t *m, const tu_pipe_t *p, int ranks_per_node, void **out) {
  const int expert = p->algo == EPX_ALGO_LL || p->layout == EPX_LAYOUT_EXPERT;
  dense_cfg_t c = {.nranks = m->R, .num_experts = m->E, .hidden = m->H, .topk = m->K, .x_dtype = m->x_dtype,
                   .recv_dtype = p->recv_dtype, .y_dtype = p->y_dtype, .out_dtype = p->out_dtype,
                   .expert_layout = expert, .ranks_per_node = ranks_per_node};
  for (int r = 0; r < m->R; r++) out[r] = tu_alloc_poison((size_t)(m->T[r] * m->H) * epx_dtype_size(p->out_dtype));
  CHECK(dense_moe(&c, m->T, (const void *const *)m->x, (const int32_t *const *)m->idx,
                  (const float *const *)m->w, out) == 0,
        "dense_moe refused its input");
}

/* What crosses into rank r on its way, counted from the routing: as a source, its tokens'
 * (token, remote node) and (token, remote rank) pairs (combine brings those back); as a
 * receiver, the tokens of its rail sources on other nodes that come to its node (what it
 * forwards) and the tokens of other nodes' ranks that come to it (one crossing per rank). */
typedef struct {
  int64_t back_nodes, back_ranks, forwarded, arrived;
} crossings_t;

static int token_hits(const tu_moe_t *m, int s, int64_t t, int rank_lo, int rank_hi) {
  for (int k = 0; k < K; k++) {
    const int e = m->idx[s][t * K + k];
    if (e >= 0 && e / L >= rank_lo && e / L < rank_hi) return 1;
  }
  return 0;
}

static crossings_t count_crossings(const tu_moe_t *m, int r, int P) {
  crossings_t c = {0, 0, 0, 0};
  const int node = r / P;
  for (int n = 0; n < m->R / P; n++)
    for (int64_t t = 0; t < m->T[r] && n != node; t++) {
      c.back_nodes += token_hits(m, r, t, n * P, (n + 1) * P);
      for (int d = n * P; d < (n + 1) * P; d++) c.back_ranks += token_hits(m, r, t, d, d + 1);
    }
  for (int s = 0; s < m->R; s++)
    for (int64_t t = 0; t < m->T[s] && s / P != node; t++) {
      if (s % P == r % P) c.forwarded += token_hits(m, s, t, node * P, (node + 1) * P);
      c.arrived += token_hits(m, s, t, r, r + 1);
    }
  return c;
}

static void check_traffic(const char *what, const tu_moe_t *m, const scenario_t *sc, int P, epx_handle_t *const *h) {
  const int ll = sc->path.algo == EPX_ALGO_LL;
  const int64_t drow = (int64_t)H * epx_dtype_size(sc->recv) +
                       (sc->recv == EPX_FP8_E4M3 ? (int64_t)sizeof(float) * tu_nblocks(H) : 0);
  const int64_t crow = (int64_t)H * epx_dtype_size(sc->y);
  for (int r = 0; r < m->R; r++) {
    const crossings_t c = count_crossings(m, r, P);
    epx_node_traffic_t t;
    CHECK_STATUS(epx_handle_node_traffic(h[r], &t), EPX_SUCCESS, "%s rank %d node traffic", what, r);
    const int64_t in = (ll ? c.arrived : c.forwarded) * drow, back = (ll ? c.back_ranks : c.back_nodes) * crow;
    CHECK(t.dispatch_bytes == in && t.dispatch_bytes_per_rank == c.arrived * drow,
          "%s rank %d: dispatch brought %lld bytes across nodes (per rank %lld), want %lld (%lld)", what, r,
          (long long)t.dispatch_bytes, (long long)t.dispatch_bytes_per_rank, (long long)in,
          (long long)(c.arrived * drow));
    CHECK(t.combine_bytes == back && t.combine_bytes_per_rank == c.back_ranks * crow,
          "%s rank %d: combine brought %lld bytes across nodes (per rank %lld), want %lld (%lld)", what, r,
          (long long)t.combine_bytes, (long long)t.combine_bytes_per_rank, (long long)back,
          (long long)(c.back_ranks * crow));
  }
}

/* One scenario on one (R, P): the pipeline's output against dense_moe in the order the
 * contract gives (`dense_P`), and its node traffic. Returns whether any output element
 * differs from the flat order's (for the "the order is real" check). */
static int run_forward(const scenario_t *sc, int R, int P, int dense_P) {
  char what[200];
  snprintf(what, sizeof what, "[%s R=%d ranks_per_node=%d]", sc->name, R, P);
  tu_moe_t m;
  random_input(&m, R, sc->x);
  tu_world_t w;
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  int differs_from_flat = 0;
  if (CHECK_STATUS(world_for(&w, R, P), EPX_SUCCESS, "%s world", what)) {
    epx_handle_config_t hc = tu_handle_config(sc->path.algo, sc->path.layout, sc->path.align);
    if (CHECK_STATUS(tu_handles_create(&w, &hc, h), EPX_SUCCESS, "%s handles", what)) {
      tu_pipe_t p = tu_pipe_default();
      p.algo = sc->path.algo, p.layout = sc->path.layout, p.align = sc->path.align;
      p.recv_dtype = sc->recv, p.y_dtype = sc->y, p.out_dtype = sc->out;
      tu_pipe_res_t res;
      int rc = tu_pipe_run(&w, h, &m, &p, &res);
      CHECK(rc == 0, "%s: the pipeline failed (rank 0: %s)", what, res.err[0]);
      if (rc == 0) {
        void *want[TU_MAX_RANKS], *flat[TU_MAX_RANKS];
        dense_for(&m, &p, dense_P, want);
        dense_for(&m, &p, 0, flat);
        for (int r = 0; r < R; r++) {
          char ww[300];
          snprintf(ww, sizeof ww, "%s rank %d out vs dense_moe", what, r);
          CHECK_BITS(ww, sc->out, res.out[r], want[r], m.T[r] * H, H);
          differs_from_flat |= tu_first_diff(res.out[r], flat[r], epx_dtype_size(sc->out), m.T[r] * H) >= 0;
        }
        tu_free_all(want, R);
        tu_free_all(flat, R);
        check_traffic(what, &m, sc, P ? P : R, h);
      }
      tu_pipe_free(&res, R);
    }
    tu_handles_destroy(&w, h);
  }
  tu_world_destroy(&w);
  tu_moe_free(&m);
  return differs_from_flat;
}

static void test_forward(void) {
  for (int i = 0; i < NLAYOUTS; i++)
    for (int s = 0; s < NSCEN; s++) {
      const scenario_t *sc = &kScenarios[s];
      const int P = kLayouts[i].P, ll = sc->path.algo == EPX_ALGO_LL;
      run_forward(sc, kLayouts[i].R, P, ll ? 0 : P);
    }
}

/* One node, spelled both ways, is today's flat order; several nodes are not. */
static void test_one_node(void) {
  for (int i = 0; i < NLAYOUTS; i++) {
    const int R = kLayouts[i].R;
    for (int s = 0; s < NSCEN; s++) {
      run_forward(&kScenarios[s], R, R, 0);
      run_forward(&kScenarios[s], R, 0, 0);
    }
  }
  /* a bf16 partial rounded at the node boundary, summed into float32: with 16 ranks in 4
   * nodes and ~20 tokens per rank some element differs from the flat sum */
  int differs = 0;
  for (int rep = 0; rep < 3 && !differs; rep++) differs = run_forward(&kScenarios[2], 16, 4, 4);
  CHECK(differs, "16 ranks in nodes of 4: every combine output equals the flat order's (is the node order applied?)");
}

/* ---- backward ------------------------------------------------------------------------- */

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
  const tu_moe_t *m;
  int expert;
  epx_dtype_t dt;
  int64_t cap[TU_MAX_RANKS];
  void *g[TU_MAX_RANKS], *gx[TU_MAX_RANKS]; /* grad of out [T, H]; grad of the expert rows [cap, H] */
  float *rwg[TU_MAX_RANKS];                 /* row weight gradients */
  void *dx[TU_MAX_RANKS], *G[TU_MAX_RANKS]; /* dispatch's and combine's backward */
  float *dw[TU_MAX_RANKS], *Gp[TU_MAX_RANKS];
  epx_status_t st[TU_MAX_RANKS];
  char err[TU_MAX_RANKS][256];
} bw_t;

/* Dispatch's backward (combine, unweighted, of the row gradients with their weight
 * gradients), then combine's backward (the dispatch replayed on g). */
static epx_status_t bw_rank(int r, void *arg) {
  bw_t *c = arg;
  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = c->gx[r], ca.y_dtype = c->dt, ca.out = c->dx[r], ca.out_dtype = c->dt, ca.weighted = 0;
  ca.row_weight_grad = c->rwg[r], ca.topk_weight_grad = c->dw[r];
  c->st[r] = epx_combine(c->w->comm[r], c->h[r], &ca);
  if (c->st[r] == EPX_SUCCESS) {
    epx_dispatch_args_t da;
    epx_dispatch_args_init(&da);
    da.x = c->g[r], da.x_dtype = c->dt, da.recv_dtype = c->dt, da.recv_x = c->G[r], da.recv_capacity = c->cap[r];
    da.recv_probs = c->expert ? c->Gp[r] : NULL, da.scale_by_probs = c->expert;
    c->st[r] = epx_dispatch(c->w->comm[r], c->h[r], NULL, &da);
  }
  if (c->st[r] != EPX_SUCCESS) snprintf(c->err[r], sizeof c->err[r], "%s", epx_last_error());
  return c->st[r];
}

/* Rows of (s, t) and of (s, t, k) on every destination: tok[d][s][t], pair[d][s][t * K + k]. */
typedef struct {
  int64_t *tok[TU_MAX_RANKS][TU_MAX_RANKS], *pair[TU_MAX_RANKS][TU_MAX_RANKS];
} rowmap_t;

static void rowmap_make(rowmap_t *rm, const tu_moe_t *m, const tu_expect_t *ex) {
  for (int d = 0; d < m->R; d++) {
    for (int s = 0; s < m->R; s++) {
      rm->tok[d][s] = malloc(sizeof(int64_t) * (size_t)(m->T[s] + 1));
      rm->pair[d][s] = malloc(sizeof(int64_t) * (size_t)(m->T[s] * K + 1));
      for (int64_t i = 0; i < m->T[s]; i++) rm->tok[d][s][i] = -1;
      for (int64_t i = 0; i < m->T[s] * K; i++) rm->pair[d][s][i] = -1;
    }
    for (int64_t n = 0; n < ex[d].ntok; n++) rm->tok[d][ex[d].tok_rows[n].src][ex[d].tok_rows[n].tok] = n;
    for (int64_t n = 0; n < ex[d].nrows; n++) {
      const tu_row_t *pr = &ex[d].pair_rows[n];
      if (pr->src >= 0) rm->pair[d][pr->src][pr->tok * K + pr->k] = n;
    }
  }
}

static void rowmap_free(rowmap_t *rm, int R) {
  for (int d = 0; d < R; d++)
    for (int s = 0; s < R; s++) free(rm->tok[d][s]), free(rm->pair[d][s]);
}

/* What destination d sends back for (s, t) in channel cc; 0 when the token is not there. */
static int returned_value(const bw_t *c, const rowmap_t *rm, int d, int s, int64_t t, int cc, float *v) {
  const tu_moe_t *m = c->m;
  if (!c->expert) {
    const int64_t n = rm->tok[d][s][t];
    if (n >= 0) *v = tu_load(c->dt, c->gx[d], (size_t)(n * H + cc));
    return n >= 0;
  }
  float part = 0.0f;
  int any = 0;
  for (int l = 0; l < L; l++)
    for (int k = 0; k < K; k++)
      if (m->idx[s][t * K + k] == d * L + l) {
        any = 1;
        part = part + tu_load(c->dt, c->gx[d], (size_t)(rm->pair[d][s][t * K + k] * H + cc));
      }
  *v = tu_round(c->dt, part);
  return any;
}

/* dx: node partials in node order, each its ranks' rows in rank order, rounded where it
 * crossed a node boundary; dw: each slot's row weight gradient. */
static void check_dispatch_backward(const char *what, const bw_t *c, const rowmap_t *rm, int P) {
  const tu_moe_t *m = c->m;
  for (int s = 0; s < m->R; s++) {
    long bad_dx = 0, bad_dw = 0;
    for (int64_t t = 0; t < m->T[s]; t++) {
      for (int cc = 0; cc < H; cc++) {
        float acc = 0.0f;
        for (int n = 0; n < m->R / P; n++) {
          float sub = 0.0f, v;
          int any = 0;
          for (int d = n * P; d < (n + 1) * P; d++)
            if (returned_value(c, rm, d, s, t, cc, &v)) sub = sub + v, any = 1;
          if (any) acc = acc + (n == s / P ? sub : tu_round(c->dt, sub));
        }
        const float want = tu_round(c->dt, acc), got = tu_load(c->dt, c->dx[s], (size_t)(t * H + cc));
        bad_dx += memcmp(&want, &got, sizeof want) != 0;
      }
      for (int k = 0; k < K; k++) {
        const int e = m->idx[s][t * K + k];
        float want = 0.0f;
        if (e >= 0) {
          const int d = e / L;
          want = c->expert ? c->rwg[d][rm->pair[d][s][t * K + k]] : c->rwg[d][rm->tok[d][s][t] * K + k];
        }
        bad_dw += memcmp(&want, &c->dw[s][t * K + k], sizeof want) != 0;
      }
    }
    CHECK(bad_dx == 0, "%s rank %d: %ld elements of dispatch's backward (dx) differ from the node-aware sum", what, s,
          bad_dx);
    CHECK(bad_dw == 0, "%s rank %d: %ld topk_weight_grad entries are not their slot's row gradient", what, s, bad_dw);
  }
}

/* The replay: a copy of g per row (expert layout: round(p * g), padding 0). */
static void check_combine_backward(const char *what, const bw_t *c, const tu_expect_t *ex) {
  const tu_moe_t *m = c->m;
  for (int d = 0; d < m->R; d++) {
    long bad = 0;
    const int64_t N = c->expert ? ex[d].nrows : ex[d].ntok;
    for (int64_t n = 0; n < N; n++) {
      const tu_row_t *er = c->expert ? &ex[d].pair_rows[n] : &ex[d].tok_rows[n];
      const float p = er->src >= 0 && c->expert ? m->w[er->src][er->tok * K + er->k] : 1.0f;
      for (int cc = 0; cc < H; cc++) {
        float want = 0.0f;
        if (er->src >= 0) want = tu_load(c->dt, c->g[er->src], (size_t)(er->tok * H + cc));
        if (er->src >= 0 && c->expert) want = tu_round(c->dt, p * want);
        const float got = tu_load(c->dt, c->G[d], (size_t)(n * H + cc));
        bad += memcmp(&want, &got, sizeof want) != 0;
      }
      if (c->expert) bad += c->Gp[d][n] != (er->src >= 0 ? p : 0.0f);
    }
    CHECK(bad == 0, "%s rank %d: %ld elements of combine's backward (the replayed dispatch) differ", what, d, bad);
  }
}

static void bw_alloc(bw_t *c, const tu_pipe_res_t *res) {
  const tu_moe_t *m = c->m;
  const size_t es = epx_dtype_size(c->dt);
  for (int r = 0; r < m->R; r++) {
    const int64_t cap = c->cap[r] = res->cap[r], nw = c->expert ? cap : cap * K;
    c->g[r] = tu_alloc_poison((size_t)(m->T[r] * H) * es);
    c->gx[r] = tu_alloc_poison((size_t)(cap * H) * es);
    c->rwg[r] = tu_alloc_poison(sizeof(float) * (size_t)nw);
    c->dx[r] = tu_alloc_poison((size_t)(m->T[r] * H) * es);
    c->G[r] = tu_alloc_poison((size_t)(cap * H) * es);
    c->dw[r] = tu_alloc_poison(sizeof(float) * (size_t)(m->T[r] * K));
    c->Gp[r] = tu_alloc_poison(sizeof(float) * (size_t)cap);
    for (int64_t i = 0; i < m->T[r] * H; i++) tu_store(c->dt, c->g[r], (size_t)i, tu_value(&tu_rng));
    for (int64_t i = 0; i < cap * H; i++) tu_store(c->dt, c->gx[r], (size_t)i, tu_value(&tu_rng));
    for (int64_t i = 0; i < nw; i++) c->rwg[r][i] = tu_value(&tu_rng);
  }
}

static void bw_free(bw_t *c, int R) {
  for (int r = 0; r < R; r++) {
    void *bufs[] = {c->g[r], c->gx[r], c->rwg[r], c->dx[r], c->G[r], c->dw[r], c->Gp[r]};
    tu_free_all(bufs, (int)(sizeof bufs / sizeof *bufs));
  }
}

static void run_backward(int R, int P, epx_layout_t layout, epx_dtype_t dt) {
  char what[160];
  snprintf(what, sizeof what, "[backward %s %s R=%d ranks_per_node=%d]", layout == EPX_LAYOUT_EXPERT ? "expert" : "token",
           tu_dtype(dt), R, P);
  tu_moe_t m;
  random_input(&m, R, dt);
  tu_world_t w;
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  bw_t c;
  memset(&c, 0, sizeof c);
  c.m = &m, c.expert = layout == EPX_LAYOUT_EXPERT, c.dt = dt;
  if (CHECK_STATUS(world_for(&w, R, P), EPX_SUCCESS, "%s world", what)) {
    epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, layout, 1);
    if (CHECK_STATUS(tu_handles_create(&w, &hc, h), EPX_SUCCESS, "%s handles", what)) {
      tu_pipe_t p = tu_pipe_default();
      p.layout = layout, p.recv_dtype = dt, p.y_dtype = dt, p.out_dtype = dt, p.combine = 0;
      tu_pipe_res_t res;
      const int rc = tu_pipe_run(&w, h, &m, &p, &res);
      CHECK(rc == 0, "%s: forward dispatch failed (%s)", what, res.err[0]);
      if (rc == 0) {
        c.w = &w, c.h = h;
        bw_alloc(&c, &res);
        epx_run_ranks(R, bw_rank, &c, NULL);
        int ok = 1;
        for (int r = 0; r < R; r++) ok &= CHECK_STATUS(c.st[r], EPX_SUCCESS, "%s rank %d (%s)", what, r, c.err[r]);
        if (ok) {
          rowmap_t rm;
          rowmap_make(&rm, &m, res.ex);
          check_dispatch_backward(what, &c, &rm, P);
          check_combine_backward(what, &c, res.ex);
          rowmap_free(&rm, R);
        }
        bw_free(&c, R);
      }
      tu_pipe_free(&res, R);
    }
    tu_handles_destroy(&w, h);
  }
  tu_world_destroy(&w);
  tu_moe_free(&m);
}

static void test_backward(void) {
  for (int i = 0; i < NLAYOUTS; i++) {
    run_backward(kLayouts[i].R, kLayouts[i].P, EPX_LAYOUT_TOKEN, EPX_BFLOAT16);
    run_backward(kLayouts[i].R, kLayouts[i].P, EPX_LAYOUT_EXPERT, EPX_BFLOAT16);
    run_backward(kLayouts[i].R, kLayouts[i].P, EPX_LAYOUT_EXPERT, EPX_FLOAT32);
  }
  run_backward(8, 8, EPX_LAYOUT_EXPERT, EPX_BFLOAT16);
}

static void test_config(void) {
  const int R = 6;
  tu_world_t w;
  const int bad[] = {4, -1, 7};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    epx_status_t st[TU_MAX_RANKS];
    epx_config_t cfg = tu_config(R * L, H, K, 8);
    cfg.ranks_per_node = bad[i];
    CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, st), EPX_ERR_INVALID_ARGUMENT, "ranks_per_node %d of %d ranks",
                 bad[i], R);
    for (int r = 0; r < R; r++)
      CHECK_STATUS(st[r], EPX_ERR_INVALID_ARGUMENT, "ranks_per_node %d: rank %d", bad[i], r);
    tu_world_destroy(&w);
  }
  /* rank 4 says nodes of 3, the others nodes of 2: a mismatch on every rank, naming the field */
  epx_config_t cfgs[TU_MAX_RANKS];
  epx_status_t st[TU_MAX_RANKS];
  for (int r = 0; r < R; r++) {
    cfgs[r] = tu_config(R * L, H, K, 8);
    cfgs[r].ranks_per_node = r == 4 ? 3 : 2;
  }
  CHECK_STATUS(tu_world_create(&w, R, NULL, cfgs, st), EPX_ERR_CONFIG_MISMATCH, "ranks_per_node 2 vs 3");
  for (int r = 0; r < R; r++) CHECK_STATUS(st[r], EPX_ERR_CONFIG_MISMATCH, "ranks_per_node 2 vs 3: rank %d", r);
  tu_world_destroy(&w);
  /* 0 and R mean the same (one node): they agree, and the comm reports R */
  for (int r = 0; r < R; r++) cfgs[r].ranks_per_node = r % 2 ? R : 0;
  if (CHECK_STATUS(tu_world_create(&w, R, NULL, cfgs, st), EPX_SUCCESS, "ranks_per_node 0 and %d", R))
    for (int r = 0; r < R; r++)
      CHECK(epx_comm_config(w.comm[r])->ranks_per_node == R, "rank %d: ranks_per_node %d after defaults, want %d", r,
            epx_comm_config(w.comm[r])->ranks_per_node, R);
  tu_world_destroy(&w);
  epx_node_traffic_t t;
  CHECK_STATUS(epx_handle_node_traffic(NULL, &t), EPX_ERR_NULL_POINTER, "node traffic of no handle");
}

int main(void) {
  tu_begin("test_nodes");
  test_config();
  test_forward();
  test_one_node();
  test_backward();
  return tu_end();
}
