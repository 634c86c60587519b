/* test_threads: a comm takes one call at a time. A second thread's call on a comm that is
 * inside a collective fails at once with EPX_ERR_BUSY ("another thread"), touches none of
 * its outputs, and leaves the collective and the group as they were: the collective
 * completes on every rank and a pipeline afterwards matches the dense reference. Several
 * threads hammering one comm's local calls each get success with the right counts or
 * EPX_ERR_BUSY with outputs untouched, never anything else (run under ThreadSanitizer by
 * make test-tsan). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

#define R 2
#define E 4
#define H 8
#define K 2
#define HAMMER_THREADS 4
#define HAMMER_CALLS 300

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
  tu_moe_t *m;
  _Atomic int rank0_calling, release_rank1;
  int busy_retries; /* rank 0's notify refused because the intruder held the comm */
} race_t;

static epx_status_t race_rank(int r, void *p) {
  race_t *a = p;
  epx_routing_t rt = tu_routing(a->m, r, TU_FORM_TOPK32);
  if (r == 1)
    while (!atomic_load(&a->release_rank1)) tu_sleep_ms(1);
  else
    atomic_store(&a->rank0_calling, 1);
  epx_status_t s;
  /* a call refused with BUSY took no part in anything: making it again is right */
  while ((s = epx_notify(a->w->comm[r], a->h[r], &rt)) == EPX_ERR_BUSY) a->busy_retries++, tu_sleep_ms(1);
  CHECK_STATUS(s, EPX_SUCCESS, "rank %d: its own notify, with another thread knocking", r);
  return s;
}

/* The intruder: every call on rank 0's comm while rank 0 waits in its notify. */
static void intrude(race_t *a) {
  epx_comm_t *c = a->w->comm[0];
  int32_t tpr[R];
  epx_routing_t rt = tu_routing(a->m, 0, TU_FORM_TOPK32);
  epx_status_t s = EPX_SUCCESS;
  for (int tries = 0; tries < 5000 && s != EPX_ERR_BUSY; tries++) { /* until rank 0 is inside */
    tu_sleep_ms(1);
    memset(tpr, TU_POISON, sizeof tpr);
    s = epx_get_layout(c, &rt, tpr, NULL, NULL);
  }
  if (!CHECK_STATUS(s, EPX_ERR_BUSY, "get_layout while another thread is in notify")) return;
  CHECK(tu_contains(epx_last_error(), "another thread"), "message: %s", epx_last_error());
  CHECK(tu_is_poison(tpr, sizeof tpr), "get_layout's output untouched");
  void *buf = tu_alloc_poison(1024);
  epx_dispatch_args_t da;
  epx_combine_args_t ca;
  tu_refused_args(buf, 4, &da, &ca);
  epx_handle_info_t info;
  memset(&info, TU_POISON, sizeof info);
  CHECK_STATUS(epx_notify(c, a->h[0], &rt), EPX_ERR_BUSY, "a second notify");
  CHECK_STATUS(epx_dispatch(c, a->h[0], &rt, &da), EPX_ERR_BUSY, "a dispatch");
  CHECK_STATUS(epx_combine(c, a->h[0], &ca), EPX_ERR_BUSY, "a combine");
  CHECK_STATUS(epx_handle_info(a->h[0], &info, NULL), EPX_ERR_BUSY, "handle_info");
  CHECK_STATUS(epx_handle_destroy(a->h[0]), EPX_ERR_BUSY, "destroying the handle in use");
  CHECK_STATUS(epx_comm_synchronize(c), EPX_ERR_BUSY, "synchronize");
  CHECK(tu_is_poison(buf, 1024) && tu_is_poison(&info, sizeof info), "outputs of the refused calls untouched");
  epx_status_t st = EPX_ERR_INTERNAL;
  CHECK_STATUS(epx_comm_get_async_error(c, &st), EPX_SUCCESS, "the async-error query is not refused");
  CHECK(st == EPX_SUCCESS && epx_last_error()[0] == '\0', "and says all is well (%d, \"%s\")", (int)st,
        epx_last_error());
  free(buf);
}

