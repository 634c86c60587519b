/* The public entry points: argument checks common to every backend, object life cycles,
 * and the hand-off to the backend. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

/* ---- version and the structs callers fill (epx.h: "A stable ABI") ----------------------- */

int epx_get_version(void) { return EPX_VERSION_CODE; }

typedef struct {
  uint32_t size, version;
} struct_head_t;

#define EPX_STRUCT_HEAD(p) ((p)->struct_size = (uint32_t)sizeof *(p), (p)->struct_version = EPX_VERSION_CODE)

/* A struct of another size, or from an epx.h of another major.minor release, is refused
 * before any of its other fields is read. */
static epx_status_t check_struct(const void *p, size_t size, const char *type, const char *init, const char *fn) {
  struct_head_t h;
  memcpy(&h, p, sizeof h);
  if (h.size == size && h.version / 100 == EPX_VERSION_CODE / 100) return EPX_SUCCESS;
  if (h.size == 0)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: the %s has struct_size 0: set it up with %s, then set its fields",
                     fn, type, init);
  return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                   "%s: the %s is %u bytes from epx.h version %u.%u.%u, but this libepx (version %d.%d.%d) takes "
                   "%zu bytes from its own: build the program against this library's epx.h and set the struct "
                   "up with %s",
                   fn, type, h.size, h.version / 10000, h.version / 100 % 100, h.version % 100, EPX_VERSION_MAJOR,
                   EPX_VERSION_MINOR, EPX_VERSION_PATCH, size, init);
}
#define EPX_CHECK_STRUCT(p, type, init, fn) check_struct((p), sizeof(type), #type, #init, (fn))

/* ---- backends ------------------------------------------------------------------------- */

const char *epx_backend_name(epx_backend_t backend) {
  switch (backend) {
    case EPX_BACKEND_HOST: return "host";
    case EPX_BACKEND_CUDA: return "cuda";
    case EPX_BACKEND_AUTO: return "auto";
  }
  return "unknown";
}

epx_status_t epx_backend_available(epx_backend_t backend) {
  epxi_clear_error();
  switch (backend) {
    case EPX_BACKEND_HOST: return EPX_SUCCESS;
    case EPX_BACKEND_CUDA:
#ifdef EPX_HAVE_CUDA
      return epxi_cuda_available();
#else
      return epxi_fail(EPX_ERR_UNSUPPORTED, "this build of epx has no CUDA backend (nvcc was not found at build time)");
#endif
    case EPX_BACKEND_AUTO: return EPX_SUCCESS;
  }
  return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "unknown backend %d", (int)backend);
}

static const epxi_backend_t *backend_ops(epx_backend_t backend) {
#ifdef EPX_HAVE_CUDA
  if (backend == EPX_BACKEND_CUDA) return &epxi_cuda_backend;
#endif
  return backend == EPX_BACKEND_HOST ? &epxi_host_backend : NULL;
}

/* ---- world ---------------------------------------------------------------------------- */

void epx_world_config_init(epx_world_config_t *wc) {
  memset(wc, 0, sizeof *wc);
  EPX_STRUCT_HEAD(wc);
  wc->backend = EPX_BACKEND_AUTO;
  wc->nranks = 1;
}

/* A world of `num_local` ranks from `first_rank` on: the backend resolved, the group made
 * (in this process; or, given a bootstrap exchange, this rank's part of a group across
 * processes), then the backend's part. */
static epx_status_t world_make(const epx_world_config_t *wc, int first_rank, int num_local, epxi_exchange_fn exchange,
                               void *ctx, epx_world_t **world) {
  epx_backend_t backend = wc->backend;
#ifdef EPX_HAVE_CUDA
  if (backend != EPX_BACKEND_HOST) epxi_cuda_world_env(wc, first_rank, num_local); /* before CUDA starts */
#endif
  if (backend == EPX_BACKEND_AUTO)
    backend = epx_backend_available(EPX_BACKEND_CUDA) == EPX_SUCCESS ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
  EPX_CHECK(epx_backend_available(backend));
  const epxi_backend_t *ops = backend_ops(backend);
  if (!ops) return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "unknown backend %d", (int)backend);

  epx_world_t *w = calloc(1, sizeof *w);
  if (!w) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "world");
  w->backend = backend;
  w->nranks = wc->nranks;
  w->first_rank = first_rank;
  w->num_local = num_local;
  w->ops = ops;
  for (int r = 0; r < w->nranks; r++) w->devices[r] = wc->devices ? wc->devices[r] : -1;
  epx_status_t s = exchange ? epxi_shm_group_create(w->nranks, first_rank, (int)backend, exchange, ctx,
                                                    epxi_env()->timeout_ms, &w->group)
                            : epxi_group_create(w->nranks, &w->group);
  if (s == EPX_SUCCESS && ops->world_create) s = ops->world_create(w);
  bool made = s == EPX_SUCCESS;
  if (s == EPX_SUCCESS) s = epxi_obj_register(w, EPXI_OBJ_WORLD);
  if (s != EPX_SUCCESS) {
    if (made && ops->world_destroy) ops->world_destroy(w);
    if (w->group) epxi_group_destroy(w->group);
    free(w);
    return s;
  }
  *world = w;
  epxi_clear_error();
  return EPX_SUCCESS;
}

epx_status_t epx_world_create(const epx_world_config_t *wc, epx_world_t **world) {
  epxi_clear_error();
  if (!wc || !world) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_world_create: config and world are required");
  EPX_CHECK(EPX_CHECK_STRUCT(wc, epx_world_config_t, epx_world_config_init, "epx_world_create"));
  if (wc->nranks < 1 || wc->nranks > EPX_MAX_RANKS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "nranks %d outside [1, %d]", wc->nranks, EPX_MAX_RANKS);
  return world_make(wc, 0, wc->nranks, NULL, NULL, world);
}

/* Unregisters a world nothing uses any more (registry locked). */
static epx_status_t retire_world(void *obj, void *arg) {
  epx_world_t *w = obj;
  (void)arg;
  int n = atomic_load(&w->live_comms);
  if (n > 0)
    return epxi_fail(EPX_ERR_BUSY, "epx_world_destroy: the world still has %d live comm%s: destroy them first", n,
                     n == 1 ? "" : "s");
  epxi_obj_unregister(w, EPXI_OBJ_WORLD);
  return EPX_SUCCESS;
}

