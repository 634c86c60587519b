/* epx-latency: what the steps of a low-latency kernel cost on this GPU, one thread timing each
 * by the global timer over many repetitions. A decode step is a chain of dependent loads,
 * fences, flags and barriers; these figures say which of them a faster step must drop.
 *
 *   epx-latency
 *
 * Lines (ns per operation, the median of 5 runs, each run after 20 ms of arithmetic on every SM
 * so the clocks are up):
 *  - timer tick: the smallest step of %globaltimer seen.
 *  - load chain L2 / HBM: dependent 8-byte loads (ld.volatile: not from L1) over 4 MiB just
 *    written, or over 2 GiB after 256 MiB more were written.
 *  - straight code: ~32 KiB of instructions run once, then again in the same launch: what
 *    fetching a kernel's instructions costs the first time through.
 *  - ld.acquire.sys chain: the same over 4 MiB, each load an acquire at system scope.
 *  - fence F, after S stores: one thread stores S 16-byte words (distinct lines), then fence F.
 *  - st.release.sys after 1 store.
 *  - atomicAdd chain: dependent atomics on one word (each adds the last result's low bit).
 *  - __syncthreads, 512 threads.
 *  - flag one way: two blocks on two SMs pass a counter back and forth by a store and a poll
 *    (release / acquire at system scope, or relaxed volatile); half the round trip.
 *  - L1 load chain beside a poller: dependent loads over 4 KiB that stay in L1, by one warp,
 *    while another warp of the same block polls a flag by acquires at system scope, by
 *    volatile loads, or not at all. An acquire compiles to a load and CCTL.IVALL, an
 *    invalidation of the whole L1: if the poller's acquires empty it, the chain runs at L2's
 *    pace instead of L1's (what a waiting block does to the blocks beside it). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/common.cuh" /* the kernels' own timer, acquire loads and release stores */

#define REPS 2000
#define RUNS 5

