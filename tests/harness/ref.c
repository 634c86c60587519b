/* ref — see ref.h. */
#include "ref.h"

#include <stdlib.h>
#include <string.h>

void tu_dense_at(const char *file, int line, const tu_moe_t *m, epx_dtype_t recv_dtype, epx_dtype_t y_dtype,
                 epx_dtype_t out_dtype, int expert_layout, const float *const *weights, void **out) {
  dense_cfg_t c = {m->R, m->E, m->H, m->K, m->x_dtype, recv_dtype, y_dtype, out_dtype, expert_layout,
                   m->ranks_per_node};
  for (int r = 0; r < m->R; r++) out[r] = tu_alloc_poison((size_t)(m->T[r] * m->H) * epx_dtype_size(out_dtype));
  int rc = dense_moe(&c, m->T, (const void *const *)m->x, (const int32_t *const *)m->idx, weights, out);
  if (rc == 0)
    check_pass();
  else
    check_fail(file, line, "rc == 0", "dense_moe refused its input");
}

void tu_free_all(void **p, int n) {
  for (int i = 0; i < n; i++) {
    free(p[i]);
    p[i] = NULL;
  }
}

/* ---- expectations ------------------------------------------------------------------- */
void tu_expect(const tu_moe_t *m, int d, int align, tu_expect_t *ex) {
  const int L = m->L, K = m->K;
  if (align < 1) align = 1;
  memset(ex, 0, sizeof *ex);
  int64_t total_tokens = 0, total_pairs = 0;
  for (int s = 0; s < m->R; s++) total_tokens += m->T[s], total_pairs += m->T[s] * K;
  ex->tok_rows = calloc((size_t)total_tokens + 1, sizeof(tu_row_t));
  ex->pair_rows = calloc((size_t)(total_pairs + (int64_t)L * align) + 1, sizeof(tu_row_t));
  ex->cnt = calloc((size_t)L, sizeof(int32_t));
  for (int s = 0; s < m->R; s++)
    for (int64_t t = 0; t < m->T[s]; t++) {
      const int32_t *row = m->idx[s] + t * K;
      int here = 0;
      for (int k = 0; k < K; k++) here |= row[k] >= 0 && row[k] / L == d;
      if (here) ex->tok_rows[ex->ntok++] = (tu_row_t){s, t, -1, -1};
    }
  for (int l = 0; l < L; l++) {
    for (int s = 0; s < m->R; s++)
      for (int64_t t = 0; t < m->T[s]; t++)
        for (int k = 0; k < K; k++)
          if (m->idx[s][t * K + k] == d * L + l) {
            ex->pair_rows[ex->nrows++] = (tu_row_t){s, t, k, l};
            ex->cnt[l]++;
          }
    ex->npairs += ex->cnt[l];
    while (ex->nrows % align) ex->pair_rows[ex->nrows++] = (tu_row_t){-1, 0, -1, l};
  }
  for (int64_t t = 0; t < m->T[d]; t++) {
    int seen[TU_MAX_RANKS] = {0};
    for (int k = 0; k < K; k++) {
      const int32_t e = m->idx[d][t * K + k];
      if (e >= 0 && !seen[e / L]) seen[e / L] = 1, ex->sent_copies++;
    }
  }
}

void tu_expect_free(tu_expect_t *ex) {
  free(ex->tok_rows), free(ex->pair_rows), free(ex->cnt);
  memset(ex, 0, sizeof *ex);
}

/* ---- stand-in experts --------------------------------------------------------------- */
void tu_expert_token_layout(int d, int L, int H, int K, int64_t N, epx_dtype_t recv_dtype, const void *recv_x,
                            const float *recv_scales, const int32_t *ridx, const float *rw, epx_dtype_t y_dtype, void *y) {
  float *acc = malloc(sizeof(float) * (size_t)H);
  for (int64_t n = 0; n < N; n++) {
    for (int c = 0; c < H; c++) acc[c] = 0.0f;
    for (int k = 0; k < K; k++) {
      const int32_t li = ridx[n * K + k];
      if (li < 0 || li >= L) continue; /* wrong ids are reported by the callers' checks */
      const float s = dense_expert_scale(d * L + li), wk = rw[n * K + k];
      for (int c = 0; c < H; c++) {
        const float ye = tu_round(y_dtype, s * tu_recv_value(recv_dtype, recv_x, recv_scales, H, n, c));
        const float p = wk * ye;
        acc[c] = acc[c] + p;
      }
    }
    for (int c = 0; c < H; c++) tu_store(y_dtype, y, (size_t)(n * H + c), acc[c]);
  }
  free(acc);
}

void tu_expert_rows(int d, int L, int H, epx_dtype_t recv_dtype, const void *recv_x, const float *recv_scales,
                    const int32_t *cnt, int align, int64_t block_stride, int64_t total_rows, epx_dtype_t y_dtype, void *y) {
  if (align < 1) align = 1;
  for (int64_t i = 0; i < total_rows * H; i++) tu_store_nan(y_dtype, y, (size_t)i);
  int64_t pos = 0;
  for (int l = 0; l < L; l++) {
    const int64_t start = block_stride ? l * block_stride : pos;
    const int64_t n = cnt[l] < 0 ? 0 : cnt[l];
    const float s = dense_expert_scale(d * L + l);
    for (int64_t i = 0; i < n && start + i < total_rows; i++)
      for (int c = 0; c < H; c++)
        tu_store(y_dtype, y, (size_t)((start + i) * H + c),
                 s * tu_recv_value(recv_dtype, recv_x, recv_scales, H, start + i, c));
    pos += (n + align - 1) / align * align;
  }
}
