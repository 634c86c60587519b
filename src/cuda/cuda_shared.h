/* What the CUDA backend's host side (backend.h, C11) and its kernels (*.cu) share: the
 * device-resident structures and the launchers' signatures.
 *
 * The model: ranks pull. Every operation is a few work kernels (which never wait on a peer)
 * framed by exchanges (one block, which does): an exchange publishes a few words to every
 * peer (pointers to this rank's data, a status) and waits until every peer has published;
 * work kernels then read peers' memory directly; a closing exchange tells the peers this rank
 * has finished reading theirs. An exchange is a kernel of its own, or the last part of one
 * block of a work kernel (notify's, the low-latency kernels'). A rank thus writes only its own
 * outputs, and only exchanges need the ranks to be co-resident. The low-latency kernels are
 * the exception: their sources push into inboxes on the destinations before they post (see
 * "The low-latency path" below). Peer pointers come from whatever transport made them: the
 * kernels do not care whether a peer is on this GPU or across NVLink. */
#ifndef EPX_CUDA_SHARED_H
#define EPX_CUDA_SHARED_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPXC_PAYLOAD_WORDS 6 /* what an exchange publishes (epxc_words_t) */
#define EPXC_STAMP_WORDS 4   /* the call's stamp (epxc_stamp_t) */
#define EPXC_SLOT_WORDS (EPXC_PAYLOAD_WORDS + EPXC_STAMP_WORDS + 2) /* then the phase tag and the verdict */
#define EPXC_PHASE_TAG 0x6570780000000000ull
/* What notify's sources push to a rank (epxc_state_t.notify_in): 1 + R + L ints from each of R. */
#define EPXC_NOTIFY_IN_INTS (EPX_MAX_RANKS * (1 + EPX_MAX_RANKS) + EPX_MAX_EXPERTS)

/* What an exchange publishes, by kind of exchange. The first word of every kind is the rank's
 * status (epx_status_t: a failure makes every rank skip the operation); addresses are the
 * publisher's own (a reader reaches them through peer_ptr, see epxc_group_t). */
typedef struct {
  uint64_t status;
  uint64_t plan;       /* epxc_plan_t *: its plan, whose send side the readers take in */
  uint64_t num_tokens;
} epxc_notify_words_t;

typedef struct { /* high-throughput dispatch */
  uint64_t status;
  uint64_t x;          /* the rows destinations pull: the caller's x, or its copy in the arena */
} epxc_ht_dispatch_words_t;

typedef struct { /* all-to-all dispatch: the send buffer (epxc_a2a_t) destinations pull chunks of */
  uint64_t status;
  uint64_t send_x, send_scales, send_token, send_weight;
} epxc_a2a_dispatch_words_t;

typedef struct { /* low-latency dispatch and combine: the data came before, pushed (ll.cu) */
  uint64_t status;
  uint64_t parity;     /* the half of every peer's inbox this rank pushed into */
} epxc_ll_words_t;

typedef struct { /* the framed combines (high-throughput, all-to-all) */
  uint64_t status;
  uint64_t rows;       /* the rows sources pull back: y, or the partials */
  uint64_t row_weight_grad; /* float *: the row weight gradients, NULL when not asked for */
} epxc_combine_words_t;

typedef union {
  uint64_t word[EPXC_PAYLOAD_WORDS];
  uint64_t status;     /* word 0 of every kind */
  epxc_notify_words_t notify;
  epxc_ht_dispatch_words_t ht_dispatch;
  epxc_a2a_dispatch_words_t a2a_dispatch;
  epxc_ll_words_t ll;
  epxc_combine_words_t combine;
} epxc_words_t;

/* The stamp of the collective call an exchange opens (core/call.c, epxi_stamp_t, copied word
 * for word): word 0 the comm's call number; word 1 the handle id (bits 0-31) and the operation
 * (bits 32-47), the status bits (48-63) left 0 (the payload's status word carries it); words
 * 2, 3 the digest of the handle's settings and the call's arguments. All zero in the
 * exchanges that open no call (closing exchanges). */
