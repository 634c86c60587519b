/* test_dtype: the scalar conversions every backend shares (bf16, e4m3, fp8 row quantisation),
 * checked against independent reference roundings written here. */
#include <math.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ---- reference bf16: round to nearest even on the bit pattern ---------------------- */
static int bf16_is_nan(uint16_t h) { return (h & 0x7F80) == 0x7F80 && (h & 0x7F) != 0; }

static uint16_t ref_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static void test_bf16(void) {
  static const struct {
    uint32_t in;
    uint16_t want;
    const char *what;
  } cases[] = {
      {0x3F800000, 0x3F80, "1.0"},
      {0x3F808000, 0x3F80, "tie 1+2^-8 -> even (down)"},
      {0x3F818000, 0x3F82, "tie -> even (up)"},
      {0x3F808001, 0x3F81, "just above a tie"},
      {0x3F807FFF, 0x3F80, "just below a tie"},
      {0xBF808000, 0xBF80, "negative tie -> even"},
      {0xBF818000, 0xBF82, "negative tie -> even (up)"},
      {0xBFC00000, 0xBFC0, "-1.5"},
      {0x7F7FFFFF, 0x7F80, "FLT_MAX overflows to inf"},
      {0x7F7F8000, 0x7F80, "largest tie overflows to inf (odd below)"},
      {0x7F7F7FFF, 0x7F7F, "just below the overflow tie"},
      {0xFF7FFFFF, 0xFF80, "-FLT_MAX overflows to -inf"},
      {0x7F800000, 0x7F80, "inf"},
      {0xFF800000, 0xFF80, "-inf"},
      {0x00000000, 0x0000, "+0"},
      {0x80000000, 0x8000, "-0"},
      {0x00008000, 0x0000, "subnormal tie -> even (zero)"},
      {0x00018000, 0x0002, "subnormal tie -> even (up)"},
      {0x00010001, 0x0001, "subnormal rounds down"},
      {0x0000C000, 0x0001, "subnormal rounds up"},
      {0x00000001, 0x0000, "smallest subnormal rounds to zero"},
      {0x807FFFFF, 0x8080, "largest negative subnormal rounds to -min normal"},
      {0x00400000, 0x0040, "subnormal exact"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint16_t got = epx_float_to_bf16(u2f(cases[i].in));
    CHECK(got == cases[i].want, "bf16(0x%08x) %s: got 0x%04x want 0x%04x", (unsigned)cases[i].in, cases[i].what,
          (unsigned)got, (unsigned)cases[i].want);
  }
  /* NaNs stay NaN, including those whose payload is only in the dropped bits. */
  static const uint32_t nans[] = {0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FFFFFFF, 0x7FA00000};
  for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
    uint16_t got = epx_float_to_bf16(u2f(nans[i]));
    CHECK(bf16_is_nan(got), "bf16(NaN 0x%08x) = 0x%04x is not a NaN", (unsigned)nans[i], (unsigned)got);
    /* a conversion's NaN is the canonical one, whatever the payload or sign */
    CHECK(got == 0x7FFF, "bf16(NaN 0x%08x) = 0x%04x, not the canonical 0x7FFF", (unsigned)nans[i], (unsigned)got);
    const uint8_t q = epx_float_to_e4m3(u2f(nans[i]));
    CHECK(q == 0x7F, "e4m3(NaN 0x%08x) = 0x%02x, not the canonical 0x7F", (unsigned)nans[i], (unsigned)q);
  }
  CHECK(f2u(epx_e4m3_to_float(0x7F)) == 0x7FFFFFFFu && f2u(epx_e4m3_to_float(0xFF)) == 0x7FFFFFFFu,
        "e4m3 NaN codes widen to 0x%08x and 0x%08x, not the canonical 0x7FFFFFFF", (unsigned)f2u(epx_e4m3_to_float(0x7F)),
        (unsigned)f2u(epx_e4m3_to_float(0xFF)));
  /* bf16 -> float is exact: the bits shifted up; every non-NaN value round-trips. */
  long bad_widen = 0, bad_trip = 0, bad_nan = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = epx_bf16_to_float((uint16_t)h);
    if (bf16_is_nan((uint16_t)h)) {
      bad_nan += !isnan(f);
      continue;
    }
    if (f2u(f) != h << 16) {
      if (!bad_widen) printf("  bf16_to_float(0x%04x) = 0x%08x\n", (unsigned)h, (unsigned)f2u(f));
      bad_widen++;
    }
    if (epx_float_to_bf16(f) != h) bad_trip++;
  }
  CHECK(bad_widen == 0, "%ld bf16 codes do not widen to their bits << 16", bad_widen);
  CHECK(bad_trip == 0, "%ld bf16 codes do not round-trip", bad_trip);
  CHECK(bad_nan == 0, "%ld bf16 NaN codes widen to a non-NaN", bad_nan);
  /* Random bit patterns against the reference. */
  long bad = 0;
  for (int i = 0; i < 1000000; i++) {
    uint32_t u = (uint32_t)tu_u64(&tu_rng);
    float f = u2f(u);
    uint16_t got = epx_float_to_bf16(f), want = ref_bf16(f);
    int ok = isnan(f) ? bf16_is_nan(got) : got == want;
    if (!ok && bad++ < 5) printf("  bf16(0x%08x): got 0x%04x want 0x%04x\n", (unsigned)u, (unsigned)got, (unsigned)want);
  }
  CHECK(bad == 0, "%ld of 1000000 random floats round to the wrong bf16", bad);
}

