/* The group's calls, dispatched to its implementation (inproc.c, shm.c). */
#include <string.h>

#include "core/internal.h"

static epx_status_t check_rank(const epxi_group_t *g, int rank, const char *phase) {
  if (rank < g->first_rank || rank >= g->first_rank + g->num_local)
    return epxi_fail(EPX_ERR_INTERNAL, "phase %s: rank %d is not driven by this process's %s group (ranks [%d, %d))",
                     phase, rank, g->ops->name, g->first_rank, g->first_rank + g->num_local);
  return EPX_SUCCESS;
}

void epxi_group_destroy(epxi_group_t *g) {
  if (g) g->ops->destroy(g);
}

bool epxi_group_broken(const epxi_group_t *g) { return g->ops->broken(g); }

void *epxi_group_common(epxi_group_t *g, size_t *bytes) {
  *bytes = 0;
  return g->ops->common ? g->ops->common(g, bytes) : NULL;
}

bool epxi_group_peer_lost(const epxi_group_t *g, int rank) {
  return g->ops->peer_lost && rank >= 0 && rank < g->nranks && g->ops->peer_lost(g, rank);
}

void epxi_group_abort(epxi_group_t *g, int rank) { g->ops->abort(g, rank); }

epx_status_t epxi_group_error(const epxi_group_t *g, int rank, char *why, size_t size) {
  why[0] = '\0';
  return g->ops->error(g, rank, why, size);
}

epx_status_t epxi_group_barrier(epxi_group_t *g, int rank, const char *phase, int timeout_ms) {
  EPX_CHECK(check_rank(g, rank, phase));
  return g->ops->barrier(g, rank, phase, timeout_ms);
}

epx_status_t epxi_group_share(epxi_group_t *g, int rank, const char *phase, int timeout_ms, const void *mine,
                              size_t bytes, const void **all) {
  EPX_CHECK(check_rank(g, rank, phase));
  return g->ops->share(g, rank, phase, timeout_ms, mine, bytes, all);
}

epx_status_t epxi_group_allgather(epxi_group_t *g, int rank, const char *phase, int timeout_ms, const void *mine,
                                  size_t bytes, void *all) {
  const void *ptrs[EPX_MAX_RANKS];
  EPX_CHECK(epxi_group_share(g, rank, phase, timeout_ms, mine, bytes, ptrs));
  for (int r = 0; r < g->nranks; r++)
    if (bytes) memcpy((char *)all + r * bytes, ptrs[r], bytes);
  /* The shared data must outlive the peers' copies. */
  return epxi_group_barrier(g, rank, phase, timeout_ms);
}
