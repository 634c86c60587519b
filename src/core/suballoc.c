/* A first-fit range allocator: the host-side bookkeeping of a block of memory carved by hand.
 * The CUDA backend carves its cross-process arena with it (peers can only reach memory they
 * mapped once, at comm init, so every buffer they read is a range of that one allocation).
 *
 * The ranges cover [0, size) in address order, each free or in use; neighbouring free ranges
 * are merged when one is freed, so a buffer that grows (free, then allocate larger) finds the
 * space it left. Few ranges live at once (a handful per handle), so linear scans do. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

static int reserve(epxi_suballoc_t *a, int n) {
  if (n <= a->cap) return 0;
  int cap = a->cap ? a->cap * 2 : 16;
  while (cap < n) cap *= 2;
  epxi_range_t *r = realloc(a->range, sizeof *r * (size_t)cap);
  if (!r) return -1;
  a->range = r;
  a->cap = cap;
  return 0;
}

int epxi_suballoc_init(epxi_suballoc_t *a, size_t size, size_t align) {
  memset(a, 0, sizeof *a);
  if (align == 0 || (align & (align - 1)) || size == 0) return -1;
  a->size = size;
  a->align = align;
  if (reserve(a, 1)) return -1;
  a->range[0] = (epxi_range_t){.off = 0, .len = size, .used = false};
  a->n = 1;
  return 0;
}

void epxi_suballoc_destroy(epxi_suballoc_t *a) {
  free(a->range);
  memset(a, 0, sizeof *a);
}

size_t epxi_suballoc_alloc(epxi_suballoc_t *a, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes > a->size) return EPXI_SUBALLOC_FULL;
  const size_t need = (bytes + a->align - 1) & ~(a->align - 1);
  for (int i = 0; i < a->n; i++) {
    epxi_range_t *r = &a->range[i];
    if (r->used || r->len < need) continue;
    if (r->len > need) { /* split: the rest stays free, right after */
      if (reserve(a, a->n + 1)) return EPXI_SUBALLOC_FULL;
      r = &a->range[i];
      memmove(&a->range[i + 2], &a->range[i + 1], sizeof *r * (size_t)(a->n - i - 1));
      a->range[i + 1] = (epxi_range_t){.off = r->off + need, .len = r->len - need, .used = false};
      a->n++;
      r->len = need;
    }
    r->used = true;
    a->in_use += r->len;
    return r->off;
  }
  return EPXI_SUBALLOC_FULL;
}

int epxi_suballoc_free(epxi_suballoc_t *a, size_t off) {
  int i = 0;
  while (i < a->n && a->range[i].off != off) i++;
  if (i == a->n || !a->range[i].used) return -1;
  a->range[i].used = false;
  a->in_use -= a->range[i].len;
  if (i + 1 < a->n && !a->range[i + 1].used) { /* merge the next one into this one */
    a->range[i].len += a->range[i + 1].len;
    memmove(&a->range[i + 1], &a->range[i + 2], sizeof *a->range * (size_t)(a->n - i - 2));
    a->n--;
  }
  if (i > 0 && !a->range[i - 1].used) { /* and this one into the one before */
    a->range[i - 1].len += a->range[i].len;
    memmove(&a->range[i], &a->range[i + 1], sizeof *a->range * (size_t)(a->n - i - 1));
    a->n--;
  }
  return 0;
}
