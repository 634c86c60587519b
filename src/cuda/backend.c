/* The CUDA backend's host side: memory, streams, the peer table, and the order of launches
 * that makes each operation. Thin on purpose: all data movement is in the kernels.
 *
 * Every operation is enqueued on the comm's stream and returns without waiting, except where
 * the caller asked for exact sizes (the handle's `exact`): then notify waits for the counts.
 * Allocations after set-up are stream-ordered (cudaMallocAsync), so growing a buffer never
 * synchronises the device while a peer's kernel waits on this rank. */
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "cuda/cuda_shared.h"

typedef struct {
  epxc_error_t *errors_host; /* [R], host-mapped */
  epxc_error_t *errors_dev;
} cuda_world_t;

typedef struct {
  int device;
  cudaStream_t own_stream;
  cudaStream_t last_stream; /* where the previous operation went */
  cudaEvent_t order;        /* orders an operation after the previous one when the stream changes */
  epxc_state_t *state;
  epxc_group_t group;
  epxc_shape_t shape;
} cuda_comm_t;

/* What the host learns of a plan in exact mode. */
typedef struct {
  int32_t status, group_status;
  uint64_t bad_key;
  int64_t num_tokens, num_recv, num_rows, num_pairs, sent_copies;
} plan_summary_t;

typedef struct {
  epxc_plan_t *dev;        /* the device struct */
  epxc_plan_t host;        /* its pointers and strides, as uploaded */
  int64_t token_cap;       /* tokens the send-side buffers hold */
  void *partials;          /* combine's per-token partials */
  size_t partial_bytes;
  int64_t recv_capacity;   /* last dispatch's, sizes the partials in sync-free mode */
  int64_t num_tokens;      /* T of the last plan, as the host knows it */
  epxc_a2a_t a2a;          /* all-to-all baseline buffers */
  size_t a2a_send_bytes, a2a_stage_bytes;
  void *a2a_back;            /* all-to-all combine: rows pulled back */
  size_t a2a_back_bytes;
  /* low-latency: the device state, the host's copy of its pointers, and the routing that
   * epx_notify recorded for the next dispatch (planning happens inside that dispatch) */
  epxc_ll_t *ll_dev;
  epxc_ll_t ll;
  epxc_plan_t ll_plan[2];
  epx_routing_t ll_route;
  bool ll_route_pending, ll_dispatched;
  epxc_dispatch_t ll_send_dispatch; /* what a SEND half passed: its COMPLETE uses the same */
  epxc_combine_t ll_send_combine;
  plan_summary_t *summary;   /* exact mode's copy of the counts */
  int32_t *pairs_local_host; /* [L] */
  bool known;              /* summary holds this plan (exact mode) */
  bool captured;           /* a CUDA graph holds this handle's buffers: they may not move */
} cuda_handle_t;

static const char *const phase_names[EPXC_PH_COUNT] = {
    [EPXC_PH_NOTIFY] = "notify",       [EPXC_PH_NOTIFY_DONE] = "notify (closing)",
    [EPXC_PH_DISPATCH] = "dispatch",   [EPXC_PH_DISPATCH_DONE] = "dispatch (closing)",
    [EPXC_PH_COMBINE] = "combine",     [EPXC_PH_COMBINE_DONE] = "combine (closing)",
    [EPXC_PH_LL_DISPATCH] = "low-latency dispatch", [EPXC_PH_LL_COMBINE] = "low-latency combine",
    [EPXC_PH_LAYOUT] = "layout",
};

static bool fatal_status(int s) { return s == EPX_ERR_TIMEOUT || s == EPX_ERR_BROKEN || s == EPX_ERR_PEER_LOST; }

