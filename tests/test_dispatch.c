/* test_dispatch: the ordering and padding contract of dispatch, both layouts, every dtype.
 * Receive buffers are poisoned before each run so that an unwritten row shows. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

typedef struct {
  int R, L, K, H;
  epx_dtype_t x_dtype, recv_dtype;
  epx_layout_t layout;
  int align, form, weights, notify_first;
  double p_none;
} case_t;

static size_t dsize(epx_dtype_t t) { return t == EPX_FLOAT32 ? 4 : t == EPX_BFLOAT16 ? 2 : 1; }

/* The bytes (and fp8 scales) a source row must arrive as. */
static void expected_row(const tu_moe_t *m, epx_dtype_t recv_dtype, int s, int64_t t, uint8_t *bytes, float *scales) {
  const int H = m->H;
  if (recv_dtype != EPX_FP8_E4M3) {
    memcpy(bytes, (const uint8_t *)m->x[s] + (size_t)(t * H) * dsize(m->x_dtype), (size_t)H * dsize(m->x_dtype));
    return;
  }
  float *f = malloc(sizeof(float) * (size_t)H);
  for (int c = 0; c < H; c++) f[c] = tu_load(m->x_dtype, m->x[s], (size_t)(t * H + c));
  epx_quantize_row_e4m3(f, H, bytes, scales);
  free(f);
}

