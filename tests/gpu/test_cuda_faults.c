/* What goes wrong on the CUDA backend comes back as a status, never as a hang or a write out
 * of bounds: a rank that never arrives, an output too small in sync-free mode, a bad expert
 * id, too many tokens in low-latency mode, ranks whose calls do not pair (settings that
 * differ, different operations), a rank that refuses its call without a usable handle or in a
 * lone COMPLETE, a rank that comes after its peers gave up, an SM budget the GPU cannot hold. */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuutil.h"

enum { E = 16, H = 256, K = 4, T = 64 };

typedef struct {
  epx_world_t *world;
  int R;
  int timeout_ms, num_sms;
  int absent;            /* this rank inits its comm, then calls nothing */
  int small_rank;        /* this rank's recv_capacity is 1 */
  int bad_rank;          /* this rank routes a token to expert E */
  int ll, exact;
  int64_t tokens[8];
  epx_status_t init_st[8], op_st[8];
  char msg[8][256];
  double secs[8];
  int poison_ok[8];
  /* the watchdog: once every rank but `absent` is inside its call, it waits 200 ms and
   * aborts abort_rank's comm (-1: no watchdog) */
  int abort_rank;
  _Atomic(epx_comm_t *) comms[8];
  atomic_int entered, watch_done;
  epx_status_t before_ret, before, abort_st[2]; /* async error before; both aborts */
  epx_status_t after[8];                        /* every rank's async error afterwards */
  char after_msg[8][256];
} fault_t;

static void *watchdog(void *arg) {
  fault_t *f = arg;
  while (atomic_load(&f->entered) < f->R - 1) tu_sleep_ms(1);
  epx_comm_t *c = atomic_load(&f->comms[f->abort_rank]);
  tu_sleep_ms(200);
  if (!c) { /* its init failed: the checks say so */
    atomic_store(&f->watch_done, 1);
    return NULL;
  }
  f->before = EPX_ERR_INTERNAL;
  f->before_ret = epx_comm_get_async_error(c, &f->before);
  f->abort_st[0] = epx_comm_abort(c);
  f->abort_st[1] = epx_comm_abort(c); /* twice is harmless */
  atomic_store(&f->watch_done, 1);
  return NULL;
}

/* After the watchdog's abort: what epx_comm_get_async_error says on this rank's comm. */
static void async_after(fault_t *f, int r, epx_comm_t *comm) {
  while (!atomic_load(&f->watch_done)) tu_sleep_ms(1);
  epx_status_t found = EPX_SUCCESS;
  const epx_status_t ret = epx_comm_get_async_error(comm, &found);
  f->after[r] = ret == found ? found : EPX_ERR_INTERNAL; /* it returns what it stores */
  snprintf(f->after_msg[r], sizeof f->after_msg[r], "%s", epx_last_error());
}

static void note(fault_t *f, int r, epx_status_t s) {
  f->op_st[r] = s;
  if (s != EPX_SUCCESS && !f->msg[r][0]) snprintf(f->msg[r], sizeof f->msg[r], "%s", epx_last_error());
}

