/*
 * ref — what a correct run gives, computed from the inputs alone: the dense reference's output
 * (tools/dense_ref.c), the rows each rank must receive, and stand-in experts that do to
 * received rows what a user's expert GEMM would.
 */
#ifndef EPX_TEST_REF_H
#define EPX_TEST_REF_H

#include "check.h"
#include "data.h"
#include "dense_ref.h"

/* dense_moe on this input into out[r] (allocated here, poisoned first); CHECKs that it took
 * the input, naming the caller's line. */
#define tu_dense(...) tu_dense_at(TU_HERE, __VA_ARGS__)
void tu_dense_at(const char *file, int line, const tu_moe_t *m, epx_dtype_t recv_dtype, epx_dtype_t y_dtype,
                 epx_dtype_t out_dtype, int expert_layout, const float *const *weights, void **out);
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

/* ---- stand-in experts --------------------------------------------------------------- */
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

#endif /* EPX_TEST_REF_H */
