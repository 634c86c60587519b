/* test_property: a sweep over fresh random configs and routings, every result compared bit for
 * bit with dense_moe; half the cases feed special values in the tokens and the routing
 * weights (NaN payloads, infinities, -0.0, subnormals, values past e4m3's range): copied rows
 * keep their bits, every NaN that arithmetic makes is canonical; half the cases run in several nodes (config.ranks_per_node)
 * against dense_moe's node-aware order. Each case is printed when it fails; EPX_TEST_SEED
 * reproduces the sweep.
 * EPX_TEST_CASES overrides the number of cases (default 100). */
#include <math.h>
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

/* ---- special values (tu_add_specials) ------------------------------------------------- */
/* Half the cases carry special values; a high rate sometimes, so that whole rows and fp8
 * blocks hold them. Returns the rate (0: none) and notes it in `what`. */
static int pick_specials(tu_moe_t *m, char *what, size_t size) {
  const int rate = tu_int(&tu_rng, 0, 1) ? (tu_int(&tu_rng, 0, 3) ? 40 : 3) : 0;
  if (rate) {
    tu_moe_add_specials(m, &tu_rng, rate);
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
    if (specials) tu_moe_add_specials(&m, &tu_rng, specials);
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

/* ---- the rule, directed: what the sweep's special-value cases rely on ------------------- */

/* The sprinkled inputs hold every kind of special value, at about the rate asked (a sweep whose
 * inputs held none would pass without testing the rule), and plain random values hold none. */
static void sprinkled_inputs(void) {
  static const epx_dtype_t types[] = {EPX_FLOAT32, EPX_BFLOAT16};
  static const int rates[] = {3, 50, 200};
  const int64_t n = 1 << 16;
  float *buf = malloc(sizeof(float) * (size_t)n);
  for (int ti = 0; ti < 2; ti++)
    for (int ri = 0; ri < 3; ri++) {
      const epx_dtype_t t = types[ti];
      char what[64];
      snprintf(what, sizeof what, "%s specials at 1 in %d", tu_dtype(t), rates[ri]);
      for (int64_t i = 0; i < n; i++) tu_store(t, buf, (size_t)i, tu_value(&tu_rng));
      tu_specials_t c;
      tu_count_specials(t, buf, n, &c);
      CHECK(tu_specials_total(&c) == 0, "%s: %lld random values counted as special", what,
            (long long)tu_specials_total(&c));
      tu_add_specials(&tu_rng, t, buf, n, rates[ri]);
      tu_count_specials(t, buf, n, &c);
      tu_check_specials(what, &c);
      const double want = (double)n / rates[ri], got = (double)tu_specials_total(&c);
      CHECK(got > 0.8 * want && got < 1.2 * want, "%s: %.0f special values, want about %.0f", what, got, want);
    }
  free(buf);
}

/* One element's bits: float32, bf16 or an fp8 byte. */
static uint32_t bits_at(epx_dtype_t t, const void *base, int64_t i) {
  uint32_t u = 0;
  memcpy(&u, (const uint8_t *)base + i * (int64_t)epx_dtype_size(t), epx_dtype_size(t));
  return u;
}

static void put_bits(epx_dtype_t t, void *base, int64_t i, uint32_t u) {
  memcpy((uint8_t *)base + i * (int64_t)epx_dtype_size(t), &u, epx_dtype_size(t));
}

/* The receive row of rank 1 that holds (rank 0's) token t. */
static int64_t row_of(const tu_expect_t *ex, epx_layout_t layout, int64_t t) {
  const int expert = layout == EPX_LAYOUT_EXPERT;
  const tu_row_t *rows = expert ? ex->pair_rows : ex->tok_rows;
  for (int64_t i = 0; i < (expert ? ex->nrows : ex->ntok); i++)
    if (rows[i].src == 0 && rows[i].tok == t) return i;
  return -1;
}

/* rule_case's checks, on rank 1's receive rows r0 and r1 (rank 0's tokens 0 and 1), the
 * stand-in expert's y there, and rank 0's combine output. */
static void rule_checks(const char *what, epx_layout_t layout, epx_dtype_t x, epx_dtype_t recv, epx_dtype_t y,
                        const tu_moe_t *m, const tu_pipe_res_t *res, int64_t r0, int64_t r1) {
  const int H = m->H;
  const uint32_t out_nan = y == EPX_FLOAT32 ? 0x7fffffffu : 0x7fffu, out_inf = y == EPX_FLOAT32 ? 0x7f800000u : 0x7f80u;
  if (recv == x) {
    for (int c = 0; c < 3; c++)
      CHECK(bits_at(x, res->recv_x[1], r0 * H + c) == bits_at(x, m->x[0], c), "%s: channel %d arrived as 0x%x, sent 0x%x",
            what, c, (unsigned)bits_at(x, res->recv_x[1], r0 * H + c), (unsigned)bits_at(x, m->x[0], c));
    if (y == EPX_FLOAT32) { /* the premise: the combine is handed a NaN with a payload */
      const uint32_t y0 = bits_at(y, res->y[1], r0 * H);
      CHECK((y0 & 0x7fffffffu) > 0x7f800000u && y0 != 0x7fffffffu, "%s: y holds a NaN payload: 0x%x", what, (unsigned)y0);
    }
  } else {
    const uint8_t *q = res->recv_x[1];
    CHECK(q[r0 * H] == 0x7f && q[r0 * H + 2] == 0x7f, "%s: NaNs quantise to 0x7f, got 0x%x 0x%x", what, q[r0 * H],
          q[r0 * H + 2]);
    float amax = 0.0f; /* of the block's numbers: its NaNs left out */
    for (int c = 0; c < H; c++) {
      const float v = fabsf(tu_load(x, m->x[0], (size_t)c));
      if (v == v && v > amax) amax = v;
    }
    const float want = (amax > 1e-4f ? amax : 1e-4f) / 448.0f, got = res->recv_scales[1][r0];
    CHECK(got == want, "%s: token 0's scale %.9g, want %.9g", what, got, want);
    CHECK(bits_at(EPX_FLOAT32, res->recv_scales[1], r1) == 0x7f800000u, "%s: token 1's scale %g, want +inf", what,
          res->recv_scales[1][r1]);
    int64_t bad = 0; /* x * (448 / inf): +-0, and NaN for the infinity */
    for (int c = 0; c < H; c++)
      bad += q[r1 * H + c] != (c == 5 ? 0x7f : signbit(tu_load(x, m->x[0], (size_t)(H + c))) ? 0x80 : 0x00);
    CHECK(bad == 0, "%s: %lld of token 1's elements are not +-0 (0x7f for the infinity)", what, (long long)bad);
  }
  if (layout == EPX_LAYOUT_EXPERT) /* the premise: y = scale * x keeps the sign of -0.0 */
    CHECK(bits_at(y, res->y[1], r0 * H + 1) == (y == EPX_FLOAT32 ? 0x80000000u : 0x8000u), "%s: y holds -0.0: 0x%x",
          what, (unsigned)bits_at(y, res->y[1], r0 * H + 1));
  const void *out = res->out[0];
  CHECK(bits_at(y, out, 0) == out_nan && bits_at(y, out, 2) == out_nan, "%s: NaN sums 0x%x 0x%x, want 0x%x", what,
        (unsigned)bits_at(y, out, 0), (unsigned)bits_at(y, out, 2), (unsigned)out_nan);
  CHECK(bits_at(y, out, 1) == 0, "%s: a sum of -0.0 from +0.0f is +0.0, got 0x%x", what, (unsigned)bits_at(y, out, 1));
  if (recv == x) {
    CHECK(bits_at(y, out, H + 5) == out_inf, "%s: +inf sums to 0x%x", what, (unsigned)bits_at(y, out, H + 5));
  } else {
    int64_t bad = 0;
    for (int c = 0; c < H; c++) bad += bits_at(y, out, H + c) != out_nan;
    CHECK(bad == 0, "%s: a block with scale +inf arrives as NaN: %lld elements are not 0x%x", what, (long long)bad,
          (unsigned)out_nan);
  }
}

/* Rank 0's two tokens, both to rank 1's only expert, hold hand-placed special values: token 0
 * a quiet NaN with a payload (channel 0), -0.0 (1) and a negative signalling NaN (2); token 1
 * +inf (5). On the host backend: a row received in its own type keeps those bits; the
 * combine's float32 sums start at +0.0f, so -0.0 comes back +0.0, and every NaN they make is
 * the canonical one (float32 0x7FFFFFFF, bf16 0x7FFF) even where the stand-in expert's x86
 * arithmetic handed it a payload; fp8 quantises a NaN to 0x7F and leaves it out of the block's
 * amax, and a block holding an infinity gets the scale +inf, so it arrives as NaN throughout. */
static void rule_case(epx_layout_t layout, epx_dtype_t x, epx_dtype_t recv, epx_dtype_t y) {
  const int R = 2, E = 2, K = 1, H = 128;
  const int f32 = x == EPX_FLOAT32;
  const uint32_t payload = f32 ? 0x7fc01234u : 0x7fc1u, signalling = f32 ? 0xff800001u : 0xff81u;
  const uint32_t neg_zero = f32 ? 0x80000000u : 0x8000u, inf = f32 ? 0x7f800000u : 0x7f80u;
  char what[160];
  snprintf(what, sizeof what, "special-value rule [%s layout x=%s recv=%s y=out=%s]",
           layout == EPX_LAYOUT_EXPERT ? "expert" : "token", tu_dtype(x), tu_dtype(recv), tu_dtype(y));
  const int64_t T[2] = {2, 0};
  tu_route_opts_t o = tu_route_default();
  o.one_expert = 1;
  tu_moe_t m;
  tu_moe_random(&m, &tu_rng, R, E, H, K, x, T, &o, 1);
  put_bits(x, m.x[0], 0, payload), put_bits(x, m.x[0], 1, neg_zero), put_bits(x, m.x[0], 2, signalling);
  put_bits(x, m.x[0], H + 5, inf);
  tu_world_t w;
  epx_config_t cfg = tu_config(E, H, K, 64);
  epx_handle_t *h[TU_MAX_RANKS] = {0};
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, layout, 1);
  tu_pipe_res_t res;
  memset(&res, 0, sizeof res);
  if (CHECK_STATUS(tu_world_create(&w, R, &cfg, NULL, NULL), EPX_SUCCESS, "%s world", what) &&
      CHECK_STATUS(tu_handles_create(&w, &hc, h), EPX_SUCCESS, "%s handles", what)) {
    tu_pipe_t p = tu_pipe_default();
    p.layout = layout, p.recv_dtype = recv, p.y_dtype = y, p.out_dtype = y;
    if (tu_pipe_check(what, &w, h, &m, &p, NULL, &res) == 0) {
      const int64_t r0 = row_of(&res.ex[1], layout, 0), r1 = row_of(&res.ex[1], layout, 1);
      CHECK(r0 >= 0 && r1 >= 0, "%s: both tokens arrive on rank 1", what);
      if (r0 >= 0 && r1 >= 0) rule_checks(what, layout, x, recv, y, &m, &res, r0, r1);
    }
  }
  tu_pipe_free(&res, R);
  tu_moe_free(&m);
  tu_handles_destroy(&w, h);
  tu_world_destroy(&w);
}

static void special_rules(void) {
  static const epx_dtype_t types[] = {EPX_FLOAT32, EPX_BFLOAT16};
  for (int layout = 0; layout < 2; layout++)
    for (int xi = 0; xi < 2; xi++)
      for (int yi = 0; yi < 2; yi++) {
        const epx_layout_t l = layout ? EPX_LAYOUT_EXPERT : EPX_LAYOUT_TOKEN;
        rule_case(l, types[xi], types[xi], types[yi]);
        rule_case(l, types[xi], EPX_FP8_E4M3, types[yi]);
      }
}

int main(void) {
  tu_begin("test_property");
  sprinkled_inputs();
  special_rules();
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
