/* The CPU backend: ranks are threads, and this file is the readable statement of epx's
 * semantics that every GPU path is checked against bit for bit.
 *
 * Each collective follows the GPU's structure: notify exchanges counts and derives where
 * every row lands (core/plan.c), dispatch writes each row straight into its final position
 * on the receiver, combine reduces in the contract's order. Ranks see each other's arrays
 * through the group's pointer exchange. A failure found in the data (bad expert id, too many
 * tokens, an output too small) is voted on, so every rank returns it and none hangs. */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "host/nodes.h"

/* ---- rows in any element type ---------------------------------------------------------- */

/* The contract's special values: a row copied without conversion keeps its bits; every NaN
 * that arithmetic makes is the canonical float32 NaN (bf16 and e4m3 stores then give their
 * canonical NaNs too), as the GPU's arithmetic does. x86 arithmetic would instead keep an
 * input's payload (or give the negative "default" NaN). */
static float canonical(float v) {
  if (v == v) return v;
  const uint32_t nan = 0x7fffffffu;
  memcpy(&v, &nan, sizeof v);
  return v;
}

static void canonical_row(float *v, int hidden) {
  for (int c = 0; c < hidden; c++) v[c] = canonical(v[c]);
}

static void copy_row(void *dst, int64_t dst_row, const void *src, int64_t src_row, size_t row_bytes) {
  memcpy((char *)dst + dst_row * row_bytes, (const char *)src + src_row * row_bytes, row_bytes);
}

static void load_row(const void *base, epx_dtype_t dtype, int64_t row, int hidden, float *out) {
  if (dtype == EPX_FLOAT32) {
    memcpy(out, (const float *)base + row * hidden, sizeof(float) * hidden);
  } else {
    const uint16_t *p = (const uint16_t *)base + row * hidden;
    for (int c = 0; c < hidden; c++) out[c] = epx_bf16_to_float(p[c]);
  }
}

static void store_row(void *base, epx_dtype_t dtype, int64_t row, int hidden, const float *in) {
  if (dtype == EPX_FLOAT32) {
    memcpy((float *)base + row * hidden, in, sizeof(float) * hidden);
  } else {
    uint16_t *p = (uint16_t *)base + row * hidden;
    for (int c = 0; c < hidden; c++) p[c] = epx_float_to_bf16(in[c]);
  }
}

