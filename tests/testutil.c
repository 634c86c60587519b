/* testutil — see testutil.h. */
#define _POSIX_C_SOURCE 200809L
#include "testutil.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- world and comms ---------------------------------------------------------------- */
typedef struct {
  tu_world_t *w;
  const epx_config_t *cfg, *cfgs;
} init_ctx_t;

static epx_status_t init_rank(int r, void *arg) {
  init_ctx_t *c = arg;
  return epx_comm_init(c->w->world, r, c->cfgs ? &c->cfgs[r] : c->cfg, &c->w->comm[r]);
}

epx_status_t tu_world_create(tu_world_t *w, int R, const epx_config_t *cfg, const epx_config_t *cfgs, epx_status_t *st) {
  memset(w, 0, sizeof *w);
  w->R = R;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST;
  wc.nranks = R;
  epx_status_t s = epx_world_create(&wc, &w->world);
  if (s != EPX_SUCCESS) {
    w->world = NULL;
    return s;
  }
  epx_status_t local[TU_MAX_RANKS];
  if (!st) st = local;
  init_ctx_t c = {w, cfg, cfgs};
  s = epx_run_ranks(R, init_rank, &c, st);
  for (int r = 0; r < R; r++)
    if (st[r] != EPX_SUCCESS) w->comm[r] = NULL;
  return s;
}

void tu_world_destroy(tu_world_t *w) {
  for (int r = 0; r < w->R; r++)
    if (w->comm[r]) {
      epx_status_t s = epx_comm_destroy(w->comm[r]);
      CHECK(s == EPX_SUCCESS, "epx_comm_destroy(rank %d): %s", r, epx_status_string(s));
      w->comm[r] = NULL;
    }
  if (w->world) {
    epx_status_t s = epx_world_destroy(w->world);
    CHECK(s == EPX_SUCCESS, "epx_world_destroy: %s", epx_status_string(s));
    w->world = NULL;
  }
}

epx_status_t tu_handles_create(tu_world_t *w, const epx_handle_config_t *hc, epx_handle_t **h) {
  epx_status_t first = EPX_SUCCESS;
  for (int r = 0; r < w->R; r++) {
    h[r] = NULL;
    epx_status_t s = epx_handle_create(w->comm[r], hc, &h[r]);
    CHECK(s == EPX_SUCCESS, "epx_handle_create(rank %d): %s (%s)", r, epx_status_string(s), epx_last_error());
    if (s != EPX_SUCCESS) {
      h[r] = NULL;
      if (first == EPX_SUCCESS) first = s;
    }
  }
  return first;
}

void tu_handles_destroy(tu_world_t *w, epx_handle_t **h) {
  for (int r = 0; r < w->R; r++)
    if (h[r]) {
      epx_status_t s = epx_handle_destroy(h[r]);
      CHECK(s == EPX_SUCCESS, "epx_handle_destroy(rank %d): %s", r, epx_status_string(s));
      h[r] = NULL;
    }
}

/* ---- barrier ------------------------------------------------------------------------ */
static pthread_mutex_t bar_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t bar_cv = PTHREAD_COND_INITIALIZER;
static int bar_n, bar_waiting, bar_acc, bar_result;
static unsigned bar_gen;

void tu_barrier_init(int n) {
  pthread_mutex_lock(&bar_mu);
  bar_n = n, bar_waiting = 0, bar_acc = 0;
  pthread_mutex_unlock(&bar_mu);
}

void tu_barrier_wait(void) { (void)tu_barrier_vote(0); }

int tu_barrier_vote(int mine) {
  pthread_mutex_lock(&bar_mu);
  const unsigned gen = bar_gen;
  bar_acc |= mine != 0;
  if (++bar_waiting == bar_n) {
    bar_result = bar_acc;
    bar_acc = 0, bar_waiting = 0;
    bar_gen++;
    pthread_cond_broadcast(&bar_cv);
  } else {
    while (gen == bar_gen) pthread_cond_wait(&bar_cv, &bar_mu);
  }
  /* Nobody can finish the next round before this thread joins it: bar_result is still ours. */
  const int result = bar_result;
  pthread_mutex_unlock(&bar_mu);
  return result;
}

