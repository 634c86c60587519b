/* epx_get_layout on the CUDA backend against epx_layout_counts on the host, bit for bit: every
 * routing form (topk int32 / int64, the map), slots routed nowhere, every token on one expert
 * (the counters a block shares most), 0 and 1 tokens, token counts that are not a multiple of
 * the launch's threads, up to 4096 experts and 16 slots, SM budgets of 1 to 32, and each
 * output left out in turn. Outputs start poisoned, so a count never written shows. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuutil.h"

typedef struct {
  int R, E, K, num_sms;
  int64_t T;
  int form;       /* TU_FORM_TOPK32, _TOPK64 or _MAP, the same on every rank */
  int one_expert; /* >= 0: every token routes to this expert only */
} layout_case_t;

static const layout_case_t cases[] = {
    {8, 256, 8, 16, 4096, TU_FORM_TOPK32, -1},  {8, 256, 8, 16, 4095, TU_FORM_TOPK64, -1},
    {8, 256, 8, 16, 777, TU_FORM_MAP, -1},      {8, 256, 8, 16, 0, TU_FORM_TOPK32, -1},
    {8, 256, 8, 1, 1, TU_FORM_TOPK32, -1},      {8, 256, 8, 16, 32768, TU_FORM_TOPK32, -1},
    {4, 256, 8, 32, 4096, TU_FORM_TOPK32, 37},  {2, 8, 2, 4, 5000, TU_FORM_TOPK32, -1},
    {2, 8, 2, 3, 4096, TU_FORM_MAP, 0},         {4, 4096, 16, 16, 1500, TU_FORM_TOPK32, -1},
    {4, 4096, 16, 8, 300, TU_FORM_MAP, -1},     {16, 64, 12, 2, 2049, TU_FORM_TOPK64, -1},
};

static tu_moe_t moe;
static epx_world_t *world;

/* Rank r's routing in the case's form, copied to the device: the same routing with device
 * pointers. */
static epx_routing_t device_routing(const layout_case_t *c, int r, void **owned) {
  epx_routing_t rt = tu_routing(&moe, r, c->form);
  const int64_t T = c->T;
  if (c->form == TU_FORM_MAP) {
    rt.routing_map = *owned = gu_upload(1, moe.map[r], (size_t)T * c->E);
    rt.probs = NULL;
  } else {
    const size_t idx = c->form == TU_FORM_TOPK64 ? sizeof(int64_t) : sizeof(int32_t);
    rt.topk_idx = *owned = gu_upload(1, rt.topk_idx, (size_t)T * c->K * idx);
    rt.topk_weights = NULL;
  }
  return rt;
}

/* Case i leaves out output i % 4 (3: none). */
static epx_status_t rank_main(int r, void *arg) {
  const int i = *(const int *)arg;
  const layout_case_t *c = &cases[i];
  const int R = c->R, E = c->E;
  const int64_t T = c->T;
  epx_config_t cfg = tu_config(E, 128, c->K, T > 0 ? (int)T : 1);
  cfg.num_sms = c->num_sms;
  epx_comm_t *comm = NULL;
  const epx_status_t made = epx_comm_init(world, r, &cfg, &comm);
  CHECK(made == EPX_SUCCESS, "case %d rank %d: comm: %s", i, r, epx_last_error());
  if (made != EPX_SUCCESS) return made;

  void *owned = NULL;
  const epx_routing_t rt = device_routing(c, r, &owned);
  int32_t *tpr = i % 4 == 0 ? NULL : gu_alloc(1, sizeof(int32_t) * R); /* poisoned */
  int32_t *tpe = i % 4 == 1 ? NULL : gu_alloc(1, sizeof(int32_t) * E);
  uint8_t *in = i % 4 == 2 ? NULL : gu_alloc(1, (size_t)T * R);
  /* The uploads and the poison went to the legacy stream, which the comm's stream does not wait
     for; the layout waits on no peer, so waiting for the whole device here is safe. */
  cudaDeviceSynchronize();
  const epx_status_t st = epx_get_layout(comm, &rt, tpr, tpe, in);
  CHECK(st == EPX_SUCCESS, "case %d rank %d: epx_get_layout: %s", i, r, epx_last_error());
  CHECK(epx_comm_synchronize(comm) == EPX_SUCCESS, "case %d rank %d: synchronize: %s", i, r, epx_last_error());

  int32_t *want_tpr = calloc((size_t)R, sizeof(int32_t)), *want_tpe = calloc((size_t)E, sizeof(int32_t));
  uint8_t *want_in = calloc((size_t)T * R + 1, 1);
  const epx_routing_t host = tu_routing(&moe, r, c->form);
  CHECK(epx_layout_counts(R, E, c->K, &host, want_tpr, want_tpe, want_in) == EPX_SUCCESS, "case %d: host counts: %s",
        i, epx_last_error());
  char what[96];
  if (tpr) {
    int32_t *got = gu_host_copy(1, tpr, sizeof(int32_t) * R);
    snprintf(what, sizeof what, "case %d rank %d tokens_per_rank", i, r);
    CHECK_BITS(what, EPX_INT32, got, want_tpr, R, R);
    free(got);
  }
  if (tpe) {
    int32_t *got = gu_host_copy(1, tpe, sizeof(int32_t) * E);
    snprintf(what, sizeof what, "case %d rank %d tokens_per_expert", i, r);
    CHECK_BITS(what, EPX_INT32, got, want_tpe, E, E);
    free(got);
  }
  if (in && T > 0) {
    uint8_t *got = gu_host_copy(1, in, (size_t)T * R);
    const int64_t at = tu_first_diff(got, want_in, 1, T * R);
    CHECK(at < 0, "case %d rank %d: is_token_in_rank differs at %lld", i, r, (long long)at);
    free(got);
  }
  free(want_tpr), free(want_tpe), free(want_in);
  gu_free(1, owned), gu_free(1, tpr), gu_free(1, tpe), gu_free(1, in);
  epx_comm_destroy(comm);
  return EPX_SUCCESS;
}

static void run_case(int i) {
  const layout_case_t *c = &cases[i];
  int64_t T[TU_MAX_RANKS];
  for (int r = 0; r < c->R; r++) T[r] = c->T;
  tu_route_opts_t o = tu_route_default();
  o.one_expert = c->one_expert;
  tu_moe_random(&moe, &tu_rng, c->R, c->E, 8, c->K, EPX_BFLOAT16, T, &o, 1);
  if (c->form == TU_FORM_MAP) tu_moe_make_map(&moe);
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_CUDA;
  wc.nranks = c->R;
  CHECK(epx_world_create(&wc, &world) == EPX_SUCCESS, "case %d: world: %s", i, epx_last_error());
  if (world) epx_run_ranks(c->R, rank_main, &i, NULL);
  printf("case %d: R=%d E=%d K=%d T=%lld sms=%d form=%d one_expert=%d\n", i, c->R, c->E, c->K, (long long)c->T,
         c->num_sms, c->form, c->one_expert);
  epx_world_destroy(world);
  tu_moe_free(&moe);
}

int main(void) {
  tu_begin("test_cuda_layout");
  if (!gu_have_gpu()) return GU_SKIP;
  for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) run_case(i);
  return tu_end();
}