static int scale_blocks(int hidden) { return (hidden + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK; }

/* Writes one dispatched row in the receive type (fp8 rows carry their scales). */
static void store_recv_row(const epx_dispatch_args_t *a, void *recv_x, float *recv_scales, int64_t row, int hidden,
                           const float *in) {
  if (a->recv_dtype == EPX_FP8_E4M3)
    epx_quantize_row_e4m3(in, hidden, (uint8_t *)recv_x + row * hidden, recv_scales + row * scale_blocks(hidden));
  else
    store_row(recv_x, a->recv_dtype, row, hidden, in);
}

static void zero_recv_row(const epx_dispatch_args_t *a, void *recv_x, float *recv_scales, int64_t row, int hidden) {
  memset((char *)recv_x + row * hidden * epx_dtype_size(a->recv_dtype), 0, hidden * epx_dtype_size(a->recv_dtype));
  if (a->recv_dtype == EPX_FP8_E4M3) memset(recv_scales + row * scale_blocks(hidden), 0, sizeof(float) * scale_blocks(hidden));
}

/* ---- the plan ---------------------------------------------------------------------------- */

typedef struct {
  int nranks, rank, num_experts, num_local, topk, hidden, align, max_tokens;
  bool ll, expert_layout;
  /* counts of every rank, from notify */
  int32_t *tok;   /* [R, R] */
  int32_t *pair;  /* [R, E]: pairs that arrive (past a receive budget: those kept) */
  int32_t *routed; /* [R, E]: pairs routed, when a budget dropped some (else NULL) */
  int64_t num_dropped; /* pairs the whole group dropped */
  int64_t budget; /* this rank's receive budget in rows, 0 = none */
  epxi_counts_t counts;
  /* send side */
  epxi_topk_t route;   /* [T, K] */
  int64_t *dest_row;   /* [T, R]: token-layout row on each destination, -1 if not sent */
  int64_t *slot_row;   /* [T, K]: row of the slot's pair on its destination, -1 for -1 slots */
  /* receive side */
  int64_t num_recv;    /* tokens */
  int64_t num_rows;    /* rows of the receive buffer in use (expert layout: with padding) */
  int64_t num_pairs;
  int32_t *recv_src;   /* [N]: source rank */
  int64_t *recv_tok;   /* [N]: source token */
  int32_t *recv_local; /* [N, K]: local expert of each slot, -1 if not on this rank */
  float *recv_weight;  /* [N, K] */
  int64_t *recv_row;   /* [N, K]: expert-layout row of each slot, -1 if not on this rank */
  int32_t *pairs_per_local; /* [L] */
  int64_t *block;            /* [L + 1]: first row of each local expert's block here */
  epxh_nodes_t nodes;        /* the node path (host/nodes.c) */
} host_plan_t;

static void plan_clear(host_plan_t *p) {
  epxh_nodes_clear(&p->nodes);
  free(p->tok);
  free(p->pair);
  free(p->routed);
  epxi_topk_free(&p->route);
  free(p->dest_row);
  free(p->slot_row);
  free(p->recv_src);
  free(p->recv_tok);
  free(p->recv_local);
  free(p->recv_weight);
  free(p->recv_row);
  free(p->pairs_per_local);
  free(p->block);
  host_plan_t keep = *p;
  memset(p, 0, sizeof *p);
  p->nranks = keep.nranks, p->rank = keep.rank, p->num_experts = keep.num_experts;
  p->num_local = keep.num_local, p->topk = keep.topk, p->hidden = keep.hidden;
  p->align = keep.align, p->max_tokens = keep.max_tokens, p->ll = keep.ll, p->expert_layout = keep.expert_layout;
  p->budget = keep.budget;
}

static epx_status_t host_handle_create(epx_handle_t *h) {
  host_plan_t *p = calloc(1, sizeof *p);
  if (!p) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "host plan");
  const epx_comm_t *c = h->comm;
  p->nranks = c->nranks;
  p->rank = c->rank;
  p->num_experts = c->cfg.num_experts;
  p->num_local = c->num_local_experts;
  p->topk = c->cfg.topk;
  p->hidden = c->cfg.hidden;
  p->align = h->hc.align;
  p->max_tokens = c->cfg.max_tokens_per_rank;
  p->ll = h->hc.algo == EPX_ALGO_LL;
  p->expert_layout = h->hc.layout == EPX_LAYOUT_EXPERT;
  p->budget = h->hc.recv_budget;
  h->impl = p;
  return EPX_SUCCESS;
}

static void host_handle_destroy(epx_handle_t *h) {
  host_plan_t *p = h->impl;
  if (!p) return;
  plan_clear(p);
  free(p);
}

/* First row of each local expert's block on destination d (low-latency: fixed strides). */
static void expert_blocks(const host_plan_t *p, int d, int64_t *block) {
  if (!p->ll) return epxi_expert_blocks(&p->counts, d, p->align, block);
  for (int l = 0; l <= p->num_local; l++) block[l] = (int64_t)l * p->nranks * p->max_tokens;
}

static epx_status_t host_get_layout(epx_comm_t *comm, const epx_routing_t *routing, int32_t *tokens_per_rank,
                                    int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  epxi_topk_t t;
  EPX_CHECK(epxi_topk_from_routing(routing, comm->cfg.num_experts, comm->cfg.topk, &t));
  epxi_count_layout(&t, comm->nranks, comm->num_local_experts, tokens_per_rank, tokens_per_expert, is_token_in_rank);
  epxi_topk_free(&t);
  return EPX_SUCCESS;
}

/* Agrees on the first failure of any rank, and that every rank is in the same call with
 * the same settings: each carries the call's stamp (core/call.c) with its status. Every
 * operation opens with one, so a call can only pair with the same call of every peer. A rank
 * that failed keeps its own message, the others learn who failed. */
static epx_status_t agree(epx_comm_t *comm, const char *phase, epx_status_t mine) {
  epxi_stamp_t stamp = comm->stamp, all[EPX_MAX_RANKS];
  stamp.status = (int16_t)mine;
  EPX_CHECK(epxi_group_allgather(comm->world->group, comm->rank, phase, comm->cfg.timeout_ms, &stamp, sizeof stamp, all));
  return epxi_stamp_compare(all, comm->nranks, comm->rank, phase);
}

