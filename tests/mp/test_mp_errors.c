/* test_mp_errors: what goes wrong when forming a group across processes.
 *   config mismatch   one rank's config differs: every rank's comm_init fails with
 *                     EPX_ERR_CONFIG_MISMATCH naming the field and the rank; the world stays
 *                     usable (a second comm_init with one config works)
 *   rank checks       comm_init on a rank the world does not drive
 *   group size        a process disagrees on nranks: every process fails
 *   rank twice        two processes claim one rank: every process fails
 *   never joins       one rank never starts: the others' bootstrap times out (EPX_TIMEOUT_MS)
 *                     naming it, and nothing is left in /dev/shm
 *   arguments         bad ids, NULLs, ranks out of range, a failing or garbled allgather, an
 *                     id whose group already formed, a one-rank group. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mp_util.h"

static epx_config_t small_config(int nranks) {
  epx_config_t c;
  epx_config_init(&c);
  c.num_experts = 2 * nranks;
  c.hidden = 64;
  c.topk = 2;
  c.max_tokens_per_rank = 8;
  c.timeout_ms = 10000;
  return c;
}

static bool contains(const char *msg, const char *what) { return strstr(msg, what) != NULL; }

/* ---- config mismatch ------------------------------------------------------------------ */

typedef struct {
  int nranks, odd_rank;
  const char *field;
} mismatch_t;

static void mismatch_main(mp_ctx_t *ctx) {
  const mismatch_t *mm = ctx->arg;
  const int me = ctx->proc;
  char tag[96];
  snprintf(tag, sizeof tag, "[mismatch %s, %s, rank %d]", mm->field, mp_boot_name(ctx->boot), me);
  epx_world_t *w = NULL;
  if (!CHECK_STATUS(mp_world_create(ctx, mm->nranks, me, &w), EPX_SUCCESS, "%s world", tag)) return;
  epx_config_t good = small_config(mm->nranks), cfg = good;
  if (me == mm->odd_rank) {
    if (!strcmp(mm->field, "hidden")) cfg.hidden = 128;
    if (!strcmp(mm->field, "num_experts")) cfg.num_experts = 4 * mm->nranks;
    if (!strcmp(mm->field, "topk")) cfg.topk = 1;
  }
  /* a rank this world does not drive: refused here, before any collective */
  epx_comm_t *comm = NULL;
  CHECK_STATUS(epx_comm_init(w, (me + 1) % mm->nranks, &good, &comm), EPX_ERR_INVALID_ARGUMENT,
               "%s comm_init on another rank", tag);
  CHECK(contains(epx_last_error(), "not driven by this world"), "%s: message: %s", tag, epx_last_error());
  CHECK_STATUS(epx_comm_init(w, mm->nranks, &good, &comm), EPX_ERR_INVALID_ARGUMENT, "%s comm_init on rank nranks", tag);

  epx_status_t s = epx_comm_init(w, me, &cfg, &comm);
  CHECK_STATUS(s, EPX_ERR_CONFIG_MISMATCH, "%s comm_init", tag);
  char field[64], who[32];
  snprintf(field, sizeof field, "'%s'", mm->field);
  snprintf(who, sizeof who, "rank %d", mm->odd_rank);
  CHECK(contains(epx_last_error(), field) && contains(epx_last_error(), who),
        "%s: the message does not name %s and %s: %s", tag, field, who, epx_last_error());
  CHECK(comm == NULL, "%s: comm set after a failure", tag);
  /* the world is still good */
  if (CHECK_STATUS(epx_comm_init(w, me, &good, &comm), EPX_SUCCESS, "%s comm_init with one config", tag)) {
    epx_handle_config_t hc;
    epx_handle_config_init(&hc);
    epx_handle_t *h = NULL;
    CHECK_STATUS(epx_handle_create(comm, &hc, &h), EPX_SUCCESS, "%s handle", tag);
    int32_t idx[2] = {me % good.num_experts, -1};
    epx_routing_t rt = {.num_tokens = 1, .idx_dtype = EPX_INT32, .topk_idx = idx};
    CHECK_STATUS(epx_notify(comm, h, &rt), EPX_SUCCESS, "%s notify after the mismatch", tag);
    epx_handle_destroy(h);
    epx_comm_destroy(comm);
  }
  epx_world_destroy(w);
}

/* ---- bootstrap disagreements ---------------------------------------------------------- */

typedef struct {
  const char *name;
  int nranks;                   /* of the group, as most processes say */
  int claim_rank[MP_MAX_PROCS]; /* the rank each process claims */
  int claim_n[MP_MAX_PROCS];    /* the size each process claims (0: nranks) */
  epx_status_t want;
  const char *words;            /* the message contains this */
  double max_s;                 /* every process fails within this */
  double min_s;
} boot_case_t;

