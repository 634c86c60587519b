/* bf16 rows quantised to fp8 from shared memory: each warp's rows come in by bulk copies (the
 * copy engine, not the load/store unit), its lanes quantise a staged chunk in registers and
 * store the fp8 straight to each of the token's destination rows. ht.cu's fp8 dispatch runs
 * on it where it applies (ht_staged).
 *
 * Why: the lanes' rings (ring.cuh) pass every byte through the load/store unit three times
 * (the cp.async copy in, the read back, the store per destination) and bind on its queues
 * (bench/RESULTS.md, 2026-12-02). Here a lane reads its bytes once from shared memory and
 * stores half as many per destination. Such a kernel binds on issuing instructions, not on
 * memory (ncu, on the form before this one: 3.4 of 4 a cycle), so what a chunk costs beyond
 * its channels' arithmetic is kept small: an fp8 stage written out by bulk copies cost a
 * shared-memory store, a proxy fence, a group wait and a bulk copy per destination (with its
 * uniform-register loop) for each chunk; plain 8-byte stores cost four instructions a
 * destination (65 GB/s per SM against 54, bench/RESULTS.md).
 *
 * A chunk is EPXC_STAGED_CHUNK channels: two units of EPXC_STAGED_UNIT (512), 16 channels a
 * lane in each, so a 128-channel scale block is 8 lanes. Lane 8g + i holds block g of a unit
 * as two pieces of 8 channels, 128g + 8i and 128g + 64 + 8i: each 16-byte shared read of the
 * warp is 4 runs of 128 contiguous bytes (no bank conflict), each 8-byte store 4 runs of 64.
 * The two units travel together: their amaxes, exact bf16 values, share one 32-bit word in
 * the three shuffles of the block reduction, and the four numbers a block group needs (a
 * factor and a scale for each unit) are one division a lane, shuffled back. The arithmetic is
 * the contract's: the same bits as quantise_unit (ring.cuh) and convert_row (rows.cuh). */
#ifndef EPX_CUDA_STAGED_CUH
#define EPX_CUDA_STAGED_CUH

#include "cuda/rows.cuh"
#include "cuda/tma.cuh"

#define EPXC_STAGED_UNIT EPXC_UNIT_SPAN       /* 512: a unit, 16 channels a lane (config.cuh) */
#define EPXC_STAGED_PIECE EPXC_LANE_CHANNELS  /* 8: a lane's channels in one shared read */
#define EPXC_STAGED_BLOCK_LANES (EPX_FP8_BLOCK / EPXC_UNIT_CHANNELS) /* 8 lanes to a scale block */
#define EPXC_STAGED_BLOCKS (EPXC_STAGED_CHUNK / EPX_FP8_BLOCK)      /* 8 scale blocks a chunk */
static_assert(EPXC_STAGED_CHUNK == 2 * EPXC_STAGED_UNIT, "a chunk is two units: their amaxes share a word");
static_assert(EPXC_STAGED_BLOCK_LANES == 8 && EPX_FP8_BLOCK == 16 * EPXC_STAGED_PIECE,
              "a block is 8 lanes of two 8-channel pieces");

typedef struct {
  __align__(128) uint16_t in[EPXC_STAGED_IN][EPXC_STAGED_CHUNK]; /* bf16 chunks, as sent */
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

/* The largest |x| of n bf16 words' channels, as bf16 bits: exact, and NaN only where all are
 * NaN (max skips NaN, as fmaxf does). */
template <int N>
static __device__ __forceinline__ uint32_t lane_amax_bf16(const uint32_t *w) {
  __nv_bfloat162 m;
  const uint32_t a0 = w[0] & 0x7fff7fffu;
  memcpy(&m, &a0, sizeof a0);
#pragma unroll
  for (int i = 1; i < N; i++) {
    const uint32_t a = w[i] & 0x7fff7fffu;
    __nv_bfloat162 x;
    memcpy(&x, &a, sizeof a);
    m = __hmax2(m, x);
  }
  const __nv_bfloat16 top = __hmax(__low2bfloat16(m), __high2bfloat16(m));
  uint16_t bits;
  memcpy(&bits, &top, sizeof bits);
  return bits;
}

/* Stores to global memory through pointers the compiler sees only as generic ones (the warp's
 * table in shared memory): STG, where a plain store would be a generic ST. */
static __device__ __forceinline__ void st_global_v2(void *p, uint2 v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(__cvta_generic_to_global(p)), "r"(v.x), "r"(v.y) : "memory");
}
static __device__ __forceinline__ void st_global_f32(float *p, float v) {
  asm volatile("st.global.f32 [%0], %1;" ::"l"(__cvta_generic_to_global(p)), "f"(v) : "memory");
}

