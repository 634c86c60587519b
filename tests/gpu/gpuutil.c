#include "gpuutil.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int gu_have_gpu(void) {
  if (epx_backend_available(EPX_BACKEND_CUDA) != EPX_SUCCESS) {
    printf("skipped: %s\n", epx_last_error());
    return 0;
  }
  return 1;
}

const char *gu_case_str(const gu_case_t *c) {
  static _Thread_local char buf[256];
  static const char *const algo[] = {"ht", "ll", "a2a"}, *const form[] = {"topk32", "topk64", "map", "mixed"};
  static const char *const route[] = {"", " route=one-expert", " route=one-rank"};
  char specials[32] = "", budget[32] = "", out[32] = "";
  if (c->specials) snprintf(specials, sizeof specials, " specials=1/%d", c->specials);
  if (c->budget) snprintf(budget, sizeof budget, " budget=%d%%", c->budget);
  if (c->out_dtype != c->x_dtype) snprintf(out, sizeof out, " out=%s", tu_dtype(c->out_dtype));
  snprintf(buf, sizeof buf, "R=%d E=%d H=%d K=%d T0=%lld algo=%s layout=%s align=%d %s->%s form=%s exact=%d%s%s%s%s",
           c->R, c->E, c->H, c->K, (long long)c->T[0], algo[c->algo],
           c->layout == EPX_LAYOUT_EXPERT ? "expert" : "token", c->align, tu_dtype(c->x_dtype),
           tu_dtype(c->recv_dtype), form[c->form], c->exact, route[c->route], specials, budget, out);
  return buf;
}

gu_case_t gu_case_of(const gu_row_t *k, int num_sms) {
  gu_case_t c = {.R = k->R, .E = k->E, .H = k->H, .K = k->K, .align = k->align, .exact = k->exact, .form = k->form,
                 .algo = k->algo, .layout = k->layout, .x_dtype = k->x, .recv_dtype = k->recv, .out_dtype = k->x,
                 .num_sms = num_sms};
  c.max_tokens = k->algo == EPX_ALGO_LL ? (k->T > 64 ? (int)k->T : 64) : 0;
  for (int r = 0; r < c.R; r++) c.T[r] = k->uneven && (r & 1) ? (r == 1 ? 0 : k->T / 3) : k->T;
  return c;
}

static size_t esz(epx_dtype_t t) { return epx_dtype_size(t); }
static int expert_rows(const gu_case_t *c) { return c->algo == EPX_ALGO_LL || c->layout == EPX_LAYOUT_EXPERT; }
/* Row weight gradients per row: one float (expert rows) or K (token rows). */
static int g_per_row(const gu_case_t *c) { return expert_rows(c) ? 1 : c->K; }

static int64_t rows_needed(const gu_case_t *c, const tu_moe_t *m, int d);

void gu_inputs_make(gu_inputs_t *in, const gu_case_t *c) {
  memset(in, 0, sizeof *in);
  tu_route_opts_t o = tu_route_default();
  if (c->route == GU_ROUTE_ONE_EXPERT) o.one_expert = c->E / 2;
  if (c->route == GU_ROUTE_ONE_RANK) o.span_lo = c->E - c->E / c->R, o.span_hi = c->E;
  tu_moe_random(&in->m, &tu_rng, c->R, c->E, c->H, c->K, c->x_dtype, c->T, &o, 1);
  /* Every draw for special values comes after a case's other draws, and only in cases that
   * ask: the other cases get the inputs they always got. */
  if (c->specials) tu_moe_add_specials(&in->m, &tu_rng, c->specials); /* x, weights (so probs) */
  if (c->form == TU_FORM_MAP) tu_moe_make_map(&in->m);
  for (int r = 0; r < c->R; r++) {
    const int64_t cap = rows_needed(c, &in->m, r);
    in->x2[r] = malloc((size_t)(c->T[r] * c->H) * esz(c->x_dtype) + 16);
    for (int64_t i = 0; i < c->T[r] * c->H; i++) tu_store(c->x_dtype, in->x2[r], (size_t)i, tu_value(&tu_rng));
    in->g[r] = malloc(sizeof(float) * (size_t)(cap * g_per_row(c) + 1));
    for (int64_t i = 0; i < cap * g_per_row(c); i++) in->g[r][i] = tu_value(&tu_rng);
    if (!c->specials) continue;
    tu_add_specials(&tu_rng, c->x_dtype, in->x2[r], c->T[r] * c->H, c->specials);
    tu_add_specials(&tu_rng, EPX_FLOAT32, in->g[r], cap * g_per_row(c), c->specials);
    in->y_rng[r] = tu_rng_stream(tu_u64(&tu_rng), (uint64_t)r);
  }
}

