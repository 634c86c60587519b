/* Phase times of one launch, for builds that ask for them: -DEPX_LL_TRACE (the low-latency
 * kernels, rank 0's block 0), -DEPX_NOTIFY_TRACE (notify, every block of rank 0) or
 * -DEPX_EXCHANGE_TRACE (the steps of each of rank 0's exchanges, exchange.cuh). A kernel
 * keeps an epxc_trace_t, stamps the global timer (trace_mark) where a phase ends, and prints
 * the marks (trace_print): the first one's absolute time, then each later one since it, so
 * the blocks of a launch line up. Where a step's time goes, without a profiler. Only the
 * trace builds include this file. */
#ifndef EPX_CUDA_TRACE_CUH
#define EPX_CUDA_TRACE_CUH

#include <stdio.h>

#include "cuda/common.cuh"

typedef struct {
  uint64_t at[EPXC_TRACE_POINTS];
  int n;
} epxc_trace_t;

static __device__ __forceinline__ void trace_mark(epxc_trace_t *t, bool on) {
  if (on && t->n < EPXC_TRACE_POINTS) t->at[t->n++] = globaltimer_ns();
}

/* One line (one printf, so blocks' lines do not interleave): "<what> <block>: <start> <mark 1 -
 * start> ...", in ns, marks not taken printed as 0. */
static __device__ void trace_print(const epxc_trace_t *t, bool on, const char *what, int block) {
  static_assert(EPXC_TRACE_POINTS == 12, "the format below prints 12 marks");
  if (!on || t->n == 0) return;
  unsigned long long d[EPXC_TRACE_POINTS] = {0};
  for (int i = 1; i < t->n; i++) d[i] = t->at[i] - t->at[0];
  printf("%s %d: %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", what, block,
         (unsigned long long)t->at[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11]);
}

#endif
