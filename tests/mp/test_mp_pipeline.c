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

/* The receiver's value of element c of a received row. */
static float recv_value(epx_dtype_t t, const void *rows, const float *scales, int H, int64_t row, int c) {
  if (t == EPX_FP8_E4M3) {
    int nb = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
    return epx_e4m3_to_float(((const uint8_t *)rows)[row * H + c]) * scales[row * nb + c / EPX_FP8_BLOCK];
  }
  return mp_load(t, rows, (size_t)(row * H + c));
}

static float round_to(epx_dtype_t t, float v) { return t == EPX_BFLOAT16 ? epx_bf16_to_float(epx_float_to_bf16(v)) : v; }

/* Expected arrivals on rank d: distinct tokens and (token, expert) pairs per local expert. */
static void expect_counts(const mp_moe_t *m, int d, int64_t *tokens, int32_t *pairs) {
  *tokens = 0;
  memset(pairs, 0, sizeof(int32_t) * m->L);
  for (int s = 0; s < m->R; s++)
    for (int64_t t = 0; t < m->T[s]; t++) {
      bool here = false;
      for (int k = 0; k < m->K; k++) {
        int e = m->idx[s][t * m->K + k];
        if (e >= 0 && e / m->L == d) here = true, pairs[e % m->L]++;
      }
      *tokens += here;
    }
}

