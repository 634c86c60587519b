/* The CUDA backend across processes: one rank per process, rank r on visible GPU r % count (so
 * on one GPU every process shares it; peers reach each other through their CUDA IPC arenas), through both bootstraps (unique id, caller's
 * allgather):
 *   match      gpuutil's whole sequence (notify, dispatch, combine, both backward passes) for
 *              the high-throughput, all-to-all and low-latency algorithms in both layouts, with
 *              2 and 4 processes, bit for bit against the host backend, which the parent runs
 *              on the same inputs first (the rank processes inherit its results)
 *   lost peer  a rank process dies, killing itself between two operations or killed by the
 *              parent at a random moment mid-run: every other one fails with a status naming
 *              it (EPX_ERR_PEER_LOST, or EPX_ERR_TIMEOUT) within the timeout, later calls fail
 *              at once with EPX_ERR_BROKEN, and they still exit cleanly
 * CUDA never starts in the parent (its forked children could not use it then): it looks for a
 * GPU from a child of its own, and exits 77 (skipped) without one. The rank processes' checks
 * count in the test's summary; a process that failed one also exits 1. */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpuutil.h"
#include "mp_util.h"

/* ---- match -------------------------------------------------------------------------------- */

static const gu_row_t cases[] = {
    {2, 8, 2, 2048, 300, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 1, 0},
    {2, 16, 4, 2048, 257, HT, EXP, 16, BF, FP8, TU_FORM_TOPK32, 0, 1},
    {4, 64, 8, 2048, 200, HT, TOK, 1, BF, BF, TU_FORM_TOPK64, 0, 1},
    {4, 64, 8, 4096, 160, HT, EXP, 128, F32, F32, TU_FORM_MAP, 1, 0},
    {2, 8, 2, 2048, 150, A2A, TOK, 1, BF, BF, TU_FORM_TOPK32, 0, 0},
    {4, 32, 4, 2048, 300, A2A, EXP, 16, BF, BF, TU_FORM_TOPK32, 1, 1},
    {2, 16, 4, 2048, 64, LL, EXP, 1, BF, BF, TU_FORM_TOPK32, 0, 0},
    {4, 64, 8, 4096, 37, LL, EXP, 1, BF, FP8, TU_FORM_TOPK32, 0, 1},
};

typedef struct {
  const gu_case_t *c;
  const gu_inputs_t *in;
  const gu_result_t *host;
} match_t;

/* This process's world: rank `rank` of R, rank r on GPU r % count. */
static epx_status_t cuda_world(mp_ctx_t *ctx, int R, int rank, epx_world_t **w) {
  static int devices[EPX_MAX_RANKS];
  int count = 1;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) count = 1;
  for (int r = 0; r < R; r++) devices[r] = r % count;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_CUDA;
  wc.nranks = R;
  wc.devices = devices;
  return mp_world_create_with(ctx, &wc, rank, w);
}

static void match_proc(mp_ctx_t *ctx) {
  const match_t *m = ctx->arg;
  const int r = ctx->proc;
  epx_world_t *w = NULL;
  if (CHECK_STATUS(cuda_world(ctx, m->c->R, r, &w), EPX_SUCCESS, "rank %d: world", r)) {
    gu_result_t dev;
    const int fail = gu_run_rank(m->c, m->in, w, r, m->host, &dev);
    CHECK(!fail, "rank %d: the CUDA run failed [%s]", r, gu_case_str(m->c));
    if (!fail) gu_compare_rank(m->c, &dev, m->host, "cuda across processes vs host", r);
    gu_result_free(&dev, m->c->R);
    epx_world_destroy(w);
  }
  fflush(stdout);
  exit(check_failures() ? 1 : 0);
}

