/* The host backend's nodes (docs/design.md, "Nodes"): the hierarchical path through rail
 * peers, simulated. Ranks are grouped into nodes by rank number; a row that crosses a node
 * boundary is really carried by the rail peer (copied into its forward buffer, read from
 * there), and a combine's node partial is really formed by the rail peer, in the contract's
 * order. Crossings are counted as they are read. */
#ifndef EPX_HOST_NODES_H
#define EPX_HOST_NODES_H

#include "core/internal.h"

/* host.c's row conversions and its NaN rule for sums, so that both files convert alike. */
typedef struct {
  void (*load)(const void *base, epx_dtype_t dtype, int64_t row, int hidden, float *out);
  void (*store)(void *base, epx_dtype_t dtype, int64_t row, int hidden, const float *in);
  void (*canonical)(float *v, int hidden); /* a sum's NaN is the canonical one */
} epxh_ops_t;

/* One rank's part of a plan's node path. P is the node size the order uses (the config's,
 * or R for low-latency mode, whose order is flat); real_P is the config's, which decides
 * what crosses. A forward buffer (dispatch rows, combine partials) holds one region per rail
 * source, in node order, each its tokens that come to this node, in token order. */
typedef struct {
  int R, P, N, me, my_node, real_P;
  bool flat;          /* low-latency: what crosses is one row per remote rank */
  /* as a rail peer: the rail sources n * P + me % P */
  int64_t region[EPX_MAX_RANKS + 1]; /* first forward row of each source node's region */
  int64_t *fwd_tok;   /* [region[N]]: the token at its source */
  int64_t *fwd_rows;  /* [region[N], P]: its token-layout row on each rank of this node, -1 */
  /* as a source */
  int64_t num_tokens;
  int64_t *slot;      /* [T, N]: forward row of the token in node n's rail peer, -1 */
  /* as a receiver */
  int64_t num_recv;
  int64_t *recv_fwd;  /* [num_recv]: forward row at the rail peer; -1 when the source is on this node */
  /* crossings on the real nodes: arrivals from another node, (token, remote rank) pairs sent */
  int64_t recv_remote, sent_remote;
} epxh_nodes_t;

/* From every rank's routing (num_tokens[r], idx[r] [T_r, K] of ids in [-1, R * L)).
 * flat: the one-node order (low-latency mode). */
epx_status_t epxh_nodes_plan(epxh_nodes_t *nd, const epx_comm_t *comm, bool flat, int K, int L,
                             const int64_t *num_tokens, const int32_t *const *idx);
void epxh_nodes_clear(epxh_nodes_t *nd);

/* The buffers an operation's node path shares, allocated before the operation's first vote
 * (a vote is a barrier, which ends what was shared before it across processes); free them
 * after the caller's done-reading barrier. Dispatch: the forward rows (row_bytes each);
 * combine: the node partials in y_dtype and this rank's own float32 ones. */
void *epxh_nodes_forward_alloc(const epxh_nodes_t *nd, size_t row_bytes, epx_status_t *s);
void *epxh_nodes_combine_alloc(const epxh_nodes_t *nd, int hidden, epx_dtype_t y_dtype, epx_status_t *s);

/* Dispatch, after the group shared x (xs[r]): the rail peer copies the rows of its remote
 * rail sources into its forward buffer fwd and shares it (fwds[r]). wire_bytes: a row's
 * bytes as it crosses. */
epx_status_t epxh_nodes_forward(const epxh_nodes_t *nd, epx_comm_t *comm, const void *const *xs, size_t row_bytes,
                                size_t wire_bytes, void *fwd, const void **fwds, epx_node_traffic_t *traffic);
/* Where arrival n (from source src, its token tok) is read: its source's x, or the forward
 * buffer of this node's rail peer for that source. */
static inline const void *epxh_nodes_arrival(const epxh_nodes_t *nd, int64_t n, int src, int64_t tok,
                                             const void *const *xs, const void *const *fwds, int64_t *row) {
  if (nd->recv_fwd[n] < 0) {
    *row = tok;
    return xs[src];
  }
  *row = nd->recv_fwd[n];
  return fwds[nd->my_node * nd->P + src % nd->P];
}

/* Combine, after the group shared every rank's per-token values (vals[r]: token-layout rows
 * of y_dtype): the rail peer forms its node partials in buf (epxh_nodes_combine_alloc) and
 * shares them, and this rank sums its tokens' node partials into out [T, H]. */
epx_status_t epxh_nodes_combine(const epxh_nodes_t *nd, epx_comm_t *comm, const epxh_ops_t *ops,
                                const void *const *vals, epx_dtype_t y_dtype, void *out, epx_dtype_t out_dtype,
                                void *buf, epx_node_traffic_t *traffic);

#endif