/* ---- pipeline ----------------------------------------------------------------------- */
tu_pipe_t tu_pipe_default(void) {
  tu_pipe_t p;
  memset(&p, 0, sizeof p);
  p.algo = EPX_ALGO_HT, p.layout = EPX_LAYOUT_TOKEN, p.align = 1;
  p.recv_dtype = EPX_FLOAT32, p.y_dtype = EPX_FLOAT32, p.out_dtype = EPX_FLOAT32;
  p.form = TU_FORM_TOPK32, p.combine = 1, p.weighted = 1, p.guard_rows = 2;
  return p;
}

typedef struct {
  tu_world_t *w;
  epx_handle_t *const *h;
  const tu_moe_t *m;
  const tu_pipe_t *p;
  tu_pipe_res_t *res;
  atomic_int failed;
} pipe_ctx_t;

/* Every rank reaches every barrier; a failure anywhere stops all ranks at the same one. */
static int pipe_sync(pipe_ctx_t *c, int my_failure) {
  if (my_failure) atomic_store(&c->failed, 1);
  return tu_barrier_vote(my_failure);
}

static epx_status_t pipe_rank(int r, void *arg) {
  pipe_ctx_t *c = arg;
  const tu_moe_t *m = c->m;
  const tu_pipe_t *p = c->p;
  tu_pipe_res_t *res = c->res;
  epx_comm_t *comm = c->w->comm[r];
  epx_handle_t *h = c->h[r];
  const int L = m->L, H = m->H, K = m->K, nb = tu_nblocks(H);
  const int ll = p->algo == EPX_ALGO_LL;
  const int expert = ll || p->layout == EPX_LAYOUT_EXPERT;
  const size_t rsz = epx_dtype_size(p->recv_dtype);
  epx_routing_t rt = tu_routing(m, r, p->form);

  int64_t cap;
  int fail = 0;
  if (ll) {
    cap = (int64_t)L * m->R * epx_comm_config(comm)->max_tokens_per_rank;
  } else if (p->notify_first) {
    res->notify_st[r] = epx_notify(comm, h, &rt);
    fail = res->notify_st[r] != EPX_SUCCESS;
    if (fail) snprintf(res->err[r], sizeof res->err[r], "%s", epx_last_error());
    epx_handle_info_t info;
    memset(&info, 0, sizeof info);
    if (!fail) fail = epx_handle_info(h, &info, NULL) != EPX_SUCCESS;
    cap = expert ? info.num_recv_rows : info.num_recv_tokens;
    if (cap < 0 || cap > 100000000) cap = 0, fail = 1;
  } else {
    cap = expert ? res->ex[r].nrows : res->ex[r].ntok;
  }
  if (pipe_sync(c, fail)) return EPX_ERR_INTERNAL;

  const int64_t rows = cap + p->guard_rows;
  res->cap[r] = cap;
  res->recv_x[r] = tu_alloc_poison((size_t)(rows * H) * rsz);
  if (p->recv_dtype == EPX_FP8_E4M3) res->recv_scales[r] = tu_alloc_poison(sizeof(float) * (size_t)(rows * nb));
  if (!expert) {
    res->recv_idx[r] = tu_alloc_poison(sizeof(int32_t) * (size_t)(rows * K));
    res->recv_w[r] = tu_alloc_poison(sizeof(float) * (size_t)(rows * K));
  } else if (!p->minimal) {
    res->recv_probs[r] = tu_alloc_poison(sizeof(float) * (size_t)rows);
  }
  res->cnt[r] = tu_alloc_poison(sizeof(int32_t) * (size_t)L);
  res->nrows[r] = -12345;

  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = m->x[r];
  a.x_dtype = m->x_dtype;
  a.recv_dtype = p->recv_dtype;
  a.recv_x = res->recv_x[r];
  a.recv_scales = res->recv_scales[r];
  a.recv_capacity = cap;
  a.recv_topk_idx = res->recv_idx[r];
  a.recv_topk_weights = res->recv_w[r];
  a.recv_probs = res->recv_probs[r];
  a.tokens_per_local_expert = p->minimal ? NULL : res->cnt[r];
  a.num_recv_rows = p->minimal ? NULL : &res->nrows[r];
  res->dispatch_st[r] = epx_dispatch(comm, h, p->notify_first && !ll ? NULL : &rt, &a);
  if (res->dispatch_st[r] != EPX_SUCCESS) snprintf(res->err[r], sizeof res->err[r], "%s", epx_last_error());
  if (pipe_sync(c, res->dispatch_st[r] != EPX_SUCCESS)) return res->dispatch_st[r] ? res->dispatch_st[r] : EPX_ERR_INTERNAL;

  res->info_cnt[r] = tu_alloc_poison(sizeof(int32_t) * (size_t)L);
  res->info_st[r] = epx_handle_info(h, &res->info[r], res->info_cnt[r]);
  if (p->minimal) { /* what the dispatch would have said */
    memcpy(res->cnt[r], res->info_cnt[r], sizeof(int32_t) * (size_t)L);
    res->nrows[r] = expert ? res->info[r].num_recv_rows : res->info[r].num_recv_tokens;
  }
  if (!p->combine) return EPX_SUCCESS;

  /* Stand-in experts on what arrived. */
  const size_t ysz = epx_dtype_size(p->y_dtype);
  res->y[r] = tu_alloc_poison((size_t)(cap * H) * ysz);
  if (!expert)
    tu_expert_token_layout(r, L, H, K, cap, p->recv_dtype, res->recv_x[r], res->recv_scales[r], res->recv_idx[r],
                           res->recv_w[r], p->y_dtype, res->y[r]);
  else
    tu_expert_rows(r, L, H, p->recv_dtype, res->recv_x[r], res->recv_scales[r], res->cnt[r], ll ? 1 : p->align,
                   ll ? (int64_t)m->R * epx_comm_config(comm)->max_tokens_per_rank : 0, cap, p->y_dtype, res->y[r]);

  float *row_probs = NULL;
  if (p->row_probs_mul != 0.0f && expert && res->recv_probs[r]) {
    row_probs = tu_alloc_poison(sizeof(float) * (size_t)cap);
    for (int64_t i = 0; i < cap; i++) row_probs[i] = res->recv_probs[r][i] * p->row_probs_mul;
  }
  res->out[r] = tu_alloc_poison((size_t)(m->T[r] * H) * epx_dtype_size(p->out_dtype));
  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = res->y[r];
  ca.y_dtype = p->y_dtype;
  ca.out = res->out[r];
  ca.out_dtype = p->out_dtype;
  ca.weighted = p->weighted;
  ca.row_probs = row_probs;
  res->combine_st[r] = epx_combine(comm, h, &ca);
  if (res->combine_st[r] != EPX_SUCCESS) snprintf(res->err[r], sizeof res->err[r], "%s", epx_last_error());
  free(row_probs);
  return res->combine_st[r];
}

