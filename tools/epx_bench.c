/* epx-bench: one MoE layer's communication, timed per phase, optionally checked bit for bit
 * against a single-process dense computation of the same layer (tools/dense_ref.c).
 *
 * A run: every rank draws tokens and a top-k routing, then per iteration computes the layout,
 * plans (notify), dispatches, runs a stand-in expert on what it received (global expert e
 * multiplies by dense_expert_scale(e), so routing mistakes change the result) and combines.
 * Times are taken in stream order (CUDA events on the GPU). A phase of a collective starts when
 * its last rank enters it and ends when its last rank leaves it: with every rank on one device
 * (or the host) all timestamps share a clock and that is what is measured, so one rank waiting
 * for a peer still busy with the previous phase (the stand-in experts of 8 ranks take turns on
 * one GPU) is not counted; with a device per rank it is the slowest rank's own time. The figure
 * is the median over iterations. Every figure comes with its floor: the bytes the phase must move
 * through memory over the measured copy bandwidth (all ranks share one device when emulated). */
#include <inttypes.h>
#include <stdbool.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_dev.h"
#include "dense_ref.h"
#include "epx.h"

typedef struct {
  epx_backend_t backend;
  int ranks, tokens, hidden, experts, topk, align, iters, warmup, check, json;
  int ll, a2a, expert_layout, num_sms, graph, ranks_per_node;
  epx_dtype_t x_dtype, recv_dtype;
  uint64_t seed;
} opts_t;

enum { PH_LAYOUT, PH_NOTIFY, PH_DISPATCH, PH_STANDIN, PH_COMBINE, PH_COUNT };
static const char *const phase_names[PH_COUNT] = {"layout", "notify", "dispatch", "experts", "combine"};

/* What each rank receives and sends, counted from the routing on the host. */
typedef struct {
  int64_t recv_tokens, recv_pairs, recv_rows, sent_copies;
  int64_t sent_remote, recv_remote; /* the same, leaving out a rank's own tokens */
} sizes_t;

typedef struct {
  opts_t o;
  const bench_dev_t *dev;
  epx_world_t *world;
  /* per rank inputs and outputs (host memory) */
  void *x[EPX_MAX_RANKS];
  int32_t *idx[EPX_MAX_RANKS];
  float *w[EPX_MAX_RANKS];
  void *out[EPX_MAX_RANKS];
  sizes_t size[EPX_MAX_RANKS];
  double *stamp; /* [rank][iter][event]: ms since the iteration's origin (or the rank's first event) */
  int shared_clock;
  void *origin;  /* shared clock: recorded by rank 0 before each iteration, every rank idle */
  /* the ranks meet between iterations; a rank that fails releases the others */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int arrived, generation, failed;
  char error[EPX_MAX_RANKS][512];
  epx_node_traffic_t traffic[EPX_MAX_RANKS]; /* of each rank's last iteration */
} bench_t;