typedef struct {
  uint64_t word[EPXC_STAMP_WORDS];
} epxc_stamp_t;

/* One mailbox: `flag` is the exchange's epoch once the words are valid; then the phase tag,
 * and the poster's verdict on the exchange once its own wait ran out (EPXC_VERDICT: it is
 * deciding, or it gave up; see exchange_wait), which a late reader must respect. */
typedef struct {
  uint64_t flag;
  epxc_words_t words;
  epxc_stamp_t stamp;
  uint64_t phase_tag;
  uint64_t verdict;
} epxc_slot_t;

/* A verdict names its exchange's epoch: one left from an earlier exchange means nothing. */
enum { EPXC_VERDICT_DONE = 0, EPXC_VERDICT_DECIDING = 1, EPXC_VERDICT_GAVE_UP = 2 };
#define EPXC_VERDICT(epoch, v) (((uint64_t)(epoch) << 2) | (uint64_t)(v))

/* A low-latency handle's inboxes as its rank publishes them in its state: sources push rows
 * there before they post, so they must find them without an exchange. */
#define EPXC_LL_INBOXES 64
typedef struct {
  uint64_t key;            /* the handle's id (from 1) while it lives, 0: free */
  uint64_t dispatch_inbox; /* the owner's addresses (peers reach them through peer_ptr) */
  uint64_t combine_inbox;
  uint64_t shape[2];       /* epxc_ll_shape_key: a pusher's shape must be the same */
} epxc_ll_inbox_t;

/* Per rank, in its device memory; peers write its mailboxes. */
typedef struct {
  epxc_slot_t post[2][EPX_MAX_RANKS];            /* [exchange parity][source rank] */
  epxc_words_t got[EPX_MAX_RANKS];               /* last exchange's payloads, copied here */
  uint64_t seq;                                  /* exchanges this rank has entered */
  /* low-latency kernels: blocks of one launch meet through these (see ll.cu) */
  uint32_t ll_arrivals;                          /* blocks of the running launch that have pushed */
  uint32_t pad_;
  uint64_t ll_ready;                             /* exchange whose verdict block 0 has recorded */
  /* where peers push to this rank's low-latency handles: the entry of handle id i is at
   * i % EPXC_LL_INBOXES (ll_create; a live handle holding it refuses another) */
  epxc_ll_inbox_t ll_inbox[EPXC_LL_INBOXES];
  int32_t aborted;                               /* a wait failed: every later kernel is a no-op */
  int32_t group_status;                          /* first failure a rank reported in the last exchange */
  /* Notify: what each source pushed here once its counts were known (layout.cu, close_notify).
   * notify_flag[q]: the epoch of the notify exchange whose counts source q pushed last;
   * notify_in from q * (1 + R + L): q's routing status, its tokens per rank, its pairs of each
   * of this rank's local experts. One copy is enough: a source pushes only after the exchange
   * of the same notify, which this rank enters only once its previous notify has finished
   * reading. */
  uint64_t notify_flag[EPX_MAX_RANKS];
  int32_t notify_in[EPXC_NOTIFY_IN_INTS];
} epxc_state_t;

/* Per rank, in host-mapped memory so the host reads it without a sync, and peers' kernels
 * see a failed rank at once. */
typedef struct {
  int32_t status; /* epx_status_t */
  int32_t phase;  /* epxc_phase_t */
  int32_t peer;   /* the rank waited for, or the rank that reported the failure */
  int16_t ref_phase, peer_phase; /* EPX_ERR_OUT_OF_STEP: the exchanges rank 0 and `peer` were in */
  int64_t detail; /* e.g. the offending token */
  /* What an exchange found when the stamps differ (rank 0's against `peer`'s, the lowest rank
   * whose stamp differs from rank 0's):
   *   EPX_ERR_OUT_OF_STEP      rank 0's stamp words 0, 1, then the peer's words 0, 1
   *   EPX_ERR_CONFIG_MISMATCH  the call's words 0, 1 (the same on both), then rank 0's and the
   *                            peer's digest word `detail >> 8` (detail & 63: its lowest
   *                            differing bit) */
  uint64_t about[4];
} epxc_error_t;
/* Across processes the error words are the group's common page (src/transport/shm.c). */
#ifdef __cplusplus
static_assert(sizeof(epxc_error_t) * EPX_MAX_RANKS <= 4096, "every rank's error word fits one page");
#else
_Static_assert(sizeof(epxc_error_t) * EPX_MAX_RANKS <= 4096, "every rank's error word fits one page");
#endif

