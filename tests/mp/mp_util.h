/*
 * mp_util — harness of the multi-process tests: one process per rank (host backend here; the
 * CUDA backend in tests/gpu/test_cuda_mp).
 *
 *   mp_begin / mp_end     seed (EPX_TEST_SEED or the clock) printed first, "name: N passed,
 *                         M failed" last; the counters live in shared memory, so checks made
 *                         by the rank processes (even one killed later) count.
 *   CHECK / CHECK_STATUS  as in tests/check.h, prefixed with the process's rank.
 *   mp_launch             forks the rank processes (the parent stays single-threaded and is
 *                         no rank), bootstraps them one of two ways, waits for them under a
 *                         watchdog and checks how each one ended:
 *                           MP_BOOT_ID        process 0 calls epx_get_unique_id and hands the
 *                                             id to the parent, which forks the others with it
 *                           MP_BOOT_CALLBACK  epx_world_create_rank_with, the allgather served
 *                                             by the parent over a socketpair per process
 *   mp_world_create       the world of a rank process, through the launch's bootstrap
 *   data                  deterministic inputs of the whole group from (seed, case), so every
 *                         process can compute the dense reference of every rank itself
 */
#ifndef EPX_MP_UTIL_H
#define EPX_MP_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "dense_ref.h"
#include "epx.h"

#define MP_MAX_PROCS 16

/* ---- counters and checks ---------------------------------------------------------------- */
void mp_begin(const char *name);
int mp_end(void); /* prints the summary, returns the exit code */
extern uint64_t mp_seed;
extern int mp_rank_label; /* -1 in the parent */

void mp_pass(void);
void mp_fail(const char *file, int line, const char *cond, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
int mp_check_status(const char *file, int line, const char *expr, epx_status_t got, epx_status_t want, const char *fmt,
                    ...) __attribute__((format(printf, 6, 7)));
long mp_failures(void);

/* A test that also uses tests/check.h (the GPU helpers: include them first) keeps its CHECK,
 * counted per process; mp_launch's own checks still count here. */
#ifndef EPX_TEST_CHECK_H
#define CHECK(cond, ...)                               \
  do {                                                 \
    if (cond)                                          \
      mp_pass();                                       \
    else                                               \
      mp_fail(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)
#define CHECK_STATUS(expr, want, ...) mp_check_status(__FILE__, __LINE__, #expr, (expr), (want), __VA_ARGS__)
#endif

/* ---- processes -------------------------------------------------------------------------- */
typedef enum { MP_BOOT_ID = 0, MP_BOOT_CALLBACK } mp_boot_t;

typedef struct {
  int proc;             /* 0..nprocs-1: which process of the launch this is */
  int nprocs;
  mp_boot_t boot;
  epx_unique_id_t id;   /* MP_BOOT_ID */
  int hub_fd;           /* MP_BOOT_CALLBACK */
  void *arg;
} mp_ctx_t;

typedef void (*mp_proc_fn)(mp_ctx_t *ctx);

typedef struct {
  int nprocs;
  mp_boot_t boot;
  double limit_s;                /* watchdog: kill every process still running then */
  int expect_signal[MP_MAX_PROCS]; /* 0: the process must exit(0); else it must die of this signal */
  double kill_after_s[MP_MAX_PROCS]; /* > 0: the parent SIGKILLs the process this long after the launch */
} mp_launch_t;

/* Runs fn in nprocs processes; CHECKs how each ended. Returns the number of processes that
 * did not end as expected. */
int mp_launch(const mp_launch_t *l, mp_proc_fn fn, void *arg);
const char *mp_boot_name(mp_boot_t b);

/* The world of one rank, through the launch's bootstrap: on the host backend, or as wc says. */
epx_status_t mp_world_create(mp_ctx_t *ctx, int nranks, int rank, epx_world_t **world);
epx_status_t mp_world_create_with(mp_ctx_t *ctx, const epx_world_config_t *wc, int rank, epx_world_t **world);

/* Seconds on the monotonic clock. */
double mp_now(void);
/* Whether msg names rank v ("rank v", not followed by a digit). */
int mp_names_rank(const char *msg, int v);
/* Open file descriptors of this process. */
int mp_count_fds(void);
/* Mappings of this process whose file is one of epx's shared segments (memfd "epx-..."). */
int mp_count_epx_maps(void);
/* Entries of /dev/shm whose name contains "epx", newline separated into names; returns how
 * many. mp_shm_new counts (and lists into out) those not in an earlier list `before`. */
int mp_shm_list(char *names, size_t size);
int mp_shm_new(const char *before, char *out, size_t size);

/* ---- deterministic data ------------------------------------------------------------------ */
typedef struct {
  uint64_t s;
} mp_rng_t;
mp_rng_t mp_rng(uint64_t seed, uint64_t stream);
uint64_t mp_u64(mp_rng_t *g);
int mp_int(mp_rng_t *g, int lo, int hi); /* uniform in [lo, hi] */

/* One MoE input over R ranks, the same in every process for the same (seed, stream). */
typedef struct {
  int R, E, H, K, L;
  epx_dtype_t x_dtype;
  int64_t T[MP_MAX_PROCS];
  void *x[MP_MAX_PROCS];      /* [T, H] */
  int32_t *idx[MP_MAX_PROCS]; /* [T, K], distinct experts, -1 slots */
  float *w[MP_MAX_PROCS];     /* [T, K] */
  int ranks_per_node;         /* the combine order mp_dense_out follows (0: one node) */
} mp_moe_t;
void mp_moe_make(mp_moe_t *m, uint64_t seed, uint64_t stream, int R, int E, int H, int K, epx_dtype_t x_dtype,
                 int max_tokens);
void mp_moe_free(mp_moe_t *m);

float mp_load(epx_dtype_t t, const void *base, size_t i);
void mp_store(epx_dtype_t t, void *base, size_t i, float v);

/* The dense reference's output of rank `rank` (allocated). */
void *mp_dense_out(const mp_moe_t *m, int rank, epx_dtype_t recv_dtype, epx_dtype_t y_dtype, epx_dtype_t out_dtype,
                   int expert_layout);

#endif
