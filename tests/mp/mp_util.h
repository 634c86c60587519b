/*
 * mp_util — the multi-process tests' processes: one process per rank (host backend here; the
 * CUDA backend in tests/gpu/test_cuda_mp). Checks, the seed and the inputs are the harness's
 * (tests/harness): a rank process's checks count in the test's summary, its failures
 * prefixed "[proc N]"; tu_moe_stream gives every process the same input for (seed, stream),
 * so each can compute the dense reference of every rank itself.
 *
 *   mp_launch             forks the rank processes (the parent stays single-threaded and is
 *                         no rank), bootstraps them one of two ways, waits for them under a
 *                         watchdog and checks how each one ended, naming the caller's line:
 *                           MP_BOOT_ID        process 0 calls epx_get_unique_id and hands the
 *                                             id to the parent, which forks the others with it
 *                           MP_BOOT_CALLBACK  epx_world_create_rank_with, the allgather served
 *                                             by the parent over a socketpair per process
 *   mp_world_create       the world of a rank process, through the launch's bootstrap
 *   the system's view     descriptors, epx mappings, /dev/shm entries
 */
#ifndef EPX_MP_UTIL_H
#define EPX_MP_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"
#include "harness.h"

#define MP_MAX_PROCS 16

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
  double reap_after_s[MP_MAX_PROCS]; /* > 0: a process that ends earlier stays a zombie (unreaped)
                                        until this long after the launch, as under a launcher
                                        that reaps late */
} mp_launch_t;

/* Runs fn in nprocs processes; CHECKs how each ended (failures name the caller's line).
 * Returns the number of processes that did not end as expected. */
#define mp_launch(l, fn, arg) mp_launch_at(TU_HERE, (l), (fn), (arg))
int mp_launch_at(const char *file, int line, const mp_launch_t *l, mp_proc_fn fn, void *arg);
const char *mp_boot_name(mp_boot_t b);

/* The world of one rank, through the launch's bootstrap: on the host backend, or as wc says. */
epx_status_t mp_world_create(mp_ctx_t *ctx, int nranks, int rank, epx_world_t **world);
epx_status_t mp_world_create_with(mp_ctx_t *ctx, const epx_world_config_t *wc, int rank, epx_world_t **world);

/* Open file descriptors of this process. */
int mp_count_fds(void);
/* Mappings of this process whose file is one of epx's shared segments (memfd "epx-..."). */
int mp_count_epx_maps(void);
/* Entries of /dev/shm whose name contains "epx", newline separated into names; returns how
 * many. mp_shm_new counts (and lists into out) those not in an earlier list `before`. */
int mp_shm_list(char *names, size_t size);
int mp_shm_new(const char *before, char *out, size_t size);

/* ---- a comm ------------------------------------------------------------------------------- */
/* A comm of m's shape (max_tokens_per_rank, timeout_ms: 0 for the default) and a default
 * handle on it, each CHECKed (named by tag); returns whether both were made. */
int mp_comm_open(epx_world_t *world, int rank, const tu_moe_t *m, int max_tokens, int timeout_ms, const char *tag,
                 epx_comm_t **comm, epx_handle_t **h);

#endif
