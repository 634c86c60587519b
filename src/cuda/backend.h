/* The CUDA backend's host side, shared by its files (C11):
 *   world.c          devices, streams, the world's error words, comm set-up and teardown
 *   arena.c          device memory: the comm's arena, which every buffer is carved from
 *   transport_*.c    how a comm's peers reach its arena and state, one file per transport:
 *                    in one process (transport_inproc.c), across processes (transport_ipc.c)
 *   report.c         waiting for a stream, lost peers, turning error words into statuses
 *   handle.c         handles, layout, and the entry points, which hand each operation to the
 *                    handle's algorithm (cuda_algo_t)
 *   op_framed.c      what the exchange-framed algorithms share: notify, closing, combine
 *   op_ht.c, op_a2a.c, op_ll.c   one algorithm each
 * All data movement is in the kernels (*.cu); this side sizes buffers and orders launches. */
#ifndef EPX_CUDA_BACKEND_H
#define EPX_CUDA_BACKEND_H

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdbool.h>

#include "core/internal.h"
#include "cuda/cuda_shared.h"

/* A cudaMalloc'd block a comm of this process gave back (arena.c). */
typedef struct {
  int device;
  char *base;
  size_t bytes;
} kept_block_t;

typedef struct {
  epxc_error_t *errors_host; /* [R], host-mapped */
  epxc_error_t *errors_dev;
  bool shared;               /* across processes: errors_host is the group's shared page, registered */
  /* In one process, device memory a destroyed comm gave back, for the next comm on the same
   * GPU: cudaFree synchronises the GPU, which would stall peers inside an operation, so it
   * happens only at world destroy. */
  pthread_mutex_t kept_lock;
  kept_block_t *kept;
  int num_kept, kept_cap;
} cuda_world_t;

/* One cudaMalloc'd piece of an arena, carved by `heap`. */
typedef struct {
  char *base;
  size_t bytes;
  epxi_suballoc_t heap;
} arena_chunk_t;

#define EPXC_ARENA_CHUNKS 16

/* A comm's device memory: chunk 0 made at comm init, which the transport makes reachable by
 * the peers; more chunks only by growth, where that is safe (arena_extend). */
typedef struct {
  arena_chunk_t chunk[EPXC_ARENA_CHUNKS];
  int chunks;
  bool growable;      /* one process, and no other rank of it on this GPU */
  cuda_world_t *keep; /* where freed chunks go (one process), NULL: cudaFree (across processes) */
  int device;
} arena_t;

typedef struct cuda_transport cuda_transport_t;

typedef struct {
  int device;
  cudaStream_t own_stream;
  cudaStream_t last_stream; /* where the previous operation went */
  cudaEvent_t order;        /* orders an operation after the previous one when the stream changes */
  epxc_state_t *state;      /* this rank's exchange state (in the arena, or beside it: the transport's choice) */
  epxc_group_t group;       /* what the kernels know of the group: filled by the transport */
  epxc_shape_t shape;
  const cuda_transport_t *transport;
  arena_t arena;
  void *mapped[EPX_MAX_RANKS]; /* across processes: the peers' arenas as mapped here */
  /* What a refused call without a usable handle takes part as (cuda_abort): the algorithm of
   * the last handle a call used on the comm (NULL: none yet, high-throughput), and whether
   * that handle was sync-free */
  const struct cuda_algo *last_algo;
  bool last_sync_free;
  uint64_t last_send;       /* the call number of this rank's last SEND half, made or refused (0: none) */
  uint64_t ll_inbox_key[EPXC_LL_INBOXES]; /* the ids of the low-latency handles whose inboxes the state
                                             publishes (epxc_state_t.ll_inbox), 0: free */
} cuda_comm_t;

/* How a comm's peers reach its memory and it theirs. open makes the arena (chunk 0, `bytes`),
 * the state, and fills cc->group (state[], delta[]); it is collective: every rank succeeds or
 * every rank fails, and a failure leaves nothing of the arena behind. close undoes it once the
 * comm's streams are idle. A new transport (NCCL windows, say) is a file with these two. */
struct cuda_transport {
  const char *name;
  /* Peers reach the caller's own buffers (one address space, or peer access): false across
   * processes, where rows peers read are copied into the arena first. */
  bool caller_memory;
  epx_status_t (*open)(epx_comm_t *c, cuda_comm_t *cc, size_t bytes, bool growable);
  void (*close)(epx_comm_t *c, cuda_comm_t *cc);
};

extern const cuda_transport_t epxc_transport_inproc, epxc_transport_ipc;

/* The first rank whose entry of `status` (stride bytes apart) is a failure, or -1: how the
 * transports agree on the outcome of a collective step. */
static inline int first_failed(const void *status, size_t stride, int n) {
  for (int r = 0; r < n; r++)
    if (*(const int32_t *)((const char *)status + r * stride) != EPX_SUCCESS) return r;
  return -1;
}

