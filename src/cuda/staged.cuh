/* bf16 rows quantised to fp8 from shared memory: each warp's rows come in by bulk copies (the
 * copy engine, not the load/store unit), its lanes quantise a staged chunk into an fp8 stage,
 * and bulk copies write that stage to each of the token's destination rows. ht.cu's fp8
 * dispatch runs on it where it applies (ht_staged).
 *
 * Why: the lanes' rings (ring.cuh) pass every byte through the load/store unit three times
 * (the cp.async copy in, the read back, the store per destination) and bind on its queues
 * (bench/RESULTS.md, 2026-12-02). Here a lane reads its bytes once from shared memory and
 * writes half as many back; the copies and the fan-out cost one lane a bulk instruction each
 * (the scales, 4 bytes a block, are plain stores). The destinations sit in the warp's table,
 * not in lanes: nothing is shuffled per chunk.
 *
 * A chunk is EPXC_STAGED_CHUNK channels: four sub-units of 256, lane L holding channels
 * 8L..8L+7 of each (one conflict-free 16-byte read), so a 128-channel scale block is 16 lanes.
 * Two sub-units travel together: their amaxes, exact bf16 values, share one 32-bit word in the
 * four shuffles of the block reduction, and the four divisions their blocks need (a factor and
 * a scale each) are one division a lane, shuffled back. A lane quantising 8 channels would
 * otherwise divide twice for them: the divisions were a fifth of the kernel's instructions, and
 * it binds on issuing them (ncu: 3.3 of 4 a cycle). The arithmetic is the contract's: the same
 * bits as quantise_unit (ring.cuh) and convert_row (rows.cuh). */
#ifndef EPX_CUDA_STAGED_CUH
#define EPX_CUDA_STAGED_CUH

#include "cuda/rows.cuh"
#include "cuda/tma.cuh"

#define EPXC_STAGED_SUB EPXC_CHUNK_CHANNELS /* 256: a sub-unit, 8 channels a lane (config.cuh) */
static_assert(EPXC_STAGED_CHUNK % (2 * EPXC_STAGED_SUB) == 0, "a chunk is pairs of sub-units");
static_assert(EPXC_STAGED_SUB % EPX_FP8_BLOCK == 0, "a sub-unit is whole scale blocks");

typedef struct {
  __align__(128) uint16_t in[EPXC_STAGED_IN][EPXC_STAGED_CHUNK]; /* bf16 chunks, as sent */
  __align__(16) uint8_t out[EPXC_STAGED_OUT][EPXC_STAGED_CHUNK];  /* their fp8 */
  uint64_t full[EPXC_STAGED_IN];                                  /* an input chunk has landed */
  uint8_t *dst[EPXC_MAX_TOPK];                                    /* the current token's rows */
  float *dscale[EPXC_MAX_TOPK];                                   /* and their scales */
} staged_warp_t;

static size_t staged_smem_bytes(void) { return sizeof(staged_warp_t) * EPXC_WARPS; }

static __device__ staged_warp_t *staged_warp_setup(void) {
  extern __shared__ __align__(128) uint8_t staged_smem[];
  staged_warp_t *w = (staged_warp_t *)staged_smem + threadIdx.x / EPXC_WARP;
  if (lane_id() == 0) mbar_init_stages(w->full, EPXC_STAGED_IN);
  __syncwarp();
  return w;
}

/* ---- a chunk's quantisation ---------------------------------------------------------------- */

/* The largest |x| of a lane's 8 bf16 channels (4 words), as bf16 bits: exact, and NaN only
 * where all 8 are NaN (max skips NaN, as fmaxf does). */
static __device__ __forceinline__ uint32_t lane_amax_bf16(const uint32_t *w) {
  __nv_bfloat162 m[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t a = w[i] & 0x7fff7fffu;
    memcpy(&m[i], &a, sizeof a);
  }
  const __nv_bfloat162 t = __hmax2(__hmax2(m[0], m[1]), __hmax2(m[2], m[3]));
  const __nv_bfloat16 top = __hmax(__low2bfloat16(t), __high2bfloat16(t));
  uint16_t bits;
  memcpy(&bits, &top, sizeof bits);
  return bits;
}