static epx_status_t rank_main(int r, void *arg) {
  fault_t *f = arg;
  const int L = E / f->R;
  const int64_t Tr = f->tokens[r] ? f->tokens[r] : T;
  const int64_t cap = f->ll ? (int64_t)L * f->R * T : (int64_t)f->R * T * K;
  const size_t recv_bytes = sizeof(uint16_t) * cap * H;
  /* inputs: nonzero tokens, valid routing (rank bad_rank gets one bad id) */
  uint16_t *xh = malloc(sizeof(uint16_t) * Tr * H);
  int32_t *ih = malloc(sizeof(int32_t) * Tr * K);
  tu_fixed_bf16(xh, Tr * H, 0.25f, 7, 0);
  tu_fixed_topk(ih, Tr, K, E, r);
  if (r == f->bad_rank) ih[3 * K + 1] = E;
  void *x, *recv, *idx;
  cudaMalloc(&x, sizeof(uint16_t) * Tr * H);
  cudaMalloc(&idx, sizeof(int32_t) * Tr * K);
  cudaMalloc(&recv, recv_bytes);
  cudaMemcpy(x, xh, sizeof(uint16_t) * Tr * H, cudaMemcpyHostToDevice);
  cudaMemcpy(idx, ih, sizeof(int32_t) * Tr * K, cudaMemcpyHostToDevice);
  cudaMemset(recv, TU_POISON, recv_bytes);
  tu_barrier_wait();

  epx_comm_t *comm = NULL;
  epx_handle_t *h = NULL;
  epx_config_t cfg = tu_config(E, H, K, T);
  cfg.timeout_ms = f->timeout_ms;
  cfg.num_sms = f->num_sms;
  f->init_st[r] = epx_comm_init(f->world, r, &cfg, &comm);
  if (f->init_st[r] != EPX_SUCCESS) snprintf(f->msg[r], sizeof f->msg[r], "%s", epx_last_error());
  if (f->init_st[r] != EPX_SUCCESS && r != f->absent) atomic_fetch_add(&f->entered, 1); /* the watchdog goes on */
  if (f->init_st[r] == EPX_SUCCESS && r != f->absent) {
    epx_handle_config_t hc = tu_handle_config(f->ll ? EPX_ALGO_LL : EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
    hc.exact = f->exact;
    epx_handle_create(comm, &hc, &h);
    epx_routing_t rt = {.num_tokens = Tr, .idx_dtype = EPX_INT32, .topk_idx = idx};
    epx_dispatch_args_t d;
    epx_dispatch_args_init(&d);
    d.x = x, d.recv_x = recv, d.recv_capacity = r == f->small_rank ? 1 : cap;
    atomic_store(&f->comms[r], comm);
    atomic_fetch_add(&f->entered, 1);
    double t0 = tu_now();
    epx_status_t s = epx_dispatch(comm, h, &rt, &d);
    if (s == EPX_SUCCESS) s = epx_comm_synchronize(comm);
    note(f, r, s);
    f->secs[r] = tu_now() - t0;
  }
  tu_barrier_wait(); /* nobody frees state a peer may still post to */
  if (f->abort_rank >= 0 && f->init_st[r] == EPX_SUCCESS) async_after(f, r, comm);
  cudaDeviceSynchronize();
  uint8_t *back = malloc(recv_bytes);
  cudaMemcpy(back, recv, recv_bytes, cudaMemcpyDeviceToHost);
  f->poison_ok[r] = tu_is_poison(back, recv_bytes);
  free(back);
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  cudaFree(x);
  cudaFree(idx);
  cudaFree(recv);
  free(xh);
  free(ih);
  return EPX_SUCCESS;
}

static void run(fault_t *f) {
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_CUDA;
  wc.nranks = f->R;
  CHECK(epx_world_create(&wc, &f->world) == EPX_SUCCESS, "world: %s", epx_last_error());
  tu_barrier_init(f->R);
  pthread_t dog;
  const int watched = f->abort_rank >= 0 && pthread_create(&dog, NULL, watchdog, f) == 0;
  CHECK(f->abort_rank < 0 || watched, "no watchdog thread");
  if (f->abort_rank >= 0 && !watched) atomic_store(&f->watch_done, 1);
  epx_run_ranks(f->R, rank_main, f, NULL);
  if (watched) pthread_join(dog, NULL);
  epx_world_destroy(f->world);
}

static fault_t fresh(int R) {
  fault_t f;
  memset(&f, 0, sizeof f);
  f.R = R, f.timeout_ms = 5000, f.num_sms = 8, f.absent = f.small_rank = f.bad_rank = f.abort_rank = -1, f.exact = 1;
  return f;
}

/* A watchdog aborts rank 1's comm while ranks 0-2 wait inside the device exchange for rank
 * 3, which never calls: every wait ends with EPX_ERR_BROKEN long before the timeout, saying
 * who aborted; the async error is clean before and a failure on every comm after. */
static void watchdog_abort(int ll, int exact) {
  fault_t f = fresh(4);
  f.absent = 3, f.abort_rank = 1, f.timeout_ms = 20000, f.ll = ll, f.exact = exact;
  run(&f);
  const char *mode = ll ? "ll" : exact ? "ht exact" : "ht sync-free";
  CHECK(f.before_ret == EPX_SUCCESS && f.before == EPX_SUCCESS, "%s: async error before the abort: %s", mode,
        epx_status_string(f.before));
  CHECK(f.abort_st[0] == EPX_SUCCESS && f.abort_st[1] == EPX_SUCCESS, "%s: abort: %s, again %s", mode,
        epx_status_string(f.abort_st[0]), epx_status_string(f.abort_st[1]));
  for (int r = 0; r < 4; r++) {
    if (r != f.absent) {
      CHECK(f.op_st[r] == EPX_ERR_BROKEN, "%s: rank %d: %s, want broken (%s)", mode, r, epx_status_string(f.op_st[r]),
            f.msg[r]);
      CHECK(strstr(f.msg[r], "ABORTED") && strstr(f.msg[r], "rank 1 aborted"), "%s: rank %d's message: %s", mode, r,
            f.msg[r]);
      CHECK(f.secs[r] < f.timeout_ms / 2000.0, "%s: rank %d took %.2f s to stop", mode, r, f.secs[r]);
    }
    CHECK(f.after[r] == EPX_ERR_BROKEN && strstr(f.after_msg[r], "ABORTED"), "%s: rank %d's async error after: %s (%s)",
          mode, r, epx_status_string(f.after[r]), f.after_msg[r]);
  }
  printf("  watchdog, %s: rank 0 says: %s; async: %s\n", mode, f.msg[0], f.after_msg[3]);
}

/* ---- calls that do not pair: what the first exchange's stamps catch --------------------------- */

/* What differs between the ranks' calls: the handle's align or layout in one dispatch, whether
 * a combine is given row weight gradients, or the operation itself. */
typedef enum { DIFF_ALIGN, DIFF_LAYOUT, DIFF_WGRAD, DIFF_OP } diff_t;
enum { PR = 4, PT = 48 };

typedef struct {
  void *x, *idx, *w;
  void *recv_bad, *out_bad, *tgrad_bad, *rgrad; /* what the call that does not pair may not touch */
  int32_t *cnt_bad;
  void *recv, *out;   /* the good dispatch and combine after it */
  int64_t *nrows;
  epx_status_t bad, good, after; /* the call that does not pair; the good ones; the call after */
  char msg[512];
} pair_rank_t;

typedef struct {
  diff_t diff;
  int cuda, exact;
  epx_algo_t algo;
  epx_layout_t layout;
  const tu_moe_t *m;
  epx_world_t *world;
  int64_t cap; /* receive rows per rank: an upper bound */
  pair_rank_t rk[PR];
} pairing_t;

static epx_status_t finished(epx_comm_t *comm, epx_status_t s, pair_rank_t *b) {
  if (s == EPX_SUCCESS) s = epx_comm_synchronize(comm);
  if (s != EPX_SUCCESS && !b->msg[0]) snprintf(b->msg, sizeof b->msg, "%s", epx_last_error());
  return s;
}

static void pair_args(const pairing_t *p, pair_rank_t *b, epx_dispatch_args_t *d, epx_combine_args_t *k) {
  epx_dispatch_args_init(d);
  d->x = b->x, d->recv_x = b->recv, d->recv_capacity = p->cap, d->num_recv_rows = b->nrows;
  epx_combine_args_init(k);
  k->y = b->recv, k->out = b->out, k->weighted = p->algo == EPX_ALGO_LL || p->layout == EPX_LAYOUT_EXPERT;
}

/* The call that does not pair, on a comm whose handle `good` has a plan (DIFF_WGRAD, DIFF_OP)
 * or on the handle `bad`, whose settings differ between the ranks. */
static epx_status_t unpaired_call(pairing_t *p, int r, epx_comm_t *comm, epx_handle_t *bad, epx_handle_t *good,
                                  const epx_routing_t *rt) {
  pair_rank_t *b = &p->rk[r];
  epx_dispatch_args_t d;
  epx_combine_args_t k;
  pair_args(p, b, &d, &k);
  d.recv_x = b->recv_bad, d.tokens_per_local_expert = b->cnt_bad, d.num_recv_rows = NULL;
  k.out = b->out_bad;
  if (p->diff == DIFF_ALIGN || p->diff == DIFF_LAYOUT) return epx_dispatch(comm, bad, rt, &d);
  if (p->diff == DIFF_WGRAD && r == 1) k.row_weight_grad = b->rgrad, k.topk_weight_grad = b->tgrad_bad;
  if (p->diff == DIFF_WGRAD || r == 0) return epx_combine(comm, good, &k);
  return epx_dispatch(comm, good, NULL, &d); /* DIFF_OP: rank 0 combines, the others dispatch */
}

/* Rank r's calls on its comm: the good ones and the one that does not pair. */
static void pair_calls(pairing_t *p, int r, epx_comm_t *comm) {
  pair_rank_t *b = &p->rk[r];
  epx_handle_t *bad = NULL, *good = NULL;
  const int align = p->layout == EPX_LAYOUT_EXPERT && p->algo != EPX_ALGO_LL ? 16 : 1;
  epx_handle_config_t hc = tu_handle_config(p->algo, p->layout, align), hb = hc;
  hc.exact = hb.exact = p->exact;
  if (p->diff == DIFF_ALIGN) hb.align = r == PR - 1 ? 1 : 16;
  if (p->diff == DIFF_LAYOUT) hb.layout = r & 1 ? EPX_LAYOUT_EXPERT : EPX_LAYOUT_TOKEN;
  epx_handle_create(comm, &hb, &bad);
  epx_handle_create(comm, &hc, &good);
  const epx_routing_t rt = {.num_tokens = PT, .idx_dtype = EPX_INT32, .topk_idx = b->idx, .topk_weights = b->w};
  epx_dispatch_args_t d;
  epx_combine_args_t k;
  pair_args(p, b, &d, &k);
  /* ALIGN, LAYOUT: the unpaired dispatch first, then the good pair on the same comm; WGRAD:
   * a good dispatch, the unpaired combine, a good combine; OP: a good dispatch, then the
   * unpaired call, then any call is refused */
  const int first = p->diff == DIFF_ALIGN || p->diff == DIFF_LAYOUT;
  if (first) b->bad = finished(comm, unpaired_call(p, r, comm, bad, good, &rt), b);
  b->good = finished(comm, epx_dispatch(comm, good, &rt, &d), b);
  if (!first) b->bad = finished(comm, unpaired_call(p, r, comm, bad, good, &rt), b);
  if (p->diff == DIFF_OP)
    b->after = epx_dispatch(comm, good, NULL, &d);
  else if (b->good == EPX_SUCCESS)
    b->good = finished(comm, epx_combine(comm, good, &k), b);
  tu_barrier_wait(); /* nobody frees state a peer may still post to */
  epx_handle_destroy(bad);
  epx_handle_destroy(good);
}

static epx_status_t pair_rank(int r, void *arg) {
  pairing_t *p = arg;
  pair_rank_t *b = &p->rk[r];
  epx_comm_t *comm = NULL;
  epx_config_t cfg = tu_config(E, H, K, p->algo == EPX_ALGO_LL ? PT : 0);
  cfg.timeout_ms = 5000;
  b->bad = b->good = b->after = epx_comm_init(p->world, r, &cfg, &comm);
  if (b->bad == EPX_SUCCESS)
    pair_calls(p, r, comm);
  else
    snprintf(b->msg, sizeof b->msg, "comm init: %s", epx_last_error());
  epx_comm_destroy(comm);
  return EPX_SUCCESS;
}

static const char *const diff_names[] = {"align", "layout", "row_weight_grad", "operation"};

/* Every rank's buffers, in the backend's memory. */
static void pair_alloc(pairing_t *p) {
  const size_t row = sizeof(uint16_t) * H, x_bytes = row * PT;
  for (int r = 0; r < PR; r++) {
    pair_rank_t *b = &p->rk[r];
    memset(b, 0, sizeof *b);
    b->x = gu_upload(p->cuda, p->m->x[r], x_bytes);
    b->idx = gu_upload(p->cuda, p->m->idx[r], sizeof(int32_t) * PT * K);
    b->w = gu_upload(p->cuda, p->m->w[r], sizeof(float) * PT * K);
    b->recv_bad = gu_alloc(p->cuda, row * p->cap);
    b->recv = gu_alloc(p->cuda, row * p->cap);
    b->out_bad = gu_alloc(p->cuda, x_bytes);
    b->out = gu_alloc(p->cuda, x_bytes);
    b->rgrad = gu_upload(p->cuda, NULL, sizeof(float) * p->cap * K);
    b->tgrad_bad = gu_alloc(p->cuda, sizeof(float) * PT * K);
    b->cnt_bad = gu_alloc(p->cuda, sizeof(int32_t) * E);
    b->nrows = gu_alloc(p->cuda, sizeof(int64_t));
  }
}

/* The rows each rank received, its output, its row count (host copies), and checks that the
 * unpaired call wrote nothing; every buffer freed. */
typedef struct {
  void *recv[PR], *out[PR];
  int64_t nrows[PR];
} pair_out_t;

static void pair_collect(pairing_t *p, pair_out_t *o) {
  const size_t row = sizeof(uint16_t) * H;
  for (int r = 0; r < PR; r++) {
    pair_rank_t *b = &p->rk[r];
    const size_t n[] = {row * p->cap, row * PT, sizeof(float) * PT * K, sizeof(int32_t) * E};
    void *untouched[] = {b->recv_bad, b->out_bad, b->tgrad_bad, b->cnt_bad};
    static const char *const names[] = {"recv_x", "out", "topk_weight_grad", "tokens_per_local_expert"};
    for (int i = 0; i < 4; i++) {
      void *h = gu_host_copy(p->cuda, untouched[i], n[i]);
      CHECK(tu_is_poison(h, n[i]), "%s, %s: rank %d: the unpaired call wrote %s", diff_names[p->diff],
            p->cuda ? "cuda" : "host", r, names[i]);
      free(h);
    }
    o->recv[r] = gu_host_copy(p->cuda, b->recv, row * p->cap);
    o->out[r] = gu_host_copy(p->cuda, b->out, row * PT);
    int64_t *nr = gu_host_copy(p->cuda, b->nrows, sizeof(int64_t));
    o->nrows[r] = *nr;
    free(nr);
    void *bufs[] = {b->x, b->idx, b->w, b->recv_bad, b->recv, b->out_bad, b->out, b->rgrad, b->tgrad_bad,
                    b->cnt_bad, b->nrows};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) gu_free(p->cuda, bufs[i]);
  }
}

