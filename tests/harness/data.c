/* data — see data.h. */
#include "data.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- elements ----------------------------------------------------------------------- */

const char *tu_dtype(epx_dtype_t t) {
  switch (t) {
    case EPX_FLOAT32: return "f32";
    case EPX_BFLOAT16: return "bf16";
    case EPX_FP8_E4M3: return "fp8";
    case EPX_INT32: return "i32";
    case EPX_INT64: return "i64";
    case EPX_BOOL: return "bool";
  }
  return "?";
}


float tu_load(epx_dtype_t t, const void *base, size_t i) {
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(((const uint16_t *)base)[i]);
  return ((const float *)base)[i];
}

void tu_store(epx_dtype_t t, void *base, size_t i, float v) {
  if (t == EPX_BFLOAT16)
    ((uint16_t *)base)[i] = epx_float_to_bf16(v);
  else
    ((float *)base)[i] = v;
}

void tu_store_nan(epx_dtype_t t, void *base, size_t i) {
  if (t == EPX_BFLOAT16)
    ((uint16_t *)base)[i] = 0x7FC0;
  else
    ((float *)base)[i] = NAN;
}

float tu_round(epx_dtype_t t, float v) {
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(epx_float_to_bf16(v));
  return v;
}

int tu_nblocks(int H) { return (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK; }

float tu_recv_value(epx_dtype_t recv_dtype, const void *rows, const float *scales, int H, int64_t row, int c) {
  if (recv_dtype == EPX_FP8_E4M3) {
    const uint8_t q = ((const uint8_t *)rows)[row * H + c];
    return epx_e4m3_to_float(q) * scales[row * tu_nblocks(H) + c / EPX_FP8_BLOCK];
  }
  return tu_load(recv_dtype, rows, (size_t)(row * H + c));
}

/* ---- poison ------------------------------------------------------------------------- */
void *tu_alloc_poison(size_t bytes) {
  if (bytes == 0) bytes = 1;
  void *p = malloc(bytes);
  if (!p) {
    printf("out of memory (%zu bytes)\n", bytes);
    abort();
  }
  memset(p, TU_POISON, bytes);
  return p;
}

int tu_is_poison(const void *p, size_t bytes) {
  const uint8_t *b = p;
  for (size_t i = 0; i < bytes; i++)
    if (b[i] != TU_POISON) return 0;
  return 1;
}

int64_t tu_first_diff(const void *a, const void *b, size_t elem_size_, int64_t n) {
  const uint8_t *x = a, *y = b;
  for (int64_t i = 0; i < n; i++)
    if (memcmp(x + i * elem_size_, y + i * elem_size_, elem_size_)) return i;
  return -1;
}
/* ---- routing ------------------------------------------------------------------------ */
tu_route_opts_t tu_route_default(void) {
  tu_route_opts_t o = {0.25, -1, 0, 0};
  return o;
}

void tu_random_topk(tu_rng_t *g, int64_t T, int K, int E, const tu_route_opts_t *o, int32_t *idx) {
  const int lo = o->span_hi > 0 ? o->span_lo : 0;
  const int hi = o->span_hi > 0 ? o->span_hi : E;
  for (int64_t t = 0; t < T; t++) {
    int32_t *row = idx + t * K;
    for (int k = 0; k < K; k++) row[k] = -1;
    if (o->one_expert >= 0) {
      row[tu_int(g, 0, K - 1)] = o->one_expert;
      continue;
    }
    int m = 0;
    for (int k = 0; k < K; k++)
      if (tu_unit(g) >= o->p_none) m++;
    if (m > hi - lo) m = hi - lo;
    /* m distinct experts by rejection, then scattered over random slots. */
    int32_t chosen[EPX_MAX_TOPK];
    for (int i = 0; i < m; i++) {
      for (;;) {
        int32_t e = tu_int(g, lo, hi - 1), dup = 0;
        for (int j = 0; j < i; j++) dup |= chosen[j] == e;
        if (!dup) {
          chosen[i] = e;
          break;
        }
      }
    }
    int slot[EPX_MAX_TOPK];
    for (int k = 0; k < K; k++) slot[k] = k;
    for (int k = K - 1; k > 0; k--) {
      int j = tu_int(g, 0, k), tmp = slot[k];
      slot[k] = slot[j], slot[j] = tmp;
    }
    for (int i = 0; i < m; i++) row[slot[i]] = chosen[i];
  }
}

void tu_sort_topk_rows(int64_t T, int K, int32_t *idx, float *w) {
  for (int64_t t = 0; t < T; t++) {
    int32_t *r = idx + t * K;
    float *wr = w ? w + t * K : NULL;
    for (int k = 0; k < K; k++) /* -1 sorts last */
      if (r[k] < 0 && wr) wr[k] = 0.0f;
    for (int i = 1; i < K; i++)
      for (int j = i; j > 0; j--) {
        uint32_t a = (uint32_t)r[j - 1], b = (uint32_t)r[j]; /* -1 is the largest unsigned */
        if (a <= b) break;
        int32_t ti = r[j - 1];
        r[j - 1] = r[j], r[j] = ti;
        if (wr) {
          float tw = wr[j - 1];
          wr[j - 1] = wr[j], wr[j] = tw;
        }
      }
  }
}

/* ---- one MoE input ------------------------------------------------------------------ */
void tu_moe_random(tu_moe_t *m, tu_rng_t *g, int R, int E, int H, int K, epx_dtype_t x_dtype, const int64_t *T,
                   const tu_route_opts_t *o, int with_weights) {
  memset(m, 0, sizeof *m);
  m->R = R, m->E = E, m->H = H, m->K = K, m->L = E / R, m->x_dtype = x_dtype;
  for (int r = 0; r < R; r++) {
    const int64_t n = T[r];
    m->T[r] = n;
    m->x[r] = tu_alloc_poison((size_t)(n * H) * epx_dtype_size(x_dtype));
    for (int64_t i = 0; i < n * H; i++) tu_store(x_dtype, m->x[r], (size_t)i, tu_value(g));
    m->idx[r] = tu_alloc_poison(sizeof(int32_t) * (size_t)(n * K));
    tu_random_topk(g, n, K, E, o, m->idx[r]);
    m->idx64[r] = tu_alloc_poison(sizeof(int64_t) * (size_t)(n * K));
    for (int64_t i = 0; i < n * K; i++) m->idx64[r][i] = m->idx[r][i];
    if (with_weights) {
      m->w[r] = tu_alloc_poison(sizeof(float) * (size_t)(n * K));
      for (int64_t i = 0; i < n * K; i++) m->w[r][i] = tu_weight(g); /* -1 slots keep junk weights */
    }
  }
}

void tu_moe_make_map(tu_moe_t *m) {
  for (int r = 0; r < m->R; r++) {
    const int64_t n = m->T[r];
    tu_sort_topk_rows(n, m->K, m->idx[r], m->w[r]);
    for (int64_t i = 0; i < n * m->K; i++) m->idx64[r][i] = m->idx[r][i];
    free(m->map[r]);
    free(m->probs[r]);
    m->map[r] = tu_alloc_poison((size_t)(n * m->E));
    memset(m->map[r], 0, (size_t)(n * m->E));
    m->probs[r] = NULL;
    if (m->w[r]) {
      m->probs[r] = tu_alloc_poison(sizeof(float) * (size_t)(n * m->E));
      memset(m->probs[r], 0, sizeof(float) * (size_t)(n * m->E));
    }
    for (int64_t t = 0; t < n; t++)
      for (int k = 0; k < m->K; k++) {
        const int32_t e = m->idx[r][t * m->K + k];
        if (e < 0) continue;
        m->map[r][t * m->E + e] = 1;
        if (m->probs[r]) m->probs[r][t * m->E + e] = m->w[r][t * m->K + k];
      }
  }
}

void tu_moe_free(tu_moe_t *m) {
  for (int r = 0; r < m->R; r++) {
    free(m->x[r]), free(m->idx[r]), free(m->idx64[r]), free(m->w[r]), free(m->map[r]), free(m->probs[r]);
  }
  memset(m, 0, sizeof *m);
}

epx_routing_t tu_routing(const tu_moe_t *m, int rank, int form) {
  epx_routing_t rt;
  memset(&rt, 0, sizeof rt);
  rt.num_tokens = m->T[rank];
  if (form == TU_FORM_MIXED) form = rank % 3;
  if (form == TU_FORM_MAP) {
    rt.idx_dtype = EPX_INT32;
    rt.routing_map = m->map[rank];
    rt.probs = m->probs[rank];
  } else {
    rt.idx_dtype = form == TU_FORM_TOPK64 ? EPX_INT64 : EPX_INT32;
    rt.topk_idx = form == TU_FORM_TOPK64 ? (const void *)m->idx64[rank] : (const void *)m->idx[rank];
    rt.topk_weights = m->w[rank];
  }
  return rt;
}

void tu_moe_stream(tu_moe_t *m, uint64_t seed, uint64_t stream, int R, int E, int H, int K, epx_dtype_t x_dtype,
                   int max_tokens) {
  tu_rng_t g = tu_rng_stream(seed, stream);
  int64_t T[TU_MAX_RANKS];
  const int empty = tu_int(&g, 0, R);
  for (int r = 0; r < R; r++) T[r] = r == empty ? 0 : tu_int(&g, 1, max_tokens);
  tu_route_opts_t o = tu_route_default();
  o.p_none = 0.15;
  tu_moe_random(m, &g, R, E, H, K, x_dtype, T, &o, 1);
}

/* ---- configs ---------------------------------------------------------------------- */
epx_config_t tu_config(int E, int H, int K, int max_tokens_per_rank) {
  epx_config_t c;
  epx_config_init(&c);
  c.num_experts = E, c.hidden = H, c.topk = K, c.max_tokens_per_rank = max_tokens_per_rank;
  c.timeout_ms = 10000;
  return c;
}

epx_handle_config_t tu_handle_config(epx_algo_t algo, epx_layout_t layout, int align) {
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  hc.algo = algo, hc.layout = layout, hc.align = align;
  return hc;
}

/* ---- fixed patterns ----------------------------------------------------------------- */
void tu_fixed_bf16(uint16_t *x, int64_t n, float base, int period, int salt) {
  for (int64_t i = 0; i < n; i++) x[i] = epx_float_to_bf16(base + (float)((i + salt) % period));
}

void tu_fixed_topk(int32_t *idx, int64_t T, int K, int E, int salt) {
  for (int64_t t = 0; t < T; t++)
    for (int k = 0; k < K; k++) idx[t * K + k] = (int32_t)((t + 5 * k + salt) % E);
}
