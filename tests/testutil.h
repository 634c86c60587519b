/*
 * testutil — shared helpers of the epx C tests (host backend).
 *
 *   run bookkeeping   tu_begin / tu_end: seed printed first, summary line last
 *   RNG               splitmix64, seeded from EPX_TEST_SEED or the clock; used from the main
 *                     thread only (rank threads get their data prepared beforehand)
 *   elements          load / store / round f32, bf16 per the contract
 *   routing           random topk rows: distinct experts, unsorted, -1 slots
 *   tu_moe_t          one MoE input over R ranks (tokens, routing in every form)
 *   tu_expect_t       what a rank must receive, computed directly from the inputs
 *   tu_world_t        a host world and one comm per rank (comm init from rank threads)
 *   tu_pipe_run       notify / dispatch / stand-in experts / combine on every rank
 */
#ifndef EPX_TESTUTIL_H
#define EPX_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "check.h"
#include "dense_ref.h"
#include "epx.h"

#define TU_MAX_RANKS EPX_MAX_RANKS

/* ---- run bookkeeping ---------------------------------------------------------------- */
/* Seeds tu_rng from EPX_TEST_SEED (decimal) or the clock and prints "seed: N". */
void tu_begin(const char *name);
/* Prints "<name>: N passed, M failed" and returns the process exit code. */
int tu_end(void);
double tu_now(void); /* monotonic seconds */

/* ---- RNG ---------------------------------------------------------------------------- */
typedef struct {
  uint64_t s;
} tu_rng_t;
extern tu_rng_t tu_rng;
extern uint64_t tu_seed;
uint64_t tu_u64(tu_rng_t *g);
int tu_int(tu_rng_t *g, int lo, int hi); /* uniform in [lo, hi] */
double tu_unit(tu_rng_t *g);             /* uniform in [0, 1) */
float tu_value(tu_rng_t *g);             /* nonzero, both signs, magnitudes about 2^-6 .. 2^3 */
float tu_weight(tu_rng_t *g);            /* a router weight in (0.01, 1) */

/* ---- elements ----------------------------------------------------------------------- */
float tu_load(epx_dtype_t t, const void *base, size_t i); /* f32 or bf16 */
void tu_store(epx_dtype_t t, void *base, size_t i, float v);
float tu_round(epx_dtype_t t, float v);
int tu_nblocks(int H); /* fp8 scales per row */
/* The receiver's float value of element c of row `row` (fp8: float(q) * scale). */
float tu_recv_value(epx_dtype_t recv_dtype, const void *rows, const float *scales, int H, int64_t row, int c);
void tu_store_nan(epx_dtype_t t, void *base, size_t i);
const char *tu_dtype(epx_dtype_t t); /* short name for messages */
int tu_contains(const char *msg, const char *word); /* word in msg, any case: checks a message */

/* ---- poison: unwritten memory shows ------------------------------------------------- */
#define TU_POISON 0x7f
void *tu_alloc_poison(size_t bytes); /* malloc (at least 1 byte) filled with TU_POISON */
int tu_is_poison(const void *p, size_t bytes);
/* Index of the first element whose bytes differ, or -1. */
int64_t tu_first_diff(const void *a, const void *b, size_t elem_size, int64_t n);

/* ---- routing ------------------------------------------------------------------------ */
typedef struct {
  double p_none;   /* probability that a slot is -1 */
  int one_expert;  /* >= 0: every token routes to exactly this expert, in a random slot */
  int span_lo;     /* experts drawn from [span_lo, span_hi) ... */
  int span_hi;     /* ... span_hi = 0 means the whole [0, E) */
} tu_route_opts_t;
tu_route_opts_t tu_route_default(void);
/* Random rows of distinct experts in random slot positions (unsorted), -1 in the others. */
void tu_random_topk(tu_rng_t *g, int64_t T, int K, int E, const tu_route_opts_t *o, int32_t *idx);
/* Sorts each row ascending with the -1 slots last (map -> topk order), weights alongside;
 * -1 slots get weight 0. */
void tu_sort_topk_rows(int64_t T, int K, int32_t *idx, float *w);

/* ---- one MoE input over R ranks ----------------------------------------------------- */
/* TU_FORM_MIXED: rank r uses form r % 3 (ranks of one group may pass different forms; needs
 * tu_moe_make_map). */
enum { TU_FORM_TOPK32 = 0, TU_FORM_TOPK64, TU_FORM_MAP, TU_FORM_MIXED };