epx_status_t epx_world_destroy(epx_world_t *world) {
  epxi_clear_error();
  if (!world) return EPX_SUCCESS;
  EPX_CHECK(epxi_obj_with(world, EPXI_OBJ_WORLD, "epx_world_destroy", retire_world, NULL));
  if (world->ops->world_destroy) world->ops->world_destroy(world);
  epxi_group_destroy(world->group);
  free(world);
  epxi_clear_error();
  return EPX_SUCCESS;
}

/* ---- worlds of one rank of a group across processes ---------------------------------- */

/* The caller's allgather as a bootstrap exchange. */
typedef struct {
  epx_allgather_fn fn;
  void *ctx;
  int rank;
} user_exchange_t;

static epx_status_t user_exchange(const void *mine, void *all, size_t bytes, void *ctx) {
  user_exchange_t *u = ctx;
  int rc = u->fn(mine, all, bytes, u->ctx);
  if (rc != 0)
    return epxi_fail(EPX_ERR_SYSTEM, "rank %d, bootstrap: the caller's allgather failed (returned %d)", u->rank, rc);
  return EPX_SUCCESS;
}

static epx_status_t check_rank_args(const epx_world_config_t *wc, int rank, epx_world_t **world, const char *fn) {
  if (!wc || !world) return epxi_fail(EPX_ERR_NULL_POINTER, "%s: config and world are required", fn);
  *world = NULL;
  EPX_CHECK(EPX_CHECK_STRUCT(wc, epx_world_config_t, epx_world_config_init, fn));
  if (wc->nranks < 1 || wc->nranks > EPX_MAX_RANKS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: nranks %d outside [1, %d]", fn, wc->nranks, EPX_MAX_RANKS);
  if (rank < 0 || rank >= wc->nranks)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: rank %d outside [0, %d)", fn, rank, wc->nranks);
  return EPX_SUCCESS;
}

epx_status_t epx_world_create_rank(const epx_world_config_t *wc, const epx_unique_id_t *id, int rank,
                                   epx_world_t **world) {
  epxi_clear_error();
  EPX_CHECK(check_rank_args(wc, rank, world, "epx_world_create_rank"));
  if (!id) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_world_create_rank: id is required");
  epxi_bootstrap_t *conn;
  EPX_CHECK(epxi_bootstrap_connect(id, rank, wc->nranks, epxi_env()->timeout_ms, &conn));
  epx_status_t s = world_make(wc, rank, 1, epxi_bootstrap_exchange, conn, world);
  epxi_bootstrap_close(conn);
  return s;
}

epx_status_t epx_world_create_rank_with(const epx_world_config_t *wc, int rank, epx_allgather_fn allgather, void *ctx,
                                        epx_world_t **world) {
  epxi_clear_error();
  EPX_CHECK(check_rank_args(wc, rank, world, "epx_world_create_rank_with"));
  if (!allgather) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_world_create_rank_with: allgather is required");
  user_exchange_t u = {.fn = allgather, .ctx = ctx, .rank = rank};
  return world_make(wc, rank, 1, user_exchange, &u, world);
}

int epx_world_nranks(const epx_world_t *world) {
  return epxi_obj_live(world, EPXI_OBJ_WORLD) ? world->nranks : 0;
}
epx_backend_t epx_world_backend(const epx_world_t *world) {
  return epxi_obj_live(world, EPXI_OBJ_WORLD) ? world->backend : EPX_BACKEND_HOST;
}

/* ---- config and comm ------------------------------------------------------------------ */

void epx_config_init(epx_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  EPX_STRUCT_HEAD(cfg);
  cfg->num_experts = 256;
  cfg->hidden = 7168;
  cfg->topk = 8;
  cfg->max_tokens_per_rank = 128;
  cfg->num_sms = 0;
  cfg->timeout_ms = 0;
}

static epx_status_t check_config(const epx_config_t *c, int nranks) {
  EPX_CHECK(EPX_CHECK_STRUCT(c, epx_config_t, epx_config_init, "epx_comm_init"));
  if (c->topk < 1 || c->topk > EPX_MAX_TOPK)
    return epxi_fail(EPX_ERR_TOPK_RANGE, "config.topk %d outside [1, %d]", c->topk, EPX_MAX_TOPK);
  if (c->hidden < 1 || c->hidden > EPX_MAX_HIDDEN)
    return epxi_fail(EPX_ERR_HIDDEN_RANGE, "config.hidden %d outside [1, %d]", c->hidden, EPX_MAX_HIDDEN);
  if (c->num_experts < 1 || c->num_experts > EPX_MAX_EXPERTS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "config.num_experts %d outside [1, %d]", c->num_experts,
                     EPX_MAX_EXPERTS);
  if (c->num_experts % nranks)
    return epxi_fail(EPX_ERR_EXPERTS_NOT_DIVISIBLE, "config.num_experts %d is not a multiple of %d ranks",
                     c->num_experts, nranks);
  if (c->max_tokens_per_rank < 0)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "config.max_tokens_per_rank %d < 0", c->max_tokens_per_rank);
  if (c->num_sms < 0) return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "config.num_sms %d < 0", c->num_sms);
  if (c->timeout_ms < 0) return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "config.timeout_ms %d < 0", c->timeout_ms);
  return epxi_nodes_check_config(c, nranks);
}

/* What every rank contributes to the config exchange. */
typedef struct {
  epx_status_t status;
  epx_config_t cfg;
} config_vote_t;

/* The fields ranks must agree on (timeouts may differ). */
#define EPX_CONFIG_AGREED(X) X(num_experts) X(hidden) X(topk) X(num_sms) X(ranks_per_node)

static epx_status_t compare_configs(const config_vote_t *votes, int nranks, int rank) {
  if (votes[rank].status != EPX_SUCCESS) return votes[rank].status; /* its own message stands */
  for (int r = 0; r < nranks; r++)
    if (votes[r].status != EPX_SUCCESS)
      return r == rank ? votes[r].status
                       : epxi_fail(votes[r].status, "rank %d passed an invalid config (%s)", r,
                                   epx_status_string(votes[r].status));
  for (int r = 1; r < nranks; r++) {
#define EPX_COMPARE_FIELD(f)                                                                             \
  if (votes[r].cfg.f != votes[0].cfg.f)                                                                  \
    return epxi_fail(EPX_ERR_CONFIG_MISMATCH, "config field '%s' is %d on rank 0 but %d on rank %d", #f, \
                     votes[0].cfg.f, votes[r].cfg.f, r);
    EPX_CONFIG_AGREED(EPX_COMPARE_FIELD)
#undef EPX_COMPARE_FIELD
  }
  return EPX_SUCCESS;
}