typedef enum {
  EPXC_PH_NOTIFY = 0, /* notify has no closing exchange (epxc_state_t.notify_in) */
  EPXC_PH_DISPATCH,
  EPXC_PH_DISPATCH_DONE,
  EPXC_PH_COMBINE,
  EPXC_PH_COMBINE_DONE,
  EPXC_PH_LL_DISPATCH,
  EPXC_PH_LL_COMBINE,
  EPXC_PH_LAYOUT,
  EPXC_PH_COUNT
} epxc_phase_t;

/* What every kernel needs to reach the group: the seam between the kernels and a transport.
 * The transport that made the comm (src/cuda/transport_*.c) fills state[] and delta[]; the
 * world fills errors. Passed by value.
 *
 * Addresses a peer publishes (exchange words, the pointers inside its plan) are its own. In
 * one process they are this rank's too (delta 0); across processes each rank maps every
 * peer's arena wherever CUDA IPC put it, so a peer's address p is reached at p + delta[peer]
 * (device helper peer_ptr). The flags a rank waits on are in its own state's mailboxes; the
 * error words every rank's kernels watch are errors[]. */
typedef struct {
  int rank, nranks;
  epxc_state_t *state[EPX_MAX_RANKS]; /* every rank's state, this one included, as reached here */
  epxc_error_t *errors;               /* [nranks], device view of the host-mapped array */
  uint64_t timeout_ns;
  int64_t delta[EPX_MAX_RANKS];       /* where each peer's addresses are here, minus where they are there */
} epxc_group_t;

/* What a rank reads of a peer's plan (its send side), with the pointers already translated
 * to this rank's address space: filled once per plan, right after the exchange that publishes
 * the plans (notify), so no other kernel translates them again. */
typedef struct {
  int64_t num_tokens, words;
  const int32_t *idx;
  const float *weight;
  const uint32_t *rank_bits;
  const int32_t *rank_pre;
  const uint32_t *exp_bits;
  const int32_t *exp_pre;
  const int32_t *counts;
  const int64_t *send_base;      /* its send_base[R] */
  const int64_t *pair_send_base; /* its [E + 1] */
  const int64_t *pair_base;      /* its [L, R]: where sources' pairs land on that rank */
  const int32_t *kept;           /* its [L, R]: of each source's pairs of local expert l, how many
                                    that rank keeps (the first ones); NULL: all */
  const int64_t *dropped;        /* the pairs that rank dropped past its receive budget */
} epxc_peer_t;

/* The plan of one dispatch, in device memory. The send side is written by this rank's notify
 * and read by peers; the receive side is derived from every rank's counts. Bitmaps have one
 * bit per token: bit t of rank_bits[d] says token t goes to rank d, of exp_bits[e] that it
 * chose expert e; *_pre holds the popcount of the words before, so a token's position among
 * those of its source that go to the same place is one popcount away. */
