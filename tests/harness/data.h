/*
 * data — the tests' inputs: elements per the contract, poisoned buffers, random routings, one
 * MoE input over R ranks in every routing form, configs, and fixed patterns for the fault tests.
 */
#ifndef EPX_TEST_DATA_H
#define EPX_TEST_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"
#include "rng.h"

#define TU_MAX_RANKS EPX_MAX_RANKS

/* ---- elements ----------------------------------------------------------------------- */
float tu_load(epx_dtype_t t, const void *base, size_t i); /* f32 or bf16 */
void tu_store(epx_dtype_t t, void *base, size_t i, float v);
float tu_round(epx_dtype_t t, float v);
int tu_nblocks(int H); /* fp8 scales per row */
/* The receiver's float value of element c of row `row` (fp8: float(q) * scale). */
float tu_recv_value(epx_dtype_t recv_dtype, const void *rows, const float *scales, int H, int64_t row, int c);
void tu_store_nan(epx_dtype_t t, void *base, size_t i);
const char *tu_dtype(epx_dtype_t t); /* short name for messages */

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
  int ranks_per_node;          /* the combine order tu_dense follows (0: one node, flat) */
} tu_moe_t;

/* Random tokens and routing. T[r] as given. with_weights = 0 leaves w NULL (every weight 1). */
void tu_moe_random(tu_moe_t *m, tu_rng_t *g, int R, int E, int H, int K, epx_dtype_t x_dtype, const int64_t *T,
                   const tu_route_opts_t *o, int with_weights);
/* Sorts the rows (as the map form will present them) and builds map / probs. */
void tu_moe_make_map(tu_moe_t *m);
void tu_moe_free(tu_moe_t *m);
epx_routing_t tu_routing(const tu_moe_t *m, int rank, int form);

/* The input of stream `stream` of seed `seed`, the same in every process of a multi-process
 * test: each rank 1..max_tokens tokens, except that one rank, or none (a draw of R), gets
 * none; a slot routes nowhere with probability 0.15; weights on. */
void tu_moe_stream(tu_moe_t *m, uint64_t seed, uint64_t stream, int R, int E, int H, int K, epx_dtype_t x_dtype,
                   int max_tokens);

/* ---- configs ---------------------------------------------------------------------- */
/* A config with timeout 10 s (so a bug shows as a failure, not a long hang). */
epx_config_t tu_config(int E, int H, int K, int max_tokens_per_rank);
epx_handle_config_t tu_handle_config(epx_algo_t algo, epx_layout_t layout, int align);

/* ---- fixed patterns (tests of failures, whose data need not vary) ------------------- */
/* x[i] = bf16(base + (i + salt) % period). */
void tu_fixed_bf16(uint16_t *x, int64_t n, float base, int period, int salt);
/* idx[t, k] = (t + 5k + salt) % E: distinct experts in a row while 5 (K - 1) < E. */
void tu_fixed_topk(int32_t *idx, int64_t T, int K, int E, int salt);

#endif /* EPX_TEST_DATA_H */