static epx_status_t cuda_fail(cudaError_t e, const char *what) {
  return epxi_fail(EPX_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CUDA_TRY(call, what)                       \
  do {                                             \
    cudaError_t e_ = (call);                       \
    if (e_ != cudaSuccess) return cuda_fail(e_, what); \
  } while (0)

#define LAUNCH_TRY(call, what) CUDA_TRY((cudaError_t)(call), what)

/* Kernels of the ranks sharing a GPU wait on each other, so no rank's stream may queue behind
 * another's in one hardware queue: ask for as many queues as CUDA has (the default is 8). This
 * only takes effect before CUDA starts in this process; a framework that starts CUDA first
 * should set the variable itself. */
epx_status_t epxi_cuda_available(void) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  /* Lazy module loading can make a first launch wait for the device to go idle: with ranks'
   * kernels waiting on each other that is a deadlock until the timeout. Same caveat. */
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    return epxi_fail(EPX_ERR_UNSUPPORTED, "no CUDA device is available (%s)",
                     e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  return EPX_SUCCESS;
}

static cuda_comm_t *CC(const epx_comm_t *c) { return (cuda_comm_t *)c->impl; }
static cuda_handle_t *ch_of(const epx_handle_t *h) { return (cuda_handle_t *)h->impl; }
static bool capturing(cudaStream_t st) {
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(st, &cs);
  return cs != cudaStreamCaptureStatusNone;
}

static cudaStream_t stream_of(const epx_comm_t *c) {
  return c->stream ? (cudaStream_t)c->stream : CC(c)->own_stream;
}

/* The stream of an operation, ordered after the previous operation of this comm even when
 * the caller moved the comm to another stream in between. */
static cudaStream_t op_stream(const epx_comm_t *c) {
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

static epx_status_t cuda_world_create(epx_world_t *w) {
  int count = 0;
  CUDA_TRY(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (int r = 0; r < w->nranks; r++) {
    if (w->devices[r] < 0) w->devices[r] = r % count;
    if (w->devices[r] >= count)
      return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: device %d, but %d are visible", r, w->devices[r], count);
  }
  /* Ranks on different GPUs read each other's memory directly. */
  for (int a = 0; a < w->nranks; a++)
    for (int b = 0; b < w->nranks; b++) {
      int da = w->devices[a], db = w->devices[b], ok = 0;
      if (da == db) continue;
      CUDA_TRY(cudaDeviceCanAccessPeer(&ok, da, db), "cudaDeviceCanAccessPeer");
      if (!ok) return epxi_fail(EPX_ERR_UNSUPPORTED, "device %d cannot access device %d's memory (no P2P)", da, db);
      CUDA_TRY(cudaSetDevice(da), "cudaSetDevice");
      cudaError_t e = cudaDeviceEnablePeerAccess(db, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) return cuda_fail(e, "cudaDeviceEnablePeerAccess");
      cudaGetLastError();
      /* plans live in stream-ordered memory: peers read it too */
      cudaMemPool_t pool;
      CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, db), "cudaDeviceGetDefaultMemPool");
      struct cudaMemAccessDesc access = {.location = {.type = cudaMemLocationTypeDevice, .id = da},
                                         .flags = cudaMemAccessFlagsProtReadWrite};
      CUDA_TRY(cudaMemPoolSetAccess(pool, &access, 1), "cudaMemPoolSetAccess");
    }
  cuda_world_t *cw = calloc(1, sizeof *cw);
  if (!cw) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda world");
  CUDA_TRY(cudaSetDevice(w->devices[0]), "cudaSetDevice");
  cudaError_t e = cudaHostAlloc((void **)&cw->errors_host, sizeof(epxc_error_t) * w->nranks,
                                cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    free(cw);
    return cuda_fail(e, "cudaHostAlloc (error words)");
  }
  memset(cw->errors_host, 0, sizeof(epxc_error_t) * w->nranks);
  e = cudaHostGetDevicePointer((void **)&cw->errors_dev, cw->errors_host, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(cw->errors_host);
    free(cw);
    return cuda_fail(e, "cudaHostGetDevicePointer");
  }
  w->impl = cw;
  return EPX_SUCCESS;
}

static void cuda_world_destroy(epx_world_t *w) {
  cuda_world_t *cw = w->impl;
  if (!cw) return;
  cudaFreeHost(cw->errors_host);
  free(cw);
}

/* ---- comm ------------------------------------------------------------------------------- */

static epx_status_t cuda_comm_init(epx_comm_t *c) {
  epx_world_t *w = c->world;
  cuda_world_t *cw = w->impl;
  const int dev = w->devices[c->rank];
  struct cudaDeviceProp prop;
  CUDA_TRY(cudaSetDevice(dev), "cudaSetDevice");
  CUDA_TRY(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  /* The ranks' exchanges wait on each other: every rank's kernels must fit on the GPU at once. */
  int sharing = 0;
  for (int r = 0; r < w->nranks; r++) sharing += w->devices[r] == dev;
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
  if (pe != cudaSuccess) return cuda_fail(pe, "loading the kernels");
  /* A launch needing more stack than the limit first grows it, which waits for the device to
   * go idle: a deadlock (until the timeout) while a peer's kernel spins on this rank. Grow it
   * now, before any kernel of this group runs. */
  CUDA_TRY(cudaDeviceGetLimit(&limit, cudaLimitStackSize), "cudaDeviceGetLimit");
  if (stack > limit) CUDA_TRY(cudaDeviceSetLimit(cudaLimitStackSize, stack), "cudaDeviceSetLimit (stack)");
  cuda_comm_t *cc = calloc(1, sizeof *cc);
  if (!cc) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda comm");
  cc->device = dev;
  /* Stream-ordered, like every allocation after set-up: another group on this GPU may have
   * kernels waiting that a device-wide sync would stall. */
  /* one stream per rank: each stream made takes a hardware queue (see epxi_cuda_available) */
  cudaError_t e = cudaStreamCreateWithFlags(&cc->own_stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&cc->order, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaMallocAsync((void **)&cc->state, sizeof(epxc_state_t), cc->own_stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(cc->state, 0, sizeof(epxc_state_t), cc->own_stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(cc->own_stream);
  if (e != cudaSuccess) {
    free(cc);
    return cuda_fail(e, "comm state");
  }
  cw->errors_host[c->rank] = (epxc_error_t){0};
  void *states[EPX_MAX_RANKS];
  epx_status_t s = epxi_group_allgather(w->group, c->rank, "comm_init:cuda", c->cfg.timeout_ms, &cc->state,
                                        sizeof(void *), states);
  if (s != EPX_SUCCESS) { /* a peer may have the state already: keep it (a few KB) */
    free(cc);
    return s;
  }
  cc->group.rank = c->rank;
  cc->group.nranks = c->nranks;
  for (int r = 0; r < c->nranks; r++) cc->group.state[r] = states[r];
  cc->group.errors = cw->errors_dev;
  cc->group.timeout_ns = (uint64_t)c->cfg.timeout_ms * 1000000ull;
  cc->shape = (epxc_shape_t){.nranks = c->nranks, .rank = c->rank, .num_experts = c->cfg.num_experts,
                             .num_local = c->num_local_experts, .topk = c->cfg.topk, .hidden = c->cfg.hidden,
                             .align = 1, .max_tokens = c->cfg.max_tokens_per_rank, .num_sms = c->cfg.num_sms};
  c->impl = cc;
  return EPX_SUCCESS;
}

/* After a healthy run every post to this rank was consumed by one of its own exchanges, so
 * its state can go. After a failure a late peer may still post to it: then it is kept (a few
 * KB), so no new comm gets that memory. */
static void cuda_comm_destroy(epx_comm_t *c) {
  cuda_comm_t *cc = CC(c);
  if (!cc) return;
  cudaSetDevice(cc->device);
  cudaStream_t st = stream_of(c);
  cudaStreamSynchronize(st);
  const int status = ((volatile epxc_error_t *)((cuda_world_t *)c->world->impl)->errors_host)[c->rank].status;
  if (!c->broken && !fatal_status(status)) {
    cudaFreeAsync(cc->state, st);
    cudaStreamSynchronize(st);
  }
  cudaEventDestroy(cc->order);
  cudaStreamDestroy(cc->own_stream);
  free(cc);
}

/* Turns this rank's error word into a status and message. Fatal ones only, unless `all`. */
static epx_status_t report(epx_comm_t *c, bool all) {
  cuda_world_t *cw = c->world->impl;
  volatile epxc_error_t *e = &cw->errors_host[c->rank];
  int status = e->status;
  if (!status) return EPX_SUCCESS;
  bool fatal = fatal_status(status);
  if (!fatal && !all) return EPX_SUCCESS;
  const int phase = e->phase, peer = e->peer;
  const long long detail = (long long)e->detail;
  const char *ph = phase >= 0 && phase < EPXC_PH_COUNT ? phase_names[phase] : "?";
  epx_status_t s;
  if (status == EPX_ERR_TIMEOUT)
    s = epxi_fail(EPX_ERR_TIMEOUT, "rank %d: %s timed out after %lld ms waiting for rank %d", c->rank, ph, detail, peer);
  else if (status == EPX_ERR_BROKEN)
    s = epxi_fail(EPX_ERR_BROKEN, "rank %d: %s stopped: rank %d failed first (%s)", c->rank, ph, peer,
                  epx_status_string((epx_status_t)detail));
  else if (status == EPX_ERR_OUTPUT_TOO_SMALL)
    s = epxi_fail(EPX_ERR_OUTPUT_TOO_SMALL, "rank %d: %s: %lld rows arrive but recv_capacity is smaller; nothing written",
                  c->rank, ph, detail);
  else
    s = epxi_fail((epx_status_t)status, "rank %d: %s: rank %d failed (%s)", c->rank, ph, peer,
                  epx_status_string((epx_status_t)status));
  if (!fatal) e->status = 0; /* reported; the comm stays usable */
  return s;
}

static epx_status_t cuda_poll(epx_comm_t *c) { return report(c, false); }

static epx_status_t cuda_synchronize(epx_comm_t *c) {
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  CUDA_TRY(cudaStreamSynchronize(stream_of(c)), "cudaStreamSynchronize");
  return report(c, true);
}

/* ---- handles ------------------------------------------------------------------------------ */

/* Device arrays of one plan, for `cap` tokens; the struct itself is uploaded by the caller. */
static epx_status_t plan_arrays(const epx_comm_t *c, epxc_plan_t *p, int64_t cap, cudaStream_t st) {
  const int64_t W = (cap + 31) / 32, K = c->cfg.topk, R = c->nranks, E = c->cfg.num_experts, L = c->num_local_experts;
  p->words = W;
  CUDA_TRY(cudaMallocAsync((void **)&p->idx, sizeof(int32_t) * cap * K + 16, st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->weight, sizeof(float) * cap * K + 16, st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->rank_bits, sizeof(uint32_t) * R * W + 16, st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->rank_pre, sizeof(int32_t) * R * W + 16, st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->exp_bits, sizeof(uint32_t) * E * W + 16, st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->exp_pre, sizeof(int32_t) * E * W + 16, st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->counts, sizeof(int32_t) * (R + E), st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->pair_base, sizeof(int64_t) * L * R, st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->block, sizeof(int64_t) * (L + 1), st), "plan buffers");
  CUDA_TRY(cudaMallocAsync((void **)&p->pairs_local, sizeof(int32_t) * L, st), "plan buffers");
  return EPX_SUCCESS;
}

static void plan_arrays_free(epxc_plan_t *p, cudaStream_t st) {
  void *bufs[] = {p->idx, p->weight, p->rank_bits, p->rank_pre, p->exp_bits, p->exp_pre, p->counts,
                  p->pair_base, p->block, p->pairs_local};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
    if (bufs[i]) cudaFreeAsync(bufs[i], st);
}

/* Low-latency handles have every buffer at its final size from the start: two plans for
 * max_tokens_per_rank tokens, staging and partials for any element type. */
static epx_status_t ll_create(const epx_comm_t *c, cuda_handle_t *ch, cudaStream_t st) {
  const int64_t T = c->cfg.max_tokens_per_rank > 0 ? c->cfg.max_tokens_per_rank : 1, H = c->cfg.hidden;
  const int64_t blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  for (int i = 0; i < 2; i++) {
    EPX_CHECK(plan_arrays(c, &ch->ll_plan[i], T, st));
    CUDA_TRY(cudaMallocAsync((void **)&ch->ll.plan[i], sizeof(epxc_plan_t), st), "low-latency buffers");
    CUDA_TRY(cudaMemcpyAsync(ch->ll.plan[i], &ch->ll_plan[i], sizeof(epxc_plan_t), cudaMemcpyHostToDevice, st),
             "low-latency buffers");
    CUDA_TRY(cudaMallocAsync(&ch->ll.stage[i], sizeof(float) * T * H, st), "low-latency buffers");
    CUDA_TRY(cudaMallocAsync((void **)&ch->ll.stage_scales[i], sizeof(float) * T * blocks, st), "low-latency buffers");
    CUDA_TRY(cudaMallocAsync(&ch->ll.partials[i], sizeof(float) * c->nranks * T * H, st), "low-latency buffers");
  }
  CUDA_TRY(cudaMallocAsync((void **)&ch->ll_dev, sizeof(epxc_ll_t), st), "low-latency buffers");
  CUDA_TRY(cudaMemcpyAsync(ch->ll_dev, &ch->ll, sizeof(epxc_ll_t), cudaMemcpyHostToDevice, st), "low-latency buffers");
  CUDA_TRY(cudaStreamSynchronize(st), "low-latency buffers"); /* the uploads read ch's memory */
  return EPX_SUCCESS;
}

/* Handles are made while peers may already wait on this rank in an exchange: nothing here may
 * synchronise the device, so every allocation is stream-ordered on the comm's stream. */
static epx_status_t cuda_handle_create(epx_handle_t *h) {
  cuda_handle_t *ch = calloc(1, sizeof *ch);
  const epx_comm_t *c = h->comm;
  const int L = c->num_local_experts, R = c->nranks;
  if (ch) ch->summary = calloc(1, sizeof *ch->summary);
  if (ch) ch->pairs_local_host = calloc(L, sizeof(int32_t));
  h->impl = ch;
  if (!ch || !ch->summary || !ch->pairs_local_host) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cuda handle");
  cudaStream_t st = stream_of(c);
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  CUDA_TRY(cudaMallocAsync((void **)&ch->dev, sizeof(epxc_plan_t), st), "handle buffers");
  CUDA_TRY(cudaMallocAsync((void **)&ch->host.pair_base, sizeof(int64_t) * L * R, st), "handle buffers");
  CUDA_TRY(cudaMallocAsync((void **)&ch->host.block, sizeof(int64_t) * (L + 1), st), "handle buffers");
  CUDA_TRY(cudaMallocAsync((void **)&ch->host.pairs_local, sizeof(int32_t) * L, st), "handle buffers");
  CUDA_TRY(cudaMallocAsync((void **)&ch->host.counts, sizeof(int32_t) * (R + c->cfg.num_experts), st), "handle buffers");
  CUDA_TRY(cudaMallocAsync((void **)&ch->host.pair_send_base, sizeof(int64_t) * (c->cfg.num_experts + 1), st),
           "handle buffers");
  CUDA_TRY(cudaMemsetAsync(ch->dev, 0, sizeof(epxc_plan_t), st), "handle buffers");
  if (h->hc.algo == EPX_ALGO_LL) EPX_CHECK(ll_create(c, ch, st));
  return EPX_SUCCESS;
}

static void cuda_handle_destroy(epx_handle_t *h) {
  cuda_handle_t *ch = h->impl;
  if (!ch) return;
  cudaStream_t st = stream_of(h->comm);
  cudaSetDevice(CC(h->comm)->device);
  void *bufs[] = {ch->dev, ch->host.pair_base, ch->host.block, ch->host.pairs_local, ch->host.counts, ch->host.idx,
                  ch->host.weight, ch->host.rank_bits, ch->host.rank_pre, ch->host.exp_bits, ch->host.exp_pre,
                  ch->host.pair_send_base, ch->partials, ch->a2a.send_x, ch->a2a.stage_x, ch->a2a_back};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
    if (bufs[i]) cudaFreeAsync(bufs[i], st);
  for (int i = 0; i < 2; i++) {
    plan_arrays_free(&ch->ll_plan[i], st);
    void *ll_bufs[] = {ch->ll.plan[i], ch->ll.stage[i], ch->ll.stage_scales[i], ch->ll.partials[i]};
    for (size_t j = 0; j < 4; j++)
      if (ll_bufs[j]) cudaFreeAsync(ll_bufs[j], st);
  }
  if (ch->ll_dev) cudaFreeAsync(ch->ll_dev, st);
  free(ch->summary);
  free(ch->pairs_local_host);
  free(ch);
}


/* (Re)allocates a stream-ordered buffer to hold `bytes`. Refused while the stream is being
 * captured, and for a handle a captured graph uses (grow_frozen, set by the caller): the
 * graph holds the old addresses. */
static _Thread_local bool grow_frozen;
static epx_status_t grow(cudaStream_t st, void **p, size_t bytes, const char *what) {
  if (capturing(st) || grow_frozen)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "%s must grow to %zu bytes inside a CUDA graph capture; run the largest shape once before "
                     "capturing",
                     what, bytes);
  if (*p) CUDA_TRY(cudaFreeAsync(*p, st), "cudaFreeAsync");
  *p = NULL;
  CUDA_TRY(cudaMallocAsync(p, bytes ? bytes : 16, st), what);
  return EPX_SUCCESS;
}

/* Grows a buffer kept with its size in bytes. */
static epx_status_t ensure_bytes(cudaStream_t st, void **p, size_t *have, size_t need, const char *what) {
  if (*p && need <= *have) return EPX_SUCCESS;
  EPX_CHECK(grow(st, p, need, what));
  *have = need;
  return EPX_SUCCESS;
}

/* One allocation carved into consecutive 256-byte aligned pieces. */
static size_t carve(char **base, size_t bytes) {
  size_t at = (size_t)(uintptr_t)*base;
  *base += (bytes + 255) / 256 * 256;
  return at;
}

/* The all-to-all baseline's send and staging buffers, sized for this dispatch. */
static epx_status_t ensure_a2a(epx_comm_t *c, cuda_handle_t *ch, const epx_dispatch_args_t *a, bool expert,
                               cudaStream_t st) {
  const int64_t H = c->cfg.hidden, blocks = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
  const size_t row = (size_t)H * epx_dtype_size(a->recv_dtype);
  /* a row per (token, expert) at most, in either layout */
  const int64_t send_rows = (ch->num_tokens > 0 ? ch->num_tokens : 1) * c->cfg.topk;
  char *at = NULL;
  carve(&at, row * send_rows), carve(&at, sizeof(float) * blocks * send_rows), carve(&at, sizeof(int32_t) * send_rows);
  carve(&at, sizeof(float) * send_rows);
  EPX_CHECK(ensure_bytes(st, &ch->a2a.send_x, &ch->a2a_send_bytes, (size_t)(uintptr_t)at, "all-to-all send buffer"));
  char *base = ch->a2a.send_x;
  carve(&base, row * send_rows);
  ch->a2a.send_scales = (float *)carve(&base, sizeof(float) * blocks * send_rows);
  ch->a2a.send_token = (int32_t *)carve(&base, sizeof(int32_t) * send_rows);
  ch->a2a.send_weight = (float *)carve(&base, sizeof(float) * send_rows);
  if (!expert) return EPX_SUCCESS;
  const int64_t stage_rows = a->recv_capacity > 0 ? a->recv_capacity : 1;
  at = NULL;
  carve(&at, row * stage_rows), carve(&at, sizeof(float) * blocks * stage_rows), carve(&at, sizeof(float) * stage_rows);
  EPX_CHECK(ensure_bytes(st, &ch->a2a.stage_x, &ch->a2a_stage_bytes, (size_t)(uintptr_t)at, "all-to-all staging buffer"));
  base = ch->a2a.stage_x;
  carve(&base, row * stage_rows);
  ch->a2a.stage_scales = (float *)carve(&base, sizeof(float) * blocks * stage_rows);
  ch->a2a.stage_weight = (float *)carve(&base, sizeof(float) * stage_rows);
  return EPX_SUCCESS;
}

/* Send-side buffers sized for `cap` tokens. */
static epx_status_t ensure_tokens(epx_comm_t *c, cuda_handle_t *ch, int64_t cap, cudaStream_t st) {
  if (cap <= ch->token_cap && ch->host.idx) return EPX_SUCCESS;
  cap = cap < 32 ? 32 : cap;
  const int64_t W = (cap + 31) / 32, K = c->cfg.topk, R = c->nranks, E = c->cfg.num_experts;
  epxc_plan_t *p = &ch->host;
  ch->token_cap = 0; /* until every buffer below has grown: a failure grows them all next time */
  EPX_CHECK(grow(st, (void **)&p->idx, sizeof(int32_t) * cap * K, "routing buffer"));
  EPX_CHECK(grow(st, (void **)&p->weight, sizeof(float) * cap * K, "weight buffer"));
  EPX_CHECK(grow(st, (void **)&p->rank_bits, sizeof(uint32_t) * R * W, "rank bitmap"));
  EPX_CHECK(grow(st, (void **)&p->rank_pre, sizeof(int32_t) * R * W, "rank prefix"));
  EPX_CHECK(grow(st, (void **)&p->exp_bits, sizeof(uint32_t) * E * W, "expert bitmap"));
  EPX_CHECK(grow(st, (void **)&p->exp_pre, sizeof(int32_t) * E * W, "expert prefix"));
  p->words = W;
  ch->token_cap = cap;
  CUDA_TRY(cudaMemcpyAsync(ch->dev, p, sizeof *p, cudaMemcpyHostToDevice, st), "plan upload");
  /* the upload reads `p` when the stream gets there: keep it still until then */
  CUDA_TRY(cudaStreamSynchronize(st), "plan upload");
  return EPX_SUCCESS;
}

static epxc_shape_t shape_of(const epx_comm_t *c, const epx_handle_t *h) {
  epxc_shape_t s = CC(c)->shape;
  s.align = h->hc.align;
  s.ll = h->hc.algo == EPX_ALGO_LL;
  s.expert_layout = h->hc.layout == EPX_LAYOUT_EXPERT;
  return s;
}

static epx_status_t cuda_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status);

static epx_status_t cuda_get_layout(epx_comm_t *c, const epx_routing_t *r, int32_t *tokens_per_rank,
                                    int32_t *tokens_per_expert, uint8_t *is_token_in_rank) {
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  LAUNCH_TRY(epxc_layout(&CC(c)->shape, &CC(c)->group, r->num_tokens, r->topk_idx, r->idx_dtype, r->topk_idx ? NULL : r->routing_map,
                         tokens_per_rank, tokens_per_expert, is_token_in_rank, op_stream(c)),
             "layout kernel");
  return EPX_SUCCESS;
}

static epx_status_t cuda_notify(epx_comm_t *c, epx_handle_t *h, const epx_routing_t *r) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  cudaStream_t st = op_stream(c);
  const bool ll = h->hc.algo == EPX_ALGO_LL;
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  if (h->hc.exact && !ll && capturing(st))
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: an exact notify waits for the counts, which a CUDA graph "
                     "capture cannot: create the handle with exact = 0", c->rank);
  ch->known = false;
  ch->num_tokens = r->num_tokens;
  ch->captured |= capturing(st);
  grow_frozen = ch->captured;
  if (ll) { /* planned inside the dispatch that follows, in the same launch */
    ch->ll_route = *r;
    ch->ll_route_pending = true;
    return EPX_SUCCESS;
  }
  epx_status_t grown = ensure_tokens(c, ch, r->num_tokens, st);
  if (grown != EPX_SUCCESS) return cuda_abort(c, h, h->dispatch_follows ? EPXI_OP_NOTIFY_DISPATCH : EPXI_OP_NOTIFY, grown);
  epxc_shape_t s = shape_of(c, h);
  LAUNCH_TRY(epxc_notify_build(&s, ch->dev, &ch->host, r->num_tokens, r->topk_idx,
                               r->idx_dtype, r->topk_idx ? r->topk_weights : NULL,
                               r->topk_idx ? NULL : r->routing_map, r->topk_idx ? NULL : r->probs, st),
             "notify kernels");
  uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)ch->dev, (uint64_t)r->num_tokens};
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_NOTIFY, words, &ch->dev->status, st), "notify exchange");
  LAUNCH_TRY(epxc_notify_finish(&s, &cc->group, ch->dev, st), "notify finish");
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_NOTIFY_DONE, NULL, NULL, st), "notify closing exchange");
  if (!h->hc.exact) return EPX_SUCCESS;

  /* Exact sizes: wait for the counts. */
  plan_summary_t *sum = ch->summary;
  CUDA_TRY(cudaMemcpyAsync(&sum->status, &ch->dev->status, sizeof(int32_t) * 2, cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(&sum->bad_key, &ch->dev->bad_key, sizeof(uint64_t), cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(&sum->num_recv, &ch->dev->num_recv, sizeof(int64_t) * 4, cudaMemcpyDeviceToHost, st), "counts");
  CUDA_TRY(cudaMemcpyAsync(ch->pairs_local_host, ch->host.pairs_local, sizeof(int32_t) * c->num_local_experts,
                           cudaMemcpyDeviceToHost, st),
           "counts");
  CUDA_TRY(cudaStreamSynchronize(st), "cudaStreamSynchronize (notify)");
  sum->num_tokens = r->num_tokens;
  /* Every rank decides from the statuses the exchange agreed on; a recoverable record left
   * from an earlier call must not make this one fail on one rank only. */
  EPX_CHECK(report(c, false));
  if (sum->group_status) {
    volatile epxc_error_t *e = &((cuda_world_t *)c->world->impl)->errors_host[c->rank];
    const int who = e->peer;
    if (!fatal_status(e->status)) e->status = 0;
    if (sum->status) { /* this rank's own routing: name the token */
      const uint64_t key = sum->bad_key;
      return epxi_fail((epx_status_t)sum->status, "rank %d: token %llu slot %u: %s", c->rank,
                       (unsigned long long)(key >> 16), (unsigned)((key >> 8) & 0xff),
                       epx_status_string((epx_status_t)sum->status));
    }
    return epxi_fail((epx_status_t)sum->group_status, "rank %d: notify: rank %d's routing was refused (%s)", c->rank,
                     who, epx_status_string((epx_status_t)sum->group_status));
  }
  ch->known = true;
  return EPX_SUCCESS;
}

static epx_status_t cuda_handle_info(const epx_handle_t *h, epx_handle_info_t *info, int32_t *per_expert) {
  const cuda_handle_t *ch = h->impl;
  if (!ch->known)
    return epxi_fail(EPX_ERR_UNSUPPORTED,
                     "the handle's sizes live on the device (sync-free or low-latency mode): read them from the "
                     "dispatch's outputs, or create the handle with exact = 1");
  info->num_send_tokens = ch->summary->num_tokens;
  info->num_recv_tokens = ch->summary->num_recv;
  info->num_recv_rows = ch->summary->num_rows;
  info->num_recv_pairs = ch->summary->num_pairs;
  info->num_sent_copies = ch->summary->sent_copies;
  if (per_expert) memcpy(per_expert, ch->pairs_local_host, sizeof(int32_t) * h->comm->num_local_experts);
  return EPX_SUCCESS;
}

/* ---- dispatch and combine ------------------------------------------------------------------ */

static epx_status_t cuda_dispatch(epx_comm_t *c, epx_handle_t *h, const epx_dispatch_args_t *a) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  cudaStream_t st = op_stream(c);
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  epxc_shape_t s = shape_of(c, h);
  epxc_dispatch_t d = {.x = a->x, .x_dtype = a->x_dtype, .recv_dtype = a->recv_dtype, .recv_x = a->recv_x,
                       .recv_scales = a->recv_scales, .recv_capacity = a->recv_capacity,
                       .recv_topk_idx = a->recv_topk_idx, .recv_topk_weights = a->recv_topk_weights,
                       .recv_probs = a->recv_probs, .tokens_per_local_expert = a->tokens_per_local_expert,
                       .num_recv_rows = a->num_recv_rows, .scale_by_probs = a->scale_by_probs};
  d.report_capacity = !ch->known;
  d.part = a->part;
  if (a->part == EPX_PART_COMPLETE) { /* SEND did it all, or (low-latency) left the rest */
    if (!s.ll) return EPX_SUCCESS;
    d = ch->ll_send_dispatch;
    d.part = EPX_PART_COMPLETE;
    epxc_route_t none = {.num_tokens = ch->num_tokens, .replay = 1};
    LAUNCH_TRY(epxc_ll_dispatch(&s, &cc->group, ch->ll_dev, &none, &d, st), "low-latency dispatch");
    return EPX_SUCCESS;
  }
  ch->captured |= capturing(st);
  grow_frozen = ch->captured;
  if (!a->x && ch->num_tokens > 0)
    return cuda_abort(c, h, EPXI_OP_DISPATCH,
                      epxi_fail(EPX_ERR_NULL_POINTER, "dispatch on rank %d: x is NULL with %lld tokens", c->rank,
                                (long long)ch->num_tokens));
  ch->recv_capacity = s.ll ? (int64_t)c->nranks * c->cfg.max_tokens_per_rank : a->recv_capacity;
  if (s.ll) {
    /* the recorded routing, or (a replay) the last plan's own copy of it */
    const epx_routing_t *rt = &ch->ll_route;
    epxc_route_t route = {.num_tokens = ch->num_tokens, .replay = !ch->ll_route_pending};
    if (ch->ll_route_pending) {
      route.topk_idx = rt->topk_idx;
      route.idx_dtype = rt->idx_dtype;
      route.topk_weights = rt->topk_idx ? rt->topk_weights : NULL;
      route.routing_map = rt->topk_idx ? NULL : rt->routing_map;
      route.probs = rt->topk_idx ? NULL : rt->probs;
    }
    ch->ll_route_pending = false;
    ch->ll_dispatched = true;
    ch->ll_send_dispatch = d;
    LAUNCH_TRY(epxc_ll_dispatch(&s, &cc->group, ch->ll_dev, &route, &d, st), "low-latency dispatch");
    return EPX_SUCCESS;
  }
  if (h->hc.algo == EPX_ALGO_ALLTOALL) {
    /* permute here, then every destination pulls whole chunks (and sorts them) */
    epx_status_t grown = ensure_a2a(c, ch, a, s.expert_layout, st);
    if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_DISPATCH, grown);
    const epxc_a2a_t *b = &ch->a2a;
    uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)b->send_x, (uint64_t)(uintptr_t)b->send_scales,
                                       (uint64_t)(uintptr_t)b->send_token, (uint64_t)(uintptr_t)b->send_weight};
    LAUNCH_TRY(epxc_a2a_permute(&s, &cc->group, ch->dev, b, &d, st), "all-to-all permute");
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, words, NULL, st), "dispatch exchange");
    LAUNCH_TRY(epxc_a2a_gather(&s, &cc->group, ch->dev, b, &d, st), "all-to-all gather");
  } else {
    uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)a->x};
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, words, NULL, st), "dispatch exchange");
    LAUNCH_TRY(epxc_dispatch(&s, &cc->group, ch->dev, &d, st), "dispatch kernel");
  }
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH_DONE, NULL, NULL, st), "dispatch closing exchange");
  if (ch->known && !s.ll && a->recv_capacity < ch->summary->num_rows)
    return epxi_fail(EPX_ERR_OUTPUT_TOO_SMALL, "dispatch on rank %d: %lld rows arrive but recv_capacity is %lld",
                     c->rank, (long long)ch->summary->num_rows, (long long)a->recv_capacity);
  return EPX_SUCCESS;
}