/* What the host learns of a plan in exact mode. */
typedef struct {
  int32_t status, group_status;
  uint64_t bad_key;
  int64_t num_tokens, num_recv, num_rows, num_pairs, sent_copies;
} plan_summary_t;

typedef struct cuda_algo cuda_algo_t;

typedef struct {
  const cuda_algo_t *algo; /* the handle's algorithm */
  epxc_plan_t *dev;        /* the device struct */
  epxc_plan_t host;        /* its pointers and strides, as uploaded */
  int64_t token_cap;       /* tokens the send-side buffers hold */
  epxc_scan_t *scan;       /* how a notify launch's blocks meet (layout.cu) */
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
  /* low-latency: the buffers (their device counters at ll.dev), and the routing that
   * epx_notify recorded for the next dispatch (planning happens inside that dispatch) */
  epxc_ll_bufs_t ll;
  epxc_ll_inbox_t ll_entry; /* its inboxes as the comm's state publishes them (the upload's source),
                              at ll.id % EPXC_LL_INBOXES while the comm's ll_inbox_key there is ll.id */
  epx_routing_t ll_route;
  bool ll_route_pending, ll_dispatched;
  epxc_dispatch_t ll_send_dispatch; /* what a SEND half passed: its COMPLETE uses the same */
  epxc_combine_t ll_send_combine;
  plan_summary_t *summary;   /* exact mode's copy of the counts */
  int32_t *pairs_local_host; /* [L] */
  bool known;              /* summary holds this plan (exact mode) */
  bool captured;           /* a CUDA graph holds this handle's buffers: they may not move */
} cuda_handle_t;

/* One algorithm's operations. The entry points (handle.c) have done what every algorithm
 * does first (the rank's device, the stream, the argument checks that need the handle) and
 * filled `d` / `k` from the caller's arguments. A NULL `*_complete` means the SEND half did
 * everything. */
struct cuda_algo {
  const char *name;
  /* optional: what the algorithm makes with a handle (h->impl is ch), and gives back when it
   * goes, the device idle for it (destroy also runs after a create that failed half way) */
  epx_status_t (*create)(const epx_handle_t *h, cuda_handle_t *ch, cudaStream_t st);
  void (*destroy)(const epx_handle_t *h, cuda_handle_t *ch, cudaStream_t st);
  epx_status_t (*notify)(epx_comm_t *c, epx_handle_t *h, const epx_routing_t *r);
  epx_status_t (*dispatch)(epx_comm_t *c, epx_handle_t *h, const epx_dispatch_args_t *a, const epxc_shape_t *s,
                           epxc_dispatch_t *d, cudaStream_t st);
  epx_status_t (*dispatch_complete)(epx_comm_t *c, epx_handle_t *h, const epxc_shape_t *s, cudaStream_t st);
  epx_status_t (*combine)(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a, const epxc_shape_t *s,
                          epxc_combine_t *k, cudaStream_t st);
  epx_status_t (*combine_complete)(epx_comm_t *c, epx_handle_t *h, const epxc_shape_t *s, cudaStream_t st);
  /* takes part in `op` as the peers need (see epxi_backend_t.abort), on stream st; h is
   * NULL when the call has no usable handle (the peers' handle is then guessed to be of this
   * algorithm, see cuda_abort) */
  epx_status_t (*abort)(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status, cudaStream_t st);
};

extern const cuda_algo_t epxc_algo_ht, epxc_algo_a2a, epxc_algo_ll;

/* ---- errors ----------------------------------------------------------------------------- */

epx_status_t cuda_fail(cudaError_t e, const char *what);

#define CUDA_TRY(call, what)                       \
  do {                                             \
    cudaError_t e_ = (call);                       \
    if (e_ != cudaSuccess) return cuda_fail(e_, what); \
  } while (0)

#define LAUNCH_TRY(call, what) CUDA_TRY((cudaError_t)(call), what)

/* as the kernels' fatal_status (common.cuh): after these a rank's kernels do nothing more */
static inline bool fatal_status(int s) {
  return s == EPX_ERR_TIMEOUT || s == EPX_ERR_BROKEN || s == EPX_ERR_PEER_LOST || s == EPX_ERR_OUT_OF_STEP;
}

static inline cuda_comm_t *CC(const epx_comm_t *c) { return (cuda_comm_t *)c->impl; }
static inline cuda_handle_t *ch_of(const epx_handle_t *h) { return (cuda_handle_t *)h->impl; }

/* Across processes this world drives one rank of the group: everything about peers then goes
 * through IPC (comm init), and the error words through the group's shared page. */
static inline bool cross_process(const epx_world_t *w) { return w->num_local < w->nranks; }

/* ---- streams (world.c) ------------------------------------------------------------------ */

bool capturing(cudaStream_t st);
cudaStream_t stream_of(const epx_comm_t *c);
/* The stream of an operation, ordered after the previous operation of this comm even when
 * the caller moved the comm to another stream in between. */
