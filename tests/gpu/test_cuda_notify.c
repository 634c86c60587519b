/* Notify alone, back to back: R ranks on the CUDA backend call epx_notify over and over on
 * exact high-throughput handles, each time with a fresh routing and token count and no
 * dispatch in between. What each rank reads back (epx_handle_info, tokens per local expert)
 * is checked against the counts of every rank's routing computed on the host
 * (epx_layout_counts). The handles take turns, one is destroyed and made again right after
 * some of its notifies, and ranks enter at staggered times. It does not force the timing in
 * which a peer's next notify rewrites counts a rank is still reading: with exact sizes every
 * rank waits on the host between two notifies, longer than a notify takes to read them.
 *   test_cuda_notify [steps]   (default 300) */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuutil.h"

enum { R = 8, E = 64, K = 4, H = 128, TMAX = 512, HANDLES = 2, DEFAULT_STEPS = 300 };
#define L (E / R)

static int steps = DEFAULT_STEPS;
static epx_world_t *world;

/* Step s's routing of rank q, from a stream of the seed of its own: every rank draws every
 * rank's. Returns its token count. */
static int64_t routing_of(int s, int q, int32_t *idx) {
  tu_rng_t g = tu_rng_stream(tu_seed, (uint64_t)s * R + (uint64_t)q);
  const int64_t T = tu_int(&g, 0, TMAX);
  const tu_route_opts_t o = tu_route_default();
  tu_random_topk(&g, T, K, E, &o, idx);
  return T;
}

/* What rank r must read back after step s: from every rank's counts on the host. */
typedef struct {
  epx_handle_info_t info;
  int32_t per_local[L];
} expect_t;

static void expected(int s, int r, expect_t *x) {
  static _Thread_local int32_t idx[TMAX * K];
  int32_t per_rank[R][R], per_expert[R][E];
  int64_t T_r = 0;
  for (int q = 0; q < R; q++) {
    const int64_t T = routing_of(s, q, idx);
    if (q == r) T_r = T;
    const epx_routing_t rt = {.num_tokens = T, .idx_dtype = EPX_INT32, .topk_idx = idx};
    epx_layout_counts(R, E, K, &rt, per_rank[q], per_expert[q], NULL);
  }
  memset(x, 0, sizeof *x);
  x->info.num_send_tokens = T_r;
  for (int q = 0; q < R; q++) {
    x->info.num_recv_tokens += per_rank[q][r];
    x->info.num_sent_copies += per_rank[r][q];
    for (int l = 0; l < L; l++) x->per_local[l] += per_expert[q][r * L + l];
  }
  for (int l = 0; l < L; l++) x->info.num_recv_pairs += x->per_local[l];
  x->info.num_recv_rows = x->info.num_recv_tokens; /* token layout */
}

static epx_handle_t *make_handle(epx_comm_t *comm) {
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  hc.exact = 1;
  epx_handle_t *h = NULL;
  const epx_status_t s = epx_handle_create(comm, &hc, &h);
  CHECK(s == EPX_SUCCESS, "handle: %s", epx_last_error());
  return h;
}

/* A rank busy on the host for up to 50 us before its call, so ranks enter in changing order. */
static void stagger(int s, int r) {
  tu_rng_t g = tu_rng_stream(tu_seed ^ 0x5bd1e995u, (uint64_t)s * R + (uint64_t)r);
  const double until = tu_now() + 50e-6 * tu_unit(&g);
  while (tu_now() < until) {
  }
}

static void check_step(int s, int r, const expect_t *got) {
  expect_t want;
  expected(s, r, &want);
  const epx_handle_info_t *a = &got->info, *b = &want.info;
  CHECK(a->num_send_tokens == b->num_send_tokens && a->num_recv_tokens == b->num_recv_tokens &&
            a->num_recv_rows == b->num_recv_rows && a->num_recv_pairs == b->num_recv_pairs &&
            a->num_sent_copies == b->num_sent_copies,
        "rank %d step %d: send %lld recv %lld rows %lld pairs %lld copies %lld, want %lld %lld %lld %lld %lld", r, s,
        (long long)a->num_send_tokens, (long long)a->num_recv_tokens, (long long)a->num_recv_rows,
        (long long)a->num_recv_pairs, (long long)a->num_sent_copies, (long long)b->num_send_tokens,
        (long long)b->num_recv_tokens, (long long)b->num_recv_rows, (long long)b->num_recv_pairs,
        (long long)b->num_sent_copies);
  CHECK(!memcmp(got->per_local, want.per_local, sizeof want.per_local),
        "rank %d step %d: tokens per local expert differ", r, s);
}

