/* Sync-free dispatch -> expert stand-in -> combine captured in one CUDA graph per rank, then
 * replayed with fresh routings and token counts; every replay is checked against the host
 * backend bit for bit. The stand-in expert is the identity (a device copy of the received
 * rows), so the whole layer runs on the device.
 *   test_cuda_graph ht        high-throughput, expert layout padded to 16
 *   test_cuda_graph ll        low-latency (one launch per operation)
 *   test_cuda_graph ll-split  low-latency issued as SEND and COMPLETE halves
 * A second argument sets the number of replays (default 100): fewer under compute-sanitizer. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuutil.h"

enum { R = 4, E = 64, K = 8, H = 2048, T = 256, ALIGN = 16, DEFAULT_REPLAYS = 100 };
#define L (E / R)
#define CAP_HT ((int64_t)R * T * K + (int64_t)L * ALIGN)
#define CAP_LL ((int64_t)L * R * T)
#define CAP (CAP_LL > CAP_HT ? CAP_LL : CAP_HT)

static int low_latency, split, replays = DEFAULT_REPLAYS; /* from argv */

static epx_handle_config_t layer_config(void) {
  epx_handle_config_t hc = tu_handle_config(low_latency ? EPX_ALGO_LL : EPX_ALGO_HT, EPX_LAYOUT_EXPERT, ALIGN);
  hc.exact = 0;
  return hc;
}

typedef struct {
  epx_world_t *world;
  tu_moe_t m;                 /* this replay's inputs (host) */
  void *out_host[R];          /* what the graph produced */
  int replay;
  int failed;
  char err[R][256];
} graph_t;

/* The layer: sync-free dispatch, identity expert, weighted combine. */
static epx_status_t layer(epx_comm_t *comm, epx_handle_t *h, const epx_routing_t *rt, const epx_dispatch_args_t *d,
                         const epx_combine_args_t *c, cudaStream_t st) {
  epx_dispatch_args_t dd = *d;
  epx_combine_args_t cc = *c;
  dd.part = cc.part = split ? EPX_PART_SEND : EPX_PART_ALL;
  epx_status_t s = epx_dispatch(comm, h, rt, &dd);
  if (s == EPX_SUCCESS && split) {
    dd.part = EPX_PART_COMPLETE;
    s = epx_dispatch(comm, h, NULL, &dd);
  }
  if (s != EPX_SUCCESS) return s;
  cudaMemcpyAsync((void *)c->y, d->recv_x, sizeof(uint16_t) * CAP * H, cudaMemcpyDeviceToDevice, st);
  s = epx_combine(comm, h, &cc);
  if (s == EPX_SUCCESS && split) {
    cc.part = EPX_PART_COMPLETE;
    s = epx_combine(comm, h, &cc);
  }
  return s;
}

/* One rank: run the layer once (which sizes every buffer), capture it, then replay it as the
 * driver supplies inputs. A failure keeps the rank in step with the driver's barriers. */
