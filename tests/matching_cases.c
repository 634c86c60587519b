/* matching_cases — see matching_cases.h. */
#include "matching_cases.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "dense_ref.h"

enum { MC_E_PER_RANK = 4, MC_H = 32, MC_K = 2, MC_CAP = 256, MC_POISON = 0x7f };

static const char *const names[MC_NUM_CASES] = {
    [MC_NULL_HANDLE] = "NULL handle",         [MC_FOREIGN_HANDLE] = "another comm's handle",
    [MC_LONE_COMPLETE] = "lone COMPLETE",     [MC_BAD_DTYPE] = "x_dtype int32",
    [MC_HUGE_TOKENS] = "2^62 tokens",         [MC_COMBINE_NULL_HANDLE] = "combine, NULL handle",
    [MC_ALIGN] = "align 3 against 1",         [MC_LAYOUT] = "expert against token layout",
    [MC_ALGO] = "LL against HT",              [MC_EXACT] = "exact 0 against 1",
    [MC_RECV_DTYPE] = "recv fp8 against f32", [MC_SCALE_BY_PROBS] = "scale_by_probs on one rank",
    [MC_RECV_PROBS] = "recv_probs on all but one rank", [MC_PART] = "SEND against ALL",
    [MC_Y_DTYPE] = "y bf16 against f32",      [MC_WEIGHTED] = "unweighted against weighted",
    [MC_WEIGHT_GRAD] = "row_weight_grad on one rank", [MC_SKIPPED_NOTIFY] = "a skipped notify, then combine",
    [MC_COMBINE_VS_REPLAY] = "combine against a dispatch replay", [MC_X_DTYPE] = "x bf16 against f32",
    [MC_COUNTS] = "counts on all but one rank", [MC_OUT_DTYPE] = "out bf16 against f32",
    [MC_ROW_PROBS] = "row_probs on one rank",
};

const char *mc_name(mc_kind_t kind) { return kind < MC_NUM_CASES ? names[kind] : "?"; }

epx_config_t mc_config(const mc_case_t *c) {
  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = MC_E_PER_RANK * c->nranks;
  cfg.hidden = MC_H;
  cfg.topk = MC_K;
  cfg.max_tokens_per_rank = 16;
  cfg.timeout_ms = c->timeout_ms;
  return cfg;
}

/* ---- expectations ----------------------------------------------------------------------- */

typedef struct {
  const char *tag;
  int checked, failed;
} mc_log_t;