/* 8 bf16 channels (4 words) times f, as 8 e4m3 bytes. */
static __device__ __forceinline__ uint2 quantise_piece(const uint32_t *w, float f) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    x[2 * i] = __fmul_rn(__uint_as_float(w[i] << 16), f);
    x[2 * i + 1] = __fmul_rn(__uint_as_float(w[i] & 0xffff0000u), f);
  }
  return make_uint2(e4m3x4(x[0], x[1], x[2], x[3]), e4m3x4(x[4], x[5], x[6], x[7]));
}

/* Chunk k of a row, staged in `in`, of which `valid` channels are in the row (FULL: all of it,
 * as in every chunk but a row's last, and no channel is checked): quantised with each
 * block's scale and stored to chunk k of the m rows in the warp's table, the scales to their
 * scale rows. Lane bit 0 picks the unit and bit 1 the number (factor 448 / a, or scale
 * a / 448) that the lane's one division gives; lanes 2 and 3 of a block group (and their
 * copies 6 and 7) hold the group's scales, 2 and 3 store them. Called by the whole warp. */
template <bool FULL>
static __device__ __forceinline__ void quantise_chunk(const staged_warp_t *w, const uint16_t *in, int k, int valid,
                                                      int m) {
  const int lane = lane_id(), g = lane / EPXC_STAGED_BLOCK_LANES, i = lane % EPXC_STAGED_BLOCK_LANES;
  const int c0 = EPX_FP8_BLOCK * g + EPXC_STAGED_PIECE * i; /* the lane's first channel */
  uint32_t v[2][8];                                         /* [unit][piece 0's words, piece 1's] */
  uint32_t packed = 0; /* the two units' amaxes, bf16 bits, low and high */
#pragma unroll
  for (int u = 0; u < 2; u++) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
      const int c = c0 + u * EPXC_STAGED_UNIT + p * (EPX_FP8_BLOCK / 2);
      const uint4 x = FULL || c < valid ? *(const uint4 *)(in + c) : make_uint4(0, 0, 0, 0);
      v[u][4 * p] = x.x, v[u][4 * p + 1] = x.y, v[u][4 * p + 2] = x.z, v[u][4 * p + 3] = x.w;
    }
    packed |= lane_amax_bf16<8>(v[u]) << (16 * u);
  }
#pragma unroll
  for (int o = EPXC_STAGED_BLOCK_LANES / 2; o >= 1; o >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, packed, o);
    __nv_bfloat162 a, b;
    memcpy(&a, &packed, sizeof a);
    memcpy(&b, &other, sizeof b);
    a = __hmax2(a, b);
    memcpy(&packed, &a, sizeof packed);
  }
  /* a block of NaNs only: NaN, which the floor (fmaxf) turns into the floor, as the contract's
     running max from 0 gives */
  const int unit = lane & 1, inverse = (lane >> 1) & 1;
  const float amax = __uint_as_float(((packed >> (16 * unit)) & 0xffffu) << 16);
  const float a = fmaxf(amax, EPXC_FP8_AMAX_FLOOR);
  const float r = __fdiv_rn(inverse ? a : EPXC_FP8_MAX, inverse ? EPXC_FP8_MAX : a);
  uint2 q[2][2];
