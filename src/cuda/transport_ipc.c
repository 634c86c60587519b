/* The CUDA IPC transport: ranks in processes of their own. A peer process can only reach
 * memory it mapped, once, at comm init: each rank's arena (arena.c, its state carved from it)
 * is exported, every peer's is mapped here, and the peers' addresses are translated by where
 * this process mapped their arenas (epxc_group_t.delta). The arena cannot grow: the peers
 * would not see the new memory. Rows peers would read from the caller's memory are copied
 * into the arena first (caller_memory = false). */
#include <stdio.h>
#include <string.h>

#include "cuda/backend.h"

/* What a rank tells the others about its arena: addresses in its process. */
typedef struct {
  cudaIpcMemHandle_t handle;
  uint64_t base, state;
  int32_t status, pad;
} ipc_card_t;

/* Unmaps the peers' arenas and frees this rank's. With `meet`, the ranks first wait for each
 * other (bounded), so that no arena is freed while a peer still maps it, which CUDA leaves
 * undefined. A broken group has nobody to meet: the arena goes anyway, as it would if the
 * process exited. */
static void ipc_unmap(epx_comm_t *c, cuda_comm_t *cc, bool meet) {
  for (int r = 0; r < c->nranks; r++)
    if (cc->mapped[r]) {
      cudaIpcCloseMemHandle(cc->mapped[r]);
      cc->mapped[r] = NULL;
    }
  if (meet && !epxi_group_broken(c->world->group) &&
      epxi_group_barrier(c->world->group, c->rank, "ipc teardown", c->cfg.timeout_ms) != EPX_SUCCESS)
    EPX_WARN("rank %d: freeing its cross-process arena without meeting the peers: %s", c->rank, epx_last_error());
  arena_free(&cc->arena);
  cc->state = NULL;
}

static void ipc_close(epx_comm_t *c, cuda_comm_t *cc) { ipc_unmap(c, cc, true); }

/* Across processes, collective: this rank's arena made (its state in it) and exported, every
 * peer's opened, the peer table filled. Every rank succeeds or every rank fails, and a
 * failure leaves nothing behind. */
static epx_status_t ipc_open(epx_comm_t *c, cuda_comm_t *cc, size_t bytes, bool growable) {
  (void)growable; /* never: the peers map the arena once */
  epxi_group_t *grp = c->world->group;
  const int R = c->nranks, me = c->rank;
  ipc_card_t mine, cards[EPX_MAX_RANKS];
  memset(&mine, 0, sizeof mine);
  char why[1024] = "";
  epx_status_t s = EPX_SUCCESS;
  char who[64];
  snprintf(who, sizeof who, "rank %d (across processes)", me);
  s = arena_make(&cc->arena, bytes, false, NULL, cc->device, who);
  if (s == EPX_SUCCESS) s = dev_alloc(cc, (void **)&cc->state, sizeof(epxc_state_t), cc->own_stream, "comm state");
  if (s == EPX_SUCCESS) {
    cudaError_t e = cudaMemsetAsync(cc->state, 0, sizeof(epxc_state_t), cc->own_stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cc->own_stream);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&mine.handle, cc->arena.chunk[0].base);
    if (e != cudaSuccess) s = cuda_fail(e, "exporting the cross-process arena (cudaIpcGetMemHandle)");
  }
  mine.status = s;
  mine.base = (uint64_t)(uintptr_t)cc->arena.chunk[0].base;
  mine.state = (uint64_t)(uintptr_t)cc->state;
  if (s != EPX_SUCCESS) snprintf(why, sizeof why, "%s", epx_last_error());
  epx_status_t x = epxi_group_allgather(grp, me, "comm_init:ipc", c->cfg.timeout_ms, &mine, sizeof mine, cards);
  int bad = x == EPX_SUCCESS ? first_failed(&cards[0].status, sizeof *cards, R) : -1;
  if (x != EPX_SUCCESS || bad >= 0) { /* nobody has mapped anything yet */
    ipc_unmap(c, cc, false);
    if (s != EPX_SUCCESS) return epxi_fail(s, "%s", why);
    if (x != EPX_SUCCESS) return x;
    return epxi_fail((epx_status_t)cards[bad].status, "rank %d: rank %d could not make its cross-process arena (%s)",
                     me, bad, epx_status_string((epx_status_t)cards[bad].status));
  }

  for (int r = 0; r < R && s == EPX_SUCCESS; r++) {
    if (r == me) {
      cc->group.state[r] = cc->state;
      cc->group.delta[r] = 0;
      continue;
    }
    /* the same GPU or a peer one: the lazy flag enables peer access as the mapping needs */
    const cudaError_t e = cudaIpcOpenMemHandle(&cc->mapped[r], cards[r].handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cc->mapped[r] = NULL;
      cudaGetLastError();
      s = epxi_fail(EPX_ERR_CUDA, "rank %d: could not map rank %d's cross-process arena (cudaIpcOpenMemHandle: %s)",
                    me, r, cudaGetErrorString(e));
      snprintf(why, sizeof why, "%s", epx_last_error());
      break;
    }
    cc->group.delta[r] = (int64_t)((uint64_t)(uintptr_t)cc->mapped[r] - cards[r].base);
    cc->group.state[r] = (epxc_state_t *)(uintptr_t)(cards[r].state + (uint64_t)cc->group.delta[r]);
  }
  int32_t vote = s, votes[EPX_MAX_RANKS];
  x = epxi_group_allgather(grp, me, "comm_init:ipc mapped", c->cfg.timeout_ms, &vote, sizeof vote, votes);
  bad = x == EPX_SUCCESS ? first_failed(votes, sizeof *votes, R) : -1;
  if (x != EPX_SUCCESS || bad >= 0) {
    ipc_unmap(c, cc, x == EPX_SUCCESS); /* every rank saw the same votes: all meet */
    if (s != EPX_SUCCESS) return epxi_fail(s, "%s", why);
    if (x != EPX_SUCCESS) return x;
    return epxi_fail((epx_status_t)votes[bad], "rank %d: rank %d could not map the peers' arenas (%s)", me, bad,
                     epx_status_string((epx_status_t)votes[bad]));
  }
  return EPX_SUCCESS;
}

const cuda_transport_t epxc_transport_ipc = {
    .name = "CUDA IPC",
    .caller_memory = false,
    .open = ipc_open,
    .close = ipc_close,
};
