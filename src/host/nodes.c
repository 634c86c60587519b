/* The host backend's nodes: the hierarchical path through rail peers (see nodes.h).
 *
 * A token of source s goes to node n's rail peer g = n * P + s % P once; g keeps, per rail
 * source (one per node, g's own local index), the tokens that come to its node in token
 * order. Every rank derives the whole layout from every rank's routing in notify: as a rail
 * peer where each forwarded token lands on its node's ranks, as a source where its tokens
 * sit in each rail peer's buffer, as a receiver where to read each arrival. */
#include "host/nodes.h"

#include <stdlib.h>
#include <string.h>

void epxh_nodes_clear(epxh_nodes_t *nd) {
  free(nd->fwd_tok);
  free(nd->fwd_rows);
  free(nd->slot);
  free(nd->recv_fwd);
  memset(nd, 0, sizeof *nd);
}

/* The ranks a token goes to (in_rank[R]); returns whether any. */
static bool token_ranks(const int32_t *row, int K, int L, int R, bool *in_rank) {
  bool any = false;
  memset(in_rank, 0, sizeof(bool) * R);
  for (int k = 0; k < K; k++)
    if (row[k] >= 0) in_rank[row[k] / L] = any = true;
  return any;
}

static bool hits_node(const bool *in_rank, int P, int n) {
  for (int j = 0; j < P; j++)
    if (in_rank[n * P + j]) return true;
  return false;
}

/* go[r * N + n]: tokens of rank r that go to node n; also this rank's arrivals. */
static void count_node_tokens(epxh_nodes_t *nd, int K, int L, const int64_t *T, const int32_t *const *idx, int64_t *go) {
  bool in_rank[EPX_MAX_RANKS];
  nd->num_recv = nd->recv_remote = nd->sent_remote = 0;
  for (int r = 0; r < nd->R; r++)
    for (int64_t t = 0; t < T[r]; t++) {
      if (!token_ranks(idx[r] + t * K, K, L, nd->R, in_rank)) continue;
      for (int n = 0; n < nd->N; n++) go[r * nd->N + n] += hits_node(in_rank, nd->P, n);
      if (in_rank[nd->me]) {
        nd->num_recv++;
        nd->recv_remote += r / nd->real_P != nd->me / nd->real_P;
      }
      if (r == nd->me)
        for (int d = 0; d < nd->R; d++) nd->sent_remote += in_rank[d] && d / nd->real_P != nd->me / nd->real_P;
    }
}

/* First row of rail source s's region in node n's rail peer: the regions of the sources of
 * s's rail on the nodes before s's. */
static int64_t region_start(const epxh_nodes_t *nd, const int64_t *go, int s, int n) {
  int64_t base = 0;
  for (int m = 0; m < s / nd->P; m++) base += go[(m * nd->P + s % nd->P) * nd->N + n];
  return base;
}

/* One pass over every source in order: token rows on this node's ranks as the sources'
 * tokens arrive, the rail peer's forward rows, the source's slots, the receiver's reads. */
static void place_tokens(epxh_nodes_t *nd, int K, int L, const int64_t *T, const int32_t *const *idx, const int64_t *go) {
  const int R = nd->R, P = nd->P, N = nd->N, mine = nd->my_node;
  bool in_rank[EPX_MAX_RANKS];
  int64_t row_on[EPX_MAX_RANKS] = {0}; /* next token row on rank mine * P + j */
  int64_t arrival = 0;
  for (int s = 0; s < R; s++) {
    const bool rail = s % P == nd->me % P;
    int64_t fwd = nd->region[s / P];                  /* next forward row here, as s's rail peer */
    int64_t to_here = region_start(nd, go, s, mine);  /* s's next row in this node's rail peer */
    int64_t next_slot[EPX_MAX_RANKS];
    for (int n = 0; n < N && s == nd->me; n++) next_slot[n] = region_start(nd, go, s, n);
    for (int64_t t = 0; t < T[s]; t++) {
      const bool any = token_ranks(idx[s] + t * K, K, L, R, in_rank);
      if (s == nd->me)
        for (int n = 0; n < N; n++) nd->slot[t * N + n] = any && hits_node(in_rank, P, n) ? next_slot[n]++ : -1;
      if (!any || !hits_node(in_rank, P, mine)) continue;
      if (in_rank[nd->me]) nd->recv_fwd[arrival++] = s / P == mine ? -1 : to_here;
      to_here++;
      if (rail) {
        nd->fwd_tok[fwd] = t;
        for (int j = 0; j < P; j++) nd->fwd_rows[fwd * P + j] = in_rank[mine * P + j] ? row_on[j] : -1;
        fwd++;
      }
      for (int j = 0; j < P; j++) row_on[j] += in_rank[mine * P + j];
    }
  }
}

