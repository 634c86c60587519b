/* The CUDA backend against the host backend, bit for bit: dispatch outputs in both layouts
 * and low-latency mode, combine, and both backward passes, over fresh random routings; later
 * tables add skewed routings, special values (NaN payloads, infinities, -0.0, subnormals) in
 * every input, receive budgets, decode steps, the combine's row sizes, a notify whose scan
 * does not fit shared memory and routings wider than top-8.
 *   test_cuda_match               every case of the table
 *   test_cuda_match --list        prints the cases with their indices, runs nothing
 *   test_cuda_match 0,4 15-17     only the cases selected by index: comma-separated indices
 *                                 and ranges, in one or more arguments (for slow tools such as
 *                                 compute-sanitizer); a bad or empty selection is refused
 * Case i draws its inputs from its own stream of the seed, so EPX_TEST_SEED=S with case i alone
 * replays what case i got in a whole run with seed S. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuutil.h"

/* The table covers: R {2,4,8}, H {2048,2880,4096,7168}, K {1,2,8},
 * E {8,64,256}, T {0,1,4095,4096}, both layouts, align {1,16,128}, bf16 and float32, fp8
 * dispatch, each routing form, exact and sync-free sizing, uneven token counts. The last
 * rows stress the pipelined dispatch (7 KB stages): rows shorter than a stage (H 2880 bf16),
 * straddling two (4096 bf16, 2048 and 2880 float32), 5120 bf16 (a stage and a remainder),
 * every token on one expert, every token to one rank, and 32768 tokens per rank. */
static const gu_row_t cases[] = {
    {2, 8, 1, 2048, 4096, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 1, 0},
    {2, 8, 2, 2880, 4095, HT, EXP, 16, BF, BF, TU_FORM_TOPK64, 1, 1},
    {4, 64, 8, 4096, 1, HT, TOK, 1, F32, F32, TU_FORM_TOPK32, 0, 0},
    {4, 64, 2, 7168, 0, HT, EXP, 128, BF, BF, TU_FORM_TOPK32, 1, 0},
    {8, 256, 8, 2048, 512, HT, EXP, 128, BF, FP8, TU_FORM_TOPK32, 1, 1},
    {8, 256, 8, 7168, 256, HT, TOK, 1, BF, FP8, TU_FORM_TOPK32, 0, 0},
    {8, 64, 1, 2880, 1000, HT, TOK, 1, F32, F32, TU_FORM_MAP, 1, 1},
    {8, 8, 8, 4096, 300, HT, EXP, 1, F32, FP8, TU_FORM_MAP, 0, 0},
    {4, 256, 8, 2048, 4095, HT, EXP, 16, F32, F32, TU_FORM_TOPK64, 0, 1},
    {2, 64, 8, 7168, 4096, HT, EXP, 128, BF, BF, TU_FORM_TOPK32, 1, 0},
    {4, 8, 2, 4096, 1, HT, EXP, 16, BF, BF, TU_FORM_MAP, 1, 0},
    {2, 256, 1, 2880, 0, HT, TOK, 1, F32, F32, TU_FORM_TOPK32, 0, 0},
    {8, 256, 8, 7168, 4096, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 1, 1},
    {8, 256, 8, 7168, 2048, HT, EXP, 128, BF, BF, TU_FORM_TOPK32, 0, 0},
    {8, 256, 8, 7168, 128, LL, EXP, 1, BF, BF, TU_FORM_TOPK32, 0, 1},
    {4, 64, 8, 2048, 37, LL, EXP, 1, BF, FP8, TU_FORM_TOPK32, 0, 0},
    {2, 8, 1, 4096, 0, LL, EXP, 1, F32, F32, TU_FORM_TOPK64, 0, 0},
    {8, 64, 1, 4096, 256, LL, EXP, 1, BF, FP8, TU_FORM_TOPK32, 0, 1},
    /* the all-to-all baseline: the same bits through permute, chunks and sort */
    {8, 256, 8, 7168, 1024, A2A, TOK, 1, BF, BF, TU_FORM_TOPK32, 1, 1},
    {8, 256, 8, 4096, 512, A2A, EXP, 128, BF, BF, TU_FORM_TOPK32, 0, 0},
    {4, 64, 2, 2880, 333, A2A, EXP, 16, BF, FP8, TU_FORM_TOPK64, 1, 1},
    {2, 8, 8, 2048, 100, A2A, TOK, 1, F32, F32, TU_FORM_MAP, 0, 0},
};

