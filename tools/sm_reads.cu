/* epx-sm-reads: how fast one SM reads memory, by each way a kernel can read it, and how fast it
 * writes (the pushes of a kernel that writes into peers). A combine reads most of what it moves
 * (a DeepSeek-V3 token sums about five rows into one), so its speed per SM is bounded by these
 * read rates, not by the copy kernels' read + write figure that epx-bench prints beside every
 * phase.
 *
 *   epx-sm-reads [blocks]      (default 16: one block per SM, as 8 ranks x 2 SMs; 0: every SM)
 *
 * Each line reads (or writes) the same 1 GiB, far past L2, on `blocks` blocks and prints bytes
 * per SM-second, the best of three runs after a warm-up:
 *  - bulk S N: one thread of the block issues bulk copies (cp.async.bulk, the copy engine) of S
 *    bytes into a ring of N shared-memory stages; 16 reader warps read each landed stage and
 *    release it, as a pipelined combine's reduce warps would. "issuers W": W warps issue, warp i
 *    the stages s with s mod W = i.
 *  - lsu T x U: T threads, each with U 16-byte loads in flight through registers.
 *  - lanes-async: per-warp rings of 16-byte cp.async (sm_80's per-lane asynchronous copies).
 *  - write bulk S / write lsu T x 4: writes, by bulk stores of S bytes from one shared-memory
 *    stage (one issuing thread, two groups in flight) or by 16-byte stores.
 * Needs sm_90 for the bulk lines (skipped elsewhere). */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/tma.cuh"

#define READERS 16
#define RING_BYTES (192 * 1024)

static void check(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "epx-sm-reads: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

/* Keeps the reads: a sum no input makes exactly 1.25 */
static __device__ void keep(float acc, float *sink) {
  if (acc == 1.25f) *sink = acc;
}

/* Warp `warp` (< issuers), lane 0: its stages of the block's chunks of S bytes. */
static __device__ void bulk_issue(const uint8_t *src, uint8_t *ring, uint64_t *full, uint64_t *empty, size_t mine,
                                  int S, int N, int warp, int issuers) {
  for (size_t k = 0; k < mine; k++) {
    const int s = (int)(k % N);
    const uint32_t lap = (uint32_t)(k / N);
    if (s % issuers != warp) continue;
    if (lap > 0) {
      mbar_wait(&empty[s], (lap - 1) & 1);
      fence_async_smem();
    }
    mbar_expect(&full[s], (uint32_t)S);
    bulk_load(ring + (size_t)s * S, src + (blockIdx.x + k * gridDim.x) * (size_t)S, (uint32_t)S, &full[s]);
  }
}

/* A reader warp: every landed stage's 16-byte vectors of lane `me` of the readers. */
static __device__ float bulk_read(const uint8_t *ring, uint64_t *full, uint64_t *empty, size_t mine, int S, int N,
                                  int me) {
  float acc = 0.0f;
  for (size_t k = 0; k < mine; k++) {
    const int s = (int)(k % N);
    mbar_wait(&full[s], (uint32_t)(k / N) & 1);
    for (int off = me * 16; off < S; off += READERS * 32 * 16) {
      const uint4 v = *(const uint4 *)(ring + (size_t)s * S + off);
      acc += __uint_as_float(v.x) + __uint_as_float(v.w);
    }
    __syncwarp();
    if (me % 32 == 0) mbar_arrive(&empty[s]);
  }
  return acc;
}

/* Warps [0, issuers) issue, the next READERS read; chunks dealt to blocks round robin. */
static __global__ void bulk_kernel(const uint8_t *src, size_t chunks, int S, int N, int issuers, float *sink) {
  extern __shared__ __align__(128) uint8_t ring[];
  uint64_t *full = (uint64_t *)(ring + (size_t)N * S), *empty = full + N;
  if (threadIdx.x == 0) {
    for (int i = 0; i < N; i++) mbar_init(&full[i]), mbar_init_count(&empty[i], READERS);
    fence_async_smem();
  }
  __syncthreads();
  const int warp = (int)(threadIdx.x / 32);
  const size_t mine = (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x;
  if (warp < issuers) {
    if (threadIdx.x % 32 == 0) bulk_issue(src, ring, full, empty, mine, S, N, warp, issuers);
    return;
  }
  keep(bulk_read(ring, full, empty, mine, S, N, (int)threadIdx.x - issuers * 32), sink);
}

/* Each thread U 16-byte loads in flight, the grid striding over n vectors. */
template <int U>
static __global__ void lsu_kernel(const uint4 *src, size_t n, float *sink) {
  const size_t step = (size_t)gridDim.x * blockDim.x;
  float acc = 0.0f;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += U * step) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; u++) v[u] = i + u * step < n ? __ldcs(src + i + u * step) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; u++) acc += __uint_as_float(v[u].x) + __uint_as_float(v[u].w);
  }
  keep(acc, sink);
}