/* Ranks may see different token counts (uneven batches): every rank sizes for the largest. */
static int group_max_tokens(const config_vote_t *votes, int nranks) {
  int m = 0;
  for (int r = 0; r < nranks; r++)
    if (votes[r].cfg.max_tokens_per_rank > m) m = votes[r].cfg.max_tokens_per_rank;
  return m;
}

static epx_status_t check_backend_config(const epx_world_t *world, const epx_config_t *c) {
  if (!world->ops->wide_topk && c->topk > EPXI_NARROW_TOPK)
    return epxi_fail(EPX_ERR_UNSUPPORTED, "config.topk %d: the %s backend takes top-k up to %d (EPX_MAX_TOPK %d is the "
                     "host backend's)", c->topk, world->ops->name, EPXI_NARROW_TOPK, EPX_MAX_TOPK);
  return EPX_SUCCESS;
}

/* A comm being made keeps its world from being destroyed (registry locked). */
static epx_status_t reserve_world(void *obj, void *arg) {
  (void)arg;
  atomic_fetch_add(&((epx_world_t *)obj)->live_comms, 1);
  return EPX_SUCCESS;
}

static epx_status_t comm_init_body(epx_world_t *world, int rank, const epx_config_t *cfg, epx_comm_t **comm);

epx_status_t epx_comm_init(epx_world_t *world, int rank, const epx_config_t *cfg, epx_comm_t **comm) {
  epxi_clear_error();
  if (!world || !cfg || !comm) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_comm_init: world, config and comm are required");
  EPX_CHECK(epxi_obj_with(world, EPXI_OBJ_WORLD, "epx_comm_init", reserve_world, NULL));
  epx_status_t s = comm_init_body(world, rank, cfg, comm);
  if (s != EPX_SUCCESS) atomic_fetch_sub(&world->live_comms, 1);
  else epxi_clear_error();
  return s;
}

static epx_status_t comm_init_body(epx_world_t *world, int rank, const epx_config_t *cfg, epx_comm_t **comm) {
  if (rank < 0 || rank >= world->nranks)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d outside [0, %d)", rank, world->nranks);
  if (rank < world->first_rank || rank >= world->first_rank + world->num_local)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "rank %d is not driven by this world: it drives ranks [%d, %d) of a group of %d", rank,
                     world->first_rank, world->first_rank + world->num_local, world->nranks);
  config_vote_t mine = {.status = check_config(cfg, world->nranks), .cfg = *cfg};
  if (mine.status == EPX_SUCCESS) mine.status = check_backend_config(world, cfg);
  if (mine.cfg.num_sms == 0) mine.cfg.num_sms = epxi_env()->num_sms;
  if (mine.cfg.timeout_ms == 0) mine.cfg.timeout_ms = epxi_env()->timeout_ms;
  mine.cfg.ranks_per_node = epxi_nodes_resolve(mine.cfg.ranks_per_node, world->nranks);
  config_vote_t votes[EPX_MAX_RANKS];
  EPX_CHECK(epxi_group_allgather(world->group, rank, "comm_init:config", mine.cfg.timeout_ms, &mine, sizeof mine,
                                 votes));
  EPX_CHECK(compare_configs(votes, world->nranks, rank));
  EPX_CHECK(epxi_nodes_supported(world->ops, &mine.cfg, world->nranks));
  mine.cfg.max_tokens_per_rank = group_max_tokens(votes, world->nranks);

  epx_comm_t *c = calloc(1, sizeof *c);
  if (!c) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "comm");
  c->world = world;
  c->rank = rank;
  c->nranks = world->nranks;
  c->cfg = mine.cfg;
  c->num_local_experts = cfg->num_experts / world->nranks;
  epx_status_t s = world->ops->comm_init ? world->ops->comm_init(c) : EPX_SUCCESS;
  bool made = s == EPX_SUCCESS;
  if (s == EPX_SUCCESS) s = epxi_obj_register(c, EPXI_OBJ_COMM);
  if (s != EPX_SUCCESS) {
    if (made && world->ops->comm_destroy) world->ops->comm_destroy(c);
    free(c);
    return s;
  }
  *comm = c;
  return EPX_SUCCESS;
}

/* ---- taking a comm for one call -------------------------------------------------------- */

typedef struct {
  const epx_handle_t *handle; /* checked too, when not NULL */
  const char *what;
  bool *dead; /* a collective call's: a handle that is not live is noted here, not refused */
} enter_arg_t;

/* Registry locked: the handle is live and the comm's, and no other thread is in the comm. A
 * collective call lets a dead or foreign handle in: it refuses it while taking part (api.c's
 * fail_collective), so the peers fail at once too. */
static epx_status_t enter_locked(void *obj, void *arg) {
  epx_comm_t *c = obj;
  const enter_arg_t *a = arg;
  const bool live = !a->handle || epxi_obj_live(a->handle, EPXI_OBJ_HANDLE);
  if (a->dead) *a->dead = !live;
  if (!a->dead && !live)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: the handle is not a live epx handle (destroyed already?)", a->what);
  if (!a->dead && a->handle && a->handle->comm != c)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: the handle belongs to another comm", a->what);
  int idle = 0;
  if (!atomic_compare_exchange_strong(&c->in_call, &idle, 1))
    return epxi_fail(EPX_ERR_BUSY,
                     "%s on rank %d: another thread is inside a call on this comm (a comm takes one call at a time)",
                     a->what, c->rank);
  return EPX_SUCCESS;
}

static epx_status_t comm_enter(epx_comm_t *comm, const epx_handle_t *handle, const char *what) {
  enter_arg_t a = {handle, what, NULL};
  return epxi_obj_with(comm, EPXI_OBJ_COMM, what, enter_locked, &a);
}

/* comm_enter for a collective call: *dead says whether `handle` is not a live handle (the
 * call then goes on with none, and refuses it while taking part). */
static epx_status_t comm_enter_call(epx_comm_t *comm, const epx_handle_t *handle, const char *what, bool *dead) {
  *dead = false;
  enter_arg_t a = {handle, what, dead};
  return epxi_obj_with(comm, EPXI_OBJ_COMM, what, enter_locked, &a);
}

