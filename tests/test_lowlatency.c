/* test_lowlatency: EPX_ALGO_LL handles. Fixed [L, R * max_tokens, H] receive buffers, rows of
 * expert l from l * R * max_tokens in (source rank, source token) order, untouched rows past
 * the counts, weighted combine equal to dense_moe's expert layout, and the overflow error. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* L = 4 and K = 6: tokens often pick three or more experts of one rank, so the order of the
 * destination-side sum matters to the bits. */
enum { R = 4, L = 4, E = R * L, K = 6, MAXT = 16 };

static size_t dsize(epx_dtype_t t) { return t == EPX_FLOAT32 ? 4 : t == EPX_BFLOAT16 ? 2 : 1; }

static void check_recv(const char *what, const tu_moe_t *m, const tu_pipe_t *p, const tu_pipe_res_t *res, int d) {
  const int H = m->H, nb = tu_nblocks(H);
  const tu_expect_t *ex = &res->ex[d];
  const size_t rb = (size_t)H * dsize(p->recv_dtype);
  const int64_t stride = (int64_t)R * MAXT;
  CHECK(res->cap[d] == L * stride, "%s: LL buffer rows %lld", what, (long long)res->cap[d]);
  char w2[640];
  snprintf(w2, sizeof w2, "%s rank %d tokens_per_local_expert", what, d);
  CHECK_BITS(w2, EPX_INT32, res->cnt[d], ex->cnt, L, L);

  uint8_t *row = malloc(rb);
  float *sc = malloc(sizeof(float) * (size_t)nb), *f = malloc(sizeof(float) * (size_t)H);
  long bad_x = 0, bad_sc = 0, bad_p = 0, touched = 0;
  int64_t pr = 0; /* walks ex->pair_rows (align 1: no padding) */
  for (int l = 0; l < L; l++) {
    for (int64_t i = 0; i < stride; i++) {
      const int64_t n = l * stride + i;
      const uint8_t *got = (const uint8_t *)res->recv_x[d] + (size_t)n * rb;
      if (i >= ex->cnt[l]) { /* past the count: left as it was */
        touched += !tu_is_poison(got, rb);
        continue;
      }
      const tu_row_t *er = &ex->pair_rows[pr++];
      if (p->recv_dtype == EPX_FP8_E4M3) {
        for (int c = 0; c < H; c++) f[c] = tu_load(m->x_dtype, m->x[er->src], (size_t)(er->tok * H + c));
        epx_quantize_row_e4m3(f, H, row, sc);
        bad_sc += memcmp(res->recv_scales[d] + n * nb, sc, sizeof(float) * (size_t)nb) != 0;
      } else {
        memcpy(row, (const uint8_t *)m->x[er->src] + (size_t)(er->tok * H) * dsize(m->x_dtype), rb);
      }
      if (memcmp(got, row, rb) && bad_x++ == 0)
        printf("  %s rank %d: row %lld (expert %d, #%lld) should be token %lld of rank %d\n", what, d, (long long)n, l,
               (long long)i, (long long)er->tok, er->src);
      const float want_p = m->w[er->src] ? m->w[er->src][er->tok * K + er->k] : 1.0f;
      bad_p += memcmp(&res->recv_probs[d][n], &want_p, sizeof(float)) != 0;
    }
  }
  CHECK(bad_x == 0, "%s rank %d: %ld LL rows differ", what, d, bad_x);
  CHECK(bad_sc == 0, "%s rank %d: %ld LL rows with wrong fp8 scales", what, d, bad_sc);
  CHECK(bad_p == 0, "%s rank %d: %ld wrong recv_probs", what, d, bad_p);
  CHECK(touched == 0, "%s rank %d: %ld rows past the counts were written", what, d, touched);
  free(row), free(sc), free(f);
}

