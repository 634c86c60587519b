/* In-process rendezvous: the ranks are threads of this process. Bounded barriers and
 * pointer exchanges under one mutex; a wait that runs out breaks the group for good, so no
 * rank can hang on it later. One of the group's implementations (internal.h; the other,
 * across processes, is shm.c). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"

typedef struct {
  epxi_group_t base;               /* ops, nranks; drives ranks [0, nranks) */
  int nranks;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t gen;                    /* barriers completed */
  int arrived;                     /* ranks waiting in barrier `gen` */
  uint64_t reached[EPX_MAX_RANKS]; /* barriers each rank has entered */
  const void *slot[2][EPX_MAX_RANKS]; /* shared pointers, by barrier parity */
  bool broken;
  epx_status_t broken_status;      /* what the waits cut short return: TIMEOUT, or BROKEN (abort) */
  char broken_why[256];
} inproc_group_t;

static const epxi_group_ops_t inproc_ops;

epx_status_t epxi_group_create(int nranks, epxi_group_t **group) {
  inproc_group_t *g = calloc(1, sizeof *g);
  if (!g) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "group of %d ranks", nranks);
  g->base = (epxi_group_t){.ops = &inproc_ops, .nranks = nranks, .first_rank = 0, .num_local = nranks};
  g->nranks = nranks;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, &ca);
  pthread_condattr_destroy(&ca);
  *group = &g->base;
  return EPX_SUCCESS;
}

static void inproc_destroy(epxi_group_t *base) {
  inproc_group_t *g = (inproc_group_t *)base;
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
  free(g);
}

static bool inproc_broken(const epxi_group_t *g) {
  inproc_group_t *m = (inproc_group_t *)g;
  pthread_mutex_lock(&m->mu);
  bool b = m->broken;
  pthread_mutex_unlock(&m->mu);
  return b;
}

/* Names the ranks that have not entered barrier `gen` (called with the lock held). */
static void describe_missing(const inproc_group_t *g, uint64_t gen, char *buf, size_t n) {
  size_t len = 0;
  int count = 0;
  buf[0] = '\0';
  for (int r = 0; r < g->nranks; r++) {
    if (g->reached[r] > gen) continue;
    if (count++ < 8 && len < n) len += snprintf(buf + len, n - len, "%s%d", count > 1 ? ", " : "", r);
  }
  if (count > 8 && len < n) snprintf(buf + len, n - len, " and %d more", count - 8);
}

/* Enters the next barrier with `mine` in this rank's slot; on return every rank's pointer of
 * this barrier is in g->slot[parity]. */
static epx_status_t enter(inproc_group_t *g, int rank, const char *phase, int timeout_ms, const void *mine,
                          int *parity) {
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&g->mu);
  if (g->broken) {
    epx_status_t s = epxi_fail(EPX_ERR_BROKEN, "rank %d, phase %s: the group broke earlier (%s)", rank, phase,
                               g->broken_why);
    pthread_mutex_unlock(&g->mu);
    return s;
  }
  uint64_t gen = g->gen;
  *parity = (int)(gen & 1);
  g->slot[*parity][rank] = mine;
  g->reached[rank] = gen + 1;
  if (++g->arrived == g->nranks) {
    g->arrived = 0;
    g->gen++;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return EPX_SUCCESS;
  }
  while (g->gen == gen && !g->broken) {
    int rc = pthread_cond_timedwait(&g->cv, &g->mu, &deadline);
    if (rc == ETIMEDOUT && g->gen == gen && !g->broken) {
      char missing[160];
      describe_missing(g, gen, missing, sizeof missing);
      snprintf(g->broken_why, sizeof g->broken_why, "phase %s timed out after %d ms waiting for rank %s", phase,
               timeout_ms, missing);
      g->broken = true;
      g->broken_status = EPX_ERR_TIMEOUT;
      pthread_cond_broadcast(&g->cv);
    }
  }
  epx_status_t s = EPX_SUCCESS;
  if (g->gen == gen) s = epxi_fail(g->broken_status, "rank %d: %s", rank, g->broken_why);
  pthread_mutex_unlock(&g->mu);
  return s;
}

static epx_status_t inproc_barrier(epxi_group_t *base, int rank, const char *phase, int timeout_ms) {
  int parity;
  return enter((inproc_group_t *)base, rank, phase, timeout_ms, NULL, &parity);
}

static epx_status_t inproc_share(epxi_group_t *base, int rank, const char *phase, int timeout_ms, const void *mine,
                                 size_t bytes, const void **all) {
  inproc_group_t *g = (inproc_group_t *)base;
  (void)bytes; /* the peers read `mine` in place */
  int parity;
  EPX_CHECK(enter(g, rank, phase, timeout_ms, mine, &parity));
  /* Nobody can overwrite this parity's slots before every rank has entered the next
   * barrier, which this rank has not yet done. */
  memcpy(all, g->slot[parity], sizeof(void *) * g->nranks);
  return EPX_SUCCESS;
}

/* Holds the mutex only as long as the waiters do between their checks: never waits. */
static void inproc_abort(epxi_group_t *base, int rank) {
  inproc_group_t *g = (inproc_group_t *)base;
  pthread_mutex_lock(&g->mu);
  if (!g->broken) {
    g->broken = true;
    g->broken_status = EPX_ERR_BROKEN;
    snprintf(g->broken_why, sizeof g->broken_why, "ABORTED: rank %d aborted the comm (epx_comm_abort)", rank);
    pthread_cond_broadcast(&g->cv);
  }
  pthread_mutex_unlock(&g->mu);
}

static epx_status_t inproc_error(const epxi_group_t *base, int rank, char *why, size_t size) {
  inproc_group_t *g = (inproc_group_t *)base;
  (void)rank;
  pthread_mutex_lock(&g->mu);
  epx_status_t s = g->broken ? g->broken_status : EPX_SUCCESS;
  if (g->broken) snprintf(why, size, "%s", g->broken_why);
  pthread_mutex_unlock(&g->mu);
  return s;
}

static const epxi_group_ops_t inproc_ops = {
    .abort = inproc_abort,
    .error = inproc_error,
    .name = "in-process",
    .destroy = inproc_destroy,
    .barrier = inproc_barrier,
    .share = inproc_share,
    .broken = inproc_broken,
};
