/* test_property: a sweep over fresh random configs and routings, every result compared bit for
 * bit with dense_moe; half the cases feed special values (NaN payloads, infinities, -0.0,
 * subnormals, values past e4m3's range): copied rows keep their bits, every NaN that
 * arithmetic makes is canonical; half the cases run in several nodes (config.ranks_per_node)
 * against dense_moe's node-aware order. Each case is printed when it fails; EPX_TEST_SEED
 * reproduces the sweep.
 * EPX_TEST_CASES overrides the number of cases (default 100). */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { SC_RANDOM, SC_ONE_EXPERT, SC_SPARSE, SC_NOWHERE, SC_HOT_RANK, SC_FULL, SC_COUNT };
static const char *sc_name[SC_COUNT] = {"random", "one-expert", "sparse", "nowhere", "hot-rank", "full"};

static epx_dtype_t pick_float(void) { return tu_int(&tu_rng, 0, 1) ? EPX_BFLOAT16 : EPX_FLOAT32; }

/* Half the cases in several nodes: a random divisor of R below R (docs/design.md, "Nodes");
 * else one node, spelled 0 or R. */
static int pick_ranks_per_node(int R) {
  int divisors[EPX_MAX_RANKS], n = 0;
  for (int p = 1; p < R; p++)
    if (R % p == 0) divisors[n++] = p;
  if (n == 0 || tu_int(&tu_rng, 0, 1)) return tu_int(&tu_rng, 0, 1) ? R : 0;
  return divisors[tu_int(&tu_rng, 0, n - 1)];
}

/* ---- special values ------------------------------------------------------------------- */
/* NaNs with payloads (quiet, signalling, negative), infinities, -0.0, subnormals, values past
 * e4m3's range (448) and past bf16's largest finite value. */
static const uint32_t f32_specials[] = {0x7fc01234u, 0xffc00001u, 0x7f800001u, 0x7fffffffu, 0x7f800000u, 0xff800000u,
                                        0x80000000u, 0x00000001u, 0x807fffffu, 0x43f00000u /* 480 */,
                                        0xc8927c00u /* -3e5 */, 0x7f7fffffu};
static const uint16_t bf16_specials[] = {0x7fc1u, 0xffa5u, 0x7f81u, 0x7fffu, 0x7f80u, 0xff80u, 0x8000u,
                                         0x0001u, 0x807fu, 0x43f0u /* 480 */, 0xc893u, 0x7f7fu};

/* Overwrites about one element in `rate` of every rank's tokens with a special value. */
static void add_specials(tu_moe_t *m, int rate) {
  for (int r = 0; r < m->R; r++)
    for (int64_t i = 0; i < m->T[r] * m->H; i++) {
      if (tu_int(&tu_rng, 0, rate - 1)) continue;
      if (m->x_dtype == EPX_FLOAT32)
        memcpy((float *)m->x[r] + i, &f32_specials[tu_int(&tu_rng, 0, 11)], 4);
      else
        ((uint16_t *)m->x[r])[i] = bf16_specials[tu_int(&tu_rng, 0, 11)];
    }
}

/* Half the cases carry special values; a high rate sometimes, so that whole rows and fp8
 * blocks hold them. Returns the rate (0: none) and notes it in `what`. */
static int pick_specials(tu_moe_t *m, char *what, size_t size) {
  const int rate = tu_int(&tu_rng, 0, 1) ? (tu_int(&tu_rng, 0, 3) ? 40 : 3) : 0;
  if (rate) {
    add_specials(m, rate);
    strncat(what, " +special values", size - strlen(what) - 1);
  }
  return rate;
}

/* Every NaN that arithmetic made is the canonical one of its type. */
static void check_canonical_nans(const char *what, epx_dtype_t t, const void *out, int64_t n) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; i++) {
    int nan, canon;
    if (t == EPX_FLOAT32) {
      uint32_t u;
      memcpy(&u, (const float *)out + i, 4);
      nan = (u & 0x7fffffffu) > 0x7f800000u, canon = u == 0x7fffffffu;
    } else {
      uint16_t u = ((const uint16_t *)out)[i];
      nan = (u & 0x7fffu) > 0x7f80u, canon = u == 0x7fffu;
    }
    if (nan && !canon && bad++ == 0) first = i;
  }
  CHECK(bad == 0, "%s: %lld NaNs are not canonical (first at %lld)", what, (long long)bad, (long long)first);
}

/* A row that arrives in its own type is a copy: the bits of the source token, NaN payloads
 * included; padding rows are zero. */