/* What the node path (host/nodes.c) borrows from this file. */
static const epxh_ops_t host_ops = {.load = load_row, .store = store_row, .canonical = canonical_row};

/* Shares `bytes` at `data` with the peers: peers[r] is rank r's copy, readable until the
 * caller's next barrier. */
static epx_status_t share(epx_comm_t *comm, const char *phase, const void *data, size_t bytes, const void **peers) {
  return epxi_group_share(comm->world->group, comm->rank, phase, comm->cfg.timeout_ms, data, bytes, peers);
}

static epx_status_t done_reading(epx_comm_t *comm, const char *phase) {
  return epxi_group_barrier(comm->world->group, comm->rank, phase, comm->cfg.timeout_ms);
}

static void *xcalloc(size_t n, size_t size, epx_status_t *s) {
  void *p = calloc(n ? n : 1, size);
  if (!p && *s == EPX_SUCCESS) *s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "host plan arrays");
  return p;
}

/* The receive budgets (one per destination, 0 = none), applied to the gathered counts: pair
 * then holds the pairs each destination keeps (core/plan.c says which), routed what was
 * routed. Every rank computes every destination's cut, so sources and destinations agree
 * without another exchange. */
static epx_status_t apply_budgets(host_plan_t *p, const int64_t *budgets) {
  const int R = p->nranks, E = p->num_experts, L = p->num_local;
  bool any = false;
  for (int d = 0; d < R; d++) any |= budgets[d] > 0;
  if (!any) return EPX_SUCCESS;
  epx_status_t s = EPX_SUCCESS;
  p->routed = xcalloc((size_t)R * E, sizeof(int32_t), &s);
  int32_t *kept = xcalloc((size_t)R * L, sizeof(int32_t), &s);
  if (s == EPX_SUCCESS) {
    memcpy(p->routed, p->pair, sizeof(int32_t) * R * E);
    epxi_counts_t routed = p->counts;
    routed.pair = p->routed;
    for (int d = 0; d < R; d++) {
      p->num_dropped += epxi_budget_keep(&routed, d, p->align, budgets[d], kept);
      for (int q = 0; q < R; q++)
        for (int l = 0; l < L; l++) p->pair[q * E + d * L + l] = kept[q * L + l];
    }
  }
  free(kept);
  return s;
}

/* Send side: where each of this rank's tokens and pairs lands. Tokens are visited in order,
 * so rows keep (source rank, source token) order within every block. */
static epx_status_t plan_send(host_plan_t *p) {
  const int R = p->nranks, K = p->topk, L = p->num_local, me = p->rank;
  int64_t next_tok[EPX_MAX_RANKS];
  for (int d = 0; d < R; d++) next_tok[d] = epxi_token_base(&p->counts, d, me);
  int64_t *next_pair = calloc(p->num_experts, sizeof(int64_t)), *block = calloc(L + 1, sizeof(int64_t));
  int64_t *sent = calloc(p->num_experts, sizeof(int64_t)); /* pairs routed to each expert so far */
  if (!next_pair || !block || !sent) {
    free(next_pair);
    free(block);
    free(sent);
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "notify on rank %d: send plan", me);
  }
  for (int d = 0; d < R; d++) {
    expert_blocks(p, d, block);
    for (int l = 0; l < L; l++) next_pair[d * L + l] = block[l] + epxi_expert_source_base(&p->counts, d, l, me);
  }
  free(block);
  for (int64_t t = 0; t < p->route.num_tokens; t++) {
    bool in_rank[EPX_MAX_RANKS] = {false};
    for (int k = 0; k < K; k++) {
      int e = p->route.idx[t * K + k];
      /* past its destination's budget a pair is dropped: it has no row (the token still
       * crosses for the pairs kept, or as a zero partial) */
      bool kept = e >= 0 && sent[e]++ < p->pair[me * p->num_experts + e];
      p->slot_row[t * K + k] = kept ? next_pair[e]++ : -1;
      if (e >= 0) in_rank[e / L] = true;
    }
    for (int d = 0; d < R; d++) p->dest_row[t * R + d] = in_rank[d] ? next_tok[d]++ : -1;
  }
  free(sent);
  free(next_pair);
  return EPX_SUCCESS;
}