/* One backend's run of the pairing: every rank's statuses, messages checked; outputs to `o`. */
static void pair_run(pairing_t *p, pair_out_t *o) {
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = p->cuda ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
  wc.nranks = PR;
  CHECK(epx_world_create(&wc, &p->world) == EPX_SUCCESS, "world: %s", epx_last_error());
  pair_alloc(p);
  tu_barrier_init(PR);
  epx_run_ranks(PR, pair_rank, p, NULL);
  epx_world_destroy(p->world);
  const char *be = p->cuda ? "cuda" : "host", *what = diff_names[p->diff];
  const epx_status_t want = p->diff == DIFF_OP ? EPX_ERR_OUT_OF_STEP : EPX_ERR_CONFIG_MISMATCH;
  for (int r = 0; r < PR; r++) {
    const pair_rank_t *b = &p->rk[r];
    CHECK(b->bad == want, "%s, %s: rank %d: %s, want %s (%s)", what, be, r, epx_status_string(b->bad),
          epx_status_string(want), b->msg);
    CHECK(strstr(b->msg, p->diff == DIFF_OP ? "epx_combine" : what) != NULL, "%s, %s: rank %d's message: %s", what,
          be, r, b->msg);
    if (p->diff == DIFF_OP)
      CHECK(b->after == EPX_ERR_BROKEN, "%s, %s: rank %d: the call after: %s", what, be, r,
            epx_status_string(b->after));
    else
      CHECK(b->good == EPX_SUCCESS, "%s, %s: rank %d: the good pair after: %s (%s)", what, be, r,
            epx_status_string(b->good), b->msg);
  }
  if (p->diff == DIFF_OP) CHECK(strstr(p->rk[1].msg, "epx_dispatch") != NULL, "the message names both calls");
  printf("  %s, %s: rank 1 says: %s\n", what, be, p->rk[1].msg);
  pair_collect(p, o);
}

