/* test_mp_peerlost: a rank process that dies (SIGKILL), hangs or leaves makes the others fail
 * quickly and cleanly, in comm_init, notify, dispatch and combine, through either bootstrap:
 *   killed    the others get EPX_ERR_PEER_LOST naming the rank, long before the timeout
 *   hung      the others get EPX_ERR_TIMEOUT naming it after timeout_ms; when it wakes up
 *             its own call fails at once
 *   left      (destroyed its world early) the others get EPX_ERR_PEER_LOST
 *   mid-run   the parent kills a rank at a random moment of a loop of pipelines
 * After a failure every later call gives EPX_ERR_BROKEN, the survivors exit cleanly (no
 * leak under ASan), and /dev/shm has no new epx entries. */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mp_util.h"

#define R 4
#define KILL_TIMEOUT_MS 2000 /* a death must show long before this */
#define HANG_TIMEOUT_MS 1000
#define H 64
#define K 2
#define L 2
#define MAXT 16

typedef enum { AT_INIT, AT_NOTIFY, AT_DISPATCH, AT_COMBINE, AT_LOOP } stage_t;
static const char *stage_name[] = {"comm_init", "notify", "dispatch", "combine", "a loop of pipelines"};
typedef enum { HOW_KILL, HOW_HANG, HOW_LEAVE, HOW_PARENT_KILL } how_t;
static const char *how_name[] = {"killed", "hung", "left", "killed by the parent"};

typedef struct {
  stage_t stage;
  how_t how;
  int victim;
  int timeout_ms;
} case_t;

/* One rank's pipeline state. */
typedef struct {
  epx_comm_t *comm;
  epx_handle_t *h;
  int me;
  tu_moe_t m;
  void *recv, *y, *out;
  int64_t rows;
} pipe_t;

static epx_status_t do_notify(pipe_t *p, int iter) {
  tu_moe_free(&p->m);
  tu_moe_stream(&p->m, tu_seed, (uint64_t)iter, R, R * L, H, K, EPX_BFLOAT16, MAXT);
  epx_routing_t rt = {.num_tokens = p->m.T[p->me], .idx_dtype = EPX_INT32, .topk_idx = p->m.idx[p->me],
                      .topk_weights = p->m.w[p->me]};
  return epx_notify(p->comm, p->h, &rt);
}

static epx_status_t do_dispatch(pipe_t *p) {
  epx_handle_info_t info;
  epx_status_t s = epx_handle_info(p->h, &info, NULL);
  if (s != EPX_SUCCESS) return s;
  p->rows = info.num_recv_rows;
  free(p->recv), free(p->y);
  p->recv = calloc((size_t)(p->rows * H) + 1, 2);
  p->y = calloc((size_t)(p->rows * H) + 1, 2);
  epx_dispatch_args_t a;
  epx_dispatch_args_init(&a);
  a.x = p->m.x[p->me];
  a.recv_x = p->recv;
  a.recv_capacity = p->rows;
  return epx_dispatch(p->comm, p->h, NULL, &a);
}

static epx_status_t do_combine(pipe_t *p) {
  memcpy(p->y, p->recv, (size_t)(p->rows * H) * 2);
  free(p->out);
  p->out = malloc((size_t)(p->m.T[p->me] * H) * 2 + 1);
  epx_combine_args_t a;
  epx_combine_args_init(&a);
  a.y = p->y;
  a.out = p->out;
  return epx_combine(p->comm, p->h, &a);
}