/* A routing as shared with the peers: T, then idx [T, K], then weights [T, K]. */
static size_t route_blob_bytes(int64_t T, int K) { return sizeof(int64_t) + (size_t)T * K * (sizeof(int32_t) + sizeof(float)); }

static void route_blob_pack(const epxi_topk_t *r, void *blob) {
  char *b = blob;
  memcpy(b, &r->num_tokens, sizeof(int64_t));
  memcpy(b + sizeof(int64_t), r->idx, sizeof(int32_t) * r->num_tokens * r->topk);
  memcpy(b + sizeof(int64_t) + sizeof(int32_t) * r->num_tokens * r->topk, r->weights,
         sizeof(float) * r->num_tokens * r->topk);
}

/* Receive side, from every source's routing: what lands here, in arrival order, and at which
 * rows (the same sums as the source's plan_send, seen from the destination). */
static epx_status_t plan_recv(host_plan_t *p, const void *const *routes) {
  const int R = p->nranks, K = p->topk, L = p->num_local, me = p->rank;
  int64_t n = 0;
  int64_t *next_pair = calloc(L, sizeof(int64_t)), *arrived = calloc(L, sizeof(int64_t));
  if (!next_pair || !arrived) {
    free(next_pair);
    free(arrived);
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "notify on rank %d: receive plan", me);
  }
  for (int s = 0; s < R; s++) {
    const int32_t *kept = p->pair + (size_t)s * p->num_experts + (size_t)me * L;
    for (int l = 0; l < L; l++) arrived[l] = 0;
    int64_t T;
    memcpy(&T, routes[s], sizeof T);
    const int32_t *idx = (const int32_t *)((const char *)routes[s] + sizeof(int64_t));
    const float *w = (const float *)(idx + T * K);
    for (int l = 0; l < L; l++) next_pair[l] = p->block[l] + epxi_expert_source_base(&p->counts, me, l, s);
    for (int64_t t = 0; t < T; t++) {
      bool here_any = false;
      for (int k = 0; k < K; k++) here_any |= idx[t * K + k] >= 0 && idx[t * K + k] / L == me;
      if (!here_any) continue;
      p->recv_src[n] = s;
      p->recv_tok[n] = t;
      for (int k = 0; k < K; k++) {
        int e = idx[t * K + k];
        bool here = e >= 0 && e / L == me && arrived[e % L]++ < kept[e % L];
        p->recv_local[n * K + k] = here ? e % L : -1;
        p->recv_weight[n * K + k] = here ? w[t * K + k] : 0.0f;
        p->recv_row[n * K + k] = here ? next_pair[e % L]++ : -1;
      }
      n++;
    }
  }
  free(arrived);
  free(next_pair);
  return EPX_SUCCESS;
}

/* The node path's plan, from every source's routing (low-latency mode: the flat order). */
static epx_status_t plan_nodes(const epx_comm_t *comm, host_plan_t *p, const void *const *routes) {
  int64_t T[EPX_MAX_RANKS];
  const int32_t *idx[EPX_MAX_RANKS];
  for (int s = 0; s < p->nranks; s++) {
    memcpy(&T[s], routes[s], sizeof T[s]);
    idx[s] = (const int32_t *)((const char *)routes[s] + sizeof(int64_t));
  }
  return epxh_nodes_plan(&p->nodes, comm, p->ll, p->topk, p->num_local, T, idx);
}

