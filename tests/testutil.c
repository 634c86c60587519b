/* testutil — see testutil.h. */
#define _POSIX_C_SOURCE 200809L
#include "testutil.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- check.h ------------------------------------------------------------------------ */
static atomic_long n_passed, n_failed;

void check_pass(void) { atomic_fetch_add(&n_passed, 1); }

static void check_vfail(const char *file, int line, const char *cond, const char *fmt, va_list ap) {
  long n = atomic_fetch_add(&n_failed, 1);
  if (n >= CHECK_MAX_PRINTED) {
    if (n == CHECK_MAX_PRINTED) printf("(further failures are counted, not printed)\n");
    return;
  }
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  printf("%s:%d: CHECK(%s) failed: %s\n", file, line, cond, msg);
  fflush(stdout);
}

void check_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  check_vfail(file, line, cond, fmt, ap);
  va_end(ap);
}

int check_status_at(const char *file, int line, const char *expr, epx_status_t got, epx_status_t want,
                    const char *fmt, ...) {
  if (got == want) {
    check_pass();
    return 1;
  }
  char ctx[512], cond[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  va_end(ap);
  snprintf(cond, sizeof cond, "%s == %s", expr, epx_status_string(want));
  check_fail(file, line, cond, "%s: got %s (this thread's last error: \"%s\")", ctx, epx_status_string(got), epx_last_error());
  return 0;
}

long check_failures(void) { return atomic_load(&n_failed); }

int check_summary(const char *name) {
  long p = atomic_load(&n_passed), f = atomic_load(&n_failed);
  printf("%s: %ld passed, %ld failed\n", name, p, f);
  fflush(stdout);
  return f ? 1 : 0;
}

/* ---- run bookkeeping ---------------------------------------------------------------- */
tu_rng_t tu_rng;
uint64_t tu_seed;
static const char *test_name = "test";

double tu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void tu_begin(const char *name) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  test_name = name;
  const char *env = getenv("EPX_TEST_SEED");
  if (env && *env) {
    tu_seed = strtoull(env, NULL, 10);
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    tu_seed = ((uint64_t)ts.tv_sec * 1000003u) ^ (uint64_t)ts.tv_nsec;
    tu_seed %= 1000000000u;
  }
  tu_rng.s = tu_seed;
  printf("seed: %llu\n", (unsigned long long)tu_seed);
  printf("(%s: rerun with EPX_TEST_SEED=%llu to reproduce)\n", name, (unsigned long long)tu_seed);
}

int tu_end(void) { return check_summary(test_name); }