static void boot_main(mp_ctx_t *ctx) {
  const boot_case_t *bc = ctx->arg;
  const int me = ctx->proc;
  int n = bc->claim_n[me] ? bc->claim_n[me] : bc->nranks;
  char tag[96];
  snprintf(tag, sizeof tag, "[%s, %s, process %d]", bc->name, mp_boot_name(ctx->boot), me);
  epx_world_t *w = NULL;
  double t0 = tu_now();
  epx_status_t s = mp_world_create(ctx, n, bc->claim_rank[me], &w);
  double secs = tu_now() - t0;
  CHECK_STATUS(s, bc->want, "%s world", tag);
  CHECK(contains(epx_last_error(), bc->words), "%s: the message lacks \"%s\": %s", tag, bc->words, epx_last_error());
  CHECK(secs <= bc->max_s && secs >= bc->min_s, "%s: failed after %.3f s, want [%.1f, %.1f]", tag, secs, bc->min_s,
        bc->max_s);
  CHECK(w == NULL, "%s: world set after a failure", tag);
  if (w) epx_world_destroy(w);
  if (me == 0 && ctx->boot == MP_BOOT_ID) {
    /* The id's listener lives in this process: stay a moment, so that a process that joins
     * late still hears why the group failed (not just "connection refused"). */
    struct timespec ts = {0, 500000000L};
    nanosleep(&ts, NULL);
  }
}

/* ---- single-process argument checks ------------------------------------------------- */

static int failing_allgather(const void *mine, void *all, size_t bytes, void *ctx) {
  (void)mine, (void)all, (void)bytes, (void)ctx;
  return 7;
}

static int zero_allgather(const void *mine, void *all, size_t bytes, void *ctx) {
  (void)mine, (void)ctx;
  memset(all, 0, bytes);
  return 0;
}

static int self_allgather(const void *mine, void *all, size_t bytes, void *ctx) {
  (void)ctx;
  memcpy(all, mine, bytes);
  return 0;
}

static void args_main(mp_ctx_t *ctx) {
  (void)ctx;
  const int fds0 = mp_count_fds();
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST;
  wc.nranks = 2;
  epx_world_t *w = (epx_world_t *)&wc; /* must be overwritten with NULL on failure */
  epx_unique_id_t id;
  memset(&id, 0x5a, sizeof id);

  CHECK_STATUS(epx_get_unique_id(NULL), EPX_ERR_NULL_POINTER, "get_unique_id(NULL)");
  CHECK_STATUS(epx_world_create_rank(NULL, &id, 0, &w), EPX_ERR_NULL_POINTER, "create_rank without config");
  CHECK_STATUS(epx_world_create_rank(&wc, NULL, 0, &w), EPX_ERR_NULL_POINTER, "create_rank without id");
  CHECK_STATUS(epx_world_create_rank(&wc, &id, 2, &w), EPX_ERR_INVALID_ARGUMENT, "create_rank rank 2 of 2");
  CHECK(w == NULL, "world not cleared on failure");
  CHECK_STATUS(epx_world_create_rank(&wc, &id, -1, &w), EPX_ERR_INVALID_ARGUMENT, "create_rank rank -1");
  CHECK_STATUS(epx_world_create_rank(&wc, &id, 0, &w), EPX_ERR_INVALID_ARGUMENT, "create_rank with a garbage id");
  CHECK(contains(epx_last_error(), "not an epx unique id"), "garbage id message: %s", epx_last_error());
  wc.nranks = 0;
  CHECK_STATUS(epx_world_create_rank_with(&wc, 0, self_allgather, NULL, &w), EPX_ERR_INVALID_ARGUMENT, "nranks 0");
  wc.nranks = EPX_MAX_RANKS + 1;
  CHECK_STATUS(epx_world_create_rank_with(&wc, 0, self_allgather, NULL, &w), EPX_ERR_INVALID_ARGUMENT, "nranks > max");
  wc.nranks = 1;
  CHECK_STATUS(epx_world_create_rank_with(&wc, 0, NULL, NULL, &w), EPX_ERR_NULL_POINTER, "no allgather");
  CHECK_STATUS(epx_world_create_rank_with(&wc, 0, failing_allgather, NULL, &w), EPX_ERR_SYSTEM, "failing allgather");
  CHECK(contains(epx_last_error(), "allgather failed (returned 7)"), "failing allgather message: %s", epx_last_error());
  CHECK_STATUS(epx_world_create_rank_with(&wc, 0, zero_allgather, NULL, &w), EPX_ERR_INVALID_ARGUMENT,
               "garbled allgather");

  /* a group of one, through a trivial allgather and through an id */
  if (CHECK_STATUS(epx_world_create_rank_with(&wc, 0, self_allgather, NULL, &w), EPX_SUCCESS, "one-rank group")) {
    epx_config_t cfg = small_config(1);
    epx_comm_t *c = NULL;
    CHECK_STATUS(epx_comm_init(w, 1, &cfg, &c), EPX_ERR_INVALID_ARGUMENT, "comm_init rank 1 of 1");
    CHECK_STATUS(epx_comm_init(w, 0, &cfg, &c), EPX_SUCCESS, "comm_init rank 0 of 1");
    epx_comm_destroy(c);
    epx_world_destroy(w);
  }
  CHECK(mp_count_fds() == fds0, "descriptors: %d before, %d after", fds0, mp_count_fds());

  if (CHECK_STATUS(epx_get_unique_id(&id), EPX_SUCCESS, "get_unique_id")) {
    if (CHECK_STATUS(epx_world_create_rank(&wc, &id, 0, &w), EPX_SUCCESS, "one-rank group through an id"))
      epx_world_destroy(w);
    /* the group formed: its listener is gone */
    struct timespec ts = {0, 200000000L};
    nanosleep(&ts, NULL);
    double t0 = tu_now();
    CHECK_STATUS(epx_world_create_rank(&wc, &id, 0, &w), EPX_ERR_PEER_LOST, "a used id");
    CHECK(tu_now() - t0 < 1.0, "a used id took %.3f s to fail", tu_now() - t0);
  }

  /* The CUDA backend spans processes where it runs (tests/gpu/test_cuda_mp checks that) and
   * is refused where this build or machine lacks it. Last: starting CUDA opens descriptors. */
  wc.backend = EPX_BACKEND_CUDA;
  if (epx_backend_available(EPX_BACKEND_CUDA) != EPX_SUCCESS)
    CHECK_STATUS(epx_world_create_rank_with(&wc, 0, self_allgather, NULL, &w), EPX_ERR_UNSUPPORTED,
                 "cuda backend without CUDA");
}