static epx_status_t host_notify(epx_comm_t *comm, epx_handle_t *h, const epx_routing_t *routing) {
  host_plan_t *p = h->impl;
  const int R = p->nranks, E = p->num_experts, L = p->num_local, K = p->topk, me = p->rank;
  plan_clear(p);

  epx_status_t s = epxi_topk_from_routing(routing, E, K, &p->route);
  if (s == EPX_SUCCESS && p->ll && p->route.num_tokens > p->max_tokens)
    s = epxi_fail(EPX_ERR_LL_OVERFLOW, "rank %d has %lld tokens, more than max_tokens_per_rank = %d", me,
                  (long long)p->route.num_tokens, p->max_tokens);

  /* Counts: what this rank sends to each rank and expert, gathered from every rank. */
  size_t row_ints = (size_t)R + E + 1; /* counts, then this rank's receive budget */
  int32_t *mine = xcalloc(row_ints, sizeof(int32_t), &s);
  int32_t *all = xcalloc(row_ints * R, sizeof(int32_t), &s);
  p->tok = xcalloc((size_t)R * R, sizeof(int32_t), &s);
  p->pair = xcalloc((size_t)R * E, sizeof(int32_t), &s);
  if (s == EPX_SUCCESS) epxi_count_layout(&p->route, R, L, mine, mine + R, NULL);
  if (mine) mine[R + E] = p->budget > INT32_MAX ? INT32_MAX : (int32_t)p->budget;
  int64_t budgets[EPX_MAX_RANKS] = {0};
  epx_status_t agreed = agree(comm, "notify:validate", s);
  if (agreed == EPX_SUCCESS)
    agreed = epxi_group_allgather(comm->world->group, me, "notify:counts", comm->cfg.timeout_ms, mine,
                                  row_ints * sizeof(int32_t), all);
  if (agreed == EPX_SUCCESS)
    for (int q = 0; q < R; q++) {
      memcpy(p->tok + q * R, all + q * row_ints, sizeof(int32_t) * R);
      memcpy(p->pair + q * E, all + q * row_ints + R, sizeof(int32_t) * E);
      budgets[q] = all[q * row_ints + R + E];
    }
  free(mine);
  free(all);
  if (agreed != EPX_SUCCESS) {
    plan_clear(p);
    return agreed;
  }
  p->counts = (epxi_counts_t){.nranks = R, .num_experts = E, .num_local = L, .tok = p->tok, .pair = p->pair};
  s = apply_budgets(p, budgets);

  /* Positions. */
  const int64_t T = p->route.num_tokens;
  p->dest_row = xcalloc(T * R, sizeof(int64_t), &s);
  p->slot_row = xcalloc(T * K, sizeof(int64_t), &s);
  p->num_recv = epxi_recv_tokens(&p->counts, me);
  p->recv_src = xcalloc(p->num_recv, sizeof(int32_t), &s);
  p->recv_tok = xcalloc(p->num_recv, sizeof(int64_t), &s);
  p->recv_local = xcalloc(p->num_recv * K, sizeof(int32_t), &s);
  p->recv_weight = xcalloc(p->num_recv * K, sizeof(float), &s);
  p->recv_row = xcalloc(p->num_recv * K, sizeof(int64_t), &s);
  p->pairs_per_local = xcalloc(L, sizeof(int32_t), &s);
  void *blob = xcalloc(route_blob_bytes(T, K), 1, &s);
  if (s == EPX_SUCCESS) s = plan_send(p);
  if (s == EPX_SUCCESS) route_blob_pack(&p->route, blob);
  for (int l = 0; l < L && s == EPX_SUCCESS; l++) {
    int64_t pairs = epxi_expert_pairs(&p->counts, me, l);
    if (pairs > INT32_MAX) /* tokens_per_local_expert is int32 */
      s = epxi_fail(EPX_ERR_INVALID_ARGUMENT, "notify on rank %d: %lld pairs arrive for local expert %d, more than %d",
                    me, (long long)pairs, l, INT32_MAX);
    else
      p->pairs_per_local[l] = (int32_t)pairs;
    p->num_pairs += pairs;
  }
  p->block = xcalloc(L + 1, sizeof(int64_t), &s);
  if (s == EPX_SUCCESS) expert_blocks(p, me, p->block);
  p->num_rows = !p->expert_layout ? p->num_recv : s == EPX_SUCCESS ? p->block[L] : 0;

  /* Arrival metadata, from the sources' routings. */
  s = agree(comm, "notify:plan", s);
  const void *routes[EPX_MAX_RANKS];
  if (s == EPX_SUCCESS) s = share(comm, "notify:routes", blob, route_blob_bytes(T, K), routes);
  if (s == EPX_SUCCESS) {
    /* a failure here still finishes reading, then meets the peers in the agreement */
    epx_status_t planned = plan_recv(p, routes);
    if (planned == EPX_SUCCESS) planned = plan_nodes(comm, p, routes);
    s = done_reading(comm, "notify:routes-read");
    if (s == EPX_SUCCESS) s = agree(comm, "notify:nodes", planned);
  }
  free(blob);
  if (s != EPX_SUCCESS) plan_clear(p);
  return s;
}

