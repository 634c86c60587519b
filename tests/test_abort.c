/* test_abort: epx_comm_abort and epx_comm_get_async_error, in one process (the ranks are
 * threads; tests/mp/test_mp_liveness does the same across processes).
 *   peers wait   ranks 1..R-1 wait in a dispatch for rank 0, which never comes; a watchdog
 *                thread aborts rank 0's comm: every waiting rank returns EPX_ERR_BROKEN
 *                within a second (the timeout is 10 s) with a message naming the abort,
 *                their receive buffers untouched
 *   own wait     rank 0 waits in a notify for rank 1; the watchdog aborts rank 0's comm:
 *                rank 0's own wait ends the same way, and rank 1's late notify fails fast
 *   the query    before: EPX_SUCCESS and "" on every rank, not waiting even while a rank is
 *                inside a collective; after: EPX_ERR_BROKEN on every rank with the reason;
 *                every later collective fails with EPX_ERR_BROKEN; a second abort is
 *                harmless; a new world works. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

#define R 4
#define E 8
#define H 8
#define K 2
#define CAP 64

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
  tu_moe_t *m;
  int absent;               /* the rank that never calls */
  int use_notify;           /* notify instead of dispatch */
  void *recv[TU_MAX_RANKS]; /* poisoned receive buffers */
  epx_status_t st[TU_MAX_RANKS];
  char msg[TU_MAX_RANKS][512];
  double end[TU_MAX_RANKS]; /* when each rank's call returned */
  _Atomic int entered;
} abort_case_t;

static epx_status_t waiting_rank(int r, void *p) {
  abort_case_t *a = p;
  a->st[r] = EPX_SUCCESS;
  if (r == a->absent) return EPX_SUCCESS;
  epx_routing_t rt = tu_routing(a->m, r, TU_FORM_TOPK32);
  epx_dispatch_args_t da;
  epx_dispatch_args_init(&da);
  da.x_dtype = da.recv_dtype = EPX_FLOAT32;
  da.x = a->m->x[r], da.recv_x = a->recv[r], da.recv_capacity = CAP;
  atomic_fetch_add(&a->entered, 1);
  epx_status_t s = a->use_notify ? epx_notify(a->w->comm[r], a->h[r], &rt) : epx_dispatch(a->w->comm[r], a->h[r], &rt, &da);
  a->end[r] = tu_now();
  a->st[r] = s;
  snprintf(a->msg[r], sizeof a->msg[r], "%s", epx_last_error());
  return s;
}

static void *ranks_main(void *p) {
  epx_run_ranks(R, waiting_rank, p, NULL);
  return NULL;
}

/* Every rank's view after the abort. */
static void check_after(const char *what, abort_case_t *a) {
  for (int r = 0; r < R; r++) {
    epx_status_t st = EPX_ERR_INTERNAL;
    epx_status_t s = epx_comm_get_async_error(a->w->comm[r], &st);
    CHECK(s == EPX_ERR_BROKEN && st == EPX_ERR_BROKEN, "%s rank %d: async error %s / %s", what, r,
          epx_status_string(s), epx_status_string(st));
    CHECK(tu_contains(epx_last_error(), "abort"), "%s rank %d: the async error says why: %s", what, r,
          epx_last_error());
    int32_t idx[K] = {0, 1};
    epx_routing_t rt = {.num_tokens = 1, .idx_dtype = EPX_INT32, .topk_idx = idx};
    /* a lone rank's call: the group is broken, so it fails fast rather than waiting */
    double t0 = tu_now();
    CHECK_STATUS(epx_notify(a->w->comm[r], a->h[r], &rt), EPX_ERR_BROKEN, "%s rank %d: a later notify", what, r);
    CHECK(tu_now() - t0 < 1.0, "%s rank %d: ... fails at once", what, r);
  }
  CHECK_STATUS(epx_comm_abort(a->w->comm[0]), EPX_SUCCESS, "%s: a second abort", what);
  CHECK(epx_last_error()[0] == '\0', "%s: no message after a successful abort", what);
}

static void run_case(const char *what, int absent, int use_notify) {
  epx_config_t cfg = tu_config(E, H, K, 16); /* timeout 10 s */
  tu_world_t w;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s: world", what)) return;
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  CHECK_STATUS(tu_handles_create(&w, &hc, h), EPX_SUCCESS, "%s: handles", what);
  int64_t T[R];
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 1, 12);
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
  abort_case_t a = {.w = &w, .h = h, .m = &m, .absent = absent, .use_notify = use_notify};
  for (int r = 0; r < R; r++) a.recv[r] = tu_alloc_poison((size_t)CAP * H * sizeof(float));

  pthread_t ranks;
  pthread_create(&ranks, NULL, ranks_main, &a);
  while (atomic_load(&a.entered) < R - 1) tu_sleep_ms(1);
  tu_sleep_ms(100); /* they are waiting now */
  for (int r = 0; r < R; r++) {
    epx_status_t st = EPX_ERR_INTERNAL;
    double t0 = tu_now();
    CHECK_STATUS(epx_comm_get_async_error(w.comm[r], &st), EPX_SUCCESS, "%s rank %d: async error before", what, r);
    CHECK(st == EPX_SUCCESS && epx_last_error()[0] == '\0' && tu_now() - t0 < 0.5,
          "%s rank %d: nothing yet, and the query did not wait", what, r);
  }
  const double t_abort = tu_now();
  CHECK_STATUS(epx_comm_abort(w.comm[0]), EPX_SUCCESS, "%s: abort", what);
  CHECK(tu_now() - t_abort < 0.1, "%s: the abort did not wait (%.3f s)", what, tu_now() - t_abort);
  pthread_join(ranks, NULL);
  for (int r = 0; r < R; r++) {
    if (r == absent) continue;
    CHECK_STATUS(a.st[r], EPX_ERR_BROKEN, "%s rank %d: its waiting call (%s)", what, r, a.msg[r]);
    CHECK(tu_contains(a.msg[r], "abort") && tu_contains(a.msg[r], "rank 0"), "%s rank %d: message %s", what, r,
          a.msg[r]);
    CHECK(a.end[r] - t_abort < 1.0, "%s rank %d: its wait ended %.3f s after the abort", what, r, a.end[r] - t_abort);
    CHECK(tu_is_poison(a.recv[r], (size_t)CAP * H * sizeof(float)), "%s rank %d: recv_x untouched", what, r);
    if (r == R - 1) printf("%s, rank %d: %s\n", what, r, a.msg[r]);
  }
  check_after(what, &a);
  for (int r = 0; r < R; r++) free(a.recv[r]);
  tu_moe_free(&m);
  tu_handles_destroy(&w, h);
  tu_world_destroy(&w);
}

static void fresh_world_works(void) {
  epx_config_t cfg = tu_config(E, H, K, 16);
  tu_world_t w;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "a new world")) return;
  tu_world_usable("a new world after the aborts", &w, E, H, K);
  tu_world_destroy(&w);
}

int main(void) {
  tu_begin("test_abort");
  run_case("peers wait in dispatch", 0, 0);
  run_case("own wait in notify", 1, 1);
  fresh_world_works();
  return tu_end();
}