static epx_status_t rank_main(int r, graph_t *g) {
  epx_status_t s = EPX_SUCCESS;
  epx_comm_t *comm = NULL;
  epx_handle_t *h = NULL;
  cudaStream_t st;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  void *x, *recv, *y, *out;
  int32_t *idx;
  float *w, *probs;
  cudaMalloc(&x, sizeof(uint16_t) * T * H);
  cudaMalloc((void **)&idx, sizeof(int32_t) * T * K);
  cudaMalloc((void **)&w, sizeof(float) * T * K);
  cudaMalloc(&recv, sizeof(uint16_t) * CAP * H);
  cudaMalloc(&y, sizeof(uint16_t) * CAP * H);
  cudaMalloc((void **)&probs, sizeof(float) * CAP);
  cudaMalloc(&out, sizeof(uint16_t) * T * H);
  tu_barrier_wait(); /* every rank allocated before any waits on another */

  epx_config_t cfg = tu_config(E, H, K, T);
  epx_handle_config_t hc = layer_config();
  s = epx_comm_init(g->world, r, &cfg, &comm);
  if (s == EPX_SUCCESS) s = epx_comm_set_stream(comm, st);
  if (s == EPX_SUCCESS) s = epx_handle_create(comm, &hc, &h);
  epx_routing_t rt = {.num_tokens = T, .idx_dtype = EPX_INT32, .topk_idx = idx, .topk_weights = w};
  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = x, d.recv_x = recv, d.recv_capacity = CAP_HT, d.recv_probs = probs;
  epx_combine_args_t c;
  epx_combine_args_init(&c);
  c.y = y, c.out = out;
  cudaMemsetAsync(recv, 0, sizeof(uint16_t) * CAP * H, st); /* LL rows past the counts stay as they are */

  for (int pass = 0; pass <= replays; pass++) {
    tu_barrier_wait(); /* inputs of this pass are ready */
    if (s == EPX_SUCCESS) {
      cudaMemcpyAsync(x, g->m.x[r], sizeof(uint16_t) * T * H, cudaMemcpyHostToDevice, st);
      cudaMemcpyAsync(idx, g->m.idx[r], sizeof(int32_t) * T * K, cudaMemcpyHostToDevice, st);
      cudaMemcpyAsync(w, g->m.w[r], sizeof(float) * T * K, cudaMemcpyHostToDevice, st);
      cudaMemsetAsync(out, 0x7f, sizeof(uint16_t) * T * H, st);
    }
    if (s == EPX_SUCCESS && pass == 0) {
      s = layer(comm, h, &rt, &d, &c, st);
      if (s == EPX_SUCCESS) s = epx_comm_synchronize(comm);
      if (s == EPX_SUCCESS) {
        cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
        s = layer(comm, h, &rt, &d, &c, st);
        cudaError_t e = cudaStreamEndCapture(st, &graph);
        if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
        if (s == EPX_SUCCESS && e != cudaSuccess) {
          snprintf(g->err[r], sizeof g->err[r], "capture: %s", cudaGetErrorString(e));
          s = EPX_ERR_CUDA;
        }
      }
      if (s != EPX_SUCCESS && !g->err[r][0]) snprintf(g->err[r], sizeof g->err[r], "pass 0: %s", epx_last_error());
    }
    if (s == EPX_SUCCESS) {
      cudaGraphLaunch(exec, st);
      s = epx_comm_synchronize(comm);
      if (s != EPX_SUCCESS) snprintf(g->err[r], sizeof g->err[r], "replay %d: %s", pass, epx_last_error());
      cudaMemcpy(g->out_host[r], out, sizeof(uint16_t) * T * H, cudaMemcpyDeviceToHost);
    }
    if (s != EPX_SUCCESS) g->failed = 1;
    tu_barrier_wait(); /* outputs are in */
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  void *bufs[] = {x, idx, w, recv, y, probs, out};
  for (int i = 0; i < 7; i++) cudaFree(bufs[i]);
  cudaStreamDestroy(st);
  return s;
}

/* The host backend's result for the same inputs: dispatch, identity expert, combine. */
typedef struct {
  epx_world_t *world;
  const tu_moe_t *m;
  void **want;
} host_ref_t;

static epx_status_t host_rank(int r, void *arg) {
  host_ref_t *a = arg;
  epx_comm_t *comm = NULL;
  epx_handle_t *h = NULL;
  epx_config_t cfg = tu_config(E, H, K, T);
  void *recv = calloc((size_t)CAP * H, sizeof(uint16_t));
  float *probs = malloc(sizeof(float) * CAP);
  epx_status_t s = epx_comm_init(a->world, r, &cfg, &comm);
  epx_handle_config_t hc = layer_config();
  if (s == EPX_SUCCESS) s = epx_handle_create(comm, &hc, &h);
  epx_routing_t rt = tu_routing(a->m, r, TU_FORM_TOPK32);
  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = a->m->x[r], d.recv_x = recv, d.recv_capacity = CAP_HT, d.recv_probs = probs;
  if (s == EPX_SUCCESS) s = epx_dispatch(comm, h, &rt, &d);
  epx_combine_args_t c;
  epx_combine_args_init(&c);
  c.y = recv, c.out = a->want[r];
  if (s == EPX_SUCCESS) s = epx_combine(comm, h, &c);
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  free(recv);
  free(probs);
  return s;
}

static epx_status_t host_reference(const tu_moe_t *m, void **want) {
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST;
  wc.nranks = R;
  host_ref_t a = {NULL, m, want};
  epx_status_t s = epx_world_create(&wc, &a.world);
  if (s == EPX_SUCCESS) s = epx_run_ranks(R, host_rank, &a, NULL);
  epx_world_destroy(a.world);
  return s;
}

/* Fresh inputs: token count varies by replay, the rest of the T rows route nowhere. */
static void make_inputs(tu_moe_t *m, int replay) {
  int64_t Ts[TU_MAX_RANKS];
  for (int r = 0; r < R; r++) Ts[r] = T;
  tu_route_opts_t o = tu_route_default();
  tu_moe_random(m, &tu_rng, R, E, H, K, EPX_BFLOAT16, Ts, &o, 1);
  for (int r = 0; r < R; r++) {
    int live = replay % 5 == 0 ? T : tu_int(&tu_rng, 0, T);
    for (int64_t i = (int64_t)live * K; i < (int64_t)T * K; i++) m->idx[r][i] = -1;
  }
}

/* The driver: inputs before each pass, the check after it. */
static epx_status_t driver(graph_t *g) {
  tu_barrier_wait(); /* ranks allocated */
  for (int pass = 0; pass <= replays; pass++) {
    if (pass) tu_moe_free(&g->m);
    make_inputs(&g->m, pass);
    tu_barrier_wait(); /* inputs ready */
    tu_barrier_wait(); /* outputs in */
    void *want[TU_MAX_RANKS];
    for (int r = 0; r < R; r++) want[r] = malloc(sizeof(uint16_t) * T * H);
    CHECK(host_reference(&g->m, want) == EPX_SUCCESS, "host reference: %s", epx_last_error());
    char what[64];
    for (int r = 0; r < R && !g->failed; r++) {
      snprintf(what, sizeof what, "replay %d rank %d out", pass, r);
      CHECK_BITS(what, EPX_BFLOAT16, g->out_host[r], want[r], (int64_t)T * H, H);
    }
    for (int r = 0; r < R; r++) free(want[r]);
  }
  tu_moe_free(&g->m);
  return EPX_SUCCESS;
}

static graph_t G;

static epx_status_t thread_main(int r, void *arg) {
  (void)arg;
  return r == R ? driver(&G) : rank_main(r, &G);
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "ht";
  low_latency = !strcmp(mode, "ll") || !strcmp(mode, "ll-split");
  split = !strcmp(mode, "ll-split");
  if (argc > 2 && (replays = atoi(argv[2])) < 1) {
    fprintf(stderr, "test_cuda_graph: replays must be a positive count, got '%s'\n", argv[2]);
    return 2;
  }
  tu_begin("test_cuda_graph");
  printf("mode: %s\n", mode);
  if (!gu_have_gpu()) return GU_SKIP;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_CUDA;
  wc.nranks = R;
  CHECK(epx_world_create(&wc, &G.world) == EPX_SUCCESS, "world: %s", epx_last_error());
  for (int r = 0; r < R; r++) G.out_host[r] = malloc(sizeof(uint16_t) * T * H);
  tu_barrier_init(R + 1);
  epx_run_ranks(R + 1, thread_main, NULL, NULL);
  for (int r = 0; r < R; r++) {
    CHECK(!G.err[r][0], "rank %d: %s", r, G.err[r]);
    free(G.out_host[r]);
  }
  printf("%d replays of the captured layer checked\n", replays);
  epx_world_destroy(G.world);
  return tu_end();
}
