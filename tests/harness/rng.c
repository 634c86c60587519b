/* rng — see rng.h. */
#define _GNU_SOURCE
#include "rng.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

tu_rng_t tu_rng;
uint64_t tu_seed;

void tu_seed_init(void) {
  const char *env = getenv("EPX_TEST_SEED");
  if (env && *env) {
    tu_seed = strtoull(env, NULL, 10);
  } else {
    /* the process id too: tests started in the same instant get different seeds */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    tu_seed = ((uint64_t)ts.tv_sec * 1000003u) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    tu_seed %= 1000000000u;
  }
  tu_rng.s = tu_seed;
}

tu_rng_t tu_rng_stream(uint64_t seed, uint64_t stream) {
  tu_rng_t g = {seed * 0x9E3779B97F4A7C15ull + stream * 0xBF58476D1CE4E5B9ull + 1};
  return g;
}

/* splitmix64 */
uint64_t tu_u64(tu_rng_t *g) {
  uint64_t z = (g->s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int tu_int(tu_rng_t *g, int lo, int hi) { return lo + (int)(tu_u64(g) % (uint64_t)(hi - lo + 1)); }

double tu_unit(tu_rng_t *g) { return (double)(tu_u64(g) >> 11) * (1.0 / 9007199254740992.0); }

float tu_value(tu_rng_t *g) {
  /* mantissa in [1, 2), exponent -6..3, random sign: never zero, never tiny. */
  float m = 1.0f + (float)tu_unit(g);
  float v = ldexpf(m, tu_int(g, -6, 3));
  return (tu_u64(g) & 1) ? -v : v;
}

float tu_weight(tu_rng_t *g) { return 0.01f + 0.99f * (float)tu_unit(g); }
