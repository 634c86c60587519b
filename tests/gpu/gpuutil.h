/*
 * gpuutil — runs one MoE layer's whole sequence of epx calls on either backend with the same
 * inputs, so the GPU tests can compare the CUDA backend with the host backend bit for bit.
 *
 * The sequence, on every rank:
 *   notify (routing in the case's form)          exact sizes or sync-free
 *   dispatch (routing NULL: the plan)            -> recv_x, scales, recv_idx / recv_w, probs, cnt, nrows
 *   [host only] stand-in experts on recv_x       -> y (the CUDA run gets the host's y),
 *                                                   special values added when the case asks
 *   combine(y, weighted as the layout wants)     -> out
 *   combine(y, weighted 0, row_weight_grad = g)  -> out2, wgrad       (dispatch's gradient)
 *   dispatch replay of x2, scale_by_probs        -> recv2             (combine's gradient)
 * Buffers are allocated before and read after the rank threads run, so no allocation or
 * device-wide sync happens while a peer's kernel waits.
 */
#ifndef EPX_GPUUTIL_H
#define EPX_GPUUTIL_H

#include "testutil.h"

#define GU_SKIP 77 /* CTest's skip code: no GPU here */

/* How a case routes its tokens: at random, every token to one expert only, or every token to
 * experts of the last rank only (the skews a pipeline must survive: one expert's block or one
 * rank takes everything, the others get nothing). */
typedef enum { GU_ROUTE_RANDOM = 0, GU_ROUTE_ONE_EXPERT, GU_ROUTE_ONE_RANK } gu_route_t;

typedef struct {
  int R, E, H, K, align, exact, form, max_tokens;
  epx_algo_t algo;
  epx_layout_t layout;
  epx_dtype_t x_dtype, recv_dtype;
  epx_dtype_t out_dtype; /* the combines' outputs (gu_case_of: x's type) */
  int64_t T[TU_MAX_RANKS];
  int num_sms;
  gu_route_t route;
  int specials; /* > 0: about one element in `specials` of every floating input is a special
                   value (tu_add_specials): x, the routing weights, x2, g, and the y that the
                   host's stand-in experts hand to both runs */
  int budget;   /* > 0 (expert layout of HT): rank r's receive budget is about `budget` percent
                   of the rows it would get, a different share on each rank, none on every third
                   (gu_budget_of); the pairs the group dropped are compared too */
} gu_case_t;

/* Rank r's receive budget in case c (0: none). */
int64_t gu_budget_of(const gu_case_t *c, const tu_moe_t *m, int r);

/* A row of a test's case table, and the case it makes: every rank gets T tokens, or with
 * `uneven` rank 1 none and the other odd ranks T / 3; low-latency capacity max(T, 64). */
typedef struct {
  int R, E, K, H;
  int64_t T;
  epx_algo_t algo;
  epx_layout_t layout;
  int align;
  epx_dtype_t x, recv;
  int form, exact, uneven;
} gu_row_t;

gu_case_t gu_case_of(const gu_row_t *k, int num_sms);

/* Shorthands for case tables. */
#define BF EPX_BFLOAT16
#define F32 EPX_FLOAT32
#define FP8 EPX_FP8_E4M3
#define TOK EPX_LAYOUT_TOKEN
#define EXP EPX_LAYOUT_EXPERT
#define HT EPX_ALGO_HT
#define LL EPX_ALGO_LL
#define A2A EPX_ALGO_ALLTOALL

/* One backend's buffers and results, every array host-readable after gu_run. */
typedef struct {
  int64_t cap[TU_MAX_RANKS];
  void *recv_x[TU_MAX_RANKS], *recv2[TU_MAX_RANKS], *out[TU_MAX_RANKS], *out2[TU_MAX_RANKS];
  float *scales[TU_MAX_RANKS], *scales2[TU_MAX_RANKS], *recv_w[TU_MAX_RANKS], *probs[TU_MAX_RANKS];
  float *wgrad[TU_MAX_RANKS];
  int32_t *recv_idx[TU_MAX_RANKS], *cnt[TU_MAX_RANKS];
  int64_t nrows[TU_MAX_RANKS];
  int32_t *dropped[TU_MAX_RANKS]; /* [1]: the pairs the group dropped past its budgets */
  void *y[TU_MAX_RANKS];
  epx_status_t st[TU_MAX_RANKS];
  char err[TU_MAX_RANKS][256];
} gu_result_t;

/* Inputs shared by both runs. */
typedef struct {
  tu_moe_t m;
  void *x2[TU_MAX_RANKS];      /* [T, H] x_dtype: the "output gradient" replayed by dispatch */
  float *g[TU_MAX_RANKS];      /* [cap(, K)] row weight gradients */
  tu_rng_t y_rng[TU_MAX_RANKS]; /* specials: where rank r's special values in y come from */
} gu_inputs_t;

/* Memory of either backend (cuda: device memory, else host memory), filled with TU_POISON;
 * gu_upload fills it from host memory; gu_host_copy returns a malloc'd copy of it. */
void *gu_alloc(int cuda, size_t bytes);
void *gu_upload(int cuda, const void *src, size_t bytes);
void *gu_host_copy(int cuda, const void *p, size_t bytes);
void gu_free(int cuda, void *p);

/* 1 when a CUDA device is usable; prints why not otherwise. */
int gu_have_gpu(void);
void gu_inputs_make(gu_inputs_t *in, const gu_case_t *c);
void gu_inputs_free(gu_inputs_t *in, const gu_case_t *c);
/* Runs the sequence. For the CUDA backend, `host` (a finished host run) supplies y and the
 * buffer sizes. Returns 0 when every rank succeeded. */
int gu_run(const gu_case_t *c, const gu_inputs_t *in, epx_backend_t backend, const gu_result_t *host, gu_result_t *res);
/* The same sequence for rank r alone, on a world that drives only it (its peers run in other
 * processes, each with its own gu_run_rank); only rank r's entries of res are filled. */
int gu_run_rank(const gu_case_t *c, const gu_inputs_t *in, epx_world_t *world, int r, const gu_result_t *host,
                gu_result_t *res);
/* CHECKs every output of `got` against `want` bit for bit: every rank's, or rank r's; a
 * failure names the caller's line and the output. */
#define gu_compare(...) gu_compare_at(TU_HERE, __VA_ARGS__)
#define gu_compare_rank(...) gu_compare_rank_at(TU_HERE, __VA_ARGS__)
void gu_compare_at(const char *file, int line, const gu_case_t *c, const gu_result_t *got, const gu_result_t *want,
                   const char *label);
void gu_compare_rank_at(const char *file, int line, const gu_case_t *c, const gu_result_t *got, const gu_result_t *want,
                        const char *label, int r);
void gu_result_free(gu_result_t *r, int R);
/* "R=4 E=64 ..." for messages. */
const char *gu_case_str(const gu_case_t *c);

#endif