/* Fresh random tokens and routing, PT tokens on each of PR ranks. */
static void pair_inputs(tu_moe_t *m) {
  int64_t T[PR];
  for (int r = 0; r < PR; r++) T[r] = PT;
  tu_route_opts_t o = tu_route_default();
  tu_moe_random(m, &tu_rng, PR, E, H, K, EPX_BFLOAT16, T, &o, 1);
}

/* The same calls on both backends: the same statuses, nothing written by the unpaired call,
 * and the good calls after it bit for bit the host's. */
static void pairing(diff_t diff, epx_algo_t algo, epx_layout_t layout, int exact) {
  tu_moe_t m;
  pair_inputs(&m);
  pair_out_t got[2];
  for (int cuda = 0; cuda <= 1; cuda++) {
    pairing_t p = {.diff = diff, .cuda = cuda, .exact = exact, .algo = algo, .layout = layout, .m = &m};
    p.cap = algo == EPX_ALGO_LL ? (int64_t)E * PT : (int64_t)PR * PT * K + E * 16; /* every pair, padded */
    pair_run(&p, &got[cuda]);
    if (cuda == 0) continue;
    for (int r = 0; r < PR; r++) {
      char what[128];
      snprintf(what, sizeof what, "%s: rank %d after the unpaired call", diff_names[diff], r);
      if (diff != DIFF_OP) {
        CHECK(got[1].nrows[r] == got[0].nrows[r], "%s: %lld rows, host %lld", what, (long long)got[1].nrows[r],
              (long long)got[0].nrows[r]);
        const int64_t rows = algo == EPX_ALGO_LL ? p.cap : got[0].nrows[r];
        CHECK_BITS(what, EPX_BFLOAT16, got[1].recv[r], got[0].recv[r], rows * H, H);
        CHECK_BITS(what, EPX_BFLOAT16, got[1].out[r], got[0].out[r], (int64_t)PT * H, H);
      }
    }
  }
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < PR; r++) free(got[b].recv[r]), free(got[b].out[r]);
  tu_moe_free(&m);
}