/* Sub-units q and q + 1 of a chunk, of which `valid` channels are in the row (FULL: all of
 * it, as in every chunk but a row's last, and no channel is checked): each lane's 8
 * channels of each quantised with their block's scale into out. Returns what this lane's
 * division gave: lanes agree within a block, so each lane divides once for the four numbers a
 * 16-lane group needs (bit 3 of the lane: sub-unit q or q + 1; bit 2: the quantising factor
 * 448 / a or the scale a / 448) and shuffles the factors back; lanes 4 and 12 of each group
 * keep the scales (staged_store_scales). Called by the whole warp. */
template <bool FULL>
static __device__ __forceinline__ float quantise_pair(const uint16_t *in, uint8_t *out, int q, int valid) {
  const int lane = lane_id();
  uint32_t w[2][4];
  uint32_t packed = 0; /* the two sub-units' amaxes, bf16 bits, low and high */
#pragma unroll
  for (int p = 0; p < 2; p++) {
    const int c = (q + p) * EPXC_STAGED_SUB + EPXC_LANE_CHANNELS * lane;
    const uint4 v = FULL || c < valid ? *(const uint4 *)(in + c) : make_uint4(0, 0, 0, 0);
    w[p][0] = v.x, w[p][1] = v.y, w[p][2] = v.z, w[p][3] = v.w;
    packed |= lane_amax_bf16(w[p]) << (16 * p);
  }
#pragma unroll
  for (int o = EPXC_FP8_BLOCK_LANES / 2; o >= 1; o >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, packed, o);
    __nv_bfloat162 a, b;
    memcpy(&a, &packed, sizeof a);
    memcpy(&b, &other, sizeof b);
    a = __hmax2(a, b);
    memcpy(&packed, &a, sizeof packed);
  }
  /* a block of NaNs only: NaN, which the floor (fmaxf) turns into the floor, as the contract's
     running max from 0 gives */
  const int hi = (lane >> 3) & 1, inverse = (lane >> 2) & 1;
  const float amax = __uint_as_float(((packed >> (16 * hi)) & 0xffffu) << 16);
  const float a = fmaxf(amax, EPXC_FP8_AMAX_FLOOR);
  const float r = __fdiv_rn(inverse ? a : EPXC_FP8_MAX, inverse ? EPXC_FP8_MAX : a);
  const int group = lane & ~12;
#pragma unroll
  for (int p = 0; p < 2; p++) {
    const int c = (q + p) * EPXC_STAGED_SUB + EPXC_LANE_CHANNELS * lane;
    const float sc = __shfl_sync(0xffffffffu, r, group | 8 * p);
    float x[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      x[2 * i] = __fmul_rn(__uint_as_float(w[p][i] << 16), sc);
      x[2 * i + 1] = __fmul_rn(__uint_as_float(w[p][i] & 0xffff0000u), sc);
    }
    if (FULL || c < valid) *(uint2 *)(out + c) = make_uint2(e4m3x4(x[0], x[1], x[2], x[3]), e4m3x4(x[4], x[5], x[6], x[7]));
  }
  return r;
}

#define EPXC_STAGED_PAIRS (EPXC_STAGED_CHUNK / (2 * EPXC_STAGED_SUB))
#define EPXC_STAGED_BLOCKS (EPXC_STAGED_CHUNK / EPX_FP8_BLOCK)

/* Chunk k's scales (the pairs' quantise_pair results) into the m destinations' scale rows: a
 * lane a (destination, block), plain stores, a few bytes a block. Block 4P + 2h + g of the
 * chunk (pair P, sub-unit h of it, 16-lane group g) is held by lane 16g + 8h + 4. Called by
 * the whole warp. */
static __device__ __forceinline__ void staged_store_scales(const staged_warp_t *w, const float *r, int k, int valid,
                                                           int m) {
  for (int i0 = 0; i0 < m * EPXC_STAGED_BLOCKS; i0 += EPXC_WARP) {
    const int i = i0 + lane_id(), b = i % EPXC_STAGED_BLOCKS, in_pair = b % 4;
    const int holder = 16 * (in_pair & 1) + 8 * (in_pair >> 1) + 4;
    float scale = 0.0f;
#pragma unroll
    for (int P = 0; P < EPXC_STAGED_PAIRS; P++) {
      const float v = __shfl_sync(0xffffffffu, r[P], holder);
      if (b / 4 == P) scale = v;
    }
    if (i < m * EPXC_STAGED_BLOCKS && b * EPX_FP8_BLOCK < valid)
      w->dscale[i / EPXC_STAGED_BLOCKS][k * EPXC_STAGED_BLOCKS + b] = scale;
  }
}

