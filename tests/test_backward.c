/* test_backward: the backward identities, through one full forward and backward pass of the
 * stand-in MoE layer, checked against the hand-derived gradient of the dense MoE (float64):
 *
 *   forward   out[t] = sum_k w[t][k] * s(e_k) * x[t]      (s = dense_expert_scale)
 *   loss      sum_t <g[t], out[t]>
 *   dx[t]     = sum_k w[t][k] * s(e_k) * g[t]
 *   dw[t][k]  = s(e_k) * <g[t], x[t]>                     (0 for a -1 slot)
 *
 * through epx: combine's backward is epx_dispatch(routing NULL) of g (expert layout:
 * scale_by_probs gives p * g), the experts' backward runs on the received rows, dispatch's
 * backward is epx_combine(weighted 0) of the row gradients with row_weight_grad ->
 * topk_weight_grad. Where the result is a copy or a defined float32 sum it is also checked bit
 * for bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { R = 4, L = 3, E = R * L, K = 4, H = 32 };

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
  const tu_moe_t *m;
  epx_layout_t layout;
  int align;
  epx_dtype_t dt; /* every activation and gradient */
  void *g[R];     /* grad_out [T, H] */
  /* per rank results */
  int64_t rows[R];
  void *recv_x[R], *y[R], *G[R], *Gs[R], *gx[R], *out[R], *dx[R];
  int32_t *recv_idx[R], *cnt[R];
  float *recv_w[R], *recv_p[R], *dwr[R], *dw[R];
  epx_status_t st[R];
  char err[R][256];
  const char *failed_call[R];
} bw_t;

static size_t dsize(epx_dtype_t t) { return t == EPX_FLOAT32 ? 4 : 2; }

static int step(bw_t *c, int r, const char *call, epx_status_t s) {
  if (s != EPX_SUCCESS && c->st[r] == EPX_SUCCESS) {
    c->st[r] = s;
    c->failed_call[r] = call;
    snprintf(c->err[r], sizeof c->err[r], "%s", epx_last_error());
  }
  return tu_barrier_vote(c->st[r] != EPX_SUCCESS);
}

/* The experts' backward on rank r's N received rows: the row gradients gx from the replayed
 * G (expert layout: Gs, already scaled by p) and the row weight gradients dwr. */
static void experts_backward(bw_t *c, int r, int64_t N) {
  const int expert = c->layout == EPX_LAYOUT_EXPERT;
  const epx_dtype_t dt = c->dt;
  if (!expert) {
    for (int64_t n = 0; n < N; n++) {
      for (int cc = 0; cc < H; cc++) {
        float acc = 0.0f;
        for (int k = 0; k < K; k++) {
          const int32_t li = c->recv_idx[r][n * K + k];
          if (li < 0 || li >= L) continue;
          const float s = dense_expert_scale(r * L + li), p = c->recv_w[r][n * K + k] * s;
          acc = acc + p * tu_load(dt, c->G[r], (size_t)(n * H + cc));
        }
        tu_store(dt, c->gx[r], (size_t)(n * H + cc), acc);
      }
      for (int k = 0; k < K; k++) {
        const int32_t li = c->recv_idx[r][n * K + k];
        double dot = 0.0;
        for (int cc = 0; cc < H; cc++)
          dot += (double)tu_load(dt, c->G[r], (size_t)(n * H + cc)) * tu_load(dt, c->recv_x[r], (size_t)(n * H + cc));
        /* Slots of other ranks: 0 (this rank's weight there was 0). */
        c->dwr[r][n * K + k] = li >= 0 && li < L ? (float)(dense_expert_scale(r * L + li) * dot) : 0.0f;
      }
    }
  } else {
    int64_t pos = 0;
    for (int64_t n = 0; n < N; n++) { /* padding rows: NaN, never read */
      for (int cc = 0; cc < H; cc++) tu_store_nan(dt, c->gx[r], (size_t)(n * H + cc));
      c->dwr[r][n] = NAN;
    }
    for (int l = 0; l < L; l++) {
      const float s = dense_expert_scale(r * L + l);
      for (int64_t i = 0; i < c->cnt[r][l] && pos + i < N; i++) {
        const int64_t n = pos + i;
        double dot = 0.0;
        for (int cc = 0; cc < H; cc++) {
          tu_store(dt, c->gx[r], (size_t)(n * H + cc), s * tu_load(dt, c->Gs[r], (size_t)(n * H + cc)));
          dot += (double)tu_load(dt, c->G[r], (size_t)(n * H + cc)) * tu_load(dt, c->y[r], (size_t)(n * H + cc));
        }
        c->dwr[r][n] = (float)dot;
      }
      pos += (c->cnt[r][l] + c->align - 1) / c->align * c->align;
    }
  }
}

