/*
 * testutil — the C tests' groups of rank threads (host backend), on top of the harness
 * (harness/: checks, seed and RNG, inputs, references):
 *   tu_world_t        a host world and one comm per rank (comm init from rank threads)
 *   tu_barrier_*      a barrier of the test's own between rank threads
 *   tu_pipe_run       notify / dispatch / stand-in experts / combine on every rank
 *   tu_add_specials   special values sprinkled into a call's floating inputs, and their census
 */
#ifndef EPX_TESTUTIL_H
#define EPX_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"
#include "harness.h"

/* ---- world and comms ---------------------------------------------------------------- */
typedef struct {
  int R;
  epx_world_t *world;
  epx_comm_t *comm[TU_MAX_RANKS];
} tu_world_t;

/* Host world of R ranks; each rank thread calls epx_comm_init with cfgs[r] (or cfg for all
 * when cfgs is NULL). st (may be NULL) gets each rank's status. Returns the first failure;
 * on failure the world is left created and the failed comms NULL: tu_world_destroy it. */
epx_status_t tu_world_create(tu_world_t *w, int R, const epx_config_t *cfg, const epx_config_t *cfgs, epx_status_t *st);
void tu_world_destroy(tu_world_t *w);
epx_status_t tu_handles_create(tu_world_t *w, const epx_handle_config_t *hc, epx_handle_t **h);
void tu_handles_destroy(tu_world_t *w, epx_handle_t **h);

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
 * combine's weights `dense_w` (NULL: the routing's), bit for bit. Failures name the caller's
 * line. Returns tu_pipe_run's result; the caller checks more in res if it likes, then frees
 * it (tu_pipe_free). */
#define tu_pipe_check(...) tu_pipe_check_at(TU_HERE, __VA_ARGS__)
int tu_pipe_check_at(const char *file, int line, const char *what, tu_world_t *w, epx_handle_t *const *h,
                     const tu_moe_t *m, const tu_pipe_t *p, const float *const *dense_w, tu_pipe_res_t *res);

/* Dispatch and combine arguments (float32) whose every buffer is buf, of cap rows: for
 * calls that must be refused, so that buf shows whether anything was written. */
void tu_refused_args(void *buf, int64_t cap, epx_dispatch_args_t *da, epx_combine_args_t *ca);

/* Whether the group of w still works: a fresh random pipeline (new handles, HT expert layout,
 * combine) on every rank, checked against the dense reference. Returns 0 when it did. */
int tu_world_usable(const char *what, tu_world_t *w, int E, int H, int K);

/* ---- special values (docs/design.md, "Arithmetic, exactly": NaN) -------------------- */
/* Overwrites about one in `rate` of the n elements at base (float32 or bf16) with a special
 * value drawn from g: a NaN with a payload (quiet, signalling, negative), the canonical NaN,
 * an infinity, -0.0, a subnormal, a value past e4m3's range (448) or bf16's largest finite
 * value. */
void tu_add_specials(tu_rng_t *g, epx_dtype_t t, void *base, int64_t n, int rate);
/* The same into every rank's tokens and, when m has them, its routing weights: legal inputs
 * (the routing check refuses expert ids, never weights) that feed scale_by_probs and the
 * weighted combine as arithmetic, recv_topk_weights and recv_probs as copies. Call it before
 * tu_moe_make_map, which takes the probs from the weights. */
void tu_moe_add_specials(tu_moe_t *m, tu_rng_t *g, int rate);

/* How many elements of a float32 or bf16 buffer are special, by kind. */
typedef struct {
  int64_t nan_payload;   /* NaNs other than the canonical one of the type */
  int64_t nan_canonical; /* float32 0x7FFFFFFF, bf16 0x7FFF */
  int64_t inf, neg_zero, subnormal;
  int64_t past_e4m3;     /* finite, |v| > 448 */
} tu_specials_t;
void tu_count_specials(epx_dtype_t t, const void *base, int64_t n, tu_specials_t *c);
int64_t tu_specials_total(const tu_specials_t *c);
/* CHECKs, naming the caller's line, that a buffer given to tu_add_specials holds NaN payloads,
 * infinities, -0.0, subnormals and values past e4m3's range: that the inputs really are
 * special. Returns 1 when it does. */
#define tu_check_specials(...) tu_check_specials_at(TU_HERE, __VA_ARGS__)
int tu_check_specials_at(const char *file, int line, const char *what, const tu_specials_t *c);

#endif /* EPX_TESTUTIL_H */
