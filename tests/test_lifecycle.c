/* test_lifecycle: destroyed objects are refused, not used; destroys in the wrong order are
 * refused and change nothing; epx_last_error() is "" after every successful call.
 *   twice       a second destroy of a handle, a comm, a world: EPX_ERR_INVALID_ARGUMENT
 *               naming the object, on every rank
 *   after       a destroyed handle or comm passed to notify, dispatch, combine, handle_info,
 *               get_layout, the getters: refused, outputs untouched (poisoned), and the group
 *               still runs a pipeline checked against the dense reference (every rank passes
 *               its destroyed handle at once: a collective call refuses it while taking part)
 *   busy        a world with live comms, a comm with live handles: EPX_ERR_BUSY with a
 *               message that says what is live; the objects stay usable
 *   messages    "" after each successful call, also right after a failed one (the object
 *               calls, the routing conversions, epx_backend_available)
 * The freed pointers are only compared, never read: ASan runs this test too. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define R 3
#define E 6
#define H 8
#define K 2

static void expect_empty_error(const char *after) {
  const char *e = epx_last_error();
  CHECK(e[0] == '\0', "epx_last_error() after a successful %s is \"%s\", want \"\"", after, e);
}

/* The refusals of a destroyed handle (hd) and a destroyed comm (cd); live is a live comm. */
static void refuses_dead(epx_comm_t *live, epx_handle_t *hd, epx_comm_t *cd) {
  void *out = tu_alloc_poison(4096);
  int32_t tok[R];
  memset(tok, TU_POISON, sizeof tok);
  int32_t idx[2 * K] = {0, 1, 2, 3};
  epx_routing_t rt = {.num_tokens = 2, .idx_dtype = EPX_INT32, .topk_idx = idx};
  epx_dispatch_args_t da;
  epx_combine_args_t ca;
  tu_refused_args(out, 1, &da, &ca);
  epx_handle_info_t info;
  memset(&info, TU_POISON, sizeof info);
  struct {
    const char *what;
    epx_status_t s;
  } calls[] = {
      {"notify with a destroyed handle", epx_notify(live, hd, &rt)},
      {"dispatch with a destroyed handle", epx_dispatch(live, hd, &rt, &da)},
      {"combine with a destroyed handle", epx_combine(live, hd, &ca)},
      {"handle_info of a destroyed handle", epx_handle_info(hd, &info, NULL)},
      {"handle_destroy again", epx_handle_destroy(hd)},
      {"notify on a destroyed comm", epx_notify(cd, hd, &rt)},
      {"get_layout on a destroyed comm", epx_get_layout(cd, &rt, tok, NULL, NULL)},
      {"synchronize on a destroyed comm", epx_comm_synchronize(cd)},
      {"set_stream on a destroyed comm", epx_comm_set_stream(cd, NULL)},
      {"abort of a destroyed comm", epx_comm_abort(cd)},
      {"comm_destroy again", epx_comm_destroy(cd)},
  };
  for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
    CHECK_STATUS(calls[i].s, EPX_ERR_INVALID_ARGUMENT, "%s", calls[i].what);
  }
  /* the last message names the object */
  CHECK(tu_contains(epx_last_error(), "not a live epx comm"), "message: %s", epx_last_error());
  epx_status_t st = EPX_ERR_INTERNAL;
  CHECK_STATUS(epx_comm_get_async_error(cd, &st), EPX_ERR_INVALID_ARGUMENT, "async error of a destroyed comm");
  CHECK(st == EPX_ERR_INTERNAL, "the status of a refused query is left alone (%d)", (int)st);
  CHECK(epx_comm_rank(cd) == -1 && epx_comm_nranks(cd) == 0 && epx_comm_config(cd) == NULL,
        "getters of a destroyed comm give their 'none' values");
  CHECK(tu_is_poison(out, 4096) && tu_is_poison(tok, sizeof tok) && tu_is_poison(&info, sizeof info),
        "outputs of refused calls untouched");
  free(out);
}

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
} busy_arg_t;

/* Each rank: a live handle keeps its comm from being destroyed. */
static epx_status_t busy_rank(int r, void *p) {
  busy_arg_t *a = p;
  epx_status_t s = epx_comm_destroy(a->w->comm[r]);
  CHECK_STATUS(s, EPX_ERR_BUSY, "rank %d: destroying a comm with a live handle", r);
  CHECK(tu_contains(epx_last_error(), "1 live handle"), "rank %d: message %s", r, epx_last_error());
  CHECK(epx_comm_rank(a->w->comm[r]) == r, "rank %d: the comm is still there", r);
  return EPX_SUCCESS;
}