static void check_copied_rows(const char *what, const tu_moe_t *m, const tu_pipe_t *p, const tu_pipe_res_t *res, int r) {
  const size_t rb = (size_t)m->H * (m->x_dtype == EPX_FLOAT32 ? 4 : 2);
  const int expert = p->layout == EPX_LAYOUT_EXPERT;
  const int64_t n = expert ? res->ex[r].nrows : res->ex[r].ntok;
  const tu_row_t *rows = expert ? res->ex[r].pair_rows : res->ex[r].tok_rows;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; i++) {
    const uint8_t *got = (const uint8_t *)res->recv_x[r] + i * rb;
    int ok = 1;
    if (rows[i].src < 0) {
      for (size_t b = 0; b < rb; b++) ok &= got[b] == 0;
    } else {
      ok = memcmp(got, (const uint8_t *)m->x[rows[i].src] + rows[i].tok * rb, rb) == 0;
    }
    if (!ok && bad++ == 0) first = i;
  }
  CHECK(bad == 0, "%s rank %d: %lld of %lld received rows are not the source's bits (first: row %lld)", what, r,
        (long long)bad, (long long)n, (long long)first);
}

static void run_layout(const char *what, tu_world_t *w, epx_handle_t **h, const tu_moe_t *m, const tu_pipe_t *p) {
  tu_pipe_res_t res;
  const int R = m->R;
  if (tu_pipe_check(what, w, h, m, p, NULL, &res) == 0)
    for (int r = 0; r < R; r++) { /* the plan's sizes agree with the routing */
      if (p->recv_dtype == m->x_dtype) check_copied_rows(what, m, p, &res, r);
      check_canonical_nans(what, p->out_dtype, res.out[r], m->T[r] * m->H);
      const tu_expect_t *ex = &res.ex[r];
      const int64_t want_rows = p->layout == EPX_LAYOUT_EXPERT ? ex->nrows : ex->ntok;
      CHECK(res.nrows[r] == want_rows, "%s rank %d: num_recv_rows %lld want %lld", what, r, (long long)res.nrows[r],
            (long long)want_rows);
      char ww[640];
      snprintf(ww, sizeof ww, "%s rank %d tokens per local expert", what, r);
      CHECK_BITS(ww, EPX_INT32, res.cnt[r], ex->cnt, m->L, m->L);
    }
  tu_pipe_free(&res, R);
}

/* Cases -2 and -1 reach the API's limits: EPX_MAX_EXPERTS experts over 4 ranks, and
 * EPX_MAX_RANKS ranks with 4 experts each, both with EPX_MAX_TOPK. (Both at once is left
 * out only for time: the host plan costs O(E * L * R) per rank.) */
