/*
 * epx — expert-parallel exchange.
 *
 * Moves Mixture-of-Experts tokens between the ranks of an expert-parallel (EP) group:
 * dispatch sends each token to the ranks that hold its chosen experts, combine brings the
 * expert outputs back and reduces them per token, deterministically.
 *
 * Objects and their life cycles
 *   epx_world_t   the ranks this process drives (one for one-process-per-GPU, several for
 *                 emulation and tests). Created once, destroyed after every comm on it.
 *   epx_comm_t    one rank's endpoint. epx_comm_init is collective over the group: every rank
 *                 calls it (from its own thread when a process drives several ranks) and the
 *                 ranks compare their configs. Destroy after every handle on it.
 *   epx_handle_t  the plan of one dispatch (who sent what where), reused by combine and by
 *                 both backward passes. Create once per comm and algorithm, then re-plan it
 *                 with new routings as often as you like (its storage is sized once, which is
 *                 what lets low-latency mode live inside a CUDA graph). Any number of handles
 *                 may hold plans at once (a framework keeps one per MoE layer until that
 *                 layer's backward); the host backend's plan holds memory in proportion to
 *                 what it routed.
 *
 * Collective calls (epx_comm_init, epx_notify, epx_dispatch, epx_combine) must be made by
 * every rank of the group. A call blocks (CPU backend) or enqueues on the comm's stream
 * (CUDA backend); either way a process that drives several ranks calls each rank from its own
 * thread: epx_run_ranks does that for you. Every wait is bounded by the comm's timeout: a
 * peer that never arrives gives EPX_ERR_TIMEOUT, naming the phase and the peer, never a hang.
 * After a timeout the comm is broken: every later collective on it fails fast; destroy the
 * comms and the world and create them again. A call that a peer gave up on never returns
 * EPX_SUCCESS on any rank.
 *
 * Matching: every collective call carries, into its first exchange, the operation, the comm's
 * call number, the handle's identity (its creation number on the comm) and its settings, and the
 * call's own arguments (part, dtypes, flags, which optional arrays are given). Ranks in
 * different calls fail with EPX_ERR_OUT_OF_STEP (the comm is then broken); the same call with
 * different settings or arguments fails with EPX_ERR_CONFIG_MISMATCH naming the field (the comm
 * stays usable). A rank that refuses its own arguments still takes part, so its peers fail at
 * once with its status; only a NULL comm cannot. (CUDA backend: not yet; see the README.)
 *
 * Memory: every pointer handed to an operation lives where the comm's backend computes
 * (host memory for EPX_BACKEND_HOST, device memory for EPX_BACKEND_CUDA).
 *
 * Errors: every call returns an epx_status_t; epx_last_error() gives a thread-local message
 * with the details (which field, which rank, which token). Bad input corrupts nothing.
 *
 * Threads: a comm (and its handles) takes one call at a time. A call made while another
 * thread is inside a call on the same comm fails at once with EPX_ERR_BUSY and touches
 * nothing; the other call goes on. epx_comm_abort and epx_comm_get_async_error are the
 * exceptions: any thread, any time.
 *
 * Destroyed objects: every call checks that the world, comm or handle it is given is live
 * (a registry of live objects, so a destroyed pointer is never read): a destroyed one gives
 * EPX_ERR_INVALID_ARGUMENT, a second destroy too. What cannot be seen: a destroyed object's
 * address that malloc has since given to a new object of the same kind (the call then acts
 * on the new one).
 */
#ifndef EPX_H
#define EPX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define EPX_API __attribute__((visibility("default")))
#else
#define EPX_API
#endif

#define EPX_VERSION_MAJOR 0
#define EPX_VERSION_MINOR 1
#define EPX_VERSION_PATCH 0
#define EPX_VERSION_CODE (EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 + EPX_VERSION_PATCH)

/* The library's version at run time: EPX_VERSION_CODE of the epx.h it was built from. A
 * program may compare it with the EPX_VERSION_CODE it was compiled with; the structs below
 * are checked on every call anyway. */