/* A case of the tables after the first: its row and what it sets beyond it (left 0: random
 * routing, no special values, no budget, 16 SMs, the combines' output in x's type). */
typedef struct {
  gu_row_t row;
  gu_route_t route;
  int specials, budget, num_sms;
  int out_other; /* the combines' output in the other float type (bf16 <-> float32) */
} extra_t;

/* Skews and sizes for the pipelines, after the table so its cases keep their indices (and
 * their inputs: case i draws from stream i of the seed). */
static const extra_t skewed[] = {
    {{8, 256, 8, 7168, 1024, HT, EXP, 128, BF, BF, TU_FORM_TOPK32, 1, 0}, .route = GU_ROUTE_ONE_EXPERT},
    {{8, 256, 8, 5120, 1024, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 0, 1}, .route = GU_ROUTE_ONE_RANK},
    {{4, 64, 8, 7168, 512, HT, EXP, 1, BF, FP8, TU_FORM_TOPK32, 0, 0}, .route = GU_ROUTE_ONE_RANK},
    {{4, 64, 2, 5120, 700, HT, EXP, 16, BF, BF, TU_FORM_MAP, 1, 1}, .route = GU_ROUTE_ONE_EXPERT},
    {{2, 16, 2, 2048, 32768, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 0, 0}, .route = GU_ROUTE_RANDOM},
};

/* Special values (docs/design.md, "Arithmetic, exactly": NaN), after the skewed cases for the
 * same reason: about one element in `specials` of every floating input the calls take (x, the
 * routing weights or probs, x2, the row weight gradients, and y) is a NaN with a payload, the
 * canonical NaN, an infinity, -0.0, a subnormal or a value past e4m3's range; copies must keep
 * their bits, sums and conversions must give the host's canonical NaNs, and the fp8 quantiser
 * must meet NaN and infinities in its amax as the host's does. Every algorithm and layout, both
 * element types, fp8 (rows of 2880 end in a 64-channel block), float32 rows whose width is not
 * a multiple of 8 (the one-channel tails). Sizes small enough for the host backend. */
static const extra_t special[] = {
    {{4, 32, 4, 2048, 256, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 1, 0}, .specials = 64},
    {{8, 64, 8, 2048, 128, HT, EXP, 16, BF, BF, TU_FORM_TOPK32, 0, 1}, .specials = 100},
    {{4, 32, 4, 2052, 200, HT, EXP, 1, F32, F32, TU_FORM_MAP, 1, 0}, .specials = 50},
    {{2, 16, 8, 4096, 128, HT, EXP, 128, BF, FP8, TU_FORM_TOPK32, 1, 0}, .specials = 200},
    {{4, 64, 8, 2880, 256, HT, TOK, 1, F32, FP8, TU_FORM_TOPK64, 0, 1}, .specials = 200},
    {{4, 32, 8, 2048, 64, LL, EXP, 1, BF, BF, TU_FORM_TOPK32, 0, 1}, .specials = 50},
    {{2, 16, 2, 2052, 100, LL, EXP, 1, F32, F32, TU_FORM_TOPK64, 0, 0}, .specials = 128},
    {{4, 64, 8, 2048, 128, LL, EXP, 1, BF, FP8, TU_FORM_MAP, 0, 0}, .specials = 200},
    {{4, 32, 4, 2052, 256, A2A, TOK, 1, F32, F32, TU_FORM_TOPK32, 1, 0}, .specials = 64},
    {{4, 32, 2, 2880, 300, A2A, EXP, 16, BF, BF, TU_FORM_MAP, 0, 1}, .specials = 100},
    {{2, 16, 8, 4096, 128, A2A, EXP, 128, F32, FP8, TU_FORM_TOPK32, 1, 0}, .specials = 200},
};

/* Receive budgets (docs/design.md, "Receive budget"), after the special values: rank r keeps
 * about `budget` percent of its rows (a different share per rank, none on every third), so
 * pairs are dropped at the end of some experts' blocks and whole experts go empty. Both
 * dispatch kernels (bulk copies, fp8), sync-free and exact sizing, every token on one expert,
 * and the gradients (the dispatch replay, a dropped pair's weight gradient 0). */