/* Ends a call that comm_enter let in: its status, with no message left on success. */
static epx_status_t comm_leave(epx_comm_t *comm, epx_status_t s) {
  atomic_store(&comm->in_call, 0);
  if (s == EPX_SUCCESS) epxi_clear_error();
  return s;
}

/* Unregisters a comm nothing uses any more (registry locked). */
static epx_status_t retire_comm(void *obj, void *arg) {
  epx_comm_t *c = obj;
  (void)arg;
  int n = atomic_load(&c->live_handles);
  if (n > 0)
    return epxi_fail(EPX_ERR_BUSY, "epx_comm_destroy on rank %d: the comm still has %d live handle%s: destroy them first",
                     c->rank, n, n == 1 ? "" : "s");
  if (atomic_load(&c->in_call))
    return epxi_fail(EPX_ERR_BUSY, "epx_comm_destroy on rank %d: another thread is inside a call on this comm", c->rank);
  epxi_obj_unregister(c, EPXI_OBJ_COMM);
  return EPX_SUCCESS;
}

epx_status_t epx_comm_destroy(epx_comm_t *comm) {
  epxi_clear_error();
  if (!comm) return EPX_SUCCESS;
  EPX_CHECK(epxi_obj_with(comm, EPXI_OBJ_COMM, "epx_comm_destroy", retire_comm, NULL));
  epx_world_t *w = comm->world;
  if (w->ops->comm_destroy) w->ops->comm_destroy(comm);
  free(comm);
  atomic_fetch_sub(&w->live_comms, 1);
  epxi_clear_error();
  return EPX_SUCCESS;
}

int epx_comm_rank(const epx_comm_t *comm) { return epxi_obj_live(comm, EPXI_OBJ_COMM) ? comm->rank : -1; }
int epx_comm_nranks(const epx_comm_t *comm) { return epxi_obj_live(comm, EPXI_OBJ_COMM) ? comm->nranks : 0; }
const epx_config_t *epx_comm_config(const epx_comm_t *comm) {
  return epxi_obj_live(comm, EPXI_OBJ_COMM) ? &comm->cfg : NULL;
}

epx_status_t epx_comm_set_stream(epx_comm_t *comm, void *stream) {
  epxi_clear_error();
  EPX_CHECK(comm_enter(comm, NULL, "epx_comm_set_stream"));
  comm->stream = stream;
  return comm_leave(comm, EPX_SUCCESS);
}

/* ---- abort and the asynchronous error ------------------------------------------------ */

epx_status_t epxi_comm_abort_group(epx_comm_t *comm) {
  epxi_group_abort(comm->world->group, comm->rank);
  return EPX_SUCCESS;
}

epx_status_t epxi_comm_group_error(epx_comm_t *comm, char *why, size_t size) {
  return epxi_group_error(comm->world->group, comm->rank, why, size);
}

/* Registry locked (the comm cannot be destroyed meanwhile); never waits. */
static epx_status_t abort_locked(void *obj, void *arg) {
  epx_comm_t *c = obj;
  (void)arg;
  if (!c->world->ops->comm_abort)
    return epxi_fail(EPX_ERR_UNSUPPORTED, "epx_comm_abort: the %s backend does not implement abort yet",
                     c->world->ops->name);
  EPX_CHECK(c->world->ops->comm_abort(c));
  c->broken = true;
  return EPX_SUCCESS;
}

epx_status_t epx_comm_abort(epx_comm_t *comm) {
  epxi_clear_error();
  EPX_CHECK(epxi_obj_with(comm, EPXI_OBJ_COMM, "epx_comm_abort", abort_locked, NULL));
  epxi_clear_error();
  return EPX_SUCCESS;
}

static epx_status_t async_error_locked(void *obj, void *arg) {
  epx_comm_t *c = obj;
  epx_status_t *out = arg;
  if (!c->world->ops->async_error)
    return epxi_fail(EPX_ERR_UNSUPPORTED, "epx_comm_get_async_error: the %s backend does not implement it yet",
                     c->world->ops->name);
  char why[512];
  why[0] = '\0';
  epx_status_t s = c->world->ops->async_error(c, why, sizeof why);
  if (s == EPX_SUCCESS && c->broken) {
    s = EPX_ERR_BROKEN;
    snprintf(why, sizeof why, "an earlier call failed and left the comm broken");
  }
  *out = s;
  if (s == EPX_SUCCESS) return s;
  return epxi_fail(s, "rank %d: %s", c->rank, why);
}

epx_status_t epx_comm_get_async_error(epx_comm_t *comm, epx_status_t *status) {
  epxi_clear_error();
  if (!status) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_comm_get_async_error: status is NULL");
  epx_status_t found = EPX_SUCCESS;
  epx_status_t s = epxi_obj_with(comm, EPXI_OBJ_COMM, "epx_comm_get_async_error", async_error_locked, &found);
  if (s == EPX_SUCCESS || s == found) *status = found;
  return s;
}

/* Marks the comm broken when the group failed under the call. */
static epx_status_t collective_result(epx_comm_t *comm, epx_status_t s) {
  /* a CUDA call that failed mid-operation left the peers waiting for the rest of it */
  /* ranks out of step would pair every later call wrongly too */
  if (s == EPX_ERR_TIMEOUT || s == EPX_ERR_PEER_LOST || s == EPX_ERR_BROKEN || s == EPX_ERR_CUDA ||
      s == EPX_ERR_OUT_OF_STEP)
    comm->broken = true;
  return s;
}

/* A comm whose group broke cannot be trusted with another collective; a failure the device
 * recorded since the last call is reported now. */
static epx_status_t check_comm(epx_comm_t *comm, const char *op) {
  if (!comm) return epxi_fail(EPX_ERR_NULL_POINTER, "%s: comm is NULL", op);
  if (!comm->broken && comm->world->ops->poll) {
    epx_status_t s = comm->world->ops->poll(comm);
    if (s != EPX_SUCCESS) return collective_result(comm, s);
  }
  if (comm->broken || epxi_group_broken(comm->world->group)) {
    comm->broken = true;
    return epxi_fail(EPX_ERR_BROKEN, "%s on rank %d: the group broke earlier; destroy and re-create it", op,
                     comm->rank);
  }
  return EPX_SUCCESS;
}