int tu_pipe_run(tu_world_t *w, epx_handle_t *const *h, const tu_moe_t *m, const tu_pipe_t *p, tu_pipe_res_t *res) {
  memset(res, 0, sizeof *res);
  const int expert = p->algo == EPX_ALGO_LL || p->layout == EPX_LAYOUT_EXPERT;
  for (int r = 0; r < m->R; r++) tu_expect(m, r, expert && p->algo != EPX_ALGO_LL ? p->align : 1, &res->ex[r]);
  pipe_ctx_t c;
  c.w = w, c.h = h, c.m = m, c.p = p, c.res = res;
  atomic_init(&c.failed, 0);
  tu_barrier_init(m->R);
  epx_status_t st[TU_MAX_RANKS];
  epx_status_t s = epx_run_ranks(m->R, pipe_rank, &c, st);
  return s == EPX_SUCCESS && !atomic_load(&c.failed) ? 0 : -1;
}

int tu_pipe_check_at(const char *file, int line, const char *what, tu_world_t *w, epx_handle_t *const *h,
                     const tu_moe_t *m, const tu_pipe_t *p, const float *const *dense_w, tu_pipe_res_t *res) {
  const int R = m->R;
  const int rc = tu_pipe_run(w, h, m, p, res);
  for (int r = 0; r < R; r++) {
    if (p->notify_first)
      check_status_at(file, line, "notify", res->notify_st[r], EPX_SUCCESS, "%s rank %d notify (%s)", what, r, res->err[r]);
    check_status_at(file, line, "dispatch", res->dispatch_st[r], EPX_SUCCESS, "%s rank %d dispatch (%s)", what, r,
                    res->err[r]);
    if (p->combine && rc == 0)
      check_status_at(file, line, "combine", res->combine_st[r], EPX_SUCCESS, "%s rank %d combine (%s)", what, r,
                      res->err[r]);
  }
  if (p->combine && rc == 0) {
    void *want[TU_MAX_RANKS];
    tu_dense_at(file, line, m, p->recv_dtype, p->y_dtype, p->out_dtype,
                p->layout == EPX_LAYOUT_EXPERT || p->algo == EPX_ALGO_LL, dense_w ? dense_w : (const float *const *)m->w,
                want);
    for (int r = 0; r < R; r++) {
      char ww[640];
      snprintf(ww, sizeof ww, "%s rank %d out vs dense_moe", what, r);
      check_bits_at(file, line, ww, p->out_dtype, res->out[r], want[r], m->T[r] * m->H, m->H);
    }
    tu_free_all(want, R);
  }
  return rc;
}