static void busy(void) {
  epx_config_t cfg = tu_config(E, H, K, 16);
  tu_world_t w;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "world")) return;
  expect_empty_error("world and comm creation");
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  CHECK_STATUS(tu_handles_create(&w, &hc, h), EPX_SUCCESS, "handles");
  CHECK_STATUS(epx_world_destroy(w.world), EPX_ERR_BUSY, "destroying a world with live comms");
  CHECK(tu_contains(epx_last_error(), "3 live comms"), "message: %s", epx_last_error());
  busy_arg_t a = {&w, h};
  epx_run_ranks(R, busy_rank, &a, NULL);
  expect_empty_error("epx_run_ranks");
  tu_handles_destroy(&w, h);
  tu_world_usable("after the refused destroys", &w, E, H, K);
  tu_world_destroy(&w);
}

typedef struct {
  tu_world_t *w;
  epx_handle_t **dead; /* per rank: a destroyed handle */
  epx_comm_t *cd;      /* a destroyed comm */
} dead_arg_t;

static epx_status_t dead_rank(int r, void *p) {
  dead_arg_t *a = p;
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  epx_handle_t *h = NULL;
  CHECK_STATUS(epx_handle_create(a->w->comm[r], &hc, &h), EPX_SUCCESS, "rank %d handle", r);
  expect_empty_error("epx_handle_create");
  CHECK_STATUS(epx_handle_destroy(h), EPX_SUCCESS, "rank %d handle destroy", r);
  expect_empty_error("epx_handle_destroy");
  a->dead[r] = h;
  return EPX_SUCCESS;
}

static epx_status_t refuses_dead_rank(int r, void *p) {
  dead_arg_t *a = p;
  refuses_dead(a->w->comm[r], a->dead[r], a->cd);
  return EPX_SUCCESS;
}

static void after_destroy(void) {
  epx_config_t cfg = tu_config(E, H, K, 16);
  tu_world_t w, w2;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "world")) return;
  if (!CHECK_STATUS(tu_world_create(&w2, 1, &cfg, NULL, NULL), EPX_SUCCESS, "world of one")) return;
  epx_handle_t *dead[TU_MAX_RANKS];
  dead_arg_t a = {&w, dead, NULL};
  epx_run_ranks(R, dead_rank, &a, NULL);
  /* a comm of its own world of one rank, destroyed */
  epx_comm_t *cd = w2.comm[0];
  CHECK_STATUS(epx_comm_destroy(cd), EPX_SUCCESS, "comm destroy");
  expect_empty_error("epx_comm_destroy");
  w2.comm[0] = NULL;
  a.cd = cd;
  epx_run_ranks(R, refuses_dead_rank, &a, NULL);
  epx_world_t *wd = w2.world;
  CHECK_STATUS(epx_world_destroy(wd), EPX_SUCCESS, "world destroy");
  expect_empty_error("epx_world_destroy");
  w2.world = NULL;
  CHECK_STATUS(epx_world_destroy(wd), EPX_ERR_INVALID_ARGUMENT, "world destroyed twice");
  CHECK(tu_contains(epx_last_error(), "not a live epx world"), "message: %s", epx_last_error());
  CHECK(epx_world_nranks(wd) == 0, "nranks of a destroyed world");
  epx_comm_t *c = NULL;
  CHECK_STATUS(epx_comm_init(wd, 0, &cfg, &c), EPX_ERR_INVALID_ARGUMENT, "comm_init on a destroyed world");
  CHECK(c == NULL, "no comm made");
  /* the group never saw any of it */
  tu_world_usable("after the refused calls", &w, E, H, K);
  expect_empty_error("the pipeline");
  tu_world_destroy(&w);
}

/* The calls outside a comm: a success right after a failure leaves no message behind. */
static void messages_cleared(void) {
  int32_t idx[K];
  float w[K], probs[E];
  uint8_t map[E] = {0};
  map[1] = map[4] = 1;
  CHECK_STATUS(epx_map_to_topk(1, E, 0, map, NULL, idx, w), EPX_ERR_TOPK_RANGE, "a failing call first");
  CHECK(epx_map_to_topk(1, E, K, map, NULL, idx, w) == EPX_SUCCESS && idx[0] == 1 && idx[1] == 4, "map_to_topk");
  expect_empty_error("epx_map_to_topk");
  CHECK_STATUS(epx_map_to_topk(1, E, 0, map, NULL, idx, w), EPX_ERR_TOPK_RANGE, "a failing call first");
  memset(map, 0, sizeof map);
  CHECK(epx_topk_to_map(1, E, K, EPX_INT32, idx, w, map, probs) == EPX_SUCCESS && map[1] && map[4], "topk_to_map");
  expect_empty_error("epx_topk_to_map");
  CHECK_STATUS(epx_map_to_topk(1, E, 0, map, NULL, idx, w), EPX_ERR_TOPK_RANGE, "a failing call first");
  CHECK_STATUS(epx_backend_available(EPX_BACKEND_HOST), EPX_SUCCESS, "host backend");
  expect_empty_error("epx_backend_available");
}

int main(void) {
  tu_begin("test_lifecycle");
  busy();
  after_destroy();
  messages_cleared();
  return tu_end();
}
