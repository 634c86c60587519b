/* Data types and the exact scalar roundings every backend reproduces. */
#include <math.h>
#include <string.h>

#include "core/internal.h"

size_t epx_dtype_size(epx_dtype_t dtype) {
  switch (dtype) {
    case EPX_FLOAT32: return 4;
    case EPX_BFLOAT16: return 2;
    case EPX_FP8_E4M3: return 1;
    case EPX_INT32: return 4;
    case EPX_INT64: return 8;
    case EPX_BOOL: return 1;
  }
  return 0;
}

const char *epx_dtype_name(epx_dtype_t dtype) {
  switch (dtype) {
    case EPX_FLOAT32: return "float32";
    case EPX_BFLOAT16: return "bfloat16";
    case EPX_FP8_E4M3: return "fp8_e4m3";
    case EPX_INT32: return "int32";
    case EPX_INT64: return "int64";
    case EPX_BOOL: return "bool";
  }
  return "unknown";
}

static uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* NaN becomes the canonical 0x7fff, as the GPU's cvt.rn.bf16.f32 does. */
uint16_t epx_float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Widening is exact and keeps the bits (a NaN's payload too, as the GPU's does): it never
 * makes an output by itself, only feeds arithmetic, whose NaNs are canonical. */
float epx_bf16_to_float(uint16_t x) { return bits_float((uint32_t)x << 16); }

/* e4m3 "fn": bias 7, no infinities, 0x7f / 0xff are NaN, largest finite 448, smallest
 * subnormal 2^-9. Scaling by powers of two is exact, so rintf (nearest even) does the
 * rounding of the mantissa. */
uint8_t epx_float_to_e4m3(float x) {
  if (isnan(x)) return 0x7f;
  uint8_t sign = signbit(x) ? 0x80 : 0x00;
  float a = fabsf(x);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f) { /* below 2^-6: subnormal grid of 2^-9 */
    int m = (int)rintf(ldexpf(a, 9));
    return sign | (uint8_t)m; /* m == 8 is the smallest normal, code 0x08 */
  }
  int e;
  frexpf(a, &e);
  e -= 1; /* a in [2^e, 2^(e+1)) */
  int r = (int)rintf(ldexpf(a, 3 - e));
  if (r == 16) {
    r = 8;
    e += 1;
  }
  return sign | (uint8_t)(((e + 7) << 3) | (r - 8));
}

float epx_e4m3_to_float(uint8_t x) {
  int exp = (x >> 3) & 15, m = x & 7;
  if ((x & 0x7f) == 0x7f) return bits_float(0x7fffffffu); /* the canonical NaN */
  float v = exp == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), exp - 10);
  return (x & 0x80) ? -v : v;
}

void epx_quantize_row_e4m3(const float *x, int hidden, uint8_t *q, float *scales) {
  for (int b = 0; b * EPX_FP8_BLOCK < hidden; b++) {
    int lo = b * EPX_FP8_BLOCK, hi = lo + EPX_FP8_BLOCK < hidden ? lo + EPX_FP8_BLOCK : hidden;
    /* NaNs, quiet or signalling, are left out of amax, as the GPU's max does. C's fmaxf would
     * not do for a signalling NaN: glibc's returns a quiet NaN for it (IEEE 754-2008 maxNum),
     * which the next step then drops, losing the amax of the channels before it. */
    float amax = 0.0f;
    for (int c = lo; c < hi; c++) {
      const float m = fabsf(x[c]);
      if (m > amax) amax = m;
    }
    float a = amax > 1e-4f ? amax : 1e-4f;
    float s = 448.0f / a;
    for (int c = lo; c < hi; c++) q[c] = epx_float_to_e4m3(x[c] * s);
    scales[b] = a / 448.0f;
  }
}