static void check_rank(const char *what, const case_t *c, const tu_moe_t *m, const tu_pipe_res_t *res, int d) {
  const int H = m->H, K = m->K, L = m->L, nb = tu_nblocks(H);
  const tu_expect_t *ex = &res->ex[d];
  const int expert = c->layout == EPX_LAYOUT_EXPERT;
  const size_t rb = (size_t)H * dsize(c->recv_dtype);
  const int64_t want_rows = expert ? ex->nrows : ex->ntok;
  const int fp8 = c->recv_dtype == EPX_FP8_E4M3;
  uint8_t *row = malloc(rb);
  float *sc = malloc(sizeof(float) * (size_t)nb);
  long bad_x = 0, bad_sc = 0, bad_idx = 0, bad_w = 0, bad_pad = 0;
  int64_t first_x = -1;

  CHECK(res->nrows[d] == want_rows, "%s rank %d: num_recv_rows %lld, want %lld", what, d, (long long)res->nrows[d],
        (long long)want_rows);
  for (int64_t n = 0; n < want_rows; n++) {
    const tu_row_t *er = expert ? &ex->pair_rows[n] : &ex->tok_rows[n];
    const uint8_t *got = (const uint8_t *)res->recv_x[d] + (size_t)n * rb;
    if (er->src < 0) { /* padding: zero row, zero probability */
      for (size_t i = 0; i < rb; i++)
        if (got[i]) {
          bad_pad++;
          break;
        }
      if (res->recv_probs[d][n] != 0.0f) bad_pad++;
      continue;
    }
    expected_row(m, c->recv_dtype, er->src, er->tok, row, sc);
    if (memcmp(got, row, rb)) {
      if (first_x < 0) first_x = n;
      bad_x++;
    }
    if (fp8 && memcmp(res->recv_scales[d] + n * nb, sc, sizeof(float) * (size_t)nb)) bad_sc++;
    const int32_t *sidx = m->idx[er->src] + er->tok * K;
    const float *sw = m->w[er->src] ? m->w[er->src] + er->tok * K : NULL;
    if (!expert) {
      for (int k = 0; k < K; k++) {
        const int mine = sidx[k] >= 0 && sidx[k] / L == d;
        const int32_t want_i = mine ? sidx[k] % L : -1;
        const float want_w = mine ? (sw ? sw[k] : 1.0f) : 0.0f;
        bad_idx += res->recv_idx[d][n * K + k] != want_i;
        bad_w += memcmp(&res->recv_w[d][n * K + k], &want_w, sizeof(float)) != 0;
      }
    } else {
      const float want_p = sw ? sw[er->k] : 1.0f;
      bad_w += memcmp(&res->recv_probs[d][n], &want_p, sizeof(float)) != 0;
    }
  }
  if (first_x >= 0) {
    const tu_row_t *er = expert ? &ex->pair_rows[first_x] : &ex->tok_rows[first_x];
    CHECK(bad_x == 0, "%s rank %d: %ld rows differ; first row %lld should be token %lld of rank %d", what, d, bad_x,
          (long long)first_x, (long long)er->tok, er->src);
  } else {
    CHECK(bad_x == 0, "%s rank %d: rows differ", what, d);
  }
  CHECK(bad_sc == 0, "%s rank %d: %ld rows with wrong fp8 scales", what, d, bad_sc);
  CHECK(bad_idx == 0, "%s rank %d: %ld wrong recv_topk_idx entries", what, d, bad_idx);
  CHECK(bad_w == 0, "%s rank %d: %ld wrong %s entries", what, d, bad_w, expert ? "recv_probs" : "recv_topk_weights");
  CHECK(bad_pad == 0, "%s rank %d: %ld padding rows not zero (row or probability)", what, d, bad_pad);

  /* Nothing past the capacity. */
  const int64_t cap = res->cap[d], g = 2;
  CHECK(tu_is_poison((const uint8_t *)res->recv_x[d] + (size_t)cap * rb, (size_t)g * rb),
        "%s rank %d: recv_x written past its capacity of %lld rows", what, d, (long long)cap);
  if (fp8)
    CHECK(tu_is_poison(res->recv_scales[d] + cap * nb, sizeof(float) * (size_t)(g * nb)),
          "%s rank %d: recv_scales written past the capacity", what, d);
  if (!expert) {
    CHECK(tu_is_poison(res->recv_idx[d] + cap * K, sizeof(int32_t) * (size_t)(g * K)) &&
              tu_is_poison(res->recv_w[d] + cap * K, sizeof(float) * (size_t)(g * K)),
          "%s rank %d: recv_topk_idx / weights written past the capacity", what, d);
  } else {
    CHECK(tu_is_poison(res->recv_probs[d] + cap, sizeof(float) * (size_t)g),
          "%s rank %d: recv_probs written past the capacity", what, d);
  }

  /* Counts, from the dispatch and from the handle. */
  char w2[640];
  snprintf(w2, sizeof w2, "%s rank %d tokens_per_local_expert (dispatch)", what, d);
  CHECK_BITS(w2, EPX_INT32, res->cnt[d], ex->cnt, L, L);
  if (CHECK_STATUS(res->info_st[d], EPX_SUCCESS, "%s rank %d: epx_handle_info", what, d)) {
    const epx_handle_info_t *in = &res->info[d];
    snprintf(w2, sizeof w2, "%s rank %d tokens_per_local_expert (handle_info)", what, d);
    CHECK_BITS(w2, EPX_INT32, res->info_cnt[d], ex->cnt, L, L);
    CHECK(in->num_send_tokens == m->T[d], "%s rank %d: info.num_send_tokens %lld want %lld", what, d,
          (long long)in->num_send_tokens, (long long)m->T[d]);
    CHECK(in->num_recv_tokens == ex->ntok, "%s rank %d: info.num_recv_tokens %lld want %lld", what, d,
          (long long)in->num_recv_tokens, (long long)ex->ntok);
    CHECK(in->num_recv_pairs == ex->npairs, "%s rank %d: info.num_recv_pairs %lld want %lld", what, d,
          (long long)in->num_recv_pairs, (long long)ex->npairs);
    CHECK(in->num_sent_copies == ex->sent_copies, "%s rank %d: info.num_sent_copies %lld want %lld", what, d,
          (long long)in->num_sent_copies, (long long)ex->sent_copies);
    if (expert)
      CHECK(in->num_recv_rows == ex->nrows, "%s rank %d: info.num_recv_rows %lld want %lld", what, d,
            (long long)in->num_recv_rows, (long long)ex->nrows);
  }
  free(row);
  free(sc);
}

