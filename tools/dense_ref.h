/*
 * dense_ref — a single-process, dense computation of one MoE layer, independent of epx's
 * implementation (it uses only the dtype enum and the public scalar conversions of epx.h).
 *
 * It is the oracle of the tests and of `epx-bench --check`: a dispatch, a stand-in expert on
 * every received row, and a combine through epx must give exactly these bits.
 *
 * The stand-in expert: global expert e multiplies its input row by dense_expert_scale(e)
 * (float32 product), then rounds to the expert output type y_dtype.
 *
 * Exact arithmetic (IEEE float32 throughout; products rounded before they are added, i.e.
 * compiled with -ffp-contract=off; no fma, no double):
 *   xin(t)   the token as a receiver sees it: float(x) for f32 / bf16; for an fp8 receive
 *            type the float(x) row is quantised with epx_quantize_row_e4m3 and the value is
 *            epx_e4m3_to_float(q[c]) * scale[c / 128].
 *   y_e(t)   cast_y(dense_expert_scale(e) * xin(t)).
 *   rank of expert e: e / L, local id e % L, with L = num_experts / nranks.
 *   token layout (expert_layout = 0): destination d makes one row per token:
 *            row_d = cast_y(sum over slots k ascending whose expert is on d of w[k] * float(y_e))
 *   expert layout (expert_layout = 1, also low-latency mode): destination d makes
 *            partial_d = cast_y(sum over the token's local experts on d, ascending local id,
 *                               of w * float(y_e))
 *   node:    with P = ranks_per_node, node n holds ranks [n P, (n + 1) P). For every node n
 *            the token went to, node_n = sum over its ranks d ascending that the token went
 *            to of float(row_d or partial_d); it is rounded, cast_y, when n is not the
 *            source's node (it crossed a node boundary) and stays float32 when it is.
 *   source:  out[t] = cast_out(sum over those nodes n ascending of node_n). One node: the
 *            sum over destination ranks ascending. A token that routes nowhere gives 0.
 *   Every sum is float32, left to right, starting from 0.0f. A missing weight array
 *   Every sum is float32, left to right, starting from 0.0f; a NaN result is stored as the
 *   canonical NaN of the output type (float32 0x7FFFFFFF, bf16 0x7FFF). A missing weight array
 *   (topk_weights NULL, or topk_weights[s] NULL) means every weight is 1.
 */
#ifndef EPX_DENSE_REF_H
#define EPX_DENSE_REF_H

#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The expert stand-in's factor for global expert e: 0.5 + 0.0625 * (e % 23). Distinct for
 * neighbouring experts, so a row that reaches the wrong expert changes the result; exact in
 * bf16, so the factor itself adds no rounding. */
float dense_expert_scale(int e);

typedef struct {
  int nranks, num_experts, hidden, topk;
  epx_dtype_t x_dtype;    /* EPX_FLOAT32 or EPX_BFLOAT16: type of the tokens */
  epx_dtype_t recv_dtype; /* x_dtype, or EPX_FP8_E4M3 (quantised on dispatch) */
  epx_dtype_t y_dtype;    /* expert output type = combine partial type (f32 or bf16) */
  epx_dtype_t out_dtype;  /* combine output type (f32 or bf16) */
  int expert_layout;      /* 0: token layout; 1: expert layout (also what low-latency mode does) */
  int ranks_per_node;     /* 0 or nranks: one node (and low-latency mode, whose order is flat);
                             else a divisor of nranks: the node-aware order below */
} dense_cfg_t;

/* For every rank s in 0..nranks-1 and token t < num_tokens[s]:
 *   x[s]            [T_s, hidden] in x_dtype (may be NULL when T_s = 0)
 *   topk_idx[s]     [T_s, topk] int32 global expert ids, -1 = no expert
 *   topk_weights    NULL, or per rank [T_s, topk] float32 (an entry NULL: weights 1)
 *   out[s]          [T_s, hidden] in out_dtype, written with the exact result above.
 * Returns 0, or -1 for a config it cannot compute (bad dtype, experts not divisible,
 * an expert id out of range, out of memory); out is then not written. */
int dense_moe(const dense_cfg_t *cfg, const int64_t *num_tokens, const void *const *x,
              const int32_t *const *topk_idx, const float *const *topk_weights, void *const *out);

#ifdef __cplusplus
}
#endif
#endif /* EPX_DENSE_REF_H */
