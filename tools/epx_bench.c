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
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "dense_ref.h"

typedef bench_opts_t opts_t;

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
  double started, last_progress; /* wall clock: progress lines for long runs */
  epx_node_traffic_t traffic[EPX_MAX_RANKS]; /* of each rank's last iteration */
} bench_t;

/* Rank r's event times in iteration it: [PH_COUNT + 1], ms (see bench_t.stamp). */
static double *stamps_of(const bench_t *b, int r, int it) {
  return b->stamp + ((size_t)r * b->o.iters + it) * (PH_COUNT + 1);
}

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
    host_copy_bandwidth, NULL, NULL, NULL, NULL, NULL, NULL,
};

/* ---- one rank ------------------------------------------------------------------------- */

/* A run longer than a few seconds says how far it is, on stderr (the results go elsewhere). */
static void progress(bench_t *b, int it) {
  const double t = now();
  if (t - b->started < 3.0 || t - b->last_progress < 5.0) return;
  b->last_progress = t;
  if (it < 0)
    fprintf(stderr, "epx-bench: warm-up %d of %d, %.0f s\n", it + b->o.warmup + 1, b->o.warmup, t - b->started);
  else
    fprintf(stderr, "epx-bench: iteration %d of %d, %.0f s\n", it + 1, b->o.iters, t - b->started);
}

#define TRY(b, rank, call)                                                                        \
  do {                                                                                            \
    epx_status_t s_ = (call);                                                                     \
    if (s_ != EPX_SUCCESS) {                                                                      \
      snprintf((b)->error[rank], sizeof (b)->error[rank], "%s: %s (%s)", #call, epx_status_string(s_), \
               epx_last_error());                                                                 \
      goto done;                                                                                  \
    }                                                                                             \
  } while (0)

/* What one rank's layer calls take. */
typedef struct {
  epx_comm_t *comm;
  epx_handle_t *handle;
  void *stream, *ev[PH_COUNT + 1];
  epx_routing_t routing;
  int32_t *per_rank, *per_expert;
  epx_dispatch_args_t da;
  epx_combine_args_t ca;
  bench_standin_t sa;
} layer_t;

/* The comm and the handle of the options: 0, or 1 with the rank's error set. */
static int open_comm(bench_t *b, int rank, layer_t *l) {
  const opts_t *o = &b->o;
  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = o->experts;
  cfg.hidden = o->hidden;
  cfg.topk = o->topk;
  cfg.max_tokens_per_rank = o->tokens;
  cfg.num_sms = o->num_sms;
  cfg.ranks_per_node = o->ranks_per_node;
  TRY(b, rank, epx_comm_init(b->world, rank, &cfg, &l->comm));
  if (l->stream) TRY(b, rank, epx_comm_set_stream(l->comm, l->stream));
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  hc.algo = o->ll ? EPX_ALGO_LL : o->a2a ? EPX_ALGO_ALLTOALL : EPX_ALGO_HT;
  hc.layout = o->expert_layout ? EPX_LAYOUT_EXPERT : EPX_LAYOUT_TOKEN;
  hc.align = o->align;
  hc.exact = 0; /* sizes come from the host's count; no sync inside the timed phases */
  TRY(b, rank, epx_handle_create(l->comm, &hc, &l->handle));
  return 0;
done:
  return 1;
}

/* One layer issued on the rank's stream, an event between phases: 0, or 1 with the error set. */
static int issue_layer(bench_t *b, int rank, layer_t *l) {
  const bench_dev_t *dev = b->dev;
  dev->event_record(l->ev[0], l->stream);
  TRY(b, rank, epx_get_layout(l->comm, &l->routing, l->per_rank, l->per_expert, NULL));
  dev->event_record(l->ev[1], l->stream);
  TRY(b, rank, epx_notify(l->comm, l->handle, &l->routing));
  dev->event_record(l->ev[2], l->stream);
  TRY(b, rank, epx_dispatch(l->comm, l->handle, NULL, &l->da));
  dev->event_record(l->ev[3], l->stream);
  if (expert_rows(&b->o))
    dev->standin_experts(&l->sa, l->stream);
  else
    dev->standin_tokens(&l->sa, l->stream);
  dev->event_record(l->ev[4], l->stream);
  TRY(b, rank, epx_combine(l->comm, l->handle, &l->ca));
  dev->event_record(l->ev[5], l->stream);
  return 0;
done:
  return 1;
}