int main(void) {
  tu_begin("test_mp_errors");
  setenv("EPX_TIMEOUT_MS", "10000", 1);
  char shm_before[8192];
  mp_shm_list(shm_before, sizeof shm_before);
  tu_rng_t g = tu_rng_stream(tu_seed, 77);

  printf("-- config mismatch\n");
  {
    mismatch_t a = {.nranks = 4, .odd_rank = tu_int(&g, 1, 3), .field = "hidden"};
    mp_launch_t l = {.nprocs = a.nranks, .boot = MP_BOOT_ID, .limit_s = 60};
    mp_launch(&l, mismatch_main, &a);
    mismatch_t b = {.nranks = 3, .odd_rank = tu_int(&g, 1, 2), .field = "num_experts"};
    l = (mp_launch_t){.nprocs = b.nranks, .boot = MP_BOOT_CALLBACK, .limit_s = 60};
    mp_launch(&l, mismatch_main, &b);
    mismatch_t c = {.nranks = 2, .odd_rank = 1, .field = "topk"};
    l = (mp_launch_t){.nprocs = c.nranks, .boot = MP_BOOT_CALLBACK, .limit_s = 60};
    mp_launch(&l, mismatch_main, &c);
  }

  printf("-- disagreement on the group size\n");
  {
    boot_case_t bc = {.name = "group size", .nranks = 3, .claim_rank = {0, 1, 2}, .claim_n = {0, 0, 4},
                      .want = EPX_ERR_CONFIG_MISMATCH, .words = "ranks", .max_s = 5};
    mp_launch_t l = {.nprocs = 3, .boot = MP_BOOT_ID, .limit_s = 60};
    mp_launch(&l, boot_main, &bc);
  }

  printf("-- two processes claim one rank\n");
  {
    boot_case_t bc = {.name = "rank twice", .nranks = 3, .claim_rank = {0, 1, 1}, .want = EPX_ERR_INVALID_ARGUMENT,
                      .words = "rank 1", .max_s = 5};
    mp_launch_t l = {.nprocs = 3, .boot = MP_BOOT_ID, .limit_s = 60};
    mp_launch(&l, boot_main, &bc);
    /* through the caller's allgather, position 2 holds rank 1 */
    l.boot = MP_BOOT_CALLBACK;
    mp_launch(&l, boot_main, &bc);
  }

  printf("-- a rank never joins (EPX_TIMEOUT_MS=1500)\n");
  {
    setenv("EPX_TIMEOUT_MS", "1500", 1);
    boot_case_t bc = {.name = "never joins", .nranks = 4, .claim_rank = {0, 1, 2}, .want = EPX_ERR_TIMEOUT,
                      .words = "rank 3 never joined", .min_s = 1.2, .max_s = 6};
    mp_launch_t l = {.nprocs = 3, .boot = MP_BOOT_ID, .limit_s = 60};
    double t0 = tu_now();
    mp_launch(&l, boot_main, &bc);
    printf("   %.2f s\n", tu_now() - t0);
    setenv("EPX_TIMEOUT_MS", "10000", 1);
  }

  printf("-- arguments\n");
  {
    mp_launch_t l = {.nprocs = 1, .boot = MP_BOOT_CALLBACK, .limit_s = 60};
    mp_launch(&l, args_main, NULL);
  }

  char extra[1024];
  int n = mp_shm_new(shm_before, extra, sizeof extra);
  CHECK(n == 0, "/dev/shm has %d new epx entries: %s", n, extra);
  return tu_end();
}