static const extra_t budgeted[] = {
    {{4, 32, 4, 2048, 256, HT, EXP, 16, BF, BF, TU_FORM_TOPK32, 1, 0}, .budget = 60},
    {{8, 64, 8, 7168, 512, HT, EXP, 128, BF, FP8, TU_FORM_TOPK32, 0, 1}, .budget = 40},
    {{2, 16, 2, 4096, 300, HT, EXP, 1, F32, F32, TU_FORM_MAP, 0, 0}, .budget = 75},
    {{2, 32, 8, 2880, 200, HT, EXP, 16, BF, BF, TU_FORM_TOPK64, 1, 0}, .route = GU_ROUTE_ONE_EXPERT, .budget = 50},
};

/* Decode steps, after the budgets: the low-latency kernels cut rows into slices when a step
 * has fewer rows than the launch has warps (more SMs: thinner slices, fp8 scale blocks and
 * float32 tails inside a row), a rank with no tokens, one token, a step of exactly the
 * capacity with every token on one expert, a plan too large to build in shared memory
 * (8 ranks, 256 experts, 512 tokens), and a routing too large to keep there beside its bitmaps
 * (1500 tokens of top-8: the pushes read the caller's arrays again). */
static const extra_t decode[] = {
    {{2, 64, 8, 7168, 16, LL, EXP, 1, BF, FP8, TU_FORM_TOPK32, 0, 1}, .num_sms = 64},
    {{2, 32, 4, 7168, 1, LL, EXP, 1, BF, BF, TU_FORM_TOPK32, 0, 0}, .num_sms = 16},
    {{4, 64, 8, 4096, 64, LL, EXP, 1, BF, BF, TU_FORM_TOPK64, 0, 0}, .route = GU_ROUTE_ONE_EXPERT, .num_sms = 32},
    {{2, 16, 2, 2052, 24, LL, EXP, 1, F32, F32, TU_FORM_MAP, 0, 1}, .num_sms = 64},
    {{8, 256, 8, 7168, 32, LL, EXP, 1, BF, BF, TU_FORM_TOPK32, 0, 1}, .num_sms = 16},
    {{8, 256, 8, 2048, 512, LL, EXP, 1, BF, BF, TU_FORM_TOPK32, 0, 0}, .num_sms = 16},
    {{2, 64, 8, 256, 1500, LL, EXP, 1, BF, BF, TU_FORM_TOPK64, 0, 1}, .num_sms = 16},
};

/* The staged fp8 dispatch (bf16 rows of more than 1024 channels), after the decode steps:
 * rows that end half way into a chunk (2560 and 1536 channels) or inside a scale block (2000),
 * special values in its amax, every token on one expert with one token on some ranks; and rows
 * of 1024, which go through the lanes' rings instead. */
static const extra_t staged[] = {
    {{4, 32, 4, 2560, 300, HT, EXP, 16, BF, FP8, TU_FORM_TOPK32, 1, 0}, .route = GU_ROUTE_RANDOM},
    {{2, 16, 2, 1536, 1000, HT, TOK, 1, BF, FP8, TU_FORM_TOPK64, 0, 1}, .route = GU_ROUTE_ONE_RANK, .specials = 100},
    {{8, 64, 8, 7168, 1, HT, EXP, 128, BF, FP8, TU_FORM_TOPK32, 1, 0}, .route = GU_ROUTE_ONE_EXPERT},
    {{4, 32, 4, 2000, 200, HT, EXP, 16, BF, FP8, TU_FORM_TOPK32, 0, 1}, .specials = 200},
    {{4, 64, 2, 1024, 333, HT, EXP, 16, BF, FP8, TU_FORM_TOPK64, 1, 1}, .route = GU_ROUTE_RANDOM},
};

/* The combine's rows and types, after the staged fp8 cases: rows of 16 KB and a remainder
 * (float32 5120, bf16 9216), of exactly 16 KB (bf16 8192) and of 48 KB (float32 12288, the
 * all-to-all's sums), outputs in the other type (float32 rows summed into bf16 and back), a rank
 * with no tokens, one token a rank with every token on one expert, and 2 SMs, so that each
 * block of the combine's kernels takes many tokens. */
