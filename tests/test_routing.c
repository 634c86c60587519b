/* test_routing: conversions between the topk form and the routing-map form. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* The map and probs a topk routing must give, computed directly. */
static void expected_map(int64_t T, int E, int K, const int32_t *idx, const float *w, uint8_t *map, float *probs) {
  memset(map, 0, (size_t)(T * E));
  memset(probs, 0, sizeof(float) * (size_t)(T * E));
  for (int64_t t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      const int32_t e = idx[t * K + k];
      if (e < 0) continue;
      map[t * E + e] = 1;
      probs[t * E + e] = w ? w[t * K + k] : 1.0f;
    }
}

static void one_round_trip(int64_t T, int E, int K, double p_none) {
  char what[128];
  snprintf(what, sizeof what, "T=%lld E=%d K=%d p_none=%.2f", (long long)T, E, K, p_none);
  tu_route_opts_t o = tu_route_default();
  o.p_none = p_none;
  const size_t nk = (size_t)(T * K), ne = (size_t)(T * E);
  int32_t *idx = tu_alloc_poison(sizeof(int32_t) * nk);
  int64_t *idx64 = tu_alloc_poison(sizeof(int64_t) * nk);
  float *w = tu_alloc_poison(sizeof(float) * nk);
  tu_random_topk(&tu_rng, T, K, E, &o, idx);
  for (size_t i = 0; i < nk; i++) idx64[i] = idx[i], w[i] = tu_weight(&tu_rng); /* -1 slots: junk weights */

  uint8_t *want_map = tu_alloc_poison(ne), *map = tu_alloc_poison(ne), *map64 = tu_alloc_poison(ne);
  float *want_probs = tu_alloc_poison(sizeof(float) * ne), *probs = tu_alloc_poison(sizeof(float) * ne),
        *probs64 = tu_alloc_poison(sizeof(float) * ne);
  expected_map(T, E, K, idx, w, want_map, want_probs);

  /* topk -> map, int32 and int64 ids. */
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT32, idx, w, map, probs), EPX_SUCCESS, "%s int32", what);
  CHECK_BITS(what, EPX_BOOL, map, want_map, (int64_t)ne, E);
  CHECK_BITS(what, EPX_FLOAT32, probs, want_probs, (int64_t)ne, E);
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT64, idx64, w, map64, probs64), EPX_SUCCESS, "%s int64", what);
  CHECK_BITS(what, EPX_BOOL, map64, want_map, (int64_t)ne, E);
  CHECK_BITS(what, EPX_FLOAT32, probs64, want_probs, (int64_t)ne, E);

  /* Without weights every chosen expert gets probability 1. */
  expected_map(T, E, K, idx, NULL, want_map, want_probs);
  memset(probs, TU_POISON, sizeof(float) * ne);
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT32, idx, NULL, map, probs), EPX_SUCCESS, "%s no weights", what);
  CHECK_BITS(what, EPX_FLOAT32, probs, want_probs, (int64_t)ne, E);

  /* map -> topk: ascending expert ids, -1 / 0 padding. */
  int32_t *want_idx = malloc(sizeof(int32_t) * (nk + 1));
  float *want_w = malloc(sizeof(float) * (nk + 1));
  memcpy(want_idx, idx, sizeof(int32_t) * nk);
  memcpy(want_w, w, sizeof(float) * nk);
  tu_sort_topk_rows(T, K, want_idx, want_w);
  int32_t *back = tu_alloc_poison(sizeof(int32_t) * nk);
  float *back_w = tu_alloc_poison(sizeof(float) * nk);
  /* Probabilities of experts the map does not choose are ignored. */
  for (size_t i = 0; i < ne; i++)
    if (!map64[i]) probs64[i] = 0.5f + (float)(i % 7);
  CHECK_STATUS(epx_map_to_topk(T, E, K, map64, probs64, back, back_w), EPX_SUCCESS, "%s map->topk", what);
  CHECK_BITS(what, EPX_INT32, back, want_idx, (int64_t)nk, K);
  CHECK_BITS(what, EPX_FLOAT32, back_w, want_w, (int64_t)nk, K);
  long unsorted = 0;
  for (int64_t t = 0; t < T; t++)
    for (int k = 1; k < K; k++) {
      const int32_t a = back[t * K + k - 1], b = back[t * K + k];
      if (b >= 0 && (a < 0 || a >= b)) unsorted++;
    }
  CHECK(unsorted == 0, "%s: %ld map->topk rows not ascending with -1 last", what, unsorted);

  /* Without probs every weight is 1 (padding 0). */
  for (size_t i = 0; i < nk; i++) want_w[i] = want_idx[i] >= 0 ? 1.0f : 0.0f;
  memset(back_w, TU_POISON, sizeof(float) * nk);
  CHECK_STATUS(epx_map_to_topk(T, E, K, map64, NULL, back, back_w), EPX_SUCCESS, "%s map->topk no probs", what);
  CHECK_BITS(what, EPX_INT32, back, want_idx, (int64_t)nk, K);
  CHECK_BITS(what, EPX_FLOAT32, back_w, want_w, (int64_t)nk, K);

  /* And back again: map -> topk -> map is the identity. */
  memset(map, TU_POISON, ne);
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT32, back, NULL, map, probs), EPX_SUCCESS, "%s second trip", what);
  CHECK_BITS(what, EPX_BOOL, map, map64, (int64_t)ne, E);

  free(idx), free(idx64), free(w), free(want_map), free(map), free(map64), free(want_probs), free(probs), free(probs64);
  free(want_idx), free(want_w), free(back), free(back_w);
}

