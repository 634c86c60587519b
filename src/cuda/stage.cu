/* Staging for groups across processes: a peer reaches only this rank's arena, so rows it would
 * read from the caller's memory (combine's y in the token layout, row weight gradients) are
 * copied there first. How many rows is the plan's count, known on the device only in
 * sync-free mode: hence a kernel rather than a copy the host sizes. */
#include "cuda/common.cuh"

static __global__ void stage_kernel(epxc_group_t g, epxc_plan_t *plan, int count, const void *src, void *dst,
                                    int64_t row_bytes, int64_t cap_rows) {
  if (rank_stopped(&g) || plan->group_status != EPX_SUCCESS || plan->refused) return;
  const int64_t n = count == EPXC_STAGE_RECV ? plan->num_recv : plan->num_rows;
  if (n > cap_rows) { /* sized from a capacity the plan outgrew: refused as partials_kernel does */
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      plan->refused = EPX_ERR_OUTPUT_TOO_SMALL;
      record_error(&g, EPX_ERR_OUTPUT_TOO_SMALL, EPXC_PH_COMBINE, g.rank, n);
    }
    return;
  }
  const int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, step = (int64_t)gridDim.x * blockDim.x;
  if ((((uintptr_t)src | (uintptr_t)dst | (uintptr_t)row_bytes) & 15) == 0) { /* data rows: 16-byte vectors */
    const int64_t v = n * (row_bytes / 16);
    for (int64_t i = i0; i < v; i += step) ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
  } else {
    const int64_t v = n * (row_bytes / 4);
    for (int64_t i = i0; i < v; i += step) ((uint32_t *)dst)[i] = ((const uint32_t *)src)[i];
  }
}

extern "C" int epxc_stage_rows(const epxc_group_t *g, epxc_plan_t *plan_dev, int count, const void *src, void *dst,
                               int64_t row_bytes, int64_t cap_rows, int num_sms, void *stream) {
  stage_kernel<<<num_sms, EPXC_THREADS, 0, (cudaStream_t)stream>>>(*g, plan_dev, count, src, dst, row_bytes, cap_rows);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_stage(size_t *stack) {
  const void *const kernels[] = {(const void *)stage_kernel};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}
