/* epx-bench: one MoE layer's communication, timed per phase, optionally checked bit for bit
 * against a single-process dense computation of the same layer (tools/dense_ref.c).
 *
 * A run: every rank draws tokens and a top-k routing, then per iteration computes the layout,
 * plans (notify), dispatches, runs a stand-in expert on what it received (global expert e
 * multiplies by dense_expert_scale(e), so routing mistakes change the result) and combines.
 * Times are the median over iterations of the slowest rank. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dense_ref.h"
#include "epx.h"

typedef struct {
  epx_backend_t backend;
  int ranks, tokens, hidden, experts, topk, align, iters, warmup, check, json;
  int ll, expert_layout, num_sms;
  epx_dtype_t x_dtype, recv_dtype;
  uint64_t seed;
} opts_t;

enum { PH_LAYOUT, PH_NOTIFY, PH_DISPATCH, PH_COMBINE, PH_COUNT };
static const char *const phase_names[PH_COUNT] = {"layout", "notify", "dispatch", "combine"};

typedef struct {
  opts_t o;
  epx_world_t *world;
  /* per rank inputs (host memory) */
  void *x[EPX_MAX_RANKS];
  int32_t *idx[EPX_MAX_RANKS];
  float *w[EPX_MAX_RANKS];
  void *out[EPX_MAX_RANKS];
  /* per rank, per iteration, per phase: seconds */
  double *secs;
  /* per rank: bytes its dispatch sends (rows that cross to another rank and stay local) */
  double sent_dispatch[EPX_MAX_RANKS], sent_combine[EPX_MAX_RANKS];
  char error[EPX_MAX_RANKS][512];
} bench_t;

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static double uniform(uint64_t *s) { return (double)(splitmix(s) >> 11) * 0x1.0p-53; }

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static size_t esize(epx_dtype_t t) { return epx_dtype_size(t); }

/* ---- the stand-in expert on received rows (host memory) --------------------------------- */

