/* Rows converted on the way (fp8 quantised per 128 channels; scaled by the routing weight),
 * read through each lane's own ring of asynchronous copies. ht.cu's converting dispatches run
 * on it, a warp per token, except bf16 rows of more than 1024 channels to fp8, which go
 * through bulk-copied stages (staged.cuh: 75% more bytes per SM-second, bench/RESULTS.md).
 *
 * Why: a warp that loads a 16-byte vector and then works on it keeps one load in flight per
 * lane, 16 KB per 1024-thread block, a sixth of what an SM needs to move at its limit; holding
 * more in registers spills. Here each lane copies its 16-channel units of the row into its own
 * slots of shared memory (cp.async), EPXC_RING_LANE_BYTES ahead of the unit it works on, so
 * the loads in flight cost no registers. A lane reads back only what it copied itself: its own
 * wait orders them, and no lane waits on another.
 *
 * A lane works on 16 channels at once (EPXC_UNIT_CHANNELS): an fp8 scale block is 8 lanes,
 * its amax three shuffles, its scale one division each, and the quantised 16 bytes one store
 * per destination row; a row that is not scaled per destination is quantised once for all of
 * them. The arithmetic is the contract's, element by element: the same bits as convert_row.
 *
 * Measured and left out (bench/RESULTS.md, 2026-12-02): the expert layout's partial sums on
 * the same rings ran at 35 GB/s per SM against the register kernel's 68. The first version
 * here ran at 27 before the destinations moved from per-thread arrays into lanes: a
 * 1024-thread block's stacks do not fit the L1 that 128 KB of rings leave, so every array read
 * went to L2. Units of 32 channels (64 bytes a lane, 2 slots) issued a third fewer
 * instructions and ran 22% slower: the load/store unit's queues bind, as every byte read here
 * passes it twice (the copy in, the read back) before the store. */
#ifndef EPX_CUDA_RING_CUH
#define EPX_CUDA_RING_CUH

#include "cuda/rows.cuh"
#include "cuda/tma.cuh"

static_assert(EPX_FP8_BLOCK % EPXC_UNIT_CHANNELS == 0 && EPXC_UNIT_SPAN % EPX_FP8_BLOCK == 0,
              "an fp8 scale block is whole lanes of one warp unit");
#define EPXC_UNIT_BLOCK_LANES (EPX_FP8_BLOCK / EPXC_UNIT_CHANNELS) /* 8 lanes share one scale */
/* A unit of X: its bytes per channel, 16-byte parts, and channels per part. */
#define EPXC_XB(X) ((X) == EPX_FLOAT32 ? 4 : 2)
#define EPXC_PARTS(X) (EPXC_XB(X) * EPXC_UNIT_CHANNELS / 16)
#define EPXC_PART_CHANNELS(X) (16 / EPXC_XB(X))

/* ---- a lane's ring ------------------------------------------------------------------------- */

/* A unit is a lane's 16 channels of the source row: 32 bytes of bf16 (2 parts of 16), 64 of
 * float32 (4). Part p of slot s is 32 lanes after part p - 1: a warp's loads and reads of
 * one part are 512 contiguous bytes (no bank conflicts). */
template <epx_dtype_t X>
struct ring_of {
  static constexpr int slots = EPXC_RING_LANE_BYTES / 16 / EPXC_PARTS(X); /* the units in flight: 4 bf16, 2 float32 */
  static_assert(slots >= 2 && (slots & (slots - 1)) == 0, "a ring of 2, 4, .. units");
};

/* This lane's part 0 of slot 0, in the launch's dynamic shared memory (EPXC_RING_LANE_BYTES a
 * lane). */
static __device__ __forceinline__ uint4 *lane_ring(void) {
  extern __shared__ __align__(16) uint4 ring_smem[];
  return ring_smem + (threadIdx.x / EPXC_WARP) * (EPXC_RING_LANE_BYTES / 16) * EPXC_WARP + lane_id();
}

/* The lane's channel unit u of `row` (channels u * 512 + 16 lane on) into slot u % slots;
 * nothing past the row's end. */
template <epx_dtype_t X>
static __device__ __forceinline__ void ring_load(uint4 *ring, const void *row, int hidden, int u) {
  constexpr int xb = EPXC_XB(X), parts = EPXC_PARTS(X), part_ch = EPXC_PART_CHANNELS(X);
  const int c = u * EPXC_UNIT_SPAN + lane_id() * EPXC_UNIT_CHANNELS;
  uint4 *slot = ring + (u & (ring_of<X>::slots - 1)) * parts * EPXC_WARP;
#pragma unroll
  for (int p = 0; p < parts; p++)
    if (c + p * part_ch < hidden)
      lane_copy16(slot + p * EPXC_WARP, (const uint8_t *)row + (size_t)(c + p * part_ch) * xb);
}