/* This lane's V 16-byte vectors of unit `u` (of units) into its warp's stage, if there is one. */
template <int V>
static __device__ __forceinline__ void lanes_copy_unit(uint8_t *stage, const uint8_t *src, size_t u, size_t units) {
  const int lane = (int)(threadIdx.x % 32);
  if (u < units)
    for (int v = 0; v < V; v++) lane_copy16(stage + (v * 32 + lane) * 16, src + u * (32 * 16 * V) + (v * 32 + lane) * 16);
}

/* Per-warp rings of ST stages of V 16-byte vectors a lane, filled by cp.async. */
template <int ST, int V>
static __global__ void __launch_bounds__(1024) lanes_async_kernel(const uint8_t *src, size_t bytes, float *sink) {
  extern __shared__ __align__(128) uint8_t ring_all[];
  const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x % 32);
  const size_t unit = 32 * 16 * V, units = bytes / unit;
  const size_t first = (size_t)blockIdx.x * (blockDim.x / 32) + warp, stride = (size_t)gridDim.x * (blockDim.x / 32);
  uint8_t *ring = ring_all + (size_t)warp * ST * unit;
  size_t issue = first;
  for (int s = 0; s < ST - 1; s++, issue += stride) {
    lanes_copy_unit<V>(ring + s * unit, src, issue, units);
    lane_commit();
  }
  float acc = 0.0f;
  int k = 0;
  for (size_t u = first; u < units; u += stride, k++, issue += stride) {
    const int s = (k + ST - 1) % ST;
    lanes_copy_unit<V>(ring + s * unit, src, issue, units);
    lane_commit();
    lane_wait<ST - 1>();
    const uint8_t *stage = ring + (k % ST) * unit;
    for (int v = 0; v < V; v++) {
      const uint4 x = *(const uint4 *)(stage + (v * 32 + lane) * 16);
      acc += __uint_as_float(x.x) + __uint_as_float(x.w);
    }
  }
  keep(acc, sink);
}

/* One thread streams bulk stores of S bytes from shared memory over the block's chunks. */
static __global__ void bulk_store_kernel(uint8_t *dst, size_t chunks, int S) {
  extern __shared__ __align__(128) uint8_t stage[];
  if (threadIdx.x != 0) return;
  for (size_t k = blockIdx.x; k < chunks; k += gridDim.x) {
    bulk_store(dst + k * (size_t)S, stage, (uint32_t)S);
    bulk_commit();
    bulk_wait_read_but_one();
  }
  bulk_wait_all();
}

/* Each thread four 16-byte stores a round, the grid striding over n vectors. */
static __global__ void lsu_store_kernel(uint4 *dst, size_t n) {
  const size_t step = (size_t)gridDim.x * blockDim.x;
  const uint4 v = make_uint4(threadIdx.x, blockIdx.x, 1, 2);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 4 * step)
#pragma unroll
    for (int u = 0; u < 4; u++)
      if (i + u * step < n) __stcs(dst + i + u * step, v);
}

typedef enum { BULK, LSU4, LSU8, LSU16, LANES_ASYNC, WRITE_BULK, WRITE_LSU } way_t;

typedef struct {
  way_t way;
  int threads, S, N, issuers;
} probe_t;