typedef struct {
  int R, E, H, K, L;
  epx_dtype_t x_dtype;
  int64_t T[TU_MAX_RANKS];
  void *x[TU_MAX_RANKS];       /* [T, H] x_dtype, nonzero values */
  int32_t *idx[TU_MAX_RANKS];  /* [T, K] */
  int64_t *idx64[TU_MAX_RANKS];/* the same ids, int64 */
  float *w[TU_MAX_RANKS];      /* [T, K], junk on -1 slots; all NULL when built without weights */
  uint8_t *map[TU_MAX_RANKS];  /* [T, E]; built by tu_moe_make_map */
  float *probs[TU_MAX_RANKS];  /* [T, E] or NULL */
} tu_moe_t;

/* Random tokens and routing. T[r] as given. with_weights = 0 leaves w NULL (every weight 1). */
void tu_moe_random(tu_moe_t *m, tu_rng_t *g, int R, int E, int H, int K, epx_dtype_t x_dtype, const int64_t *T,
                   const tu_route_opts_t *o, int with_weights);
/* Sorts the rows (as the map form will present them) and builds map / probs. */
void tu_moe_make_map(tu_moe_t *m);
void tu_moe_free(tu_moe_t *m);
epx_routing_t tu_routing(const tu_moe_t *m, int rank, int form);
/* dense_moe on this input into out[r] (allocated here, poisoned first). */
void tu_dense(const tu_moe_t *m, epx_dtype_t recv_dtype, epx_dtype_t y_dtype, epx_dtype_t out_dtype, int expert_layout,
              const float *const *weights, void **out);
void tu_free_all(void **p, int n);

/* ---- what rank d must receive ------------------------------------------------------- */
typedef struct {
  int src;     /* source rank; -1 for a padding row */
  int64_t tok; /* source token */
  int k;       /* expert layout: the slot of this pair */
  int local;   /* expert layout: local expert of this row (padding too) */
} tu_row_t;

typedef struct {
  int64_t ntok;        /* token layout rows */
  tu_row_t *tok_rows;  /* [ntok] */
  int64_t npairs;      /* (token, local expert) pairs */
  int64_t nrows;       /* expert layout rows with padding */
  tu_row_t *pair_rows; /* [nrows] */
  int32_t *cnt;        /* [L] pairs per local expert */
  int64_t sent_copies; /* d as a source: sum over its tokens of distinct destination ranks */
} tu_expect_t;
void tu_expect(const tu_moe_t *m, int d, int align, tu_expect_t *ex);
void tu_expect_free(tu_expect_t *ex);

/* ---- world and comms ---------------------------------------------------------------- */
typedef struct {
  int R;
  epx_world_t *world;
  epx_comm_t *comm[TU_MAX_RANKS];
} tu_world_t;

/* A config with timeout 10 s (so a bug shows as a failure, not a long hang). */
epx_config_t tu_config(int E, int H, int K, int max_tokens_per_rank);
/* Host world of R ranks; each rank thread calls epx_comm_init with cfgs[r] (or cfg for all
 * when cfgs is NULL). st (may be NULL) gets each rank's status. Returns the first failure;
 * on failure the world is left created and the failed comms NULL: tu_world_destroy it. */
epx_status_t tu_world_create(tu_world_t *w, int R, const epx_config_t *cfg, const epx_config_t *cfgs, epx_status_t *st);
void tu_world_destroy(tu_world_t *w);
epx_status_t tu_handles_create(tu_world_t *w, const epx_handle_config_t *hc, epx_handle_t **h);
void tu_handles_destroy(tu_world_t *w, epx_handle_t **h);
epx_handle_config_t tu_handle_config(epx_algo_t algo, epx_layout_t layout, int align);

/* A reusable barrier for the rank threads of one run (test-side, not epx's): every thread
 * passes its vote and gets the OR of the votes of this round. */
void tu_barrier_init(int n);
int tu_barrier_vote(int mine);
void tu_barrier_wait(void); /* a vote of 0 */

/* ---- the whole pipeline ------------------------------------------------------------- */
typedef struct {
  epx_algo_t algo;
  epx_layout_t layout; /* ignored (expert) for EPX_ALGO_LL */
  int align;
  epx_dtype_t recv_dtype, y_dtype, out_dtype;
  int form;            /* TU_FORM_* */
  int notify_first;    /* epx_notify + epx_handle_info size the buffers, then dispatch(NULL) */
  int combine;         /* run stand-in experts and combine */
  int weighted;        /* combine's weighted flag */
  float row_probs_mul; /* != 0: combine gets row_probs = recv_probs * this */
  int64_t guard_rows;  /* poisoned rows past the capacity that nothing may touch */
  int minimal;         /* expert layout: pass no optional output (recv_probs, counts, row
                          count); the stand-in takes the counts from epx_handle_info */
} tu_pipe_t;
tu_pipe_t tu_pipe_default(void);

