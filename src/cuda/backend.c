/* The CUDA backend's host side: memory, streams, the peer table, and the order of launches
 * that makes each operation. Thin on purpose: all data movement is in the kernels.
 *
 * Every operation is enqueued on the comm's stream and returns without waiting, except where
 * the caller asked for exact sizes (the handle's `exact`): then notify waits for the counts.
 * Allocations after set-up are stream-ordered, from the world's own pools (connect_devices), so
 * growing a buffer never synchronises the device nor waits on another stream while a peer's
 * kernel waits on this rank.
 *
 * Across processes (one rank per process, epx_world_create_rank*), a peer can only reach
 * memory it mapped, once, at comm init: so each rank makes one arena (cudaMalloc, exported
 * with CUDA IPC) and carves from it everything a peer reads: its state, plans, the buffers
 * peers pull from, and copies of the caller's rows they would otherwise read in place (x for
 * a dispatch, y and row weight gradients for a combine: one extra local copy). The kernels
 * translate a peer's addresses by where this process mapped its arena (epxc_group_t.delta).
 * The error words live in the group's shared page, registered with CUDA, so every rank and
 * every GPU sees a failure at once. */
#include <cuda_runtime_api.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"
#include "cuda/cuda_shared.h"

typedef struct {
  epxc_error_t *errors_host; /* [R], host-mapped */
  epxc_error_t *errors_dev;
  bool shared;               /* across processes: errors_host is the group's shared page, registered */
  int num_devices;
  cudaMemPool_t *pools;      /* [num_devices]: epx's stream-ordered memory on the devices of this
                                process's ranks (see connect_devices), NULL elsewhere */
} cuda_world_t;

typedef struct {
  int device;
  cudaMemPool_t pool;       /* the world's pool of this device */
  cudaStream_t own_stream;
  cudaStream_t last_stream; /* where the previous operation went */
  cudaEvent_t order;        /* orders an operation after the previous one when the stream changes */
  epxc_state_t *state;
  epxc_group_t group;
  epxc_shape_t shape;
  /* across processes: this rank's arena (carved by `heap`, the state included), exported to
   * the peers, and the peers' arenas as mapped here; arena is NULL in one process */
  char *arena;
  size_t arena_bytes;
  epxi_suballoc_t heap;
  void *mapped[EPX_MAX_RANKS];
} cuda_comm_t;

/* What the host learns of a plan in exact mode. */
typedef struct {
  int32_t status, group_status;
  uint64_t bad_key;
  int64_t num_tokens, num_recv, num_rows, num_pairs, sent_copies;
} plan_summary_t;

typedef struct {
  epxc_plan_t *dev;        /* the device struct */
  epxc_plan_t host;        /* its pointers and strides, as uploaded */
  int64_t token_cap;       /* tokens the send-side buffers hold */
  void *partials;          /* combine's per-token partials */
  size_t partial_bytes;
  int64_t recv_capacity;   /* last dispatch's, sizes the partials in sync-free mode */
  int64_t num_tokens;      /* T of the last plan, as the host knows it */
  epxc_a2a_t a2a;          /* all-to-all baseline buffers */
  size_t a2a_send_bytes, a2a_stage_bytes;
  void *a2a_back;            /* all-to-all combine: rows pulled back */
  size_t a2a_back_bytes;
  void *ipc_x;               /* across processes: dispatch's x, copied where peers reach it */
  size_t ipc_x_bytes;
  float *ipc_wgrad;          /* across processes: combine's row weight gradients, likewise */
  size_t ipc_wgrad_bytes;
  /* low-latency: the device state, the host's copy of its pointers, and the routing that
   * epx_notify recorded for the next dispatch (planning happens inside that dispatch) */
  epxc_ll_t *ll_dev;
  epxc_ll_t ll;
  epxc_plan_t ll_plan[2];
  epx_routing_t ll_route;
  bool ll_route_pending, ll_dispatched;
  epxc_dispatch_t ll_send_dispatch; /* what a SEND half passed: its COMPLETE uses the same */
  epxc_combine_t ll_send_combine;
  plan_summary_t *summary;   /* exact mode's copy of the counts */
  int32_t *pairs_local_host; /* [L] */
  bool known;              /* summary holds this plan (exact mode) */
  bool captured;           /* a CUDA graph holds this handle's buffers: they may not move */
} cuda_handle_t;

static const char *const phase_names[EPXC_PH_COUNT] = {
    [EPXC_PH_NOTIFY] = "notify",       [EPXC_PH_NOTIFY_DONE] = "notify (closing)",
    [EPXC_PH_DISPATCH] = "dispatch",   [EPXC_PH_DISPATCH_DONE] = "dispatch (closing)",
    [EPXC_PH_COMBINE] = "combine",     [EPXC_PH_COMBINE_DONE] = "combine (closing)",
    [EPXC_PH_LL_DISPATCH] = "low-latency dispatch", [EPXC_PH_LL_COMBINE] = "low-latency combine",
    [EPXC_PH_LAYOUT] = "layout",
};

static bool fatal_status(int s) { return s == EPX_ERR_TIMEOUT || s == EPX_ERR_BROKEN || s == EPX_ERR_PEER_LOST; }

