/* test_timeout: a rank that never arrives. With timeout_ms = 200, ranks 0 and 1 of a world of
 * 3 get EPX_ERR_TIMEOUT (naming the phase and rank 2) within a bounded time, every later call
 * on their comms fails fast with EPX_ERR_BROKEN, and a new world works again. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { R = 3, E = 6, H = 16, K = 2, TIMEOUT_MS = 200 };

typedef struct {
  tu_world_t *w;
  epx_handle_t **h;
  const tu_moe_t *m;
  int stall_after_notify; /* 0: rank 2 never calls epx_notify; 1: it notifies, then never dispatches */
  epx_status_t first[R], notify_again[R], dispatch_again[R], combine_again[R];
  double first_secs[R], again_secs[R];
  char err[R][512], err_again[R][512];
} ctx_t;

static epx_status_t rank_fn(int r, void *arg) {
  ctx_t *c = arg;
  epx_comm_t *comm = c->w->comm[r];
  epx_handle_t *h = c->h[r];
  epx_routing_t rt = tu_routing(c->m, r, TU_FORM_TOPK32);
  float *recv = tu_alloc_poison(sizeof(float) * 256 * H), *out = tu_alloc_poison(sizeof(float) * 256 * H);
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = c->m->x[r], a.x_dtype = EPX_FLOAT32, a.recv_dtype = EPX_FLOAT32, a.recv_x = recv, a.recv_capacity = 256;
  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = recv, ca.y_dtype = EPX_FLOAT32, ca.out = out, ca.out_dtype = EPX_FLOAT32;

  if (c->stall_after_notify) {
    epx_status_t s = epx_notify(comm, h, &rt);
    CHECK(s == EPX_SUCCESS, "rank %d: the notify before the stall: %s (%s)", r, epx_status_string(s), epx_last_error());
  }
  if (r == 2) { /* the rank that never arrives */
    free(recv), free(out);
    return EPX_SUCCESS;
  }
  double t0 = tu_now();
  c->first[r] = c->stall_after_notify ? epx_dispatch(comm, h, NULL, &a) : epx_notify(comm, h, &rt);
  c->first_secs[r] = tu_now() - t0;
  snprintf(c->err[r], sizeof c->err[r], "%s", epx_last_error());

  t0 = tu_now();
  c->notify_again[r] = epx_notify(comm, h, &rt);
  snprintf(c->err_again[r], sizeof c->err_again[r], "%s", epx_last_error());
  c->dispatch_again[r] = epx_dispatch(comm, h, &rt, &a);
  c->combine_again[r] = epx_combine(comm, h, &ca);
  c->again_secs[r] = tu_now() - t0;
  free(recv), free(out);
  return EPX_SUCCESS;
}

static void stalled_world(int stall_after_notify) {
  const char *phase = stall_after_notify ? "dispatch" : "notify";
  char what[80];
  snprintf(what, sizeof what, "rank 2 stalls before %s", phase);
  epx_config_t cfg = tu_config(E, H, K, 64);
  cfg.timeout_ms = TIMEOUT_MS;
  tu_world_t w;
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s: world", what)) {
    tu_world_destroy(&w);
    return;
  }
  int64_t T[R] = {10, 12, 8};
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  if (tu_handles_create(&w, &hc, h) == EPX_SUCCESS) {
    ctx_t c;
    memset(&c, 0, sizeof c);
    c.w = &w, c.h = h, c.m = &m, c.stall_after_notify = stall_after_notify;
    const double t0 = tu_now();
    epx_run_ranks(R, rank_fn, &c, NULL);
    const double total = tu_now() - t0;
    CHECK(total < 10.0, "%s: the whole run took %.2f s", what, total);
    for (int r = 0; r < 2; r++) {
      CHECK_STATUS(c.first[r], EPX_ERR_TIMEOUT, "%s: rank %d's %s", what, r, phase);
      CHECK(c.first_secs[r] < 5.0, "%s: rank %d waited %.2f s with a %d ms timeout", what, r, c.first_secs[r], TIMEOUT_MS);
      CHECK(c.first_secs[r] >= 0.5 * TIMEOUT_MS / 1000.0, "%s: rank %d gave up after %.3f s, before the %d ms timeout",
            what, r, c.first_secs[r], TIMEOUT_MS);
      CHECK(tu_contains(c.err[r], "rank 2") || tu_contains(c.err[r], "peer 2"),
            "%s: rank %d's message does not name rank 2: \"%s\"", what, r, c.err[r]);
      CHECK(tu_contains(c.err[r], phase) || tu_contains(c.err[r], "phase"), "%s: rank %d's message names no phase: \"%s\"",
            what, r, c.err[r]);
      CHECK_STATUS(c.notify_again[r], EPX_ERR_BROKEN, "%s: rank %d, epx_notify after the timeout", what, r);
      CHECK(c.err_again[r][0], "%s: rank %d, a message for the broken comm", what, r);
      CHECK_STATUS(c.dispatch_again[r], EPX_ERR_BROKEN, "%s: rank %d, epx_dispatch after the timeout", what, r);
      CHECK_STATUS(c.combine_again[r], EPX_ERR_BROKEN, "%s: rank %d, epx_combine after the timeout", what, r);
      CHECK(c.again_secs[r] < 0.5 * TIMEOUT_MS / 1000.0, "%s: rank %d: three calls on a broken comm took %.3f s", what, r,
            c.again_secs[r]);
      printf("  %s, rank %d: \"%s\" (%.3f s); then \"%s\"\n", what, r, c.err[r], c.first_secs[r], c.err_again[r]);
    }
  }
  /* Everything can be destroyed, broken or not. */
  tu_handles_destroy(&w, h);
  tu_world_destroy(&w);
  tu_moe_free(&m);
}

static void fresh_world_works(void) {
  epx_config_t cfg = tu_config(E, H, K, 64);
  cfg.timeout_ms = TIMEOUT_MS;
  tu_world_t w;
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  if (CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "a new world after the timeouts")) {
    epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 4);
    if (tu_handles_create(&w, &hc, h) == EPX_SUCCESS) {
      int64_t T[R] = {9, 0, 14};
      tu_route_opts_t o = tu_route_default();
      tu_moe_t m;
      tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
      tu_pipe_t p = tu_pipe_default();
      p.layout = EPX_LAYOUT_EXPERT, p.align = 4;
      tu_pipe_res_t res;
      const int rc = tu_pipe_check("new world", &w, h, &m, &p, NULL, &res);
      CHECK(rc == 0, "new world: the pipeline ran on every rank");
      tu_pipe_free(&res, R);
      tu_moe_free(&m);
    }
  }
  tu_handles_destroy(&w, h);
  tu_world_destroy(&w);
}

int main(void) {
  tu_begin("test_timeout");
  stalled_world(0);
  fresh_world_works();
  stalled_world(1);
  fresh_world_works();
  return tu_end();
}