static void one_case(int i) {
  static const int ranks[] = {1, 2, 3, 4, 8, 16};
  const int R = i == -2 ? 4 : i == -1 ? EPX_MAX_RANKS : ranks[tu_int(&tu_rng, 0, 5)];
  const int maxL = 256 / R < 16 ? 256 / R : 16;
  int L = i == -2 ? EPX_MAX_EXPERTS / R : i == -1 ? 4 : tu_int(&tu_rng, 1, maxL);
  if (i >= 0 && tu_int(&tu_rng, 0, 7) == 0) L = 256 / R; /* sometimes the largest E */
  const int E = R * L, K = i < 0 ? EPX_MAX_TOPK : tu_int(&tu_rng, 1, 8), H = 16 * tu_int(&tu_rng, 1, 4);
  const int sc = tu_int(&tu_rng, 0, SC_COUNT - 1);
  /* y = f32 two times in three: with bf16 partials the float32 sums are often exact, and
   * only inexact sums show a wrong summation order. */
  const epx_dtype_t x = pick_float(), y = tu_int(&tu_rng, 0, 2) ? EPX_FLOAT32 : EPX_BFLOAT16, out = pick_float();
  const epx_dtype_t recv = tu_int(&tu_rng, 0, 3) == 0 ? EPX_FP8_E4M3 : x;
  static const int aligns[] = {1, 2, 8, 16, 128};
  const int align = aligns[tu_int(&tu_rng, 0, 4)];
  const int form = tu_int(&tu_rng, 0, 3), weights = tu_int(&tu_rng, 0, 4) != 0;
  const int minimal = tu_int(&tu_rng, 0, 3) == 0;
  /* Every algorithm gives the same bits: the all-to-all baseline must match too. */
  const epx_algo_t algo = tu_int(&tu_rng, 0, 3) == 0 ? EPX_ALGO_ALLTOALL : EPX_ALGO_HT;
  const int P = pick_ranks_per_node(R); /* printed as R=R/P */

  int64_t T[TU_MAX_RANKS];
  const int all_empty = tu_int(&tu_rng, 0, 15) == 0;
  const int maxT = i < 0 ? 6 : 48;
  for (int r = 0; r < R; r++) T[r] = all_empty ? 0 : tu_int(&tu_rng, 0, maxT);
  T[tu_int(&tu_rng, 0, R - 1)] = 0; /* a rank with no tokens */

  tu_route_opts_t o = tu_route_default();
  switch (sc) {
    case SC_ONE_EXPERT: o.one_expert = tu_int(&tu_rng, 0, E - 1); break;
    case SC_SPARSE: o.p_none = 0.8; break;
    case SC_NOWHERE: o.p_none = 1.0; break;
    case SC_HOT_RANK: { /* every expert on one rank */
      const int d = tu_int(&tu_rng, 0, R - 1);
      o.span_lo = d * L, o.span_hi = (d + 1) * L;
      break;
    }
    case SC_FULL: o.p_none = 0.0; break;
    default: break;
  }
  char what[320];
  snprintf(what, sizeof what,
           "case %d [%s R=%d/%d E=%d K=%d H=%d %s x=%s recv=%s y=%s out=%s align=%d form=%d weights=%d minimal=%d]", i,
           algo == EPX_ALGO_HT ? "ht" : "alltoall", R, P, E, K, H, sc_name[sc], tu_dtype(x), tu_dtype(recv), tu_dtype(y),
           tu_dtype(out), align, form, weights, minimal);

  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, x, T, &o, weights), m.ranks_per_node = P; /* dense_moe's order */
  /* Sometimes weights of exactly 0 on chosen experts: still routed (only -1 means none). */
  const int zero_weights = weights && tu_int(&tu_rng, 0, 4) == 0;
  if (zero_weights)
    for (int r = 0; r < R; r++)
      for (int64_t j = 0; j < T[r] * K; j++)
        if (tu_int(&tu_rng, 0, 3) == 0) m.w[r][j] = 0.0f;
  if (zero_weights) strncat(what, " +zero weights", sizeof what - strlen(what) - 1);
  const int specials = pick_specials(&m, what, sizeof what);
  if (form >= TU_FORM_MAP) tu_moe_make_map(&m);

  tu_world_t w;
  epx_config_t cfg = tu_config(E, H, K, 64);
  cfg.ranks_per_node = P;
  if (!CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s world", what)) {
    tu_world_destroy(&w);
    tu_moe_free(&m);
    return;
  }
  epx_handle_t *ht[TU_MAX_RANKS] = {0}, *he[TU_MAX_RANKS] = {0};
  epx_handle_config_t hct = tu_handle_config(algo, EPX_LAYOUT_TOKEN, 1);
  epx_handle_config_t hce = tu_handle_config(algo, EPX_LAYOUT_EXPERT, align);
  if (tu_handles_create(&w, &hct, ht) == EPX_SUCCESS && tu_handles_create(&w, &hce, he) == EPX_SUCCESS) {
    tu_pipe_t p = tu_pipe_default();
    p.algo = algo;
    p.recv_dtype = recv, p.y_dtype = y, p.out_dtype = out, p.form = form, p.weighted = 1;
    p.notify_first = tu_int(&tu_rng, 0, 1), p.minimal = minimal;
    char w2[640];
    snprintf(w2, sizeof w2, "%s token layout", what);
    p.layout = EPX_LAYOUT_TOKEN, p.align = 1;
    run_layout(w2, &w, ht, &m, &p);
    snprintf(w2, sizeof w2, "%s expert layout", what);
    p.layout = EPX_LAYOUT_EXPERT, p.align = align;
    run_layout(w2, &w, he, &m, &p);

    /* A second routing on the same handles (re-plan), fresh tokens. */
    tu_moe_free(&m);
    for (int r = 0; r < R; r++) T[r] = tu_int(&tu_rng, 0, maxT);
    tu_moe_random(&m, &tu_rng, R, E, H, K, x, T, &o, weights), m.ranks_per_node = P;
    if (specials) add_specials(&m, specials);
    if (form >= TU_FORM_MAP) tu_moe_make_map(&m);
    snprintf(w2, sizeof w2, "%s token layout, re-planned", what);
    p.layout = EPX_LAYOUT_TOKEN, p.align = 1;
    run_layout(w2, &w, ht, &m, &p);
    snprintf(w2, sizeof w2, "%s expert layout, re-planned", what);
    p.layout = EPX_LAYOUT_EXPERT, p.align = align;
    run_layout(w2, &w, he, &m, &p);
  }
  tu_handles_destroy(&w, ht);
  tu_handles_destroy(&w, he);
  tu_world_destroy(&w);
  tu_moe_free(&m);
}

int main(void) {
  tu_begin("test_property");
  int cases = 100;
  const char *env = getenv("EPX_TEST_CASES");
  if (env && atoi(env) > 0) cases = atoi(env);
  for (int i = -2; i < cases; i++) {
    const long before = check_failures();
    one_case(i);
    if (check_failures() != before) printf("  (case %d failed)\n", i);
  }
  return tu_end();
}