/* ---- a warp's stream of chunks --------------------------------------------------------------- */

/* A row being streamed: its source, chunks, and chunks whose loads were issued. */
typedef struct {
  const uint16_t *src;
  int chunks, issued;
} staged_row_t;

/* Where the warp's ring stands: chunks loaded into it and converted, over the kernel's life (a
 * stage's barrier phase is its use count's parity, as in bulk.cuh). */
typedef struct {
  uint32_t loaded, converted;
} staged_ring_t;

static __device__ __forceinline__ int staged_valid(int hidden, int k) {
  return min(EPXC_STAGED_CHUNK, hidden - k * EPXC_STAGED_CHUNK);
}

/* Lane 0: loads ahead until EPXC_STAGED_IN chunks are in flight, the current row's first and
 * then the next one's (nxt NULL: none). A stage is loaded only once the warp has read it. */
static __device__ __forceinline__ void staged_load_ahead(staged_warp_t *w, staged_ring_t *r, staged_row_t *cur,
                                                         staged_row_t *nxt, int hidden) {
  while (r->loaded - r->converted < EPXC_STAGED_IN) {
    const uint16_t *src;
    int k;
    if (cur->issued < cur->chunks)
      src = cur->src, k = cur->issued++;
    else if (nxt && nxt->issued < nxt->chunks)
      src = nxt->src, k = nxt->issued++;
    else
      return;
    const int s = r->loaded % EPXC_STAGED_IN;
    const uint32_t bytes = (uint32_t)staged_valid(hidden, k) * 2;
    mbar_expect(&w->full[s], bytes);
    bulk_load(w->in[s], src + (size_t)k * EPXC_STAGED_CHUNK, bytes, &w->full[s]);
    r->loaded++;
  }
}

/* The current token's destinations into the warp's table, from the lanes that hold them
 * (lane j < m: row dst, scales dscale). */
static __device__ __forceinline__ void staged_set_dests(staged_warp_t *w, int m, void *dst, float *dscale) {
  __syncwarp(); /* the previous token's last chunk has read the table */
  if (lane_id() < m) w->dst[lane_id()] = (uint8_t *)dst, w->dscale[lane_id()] = dscale;
  __syncwarp();
}

/* Chunk k of the current token's row (in the ring's next stage): quantised into the next fp8
 * stage, then written by bulk copies to the m rows of the warp's table. Called by the whole
 * warp. */
static __device__ __forceinline__ void staged_convert_next(staged_warp_t *w, staged_ring_t *r, int hidden, int k, int m) {
  const int s = r->converted % EPXC_STAGED_IN, o = r->converted % EPXC_STAGED_OUT;
  const int valid = staged_valid(hidden, k);
  if (lane_id() == 0) bulk_wait_read_but_one(); /* the stores that read stage o last are done with it */
  static_assert(EPXC_STAGED_OUT == 2, "the wait above leaves one group in flight: two fp8 stages");
  __syncwarp();
  mbar_wait(&w->full[s], (r->converted / EPXC_STAGED_IN) & 1);
  if (m > 0) {
    float held[EPXC_STAGED_PAIRS];
    if (valid == EPXC_STAGED_CHUNK)
#pragma unroll
      for (int P = 0; P < EPXC_STAGED_PAIRS; P++) held[P] = quantise_pair<true>(w->in[s], w->out[o], 2 * P, valid);
    else
#pragma unroll
      for (int P = 0; P < EPXC_STAGED_PAIRS; P++) held[P] = quantise_pair<false>(w->in[s], w->out[o], 2 * P, valid);
    staged_store_scales(w, held, k, valid, m);
  }
  fence_async_smem(); /* this lane's reads of in[s] and writes of out[o], before the copy engine's */
  __syncwarp();
  if (lane_id() == 0) {
    for (int j = 0; j < m; j++) bulk_store(w->dst[j] + (size_t)k * EPXC_STAGED_CHUNK, w->out[o], (uint32_t)valid);
    bulk_commit(); /* a group per chunk, empty when m is 0: the wait above counts chunks */
  }
  r->converted++;
}

#endif
