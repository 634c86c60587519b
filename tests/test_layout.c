/* test_layout: epx_get_layout against counts computed directly, for every routing form. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static void check_layout(const char *what, epx_comm_t *comm, const tu_moe_t *m, int r, int form) {
  const int R = m->R, E = m->E, L = m->L, K = m->K;
  const int64_t T = m->T[r];
  int32_t *tpr = tu_alloc_poison(sizeof(int32_t) * (size_t)R), *tpe = tu_alloc_poison(sizeof(int32_t) * (size_t)E);
  uint8_t *in = tu_alloc_poison((size_t)(T * R));
  int32_t *want_tpr = calloc((size_t)R, sizeof(int32_t)), *want_tpe = calloc((size_t)E, sizeof(int32_t));
  uint8_t *want_in = calloc((size_t)(T * R) + 1, 1);
  for (int64_t t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      const int32_t e = m->idx[r][t * K + k];
      if (e < 0) continue;
      want_tpe[e]++;
      if (!want_in[t * R + e / L]) want_in[t * R + e / L] = 1, want_tpr[e / L]++;
    }
  char ctx[160];
  snprintf(ctx, sizeof ctx, "%s rank %d form %d", what, r, form);
  epx_routing_t rt = tu_routing(m, r, form);
  if (CHECK_STATUS(epx_get_layout(comm, &rt, tpr, tpe, in), EPX_SUCCESS, "%s", ctx)) {
    char w[200];
    snprintf(w, sizeof w, "%s tokens_per_rank", ctx);
    CHECK_BITS(w, EPX_INT32, tpr, want_tpr, R, R);
    snprintf(w, sizeof w, "%s tokens_per_expert", ctx);
    CHECK_BITS(w, EPX_INT32, tpe, want_tpe, E, E);
    snprintf(w, sizeof w, "%s is_token_in_rank", ctx);
    CHECK_BITS(w, EPX_BOOL, in, want_in, T * R, R);
  }
  /* The same counts from the group's shape alone, no comm. */
  memset(tpr, TU_POISON, sizeof(int32_t) * (size_t)R), memset(tpe, TU_POISON, sizeof(int32_t) * (size_t)E);
  memset(in, TU_POISON, (size_t)(T * R));
  if (CHECK_STATUS(epx_layout_counts(R, E, K, &rt, tpr, tpe, in), EPX_SUCCESS, "%s epx_layout_counts", ctx)) {
    CHECK_BITS(ctx, EPX_INT32, tpr, want_tpr, R, R);
    CHECK_BITS(ctx, EPX_INT32, tpe, want_tpe, E, E);
    CHECK_BITS(ctx, EPX_BOOL, in, want_in, T * R, R);
  }
  if (R > 1) /* E + 1 experts cannot split over R ranks: refused before anything is written */
    CHECK_STATUS(epx_layout_counts(R, E + 1, K, &rt, tpr, tpe, in), EPX_ERR_EXPERTS_NOT_DIVISIBLE, "%s", ctx);
  /* Any output may be NULL. */
  memset(tpe, TU_POISON, sizeof(int32_t) * (size_t)E);
  if (CHECK_STATUS(epx_get_layout(comm, &rt, NULL, tpe, NULL), EPX_SUCCESS, "%s only tokens_per_expert", ctx))
    CHECK_BITS(ctx, EPX_INT32, tpe, want_tpe, E, E);
  memset(tpr, TU_POISON, sizeof(int32_t) * (size_t)R);
  if (CHECK_STATUS(epx_get_layout(comm, &rt, tpr, NULL, NULL), EPX_SUCCESS, "%s only tokens_per_rank", ctx))
    CHECK_BITS(ctx, EPX_INT32, tpr, want_tpr, R, R);
  free(tpr), free(tpe), free(in), free(want_tpr), free(want_tpe), free(want_in);
}

int main(void) {
  tu_begin("test_layout");
  static const int ranks[] = {1, 2, 3, 4, 8};
  for (int it = 0; it < 16; it++) {
    const int R = ranks[it % 5];
    const int L = tu_int(&tu_rng, 1, 8);
    const int E = R * L, K = tu_int(&tu_rng, 1, 8), H = 32;
    int64_t T[TU_MAX_RANKS];
    for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 0, 3) == 0 ? 0 : tu_int(&tu_rng, 1, 100);
    tu_route_opts_t o = tu_route_default();
    if (it % 4 == 1) o.p_none = 0.85;
    if (it % 4 == 2) o.one_expert = tu_int(&tu_rng, 0, E - 1);
    tu_moe_t m;
    tu_moe_random(&m, &tu_rng, R, E, H, K, EPX_FLOAT32, T, &o, 1);
    char what[96];
    snprintf(what, sizeof what, "R=%d E=%d K=%d", R, E, K);

    tu_world_t w;
    epx_config_t cfg = tu_config(E, H, K, 128);
    if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s world", what)) {
      tu_world_destroy(&w);
      tu_moe_free(&m);
      continue;
    }
    for (int r = 0; r < R; r++) {
      check_layout(what, w.comm[r], &m, r, TU_FORM_TOPK32);
      check_layout(what, w.comm[r], &m, r, TU_FORM_TOPK64);
    }
    /* The map form (rows presented in ascending order) gives the same layout. */
    tu_moe_make_map(&m);
    for (int r = 0; r < R; r++) check_layout(what, w.comm[r], &m, r, TU_FORM_MAP);
    /* An id out of range is refused, outputs untouched. */
    if (m.T[0] > 0) {
      const int32_t keep = m.idx[0][0];
      m.idx[0][0] = E;
      int32_t *tpr = tu_alloc_poison(sizeof(int32_t) * (size_t)R);
      epx_routing_t rt = tu_routing(&m, 0, TU_FORM_TOPK32);
      CHECK_STATUS(epx_get_layout(w.comm[0], &rt, tpr, NULL, NULL), EPX_ERR_EXPERT_OUT_OF_RANGE, "%s: expert %d", what, E);
      CHECK(tu_is_poison(tpr, sizeof(int32_t) * (size_t)R), "%s: a refused layout wrote tokens_per_rank", what);
      m.idx[0][0] = keep;
      free(tpr);
    }
    /* A rank may ask for the layout of another rank's routing: it is local. */
    if (R > 1) check_layout(what, w.comm[0], &m, R - 1, TU_FORM_TOPK32);
    tu_world_destroy(&w);
    tu_moe_free(&m);
  }
  return tu_end();
}