static epx_status_t bw_rank(int r, void *arg) {
  bw_t *c = arg;
  const tu_moe_t *m = c->m;
  epx_comm_t *comm = c->w->comm[r];
  epx_handle_t *h = c->h[r];
  const int expert = c->layout == EPX_LAYOUT_EXPERT;
  const epx_dtype_t dt = c->dt;
  const size_t es = dsize(dt);
  c->st[r] = EPX_SUCCESS;

  epx_routing_t rt = tu_routing(m, r, TU_FORM_TOPK32);
  if (step(c, r, "epx_notify", epx_notify(comm, h, &rt))) return c->st[r];
  epx_handle_info_t info;
  if (step(c, r, "epx_handle_info", epx_handle_info(h, &info, NULL))) return c->st[r];
  const int64_t N = expert ? info.num_recv_rows : info.num_recv_tokens;
  c->rows[r] = N;
  const size_t rowsz = (size_t)(N * H) * es;
  c->recv_x[r] = tu_alloc_poison(rowsz), c->y[r] = tu_alloc_poison(rowsz), c->G[r] = tu_alloc_poison(rowsz);
  c->Gs[r] = tu_alloc_poison(rowsz), c->gx[r] = tu_alloc_poison(rowsz);
  c->recv_idx[r] = tu_alloc_poison(sizeof(int32_t) * (size_t)(N * K));
  c->recv_w[r] = tu_alloc_poison(sizeof(float) * (size_t)(N * K));
  c->recv_p[r] = tu_alloc_poison(sizeof(float) * (size_t)N);
  c->cnt[r] = tu_alloc_poison(sizeof(int32_t) * L);
  c->dwr[r] = tu_alloc_poison(sizeof(float) * (size_t)(N * (expert ? 1 : K)));
  c->out[r] = tu_alloc_poison((size_t)(m->T[r] * H) * es);
  c->dx[r] = tu_alloc_poison((size_t)(m->T[r] * H) * es);
  c->dw[r] = tu_alloc_poison(sizeof(float) * (size_t)(m->T[r] * K));

  /* Forward: dispatch (replaying the notified plan), experts, weighted combine. */
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = m->x[r], a.x_dtype = dt, a.recv_dtype = dt, a.recv_x = c->recv_x[r], a.recv_capacity = N;
  if (expert)
    a.recv_probs = c->recv_p[r];
  else
    a.recv_topk_idx = c->recv_idx[r], a.recv_topk_weights = c->recv_w[r];
  a.tokens_per_local_expert = c->cnt[r];
  if (step(c, r, "epx_dispatch (forward)", epx_dispatch(comm, h, NULL, &a))) return c->st[r];
  if (expert)
    tu_expert_rows(r, L, H, dt, c->recv_x[r], NULL, c->cnt[r], c->align, 0, N, dt, c->y[r]);
  else
    tu_expert_token_layout(r, L, H, K, N, dt, c->recv_x[r], NULL, c->recv_idx[r], c->recv_w[r], dt, c->y[r]);
  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = c->y[r], ca.y_dtype = dt, ca.out = c->out[r], ca.out_dtype = dt, ca.weighted = 1;
  if (step(c, r, "epx_combine (forward)", epx_combine(comm, h, &ca))) return c->st[r];

  /* Combine's backward: the cached dispatch of g, plain and (expert layout) scaled by p. */
  epx_dispatch_args_t b;
  epx_dispatch_args_init(&b);
  b.x = c->g[r], b.x_dtype = dt, b.recv_dtype = dt, b.recv_x = c->G[r], b.recv_capacity = N;
  if (step(c, r, "epx_dispatch (replay of g)", epx_dispatch(comm, h, NULL, &b))) return c->st[r];
  if (expert) {
    b.recv_x = c->Gs[r], b.scale_by_probs = 1;
    if (step(c, r, "epx_dispatch (replay of g, scale_by_probs)", epx_dispatch(comm, h, NULL, &b))) return c->st[r];
  }

  experts_backward(c, r, N);

  /* Dispatch's backward: an unweighted combine of the row gradients, weight gradients home. */
  epx_combine_args_t cb;
  epx_combine_args_init(&cb);
  cb.y = c->gx[r], cb.y_dtype = dt, cb.out = c->dx[r], cb.out_dtype = dt, cb.weighted = 0;
  cb.row_weight_grad = c->dwr[r], cb.topk_weight_grad = c->dw[r];
  step(c, r, "epx_combine (backward)", epx_combine(comm, h, &cb));
  return c->st[r];
}