cudaStream_t op_stream(const epx_comm_t *c);

/* ---- memory (arena.c) ------------------------------------------------------------------- */

/* The default size of a comm's arena for `sharing` ranks of this process on a GPU of
 * `device_bytes` (the README's formula), or EPX_ARENA_MB. */
size_t arena_size(const epx_comm_t *c, int sharing, size_t device_bytes);
/* Chunk 0 of `bytes`, from what `keep` kept of an earlier comm on `device` when it can (keep
 * NULL: a fresh cudaMalloc, freed by cudaFree); the device must be current. */
epx_status_t arena_make(arena_t *a, size_t bytes, bool growable, cuda_world_t *keep, int device, const char *who);
void arena_free(arena_t *a);
/* Device memory of the world's (see cuda_world_t.kept): a kept block of at least `bytes` (at
 * most twice as large) or a new one; given back for a later comm; all freed at world destroy. */
void *world_block_take(cuda_world_t *cw, int device, size_t bytes, size_t *got, cudaError_t *err);
void world_block_give(cuda_world_t *cw, int device, void *p, size_t bytes);
void world_blocks_free(cuda_world_t *cw);
size_t arena_in_use(const arena_t *a);
size_t arena_bytes(const arena_t *a);
/* A buffer of the comm's arena; EPX_ERR_OUT_OF_MEMORY, naming EPX_ARENA_MB, when it does not fit. */
epx_status_t dev_alloc(cuda_comm_t *cc, void **p, size_t bytes, cudaStream_t st, const char *what);
void dev_free(cuda_comm_t *cc, void *p);
epx_status_t grow(cuda_comm_t *cc, const cuda_handle_t *ch, cudaStream_t st, void **p, size_t bytes, const char *what);
epx_status_t ensure_bytes(cuda_comm_t *cc, const cuda_handle_t *ch, cudaStream_t st, void **p, size_t *have,
                          size_t need, const char *what);
size_t carve(char **base, size_t bytes);

/* ---- waiting and reporting (report.c) ---------------------------------------------------- */

/* Waits for the stream's work, watching for lost peers across processes. */
cudaError_t wait_stream(const epx_comm_t *c, cudaStream_t st);
/* Turns this rank's error word into a status and message. Fatal ones only, unless `all`. */
epx_status_t report(epx_comm_t *c, bool all);
void forget_own_report(epx_comm_t *c, epx_status_t status, cudaStream_t st);
epx_status_t cuda_poll(epx_comm_t *c);
epx_status_t cuda_synchronize(epx_comm_t *c);
/* epx_comm_abort and epx_comm_get_async_error (any thread, never waiting). */
epx_status_t cuda_comm_abort(epx_comm_t *c);
epx_status_t cuda_async_error(epx_comm_t *c, char *why, size_t size);
/* The phase of the record epx_comm_abort writes in every rank's error word (host-written
 * only: a lost peer's record has phase -1, the kernels' are epxc_phase_t). */
#define EPXC_PHASE_ABORTED (-2)

/* ---- world and comm (world.c) ------------------------------------------------------------ */

epx_status_t cuda_world_create(epx_world_t *w);
void cuda_world_destroy(epx_world_t *w);
epx_status_t cuda_comm_init(epx_comm_t *c);
void cuda_comm_destroy(epx_comm_t *c);

/* ---- what the operations share (handle.c, op_framed.c) ----------------------------------- */

epxc_shape_t shape_of(const epx_comm_t *c, const epx_handle_t *h);
/* The stamp of the call in progress (c->stamp), as the call's first exchange carries it. */
epxc_stamp_t stamp_of(const epx_comm_t *c);
/* A routing as the kernels read it: topk ids (with their weights), else the map (with its
 * probabilities); not a replay. */
epxc_route_t route_of(const epx_routing_t *r);
epx_status_t op_begin(epx_comm_t *c, cuda_handle_t *ch, cudaStream_t *st);
epx_status_t cuda_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status);

/* The exchange-framed algorithms (high-throughput, all-to-all): notify builds the plan and
 * meets the peers; dispatch and combine close with an exchange; combine opens with the
 * exchange of the rows peers pull back. */
epx_status_t framed_notify(epx_comm_t *c, epx_handle_t *h, const epx_routing_t *r);
epx_status_t framed_dispatch_close(epx_comm_t *c, cuda_handle_t *ch, const epx_dispatch_args_t *a, cudaStream_t st);
epx_status_t framed_combine_open(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a, const epxc_shape_t *s,
                                 epxc_combine_t *k, cudaStream_t st);
epx_status_t framed_combine_close(epx_comm_t *c, cuda_handle_t *ch, const epxc_shape_t *s, const epxc_combine_t *k,
                                  cudaStream_t st);
epx_status_t framed_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status, cudaStream_t st);

#endif