static epx_status_t run_rank(int rank, void *arg) {
  bench_t *b = arg;
  const opts_t *o = &b->o;
  const bench_dev_t *dev = b->dev;
  const int L = o->experts / o->ranks, H = o->hidden, K = o->topk, T = o->tokens, R = o->ranks;
  const int64_t rows = b->size[rank].recv_rows > 0 ? b->size[rank].recv_rows : 1;
  layer_t l = {0};
  void *graph = NULL;
  dev->bind_rank(rank, R);

  /* Everything is allocated before the first collective call: an allocation must never
   * wait on the device while a peer's kernel waits on this rank. */
  void *stream = l.stream = dev->stream_create();
  void *x = dev->alloc((size_t)T * H * esize(o->x_dtype)), *out = dev->alloc((size_t)T * H * esize(o->x_dtype));
  int32_t *idx = dev->alloc(sizeof(int32_t) * T * K), *per_rank = l.per_rank = dev->alloc(sizeof(int32_t) * R),
          *per_expert = l.per_expert = dev->alloc(sizeof(int32_t) * o->experts), *counts = dev->alloc(sizeof(int32_t) * L),
          *ridx = dev->alloc(sizeof(int32_t) * rows * K);
  float *w = dev->alloc(sizeof(float) * T * K), *scales = dev->alloc(sizeof(float) * rows * fp8_blocks(H)),
        *rw = dev->alloc(sizeof(float) * rows * K), *probs = dev->alloc(sizeof(float) * rows);
  /* The stand-in experts write their outputs over recv_x where the types match, as a fused
   * expert may (each element is read before it is written): 8 ranks of 32k tokens in the
   * expert layout then need about 73 GB in bf16 with a 4 GB arena (103 with y apart). */
  const bool y_in_place = o->recv_dtype == o->x_dtype;
  void *recv_x = dev->alloc((size_t)rows * H * esize(o->recv_dtype));
  void *y = y_in_place ? recv_x : dev->alloc((size_t)rows * H * esize(o->x_dtype));
  int32_t *counts_host = calloc(L, sizeof(int32_t));
  dev->upload(x, b->x[rank], (size_t)T * H * esize(o->x_dtype));
  dev->upload(idx, b->idx[rank], sizeof(int32_t) * T * K);
  dev->upload(w, b->w[rank], sizeof(float) * T * K);
  for (int i = 0; i <= PH_COUNT; i++) l.ev[i] = dev->event_create();
  if (open_comm(b, rank, &l)) goto done;

  l.routing = (epx_routing_t){.num_tokens = T, .idx_dtype = EPX_INT32, .topk_idx = idx, .topk_weights = w};
  epx_dispatch_args_init(&l.da);
  l.da.x = x, l.da.x_dtype = o->x_dtype, l.da.recv_dtype = o->recv_dtype;
  l.da.recv_x = recv_x, l.da.recv_scales = scales, l.da.recv_capacity = rows;
  l.da.recv_topk_idx = expert_rows(o) ? NULL : ridx;
  l.da.recv_topk_weights = expert_rows(o) ? NULL : rw;
  l.da.recv_probs = expert_rows(o) ? probs : NULL;
  l.da.tokens_per_local_expert = counts;

  epx_combine_args_init(&l.ca);
  l.ca.y = y, l.ca.y_dtype = o->x_dtype, l.ca.out = out, l.ca.out_dtype = o->x_dtype;
  l.ca.weighted = expert_rows(o);

  l.sa = (bench_standin_t){.rank = rank, .nranks = R, .num_local = L, .hidden = H, .topk = K, .align = o->align,
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
      if (issue_layer(b, rank, &l)) goto done;
      if (capture) {
        graph = dev->capture_end(stream);
        dev->graph_launch(graph, stream);
      }
    }
    TRY(b, rank, epx_comm_synchronize(l.comm));
    if (rank == 0) progress(b, it);
    if (it >= 0)
      for (int i = 0; i <= PH_COUNT; i++)
        stamps_of(b, rank, it)[i] = dev->elapsed_ms(b->shared_clock ? b->origin : l.ev[0], l.ev[i]);
  }
  TRY(b, rank, epx_handle_node_traffic(l.handle, &b->traffic[rank]));
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
  epx_handle_destroy(l.handle);
  epx_comm_destroy(l.comm);
  void *bufs[] = {x, out, idx, per_rank, per_expert, counts, ridx, w, scales, rw, probs, recv_x, y_in_place ? NULL : y};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) dev->release(bufs[i]);
  for (int i = 0; i <= PH_COUNT; i++)
    if (l.ev[i]) dev->event_destroy(l.ev[i]);
  dev->stream_destroy(stream);
  free(counts_host);
  return b->error[rank][0] ? EPX_ERR_INTERNAL : EPX_SUCCESS;
}

