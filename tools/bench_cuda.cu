/* epx-bench on the CUDA backend: device memory, events, the stand-in experts as kernels with
 * the host's arithmetic, and the two copy references: the device's copy bandwidth (the floor)
 * and the best copy kernel's bytes per SM-second. */
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include "cuda/tma.cuh"
extern "C" {
#include "bench_dev.h"
#include "dense_ref.h"
}

static void check(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "epx-bench: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

static __global__ void tokens_kernel(bench_standin_t a);
static __global__ void experts_kernel(bench_standin_t a);

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  check(cudaMalloc(&p, bytes ? bytes : 16), "cudaMalloc");
  check(cudaMemset(p, 0, bytes ? bytes : 16), "cudaMemset");
  return p;
}
static void dev_release(void *p) { cudaFree(p); }
static void dev_upload(void *d, const void *s, size_t n) { check(cudaMemcpy(d, s, n, cudaMemcpyHostToDevice), "upload"); }
static void dev_download(void *d, const void *s, size_t n) { check(cudaMemcpy(d, s, n, cudaMemcpyDeviceToHost), "download"); }
static void *dev_stream_create(void) {
  /* load the stand-in kernels before any rank's exchange can wait (lazy loading, see epx) */
  struct cudaFuncAttributes fa;
  cudaFuncGetAttributes(&fa, (const void *)tokens_kernel);
  cudaFuncGetAttributes(&fa, (const void *)experts_kernel);
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  return s;
}
static void dev_stream_destroy(void *s) { cudaStreamDestroy((cudaStream_t)s); }
static void *dev_event_create(void) {
  cudaEvent_t e;
  check(cudaEventCreate(&e), "event");
  return e;
}
static void dev_event_destroy(void *e) { cudaEventDestroy((cudaEvent_t)e); }
/* Inside a capture the event becomes a node of the graph that records it at each replay (a
 * plain record would only order the capture's streams). */
static void dev_event_record(void *e, void *s) {
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing((cudaStream_t)s, &cs), "capture status");
  check(cudaEventRecordWithFlags((cudaEvent_t)e, (cudaStream_t)s,
                                 cs == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : cudaEventRecordDefault),
        "event record");
}
static int dev_bind_rank(int rank, int nranks) {
  int n = 0;
  check(cudaGetDeviceCount(&n), "device count");
  check(cudaSetDevice(rank % n), "set device");
  return n < nranks ? n : nranks;
}
static double dev_elapsed_ms(void *a, void *b) {
  float ms = 0;
  check(cudaEventSynchronize((cudaEvent_t)b), "event sync");
  check(cudaEventElapsedTime(&ms, (cudaEvent_t)a, (cudaEvent_t)b), "elapsed");
  return ms;
}

static __device__ float scale_of(int e) { return 0.5f + 0.0625f * (float)(e % 23); } /* dense_expert_scale */

static __device__ float recv_value(const bench_standin_t &a, int64_t row, int c) {
  if (a.recv_dtype == EPX_FLOAT32) return ((const float *)a.recv_x)[row * a.hidden + c];
  if (a.recv_dtype == EPX_BFLOAT16)
    return __uint_as_float((uint32_t)((const uint16_t *)a.recv_x)[row * a.hidden + c] << 16);
  const int blocks = (a.hidden + 127) / 128;
  __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)a.recv_x)[row * a.hidden + c], __NV_E4M3);
  return __fmul_rn(__half2float(*(__half *)&h), a.scales[row * blocks + c / 128]);
}

static __device__ float round_y(epx_dtype_t t, float v) {
  return t == EPX_BFLOAT16 ? __bfloat162float(__float2bfloat16_rn(v)) : v;
}

static __device__ void put(void *y, epx_dtype_t t, int64_t i, float v) {
  if (t == EPX_BFLOAT16) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    ((uint16_t *)y)[i] = *(uint16_t *)&b;
  } else {
    ((float *)y)[i] = v;
  }
}