static void run_matches(void) {
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    gu_case_t c = gu_case_of(&cases[i], 8);
    const double t0 = tu_now();
    gu_inputs_t in;
    gu_inputs_make(&in, &c);
    gu_result_t host;
    const int hf = gu_run(&c, &in, EPX_BACKEND_HOST, NULL, &host);
    CHECK(!hf, "host run failed [%s]", gu_case_str(&c));
    if (!hf) {
      match_t m = {.c = &c, .in = &in, .host = &host};
      mp_launch_t l = {.nprocs = c.R, .boot = i % 2 ? MP_BOOT_CALLBACK : MP_BOOT_ID, .limit_s = 120};
      const int bad = mp_launch(&l, match_proc, &m);
      CHECK(bad == 0, "case %zu: %d rank processes failed [%s]", i, bad, gu_case_str(&c));
    }
    printf("match %zu (%s, %s bootstrap): %.2fs\n", i, gu_case_str(&c), mp_boot_name(i % 2 ? MP_BOOT_CALLBACK : MP_BOOT_ID),
           tu_now() - t0);
    gu_result_free(&host, c.R);
    gu_inputs_free(&in, &c);
  }
}

/* ---- lost peer ---------------------------------------------------------------------------- */

enum { LR = 4, LE = 16, LH = 256, LK = 4, LT = 64, LOST_TIMEOUT_MS = 4000 };

/* What the rank processes tell the parent (shared memory). */
typedef struct {
  int victim, self_kill_after; /* > 0: the victim kills itself after this many whole iterations */
  double killed_at;            /* when it did */
  epx_status_t st[LR];         /* each survivor's first failure */
  double after_ok[LR];         /* seconds from its last good iteration to that failure */
  double after_kill[LR];       /* seconds from the self-kill to that failure */
} lost_t;

/* Until the victim dies: one rank's loop of notify, dispatch, combine, synchronize. Whatever
 * step the death interrupts (the parent's kill may come during set-up), a survivor must fail
 * there, naming the victim. */
static void lost_proc(mp_ctx_t *ctx) {
  lost_t *L = ctx->arg;
  const int r = ctx->proc;
  epx_world_t *w = NULL;
  epx_comm_t *comm = NULL;
  epx_handle_t *h = NULL;
  uint16_t xh[LT * LH];
  int32_t ih[LT * LK];
  tu_fixed_bf16(xh, LT * LH, 0.5f, 5, r);
  tu_fixed_topk(ih, LT, LK, LE, r); /* distinct in a row */
  const int64_t cap = (int64_t)LR * LT;
  void *x = NULL, *idx = NULL, *recv = NULL, *out = NULL;
  const double start = tu_now();
  double ok_at = start;
  epx_status_t s = cuda_world(ctx, LR, r, &w);
  if (s == EPX_SUCCESS) {
    /* before the comm: CUDA's own set-up is not what the bound is about */
    cudaMalloc(&x, sizeof xh);
    cudaMalloc(&idx, sizeof ih);
    cudaMalloc(&recv, sizeof(uint16_t) * cap * LH);
    cudaMalloc(&out, sizeof xh);
    cudaMemcpy(x, xh, sizeof xh, cudaMemcpyHostToDevice);
    cudaMemcpy(idx, ih, sizeof ih, cudaMemcpyHostToDevice);
    ok_at = tu_now();
    epx_config_t cfg = tu_config(LE, LH, LK, LT);
    cfg.timeout_ms = LOST_TIMEOUT_MS;
    cfg.num_sms = 8;
    s = epx_comm_init(w, r, &cfg, &comm);
  }
  epx_handle_config_t hc = tu_handle_config(HT, TOK, 1);
  if (s == EPX_SUCCESS) s = epx_handle_create(comm, &hc, &h);
  const epx_routing_t rt = {.num_tokens = LT, .idx_dtype = EPX_INT32, .topk_idx = idx};
  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = x, d.recv_x = recv, d.recv_capacity = cap;
  epx_combine_args_t cb;
  epx_combine_args_init(&cb);
  cb.y = recv, cb.out = out; /* the received rows come straight back */
  for (int it = 0; s == EPX_SUCCESS && tu_now() - start < 40.0; it++) {
    ok_at = tu_now();
    if (r == L->victim && L->self_kill_after && it == L->self_kill_after) { /* between two operations */
      L->killed_at = tu_now();
      raise(SIGKILL);
    }
    s = epx_notify(comm, h, &rt);
    if (s == EPX_SUCCESS) s = epx_dispatch(comm, h, NULL, &d);
    if (s == EPX_SUCCESS) s = epx_combine(comm, h, &cb);
    if (s == EPX_SUCCESS) s = epx_comm_synchronize(comm);
  }
  const double failed_at = tu_now();
  char msg[512];
  snprintf(msg, sizeof msg, "%s", epx_last_error());
  if (r != L->victim) {
    L->st[r] = s;
    L->after_ok[r] = failed_at - ok_at;
    L->after_kill[r] = L->self_kill_after ? failed_at - L->killed_at : 0;
    CHECK(s == EPX_ERR_PEER_LOST || s == EPX_ERR_TIMEOUT || s == EPX_ERR_BROKEN,
          "rank %d: %s (%s), want the peer lost", r, epx_status_string(s), msg);
    CHECK(tu_names_rank(msg, L->victim), "rank %d's message names rank %d: %s", r, L->victim, msg);
    CHECK(L->after_ok[r] < LOST_TIMEOUT_MS / 1000.0 + 2.0, "rank %d took %.2f s to see the loss (%s)", r,
          L->after_ok[r], msg);
    if (h) CHECK_STATUS(epx_notify(comm, h, &rt), EPX_ERR_BROKEN, "rank %d: a call after the failure", r);
  }
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  epx_world_destroy(w);
  cudaFree(x), cudaFree(idx), cudaFree(recv), cudaFree(out);
  fflush(stdout);
  exit(check_failures() ? 1 : 0);
}

