/* test_mp_pipeline: 1, 2, 4 and 8 processes (one rank each, host backend), bootstrapped through
 * a unique id and through a caller's allgather, run random routings through notify, dispatch
 * and combine in the token layout, the expert layout and low-latency mode; every rank
 * compares its combine output bit for bit with dense_moe, which each process computes for
 * the whole group from the shared seed; groups of 4 and 6 processes also in nodes of 2 and 3
 * (node-aware combine order). Also: descriptors and /dev/shm are as before. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mp_util.h"

typedef struct {
  const char *name;
  epx_algo_t algo;
  epx_layout_t layout;
  int align;
  epx_dtype_t x, recv, y, out;
  int idx64; /* routing ids as int64 */
} scenario_t;

static const scenario_t scenarios[] = {
    {"HT token bf16", EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, 0},
    {"HT token f32 (int64 ids)", EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, EPX_FLOAT32, 1},
    {"HT expert align 8, out f32", EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 8, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16,
     EPX_FLOAT32, 0},
    {"HT expert fp8 dispatch", EPX_ALGO_HT, EPX_LAYOUT_EXPERT, 4, EPX_BFLOAT16, EPX_FP8_E4M3, EPX_BFLOAT16,
     EPX_BFLOAT16, 0},
    {"all-to-all token bf16", EPX_ALGO_ALLTOALL, EPX_LAYOUT_TOKEN, 1, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16,
     EPX_BFLOAT16, 0},
    {"LL bf16", EPX_ALGO_LL, EPX_LAYOUT_EXPERT, 1, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, EPX_BFLOAT16, 0},
    {"LL fp8", EPX_ALGO_LL, EPX_LAYOUT_EXPERT, 1, EPX_BFLOAT16, EPX_FP8_E4M3, EPX_BFLOAT16, EPX_FLOAT32, 1},
};
#define NSCEN ((int)(sizeof scenarios / sizeof scenarios[0]))
#define ROUTINGS 2 /* per scenario, on one handle: the second is a re-plan */

typedef struct {
  int R, L, H, K, max_tokens;
  int ranks_per_node; /* 0: one node */
} shape_t;

/* What one routing's run on this rank received, and the combine's outputs. */
typedef struct {
  int64_t rows, nrows;
  void *recv_x;
  float *recv_scales, *recv_w, *recv_probs;
  int32_t *recv_idx, cnt[64];
} recv_t;

/* The combine of what arrived (through stand-in experts), weighted, with row weight
 * gradients of twice the delivered weight: each source must get 2 * w back in every slot
 * that routed somewhere (a second share before combine's barrier), and dense_moe's output. */