static int64_t find_row(const tu_expect_t *ex, int expert, int s, int64_t t, int k) {
  if (!expert) {
    for (int64_t n = 0; n < ex->ntok; n++)
      if (ex->tok_rows[n].src == s && ex->tok_rows[n].tok == t) return n;
  } else {
    for (int64_t n = 0; n < ex->nrows; n++)
      if (ex->pair_rows[n].src == s && ex->pair_rows[n].tok == t && ex->pair_rows[n].k == k) return n;
  }
  return -1;
}

/* The replayed gradient rows: copies of g (expert layout: and p * g, rounded once). */
static void check_replays(const char *what, const bw_t *c, const tu_expect_t *ex) {
  const tu_moe_t *m = c->m;
  const int expert = c->layout == EPX_LAYOUT_EXPERT;
  const epx_dtype_t dt = c->dt;
  for (int d = 0; d < R; d++) {
    long bad_g = 0, bad_gs = 0;
    const int64_t N = expert ? ex[d].nrows : ex[d].ntok;
    CHECK(c->rows[d] == N, "%s rank %d: %lld rows planned, want %lld", what, d, (long long)c->rows[d], (long long)N);
    if (c->rows[d] != N) continue;
    for (int64_t n = 0; n < N; n++) {
      const tu_row_t *er = expert ? &ex[d].pair_rows[n] : &ex[d].tok_rows[n];
      for (int cc = 0; cc < H; cc++) {
        const float got = tu_load(dt, c->G[d], (size_t)(n * H + cc));
        if (er->src < 0) {
          bad_g += got != 0.0f;
          if (expert) bad_gs += tu_load(dt, c->Gs[d], (size_t)(n * H + cc)) != 0.0f;
          continue;
        }
        const float g = tu_load(dt, c->g[er->src], (size_t)(er->tok * H + cc));
        bad_g += memcmp(&got, &g, 4) != 0;
        if (expert) {
          const float p = m->w[er->src][er->tok * K + er->k];
          const float want_s = tu_round(dt, p * g), got_s = tu_load(dt, c->Gs[d], (size_t)(n * H + cc));
          bad_gs += memcmp(&got_s, &want_s, 4) != 0;
        }
      }
    }
    CHECK(bad_g == 0, "%s rank %d: %ld elements of the replayed dispatch of g differ from g", what, d, bad_g);
    CHECK(bad_gs == 0, "%s rank %d: %ld elements of the scale_by_probs replay differ from round(p * g)", what, d, bad_gs);
  }
}

/* Source rank s's gradients: dx, the exact float32 sum the combine defines and near the
 * dense gradient; dw, each slot its owner's row weight gradient (-1 slots 0), near the dense
 * gradient. */