static void run(const char *what, tu_world_t *w, epx_handle_t **h, const tu_pipe_t *p, epx_dtype_t x, int H) {
  int64_t T[R];
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 1, MAXT);
  T[tu_int(&tu_rng, 0, R - 1)] = MAXT; /* one rank at capacity */
  T[tu_int(&tu_rng, 0, R - 1)] = 0;
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, x, T, &o, 1);
  tu_pipe_res_t res;
  if (tu_pipe_check(what, w, h, &m, p, NULL, &res) == 0)
    for (int r = 0; r < R; r++) check_recv(what, &m, p, &res, r);
  tu_pipe_free(&res, R);
  tu_moe_free(&m);
}

static void overflow(const char *what, tu_world_t *w, epx_handle_t **h, const tu_pipe_t *p, epx_dtype_t x, int H) {
  int64_t T[R];
  for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 1, MAXT);
  const int bad = tu_int(&tu_rng, 0, R - 1);
  T[bad] = MAXT + 1;
  tu_route_opts_t o = tu_route_default();
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, x, T, &o, 1);
  tu_pipe_res_t res;
  tu_pipe_run(w, h, &m, p, &res);
  const size_t rb = (size_t)H * dsize(p->recv_dtype);
  for (int r = 0; r < R; r++) {
    CHECK_STATUS(res.dispatch_st[r], EPX_ERR_LL_OVERFLOW, "%s: rank %d, rank %d has %d tokens of %d", what, r, bad,
                 MAXT + 1, MAXT);
    CHECK(res.err[r][0] != '\0', "%s rank %d: an overflow message", what, r);
    CHECK(tu_is_poison(res.recv_x[r], (size_t)res.cap[r] * rb), "%s rank %d: recv_x written despite the overflow",
          what, r);
    CHECK(tu_is_poison(res.recv_probs[r], sizeof(float) * (size_t)res.cap[r]),
          "%s rank %d: recv_probs written despite the overflow", what, r);
  }
  printf("  overflow message on rank %d: \"%s\"\n", bad, res.err[bad]);
  tu_pipe_free(&res, R);
  tu_moe_free(&m);
}

int main(void) {
  tu_begin("test_lowlatency");
  static const struct {
    epx_dtype_t x, recv, y, out;
    int H;
  } cases[] = {
      {EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, 64},
      {EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, 64},
      {EPX_BFLOAT16, EPX_FP8_E4M3, EPX_BFLOAT16, EPX_BFLOAT16, 256},
      {EPX_FLOAT32, EPX_FP8_E4M3, EPX_BFLOAT16, EPX_FLOAT32, 144},
      {EPX_BFLOAT16, EPX_BFLOAT16, EPX_FLOAT32, EPX_BFLOAT16, 32},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char what[160];
    snprintf(what, sizeof what, "[LL x=%s recv=%s y=%s out=%s H=%d]", tu_dtype(cases[i].x), tu_dtype(cases[i].recv),
             tu_dtype(cases[i].y), tu_dtype(cases[i].out), cases[i].H);
    tu_world_t w;
    epx_config_t cfg = tu_config(E, cases[i].H, K, MAXT);
    if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s world", what)) {
      tu_world_destroy(&w);
      continue;
    }
    epx_handle_t *h[TU_MAX_RANKS] = {0};
    /* The layout field is ignored by LL (always the expert layout): pass the token one. */
    epx_handle_config_t hc = tu_handle_config(EPX_ALGO_LL, EPX_LAYOUT_TOKEN, 1);
    if (tu_handles_create(&w, &hc, h) == EPX_SUCCESS) {
      tu_pipe_t p = tu_pipe_default();
      p.algo = EPX_ALGO_LL, p.layout = EPX_LAYOUT_EXPERT, p.recv_dtype = cases[i].recv, p.y_dtype = cases[i].y;
      p.out_dtype = cases[i].out, p.weighted = 1, p.guard_rows = 0;
      /* Three routings on one handle (re-plans), an overflow, then one more that works. */
      for (int it = 0; it < 3; it++) run(what, &w, h, &p, cases[i].x, cases[i].H);
      overflow(what, &w, h, &p, cases[i].x, cases[i].H);
      run(what, &w, h, &p, cases[i].x, cases[i].H);
    }
    tu_handles_destroy(&w, h);
    tu_world_destroy(&w);
  }
  return tu_end();
}