/* ---- reference e4m3 (OCP E4M3FN: bias 7, no inf, NaN = S.1111.111, max 448) ---------- */
static int e4m3_is_nan(uint8_t c) { return (c & 0x7F) == 0x7F; }

static float ref_e4m3_decode(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return NAN;
  float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
  return (c & 0x80) ? -v : v;
}

/* Nearest of the positive codes 0..0x7E, ties to the even code (even mantissa). */
static uint8_t ref_e4m3(float x) {
  if (isnan(x)) return 0x7F;
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const float a = fabsf(x);
  if (a >= 448.0f) return sign | 0x7E;
  static float table[0x7F];
  static int ready;
  if (!ready) {
    for (int i = 0; i < 0x7F; i++) table[i] = ref_e4m3_decode((uint8_t)i);
    ready = 1;
  }
  int c = 0;
  while (c < 0x7E && table[c + 1] <= a) c++;
  const double lo = table[c], hi = table[c + 1];
  const double dlo = (double)a - lo, dhi = hi - (double)a;
  if (dlo > dhi || (dlo == dhi && (c & 1))) c++;
  return sign | (uint8_t)c;
}

/* Equal codes, or both zero (the sign of an underflow to zero is not part of the contract). */
static int e4m3_same(uint8_t got, uint8_t want) {
  if (got == want) return 1;
  return (got & 0x7F) == 0 && (want & 0x7F) == 0;
}

