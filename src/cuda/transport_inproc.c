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

/* The state is a small block of its own, beside the arena: after a failure a late peer may
 * still post to it, so it is then never reused (inproc_close), while the arena is. */
static epx_status_t state_make(cuda_world_t *cw, cuda_comm_t *cc) {
  size_t got = 0;
  cudaError_t e = cudaSuccess;
  cc->state = world_block_take(cw, cc->device, sizeof(epxc_state_t), &got, &e);
  if (e == cudaSuccess) e = cudaMemsetAsync(cc->state, 0, sizeof(epxc_state_t), cc->own_stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(cc->own_stream);
  if (e == cudaSuccess) return EPX_SUCCESS;
  if (cc->state) world_block_give(cw, cc->device, cc->state, got);
  cc->state = NULL;
  cudaGetLastError();
  return cuda_fail(e, "comm state");
}

static epx_status_t inproc_open(epx_comm_t *c, cuda_comm_t *cc, size_t bytes, bool growable) {
  const int R = c->nranks, me = c->rank;
  char who[64];
  snprintf(who, sizeof who, "rank %d", me);
  cuda_world_t *cw = c->world->impl;
  epx_status_t s = arena_make(&cc->arena, bytes, growable, cw, cc->device, who);
  if (s == EPX_SUCCESS) s = state_make(cw, cc);
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
    if (x == EPX_SUCCESS && cc->state) world_block_give(cw, cc->device, cc->state, sizeof(epxc_state_t));
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

/* Nothing is freed (cudaFree would synchronise the GPU while peers may be inside an
 * operation): the arena and the state are kept by the world for the next comm. After a
 * healthy run every post to this rank was consumed by one of its own exchanges, so the state
 * may be reused; after a failure a late peer may still post to it, so it is left alone (a few
 * KB, until exit). The arena peers only read; a later comm's writes to it come after its
 * collective init, which every rank reaches only once its own work on this comm is done. */
static void inproc_close(epx_comm_t *c, cuda_comm_t *cc) {
  cuda_world_t *cw = c->world->impl;
  const int status = ((volatile epxc_error_t *)cw->errors_host)[c->rank].status;
  arena_free(&cc->arena);
  if (!c->broken && !fatal_status(status)) world_block_give(cw, cc->device, cc->state, sizeof(epxc_state_t));
  cc->state = NULL;
}

const cuda_transport_t epxc_transport_inproc = {
    .name = "in-process",
    .caller_memory = true,
    .open = inproc_open,
    .close = inproc_close,
};