void gu_inputs_free(gu_inputs_t *in, const gu_case_t *c) {
  for (int r = 0; r < c->R; r++) {
    free(in->x2[r]);
    free(in->g[r]);
  }
  tu_moe_free(&in->m);
}

int64_t gu_budget_of(const gu_case_t *c, const tu_moe_t *m, int r) {
  if (c->budget <= 0 || r % 3 == 2) return 0;
  const int64_t rows = rows_needed(c, m, r), b = rows * (c->budget - 10 * (r % 3)) / 100;
  return b > 1 ? b : 1;
}

/* Rows rank d's receive buffers need, counted straight from the routing. */
static int64_t rows_needed(const gu_case_t *c, const tu_moe_t *m, int d) {
  const int L = c->E / c->R;
  if (c->algo == EPX_ALGO_LL) return (int64_t)L * c->R * c->max_tokens;
  tu_expect_t ex;
  tu_expect(m, d, c->align, &ex);
  const int64_t rows = expert_rows(c) ? ex.nrows : ex.ntok;
  tu_expect_free(&ex);
  return rows;
}

/* ---- memory on either side ---------------------------------------------------------------- */

void *gu_alloc(int cuda, size_t bytes) {
  bytes = bytes ? bytes : 16;
  if (!cuda) return tu_alloc_poison(bytes);
  void *p = NULL;
  if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMemset(p, TU_POISON, bytes) != cudaSuccess) {
    fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes);
    exit(1);
  }
  return p;
}

void *gu_upload(int cuda, const void *src, size_t bytes) {
  void *p = gu_alloc(cuda, bytes);
  if (!src || !bytes) return p;
  if (cuda)
    cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice);
  else
    memcpy(p, src, bytes);
  return p;
}

void *gu_host_copy(int cuda, const void *p, size_t bytes) {
  void *h = malloc(bytes ? bytes : 16);
  if (cuda)
    cudaMemcpy(h, p, bytes, cudaMemcpyDeviceToHost);
  else
    memcpy(h, p, bytes);
  return h;
}

void gu_free(int cuda, void *p) {
  if (cuda)
    cudaFree(p);
  else
    free(p);
}

typedef struct {
  int cuda;
} mem_t;

static void *mem_alloc(const mem_t *m, size_t bytes) { return gu_alloc(m->cuda, bytes); }
static void *mem_upload(const mem_t *m, const void *src, size_t bytes) { return gu_upload(m->cuda, src, bytes); }

/* Replaces *p (backend memory) by a host copy. */
static void mem_download(const mem_t *m, void **p, size_t bytes) {
  if (!m->cuda || !*p) return;
  void *h = gu_host_copy(1, *p, bytes);
  cudaFree(*p);
  *p = h;
}

/* ---- one rank's sequence ------------------------------------------------------------------ */

typedef struct {
  const gu_case_t *c;
  const gu_inputs_t *in;
  epx_world_t *world;
  gu_result_t *res;
  int cuda;
  /* backend-memory inputs */
  void *x[TU_MAX_RANKS], *x2[TU_MAX_RANKS], *idx[TU_MAX_RANKS], *w[TU_MAX_RANKS], *map[TU_MAX_RANKS],
      *probs_in[TU_MAX_RANKS], *g[TU_MAX_RANKS];
  int64_t *nrows[TU_MAX_RANKS];
} run_t;