typedef struct epxc_plan {
  /* send side */
  int64_t num_tokens;
  int64_t words;          /* bitmap row stride, in 32-bit words */
  int32_t status;         /* first problem in this rank's routing, EPX_SUCCESS if none */
  int32_t group_status;   /* first problem any rank reported: the plan is void unless 0 */
  uint64_t bad_key;       /* (token << 16 | slot << 8 | status) of the first bad token: atomicMin */
  int32_t refused;        /* this rank's last dispatch wrote nothing (output too small): its
                             combine posts this, so every rank skips that combine */
  int32_t pad_;
  int32_t *idx;           /* [cap, K] normalised expert ids */
  float *weight;          /* [cap, K] weights, 0 on -1 slots */
  uint32_t *rank_bits;    /* [R, words] */
  int32_t *rank_pre;      /* [R, words] */
  uint32_t *exp_bits;     /* [E, words] */
  int32_t *exp_pre;       /* [E, words] */
  int32_t *counts;        /* [R + E]: tokens per destination rank, pairs per expert */
  /* receive side */
  epxc_peer_t peer[EPX_MAX_RANKS]; /* every rank's send side, this one's included */
  int64_t tok_base[EPX_MAX_RANKS];  /* first token row here of source s */
  int64_t dest_base[EPX_MAX_RANKS]; /* first token row of this rank's tokens on destination d */
  int64_t send_base[EPX_MAX_RANKS]; /* all-to-all: first send-buffer row of this rank's tokens for d */
  int64_t *pair_send_base; /* all-to-all: [E + 1] first send-buffer row of this rank's pairs of e */
  int64_t *pair_base;     /* [L, R]: first row of source s's pairs of local expert l */
  int32_t *kept;          /* [L, R]: how many of them this rank keeps, the first ones (all but
                             past a receive budget); NULL: all */
  int64_t dropped;        /* pairs this rank dropped past its receive budget */
  int64_t *block;         /* [L + 1]: first row of local expert l's block; block[L] = rows */
  int32_t *pairs_local;   /* [L] */
  int64_t num_recv;       /* tokens arriving */
  int64_t num_rows;       /* rows of the receive buffer in use (padding included) */
  int64_t num_pairs;
  int64_t sent_copies;
} epxc_plan_t;

/* How the blocks of one notify launch (layout.cu) meet, per handle, in device memory: kept
 * between launches, never cleared by the host after it is made (all zero, bad_key all ones).
 * The header is followed by ready[blocks] (uint64_t: the launch number once that build
 * ticket's sums are written), then sums[blocks][R + E] (int32_t: each row's popcount over the
 * ticket's words); `blocks` is the SM budget, the most build tickets a launch has. */
typedef struct {
  uint32_t ticket;  /* blocks of the running launch that have started */
  uint32_t pad_;
  uint64_t built;   /* build tickets of the running launch that are done (back to 0 at its end) */
  uint64_t epoch;   /* launches completed */
  uint64_t bad_key; /* the running launch's first refused token (atomicMin); all ones between launches */
} epxc_scan_t;

static inline size_t epxc_scan_bytes(int blocks, int rows) {
  return sizeof(epxc_scan_t) + sizeof(uint64_t) * (size_t)blocks + sizeof(int32_t) * (size_t)blocks * rows;
}

/* Everything a kernel needs to know about a comm's shapes. */
typedef struct {
  int nranks, rank, num_experts, num_local, topk, hidden, align, max_tokens;
  int ll;            /* low-latency layout: blocks of nranks * max_tokens rows */
  int expert_layout;
  int num_sms;
  int bulk_copies;   /* the device has the bulk-copy engine (sm_90 and later) and EPX_HT_PIPELINED is
                        not 0: see ht.cu */
  int ring_threads;  /* threads of a block of the kernels on lanes' rings on this device (epxc_ring_threads) */
  int64_t recv_budget; /* this rank's receive budget in rows (expert layout), 0: none */
} epxc_shape_t;

typedef struct {
  const void *x;
  epx_dtype_t x_dtype, recv_dtype;
  void *recv_x;
  float *recv_scales;
  int64_t recv_capacity;
  int32_t *recv_topk_idx;
  float *recv_topk_weights;
  float *recv_probs;
  int32_t *tokens_per_local_expert;
  int64_t *num_recv_rows;
  int32_t *dropped;    /* [1]: the pairs the group dropped past its receive budgets */
  int scale_by_probs;
  int report_capacity; /* record an output too small on the device (sync-free mode) */
  int part;            /* epx_part_t: low-latency kernels run the half asked for */
} epxc_dispatch_t;