static void check_source_grads(const char *what, const bw_t *c, const tu_expect_t *ex, int s) {
  const tu_moe_t *m = c->m;
  const int expert = c->layout == EPX_LAYOUT_EXPERT;
  const epx_dtype_t dt = c->dt;
  const double tol = dt == EPX_FLOAT32 ? 1e-5 : 2e-2;
  long bad_dx_bits = 0, bad_dx = 0, bad_dw_bits = 0, bad_dw = 0;
  double worst_dx = 0.0, worst_dw = 0.0;
  for (int64_t t = 0; t < m->T[s]; t++) {
    const int32_t *idx = m->idx[s] + t * K;
    const float *w = m->w[s] + t * K;
    /* dx: the exact float32 sum the combine defines, and the dense gradient. */
    for (int cc = 0; cc < H; cc++) {
      float acc = 0.0f;
      for (int d = 0; d < R; d++) {
        float part = 0.0f;
        int any = 0;
        if (!expert) {
          const int64_t n = find_row(&ex[d], 0, s, t, -1);
          if (n >= 0) any = 1, part = tu_load(dt, c->gx[d], (size_t)(n * H + cc));
        } else {
          for (int l = 0; l < L; l++)
            for (int k = 0; k < K; k++)
              if (idx[k] == d * L + l) {
                const int64_t n = find_row(&ex[d], 1, s, t, k);
                any = 1;
                part = part + tu_load(dt, c->gx[d], (size_t)(n * H + cc));
              }
          part = tu_round(dt, part);
        }
        if (any) acc = acc + part;
      }
      const float got = tu_load(dt, c->dx[s], (size_t)(t * H + cc)), want_bits = tu_round(dt, acc);
      bad_dx_bits += memcmp(&got, &want_bits, 4) != 0;
      double dense = 0.0, mag = 0.0;
      const double g = tu_load(dt, c->g[s], (size_t)(t * H + cc));
      for (int k = 0; k < K; k++)
        if (idx[k] >= 0) {
          const double term = (double)w[k] * dense_expert_scale(idx[k]) * g;
          dense += term, mag += fabs(term);
        }
      const double err = fabs((double)got - dense);
      if (err > tol * mag + 1e-30) bad_dx++;
      if (mag > 0 && err / mag > worst_dx) worst_dx = err / mag;
    }
    /* dw: each slot gets its owner's value; -1 slots get 0. */
    double gx = 0.0, gxabs = 0.0;
    for (int cc = 0; cc < H; cc++) {
      const double a = tu_load(dt, c->g[s], (size_t)(t * H + cc)), b = tu_load(dt, m->x[s], (size_t)(t * H + cc));
      gx += a * b, gxabs += fabs(a * b);
    }
    for (int k = 0; k < K; k++) {
      const float got = c->dw[s][t * K + k];
      if (idx[k] < 0) {
        bad_dw_bits += got != 0.0f;
        continue;
      }
      const int d = idx[k] / L;
      const int64_t n = find_row(&ex[d], expert, s, t, k);
      const float copy = expert ? c->dwr[d][n] : c->dwr[d][n * K + k];
      bad_dw_bits += memcmp(&got, &copy, 4) != 0;
      const double dense = dense_expert_scale(idx[k]) * gx, mag = dense_expert_scale(idx[k]) * gxabs;
      const double err = fabs((double)got - dense);
      if (err > tol * mag + 1e-30) bad_dw++;
      if (mag > 0 && err / mag > worst_dw) worst_dw = err / mag;
    }
  }
  CHECK(bad_dx_bits == 0, "%s rank %d: %ld dx elements differ from the defined float32 sum", what, s, bad_dx_bits);
  CHECK(bad_dx == 0, "%s rank %d: %ld dx elements off the dense gradient (worst relative %.3g)", what, s, bad_dx, worst_dx);
  CHECK(bad_dw_bits == 0, "%s rank %d: %ld topk_weight_grad entries are not their slot's row_weight_grad (or 0)", what, s,
        bad_dw_bits);
  CHECK(bad_dw == 0, "%s rank %d: %ld topk_weight_grad entries off the dense gradient (worst relative %.3g)", what, s,
        bad_dw, worst_dw);
}