/* ---- one run --------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The median of v[0..n), which it sorts. */
static double median(double *v, int n) {
  qsort(v, n, sizeof(double), cmp_double);
  return v[n / 2];
}

/* Median over iterations, in ms, of the phase from its last rank's start to its last rank's
 * end (shared clock), or of the slowest rank's own time. */
static double phase_ms(const bench_t *b, int ph) {
  double *v = malloc(sizeof(double) * b->o.iters);
  for (int it = 0; it < b->o.iters; it++) {
    double start = -1e300, end = -1e300, own = 0;
    for (int r = 0; r < b->o.ranks; r++) {
      const double *e = stamps_of(b, r, it);
      if (e[ph] > start) start = e[ph];
      if (e[ph + 1] > end) end = e[ph + 1];
      if (e[ph + 1] - e[ph] > own) own = e[ph + 1] - e[ph];
    }
    v[it] = b->shared_clock ? end - start : own;
  }
  const double m = median(v, b->o.iters);
  free(v);
  return m;
}

/* Each rank's start (after the phase's first) and own time in phase ph, medians over iterations:
 * which rank a phase waits for, and whether it is slow or only late. */
static void rank_phases(const bench_t *b, int ph, double *start, double *own) {
  const int n = b->o.iters;
  double *v = malloc(sizeof(double) * n), *w = malloc(sizeof(double) * n);
  for (int r = 0; r < b->o.ranks; r++) {
    for (int it = 0; it < n; it++) {
      double first = 1e300;
      for (int q = 0; q < b->o.ranks; q++) first = fmin(first, stamps_of(b, q, it)[ph]);
      const double *e = stamps_of(b, r, it);
      v[it] = b->shared_clock ? e[ph] - first : 0.0;
      w[it] = e[ph + 1] - e[ph];
    }
    start[r] = median(v, n), own[r] = median(w, n);
  }
  free(v);
  free(w);
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

/* Bit-for-bit comparison with the dense single-process layer. */
static int check(const bench_t *b, char *detail, size_t n) {
  const opts_t *o = &b->o;
  dense_cfg_t dc = {.nranks = o->ranks, .num_experts = o->experts, .hidden = o->hidden, .topk = o->topk,
                    .x_dtype = o->x_dtype, .recv_dtype = o->recv_dtype, .y_dtype = o->x_dtype,
                    .out_dtype = o->x_dtype, .expert_layout = expert_rows(o),
                    .ranks_per_node = o->ll ? 0 : o->ranks_per_node}; /* low-latency: the flat order */
  int64_t nt[EPX_MAX_RANKS];
  void *want[EPX_MAX_RANKS];
  const size_t es = esize(o->x_dtype), row = (size_t)o->hidden * es;
  for (int r = 0; r < o->ranks; r++) {
    nt[r] = o->tokens;
    want[r] = malloc(row * (o->tokens ? o->tokens : 1));
  }
  int bad = dense_moe(&dc, nt, (const void *const *)b->x, (const int32_t *const *)b->idx,
                      (const float *const *)b->w, want) != 0;
  if (bad) snprintf(detail, n, "FAILED (the dense reference refused the config)");
  for (int r = 0; r < o->ranks && !bad; r++)
    for (int64_t i = 0; i < (int64_t)o->tokens * o->hidden && !bad; i++) {
      if (!memcmp((char *)b->out[r] + i * es, (char *)want[r] + i * es, es)) continue;
      float got = o->x_dtype == EPX_FLOAT32 ? ((float *)b->out[r])[i] : epx_bf16_to_float(((uint16_t *)b->out[r])[i]);
      float exp = o->x_dtype == EPX_FLOAT32 ? ((float *)want[r])[i] : epx_bf16_to_float(((uint16_t *)want[r])[i]);
      snprintf(detail, n, "MISMATCH rank %d token %lld channel %lld: got %.9g, dense reference %.9g", r,
               (long long)(i / o->hidden), (long long)(i % o->hidden), got, exp);
      bad = 1;
    }
  if (!bad) snprintf(detail, n, "ok (bit for bit against the dense reference, %d ranks x %d tokens)", o->ranks, o->tokens);
  for (int r = 0; r < o->ranks; r++) free(want[r]);
  return bad;
}

/* Inputs: values in [-2, 2), K distinct experts per token in random order, weights in (0, 1). */
static void make_inputs(bench_t *b) {
  const opts_t *o = &b->o;
  uint64_t rng = o->seed;
  const size_t row = (size_t)o->hidden * esize(o->x_dtype);
  int *perm = malloc(sizeof(int) * o->experts);
  for (int r = 0; r < o->ranks; r++) {
    const int64_t n = (int64_t)o->tokens * o->hidden;
    b->x[r] = malloc(row * (o->tokens ? o->tokens : 1));
    b->out[r] = malloc(row * (o->tokens ? o->tokens : 1));
    b->idx[r] = malloc(sizeof(int32_t) * o->tokens * o->topk + 4);
    b->w[r] = malloc(sizeof(float) * o->tokens * o->topk + 4);
    for (int64_t i = 0; i < n; i++) {
      float v = (float)(uniform(&rng) * 4.0 - 2.0);
      if (o->x_dtype == EPX_FLOAT32) ((float *)b->x[r])[i] = v;
      else ((uint16_t *)b->x[r])[i] = epx_float_to_bf16(v);
    }
    for (int t = 0; t < o->tokens; t++) {
      for (int e = 0; e < o->experts; e++) perm[e] = e;
      for (int k = 0; k < o->topk; k++) {
        int j = k + (int)(splitmix(&rng) % (uint64_t)(o->experts - k));
        int tmp = perm[k];
        perm[k] = perm[j];
        perm[j] = tmp;
        b->idx[r][t * o->topk + k] = perm[k];
        b->w[r][t * o->topk + k] = (float)(0.05 + 0.95 * uniform(&rng));
      }
    }
  }
  free(perm);
}

/* With a GPU per rank the floor is the link: the busiest rank's max(sent, received) rows over
 * NVLink 4's 450 GB/s per direction. */
static void link_floors(const bench_t *b, bench_result_t *res) {
  const opts_t *o = &b->o;
  double busiest = 0;
  for (int r = 0; r < o->ranks; r++) {
    const sizes_t *z = &b->size[r];
    const double n = (double)(z->sent_remote > z->recv_remote ? z->sent_remote : z->recv_remote);
    if (n > busiest) busiest = n;
  }
  const double sc = o->recv_dtype == EPX_FP8_E4M3 ? 4.0 * fp8_blocks(o->hidden) / o->hidden : 0.0;
  res->nvlink_ms[PH_DISPATCH] = busiest * o->hidden * ((double)esize(o->recv_dtype) + sc) / 450e9 * 1e3;
  res->nvlink_ms[PH_COMBINE] = busiest * o->hidden * (double)esize(o->x_dtype) / 450e9 * 1e3;
}

static void free_run(bench_t *b) {
  for (int r = 0; r < b->o.ranks; r++) {
    free(b->x[r]);
    free(b->out[r]);
    free(b->idx[r]);
    free(b->w[r]);
  }
  free(b->stamp);
  if (b->origin) b->dev->event_destroy(b->origin);
  pthread_mutex_destroy(&b->lock);
  pthread_cond_destroy(&b->cond);
  epx_world_destroy(b->world);
  free(b);
}

/* One measured run of the options: 0, or 1 after the failing ranks' messages on stderr. */
static int run_once(const bench_env_t *env, const opts_t *o, bench_result_t *res) {
  bench_t *b = calloc(1, sizeof *b);
  b->o = *o;
  b->dev = env->dev;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = env->backend;
  wc.nranks = o->ranks;
  epx_status_t s = epx_world_create(&wc, &b->world);
  if (s != EPX_SUCCESS) {
    fprintf(stderr, "epx-bench: %s (%s)\n", epx_status_string(s), epx_last_error());
    free(b);
    return 1;
  }
  make_inputs(b);
  count_sizes(b);
  b->stamp = calloc((size_t)o->ranks * o->iters * (PH_COUNT + 1), sizeof(double));
  pthread_mutex_init(&b->lock, NULL);
  pthread_cond_init(&b->cond, NULL);
  const int devices = b->dev->bind_rank(0, o->ranks);
  b->shared_clock = devices == 1;
  b->origin = b->dev->event_create();
  b->started = b->last_progress = now();
  epx_run_ranks(o->ranks, run_rank, b, NULL);
  int rc = 0;
  for (int r = 0; r < o->ranks; r++)
    if (b->error[r][0]) fprintf(stderr, "rank %d: %s\n", r, b->error[r]), rc = 1;
  if (!rc) {
    *res = (bench_result_t){.o = *o, .devices = devices, .shared_clock = b->shared_clock, .check = -1};
    for (int ph = 0; ph < PH_COUNT; ph++) {
      res->ms[ph] = phase_ms(b, ph);
      rank_phases(b, ph, res->rank_start_ms[ph], res->rank_own_ms[ph]);
    }
    phase_bytes(b, res->memory, res->link);
    link_floors(b, res);
    for (int r = 0; r < o->ranks; r++) {
      res->nodes.dispatch_bytes += b->traffic[r].dispatch_bytes;
      res->nodes.combine_bytes += b->traffic[r].combine_bytes;
      res->nodes.dispatch_bytes_per_rank += b->traffic[r].dispatch_bytes_per_rank;
      res->nodes.combine_bytes_per_rank += b->traffic[r].combine_bytes_per_rank;
    }
    if (b->dev->sm_copy_bandwidth) { /* the reference kernel on as many SMs as the ranks of one device use */
      const int per_device = (o->ranks + devices - 1) / devices;
      res->sms_in_use = o->ranks * o->num_sms;
      res->sm_copy_bw = b->dev->sm_copy_bandwidth(per_device * o->num_sms);
    }
    if (o->check) {
      if (now() - b->started > 3.0) fprintf(stderr, "epx-bench: checking against the dense reference\n");
      res->check = check(b, res->check_detail, sizeof res->check_detail);
    }
  }
  free_run(b);
  return rc;
}

/* ---- driver ----------------------------------------------------------------------------- */

static void quote_command(int argc, char **argv, char *out, size_t n) {
  size_t len = 0;
  out[0] = 0;
  for (int i = 0; i < argc && len + 4 < n; i++) {
    const char *a = argv[i];
    const int plain = a[0] && strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./=:,+-") == strlen(a);
    len += (size_t)snprintf(out + len, n - len, plain ? "%s%s" : "%s'%s'", i ? " " : "", a);
    if (len >= n) len = n - 1;
  }
}

/* The points of a sweep: SMs per rank 2, 4, .. 16, or tokens per rank 128, 256, .. up to
 * --tokens. */
static int sweep_points(const opts_t *o, opts_t *pts, int max) {
  int n = 0;
  if (o->sweep == SWEEP_SMS)
    for (int sms = 2; sms <= 16 && n < max; sms += 2) pts[n] = *o, pts[n++].num_sms = sms;
  else if (o->sweep == SWEEP_TOKENS)
    for (int t = 128; t <= o->tokens && n < max; t *= 2) pts[n] = *o, pts[n++].tokens = t;
  if (n == 0) pts[n++] = *o; /* no sweep, or --tokens below the first point */
  return n;
}

static int setup_env(int argc, char **argv, const opts_t *o, bench_env_t *env) {
  /* The benchmark starts CUDA itself (availability, the copy reference) before any world
   * exists, so the world cannot set what ranks sharing a GPU need: set it here, as a program
   * emulating a group on one GPU should, keeping values the user chose. */
  if (o->backend != EPX_BACKEND_HOST) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  }
  env->backend = o->backend;
  if (env->backend == EPX_BACKEND_AUTO)
    env->backend = epx_backend_available(EPX_BACKEND_CUDA) == EPX_SUCCESS ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
  if (epx_backend_available(env->backend) != EPX_SUCCESS) {
    fprintf(stderr, "epx-bench: the %s backend is not available: %s\n", epx_backend_name(env->backend), epx_last_error());
    return 2;
  }
  if (bench_check_backend(o, env->backend)) return 2;
  env->dev = &bench_host_dev;
#ifdef EPX_BENCH_CUDA
  if (env->backend == EPX_BACKEND_CUDA) env->dev = &bench_cuda_dev;
#endif
  if (env->backend == EPX_BACKEND_CUDA && env->dev == &bench_host_dev) {
    fprintf(stderr, "epx-bench: this epx-bench was built without CUDA: use --backend host\n");
    return 2;
  }
  quote_command(argc, argv, env->command, sizeof env->command);
  char device[256] = "";
  if (env->dev->describe) env->dev->describe(device, sizeof device);
  bench_describe_machine(env, device);
  env->copy_bw = env->dev->copy_bandwidth();
  return 0;
}