static void check(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "epx-latency: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

static __device__ __forceinline__ uint64_t ld_volatile(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

static __device__ __forceinline__ void st_volatile(uint64_t *p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

enum { FENCE_NONE, FENCE_SC_SYS, FENCE_ACQREL_SYS, FENCE_SC_GPU, FENCE_ACQREL_GPU, FENCE_COUNT };
static const char *const fence_names[FENCE_COUNT] = {"none", "fence.sc.sys", "fence.acq_rel.sys", "fence.sc.gpu",
                                                     "fence.acq_rel.gpu"};

static __device__ __forceinline__ void fence(int f) {
  switch (f) {
    case FENCE_SC_SYS: fence_sc(); break;
    case FENCE_ACQREL_SYS: asm volatile("fence.acq_rel.sys;" ::: "memory"); break;
    case FENCE_SC_GPU: asm volatile("fence.sc.gpu;" ::: "memory"); break;
    case FENCE_ACQREL_GPU: asm volatile("fence.acq_rel.gpu;" ::: "memory"); break;
    default: break;
  }
}

/* Nodes at `stride` bytes: node i points at node (i + step) mod n, a walk no prefetcher follows. */
static __global__ void chain_init(uint64_t *buf, uint64_t n, uint64_t stride_words, uint64_t step) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    buf[i * stride_words] = (uint64_t)(uintptr_t)(buf + ((i + step) % n) * stride_words);
}

static __global__ void chain_walk(const uint64_t *start, int acquire, double *ns, uint64_t *sink) {
  const uint64_t *p = start;
  for (int i = 0; i < 64; i++) p = (const uint64_t *)ld_volatile(p); /* warm the path */
  const uint64_t t0 = globaltimer_ns();
  for (int i = 0; i < REPS; i++) p = (const uint64_t *)(acquire ? ld_acquire(p) : ld_volatile(p));
  *ns = (double)(globaltimer_ns() - t0) / REPS;
  *sink = (uint64_t)(uintptr_t)p;
}

static __global__ void timer_tick(double *ns) {
  uint64_t best = ~0ull, last = globaltimer_ns();
  for (int i = 0; i < 100000; i++) {
    const uint64_t t = globaltimer_ns();
    if (t != last && t - last < best) best = t - last;
    last = t;
  }
  *ns = (double)best;
}

/* One thread: `stores` 16-byte stores to distinct lines, then the fence; REPS times. */
static __global__ void fence_cost(uint4 *buf, int stores, int f, double *ns) {
  const uint64_t t0 = globaltimer_ns();
  for (int i = 0; i < REPS; i++) {
    for (int s = 0; s < stores; s++) buf[(size_t)(i * 64 + s) * 8] = make_uint4(i, s, 0, 0);
    fence(f);
  }
  *ns = (double)(globaltimer_ns() - t0) / REPS;
}

static __global__ void release_cost(uint64_t *buf, double *ns) {
  const uint64_t t0 = globaltimer_ns();
  for (int i = 0; i < REPS; i++) {
    buf[(size_t)(i + 1) * 16] = i;
    st_release(buf, i);
  }
  *ns = (double)(globaltimer_ns() - t0) / REPS;
}

static __global__ void atomic_chain(unsigned long long *word, double *ns) {
  unsigned long long v = 1;
  const uint64_t t0 = globaltimer_ns();
  for (int i = 0; i < REPS; i++) v = atomicAdd(word, v & 1);
  *ns = (double)(globaltimer_ns() - t0) / REPS;
  if (v == 7) word[1] = v;
}

static __global__ void barrier_cost(double *ns) {
  const uint64_t t0 = globaltimer_ns();
  for (int i = 0; i < REPS; i++) __syncthreads();
  if (threadIdx.x == 0) *ns = (double)(globaltimer_ns() - t0) / REPS;
}

/* Block 0 sends i, block 1 answers i; both poll. `ordered`: release / acquire at system scope. */
static __global__ void ping_pong(uint64_t *flags, int ordered, double *ns) {
  if (threadIdx.x != 0) return;
  uint64_t *to = &flags[blockIdx.x == 0 ? 0 : 32], *from = &flags[blockIdx.x == 0 ? 32 : 0];
  const uint64_t t0 = globaltimer_ns();
  for (uint64_t i = 1; i <= REPS; i++) {
    if (blockIdx.x == 0) ordered ? st_release(to, i) : st_volatile(to, i);
    while ((ordered ? ld_acquire(from) : ld_volatile(from)) < i) {
    }
    if (blockIdx.x == 1) ordered ? st_release(to, i) : st_volatile(to, i);
  }
  if (blockIdx.x == 0) *ns = (double)(globaltimer_ns() - t0) / REPS / 2;
}

/* Warp 0's lane 0 walks a chain that fits L1 (loads cached in L1) while warp 1's lane 0 polls
 * `flag` (poll 1: acquire at system scope, 2: volatile) until the walk is done; poll 0: no
 * poller. Both warps are in one block, so on one SM. */
static __global__ void l1_beside_poller(const uint64_t *start, const uint64_t *flag, int poll, double *ns,
                                        uint64_t *sink) {
  __shared__ volatile int walking;
  if (threadIdx.x == 0) walking = 1;
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t *p = start;
    for (int i = 0; i < 256; i++) p = (const uint64_t *)__ldca(p); /* into L1 */
    const uint64_t t0 = globaltimer_ns();
    for (int i = 0; i < REPS; i++) p = (const uint64_t *)__ldca(p);
    *ns = (double)(globaltimer_ns() - t0) / REPS;
    *sink = (uint64_t)(uintptr_t)p;
    walking = 0;
  } else if (threadIdx.x == EPXC_WARP && poll) {
    uint64_t seen = 0;
    while (walking) seen += poll == 1 ? ld_acquire(flag) : ld_volatile(flag);
    sink[1] = seen;
  }
}

/* Keeps the SMs' clocks up between the one-thread kernels: 20 ms of arithmetic on every SM. */
static __global__ void busy(float *sink) {
  float x = threadIdx.x;
  const uint64_t t0 = globaltimer_ns();
  while (globaltimer_ns() - t0 < 20000000ull)
    for (int i = 0; i < 256; i++) x = x * 0.999f + 0.5f;
  if (x == 0.25f) *sink = x;
}

/* Straight-line code run twice in one launch: the first pass fetches its instructions, the
 * second finds them cached: ICACHE_OPS x 4 instructions, about 32 KiB. */
#define ICACHE_OPS 512
static __global__ void icache(double *ns, float *sink) {
  float a = threadIdx.x, b = 1.0f, c = 2.0f, d = 3.0f;
  uint64_t t[3];
#pragma unroll 1 /* one copy of the code, run twice */
  for (int pass = 0; pass < 2; pass++) {
    t[pass] = globaltimer_ns();
#pragma unroll
    for (int i = 0; i < ICACHE_OPS; i++) {
      a = a * 1.0001f + (float)i;
      b = b * 0.9999f - (float)i;
      c = c + a * 0.5f;
      d = d - b * 0.25f;
    }
    __syncwarp();
  }
  t[2] = globaltimer_ns();
  ns[0] = (double)(t[1] - t[0]);
  ns[1] = (double)(t[2] - t[1]);
  if (a + b + c + d == 0.125f) *sink = a;
}

static int cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Runs `launch` RUNS times, each after the busy kernel; prints the median of what it leaves in *ns. */
#define MEASURE(label, launch)                                                         \
  do {                                                                                 \
    double v[RUNS];                                                                    \
    for (int run_ = 0; run_ < RUNS; run_++) {                                          \
      busy<<<prop.multiProcessorCount, 256>>>((float *)sink);                          \
      launch;                                                                          \
      check(cudaGetLastError(), label);                                                \
      check(cudaMemcpy(&v[run_], ns, sizeof(double), cudaMemcpyDeviceToHost), label); \
    }                                                                                  \
    qsort(v, RUNS, sizeof(double), cmp);                                               \
    printf("%-40s %8.1f ns\n", label, v[RUNS / 2]);                                   \
  } while (0)

int main(void) {
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "device");
  printf("epx-latency on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  double *ns;
  uint64_t *sink, *big, *small;
  void *flush;
  const size_t big_bytes = (size_t)2 << 30, small_bytes = (size_t)4 << 20, flush_bytes = (size_t)256 << 20;
  check(cudaMalloc(&flush, flush_bytes), "alloc");
  check(cudaMalloc((void **)&ns, 2 * sizeof(double)), "alloc");
  check(cudaMalloc((void **)&sink, 4096), "alloc");
  check(cudaMalloc((void **)&big, big_bytes), "alloc");
  check(cudaMalloc((void **)&small, small_bytes), "alloc");
  check(cudaMemset(sink, 0, 4096), "memset");

  MEASURE("timer tick", (timer_tick<<<1, 1>>>(ns)));
  /* 4 MiB: 16384 nodes 256 B apart; 2 GiB: 262144 nodes 8 KiB apart; steps prime to n */
  chain_init<<<256, 256>>>(small, 16384, 32, 4099);
  MEASURE("load chain L2 (4 MiB)", (chain_walk<<<1, 1>>>(small, 0, ns, sink)));
  MEASURE("ld.acquire.sys chain (4 MiB)", (chain_walk<<<1, 1>>>(small, 1, ns, sink)));
  chain_init<<<1024, 256>>>(big, 262144, 1024, 65537);
  /* the walk's nodes out of L2: a 256 MiB buffer written after them */
  MEASURE("load chain HBM (2 GiB)", (cudaMemset(flush, 1, flush_bytes), chain_walk<<<1, 1>>>(big, 0, ns, sink)));
  {
    double v[2];
    for (int run = 0; run < 2; run++) {
      busy<<<prop.multiProcessorCount, 256>>>((float *)sink);
      icache<<<1, 32>>>(ns, (float *)sink);
      check(cudaMemcpy(v, ns, sizeof v, cudaMemcpyDeviceToHost), "icache");
    }
    printf("%-40s %8.1f ns, then %.1f ns (instructions cached)\n", "straight code, ~32 KiB, first pass", v[0], v[1]);
  }
  const int stores[] = {0, 1, 32};
  for (int f = 0; f < FENCE_COUNT; f++)
    for (int s = 0; s < 3; s++) {
      char label[64];
      snprintf(label, sizeof label, "%s after %d stores", fence_names[f], stores[s]);
      MEASURE(label, (fence_cost<<<1, 1>>>((uint4 *)big, stores[s], f, ns)));
    }
  MEASURE("st.release.sys after 1 store", (release_cost<<<1, 1>>>(small, ns)));
  MEASURE("atomicAdd chain", (atomic_chain<<<1, 1>>>((unsigned long long *)sink, ns)));
  MEASURE("__syncthreads, 512 threads", (barrier_cost<<<1, 512>>>(ns)));
  MEASURE("flag one way, release/acquire.sys", (cudaMemset(sink, 0, 4096), ping_pong<<<2, 32>>>(sink, 1, ns)));
  MEASURE("flag one way, volatile", (cudaMemset(sink, 0, 4096), ping_pong<<<2, 32>>>(sink, 0, ns)));
  /* 32 nodes 128 B apart: 4 KiB, one L1 line a node */
  chain_init<<<1, 32>>>(small, 32, 16, 7);
  MEASURE("L1 load chain, no poller", (l1_beside_poller<<<1, 64>>>(small, sink + 64, 0, ns, sink)));
  MEASURE("L1 load chain, poller by acquires", (l1_beside_poller<<<1, 64>>>(small, sink + 64, 1, ns, sink)));
  MEASURE("L1 load chain, poller by volatile loads", (l1_beside_poller<<<1, 64>>>(small, sink + 64, 2, ns, sink)));
  check(cudaDeviceSynchronize(), "sync");
  return 0;
}