typedef struct {
  const void *y;
  epx_dtype_t y_dtype;
  void *out;
  epx_dtype_t out_dtype;
  int weighted;
  const float *row_probs;
  const float *row_weight_grad;
  float *topk_weight_grad;
  void *partials;   /* expert layout: [num_recv, H] in y_dtype, this rank's */
  int64_t partial_rows; /* rows `partials` holds */
  int part;             /* epx_part_t */
  void *staged;     /* all-to-all: the rows pulled back, [sum of counts to each rank, H] */
} epxc_combine_t;

/* The all-to-all baseline's buffers: a send buffer on the source, rows grouped by destination
 * (token layout) or by expert (expert layout), and a staging buffer on the destination. */
typedef struct {
  void *send_x;
  float *send_scales;
  int32_t *send_token;  /* token layout: the source token of each send row */
  float *send_weight;   /* expert layout: the weight of each send row */
  void *stage_x;        /* expert layout: chunks as they arrive, (source, expert, token) order */
  float *stage_scales;
  float *stage_weight;
} epxc_a2a_t;

/* The low-latency path (ll.cu). Sources push: each writes its tokens' rows, and what the
 * destination needs to place them, into the destination's inbox, then posts; so every buffer
 * peers write is an inbox, double-buffered by the parity of the writer's own call count (the
 * parity travels in its post, epxc_ll_words_t), and a writer is at most one call ahead of a
 * reader of the older half (it cannot post call n + 1 before every peer has posted call n,
 * which each does only once it finished with call n - 1).
 *
 * The dispatch inbox holds a region per (half, source): a header (the source's token count,
 * its pairs per local expert of this rank, which of its tokens come here), a record per token
 * (epxc_ll_meta_t), the rows in the type they were staged in, and fp8 scales. The combine
 * inbox holds a region per (half, expert owner): each token's partial, then the row weight
 * gradients of its slots. */
#define EPXC_LL_SLOTS 16 /* slots a token's record holds: at least EPXC_MAX_TOPK */
typedef struct {
  int32_t n;                        /* the token's slots that chose an expert of this rank */
  int32_t pad_[3];
  int32_t slot[EPXC_LL_SLOTS];      /* local expert | source slot << 16, local experts ascending */
  int32_t ord[EPXC_LL_SLOTS];       /* the token's place among its source's tokens of that expert */
  float weight[EPXC_LL_SLOTS];      /* its routing weight */
} epxc_ll_meta_t;

typedef struct {
  size_t tokens, counts, rbits, meta, rows, scales, region; /* dispatch: offsets in a region, its size */
  size_t wgrad, combine_region;                     /* combine: the same (its rows at 0) */
  size_t row_bytes;                                 /* a staged row at its widest (float32) */
} epxc_ll_layout_t;

#ifdef __CUDACC__
#define EPXC_HD __host__ __device__
#else
#define EPXC_HD
#endif

static inline EPXC_HD size_t epxc_ll_round(size_t n) { return (n + 255) / 256 * 256; }

static inline EPXC_HD epxc_ll_layout_t epxc_ll_layout(int L, int K, int64_t M, int H) {
  epxc_ll_layout_t y;
  const size_t W = (size_t)(M + 31) / 32, B = (size_t)(H + 127) / 128;
  y.row_bytes = sizeof(float) * (size_t)H;
  y.tokens = 0; /* an int32_t, then padding to 16 bytes */
  y.counts = 16;
  y.rbits = y.counts + sizeof(int32_t) * (size_t)L;
  y.meta = epxc_ll_round(y.rbits + sizeof(uint32_t) * W);
  y.rows = epxc_ll_round(y.meta + sizeof(epxc_ll_meta_t) * (size_t)M);
  y.scales = epxc_ll_round(y.rows + y.row_bytes * (size_t)M);
  y.region = epxc_ll_round(y.scales + sizeof(float) * B * (size_t)M);
  y.wgrad = epxc_ll_round(y.row_bytes * (size_t)M);
  y.combine_region = epxc_ll_round(y.wgrad + sizeof(float) * (size_t)K * (size_t)M);
  return y;
}

