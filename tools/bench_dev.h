/* epx-bench's view of where the data lives: host memory for the host backend, device memory
 * for CUDA. The stand-in experts have the same arithmetic on both (tools/dense_ref.h). */
#ifndef EPX_BENCH_DEV_H
#define EPX_BENCH_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

/* The stand-in experts' work on one rank's received rows. */
typedef struct {
  int rank, nranks, num_local, hidden, topk, align;
  int64_t ll_stride;          /* > 0: low-latency, expert l's rows start at l * ll_stride */
  epx_dtype_t recv_dtype, y_dtype;
  int64_t rows;               /* token layout: received tokens; expert layout: buffer rows */
  const void *recv_x;
  const float *scales;
  const int32_t *recv_idx;    /* token layout */
  const float *recv_w;        /* token layout */
  const int32_t *counts;      /* expert layout: [L] pairs per local expert */
  void *y;
} bench_standin_t;

typedef struct {
  const char *name;
  void *(*alloc)(size_t bytes);
  void (*release)(void *p);
  void (*upload)(void *dst, const void *src, size_t bytes);
  void (*download)(void *dst, const void *src, size_t bytes);
  void *(*stream_create)(void);
  void (*stream_destroy)(void *stream);
  /* Binds the calling thread to rank's device (epx's default placement: rank % devices) and
   * says how many devices the ranks are on: one means every rank's timestamps compare. */
  int (*bind_rank)(int rank, int nranks);
  /* Timestamps taken in stream order; elapsed_ms waits for the later one. */
  void *(*event_create)(void);
  void (*event_destroy)(void *ev);
  void (*event_record)(void *ev, void *stream);
  double (*elapsed_ms)(void *from, void *to);
  void (*standin_tokens)(const bench_standin_t *a, void *stream);
  void (*standin_experts)(const bench_standin_t *a, void *stream);
  /* Bytes read plus written per second by a large device-to-device copy. */
  double (*copy_bandwidth)(void);
  /* CUDA graphs (NULL where there are none): capture the stream's work, replay it. */
  void (*capture_begin)(void *stream);
  void *(*capture_end)(void *stream);
  void (*graph_launch)(void *exec, void *stream);
  void (*graph_destroy)(void *exec);
  /* The per-SM reference (NULL where there are no SMs): bytes read plus written per second
   * and per SM by the better of two copy kernels on `blocks` SMs (16-byte loads, bulk copies). */
  double (*sm_copy_bandwidth)(int blocks);
  /* What the device is, for the report (NULL: nothing to add to the host's description). */
  void (*describe)(char *text, size_t bytes);
} bench_dev_t;

extern const bench_dev_t bench_host_dev;
#ifdef EPX_BENCH_CUDA
extern const bench_dev_t bench_cuda_dev;
#endif

#endif