/* ---- refusals without a usable handle, a lone COMPLETE, a late rank ---------------------- */

/* How rank 1 (RBAD) fails the call its peers make with their valid handle: it passes a NULL
 * handle, another comm's handle, a COMPLETE half with no SEND before it (its peers make the
 * whole call), a NULL handle to a SEND half (then every rank calls COMPLETE, as every rank's
 * code does), or it comes after its peers' timeout. */
typedef enum { HOW_NULL, HOW_FOREIGN, HOW_LONE_COMPLETE, HOW_SEND_REFUSED, HOW_LATE } how_t;
typedef enum { CALL_NOTIFY, CALL_DISPATCH, CALL_COMBINE } call_t; /* dispatch: with a routing */
enum { RBAD = 1, LATE_TIMEOUT_MS = 300 };

typedef struct {
  void *x, *idx, *w;
  void *recv[2], *out[2]; /* the good round before the refused call and the one after it */
  void *recv_bad, *out_bad; /* what the refused call may not touch */
  epx_status_t good[2], st, complete, next;
  char msg[512], complete_msg[512];
  double secs;
} refuse_rank_t;

typedef struct {
  how_t how;
  call_t call;
  epx_algo_t algo;
  int exact, timeout_ms;
  const tu_moe_t *m;
  epx_world_t *world;
  int64_t cap;
  refuse_rank_t rk[PR];
} refusal_t;

static const char *const how_names[] = {"NULL handle", "another comm's handle", "lone COMPLETE",
                                        "refused SEND, then COMPLETE", "late rank"};
static const char *const call_names[] = {"epx_notify", "epx_dispatch", "epx_combine"};

/* Rank r's routing, and dispatch and combine arguments writing into recv and out. */
static epx_routing_t refusal_args(const refusal_t *p, const refuse_rank_t *b, void *recv, void *out,
                                  pair_rank_t *pr, epx_dispatch_args_t *d, epx_combine_args_t *k) {
  *pr = (pair_rank_t){.x = b->x, .recv = recv, .out = out};
  const pairing_t shape = {.algo = p->algo, .layout = EPX_LAYOUT_TOKEN, .cap = p->cap};
  pair_args(&shape, pr, d, k);
  d->num_recv_rows = NULL;
  return (epx_routing_t){.num_tokens = PT, .idx_dtype = EPX_INT32, .topk_idx = b->idx, .topk_weights = b->w};
}

/* A whole dispatch (with a routing) and combine into round i's buffers. */
static void good_round(refusal_t *p, int r, epx_comm_t *comm, epx_handle_t *h, int i) {
  refuse_rank_t *b = &p->rk[r];
  pair_rank_t pr;
  epx_dispatch_args_t d;
  epx_combine_args_t k;
  const epx_routing_t rt = refusal_args(p, b, b->recv[i], b->out[i], &pr, &d, &k);
  b->good[i] = finished(comm, epx_dispatch(comm, h, &rt, &d), &pr);
  if (b->good[i] == EPX_SUCCESS) b->good[i] = finished(comm, epx_combine(comm, h, &k), &pr);
  if (b->good[i] != EPX_SUCCESS && !b->msg[0]) snprintf(b->msg, sizeof b->msg, "good round %d: %.400s", i, pr.msg);
}

/* Call and synchronise, keeping the first failure's message in `msg`. */
static epx_status_t refusal_done(epx_comm_t *comm, epx_status_t s, char *msg, size_t n) {
  if (s == EPX_SUCCESS) s = epx_comm_synchronize(comm);
  if (s != EPX_SUCCESS) snprintf(msg, n, "%s", epx_last_error());
  return s;
}