/* What a pusher and the inbox's owner must agree on (epxc_ll_inbox_t.shape). */
static inline EPXC_HD void epxc_ll_shape_key(int R, int L, int K, int64_t M, int H, uint64_t key[2]) {
  key[0] = ((uint64_t)M << 32) | (uint32_t)H;
  key[1] = ((uint64_t)(uint32_t)R << 40) | ((uint64_t)(uint32_t)L << 16) | (uint32_t)K;
}

/* Per call half: what a dispatch leaves for the next dispatch (a replay) and for the combine. */
typedef struct {
  int64_t num_tokens;
  int32_t status;       /* this rank's routing: its first problem, EPX_SUCCESS if none */
  int32_t group_status; /* the dispatch's verdict: what it placed is void unless 0 */
  int32_t parity[EPX_MAX_RANKS]; /* the half of this rank's inbox each source pushed into */
} epxc_ll_step_t;

/* The device-resident counters, written by the kernels only. */
typedef struct {
  epxc_ll_step_t step[2];  /* by the parity of this rank's dispatches */
  uint64_t dispatches, combines;
  /* what a SEND half leaves for its COMPLETE: the exchange's epoch, and the step it used
   * (a dispatch's own; a combine's, that of the dispatch it inverts) */
  uint64_t dispatch_epoch, combine_epoch;
  int32_t dispatch_half, combine_half;
} epxc_ll_t;

/* A handle's buffers, fixed when it is made: kernels take them by value. */
typedef struct {
  epxc_ll_t *dev;
  int32_t *idx[2];          /* [max_tokens, K] this rank's normalised expert ids */
  float *weight[2];         /* [max_tokens, K] their weights, 0 on -1 slots */
  uint32_t *rank_bits[2];   /* [R, W]: bit t of row d: token t went to rank d */
  int32_t *recv_base[2];    /* [L, R]: first row here of source q's pairs of local expert l */
  char *dispatch_inbox;     /* [2][R] dispatch regions */
  char *combine_inbox;      /* [2][R] combine regions */
  uint64_t id;              /* the handle's id: where peers find the inboxes (epxc_state_t.ll_inbox) */
} epxc_ll_bufs_t;

/* Where a dispatch's plan finds its routing: the caller's, or (a low-latency replay) the
 * normalised copy the last dispatch kept. */
typedef struct {
  int64_t num_tokens;
  int replay;            /* no routing: re-plan from the last dispatch's normalised copy */
  const void *topk_idx;
  epx_dtype_t idx_dtype;
  const float *topk_weights;
  const uint8_t *routing_map;
  const float *probs;
} epxc_route_t;

/* ---- launchers (each returns cudaGetLastError() as an int) --------------------------- */

/* Loads every kernel of a family now and raises *stack to the most local memory per thread
 * any of them needs. With lazy loading a kernel's first launch may wait for the device to go
 * idle, and so does a launch that needs more stack than the device's limit: neither ever
 * happens while a peer's exchange spins on this rank. */
int epxc_preload_exchange(size_t *stack);
int epxc_preload_layout(size_t *stack);
int epxc_preload_ht(size_t *stack);
/* Threads of a block of the kernels on lanes' rings (ring.cuh) on a device that gives a block at
 * most optin_bytes of shared memory. */
int epxc_ring_threads(int optin_bytes);
/* Shared memory a block of the bulk-copy kernels takes: a device that gives a block less runs
 * the others (epxc_shape_t.bulk_copies off). */
size_t epxc_bulk_smem_need(void);
int epxc_preload_a2a(size_t *stack);
int epxc_preload_ll(size_t *stack);

/* Low-latency: one launch each. Dispatch plans (from `r`), pushes this rank's tokens into
 * their destinations' inboxes, meets the peers in one exchange and places what it received;
 * combine pushes partials back, meets, and sums. */