EPX_API int epx_get_version(void);

/* A stable ABI: every config and argument struct that the caller fills (the world and comm
 * configs, handle configs, dispatch and combine arguments) starts with two fields that its
 * epx_*_init function sets: struct_size = sizeof the struct as the caller was compiled, and
 * struct_version = that epx.h's EPX_VERSION_CODE. The library refuses a struct whose size or
 * version (major and minor) is not its own with EPX_ERR_INVALID_ARGUMENT, so a program built
 * against another epx.h fails with a message instead of reading fields that are not there.
 * Always set a struct up with its init function, then change the fields you need. New fields
 * are added at the end. (epx_routing_t, epx_handle_info_t, epx_node_traffic_t and epx_unique_id_t are
 * fixed.) */

/* Limits the API checks against. */
#define EPX_MAX_RANKS 64
#define EPX_MAX_TOPK 32   /* the CUDA backend takes up to 16 (EPX_ERR_UNSUPPORTED at epx_comm_init) */
#define EPX_MAX_EXPERTS 4096
#define EPX_MAX_HIDDEN 65536
#define EPX_FP8_BLOCK 128 /* channels per fp8 scale */
#define EPX_MAX_TOKENS 2147483647LL /* tokens of one rank in one call (counts are int32) */

typedef enum {
  EPX_SUCCESS = 0,
  EPX_ERR_INVALID_ARGUMENT,   /* a value out of its documented domain not covered below */
  EPX_ERR_NULL_POINTER,       /* a required pointer is NULL */
  EPX_ERR_EXPERT_OUT_OF_RANGE,/* a routed expert id < -1 or >= num_experts */
  EPX_ERR_EXPERTS_NOT_DIVISIBLE, /* num_experts is not a multiple of the group size */
  EPX_ERR_TOPK_RANGE,         /* topk < 1 or > EPX_MAX_TOPK, or a routing map row with more than topk experts */
  EPX_ERR_HIDDEN_RANGE,       /* hidden < 1 or > EPX_MAX_HIDDEN */
  EPX_ERR_ROW_ALIGNMENT,      /* a GPU-facing row (hidden * element size) is not a multiple of 16 bytes,
                                 or a buffer of such rows does not start at a 16-byte boundary */
  EPX_ERR_OUTPUT_TOO_SMALL,   /* an output's capacity is below what the operation must write */
  EPX_ERR_LL_OVERFLOW,        /* low-latency mode: more tokens than max_tokens_per_rank */
  EPX_ERR_CONFIG_MISMATCH,    /* ranks of one group passed different configs */
  EPX_ERR_TIMEOUT,            /* a peer did not arrive within the comm's timeout */
  EPX_ERR_PEER_LOST,          /* a peer left the group (its process died) */
  EPX_ERR_UNSUPPORTED,        /* backend or feature not available in this build or on this machine */
  EPX_ERR_OUT_OF_MEMORY,      /* an allocation failed */
  EPX_ERR_SYSTEM,             /* an operating-system call failed */
  EPX_ERR_CUDA,               /* a CUDA call failed */
  EPX_ERR_BROKEN,             /* the comm is unusable after an earlier timeout or peer loss */
  EPX_ERR_INTERNAL,           /* a bug in epx */
  EPX_ERR_OUT_OF_STEP,        /* the ranks are in different collective calls (operation, call number or
                                 handle differ): the comm is broken */
  EPX_ERR_BUSY,               /* the object is in use: another thread is in a call on the comm, or a
                                 world still has comms, a comm still has handles */
  EPX_NUM_STATUS
} epx_status_t;

/* A static string naming the status ("EPX_ERR_TIMEOUT: ..."). Never NULL. */
EPX_API const char *epx_status_string(epx_status_t status);
/* The calling thread's message about its last epx call: why it failed, or "" if it succeeded. */
EPX_API const char *epx_last_error(void);