static void combine_and_check(const scenario_t *sc, const shape_t *sh, epx_comm_t *comm, epx_handle_t *h,
                              const tu_moe_t *m, int me, const recv_t *rv, const char *what) {
  const int L = sh->L, H = sh->H, K = sh->K;
  const bool ll = sc->algo == EPX_ALGO_LL, expert = ll || sc->layout == EPX_LAYOUT_EXPERT;
  const int64_t T = m->T[me], rows = rv->rows;
  void *y = calloc((size_t)(rows * H) * epx_dtype_size(sc->y) + 1, 1);
  if (!expert)
    tu_expert_token_layout(me, L, H, K, rows, sc->recv, rv->recv_x, rv->recv_scales, rv->recv_idx, rv->recv_w, sc->y, y);
  else
    tu_expert_rows(me, L, H, sc->recv, rv->recv_x, rv->recv_scales, rv->cnt, ll ? 1 : sc->align,
                   ll ? (int64_t)sh->R * sh->max_tokens : 0, rows, sc->y, y);

  void *out = malloc((size_t)(T * H) * epx_dtype_size(sc->out) + 1);
  memset(out, 0x7f, (size_t)(T * H) * epx_dtype_size(sc->out) + 1);
  const int64_t nwg = expert ? rows : rows * K;
  float *row_wg = malloc(sizeof(float) * (size_t)nwg + 1);
  for (int64_t i = 0; i < nwg; i++) row_wg[i] = 2.0f * (expert ? rv->recv_probs[i] : rv->recv_w[i]);
  float *topk_wg = malloc(sizeof(float) * (size_t)(T * K) + 1);
  epx_combine_args_t ca;
  epx_combine_args_init(&ca);
  ca.y = y, ca.y_dtype = sc->y, ca.out = out, ca.out_dtype = sc->out, ca.weighted = 1;
  ca.row_weight_grad = row_wg, ca.topk_weight_grad = topk_wg;
  if (CHECK_STATUS(epx_combine(comm, h, &ca), EPX_SUCCESS, "%s: combine", what)) {
    int64_t bad = -1;
    for (int64_t i = 0; i < T * K && bad < 0; i++)
      if (topk_wg[i] != (m->idx[me][i] < 0 ? 0.0f : 2.0f * m->w[me][i])) bad = i;
    CHECK(bad < 0, "%s: topk_weight_grad of token %lld slot %lld is %g, want %g", what, (long long)(bad / K),
          (long long)(bad % K), bad < 0 ? 0.0 : topk_wg[bad],
          bad < 0 ? 0.0 : (m->idx[me][bad] < 0 ? 0.0 : 2.0 * m->w[me][bad]));
    void *want[TU_MAX_RANKS];
    tu_dense(m, sc->recv, sc->y, sc->out, expert, (const float *const *)m->w, want);
    char w2[400];
    snprintf(w2, sizeof w2, "%s: combine output against dense_moe", what);
    CHECK_BITS(w2, sc->out, out, want[me], T * H, H);
    tu_free_all(want, m->R);
  }
  free(row_wg), free(topk_wg);
  free(out);
  free(y);
}

/* One routing on the handle: notify, the plan's sizes against the routing, the dispatch
 * (routing 0 replays notify's plan, routing 1 plans inside the dispatch), then the combine.
 * Returns 0 when notify and dispatch succeeded. */