/* The SEND/COMPLETE rule, before an operation touches anything: between a SEND and its
 * COMPLETE (same handle, same operation) nothing else may run on the comm, and a COMPLETE
 * needs its SEND. Every rank makes the same calls, so every rank refuses alike. */
static epx_status_t check_order(const epx_comm_t *comm, const epx_handle_t *handle, bool combine, epx_part_t part,
                                const char *op) {
  const bool complete = part == EPX_PART_COMPLETE;
  if (comm->pending) {
    if (complete && comm->pending == handle && comm->pending_combine == combine) return EPX_SUCCESS;
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s on rank %d: a %s SEND is outstanding on this comm: COMPLETE it first",
                     op, comm->rank, comm->pending_combine ? "combine" : "dispatch");
  }
  if (complete) return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s on rank %d: COMPLETE without a SEND before it", op, comm->rank);
  return EPX_SUCCESS;
}

/* After the call: a successful SEND is outstanding; a COMPLETE (done or not) is not. */
static epx_status_t track_order(epx_comm_t *comm, const epx_handle_t *handle, bool combine, epx_part_t part,
                                epx_status_t s) {
  if (part == EPX_PART_COMPLETE) comm->pending = NULL;
  if (part == EPX_PART_SEND && s == EPX_SUCCESS) {
    comm->pending = handle;
    comm->pending_combine = combine;
  }
  return s;
}

epx_status_t epx_comm_synchronize(epx_comm_t *comm) {
  epxi_clear_error();
  EPX_CHECK(comm_enter(comm, NULL, "epx_comm_synchronize"));
  if (!comm->world->ops->synchronize) return comm_leave(comm, EPX_SUCCESS);
  return comm_leave(comm, collective_result(comm, comm->world->ops->synchronize(comm)));
}

/* ---- layout and handles --------------------------------------------------------------- */

epx_status_t epx_layout_counts(int nranks, int num_experts, int topk, const epx_routing_t *routing,
                               int32_t *tokens_per_rank, int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  epxi_clear_error();
  if (nranks < 1 || nranks > EPX_MAX_RANKS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "epx_layout_counts: nranks %d outside [1, %d]", nranks, EPX_MAX_RANKS);
  if (num_experts < 1 || num_experts > EPX_MAX_EXPERTS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "epx_layout_counts: num_experts %d outside [1, %d]", num_experts,
                     EPX_MAX_EXPERTS);
  if (num_experts % nranks)
    return epxi_fail(EPX_ERR_EXPERTS_NOT_DIVISIBLE, "epx_layout_counts: num_experts %d is not a multiple of %d ranks",
                     num_experts, nranks);
  EPX_CHECK(epxi_check_routing_form(routing));
  epxi_topk_t t;
  EPX_CHECK(epxi_topk_from_routing(routing, num_experts, topk, &t));
  epxi_count_layout(&t, nranks, num_experts / nranks, tokens_per_rank, tokens_per_expert, is_token_in_rank);
  epxi_topk_free(&t);
  return EPX_SUCCESS;
}

static epx_status_t get_layout_body(epx_comm_t *comm, const epx_routing_t *routing, int32_t *tokens_per_rank,
                                    int32_t *tokens_per_expert, uint8_t *is_token_in_rank);

epx_status_t epx_get_layout(epx_comm_t *comm, const epx_routing_t *routing, int32_t *tokens_per_rank,
                            int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  epxi_clear_error();
  EPX_CHECK(comm_enter(comm, NULL, "epx_get_layout"));
  return comm_leave(comm, get_layout_body(comm, routing, tokens_per_rank, tokens_per_expert, is_token_in_rank));
}

static epx_status_t get_layout_body(epx_comm_t *comm, const epx_routing_t *routing, int32_t *tokens_per_rank,
                                    int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  EPX_CHECK(check_comm(comm, "epx_get_layout"));
  EPX_CHECK(check_order(comm, NULL, false, EPX_PART_ALL, "epx_get_layout"));
  EPX_CHECK(epxi_check_routing_form(routing));
  return comm->world->ops->get_layout(comm, routing, tokens_per_rank, tokens_per_expert, is_token_in_rank);
}

void epx_handle_config_init(epx_handle_config_t *hc) {
  memset(hc, 0, sizeof *hc);
  EPX_STRUCT_HEAD(hc);
  hc->algo = EPX_ALGO_HT;
  hc->layout = EPX_LAYOUT_TOKEN;
  hc->align = 1;
  hc->exact = 1;
}

static epx_status_t handle_create_body(epx_comm_t *comm, const epx_handle_config_t *hc, epx_handle_t **handle);

epx_status_t epx_handle_create(epx_comm_t *comm, const epx_handle_config_t *hc, epx_handle_t **handle) {
  epxi_clear_error();
  if (!comm) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_handle_create: comm is NULL");
  EPX_CHECK(comm_enter(comm, NULL, "epx_handle_create"));
  return comm_leave(comm, handle_create_body(comm, hc, handle));
}

static epx_status_t handle_create_body(epx_comm_t *comm, const epx_handle_config_t *hc, epx_handle_t **handle) {
  /* counted even when it fails (not when the comm was busy: then the call did nothing), so
   * the ranks' numbers stay equal as long as they make the same calls */
  const uint64_t id = ++comm->handles_made;
  if (!hc || !handle) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_handle_create: config and handle are required");
  EPX_CHECK(EPX_CHECK_STRUCT(hc, epx_handle_config_t, epx_handle_config_init, "epx_handle_create"));
  if (hc->algo != EPX_ALGO_HT && hc->algo != EPX_ALGO_LL && hc->algo != EPX_ALGO_ALLTOALL)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "unknown algorithm %d", (int)hc->algo);
  if (hc->layout != EPX_LAYOUT_TOKEN && hc->layout != EPX_LAYOUT_EXPERT)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "unknown layout %d", (int)hc->layout);
  if (hc->align < 1) return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "align %d < 1", hc->align);
  if (hc->recv_budget < 0)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "recv_budget %lld < 0", (long long)hc->recv_budget);
  if (hc->recv_budget > 0 && (hc->algo != EPX_ALGO_HT || hc->layout != EPX_LAYOUT_EXPERT))
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "recv_budget needs the expert layout of EPX_ALGO_HT");
  if (hc->recv_budget > 0 && !comm->world->ops->recv_budget)
    return epxi_fail(EPX_ERR_UNSUPPORTED, "recv_budget: the %s backend cannot drop past a receive budget yet",
                     comm->world->ops->name);
  epx_handle_t *h = calloc(1, sizeof *h);
  if (!h) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "handle");
  h->comm = comm;
  h->id = id;
  h->hc = *hc;
  if (hc->algo == EPX_ALGO_LL) {
    h->hc.layout = EPX_LAYOUT_EXPERT;
    h->hc.align = 1;
  }
  epx_status_t s = comm->world->ops->handle_create(h);
  bool made = s == EPX_SUCCESS;
  if (s == EPX_SUCCESS) s = epxi_obj_register(h, EPXI_OBJ_HANDLE);
  if (s != EPX_SUCCESS) { /* what it took goes back */
    if (made) comm->world->ops->handle_destroy(h);
    free(h);
    return s;
  }
  atomic_fetch_add(&comm->live_handles, 1);
  *handle = h;
  return EPX_SUCCESS;
}