static epx_status_t cuda_fail(cudaError_t e, const char *what) {
  return epxi_fail(EPX_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CUDA_TRY(call, what)                       \
  do {                                             \
    cudaError_t e_ = (call);                       \
    if (e_ != cudaSuccess) return cuda_fail(e_, what); \
  } while (0)

#define LAUNCH_TRY(call, what) CUDA_TRY((cudaError_t)(call), what)

/* Kernels of the ranks sharing a GPU wait on each other, so no rank's stream may queue behind
 * another's in one hardware queue: ask for as many queues as CUDA has (the default is 8). This
 * only takes effect before CUDA starts in this process; a framework that starts CUDA first
 * should set the variable itself. */
epx_status_t epxi_cuda_available(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  /* Lazy module loading can make a first launch wait for the device to go idle: with ranks'
   * kernels waiting on each other that is a deadlock until the timeout. Same caveat. */
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    return epxi_fail(EPX_ERR_UNSUPPORTED, "no CUDA device is available (%s)",
                     e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  return EPX_SUCCESS;
}

static cuda_comm_t *CC(const epx_comm_t *c) { return (cuda_comm_t *)c->impl; }
static cuda_handle_t *ch_of(const epx_handle_t *h) { return (cuda_handle_t *)h->impl; }
static bool capturing(cudaStream_t st) {
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(st, &cs);
  return cs != cudaStreamCaptureStatusNone;
}

static cudaStream_t stream_of(const epx_comm_t *c) {
  return c->stream ? (cudaStream_t)c->stream : CC(c)->own_stream;
}

/* The stream of an operation, ordered after the previous operation of this comm even when
 * the caller moved the comm to another stream in between. */
static cudaStream_t op_stream(const epx_comm_t *c) {
  cuda_comm_t *cc = CC(c);
  cudaStream_t st = stream_of(c);
  /* a stream being captured cannot wait on work outside the capture: there the caller orders */
  if (cc->last_stream && cc->last_stream != st && !capturing(st)) {
    cudaEventRecord(cc->order, cc->last_stream);
    cudaStreamWaitEvent(st, cc->order, 0);
  }
  cc->last_stream = st;
  return st;
}

/* ---- world ------------------------------------------------------------------------------ */

/* Across processes this world drives one rank of the group: everything about peers then goes
 * through IPC (comm init), and the error words through the group's shared page. */
static bool cross_process(const epx_world_t *w) { return w->num_local < w->nranks; }

static void free_pools(cuda_world_t *cw) {
  for (int d = 0; cw->pools && d < cw->num_devices; d++)
    if (cw->pools[d]) cudaMemPoolDestroy(cw->pools[d]); /* released once its last block is freed */
  free(cw->pools);
  cw->pools = NULL;
}

static void world_free(cuda_world_t *cw) {
  free_pools(cw);
  free(cw);
}

/* The devices of this process's ranks. epx's stream-ordered memory (plans, partials, staging)
 * comes from pools of its own, one per device, rather than the device's default pool, which
 * may let an allocation on one stream reuse a block freed on another by making the first
 * stream wait for the second (cudaMemPoolReuseAllowInternalDependencies). Between ranks whose
 * kernels wait on each other such a wait is a deadlock: the pools here never add one. Like the
 * default pool they give freed memory back at synchronisations (release threshold 0), so what
 * a broken comm keeps (its state) holds only its own block. Ranks of this process on
 * different GPUs read each other's memory directly, buffers and pools alike (a peer in another
 * process is reached through its IPC mapping, which enables what it needs). */
static epx_status_t connect_devices(const epx_world_t *w, cuda_world_t *cw, int count) {
  cw->num_devices = count;
  cw->pools = calloc((size_t)count, sizeof *cw->pools);
  if (!cw->pools) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda world pools");
  const int lo = w->first_rank, hi = w->first_rank + w->num_local;
  for (int r = lo; r < hi; r++) {
    const int d = w->devices[r];
    if (cw->pools[d]) continue;
    struct cudaMemPoolProps props = {.allocType = cudaMemAllocationTypePinned,
                                     .location = {.type = cudaMemLocationTypeDevice, .id = d}};
    CUDA_TRY(cudaMemPoolCreate(&cw->pools[d], &props), "cudaMemPoolCreate");
    int no = 0;
    CUDA_TRY(cudaMemPoolSetAttribute(cw->pools[d], cudaMemPoolReuseAllowInternalDependencies, &no),
             "cudaMemPoolSetAttribute (internal dependencies)");
  }
  for (int a = lo; a < hi; a++)
    for (int b = lo; b < hi; b++) {
      const int da = w->devices[a], db = w->devices[b];
      int ok = 0;
      if (da == db) continue;
      CUDA_TRY(cudaDeviceCanAccessPeer(&ok, da, db), "cudaDeviceCanAccessPeer");
      if (!ok) return epxi_fail(EPX_ERR_UNSUPPORTED, "device %d cannot access device %d's memory (no P2P)", da, db);
      CUDA_TRY(cudaSetDevice(da), "cudaSetDevice");
      cudaError_t e = cudaDeviceEnablePeerAccess(db, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) return cuda_fail(e, "cudaDeviceEnablePeerAccess");
      cudaGetLastError();
      struct cudaMemAccessDesc access = {.location = {.type = cudaMemLocationTypeDevice, .id = da},
                                         .flags = cudaMemAccessFlagsProtReadWrite};
      CUDA_TRY(cudaMemPoolSetAccess(cw->pools[db], &access, 1), "cudaMemPoolSetAccess");
    }
  CUDA_TRY(cudaSetDevice(w->devices[lo]), "cudaSetDevice");
  return EPX_SUCCESS;
}

static epx_status_t cuda_world_create(epx_world_t *w) {
  int count = 0;
  CUDA_TRY(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (int r = 0; r < w->nranks; r++) {
    if (w->devices[r] < 0) w->devices[r] = r % count;
    if (w->devices[r] >= count)
      return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: device %d, but %d are visible", r, w->devices[r], count);
  }
  cuda_world_t *cw = calloc(1, sizeof *cw);
  if (!cw) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda world");
  epx_status_t ps = connect_devices(w, cw, count);
  if (ps != EPX_SUCCESS) {
    world_free(cw);
    return ps;
  }
  const size_t need = sizeof(epxc_error_t) * w->nranks;
  cudaError_t e;
  if (cross_process(w)) {
    /* The peers' kernels and hosts must see this rank's failure: one page all processes map,
     * pinned and mapped into this process's device address space. */
    size_t bytes = 0;
    cw->errors_host = epxi_group_common(w->group, &bytes);
    if (!cw->errors_host || bytes < need) {
      const bool mapped = cw->errors_host != NULL;
      world_free(cw);
      if (!mapped) return EPX_ERR_SYSTEM; /* the group said why */
      return epxi_fail(EPX_ERR_INTERNAL, "the group's common page holds %zu bytes, the error words need %zu", bytes,
                       need);
    }
    e = cudaHostRegister(cw->errors_host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      world_free(cw);
      return cuda_fail(e, "cudaHostRegister (the group's error words)");
    }
    cw->shared = true;
  } else {
    e = cudaHostAlloc((void **)&cw->errors_host, need, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      world_free(cw);
      return cuda_fail(e, "cudaHostAlloc (error words)");
    }
    memset(cw->errors_host, 0, need);
  }
  e = cudaHostGetDevicePointer((void **)&cw->errors_dev, cw->errors_host, 0);
  if (e != cudaSuccess) {
    if (cw->shared)
      cudaHostUnregister(cw->errors_host);
    else
      cudaFreeHost(cw->errors_host);
    world_free(cw);
    return cuda_fail(e, "cudaHostGetDevicePointer");
  }
  w->impl = cw;
  return EPX_SUCCESS;
}

static void cuda_world_destroy(epx_world_t *w) {
  cuda_world_t *cw = w->impl;
  if (!cw) return;
  if (cw->shared)
    cudaHostUnregister(cw->errors_host); /* the page itself goes with the group */
  else
    cudaFreeHost(cw->errors_host);
  world_free(cw);
}

/* ---- across processes: the arena ------------------------------------------------------------ */

static size_t round256(size_t n) { return (n + 255) / 256 * 256; }

/* The arena's default size: two handles' worth of everything a peer may read, each buffer at
 * its largest for T = max(max_tokens_per_rank, 32) tokens on every rank, rows in float32 (the
 * widest type); the README gives the formula. EPX_IPC_ARENA_MB sets it instead. */
static size_t ipc_arena_bytes(const epx_comm_t *c) {
  if (epxi_env()->ipc_arena_mb) return (size_t)epxi_env()->ipc_arena_mb << 20;
  const size_t T = c->cfg.max_tokens_per_rank > 32 ? (size_t)c->cfg.max_tokens_per_rank : 32;
  const size_t R = c->nranks, E = c->cfg.num_experts, K = c->cfg.topk, H = c->cfg.hidden, L = c->num_local_experts;
  const size_t B = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK, W = (T + 31) / 32;
  /* one plan: struct, routing, bitmaps and prefixes, counts and bases, each rounded up */
  const size_t plan = sizeof(epxc_plan_t) + 8 * T * K + 8 * (R + E) * W + 4 * (R + E) + 8 * L * R + 12 * L + 8 * E +
                      16 * 256;
  /* high-throughput or all-to-all: x, the combine rows and weight gradients, the send buffer */
  const size_t ht = plan + 4 * T * H + 4 * R * T * (H + K) + T * K * (4 * H + 4 * B + 8);
  /* low-latency: its own plan and two of everything else */
  const size_t ll = plan + 2 * (plan + 4 * T * (H + B) + 4 * R * T * H + 4 * L * R * T);
  const size_t bytes = round256(sizeof(epxc_state_t)) + 2 * (ht > ll ? ht : ll);
  const size_t floor = (size_t)64 << 20;
  return bytes > floor ? bytes : floor;
}

static bool in_arena(const cuda_comm_t *cc, const void *p) {
  return cc->arena && (const char *)p >= cc->arena && (const char *)p < cc->arena + cc->arena_bytes;
}

/* Memory peers read (`peers`): carved from the arena across processes, stream-ordered pool
 * memory otherwise (and for what only this rank reads). */
static epx_status_t dev_alloc(cuda_comm_t *cc, bool peers, void **p, size_t bytes, cudaStream_t st, const char *what) {
  *p = NULL;
  if (!peers || !cc->arena) {
    CUDA_TRY(cudaMallocFromPoolAsync(p, bytes ? bytes : 16, cc->pool, st), what);
    return EPX_SUCCESS;
  }
  const size_t off = epxi_suballoc_alloc(&cc->heap, bytes);
  if (off == EPXI_SUBALLOC_FULL)
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY,
                     "%s: %zu bytes do not fit in the cross-process arena (%zu of %zu MiB in use; set "
                     "EPX_IPC_ARENA_MB, or a max_tokens_per_rank that covers the shapes you run)",
                     what, bytes, cc->heap.in_use >> 20, cc->arena_bytes >> 20);
  *p = cc->arena + off;
  return EPX_SUCCESS;
}

/* Arena memory is reused at once, by work this rank orders after what used it (cc's streams
 * are chained by op_stream; handle_destroy waits for them). */
static void dev_free(cuda_comm_t *cc, void *p, cudaStream_t st) {
  if (!p) return;
  if (in_arena(cc, p))
    epxi_suballoc_free(&cc->heap, (size_t)((char *)p - cc->arena));
  else
    cudaFreeAsync(p, st);
}

/* What a rank tells the others about its arena: addresses in its process. */
typedef struct {
  cudaIpcMemHandle_t handle;
  uint64_t base, state;
  int32_t status, pad;
} ipc_card_t;

/* Unmaps the peers' arenas and frees this rank's. With `meet`, the ranks first wait for each
 * other (bounded), so that no arena is freed while a peer still maps it, which CUDA leaves
 * undefined. A broken group has nobody to meet: the arena goes anyway, as it would if the
 * process exited. */
static void ipc_close(epx_comm_t *c, cuda_comm_t *cc, bool meet) {
  for (int r = 0; r < c->nranks; r++)
    if (cc->mapped[r]) {
      cudaIpcCloseMemHandle(cc->mapped[r]);
      cc->mapped[r] = NULL;
    }
  if (meet && !epxi_group_broken(c->world->group) &&
      epxi_group_barrier(c->world->group, c->rank, "ipc teardown", c->cfg.timeout_ms) != EPX_SUCCESS)
    EPX_WARN("rank %d: freeing its cross-process arena without meeting the peers: %s", c->rank, epx_last_error());
  if (cc->arena) cudaFree(cc->arena);
  cc->arena = NULL;
  cc->state = NULL;
  epxi_suballoc_destroy(&cc->heap);
}

/* The first rank whose entry of `status` (stride bytes apart) is a failure, or -1. */
static int first_failed(const void *status, size_t stride, int n) {
  for (int r = 0; r < n; r++)
    if (*(const int32_t *)((const char *)status + r * stride) != EPX_SUCCESS) return r;
  return -1;
}

/* Across processes, collective: this rank's arena made (its state in it) and exported, every
 * peer's opened, the peer table filled. Every rank succeeds or every rank fails, and a
 * failure leaves nothing behind. */
static epx_status_t ipc_open(epx_comm_t *c, cuda_comm_t *cc) {
  epxi_group_t *grp = c->world->group;
  const int R = c->nranks, me = c->rank;
  ipc_card_t mine, cards[EPX_MAX_RANKS];
  memset(&mine, 0, sizeof mine);
  char why[1024] = "";
  epx_status_t s = EPX_SUCCESS;
  const size_t bytes = ipc_arena_bytes(c);
  cudaError_t e = cudaMalloc((void **)&cc->arena, bytes);
  if (e != cudaSuccess) {
    cc->arena = NULL;
    cudaGetLastError();
    s = epxi_fail(e == cudaErrorMemoryAllocation ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_CUDA,
                  "rank %d: its cross-process arena of %zu MiB: %s (EPX_IPC_ARENA_MB sets the size)", me, bytes >> 20,
                  cudaGetErrorString(e));
  }
  if (s == EPX_SUCCESS) {
    cc->arena_bytes = bytes;
    if (epxi_suballoc_init(&cc->heap, bytes, 256) != 0)
      s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "rank %d: cross-process arena bookkeeping", me);
  }
  if (s == EPX_SUCCESS) s = dev_alloc(cc, true, (void **)&cc->state, sizeof(epxc_state_t), cc->own_stream, "comm state");
  if (s == EPX_SUCCESS) {
    e = cudaMemsetAsync(cc->state, 0, sizeof(epxc_state_t), cc->own_stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cc->own_stream);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&mine.handle, cc->arena);
    if (e != cudaSuccess) s = cuda_fail(e, "exporting the cross-process arena (cudaIpcGetMemHandle)");
  }
  mine.status = s;
  mine.base = (uint64_t)(uintptr_t)cc->arena;
  mine.state = (uint64_t)(uintptr_t)cc->state;
  if (s != EPX_SUCCESS) snprintf(why, sizeof why, "%s", epx_last_error());
  epx_status_t x = epxi_group_allgather(grp, me, "comm_init:ipc", c->cfg.timeout_ms, &mine, sizeof mine, cards);
  int bad = x == EPX_SUCCESS ? first_failed(&cards[0].status, sizeof *cards, R) : -1;
  if (x != EPX_SUCCESS || bad >= 0) { /* nobody has mapped anything yet */
    ipc_close(c, cc, false);
    if (s != EPX_SUCCESS) return epxi_fail(s, "%s", why);
    if (x != EPX_SUCCESS) return x;
    return epxi_fail((epx_status_t)cards[bad].status, "rank %d: rank %d could not make its cross-process arena (%s)",
                     me, bad, epx_status_string((epx_status_t)cards[bad].status));
  }

  for (int r = 0; r < R && s == EPX_SUCCESS; r++) {
    if (r == me) {
      cc->group.state[r] = cc->state;
      cc->group.delta[r] = 0;
      continue;
    }
    /* the same GPU or a peer one: the lazy flag enables peer access as the mapping needs */
    e = cudaIpcOpenMemHandle(&cc->mapped[r], cards[r].handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cc->mapped[r] = NULL;
      cudaGetLastError();
      s = epxi_fail(EPX_ERR_CUDA, "rank %d: could not map rank %d's cross-process arena (cudaIpcOpenMemHandle: %s)",
                    me, r, cudaGetErrorString(e));
      snprintf(why, sizeof why, "%s", epx_last_error());
      break;
    }
    cc->group.delta[r] = (int64_t)((uint64_t)(uintptr_t)cc->mapped[r] - cards[r].base);
    cc->group.state[r] = (epxc_state_t *)(uintptr_t)(cards[r].state + (uint64_t)cc->group.delta[r]);
  }
  int32_t vote = s, votes[EPX_MAX_RANKS];
  x = epxi_group_allgather(grp, me, "comm_init:ipc mapped", c->cfg.timeout_ms, &vote, sizeof vote, votes);
  bad = x == EPX_SUCCESS ? first_failed(votes, sizeof *votes, R) : -1;
  if (x != EPX_SUCCESS || bad >= 0) {
    ipc_close(c, cc, x == EPX_SUCCESS); /* every rank saw the same votes: all meet */
    if (s != EPX_SUCCESS) return epxi_fail(s, "%s", why);
    if (x != EPX_SUCCESS) return x;
    return epxi_fail((epx_status_t)votes[bad], "rank %d: rank %d could not map the peers' arenas (%s)", me, bad,
                     epx_status_string((epx_status_t)votes[bad]));
  }
  return EPX_SUCCESS;
}

/* ---- across processes: lost peers ------------------------------------------------------------ */

/* A peer whose process is gone (or that left) never posts again: say so in its error word,
 * which every device wait on it checks, so every rank's kernels stop now rather than at the
 * timeout. Its own process can no longer write that word. */
static void mark_lost_peers(const epx_comm_t *c) {
  cuda_world_t *cw = c->world->impl;
  for (int r = 0; r < c->nranks; r++) {
    if (r == c->rank || !epxi_group_peer_lost(c->world->group, r)) continue;
    volatile epxc_error_t *e = &cw->errors_host[r];
    if (fatal_status(e->status)) continue;
    e->phase = -1;
    e->peer = r;
    e->detail = 0;
    atomic_thread_fence(memory_order_seq_cst);
    e->status = EPX_ERR_PEER_LOST;
  }
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Waits for the stream's work. Across processes it polls (busily at first: most waits are
 * short), looking for lost peers every millisecond meanwhile. */
static cudaError_t wait_stream(const epx_comm_t *c, cudaStream_t st) {
  if (!((cuda_world_t *)c->world->impl)->shared) return cudaStreamSynchronize(st);
  const int64_t start = now_ns();
  for (int64_t checked = start;;) {
    const cudaError_t e = cudaStreamQuery(st);
    if (e != cudaErrorNotReady) return e;
    const int64_t now = now_ns();
    if (now - checked >= 1000000) {
      mark_lost_peers(c);
      checked = now;
    }
    if (now - start > 200000) {
      const struct timespec nap = {0, 50000L};
      nanosleep(&nap, NULL);
    }
  }
}

/* ---- comm ------------------------------------------------------------------------------- */

static void comm_free(cuda_comm_t *cc) {
  if (cc->order) cudaEventDestroy(cc->order);
  if (cc->own_stream) cudaStreamDestroy(cc->own_stream);
  free(cc);
}

static epx_status_t cuda_comm_init(epx_comm_t *c) {
  epx_world_t *w = c->world;
  cuda_world_t *cw = w->impl;
  const int dev = w->devices[c->rank];
  struct cudaDeviceProp prop;
  CUDA_TRY(cudaSetDevice(dev), "cudaSetDevice");
  CUDA_TRY(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  /* The ranks' exchanges wait on each other: every rank's kernels must fit on the GPU at once.
   * Ranks in other processes run in contexts of their own, which the driver time-slices. */
  int sharing = 0;
  for (int r = w->first_rank; r < w->first_rank + w->num_local; r++) sharing += w->devices[r] == dev;
  if (sharing * c->cfg.num_sms > prop.multiProcessorCount)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "num_sms %d x %d ranks on device %d needs %d SMs, the GPU has %d: the ranks could not run "
                     "at once",
                     c->cfg.num_sms, sharing, dev, sharing * c->cfg.num_sms, prop.multiProcessorCount);
  /* Every kernel loaded before any rank can launch one (the allgather below is a barrier). */
  size_t stack = 0, limit = 0;
  cudaError_t pe = (cudaError_t)epxc_preload_exchange(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_layout(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_ht(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_a2a(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_ll(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_stage(&stack);
  if (pe != cudaSuccess) return cuda_fail(pe, "loading the kernels");
  /* A launch needing more stack than the limit first grows it, which waits for the device to
   * go idle: a deadlock (until the timeout) while a peer's kernel spins on this rank. Grow it
   * now, before any kernel of this group runs. */
  CUDA_TRY(cudaDeviceGetLimit(&limit, cudaLimitStackSize), "cudaDeviceGetLimit");
  if (stack > limit) CUDA_TRY(cudaDeviceSetLimit(cudaLimitStackSize, stack), "cudaDeviceSetLimit (stack)");
  cuda_comm_t *cc = calloc(1, sizeof *cc);
  if (!cc) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda comm");
  cc->device = dev;
  cc->pool = cw->pools[dev];
  /* one stream per rank: each stream made takes a hardware queue (see epxi_cuda_available) */
  cudaError_t e = cudaStreamCreateWithFlags(&cc->own_stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&cc->order, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    comm_free(cc);
    return cuda_fail(e, "comm stream");
  }
  cw->errors_host[c->rank] = (epxc_error_t){0};
  cc->group.rank = c->rank;
  cc->group.nranks = c->nranks;
  cc->group.errors = cw->errors_dev;
  cc->group.timeout_ns = (uint64_t)c->cfg.timeout_ms * 1000000ull;
  if (cross_process(w)) {
    epx_status_t s = ipc_open(c, cc);
    if (s != EPX_SUCCESS) {
      comm_free(cc);
      return s;
    }
  } else {
    /* Stream-ordered, like every allocation after set-up: another group on this GPU may have
     * kernels waiting that a device-wide sync would stall. */
    e = cudaMallocFromPoolAsync((void **)&cc->state, sizeof(epxc_state_t), cc->pool, cc->own_stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(cc->state, 0, sizeof(epxc_state_t), cc->own_stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cc->own_stream);
    if (e != cudaSuccess) {
      comm_free(cc);
      return cuda_fail(e, "comm state");
    }
    void *states[EPX_MAX_RANKS];
    epx_status_t s = epxi_group_allgather(w->group, c->rank, "comm_init:cuda", c->cfg.timeout_ms, &cc->state,
                                          sizeof(void *), states);
    if (s != EPX_SUCCESS) { /* a peer may have the state already: keep it (a few KB) */
      comm_free(cc);
      return s;
    }
    for (int r = 0; r < c->nranks; r++) cc->group.state[r] = states[r];
  }
  cc->shape = (epxc_shape_t){.nranks = c->nranks, .rank = c->rank, .num_experts = c->cfg.num_experts,
                             .num_local = c->num_local_experts, .topk = c->cfg.topk, .hidden = c->cfg.hidden,
                             .align = 1, .max_tokens = c->cfg.max_tokens_per_rank, .num_sms = c->cfg.num_sms};
  c->impl = cc;
  return EPX_SUCCESS;
}

/* After a healthy run every post to this rank was consumed by one of its own exchanges, so
 * its state can go. After a failure a late peer may still post to it: in one process it is
 * then kept (a few KB), so no new comm gets that memory; across processes the arena goes
 * (see ipc_close). */
static void cuda_comm_destroy(epx_comm_t *c) {
  cuda_comm_t *cc = CC(c);
  if (!cc) return;
  cudaSetDevice(cc->device);
  cudaStream_t st = stream_of(c);
  wait_stream(c, st);
  if (cc->arena) {
    if (cc->last_stream && cc->last_stream != st) wait_stream(c, cc->last_stream);
    ipc_close(c, cc, true);
  } else {
    const int status = ((volatile epxc_error_t *)((cuda_world_t *)c->world->impl)->errors_host)[c->rank].status;
    if (!c->broken && !fatal_status(status)) {
      cudaFreeAsync(cc->state, st);
      cudaStreamSynchronize(st);
    }
  }
  comm_free(cc);
}

/* Turns this rank's error word into a status and message. Fatal ones only, unless `all`. */
static epx_status_t report(epx_comm_t *c, bool all) {
  cuda_world_t *cw = c->world->impl;
  volatile epxc_error_t *e = &cw->errors_host[c->rank];
  int status = e->status;
  if (!status) return EPX_SUCCESS;
  bool fatal = fatal_status(status);
  if (!fatal && !all) return EPX_SUCCESS;
  const int phase = e->phase, peer = e->peer;
  const long long detail = (long long)e->detail;
  const char *ph = phase >= 0 && phase < EPXC_PH_COUNT ? phase_names[phase] : "?";
  /* The rank a fatal failure started at: the one waited for, or, when this rank stopped
   * because a peer failed first, whatever that peer stopped on, and so on. */
  int root = peer;
  for (int hops = 0; fatal && hops < c->nranks && root >= 0 && root < c->nranks && root != c->rank; hops++) {
    if (cw->shared && epxi_group_peer_lost(c->world->group, root)) break;
    const volatile epxc_error_t *pe = &cw->errors_host[root];
    if ((pe->status != EPX_ERR_BROKEN && pe->status != EPX_ERR_TIMEOUT) || pe->peer == root) break;
    root = pe->peer;
  }
  epx_status_t s;
  if (fatal && cw->shared && root != c->rank && epxi_group_peer_lost(c->world->group, root))
    s = epxi_fail(EPX_ERR_PEER_LOST, "rank %d: %s stopped: rank %d's process is gone (it died or left the group)",
                  c->rank, ph, root);
  else if (status == EPX_ERR_TIMEOUT)
    s = epxi_fail(EPX_ERR_TIMEOUT, "rank %d: %s timed out after %lld ms waiting for rank %d", c->rank, ph, detail, peer);
  else if (status == EPX_ERR_BROKEN && root != peer && root >= 0 && root < c->nranks)
    s = epxi_fail(EPX_ERR_BROKEN, "rank %d: %s stopped: rank %d failed first (it stopped on rank %d: %s)", c->rank, ph,
                  peer, root, epx_status_string((epx_status_t)cw->errors_host[root].status));
  else if (status == EPX_ERR_BROKEN)
    s = epxi_fail(EPX_ERR_BROKEN, "rank %d: %s stopped: rank %d failed first (%s)", c->rank, ph, peer,
                  epx_status_string((epx_status_t)detail));
  else if (status == EPX_ERR_OUTPUT_TOO_SMALL)
    s = epxi_fail(EPX_ERR_OUTPUT_TOO_SMALL, "rank %d: %s: %lld rows arrive but recv_capacity is smaller; nothing written",
                  c->rank, ph, detail);
  else
    s = epxi_fail((epx_status_t)status, "rank %d: %s: rank %d failed (%s)", c->rank, ph, peer,
                  epx_status_string((epx_status_t)status));
  if (!fatal) e->status = 0; /* reported; the comm stays usable */
  return s;
}

static epx_status_t cuda_poll(epx_comm_t *c) { return report(c, false); }

static epx_status_t cuda_synchronize(epx_comm_t *c) {
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  CUDA_TRY(wait_stream(c, stream_of(c)), "cudaStreamSynchronize");
  return report(c, true);
}

/* ---- handles ------------------------------------------------------------------------------ */

/* Device arrays of one plan, for `cap` tokens; the struct itself is uploaded by the caller.
 * Peers read all of them. */
static epx_status_t plan_arrays(const epx_comm_t *c, epxc_plan_t *p, int64_t cap, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  const int64_t W = (cap + 31) / 32, K = c->cfg.topk, R = c->nranks, E = c->cfg.num_experts, L = c->num_local_experts;
  p->words = W;
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->idx, sizeof(int32_t) * cap * K + 16, st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->weight, sizeof(float) * cap * K + 16, st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->rank_bits, sizeof(uint32_t) * R * W + 16, st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->rank_pre, sizeof(int32_t) * R * W + 16, st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->exp_bits, sizeof(uint32_t) * E * W + 16, st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->exp_pre, sizeof(int32_t) * E * W + 16, st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->counts, sizeof(int32_t) * (R + E), st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->pair_base, sizeof(int64_t) * L * R, st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->block, sizeof(int64_t) * (L + 1), st, "plan buffers"));
  EPX_CHECK(dev_alloc(cc, true, (void **)&p->pairs_local, sizeof(int32_t) * L, st, "plan buffers"));
  return EPX_SUCCESS;
}

static void plan_arrays_free(cuda_comm_t *cc, epxc_plan_t *p, cudaStream_t st) {
  void *bufs[] = {p->idx, p->weight, p->rank_bits, p->rank_pre, p->exp_bits, p->exp_pre, p->counts,
                  p->pair_base, p->block, p->pairs_local};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) dev_free(cc, bufs[i], st);
}

/* Low-latency handles have every buffer at its final size from the start: two plans for
 * max_tokens_per_rank tokens, staging and partials for any element type (and, across
 * processes, the row weight gradients peers read). */
static epx_status_t ll_create(const epx_comm_t *c, cuda_handle_t *ch, cudaStream_t st) {
  cuda_comm_t *cc = CC(c);
  const int64_t T = c->cfg.max_tokens_per_rank > 0 ? c->cfg.max_tokens_per_rank : 1, H = c->cfg.hidden;
  const int64_t blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK, R = c->nranks, L = c->num_local_experts;
  const char *what = "low-latency buffers";
  for (int i = 0; i < 2; i++) {
    EPX_CHECK(plan_arrays(c, &ch->ll_plan[i], T, st));
    EPX_CHECK(dev_alloc(cc, true, (void **)&ch->ll.plan[i], sizeof(epxc_plan_t), st, what));
    CUDA_TRY(cudaMemcpyAsync(ch->ll.plan[i], &ch->ll_plan[i], sizeof(epxc_plan_t), cudaMemcpyHostToDevice, st), what);
    EPX_CHECK(dev_alloc(cc, true, &ch->ll.stage[i], sizeof(float) * T * H, st, what));
    EPX_CHECK(dev_alloc(cc, true, (void **)&ch->ll.stage_scales[i], sizeof(float) * T * blocks, st, what));
    EPX_CHECK(dev_alloc(cc, true, &ch->ll.partials[i], sizeof(float) * R * T * H, st, what));
    if (cc->arena) EPX_CHECK(dev_alloc(cc, true, (void **)&ch->ll.wgrad[i], sizeof(float) * L * R * T, st, what));
  }
  EPX_CHECK(dev_alloc(cc, false, (void **)&ch->ll_dev, sizeof(epxc_ll_t), st, what));
  CUDA_TRY(cudaMemcpyAsync(ch->ll_dev, &ch->ll, sizeof(epxc_ll_t), cudaMemcpyHostToDevice, st), what);
  CUDA_TRY(wait_stream(c, st), what); /* the uploads read ch's memory */
  return EPX_SUCCESS;
}

/* Handles are made while peers may already wait on this rank in an exchange: nothing here may
 * synchronise the device, so every allocation is stream-ordered on the comm's stream. */
static epx_status_t cuda_handle_create(epx_handle_t *h) {
  cuda_handle_t *ch = calloc(1, sizeof *ch);
  const epx_comm_t *c = h->comm;
  cuda_comm_t *cc = CC(c);
  const int L = c->num_local_experts, R = c->nranks, E = c->cfg.num_experts;
  if (ch) ch->summary = calloc(1, sizeof *ch->summary);
  if (ch) ch->pairs_local_host = calloc(L, sizeof(int32_t));
  h->impl = ch;
  if (!ch || !ch->summary || !ch->pairs_local_host) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda handle");
  cudaStream_t st = stream_of(c);
  const char *what = "handle buffers";
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  EPX_CHECK(dev_alloc(cc, true, (void **)&ch->dev, sizeof(epxc_plan_t), st, what));
  EPX_CHECK(dev_alloc(cc, true, (void **)&ch->host.pair_base, sizeof(int64_t) * L * R, st, what));
  EPX_CHECK(dev_alloc(cc, true, (void **)&ch->host.block, sizeof(int64_t) * (L + 1), st, what));
  EPX_CHECK(dev_alloc(cc, true, (void **)&ch->host.pairs_local, sizeof(int32_t) * L, st, what));
  EPX_CHECK(dev_alloc(cc, true, (void **)&ch->host.counts, sizeof(int32_t) * (R + E), st, what));
  EPX_CHECK(dev_alloc(cc, true, (void **)&ch->host.pair_send_base, sizeof(int64_t) * (E + 1), st, what));
  CUDA_TRY(cudaMemsetAsync(ch->dev, 0, sizeof(epxc_plan_t), st), what);
  if (h->hc.algo == EPX_ALGO_LL) EPX_CHECK(ll_create(c, ch, st));
  return EPX_SUCCESS;
}

static void cuda_handle_destroy(epx_handle_t *h) {
  cuda_handle_t *ch = h->impl;
  if (!ch) return;
  cuda_comm_t *cc = CC(h->comm);
  cudaStream_t st = stream_of(h->comm);
  cudaSetDevice(cc->device);
  /* arena memory is reused at once: nothing queued may still use it (nor the peers reading
   * it, which the closing exchange of an operation already waited for) */
  if (cc->arena) {
    wait_stream(h->comm, st);
    if (cc->last_stream && cc->last_stream != st) wait_stream(h->comm, cc->last_stream);
  }
  void *bufs[] = {ch->dev, ch->host.pair_base, ch->host.block, ch->host.pairs_local, ch->host.counts, ch->host.idx,
                  ch->host.weight, ch->host.rank_bits, ch->host.rank_pre, ch->host.exp_bits, ch->host.exp_pre,
                  ch->host.pair_send_base, ch->partials, ch->a2a.send_x, ch->a2a.stage_x, ch->a2a_back,
                  ch->ipc_x, ch->ipc_wgrad, ch->ll_dev};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) dev_free(cc, bufs[i], st);
  for (int i = 0; i < 2; i++) {
    plan_arrays_free(cc, &ch->ll_plan[i], st);
    void *ll_bufs[] = {ch->ll.plan[i], ch->ll.stage[i], ch->ll.stage_scales[i], ch->ll.partials[i], ch->ll.wgrad[i]};
    for (size_t j = 0; j < sizeof ll_bufs / sizeof *ll_bufs; j++) dev_free(cc, ll_bufs[j], st);
  }
  free(ch->summary);
  free(ch->pairs_local_host);
  free(ch);
}

/* (Re)allocates a buffer (see dev_alloc) to hold `bytes`. Refused while the stream is being
 * captured, and for a handle a captured graph uses (grow_frozen, set by the caller): the
 * graph holds the old addresses. */
static _Thread_local bool grow_frozen;
static epx_status_t grow(cuda_comm_t *cc, bool peers, cudaStream_t st, void **p, size_t bytes, const char *what) {
  if (capturing(st) || grow_frozen)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "%s must grow to %zu bytes inside a CUDA graph capture; run the largest shape once before "
                     "capturing",
                     what, bytes);
  dev_free(cc, *p, st);
  *p = NULL;
  return dev_alloc(cc, peers, p, bytes, st, what);
}

/* Grows a buffer kept with its size in bytes. */
static epx_status_t ensure_bytes(cuda_comm_t *cc, bool peers, cudaStream_t st, void **p, size_t *have, size_t need,
                                 const char *what) {
  if (*p && need <= *have) return EPX_SUCCESS;
  EPX_CHECK(grow(cc, peers, st, p, need, what));
  *have = need;
  return EPX_SUCCESS;
}

/* One allocation carved into consecutive 256-byte aligned pieces. */
static size_t carve(char **base, size_t bytes) {
  size_t at = (size_t)(uintptr_t)*base;
  *base += (bytes + 255) / 256 * 256;
  return at;
}

/* The all-to-all baseline's send and staging buffers, sized for this dispatch. */
static epx_status_t ensure_a2a(epx_comm_t *c, cuda_handle_t *ch, const epx_dispatch_args_t *a, bool expert,
                               cudaStream_t st) {
  const int64_t H = c->cfg.hidden, blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const size_t row = (size_t)H * epx_dtype_size(a->recv_dtype);
  /* a row per (token, expert) at most, in either layout */
  const int64_t send_rows = (ch->num_tokens > 0 ? ch->num_tokens : 1) * c->cfg.topk;
  char *at = NULL;
  carve(&at, row * send_rows), carve(&at, sizeof(float) * blocks * send_rows), carve(&at, sizeof(int32_t) * send_rows);
  carve(&at, sizeof(float) * send_rows);
  EPX_CHECK(ensure_bytes(CC(c), true, st, &ch->a2a.send_x, &ch->a2a_send_bytes, (size_t)(uintptr_t)at,
                         "all-to-all send buffer"));
  char *base = ch->a2a.send_x;
  carve(&base, row * send_rows);
  ch->a2a.send_scales = (float *)carve(&base, sizeof(float) * blocks * send_rows);
  ch->a2a.send_token = (int32_t *)carve(&base, sizeof(int32_t) * send_rows);
  ch->a2a.send_weight = (float *)carve(&base, sizeof(float) * send_rows);
  if (!expert) return EPX_SUCCESS;
  const int64_t stage_rows = a->recv_capacity > 0 ? a->recv_capacity : 1;
  at = NULL;
  carve(&at, row * stage_rows), carve(&at, sizeof(float) * blocks * stage_rows), carve(&at, sizeof(float) * stage_rows);
  EPX_CHECK(ensure_bytes(CC(c), false, st, &ch->a2a.stage_x, &ch->a2a_stage_bytes, (size_t)(uintptr_t)at,
                         "all-to-all staging buffer"));
  base = ch->a2a.stage_x;
  carve(&base, row * stage_rows);
  ch->a2a.stage_scales = (float *)carve(&base, sizeof(float) * blocks * stage_rows);
  ch->a2a.stage_weight = (float *)carve(&base, sizeof(float) * stage_rows);
  return EPX_SUCCESS;
}

/* Send-side buffers sized for `cap` tokens. */
static epx_status_t ensure_tokens(epx_comm_t *c, cuda_handle_t *ch, int64_t cap, cudaStream_t st) {
  if (cap <= ch->token_cap && ch->host.idx) return EPX_SUCCESS;
  cap = cap < 32 ? 32 : cap;
  const int64_t W = (cap + 31) / 32, K = c->cfg.topk, R = c->nranks, E = c->cfg.num_experts;
  epxc_plan_t *p = &ch->host;
  cuda_comm_t *cc = CC(c);
  ch->token_cap = 0; /* until every buffer below has grown: a failure grows them all next time */
  EPX_CHECK(grow(cc, true, st, (void **)&p->idx, sizeof(int32_t) * cap * K, "routing buffer"));
  EPX_CHECK(grow(cc, true, st, (void **)&p->weight, sizeof(float) * cap * K, "weight buffer"));
  EPX_CHECK(grow(cc, true, st, (void **)&p->rank_bits, sizeof(uint32_t) * R * W, "rank bitmap"));
  EPX_CHECK(grow(cc, true, st, (void **)&p->rank_pre, sizeof(int32_t) * R * W, "rank prefix"));
  EPX_CHECK(grow(cc, true, st, (void **)&p->exp_bits, sizeof(uint32_t) * E * W, "expert bitmap"));
  EPX_CHECK(grow(cc, true, st, (void **)&p->exp_pre, sizeof(int32_t) * E * W, "expert prefix"));
  p->words = W;
  ch->token_cap = cap;
  CUDA_TRY(cudaMemcpyAsync(ch->dev, p, sizeof *p, cudaMemcpyHostToDevice, st), "plan upload");
  /* the upload reads `p` when the stream gets there: keep it still until then */
  CUDA_TRY(wait_stream(c, st), "plan upload");
  return EPX_SUCCESS;
}

static epxc_shape_t shape_of(const epx_comm_t *c, const epx_handle_t *h) {
  epxc_shape_t s = CC(c)->shape;
  s.align = h->hc.align;
  s.ll = h->hc.algo == EPX_ALGO_LL;
  s.expert_layout = h->hc.layout == EPX_LAYOUT_EXPERT;
  return s;
}

static epx_status_t cuda_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status);

static epx_status_t cuda_get_layout(epx_comm_t *c, const epx_routing_t *r, int32_t *tokens_per_rank,
                                    int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  LAUNCH_TRY(epxc_layout(&CC(c)->shape, &CC(c)->group, r->num_tokens, r->topk_idx, r->idx_dtype, r->topk_idx ? NULL : r->routing_map,
                         tokens_per_rank, tokens_per_expert, is_token_in_rank, op_stream(c)),
             "layout kernel");
  return EPX_SUCCESS;
}

/* What notify, dispatch and combine start with: the rank's device, and the stream the operation
 * runs on, noting whether a graph captures it (the handle's buffers must not move then). */
static epx_status_t op_begin(epx_comm_t *c, cuda_handle_t *ch, cudaStream_t *st) {
  *st = op_stream(c);
  ch->captured |= capturing(*st);
  grow_frozen = ch->captured;
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  return EPX_SUCCESS;
}

static epx_status_t cuda_notify(epx_comm_t *c, epx_handle_t *h, const epx_routing_t *r) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  const bool ll = h->hc.algo == EPX_ALGO_LL;
  if (h->hc.exact && !ll && capturing(op_stream(c)))
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: an exact notify waits for the counts, which a CUDA graph "
                     "capture cannot: create the handle with exact = 0", c->rank);
  cudaStream_t st;
  EPX_CHECK(op_begin(c, ch, &st));
  ch->known = false;
  ch->num_tokens = r->num_tokens;
  if (ll) { /* planned inside the dispatch that follows, in the same launch */
    ch->ll_route = *r;
    ch->ll_route_pending = true;
    return EPX_SUCCESS;
  }
  epx_status_t grown = ensure_tokens(c, ch, r->num_tokens, st);
  if (grown != EPX_SUCCESS) return cuda_abort(c, h, h->dispatch_follows ? EPXI_OP_NOTIFY_DISPATCH : EPXI_OP_NOTIFY, grown);
  epxc_shape_t s = shape_of(c, h);
  LAUNCH_TRY(epxc_notify_build(&s, ch->dev, &ch->host, r->num_tokens, r->topk_idx,
                               r->idx_dtype, r->topk_idx ? r->topk_weights : NULL,
                               r->topk_idx ? NULL : r->routing_map, r->topk_idx ? NULL : r->probs, st),
             "notify kernels");
  uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)ch->dev, (uint64_t)r->num_tokens};
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_NOTIFY, words, &ch->dev->status, st), "notify exchange");
  LAUNCH_TRY(epxc_notify_finish(&s, &cc->group, ch->dev, st), "notify finish");
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_NOTIFY_DONE, NULL, NULL, st), "notify closing exchange");
  if (!h->hc.exact) return EPX_SUCCESS;

  /* Exact sizes: wait for the counts. */
  plan_summary_t *sum = ch->summary;
  CUDA_TRY(cudaMemcpyAsync(&sum->status, &ch->dev->status, sizeof(int32_t) * 2, cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(&sum->bad_key, &ch->dev->bad_key, sizeof(uint64_t), cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(&sum->num_recv, &ch->dev->num_recv, sizeof(int64_t) * 4, cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(ch->pairs_local_host, ch->host.pairs_local, sizeof(int32_t) * c->num_local_experts,
                           cudaMemcpyDeviceToHost, st),
           "counts");
  CUDA_TRY(wait_stream(c, st), "cudaStreamSynchronize (notify)");
  sum->num_tokens = r->num_tokens;
  /* Every rank decides from the statuses the exchange agreed on; a recoverable record left
   * from an earlier call must not make this one fail on one rank only. */
  EPX_CHECK(report(c, false));
  if (sum->group_status) {
    volatile epxc_error_t *e = &((cuda_world_t *)c->world->impl)->errors_host[c->rank];
    const int who = e->peer;
    if (!fatal_status(e->status)) e->status = 0;
    if (sum->status) { /* this rank's own routing: name the token */
      const uint64_t key = sum->bad_key;
      return epxi_fail((epx_status_t)sum->status, "rank %d: token %llu slot %u: %s", c->rank,
                       (unsigned long long)(key >> 16), (unsigned)((key >> 8) & 0xff),
                       epx_status_string((epx_status_t)sum->status));
    }
    return epxi_fail((epx_status_t)sum->group_status, "rank %d: notify: rank %d's routing was refused (%s)", c->rank,
                     who, epx_status_string((epx_status_t)sum->group_status));
  }
  ch->known = true;
  return EPX_SUCCESS;
}

static epx_status_t cuda_handle_info(const epx_handle_t *h, epx_handle_info_t *info, int32_t *per_expert) {
  const cuda_handle_t *ch = h->impl;
  if (!ch->known)
    return epxi_fail(EPX_ERR_UNSUPPORTED,
                     "the handle's sizes live on the device (sync-free or low-latency mode): read them from the "
                     "dispatch's outputs, or create the handle with exact = 1");
  info->num_send_tokens = ch->summary->num_tokens;
  info->num_recv_tokens = ch->summary->num_recv;
  info->num_recv_rows = ch->summary->num_rows;
  info->num_recv_pairs = ch->summary->num_pairs;
  info->num_sent_copies = ch->summary->sent_copies;
  if (per_expert) memcpy(per_expert, ch->pairs_local_host, sizeof(int32_t) * h->comm->num_local_experts);
  return EPX_SUCCESS;
}

/* ---- dispatch and combine ------------------------------------------------------------------ */

static epx_status_t cuda_dispatch(epx_comm_t *c, epx_handle_t *h, const epx_dispatch_args_t *a) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  cudaStream_t st;
  EPX_CHECK(op_begin(c, ch, &st));
  epxc_shape_t s = shape_of(c, h);
  epxc_dispatch_t d = {.x = a->x, .x_dtype = a->x_dtype, .recv_dtype = a->recv_dtype, .recv_x = a->recv_x,
                       .recv_scales = a->recv_scales, .recv_capacity = a->recv_capacity,
                       .recv_topk_idx = a->recv_topk_idx, .recv_topk_weights = a->recv_topk_weights,
                       .recv_probs = a->recv_probs, .tokens_per_local_expert = a->tokens_per_local_expert,
                       .num_recv_rows = a->num_recv_rows, .scale_by_probs = a->scale_by_probs};
  d.report_capacity = !ch->known;
  d.part = a->part;
  if (a->part == EPX_PART_COMPLETE) { /* SEND did it all, or (low-latency) left the rest */
    if (!s.ll) return EPX_SUCCESS;
    d = ch->ll_send_dispatch;
    d.part = EPX_PART_COMPLETE;
    epxc_route_t none = {.num_tokens = ch->num_tokens, .replay = 1};
    LAUNCH_TRY(epxc_ll_dispatch(&s, &cc->group, ch->ll_dev, &none, &d, st), "low-latency dispatch");
    return EPX_SUCCESS;
  }
  if (!a->x && ch->num_tokens > 0)
    return cuda_abort(c, h, EPXI_OP_DISPATCH,
                      epxi_fail(EPX_ERR_NULL_POINTER, "dispatch on rank %d: x is NULL with %lld tokens", c->rank,
                                (long long)ch->num_tokens));
  ch->recv_capacity = s.ll ? (int64_t)c->nranks * c->cfg.max_tokens_per_rank : a->recv_capacity;
  if (s.ll) {
    /* the recorded routing, or (a replay) the last plan's own copy of it */
    const epx_routing_t *rt = &ch->ll_route;
    epxc_route_t route = {.num_tokens = ch->num_tokens, .replay = !ch->ll_route_pending};
    if (ch->ll_route_pending) {
      route.topk_idx = rt->topk_idx;
      route.idx_dtype = rt->idx_dtype;
      route.topk_weights = rt->topk_idx ? rt->topk_weights : NULL;
      route.routing_map = rt->topk_idx ? NULL : rt->routing_map;
      route.probs = rt->topk_idx ? NULL : rt->probs;
    }
    ch->ll_route_pending = false;
    ch->ll_dispatched = true;
    ch->ll_send_dispatch = d;
    LAUNCH_TRY(epxc_ll_dispatch(&s, &cc->group, ch->ll_dev, &route, &d, st), "low-latency dispatch");
    return EPX_SUCCESS;
  }
  if (h->hc.algo == EPX_ALGO_ALLTOALL) {
    /* permute here, then every destination pulls whole chunks (and sorts them) */
    epx_status_t grown = ensure_a2a(c, ch, a, s.expert_layout, st);
    if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_DISPATCH, grown);
    const epxc_a2a_t *b = &ch->a2a;
    uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)b->send_x, (uint64_t)(uintptr_t)b->send_scales,
                                       (uint64_t)(uintptr_t)b->send_token, (uint64_t)(uintptr_t)b->send_weight};
    LAUNCH_TRY(epxc_a2a_permute(&s, &cc->group, ch->dev, b, &d, st), "all-to-all permute");
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, words, NULL, st), "dispatch exchange");
    LAUNCH_TRY(epxc_a2a_gather(&s, &cc->group, ch->dev, b, &d, st), "all-to-all gather");
  } else {
    const void *x = a->x;
    if (cc->arena) { /* across processes peers reach x only in the arena */
      const size_t bytes = (size_t)ch->num_tokens * c->cfg.hidden * epx_dtype_size(a->x_dtype);
      epx_status_t grown = ensure_bytes(cc, true, st, &ch->ipc_x, &ch->ipc_x_bytes, bytes, "dispatch staging buffer");
      if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_DISPATCH, grown);
      if (bytes) CUDA_TRY(cudaMemcpyAsync(ch->ipc_x, a->x, bytes, cudaMemcpyDeviceToDevice, st), "dispatch staging");
      x = ch->ipc_x;
    }
    uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)x};
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, words, NULL, st), "dispatch exchange");
    LAUNCH_TRY(epxc_dispatch(&s, &cc->group, ch->dev, &d, st), "dispatch kernel");
  }
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH_DONE, NULL, NULL, st), "dispatch closing exchange");
  if (ch->known && !s.ll && a->recv_capacity < ch->summary->num_rows)
    return epxi_fail(EPX_ERR_OUTPUT_TOO_SMALL, "dispatch on rank %d: %lld rows arrive but recv_capacity is %lld",
                     c->rank, (long long)ch->summary->num_rows, (long long)a->recv_capacity);
  return EPX_SUCCESS;
}