static void run_lost(bool self_kill) {
  lost_t *L = mmap(NULL, sizeof *L, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (L == MAP_FAILED) {
    perror("mmap");
    exit(2);
  }
  memset(L, 0, sizeof *L);
  L->victim = tu_int(&tu_rng, 0, LR - 1);
  L->self_kill_after = self_kill ? tu_int(&tu_rng, 1, 4) : 0;
  mp_launch_t l = {.nprocs = LR, .boot = self_kill ? MP_BOOT_ID : MP_BOOT_CALLBACK, .limit_s = 90};
  l.expect_signal[L->victim] = SIGKILL;
  if (!self_kill) l.kill_after_s[L->victim] = 3.0 + 2.0 * tu_unit(&tu_rng); /* CUDA start-up included */
  const double t0 = tu_now();
  const int bad = mp_launch(&l, lost_proc, L);
  CHECK(bad == 0, "%s: %d rank processes did not end as expected", self_kill ? "self kill" : "parent kill", bad);
  bool named = false;
  for (int r = 0; r < LR; r++) {
    if (r == L->victim) continue;
    named |= L->st[r] == EPX_ERR_PEER_LOST || L->st[r] == EPX_ERR_TIMEOUT;
    printf("lost peer (%s, victim %d): rank %d got %s %.3f s after its last good iteration", self_kill ? "self kill" : "parent kill",
           L->victim, r, epx_status_string(L->st[r]), L->after_ok[r]);
    if (self_kill) printf(", %.3f s after the kill", L->after_kill[r]);
    printf("\n");
  }
  CHECK(named, "no survivor reported the loss itself (all stopped on each other)");
  printf("lost peer (%s): %.2fs\n", self_kill ? "self kill" : "parent kill", tu_now() - t0);
  munmap(L, sizeof *L);
}

/* ---- main --------------------------------------------------------------------------------- */

/* Whether CUDA runs here, asked in a child: CUDA must not start in this process. */
static bool have_gpu(void) {
  fflush(stdout);
  const pid_t p = fork();
  if (p == 0) _exit(gu_have_gpu() ? 0 : GU_SKIP);
  int st = 0;
  if (p < 0 || waitpid(p, &st, 0) != p) return false;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

int main(void) {
  tu_begin("test_cuda_mp");
  setenv("EPX_TIMEOUT_MS", "10000", 1); /* bounds the bootstraps too */
  if (!have_gpu()) return GU_SKIP;
  run_matches();
  run_lost(true);
  run_lost(false);
  return tu_end();
}
