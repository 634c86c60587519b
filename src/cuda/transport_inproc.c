/* The in-process transport: every rank of the group is a thread of this process, so peers
 * reach each other's memory at the addresses it has (one address space; ranks on other GPUs
 * of the process through peer access, enabled with the world): delta is 0, and peers read the
 * caller's own rows in place. Each rank's arena and its exchange state are plain cudaMalloc'd
 * device memory, which compute-sanitizer follows across ranks. */
#include <stdio.h>

#include "cuda/backend.h"

/* What a rank tells the others: where its state is, and whether it got its memory. */
typedef struct {
  uint64_t state;
  int32_t status, pad;
} inproc_card_t;

/* The state is a small allocation of its own, beside the arena: after a failure a late peer
 * may still post to it, so it is then kept (inproc_close) while the arena goes. */
static epx_status_t state_make(cuda_comm_t *cc) {
  cudaError_t e = cudaMalloc((void **)&cc->state, sizeof(epxc_state_t));
  if (e == cudaSuccess) e = cudaMemsetAsync(cc->state, 0, sizeof(epxc_state_t), cc->own_stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(cc->own_stream);
  if (e == cudaSuccess) return EPX_SUCCESS;
  if (cc->state) cudaFree(cc->state);
  cc->state = NULL;
  cudaGetLastError();
  return cuda_fail(e, "comm state");
}

static epx_status_t inproc_open(epx_comm_t *c, cuda_comm_t *cc, size_t bytes, bool growable) {
  const int R = c->nranks, me = c->rank;
  char who[64];
  snprintf(who, sizeof who, "rank %d", me);
  epx_status_t s = arena_make(&cc->arena, bytes, growable, who);
  if (s == EPX_SUCCESS) s = state_make(cc);
  char why[1024] = "";
  if (s != EPX_SUCCESS) snprintf(why, sizeof why, "%s", epx_last_error());
  inproc_card_t mine = {.state = (uint64_t)(uintptr_t)cc->state, .status = s}, cards[EPX_MAX_RANKS];
  const epx_status_t x =
      epxi_group_allgather(c->world->group, me, "comm_init:cuda", c->cfg.timeout_ms, &mine, sizeof mine, cards);
  const int bad = x == EPX_SUCCESS ? first_failed(&cards[0].status, sizeof *cards, R) : -1;
  if (x != EPX_SUCCESS || bad >= 0) {
    arena_free(&cc->arena);
    /* every rank saw the same cards: nobody posts to this state; after a failed allgather a
     * peer may have it already: keep it (a few KB) */
    if (x == EPX_SUCCESS && cc->state) cudaFree(cc->state);
    cc->state = NULL;
    if (s != EPX_SUCCESS) return epxi_fail(s, "%s", why);
    if (x != EPX_SUCCESS) return x;
    return epxi_fail((epx_status_t)cards[bad].status, "rank %d: rank %d could not make its arena (%s)", me, bad,
                     epx_status_string((epx_status_t)cards[bad].status));
  }
  for (int r = 0; r < R; r++) {
    cc->group.state[r] = (epxc_state_t *)(uintptr_t)cards[r].state;
    cc->group.delta[r] = 0;
  }
  return EPX_SUCCESS;
}

/* After a healthy run every post to this rank was consumed by one of its own exchanges, so
 * its state can go; after a failure it is kept, so no new comm gets memory a late peer may
 * still post to. Freeing the arena synchronises this GPU: the peers on it finish reading it
 * first (a low-latency peer may still be reading what this rank's last call staged). */
static void inproc_close(epx_comm_t *c, cuda_comm_t *cc) {
  const int status = ((volatile epxc_error_t *)((cuda_world_t *)c->world->impl)->errors_host)[c->rank].status;
  arena_free(&cc->arena);
  if (!c->broken && !fatal_status(status) && cc->state) cudaFree(cc->state);
  cc->state = NULL;
}

const cuda_transport_t epxc_transport_inproc = {
    .name = "in-process",
    .caller_memory = true,
    .open = inproc_open,
    .close = inproc_close,
};