/* Unit u, landed, widened to float32: 0 past the row's end. */
template <epx_dtype_t X>
static __device__ __forceinline__ void ring_take(const uint4 *ring, int hidden, int u, float *v) {
  constexpr int parts = EPXC_PARTS(X), part_ch = EPXC_PART_CHANNELS(X);
  const int c = u * EPXC_UNIT_SPAN + lane_id() * EPXC_UNIT_CHANNELS;
  const uint4 *slot = ring + (u & (ring_of<X>::slots - 1)) * parts * EPXC_WARP;
#pragma unroll
  for (int p = 0; p < parts; p++) {
    const uint4 q = c + p * part_ch < hidden ? slot[p * EPXC_WARP] : make_uint4(0, 0, 0, 0);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      if (X == EPX_FLOAT32) {
        v[p * part_ch + i] = __uint_as_float(w[i]);
      } else {
        v[p * part_ch + 2 * i] = __uint_as_float(w[i] << 16);
        v[p * part_ch + 2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
  }
}

/* ---- a unit's conversions ------------------------------------------------------------------- */

static __device__ __forceinline__ float scaled_by(float x, float f, bool scaled) {
  return scaled ? __fmul_rn(f, x) : x;
}

/* The lane's 16 channels v (times f when scaled), quantised with their block's scale: the
 * block's amax over its 8 lanes, floored, mapped to e4m3's largest value. *scale is the
 * block's dequantisation scale (the same on its 8 lanes). Called by the whole warp. */
static __device__ __forceinline__ uint4 quantise_unit(const float *v, float f, bool scaled, float *scale) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < EPXC_UNIT_CHANNELS; i++) amax = fmaxf(amax, fabsf(scaled_by(v[i], f, scaled)));
#pragma unroll
  for (int o = EPXC_UNIT_BLOCK_LANES / 2; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float a = fmaxf(amax, EPXC_FP8_AMAX_FLOOR), sc = __fdiv_rn(EPXC_FP8_MAX, a);
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; i++)
    q[i] = e4m3x4(__fmul_rn(scaled_by(v[4 * i], f, scaled), sc), __fmul_rn(scaled_by(v[4 * i + 1], f, scaled), sc),
                  __fmul_rn(scaled_by(v[4 * i + 2], f, scaled), sc), __fmul_rn(scaled_by(v[4 * i + 3], f, scaled), sc));
  *scale = __fdiv_rn(a, EPXC_FP8_MAX);
  return make_uint4(q[0], q[1], q[2], q[3]);
}

/* The lane's 16 channels at c (channels past `hidden` not written) times f, as X. */
template <epx_dtype_t X>
static __device__ __forceinline__ void store_unit(void *row, int64_t c, int hidden, const float *v, float f,
                                                  bool scaled) {
  constexpr int xb = EPXC_XB(X), parts = EPXC_PARTS(X), part_ch = EPXC_PART_CHANNELS(X);
#pragma unroll
  for (int p = 0; p < parts; p++) {
    if (c + p * part_ch >= hidden) continue;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      if (X == EPX_FLOAT32) {
        w[i] = __float_as_uint(scaled_by(v[p * part_ch + i], f, scaled));
      } else {
        w[i] = (uint32_t)float_to_bf16(scaled_by(v[p * part_ch + 2 * i], f, scaled)) |
               (uint32_t)float_to_bf16(scaled_by(v[p * part_ch + 2 * i + 1], f, scaled)) << 16;
      }
    }
    *(uint4 *)((uint8_t *)row + (size_t)(c + p * part_ch) * xb) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

/* ---- a row ----------------------------------------------------------------------------------- */

/* Converts a row of X to m destinations in the receive type (fp8 with a scale per 128
 * channels, or X), each scaled by its factor when `scaled`. Lane j < m holds destination j:
 * its row (dst), its scales (fp8) and its factor; a shuffle hands them round, so nothing of a
 * token's routing sits in local memory (see the top). Called by the whole warp; the ring is
 * this lane's, empty between rows. */
template <epx_dtype_t X>
static __device__ __forceinline__ void convert_row_ring(uint4 *ring, const void *src, epx_dtype_t recv_dtype,
                                                        int hidden, void *dst, float *scales, float factor, bool scaled,
                                                        int m) {
  constexpr int S = ring_of<X>::slots;
  const int lane = lane_id(), units = (hidden + EPXC_UNIT_SPAN - 1) / EPXC_UNIT_SPAN;
  const bool fp8 = recv_dtype == EPX_FP8_E4M3, lead = (lane & (EPXC_UNIT_BLOCK_LANES - 1)) == 0;
  for (int u = 0; u < S; u++) { /* a group per slot, empty past the row: the waits count slots */
    if (u < units) ring_load<X>(ring, src, hidden, u);
    lane_commit();
  }
  for (int u = 0; u < units; u++) {
    lane_wait<S - 1>();
    const int64_t c = (int64_t)u * EPXC_UNIT_SPAN + lane * EPXC_UNIT_CHANNELS;
    const bool live = c < hidden;
    float v[EPXC_UNIT_CHANNELS];
    ring_take<X>(ring, hidden, u, v);
    if (fp8) {
      uint4 q = make_uint4(0, 0, 0, 0);
      float scale = 0.0f;
      for (int j = 0; j < m; j++) {
        const float f = __shfl_sync(0xffffffffu, factor, j);
        if (j == 0 || scaled) q = quantise_unit(v, f, scaled, &scale);
        uint8_t *d = (uint8_t *)lane_ptr(dst, j);
        float *sc = lane_ptr(scales, j);
        if (live) *(uint4 *)(d + c) = q;
        if (live && lead) sc[c / EPX_FP8_BLOCK] = scale;
      }
    } else {
      for (int j = 0; j < m; j++)
        store_unit<X>(lane_ptr(dst, j), c, hidden, v, __shfl_sync(0xffffffffu, factor, j), scaled);
    }
    /* into the slot just read: its values are used above, so the read is done */
    if (u + S < units) ring_load<X>(ring, src, hidden, u + S);
    lane_commit();
  }
}

/* Threads of a launch on lanes' rings on a device that gives a block at most optin_bytes of
 * shared memory: EPXC_THREADS, or fewer (whole warps) where their rings would not fit. */
static int ring_threads(int optin_bytes) {
  const int fit = optin_bytes / EPXC_RING_LANE_BYTES / EPXC_WARP * EPXC_WARP;
  return fit < EPXC_THREADS ? fit : EPXC_THREADS;
}

#endif
