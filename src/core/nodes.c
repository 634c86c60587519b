/* Nodes: a group of R ranks in nodes of ranks_per_node (docs/design.md, "Nodes"). The plan
 * math every backend shares: the config rule, the capability check, the source side of the
 * node-aware combine and the count of what crosses a node boundary. */
#include <string.h>

#include "core/internal.h"

epx_status_t epxi_nodes_check_config(const epx_config_t *cfg, int nranks) {
  const int p = cfg->ranks_per_node;
  if (p < 0 || p > nranks)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "config.ranks_per_node %d outside [0, %d ranks]", p, nranks);
  if (p > 0 && nranks % p)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "config.ranks_per_node %d does not divide the group's %d ranks", p,
                     nranks);
  return EPX_SUCCESS;
}

int epxi_nodes_resolve(int ranks_per_node, int nranks) { return ranks_per_node > 0 ? ranks_per_node : nranks; }

epx_status_t epxi_nodes_supported(const epxi_backend_t *ops, const epx_config_t *cfg, int nranks) {
  const int p = epxi_nodes_resolve(cfg->ranks_per_node, nranks);
  if (p == nranks || ops->nodes) return EPX_SUCCESS;
  return epxi_fail(EPX_ERR_UNSUPPORTED,
                   "the %s backend runs a group of one node only: config.ranks_per_node %d makes %d nodes of %d ranks "
                   "(use the host backend, or ranks_per_node 0)",
                   ops->name, p, nranks / p, nranks);
}

void epxi_node_fold(float *acc, const float *sub, int hidden, epx_dtype_t crossing) {
  if (crossing == EPX_BFLOAT16)
    for (int c = 0; c < hidden; c++) acc[c] = acc[c] + epx_bf16_to_float(epx_float_to_bf16(sub[c]));
  else
    for (int c = 0; c < hidden; c++) acc[c] = acc[c] + sub[c];
}

void epxi_nodes_count(const epx_comm_t *comm, const int64_t *dest_row, int64_t num_tokens, int64_t *per_node,
                      int64_t *per_rank) {
  const int R = comm->nranks, P = comm->cfg.ranks_per_node, mine = epxi_node_of(comm, comm->rank);
  *per_node = *per_rank = 0;
  for (int64_t t = 0; t < num_tokens; t++) {
    const int64_t *row = dest_row + t * R;
    for (int n = 0; n < R / P; n++) {
      if (n == mine) continue;
      int ranks = 0;
      for (int d = n * P; d < (n + 1) * P; d++) ranks += row[d] >= 0;
      *per_node += ranks > 0;
      *per_rank += ranks;
    }
  }
}

epx_status_t epx_handle_node_traffic(const epx_handle_t *handle, epx_node_traffic_t *traffic) {
  epxi_clear_error();
  if (!handle || !traffic) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_handle_node_traffic: handle and traffic are required");
  *traffic = handle->traffic;
  return EPX_SUCCESS;
}
