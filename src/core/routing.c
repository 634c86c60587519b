/* The two routing forms, their conversion, and the checks on their contents. */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

static int64_t topk_id(epx_dtype_t idx_dtype, const void *idx, int64_t i) {
  return idx_dtype == EPX_INT64 ? ((const int64_t *)idx)[i] : ((const int32_t *)idx)[i];
}

/* Checks one topk row: ids in [-1, E), no expert twice. */
static epx_status_t check_topk_row(int64_t t, const int32_t *row, int topk, int num_experts) {
  for (int k = 0; k < topk; k++) {
    if (row[k] < -1 || row[k] >= num_experts)
      return epxi_fail(EPX_ERR_EXPERT_OUT_OF_RANGE, "token %lld slot %d routes to expert %d, outside [-1, %d)",
                       (long long)t, k, row[k], num_experts);
    for (int j = 0; j < k; j++)
      if (row[k] >= 0 && row[j] == row[k])
        return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "token %lld routes to expert %d twice (slots %d and %d)",
                         (long long)t, row[k], j, k);
  }
  return EPX_SUCCESS;
}

void epxi_count_layout(const epxi_topk_t *t, int nranks, int num_local, int32_t *tokens_per_rank,
                       int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  const int K = t->topk;
  if (tokens_per_rank) memset(tokens_per_rank, 0, sizeof(int32_t) * nranks);
  if (tokens_per_expert) memset(tokens_per_expert, 0, sizeof(int32_t) * nranks * num_local);
  for (int64_t i = 0; i < t->num_tokens; i++) {
    bool in_rank[EPX_MAX_RANKS] = {false};
    for (int k = 0; k < K; k++) {
      int e = t->idx[i * K + k];
      if (e < 0) continue;
      in_rank[e / num_local] = true;
      if (tokens_per_expert) tokens_per_expert[e]++;
    }
    for (int d = 0; d < nranks; d++) {
      if (tokens_per_rank && in_rank[d]) tokens_per_rank[d]++;
      if (is_token_in_rank) is_token_in_rank[i * nranks + d] = in_rank[d];
    }
  }
}

/* The shape checks of the host conversions: [T, E] and [T, K] arrays must be addressable. Every
   conversion starts here, so the message is cleared on entry: a success after a failure leaves none. */
static epx_status_t check_converter_shape(int64_t num_tokens, int num_experts, int topk) {
  epxi_clear_error();
  if (num_tokens < 0 || num_tokens > EPX_MAX_TOKENS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "num_tokens %lld outside [0, EPX_MAX_TOKENS = %lld]",
                     (long long)num_tokens, (long long)EPX_MAX_TOKENS);
  if (topk < 1 || topk > EPX_MAX_TOPK)
    return epxi_fail(EPX_ERR_TOPK_RANGE, "topk %d outside [1, %d]", topk, EPX_MAX_TOPK);
  if (num_experts < 1) return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "num_experts %d < 1", num_experts);
  int64_t bytes;
  if (!epxi_mul_i64(num_tokens, (int64_t)num_experts * (int64_t)sizeof(float), &bytes) ||
      !epxi_mul_i64(num_tokens, (int64_t)topk * (int64_t)sizeof(int64_t), &bytes) || (uint64_t)bytes > SIZE_MAX / 2)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "num_tokens %lld with %d experts and topk %d: the arrays' sizes overflow",
                     (long long)num_tokens, num_experts, topk);
  return EPX_SUCCESS;
}

epx_status_t epx_map_to_topk(int64_t num_tokens, int num_experts, int topk, const uint8_t *routing_map,
                             const float *probs, int32_t *topk_idx, float *topk_weights) {
  EPX_CHECK(check_converter_shape(num_tokens, num_experts, topk));
  if (num_tokens > 0 && (!routing_map || !topk_idx))
    return epxi_fail(EPX_ERR_NULL_POINTER, "map_to_topk: routing_map and topk_idx are required");
  for (int64_t t = 0; t < num_tokens; t++) {
    const uint8_t *row = routing_map + t * num_experts;
    int k = 0;
    for (int e = 0; e < num_experts; e++) {
      if (!row[e]) continue;
      if (k == topk)
        return epxi_fail(EPX_ERR_TOPK_RANGE, "routing map row of token %lld chooses more than topk = %d experts",
                         (long long)t, topk);
      topk_idx[t * topk + k] = e;
      if (topk_weights) topk_weights[t * topk + k] = probs ? probs[t * num_experts + e] : 1.0f;
      k++;
    }
    for (; k < topk; k++) {
      topk_idx[t * topk + k] = -1;
      if (topk_weights) topk_weights[t * topk + k] = 0.0f;
    }
  }
  return EPX_SUCCESS;
}