static int run_routing(const scenario_t *sc, const shape_t *sh, epx_comm_t *comm, epx_handle_t *h, int me, int si,
                       int it, const char *tag) {
  const int R = sh->R, L = sh->L, H = sh->H, K = sh->K;
  const bool ll = sc->algo == EPX_ALGO_LL, expert = ll || sc->layout == EPX_LAYOUT_EXPERT;
  tu_moe_t m;
  tu_moe_stream(&m, tu_seed, (uint64_t)(si * 16 + it), R, R * L, H, K, sc->x, sh->max_tokens);
  m.ranks_per_node = ll ? 0 : sh->ranks_per_node; /* low-latency combines in the flat order */
  const int64_t T = m.T[me];
  epx_routing_t rt = tu_routing(&m, me, sc->idx64 ? TU_FORM_TOPK64 : TU_FORM_TOPK32);
  char what[300];
  snprintf(what, sizeof what, "%s %s, routing %d (T=%lld)", tag, sc->name, it, (long long)T);
  if (!CHECK_STATUS(epx_notify(comm, h, &rt), EPX_SUCCESS, "%s: notify", what)) {
    tu_moe_free(&m);
    return -1;
  }
  epx_handle_info_t info;
  int32_t info_cnt[64];
  CHECK_STATUS(epx_handle_info(h, &info, info_cnt), EPX_SUCCESS, "%s: handle_info", what);
  tu_expect_t ex;
  tu_expect(&m, me, 1, &ex);
  CHECK(info.num_send_tokens == T, "%s: num_send_tokens %lld", what, (long long)info.num_send_tokens);
  CHECK(info.num_recv_tokens == ex.ntok, "%s: num_recv_tokens %lld, want %lld", what, (long long)info.num_recv_tokens,
        (long long)ex.ntok);
  CHECK(info.num_recv_pairs == ex.npairs, "%s: num_recv_pairs %lld, want %lld", what, (long long)info.num_recv_pairs,
        (long long)ex.npairs);
  char w2[400];
  snprintf(w2, sizeof w2, "%s: handle_info's tokens_per_local_expert", what);
  CHECK_BITS(w2, EPX_INT32, info_cnt, ex.cnt, L, L);

  recv_t rv = {.rows = ll ? (int64_t)L * R * sh->max_tokens : info.num_recv_rows, .nrows = -1};
  const int nb = tu_nblocks(H);
  rv.recv_x = calloc((size_t)(rv.rows * H) * epx_dtype_size(sc->recv) + 1, 1);
  rv.recv_scales = calloc((size_t)(rv.rows * nb) + 1, sizeof(float));
  rv.recv_idx = calloc((size_t)(rv.rows * K) + 1, sizeof(int32_t));
  rv.recv_w = calloc((size_t)(rv.rows * K) + 1, sizeof(float));
  rv.recv_probs = calloc((size_t)rv.rows + 1, sizeof(float));
  epx_dispatch_args_t da;
  epx_dispatch_args_init(&da);
  da.x = m.x[me];
  da.x_dtype = sc->x;
  da.recv_dtype = sc->recv;
  da.recv_x = rv.recv_x;
  da.recv_scales = sc->recv == EPX_FP8_E4M3 ? rv.recv_scales : NULL;
  da.recv_capacity = rv.rows;
  da.recv_topk_idx = expert ? NULL : rv.recv_idx;
  da.recv_topk_weights = expert ? NULL : rv.recv_w;
  da.recv_probs = expert ? rv.recv_probs : NULL;
  da.tokens_per_local_expert = rv.cnt;
  da.num_recv_rows = &rv.nrows;
  const epx_status_t ds = epx_dispatch(comm, h, it == 0 ? NULL : &rt, &da);
  if (CHECK_STATUS(ds, EPX_SUCCESS, "%s: dispatch", what)) {
    snprintf(w2, sizeof w2, "%s: the dispatch's tokens_per_local_expert", what);
    CHECK_BITS(w2, EPX_INT32, rv.cnt, ex.cnt, L, L);
    combine_and_check(sc, sh, comm, h, &m, me, &rv, what);
  }
  free(rv.recv_x), free(rv.recv_scales), free(rv.recv_idx), free(rv.recv_w), free(rv.recv_probs);
  tu_expect_free(&ex);
  tu_moe_free(&m);
  return ds == EPX_SUCCESS ? 0 : -1;
}

static void run_scenario(const scenario_t *sc, const shape_t *sh, epx_comm_t *comm, int me, int si, const char *tag) {
  epx_handle_config_t hc = tu_handle_config(sc->algo, sc->layout, sc->algo == EPX_ALGO_LL ? 1 : sc->align);
  epx_handle_t *h = NULL;
  if (!CHECK_STATUS(epx_handle_create(comm, &hc, &h), EPX_SUCCESS, "%s %s: handle", tag, sc->name)) return;
  for (int it = 0; it < ROUTINGS; it++)
    if (run_routing(sc, sh, comm, h, me, si, it, tag)) break;
  epx_handle_destroy(h);
}