epx_status_t epxh_nodes_plan(epxh_nodes_t *nd, const epx_comm_t *comm, bool flat, int K, int L,
                             const int64_t *num_tokens, const int32_t *const *idx) {
  epxh_nodes_clear(nd);
  nd->R = comm->nranks, nd->me = comm->rank, nd->real_P = comm->cfg.ranks_per_node, nd->flat = flat;
  nd->P = flat ? nd->R : nd->real_P, nd->N = nd->R / nd->P, nd->my_node = nd->me / nd->P;
  nd->num_tokens = num_tokens[nd->me];
  const int N = nd->N;
  int64_t *go = calloc((size_t)nd->R * N, sizeof(int64_t));
  if (!go) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "node plan");
  count_node_tokens(nd, K, L, num_tokens, idx, go);
  for (int n = 0; n < N; n++) nd->region[n + 1] = nd->region[n] + go[(n * nd->P + nd->me % nd->P) * N + nd->my_node];
  nd->fwd_tok = malloc(sizeof(int64_t) * (size_t)(nd->region[N] + 1));
  nd->fwd_rows = malloc(sizeof(int64_t) * (size_t)(nd->region[N] * nd->P + 1));
  nd->slot = malloc(sizeof(int64_t) * (size_t)(nd->num_tokens * N + 1));
  nd->recv_fwd = malloc(sizeof(int64_t) * (size_t)(nd->num_recv + 1));
  epx_status_t s = EPX_SUCCESS;
  if (!nd->fwd_tok || !nd->fwd_rows || !nd->slot || !nd->recv_fwd)
    s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "node plan");
  else
    place_tokens(nd, K, L, num_tokens, idx, go);
  free(go);
  return s;
}

void *epxh_nodes_forward_alloc(const epxh_nodes_t *nd, size_t row_bytes, epx_status_t *s) {
  void *fwd = malloc(nd->region[nd->N] ? (size_t)nd->region[nd->N] * row_bytes : 1);
  if (!fwd && *s == EPX_SUCCESS) *s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "dispatch forward buffer");
  return fwd;
}

epx_status_t epxh_nodes_forward(const epxh_nodes_t *nd, epx_comm_t *comm, const void *const *xs, size_t row_bytes,
                                size_t wire_bytes, void *fwd, const void **fwds, epx_node_traffic_t *traffic) {
  /* the rows of the rail sources on other nodes cross, once each */
  int64_t crossed = 0;
  for (int n = 0; n < nd->N; n++) {
    if (n == nd->my_node) continue;
    const char *x = xs[n * nd->P + nd->me % nd->P];
    for (int64_t k = nd->region[n]; k < nd->region[n + 1]; k++, crossed++)
      memcpy((char *)fwd + k * row_bytes, x + nd->fwd_tok[k] * row_bytes, row_bytes);
  }
  traffic->dispatch_bytes = (nd->flat ? nd->recv_remote : crossed) * (int64_t)wire_bytes;
  traffic->dispatch_bytes_per_rank = nd->recv_remote * (int64_t)wire_bytes;
  return epxi_group_share(comm->world->group, comm->rank, "dispatch:forward", comm->cfg.timeout_ms, fwd,
                          (size_t)nd->region[nd->N] * row_bytes, fwds);
}

/* The combine buffer: the node partials [region[N], H] of y_dtype, then (16-byte aligned)
 * this rank's own float32 ones [own rows, H] and three float rows of scratch. */