static void run_case(const case_t *c) {
  const int R = c->R, E = c->R * c->L;
  char what[200];
  snprintf(what, sizeof what, "[R=%d E=%d K=%d H=%d x=%s recv=%s %s align=%d form=%d weights=%d notify=%d]", R, E, c->K,
           c->H, tu_dtype(c->x_dtype), tu_dtype(c->recv_dtype), c->layout == EPX_LAYOUT_EXPERT ? "expert" : "token",
           c->align, c->form, c->weights, c->notify_first);
  int64_t T[TU_MAX_RANKS];
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 1, 60);
  if (R > 1) T[tu_int(&tu_rng, 0, R - 1)] = 0; /* one rank sends nothing */
  tu_route_opts_t o = tu_route_default();
  o.p_none = c->p_none;
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, c->H, c->K, c->x_dtype, T, &o, c->weights);
  if (c->form == TU_FORM_MAP) tu_moe_make_map(&m);

  tu_world_t w;
  epx_config_t cfg = tu_config(E, c->H, c->K, 64);
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  if (CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s world", what)) {
    epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, c->layout, c->align);
    if (tu_handles_create(&w, &hc, h) == EPX_SUCCESS) {
      tu_pipe_t p = tu_pipe_default();
      p.layout = c->layout, p.align = c->align, p.recv_dtype = c->recv_dtype, p.form = c->form;
      p.notify_first = c->notify_first, p.combine = 0, p.guard_rows = 2;
      /* Twice on the same handles: a re-plan with the same routing gives the same rows. */
      for (int rep = 0; rep < 2; rep++) {
        tu_pipe_res_t res;
        if (tu_pipe_check(what, &w, h, &m, &p, NULL, &res) == 0)
          for (int r = 0; r < R; r++) check_rank(what, c, &m, &res, r);
        tu_pipe_free(&res, R);
        p.notify_first = !p.notify_first;
      }
    }
    tu_handles_destroy(&w, h);
  }
  tu_world_destroy(&w);
  tu_moe_free(&m);
}

int main(void) {
  tu_begin("test_dispatch");
  const epx_dtype_t F = EPX_FLOAT32, B = EPX_BFLOAT16, Q = EPX_FP8_E4M3;
  const epx_layout_t TOK = EPX_LAYOUT_TOKEN, EXP = EPX_LAYOUT_EXPERT;
  const case_t cases[] = {
      /* R  L  K  H    x  recv layout align form            weights notify p_none */
      {4, 4, 4, 64, F, F, TOK, 1, TU_FORM_TOPK32, 1, 0, 0.25},
      {4, 4, 6, 64, B, B, TOK, 1, TU_FORM_TOPK32, 1, 1, 0.25},
      {4, 4, 4, 64, F, F, EXP, 1, TU_FORM_TOPK32, 1, 0, 0.25},
      {4, 4, 4, 64, F, F, EXP, 16, TU_FORM_TOPK32, 1, 1, 0.25},
      {4, 4, 4, 64, B, B, EXP, 128, TU_FORM_TOPK32, 1, 0, 0.25},
      {3, 5, 8, 32, F, F, TOK, 1, TU_FORM_TOPK64, 1, 0, 0.5},
      {3, 5, 8, 32, B, B, EXP, 16, TU_FORM_TOPK64, 1, 1, 0.5},
      {4, 2, 3, 48, F, F, TOK, 1, TU_FORM_TOPK32, 0, 0, 0.2},  /* no weights: every weight 1 */
      {4, 2, 3, 48, F, F, EXP, 4, TU_FORM_TOPK32, 0, 0, 0.2},
      {2, 8, 4, 64, F, F, TOK, 1, TU_FORM_MAP, 1, 0, 0.3},
      {2, 8, 4, 64, B, B, EXP, 16, TU_FORM_MAP, 1, 1, 0.3},
      {1, 6, 4, 32, F, F, TOK, 1, TU_FORM_TOPK32, 1, 0, 0.3},  /* one rank: everything local */
      {1, 6, 4, 32, F, F, EXP, 16, TU_FORM_TOPK32, 1, 0, 0.3},
      {4, 4, 4, 256, F, Q, TOK, 1, TU_FORM_TOPK32, 1, 0, 0.25}, /* fp8: two full blocks */
      {4, 4, 4, 208, B, Q, TOK, 1, TU_FORM_TOPK32, 1, 1, 0.25}, /* fp8: a partial last block */
      {4, 4, 4, 208, F, Q, EXP, 16, TU_FORM_TOPK32, 1, 0, 0.25},
      {4, 4, 4, 256, B, Q, EXP, 1, TU_FORM_TOPK64, 1, 1, 0.25},
      {8, 2, 8, 16, F, F, TOK, 1, TU_FORM_TOPK32, 1, 0, 0.9},  /* mostly -1 slots */
      {8, 2, 8, 16, B, B, EXP, 128, TU_FORM_TOPK32, 1, 0, 0.9},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
  return tu_end();
}