static void expect(mc_log_t *log, int ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void expect(mc_log_t *log, int ok, const char *fmt, ...) {
  log->checked++;
  if (ok) return;
  log->failed++;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", log->tag);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static int has(const char *msg, const char *word) {
  for (size_t n = strlen(word); *msg; msg++)
    if (strncasecmp(msg, word, n) == 0) return 1;
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- inputs, the same in every rank's view ---------------------------------------------- */

typedef struct {
  int R, E, L;
  int64_t T[EPX_MAX_RANKS];
  float *x[EPX_MAX_RANKS];
  int32_t *idx[EPX_MAX_RANKS];
  float *w[EPX_MAX_RANKS];
} mc_data_t;

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void data_make(mc_data_t *d, const mc_case_t *c, uint64_t salt) {
  memset(d, 0, sizeof *d);
  d->R = c->nranks, d->E = MC_E_PER_RANK * c->nranks, d->L = MC_E_PER_RANK;
  for (int r = 0; r < d->R; r++) {
    const int64_t T = d->T[r] = 3 + (int64_t)(mix(c->seed ^ salt ^ (uint64_t)r) % 6);
    d->x[r] = malloc(sizeof(float) * (size_t)(T * MC_H + 1));
    d->idx[r] = malloc(sizeof(int32_t) * (size_t)(T * MC_K + 1));
    d->w[r] = malloc(sizeof(float) * (size_t)(T * MC_K + 1));
    for (int64_t i = 0; i < T * MC_H; i++)
      d->x[r][i] = (float)((int)(mix(c->seed + salt * 977 + (uint64_t)r * 7919 + (uint64_t)i) % 33) - 16) / 8.0f;
    for (int64_t t = 0; t < T; t++) {
      const int e0 = (int)(mix(c->seed ^ (salt << 8) ^ ((uint64_t)r << 40) ^ (uint64_t)t) % (uint64_t)d->E);
      d->idx[r][t * MC_K] = e0;
      d->idx[r][t * MC_K + 1] = t % 3 == 0 ? -1 : (e0 + 1 + (int)(t % (d->E - 1))) % d->E;
      d->w[r][t * MC_K] = 0.25f * (float)(1 + t % 3);
      d->w[r][t * MC_K + 1] = 0.125f * (float)(1 + (t + r) % 5);
    }
  }
}

static void data_free(mc_data_t *d) {
  for (int r = 0; r < d->R; r++) free(d->x[r]), free(d->idx[r]), free(d->w[r]);
}

static epx_routing_t routing_of(const mc_data_t *d, int r) {
  epx_routing_t rt = {.num_tokens = d->T[r], .idx_dtype = EPX_INT32, .topk_idx = d->idx[r], .topk_weights = d->w[r]};
  return rt;
}

/* ---- buffers ------------------------------------------------------------------------------- */

typedef struct {
  float *recv_x, *recv_scales, *recv_w, *recv_probs, *y, *out, *row_wgrad, *topk_wgrad;
  int32_t *recv_idx, *cnt;
  int64_t nrows;
} mc_bufs_t;

#define MC_BUF_FIELDS(X) \
  X(recv_x, MC_CAP * MC_H * 4) X(recv_scales, MC_CAP * 4) X(recv_w, MC_CAP * MC_K * 4) X(recv_probs, MC_CAP * 4) \
  X(y, MC_CAP * MC_H * 4) X(out, MC_CAP * MC_H * 4) X(row_wgrad, MC_CAP * MC_K * 4) X(topk_wgrad, MC_CAP * MC_K * 4) \
  X(recv_idx, MC_CAP * MC_K * 4) X(cnt, MC_E_PER_RANK * 4)

static void bufs_alloc(mc_bufs_t *b) {
#define MC_ALLOC(f, bytes) b->f = malloc(bytes);
  MC_BUF_FIELDS(MC_ALLOC)
#undef MC_ALLOC
  memset(b->y, 0, MC_CAP * MC_H * 4);
  memset(b->row_wgrad, 0, MC_CAP * MC_K * 4);
}

/* The outputs of a call, sentinel-filled (y and the row gradients are inputs). */
static void bufs_poison(mc_bufs_t *b) {
#define MC_POISON_FIELD(f, bytes) \
  if ((void *)b->f != (void *)b->y && (void *)b->f != (void *)b->row_wgrad) memset(b->f, MC_POISON, bytes);
  MC_BUF_FIELDS(MC_POISON_FIELD)
#undef MC_POISON_FIELD
  memset(&b->nrows, MC_POISON, sizeof b->nrows);
}

/* The output that is not its sentinel, or NULL. */
static const char *bufs_touched(const mc_bufs_t *b) {
#define MC_CHECK_FIELD(f, bytes)                                                        \
  if ((void *)b->f != (void *)b->y && (void *)b->f != (void *)b->row_wgrad)             \
    for (size_t i = 0; i < (size_t)(bytes); i++)                                        \
      if (((const unsigned char *)b->f)[i] != MC_POISON) return #f;
  MC_BUF_FIELDS(MC_CHECK_FIELD)
#undef MC_CHECK_FIELD
  return NULL;
}

static void bufs_free(mc_bufs_t *b) {
#define MC_FREE(f, bytes) free(b->f);
  MC_BUF_FIELDS(MC_FREE)
#undef MC_FREE
}

static epx_dispatch_args_t dispatch_args(const mc_data_t *d, int r, mc_bufs_t *b, int expert) {
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = d->x[r], a.x_dtype = EPX_FLOAT32, a.recv_dtype = EPX_FLOAT32;
  a.recv_x = b->recv_x, a.recv_scales = b->recv_scales, a.recv_capacity = MC_CAP;
  if (expert)
    a.recv_probs = b->recv_probs;
  else
    a.recv_topk_idx = b->recv_idx, a.recv_topk_weights = b->recv_w;
  a.tokens_per_local_expert = b->cnt, a.num_recv_rows = &b->nrows;
  return a;
}

static epx_combine_args_t combine_args(const mc_data_t *d, int r, mc_bufs_t *b) {
  (void)d, (void)r;
  epx_combine_args_t a;
  epx_combine_args_init(&a);
  a.y = b->y, a.y_dtype = EPX_FLOAT32, a.out = b->out, a.out_dtype = EPX_FLOAT32;
  return a;
}

/* ---- the case's handle and call ------------------------------------------------------------ */

static int expert_case(mc_kind_t k) {
  return k == MC_SCALE_BY_PROBS || k == MC_WEIGHTED || k == MC_RECV_PROBS || k == MC_ROW_PROBS;
}

static epx_handle_config_t handle_config(const mc_case_t *c, int me) {
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  const int odd = me == c->bad;
  if (expert_case(c->kind)) hc.layout = EPX_LAYOUT_EXPERT;
  if (c->kind == MC_ALIGN) hc.layout = EPX_LAYOUT_EXPERT, hc.align = odd ? 3 : 1;
  if (c->kind == MC_LAYOUT && odd) hc.layout = EPX_LAYOUT_EXPERT;
  if (c->kind == MC_ALGO && odd) hc.algo = EPX_ALGO_LL;
  if (c->kind == MC_EXACT && odd) hc.exact = 0;
  return hc;
}

static int combine_case(mc_kind_t k) {
  return k == MC_COMBINE_NULL_HANDLE || k == MC_Y_DTYPE || k == MC_WEIGHTED || k == MC_WEIGHT_GRAD ||
         k == MC_OUT_DTYPE || k == MC_ROW_PROBS;
}

/* The call under test on rank me. */
static epx_status_t bad_call(const mc_case_t *c, int me, epx_comm_t *comm, epx_handle_t *h, epx_handle_t *foreign,
                             const mc_data_t *d, mc_bufs_t *b) {
  const int odd = me == c->bad;
  epx_routing_t rt = routing_of(d, me);
  if (combine_case(c->kind) || (c->kind == MC_COMBINE_VS_REPLAY && odd) || (c->kind == MC_SKIPPED_NOTIFY && odd)) {
    epx_combine_args_t a = combine_args(d, me, b);
    if (odd && c->kind == MC_Y_DTYPE) a.y_dtype = EPX_BFLOAT16;
    if (odd && c->kind == MC_WEIGHTED) a.weighted = 0;
    if (odd && c->kind == MC_WEIGHT_GRAD) a.row_weight_grad = b->row_wgrad, a.topk_weight_grad = b->topk_wgrad;
    if (odd && c->kind == MC_OUT_DTYPE) a.out_dtype = EPX_BFLOAT16;
    if (odd && c->kind == MC_ROW_PROBS) a.row_probs = b->row_wgrad; /* any [rows] of floats */
    return epx_combine(comm, odd && c->kind == MC_COMBINE_NULL_HANDLE ? NULL : h, &a);
  }
  if (c->kind == MC_SKIPPED_NOTIFY) return epx_notify(comm, h, &rt);
  epx_dispatch_args_t a = dispatch_args(d, me, b, expert_case(c->kind) || c->kind == MC_ALIGN || (c->kind == MC_LAYOUT && odd));
  if (c->kind == MC_COMBINE_VS_REPLAY) return epx_dispatch(comm, h, NULL, &a);
  epx_handle_t *use = h;
  if (odd) switch (c->kind) {
      case MC_NULL_HANDLE: use = NULL; break;
      case MC_FOREIGN_HANDLE: use = foreign; break;
      case MC_LONE_COMPLETE: a.part = EPX_PART_COMPLETE; return epx_dispatch(comm, h, NULL, &a);
      case MC_BAD_DTYPE: a.x_dtype = EPX_INT32; break;
      case MC_HUGE_TOKENS: rt.num_tokens = (int64_t)1 << 62; break;
      case MC_RECV_DTYPE: a.recv_dtype = EPX_FP8_E4M3; break;
      case MC_SCALE_BY_PROBS: a.scale_by_probs = 1; break;
      case MC_RECV_PROBS: a.recv_probs = NULL; break;
      case MC_PART: a.part = EPX_PART_SEND; break;
      case MC_X_DTYPE: a.x_dtype = a.recv_dtype = EPX_BFLOAT16; break;
      case MC_COUNTS: a.tokens_per_local_expert = NULL; break;
      default: break;
    }
  return epx_dispatch(comm, use, &rt, &a);
}

static epx_status_t want_status(mc_kind_t k) {
  switch (k) {
    case MC_NULL_HANDLE:
    case MC_COMBINE_NULL_HANDLE: return EPX_ERR_NULL_POINTER;
    case MC_FOREIGN_HANDLE:
    case MC_LONE_COMPLETE:
    case MC_BAD_DTYPE:
    case MC_HUGE_TOKENS: return EPX_ERR_INVALID_ARGUMENT;
    case MC_SKIPPED_NOTIFY:
    case MC_COMBINE_VS_REPLAY: return EPX_ERR_OUT_OF_STEP;
    default: return EPX_ERR_CONFIG_MISMATCH;
  }
}

/* What every rank's message names (besides the bad rank); the bad rank's own message of a
 * refused call names its argument instead. */
static const char *want_words(mc_kind_t k, int odd) {
  static const char *const own[] = {[MC_NULL_HANDLE] = "handle", [MC_FOREIGN_HANDLE] = "another comm",
                                    [MC_LONE_COMPLETE] = "COMPLETE", [MC_BAD_DTYPE] = "x_dtype",
                                    [MC_HUGE_TOKENS] = "num_tokens", [MC_COMBINE_NULL_HANDLE] = "handle"};
  static const char *const field[] = {[MC_ALIGN] = "'handle align'", [MC_LAYOUT] = "'handle layout'",
                                      [MC_ALGO] = "'handle algo'", [MC_EXACT] = "'handle exact'",
                                      [MC_RECV_DTYPE] = "'recv_dtype'", [MC_SCALE_BY_PROBS] = "'scale_by_probs'",
                                      [MC_RECV_PROBS] = "'recv_probs given'", [MC_PART] = "'part'",
                                      [MC_Y_DTYPE] = "'y_dtype'", [MC_WEIGHTED] = "'weighted'",
                                      [MC_WEIGHT_GRAD] = "'row_weight_grad given'", [MC_X_DTYPE] = "'x_dtype'",
                                      [MC_COUNTS] = "'tokens_per_local_expert given'",
                                      [MC_OUT_DTYPE] = "'out_dtype'", [MC_ROW_PROBS] = "'row_probs given'",
                                      [MC_SKIPPED_NOTIFY] = "out of step", [MC_COMBINE_VS_REPLAY] = "out of step"};
  if (k <= MC_COMBINE_NULL_HANDLE) return odd ? own[k] : "failed";
  return field[k];
}

/* ---- the run on one rank -------------------------------------------------------------------- */

/* A valid dispatch + combine on a fresh token-layout handle; out against dense_ref. */
static void check_usable(const mc_case_t *c, int me, epx_comm_t *comm, mc_log_t *log) {
  mc_data_t d;
  data_make(&d, c, 2);
  mc_bufs_t b;
  bufs_alloc(&b);
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  epx_handle_t *h = NULL;
  epx_status_t s = epx_handle_create(comm, &hc, &h);
  epx_routing_t rt = routing_of(&d, me);
  epx_dispatch_args_t da = dispatch_args(&d, me, &b, 0);
  if (s == EPX_SUCCESS) s = epx_dispatch(comm, h, &rt, &da);
  if (s == EPX_SUCCESS) /* stand-in experts: y = sum over local slots of w * scale(e) * x */
    for (int64_t n = 0; n < b.nrows; n++)
      for (int col = 0; col < MC_H; col++) {
        float acc = 0.0f;
        for (int k = 0; k < MC_K; k++) {
          const int l = b.recv_idx[n * MC_K + k];
          if (l < 0) continue;
          const float ye = dense_expert_scale(me * d.L + l) * b.recv_x[n * MC_H + col];
          const float p = b.recv_w[n * MC_K + k] * ye;
          acc = acc + p;
        }
        b.y[n * MC_H + col] = acc;
      }
  epx_combine_args_t ca = combine_args(&d, me, &b);
  if (s == EPX_SUCCESS) s = epx_combine(comm, h, &ca);
  expect(log, s == EPX_SUCCESS, "a valid dispatch + combine afterwards: %s (%s)", epx_status_string(s), epx_last_error());
  if (s == EPX_SUCCESS) {
    dense_cfg_t dc = {d.R, d.E, MC_H, MC_K, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, 0, 0};
    void *want[EPX_MAX_RANKS];
    for (int r = 0; r < d.R; r++) want[r] = malloc(sizeof(float) * (size_t)(d.T[r] * MC_H + 1));
    int rc = dense_moe(&dc, d.T, (const void *const *)d.x, (const int32_t *const *)d.idx, (const float *const *)d.w, want);
    expect(log, rc == 0 && memcmp(want[me], b.out, sizeof(float) * (size_t)(d.T[me] * MC_H)) == 0,
           "the valid combine afterwards differs from dense_ref");
    for (int r = 0; r < d.R; r++) free(want[r]);
  }
  epx_handle_destroy(h);
  bufs_free(&b);
  data_free(&d);
}

int mc_rank(const mc_case_t *c, int me, epx_comm_t *comm, epx_comm_t *other, const char *tag, int *checked) {
  mc_log_t log = {tag, 0, 0};
  const int odd = me == c->bad;
  mc_data_t d;
  data_make(&d, c, 1);
  mc_bufs_t b;
  bufs_alloc(&b);
  epx_handle_config_t hc = handle_config(c, me), plain;
  epx_handle_config_init(&plain);
  epx_handle_t *h = NULL, *foreign = NULL;
  epx_status_t s = epx_handle_create(comm, &hc, &h);
  if (s == EPX_SUCCESS && odd && c->kind == MC_FOREIGN_HANDLE) s = epx_handle_create(other, &plain, &foreign);
  expect(&log, s == EPX_SUCCESS, "handle: %s (%s)", epx_status_string(s), epx_last_error());
  /* the combine and replay cases need a plan */
  if (s == EPX_SUCCESS && (combine_case(c->kind) || c->kind == MC_COMBINE_VS_REPLAY || c->kind == MC_SKIPPED_NOTIFY)) {
    epx_routing_t rt = routing_of(&d, me);
    epx_dispatch_args_t a = dispatch_args(&d, me, &b, expert_case(c->kind));
    s = epx_dispatch(comm, h, &rt, &a);
    expect(&log, s == EPX_SUCCESS, "the planning dispatch: %s (%s)", epx_status_string(s), epx_last_error());
  }
  if (s == EPX_SUCCESS && odd && c->kind == MC_SKIPPED_NOTIFY) {
    epx_routing_t rt = routing_of(&d, me);
    s = epx_notify(NULL, h, &rt);
    expect(&log, s == EPX_ERR_NULL_POINTER, "notify with a NULL comm: %s", epx_status_string(s));
    s = EPX_SUCCESS;
  }
  if (s == EPX_SUCCESS) {
    bufs_poison(&b);
    const double t0 = now_s();
    s = bad_call(c, me, comm, h, foreign, &d, &b);
    const double secs = now_s() - t0;
    char msg[1024], who[32];
    snprintf(msg, sizeof msg, "%s", epx_last_error());
    snprintf(who, sizeof who, "rank %d", c->bad);
    const epx_status_t want = want_status(c->kind);
    expect(&log, s == want, "status %s, want %s (%s)", epx_status_string(s), epx_status_string(want), msg);
    expect(&log, has(msg, want_words(c->kind, odd)), "the message lacks \"%s\": %s", want_words(c->kind, odd), msg);
    expect(&log, odd || has(msg, who), "the message does not name %s: %s", who, msg);
    expect(&log, secs < c->timeout_ms / 2000.0, "failed after %.3f s, not at once (timeout %d ms)", secs, c->timeout_ms);
    const char *touched = bufs_touched(&b);
    expect(&log, touched == NULL, "the failed call wrote %s", touched ? touched : "");
    if (want == EPX_ERR_OUT_OF_STEP) { /* the README: the comm is broken */
      epx_routing_t rt = routing_of(&d, me);
      s = epx_notify(comm, h, &rt);
      expect(&log, s == EPX_ERR_BROKEN, "a call after the ranks fell out of step: %s, want EPX_ERR_BROKEN",
             epx_status_string(s));
    } else {
      check_usable(c, me, comm, &log);
    }
  }
  epx_handle_destroy(h);
  epx_handle_destroy(foreign);
  bufs_free(&b);
  data_free(&d);
  *checked = log.checked;
  return log.failed;
}
