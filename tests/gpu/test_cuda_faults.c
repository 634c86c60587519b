/* What goes wrong on the CUDA backend comes back as a status, never as a hang or a write out
 * of bounds: a rank that never arrives, an output too small in sync-free mode, a bad expert
 * id, too many tokens in low-latency mode, an SM budget the GPU cannot hold. */
#include <cuda_runtime_api.h>
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
} fault_t;

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
  if (f->init_st[r] == EPX_SUCCESS && r != f->absent) {
    epx_handle_config_t hc = tu_handle_config(f->ll ? EPX_ALGO_LL : EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
    hc.exact = f->exact;
    epx_handle_create(comm, &hc, &h);
    epx_routing_t rt = {.num_tokens = Tr, .idx_dtype = EPX_INT32, .topk_idx = idx};
    epx_dispatch_args_t d;
    epx_dispatch_args_init(&d);
    d.x = x, d.recv_x = recv, d.recv_capacity = r == f->small_rank ? 1 : cap;
    double t0 = tu_now();
    epx_status_t s = epx_dispatch(comm, h, &rt, &d);
    if (s == EPX_SUCCESS) s = epx_comm_synchronize(comm);
    note(f, r, s);
    f->secs[r] = tu_now() - t0;
  }
  tu_barrier_wait(); /* nobody frees state a peer may still post to */
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
  epx_run_ranks(f->R, rank_main, f, NULL);
  epx_world_destroy(f->world);
}

static fault_t fresh(int R) {
  fault_t f;
  memset(&f, 0, sizeof f);
  f.R = R, f.timeout_ms = 5000, f.num_sms = 8, f.absent = f.small_rank = f.bad_rank = -1, f.exact = 1;
  return f;
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