static __global__ void tokens_kernel(bench_standin_t a) {
  const int64_t n_elems = a.rows * a.hidden;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_elems; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / a.hidden;
    const int c = (int)(i % a.hidden);
    const float xin = recv_value(a, n, c);
    float acc = 0.0f;
    for (int k = 0; k < a.topk; k++) {
      const int l = a.recv_idx[n * a.topk + k];
      if (l < 0) continue;
      acc = __fadd_rn(acc, __fmul_rn(a.recv_w[n * a.topk + k], round_y(a.y_dtype, __fmul_rn(scale_of(a.rank * a.num_local + l), xin))));
    }
    put(a.y, a.y_dtype, i, acc);
  }
}

/* Only the counted rows of each expert's block: the padding and the unused rows of the
 * low-latency blocks are left alone, so ranks sharing a GPU lend each other little time. */
static __global__ void experts_kernel(bench_standin_t a) {
  int64_t start = 0;
  for (int l = 0; l < a.num_local; l++) {
    const int64_t n_elems = (int64_t)a.counts[l] * a.hidden;
    const float f = scale_of(a.rank * a.num_local + l);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_elems; i += (int64_t)gridDim.x * blockDim.x) {
      const int64_t r = start + i / a.hidden;
      const int c = (int)(i % a.hidden);
      put(a.y, a.y_dtype, r * a.hidden + c, __fmul_rn(f, recv_value(a, r, c)));
    }
    start += a.ll_stride ? a.ll_stride : (a.counts[l] + a.align - 1) / a.align * a.align;
  }
}

static void dev_standin_tokens(const bench_standin_t *a, void *s) {
  if (a->rows) tokens_kernel<<<132, 512, 0, (cudaStream_t)s>>>(*a);
  check(cudaGetLastError(), "stand-in kernel");
}
static void dev_standin_experts(const bench_standin_t *a, void *s) {
  if (a->rows) experts_kernel<<<132, 512, 0, (cudaStream_t)s>>>(*a);
  check(cudaGetLastError(), "stand-in kernel");
}

/* The per-SM references, the two ways one SM reaches its limit (~97 GB/s read + written on
 * an H200): 1024 threads of 16-byte loads, four in flight per thread before any store; and
 * one thread per block driving bulk asynchronous copies through four 24 KB stages of shared
 * memory (bulk.cuh's instructions). */
#define REF_UNROLL 4
static __global__ void __launch_bounds__(1024) sm_copy_kernel(const int4 *__restrict__ src, int4 *__restrict__ dst,
                                                              size_t n) {
  const size_t step = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += REF_UNROLL * step) {
    int4 v[REF_UNROLL];
#pragma unroll
    for (int u = 0; u < REF_UNROLL; u++)
      if (i + u * step < n) v[u] = src[i + u * step];
#pragma unroll
    for (int u = 0; u < REF_UNROLL; u++)
      if (i + u * step < n) dst[i + u * step] = v[u];
  }
}

#define REF_STAGES 4
#define REF_STAGE_BYTES (24 * 1024)
static __global__ void sm_bulk_copy_kernel(const uint8_t *src, uint8_t *dst, size_t chunks) {
  extern __shared__ __align__(128) uint8_t bulk_smem[];
  uint64_t *full = (uint64_t *)(bulk_smem + REF_STAGES * REF_STAGE_BYTES);
  if (threadIdx.x != 0) return;
  mbar_init_stages(full, REF_STAGES);
  uint32_t loaded = 0, consumed = 0;
  size_t next = blockIdx.x, done = blockIdx.x;
  for (; next < chunks && loaded < REF_STAGES - 1; next += gridDim.x, loaded++) {
    mbar_expect(&full[loaded % REF_STAGES], REF_STAGE_BYTES);
    bulk_load(bulk_smem + (loaded % REF_STAGES) * REF_STAGE_BYTES, src + next * REF_STAGE_BYTES, REF_STAGE_BYTES,
              &full[loaded % REF_STAGES]);
  }
  for (; done < chunks; done += gridDim.x, consumed++) {
    const int s = consumed % REF_STAGES;
    mbar_wait(&full[s], (consumed / REF_STAGES) & 1);
    bulk_store(dst + done * REF_STAGE_BYTES, bulk_smem + s * REF_STAGE_BYTES, REF_STAGE_BYTES);
    bulk_commit();
    if (next < chunks) {
      bulk_wait_read_but_one();
      const int l = loaded % REF_STAGES;
      mbar_expect(&full[l], REF_STAGE_BYTES);
      bulk_load(bulk_smem + l * REF_STAGE_BYTES, src + next * REF_STAGE_BYTES, REF_STAGE_BYTES, &full[l]);
      next += gridDim.x;
      loaded++;
    }
  }
  bulk_wait_all();
}

