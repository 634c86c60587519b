/* Internal declarations shared by the core, the transports and the backends. */
#ifndef EPX_INTERNAL_H
#define EPX_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors and logging (status.c) ----------------------------------------------------- */

/* Records a thread-local message for epx_last_error() and returns status. */
epx_status_t epxi_fail(epx_status_t status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void epxi_clear_error(void);

typedef enum { EPXI_LOG_NONE = 0, EPXI_LOG_WARN, EPXI_LOG_INFO } epxi_log_level_t;
void epxi_log(epxi_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define EPX_WARN(...) epxi_log(EPXI_LOG_WARN, __VA_ARGS__)
#define EPX_INFO(...) epxi_log(EPXI_LOG_INFO, __VA_ARGS__)

/* Environment knobs, read once (status.c). */
typedef struct {
  int timeout_ms;        /* EPX_TIMEOUT_MS, default 30000 */
  int num_sms;           /* EPX_NUM_SMS, default 16 */
  int arena_mb;          /* EPX_ARENA_MB (old name EPX_IPC_ARENA_MB): a CUDA comm's arena; 0 = from the config */
  int ht_pipelined;      /* EPX_HT_PIPELINED=0: the CUDA high-throughput dispatch per token only (for comparison) */
  epxi_log_level_t log;  /* EPX_DEBUG=WARN|INFO */
} epxi_env_t;
const epxi_env_t *epxi_env(void);

#define EPX_CHECK(call)                        \
  do {                                         \
    epx_status_t epx_check_s_ = (call);        \
    if (epx_check_s_ != EPX_SUCCESS) return epx_check_s_; \
  } while (0)

/* ---- host-side rendezvous of the group (transport/) ------------------------------------ */

/* The ranks' meeting point on the host: bounded barriers and exchanges. Every backend uses
 * it for set-up (config check, and later the exchange of device memory handles) and the host
 * backend for everything. Two implementations behind one small vtable:
 *   in-process (inproc.c)  the ranks are threads of this process; peers read each other's
 *                          memory in place.
 *   cross-process (shm.c)  one rank per process, all on this host; barriers on counters in
 *                          shared memory (memfd, passed over unix sockets: no names in
 *                          /dev/shm), shares copied through each rank's shared segment, peers'
 *                          deaths seen through their sockets and pids.
 * Every call is made by the thread that drives `rank`; all ranks make the same sequence of
 * calls (barrier, share, allgather) in the same order. */
typedef struct epxi_group epxi_group_t;

typedef struct {
  const char *name;
  void (*destroy)(epxi_group_t *group);
  epx_status_t (*barrier)(epxi_group_t *group, int rank, const char *phase, int timeout_ms);
  epx_status_t (*share)(epxi_group_t *group, int rank, const char *phase, int timeout_ms, const void *mine,
                        size_t bytes, const void **all);
  bool (*broken)(const epxi_group_t *group);
  /* Optional (cross-process groups): the group's common page, and whether a peer is gone. */
  void *(*common)(epxi_group_t *group, size_t *bytes);
  bool (*peer_lost)(const epxi_group_t *group, int rank);
  /* Any thread, never waits: break the group for good on behalf of `rank` (its waits and its
   * peers' end with EPX_ERR_BROKEN); and what broke it so far, with a message (EPX_SUCCESS
   * while whole; a dead peer counts even before a wait saw it). */
  void (*abort)(epxi_group_t *group, int rank);
  epx_status_t (*error)(const epxi_group_t *group, int rank, char *why, size_t size);
} epxi_group_ops_t;

/* The head of every implementation's group. */
struct epxi_group {
  const epxi_group_ops_t *ops;
  int nranks;       /* ranks of the whole group */
  int first_rank;   /* this process drives ranks [first_rank, first_rank + num_local) */
  int num_local;
};

/* In-process group: this process drives all nranks ranks (inproc.c). */
epx_status_t epxi_group_create(int nranks, epxi_group_t **group);

/* The bootstrap exchange of a cross-process group: gathers `bytes` from every rank into all,
 * rank-major. Records a message and returns the failure (bounded by its own deadline). */
typedef epx_status_t (*epxi_exchange_fn)(const void *mine, void *all, size_t bytes, void *ctx);

/* Cross-process group of nranks ranks on this host, of which this process drives `rank`
 * (shm.c). Collective over the processes: exchanges (rank, pid, backend, socket name) through
 * `exchange`, passes the shared segments over unix sockets, and agrees on the outcome, so
 * every rank succeeds or every rank fails. `backend` must be the same on every rank
 * (EPX_ERR_CONFIG_MISMATCH otherwise). Every wait is bounded by timeout_ms. */
epx_status_t epxi_shm_group_create(int nranks, int rank, int backend, epxi_exchange_fn exchange, void *ctx,
                                   int timeout_ms, epxi_group_t **group);

/* TCP bootstrap of epx_get_unique_id / epx_world_create_rank (bootstrap.c): a connection to
 * the id's listener, authenticated both ways by the id's secret (a challenge-response),
 * whose epxi_bootstrap_exchange is an epxi_exchange_fn (ctx = the connection). Only
 * loopback addresses are ever contacted. */
typedef struct epxi_bootstrap epxi_bootstrap_t;
epx_status_t epxi_bootstrap_connect(const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                                    epxi_bootstrap_t **conn);
epx_status_t epxi_bootstrap_exchange(const void *mine, void *all, size_t bytes, void *ctx);
void epxi_bootstrap_close(epxi_bootstrap_t *conn);

/* SHA-256 and HMAC-SHA256 (sha256.c), for the bootstrap's challenge-response; a comparison
 * whose time does not depend on where the inputs differ. */
#define EPXI_SHA256_BYTES 32
typedef struct {
  uint32_t h[8];
  uint64_t bytes;
  uint8_t buf[64];
  size_t fill;
} epxi_sha256_t;
void epxi_sha256_init(epxi_sha256_t *s);
void epxi_sha256_update(epxi_sha256_t *s, const void *data, size_t n);
void epxi_sha256_final(epxi_sha256_t *s, uint8_t out[EPXI_SHA256_BYTES]);
void epxi_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                      uint8_t out[EPXI_SHA256_BYTES]);
bool epxi_equal_ct(const void *a, const void *b, size_t n);

/* The calls below dispatch through group->ops (group.c). */
void epxi_group_destroy(epxi_group_t *group);
/* Every rank contributes `bytes` at `mine`; `all` receives nranks * bytes, rank-major.
 * `phase` names the step in the timeout message. */
epx_status_t epxi_group_allgather(epxi_group_t *group, int rank, const char *phase, int timeout_ms,
                                  const void *mine, size_t bytes, void *all);
/* Shares `bytes` at `mine` with the peers: all[r] is rank r's data, readable until this rank
 * enters its next barrier (the caller's "done reading" barrier; several shares may come
 * before it, and all of them stay readable). In-process the peers read the caller's memory
 * directly; a cross-process group copies through shared memory. */
epx_status_t epxi_group_share(epxi_group_t *group, int rank, const char *phase, int timeout_ms,
                              const void *mine, size_t bytes, const void **all);
epx_status_t epxi_group_barrier(epxi_group_t *group, int rank, const char *phase, int timeout_ms);
/* True once a wait of this group has failed (timeout, lost peer): the group is broken for
 * good. */
bool epxi_group_broken(const epxi_group_t *group);
/* Memory that every process of a cross-process group maps, zeroed when the group is made
 * (one page: *bytes gets its size), for words the ranks (and their GPUs, once registered)
 * read and write in place: the CUDA backend's error words. NULL in-process, where the ranks
 * share an address space anyway. */
void *epxi_group_common(epxi_group_t *group, size_t *bytes);
/* Whether rank r's process is gone or it left the group (cross-process; never in-process).
 * Does not wait. */
bool epxi_group_peer_lost(const epxi_group_t *group, int rank);
/* epx_comm_abort's and epx_comm_get_async_error's part of the group (see its ops). */
void epxi_group_abort(epxi_group_t *group, int rank);
epx_status_t epxi_group_error(const epxi_group_t *group, int rank, char *why, size_t size);

/* ---- the stamp of a collective call (call.c) ------------------------------------------ */

/* The collective calls (also what a rank that takes part only to fail names). */
typedef enum { EPXI_OP_NOTIFY, EPXI_OP_DISPATCH, EPXI_OP_NOTIFY_DISPATCH, EPXI_OP_COMBINE } epxi_op_t;
const char *epxi_op_name(epxi_op_t op);

struct epx_handle;
/* What every rank carries into the first exchange of a collective call: four 64-bit words,
 * compared whole, so that a call pairs only with the same call of every peer.
 *   call       the comm's call number (1, 2, ...), counted alike on every rank
 *   handle     the handle's creation number on the comm (0: the call has no valid handle)
 *   op         epxi_op_t;  status: this rank's verdict on its own arguments (an epx_status_t)
 *              (call: word 0; handle, op, status: word 1, in that order, little-endian)
 *   digest[0]  the handle's settings, packed: align, algo, layout, exact
 *   digest[1]  the call's own arguments, packed: part, every dtype of the call, weighted,
 *              scale_by_probs, which optional inputs and outputs are present
 * The digest words are packings, not hashes: equal words mean equal fields, and a
 * difference can be decoded to name the field. What stays local to a rank is left out (the
 * routing's form and id dtype, whether its weights are given: they are normalised before
 * anything crosses; x, y and out pointers, which may be NULL on a rank with no rows). */
typedef struct {
  uint64_t call;
  uint32_t handle; /* the low 32 bits of the creation number */
  uint16_t op;
  int16_t status;
  uint64_t digest[2];
} epxi_stamp_t;
_Static_assert(sizeof(epxi_stamp_t) == 32, "four 64-bit words");

/* The stamp of `op`, call number `call`, on `handle` (NULL: none): settings packed, no
 * arguments yet. */
epxi_stamp_t epxi_stamp_make(epxi_op_t op, uint64_t call, const struct epx_handle *handle);
/* Adds the call's arguments (NULL: none). */
void epxi_stamp_dispatch(epxi_stamp_t *s, const epx_dispatch_args_t *args);
void epxi_stamp_combine(epxi_stamp_t *s, const epx_combine_args_t *args);
/* Compares the stamps every rank carried (all[r] is rank r's), the same way on every rank:
 * first a rank that refused its arguments (its status for every rank; it keeps its own
 * message), then operation, call number and handle (EPX_ERR_OUT_OF_STEP), then the digest
 * (EPX_ERR_CONFIG_MISMATCH naming the field). `me` is the calling rank, `phase` names the
 * exchange in messages. */
epx_status_t epxi_stamp_compare(const epxi_stamp_t *all, int nranks, int me, const char *phase);
/* The part of the call a stamp opens (EPX_PART_ALL for epx_notify and whole calls). */
epx_part_t epxi_stamp_part(const epxi_stamp_t *s);
/* The name of the field that holds bit `bit` (0..63) of digest word `word` (0, 1): for a
 * backend that compares the digest words on the device and reports the lowest differing bit
 * (__ffsll of the XOR). */
const char *epxi_stamp_field(int word, int bit);
/* "epx_combine (call 7, handle 2)": the call a stamp opens (call 0: none). */
void epxi_stamp_describe(const epxi_stamp_t *s, char *buf, size_t n);
/* EPX_ERR_CONFIG_MISMATCH naming the first field in which s0 (rank r0's) and sr (rank r's)
 * differ, for rank `me`, as epxi_stamp_compare reports it. */
epx_status_t epxi_stamp_mismatch(const epxi_stamp_t *s0, int r0, const epxi_stamp_t *sr, int r, int me);

/* ---- checked sizes -------------------------------------------------------------------- */

/* a * b, or false when it does not fit an int64_t (inputs >= 0). */
static inline bool epxi_mul_i64(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }

/* ---- objects --------------------------------------------------------------------------- */

typedef struct epxi_backend epxi_backend_t;

/* Live objects (objects.c). Every public call looks its objects up in a registry before it
 * reads them, so a destroyed pointer is refused, not dereferenced. A comm's calls also take
 * the comm (one call at a time: EPX_ERR_BUSY for a second thread). */
typedef enum { EPXI_OBJ_WORLD = 1, EPXI_OBJ_COMM, EPXI_OBJ_HANDLE } epxi_obj_kind_t;
#define EPXI_MAGIC_WORLD 0x57505845u  /* "EXPW" */
#define EPXI_MAGIC_COMM 0x43505845u   /* "EXPC" */
#define EPXI_MAGIC_HANDLE 0x48505845u /* "EXPH" */
#define EPXI_MAGIC_DEAD 0xdeadbeefu
epx_status_t epxi_obj_register(void *obj, epxi_obj_kind_t kind);
/* Whether obj is a live object of that kind (a NULL obj is not). */
bool epxi_obj_live(const void *obj, epxi_obj_kind_t kind);
/* Runs fn(obj, arg) with the registry locked when obj is live (its destroy waits meanwhile):
 * returns fn's status, or EPX_ERR_INVALID_ARGUMENT naming `what`. fn must not wait. */
epx_status_t epxi_obj_with(const void *obj, epxi_obj_kind_t kind, const char *what,
                           epx_status_t (*fn)(void *obj, void *arg), void *arg);
/* Unregisters a live object (its destroy, once nothing refuses it): the object's magic is
 * poisoned. Returns false when obj was not live. */
bool epxi_obj_unregister(void *obj, epxi_obj_kind_t kind);

struct epx_world {
  uint32_t magic;        /* EPXI_MAGIC_WORLD while live */
  _Atomic int live_comms; /* its destroy is refused while > 0 */
  epx_backend_t backend;
  int nranks;            /* ranks of the whole group */
  int first_rank;        /* this process drives ranks [first_rank, first_rank + num_local): */
  int num_local;         /*   all of them (epx_world_create) or one (epx_world_create_rank*) */
  int devices[EPX_MAX_RANKS]; /* by global rank */
  const epxi_backend_t *ops;
  epxi_group_t *group;
  void *impl;            /* backend's per-world state */
};

struct epx_comm {
  uint32_t magic;        /* EPXI_MAGIC_COMM while live */
  _Atomic int in_call;   /* a thread is inside a call on the comm (or its handles) */
  _Atomic int live_handles; /* its destroy is refused while > 0 */
  epx_world_t *world;
  int rank, nranks;
  int num_local_experts; /* L */
  epx_config_t cfg;      /* after defaults */
  void *stream;
  _Atomic bool broken;
  /* a SEND half whose COMPLETE has not come: nothing else may run on the comm until it does
   * (its exchange would pair with the peers' COMPLETE) */
  const struct epx_handle *pending;
  bool pending_combine;
  uint64_t calls;        /* collective calls made on the comm (epx_notify, epx_dispatch, epx_combine) */
  uint64_t handles_made; /* epx_handle_create calls on the comm, failed ones included */
  epxi_stamp_t stamp;    /* the current call's, for the backend's first exchange */
  void *impl;            /* backend's per-comm state */
};

/* A normalised routing: int32 ids and float weights [T, K] (host memory). */
typedef struct {
  int64_t num_tokens;
  int topk;
  int32_t *idx;
  float *weights;
} epxi_topk_t;

struct epx_handle {
  uint32_t magic;        /* EPXI_MAGIC_HANDLE while live */
  epx_comm_t *comm;
  uint64_t id;           /* its creation number on the comm (from 1): the same on every rank */
  epx_handle_config_t hc;
  bool planned;
  bool dispatch_follows; /* during a notify made by epx_dispatch: a failing rank aborts both */
  void *impl;            /* backend's per-handle state */
  epx_node_traffic_t traffic; /* of the last dispatch and combine, counted by the backend */
};


/* What a backend implements. The core validates arguments first; a backend only checks
 * what needs its memory (contents of device arrays). */
struct epxi_backend {
  const char *name;
  epx_status_t (*world_create)(epx_world_t *world);
  void (*world_destroy)(epx_world_t *world);
  epx_status_t (*comm_init)(epx_comm_t *comm);
  void (*comm_destroy)(epx_comm_t *comm);
  epx_status_t (*handle_create)(epx_handle_t *handle);
  void (*handle_destroy)(epx_handle_t *handle);
  epx_status_t (*get_layout)(epx_comm_t *comm, const epx_routing_t *routing, int32_t *tokens_per_rank,
                             int32_t *tokens_per_expert, uint8_t *is_token_in_rank);
  epx_status_t (*notify)(epx_comm_t *comm, epx_handle_t *handle, const epx_routing_t *routing);
  epx_status_t (*handle_info)(const epx_handle_t *handle, epx_handle_info_t *info,
                              int32_t *tokens_per_local_expert);
  epx_status_t (*dispatch)(epx_comm_t *comm, epx_handle_t *handle, const epx_dispatch_args_t *args);
  epx_status_t (*combine)(epx_comm_t *comm, epx_handle_t *handle, const epx_combine_args_t *args);
  /* Optional. poll: a failure the device recorded since the last report, without waiting.
   * synchronize: wait for the comm's queued work, then report as poll does. */
  epx_status_t (*poll)(epx_comm_t *comm);
  epx_status_t (*synchronize)(epx_comm_t *comm);
  /* Takes part in `op` as far as the peers need to learn that this rank failed with `status`
   * (the argument checks in api.c found it), so none of them waits for it. */
  epx_status_t (*abort)(epx_comm_t *comm, epx_handle_t *handle, epxi_op_t op, epx_status_t status);
  /* Capabilities; the core refuses what a backend does not declare (a backend that leaves
   * them out gets the narrow defaults):
   *   wide_topk    takes topk up to EPX_MAX_TOPK (else up to EPXI_NARROW_TOPK)
   *   recv_budget  implements the expert layout's receive budget (epx_handle_config_t) */
  bool wide_topk;
  bool recv_budget;
  /* Whether the backend carries comm->stamp in every call's first exchange and its abort
   * takes part with any handle (NULL, another comm's: the abort then gets NULL) and in any
   * part (a lone COMPLETE: comm->stamp says the part), so that the peers fail at once. Without
   * a usable handle a backend whose exchanges depend on the handle's algorithm takes part as
   * it best can (the CUDA backend: as the comm's last algorithm would); a wrong guess must
   * still fail every rank at once (the stamp or phase comparison: EPX_ERR_OUT_OF_STEP).
   * Without it the core keeps refusing those calls without taking part. */
  bool stamped;
  /* Implements groups of several nodes (config.ranks_per_node < nranks): the node-aware
   * combine order and the handle's node traffic (core/nodes.c). */
  bool nodes;
  /* epx_comm_abort and epx_comm_get_async_error (any thread, never wait); NULL: the backend
   * has none, and the calls give EPX_ERR_UNSUPPORTED. The host backend's are the group's
   * (epxi_comm_abort_group, epxi_comm_group_error); a GPU backend also ends its device waits
   * and reports its device error word. */
  epx_status_t (*comm_abort)(epx_comm_t *comm);
  epx_status_t (*async_error)(epx_comm_t *comm, char *why, size_t size);
};

/* A call on one handle alone (api.c): takes the handle, refused unless it is live, and its
 * comm, refused while another thread is in a call on it (EPX_ERR_BUSY); give ends the call
 * with its status (no message on success). */
epx_status_t epxi_handle_take(const epx_handle_t *handle, const char *what);
epx_status_t epxi_handle_give(const epx_handle_t *handle, epx_status_t s);

/* The group part of the two hooks above (api.c). */
epx_status_t epxi_comm_abort_group(epx_comm_t *comm);
epx_status_t epxi_comm_group_error(epx_comm_t *comm, char *why, size_t size);

/* The top-k every backend takes: the CUDA kernels have been run up to this width. */
#define EPXI_NARROW_TOPK 16

extern const epxi_backend_t epxi_host_backend;
#ifdef EPX_HAVE_CUDA
extern const epxi_backend_t epxi_cuda_backend;
epx_status_t epxi_cuda_available(void);
/* Before a world of ranks [first_rank, first_rank + num_local) is made: the environment that
 * ranks of one process sharing a GPU need, set if they would (cuda/env.c). */
void epxi_cuda_world_env(const epx_world_config_t *wc, int first_rank, int num_local);
#endif

/* ---- routing (routing.c) --------------------------------------------------------------- */

/* Checks the routing's form and, reading host memory, its contents: ids in [-1, E), no
 * expert twice in a row, map rows with at most K experts. Writes the normalised topk form
 * into `out` (allocated; free with epxi_topk_free). */
epx_status_t epxi_topk_from_routing(const epx_routing_t *routing, int num_experts, int topk, epxi_topk_t *out);
void epxi_topk_free(epxi_topk_t *t);
/* Form-only checks that need no memory access (pointers, T, dtype). */
epx_status_t epxi_check_routing_form(const epx_routing_t *routing);
/* Layout of a normalised routing over nranks ranks of num_local experts; any output may be
 * NULL (see epx_get_layout). */
void epxi_count_layout(const epxi_topk_t *t, int nranks, int num_local, int32_t *tokens_per_rank,
                       int32_t *tokens_per_expert, uint8_t *is_token_in_rank);

/* ---- plan math (plan.c) ---------------------------------------------------------------- */

/* Everything every rank knows after the count exchange: per source rank s,
 *   tok[s * R + d]   tokens s sends to rank d (once per rank),
 *   pair[s * E + e]  (token, expert) pairs s routes to expert e. */
typedef struct {
  int nranks, num_experts, num_local;
  const int32_t *tok;
  const int32_t *pair;
} epxi_counts_t;

/* First token-layout row of source s's tokens on destination d. */
int64_t epxi_token_base(const epxi_counts_t *c, int d, int s);
/* Tokens arriving on d. */
int64_t epxi_recv_tokens(const epxi_counts_t *c, int d);
/* Pairs arriving for local expert l of rank d. */
int64_t epxi_expert_pairs(const epxi_counts_t *c, int d, int l);
/* First row of each local expert's block on d, blocks padded to `align` rows: block[0..L],
 * block[L] being the rows in use. */
void epxi_expert_blocks(const epxi_counts_t *c, int d, int align, int64_t *block);
/* The receive budget (docs/design.md, "Receive budget"): the pairs destination d keeps of
 * every source, kept[s * L + l] for its local expert l, given the pairs that would arrive
 * (c->pair), its budget in rows (0 = none) and the block alignment. Returns the pairs d drops. */
int64_t epxi_budget_keep(const epxi_counts_t *c, int d, int align, int64_t budget, int32_t *kept);
/* First row of source s's pairs inside expert l's block on d. */
int64_t epxi_expert_source_base(const epxi_counts_t *c, int d, int l, int s);
static inline int64_t epxi_round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

/* ---- nodes (nodes.c) ------------------------------------------------------------------- */

/* config.ranks_per_node: 0 or a divisor of nranks (at most nranks). */
epx_status_t epxi_nodes_check_config(const epx_config_t *cfg, int nranks);
/* The ranks of one node after defaults: 0 becomes nranks. */
int epxi_nodes_resolve(int ranks_per_node, int nranks);
/* EPX_ERR_UNSUPPORTED, on every rank alike, for several nodes on a backend without them. */
epx_status_t epxi_nodes_supported(const epxi_backend_t *ops, const epx_config_t *cfg, int nranks);

/* ---- a range allocator (suballoc.c) ---------------------------------------------------- */

/* First-fit ranges of [0, size), each rounded up to `align` (a power of two); host
 * bookkeeping only: what the memory is, the caller knows. */
typedef struct {
  size_t off, len;
  bool used;
} epxi_range_t;

typedef struct {
  size_t size, align, in_use;
  epxi_range_t *range; /* [n], covering [0, size) in address order */
  int n, cap;
} epxi_suballoc_t;

#define EPXI_SUBALLOC_FULL SIZE_MAX
int epxi_suballoc_init(epxi_suballoc_t *a, size_t size, size_t align); /* 0, or -1 */
void epxi_suballoc_destroy(epxi_suballoc_t *a);
/* The offset of a new range of at least `bytes`, or EPXI_SUBALLOC_FULL. */
size_t epxi_suballoc_alloc(epxi_suballoc_t *a, size_t bytes);
/* Frees the range that starts at off: 0, or -1 when none in use starts there. */
int epxi_suballoc_free(epxi_suballoc_t *a, size_t off);

/* ---- config (api.c) -------------------------------------------------------------------- */
epx_status_t epxi_check_row(epx_dtype_t dtype, int hidden, const char *what);

#ifdef __cplusplus
}
#endif
#endif