static epx_status_t host_handle_info(const epx_handle_t *h, epx_handle_info_t *info, int32_t *tokens_per_local_expert) {
  const host_plan_t *p = h->impl;
  info->num_send_tokens = p->route.num_tokens;
  info->num_recv_tokens = p->num_recv;
  info->num_recv_rows = p->num_rows;
  info->num_recv_pairs = p->num_pairs;
  info->num_sent_copies = 0;
  for (int64_t i = 0; i < p->route.num_tokens * p->nranks; i++) info->num_sent_copies += p->dest_row[i] >= 0;
  if (tokens_per_local_expert) memcpy(tokens_per_local_expert, p->pairs_per_local, sizeof(int32_t) * p->num_local);
  return EPX_SUCCESS;
}

/* ---- dispatch ------------------------------------------------------------------------- */

/* Every receiver reads each arriving token once from its source and writes it to every row
 * the plan gives it: its token row, or one row per local expert it chose. */
/* The host backend does a whole operation in its SEND half: nothing is left for COMPLETE. */
static epx_status_t host_dispatch(epx_comm_t *comm, epx_handle_t *h, const epx_dispatch_args_t *a) {
  /* the COMPLETE half only meets its peers', so that it pairs with nothing else */
  if (a->part == EPX_PART_COMPLETE) return agree(comm, "dispatch:complete", EPX_SUCCESS);
  host_plan_t *p = h->impl;
  const int K = p->topk, H = p->hidden, me = p->rank;
  const int64_t T = p->route.num_tokens;

  epx_status_t input = EPX_SUCCESS;
  if (T > 0 && !a->x)
    input = epxi_fail(EPX_ERR_NULL_POINTER, "dispatch on rank %d: x is NULL with %lld tokens", me, (long long)T);
  /* rows from other nodes come through this node's rail peers */
  void *fwd = epxh_nodes_forward_alloc(&p->nodes, H * epx_dtype_size(a->x_dtype), &input);
  input = agree(comm, "dispatch:validate", input);
  if (input != EPX_SUCCESS) {
    free(fwd);
    return input;
  }
  epx_status_t s = EPX_SUCCESS;
  if (!p->ll && a->recv_capacity < p->num_rows)
    s = epxi_fail(EPX_ERR_OUTPUT_TOO_SMALL, "dispatch on rank %d: %lld rows arrive but recv_capacity is %lld", me,
                  (long long)p->num_rows, (long long)a->recv_capacity);

  const void *xs[EPX_MAX_RANKS], *fwds[EPX_MAX_RANKS];
  /* fp8 is quantised at the source, unless each expert scales its copy (then x crosses) */
  const bool fp8_wire = a->recv_dtype == EPX_FP8_E4M3 && !(a->scale_by_probs && p->expert_layout);
  const size_t x_row = H * epx_dtype_size(a->x_dtype), wire = fp8_wire ? H + sizeof(float) * scale_blocks(H) : x_row;
  epx_status_t shared = share(comm, "dispatch:x", a->x, (size_t)T * x_row, xs);
  if (shared == EPX_SUCCESS) shared = epxh_nodes_forward(&p->nodes, comm, xs, x_row, wire, fwd, fwds, &h->traffic);
  if (shared != EPX_SUCCESS) {
    free(fwd);
    return shared;
  }
  float *row = malloc(sizeof(float) * H), *scaled = malloc(sizeof(float) * H);
  if (!row || !scaled) s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "dispatch row");
  if (s == EPX_SUCCESS && p->expert_layout && !p->ll) /* padding rows: zero data, zero weight */
    for (int l = 0; l < p->num_local; l++) {
      int64_t lo = p->block[l] + p->pairs_per_local[l], hi = p->block[l + 1];
      for (int64_t r = lo; r < hi; r++) {
        zero_recv_row(a, a->recv_x, a->recv_scales, r, H);
        if (a->recv_probs) a->recv_probs[r] = 0.0f;
      }
    }
  /* a row that arrives in its own type is copied, bits and all */
  const bool copy = a->recv_dtype == a->x_dtype;
  const size_t row_bytes = (size_t)H * epx_dtype_size(a->x_dtype);
  for (int64_t n = 0; n < p->num_recv && s == EPX_SUCCESS; n++) {
    int64_t from_row;
    const void *from = epxh_nodes_arrival(&p->nodes, n, p->recv_src[n], p->recv_tok[n], xs, fwds, &from_row);
    load_row(from, a->x_dtype, from_row, H, row);
    if (!p->expert_layout) {
      if (copy)
        copy_row(a->recv_x, n, from, from_row, row_bytes);
      else
        store_recv_row(a, a->recv_x, a->recv_scales, n, H, row);
      if (a->recv_topk_idx) memcpy(a->recv_topk_idx + n * K, p->recv_local + n * K, sizeof(int32_t) * K);
      if (a->recv_topk_weights) memcpy(a->recv_topk_weights + n * K, p->recv_weight + n * K, sizeof(float) * K);
      continue;
    }
    for (int k = 0; k < K; k++) {
      int64_t r = p->recv_row[n * K + k];
      if (r < 0) continue;
      float w = p->recv_weight[n * K + k];
      if (a->scale_by_probs) {
        for (int c = 0; c < H; c++) scaled[c] = canonical(w * row[c]);
        store_recv_row(a, a->recv_x, a->recv_scales, r, H, scaled);
      } else if (copy) {
        copy_row(a->recv_x, r, from, from_row, row_bytes);
      } else {
        store_recv_row(a, a->recv_x, a->recv_scales, r, H, row);
      }
      if (a->recv_probs) a->recv_probs[r] = w;
    }
  }
  free(row);
  free(scaled);
  epx_status_t read = done_reading(comm, "dispatch:x-read");
  free(fwd);
  EPX_CHECK(read);
  if (s == EPX_SUCCESS) {
    if (a->tokens_per_local_expert) memcpy(a->tokens_per_local_expert, p->pairs_per_local, sizeof(int32_t) * p->num_local);
    if (a->num_recv_rows) *a->num_recv_rows = p->ll ? p->num_pairs : p->num_rows;
    if (a->dropped) *a->dropped = p->num_dropped > INT32_MAX ? INT32_MAX : (int32_t)p->num_dropped;
  }
  return s;
}