/* ---- RNG: splitmix64 ---------------------------------------------------------------- */
uint64_t tu_u64(tu_rng_t *g) {
  uint64_t z = (g->s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int tu_int(tu_rng_t *g, int lo, int hi) { return lo + (int)(tu_u64(g) % (uint64_t)(hi - lo + 1)); }

double tu_unit(tu_rng_t *g) { return (double)(tu_u64(g) >> 11) * (1.0 / 9007199254740992.0); }

float tu_value(tu_rng_t *g) {
  /* mantissa in [1, 2), exponent -6..3, random sign: never zero, never tiny. */
  float m = 1.0f + (float)tu_unit(g);
  float v = ldexpf(m, tu_int(g, -6, 3));
  return (tu_u64(g) & 1) ? -v : v;
}

float tu_weight(tu_rng_t *g) { return 0.01f + 0.99f * (float)tu_unit(g); }

/* ---- elements ----------------------------------------------------------------------- */
static size_t elem_size(epx_dtype_t t) { return epx_dtype_size(t); }

const char *tu_dtype(epx_dtype_t t) {
  switch (t) {
    case EPX_FLOAT32: return "f32";
    case EPX_BFLOAT16: return "bf16";
    case EPX_FP8_E4M3: return "fp8";
    case EPX_INT32: return "i32";
    case EPX_INT64: return "i64";
    case EPX_BOOL: return "bool";
  }
  return "?";
}

int tu_contains(const char *msg, const char *word) {
  const size_t n = strlen(word);
  for (const char *p = msg; *p; p++) {
    size_t i = 0;
    while (i < n && p[i] && tolower((unsigned char)p[i]) == tolower((unsigned char)word[i])) i++;
    if (i == n) return 1;
  }
  return 0;
}

float tu_load(epx_dtype_t t, const void *base, size_t i) {
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(((const uint16_t *)base)[i]);
  return ((const float *)base)[i];
}

void tu_store(epx_dtype_t t, void *base, size_t i, float v) {
  if (t == EPX_BFLOAT16)
    ((uint16_t *)base)[i] = epx_float_to_bf16(v);
  else
    ((float *)base)[i] = v;
}

void tu_store_nan(epx_dtype_t t, void *base, size_t i) {
  if (t == EPX_BFLOAT16)
    ((uint16_t *)base)[i] = 0x7FC0;
  else
    ((float *)base)[i] = NAN;
}

float tu_round(epx_dtype_t t, float v) {
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(epx_float_to_bf16(v));
  return v;
}

int tu_nblocks(int H) { return (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK; }

float tu_recv_value(epx_dtype_t recv_dtype, const void *rows, const float *scales, int H, int64_t row, int c) {
  if (recv_dtype == EPX_FP8_E4M3) {
    const uint8_t q = ((const uint8_t *)rows)[row * H + c];
    return epx_e4m3_to_float(q) * scales[row * tu_nblocks(H) + c / EPX_FP8_BLOCK];
  }
  return tu_load(recv_dtype, rows, (size_t)(row * H + c));
}

/* ---- poison ------------------------------------------------------------------------- */
void *tu_alloc_poison(size_t bytes) {
  if (bytes == 0) bytes = 1;
  void *p = malloc(bytes);
  if (!p) {
    printf("out of memory (%zu bytes)\n", bytes);
    abort();
  }
  memset(p, TU_POISON, bytes);
  return p;
}

int tu_is_poison(const void *p, size_t bytes) {
  const uint8_t *b = p;
  for (size_t i = 0; i < bytes; i++)
    if (b[i] != TU_POISON) return 0;
  return 1;
}

int64_t tu_first_diff(const void *a, const void *b, size_t elem_size_, int64_t n) {
  const uint8_t *x = a, *y = b;
  for (int64_t i = 0; i < n; i++)
    if (memcmp(x + i * elem_size_, y + i * elem_size_, elem_size_)) return i;
  return -1;
}

static uint32_t elem_bits(epx_dtype_t t, const void *p, int64_t i) {
  switch (elem_size(t)) {
    case 1: return ((const uint8_t *)p)[i];
    case 2: return ((const uint16_t *)p)[i];
    default: return ((const uint32_t *)p)[i];
  }
}

static double elem_value(epx_dtype_t t, const void *p, int64_t i) {
  switch (t) {
    case EPX_FLOAT32: return ((const float *)p)[i];
    case EPX_BFLOAT16: return epx_bf16_to_float(((const uint16_t *)p)[i]);
    case EPX_FP8_E4M3: return epx_e4m3_to_float(((const uint8_t *)p)[i]);
    case EPX_INT32: return ((const int32_t *)p)[i];
    default: return (double)elem_bits(t, p, i);
  }
}

int tu_check_bits(const char *what, epx_dtype_t t, const void *got, const void *want, int64_t n, int row) {
  const size_t es = elem_size(t);
  int64_t first = -1, count = 0;
  for (int64_t i = 0; i < n; i++)
    if (memcmp((const uint8_t *)got + i * es, (const uint8_t *)want + i * es, es)) {
      if (first < 0) first = i;
      count++;
    }
  if (row < 1) row = 1;
  if (count == 0) {
    check_pass();
    return 1;
  }
  check_fail(__FILE__, __LINE__, "same bits", "%s: %lld of %lld %s elements differ; first [%lld][%lld]: got %.9g (0x%x), want %.9g (0x%x)",
             what, (long long)count, (long long)n, tu_dtype(t), (long long)(first / row), (long long)(first % row),
             elem_value(t, got, first), (unsigned)elem_bits(t, got, first), elem_value(t, want, first),
             (unsigned)elem_bits(t, want, first));
  return 0;
}

/* ---- routing ------------------------------------------------------------------------ */
tu_route_opts_t tu_route_default(void) {
  tu_route_opts_t o = {0.25, -1, 0, 0};
  return o;
}

void tu_random_topk(tu_rng_t *g, int64_t T, int K, int E, const tu_route_opts_t *o, int32_t *idx) {
  const int lo = o->span_hi > 0 ? o->span_lo : 0;
  const int hi = o->span_hi > 0 ? o->span_hi : E;
  for (int64_t t = 0; t < T; t++) {
    int32_t *row = idx + t * K;
    for (int k = 0; k < K; k++) row[k] = -1;
    if (o->one_expert >= 0) {
      row[tu_int(g, 0, K - 1)] = o->one_expert;
      continue;
    }
    int m = 0;
    for (int k = 0; k < K; k++)
      if (tu_unit(g) >= o->p_none) m++;
    if (m > hi - lo) m = hi - lo;
    /* m distinct experts by rejection, then scattered over random slots. */
    int32_t chosen[EPX_MAX_TOPK];
    for (int i = 0; i < m; i++) {
      for (;;) {
        int32_t e = tu_int(g, lo, hi - 1), dup = 0;
        for (int j = 0; j < i; j++) dup |= chosen[j] == e;
        if (!dup) {
          chosen[i] = e;
          break;
        }
      }
    }
    int slot[EPX_MAX_TOPK];
    for (int k = 0; k < K; k++) slot[k] = k;
    for (int k = K - 1; k > 0; k--) {
      int j = tu_int(g, 0, k), tmp = slot[k];
      slot[k] = slot[j], slot[j] = tmp;
    }
    for (int i = 0; i < m; i++) row[slot[i]] = chosen[i];
  }
}

void tu_sort_topk_rows(int64_t T, int K, int32_t *idx, float *w) {
  for (int64_t t = 0; t < T; t++) {
    int32_t *r = idx + t * K;
    float *wr = w ? w + t * K : NULL;
    for (int k = 0; k < K; k++) /* -1 sorts last */
      if (r[k] < 0 && wr) wr[k] = 0.0f;
    for (int i = 1; i < K; i++)
      for (int j = i; j > 0; j--) {
        uint32_t a = (uint32_t)r[j - 1], b = (uint32_t)r[j]; /* -1 is the largest unsigned */
        if (a <= b) break;
        int32_t ti = r[j - 1];
        r[j - 1] = r[j], r[j] = ti;
        if (wr) {
          float tw = wr[j - 1];
          wr[j - 1] = wr[j], wr[j] = tw;
        }
      }
  }
}

/* ---- one MoE input ------------------------------------------------------------------ */
void tu_moe_random(tu_moe_t *m, tu_rng_t *g, int R, int E, int H, int K, epx_dtype_t x_dtype, const int64_t *T,
                   const tu_route_opts_t *o, int with_weights) {
  memset(m, 0, sizeof *m);
  m->R = R, m->E = E, m->H = H, m->K = K, m->L = E / R, m->x_dtype = x_dtype;
  for (int r = 0; r < R; r++) {
    const int64_t n = T[r];
    m->T[r] = n;
    m->x[r] = tu_alloc_poison((size_t)(n * H) * elem_size(x_dtype));
    for (int64_t i = 0; i < n * H; i++) tu_store(x_dtype, m->x[r], (size_t)i, tu_value(g));
    m->idx[r] = tu_alloc_poison(sizeof(int32_t) * (size_t)(n * K));
    tu_random_topk(g, n, K, E, o, m->idx[r]);
    m->idx64[r] = tu_alloc_poison(sizeof(int64_t) * (size_t)(n * K));
    for (int64_t i = 0; i < n * K; i++) m->idx64[r][i] = m->idx[r][i];
    if (with_weights) {
      m->w[r] = tu_alloc_poison(sizeof(float) * (size_t)(n * K));
      for (int64_t i = 0; i < n * K; i++) m->w[r][i] = tu_weight(g); /* -1 slots keep junk weights */
    }
  }
}

void tu_moe_make_map(tu_moe_t *m) {
  for (int r = 0; r < m->R; r++) {
    const int64_t n = m->T[r];
    tu_sort_topk_rows(n, m->K, m->idx[r], m->w[r]);
    for (int64_t i = 0; i < n * m->K; i++) m->idx64[r][i] = m->idx[r][i];
    free(m->map[r]);
    free(m->probs[r]);
    m->map[r] = tu_alloc_poison((size_t)(n * m->E));
    memset(m->map[r], 0, (size_t)(n * m->E));
    m->probs[r] = NULL;
    if (m->w[r]) {
      m->probs[r] = tu_alloc_poison(sizeof(float) * (size_t)(n * m->E));
      memset(m->probs[r], 0, sizeof(float) * (size_t)(n * m->E));
    }
    for (int64_t t = 0; t < n; t++)
      for (int k = 0; k < m->K; k++) {
        const int32_t e = m->idx[r][t * m->K + k];
        if (e < 0) continue;
        m->map[r][t * m->E + e] = 1;
        if (m->probs[r]) m->probs[r][t * m->E + e] = m->w[r][t * m->K + k];
      }
  }
}

void tu_moe_free(tu_moe_t *m) {
  for (int r = 0; r < m->R; r++) {
    free(m->x[r]), free(m->idx[r]), free(m->idx64[r]), free(m->w[r]), free(m->map[r]), free(m->probs[r]);
  }
  memset(m, 0, sizeof *m);
}

epx_routing_t tu_routing(const tu_moe_t *m, int rank, int form) {
  epx_routing_t rt;
  memset(&rt, 0, sizeof rt);
  rt.num_tokens = m->T[rank];
  if (form == TU_FORM_MIXED) form = rank % 3;
  if (form == TU_FORM_MAP) {
    rt.idx_dtype = EPX_INT32;
    rt.routing_map = m->map[rank];
    rt.probs = m->probs[rank];
  } else {
    rt.idx_dtype = form == TU_FORM_TOPK64 ? EPX_INT64 : EPX_INT32;
    rt.topk_idx = form == TU_FORM_TOPK64 ? (const void *)m->idx64[rank] : (const void *)m->idx[rank];
    rt.topk_weights = m->w[rank];
  }
  return rt;
}

void tu_dense(const tu_moe_t *m, epx_dtype_t recv_dtype, epx_dtype_t y_dtype, epx_dtype_t out_dtype, int expert_layout,
              const float *const *weights, void **out) {
  dense_cfg_t c = {m->R, m->E, m->H, m->K, m->x_dtype, recv_dtype, y_dtype, out_dtype, expert_layout, 0};
  for (int r = 0; r < m->R; r++) out[r] = tu_alloc_poison((size_t)(m->T[r] * m->H) * elem_size(out_dtype));
  int rc = dense_moe(&c, m->T, (const void *const *)m->x, (const int32_t *const *)m->idx, weights, out);
  CHECK(rc == 0, "dense_moe refused its input");
}

void tu_free_all(void **p, int n) {
  for (int i = 0; i < n; i++) {
    free(p[i]);
    p[i] = NULL;
  }
}

/* ---- expectations ------------------------------------------------------------------- */
void tu_expect(const tu_moe_t *m, int d, int align, tu_expect_t *ex) {
  const int L = m->L, K = m->K;
  if (align < 1) align = 1;
  memset(ex, 0, sizeof *ex);
  int64_t total_tokens = 0, total_pairs = 0;
  for (int s = 0; s < m->R; s++) total_tokens += m->T[s], total_pairs += m->T[s] * K;
  ex->tok_rows = calloc((size_t)total_tokens + 1, sizeof(tu_row_t));
  ex->pair_rows = calloc((size_t)(total_pairs + (int64_t)L * align) + 1, sizeof(tu_row_t));
  ex->cnt = calloc((size_t)L, sizeof(int32_t));
  for (int s = 0; s < m->R; s++)
    for (int64_t t = 0; t < m->T[s]; t++) {
      const int32_t *row = m->idx[s] + t * K;
      int here = 0;
      for (int k = 0; k < K; k++) here |= row[k] >= 0 && row[k] / L == d;
      if (here) ex->tok_rows[ex->ntok++] = (tu_row_t){s, t, -1, -1};
    }
  for (int l = 0; l < L; l++) {
    for (int s = 0; s < m->R; s++)
      for (int64_t t = 0; t < m->T[s]; t++)
        for (int k = 0; k < K; k++)
          if (m->idx[s][t * K + k] == d * L + l) {
            ex->pair_rows[ex->nrows++] = (tu_row_t){s, t, k, l};
            ex->cnt[l]++;
          }
    ex->npairs += ex->cnt[l];
    while (ex->nrows % align) ex->pair_rows[ex->nrows++] = (tu_row_t){-1, 0, -1, l};
  }
  for (int64_t t = 0; t < m->T[d]; t++) {
    int seen[TU_MAX_RANKS] = {0};
    for (int k = 0; k < K; k++) {
      const int32_t e = m->idx[d][t * K + k];
      if (e >= 0 && !seen[e / L]) seen[e / L] = 1, ex->sent_copies++;
    }
  }
}

void tu_expect_free(tu_expect_t *ex) {
  free(ex->tok_rows), free(ex->pair_rows), free(ex->cnt);
  memset(ex, 0, sizeof *ex);
}

/* ---- world and comms ---------------------------------------------------------------- */
epx_config_t tu_config(int E, int H, int K, int max_tokens_per_rank) {
  epx_config_t c;
  epx_config_init(&c);
  c.num_experts = E, c.hidden = H, c.topk = K, c.max_tokens_per_rank = max_tokens_per_rank;
  c.timeout_ms = 10000;
  return c;
}

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

epx_handle_config_t tu_handle_config(epx_algo_t algo, epx_layout_t layout, int align) {
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  hc.algo = algo, hc.layout = layout, hc.align = align;
  return hc;
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

/* ---- stand-in experts --------------------------------------------------------------- */
void tu_expert_token_layout(int d, int L, int H, int K, int64_t N, epx_dtype_t recv_dtype, const void *recv_x,
                            const float *recv_scales, const int32_t *ridx, const float *rw, epx_dtype_t y_dtype, void *y) {
  float *acc = malloc(sizeof(float) * (size_t)H);
  for (int64_t n = 0; n < N; n++) {
    for (int c = 0; c < H; c++) acc[c] = 0.0f;
    for (int k = 0; k < K; k++) {
      const int32_t li = ridx[n * K + k];
      if (li < 0 || li >= L) continue; /* wrong ids are reported by the callers' checks */
      const float s = dense_expert_scale(d * L + li), wk = rw[n * K + k];
      for (int c = 0; c < H; c++) {
        const float ye = tu_round(y_dtype, s * tu_recv_value(recv_dtype, recv_x, recv_scales, H, n, c));
        const float p = wk * ye;
        acc[c] = acc[c] + p;
      }
    }
    for (int c = 0; c < H; c++) tu_store(y_dtype, y, (size_t)(n * H + c), acc[c]);
  }
  free(acc);
}

void tu_expert_rows(int d, int L, int H, epx_dtype_t recv_dtype, const void *recv_x, const float *recv_scales,
                    const int32_t *cnt, int align, int64_t block_stride, int64_t total_rows, epx_dtype_t y_dtype, void *y) {
  if (align < 1) align = 1;
  for (int64_t i = 0; i < total_rows * H; i++) tu_store_nan(y_dtype, y, (size_t)i);
  int64_t pos = 0;
  for (int l = 0; l < L; l++) {
    const int64_t start = block_stride ? l * block_stride : pos;
    const int64_t n = cnt[l] < 0 ? 0 : cnt[l];
    const float s = dense_expert_scale(d * L + l);
    for (int64_t i = 0; i < n && start + i < total_rows; i++)
      for (int c = 0; c < H; c++)
        tu_store(y_dtype, y, (size_t)((start + i) * H + c),
                 s * tu_recv_value(recv_dtype, recv_x, recv_scales, H, start + i, c));
    pos += (n + align - 1) / align * align;
  }
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
  const size_t rsz = elem_size(p->recv_dtype);
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
  const size_t ysz = elem_size(p->y_dtype);
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
  res->out[r] = tu_alloc_poison((size_t)(m->T[r] * H) * elem_size(p->out_dtype));
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

int tu_pipe_check(const char *what, tu_world_t *w, epx_handle_t *const *h, const tu_moe_t *m, const tu_pipe_t *p,
                  const float *const *dense_w, tu_pipe_res_t *res) {
  const int R = m->R;
  const int rc = tu_pipe_run(w, h, m, p, res);
  for (int r = 0; r < R; r++) {
    if (p->notify_first) CHECK_STATUS(res->notify_st[r], EPX_SUCCESS, "%s rank %d notify (%s)", what, r, res->err[r]);
    CHECK_STATUS(res->dispatch_st[r], EPX_SUCCESS, "%s rank %d dispatch (%s)", what, r, res->err[r]);
    if (p->combine && rc == 0)
      CHECK_STATUS(res->combine_st[r], EPX_SUCCESS, "%s rank %d combine (%s)", what, r, res->err[r]);
  }
  if (p->combine && rc == 0) {
    void *want[TU_MAX_RANKS];
    tu_dense(m, p->recv_dtype, p->y_dtype, p->out_dtype, p->layout == EPX_LAYOUT_EXPERT || p->algo == EPX_ALGO_LL,
             dense_w ? dense_w : (const float *const *)m->w, want);
    for (int r = 0; r < R; r++) {
      char ww[640];
      snprintf(ww, sizeof ww, "%s rank %d out vs dense_moe", what, r);
      tu_check_bits(ww, p->out_dtype, res->out[r], want[r], m->T[r] * m->H, m->H);
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
