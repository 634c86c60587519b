/* A whole MoE layer's communication on 4 ranks (threads, CPU backend): dispatch into the
 * expert layout, a stand-in expert, weighted combine. Built and run by the tests. */
#include <epx.h>
#include <stdio.h>
#include <stdlib.h>

enum { R = 4, T = 16, H = 32, E = 8, K = 2 };

static epx_world_t *world;

static epx_status_t layer(int rank, void *arg) {
  (void)arg;
  float x[T * H], out[T * H], w[T * K], recv[R * T * K * H], probs[R * T * K];
  int32_t idx[T * K];
  for (int i = 0; i < T * H; i++) x[i] = (float)(rank + 1) * 0.25f + (float)(i % 7);
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) idx[t * K + k] = (t + rank + 3 * k) % E, w[t * K + k] = 0.5f;

  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = E, cfg.hidden = H, cfg.topk = K, cfg.max_tokens_per_rank = T;
  epx_comm_t *comm;
  epx_status_t s = epx_comm_init(world, rank, &cfg, &comm); /* collective: configs compared */
  if (s != EPX_SUCCESS) return s;
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  hc.layout = EPX_LAYOUT_EXPERT; /* rows grouped by local expert, for a grouped GEMM */
  epx_handle_t *h;
  s = epx_handle_create(comm, &hc, &h);

  epx_routing_t route = {.num_tokens = T, .idx_dtype = EPX_INT32, .topk_idx = idx, .topk_weights = w};
  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = x, d.x_dtype = d.recv_dtype = EPX_FLOAT32;
  d.recv_x = recv, d.recv_capacity = R * T * K, d.recv_probs = probs;
  if (s == EPX_SUCCESS) s = epx_dispatch(comm, h, &route, &d); /* plans, then moves */

  epx_handle_info_t info;
  if (s == EPX_SUCCESS) s = epx_handle_info(h, &info, NULL);
  for (int64_t i = 0; s == EPX_SUCCESS && i < info.num_recv_rows * H; i++) recv[i] *= 2.0f; /* the experts */

  epx_combine_args_t c;
  epx_combine_args_init(&c);
  c.y = recv, c.y_dtype = c.out_dtype = EPX_FLOAT32, c.out = out; /* weighted by the routing */
  if (s == EPX_SUCCESS) s = epx_combine(comm, h, &c);
  for (int i = 0; s == EPX_SUCCESS && i < T * H; i++) /* both experts doubled x: 2 * (0.5 + 0.5) * x */
    if (out[i] != 2.0f * x[i]) s = EPX_ERR_INTERNAL;
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  return s;
}

int main(void) {
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST, wc.nranks = R;
  epx_status_t s = epx_world_create(&wc, &world);
  if (s == EPX_SUCCESS) s = epx_run_ranks(R, layer, NULL, NULL);
  printf("minimal: %s%s%s\n", epx_status_string(s), s ? " " : "", s ? epx_last_error() : "");
  epx_world_destroy(world);
  return s != EPX_SUCCESS;
}