/* The call rank 1 fails and its peers make; `mine` is the handle this rank passes. */
static epx_status_t refused_call(refusal_t *p, int r, epx_comm_t *comm, epx_handle_t *h, epx_handle_t *mine) {
  refuse_rank_t *b = &p->rk[r];
  pair_rank_t pr;
  epx_dispatch_args_t d;
  epx_combine_args_t k;
  const epx_routing_t rt = refusal_args(p, b, b->recv_bad, b->out_bad, &pr, &d, &k);
  const size_t n = sizeof b->msg;
  switch (p->how) {
    case HOW_LONE_COMPLETE: /* the peers dispatch whole (on the plan of the good round) */
      d.part = r == RBAD ? EPX_PART_COMPLETE : EPX_PART_ALL;
      return refusal_done(comm, epx_dispatch(comm, h, NULL, &d), b->msg, n);
    case HOW_SEND_REFUSED: {
      d.part = EPX_PART_SEND;
      epx_status_t s = epx_dispatch(comm, mine, NULL, &d);
      if (s != EPX_SUCCESS) snprintf(b->msg, n, "%s", epx_last_error());
      d.part = EPX_PART_COMPLETE;
      b->complete = refusal_done(comm, epx_dispatch(comm, h, NULL, &d), b->complete_msg, sizeof b->complete_msg);
      if (s == EPX_SUCCESS && b->complete != EPX_SUCCESS) memcpy(b->msg, b->complete_msg, n);
      return s != EPX_SUCCESS ? s : b->complete;
    }
    case HOW_LATE:
      if (r == RBAD) tu_sleep_ms(p->timeout_ms + 500);
      return refusal_done(comm, epx_dispatch(comm, h, &rt, &d), b->msg, n);
    default:
      break;
  }
  if (p->call == CALL_NOTIFY) return refusal_done(comm, epx_notify(comm, mine, &rt), b->msg, n);
  if (p->call == CALL_DISPATCH) return refusal_done(comm, epx_dispatch(comm, mine, &rt, &d), b->msg, n);
  return refusal_done(comm, epx_combine(comm, mine, &k), b->msg, n);
}

/* Rank r: a good round (so the comm has used its handle's algorithm), the refused call, then
 * a good round again (or, after the late call, any call: the comm is broken). */
static epx_status_t refusal_rank(int r, void *arg) {
  refusal_t *p = arg;
  refuse_rank_t *b = &p->rk[r];
  epx_comm_t *comm = NULL, *other = NULL;
  epx_handle_t *h = NULL, *foreign = NULL;
  epx_config_t cfg = tu_config(E, H, K, p->algo == EPX_ALGO_LL ? PT : 0);
  cfg.timeout_ms = p->timeout_ms;
  epx_handle_config_t hc = tu_handle_config(p->algo, EPX_LAYOUT_TOKEN, 1);
  hc.exact = p->exact;
  b->st = epx_comm_init(p->world, r, &cfg, &comm);
  if (b->st == EPX_SUCCESS) b->st = epx_handle_create(comm, &hc, &h);
  if (b->st == EPX_SUCCESS && p->how == HOW_FOREIGN) b->st = epx_comm_init(p->world, r, &cfg, &other);
  if (b->st == EPX_SUCCESS && p->how == HOW_FOREIGN) b->st = epx_handle_create(other, &hc, &foreign);
  if (b->st != EPX_SUCCESS) {
    snprintf(b->msg, sizeof b->msg, "set-up: %s", epx_last_error());
    b->good[0] = b->good[1] = b->next = b->st;
    tu_barrier_wait();
  } else {
    good_round(p, r, comm, h, 0);
    tu_barrier_wait(); /* the refused call's time starts on every rank together */
    epx_handle_t *mine = r != RBAD ? h : p->how == HOW_NULL || p->how == HOW_SEND_REFUSED ? NULL
                                     : p->how == HOW_FOREIGN ? foreign : h;
    const double t0 = tu_now();
    b->st = refused_call(p, r, comm, h, mine);
    b->secs = tu_now() - t0;
    if (p->how == HOW_LATE) {
      b->next = epx_notify(comm, h, &(epx_routing_t){.num_tokens = PT, .idx_dtype = EPX_INT32, .topk_idx = b->idx});
      b->good[1] = EPX_SUCCESS;
    } else {
      good_round(p, r, comm, h, 1);
    }
  }
  tu_barrier_wait(); /* nobody frees state a peer may still post to */
  epx_handle_destroy(foreign);
  epx_handle_destroy(h);
  epx_comm_destroy(other);
  epx_comm_destroy(comm);
  return EPX_SUCCESS;
}

/* What every rank must return for the refused call, and what rank 1's message must say. */
static epx_status_t refusal_want(const refusal_t *p, int r) {
  if (p->how == HOW_LATE) return r == RBAD ? EPX_ERR_BROKEN : EPX_ERR_TIMEOUT;
  if (p->how == HOW_NULL && p->call == CALL_NOTIFY && p->algo == EPX_ALGO_LL && r != RBAD)
    return EPX_SUCCESS; /* a low-latency notify only records the routing: nothing to meet */
  return p->how == HOW_NULL || p->how == HOW_SEND_REFUSED ? EPX_ERR_NULL_POINTER : EPX_ERR_INVALID_ARGUMENT;
}