static epx_status_t cuda_combine(epx_comm_t *c, epx_handle_t *h, const epx_combine_args_t *a) {
  cuda_comm_t *cc = CC(c);
  cuda_handle_t *ch = h->impl;
  cudaStream_t st = op_stream(c);
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  epxc_shape_t s = shape_of(c, h);
  epxc_combine_t k = {.y = a->y, .y_dtype = a->y_dtype, .out = a->out, .out_dtype = a->out_dtype,
                      .weighted = a->weighted, .row_probs = a->row_probs, .row_weight_grad = a->row_weight_grad,
                      .topk_weight_grad = a->topk_weight_grad};
  k.part = a->part;
  if (a->part == EPX_PART_COMPLETE) { /* SEND did it all, or (low-latency) left the rest */
    if (!s.ll) return EPX_SUCCESS;
    k = ch->ll_send_combine;
    k.part = EPX_PART_COMPLETE;
    LAUNCH_TRY(epxc_ll_combine(&s, &cc->group, ch->ll_dev, &k, st), "low-latency combine");
    return EPX_SUCCESS;
  }
  ch->captured |= capturing(st);
  grow_frozen = ch->captured;
  if ((!a->out && ch->num_tokens > 0) || !a->y)
    return cuda_abort(c, h, EPXI_OP_COMBINE,
                      epxi_fail(EPX_ERR_NULL_POINTER, "combine on rank %d: %s is NULL", c->rank, a->y ? "out" : "y"));
  if (s.ll) {
    if (!ch->ll_dispatched)
      return cuda_abort(c, h, EPXI_OP_COMBINE,
                        epxi_fail(EPX_ERR_INVALID_ARGUMENT, "low-latency combine on rank %d: no dispatch on this "
                                  "handle to invert", c->rank));
    ch->ll_send_combine = k;
    LAUNCH_TRY(epxc_ll_combine(&s, &cc->group, ch->ll_dev, &k, st), "low-latency combine");
    return EPX_SUCCESS;
  }
  /* Buffers first: a failure after the first exchange would leave the peers waiting. */
  if (h->hc.algo == EPX_ALGO_ALLTOALL) {
    const size_t back = (size_t)(ch->num_tokens > 0 ? ch->num_tokens : 1) * c->cfg.topk * c->cfg.hidden *
                        epx_dtype_size(a->y_dtype);
    epx_status_t grown = ensure_bytes(st, &ch->a2a_back, &ch->a2a_back_bytes, back, "all-to-all combine buffer");
    if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
    k.staged = ch->a2a_back;
  }
  const void *rows = a->y;
  if (s.expert_layout) {
    /* One partial per arrived token: at most the rows dispatch could write. */
    int64_t need = ch->known ? ch->summary->num_recv : ch->recv_capacity;
    size_t bytes = (size_t)need * c->cfg.hidden * epx_dtype_size(a->y_dtype);
    if (!ch->partials || bytes > ch->partial_bytes) {
      epx_status_t grown = grow(st, &ch->partials, bytes, "combine partials");
      if (grown != EPX_SUCCESS) return cuda_abort(c, h, EPXI_OP_COMBINE, grown);
      ch->partial_bytes = bytes;
    }
    k.partials = ch->partials;
    k.partial_rows = (int64_t)(ch->partial_bytes / ((size_t)c->cfg.hidden * epx_dtype_size(a->y_dtype)));
    rows = ch->partials;
    LAUNCH_TRY(epxc_combine_partials(&s, &cc->group, ch->dev, &k, st), "combine partials");
  }
  uint64_t words[EPXC_SLOT_WORDS] = {0, (uint64_t)(uintptr_t)rows, (uint64_t)(uintptr_t)a->row_weight_grad};
  /* a rank whose dispatch wrote nothing makes every rank skip this combine */
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_COMBINE, words, &ch->dev->refused, st), "combine exchange");
  if (h->hc.algo == EPX_ALGO_ALLTOALL) /* the rows for this rank's tokens come back whole */
    LAUNCH_TRY(epxc_a2a_pull_back(&s, &cc->group, ch->dev, &k, st), "all-to-all pull back");
  LAUNCH_TRY(epxc_combine_reduce(&s, &cc->group, ch->dev, &k, st), "combine kernel");
  LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_COMBINE_DONE, NULL, NULL, st), "combine closing exchange");
  return EPX_SUCCESS;
}