static void launch(const probe_t *p, const uint8_t *src, uint8_t *dst, size_t bytes, int blocks, float *sink) {
  switch (p->way) {
  case WRITE_BULK:
    check(cudaFuncSetAttribute((const void *)bulk_store_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p->S),
          "store attribute");
    bulk_store_kernel<<<blocks, 32, p->S>>>(dst, bytes / p->S, p->S);
    break;
  case WRITE_LSU: lsu_store_kernel<<<blocks, p->threads>>>((uint4 *)dst, bytes / 16); break;
  case BULK: {
    const size_t smem = (size_t)p->S * p->N + 16 * p->N;
    check(cudaFuncSetAttribute((const void *)bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
          "bulk attribute");
    bulk_kernel<<<blocks, 32 * (p->issuers + READERS), smem>>>(src, bytes / p->S, p->S, p->N, p->issuers, sink);
    break;
  }
  case LSU4: lsu_kernel<4><<<blocks, p->threads>>>((const uint4 *)src, bytes / 16, sink); break;
  case LSU8: lsu_kernel<8><<<blocks, p->threads>>>((const uint4 *)src, bytes / 16, sink); break;
  case LSU16: lsu_kernel<16><<<blocks, p->threads>>>((const uint4 *)src, bytes / 16, sink); break;
  case LANES_ASYNC: {
    const size_t smem = 3 * 2048 * 32;
    check(cudaFuncSetAttribute((const void *)lanes_async_kernel<3, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)smem),
          "lanes attribute");
    lanes_async_kernel<3, 4><<<blocks, 1024, smem>>>(src, bytes, sink);
    break;
  }
  }
  check(cudaGetLastError(), "launch");
}

static void name_of(const probe_t *p, char *out, size_t n) {
  if (p->way == BULK)
    snprintf(out, n, "bulk S %5d N %2d issuers %d", p->S, p->N, p->issuers);
  else if (p->way == WRITE_BULK)
    snprintf(out, n, "write bulk S %5d", p->S);
  else if (p->way == WRITE_LSU)
    snprintf(out, n, "write lsu %4d x 4", p->threads);
  else if (p->way == LANES_ASYNC)
    snprintf(out, n, "lanes-async 3 x 2 KB a warp");
  else
    snprintf(out, n, "lsu %4d x %d", p->threads, p->way == LSU4 ? 4 : p->way == LSU8 ? 8 : 16);
}

int main(int argc, char **argv) {
  const size_t bytes = (size_t)1 << 30;
  int dev = 0, major = 0, sms = 0;
  check(cudaGetDevice(&dev), "device");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "capability");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
  const int asked = argc > 1 ? atoi(argv[1]) : 16, blocks = asked > 0 ? asked : sms;
  uint8_t *src, *dst;
  float *sink;
  check(cudaMalloc(&src, bytes), "malloc");
  check(cudaMalloc(&dst, bytes), "malloc");
  check(cudaMemset(src, 1, bytes), "memset");
  check(cudaMalloc(&sink, sizeof *sink), "malloc");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  static const probe_t probes[] = {
      {BULK, 0, 4096, 48, 1},  {BULK, 0, 8192, 24, 1},  {BULK, 0, 14336, 13, 1}, {BULK, 0, 14336, 13, 2},
      {BULK, 0, 14336, 13, 4}, {BULK, 0, 14336, 13, 8}, {BULK, 0, 24576, 8, 1},  {BULK, 0, 32768, 6, 1},
      {LSU4, 1024},            {LSU8, 1024},            {LSU16, 1024},           {LSU8, 512},
      {LANES_ASYNC, 1024},     {WRITE_BULK, 0, 14336}, {WRITE_BULK, 0, 32768},  {WRITE_LSU, 1024}};
  printf("%d blocks, %zu MiB read or written by each line\n", blocks, bytes >> 20);
  for (size_t i = 0; i < sizeof probes / sizeof *probes; i++) {
    const probe_t *p = &probes[i];
    if ((p->way == BULK || p->way == WRITE_BULK) && (major < 9 || (size_t)p->S * p->N > RING_BYTES)) continue;
    float best = 1e30f;
    for (int run = 0; run < 4; run++) {
      check(cudaEventRecord(e0), "record");
      launch(p, src, dst, bytes, blocks, sink);
      check(cudaEventRecord(e1), "record");
      check(cudaEventSynchronize(e1), "sync");
      float ms;
      check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
      if (run > 0 && ms < best) best = ms; /* run 0 warms up */
    }
    char name[64];
    name_of(p, name, sizeof name);
    printf("%-32s %8.3f ms %7.1f GB/s %s per SM\n", name, best, (double)bytes / (best * 1e-3) / 1e9 / blocks,
           p->way == WRITE_BULK || p->way == WRITE_LSU ? "written" : "read");
  }
  return 0;
}
