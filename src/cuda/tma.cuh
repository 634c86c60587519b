/* Asynchronous copies: the bulk-copy instructions of sm_90 (PTX ISA 8.0: mbarriers and
 * cp.async.bulk, the TMA engine's copies without a tensor map) and the per-thread 16-byte
 * cp.async of sm_80. Only what bulk.cuh, ring.cuh, the benchmark's reference copy and
 * epx-sm-reads (tools/sm_reads.cu) use; no dependency on the rest of the kernels. */
#ifndef EPX_CUDA_TMA_CUH
#define EPX_CUDA_TMA_CUH

#include <stdint.h>

/* Builds for older devices (sm_80) compile these to a trap: their hosts never launch the
 * kernels that use them (epxc_shape_t.bulk_copies). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define EPXC_TMA(...) __trap()
#else
#define EPXC_TMA(...) asm volatile(__VA_ARGS__)
#endif

static __device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

static __device__ __forceinline__ void mbar_init(uint64_t *bar) {
  EPXC_TMA("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}

/* A barrier whose phase ends after `count` arrivals (and the bytes any expect_tx announced). */
static __device__ __forceinline__ void mbar_init_count(uint64_t *bar, uint32_t count) {
  EPXC_TMA("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

/* One arrival (release: this thread's shared-memory writes before it are seen by a waiter). */
static __device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  EPXC_TMA("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

/* Makes this thread's shared-memory writes (barrier initialisation) visible to the copy engine
 * (the async proxy). */
static __device__ __forceinline__ void fence_async_smem(void) { EPXC_TMA("fence.proxy.async.shared::cta;" ::: "memory"); }

/* One thread: n stages' barriers, initialised and made visible to the copy engine. */
static __device__ __forceinline__ void mbar_init_stages(uint64_t *bars, int n) {
  for (int s = 0; s < n; s++) mbar_init(&bars[s]);
  fence_async_smem();
}

static __device__ __forceinline__ void mbar_expect(uint64_t *bar, uint32_t bytes) {
  EPXC_TMA("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    EPXC_TMA("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(parity)
                 : "memory");
}

/* global -> shared, completing `bytes` on the stage's barrier */
static __device__ __forceinline__ void bulk_load(void *stage, const void *src, uint32_t bytes, uint64_t *bar) {
  EPXC_TMA("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(stage)),
               "l"((uint64_t)__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

/* shared -> global, in the current bulk group */
static __device__ __forceinline__ void bulk_store(void *dst, const void *stage, uint32_t bytes) {
  EPXC_TMA("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                   (uint64_t)__cvta_generic_to_global(dst)),
               "r"(smem_u32(stage)), "r"(bytes)
               : "memory");
}

static __device__ __forceinline__ void bulk_commit(void) { EPXC_TMA("cp.async.bulk.commit_group;" ::: "memory"); }
/* Until every committed group but the newest has read its stage. */
static __device__ __forceinline__ void bulk_wait_read_but_one(void) { EPXC_TMA("cp.async.bulk.wait_group.read 1;" ::: "memory"); }
static __device__ __forceinline__ void bulk_wait_read_all(void) { EPXC_TMA("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
/* Until every committed group's writes are done. */
static __device__ __forceinline__ void bulk_wait_all(void) { EPXC_TMA("cp.async.bulk.wait_group 0;" ::: "memory"); }

/* ---- per-thread copies (sm_80): a thread's own groups, waited for by that thread ------------ */

/* global -> shared, 16 bytes, in the thread's current group (L2 only: the bytes are read once) */
static __device__ __forceinline__ void lane_copy16(void *dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)),
               "l"((uint64_t)__cvta_generic_to_global(src))
               : "memory");
}

/* Closes the thread's current group (an empty one too: it completes at once). */
static __device__ __forceinline__ void lane_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }

/* Until at most PENDING of the thread's newest groups are still in flight. */
template <int PENDING>
static __device__ __forceinline__ void lane_wait(void) {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

#endif
