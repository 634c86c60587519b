/* test_cuda_nodes: the CUDA backend runs a group of one node only. ranks_per_node < R is
 * refused at epx_comm_init with EPX_ERR_UNSUPPORTED on every rank (the core checks the
 * backend's capability), naming the setting; 0 and R are accepted. Skipped (77) without a GPU. */
#include <stdio.h>
#include <string.h>

#include "testutil.h"

enum { R = 4, SKIP = 77 };

typedef struct {
  epx_world_t *world;
  int ranks_per_node;
  epx_status_t st[R];
  char err[R][256];
} ctx_t;

static epx_status_t init_rank(int r, void *arg) {
  ctx_t *c = arg;
  epx_config_t cfg = tu_config(4 * R, 64, 4, 16);
  cfg.ranks_per_node = c->ranks_per_node;
  epx_comm_t *comm = NULL;
  c->st[r] = epx_comm_init(c->world, r, &cfg, &comm);
  snprintf(c->err[r], sizeof c->err[r], "%s", epx_last_error());
  epx_comm_destroy(comm);
  return c->st[r];
}

int main(void) {
  tu_begin("test_cuda_nodes");
  if (epx_backend_available(EPX_BACKEND_CUDA) != EPX_SUCCESS) {
    printf("skipped: %s\n", epx_last_error());
    return SKIP;
  }
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_CUDA;
  wc.nranks = R;
  ctx_t c;
  memset(&c, 0, sizeof c);
  if (!CHECK_STATUS(epx_world_create(&wc, &c.world), EPX_SUCCESS, "CUDA world of %d ranks", R)) return tu_end();
  const int settings[] = {2, 1, 0, R};
  for (size_t i = 0; i < sizeof settings / sizeof *settings; i++) {
    c.ranks_per_node = settings[i];
    epx_run_ranks(R, init_rank, &c, NULL);
    const epx_status_t want = settings[i] == 0 || settings[i] == R ? EPX_SUCCESS : EPX_ERR_UNSUPPORTED;
    for (int r = 0; r < R; r++) {
      CHECK_STATUS(c.st[r], want, "ranks_per_node %d, rank %d (%s)", settings[i], r, c.err[r]);
      if (want != EPX_SUCCESS)
        CHECK(tu_contains(c.err[r], "ranks_per_node"), "ranks_per_node %d, rank %d: the message does not name it: %s",
              settings[i], r, c.err[r]);
    }
  }
  epx_world_destroy(c.world);
  return tu_end();
}