static void die_or_stall(const case_t *c, epx_world_t **world, epx_comm_t **comm, epx_handle_t **h) {
  if (c->how == HOW_KILL) raise(SIGKILL);
  if (c->how == HOW_HANG) {
    int ms = c->timeout_ms + 700; /* the others give up meanwhile */
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  if (c->how == HOW_LEAVE) {
    epx_handle_destroy(*h);
    epx_comm_destroy(*comm);
    epx_world_destroy(*world);
    *h = NULL, *comm = NULL, *world = NULL;
  }
}

/* A survivor's verdict on the call that failed. */
static void check_failure(const case_t *c, const char *tag, const char *what, epx_status_t s, double secs) {
  const char *msg = epx_last_error();
  if (c->how == HOW_HANG) {
    CHECK(s == EPX_ERR_TIMEOUT, "%s: %s gave %s, want EPX_ERR_TIMEOUT (%s)", tag, what, epx_status_string(s), msg);
    CHECK(secs >= 0.9 * c->timeout_ms / 1000.0 && secs < c->timeout_ms / 1000.0 + 3.0,
          "%s: %s failed after %.3f s; the timeout is %d ms", tag, what, secs, c->timeout_ms);
  } else {
    CHECK(s == EPX_ERR_PEER_LOST, "%s: %s gave %s, want EPX_ERR_PEER_LOST (%s)", tag, what, epx_status_string(s), msg);
    /* a death is seen at once, not at the timeout */
    CHECK(secs < 0.75 * c->timeout_ms / 1000.0, "%s: %s took %.3f s to see the loss (timeout %d ms)", tag, what, secs,
          c->timeout_ms);
  }
  CHECK(tu_names_rank(msg, c->victim), "%s: the message of %s does not name rank %d: %s", tag, what, c->victim, msg);
}

/* After a good comm_init: a good pipeline, then the pipelines until the victim's failure
 * shows, the verdict on it, and that the group stays broken. The victim's own objects may be
 * released on the way (die_or_stall). */
static void run_to_failure(const case_t *c, const char *tag, bool victim, pipe_t *p, epx_world_t **world,
                           epx_comm_t **comm, epx_handle_t **h) {
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  CHECK_STATUS(epx_handle_create(*comm, &hc, h), EPX_SUCCESS, "%s handle", tag);
  p->comm = *comm, p->h = *h;

  /* one good pipeline first (the loop case has no "before": the kill may come any time) */
  if (c->stage != AT_LOOP) {
    CHECK_STATUS(do_notify(p, 0), EPX_SUCCESS, "%s first notify", tag);
    CHECK_STATUS(do_dispatch(p), EPX_SUCCESS, "%s first dispatch", tag);
    CHECK_STATUS(do_combine(p), EPX_SUCCESS, "%s first combine", tag);
  }

  epx_status_t s = EPX_SUCCESS;
  const char *what = "?";
  double t0 = tu_now(), secs;
  if (c->stage == AT_LOOP) {
    /* until the parent's kill shows (the victim loops too, until it is killed) */
    double end = tu_now() + 60;
    for (int it = 0; s == EPX_SUCCESS && tu_now() < end; it++) {
      t0 = tu_now(), what = "notify", s = do_notify(p, it);
      if (s == EPX_SUCCESS) t0 = tu_now(), what = "dispatch", s = do_dispatch(p);
      if (s == EPX_SUCCESS) t0 = tu_now(), what = "combine", s = do_combine(p);
    }
    secs = tu_now() - t0;
  } else {
    if (victim && c->stage == AT_NOTIFY) die_or_stall(c, world, comm, h);
    if (*comm) t0 = tu_now(), what = "notify", s = do_notify(p, 1);
    if (s == EPX_SUCCESS && victim && c->stage == AT_DISPATCH) die_or_stall(c, world, comm, h);
    if (s == EPX_SUCCESS && *comm) t0 = tu_now(), what = "dispatch", s = do_dispatch(p);
    if (s == EPX_SUCCESS && victim && c->stage == AT_COMBINE) die_or_stall(c, world, comm, h);
    if (s == EPX_SUCCESS && *comm) t0 = tu_now(), what = "combine", s = do_combine(p);
    secs = tu_now() - t0;
  }

  if (!victim) {
    CHECK(strcmp(what, stage_name[c->stage]) == 0 || c->stage == AT_LOOP, "%s: %s failed, not %s", tag, what,
          stage_name[c->stage]);
    check_failure(c, tag, what, s, secs);
  } else if (*comm) { /* the late rank */
    CHECK(s == EPX_ERR_TIMEOUT || s == EPX_ERR_PEER_LOST, "%s: the late rank's %s gave %s (%s)", tag, what,
          epx_status_string(s), epx_last_error());
    CHECK(secs < 1.0, "%s: the late rank took %.3f s to fail", tag, secs);
  }
  if (*comm) {
    /* broken for good */
    CHECK_STATUS(do_notify(p, 99), EPX_ERR_BROKEN, "%s: a call after the failure", tag);
    epx_dispatch_args_t a;
    epx_dispatch_args_init(&a);
    a.recv_x = p->recv ? p->recv : (void *)&a;
    CHECK_STATUS(epx_dispatch(*comm, *h, NULL, &a), EPX_ERR_BROKEN, "%s: a dispatch after the failure", tag);
  }
}

static void rank_main(mp_ctx_t *ctx) {
  const case_t *c = ctx->arg;
  const int me = ctx->proc;
  const bool victim = me == c->victim;
  const int fds_before = mp_count_fds();
  char tag[160];
  snprintf(tag, sizeof tag, "[%s: rank %d %s at %s, rank %d]", mp_boot_name(ctx->boot), c->victim, how_name[c->how],
           stage_name[c->stage], me);

  epx_world_t *world = NULL;
  if (!CHECK_STATUS(mp_world_create(ctx, R, me, &world), EPX_SUCCESS, "%s world", tag)) return;
  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = R * L;
  cfg.hidden = H;
  cfg.topk = K;
  cfg.max_tokens_per_rank = MAXT;
  cfg.timeout_ms = c->timeout_ms;
  pipe_t p = {.me = me};
  epx_handle_t *h = NULL;
  epx_comm_t *comm = NULL;

  if (victim && c->stage == AT_INIT) die_or_stall(c, &world, &comm, &h);
  double t0 = tu_now();
  epx_status_t s = world ? epx_comm_init(world, me, &cfg, &comm) : EPX_ERR_BROKEN;
  double secs = tu_now() - t0;
  if (c->stage == AT_INIT) {
    if (!victim) check_failure(c, tag, "comm_init", s, secs);
    if (victim && c->how == HOW_HANG)
      CHECK(s == EPX_ERR_TIMEOUT || s == EPX_ERR_PEER_LOST, "%s: the late rank's comm_init gave %s (%s)", tag,
            epx_status_string(s), epx_last_error());
    if (victim && c->how == HOW_HANG) CHECK(secs < 1.0, "%s: the late rank took %.3f s to fail", tag, secs);
    CHECK(comm == NULL, "%s: a failed comm_init left a comm", tag);
    epx_world_destroy(world);
    goto released;
  }
  if (c->stage == AT_LOOP && s != EPX_SUCCESS) { /* the parent's kill came this early */
    if (!victim) check_failure(c, tag, "comm_init", s, secs);
    epx_world_destroy(world);
    goto released;
  }
  if (!CHECK_STATUS(s, EPX_SUCCESS, "%s comm_init", tag)) {
    epx_world_destroy(world);
    return;
  }
  run_to_failure(c, tag, victim, &p, &world, &comm, &h);
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  epx_world_destroy(world);
  tu_moe_free(&p.m);
  free(p.recv), free(p.y), free(p.out);
released:
  /* everything released, after a failure too (process 0 of a unique-id launch also ran the
   * bootstrap listener, whose descriptors went with its thread) */
  CHECK(mp_count_epx_maps() == 0, "%s: %d epx mappings left", tag, mp_count_epx_maps());
  if (ctx->boot == MP_BOOT_CALLBACK || me != 0)
    CHECK(mp_count_fds() == fds_before, "%s: %d descriptors before the world, %d after", tag, fds_before,
          mp_count_fds());
}

int main(void) {
  tu_begin("test_mp_peerlost");
  setenv("EPX_TIMEOUT_MS", "10000", 1); /* the bootstrap's bound; the comms use c.timeout_ms */
  char shm_before[8192];
  mp_shm_list(shm_before, sizeof shm_before);
  tu_rng_t g = tu_rng_stream(tu_seed, 4242);

  const case_t cases[] = {
      {AT_INIT, HOW_KILL, 0, 0},        {AT_NOTIFY, HOW_KILL, 0, 0},      {AT_DISPATCH, HOW_KILL, 0, 0},
      {AT_COMBINE, HOW_KILL, 0, 0},     {AT_NOTIFY, HOW_HANG, 0, 0},      {AT_INIT, HOW_HANG, 0, 0},
      {AT_DISPATCH, HOW_LEAVE, 0, 0},   {AT_LOOP, HOW_PARENT_KILL, 0, 0},
  };
  const int ncases = (int)(sizeof cases / sizeof cases[0]);
  for (int i = 0; i < ncases; i++)
    for (int b = 0; b < 2; b++) {
      case_t c = cases[i];
      c.victim = tu_int(&g, 0, R - 1);
      c.timeout_ms = c.how == HOW_HANG ? HANG_TIMEOUT_MS : KILL_TIMEOUT_MS;
      if (c.how == HOW_HANG && b == 1) continue; /* one bootstrap is enough for the slow case */
      mp_launch_t l = {.nprocs = R, .boot = (mp_boot_t)b, .limit_s = 60};
      if (c.how == HOW_KILL || c.how == HOW_PARENT_KILL) l.expect_signal[c.victim] = SIGKILL;
      if (c.how == HOW_PARENT_KILL) l.kill_after_s[c.victim] = 0.2 + 0.6 * (double)tu_int(&g, 0, 1000) / 1000.0;
      printf("-- %s bootstrap: rank %d %s at %s\n", mp_boot_name(l.boot), c.victim, how_name[c.how],
             stage_name[c.stage]);
      double t0 = tu_now();
      mp_launch(&l, rank_main, &c);
      printf("   %.2f s\n", tu_now() - t0);
      char extra[1024];
      int n = mp_shm_new(shm_before, extra, sizeof extra);
      CHECK(n == 0, "/dev/shm has %d new epx entries after the run: %s", n, extra);
    }
  return tu_end();
}