#define STEP(call)                                                               \
  do {                                                                           \
    epx_status_t s_ = (call);                                                    \
    if (s_ != EPX_SUCCESS) {                                                     \
      snprintf(res->err[r], sizeof res->err[r], "%s: %s", #call, epx_last_error()); \
      res->st[r] = s_;                                                           \
      goto done;                                                                 \
    }                                                                            \
  } while (0)

static epx_status_t rank_main(int r, void *arg) {
  run_t *run = arg;
  const gu_case_t *c = run->c;
  gu_result_t *res = run->res;
  const int L = c->E / c->R, H = c->H, K = c->K;
  const int er = expert_rows(c);
  epx_comm_t *comm = NULL;
  epx_handle_t *h = NULL;
  epx_config_t cfg = tu_config(c->E, H, K, c->max_tokens);
  cfg.num_sms = c->num_sms;
  STEP(epx_comm_init(run->world, r, &cfg, &comm));
  epx_handle_config_t hc = tu_handle_config(c->algo, c->layout, c->align);
  hc.exact = c->exact;
  hc.recv_budget = gu_budget_of(c, &run->in->m, r);
  STEP(epx_handle_create(comm, &hc, &h));

  epx_routing_t rt = {.num_tokens = c->T[r]};
  if (c->form == TU_FORM_MAP) {
    rt.routing_map = run->map[r];
    rt.probs = run->probs_in[r];
  } else {
    rt.idx_dtype = c->form == TU_FORM_TOPK64 ? EPX_INT64 : EPX_INT32;
    rt.topk_idx = run->idx[r];
    rt.topk_weights = run->w[r];
  }
  STEP(epx_notify(comm, h, &rt));

  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = run->x[r];
  d.x_dtype = c->x_dtype;
  d.recv_dtype = c->recv_dtype;
  d.recv_x = res->recv_x[r];
  d.recv_scales = res->scales[r];
  d.recv_capacity = res->cap[r];
  d.recv_topk_idx = er ? NULL : res->recv_idx[r];
  d.recv_topk_weights = er ? NULL : res->recv_w[r];
  d.recv_probs = er ? res->probs[r] : NULL;
  d.tokens_per_local_expert = res->cnt[r];
  d.num_recv_rows = run->nrows[r];
  d.dropped = res->dropped[r];
  STEP(epx_dispatch(comm, h, NULL, &d));

  if (!run->cuda) { /* the experts: what a user's grouped GEMM would do */
    epx_handle_info_t info;
    STEP(epx_handle_info(h, &info, NULL));
    if (er)
      tu_expert_rows(r, L, H, c->recv_dtype, res->recv_x[r], res->scales[r], res->cnt[r], c->align,
                     c->algo == EPX_ALGO_LL ? (int64_t)c->R * c->max_tokens : 0, res->cap[r], c->x_dtype, res->y[r]);
    else
      tu_expert_token_layout(r, L, H, K, info.num_recv_tokens, c->recv_dtype, res->recv_x[r], res->scales[r],
                             res->recv_idx[r], res->recv_w[r], c->x_dtype, res->y[r]);
    if (c->specials) { /* y's own: a bf16 stand-in's NaNs are all canonical, and the sums must
                          meet payloads, infinities and -0.0 in either type */
      tu_rng_t g = run->in->y_rng[r];
      tu_add_specials(&g, c->x_dtype, res->y[r], res->cap[r] * H, c->specials);
    }
  }

  epx_combine_args_t cb;
  epx_combine_args_init(&cb);
  cb.y = res->y[r];
  cb.y_dtype = c->x_dtype;
  cb.out = res->out[r];
  cb.out_dtype = c->out_dtype;
  cb.weighted = er;
  STEP(epx_combine(comm, h, &cb));

  cb.out = res->out2[r];
  cb.weighted = 0;
  cb.row_weight_grad = run->g[r];
  cb.topk_weight_grad = res->wgrad[r];
  STEP(epx_combine(comm, h, &cb));

  d.x = run->x2[r];
  d.recv_x = res->recv2[r];
  d.recv_scales = res->scales2[r];
  d.recv_topk_idx = NULL;
  d.recv_topk_weights = NULL;
  d.recv_probs = NULL;
  d.tokens_per_local_expert = NULL;
  d.num_recv_rows = NULL;
  d.dropped = NULL;
  d.scale_by_probs = er;
  STEP(epx_dispatch(comm, h, NULL, &d));
  STEP(epx_comm_synchronize(comm));
done:
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  return res->st[r];
}

/* Rank r's inputs and outputs, in the run's memory. */
static void rank_alloc(run_t *run, const mem_t *mem, int r, const gu_result_t *host) {
  const gu_case_t *c = run->c;
  const gu_inputs_t *in = run->in;
  gu_result_t *res = run->res;
  const int H = c->H, K = c->K, nb = tu_nblocks(H);
  const int64_t T = c->T[r];
  /* Sizes: the host run learns them from its plan; the CUDA run takes the host's. */
  const int64_t cap = host ? host->cap[r] : rows_needed(c, &in->m, r);
  res->cap[r] = cap;
  run->x[r] = mem_upload(mem, in->m.x[r], (size_t)(T * H) * esz(c->x_dtype));
  run->x2[r] = mem_upload(mem, in->x2[r], (size_t)(T * H) * esz(c->x_dtype));
  run->idx[r] = c->form == TU_FORM_TOPK64 ? mem_upload(mem, in->m.idx64[r], sizeof(int64_t) * T * K)
                                          : mem_upload(mem, in->m.idx[r], sizeof(int32_t) * T * K);
  run->w[r] = mem_upload(mem, in->m.w[r], sizeof(float) * T * K);
  if (c->form == TU_FORM_MAP) {
    run->map[r] = mem_upload(mem, in->m.map[r], (size_t)(T * c->E));
    run->probs_in[r] = mem_upload(mem, in->m.probs[r], sizeof(float) * T * c->E);
  }
  run->g[r] = mem_upload(mem, in->g[r], sizeof(float) * (size_t)(cap * g_per_row(c)));
  res->recv_x[r] = mem_alloc(mem, (size_t)(cap * H) * esz(c->recv_dtype));
  res->recv2[r] = mem_alloc(mem, (size_t)(cap * H) * esz(c->recv_dtype));
  res->scales[r] = mem_alloc(mem, sizeof(float) * cap * nb);
  res->scales2[r] = mem_alloc(mem, sizeof(float) * cap * nb);
  res->recv_idx[r] = mem_alloc(mem, sizeof(int32_t) * cap * K);
  res->recv_w[r] = mem_alloc(mem, sizeof(float) * cap * K);
  res->probs[r] = mem_alloc(mem, sizeof(float) * cap);
  res->cnt[r] = mem_alloc(mem, sizeof(int32_t) * (c->E / c->R));
  res->dropped[r] = mem_alloc(mem, sizeof(int32_t));
  res->y[r] = host ? mem_upload(mem, host->y[r], (size_t)(cap * H) * esz(c->x_dtype))
                   : mem_alloc(mem, (size_t)(cap * H) * esz(c->x_dtype));
  res->out[r] = mem_alloc(mem, (size_t)(T * H) * esz(c->out_dtype));
  res->out2[r] = mem_alloc(mem, (size_t)(T * H) * esz(c->out_dtype));
  res->wgrad[r] = mem_alloc(mem, sizeof(float) * T * K);
  run->nrows[r] = mem->cuda ? mem_alloc(mem, sizeof(int64_t)) : &res->nrows[r];
}

/* Rank r's outputs made host-readable; its inputs freed. */
static void rank_collect(run_t *run, const mem_t *mem, int r) {
  const gu_case_t *c = run->c;
  gu_result_t *res = run->res;
  const int H = c->H, K = c->K, nb = tu_nblocks(H);
  const int64_t T = c->T[r], cap = res->cap[r];
  mem_download(mem, &res->recv_x[r], (size_t)(cap * H) * esz(c->recv_dtype));
  mem_download(mem, &res->recv2[r], (size_t)(cap * H) * esz(c->recv_dtype));
  mem_download(mem, (void **)&res->scales[r], sizeof(float) * cap * nb);
  mem_download(mem, (void **)&res->scales2[r], sizeof(float) * cap * nb);
  mem_download(mem, (void **)&res->recv_idx[r], sizeof(int32_t) * cap * K);
  mem_download(mem, (void **)&res->recv_w[r], sizeof(float) * cap * K);
  mem_download(mem, (void **)&res->probs[r], sizeof(float) * cap);
  mem_download(mem, (void **)&res->cnt[r], sizeof(int32_t) * (c->E / c->R));
  mem_download(mem, (void **)&res->dropped[r], sizeof(int32_t));
  mem_download(mem, &res->y[r], (size_t)(cap * H) * esz(c->x_dtype));
  mem_download(mem, &res->out[r], (size_t)(T * H) * esz(c->out_dtype));
  mem_download(mem, &res->out2[r], (size_t)(T * H) * esz(c->out_dtype));
  mem_download(mem, (void **)&res->wgrad[r], sizeof(float) * T * K);
  if (mem->cuda) {
    cudaMemcpy(&res->nrows[r], run->nrows[r], sizeof(int64_t), cudaMemcpyDeviceToHost);
    cudaFree(run->nrows[r]);
  }
  void *inputs[] = {run->x[r], run->x2[r], run->idx[r], run->w[r], run->map[r], run->probs_in[r], run->g[r]};
  for (size_t i = 0; i < sizeof inputs / sizeof *inputs; i++) {
    if (!inputs[i]) continue;
    if (mem->cuda)
      cudaFree(inputs[i]);
    else
      free(inputs[i]);
  }
}

int gu_run(const gu_case_t *c, const gu_inputs_t *in, epx_backend_t backend, const gu_result_t *host,
           gu_result_t *res) {
  memset(res, 0, sizeof *res);
  const mem_t mem = {backend == EPX_BACKEND_CUDA};
  run_t run = {.c = c, .in = in, .res = res, .cuda = mem.cuda};
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = backend;
  wc.nranks = c->R;
  if (epx_world_create(&wc, &run.world) != EPX_SUCCESS) {
    printf("world create failed: %s\n", epx_last_error());
    return 1;
  }
  for (int r = 0; r < c->R; r++) rank_alloc(&run, &mem, r, host);
  epx_status_t st[TU_MAX_RANKS];
  epx_run_ranks(c->R, rank_main, &run, st);
  int fail = 0;
  for (int r = 0; r < c->R; r++)
    if (res->st[r] != EPX_SUCCESS) {
      printf("  %s rank %d: %s\n", epx_backend_name(backend), r, res->err[r]);
      fail = 1;
    }
  for (int r = 0; r < c->R; r++) rank_collect(&run, &mem, r);
  epx_world_destroy(run.world);
  return fail;
}

int gu_run_rank(const gu_case_t *c, const gu_inputs_t *in, epx_world_t *world, int r, const gu_result_t *host,
                gu_result_t *res) {
  memset(res, 0, sizeof *res);
  const mem_t mem = {epx_world_backend(world) == EPX_BACKEND_CUDA};
  run_t run = {.c = c, .in = in, .res = res, .cuda = mem.cuda, .world = world};
  rank_alloc(&run, &mem, r, host);
  const int fail = rank_main(r, &run) != EPX_SUCCESS;
  if (fail) printf("  %s rank %d: %s\n", epx_backend_name(epx_world_backend(world)), r, res->err[r]);
  rank_collect(&run, &mem, r);
  return fail;
}

void gu_result_free(gu_result_t *r, int R) {
  for (int i = 0; i < R; i++) {
    void *p[] = {r->recv_x[i], r->recv2[i], r->out[i], r->out2[i], r->scales[i], r->scales2[i], r->recv_w[i],
                 r->probs[i], r->wgrad[i], r->recv_idx[i], r->cnt[i], r->dropped[i], r->y[i]};
    for (size_t j = 0; j < sizeof p / sizeof *p; j++) free(p[j]);
  }
  memset(r, 0, sizeof *r);
}

void gu_compare_rank_at(const char *file, int line, const gu_case_t *c, const gu_result_t *got, const gu_result_t *want,
                        const char *label, int r) {
  const int H = c->H, K = c->K, L = c->E / c->R, nb = tu_nblocks(H), er = expert_rows(c);
  const int64_t cap = want->cap[r], T = c->T[r];
  char what[512];
#define CMP(name, t, a, b, n, row)                                                  \
  do {                                                                              \
    snprintf(what, sizeof what, "%s rank %d %s [%s]", label, r, name, gu_case_str(c)); \
    check_bits_at(file, line, what, t, a, b, n, row);                              \
  } while (0)
  CMP("recv_x", c->recv_dtype == EPX_FP8_E4M3 ? EPX_BOOL : c->recv_dtype, got->recv_x[r], want->recv_x[r], cap * H, H);
  CMP("recv2", c->recv_dtype == EPX_FP8_E4M3 ? EPX_BOOL : c->recv_dtype, got->recv2[r], want->recv2[r], cap * H, H);
  if (c->recv_dtype == EPX_FP8_E4M3) {
    CMP("scales", EPX_FLOAT32, got->scales[r], want->scales[r], cap * nb, nb);
    CMP("scales2", EPX_FLOAT32, got->scales2[r], want->scales2[r], cap * nb, nb);
  }
  if (er) {
    CMP("probs", EPX_FLOAT32, got->probs[r], want->probs[r], cap, 1);
  } else {
    CMP("recv_idx", EPX_INT32, got->recv_idx[r], want->recv_idx[r], cap * K, K);
    CMP("recv_w", EPX_FLOAT32, got->recv_w[r], want->recv_w[r], cap * K, K);
  }
  CMP("tokens_per_local_expert", EPX_INT32, got->cnt[r], want->cnt[r], L, L);
  if (c->budget) CMP("dropped", EPX_INT32, got->dropped[r], want->dropped[r], 1, 1);
  if (got->nrows[r] == want->nrows[r])
    check_pass();
  else
    check_fail(file, line, "same num_recv_rows", "%s rank %d num_recv_rows %lld, host %lld", label, r,
               (long long)got->nrows[r], (long long)want->nrows[r]);
  CMP("out", c->out_dtype, got->out[r], want->out[r], T * H, H);
  CMP("out2 (dispatch gradient)", c->out_dtype, got->out2[r], want->out2[r], T * H, H);
  CMP("topk weight gradient", EPX_FLOAT32, got->wgrad[r], want->wgrad[r], T * K, K);
#undef CMP
}

void gu_compare_at(const char *file, int line, const gu_case_t *c, const gu_result_t *got, const gu_result_t *want,
                   const char *label) {
  for (int r = 0; r < c->R; r++) gu_compare_rank_at(file, line, c, got, want, label, r);
}
