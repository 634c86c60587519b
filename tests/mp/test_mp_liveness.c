/* test_mp_liveness: across processes (host backend), what a framework's watchdog relies on.
 *   forked child   a rank forks a child (which inherits its sockets and outlives it by
 *                  1.5 s), then dies, and its parent leaves it a zombie as long (so
 *                  neither a hang-up nor kill(pid, 0) shows it): the others, waiting in a notify, get
 *                  EPX_ERR_PEER_LOST naming it within a second, not their 20 s timeout
 *   abort          rank 0 aborts its comm from a watchdog thread, never calling the
 *                  collective: the others' notify ends with EPX_ERR_BROKEN within a second,
 *                  naming the abort and rank 0; every rank's async error says EPX_ERR_BROKEN
 *   async lost     a rank (with a forked child as above) dies while the others make no call:
 *                  epx_comm_get_async_error, polled, reports EPX_ERR_PEER_LOST naming it
 *                  within a second, before any wait saw it
 * Before each event every rank's query gives EPX_SUCCESS with an empty message. */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mp_util.h"

#define R 4
#define H 64
#define K 2
#define L 2
#define MAXT 16
#define TIMEOUT_MS 20000 /* far above what a detection may take */

typedef enum { CASE_FORKED_CHILD, CASE_ABORT, CASE_ASYNC_LOST } case_kind_t;
static const char *case_name[] = {"forked child", "abort", "async lost"};

typedef struct {
  case_kind_t kind;
  int victim;
} case_t;

/* Forks a child that keeps every inherited socket open for 1.5 s (quietly), then dies. */
static void die_leaving_a_child(void) {
  pid_t c = fork();
  if (c == 0) {
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, 1), dup2(null, 2);
    tu_sleep_ms(1500);
    _exit(0);
  }
  tu_sleep_ms(50); /* the peers are waiting by now */
  raise(SIGKILL);
}

static epx_status_t notify(epx_comm_t *comm, epx_handle_t *h, tu_moe_t *m, int me) {
  epx_routing_t rt = tu_routing(m, me, TU_FORM_TOPK32);
  return epx_notify(comm, h, &rt);
}

static void check_quiet(const char *tag, epx_comm_t *comm) {
  epx_status_t st = EPX_ERR_INTERNAL;
  CHECK_STATUS(epx_comm_get_async_error(comm, &st), EPX_SUCCESS, "%s async error before", tag);
  CHECK(st == EPX_SUCCESS && epx_last_error()[0] == '\0', "%s: nothing to report yet (%s, \"%s\")", tag,
        epx_status_string(st), epx_last_error());
}

static void *abort_later(void *p) {
  tu_sleep_ms(200);
  CHECK_STATUS(epx_comm_abort((epx_comm_t *)p), EPX_SUCCESS, "rank 0: abort from the watchdog thread");
  return NULL;
}

/* What the survivors see, per case. */
static void survivor(const case_t *c, const char *tag, epx_comm_t *comm, epx_handle_t *h, tu_moe_t *m, int me) {
  epx_status_t st = EPX_ERR_INTERNAL;
  double t0 = tu_now();
  if (c->kind == CASE_ASYNC_LOST) {
    epx_status_t s;
    while ((s = epx_comm_get_async_error(comm, &st)) == EPX_SUCCESS && tu_now() - t0 < 5) tu_sleep_ms(10);
    double secs = tu_now() - t0;
    CHECK(s == EPX_ERR_PEER_LOST && st == s, "%s: async error %s / %s (%s)", tag, epx_status_string(s),
          epx_status_string(st), epx_last_error());
    CHECK(secs < 1.0, "%s: the loss showed after %.3f s", tag, secs);
    CHECK(tu_names_rank(epx_last_error(), c->victim), "%s: names rank %d: %s", tag, c->victim, epx_last_error());
    tu_sleep_ms(500); /* the other survivors query too before this one leaves */
    return;
  }
  epx_status_t s = notify(comm, h, m, me);
  double secs = tu_now() - t0;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", epx_last_error());
  epx_status_t want = c->kind == CASE_ABORT ? EPX_ERR_BROKEN : EPX_ERR_PEER_LOST;
  CHECK_STATUS(s, want, "%s: the waiting notify", tag);
  CHECK(secs < 1.0, "%s: its wait ended after %.3f s (timeout %d ms)", tag, secs, TIMEOUT_MS);
  CHECK(tu_names_rank(msg, c->victim), "%s: names rank %d: %s", tag, c->victim, msg);
  if (c->kind == CASE_ABORT) CHECK(strstr(msg, "abort") != NULL, "%s: names the abort: %s", tag, msg);
  CHECK(epx_comm_get_async_error(comm, &st) == want && st == want, "%s: async error afterwards %s", tag,
        epx_status_string(st));
  t0 = tu_now();
  CHECK_STATUS(notify(comm, h, m, me), EPX_ERR_BROKEN, "%s: a later call on the broken group", tag);
  CHECK(tu_now() - t0 < 0.5, "%s: ... fails at once (%.3f s)", tag, tu_now() - t0);
}