epx_status_t epx_topk_to_map(int64_t num_tokens, int num_experts, int topk, epx_dtype_t idx_dtype,
                             const void *topk_idx, const float *topk_weights, uint8_t *routing_map, float *probs) {
  EPX_CHECK(check_converter_shape(num_tokens, num_experts, topk));
  if (idx_dtype != EPX_INT32 && idx_dtype != EPX_INT64)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "topk ids must be int32 or int64, not %s", epx_dtype_name(idx_dtype));
  if (num_tokens > 0 && (!topk_idx || !routing_map))
    return epxi_fail(EPX_ERR_NULL_POINTER, "topk_to_map: topk_idx and routing_map are required");
  /* Check everything before writing anything. */
  int32_t row[EPX_MAX_TOPK];
  for (int64_t t = 0; t < num_tokens; t++) {
    for (int k = 0; k < topk; k++) {
      int64_t e = topk_id(idx_dtype, topk_idx, t * topk + k);
      row[k] = (e < -1 || e >= num_experts) ? -2 : (int32_t)e;
    }
    EPX_CHECK(check_topk_row(t, row, topk, num_experts));
  }
  memset(routing_map, 0, (size_t)num_tokens * num_experts);
  if (probs) memset(probs, 0, sizeof(float) * num_tokens * num_experts);
  for (int64_t t = 0; t < num_tokens; t++)
    for (int k = 0; k < topk; k++) {
      int64_t e = topk_id(idx_dtype, topk_idx, t * topk + k);
      if (e < 0) continue;
      routing_map[t * num_experts + e] = 1;
      if (probs) probs[t * num_experts + e] = topk_weights ? topk_weights[t * topk + k] : 1.0f;
    }
  return EPX_SUCCESS;
}

epx_status_t epxi_check_routing_form(const epx_routing_t *routing) {
  if (!routing) return epxi_fail(EPX_ERR_NULL_POINTER, "routing is NULL");
  if (routing->num_tokens < 0 || routing->num_tokens > EPX_MAX_TOKENS)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "routing.num_tokens %lld outside [0, EPX_MAX_TOKENS = %lld]",
                     (long long)routing->num_tokens, (long long)EPX_MAX_TOKENS);
  if (routing->num_tokens > 0 && !routing->topk_idx && !routing->routing_map)
    return epxi_fail(EPX_ERR_NULL_POINTER, "routing has neither topk_idx nor routing_map");
  if (routing->topk_idx && routing->idx_dtype != EPX_INT32 && routing->idx_dtype != EPX_INT64)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "routing.idx_dtype must be int32 or int64, not %s",
                     epx_dtype_name(routing->idx_dtype));
  return EPX_SUCCESS;
}

void epxi_topk_free(epxi_topk_t *t) {
  free(t->idx);
  free(t->weights);
  memset(t, 0, sizeof *t);
}

epx_status_t epxi_topk_from_routing(const epx_routing_t *routing, int num_experts, int topk, epxi_topk_t *out) {
  memset(out, 0, sizeof *out);
  EPX_CHECK(epxi_check_routing_form(routing));
  int64_t n = routing->num_tokens * topk;
  out->num_tokens = routing->num_tokens;
  out->topk = topk;
  out->idx = malloc(sizeof(int32_t) * (n ? n : 1));
  out->weights = malloc(sizeof(float) * (n ? n : 1));
  if (!out->idx || !out->weights) {
    epxi_topk_free(out);
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "routing copy of %lld slots", (long long)n);
  }
  epx_status_t s = EPX_SUCCESS;
  if (routing->num_tokens == 0) return EPX_SUCCESS;
  if (routing->topk_idx) {
    for (int64_t i = 0; i < n; i++) {
      int64_t e = topk_id(routing->idx_dtype, routing->topk_idx, i);
      out->idx[i] = (e < -1 || e >= num_experts) ? -2 : (int32_t)e;
      out->weights[i] = e < 0 ? 0.0f : routing->topk_weights ? routing->topk_weights[i] : 1.0f;
    }
    for (int64_t t = 0; t < routing->num_tokens && s == EPX_SUCCESS; t++) {
      s = check_topk_row(t, out->idx + t * topk, topk, num_experts);
      if (s == EPX_ERR_EXPERT_OUT_OF_RANGE) /* report the id as given, not the -2 marker */
        for (int k = 0; k < topk; k++)
          if (out->idx[t * topk + k] == -2) {
            s = epxi_fail(EPX_ERR_EXPERT_OUT_OF_RANGE, "token %lld slot %d routes to expert %lld, outside [-1, %d)",
                          (long long)t, k, (long long)topk_id(routing->idx_dtype, routing->topk_idx, t * topk + k),
                          num_experts);
            break;
          }
    }
  } else {
    s = epx_map_to_topk(routing->num_tokens, num_experts, topk, routing->routing_map, routing->probs, out->idx,
                        out->weights);
  }
  if (s != EPX_SUCCESS) epxi_topk_free(out);
  return s;
}