static void test_errors(void) {
  const int E = 8, K = 2, T = 3;
  uint8_t map[3 * 8] = {0};
  float probs[3 * 8], w[3 * 2];
  int32_t idx_out[3 * 2];
  for (int i = 0; i < T * E; i++) probs[i] = 0.25f;
  /* A map row with more than K experts. */
  map[0 * E + 1] = 1;
  map[1 * E + 0] = map[1 * E + 3] = map[1 * E + 7] = 1; /* row 1: three experts, K = 2 */
  memset(idx_out, TU_POISON, sizeof idx_out);
  CHECK_STATUS(epx_map_to_topk(T, E, K, map, probs, idx_out, w), EPX_ERR_TOPK_RANGE, "map row with 3 experts, K=2");
  CHECK(*epx_last_error() != '\0', "a message for the overfull map row");
  /* A repeated expert in a topk row. */
  const int32_t dup[3 * 2] = {0, 1, 5, 5, 2, -1};
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT32, dup, NULL, map, probs), EPX_ERR_INVALID_ARGUMENT,
               "expert 5 twice in row 1");
  CHECK(*epx_last_error() != '\0', "a message for the repeated expert");
  const int64_t dup64[3 * 2] = {-1, -1, 3, 4, 6, 6};
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT64, dup64, NULL, map, probs), EPX_ERR_INVALID_ARGUMENT,
               "int64: expert 6 twice in row 2");
  /* Two -1 slots are not a repeat. */
  const int32_t none[3 * 2] = {-1, -1, -1, 0, 7, -1};
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT32, none, NULL, map, probs), EPX_SUCCESS, "-1 twice is no repeat");
  /* Out-of-range ids. */
  const int32_t big[3 * 2] = {0, 1, 2, 8, 3, 4};
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT32, big, NULL, map, probs), EPX_ERR_EXPERT_OUT_OF_RANGE, "expert 8 of 8");
  const int32_t neg[3 * 2] = {0, 1, 2, -2, 3, 4};
  CHECK_STATUS(epx_topk_to_map(T, E, K, EPX_INT32, neg, NULL, map, probs), EPX_ERR_EXPERT_OUT_OF_RANGE, "expert -2");
}

int main(void) {
  tu_begin("test_routing");
  static const int experts[] = {1, 4, 8, 16, 64, 256};
  for (int i = 0; i < 40; i++) {
    const int E = experts[tu_int(&tu_rng, 0, 5)];
    const int K = tu_int(&tu_rng, 1, 8);
    const int64_t T = i == 0 ? 0 : tu_int(&tu_rng, 1, 150);
    const double p_none = i % 4 == 0 ? 0.8 : i % 4 == 1 ? 0.0 : 0.3;
    one_round_trip(T, E, K, p_none);
  }
  one_round_trip(5, 8, EPX_MAX_TOPK, 0.0); /* K larger than E: rows hold at most E experts */
  test_errors();
  return tu_end();
}