typedef enum {
  EPX_FLOAT32 = 0,
  EPX_BFLOAT16,
  EPX_FP8_E4M3,  /* one byte, saturating at +-448, with float32 scales per EPX_FP8_BLOCK channels */
  EPX_INT32,
  EPX_INT64,
  EPX_BOOL       /* one byte, 0 or 1 */
} epx_dtype_t;

EPX_API size_t epx_dtype_size(epx_dtype_t dtype);
EPX_API const char *epx_dtype_name(epx_dtype_t dtype);

typedef enum {
  EPX_BACKEND_HOST = 0, /* CPU threads as ranks: the reference semantics */
  EPX_BACKEND_CUDA,     /* CUDA kernels; several ranks may share a GPU */
  EPX_BACKEND_AUTO      /* CUDA when a GPU is present and the build has it, else HOST */
} epx_backend_t;

EPX_API const char *epx_backend_name(epx_backend_t backend);
/* EPX_SUCCESS when the backend can run here; EPX_ERR_UNSUPPORTED with a message otherwise. */
EPX_API epx_status_t epx_backend_available(epx_backend_t backend);

/* ------------------------------------------------------------------------------------------
 * Scalar conversions. These are the exact roundings every backend uses.
 * ---------------------------------------------------------------------------------------- */
/* NaN rule (docs/design.md): a row copied without conversion keeps its bits; every NaN that a
 * narrowing conversion or arithmetic makes is the canonical one of its type: float32
 * 0x7FFFFFFF, bf16 0x7FFF, e4m3 0x7F. */
EPX_API uint16_t epx_float_to_bf16(float x);   /* round to nearest even; NaN -> 0x7FFF */
EPX_API float epx_bf16_to_float(uint16_t x);   /* exact: the bits shifted up (NaN payloads too) */
EPX_API uint8_t epx_float_to_e4m3(float x);    /* round to nearest even, saturating at +-448; NaN -> 0x7F */
EPX_API float epx_e4m3_to_float(uint8_t x);    /* exact; NaN -> 0x7FFFFFFF */
/* Quantise one row of `hidden` floats: ceil(hidden / EPX_FP8_BLOCK) scales. For each block,
 * a = max(max|x|, 1e-4f); q = e4m3(x * (448 / a)); scale = a / 448. */
EPX_API void epx_quantize_row_e4m3(const float *x, int hidden, uint8_t *q, float *scales);

/* ------------------------------------------------------------------------------------------
 * World and comm.
 * ---------------------------------------------------------------------------------------- */
typedef struct epx_world epx_world_t;
typedef struct epx_comm epx_comm_t;
typedef struct epx_handle epx_handle_t;

typedef struct {
  uint32_t struct_size;    /* set by epx_world_config_init: sizeof this struct */
  uint32_t struct_version; /* set by epx_world_config_init: EPX_VERSION_CODE */
  epx_backend_t backend;
  int nranks;          /* ranks in the group, all driven by this process: 1..EPX_MAX_RANKS */
  const int *devices;  /* CUDA: device of each rank; NULL puts rank r on device r % count */
} epx_world_config_t;

EPX_API void epx_world_config_init(epx_world_config_t *wc);
EPX_API epx_status_t epx_world_create(const epx_world_config_t *wc, epx_world_t **world);
/* Frees the world. Every comm on it must be destroyed first: a world with live comms is
 * refused with EPX_ERR_BUSY and left as it was. */
EPX_API epx_status_t epx_world_destroy(epx_world_t *world);
EPX_API int epx_world_nranks(const epx_world_t *world);
EPX_API epx_backend_t epx_world_backend(const epx_world_t *world);

