/* The range allocator that carves the CUDA backend's cross-process arena (src/core/suballoc.c,
 * compiled into this test: it is internal to libepx). Ranges are aligned, never overlap, stay
 * inside the arena; freeing merges neighbours, so a growing buffer finds its old space; a
 * random workload against a byte map of who owns what. */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

enum { SIZE = 1 << 16, ALIGN = 256, SLOTS = 40 };

int main(void) {
  tu_begin("test_suballoc");
  epxi_suballoc_t a;
  CHECK(epxi_suballoc_init(&a, SIZE, 3) == -1, "an alignment that is not a power of two is refused");
  CHECK(epxi_suballoc_init(&a, 0, ALIGN) == -1, "an empty arena is refused");
  CHECK(epxi_suballoc_init(&a, SIZE, ALIGN) == 0, "init");

  { /* basics: first fit, alignment, exhaustion, merging */
    size_t x = epxi_suballoc_alloc(&a, 1), y = epxi_suballoc_alloc(&a, 300), z = epxi_suballoc_alloc(&a, 0);
    CHECK(x == 0 && y == ALIGN && z == 3 * ALIGN, "first fit in address order: %zu %zu %zu", x, y, z);
    CHECK(a.in_use == 4 * ALIGN, "in use %zu", a.in_use);
    CHECK(epxi_suballoc_alloc(&a, SIZE) == EPXI_SUBALLOC_FULL, "more than is left is refused");
    CHECK(epxi_suballoc_free(&a, y + 1) == -1, "freeing an offset no range starts at is refused");
    CHECK(epxi_suballoc_free(&a, y) == 0 && epxi_suballoc_free(&a, y) == -1, "a range is freed once");
    CHECK(epxi_suballoc_alloc(&a, 2 * ALIGN) == y, "the hole is reused");
    CHECK(epxi_suballoc_free(&a, y) == 0 && epxi_suballoc_free(&a, x) == 0 && epxi_suballoc_free(&a, z) == 0, "free");
    CHECK(a.n == 1 && a.in_use == 0, "everything merged back into one free range (%d ranges)", a.n);
    CHECK(epxi_suballoc_alloc(&a, SIZE) == 0, "the whole arena at once");
    CHECK(epxi_suballoc_free(&a, 0) == 0, "free");
  }
  { /* a buffer that grows, between two others, finds the space it left plus the free tail */
    size_t p = epxi_suballoc_alloc(&a, 1000), q = epxi_suballoc_alloc(&a, 1000);
    CHECK(epxi_suballoc_free(&a, p) == 0, "free");
    size_t bigger = epxi_suballoc_alloc(&a, 4000);
    CHECK(bigger != EPXI_SUBALLOC_FULL && bigger > q, "grown past its neighbour: %zu", bigger);
    size_t small = epxi_suballoc_alloc(&a, 500);
    CHECK(small == p, "the old space is reused first: %zu", small);
    epxi_suballoc_free(&a, q), epxi_suballoc_free(&a, bigger), epxi_suballoc_free(&a, small);
    CHECK(a.n == 1 && a.in_use == 0, "merged back (%d ranges)", a.n);
  }
  { /* random workload: owners never overlap, everything stays in bounds */
    unsigned char *owner = calloc(SIZE, 1);
    size_t off[SLOTS], len[SLOTS];
    for (int i = 0; i < SLOTS; i++) off[i] = EPXI_SUBALLOC_FULL;
    int bad = 0, refused = 0;
    for (int step = 0; step < 20000; step++) {
      int i = tu_int(&tu_rng, 0, SLOTS - 1);
      if (off[i] != EPXI_SUBALLOC_FULL) {
        memset(owner + off[i], 0, len[i]);
        bad += epxi_suballoc_free(&a, off[i]) != 0;
        off[i] = EPXI_SUBALLOC_FULL;
        continue;
      }
      len[i] = (size_t)tu_int(&tu_rng, 1, SIZE / 8);
      off[i] = epxi_suballoc_alloc(&a, len[i]);
      if (off[i] == EPXI_SUBALLOC_FULL) {
        refused++;
        continue;
      }
      bad += off[i] % ALIGN != 0 || off[i] + len[i] > SIZE;
      for (size_t b = 0; b < len[i] && off[i] + b < SIZE; b++) bad += owner[off[i] + b] != 0;
      memset(owner + off[i], i + 1, len[i]);
    }
    CHECK(bad == 0, "%d overlaps, misalignments or out-of-bounds ranges", bad);
    CHECK(refused > 0, "the workload never filled the arena (no refusal seen)");
    for (int i = 0; i < SLOTS; i++)
      if (off[i] != EPXI_SUBALLOC_FULL) epxi_suballoc_free(&a, off[i]);
    CHECK(a.n == 1 && a.in_use == 0, "all freed: one free range (%d ranges, %zu in use)", a.n, a.in_use);
    free(owner);
  }
  epxi_suballoc_destroy(&a);
  return tu_end();
}