static epx_status_t cuda_combine(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  cudaStream_t st;
  EPX_CHECK(op_begin(c, ch, &st));
  epxc_shape_t s = shape_of(c, h);
  epxc_combine_t k = {.y = a->y, .y_dtype = a->y_dtype, .out = a->out, .out_dtype = a->out_dtype,
                      .weighted = a->weighted, .row_probs = a->row_probs, .row_weight_grad = a->row_weight_grad,
                      .topk_weight_grad = a->topk_weight_grad};
  k.part = a->part;
  if (a->part == EPX_PART_COMPLETE) { /* SEND did it all, or (low-latency) left the rest */
    if (!s.ll) return EPX_SUCCESS;
    k = ch->ll_send_combine;
    k.part = EPX_PART_COMPLETE;
    LAUNCH_TRY(epxc_ll_combine(&s, &cc->group, ch->ll_dev, &k, st), "low-latency combine");
    return EPX_SUCCESS;
  }
  if ((!a->out && ch->num_tokens > 0) || !a->y)
    return cuda_abort(c, h, EPXI_OP_COMBINE,
                      epxi_fail(EPX_ERR_NULL_POINTER, "combine on rank %d: %s is NULL", c->rank, a->y ? "out" : "y"));
  if (s.ll) {
    if (!ch->ll_dispatched)
      return cuda_abort(c, h, EPXI_OP_COMBINE,
                        epxi_fail(EPX_ERR_INVALID_ARGUMENT, "low-latency combine on rank %d: no dispatch on this "
                                  "handle to invert", c->rank));
    ch->ll_send_combine = k;
    LAUNCH_TRY(epxc_ll_combine(&s, &cc->group, ch->ll_dev, &k, st), "low-latency combine");
    return EPX_SUCCESS;
  }
  /* Buffers first: a failure after the first exchange would leave the peers waiting. */
  if (h->hc.algo == EPX_ALGO_ALLTOALL) {
    const size_t back = (size_t)(ch->num_tokens > 0 ? ch->num_tokens : 1) * c->cfg.topk * c->cfg.hidden *
                        epx_dtype_size(a->y_dtype);
    epx_status_t grown = ensure_bytes(cc, false, st, &ch->a2a_back, &ch->a2a_back_bytes, back, "all-to-all combine buffer");
    if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
    k.staged = ch->a2a_back;
  }
  /* What arrived here, as the host knows it, or at most what the last dispatch could write. */
  const int64_t recv_tokens = ch->known ? ch->summary->num_recv : ch->recv_capacity;
  const int64_t recv_rows = ch->known ? ch->summary->num_rows : ch->recv_capacity;
  const size_t row_bytes = (size_t)c->cfg.hidden * epx_dtype_size(a->y_dtype);
  const void *rows = a->y;
  if (s.expert_layout || cc->arena) {
    /* The rows peers pull back, one per arrived token: the partials (expert layout), or across
     * processes y copied where the peers reach it (token layout). */
    const size_t bytes = (size_t)recv_tokens * row_bytes;
    if (!ch->partials || bytes > ch->partial_bytes) {
      epx_status_t grown = grow(cc, true, st, &ch->partials, bytes, "combine partials");
      if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
      ch->partial_bytes = bytes;
    }
    k.partials = ch->partials;
    k.partial_rows = (int64_t)(ch->partial_bytes / row_bytes);
    rows = ch->partials;
  }
  /* Across processes the row weight gradients are copied too: [rows] or [tokens, K]. */
  const float *wgrad = a->row_weight_grad;
  const int64_t wgrad_rows = s.expert_layout ? recv_rows : recv_tokens, wgrad_row_bytes =
                             (int64_t)sizeof(float) * (s.expert_layout ? 1 : c->cfg.topk);
  if (cc->arena && wgrad) {
    epx_status_t grown = ensure_bytes(cc, true, st, (void **)&ch->ipc_wgrad, &ch->ipc_wgrad_bytes,
                                      (size_t)(wgrad_rows * wgrad_row_bytes), "combine weight gradient buffer");
    if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
  }
  if (s.expert_layout)
    LAUNCH_TRY(epxc_combine_partials(&s, &cc->group, ch->dev, &k, st), "combine partials");
  else if (cc->arena)
    LAUNCH_TRY(epxc_stage_rows(&cc->group, ch->dev, EPXC_STAGE_RECV, a->y, ch->partials, (int64_t)row_bytes,
                               k.partial_rows, s.num_sms, st),
               "combine staging");
  if (cc->arena && wgrad) {
    LAUNCH_TRY(epxc_stage_rows(&cc->group, ch->dev, s.expert_layout ? EPXC_STAGE_ROWS : EPXC_STAGE_RECV, wgrad,
                               ch->ipc_wgrad, wgrad_row_bytes, wgrad_rows, s.num_sms, st),
               "combine staging");
    wgrad = ch->ipc_wgrad;
  }
  uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)rows, (uint64_t)(uintptr_t)wgrad};
  /* a rank whose dispatch wrote nothing makes every rank skip this combine */
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_COMBINE, words, &ch->dev->refused, st), "combine exchange");
  if (h->hc.algo == EPX_ALGO_ALLTOALL) /* the rows for this rank's tokens come back whole */
    LAUNCH_TRY(epxc_a2a_pull_back(&s, &cc->group, ch->dev, &k, st), "all-to-all pull back");
  LAUNCH_TRY(epxc_combine_reduce(&s, &cc->group, ch->dev, &k, st), "combine kernel");
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_COMBINE_DONE, NULL, NULL, st), "combine closing exchange");
  return EPX_SUCCESS;
}