typedef struct {
  race_t *a;
  epx_status_t *st;
} run_t;

static void *race_ranks_main(void *p) {
  run_t *run = p;
  epx_run_ranks(R, race_rank, run->a, run->st);
  return NULL;
}

static void second_thread_refused(void) {
  epx_config_t cfg = tu_config(E, H, K, 16);
  tu_world_t w;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "world")) return;
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  CHECK_STATUS(tu_handles_create(&w, &hc, h), EPX_SUCCESS, "handles");
  int64_t T[R] = {5, 3};
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
  race_t a = {.w = &w, .h = h, .m = &m};
  epx_status_t st[R];
  run_t run = {&a, st};
  pthread_t ranks; /* the ranks run on their own threads while this one intrudes */
  pthread_create(&ranks, NULL, race_ranks_main, &run);
  while (!atomic_load(&a.rank0_calling)) tu_sleep_ms(1);
  intrude(&a);
  atomic_store(&a.release_rank1, 1);
  pthread_join(ranks, NULL);
  CHECK(st[0] == EPX_SUCCESS && st[1] == EPX_SUCCESS, "the collective completed on both ranks (%d %d)", (int)st[0],
        (int)st[1]);
  tu_handles_destroy(&w, h);
  tu_moe_free(&m);
  tu_world_usable("after the refused calls", &w, E, H, K);
  tu_world_destroy(&w);
}

typedef struct {
  epx_comm_t *comm;
  const tu_moe_t *m;
  const int32_t *want; /* tokens per rank of rank 0's routing */
  _Atomic long ok, busy, other;
} hammer_t;

static void *hammer_main(void *p) {
  hammer_t *a = p;
  epx_routing_t rt = tu_routing(a->m, 0, TU_FORM_TOPK32);
  for (int i = 0; i < HAMMER_CALLS; i++) {
    int32_t tpr[1];
    memset(tpr, TU_POISON, sizeof tpr);
    epx_status_t s = epx_get_layout(a->comm, &rt, tpr, NULL, NULL);
    if (s == EPX_SUCCESS && tpr[0] == a->want[0] && epx_last_error()[0] == '\0')
      atomic_fetch_add(&a->ok, 1);
    else if (s == EPX_ERR_BUSY && tu_is_poison(tpr, sizeof tpr))
      atomic_fetch_add(&a->busy, 1);
    else
      atomic_fetch_add(&a->other, 1);
  }
  return NULL;
}

static void hammer(void) {
  epx_config_t cfg = tu_config(E, H, K, 16);
  tu_world_t w;
  if (!CHECK_STATUS(tu_world_create(&w, 1, &cfg, NULL, NULL), EPX_SUCCESS, "world of one")) return;
  int64_t T[1] = {tu_int(&tu_rng, 500, 2000)}; /* long enough calls that the threads meet */
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, 1, E, H, K, EPX_FLOAT32, T, &o, 1);
  int32_t want = 0;
  for (int64_t t = 0; t < T[0]; t++) {
    int any = 0;
    for (int k = 0; k < K; k++) any |= m.idx[0][t * K + k] >= 0;
    want += any;
  }
  hammer_t a = {.comm = w.comm[0], .m = &m, .want = &want};
  pthread_t th[HAMMER_THREADS];
  for (int i = 0; i < HAMMER_THREADS; i++) pthread_create(&th[i], NULL, hammer_main, &a);
  for (int i = 0; i < HAMMER_THREADS; i++) pthread_join(th[i], NULL);
  CHECK(a.other == 0, "%ld of %d racing calls returned neither the right counts nor EPX_ERR_BUSY", (long)a.other,
        HAMMER_THREADS * HAMMER_CALLS);
  CHECK(a.ok > 0, "some calls got through (%ld ok, %ld busy)", (long)a.ok, (long)a.busy);
  printf("hammer: %ld calls succeeded, %ld were refused as busy\n", (long)a.ok, (long)a.busy);
  tu_moe_free(&m);
  tu_world_destroy(&w);
}

int main(void) {
  tu_begin("test_threads");
  second_thread_refused();
  hammer();
  return tu_end();
}
