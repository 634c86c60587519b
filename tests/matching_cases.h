/*
 * matching_cases — the cases of "a collective pairs only with the same call of every peer",
 * written once for both harnesses: rank threads (test_matching) and rank processes
 * (tests/mp/test_mp_matching). Each rank runs mc_rank on its own comm; the inputs are derived
 * from (seed, rank) so that every rank computes the dense reference (dense_ref) of its own
 * output by itself.
 *
 * A case: one rank (`bad`) makes a call that differs from its peers' (a refused argument, a
 * handle of other settings, other call arguments, another operation); every rank must fail
 * that call with the case's status, well before the timeout, naming the bad rank, writing no
 * output (every output sentinel-filled before); then the group is usable (a valid dispatch +
 * combine matches dense_ref bit for bit) or broken (EPX_ERR_BROKEN), as the README says.
 */
#ifndef EPX_MATCHING_CASES_H
#define EPX_MATCHING_CASES_H

#include "epx.h"

typedef enum {
  /* refused on the bad rank, which still takes part */
  MC_NULL_HANDLE,     /* dispatch with a NULL handle */
  MC_FOREIGN_HANDLE,  /* dispatch with another comm's handle */
  MC_LONE_COMPLETE,   /* dispatch COMPLETE without a SEND, the peers dispatch whole */
  MC_BAD_DTYPE,       /* dispatch x_dtype int32 */
  MC_HUGE_TOKENS,     /* dispatch of 2^62 tokens (an overflow of num_tokens * topk) */
  MC_COMBINE_NULL_HANDLE,
  /* handle settings */
  MC_ALIGN,           /* expert layout, align 1 against 3 */
  MC_LAYOUT,          /* token against expert layout */
  MC_ALGO,            /* HT against LL */
  MC_EXACT,           /* exact 1 against 0 */
  /* call arguments */
  MC_RECV_DTYPE,      /* dispatch recv_dtype bf16 against fp8 */
  MC_SCALE_BY_PROBS,  /* expert-layout dispatch */
  MC_RECV_PROBS,      /* an optional output on one rank only */
  MC_PART,            /* SEND against ALL */
  MC_X_DTYPE,         /* dispatch x bfloat16 against float32 */
  MC_COUNTS,          /* tokens_per_local_expert on all but one rank */
  MC_Y_DTYPE,         /* combine y float32 against bfloat16 */
  MC_WEIGHTED,        /* expert-layout combine */
  MC_WEIGHT_GRAD,     /* combine with row_weight_grad on one rank only */
  MC_OUT_DTYPE,       /* combine out bfloat16 against float32 */
  MC_ROW_PROBS,       /* expert-layout combine with row_probs on one rank only */
  /* other operations */
  MC_SKIPPED_NOTIFY,  /* the bad rank's notify has a NULL comm (it cannot take part), then it
                         combines while its peers notify */
  MC_COMBINE_VS_REPLAY, /* combine on the bad rank, dispatch replay on the others */
  MC_NUM_CASES
} mc_kind_t;

const char *mc_name(mc_kind_t kind);

typedef struct {
  mc_kind_t kind;
  int nranks, bad;
  uint64_t seed;
  int timeout_ms;
} mc_case_t;

/* The config every rank uses. */
epx_config_t mc_config(const mc_case_t *c);

/* Runs the case on rank `rank` (its comm; `other` a comm of another group on this rank, for
 * MC_FOREIGN_HANDLE, else NULL). Every rank of the group calls it at once. Prints each failed
 * expectation prefixed by `tag`; returns the number of expectations checked in *checked and
 * the number that failed. */
int mc_rank(const mc_case_t *c, int rank, epx_comm_t *comm, epx_comm_t *other, const char *tag, int *checked);

#endif