static void run_scenario(const scenario_t *sc, const shape_t *sh, epx_comm_t *comm, int me, int si, const char *tag) {
  const int R = sh->R, L = sh->L, H = sh->H, K = sh->K, E = R * L, maxT = sh->max_tokens;
  const bool ll = sc->algo == EPX_ALGO_LL, expert = ll || sc->layout == EPX_LAYOUT_EXPERT;
  const int align = ll ? 1 : sc->align;
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  hc.algo = sc->algo;
  hc.layout = sc->layout;
  hc.align = align;
  epx_handle_t *h = NULL;
  if (!CHECK_STATUS(epx_handle_create(comm, &hc, &h), EPX_SUCCESS, "%s %s: handle", tag, sc->name)) return;

  for (int it = 0; it < ROUTINGS; it++) {
    mp_moe_t m;
    mp_moe_make(&m, mp_seed, (uint64_t)(si * 16 + it), R, E, H, K, sc->x, maxT);
    m.ranks_per_node = ll ? 0 : sh->ranks_per_node; /* low-latency combines in the flat order */
    const int64_t T = m.T[me];
    int64_t *idx64 = malloc(sizeof(int64_t) * (size_t)(T * K) + 1);
    for (int64_t i = 0; i < T * K; i++) idx64[i] = m.idx[me][i];
    epx_routing_t rt = {.num_tokens = T,
                        .idx_dtype = sc->idx64 ? EPX_INT64 : EPX_INT32,
                        .topk_idx = sc->idx64 ? (const void *)idx64 : (const void *)m.idx[me],
                        .topk_weights = m.w[me]};
    char what[300];
    snprintf(what, sizeof what, "%s %s, routing %d (T=%lld)", tag, sc->name, it, (long long)T);

    /* notify, then size the buffers from the plan */
    if (!CHECK_STATUS(epx_notify(comm, h, &rt), EPX_SUCCESS, "%s: notify", what)) {
      free(idx64);
      mp_moe_free(&m);
      break;
    }
    epx_handle_info_t info;
    int32_t info_cnt[64];
    CHECK_STATUS(epx_handle_info(h, &info, info_cnt), EPX_SUCCESS, "%s: handle_info", what);
    int64_t want_tokens;
    int32_t want_pairs[64];
    expect_counts(&m, me, &want_tokens, want_pairs);
    int64_t want_pair_sum = 0;
    for (int l = 0; l < L; l++) want_pair_sum += want_pairs[l];
    CHECK(info.num_send_tokens == T, "%s: num_send_tokens %lld", what, (long long)info.num_send_tokens);
    CHECK(info.num_recv_tokens == want_tokens, "%s: num_recv_tokens %lld, want %lld", what,
          (long long)info.num_recv_tokens, (long long)want_tokens);
    CHECK(info.num_recv_pairs == want_pair_sum, "%s: num_recv_pairs %lld, want %lld", what,
          (long long)info.num_recv_pairs, (long long)want_pair_sum);
    CHECK(!memcmp(info_cnt, want_pairs, sizeof(int32_t) * L), "%s: tokens_per_local_expert differ", what);

    const int64_t stride = (int64_t)R * maxT; /* LL block of one local expert */
    const int64_t rows = ll ? L * stride : info.num_recv_rows;
    const int nb = (H + EPX_FP8_BLOCK - 1) / EPX_FP8_BLOCK;
    const size_t rsz = epx_dtype_size(sc->recv), ysz = epx_dtype_size(sc->y);
    void *recv_x = calloc((size_t)(rows * H) * rsz + 1, 1);
    float *recv_scales = calloc((size_t)(rows * nb) + 1, sizeof(float));
    int32_t *recv_idx = calloc((size_t)(rows * K) + 1, sizeof(int32_t));
    float *recv_w = calloc((size_t)(rows * K) + 1, sizeof(float));
    float *recv_probs = calloc((size_t)rows + 1, sizeof(float));
    int32_t cnt[64];
    int64_t nrows = -1;
    epx_dispatch_args_t da;
    epx_dispatch_args_init(&da);
    da.x = m.x[me];
    da.x_dtype = sc->x;
    da.recv_dtype = sc->recv;
    da.recv_x = recv_x;
    da.recv_scales = sc->recv == EPX_FP8_E4M3 ? recv_scales : NULL;
    da.recv_capacity = rows;
    da.recv_topk_idx = expert ? NULL : recv_idx;
    da.recv_topk_weights = expert ? NULL : recv_w;
    da.recv_probs = expert ? recv_probs : NULL;
    da.tokens_per_local_expert = cnt;
    da.num_recv_rows = &nrows;
    /* the first routing replays the plan of notify; the second plans inside the dispatch */
    epx_status_t ds = epx_dispatch(comm, h, it == 0 ? NULL : &rt, &da);
    if (CHECK_STATUS(ds, EPX_SUCCESS, "%s: dispatch", what)) {
      CHECK(!memcmp(cnt, want_pairs, sizeof(int32_t) * L), "%s: dispatch counts differ", what);

      /* stand-in experts */
      void *y = calloc((size_t)(rows * H) * ysz + 1, 1);
      if (!expert) {
        for (int64_t n = 0; n < rows; n++)
          for (int c = 0; c < H; c++) {
            float xin = recv_value(sc->recv, recv_x, recv_scales, H, n, c), acc = 0.0f;
            for (int k = 0; k < K; k++) {
              int l = recv_idx[n * K + k];
              if (l < 0) continue;
              float ye = round_to(sc->y, dense_expert_scale(me * L + l) * xin);
              float p = recv_w[n * K + k] * ye;
              acc = acc + p;
            }
            mp_store(sc->y, y, (size_t)(n * H + c), acc);
          }
      } else {
        for (int64_t i = 0; i < rows * H; i++) mp_store(sc->y, y, (size_t)i, __builtin_nanf("")); /* unread rows */
        int64_t start = 0;
        for (int l = 0; l < L; l++) {
          int64_t base = ll ? l * stride : start;
          for (int64_t r = base; r < base + cnt[l]; r++)
            for (int c = 0; c < H; c++)
              mp_store(sc->y, y, (size_t)(r * H + c),
                       dense_expert_scale(me * L + l) * recv_value(sc->recv, recv_x, recv_scales, H, r, c));
          start += (cnt[l] + align - 1) / align * align;
        }
      }

      void *out = malloc((size_t)(T * H) * epx_dtype_size(sc->out) + 1);
      memset(out, 0x7f, (size_t)(T * H) * epx_dtype_size(sc->out) + 1);
      /* weight gradients: twice the delivered weight, so each source must get 2 * w back in
       * every slot that routed somewhere (a second share before combine's barrier) */
      const int64_t nwg = expert ? rows : rows * K;
      float *row_wg = malloc(sizeof(float) * (size_t)nwg + 1);
      for (int64_t i = 0; i < nwg; i++) row_wg[i] = 2.0f * (expert ? recv_probs[i] : recv_w[i]);
      float *topk_wg = malloc(sizeof(float) * (size_t)(T * K) + 1);
      epx_combine_args_t ca;
      epx_combine_args_init(&ca);
      ca.y = y;
      ca.y_dtype = sc->y;
      ca.out = out;
      ca.out_dtype = sc->out;
      ca.weighted = 1;
      ca.row_weight_grad = row_wg;
      ca.topk_weight_grad = topk_wg;
      if (CHECK_STATUS(epx_combine(comm, h, &ca), EPX_SUCCESS, "%s: combine", what)) {
        int64_t bad = -1;
        for (int64_t i = 0; i < T * K && bad < 0; i++)
          if (topk_wg[i] != (m.idx[me][i] < 0 ? 0.0f : 2.0f * m.w[me][i])) bad = i;
        CHECK(bad < 0, "%s: topk_weight_grad of token %lld slot %lld is %g, want %g", what, (long long)(bad / K),
              (long long)(bad % K), bad < 0 ? 0.0 : topk_wg[bad],
              bad < 0 ? 0.0 : (m.idx[me][bad] < 0 ? 0.0 : 2.0 * m.w[me][bad]));
        void *want = mp_dense_out(&m, me, sc->recv, sc->y, sc->out, expert);
        size_t osz = epx_dtype_size(sc->out);
        int64_t diff = -1;
        for (int64_t i = 0; i < T * H && diff < 0; i++)
          if (memcmp((char *)out + i * osz, (char *)want + i * osz, osz)) diff = i;
        CHECK(diff < 0, "%s: combine output differs from dense_moe at token %lld channel %lld: %g vs %g", what,
              (long long)(diff / H), (long long)(diff % H), diff < 0 ? 0.0 : mp_load(sc->out, out, (size_t)diff),
              diff < 0 ? 0.0 : mp_load(sc->out, want, (size_t)diff));
        free(want);
      }
      free(row_wg), free(topk_wg);
      free(out);
      free(y);
    }
    free(recv_x), free(recv_scales), free(recv_idx), free(recv_w), free(recv_probs);
    free(idx64);
    mp_moe_free(&m);
    if (ds != EPX_SUCCESS) break;
  }
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
  double t0 = mp_now();
  mp_launch(&l, rank_main, sh);
  printf("   %.2f s\n", mp_now() - t0);
}

int main(void) {
  mp_begin("test_mp_pipeline");
  char shm_before[8192];
  mp_shm_list(shm_before, sizeof shm_before);
  const int sizes[] = {1, 2, 4, 8};
  mp_rng_t g = mp_rng(mp_seed, 999);
  for (int si = 0; si < 4; si++)
    for (int b = 0; b < 2; b++) {
      if (sizes[si] == 1 && b == 1) continue;
      shape_t sh = {.R = sizes[si], .L = mp_int(&g, 1, 3), .H = 16 * mp_int(&g, 1, 13), .max_tokens = 24};
      int E = sh.R * sh.L;
      sh.K = mp_int(&g, 1, E < 4 ? E : 4);
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
  return mp_end();
}
