/* The CUDA backend's world and comms: devices, peer access, the world's error words, streams,
 * and a comm's set-up and teardown (its peers reached through a transport: transport_*.c).
 *
 * Every operation is enqueued on the comm's stream and returns without waiting, except where
 * the caller asked for exact sizes (the handle's `exact`): then notify waits for the counts.
 * No device memory is allocated after the comm's arena is made (arena.c), so an operation
 * never synchronises the device nor waits on another stream while a peer's kernel waits on
 * this rank. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/backend.h"

epx_status_t cuda_fail(cudaError_t e, const char *what) {
  return epxi_fail(EPX_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Starts CUDA in this process: the environment ranks sharing a GPU need is set before, by the
 * creation of such a world (env.c), not here. */
epx_status_t epxi_cuda_available(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    return epxi_fail(EPX_ERR_UNSUPPORTED, "no CUDA device is available (%s)",
                     e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  return EPX_SUCCESS;
}

bool capturing(cudaStream_t st) {
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(st, &cs);
  return cs != cudaStreamCaptureStatusNone;
}

cudaStream_t stream_of(const epx_comm_t *c) {
  return c->stream ? (cudaStream_t)c->stream : CC(c)->own_stream;
}

cudaStream_t op_stream(const epx_comm_t *c) {
  cuda_comm_t *cc = CC(c);
  cudaStream_t st = stream_of(c);
  /* a stream being captured cannot wait on work outside the capture: there the caller orders */
  if (cc->last_stream && cc->last_stream != st && !capturing(st)) {
    cudaEventRecord(cc->order, cc->last_stream);
    cudaStreamWaitEvent(st, cc->order, 0);
  }
  cc->last_stream = st;
  return st;
}

/* ---- world ------------------------------------------------------------------------------ */

static void world_free(cuda_world_t *cw) {
  world_blocks_free(cw);
  pthread_mutex_destroy(&cw->kept_lock);
  free(cw);
}

/* Ranks of this process on different GPUs read each other's memory directly (a peer in
 * another process is reached through its IPC mapping, which enables what it needs). */
static epx_status_t connect_devices(const epx_world_t *w) {
  const int lo = w->first_rank, hi = w->first_rank + w->num_local;
  for (int a = lo; a < hi; a++)
    for (int b = lo; b < hi; b++) {
      const int da = w->devices[a], db = w->devices[b];
      int ok = 0;
      if (da == db) continue;
      CUDA_TRY(cudaDeviceCanAccessPeer(&ok, da, db), "cudaDeviceCanAccessPeer");
      if (!ok) return epxi_fail(EPX_ERR_UNSUPPORTED, "device %d cannot access device %d's memory (no P2P)", da, db);
      CUDA_TRY(cudaSetDevice(da), "cudaSetDevice");
      cudaError_t e = cudaDeviceEnablePeerAccess(db, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) return cuda_fail(e, "cudaDeviceEnablePeerAccess");
      cudaGetLastError();
    }
  CUDA_TRY(cudaSetDevice(w->devices[lo]), "cudaSetDevice");
  return EPX_SUCCESS;
}

epx_status_t cuda_world_create(epx_world_t *w) {
  int count = 0;
  CUDA_TRY(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (int r = 0; r < w->nranks; r++) {
    if (w->devices[r] < 0) w->devices[r] = r % count;
    if (w->devices[r] >= count)
      return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: device %d, but %d are visible", r, w->devices[r], count);
  }
  cuda_world_t *cw = calloc(1, sizeof *cw);
  if (!cw) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda world");
  pthread_mutex_init(&cw->kept_lock, NULL);
  epx_status_t ps = connect_devices(w);
  if (ps != EPX_SUCCESS) {
    world_free(cw);
    return ps;
  }
  const size_t need = sizeof(epxc_error_t) * w->nranks;
  cudaError_t e;
  if (cross_process(w)) {
    /* The peers' kernels and hosts must see this rank's failure: one page all processes map,
     * pinned and mapped into this process's device address space. */
    size_t bytes = 0;
    cw->errors_host = epxi_group_common(w->group, &bytes);
    if (!cw->errors_host || bytes < need) {
      const bool mapped = cw->errors_host != NULL;
      world_free(cw);
      if (!mapped) return EPX_ERR_SYSTEM; /* the group said why */
      return epxi_fail(EPX_ERR_INTERNAL, "the group's common page holds %zu bytes, the error words need %zu", bytes,
                       need);
    }
    e = cudaHostRegister(cw->errors_host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      world_free(cw);
      return cuda_fail(e, "cudaHostRegister (the group's error words)");
    }
    cw->shared = true;
  } else {
    e = cudaHostAlloc((void **)&cw->errors_host, need, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      world_free(cw);
      return cuda_fail(e, "cudaHostAlloc (error words)");
    }
    memset(cw->errors_host, 0, need);
  }
  e = cudaHostGetDevicePointer((void **)&cw->errors_dev, cw->errors_host, 0);
  if (e != cudaSuccess) {
    if (cw->shared)
      cudaHostUnregister(cw->errors_host);
    else
      cudaFreeHost(cw->errors_host);
    world_free(cw);
    return cuda_fail(e, "cudaHostGetDevicePointer");
  }
  w->impl = cw;
  return EPX_SUCCESS;
}

void cuda_world_destroy(epx_world_t *w) {
  cuda_world_t *cw = w->impl;
  if (!cw) return;
  if (cw->shared)
    cudaHostUnregister(cw->errors_host); /* the page itself goes with the group */
  else
    cudaFreeHost(cw->errors_host);
  world_free(cw);
}

/* ---- comm ------------------------------------------------------------------------------- */

static void comm_free(cuda_comm_t *cc) {
  if (cc->order) cudaEventDestroy(cc->order);
  if (cc->own_stream) cudaStreamDestroy(cc->own_stream);
  free(cc);
}

epx_status_t cuda_comm_init(epx_comm_t *c) {
  epx_world_t *w = c->world;
  cuda_world_t *cw = w->impl;
  const int dev = w->devices[c->rank];
  struct cudaDeviceProp prop;
  CUDA_TRY(cudaSetDevice(dev), "cudaSetDevice");
  CUDA_TRY(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  /* The ranks' exchanges wait on each other: every rank's kernels must fit on the GPU at once.
   * Ranks in other processes run in contexts of their own, which the driver time-slices. */
  int sharing = 0;
  for (int r = w->first_rank; r < w->first_rank + w->num_local; r++) sharing += w->devices[r] == dev;
  if (sharing * c->cfg.num_sms > prop.multiProcessorCount)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "num_sms %d x %d ranks on device %d needs %d SMs, the GPU has %d: the ranks could not run "
                     "at once",
                     c->cfg.num_sms, sharing, dev, sharing * c->cfg.num_sms, prop.multiProcessorCount);
  /* Every kernel loaded before any rank can launch one (the allgather below is a barrier). */
  size_t stack = 0, limit = 0;
  cudaError_t pe = (cudaError_t)epxc_preload_exchange(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_layout(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_ht(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_a2a(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_ll(&stack);
  if (pe == cudaSuccess) pe = (cudaError_t)epxc_preload_stage(&stack);
  if (pe != cudaSuccess) return cuda_fail(pe, "loading the kernels");
  /* A launch needing more stack than the limit first grows it, which waits for the device to
   * go idle: a deadlock (until the timeout) while a peer's kernel spins on this rank. Grow it
   * now, before any kernel of this group runs. */
  CUDA_TRY(cudaDeviceGetLimit(&limit, cudaLimitStackSize), "cudaDeviceGetLimit");
  if (stack > limit) CUDA_TRY(cudaDeviceSetLimit(cudaLimitStackSize, stack), "cudaDeviceSetLimit (stack)");
  cuda_comm_t *cc = calloc(1, sizeof *cc);
  if (!cc) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda comm");
  cc->device = dev;
  /* one stream per rank: each stream made takes a hardware queue (see env.c) */
  cudaError_t e = cudaStreamCreateWithFlags(&cc->own_stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&cc->order, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    comm_free(cc);
    return cuda_fail(e, "comm stream");
  }
  cw->errors_host[c->rank] = (epxc_error_t){0};
  cc->group.rank = c->rank;
  cc->group.nranks = c->nranks;
  cc->group.errors = cw->errors_dev;
  cc->group.timeout_ns = (uint64_t)c->cfg.timeout_ms * 1000000ull;
  /* Everything peers reach lives in the comm's arena, made now, while no rank of the group
   * can be inside an operation (this is collective). It may grow later only where growing
   * cannot stall a peer: no other rank of this process on this GPU. */
  cc->transport = cross_process(w) ? &epxc_transport_ipc : &epxc_transport_inproc;
  epx_status_t s = cc->transport->open(c, cc, arena_size(c, sharing, prop.totalGlobalMem),
                                       !cross_process(w) && sharing == 1);
  if (s != EPX_SUCCESS) {
    comm_free(cc);
    return s;
  }
  cc->shape = (epxc_shape_t){.nranks = c->nranks, .rank = c->rank, .num_experts = c->cfg.num_experts,
                             .num_local = c->num_local_experts, .topk = c->cfg.topk, .hidden = c->cfg.hidden,
                             .align = 1, .max_tokens = c->cfg.max_tokens_per_rank, .num_sms = c->cfg.num_sms,
                             .bulk_copies = prop.major >= 9 && epxi_env()->ht_pipelined &&
                                            prop.sharedMemPerBlockOptin >= epxc_bulk_smem_need(),
                             .ring_threads = epxc_ring_threads((int)prop.sharedMemPerBlockOptin)};
  c->impl = cc;
  return EPX_SUCCESS;
}

/* The transport frees the arena once this rank's work is done (see its close). */
void cuda_comm_destroy(epx_comm_t *c) {
  cuda_comm_t *cc = CC(c);
  if (!cc) return;
  cudaSetDevice(cc->device);
  cudaStream_t st = stream_of(c);
  wait_stream(c, st);
  if (cc->last_stream && cc->last_stream != st) wait_stream(c, cc->last_stream);
  cc->transport->close(c, cc);
  comm_free(cc);
}