/* ---- groups across processes (one process per GPU) ------------------------------------
 * NCCL-style: one rank calls epx_get_unique_id (which starts the bootstrap listener on this
 * host), the caller shares the id with the other processes however it likes, and every
 * process calls epx_world_create_rank with it. The id is a secret (a random key; the
 * listener admits only processes that prove they hold it, without sending it): whoever
 * holds it can join the group as a missing rank or make the group fail, nobody else can.
 * Every rank must run as one user; a rank's unix socket admits only the peer processes
 * the group announced. Alternatively bootstrap over the caller's own
 * allgather (e.g. torch.distributed). The world then drives one rank: the one given.
 *
 * Both backends work this way; every process must be on this host. On CUDA (wc->devices[rank]
 * is this process's device; several processes may share one GPU, which the driver
 * time-slices) each rank's comm makes one device arena at epx_comm_init that its peers map
 * through CUDA IPC: everything they read lives there, including copies of the caller's x
 * (dispatch), y and row weight gradients (combine). Its size follows the config (see the
 * README); the environment variable EPX_IPC_ARENA_MB sets it in MiB, and a buffer that would
 * not fit fails with EPX_ERR_OUT_OF_MEMORY naming it. Across processes epx_comm_destroy meets
 * the peers' (bounded by the timeout) before it frees the arena, so destroy the comms of a
 * group together. A rank whose process dies makes the others fail with EPX_ERR_PEER_LOST
 * naming it, at the latest when their waits time out. */
#define EPX_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[EPX_UNIQUE_ID_BYTES];
} epx_unique_id_t;

EPX_API epx_status_t epx_get_unique_id(epx_unique_id_t *id);
/* wc->nranks is the size of the whole group; this process drives `rank`. Collective over the
 * processes; bounded by EPX_TIMEOUT_MS. */
EPX_API epx_status_t epx_world_create_rank(const epx_world_config_t *wc, const epx_unique_id_t *id, int rank,
                                           epx_world_t **world);
/* Gathers `bytes` from every rank into all (rank-major); returns 0 on success. Called a few
 * times during the world's creation only, from the creating thread. */
typedef int (*epx_allgather_fn)(const void *mine, void *all, size_t bytes, void *ctx);
EPX_API epx_status_t epx_world_create_rank_with(const epx_world_config_t *wc, int rank, epx_allgather_fn allgather,
                                                void *ctx, epx_world_t **world);

typedef struct {
  uint32_t struct_size;    /* set by epx_config_init: sizeof this struct */
  uint32_t struct_version; /* set by epx_config_init: EPX_VERSION_CODE */
  int num_experts;          /* E, a multiple of the group size */
  int hidden;               /* H */
  int topk;                 /* K, 1..EPX_MAX_TOPK */
  int max_tokens_per_rank;  /* low-latency capacity; also sizes the CUDA backend's buffers. Ranks
                               may pass different values: epx_comm_init takes the group's largest
                               (epx_comm_config shows it), so every rank's tokens fit */
  int num_sms;              /* SM budget of every GPU launch of this comm (default 16) */
  int timeout_ms;           /* bound of every wait; 0 takes EPX_TIMEOUT_MS (default 30000) */
  int ranks_per_node;       /* ranks per node (GPUs joined by NVLink; nodes joined by a network):
                               node n holds ranks [n * ranks_per_node, (n + 1) * ranks_per_node).
                               0 or nranks: one node. Otherwise a divisor of nranks; combine then
                               pre-reduces inside each node (docs/design.md, "Nodes"). The host
                               backend simulates nodes; CUDA refuses them (EPX_ERR_UNSUPPORTED). */
} epx_config_t;

EPX_API void epx_config_init(epx_config_t *cfg);

/* Collective over the group. Checks the config, then compares it with every other rank's:
 * any difference fails on every rank with EPX_ERR_CONFIG_MISMATCH naming the field and the
 * ranks, except max_tokens_per_rank (the group's maximum is taken) and timeout_ms. */
EPX_API epx_status_t epx_comm_init(epx_world_t *world, int rank, const epx_config_t *cfg, epx_comm_t **comm);
/* A comm with live handles, or one another thread is calling, is refused with EPX_ERR_BUSY
 * and left as it was. */