void tu_pipe_free(tu_pipe_res_t *res, int R) {
  for (int r = 0; r < R; r++) {
    tu_expect_free(&res->ex[r]);
    free(res->info_cnt[r]), free(res->recv_x[r]), free(res->recv_scales[r]), free(res->recv_idx[r]);
    free(res->recv_w[r]), free(res->recv_probs[r]), free(res->cnt[r]), free(res->y[r]), free(res->out[r]);
  }
  memset(res, 0, sizeof *res);
}

int tu_world_usable(const char *what, tu_world_t *w, int E, int H, int K) {
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 2);
  if (!CHECK_STATUS(tu_handles_create(w, &hc, h), EPX_SUCCESS, "%s: handles", what)) return 1;
  int64_t T[TU_MAX_RANKS];
  for (int r = 0; r < w->R; r++) T[r] = tu_int(&tu_rng, 0, 9);
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, w->R, E, H, K, EPX_FLOAT32, T, &o, 1);
  tu_pipe_t p = tu_pipe_default();
  p.layout = EPX_LAYOUT_EXPERT, p.align = 2;
  tu_pipe_res_t res;
  const int rc = tu_pipe_check(what, w, h, &m, &p, NULL, &res);
  CHECK(rc == 0, "%s: the pipeline ran on every rank", what);
  tu_pipe_free(&res, w->R);
  tu_moe_free(&m);
  tu_handles_destroy(w, h);
  return rc;
}

void tu_refused_args(void *buf, int64_t cap, epx_dispatch_args_t *da, epx_combine_args_t *ca) {
  epx_dispatch_args_init(da);
  da->x_dtype = da->recv_dtype = EPX_FLOAT32;
  da->x = buf, da->recv_x = buf, da->recv_capacity = cap;
  epx_combine_args_init(ca);
  ca->y_dtype = ca->out_dtype = EPX_FLOAT32;
  ca->y = buf, ca->out = buf;
}