/* Registry locked: takes the handle's comm (as comm_enter does) and unregisters the
 * handle; its comm stays taken until the handle is gone. */
static epx_status_t retire_handle(void *obj, void *arg) {
  epx_handle_t *h = obj;
  (void)arg;
  EPX_CHECK(comm_enter(h->comm, h, "epx_handle_destroy"));
  epxi_obj_unregister(h, EPXI_OBJ_HANDLE);
  return EPX_SUCCESS;
}

epx_status_t epx_handle_destroy(epx_handle_t *handle) {
  epxi_clear_error();
  if (!handle) return EPX_SUCCESS;
  EPX_CHECK(epxi_obj_with(handle, EPXI_OBJ_HANDLE, "epx_handle_destroy", retire_handle, NULL));
  epx_comm_t *comm = handle->comm;
  if (comm->pending == handle) comm->pending = NULL;
  comm->world->ops->handle_destroy(handle);
  free(handle);
  atomic_fetch_sub(&comm->live_handles, 1);
  return comm_leave(comm, EPX_SUCCESS);
}

/* `dead`: the caller passed a pointer that is not a live handle (comm_enter_call). */
static epx_status_t check_handle(epx_comm_t *comm, const epx_handle_t *handle, bool dead, bool planned,
                                 const char *op) {
  if (dead)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: the handle is not a live epx handle (destroyed already?)", op);
  if (!handle) return epxi_fail(EPX_ERR_NULL_POINTER, "%s: handle is NULL", op);
  if (handle->comm != comm)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: the handle belongs to another comm", op);
  if (planned && !handle->planned)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: the handle has no plan yet (call epx_notify or pass a routing)", op);
  return EPX_SUCCESS;
}

/* Opens a collective call on a usable comm: numbers it and stamps it (call.c) for the
 * backend's first exchange. A handle of another comm counts as none. */
static void begin_call(epx_comm_t *comm, epxi_op_t op, const epx_handle_t *handle) {
  comm->calls++;
  comm->stamp = epxi_stamp_make(op, comm->calls, handle && handle->comm == comm ? handle : NULL);
}

/* Why a rank refuses a call: its arguments, or the handle / SEND-COMPLETE order. */
typedef enum { REFUSED_ARGS, REFUSED_HANDLE_OR_ORDER } refusal_t;

/* A rank that refuses a call still takes part in it, carrying its status, so every rank
 * fails with it at once instead of waiting out the timeout for this one. A backend that does
 * not stamp its exchanges can only do that with the call's own valid handle. */
static epx_status_t fail_collective(epx_comm_t *comm, epx_handle_t *handle, epxi_op_t op, epx_status_t bad,
                                    refusal_t why) {
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", epx_last_error());
  const epxi_backend_t *ops = comm->world->ops;
  if (ops->abort && (ops->stamped || why == REFUSED_ARGS)) {
    comm->stamp.status = (int16_t)bad;
    collective_result(comm, ops->abort(comm, handle && handle->comm == comm ? handle : NULL, op, bad));
  }
  return epxi_fail(bad, "%s", msg);
}

/* The plan itself, for epx_notify and for epx_dispatch with a routing (which then aborts
 * both operations on a failing rank, as its peers go on to dispatch). */
static epx_status_t plan(epx_comm_t *comm, epx_handle_t *handle, const epx_routing_t *routing, bool dispatch_follows) {
  handle->planned = false;
  epx_status_t bad = epxi_check_routing_form(routing);
  if (bad != EPX_SUCCESS)
    return fail_collective(comm, handle, dispatch_follows ? EPXI_OP_NOTIFY_DISPATCH : EPXI_OP_NOTIFY, bad, REFUSED_ARGS);
  handle->dispatch_follows = dispatch_follows;
  epx_status_t s = collective_result(comm, comm->world->ops->notify(comm, handle, routing));
  handle->dispatch_follows = false;
  handle->planned = s == EPX_SUCCESS;
  return s;
}

static epx_status_t notify_body(epx_comm_t *comm, epx_handle_t *handle, bool dead, const epx_routing_t *routing);

epx_status_t epx_notify(epx_comm_t *comm, epx_handle_t *handle, const epx_routing_t *routing) {
  epxi_clear_error();
  bool dead;
  EPX_CHECK(comm_enter_call(comm, handle, "epx_notify", &dead));
  return comm_leave(comm, notify_body(comm, dead ? NULL : handle, dead, routing));
}

static epx_status_t notify_body(epx_comm_t *comm, epx_handle_t *handle, bool dead, const epx_routing_t *routing) {
  EPX_CHECK(check_comm(comm, "epx_notify"));
  begin_call(comm, EPXI_OP_NOTIFY, handle);
  epx_status_t bad = check_handle(comm, handle, dead, false, "epx_notify");
  if (bad == EPX_SUCCESS) bad = check_order(comm, handle, false, EPX_PART_ALL, "epx_notify");
  if (bad != EPX_SUCCESS) return fail_collective(comm, handle, EPXI_OP_NOTIFY, bad, REFUSED_HANDLE_OR_ORDER);
  return plan(comm, handle, routing, false);
}

/* Registry locked: takes the handle's comm for the call (arg: the call's name). */
static epx_status_t enter_handle_comm(void *obj, void *arg) {
  epx_handle_t *h = obj;
  return comm_enter(h->comm, h, arg);
}

epx_status_t epxi_handle_take(const epx_handle_t *handle, const char *what) {
  return epxi_obj_with(handle, EPXI_OBJ_HANDLE, what, enter_handle_comm, (void *)what);
}