EPX_API epx_status_t epx_comm_destroy(epx_comm_t *comm);
EPX_API int epx_comm_rank(const epx_comm_t *comm);
EPX_API int epx_comm_nranks(const epx_comm_t *comm);
EPX_API const epx_config_t *epx_comm_config(const epx_comm_t *comm);
/* CUDA: the stream the comm's work goes to (a cudaStream_t). NULL restores the comm's own
 * non-blocking stream. Ranks that share a GPU must not use the legacy default stream: it
 * would serialise the ranks' kernels, which wait on each other. The host backend ignores it. */
EPX_API epx_status_t epx_comm_set_stream(epx_comm_t *comm, void *stream);

/* Waits for the comm's queued work (CUDA: its stream), then returns the first failure its
 * kernels recorded since the last report: a timeout, an output too small, a bad routing on
 * some rank. This is how sync-free and graph-captured work learns its status. The host
 * backend reports everything when each call returns, so this returns EPX_SUCCESS there. */
EPX_API epx_status_t epx_comm_synchronize(epx_comm_t *comm);

/* For a framework's watchdog (what ncclCommAbort and ncclCommGetAsyncError are to NCCL).
 * Both may be called from any thread, also while another thread is inside a call on the
 * comm, and neither waits for anything.
 *
 * epx_comm_abort breaks the comm's group for good: every wait of this rank and of its peers
 * ends within milliseconds with EPX_ERR_BROKEN and a message that says which rank aborted;
 * every later collective on the group fails fast with EPX_ERR_BROKEN. Outputs of the calls
 * it cuts short are undefined (the sentinel rule does not hold for them). Aborting twice is
 * harmless. Then destroy the comms and the world and make them again. On the CUDA backend it
 * makes no CUDA call: it records the abort in the error words the kernels poll, so their
 * waits end too.
 *
 * epx_comm_get_async_error stores in *status what broke the comm or its group so far
 * (EPX_ERR_TIMEOUT, EPX_ERR_PEER_LOST, EPX_ERR_BROKEN after an abort; a peer process found
 * dead counts even if no wait has seen it yet), or EPX_SUCCESS, and returns the same status
 * with its message in epx_last_error(). A comm that is not live gives
 * EPX_ERR_INVALID_ARGUMENT and *status is left alone. CUDA: what this rank's kernels
 * recorded (no stream wait), then the group's state. */
EPX_API epx_status_t epx_comm_abort(epx_comm_t *comm);
EPX_API epx_status_t epx_comm_get_async_error(epx_comm_t *comm, epx_status_t *status);

/* Runs fn(rank, arg) on one thread per rank 0..nranks-1 and waits for all of them. Statuses
 * (may be NULL) receives each rank's return value; the call returns the first failure. */
typedef epx_status_t (*epx_rank_fn)(int rank, void *arg);
EPX_API epx_status_t epx_run_ranks(int nranks, epx_rank_fn fn, void *arg, epx_status_t *statuses);

/* ------------------------------------------------------------------------------------------
 * Routing, in either form.
 *   topk: topk_idx [T, K] int32 or int64 expert ids (-1 = no expert in that slot) and
 *         topk_weights [T, K] float32 (may be NULL: every weight is 1).
 *   map:  routing_map [T, E] bool (multi-hot) and probs [T, E] float32 (may be NULL). A row
 *         may hold at most K experts; they are taken in ascending expert id.
 * ---------------------------------------------------------------------------------------- */
typedef struct {
  int64_t num_tokens;       /* 0 <= T <= EPX_MAX_TOKENS */
  epx_dtype_t idx_dtype;    /* EPX_INT32 or EPX_INT64, for topk_idx */
  const void *topk_idx;     /* topk form: [T, K] */
  const float *topk_weights;
  const uint8_t *routing_map; /* map form: [T, E]; used when topk_idx is NULL */
  const float *probs;
} epx_routing_t;

/* Host-memory conversions between the forms. map -> topk fills slots in ascending expert id
 * and pads with -1 / 0.0f; topk -> map sums nothing: a repeated expert in one row is an
 * error (EPX_ERR_INVALID_ARGUMENT). */