static const extra_t sums[] = {
    {{4, 32, 4, 5120, 300, HT, EXP, 16, F32, F32, TU_FORM_TOPK32, 1, 0}, .out_other = 1},
    {{2, 16, 8, 9216, 200, HT, TOK, 1, BF, BF, TU_FORM_TOPK64, 0, 1}, .out_other = 1},
    {{8, 64, 8, 8192, 1, HT, EXP, 128, BF, BF, TU_FORM_MAP, 0, 0}, .route = GU_ROUTE_ONE_EXPERT},
    {{4, 64, 8, 12288, 100, A2A, EXP, 16, F32, F32, TU_FORM_TOPK32, 1, 1}, .out_other = 1},
    {{8, 256, 8, 7168, 1024, HT, EXP, 128, BF, BF, TU_FORM_TOPK32, 0, 0}, .route = GU_ROUTE_ONE_RANK, .num_sms = 2},
    {{8, 256, 8, 7168, 1024, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 0, 1}, .num_sms = 2},
};

/* Notify's sizes, after the combine's: a ticket whose prefix popcounts do not fit its shared
 * memory (8 ranks of 8192 tokens, 256 experts, 2 SMs: 128 bitmap words a ticket, 135 KB of
 * popcounts), so they go into the plan and come back for the scan. */
static const extra_t notify_sizes[] = {
    {{8, 256, 8, 128, 8192, HT, EXP, 128, BF, BF, TU_FORM_TOPK32, 0, 1}, .num_sms = 2},
};

/* Routings wider than top-8, after notify's sizes (the cases above stop at 8): up to the
 * CUDA backend's 16 slots, in every algorithm, both layouts and each routing form. The
 * kernels read and check a routing of topk <= 8 with a copy unrolled to 8 slots
 * (EPXC_FEW_SLOTS), wider ones with the full copy: these cases run the full one. */
static const extra_t wide[] = {
    {{4, 64, 16, 2048, 300, HT, TOK, 1, BF, BF, TU_FORM_TOPK32, 1, 1}, .route = GU_ROUTE_RANDOM},
    {{2, 32, 12, 2880, 200, HT, EXP, 16, F32, F32, TU_FORM_TOPK64, 0, 0}, .route = GU_ROUTE_RANDOM},
    {{4, 32, 16, 2048, 128, HT, EXP, 128, BF, FP8, TU_FORM_MAP, 1, 0}, .route = GU_ROUTE_RANDOM},
    {{4, 64, 16, 2048, 64, LL, EXP, 1, BF, BF, TU_FORM_TOPK32, 0, 1}, .route = GU_ROUTE_RANDOM},
    {{2, 32, 12, 2048, 32, LL, EXP, 1, BF, FP8, TU_FORM_MAP, 0, 0}, .route = GU_ROUTE_RANDOM},
    {{2, 32, 16, 2048, 100, A2A, EXP, 16, BF, BF, TU_FORM_TOPK64, 1, 0}, .route = GU_ROUTE_RANDOM},
};

#define COUNT(t) ((int)(sizeof t / sizeof *t))
#define NTABLE COUNT(cases)
/* The tables after the first, in the order of their indices. */
static const struct {
  const extra_t *at;
  int n;
} extras[] = {{skewed, COUNT(skewed)},
              {special, COUNT(special)},
              {budgeted, COUNT(budgeted)},
              {decode, COUNT(decode)},
              {staged, COUNT(staged)},
              {sums, COUNT(sums)},
              {notify_sizes, COUNT(notify_sizes)},
              {wide, COUNT(wide)}};
#define NCASES                                                                                      \
  (NTABLE + COUNT(skewed) + COUNT(special) + COUNT(budgeted) + COUNT(decode) + COUNT(staged) + COUNT(sums) + \
   COUNT(notify_sizes) + COUNT(wide))

/* Case i, 0 <= i < NCASES. */
static gu_case_t case_of(int i) {
  if (i < NTABLE) return gu_case_of(&cases[i], 16);
  i -= NTABLE;
  int t = 0;
  while (i >= extras[t].n) i -= extras[t++].n;
  const extra_t *x = &extras[t].at[i];
  gu_case_t c = gu_case_of(&x->row, x->num_sms ? x->num_sms : 16);
  c.route = x->route, c.specials = x->specials, c.budget = x->budget;
  if (x->out_other) c.out_dtype = c.x_dtype == EPX_FLOAT32 ? EPX_BFLOAT16 : EPX_FLOAT32;
  return c;
}