epx_status_t epxi_handle_give(const epx_handle_t *handle, epx_status_t s) { return comm_leave(handle->comm, s); }

epx_status_t epx_handle_info(const epx_handle_t *handle, epx_handle_info_t *info, int32_t *tokens_per_local_expert) {
  epxi_clear_error();
  if (!handle || !info) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_handle_info: handle and info are required");
  EPX_CHECK(epxi_handle_take(handle, "epx_handle_info"));
  epx_status_t s = check_handle(handle->comm, handle, false, true, "epx_handle_info");
  if (s == EPX_SUCCESS) {
    memset(info, 0, sizeof *info); /* fields a backend does not know stay 0 */
    s = handle->comm->world->ops->handle_info(handle, info, tokens_per_local_expert);
  }
  return epxi_handle_give(handle, s);
}

/* ---- dispatch and combine ------------------------------------------------------------- */

/* Rows that GPUs move must be whole 16-byte vectors; the host backend's float32 is exempt
 * (it is the test type and never crosses a GPU). */
epx_status_t epxi_check_row(epx_dtype_t dtype, int hidden, const char *what) {
  size_t bytes = epx_dtype_size(dtype) * (size_t)hidden;
  if (bytes % 16)
    return epxi_fail(EPX_ERR_ROW_ALIGNMENT, "%s: a row of %d %s is %zu bytes, not a multiple of 16", what, hidden,
                     epx_dtype_name(dtype), bytes);
  return EPX_SUCCESS;
}

/* ... and they must start at a 16-byte boundary: the kernels read and write them as 16-byte
 * vectors and bulk copies, which fault (and stop the device) at any other address. */
static epx_status_t check_rows_for(const epx_comm_t *comm, epx_dtype_t dtype, const void *rows, const char *what) {
  if (dtype == EPX_FLOAT32 && comm->world->backend == EPX_BACKEND_HOST) return EPX_SUCCESS;
  EPX_CHECK(epxi_check_row(dtype, comm->cfg.hidden, what));
  if ((uintptr_t)rows % 16)
    return epxi_fail(EPX_ERR_ROW_ALIGNMENT, "%s: its rows start at %p, not at a 16-byte boundary", what, rows);
  return EPX_SUCCESS;
}

static bool is_float_type(epx_dtype_t t) { return t == EPX_FLOAT32 || t == EPX_BFLOAT16; }

void epx_dispatch_args_init(epx_dispatch_args_t *args) {
  memset(args, 0, sizeof *args);
  EPX_STRUCT_HEAD(args);
  args->x_dtype = EPX_BFLOAT16;
  args->recv_dtype = EPX_BFLOAT16;
}

static epx_status_t check_dispatch_args(const epx_comm_t *comm, const epx_dispatch_args_t *args) {
  if (!args) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_dispatch: args is NULL");
  EPX_CHECK(EPX_CHECK_STRUCT(args, epx_dispatch_args_t, epx_dispatch_args_init, "epx_dispatch"));
  if (!is_float_type(args->x_dtype))
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "dispatch x_dtype must be float32 or bfloat16, not %s",
                     epx_dtype_name(args->x_dtype));
  if (args->recv_dtype != args->x_dtype && args->recv_dtype != EPX_FP8_E4M3)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "dispatch recv_dtype must be x_dtype (%s) or fp8_e4m3, not %s",
                     epx_dtype_name(args->x_dtype), epx_dtype_name(args->recv_dtype));
  EPX_CHECK(check_rows_for(comm, args->x_dtype, args->x, "dispatch x"));
  EPX_CHECK(check_rows_for(comm, args->recv_dtype, args->recv_x, "dispatch recv_x"));
  if (!args->recv_x) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_dispatch: recv_x is NULL");
  if (args->recv_dtype == EPX_FP8_E4M3 && !args->recv_scales)
    return epxi_fail(EPX_ERR_NULL_POINTER, "epx_dispatch: fp8 needs recv_scales");
  if (args->recv_capacity < 0)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "recv_capacity %lld < 0", (long long)args->recv_capacity);
  if (args->part < EPX_PART_ALL || args->part > EPX_PART_COMPLETE)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "dispatch part %d is not an epx_part_t", (int)args->part);
  return EPX_SUCCESS;
}

static epx_status_t dispatch_body(epx_comm_t *comm, epx_handle_t *handle, bool dead, const epx_routing_t *routing,
                                  const epx_dispatch_args_t *args);

epx_status_t epx_dispatch(epx_comm_t *comm, epx_handle_t *handle, const epx_routing_t *routing,
                          const epx_dispatch_args_t *args) {
  epxi_clear_error();
  bool dead;
  EPX_CHECK(comm_enter_call(comm, handle, "epx_dispatch", &dead));
  return comm_leave(comm, dispatch_body(comm, dead ? NULL : handle, dead, routing, args));
}

static epx_status_t dispatch_body(epx_comm_t *comm, epx_handle_t *handle, bool dead, const epx_routing_t *routing,
                                  const epx_dispatch_args_t *args) {
  EPX_CHECK(check_comm(comm, "epx_dispatch"));
  const epx_part_t part = args ? args->part : EPX_PART_ALL;
  const epxi_op_t op = routing && part != EPX_PART_COMPLETE ? EPXI_OP_NOTIFY_DISPATCH : EPXI_OP_DISPATCH;
  begin_call(comm, op, handle);
  epxi_stamp_dispatch(&comm->stamp, args);
  /* other parts check the struct with the rest of the arguments; a refusal still takes part */
  epx_status_t refused = part == EPX_PART_COMPLETE
                             ? EPX_CHECK_STRUCT(args, epx_dispatch_args_t, epx_dispatch_args_init, "epx_dispatch")
                             : EPX_SUCCESS;
  if (refused == EPX_SUCCESS) refused = check_handle(comm, handle, dead, false, "epx_dispatch");
  if (refused == EPX_SUCCESS) refused = check_order(comm, handle, false, part, "epx_dispatch");
  if (refused != EPX_SUCCESS) return fail_collective(comm, handle, op, refused, REFUSED_HANDLE_OR_ORDER);
  if (part == EPX_PART_COMPLETE) { /* reuses what its SEND was given */
    if (routing) {
      /* taking part, it ends its SEND as the peers' COMPLETE ends theirs */
      if (comm->world->ops->stamped) comm->pending = NULL;
      return fail_collective(comm, handle, op,
                             epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                                       "epx_dispatch: the COMPLETE half takes no routing (SEND planned)"),
                             REFUSED_HANDLE_OR_ORDER);
    }
    return track_order(comm, handle, false, part, collective_result(comm, comm->world->ops->dispatch(comm, handle, args)));
  }
  epx_status_t bad = check_dispatch_args(comm, args);
  if (bad == EPX_SUCCESS && !routing && !handle->planned)
    bad = epxi_fail(EPX_ERR_INVALID_ARGUMENT, "epx_dispatch: the handle has no plan yet (call epx_notify or pass a routing)");
  if (bad == EPX_SUCCESS && routing) bad = epxi_check_routing_form(routing);
  if (bad != EPX_SUCCESS) {
    if (routing) handle->planned = false;
    return fail_collective(comm, handle, op, bad, REFUSED_ARGS);
  }
  if (routing) EPX_CHECK(plan(comm, handle, routing, true));
  return track_order(comm, handle, false, part, collective_result(comm, comm->world->ops->dispatch(comm, handle, args)));
}