/* Every step's routing is on the device before the first notify, and the results are checked
 * after the last: between two notifies a rank does nothing but read back its sizes. */
static epx_status_t rank_main(int r, void *arg) {
  (void)arg;
  epx_comm_t *comm = NULL;
  epx_config_t cfg = tu_config(E, H, K, TMAX);
  const epx_status_t made = epx_comm_init(world, r, &cfg, &comm);
  CHECK(made == EPX_SUCCESS, "rank %d: comm: %s", r, epx_last_error());
  if (made != EPX_SUCCESS) { /* still at the barrier below: the others wait there */
    tu_barrier_wait();
    return made;
  }
  const size_t per_step = (size_t)TMAX * K;
  int32_t *idx_dev = NULL, *idx = malloc(sizeof(int32_t) * per_step * steps);
  int64_t *T = malloc(sizeof(int64_t) * steps);
  expect_t *got = calloc(steps, sizeof *got);
  cudaMalloc((void **)&idx_dev, sizeof(int32_t) * per_step * steps);
  int done = 0;
  if (idx && T && got && idx_dev) {
    for (int s = 0; s < steps; s++) T[s] = routing_of(s, r, idx + per_step * s);
    cudaMemcpy(idx_dev, idx, sizeof(int32_t) * per_step * steps, cudaMemcpyHostToDevice);
  }
  /* every rank's allocation and upload (which may wait for the whole device) done before any
     rank's notify spins on its peers */
  tu_barrier_wait();
  if (idx && T && got && idx_dev) {
    epx_handle_t *h[HANDLES];
    for (int i = 0; i < HANDLES; i++) h[i] = make_handle(comm);
    for (; done < steps; done++) {
      const int s = done;
      const epx_routing_t rt = {.num_tokens = T[s], .idx_dtype = EPX_INT32, .topk_idx = idx_dev + per_step * s};
      epx_handle_t *mine = h[s % HANDLES];
      stagger(s, r);
      const epx_status_t st = epx_notify(comm, mine, &rt);
      CHECK(st == EPX_SUCCESS, "rank %d step %d: notify: %s", r, s, epx_last_error());
      if (st != EPX_SUCCESS) break;
      const epx_status_t info = epx_handle_info(mine, &got[s].info, got[s].per_local);
      CHECK(info == EPX_SUCCESS, "rank %d step %d: epx_handle_info: %s", r, s, epx_last_error());
      if (s % 7 == 3) { /* gone right after its notify, while peers may still be finishing theirs */
        epx_handle_destroy(mine);
        h[s % HANDLES] = make_handle(comm);
      }
    }
    for (int i = 0; i < HANDLES; i++) epx_handle_destroy(h[i]);
  }
  for (int s = 0; s < done; s++) check_step(s, r, &got[s]);
  cudaFree(idx_dev);
  free(idx);
  free(T);
  free(got);
  epx_comm_destroy(comm);
  return EPX_SUCCESS;
}

int main(int argc, char **argv) {
  if (argc > 1 && (steps = atoi(argv[1])) < 1) {
    fprintf(stderr, "test_cuda_notify: steps must be a positive count, got '%s'\n", argv[1]);
    return 2;
  }
  tu_begin("test_cuda_notify");
  if (!gu_have_gpu()) return GU_SKIP;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_CUDA;
  wc.nranks = R;
  CHECK(epx_world_create(&wc, &world) == EPX_SUCCESS, "world: %s", epx_last_error());
  tu_barrier_init(R);
  epx_run_ranks(R, rank_main, NULL, NULL);
  printf("%d notifies on each of %d ranks\n", steps, R);
  epx_world_destroy(world);
  return tu_end();
}