/* Waits until every rank arrives (0), or a rank failed or 120 s passed (-1). */
static int meet(bench_t *b, int fail) {
  pthread_mutex_lock(&b->lock);
  int rc = 0;
  if (fail) b->failed = 1;
  if (!b->failed && ++b->arrived == b->o.ranks) {
    b->arrived = 0;
    b->generation++;
  } else if (!b->failed) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 120;
    const int gen = b->generation;
    while (gen == b->generation && !b->failed && rc == 0) rc = pthread_cond_timedwait(&b->cond, &b->lock, &until);
    if (rc) b->failed = 1;
  }
  rc = b->failed ? -1 : 0;
  pthread_cond_broadcast(&b->cond);
  pthread_mutex_unlock(&b->lock);
  return rc;
}

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
static int expert_rows(const opts_t *o) { return o->ll || o->expert_layout; }
static int fp8_blocks(int hidden) { return (hidden + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK; }

/* ---- the host "device": plain memory, wall-clock timestamps --------------------------- */

static void *host_alloc(size_t n) { return calloc(n ? n : 16, 1); }
static void host_release(void *p) { free(p); }
static void host_copy(void *d, const void *src, size_t n) { memcpy(d, src, n); }
static void *host_stream_create(void) { return NULL; }
static void host_stream_destroy(void *s) { (void)s; }
static void *host_event_create(void) { return calloc(1, sizeof(double)); }
static void host_event_record(void *ev, void *stream) {
  (void)stream;
  *(double *)ev = now();
}
static double host_elapsed_ms(void *a, void *b) { return (*(double *)b - *(double *)a) * 1e3; }
static int host_bind_rank(int rank, int nranks) {
  (void)rank, (void)nranks;
  return 1;
}

static float recv_value(const bench_standin_t *a, int64_t row, int c) {
  if (a->recv_dtype == EPX_FLOAT32) return ((const float *)a->recv_x)[row * a->hidden + c];
  if (a->recv_dtype == EPX_BFLOAT16) return epx_bf16_to_float(((const uint16_t *)a->recv_x)[row * a->hidden + c]);
  int blocks = (a->hidden + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  return epx_e4m3_to_float(((const uint8_t *)a->recv_x)[row * a->hidden + c]) * a->scales[row * blocks + c / EPX_FP8_BLOCK];
}

static float round_to(epx_dtype_t t, float v) { return t == EPX_BFLOAT16 ? epx_bf16_to_float(epx_float_to_bf16(v)) : v; }

static void put(void *y, epx_dtype_t t, int64_t i, float v) {
  if (t == EPX_BFLOAT16)
    ((uint16_t *)y)[i] = epx_float_to_bf16(v);
  else
    ((float *)y)[i] = v;
}

/* Token layout: one row per token, its local slots' experts weighted and summed in slot order. */
static void host_standin_tokens(const bench_standin_t *a, void *stream) {
  (void)stream;
  for (int64_t n = 0; n < a->rows; n++)
    for (int c = 0; c < a->hidden; c++) {
      float xin = recv_value(a, n, c), acc = 0.0f;
      for (int k = 0; k < a->topk; k++) {
        int l = a->recv_idx[n * a->topk + k];
        if (l < 0) continue;
        acc += a->recv_w[n * a->topk + k] * round_to(a->y_dtype, dense_expert_scale(a->rank * a->num_local + l) * xin);
      }
      put(a->y, a->y_dtype, n * a->hidden + c, acc);
    }
}

/* Expert layout: each counted row through its own expert. */
static void host_standin_experts(const bench_standin_t *a, void *stream) {
  (void)stream;
  int64_t start = 0;
  for (int l = 0; l < a->num_local; l++) {
    int64_t block = a->ll_stride ? a->ll_stride : (a->counts[l] + a->align - 1) / a->align * a->align;
    float f = dense_expert_scale(a->rank * a->num_local + l);
    for (int64_t r = start; r < start + a->counts[l]; r++)
      for (int c = 0; c < a->hidden; c++) put(a->y, a->y_dtype, r * a->hidden + c, f * recv_value(a, r, c));
    start += block;
  }
}

static double host_copy_bandwidth(void) {
  const size_t bytes = (size_t)256 << 20;
  char *a = malloc(bytes), *b = malloc(bytes);
  memset(a, 1, bytes);
  memset(b, 2, bytes);
  double best = 1e30;
  for (int i = 0; i < 3; i++) {
    double t0 = now();
    memcpy(b, a, bytes);
    double t = now() - t0;
    if (t < best) best = t;
  }
  free(a);
  free(b);
  return 2.0 * (double)bytes / best;
}

const bench_dev_t bench_host_dev = {
    "host", host_alloc, host_release, host_copy, host_copy, host_stream_create, host_stream_destroy, host_bind_rank,
    host_event_create, free, host_event_record, host_elapsed_ms, host_standin_tokens, host_standin_experts,
    host_copy_bandwidth, NULL, NULL, NULL, NULL,
};

/* ---- one rank ------------------------------------------------------------------------- */

#define TRY(b, rank, call)                                                                        \
  do {                                                                                            \
    epx_status_t s_ = (call);                                                                     \
    if (s_ != EPX_SUCCESS) {                                                                      \
      snprintf((b)->error[rank], sizeof (b)->error[rank], "%s: %s (%s)", #call, epx_status_string(s_), \
               epx_last_error());                                                                 \
      goto done;                                                                                  \
    }                                                                                             \
  } while (0)

static epx_status_t run_rank(int rank, void *arg) {
  bench_t *b = arg;
  const opts_t *o = &b->o;
  const bench_dev_t *dev = b->dev;
  const int L = o->experts / o->ranks, H = o->hidden, K = o->topk, T = o->tokens, R = o->ranks;
  const int64_t rows = b->size[rank].recv_rows > 0 ? b->size[rank].recv_rows : 1;
  epx_comm_t *comm = NULL;
  epx_handle_t *handle = NULL;
  void *ev[PH_COUNT + 1] = {0}, *graph = NULL;
  dev->bind_rank(rank, R);

  /* Everything is allocated before the first collective call: an allocation must never
   * wait on the device while a peer's kernel waits on this rank. */
  void *stream = dev->stream_create();
  void *x = dev->alloc((size_t)T * H * esize(o->x_dtype)), *out = dev->alloc((size_t)T * H * esize(o->x_dtype));
  int32_t *idx = dev->alloc(sizeof(int32_t) * T * K), *per_rank = dev->alloc(sizeof(int32_t) * R),
          *per_expert = dev->alloc(sizeof(int32_t) * o->experts), *counts = dev->alloc(sizeof(int32_t) * L),
          *ridx = dev->alloc(sizeof(int32_t) * rows * K);
  float *w = dev->alloc(sizeof(float) * T * K), *scales = dev->alloc(sizeof(float) * rows * fp8_blocks(H)),
        *rw = dev->alloc(sizeof(float) * rows * K), *probs = dev->alloc(sizeof(float) * rows);
  void *recv_x = dev->alloc((size_t)rows * H * esize(o->recv_dtype)), *y = dev->alloc((size_t)rows * H * esize(o->x_dtype));
  int32_t *counts_host = calloc(L, sizeof(int32_t));
  dev->upload(x, b->x[rank], (size_t)T * H * esize(o->x_dtype));
  dev->upload(idx, b->idx[rank], sizeof(int32_t) * T * K);
  dev->upload(w, b->w[rank], sizeof(float) * T * K);
  for (int i = 0; i <= PH_COUNT; i++) ev[i] = dev->event_create();

  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = o->experts;
  cfg.hidden = H;
  cfg.topk = K;
  cfg.max_tokens_per_rank = T;
  cfg.num_sms = o->num_sms;
  cfg.ranks_per_node = o->ranks_per_node;
  TRY(b, rank, epx_comm_init(b->world, rank, &cfg, &comm));
  if (stream) TRY(b, rank, epx_comm_set_stream(comm, stream));
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  hc.algo = o->ll ? EPX_ALGO_LL : o->a2a ? EPX_ALGO_ALLTOALL : EPX_ALGO_HT;
  hc.layout = o->expert_layout ? EPX_LAYOUT_EXPERT : EPX_LAYOUT_TOKEN;
  hc.align = o->align;
  hc.exact = 0; /* sizes come from the host's count; no sync inside the timed phases */
  TRY(b, rank, epx_handle_create(comm, &hc, &handle));

  epx_routing_t routing = {.num_tokens = T, .idx_dtype = EPX_INT32, .topk_idx = idx, .topk_weights = w};
  epx_dispatch_args_t da;
  epx_dispatch_args_init(&da);
  da.x = x;
  da.x_dtype = o->x_dtype;
  da.recv_dtype = o->recv_dtype;
  da.recv_x = recv_x;
  da.recv_scales = scales;
  da.recv_capacity = rows;
  da.recv_topk_idx = expert_rows(o) ? NULL : ridx;
  da.recv_topk_weights = expert_rows(o) ? NULL : rw;
  da.recv_probs = expert_rows(o) ? probs : NULL;
  da.tokens_per_local_expert = counts;

  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = y;
  ca.y_dtype = o->x_dtype;
  ca.out = out;
  ca.out_dtype = o->x_dtype;
  ca.weighted = expert_rows(o);

  bench_standin_t sa = {.rank = rank, .nranks = R, .num_local = L, .hidden = H, .topk = K, .align = o->align,
                        .ll_stride = o->ll ? (int64_t)R * T : 0, .recv_dtype = o->recv_dtype, .y_dtype = o->x_dtype,
                        .rows = expert_rows(o) ? rows : b->size[rank].recv_tokens, .recv_x = recv_x,
                        .scales = scales, .recv_idx = ridx, .recv_w = rw, .counts = counts, .y = y};

  /* With --graph the first iteration sizes every buffer, then the layer is captured once and
   * each timed iteration replays it (the events are nodes of the graph). */
  for (int it = -o->warmup - (o->graph ? 1 : 0); it < o->iters; it++) {
    const bool capture = o->graph && it == -o->warmup;
    if (b->shared_clock) { /* every rank idle, then the origin, then the iteration */
      if (meet(b, 0)) goto done;
      if (rank == 0) {
        dev->event_record(b->origin, stream);
        dev->elapsed_ms(b->origin, b->origin); /* waits for it */
      }
      if (meet(b, 0)) goto done;
    }
    if (graph) {
      dev->graph_launch(graph, stream);
    } else {
      if (capture) dev->capture_begin(stream);
      dev->event_record(ev[0], stream);
      TRY(b, rank, epx_get_layout(comm, &routing, per_rank, per_expert, NULL));
      dev->event_record(ev[1], stream);
      TRY(b, rank, epx_notify(comm, handle, &routing));
      dev->event_record(ev[2], stream);
      TRY(b, rank, epx_dispatch(comm, handle, NULL, &da));
      dev->event_record(ev[3], stream);
      if (expert_rows(o))
        dev->standin_experts(&sa, stream);
      else
        dev->standin_tokens(&sa, stream);
      dev->event_record(ev[4], stream);
      TRY(b, rank, epx_combine(comm, handle, &ca));
      dev->event_record(ev[5], stream);
      if (capture) {
        graph = dev->capture_end(stream);
        dev->graph_launch(graph, stream);
      }
    }
    TRY(b, rank, epx_comm_synchronize(comm));
    if (it >= 0)
      for (int i = 0; i <= PH_COUNT; i++)
        b->stamp[((size_t)rank * o->iters + it) * (PH_COUNT + 1) + i] =
            dev->elapsed_ms(b->shared_clock ? b->origin : ev[0], ev[i]);
  }
  TRY(b, rank, epx_handle_node_traffic(handle, &b->traffic[rank]));
  dev->download(counts_host, counts, sizeof(int32_t) * L);
  dev->download(b->out[rank], out, (size_t)T * H * esize(o->x_dtype));
  int64_t pairs = 0;
  for (int l = 0; l < L; l++) pairs += counts_host[l];
  if (pairs != b->size[rank].recv_pairs)
    snprintf(b->error[rank], sizeof b->error[rank], "tokens_per_local_expert sums to %lld pairs, the routing has %lld",
             (long long)pairs, (long long)b->size[rank].recv_pairs);
done:
  if (b->error[rank][0]) meet(b, 1);
  if (graph) dev->graph_destroy(graph);
  epx_handle_destroy(handle);
  epx_comm_destroy(comm);
  void *bufs[] = {x, out, idx, per_rank, per_expert, counts, ridx, w, scales, rw, probs, recv_x, y};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) dev->release(bufs[i]);
  for (int i = 0; i <= PH_COUNT; i++)
    if (ev[i]) dev->event_destroy(ev[i]);
  dev->stream_destroy(stream);
  free(counts_host);
  return b->error[rank][0] ? EPX_ERR_INTERNAL : EPX_SUCCESS;
}

/* ---- driver --------------------------------------------------------------------------- */

static void usage(void) {
  fprintf(stderr,
          "usage: epx-bench [--backend auto|host|cuda] [--ranks R] [--tokens T] [--hidden H] [--experts E]\n"
          "                 [--topk K] [--dtype bf16|fp32|fp8] [--mode ht|ll|a2a] [--layout token|expert]\n"
          "                 [--align A] [--iters N] [--warmup N] [--num-sms S] [--seed N] [--check] [--json] [--graph]\n"
          "                 [--ranks-per-node P]\n"
          "defaults: auto, 8 ranks, 512 tokens per rank, H 7168, 256 experts, top-8, bf16, ht, token layout\n"
          "fp8 dispatches bf16 tokens as e4m3 with a scale per 128 channels; combine stays bf16.\n"
          "a2a is the permute -> all-to-all -> sort baseline on the same API.\n"
          "--graph (CUDA) captures the layer once and times graph replays.\n"
          "--ranks-per-node P groups the ranks in nodes of P (host backend): combine follows the node-aware\n"
          "order, and the bytes that cross node boundaries are printed next to one crossing per rank.\n");
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
    INTARG("--num-sms", num_sms) INTARG("--ranks-per-node", ranks_per_node)
#undef INTARG
    if (!strcmp(a, "--seed") && v) { o->seed = strtoull(v, NULL, 10); i++; continue; }
    if (!strcmp(a, "--check")) { o->check = 1; continue; }
    if (!strcmp(a, "--json")) { o->json = 1; continue; }
    if (!strcmp(a, "--graph")) { o->graph = 1; continue; }
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
      if (!strcmp(v, "ht")) o->ll = o->a2a = 0;
      else if (!strcmp(v, "ll")) o->ll = 1, o->a2a = 0;
      else if (!strcmp(v, "a2a")) o->ll = 0, o->a2a = 1;
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
      o->topk > o->experts || o->align < 1 || o->warmup < 0 || o->ranks_per_node < 0)
    return fprintf(stderr, "arguments out of range\n"), -1;
  if (o->iters < 0) o->iters = 3;
  if (o->iters < 1) return fprintf(stderr, "--iters must be >= 1\n"), -1;
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median over iterations, in ms, of the phase from its last rank's start to its last rank's
 * end (shared clock), or of the slowest rank's own time. */
static double phase_ms(const bench_t *b, int ph) {
  double *v = malloc(sizeof(double) * b->o.iters);
  for (int it = 0; it < b->o.iters; it++) {
    double start = -1e300, end = -1e300, own = 0;
    for (int r = 0; r < b->o.ranks; r++) {
      const double *e = b->stamp + ((size_t)r * b->o.iters + it) * (PH_COUNT + 1);
      if (e[ph] > start) start = e[ph];
      if (e[ph + 1] > end) end = e[ph + 1];
      if (e[ph + 1] - e[ph] > own) own = e[ph + 1] - e[ph];
    }
    v[it] = b->shared_clock ? end - start : own;
  }
  qsort(v, b->o.iters, sizeof(double), cmp_double);
  double m = v[b->o.iters / 2];
  free(v);
  return m;
}

/* Receive sizes of every rank, from the routings. */
static void count_sizes(bench_t *b) {
  const opts_t *o = &b->o;
  const int R = o->ranks, L = o->experts / R, K = o->topk;
  int64_t *pairs = calloc((size_t)R * L, sizeof(int64_t));
  for (int s = 0; s < R; s++)
    for (int t = 0; t < o->tokens; t++) {
      uint64_t ranks = 0;
      for (int k = 0; k < K; k++) {
        int e = b->idx[s][t * K + k];
        if (e < 0) continue;
        ranks |= 1ull << (e / L);
        pairs[e]++;
      }
      for (int d = 0; d < R; d++) {
        if (!((ranks >> d) & 1)) continue;
        b->size[d].recv_tokens++, b->size[s].sent_copies++;
        if (d != s) b->size[d].recv_remote++, b->size[s].sent_remote++;
      }
    }
  for (int d = 0; d < R; d++) {
    for (int l = 0; l < L; l++) {
      b->size[d].recv_pairs += pairs[d * L + l];
      b->size[d].recv_rows += (pairs[d * L + l] + o->align - 1) / o->align * o->align;
    }
    if (o->ll) b->size[d].recv_rows = (int64_t)L * R * o->tokens;
    else if (!o->expert_layout) b->size[d].recv_rows = b->size[d].recv_tokens;
  }
  free(pairs);
}

/* Bytes each phase must read plus write in memory, summed over ranks (the emulation's floor
 * at the copy bandwidth), and bytes that cross between ranks (the link's share). */
static void phase_bytes(const bench_t *b, double *memory, double *link) {
  const opts_t *o = &b->o;
  const double H = o->hidden, xs = (double)esize(o->x_dtype), rs = (double)esize(o->recv_dtype),
               sc = o->recv_dtype == EPX_FP8_E4M3 ? 4.0 * fp8_blocks(o->hidden) / H : 0.0;
  for (int ph = 0; ph < PH_COUNT; ph++) memory[ph] = link[ph] = 0;
  for (int r = 0; r < o->ranks; r++) {
    const sizes_t *z = &b->size[r];
    const double written = expert_rows(o) ? (double)(o->ll ? z->recv_pairs : z->recv_rows) : (double)z->recv_tokens;
    memory[PH_DISPATCH] += (double)z->recv_tokens * H * xs + written * H * (rs + sc);
    link[PH_DISPATCH] += (double)z->sent_copies * H * (rs + sc);
    if (expert_rows(o))
      memory[PH_COMBINE] += (double)z->recv_pairs * H * xs + 2.0 * (double)z->recv_tokens * H * xs;
    else
      memory[PH_COMBINE] += (double)z->recv_tokens * H * xs;
    memory[PH_COMBINE] += (double)o->tokens * H * xs;
    link[PH_COMBINE] += (double)z->sent_copies * H * xs;
  }
}

/* Bytes that crossed node boundaries in the last iteration, summed over ranks, against one
 * crossing per destination rank. */
static void print_node_traffic(const bench_t *b) {
  double d = 0, c = 0, d_rank = 0, c_rank = 0;
  for (int r = 0; r < b->o.ranks; r++) {
    d += (double)b->traffic[r].dispatch_bytes, c += (double)b->traffic[r].combine_bytes;
    d_rank += (double)b->traffic[r].dispatch_bytes_per_rank, c_rank += (double)b->traffic[r].combine_bytes_per_rank;
  }
  printf("nodes: %d of %d ranks; bytes across node boundaries (all ranks, one iteration):\n", b->o.ranks / b->o.ranks_per_node,
         b->o.ranks_per_node);
  printf("  dispatch %14.0f  one crossing per rank %14.0f  (%.1f%%)\n", d, d_rank, d_rank > 0 ? 100.0 * d / d_rank : 100.0);
  printf("  combine  %14.0f  one crossing per rank %14.0f  (%.1f%%)\n", c, c_rank, c_rank > 0 ? 100.0 * c / c_rank : 100.0);
}

/* Bit-for-bit comparison with the dense single-process layer. */
static int check(const bench_t *b) {
  const opts_t *o = &b->o;
  dense_cfg_t dc = {.nranks = o->ranks, .num_experts = o->experts, .hidden = o->hidden, .topk = o->topk,
                    .x_dtype = o->x_dtype, .recv_dtype = o->recv_dtype, .y_dtype = o->x_dtype,
                    .out_dtype = o->x_dtype, .expert_layout = expert_rows(o),
                    .ranks_per_node = o->ll ? 0 : o->ranks_per_node};
  int64_t nt[EPX_MAX_RANKS];
  void *want[EPX_MAX_RANKS];
  const size_t es = esize(o->x_dtype), row = (size_t)o->hidden * es;
  for (int r = 0; r < o->ranks; r++) {
    nt[r] = o->tokens;
    want[r] = malloc(row * (o->tokens ? o->tokens : 1));
  }
  int bad = dense_moe(&dc, nt, (const void *const *)b->x, (const int32_t *const *)b->idx,
                      (const float *const *)b->w, want) != 0;
  if (bad) printf("check: FAILED (the dense reference refused the config)\n");
  for (int r = 0; r < o->ranks && !bad; r++)
    for (int64_t i = 0; i < (int64_t)o->tokens * o->hidden && !bad; i++) {
      if (!memcmp((char *)b->out[r] + i * es, (char *)want[r] + i * es, es)) continue;
      float got = o->x_dtype == EPX_FLOAT32 ? ((float *)b->out[r])[i] : epx_bf16_to_float(((uint16_t *)b->out[r])[i]);
      float exp = o->x_dtype == EPX_FLOAT32 ? ((float *)want[r])[i] : epx_bf16_to_float(((uint16_t *)want[r])[i]);
      printf("check: MISMATCH rank %d token %lld channel %lld: got %.9g, dense reference %.9g\n", r,
             (long long)(i / o->hidden), (long long)(i % o->hidden), got, exp);
      bad = 1;
    }
  if (!bad) printf("check: ok (bit for bit against the dense reference, %d ranks x %d tokens)\n", o->ranks, o->tokens);
  for (int r = 0; r < o->ranks; r++) free(want[r]);
  return bad;
}

int main(int argc, char **argv) {
  static bench_t b;
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
  b.dev = &bench_host_dev;
#ifdef EPX_BENCH_CUDA
  if (epx_world_backend(b.world) == EPX_BACKEND_CUDA) b.dev = &bench_cuda_dev;
#endif
  if (o->graph && !b.dev->capture_begin) {
    fprintf(stderr, "epx-bench: --graph needs the CUDA backend\n");
    epx_world_destroy(b.world);
    return 2;
  }
  if (!o->num_sms) o->num_sms = 16;
  const char *mode = o->ll ? "ll" : o->a2a ? "a2a" : "ht", *layout = expert_rows(o) ? "expert" : "token";
  printf("epx-bench: backend %s, %d ranks, %d tokens/rank, hidden %d, %d experts, top-%d, %s%s, mode %s, layout %s, "
         "align %d, %d SMs per rank, seed %" PRIu64 "\n",
         epx_backend_name(epx_world_backend(b.world)), o->ranks, o->tokens, o->hidden, o->experts, o->topk,
         epx_dtype_name(o->x_dtype), o->recv_dtype == EPX_FP8_E4M3 ? " (fp8 dispatch)" : "", mode, layout, o->align,
         o->num_sms, o->seed);

  /* Inputs: values in [-2, 2), K distinct experts per token in random order, weights in (0, 1). */
  uint64_t rng = o->seed;
  const size_t row = (size_t)o->hidden * esize(o->x_dtype);
  int *perm = malloc(sizeof(int) * o->experts);
  for (int r = 0; r < o->ranks; r++) {
    const int64_t n = (int64_t)o->tokens * o->hidden;
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
  count_sizes(&b);
  b.stamp = calloc((size_t)o->ranks * o->iters * (PH_COUNT + 1), sizeof(double));
  pthread_mutex_init(&b.lock, NULL);
  pthread_cond_init(&b.cond, NULL);
  b.shared_clock = b.dev->bind_rank(0, o->ranks) == 1;
  b.origin = b.dev->event_create();
  const double copy_bw = b.dev->copy_bandwidth();

  epx_run_ranks(o->ranks, run_rank, &b, NULL);
  int rc = 0;
  for (int r = 0; r < o->ranks; r++)
    if (b.error[r][0]) {
      fprintf(stderr, "rank %d: %s\n", r, b.error[r]);
      rc = 1;
    }
  if (!rc) {
    double memory[PH_COUNT], link[PH_COUNT];
    phase_bytes(&b, memory, link);
    printf("copy bandwidth (read + write): %.0f GB/s, the floor below\n", copy_bw * 1e-9);
    printf("%-9s %10s %14s %10s %10s %8s\n", "phase", "time ms", "link bytes", "link GB/s", "floor ms", "of floor");
    for (int ph = 0; ph < PH_COUNT; ph++) {
      const double ms = phase_ms(&b, ph);
      if (link[ph] > 0) {
        const double floor_ms = memory[ph] / copy_bw * 1e3;
        printf("%-9s %10.3f %14.0f %10.1f %10.3f %7.0f%%\n", phase_names[ph], ms, link[ph], link[ph] / ms * 1e-6,
               floor_ms, 100.0 * floor_ms / ms);
      } else {
        printf("%-9s %10.3f %14s %10s %10s %8s\n", phase_names[ph], ms, "-", "-", "-", "-");
      }
    }
    printf("link bytes: rows that cross between ranks (a token crosses to a rank once); floor: bytes each phase\n"
           "reads and writes in memory over the copy bandwidth; times: median over %d iterations, %s\n",
           o->iters, b.shared_clock ? "from the last rank's start to the last rank's end" : "the slowest rank's own");
    /* With a GPU per rank the floor is the link: the busiest rank's max(sent, received) over
     * NVLink 4's 450 GB/s per direction. */
    double busiest = 0;
    for (int r = 0; r < o->ranks; r++) {
      const double n = (double)(b.size[r].sent_remote > b.size[r].recv_remote ? b.size[r].sent_remote : b.size[r].recv_remote);
      if (n > busiest) busiest = n;
    }
    const double dispatch_link = busiest * o->hidden * ((double)esize(o->recv_dtype) + (o->recv_dtype == EPX_FP8_E4M3 ? 4.0 * fp8_blocks(o->hidden) / o->hidden : 0.0));
    const double combine_link = busiest * o->hidden * (double)esize(o->x_dtype);
    printf("with a GPU per rank (NVLink 450 GB/s): dispatch floor %.3f ms, %.0f GB/s per GPU (%.0f%%); combine floor "
           "%.3f ms, %.0f GB/s per GPU (%.0f%%)\n",
           dispatch_link / 450e9 * 1e3, dispatch_link / (phase_ms(&b, PH_DISPATCH) * 1e-3) * 1e-9,
           100.0 * dispatch_link / 450e9 * 1e3 / phase_ms(&b, PH_DISPATCH), combine_link / 450e9 * 1e3,
           combine_link / (phase_ms(&b, PH_COMBINE) * 1e-3) * 1e-9,
           100.0 * combine_link / 450e9 * 1e3 / phase_ms(&b, PH_COMBINE));
    if (o->json) {
      printf("{\"backend\":\"%s\",\"ranks\":%d,\"tokens\":%d,\"hidden\":%d,\"experts\":%d,\"topk\":%d,\"dtype\":\"%s\","
             "\"recv_dtype\":\"%s\",\"mode\":\"%s\",\"layout\":\"%s\",\"num_sms\":%d,\"seed\":%" PRIu64
             ",\"copy_gbps\":%.1f",
             epx_backend_name(epx_world_backend(b.world)), o->ranks, o->tokens, o->hidden, o->experts, o->topk,
             epx_dtype_name(o->x_dtype), epx_dtype_name(o->recv_dtype), mode, layout, o->num_sms, o->seed,
             copy_bw * 1e-9);
      for (int ph = 0; ph < PH_COUNT; ph++)
        printf(",\"%s_ms\":%.6f,\"%s_link_bytes\":%.0f,\"%s_floor_ms\":%.6f", phase_names[ph], phase_ms(&b, ph),
               phase_names[ph], link[ph], phase_names[ph], memory[ph] / copy_bw * 1e3);
      printf("}\n");
    }
    if (o->ranks_per_node > 0 && o->ranks_per_node < o->ranks) print_node_traffic(&b);
    if (o->check) rc = check(&b);
  }
  for (int r = 0; r < o->ranks; r++) {
    free(b.x[r]);
    free(b.out[r]);
    free(b.idx[r]);
    free(b.w[r]);
  }
  free(b.stamp);
  b.dev->event_destroy(b.origin);
  epx_world_destroy(b.world);
  return rc;
}
