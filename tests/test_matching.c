/* test_matching: a collective pairs only with the same call of every peer (rank threads).
 *   every case of matching_cases.c (refused arguments, handle settings, call arguments,
 *   ranks out of step) over 2 and 3 ranks, the odd rank drawn at random;
 *   a rank that arrives after its peer timed out fails too (never EPX_SUCCESS);
 *   sizes past what the arithmetic can hold (2^62 tokens) are refused with a message, on
 *   every rank of the call, and by the host conversions and epx_get_layout. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "matching_cases.h"
#include "testutil.h"

typedef struct {
  mc_case_t c;
  tu_world_t *w, *other;
  int failed[TU_MAX_RANKS], checked[TU_MAX_RANKS];
} run_t;

static epx_status_t case_rank(int r, void *arg) {
  run_t *run = arg;
  char tag[160];
  snprintf(tag, sizeof tag, "[%s, %d ranks, odd rank %d, rank %d]", mc_name(run->c.kind), run->c.nranks, run->c.bad, r);
  run->failed[r] = mc_rank(&run->c, r, run->w->comm[r], run->other ? run->other->comm[r] : NULL, tag, &run->checked[r]);
  return EPX_SUCCESS;
}

static void one_case(mc_kind_t kind, int R) {
  run_t run;
  memset(&run, 0, sizeof run);
  run.c = (mc_case_t){.kind = kind, .nranks = R, .bad = tu_int(&tu_rng, 0, R - 1), .seed = tu_u64(&tu_rng),
                      .timeout_ms = 6000};
  epx_config_t cfg = mc_config(&run.c);
  tu_world_t w, other;
  run.w = &w;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s: world", mc_name(kind))) {
    tu_world_destroy(&w);
    return;
  }
  if (kind == MC_FOREIGN_HANDLE) {
    run.other = &other;
    CHECK_STATUS(tu_world_create(&other, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s: second world", mc_name(kind));
  }
  epx_run_ranks(R, case_rank, &run, NULL);
  for (int r = 0; r < R; r++)
    CHECK(run.failed[r] == 0 && run.checked[r] > 0, "[%s, %d ranks, odd rank %d] rank %d: %d of %d expectations failed",
          mc_name(kind), R, run.c.bad, r, run.failed[r], run.checked[r]);
  if (run.other) tu_world_destroy(&other);
  tu_world_destroy(&w);
}

/* ---- a rank that arrives after its peer gave up --------------------------------------- */

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
  tu_moe_t *m;
  epx_status_t st[2], next[2];
  char msg[2][512];
  int untouched[2];
} late_t;

static epx_status_t late_rank(int r, void *arg) {
  late_t *l = arg;
  if (r == 1) { /* arrives well after rank 0's timeout */
    struct timespec ts = {0, 900000000L};
    nanosleep(&ts, NULL);
  }
  const size_t bytes = sizeof(float) * 256 * (size_t)l->m->H;
  float *recv = tu_alloc_poison(bytes);
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = l->m->x[r], a.x_dtype = EPX_FLOAT32, a.recv_dtype = EPX_FLOAT32, a.recv_x = recv, a.recv_capacity = 256;
  epx_routing_t rt = tu_routing(l->m, r, TU_FORM_TOPK32);
  l->st[r] = epx_dispatch(l->w->comm[r], l->h[r], &rt, &a);
  snprintf(l->msg[r], sizeof l->msg[r], "%s", epx_last_error());
  l->untouched[r] = tu_is_poison(recv, bytes);
  l->next[r] = epx_notify(l->w->comm[r], l->h[r], &rt);
  free(recv);
  return EPX_SUCCESS;
}