int epxc_ll_dispatch(const epxc_shape_t *s, const epxc_group_t *g, const epxc_ll_bufs_t *b, const epxc_route_t *r,
                     const epxc_dispatch_t *a, const epxc_stamp_t *stamp, void *stream);
int epxc_ll_combine(const epxc_shape_t *s, const epxc_group_t *g, const epxc_ll_bufs_t *b, const epxc_combine_t *a,
                    const epxc_stamp_t *stamp, void *stream);
/* Dynamic shared memory a low-latency dispatch block needs (its routing bitmaps), and the most
 * it may take. */
size_t epxc_ll_smem(int R, int E, int64_t max_tokens);
#define EPXC_LL_SMEM_MAX (80 * 1024)

/* Publishes `words` (NULL: none but a success status) and `stamp` (NULL: none, as a closing
 * exchange) to every peer's mailbox and waits for every peer's; the payloads land in this
 * rank's state->got. Phase tags and stamps are compared with rank 0's (a difference in the
 * phase, call number, handle or operation: EPX_ERR_OUT_OF_STEP, this rank stops; in the
 * digest: EPX_ERR_CONFIG_MISMATCH), then the status of every payload (read from status_dev
 * when that is given): the first failure is recorded in group_status and as this rank's
 * error. */
int epxc_exchange(const epxc_group_t *g, int phase, const epxc_words_t *words, const int32_t *status_dev,
                  const epxc_stamp_t *stamp, void *stream);

/* notify, in one launch: normalise and validate the routing into the plan (bitmaps, prefix
 * popcounts, counts), meet the peers (plan pointers, counts and statuses) and derive the
 * receive side. */
int epxc_notify(const epxc_shape_t *s, const epxc_group_t *g, epxc_plan_t *plan_dev, epxc_scan_t *scan,
                const epxc_route_t *r, const epxc_stamp_t *stamp, void *stream);

int epxc_layout(const epxc_shape_t *s, const epxc_group_t *g, int64_t num_tokens, const void *topk_idx, epx_dtype_t idx_dtype,
                const uint8_t *routing_map, int32_t *tokens_per_rank, int32_t *tokens_per_expert,
                uint8_t *is_token_in_rank, void *stream);

int epxc_dispatch(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                  const epxc_dispatch_t *a, void *stream);
int epxc_combine_partials(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                          const epxc_combine_t *a, void *stream);
/* The all-to-all baseline: permute on the source, whole chunks pulled, sorted on the
 * destination; combine pulls chunks back into `staged` and reduces from there. */
int epxc_a2a_permute(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev, const epxc_a2a_t *b,
                     const epxc_dispatch_t *a, void *stream);
int epxc_a2a_gather(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev, const epxc_a2a_t *b,
                    const epxc_dispatch_t *a, void *stream);
int epxc_a2a_pull_back(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                       const epxc_combine_t *a, void *stream);
int epxc_combine_reduce(const epxc_shape_t *s, const epxc_group_t *g, const epxc_plan_t *plan_dev,
                        const epxc_combine_t *a, void *stream);

/* Across processes peers reach only this rank's arena: rows they would read from the caller's
 * memory are copied there first. This copies the first n rows of `row_bytes` (a multiple of
 * 4) from src to dst, n being the plan's num_recv (EPXC_STAGE_RECV) or num_rows
 * (EPXC_STAGE_ROWS) as the device knows it. More than cap_rows refuses the combine (as an
 * output too small) instead. */
enum { EPXC_STAGE_RECV = 0, EPXC_STAGE_ROWS = 1 };
int epxc_stage_rows(const epxc_group_t *g, epxc_plan_t *plan_dev, int count, const void *src, void *dst,
                    int64_t row_bytes, int64_t cap_rows, int num_sms, void *stream);
int epxc_preload_stage(size_t *stack);

#ifdef __cplusplus
}
#endif
#endif