/* ---- combine -------------------------------------------------------------------------- */

/* Expert layout, destination side: one partial per arrived token, its pairs weighted and
 * summed in ascending local expert, rounded once to the partial type. */
static epx_status_t reduce_partials(const host_plan_t *p, const epx_combine_args_t *a, void **partials) {
  const int K = p->topk, H = p->hidden;
  *partials = malloc((p->num_recv ? p->num_recv : 1) * H * epx_dtype_size(a->y_dtype));
  float *acc = malloc(sizeof(float) * H), *y = malloc(sizeof(float) * H);
  if (!*partials || !acc || !y) {
    free(acc);
    free(y);
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "combine partials");
  }
  for (int64_t n = 0; n < p->num_recv; n++) {
    /* this token's slots on this rank, by ascending local expert */
    int slots[EPX_MAX_TOPK], m = 0;
    for (int k = 0; k < K; k++) {
      if (p->recv_local[n * K + k] < 0) continue;
      int j = m++;
      for (; j > 0 && p->recv_local[n * K + slots[j - 1]] > p->recv_local[n * K + k]; j--) slots[j] = slots[j - 1];
      slots[j] = k;
    }
    for (int c = 0; c < H; c++) acc[c] = 0.0f;
    for (int i = 0; i < m; i++) {
      int k = slots[i];
      int64_t row = p->recv_row[n * K + k];
      float w = !a->weighted ? 1.0f : a->row_probs ? a->row_probs[row] : p->recv_weight[n * K + k];
      load_row(a->y, a->y_dtype, row, H, y);
      for (int c = 0; c < H; c++) acc[c] += w * y[c];
    }
    canonical_row(acc, H);
    store_row(*partials, a->y_dtype, n, H, acc);
  }
  free(acc);
  free(y);
  return EPX_SUCCESS;
}