static float recv_value(const void *recv_x, const float *scales, epx_dtype_t t, int64_t row, int hidden, int c) {
  if (t == EPX_FLOAT32) return ((const float *)recv_x)[row * hidden + c];
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(((const uint16_t *)recv_x)[row * hidden + c]);
  int blocks = (hidden + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  return epx_e4m3_to_float(((const uint8_t *)recv_x)[row * hidden + c]) * scales[row * blocks + c / EPX_FP8_BLOCK];
}

static float round_to(epx_dtype_t t, float v) {
  return t == EPX_BFLOAT16 ? epx_bf16_to_float(epx_float_to_bf16(v)) : v;
}

static void put(void *y, epx_dtype_t t, int64_t i, float v) {
  if (t == EPX_BFLOAT16)
    ((uint16_t *)y)[i] = epx_float_to_bf16(v);
  else
    ((float *)y)[i] = v;
}

/* Token layout: one row per token, its local slots' experts weighted and summed in slot order. */
static void standin_tokens(const opts_t *o, int rank, int64_t rows, const void *recv_x, const float *scales,
                           const int32_t *ridx, const float *rw, void *y) {
  const int L = o->experts / o->ranks, H = o->hidden, K = o->topk;
  for (int64_t n = 0; n < rows; n++)
    for (int c = 0; c < H; c++) {
      float xin = recv_value(recv_x, scales, o->recv_dtype, n, H, c), acc = 0.0f;
      for (int k = 0; k < K; k++) {
        int l = ridx[n * K + k];
        if (l < 0) continue;
        acc += rw[n * K + k] * round_to(o->x_dtype, dense_expert_scale(rank * L + l) * xin);
      }
      put(y, o->x_dtype, n * H + c, acc);
    }
}

/* Expert layout: each row through its own expert; blocks of `stride` rows (or padded counts). */
static void standin_experts(const opts_t *o, int rank, const int32_t *counts, const void *recv_x,
                            const float *scales, void *y) {
  const int L = o->experts / o->ranks, H = o->hidden;
  int64_t start = 0;
  for (int l = 0; l < L; l++) {
    int64_t block = o->ll ? (int64_t)o->ranks * o->tokens : (counts[l] + o->align - 1) / o->align * o->align;
    float f = dense_expert_scale(rank * L + l);
    for (int64_t r = start; r < start + counts[l]; r++)
      for (int c = 0; c < H; c++) put(y, o->x_dtype, r * H + c, f * recv_value(recv_x, scales, o->recv_dtype, r, H, c));
    start += block;
  }
}

/* ---- one rank ------------------------------------------------------------------------- */

#define FAIL(b, rank, ...)                                               \
  do {                                                                   \
    snprintf((b)->error[rank], sizeof (b)->error[rank], __VA_ARGS__);    \
    goto done;                                                           \
  } while (0)

#define TRY(b, rank, call)                                                                          \
  do {                                                                                              \
    epx_status_t s_ = (call);                                                                       \
    if (s_ != EPX_SUCCESS) FAIL(b, rank, "%s: %s (%s)", #call, epx_status_string(s_), epx_last_error()); \
  } while (0)

static epx_status_t run_rank(int rank, void *arg) {
  bench_t *b = arg;
  const opts_t *o = &b->o;
  const int L = o->experts / o->ranks, H = o->hidden, K = o->topk, T = o->tokens;
  epx_comm_t *comm = NULL;
  epx_handle_t *handle = NULL;
  void *recv_x = NULL, *y = NULL;
  float *scales = NULL, *rw = NULL, *probs = NULL;
  int32_t *ridx = NULL, counts[EPX_MAX_EXPERTS], per_rank[EPX_MAX_RANKS], *per_expert = NULL;

  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = o->experts;
  cfg.hidden = H;
  cfg.topk = K;
  cfg.max_tokens_per_rank = T;
  cfg.num_sms = o->num_sms;
  TRY(b, rank, epx_comm_init(b->world, rank, &cfg, &comm));
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  hc.algo = o->ll ? EPX_ALGO_LL : EPX_ALGO_HT;
  hc.layout = o->expert_layout ? EPX_LAYOUT_EXPERT : EPX_LAYOUT_TOKEN;
  hc.align = o->align;
  TRY(b, rank, epx_handle_create(comm, &hc, &handle));

  epx_routing_t routing = {.num_tokens = T, .idx_dtype = EPX_INT32, .topk_idx = b->idx[rank], .topk_weights = b->w[rank]};
  per_expert = malloc(sizeof(int32_t) * o->experts);

  /* Plan once to size the receive buffers. */
  TRY(b, rank, epx_notify(comm, handle, &routing));
  epx_handle_info_t info;
  TRY(b, rank, epx_handle_info(handle, &info, NULL));
  int64_t rows = info.num_recv_rows > 0 ? info.num_recv_rows : 1;
  int blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  recv_x = malloc(rows * H * esize(o->recv_dtype));
  y = calloc(rows * H, esize(o->x_dtype));
  scales = malloc(sizeof(float) * rows * blocks);
  ridx = malloc(sizeof(int32_t) * rows * K);
  rw = malloc(sizeof(float) * rows * K);
  probs = malloc(sizeof(float) * rows);
  if (!recv_x || !y || !scales || !ridx || !rw || !probs || !per_expert) FAIL(b, rank, "out of memory for %lld rows", (long long)rows);
  b->sent_dispatch[rank] = (double)info.num_sent_copies * H * esize(o->recv_dtype) +
                           (o->recv_dtype == EPX_FP8_E4M3 ? (double)info.num_sent_copies * blocks * 4 : 0);
  b->sent_combine[rank] = (double)info.num_sent_copies * H * esize(o->x_dtype);

  epx_dispatch_args_t da;
  epx_dispatch_args_init(&da);
  da.x = b->x[rank];
  da.x_dtype = o->x_dtype;
  da.recv_dtype = o->recv_dtype;
  da.recv_x = recv_x;
  da.recv_scales = scales;
  da.recv_capacity = rows;
  da.recv_topk_idx = o->expert_layout || o->ll ? NULL : ridx;
  da.recv_topk_weights = o->expert_layout || o->ll ? NULL : rw;
  da.recv_probs = o->expert_layout || o->ll ? probs : NULL;
  da.tokens_per_local_expert = counts;

  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = y;
  ca.y_dtype = o->x_dtype;
  ca.out = b->out[rank];
  ca.out_dtype = o->x_dtype;
  ca.weighted = o->expert_layout || o->ll;

  for (int it = -o->warmup; it < o->iters; it++) {
    double *secs = it >= 0 ? b->secs + ((size_t)rank * o->iters + it) * PH_COUNT : NULL;
    double t0 = now();
    TRY(b, rank, epx_get_layout(comm, &routing, per_rank, per_expert, NULL));
    double t1 = now();
    TRY(b, rank, epx_notify(comm, handle, &routing));
    double t2 = now();
    TRY(b, rank, epx_dispatch(comm, handle, NULL, &da));
    double t3 = now();
    if (o->expert_layout || o->ll)
      standin_experts(o, rank, counts, recv_x, scales, y);
    else
      standin_tokens(o, rank, info.num_recv_tokens, recv_x, scales, ridx, rw, y);
    double t4 = now();
    TRY(b, rank, epx_combine(comm, handle, &ca));
    double t5 = now();
    if (secs) {
      secs[PH_LAYOUT] = t1 - t0;
      secs[PH_NOTIFY] = t2 - t1;
      secs[PH_DISPATCH] = t3 - t2;
      secs[PH_COMBINE] = t5 - t4;
    }
  }
  (void)L;
done:
  free(recv_x);
  free(y);
  free(scales);
  free(ridx);
  free(rw);
  free(probs);
  free(per_expert);
  epx_handle_destroy(handle);
  epx_comm_destroy(comm);
  return b->error[rank][0] ? EPX_ERR_INTERNAL : EPX_SUCCESS;
}

/* ---- driver --------------------------------------------------------------------------- */

static void usage(void) {
  fprintf(stderr,
          "usage: epx-bench [--backend auto|host|cuda] [--ranks R] [--tokens T] [--hidden H] [--experts E]\n"
          "                 [--topk K] [--dtype bf16|fp32|fp8] [--mode ht|ll] [--layout token|expert]\n"
          "                 [--align A] [--iters N] [--warmup N] [--num-sms S] [--seed N] [--check] [--json]\n"
          "defaults: auto, 8 ranks, 512 tokens per rank, H 7168, 256 experts, top-8, bf16, ht, token layout\n"
          "fp8 dispatches bf16 tokens as e4m3 with a scale per 128 channels; combine stays bf16.\n");
}

static int parse(int argc, char **argv, opts_t *o) {
  *o = (opts_t){.backend = EPX_BACKEND_AUTO, .ranks = 8, .tokens = 512, .hidden = 7168, .experts = 256, .topk = 8,
                .align = 1, .iters = -1, .warmup = 1, .x_dtype = EPX_BFLOAT16, .recv_dtype = EPX_BFLOAT16};
  o->seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define INTARG(name, field)               \
  if (!strcmp(a, name) && v) {            \
    o->field = atoi(v);                   \
    i++;                                  \
    continue;                             \
  }
    INTARG("--ranks", ranks) INTARG("--tokens", tokens) INTARG("--hidden", hidden) INTARG("--experts", experts)
    INTARG("--topk", topk) INTARG("--align", align) INTARG("--iters", iters) INTARG("--warmup", warmup)
    INTARG("--num-sms", num_sms)
#undef INTARG
    if (!strcmp(a, "--seed") && v) { o->seed = strtoull(v, NULL, 10); i++; continue; }
    if (!strcmp(a, "--check")) { o->check = 1; continue; }
    if (!strcmp(a, "--json")) { o->json = 1; continue; }
    if (!strcmp(a, "--backend") && v) {
      i++;
      if (!strcmp(v, "host")) o->backend = EPX_BACKEND_HOST;
      else if (!strcmp(v, "cuda")) o->backend = EPX_BACKEND_CUDA;
      else if (!strcmp(v, "auto")) o->backend = EPX_BACKEND_AUTO;
      else return fprintf(stderr, "unknown backend %s\n", v), -1;
      continue;
    }
    if (!strcmp(a, "--dtype") && v) {
      i++;
      if (!strcmp(v, "bf16")) o->x_dtype = o->recv_dtype = EPX_BFLOAT16;
      else if (!strcmp(v, "fp32")) o->x_dtype = o->recv_dtype = EPX_FLOAT32;
      else if (!strcmp(v, "fp8")) o->x_dtype = EPX_BFLOAT16, o->recv_dtype = EPX_FP8_E4M3;
      else return fprintf(stderr, "unknown dtype %s\n", v), -1;
      continue;
    }
    if (!strcmp(a, "--mode") && v) {
      i++;
      if (!strcmp(v, "ht")) o->ll = 0;
      else if (!strcmp(v, "ll")) o->ll = 1;
      else return fprintf(stderr, "unknown mode %s\n", v), -1;
      continue;
    }
    if (!strcmp(a, "--layout") && v) {
      i++;
      if (!strcmp(v, "token")) o->expert_layout = 0;
      else if (!strcmp(v, "expert")) o->expert_layout = 1;
      else return fprintf(stderr, "unknown layout %s\n", v), -1;
      continue;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return usage(), 1;
    fprintf(stderr, "unknown or incomplete argument %s\n", a);
    return -1;
  }
  if (o->ranks < 1 || o->ranks > EPX_MAX_RANKS || o->tokens < 0 || o->hidden < 1 || o->experts < 1 || o->topk < 1 ||
      o->topk > o->experts || o->align < 1 || o->warmup < 0)
    return fprintf(stderr, "arguments out of range\n"), -1;
  if (o->iters < 0) o->iters = 3;
  if (o->iters < 1) return fprintf(stderr, "--iters must be >= 1\n"), -1;
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median over iterations of the slowest rank. */
static double phase_time(const bench_t *b, int ph) {
  double *v = malloc(sizeof(double) * b->o.iters);
  for (int it = 0; it < b->o.iters; it++) {
    v[it] = 0;
    for (int r = 0; r < b->o.ranks; r++) {
      double s = b->secs[((size_t)r * b->o.iters + it) * PH_COUNT + ph];
      if (s > v[it]) v[it] = s;
    }
  }
  qsort(v, b->o.iters, sizeof(double), cmp_double);
  double m = v[b->o.iters / 2];
  free(v);
  return m;
}

/* Bit-for-bit comparison with the dense single-process layer. */
static int check(const bench_t *b) {
  const opts_t *o = &b->o;
  dense_cfg_t dc = {.nranks = o->ranks, .num_experts = o->experts, .hidden = o->hidden, .topk = o->topk,
                    .x_dtype = o->x_dtype, .recv_dtype = o->recv_dtype, .y_dtype = o->x_dtype,
                    .out_dtype = o->x_dtype, .expert_layout = o->expert_layout || o->ll};
  int64_t nt[EPX_MAX_RANKS];
  void *want[EPX_MAX_RANKS];
  size_t row = (size_t)o->hidden * esize(o->x_dtype);
  for (int r = 0; r < o->ranks; r++) {
    nt[r] = o->tokens;
    want[r] = malloc(row * (o->tokens ? o->tokens : 1));
  }
  int bad = dense_moe(&dc, nt, (const void *const *)b->x, (const int32_t *const *)b->idx,
                      (const float *const *)b->w, want) != 0;
  if (bad) printf("check: FAILED (the dense reference refused the config)\n");
  for (int r = 0; r < o->ranks && !bad; r++)
    for (int64_t i = 0; i < (int64_t)o->tokens * o->hidden && !bad; i++) {
      float got = o->x_dtype == EPX_FLOAT32 ? ((float *)b->out[r])[i] : epx_bf16_to_float(((uint16_t *)b->out[r])[i]);
      float exp = o->x_dtype == EPX_FLOAT32 ? ((float *)want[r])[i] : epx_bf16_to_float(((uint16_t *)want[r])[i]);
      if (memcmp((char *)b->out[r] + i * esize(o->x_dtype), (char *)want[r] + i * esize(o->x_dtype), esize(o->x_dtype))) {
        printf("check: MISMATCH rank %d token %lld channel %lld: got %.9g, dense reference %.9g\n", r,
               (long long)(i / o->hidden), (long long)(i % o->hidden), got, exp);
        bad = 1;
      }
    }
  if (!bad) printf("check: ok (bit for bit against the dense reference, %d ranks x %d tokens)\n", o->ranks, o->tokens);
  for (int r = 0; r < o->ranks; r++) free(want[r]);
  return bad;
}

int main(int argc, char **argv) {
  bench_t b;
  memset(&b, 0, sizeof b);
  int pr = parse(argc, argv, &b.o);
  if (pr) return pr > 0 ? 0 : 2;
  opts_t *o = &b.o;
  if (o->backend == EPX_BACKEND_CUDA && epx_backend_available(EPX_BACKEND_CUDA) != EPX_SUCCESS) {
    fprintf(stderr, "epx-bench: the CUDA backend is not available: %s\n", epx_last_error());
    return 2;
  }
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = o->backend;
  wc.nranks = o->ranks;
  epx_status_t s = epx_world_create(&wc, &b.world);
  if (s != EPX_SUCCESS) {
    fprintf(stderr, "epx-bench: %s (%s)\n", epx_status_string(s), epx_last_error());
    return 2;
  }
  const char *mode = o->ll ? "ll" : "ht", *layout = o->ll || o->expert_layout ? "expert" : "token";
  printf("epx-bench: backend %s, %d ranks, %d tokens/rank, hidden %d, %d experts, top-%d, %s%s, mode %s, layout %s, "
         "align %d, seed %" PRIu64 "\n",
         epx_backend_name(epx_world_backend(b.world)), o->ranks, o->tokens, o->hidden, o->experts, o->topk,
         epx_dtype_name(o->x_dtype), o->recv_dtype == EPX_FP8_E4M3 ? " (fp8 dispatch)" : "", mode, layout, o->align,
         o->seed);

  /* Inputs: values in [-2, 2), K distinct experts per token in random order, weights in (0, 1). */
  uint64_t rng = o->seed;
  size_t row = (size_t)o->hidden * esize(o->x_dtype);
  int *perm = malloc(sizeof(int) * o->experts);
  for (int r = 0; r < o->ranks; r++) {
    int64_t n = (int64_t)o->tokens * o->hidden;
    b.x[r] = malloc(row * (o->tokens ? o->tokens : 1));
    b.out[r] = malloc(row * (o->tokens ? o->tokens : 1));
    b.idx[r] = malloc(sizeof(int32_t) * o->tokens * o->topk + 4);
    b.w[r] = malloc(sizeof(float) * o->tokens * o->topk + 4);
    for (int64_t i = 0; i < n; i++) {
      float v = (float)(uniform(&rng) * 4.0 - 2.0);
      if (o->x_dtype == EPX_FLOAT32) ((float *)b.x[r])[i] = v;
      else ((uint16_t *)b.x[r])[i] = epx_float_to_bf16(v);
    }
    for (int t = 0; t < o->tokens; t++) {
      for (int e = 0; e < o->experts; e++) perm[e] = e;
      for (int k = 0; k < o->topk; k++) {
        int j = k + (int)(splitmix(&rng) % (uint64_t)(o->experts - k));
        int tmp = perm[k];
        perm[k] = perm[j];
        perm[j] = tmp;
        b.idx[r][t * o->topk + k] = perm[k];
        b.w[r][t * o->topk + k] = (float)(0.05 + 0.95 * uniform(&rng));
      }
    }
  }
  free(perm);
  b.secs = calloc((size_t)o->ranks * o->iters * PH_COUNT, sizeof(double));

  epx_status_t statuses[EPX_MAX_RANKS];
  s = epx_run_ranks(o->ranks, run_rank, &b, statuses);
  int rc = 0;
  for (int r = 0; r < o->ranks; r++)
    if (b.error[r][0]) {
      fprintf(stderr, "rank %d: %s\n", r, b.error[r]);
      rc = 1;
    }
  if (!rc) {
    double dbytes = 0, cbytes = 0;
    for (int r = 0; r < o->ranks; r++) dbytes += b.sent_dispatch[r], cbytes += b.sent_combine[r];
    double bytes[PH_COUNT] = {0, 0, dbytes, cbytes};
    printf("%-10s %12s %14s %10s\n", "phase", "time (ms)", "bytes", "GB/s");
    for (int ph = 0; ph < PH_COUNT; ph++) {
      double t = phase_time(&b, ph);
      if (bytes[ph] > 0)
        printf("%-10s %12.3f %14.0f %10.2f\n", phase_names[ph], t * 1e3, bytes[ph], bytes[ph] / t * 1e-9);
      else
        printf("%-10s %12.3f %14s %10s\n", phase_names[ph], t * 1e3, "-", "-");
    }
    printf("bytes: rows sent by all ranks (a token crosses to a rank once); times: median over %d iterations of "
           "the slowest rank\n",
           o->iters);
    if (o->json) {
      printf("{\"backend\":\"%s\",\"ranks\":%d,\"tokens\":%d,\"hidden\":%d,\"experts\":%d,\"topk\":%d,\"dtype\":\"%s\","
             "\"recv_dtype\":\"%s\",\"mode\":\"%s\",\"layout\":\"%s\",\"seed\":%" PRIu64,
             epx_backend_name(epx_world_backend(b.world)), o->ranks, o->tokens, o->hidden, o->experts, o->topk,
             epx_dtype_name(o->x_dtype), epx_dtype_name(o->recv_dtype), mode, layout, o->seed);
      for (int ph = 0; ph < PH_COUNT; ph++)
        printf(",\"%s_ms\":%.6f,\"%s_bytes\":%.0f", phase_names[ph], phase_time(&b, ph) * 1e3, phase_names[ph], bytes[ph]);
      printf("}\n");
    }
    if (o->check) rc = check(&b);
  }
  for (int r = 0; r < o->ranks; r++) {
    free(b.x[r]);
    free(b.out[r]);
    free(b.idx[r]);
    free(b.w[r]);
  }
  free(b.secs);
  epx_world_destroy(b.world);
  (void)s;
  return rc;
}
