/* dense_ref — see dense_ref.h. Readable first: one token at a time, one destination at a time. */
#include "dense_ref.h"

#include <stdlib.h>
#include <string.h>

float dense_expert_scale(int e) { return 0.5f + 0.0625f * (float)(e % 23); }

static float load(epx_dtype_t t, const void *base, size_t i) {
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(((const uint16_t *)base)[i]);
  return ((const float *)base)[i];
}

static float round_to(epx_dtype_t t, float v) {
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(epx_float_to_bf16(v));
  return v;
}

/* Every stored value is a sum: a NaN is the canonical one (float32 0x7FFFFFFF; bf16 0x7FFF
 * by the conversion), whatever payload x86 arithmetic carried along. */
static void store(epx_dtype_t t, void *base, size_t i, float v) {
  if (t == EPX_BFLOAT16) {
    ((uint16_t *)base)[i] = epx_float_to_bf16(v);
  } else if (v != v) {
    const uint32_t nan = 0x7fffffffu;
    memcpy((float *)base + i, &nan, sizeof nan);
  } else {
    ((float *)base)[i] = v;
  }
}

static int is_float_type(epx_dtype_t t) { return t == EPX_FLOAT32 || t == EPX_BFLOAT16; }

/* partial[c] += w * float(cast_y(scale_e * xin[c])), each product rounded to float32. */
static void accumulate_expert(const dense_cfg_t *cfg, int e, float w, const float *xin, float *partial) {
  const float s = dense_expert_scale(e);
  for (int c = 0; c < cfg->hidden; c++) {
    const float y = round_to(cfg->y_dtype, s * xin[c]);
    const float p = w * y;
    partial[c] = partial[c] + p;
  }
}

/* What destination d makes of one token before rounding (row_d or partial_d of the header);
 * returns 0 when none of the token's experts is on d. */
static int destination_partial(const dense_cfg_t *cfg, int d, const int32_t *idx, const float *w, const float *xin,
                               float *partial) {
  const int K = cfg->topk, L = cfg->num_experts / cfg->nranks;
  int any = 0;
  for (int c = 0; c < cfg->hidden; c++) partial[c] = 0.0f;
  if (!cfg->expert_layout) {
    /* Token layout: slots in slot order. */
    for (int k = 0; k < K; k++) {
      const int e = idx[k];
      if (e < 0 || e / L != d) continue;
      any = 1;
      accumulate_expert(cfg, e, w ? w[k] : 1.0f, xin, partial);
    }
    return any;
  }
  /* Expert layout: the token's experts on d in ascending local id. */
  for (int l = 0; l < L; l++) {
    const int e = d * L + l;
    for (int k = 0; k < K; k++) {
      if (idx[k] != e) continue;
      any = 1;
      accumulate_expert(cfg, e, w ? w[k] : 1.0f, xin, partial);
      break; /* ids in a row are distinct */
    }
  }
  return any;
}

int dense_moe(const dense_cfg_t *cfg, const int64_t *num_tokens, const void *const *x,
              const int32_t *const *topk_idx, const float *const *topk_weights, void *const *out) {
  if (!cfg || !num_tokens || cfg->nranks < 1 || cfg->hidden < 1 || cfg->topk < 1) return -1;
  if (cfg->num_experts < cfg->nranks || cfg->num_experts % cfg->nranks != 0) return -1;
  if (!is_float_type(cfg->x_dtype) || !is_float_type(cfg->y_dtype) || !is_float_type(cfg->out_dtype)) return -1;
  if (cfg->recv_dtype != cfg->x_dtype && cfg->recv_dtype != EPX_FP8_E4M3) return -1;
  const int R = cfg->nranks, E = cfg->num_experts, H = cfg->hidden, K = cfg->topk;
  const int nblocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  if (cfg->ranks_per_node < 0 || cfg->ranks_per_node > R || (cfg->ranks_per_node && R % cfg->ranks_per_node)) return -1;
  const int P = cfg->ranks_per_node ? cfg->ranks_per_node : R;

  /* Validate every id before writing anything. */
  for (int s = 0; s < R; s++)
    for (int64_t i = 0; i < num_tokens[s] * K; i++)
      if (topk_idx[s][i] < -1 || topk_idx[s][i] >= E) return -1;

  float *xf = malloc(sizeof(float) * (size_t)H);
  float *xin = malloc(sizeof(float) * (size_t)H);
  float *partial = malloc(sizeof(float) * (size_t)H);
  float *acc = malloc(sizeof(float) * (size_t)H);
  float *node = malloc(sizeof(float) * (size_t)H);
  uint8_t *q = malloc((size_t)H);
  float *scales = malloc(sizeof(float) * (size_t)nblocks);
  if (!xf || !xin || !partial || !acc || !node || !q || !scales) {
    free(xf), free(xin), free(partial), free(acc), free(node), free(q), free(scales);
    return -1;
  }

  for (int s = 0; s < R; s++) {
    const float *w_s = topk_weights ? topk_weights[s] : NULL;
    for (int64_t t = 0; t < num_tokens[s]; t++) {
      const int32_t *idx = topk_idx[s] + t * K;
      const float *w = w_s ? w_s + t * K : NULL;

      /* The token as every receiver sees it. */
      for (int c = 0; c < H; c++) xf[c] = load(cfg->x_dtype, x[s], (size_t)t * H + c);
      if (cfg->recv_dtype == EPX_FP8_E4M3) {
        epx_quantize_row_e4m3(xf, H, q, scales);
        for (int c = 0; c < H; c++) xin[c] = epx_e4m3_to_float(q[c]) * scales[c / EPX_FP8_BLOCK];
      } else {
        memcpy(xin, xf, sizeof(float) * (size_t)H);
      }

      for (int c = 0; c < H; c++) acc[c] = 0.0f;
      for (int n = 0; n < R / P; n++) {
        int node_any = 0;
        for (int c = 0; c < H; c++) node[c] = 0.0f;
        for (int d = n * P; d < (n + 1) * P; d++) {
          if (!destination_partial(cfg, d, idx, w, xin, partial)) continue;
          node_any = 1;
          for (int c = 0; c < H; c++) node[c] = node[c] + round_to(cfg->y_dtype, partial[c]);
        }
        if (!node_any) continue;
        /* rounded where it crossed a node boundary */
        const epx_dtype_t crossing = n == s / P ? EPX_FLOAT32 : cfg->y_dtype;
        for (int c = 0; c < H; c++) acc[c] = acc[c] + round_to(crossing, node[c]);
      }
      for (int c = 0; c < H; c++) store(cfg->out_dtype, out[s], (size_t)t * H + c, acc[c]);
    }
  }
  free(xf), free(xin), free(partial), free(acc), free(node), free(q), free(scales);
  return 0;
}