static void late_rank_fails(void) {
  epx_config_t cfg = tu_config(4, 16, 2, 16);
  cfg.timeout_ms = 300;
  tu_world_t w;
  epx_handle_t *h[2] = {0};
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  if (!CHECK_STATUS(tu_world_create(&w, 2, &cfg, NULL, NULL), EPX_SUCCESS, "late rank: world") ||
      !CHECK_STATUS(tu_handles_create(&w, &hc, h), EPX_SUCCESS, "late rank: handles")) {
    tu_handles_destroy(&w, h);
    tu_world_destroy(&w);
    return;
  }
  int64_t T[2] = {5, 7};
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, 2, 4, 16, 2, EPX_FLOAT32, T, &o, 1);
  late_t l = {.w = &w, .h = h, .m = &m};
  epx_run_ranks(2, late_rank, &l, NULL);
  CHECK(l.st[0] == EPX_ERR_TIMEOUT && tu_contains(l.msg[0], "rank 1"), "late rank: rank 0 got %s (%s), want a timeout naming rank 1",
        epx_status_string(l.st[0]), l.msg[0]);
  CHECK(l.st[1] != EPX_SUCCESS, "late rank: rank 1 returned EPX_SUCCESS for the call its peer gave up on");
  CHECK(l.st[1] == EPX_ERR_BROKEN && tu_contains(l.msg[1], "broke"), "late rank: rank 1 got %s (%s)",
        epx_status_string(l.st[1]), l.msg[1]);
  for (int r = 0; r < 2; r++) {
    CHECK(l.untouched[r], "late rank: rank %d's recv_x was written", r);
    CHECK_STATUS(l.next[r], EPX_ERR_BROKEN, "late rank: rank %d's next call (the README: the comm is broken)", r);
  }
  tu_moe_free(&m);
  tu_handles_destroy(&w, h);
  tu_world_destroy(&w);
}

/* ---- sizes past the arithmetic ---------------------------------------------------------- */

static void huge_sizes(void) {
  const int64_t huge[] = {(int64_t)1 << 62, (int64_t)1 << 40, EPX_MAX_TOKENS + 1, INT64_MAX};
  int32_t idx[16];
  float w[16], probs[64];
  uint8_t map[64];
  for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
    memset(idx, TU_POISON, sizeof idx), memset(w, TU_POISON, sizeof w), memset(map, TU_POISON, sizeof map);
    memset(probs, TU_POISON, sizeof probs);
    CHECK_STATUS(epx_map_to_topk(huge[i], 64, 8, map, probs, idx, w), EPX_ERR_INVALID_ARGUMENT, "map_to_topk %lld tokens",
                 (long long)huge[i]);
    CHECK(tu_contains(epx_last_error(), "num_tokens"), "map_to_topk message: %s", epx_last_error());
    CHECK_STATUS(epx_topk_to_map(huge[i], 64, 8, EPX_INT32, idx, w, map, probs), EPX_ERR_INVALID_ARGUMENT,
                 "topk_to_map %lld tokens", (long long)huge[i]);
    CHECK(tu_is_poison(idx, sizeof idx) && tu_is_poison(w, sizeof w) && tu_is_poison(map, sizeof map) &&
              tu_is_poison(probs, sizeof probs),
          "a refused conversion of %lld tokens wrote its outputs", (long long)huge[i]);
  }
  epx_config_t cfg = tu_config(8, 16, 2, 16);
  tu_world_t tw;
  if (CHECK_STATUS(tu_world_create(&tw, 1, &cfg, NULL, NULL), EPX_SUCCESS, "huge sizes: world")) {
    epx_routing_t rt = {.num_tokens = (int64_t)1 << 62, .idx_dtype = EPX_INT32, .topk_idx = idx};
    int32_t per_rank[1], per_expert[8];
    memset(per_rank, TU_POISON, sizeof per_rank), memset(per_expert, TU_POISON, sizeof per_expert);
    CHECK_STATUS(epx_get_layout(tw.comm[0], &rt, per_rank, per_expert, NULL), EPX_ERR_INVALID_ARGUMENT,
                 "get_layout of 2^62 tokens");
    CHECK(tu_contains(epx_last_error(), "num_tokens"), "get_layout message: %s", epx_last_error());
    CHECK(tu_is_poison(per_rank, sizeof per_rank) && tu_is_poison(per_expert, sizeof per_expert),
          "a refused get_layout wrote its outputs");
  }
  tu_world_destroy(&tw);
}

int main(void) {
  tu_begin("test_matching");
  for (int k = 0; k < MC_NUM_CASES; k++)
    for (int R = 2; R <= 3; R++) {
      const long before = check_failures();
      one_case((mc_kind_t)k, R);
      if (check_failures() == before) printf("  %-36s %d ranks: ok\n", mc_name((mc_kind_t)k), R);
    }
  late_rank_fails();
  huge_sizes();
  return tu_end();
}