static void rank_main(mp_ctx_t *ctx) {
  const case_t *c = ctx->arg;
  const int me = ctx->proc;
  char tag[160];
  snprintf(tag, sizeof tag, "[%s, %s: rank %d]", mp_boot_name(ctx->boot), case_name[c->kind], me);
  epx_world_t *world = NULL;
  if (!CHECK_STATUS(mp_world_create(ctx, R, me, &world), EPX_SUCCESS, "%s world", tag)) return;
  epx_comm_t *comm;
  epx_handle_t *h;
  tu_moe_t m;
  tu_moe_stream(&m, tu_seed, 7, R, R * L, H, K, EPX_BFLOAT16, MAXT);
  if (mp_comm_open(world, me, &m, MAXT, TIMEOUT_MS, tag, &comm, &h)) {
    CHECK_STATUS(notify(comm, h, &m, me), EPX_SUCCESS, "%s a good notify first", tag);
    check_quiet(tag, comm);
    if (me == c->victim && c->kind != CASE_ABORT) die_leaving_a_child();
    if (me == c->victim) { /* CASE_ABORT: the watchdog aborts; this rank's thread never joins the call */
      pthread_t wd;
      pthread_create(&wd, NULL, abort_later, comm);
      pthread_join(wd, NULL);
      epx_status_t st = EPX_ERR_INTERNAL;
      CHECK(epx_comm_get_async_error(comm, &st) == EPX_ERR_BROKEN && st == EPX_ERR_BROKEN,
            "%s: its own async error after the abort: %s", tag, epx_status_string(st));
      CHECK_STATUS(notify(comm, h, &m, me), EPX_ERR_BROKEN, "%s: a call after its abort", tag);
    } else {
      survivor(c, tag, comm, h, &m, me);
    }
  }
  tu_moe_free(&m);
  CHECK_STATUS(epx_handle_destroy(h), EPX_SUCCESS, "%s handle destroy", tag);
  CHECK_STATUS(epx_comm_destroy(comm), EPX_SUCCESS, "%s comm destroy", tag);
  CHECK_STATUS(epx_world_destroy(world), EPX_SUCCESS, "%s world destroy", tag);
}

int main(void) {
  tu_begin("test_mp_liveness");
  setenv("EPX_TIMEOUT_MS", "20000", 1);
  tu_rng_t g = tu_rng_stream(tu_seed, 99);
  const case_kind_t kinds[] = {CASE_FORKED_CHILD, CASE_ABORT, CASE_ASYNC_LOST};
  for (int i = 0; i < 3; i++)
    for (int b = 0; b < 2; b++) {
      case_t c = {kinds[i], kinds[i] == CASE_ABORT ? 0 : tu_int(&g, 0, R - 1)};
      mp_launch_t l = {.nprocs = R, .boot = (mp_boot_t)b, .limit_s = 60};
      if (c.kind != CASE_ABORT) l.expect_signal[c.victim] = SIGKILL;
      if (c.kind != CASE_ABORT) l.reap_after_s[c.victim] = 1.5; /* dead but not reaped: kill(pid, 0) still works */
      printf("-- %s bootstrap: %s, rank %d\n", mp_boot_name(l.boot), case_name[c.kind], c.victim);
      double t0 = tu_now();
      mp_launch(&l, rank_main, &c);
      printf("   %.2f s\n", tu_now() - t0);
    }
  return tu_end();
}