static void rank_main(mp_ctx_t *ctx) {
  const shape_t *sh = ctx->arg;
  const int me = ctx->proc;
  char tag[96];
  snprintf(tag, sizeof tag, "[R=%d %s rank %d]", sh->R, mp_boot_name(ctx->boot), me);
  int fds_before = mp_count_fds();

  epx_world_t *world = NULL;
  if (!CHECK_STATUS(mp_world_create(ctx, sh->R, me, &world), EPX_SUCCESS, "%s world", tag)) return;
  CHECK(epx_world_nranks(world) == sh->R, "%s: world of %d ranks", tag, epx_world_nranks(world));
  CHECK(epx_world_backend(world) == EPX_BACKEND_HOST, "%s: backend", tag);

  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = sh->R * sh->L;
  cfg.hidden = sh->H;
  cfg.topk = sh->K;
  cfg.max_tokens_per_rank = sh->max_tokens;
  cfg.timeout_ms = 20000;
  cfg.ranks_per_node = sh->ranks_per_node;
  epx_comm_t *comm = NULL;
  if (CHECK_STATUS(epx_comm_init(world, me, &cfg, &comm), EPX_SUCCESS, "%s comm_init", tag)) {
    CHECK(epx_comm_rank(comm) == me && epx_comm_nranks(comm) == sh->R, "%s: comm rank/size", tag);
    for (int s = 0; s < NSCEN; s++) run_scenario(&scenarios[s], sh, comm, me, s, tag);
    epx_comm_destroy(comm);
  }
  CHECK(mp_count_epx_maps() > 0 || sh->R == 1, "%s: no epx segment is mapped while the world lives?", tag);
  epx_world_destroy(world);
  CHECK(mp_count_epx_maps() == 0, "%s: %d epx mappings left after the world", tag, mp_count_epx_maps());
  /* Process 0 of a unique-id launch also ran the bootstrap listener (its descriptors go with
   * its thread), so only the others can compare exactly. */
  if (ctx->boot == MP_BOOT_CALLBACK || me != 0) {
    int fds_after = mp_count_fds();
    CHECK(fds_after == fds_before, "%s: %d descriptors open before the world, %d after", tag, fds_before, fds_after);
  }
}

/* One run of the group: sh->R processes through bootstrap `boot`. */
static void launch(shape_t *sh, mp_boot_t boot, const char *label, int limit_s) {
  printf("-- %d processes, %s bootstrap%s: L=%d H=%d K=%d max_tokens=%d ranks_per_node=%d\n", sh->R,
         mp_boot_name(boot), label, sh->L, sh->H, sh->K, sh->max_tokens, sh->ranks_per_node);
  mp_launch_t l = {.nprocs = sh->R, .boot = boot, .limit_s = limit_s};
  double t0 = tu_now();
  mp_launch(&l, rank_main, sh);
  printf("   %.2f s\n", tu_now() - t0);
}

int main(void) {
  tu_begin("test_mp_pipeline");
  char shm_before[8192];
  mp_shm_list(shm_before, sizeof shm_before);
  const int sizes[] = {1, 2, 4, 8};
  tu_rng_t g = tu_rng_stream(tu_seed, 999);
  for (int si = 0; si < 4; si++)
    for (int b = 0; b < 2; b++) {
      if (sizes[si] == 1 && b == 1) continue;
      shape_t sh = {.R = sizes[si], .L = tu_int(&g, 1, 3), .H = 16 * tu_int(&g, 1, 13), .max_tokens = 24};
      int E = sh.R * sh.L;
      sh.K = tu_int(&g, 1, E < 4 ? E : 4);
      launch(&sh, (mp_boot_t)b, "", 90);
      char extra[1024];
      int n = mp_shm_new(shm_before, extra, sizeof extra);
      CHECK(n == 0, "/dev/shm has %d new epx entries after the run: %s", n, extra);
    }
  /* Larger rows and more tokens: shares of up to about a MiB, so the shared segments grow
   * (and the peers remap them) between routings. */
  for (int b = 0; b < 2; b++) {
    shape_t sh = {.R = 3 + b, .L = 2, .H = 1024, .K = 4, .max_tokens = 160};
    launch(&sh, (mp_boot_t)b, ", large", 120);
  }
  /* Simulated nodes: processes grouped in nodes, combine in the node-aware order. */
  for (int b = 0; b < 2; b++) {
    shape_t sh = {.R = 4 + 2 * b, .L = 2, .H = 64, .K = 4, .max_tokens = 24, .ranks_per_node = 2 + b};
    launch(&sh, (mp_boot_t)b, ", nodes", 90);
  }
  char extra[1024];
  int n = mp_shm_new(shm_before, extra, sizeof extra);
  CHECK(n == 0, "/dev/shm has %d new epx entries after the run: %s", n, extra);
  return tu_end();
}
