/*
 * rng — the tests' random source: splitmix64, seeded from EPX_TEST_SEED (decimal) or the
 * clock by tu_begin, which prints the seed. tu_rng is for the main thread (rank threads get
 * their data prepared beforehand); tu_rng_stream gives the same numbers in every process of a
 * multi-process test for the same (seed, stream).
 */
#ifndef EPX_TEST_RNG_H
#define EPX_TEST_RNG_H

#include <stdint.h>

typedef struct {
  uint64_t s;
} tu_rng_t;
extern tu_rng_t tu_rng;
extern uint64_t tu_seed;

/* Sets tu_seed (EPX_TEST_SEED or the clock) and seeds tu_rng with it; tu_begin calls it. */
void tu_seed_init(void);
/* A generator of its own for stream `stream` of seed `seed`. */
tu_rng_t tu_rng_stream(uint64_t seed, uint64_t stream);

uint64_t tu_u64(tu_rng_t *g);
int tu_int(tu_rng_t *g, int lo, int hi); /* uniform in [lo, hi] */
double tu_unit(tu_rng_t *g);             /* uniform in [0, 1) */
float tu_value(tu_rng_t *g);             /* nonzero, both signs, magnitudes about 2^-6 .. 2^3 */
float tu_weight(tu_rng_t *g);            /* a router weight in (0.01, 1) */

#endif /* EPX_TEST_RNG_H */