EPX_API epx_status_t epx_map_to_topk(int64_t num_tokens, int num_experts, int topk, const uint8_t *routing_map,
                             const float *probs, int32_t *topk_idx, float *topk_weights);
EPX_API epx_status_t epx_topk_to_map(int64_t num_tokens, int num_experts, int topk, epx_dtype_t idx_dtype,
                             const void *topk_idx, const float *topk_weights, uint8_t *routing_map,
                             float *probs);

/* Layout of a routing on this rank (local, not collective; host memory on the host backend,
 * device memory on CUDA). Any output may be NULL.
 *   tokens_per_rank [R]: tokens that go to each rank (a token counts once per rank)
 *   tokens_per_expert [E]: (token, expert) pairs per global expert
 *   is_token_in_rank [T, R]: bool */
EPX_API epx_status_t epx_get_layout(epx_comm_t *comm, const epx_routing_t *routing, int32_t *tokens_per_rank,
                            int32_t *tokens_per_expert, uint8_t *is_token_in_rank);
/* The same layout from the group's shape alone, before any comm exists (a framework asks for
 * the layout before it knows the hidden size): nranks ranks of num_experts / nranks experts
 * each, K = topk columns of topk_idx. Host memory only; validates the routing as
 * epx_notify does. */
EPX_API epx_status_t epx_layout_counts(int nranks, int num_experts, int topk, const epx_routing_t *routing,
                                       int32_t *tokens_per_rank, int32_t *tokens_per_expert,
                                       uint8_t *is_token_in_rank);

/* ------------------------------------------------------------------------------------------
 * Handles: the plan of one dispatch.
 * ---------------------------------------------------------------------------------------- */
typedef enum {
  EPX_ALGO_HT = 0,   /* high-throughput fused path: prefill and training */
  EPX_ALGO_LL,       /* low-latency, fixed-shape path: decode, CUDA graphs */
  EPX_ALGO_ALLTOALL  /* permute -> all-to-all -> sort baseline */
} epx_algo_t;

typedef enum {
  EPX_LAYOUT_TOKEN = 0, /* one row per (source rank, source token), in that order */
  EPX_LAYOUT_EXPERT     /* one row per (token, local expert), grouped by local expert */
} epx_layout_t;

typedef struct {
  uint32_t struct_size;    /* set by epx_handle_config_init: sizeof this struct */
  uint32_t struct_version; /* set by epx_handle_config_init: EPX_VERSION_CODE */
  epx_algo_t algo;
  epx_layout_t layout;  /* EPX_ALGO_LL always uses the expert layout */
  int align;            /* expert layout: each expert's block padded to a multiple (>= 1) */
  int exact;            /* CUDA: 1 = epx_notify waits for the counts so the host knows them;
                           0 = sync-free, counts stay on the device. The host backend always
                           knows them. */
  int64_t recv_budget;  /* expert layout, EPX_ALGO_HT: at most this many rows (padding included)
                           arrive on this rank; pairs past it are dropped (docs/design.md,
                           "Receive budget"). 0 = no budget. Ranks may pass different budgets.
                           Backends that cannot drop refuse a budget with EPX_ERR_UNSUPPORTED
                           at epx_handle_create (the host and CUDA backends both drop). */
} epx_handle_config_t;

EPX_API void epx_handle_config_init(epx_handle_config_t *hc);
/* Local (not collective). The handle's identity is its creation number on the comm, failed
 * calls included: create a comm's handles in the same order on every rank. Its settings are
 * compared with the peers' at every collective call that uses it (EPX_ERR_CONFIG_MISMATCH
 * naming the field), not here. */
EPX_API epx_status_t epx_handle_create(epx_comm_t *comm, const epx_handle_config_t *hc, epx_handle_t **handle);
EPX_API epx_status_t epx_handle_destroy(epx_handle_t *handle);