static epx_status_t host_combine(epx_comm_t *comm, epx_handle_t *h, const epx_combine_args_t *a) {
  if (a->part == EPX_PART_COMPLETE) return agree(comm, "combine:complete", EPX_SUCCESS);
  host_plan_t *p = h->impl;
  const int R = p->nranks, K = p->topk, H = p->hidden, me = p->rank;
  const int64_t T = p->route.num_tokens;

  epx_status_t s = EPX_SUCCESS;
  if (p->num_rows > 0 && !a->y) s = epxi_fail(EPX_ERR_NULL_POINTER, "combine on rank %d: y is NULL", me);
  if (T > 0 && !a->out) s = epxi_fail(EPX_ERR_NULL_POINTER, "combine on rank %d: out is NULL", me);
  void *partials = NULL;
  if (s == EPX_SUCCESS && p->expert_layout) s = reduce_partials(p, a, &partials);
  void *node_partials = epxh_nodes_combine_alloc(&p->nodes, H, a->y_dtype, &s);
  s = agree(comm, "combine:validate", s);
  if (s != EPX_SUCCESS) {
    free(partials);
    free(node_partials);
    return s;
  }

  /* Destinations show their rows (token layout: y; expert layout: the partials) and any
   * weight gradients; sources pull. */
  const void *rows[EPX_MAX_RANKS], *wgrads[EPX_MAX_RANKS];
  size_t row_bytes = (size_t)H * epx_dtype_size(a->y_dtype);
  s = p->expert_layout ? share(comm, "combine:partials", partials, p->num_recv * row_bytes, rows)
                       : share(comm, "combine:rows", a->y, p->num_rows * row_bytes, rows);
  if (s == EPX_SUCCESS && a->row_weight_grad) {
    size_t n = p->expert_layout ? (size_t)p->num_rows : (size_t)p->num_rows * K;
    s = share(comm, "combine:weight-grads", a->row_weight_grad, n * sizeof(float), wgrads);
  }
  if (s != EPX_SUCCESS) {
    free(partials);
    free(node_partials);
    return s;
  }

  /* Source side: what comes back from each node, in node order, each node's ranks summed by
   * its rail peer in rank order (host/nodes.c; one node: the ranks in rank order). */
  s = epxh_nodes_combine(&p->nodes, comm, &host_ops, rows, a->y_dtype, a->out, a->out_dtype, node_partials,
                         &h->traffic);
  for (int64_t t = 0; t < T && s == EPX_SUCCESS && a->topk_weight_grad; t++) {
    for (int k = 0; k < K; k++) {
      int e = p->route.idx[t * K + k];
      float g = 0.0f;
      if (e >= 0 && (!p->expert_layout || p->slot_row[t * K + k] >= 0)) {
        int d = e / p->num_local;
        const float *wg = wgrads[d];
        g = p->expert_layout ? wg[p->slot_row[t * K + k]] : wg[p->dest_row[t * R + d] * K + k];
      }
      a->topk_weight_grad[t * K + k] = g;
    }
  }
  epx_status_t read = done_reading(comm, "combine:read");
  free(node_partials);
  free(partials);
  return s != EPX_SUCCESS ? s : read;
}

/* Every operation opens with an agreement on the ranks' statuses: joining it is enough. */
static epx_status_t host_abort(epx_comm_t *comm, epx_handle_t *h, epxi_op_t op, epx_status_t status) {
  (void)h;
  static const char *const phase[] = {"notify:validate", "dispatch:validate", "notify:validate", "combine:validate"};
  return agree(comm, phase[op], status);
}

const epxi_backend_t epxi_host_backend = {
    .name = "host",
    .handle_create = host_handle_create,
    .handle_destroy = host_handle_destroy,
    .get_layout = host_get_layout,
    .notify = host_notify,
    .handle_info = host_handle_info,
    .dispatch = host_dispatch,
    .combine = host_combine,
    .abort = host_abort,
    .comm_abort = epxi_comm_abort_group,
    .async_error = epxi_comm_group_error,
    .wide_topk = true,
    .recv_budget = true,
    .stamped = true,
    .nodes = true,
};