static void refusal_check(const refusal_t *p, const char *what) {
  const size_t row = sizeof(uint16_t) * H;
  for (int r = 0; r < PR; r++) {
    const refuse_rank_t *b = &p->rk[r];
    const epx_status_t want = refusal_want(p, r);
    CHECK(b->good[0] == EPX_SUCCESS, "%s: rank %d: the good round before: %s (%s)", what, r,
          epx_status_string(b->good[0]), b->msg);
    CHECK(b->st == want, "%s: rank %d: %s, want %s (%s)", what, r, epx_status_string(b->st), epx_status_string(want),
          b->msg);
    if (r != RBAD && want != EPX_SUCCESS)
      CHECK(strstr(b->msg, "rank 1") != NULL, "%s: rank %d's message names rank 1: %s", what, r, b->msg);
    if (p->how == HOW_LATE) {
      if (r == RBAD)
        CHECK(strstr(b->msg, "gave up waiting for this rank") != NULL, "%s: the late rank's message: %s", what, b->msg);
      else
        CHECK(b->secs < 4.0, "%s: rank %d took %.2f s to time out", what, r, b->secs);
      CHECK(b->next == EPX_ERR_BROKEN, "%s: rank %d's next call: %s, want broken", what, r,
            epx_status_string(b->next));
    } else {
      CHECK(b->secs < p->timeout_ms / 2000.0, "%s: rank %d took %.2f s (timeout %d ms)", what, r, b->secs,
            p->timeout_ms);
      CHECK(b->good[1] == EPX_SUCCESS, "%s: rank %d: the good round after: %s (%s)", what, r,
            epx_status_string(b->good[1]), b->msg);
    }
    if (p->how == HOW_SEND_REFUSED && r == RBAD)
      CHECK(b->complete == EPX_ERR_INVALID_ARGUMENT && strstr(b->complete_msg, "COMPLETE without a SEND"),
            "%s: rank 1's COMPLETE: %s (%s)", what, epx_status_string(b->complete), b->complete_msg);
    const size_t n[] = {row * p->cap, row * PT};
    void *untouched[] = {b->recv_bad, b->out_bad};
    for (int i = 0; i < 2; i++) {
      void *hb = gu_host_copy(1, untouched[i], n[i]);
      CHECK(tu_is_poison(hb, n[i]) || want == EPX_SUCCESS, "%s: rank %d: the refused call wrote its %s", what, r,
            i ? "out" : "recv_x");
      free(hb);
    }
    if (p->how == HOW_LATE || b->good[1] != EPX_SUCCESS) continue;
    char label[256];
    snprintf(label, sizeof label, "%s: rank %d's round after the refusal", what, r);
    void *g[4] = {gu_host_copy(1, b->recv[0], n[0]), gu_host_copy(1, b->recv[1], n[0]),
                  gu_host_copy(1, b->out[0], n[1]), gu_host_copy(1, b->out[1], n[1])};
    CHECK(!tu_is_poison(g[2], n[1]), "%s: the good round wrote no output", label);
    CHECK_BITS(label, EPX_BFLOAT16, g[1], g[0], p->cap * H, H);
    CHECK_BITS(label, EPX_BFLOAT16, g[3], g[2], (int64_t)PT * H, H);
    for (int i = 0; i < 4; i++) free(g[i]);
  }
}

/* One scenario on the CUDA backend, four ranks: statuses and messages on every rank, the
 * refused call's outputs untouched, and the group usable after it (the same bits as before)
 * or, after the late rank, broken. */
static void refusal(how_t how, call_t call, epx_algo_t algo, int exact) {
  tu_moe_t m;
  pair_inputs(&m);
  refusal_t p = {.how = how, .call = call, .algo = algo, .exact = exact, .m = &m};
  p.timeout_ms = how == HOW_LATE ? LATE_TIMEOUT_MS : 8000;
  p.cap = algo == EPX_ALGO_LL ? (int64_t)E * PT : (int64_t)PR * PT * K;
  char what[160];
  snprintf(what, sizeof what, "%s, %s, %s", how_names[how], how <= HOW_FOREIGN ? call_names[call] : "epx_dispatch",
           algo == EPX_ALGO_LL ? "ll" : exact ? "ht exact" : "ht sync-free");
  const size_t row = sizeof(uint16_t) * H;
  for (int r = 0; r < PR; r++) {
    refuse_rank_t *b = &p.rk[r];
    b->x = gu_upload(1, m.x[r], row * PT);
    b->idx = gu_upload(1, m.idx[r], sizeof(int32_t) * PT * K);
    b->w = gu_upload(1, m.w[r], sizeof(float) * PT * K);
    for (int i = 0; i < 2; i++) b->recv[i] = gu_alloc(1, row * p.cap), b->out[i] = gu_alloc(1, row * PT);
    b->recv_bad = gu_alloc(1, row * p.cap);
    b->out_bad = gu_alloc(1, row * PT);
  }
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_CUDA;
  wc.nranks = PR;
  CHECK(epx_world_create(&wc, &p.world) == EPX_SUCCESS, "world: %s", epx_last_error());
  tu_barrier_init(PR);
  epx_run_ranks(PR, refusal_rank, &p, NULL);
  epx_world_destroy(p.world);
  refusal_check(&p, what);
  printf("  %s: rank 0 says: %s%s%s\n", what, p.rk[0].msg[0] ? p.rk[0].msg : "(success)",
         how == HOW_LATE ? "; rank 1: " : "", how == HOW_LATE ? p.rk[1].msg : "");
  for (int r = 0; r < PR; r++) {
    refuse_rank_t *b = &p.rk[r];
    void *bufs[] = {b->x, b->idx, b->w, b->recv[0], b->recv[1], b->out[0], b->out[1], b->recv_bad, b->out_bad};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) gu_free(1, bufs[i]);
  }
  tu_moe_free(&m);
}