/* The caller returns this rank's failure with its own message: drop the device's record of
 * the same thing (the exchange recorded it as "rank r failed"), and nothing else. */
static void forget_own_report(epx_comm_t *c, epx_status_t status, cudaStream_t st) {
  if (capturing(st)) return; /* the record then stays, for epx_comm_synchronize to report */
  wait_stream(c, st);
  volatile epxc_error_t *e = &((cuda_world_t *)c->world->impl)->errors_host[c->rank];
  if (e->status == (int32_t)status && e->peer == c->rank) e->status = 0;
}

/* The peers' operations are exchange-framed: post this rank's status in the opening exchange
 * (the peers then skip their work) and join the closing one. A sync-free notify + dispatch
 * is two operations to the peers; an exact notify already stops them after the first. */
static epx_status_t cuda_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status) {
  cuda_comm_t *cc = CC(c);
  cudaStream_t st = op_stream(c);
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  static const int phases[][2] = {[EPXI_OP_NOTIFY] = {EPXC_PH_NOTIFY, EPXC_PH_NOTIFY_DONE},
                                  [EPXI_OP_DISPATCH] = {EPXC_PH_DISPATCH, EPXC_PH_DISPATCH_DONE},
                                  [EPXI_OP_NOTIFY_DISPATCH] = {EPXC_PH_NOTIFY, EPXC_PH_NOTIFY_DONE},
                                  [EPXI_OP_COMBINE] = {EPXC_PH_COMBINE, EPXC_PH_COMBINE_DONE}};
  uint64_t words[EPXC_SLOT_WORDS] = {(uint64_t)(uint32_t)status};
  if (h->hc.algo == EPX_ALGO_LL) { /* one exchange per operation, none in notify */
    if (op != EPXI_OP_NOTIFY)
      LAUNCH_TRY(epxc_exchange(&cc->group, op == EPXI_OP_COMBINE ? EPXC_PH_LL_COMBINE : EPXC_PH_LL_DISPATCH, words, NULL, st),
                 "exchange");
    if (op == EPXI_OP_DISPATCH || op == EPXI_OP_NOTIFY_DISPATCH) ch_of(h)->ll_dispatched = false;
    forget_own_report(c, status, st);
    return status;
  }
  LAUNCH_TRY(epxc_exchange(&cc->group, phases[op][0], words, NULL, st), "exchange");
  LAUNCH_TRY(epxc_exchange(&cc->group, phases[op][1], NULL, NULL, st), "exchange");
  if (op == EPXI_OP_NOTIFY_DISPATCH && !(h->hc.exact && h->hc.algo != EPX_ALGO_LL)) {
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, words, NULL, st), "exchange");
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH_DONE, NULL, NULL, st), "exchange");
  }
  forget_own_report(c, status, st);
  return status;
}

const epxi_backend_t epxi_cuda_backend = {
    .name = "cuda",
    .world_create = cuda_world_create,
    .world_destroy = cuda_world_destroy,
    .comm_init = cuda_comm_init,
    .comm_destroy = cuda_comm_destroy,
    .handle_create = cuda_handle_create,
    .handle_destroy = cuda_handle_destroy,
    .get_layout = cuda_get_layout,
    .notify = cuda_notify,
    .handle_info = cuda_handle_info,
    .dispatch = cuda_dispatch,
    .combine = cuda_combine,
    .poll = cuda_poll,
    .synchronize = cuda_synchronize,
    .abort = cuda_abort,
};