int main(int argc, char **argv) {
  opts_t o;
  const int pr = bench_parse(argc, argv, &o);
  if (pr) return pr > 0 ? 0 : 2;
  static bench_env_t env;
  int rc = setup_env(argc, argv, &o, &env);
  if (rc) return rc;
  FILE *json = NULL, *table = o.json && !o.json_path ? stderr : stdout; /* stdout holds only JSON then */
  if (o.json_path && !(json = fopen(o.json_path, "w"))) {
    fprintf(stderr, "epx-bench: --json %s: cannot write it: %s\n", o.json_path, strerror(errno));
    return 2;
  }
  enum { MAX_POINTS = 32 };
  static opts_t pts[MAX_POINTS];
  static bench_result_t res[MAX_POINTS];
  const int n = sweep_points(&o, pts, MAX_POINTS);
  int nres = 0; /* runs with figures: a mismatch has them (and fails the command), a failed run not */
  for (int i = 0; i < n && !rc; i++) {
    if (n > 1) fprintf(stderr, "epx-bench: sweep point %d of %d\n", i + 1, n);
    bench_print_header(table, &env, &pts[i]);
    if (run_once(&env, &pts[i], &res[nres])) {
      rc = 1;
      break;
    }
    bench_print_table(table, &env, &res[nres]);
    if (res[nres++].check > 0) rc = 1;
    if (n > 1 && i + 1 < n) fprintf(table, "\n");
  }
  if (o.json && nres) bench_write_json(json ? json : stdout, &env, res, nres);
  if (json) fclose(json);
  return rc;
}