#pragma unroll
  for (int u = 0; u < 2; u++) {
    const float f = __shfl_sync(0xffffffffu, r, (lane & ~(EPXC_STAGED_BLOCK_LANES - 1)) | u);
#pragma unroll
    for (int p = 0; p < 2; p++) q[u][p] = quantise_piece(&v[u][4 * p], f);
  }
  const size_t at = (size_t)k * EPXC_STAGED_CHUNK + c0;
  const int b = unit * (EPXC_STAGED_BLOCKS / 2) + g; /* the block whose scale this lane holds */
  const bool scales = (lane & 6) == 2 && (FULL || b * EPX_FP8_BLOCK < valid);
  const int sat = k * EPXC_STAGED_BLOCKS + b;
  for (int j = 0; j < m; j++) { /* the scales in the same loop: one loop's set-up a chunk, not two */
    uint8_t *row = w->dst[j] + at;
#pragma unroll
    for (int u = 0; u < 2; u++)
#pragma unroll
      for (int p = 0; p < 2; p++) {
        const int off = u * EPXC_STAGED_UNIT + p * (EPX_FP8_BLOCK / 2);
        if (FULL || c0 + off < valid) st_global_v2(row + off, q[u][p]);
      }
    if (scales) st_global_f32(w->dscale[j] + sat, r);
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

/* Lane 0: one chunk's load, the current row's next or else the next row's first (nxt NULL or
 * done: none), into the stage the warp has just read. Called once before each of the first
 * EPXC_STAGED_IN chunks and once after each chunk, it keeps EPXC_STAGED_IN in flight as long as
 * a row has that many chunks (ht_staged: rows of more than one chunk), and never fewer than one:
 * the chunk the warp waits for next has always been issued. */
static __device__ __forceinline__ void staged_load_next(staged_warp_t *w, staged_ring_t *r, staged_row_t *cur,
                                                        staged_row_t *nxt, int hidden) {
  const bool here = cur->issued < cur->chunks;
  if (!here && (!nxt || nxt->issued >= nxt->chunks)) return;
  const uint16_t *src = here ? cur->src : nxt->src;
  const int k = here ? cur->issued++ : nxt->issued++;
  const int s = r->loaded % EPXC_STAGED_IN;
  const uint32_t bytes = (uint32_t)staged_valid(hidden, k) * 2;
  mbar_expect(&w->full[s], bytes);
  bulk_load(w->in[s], src + (size_t)k * EPXC_STAGED_CHUNK, bytes, &w->full[s]);
  r->loaded++;
}

/* The current token's destinations into the warp's table, from the lanes that hold them
 * (lane j < m: row dst, scales dscale). */
static __device__ __forceinline__ void staged_set_dests(staged_warp_t *w, int m, void *dst, float *dscale) {
  __syncwarp(); /* the previous token's last chunk has read the table */
  if (lane_id() < m) w->dst[lane_id()] = (uint8_t *)dst, w->dscale[lane_id()] = dscale;
  __syncwarp();
}

/* Chunk k of the current token's row (in the ring's next stage): quantised and stored to the
 * m rows of the warp's table. Called by the whole warp. */
static __device__ __forceinline__ void staged_convert_next(staged_warp_t *w, staged_ring_t *r, int hidden, int k, int m) {
  const int s = r->converted % EPXC_STAGED_IN, valid = staged_valid(hidden, k);
  mbar_wait(&w->full[s], (r->converted / EPXC_STAGED_IN) & 1);
  if (m > 0 && valid == EPXC_STAGED_CHUNK)
    quantise_chunk<true>(w, w->in[s], k, valid, m);
  else if (m > 0)
    quantise_chunk<false>(w, w->in[s], k, valid, m);
  /* No proxy fence before lane 0's next bulk copy into in[s]: the lanes' reads of it returned
     before this barrier (every value read feeds the stores above), so a later write cannot
     change them; CUTLASS's TMA pipelines hand a read stage back to the copy engine the same
     way, by a barrier alone. A fence here cost 2% (bench/RESULTS.md, 2026-12-06). */
  __syncwarp();
  r->converted++;
}

#endif
