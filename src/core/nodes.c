/* Nodes: a group of R ranks in nodes of ranks_per_node (docs/design.md, "Nodes"). What
 * every backend shares: the config rule, the capability check and the traffic report. The
 * host backend's node path is host/nodes.c. */
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

epx_status_t epx_handle_node_traffic(const epx_handle_t *handle, epx_node_traffic_t *traffic) {
  epxi_clear_error();
  if (!handle || !traffic) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_handle_node_traffic: handle and traffic are required");
  EPX_CHECK(epxi_handle_take(handle, "epx_handle_node_traffic"));
  *traffic = handle->traffic;
  return epxi_handle_give(handle, EPX_SUCCESS);
}