/* Bytes read plus written per second by the best of a few copies of `bytes` (far past L2):
 * cudaMemcpy's own when blocks is 0, else the reference kernel's (bulk or not) on that many
 * blocks. */
static double copy_rate(size_t bytes, int blocks, bool bulk) {
  void *a = dev_alloc(bytes), *b = dev_alloc(bytes);
  const size_t smem = REF_STAGES * REF_STAGE_BYTES + REF_STAGES * sizeof(uint64_t);
  if (bulk)
    check(cudaFuncSetAttribute((const void *)sm_bulk_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
          "bulk copy attribute");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  float best = 1e30f;
  for (int i = -1; i < 5; i++) { /* the first is a warm-up */
    cudaEventRecord(e0);
    if (!blocks) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    else if (bulk) sm_bulk_copy_kernel<<<blocks, 32, smem>>>((const uint8_t *)a, (uint8_t *)b, bytes / REF_STAGE_BYTES);
    else sm_copy_kernel<<<blocks, 1024>>>((const int4 *)a, (int4 *)b, bytes / sizeof(int4));
    cudaEventRecord(e1);
    check(cudaEventSynchronize(e1), "copy");
    check(cudaGetLastError(), "copy kernel");
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 0 && ms < best) best = ms;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  const size_t moved = blocks && bulk ? bytes / REF_STAGE_BYTES * REF_STAGE_BYTES : bytes;
  return 2.0 * (double)moved / (best * 1e-3);
}

static double dev_copy_bandwidth(void) { return copy_rate((size_t)2 << 30, 0, false); }

/* Per SM, on `blocks` SMs (at most the device's): the better of the two references. */
static double dev_sm_copy_bandwidth(int blocks) {
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "device");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "compute capability");
  blocks = blocks > sms ? sms : blocks < 1 ? 1 : blocks;
  const double plain = copy_rate((size_t)1 << 30, blocks, false);
  const double bulk = major >= 9 ? copy_rate((size_t)1 << 30, blocks, true) : 0.0;
  return (plain > bulk ? plain : bulk) / blocks;
}

static void dev_describe(char *text, size_t bytes) {
  int n = 0, dev = 0;
  cudaDeviceProp p;
  check(cudaGetDeviceCount(&n), "device count");
  check(cudaGetDevice(&dev), "device");
  check(cudaGetDeviceProperties(&p, dev), "device properties");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  snprintf(text, bytes, "%s, %d SMs, %.0f GiB, %d GPU%s visible, CUDA driver %d.%d, runtime %d.%d", p.name,
           p.multiProcessorCount, (double)p.totalGlobalMem / (1 << 30), n, n == 1 ? "" : "s", driver / 1000,
           driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
}

static void dev_capture_begin(void *s) {
  check(cudaStreamBeginCapture((cudaStream_t)s, cudaStreamCaptureModeThreadLocal), "begin capture");
}
static void *dev_capture_end(void *s) {
  cudaGraph_t g;
  cudaGraphExec_t e;
  check(cudaStreamEndCapture((cudaStream_t)s, &g), "end capture");
  check(cudaGraphInstantiate(&e, g, 0), "instantiate graph");
  cudaGraphDestroy(g);
  return e;
}
static void dev_graph_launch(void *e, void *s) { check(cudaGraphLaunch((cudaGraphExec_t)e, (cudaStream_t)s), "graph launch"); }
static void dev_graph_destroy(void *e) { cudaGraphExecDestroy((cudaGraphExec_t)e); }

extern "C" const bench_dev_t bench_cuda_dev = {
    "cuda", dev_alloc, dev_release, dev_upload, dev_download, dev_stream_create, dev_stream_destroy, dev_bind_rank,
    dev_event_create, dev_event_destroy, dev_event_record, dev_elapsed_ms, dev_standin_tokens, dev_standin_experts,
    dev_copy_bandwidth, dev_capture_begin, dev_capture_end, dev_graph_launch, dev_graph_destroy,
    dev_sm_copy_bandwidth, dev_describe,
};