/* ---- special values ------------------------------------------------------------------- */
/* NaNs with payloads (quiet, signalling, negative), the canonical NaN, infinities, -0.0,
 * subnormals, values past e4m3's range (448) and past bf16's largest finite value. */
static const uint32_t f32_specials[] = {0x7fc01234u, 0xffc00001u, 0x7f800001u, 0x7fffffffu, 0x7f800000u, 0xff800000u,
                                        0x80000000u, 0x00000001u, 0x807fffffu, 0x43f00000u /* 480 */,
                                        0xc8927c00u /* -3e5 */, 0x7f7fffffu};
static const uint16_t bf16_specials[] = {0x7fc1u, 0xffa5u, 0x7f81u, 0x7fffu, 0x7f80u, 0xff80u, 0x8000u,
                                         0x0001u, 0x807fu, 0x43f0u /* 480 */, 0xc893u, 0x7f7fu};
#define NSPECIALS ((int)(sizeof f32_specials / sizeof *f32_specials))
_Static_assert(sizeof bf16_specials / sizeof *bf16_specials == sizeof f32_specials / sizeof *f32_specials,
               "one special of each kind in either type");

void tu_add_specials(tu_rng_t *g, epx_dtype_t t, void *base, int64_t n, int rate) {
  for (int64_t i = 0; i < n; i++) {
    if (tu_int(g, 0, rate - 1)) continue;
    const int k = tu_int(g, 0, NSPECIALS - 1);
    if (t == EPX_FLOAT32)
      memcpy((float *)base + i, &f32_specials[k], 4);
    else
      ((uint16_t *)base)[i] = bf16_specials[k];
  }
}

void tu_moe_add_specials(tu_moe_t *m, tu_rng_t *g, int rate) {
  for (int r = 0; r < m->R; r++) {
    tu_add_specials(g, m->x_dtype, m->x[r], m->T[r] * m->H, rate);
    if (m->w[r]) tu_add_specials(g, EPX_FLOAT32, m->w[r], m->T[r] * m->K, rate);
  }
}

void tu_count_specials(epx_dtype_t t, const void *base, int64_t n, tu_specials_t *c) {
  memset(c, 0, sizeof *c);
  for (int64_t i = 0; i < n; i++) {
    uint32_t u; /* as float32 bits: bf16 widened, which keeps every kind */
    if (t == EPX_FLOAT32) {
      memcpy(&u, (const float *)base + i, 4);
    } else {
      const uint16_t b = ((const uint16_t *)base)[i];
      if (b == 0x7fffu) { /* widened it would look like a payload */
        c->nan_canonical++;
        continue;
      }
      u = (uint32_t)b << 16;
    }
    const uint32_t mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u) {
      if (u == 0x7fffffffu)
        c->nan_canonical++;
      else
        c->nan_payload++;
    } else if (mag == 0x7f800000u) {
      c->inf++;
    } else if (u == 0x80000000u) {
      c->neg_zero++;
    } else if (mag != 0 && mag < 0x00800000u) {
      c->subnormal++;
    } else if (mag > 0x43e00000u) { /* 448 */
      c->past_e4m3++;
    }
  }
}

int64_t tu_specials_total(const tu_specials_t *c) {
  return c->nan_payload + c->nan_canonical + c->inf + c->neg_zero + c->subnormal + c->past_e4m3;
}

int tu_check_specials_at(const char *file, int line, const char *what, const tu_specials_t *c) {
  const int ok = c->nan_payload > 0 && c->inf > 0 && c->neg_zero > 0 && c->subnormal > 0 && c->past_e4m3 > 0;
  if (ok)
    check_pass();
  else
    check_fail(file, line, "every kind of special value", "%s: NaN payloads %lld, infinities %lld, -0.0 %lld, subnormals %lld, past e4m3 %lld",
               what, (long long)c->nan_payload, (long long)c->inf, (long long)c->neg_zero, (long long)c->subnormal,
               (long long)c->past_e4m3);
  return ok;
}