/* Collective: plans a dispatch of this routing (layout, count exchange, receive positions).
 * The routing's memory may be reused once the call returns (CUDA: once the stream passes it;
 * CUDA low-latency handles plan inside the dispatch that follows, so there the routing must
 * stay unchanged until that dispatch). Validates every expert id; low-latency mode refuses
 * T > max_tokens_per_rank. */
EPX_API epx_status_t epx_notify(epx_comm_t *comm, epx_handle_t *handle, const epx_routing_t *routing);

typedef struct {
  int64_t num_send_tokens;   /* T of the planned routing */
  int64_t num_recv_tokens;   /* token layout rows; distinct (source rank, token) arriving */
  int64_t num_recv_rows;     /* expert layout rows, padding included */
  int64_t num_recv_pairs;    /* (token, local expert) pairs arriving */
  int64_t num_sent_copies;   /* (token, destination rank) crossings this rank sends */
} epx_handle_info_t;

/* Host-side sizes of the last plan. EPX_ERR_UNSUPPORTED in CUDA sync-free mode, where only
 * the device knows them. tokens_per_local_expert may be NULL ([L], unpadded pair counts). */
EPX_API epx_status_t epx_handle_info(const epx_handle_t *handle, epx_handle_info_t *info,
                             int32_t *tokens_per_local_expert);

/* Bytes that crossed a node boundary into this rank in the handle's last dispatch and last
 * combine, next to what one crossing per destination rank would have moved. Dispatch: the
 * rows this rank received from other nodes (on the node path, as a rail peer that forwards
 * them; rows of recv_dtype, fp8 with its scales, or x_dtype for an expert-layout
 * scale_by_probs replay). Combine: the rows of y_dtype that came back to this rank's tokens
 * from other nodes (one per node on the node path). Summed over the group, what crossed the
 * network. Low-latency mode crosses once per rank. 0 on one node. docs/design.md, "Nodes". */
typedef struct {
  int64_t dispatch_bytes, combine_bytes;           /* the node-aware path (low-latency: per rank) */
  int64_t dispatch_bytes_per_rank, combine_bytes_per_rank; /* a row to every remote rank */
} epx_node_traffic_t;

EPX_API epx_status_t epx_handle_node_traffic(const epx_handle_t *handle, epx_node_traffic_t *traffic);

/* ------------------------------------------------------------------------------------------
 * Dispatch.
 *
 * Token layout: recv_x [N, H], rows ordered by (source rank, source token); recv_topk_idx
 * [N, K] holds local expert ids of the slots that belong to this rank and -1 elsewhere;
 * recv_topk_weights [N, K] those weights and 0 elsewhere.
 *
 * Expert layout: one row per (token, local expert) pair, sorted by local expert, then by
 * (source rank, source token); each expert's block padded to a multiple of align rows, the
 * padding zeroed; recv_probs [rows] holds each row's weight (0 on padding).
 *
 * Low-latency: recv_x is [L, R * max_tokens_per_rank, H]; local expert l's rows start at
 * l * R * max_tokens_per_rank, packed in (source rank, source token) order; rows past the
 * count are left as they were. tokens_per_local_expert holds the counts.
 *
 * Called with a routing, epx_dispatch plans first (as epx_notify would). Called with NULL it
 * replays the handle's last plan: that is the gradient of combine (pass the output gradient
 * as x) and involves no layout work.
 * ---------------------------------------------------------------------------------------- */
/* Low-latency operations can be issued in two halves, so the caller can overlap other work
 * between them (DeepEP's receive hook, NCCL EP's send-only flag): SEND makes this rank's data
 * available to its peers and returns; COMPLETE (routing NULL) waits for the peers and finishes
 * with the arguments SEND was given (only its `part` is read). Between a SEND and its COMPLETE
 * no other operation may run on the comm; a CUDA graph holds both halves or neither. Every
 * other path does all its work in SEND and returns at once from COMPLETE. */
typedef enum {
  EPX_PART_ALL = 0,
  EPX_PART_SEND,
  EPX_PART_COMPLETE
} epx_part_t;