/* A case with special values has them in its tokens: every kind, on some rank. */
static void check_specials_made(const gu_case_t *c, const gu_inputs_t *in) {
  tu_specials_t all = {0};
  for (int r = 0; r < c->R; r++) {
    tu_specials_t one;
    tu_count_specials(c->x_dtype, in->m.x[r], c->T[r] * c->H, &one);
    all.nan_payload += one.nan_payload, all.inf += one.inf, all.neg_zero += one.neg_zero;
    all.subnormal += one.subnormal, all.past_e4m3 += one.past_e4m3;
  }
  tu_check_specials(gu_case_str(c), &all);
}

/* Marks the cases that one argument selects ("3", "2-5", "0,4,15-17"); 0 when it does not
 * parse or names a case the table does not have. */
static int select_cases(const char *arg, int *selected) {
  const char *p = arg;
  while (*p) {
    char *end;
    const long lo = strtol(p, &end, 10);
    if (end == p || lo < 0) return 0;
    long hi = lo;
    if (*end == '-') {
      p = end + 1;
      hi = strtol(p, &end, 10);
      if (end == p) return 0;
    }
    if (hi < lo || hi >= NCASES) return 0;
    for (long i = lo; i <= hi; i++) selected[i] = 1;
    if (*end == ',')
      end++;
    else if (*end)
      return 0;
    p = end;
  }
  return 1;
}

static void run_case(int i) {
  gu_case_t c = case_of(i);
  double t0 = tu_now();
  tu_rng = tu_rng_stream(tu_seed, (uint64_t)i);
  gu_inputs_t in;
  gu_inputs_make(&in, &c);
  if (c.specials) check_specials_made(&c, &in);
  gu_result_t host, dev;
  int hf = gu_run(&c, &in, EPX_BACKEND_HOST, NULL, &host);
  CHECK(!hf, "host run failed [%s]", gu_case_str(&c));
  double t1 = tu_now();
  int df = hf ? 1 : gu_run(&c, &in, EPX_BACKEND_CUDA, &host, &dev);
  CHECK(!df, "cuda run failed [%s]", gu_case_str(&c));
  if (!hf && c.budget) /* the case is what it claims: the budgets cut */
    CHECK(host.dropped[0][0] > 0, "a budget case in which no pair is dropped [%s]", gu_case_str(&c));
  if (!hf && !df) gu_compare(&c, &dev, &host, "cuda vs host");
  printf("case %2d %s: host %.2fs, cuda %.2fs\n", i, gu_case_str(&c), t1 - t0, tu_now() - t1);
  fflush(stdout);
  gu_result_free(&host, c.R);
  if (!hf) gu_result_free(&dev, c.R);
  gu_inputs_free(&in, &c);
}

static int bad_selection(const char *arg) {
  fprintf(stderr, "test_cuda_match: bad case selection '%s' (cases 0-%d; --list shows them)\n", arg, NCASES - 1);
  return 2;
}

int main(int argc, char **argv) {
  if (argc == 2 && !strcmp(argv[1], "--list")) {
    for (int i = 0; i < NCASES; i++) {
      gu_case_t c = case_of(i);
      printf("%2d  %s sms=%d\n", i, gu_case_str(&c), c.num_sms);
    }
    return 0;
  }
  int selected[NCASES] = {0}, n = 0;
  for (int a = 1; a < argc; a++)
    if (!select_cases(argv[a], selected)) return bad_selection(argv[a]);
  for (int i = 0; i < NCASES; i++) {
    if (argc < 2) selected[i] = 1;
    n += selected[i];
  }
  if (n == 0) return bad_selection(argc > 1 ? argv[1] : "");
  tu_begin("test_cuda_match");
  if (!gu_have_gpu()) return GU_SKIP;
  printf("%d of %d cases\n", n, NCASES);
  for (int i = 0; i < NCASES; i++)
    if (selected[i]) run_case(i);
  return tu_end();
}