void epx_combine_args_init(epx_combine_args_t *args) {
  memset(args, 0, sizeof *args);
  EPX_STRUCT_HEAD(args);
  args->y_dtype = EPX_BFLOAT16;
  args->out_dtype = EPX_BFLOAT16;
  args->weighted = 1;
}

static epx_status_t check_combine_args(const epx_comm_t *comm, const epx_combine_args_t *args) {
  if (!args) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_combine: args is NULL");
  EPX_CHECK(EPX_CHECK_STRUCT(args, epx_combine_args_t, epx_combine_args_init, "epx_combine"));
  if (!is_float_type(args->y_dtype) || !is_float_type(args->out_dtype))
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "combine y_dtype and out_dtype must be float32 or bfloat16 (got %s, %s)",
                     epx_dtype_name(args->y_dtype), epx_dtype_name(args->out_dtype));
  EPX_CHECK(check_rows_for(comm, args->y_dtype, args->y, "combine y"));
  EPX_CHECK(check_rows_for(comm, args->out_dtype, args->out, "combine out"));
  if (!args->row_weight_grad != !args->topk_weight_grad)
    return epxi_fail(EPX_ERR_NULL_POINTER, "epx_combine: row_weight_grad and topk_weight_grad go together");
  if (args->part < EPX_PART_ALL || args->part > EPX_PART_COMPLETE)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "combine part %d is not an epx_part_t", (int)args->part);
  return EPX_SUCCESS;
}

static epx_status_t combine_body(epx_comm_t *comm, epx_handle_t *handle, bool dead, const epx_combine_args_t *args);

epx_status_t epx_combine(epx_comm_t *comm, epx_handle_t *handle, const epx_combine_args_t *args) {
  epxi_clear_error();
  bool dead;
  EPX_CHECK(comm_enter_call(comm, handle, "epx_combine", &dead));
  return comm_leave(comm, combine_body(comm, dead ? NULL : handle, dead, args));
}

static epx_status_t combine_body(epx_comm_t *comm, epx_handle_t *handle, bool dead, const epx_combine_args_t *args) {
  EPX_CHECK(check_comm(comm, "epx_combine"));
  const epx_part_t part = args ? args->part : EPX_PART_ALL;
  begin_call(comm, EPXI_OP_COMBINE, handle);
  epxi_stamp_combine(&comm->stamp, args);
  /* other parts check the struct with the rest of the arguments; a refusal still takes part */
  epx_status_t refused = part == EPX_PART_COMPLETE
                             ? EPX_CHECK_STRUCT(args, epx_combine_args_t, epx_combine_args_init, "epx_combine")
                             : EPX_SUCCESS;
  if (refused == EPX_SUCCESS) refused = check_handle(comm, handle, dead, false, "epx_combine");
  if (refused == EPX_SUCCESS) refused = check_order(comm, handle, true, part, "epx_combine");
  if (refused != EPX_SUCCESS) return fail_collective(comm, handle, EPXI_OP_COMBINE, refused, REFUSED_HANDLE_OR_ORDER);
  if (part == EPX_PART_COMPLETE) /* reuses what its SEND was given */
    return track_order(comm, handle, true, part, collective_result(comm, comm->world->ops->combine(comm, handle, args)));
  epx_status_t bad = check_combine_args(comm, args);
  if (bad == EPX_SUCCESS && !handle->planned)
    bad = epxi_fail(EPX_ERR_INVALID_ARGUMENT, "epx_combine: the handle has no plan yet (call epx_notify or dispatch)");
  if (bad != EPX_SUCCESS) return fail_collective(comm, handle, EPXI_OP_COMBINE, bad, REFUSED_ARGS);
  return track_order(comm, handle, true, part, collective_result(comm, comm->world->ops->combine(comm, handle, args)));
}

/* ---- running ranks on threads --------------------------------------------------------- */

typedef struct {
  epx_rank_fn fn;
  void *arg;
  int rank;
  epx_status_t status;
} rank_thread_t;

static void *rank_main(void *p) {
  rank_thread_t *t = p;
  t->status = t->fn(t->rank, t->arg);
  return NULL;
}

epx_status_t epx_run_ranks(int nranks, epx_rank_fn fn, void *arg, epx_status_t *statuses) {
  epxi_clear_error();
  if (!fn) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_run_ranks: fn is NULL");
  if (nranks < 1 || nranks > EPX_MAX_RANKS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "nranks %d outside [1, %d]", nranks, EPX_MAX_RANKS);
  rank_thread_t ts[EPX_MAX_RANKS];
  pthread_t tids[EPX_MAX_RANKS];
  int started = 0;
  epx_status_t first = EPX_SUCCESS;
  for (int r = 0; r < nranks; r++) ts[r] = (rank_thread_t){fn, arg, r, EPX_ERR_SYSTEM};
  for (; started < nranks; started++)
    if (pthread_create(&tids[started], NULL, rank_main, &ts[started]) != 0) {
      epxi_fail(EPX_ERR_SYSTEM, "could not start the thread of rank %d", started);
      break;
    }
  for (int r = 0; r < started; r++) pthread_join(tids[r], NULL);
  for (int r = 0; r < nranks; r++) {
    if (statuses) statuses[r] = ts[r].status;
    if (first == EPX_SUCCESS && ts[r].status != EPX_SUCCESS) first = ts[r].status;
  }
  return first;
}