/* Every refusal on every kind of handle. */
static void refusals(void) {
  static const struct {
    epx_algo_t algo;
    int exact;
  } kinds[] = {{EPX_ALGO_HT, 1}, {EPX_ALGO_HT, 0}, {EPX_ALGO_LL, 0}};
  for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) {
    for (int call = CALL_NOTIFY; call <= CALL_COMBINE; call++) refusal(HOW_NULL, (call_t)call, kinds[i].algo, kinds[i].exact);
    refusal(HOW_FOREIGN, (call_t)(i == 2 ? CALL_COMBINE : CALL_DISPATCH), kinds[i].algo, kinds[i].exact);
    refusal(HOW_LONE_COMPLETE, CALL_DISPATCH, kinds[i].algo, kinds[i].exact);
    refusal(HOW_SEND_REFUSED, CALL_DISPATCH, kinds[i].algo, kinds[i].exact);
  }
  refusal(HOW_LATE, CALL_DISPATCH, EPX_ALGO_HT, 1);
  refusal(HOW_LATE, CALL_DISPATCH, EPX_ALGO_LL, 0);
}

int main(void) {
  tu_begin("test_cuda_faults");
  if (!gu_have_gpu()) return GU_SKIP;

  { /* a rank that never arrives */
    fault_t f = fresh(4);
    f.absent = 3, f.timeout_ms = 300;
    run(&f);
    for (int r = 0; r < 3; r++) {
      CHECK(f.op_st[r] == EPX_ERR_TIMEOUT || f.op_st[r] == EPX_ERR_BROKEN, "rank %d: %s, want a timeout (%s)", r,
            epx_status_string(f.op_st[r]), f.msg[r]);
      CHECK(strstr(f.msg[r], "rank 3") != NULL || f.op_st[r] == EPX_ERR_BROKEN,
            "rank %d's message names the missing rank: %s", r, f.msg[r]);
      CHECK(f.secs[r] < 5.0, "rank %d took %.2f s to time out", r, f.secs[r]);
    }
    CHECK(f.op_st[0] == EPX_ERR_TIMEOUT || f.op_st[1] == EPX_ERR_TIMEOUT || f.op_st[2] == EPX_ERR_TIMEOUT,
          "nobody reported the timeout itself");
    /* the group re-created works again */
    fault_t g = fresh(4);
    run(&g);
    for (int r = 0; r < 4; r++)
      CHECK(g.op_st[r] == EPX_SUCCESS, "after re-creation rank %d: %s (%s)", r, epx_status_string(g.op_st[r]), g.msg[r]);
  }
  watchdog_abort(0, 1);
  watchdog_abort(0, 0);
  watchdog_abort(1, 0);
  { /* sync-free output too small on one rank: a status, nothing written there */
    fault_t f = fresh(2);
    f.small_rank = 1, f.exact = 0;
    run(&f);
    CHECK(f.op_st[1] == EPX_ERR_OUTPUT_TOO_SMALL, "small rank: %s (%s)", epx_status_string(f.op_st[1]), f.msg[1]);
    CHECK(f.poison_ok[1], "the small rank's buffer was written");
    CHECK(f.op_st[0] == EPX_SUCCESS, "rank 0: %s (%s)", epx_status_string(f.op_st[0]), f.msg[0]);
    CHECK(!f.poison_ok[0], "rank 0 received nothing");
  }
  { /* a bad expert id: every rank fails, nothing written anywhere */
    for (int exact = 0; exact <= 1; exact++) {
      fault_t f = fresh(4);
      f.bad_rank = 2, f.exact = exact;
      run(&f);
      for (int r = 0; r < 4; r++) {
        CHECK(f.op_st[r] == EPX_ERR_EXPERT_OUT_OF_RANGE, "exact %d rank %d: %s (%s)", exact, r,
              epx_status_string(f.op_st[r]), f.msg[r]);
        CHECK(f.poison_ok[r], "exact %d rank %d: written despite the bad routing", exact, r);
      }
      if (exact) CHECK(strstr(f.msg[2], "token 3") != NULL, "the bad rank names the token: %s", f.msg[2]);
    }
  }
  { /* low-latency overflow */
    fault_t f = fresh(2);
    f.ll = 1, f.exact = 0;
    f.tokens[0] = T + 1;
    run(&f);
    for (int r = 0; r < 2; r++) {
      CHECK(f.op_st[r] == EPX_ERR_LL_OVERFLOW, "rank %d: %s (%s)", r, epx_status_string(f.op_st[r]), f.msg[r]);
      CHECK(f.poison_ok[r], "rank %d: written despite the overflow", r);
    }
  }
  /* calls whose settings differ: CONFIG_MISMATCH on every rank, nothing written, the comm
   * still usable; different calls: OUT_OF_STEP on every rank, then the comm is broken */
  pairing(DIFF_ALIGN, EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 1);
  pairing(DIFF_LAYOUT, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 0);
  pairing(DIFF_WGRAD, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  pairing(DIFF_WGRAD, EPX_ALGO_LL, EPX_LAYOUT_EXPERT, 0);
  pairing(DIFF_OP, EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 0);
  /* a rank that refuses its call without a usable handle, or in a lone COMPLETE, still takes
   * part: every rank fails at once with its status, and the group stays usable; a rank that
   * comes after its peers gave up never succeeds */
  refusals();
  { /* an SM budget the GPU cannot hold at once */
    fault_t f = fresh(4);
    f.num_sms = 1000;
    run(&f);
    for (int r = 0; r < 4; r++)
      CHECK(f.init_st[r] == EPX_ERR_INVALID_ARGUMENT && strstr(f.msg[r], "SMs"), "rank %d: %s (%s)", r,
            epx_status_string(f.init_st[r]), f.msg[r]);
  }
  return tu_end();
}