/* The caller returns this rank's failure with its own message: drop the device's record of
 * the same thing (the exchange recorded it as "rank r failed"), and nothing else. */
static void forget_own_report(epx_comm_t *c, epx_status_t status, cudaStream_t st) {
  if (capturing(st)) return; /* the record then stays, for epx_comm_synchronize to report */
  cudaStreamSynchronize(st);
  volatile epxc_error_t *e = &((cuda_world_t *)c->world->impl)->errors_host[c->rank];
  if (e->status == (int32_t)status && e->peer == c->rank) e->status = 0;
}

/* The peers' operations are exchange-framed: post this rank's status in the opening exchange
 * (the peers then skip their work) and join the closing one. A sync-free notify + dispatch
 * is two operations to the peers; an exact notify already stops them after the first. */
static epx_status_t cuda_abort(epx_comm_t *c, epx_handle_t *h, epxi_op_t op, epx_status_t status) {
  cuda_comm_t *cc = CC(c);
  cudaStream_t st = op_stream(c);
  CUDA_TRY(cudaSetDevice(cc->device), "cudaSetDevice");
  static const int phases[][2] = {[EPXI_OP_NOTIFY] = {EPXC_PH_NOTIFY, EPXC_PH_NOTIFY_DONE},
                                  [EPXI_OP_DISPATCH] = {EPXC_PH_DISPATCH, EPXC_PH_DISPATCH_DONE},
                                  [EPXI_OP_NOTIFY_DISPATCH] = {EPXC_PH_NOTIFY, EPXC_PH_NOTIFY_DONE},
                                  [EPXI_OP_COMBINE] = {EPXC_PH_COMBINE, EPXC_PH_COMBINE_DONE}};
  uint64_t words[EPXC_SLOT_WORDS] = {(uint64_t)(uint32_t)status};
  if (h->hc.algo == EPX_ALGO_LL) { /* one exchange per operation, none in notify */
    if (op != EPXI_OP_NOTIFY)
      LAUNCH_TRY(epxc_exchange(&cc->group, op == EPXI_OP_COMBINE ? EPXC_PH_LL_COMBINE : EPXC_PH_LL_DISPATCH, words, NULL, st),
                 "exchange");
    if (op == EPXI_OP_DISPATCH || op == EPXI_OP_NOTIFY_DISPATCH) ch_of(h)->ll_dispatched = false;
    forget_own_report(c, status, st);
    return status;
  }
  LAUNCH_TRY(epxc_exchange(&cc->group, phases[op][0], words, NULL, st), "exchange");
  LAUNCH_TRY(epxc_exchange(&cc->group, phases[op][1], NULL, NULL, st), "exchange");
  if (op == EPXI_OP_NOTIFY_DISPATCH && !(h->hc.exact && h->hc.algo != EPX_ALGO_LL)) {
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH, words, NULL, st), "exchange");
    LAUNCH_TRY(epxc_exchange(&cc->group, EPXC_PH_DISPATCH_DONE, NULL, NULL, st), "exchange");
  }
  forget_own_report(c, status, st);
  return status;
}

const epxi_backend_t epxi_cuda_backend = {
    .name = "cuda",
    .world_create = cuda_world_create,
    .world_destroy = cuda_world_destroy,
    .comm_init = cuda_comm_init,
    .comm_destroy = cuda_comm_destroy,
    .handle_create = cuda_handle_create,
    .handle_destroy = cuda_handle_destroy,
    .get_layout = cuda_get_layout,
    .notify = cuda_notify,
    .handle_info = cuda_handle_info,
    .dispatch = cuda_dispatch,
    .combine = cuda_combine,
    .poll = cuda_poll,
    .synchronize = cuda_synchronize,
    .abort = cuda_abort,
};