static void test_e4m3(void) {
  /* Decoding: every code. */
  long bad_dec = 0;
  for (int c = 0; c < 256; c++) {
    float got = epx_e4m3_to_float((uint8_t)c), want = ref_e4m3_decode((uint8_t)c);
    int ok = e4m3_is_nan((uint8_t)c) ? isnan(got) : f2u(got) == f2u(want);
    if (!ok && bad_dec++ < 5) printf("  e4m3_to_float(0x%02x) = %g, want %g\n", c, got, want);
  }
  CHECK(bad_dec == 0, "%ld e4m3 codes decode wrongly", bad_dec);
  CHECK(epx_e4m3_to_float(0x7E) == 448.0f && epx_e4m3_to_float(0xFE) == -448.0f, "max code 0x7E is 448");
  CHECK(epx_e4m3_to_float(0x01) == ldexpf(1.0f, -9), "smallest subnormal 0x01 is 2^-9");
  CHECK(epx_e4m3_to_float(0x08) == ldexpf(1.0f, -6), "smallest normal 0x08 is 2^-6");

  /* Round trip of every non-NaN code (including -0 = 0x80). */
  long bad_trip = 0;
  for (int c = 0; c < 256; c++) {
    if (c == 0x7F || c == 0xFF) continue;
    uint8_t back = epx_float_to_e4m3(epx_e4m3_to_float((uint8_t)c));
    if (back != c && bad_trip++ < 5) printf("  e4m3 round trip 0x%02x -> 0x%02x\n", c, back);
  }
  CHECK(bad_trip == 0, "%ld e4m3 codes do not round-trip", bad_trip);

  static const struct {
    float in;
    uint8_t want;
    const char *what;
  } cases[] = {
      {1.0f, 0x38, "1.0"},
      {1.0625f, 0x38, "tie between 1 and 1.125 -> even (down)"},
      {1.1875f, 0x3A, "tie between 1.125 and 1.25 -> even (up)"},
      {-1.0625f, 0xB8, "negative tie -> even"},
      {448.0f, 0x7E, "448"},
      {432.0f, 0x7E, "tie between 416 and 448 -> even (448)"},
      {449.0f, 0x7E, "just above 448 saturates"},
      {464.0f, 0x7E, "464 saturates"},
      {1000.0f, 0x7E, "1000 saturates"},
      {1e30f, 0x7E, "1e30 saturates"},
      {FLT_MAX, 0x7E, "FLT_MAX saturates"},
      {-1e30f, 0xFE, "-1e30 saturates"},
      {-500.0f, 0xFE, "-500 saturates"},
      {0x1p-9f, 0x01, "2^-9, smallest subnormal"},
      {0x1.8p-9f, 0x02, "1.5 * 2^-9: tie -> even (up)"},
      {0x1.4p-8f, 0x02, "2.5 * 2^-9: tie -> even (down)"},
      {0x1.000002p-10f, 0x01, "just above 2^-10 rounds up to 2^-9"},
      {0x1.cp-7f, 0x07, "7 * 2^-9, largest subnormal"},
      {0x1.ep-7f, 0x08, "7.5 * 2^-9: tie -> even (smallest normal)"},
      {0x1p-6f, 0x08, "2^-6, smallest normal"},
      {240.0f, 0x77, "240"},
      {0.1f, 0x1D, "0.1 -> 0.1015625"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint8_t got = epx_float_to_e4m3(cases[i].in);
    CHECK(got == cases[i].want, "e4m3(%a) %s: got 0x%02x want 0x%02x", (double)cases[i].in, cases[i].what,
          (unsigned)got, (unsigned)cases[i].want);
  }
  CHECK(epx_float_to_e4m3(INFINITY) == 0x7E, "+inf saturates to 0x7E, got 0x%02x", (unsigned)epx_float_to_e4m3(INFINITY));
  CHECK(epx_float_to_e4m3(-INFINITY) == 0xFE, "-inf saturates to 0xFE, got 0x%02x", (unsigned)epx_float_to_e4m3(-INFINITY));
  CHECK(e4m3_is_nan(epx_float_to_e4m3(NAN)), "NaN -> a NaN code, got 0x%02x", (unsigned)epx_float_to_e4m3(NAN));
  CHECK((epx_float_to_e4m3(0x1p-10f) & 0x7F) == 0, "2^-10 (tie with zero) -> zero, got 0x%02x",
        (unsigned)epx_float_to_e4m3(0x1p-10f));
  CHECK((epx_float_to_e4m3(1e-10f) & 0x7F) == 0, "1e-10 underflows to zero");
  CHECK(epx_float_to_e4m3(0.0f) == 0x00, "+0 -> 0x00");

  /* Every midpoint between neighbouring codes, and its float neighbours, both signs. */
  long bad_mid = 0;
  for (int c = 0; c < 0x7E; c++) {
    const float lo = ref_e4m3_decode((uint8_t)c), hi = ref_e4m3_decode((uint8_t)(c + 1));
    const float mid = (lo + hi) * 0.5f; /* exact */
    const float probes[3] = {nextafterf(mid, 0.0f), mid, nextafterf(mid, INFINITY)};
    for (int i = 0; i < 3; i++)
      for (int sgn = 0; sgn < 2; sgn++) {
        const float v = sgn ? -probes[i] : probes[i];
        const uint8_t got = epx_float_to_e4m3(v), want = ref_e4m3(v);
        if (!e4m3_same(got, want) && bad_mid++ < 5) printf("  e4m3(%a): got 0x%02x want 0x%02x\n", (double)v, got, want);
      }
  }
  CHECK(bad_mid == 0, "%ld midpoint probes round wrongly", bad_mid);

  /* Random floats from 2^-12 to 2^10, both signs. */
  long bad = 0;
  for (int i = 0; i < 200000; i++) {
    float v = ldexpf(1.0f + (float)tu_unit(&tu_rng), tu_int(&tu_rng, -12, 9));
    if (tu_u64(&tu_rng) & 1) v = -v;
    const uint8_t got = epx_float_to_e4m3(v), want = ref_e4m3(v);
    if (!e4m3_same(got, want) && bad++ < 5) printf("  e4m3(%a): got 0x%02x want 0x%02x\n", (double)v, got, want);
  }
  CHECK(bad == 0, "%ld of 200000 random floats round to the wrong e4m3", bad);
}

/* ---- quantize_row ----------------------------------------------------------------- */
static void check_quantize(const char *what, const float *x, int H) {
  const int nb = tu_nblocks(H);
  uint8_t *q = tu_alloc_poison((size_t)H + 16);
  float *sc = tu_alloc_poison(sizeof(float) * (size_t)(nb + 4));
  epx_quantize_row_e4m3(x, H, q, sc);
  CHECK(tu_is_poison(q + H, 16), "%s: quantize_row wrote past q[%d]", what, H);
  CHECK(tu_is_poison(sc + nb, sizeof(float) * 4), "%s: quantize_row wrote past scales[%d]", what, nb);
  long bad_q = 0, bad_deq = 0;
  for (int b = 0; b < nb; b++) {
    const int c0 = b * EPX_FP8_BLOCK, c1 = c0 + EPX_FP8_BLOCK < H ? c0 + EPX_FP8_BLOCK : H;
    float amax = 0.0f;
    for (int c = c0; c < c1; c++) amax = fabsf(x[c]) > amax ? fabsf(x[c]) : amax;
    const float a = amax > 1e-4f ? amax : 1e-4f;
    const float want_scale = a / 448.0f, mul = 448.0f / a;
    CHECK(f2u(sc[b]) == f2u(want_scale), "%s: block %d scale %a, want %a (amax %a)", what, b, (double)sc[b],
          (double)want_scale, (double)amax);
    for (int c = c0; c < c1; c++) {
      const uint8_t want = ref_e4m3(x[c] * mul);
      if (!e4m3_same(q[c], want) && bad_q++ < 5)
        printf("  %s: q[%d] = 0x%02x want 0x%02x (x %a)\n", what, c, q[c], want, (double)x[c]);
      /* Dequantised: within half an e4m3 step (relative 2^-4), or a subnormal step. */
      const float deq = epx_e4m3_to_float(q[c]) * sc[b];
      if (fabsf(deq - x[c]) > fabsf(x[c]) * 0.0625f + want_scale * 0x1p-9f) bad_deq++;
    }
  }
  CHECK(bad_q == 0, "%s: %ld quantised codes differ from e4m3(x * 448 / a)", what, bad_q);
  CHECK(bad_deq == 0, "%s: %ld dequantised values are further than half a step from x", what, bad_deq);
  free(q);
  free(sc);
}

static void test_quantize(void) {
  static const int sizes[] = {16, 128, 129, 300, 1024};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    const int H = sizes[i];
    float *x = malloc(sizeof(float) * (size_t)H);
    char what[96];
    for (int c = 0; c < H; c++) x[c] = tu_value(&tu_rng);
    snprintf(what, sizeof what, "H=%d random", H);
    check_quantize(what, x, H);
    /* Second block (or the only one) all tiny: the 1e-4 floor decides the scale. */
    for (int c = 0; c < H; c++) x[c] = tu_value(&tu_rng);
    const int b = H > EPX_FP8_BLOCK ? 1 : 0;
    for (int c = b * EPX_FP8_BLOCK; c < H && c < (b + 1) * EPX_FP8_BLOCK; c++)
      x[c] = (tu_u64(&tu_rng) & 1 ? 1.0f : -1.0f) * ldexpf(1.0f + (float)tu_unit(&tu_rng), -17); /* < 2e-5 */
    snprintf(what, sizeof what, "H=%d block %d below the 1e-4 floor", H, b);
    check_quantize(what, x, H);
    /* The last (possibly partial) block with one large value and one exactly at amax. */
    for (int c = 0; c < H; c++) x[c] = tu_value(&tu_rng);
    x[H - 1] = -1000.0f;
    x[(H - 1) / EPX_FP8_BLOCK * EPX_FP8_BLOCK] = 999.0f;
    snprintf(what, sizeof what, "H=%d large last block", H);
    check_quantize(what, x, H);
    free(x);
  }
  /* A block exactly at the floor: amax == 1e-4f. */
  float x[32];
  for (int c = 0; c < 32; c++) x[c] = 1e-4f * (c % 2 ? -1.0f : 0.5f);
  check_quantize("H=32 amax == 1e-4", x, 32);
  /* NaNs are left out of amax, a signalling one too (glibc's fmaxf quiets it, and the max
   * would restart after it): the block's largest value first, then a signalling NaN, a quiet
   * negative one and a signalling one with a payload. */
  for (int c = 0; c < 32; c++) x[c] = tu_value(&tu_rng);
  x[0] = 100.0f;
  x[5] = u2f(0x7f800001u);
  x[9] = u2f(0xffc00001u);
  x[20] = u2f(0x7fa00000u);
  check_quantize("H=32 NaNs after the block maximum", x, 32);
  /* The block maximum lands on +-448. */
  uint8_t q[32];
  float sc[1];
  for (int c = 0; c < 32; c++) x[c] = tu_value(&tu_rng);
  x[7] = 50.0f;
  epx_quantize_row_e4m3(x, 32, q, sc);
  CHECK(q[7] == 0x7E, "the block maximum quantises to 448 (0x7E), got 0x%02x", (unsigned)q[7]);
}

static void test_dtype_info(void) {
  static const struct {
    epx_dtype_t t;
    size_t size;
  } d[] = {{EPX_FLOAT32, 4}, {EPX_BFLOAT16, 2}, {EPX_FP8_E4M3, 1}, {EPX_INT32, 4}, {EPX_INT64, 8}, {EPX_BOOL, 1}};
  const int n = (int)(sizeof d / sizeof d[0]);
  for (int i = 0; i < n; i++) {
    CHECK(epx_dtype_size(d[i].t) == d[i].size, "epx_dtype_size(%d) = %zu, want %zu", (int)d[i].t,
          epx_dtype_size(d[i].t), d[i].size);
    const char *name = epx_dtype_name(d[i].t);
    CHECK(name && *name, "epx_dtype_name(%d) is empty", (int)d[i].t);
    for (int j = 0; j < i && name; j++) {
      const char *other = epx_dtype_name(d[j].t);
      CHECK(!other || strcmp(name, other) != 0, "dtypes %d and %d share the name %s", i, j, name);
    }
  }
}

int main(void) {
  tu_begin("test_dtype");
  test_bf16();
  test_e4m3();
  test_quantize();
  test_dtype_info();
  return tu_end();
}