static size_t partials_bytes(const epxh_nodes_t *nd, int hidden, epx_dtype_t y_dtype) {
  return (size_t)epxi_round_up(nd->region[nd->N] * hidden * (int64_t)epx_dtype_size(y_dtype), 16);
}

static int64_t own_rows(const epxh_nodes_t *nd) { return nd->region[nd->my_node + 1] - nd->region[nd->my_node]; }

void *epxh_nodes_combine_alloc(const epxh_nodes_t *nd, int hidden, epx_dtype_t y_dtype, epx_status_t *s) {
  size_t bytes = partials_bytes(nd, hidden, y_dtype) + sizeof(float) * (size_t)(own_rows(nd) + 3) * hidden;
  void *buf = malloc(bytes);
  if (!buf && *s == EPX_SUCCESS) *s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "combine node partials");
  return buf;
}

/* The rail peer's node partials: per forwarded token, its node's values in rank order,
 * float32; rounded to y_dtype where they cross (remote sources' regions, into fwd), kept
 * float32 for this rank's own tokens (into own). */
static void node_partials(const epxh_nodes_t *nd, const epxh_ops_t *ops, const void *const *vals, epx_dtype_t y_dtype,
                          int H, void *fwd, float *own, float *sub, float *v) {
  for (int n = 0; n < nd->N; n++)
    for (int64_t k = nd->region[n]; k < nd->region[n + 1]; k++) {
      for (int c = 0; c < H; c++) sub[c] = 0.0f;
      for (int j = 0; j < nd->P; j++) {
        const int64_t r = nd->fwd_rows[k * nd->P + j];
        if (r < 0) continue;
        ops->load(vals[nd->my_node * nd->P + j], y_dtype, r, H, v);
        for (int c = 0; c < H; c++) sub[c] += v[c];
      }
      ops->canonical(sub, H);
      if (n == nd->my_node)
        memcpy(own + (k - nd->region[n]) * H, sub, sizeof(float) * H);
      else
        ops->store(fwd, y_dtype, k, H, sub);
    }
}

epx_status_t epxh_nodes_combine(const epxh_nodes_t *nd, epx_comm_t *comm, const epxh_ops_t *ops,
                                const void *const *vals, epx_dtype_t y_dtype, void *out, epx_dtype_t out_dtype,
                                void *buf, epx_node_traffic_t *traffic) {
  const int H = comm->cfg.hidden, N = nd->N;
  const size_t row_bytes = (size_t)H * epx_dtype_size(y_dtype);
  float *own = (float *)((char *)buf + partials_bytes(nd, H, y_dtype)), *acc = own + own_rows(nd) * H, *sub = acc + H,
        *v = sub + H;
  node_partials(nd, ops, vals, y_dtype, H, buf, own, sub, v);
  const void *peers[EPX_MAX_RANKS];
  EPX_CHECK(epxi_group_share(comm->world->group, comm->rank, "combine:node-partials", comm->cfg.timeout_ms, buf,
                             (size_t)nd->region[N] * row_bytes, peers));
  /* Source side: the node partials in node order (the own node's in float32). */
  int64_t crossed = 0;
  for (int64_t t = 0; t < nd->num_tokens; t++) {
    for (int c = 0; c < H; c++) acc[c] = 0.0f;
    for (int n = 0; n < N; n++) {
      const int64_t k = nd->slot[t * N + n];
      if (k < 0) continue;
      const float *term = own + (k - nd->region[nd->my_node]) * H;
      if (n != nd->my_node) {
        ops->load(peers[n * nd->P + nd->me % nd->P], y_dtype, k, H, v);
        term = v, crossed++;
      }
      for (int c = 0; c < H; c++) acc[c] += term[c];
    }
    ops->canonical(acc, H);
    ops->store(out, out_dtype, t, H, acc);
  }
  traffic->combine_bytes = (nd->flat ? nd->sent_remote : crossed) * (int64_t)row_bytes;
  traffic->combine_bytes_per_rank = nd->sent_remote * (int64_t)row_bytes;
  return EPX_SUCCESS;
}