typedef struct {
  epx_status_t notify_st[TU_MAX_RANKS], dispatch_st[TU_MAX_RANKS], combine_st[TU_MAX_RANKS];
  tu_expect_t ex[TU_MAX_RANKS];
  epx_handle_info_t info[TU_MAX_RANKS]; /* from epx_handle_info after the dispatch */
  epx_status_t info_st[TU_MAX_RANKS];
  int32_t *info_cnt[TU_MAX_RANKS];      /* [L] tokens_per_local_expert from epx_handle_info */
  int64_t cap[TU_MAX_RANKS];            /* rows the receive buffers hold (LL: L * R * max_tokens) */
  void *recv_x[TU_MAX_RANKS];           /* [cap + guard_rows, H] recv_dtype */
  float *recv_scales[TU_MAX_RANKS];     /* fp8: [cap + guard_rows, nblocks] */
  int32_t *recv_idx[TU_MAX_RANKS];      /* token layout: [cap + guard_rows, K] */
  float *recv_w[TU_MAX_RANKS];          /* token layout: [cap + guard_rows, K] */
  float *recv_probs[TU_MAX_RANKS];      /* expert layout: [cap + guard_rows] */
  int32_t *cnt[TU_MAX_RANKS];           /* [L] tokens_per_local_expert from the dispatch */
  int64_t nrows[TU_MAX_RANKS];          /* num_recv_rows from the dispatch */
  void *y[TU_MAX_RANKS];                /* stand-in outputs, [cap, H] y_dtype */
  void *out[TU_MAX_RANKS];              /* [T, H] out_dtype */
  char err[TU_MAX_RANKS][256];          /* epx_last_error() after a rank's first failed call */
} tu_pipe_res_t;

/* Runs the pipeline on every rank with the given handles (already created for p's algo and
 * layout). Returns 0 when every call on every rank succeeded. */
int tu_pipe_run(tu_world_t *w, epx_handle_t *const *h, const tu_moe_t *m, const tu_pipe_t *p, tu_pipe_res_t *res);
void tu_pipe_free(tu_pipe_res_t *res, int R);

/* tu_pipe_run with every call's status checked (named by `what`, the rank and its message);
 * then, where the combine ran on every rank, each rank's out against tu_dense with the
 * combine's weights `dense_w` (NULL: the routing's), bit for bit. Returns tu_pipe_run's
 * result; the caller checks more in res if it likes, then frees it (tu_pipe_free). */
int tu_pipe_check(const char *what, tu_world_t *w, epx_handle_t *const *h, const tu_moe_t *m, const tu_pipe_t *p,
                  const float *const *dense_w, tu_pipe_res_t *res);

/* Dispatch and combine arguments (float32) whose every buffer is buf, of cap rows: for
 * calls that must be refused, so that buf shows whether anything was written. */
void tu_refused_args(void *buf, int64_t cap, epx_dispatch_args_t *da, epx_combine_args_t *ca);
void tu_sleep_ms(long ms);

/* Whether the group of w still works: a fresh random pipeline (new handles, HT expert layout,
 * combine) on every rank, checked against the dense reference. Returns 0 when it did. */
int tu_world_usable(const char *what, tu_world_t *w, int E, int H, int K);

/* Stand-in experts on received rows (what a user's expert GEMM would do), independent of
 * dense_ref's code path:
 *   token layout: y[n] = cast_y(sum_k ascending, idx >= 0, of fl32(w * float(cast_y(scale(d*L+idx) * xin))))
 *   expert rows:  y[row] = cast_y(scale(d*L+l) * xin) for the counted rows of each local
 *                 expert l; every other row (padding, LL rows past the count) gets NaN. */
void tu_expert_token_layout(int d, int L, int H, int K, int64_t N, epx_dtype_t recv_dtype, const void *recv_x,
                            const float *recv_scales, const int32_t *ridx, const float *rw, epx_dtype_t y_dtype, void *y);
/* block_stride = 0: blocks packed, each padded to align; > 0: LL, expert l at l * block_stride. */
void tu_expert_rows(int d, int L, int H, epx_dtype_t recv_dtype, const void *recv_x, const float *recv_scales,
                    const int32_t *cnt, int align, int64_t block_stride, int64_t total_rows, epx_dtype_t y_dtype, void *y);

/* CHECKs that got and want hold the same bits ([n] elements of size elem_size, rows of
 * `row` elements for the message) and prints the first difference with `what`. */
int tu_check_bits(const char *what, epx_dtype_t t, const void *got, const void *want, int64_t n, int row);

#endif /* EPX_TESTUTIL_H */