typedef struct {
  uint32_t struct_size;    /* set by epx_dispatch_args_init: sizeof this struct */
  uint32_t struct_version; /* set by epx_dispatch_args_init: EPX_VERSION_CODE */
  const void *x;              /* [T, H] */
  epx_dtype_t x_dtype;        /* EPX_FLOAT32 or EPX_BFLOAT16 */
  epx_dtype_t recv_dtype;     /* x_dtype, or EPX_FP8_E4M3 to quantise on the way */
  void *recv_x;               /* rows of H in recv_dtype */
  float *recv_scales;         /* fp8: [rows, ceil(H / 128)] */
  int64_t recv_capacity;      /* rows recv_x can hold (not used in low-latency mode) */
  int32_t *recv_topk_idx;     /* token layout, optional: [rows, K] */
  float *recv_topk_weights;   /* token layout, optional: [rows, K] */
  float *recv_probs;          /* expert layout, optional: [rows] */
  int32_t *tokens_per_local_expert; /* optional: [L] */
  int64_t *num_recv_rows;     /* optional: [1], rows written (padding included) */
  int scale_by_probs;         /* expert layout: multiply each row by its weight (float32
                                 product, rounded once): combine's backward */
  epx_part_t part;            /* EPX_PART_ALL unless split (see epx_part_t) */
  int32_t *dropped;           /* optional: [1], where the backend computes (CUDA: device
                                 memory): the pairs the whole group dropped past its receive
                                 budgets in this plan, 0 when none (the same on every rank).
                                 Written by backends that take a budget (low-latency mode,
                                 which has none, leaves it as it is on CUDA) */
} epx_dispatch_args_t;

EPX_API void epx_dispatch_args_init(epx_dispatch_args_t *args);
EPX_API epx_status_t epx_dispatch(epx_comm_t *comm, epx_handle_t *handle, const epx_routing_t *routing,
                          const epx_dispatch_args_t *args);

/* ------------------------------------------------------------------------------------------
 * Combine: the inverse of the handle's dispatch.
 *
 * Token layout: out[t] = round(sum over destination ranks d ascending of float(y_d[row(t)])).
 * Expert layout (and low-latency): on each destination d,
 *   partial_d[t] = round_y(sum over local experts l ascending of fl32(p[row] * float(y[row])))
 * (unweighted: p = 1); on the source, out[t] = round_out(sum over d ascending of partial_d[t]).
 * Sums are float32 left to right, products rounded before they are added.
 *
 * Weight gradients: with row_weight_grad (one float per received row; token layout: [rows, K])
 * each value is sent back to its topk slot of the source: topk_weight_grad [T, K] (0 for
 * slots that routed nowhere). That is the weight part of dispatch's gradient.
 * ---------------------------------------------------------------------------------------- */
typedef struct {
  uint32_t struct_size;    /* set by epx_combine_args_init: sizeof this struct */
  uint32_t struct_version; /* set by epx_combine_args_init: EPX_VERSION_CODE */
  const void *y;              /* rows of the handle's layout, H wide */
  epx_dtype_t y_dtype;        /* EPX_FLOAT32 or EPX_BFLOAT16; also the partials' type */
  void *out;                  /* [T, H] */
  epx_dtype_t out_dtype;      /* EPX_FLOAT32 or EPX_BFLOAT16 */
  int weighted;               /* expert layout: multiply rows by their weight */
  const float *row_probs;     /* weights to use: [rows]; NULL takes those the dispatch delivered */
  const float *row_weight_grad; /* optional, see above */
  float *topk_weight_grad;    /* [T, K], with row_weight_grad */
  epx_part_t part;            /* EPX_PART_ALL unless split (see epx_part_t) */
} epx_combine_args_t;

EPX_API void epx_combine_args_init(epx_combine_args_t *args);
EPX_API epx_status_t epx_combine(epx_comm_t *comm, epx_handle_t *handle, const epx_combine_args_t *args);

#ifdef __cplusplus
}
#endif
#endif /* EPX_H */