static void check_results(const char *what, bw_t *c, const tu_expect_t *ex) {
  const tu_moe_t *m = c->m;
  const int expert = c->layout == EPX_LAYOUT_EXPERT;
  const epx_dtype_t dt = c->dt;
  void *want[TU_MAX_RANKS];
  tu_dense(m, dt, dt, dt, expert, (const float *const *)m->w, want);
  for (int s = 0; s < R; s++) {
    char w2[640];
    snprintf(w2, sizeof w2, "%s rank %d forward out vs dense_moe", what, s);
    CHECK_BITS(w2, dt, c->out[s], want[s], m->T[s] * H, H);
  }
  tu_free_all(want, R);

  check_replays(what, c, ex);

  for (int s = 0; s < R; s++) check_source_grads(what, c, ex, s);
}

static void run(epx_layout_t layout, int align, epx_dtype_t dt) {
  char what[120];
  snprintf(what, sizeof what, "[%s align=%d %s]", layout == EPX_LAYOUT_EXPERT ? "expert" : "token", align, tu_dtype(dt));
  int64_t T[R];
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 1, 40);
  T[tu_int(&tu_rng, 0, R - 1)] = 0;
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, dt, T, &o, 1);

  bw_t c;
  memset(&c, 0, sizeof c);
  c.m = &m, c.layout = layout, c.align = align, c.dt = dt;
  for (int r = 0; r < R; r++) {
    c.g[r] = tu_alloc_poison((size_t)(T[r] * H) * dsize(dt));
    for (int64_t i = 0; i < T[r] * H; i++) tu_store(dt, c.g[r], (size_t)i, tu_value(&tu_rng));
  }
  tu_world_t w;
  epx_config_t cfg = tu_config(E, H, K, 64);
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  if (CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s world", what)) {
    epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, layout, align);
    if (tu_handles_create(&w, &hc, h) == EPX_SUCCESS) {
      c.w = &w, c.h = h;
      tu_barrier_init(R);
      epx_run_ranks(R, bw_rank, &c, NULL);
      int ok = 1;
      for (int r = 0; r < R; r++)
        if (c.st[r] != EPX_SUCCESS) {
          CHECK(0, "%s rank %d: %s failed: %s (%s)", what, r, c.failed_call[r], epx_status_string(c.st[r]), c.err[r]);
          ok = 0;
        }
      if (ok) {
        tu_expect_t ex[R];
        for (int d = 0; d < R; d++) tu_expect(&m, d, layout == EPX_LAYOUT_EXPERT ? align : 1, &ex[d]);
        check_results(what, &c, ex);
        for (int d = 0; d < R; d++) tu_expect_free(&ex[d]);
      }
    }
    tu_handles_destroy(&w, h);
  }
  tu_world_destroy(&w);
  for (int r = 0; r < R; r++) {
    void *bufs[] = {c.g[r], c.recv_x[r], c.y[r], c.G[r], c.Gs[r], c.gx[r], c.out[r], c.dx[r],
                    c.recv_idx[r], c.cnt[r], c.recv_w[r], c.recv_p[r], c.dwr[r], c.dw[r]};
    tu_free_all(bufs, (int)(sizeof bufs / sizeof bufs[0]));
  }
  tu_moe_free(&m);
}

int main(void) {
  tu_begin("test_backward");
  for (int rep = 0; rep < 2; rep++) {
    run(EPX_LAYOUT_TOKEN, 1, EPX_FLOAT32);
    run(EPX_LAYOUT_EXPERT, 1, EPX_FLOAT32);
    run(EPX_LAYOUT_EXPERT, 8, EPX_FLOAT32);
    run(EPX_LAYOUT_TOKEN, 1, EPX_BFLOAT16);
    run(EPX_LAYOUT_EXPERT, 16, EPX_BFLOAT16);
  }
  return tu_end();
}
