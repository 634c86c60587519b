/* The stable-ABI rules of epx.h: every caller-filled struct starts with its size and the
 * epx.h version it was set up from; the library refuses another size, an uninitialised
 * struct and another major.minor release with EPX_ERR_INVALID_ARGUMENT and a message naming
 * the init function, on every rank of a collective, without touching the outputs. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "testutil.h"

enum { R = 2, E = 4, H = 16, K = 2, T = 8 };

/* The three ways a struct can be wrong, applied to its head. */
typedef enum { BAD_UNSET, BAD_SIZE, BAD_MINOR, OK_PATCH, NUM_CASES } spoil_t;
static const char *const spoil_names[NUM_CASES] = {"struct_size 0", "another size", "another minor release",
                                                    "another patch release"};

static void spoil(uint32_t *size, uint32_t *version, spoil_t how) {
  if (how == BAD_UNSET) *size = 0, *version = 0;
  if (how == BAD_SIZE) *size -= 8;
  if (how == BAD_MINOR) *version += 100;
  if (how == OK_PATCH) *version = *version / 100 * 100 + (*version % 100 + 1) % 100;
}

static void expect(epx_status_t s, spoil_t how, const char *what, const char *init) {
  if (how == OK_PATCH) {
    CHECK_STATUS(s, EPX_SUCCESS, "%s, %s: accepted", what, spoil_names[how]);
    return;
  }
  CHECK_STATUS(s, EPX_ERR_INVALID_ARGUMENT, "%s, %s", what, spoil_names[how]);
  CHECK(tu_contains(epx_last_error(), init), "%s, %s: the message names %s: %s", what, spoil_names[how], init,
        epx_last_error());
}

static void inits_and_version(void) {
  CHECK(epx_get_version() == EPX_VERSION_CODE, "epx_get_version %d, epx.h %d", epx_get_version(), EPX_VERSION_CODE);
  epx_world_config_t wc;
  epx_config_t c;
  epx_handle_config_t hc;
  epx_dispatch_args_t d;
  epx_combine_args_t a;
  epx_world_config_init(&wc), epx_config_init(&c), epx_handle_config_init(&hc);
  epx_dispatch_args_init(&d), epx_combine_args_init(&a);
#define HEAD_OK(v) CHECK((v).struct_size == sizeof(v) && (v).struct_version == EPX_VERSION_CODE, #v " head %u %u", \
                         (v).struct_size, (v).struct_version)
  HEAD_OK(wc);
  HEAD_OK(c);
  HEAD_OK(hc);
  HEAD_OK(d);
  HEAD_OK(a);
#undef HEAD_OK
}

static void worlds(spoil_t how) {
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST, wc.nranks = R;
  spoil(&wc.struct_size, &wc.struct_version, how);
  epx_world_t *w = NULL;
  expect(epx_world_create(&wc, &w), how, "epx_world_create", "epx_world_config_init");
  epx_world_destroy(w);
  w = NULL;
  if (how != OK_PATCH) /* refused before the allgather (NULL here) is looked at */
    expect(epx_world_create_rank_with(&wc, 0, NULL, NULL, &w), how, "epx_world_create_rank_with",
           "epx_world_config_init");
}

/* One case: the struct of one call (the comm's config, the handle config, the dispatch or
 * the combine arguments) spoilt on every rank or on rank 1 only, every other struct good. */
enum { S_CONFIG, S_HANDLE, S_DISPATCH, S_COMBINE, NUM_STRUCTS };
static const char *const inits[NUM_STRUCTS] = {"epx_config_init", "epx_handle_config_init", "epx_dispatch_args_init",
                                               "epx_combine_args_init"};

typedef struct {
  spoil_t how;
  int which, only_rank1;
  epx_world_t *world;
  tu_moe_t m;
  epx_status_t st[R]; /* the spoilt call's status */
  char msg[R][512];
  int untouched[R];   /* its outputs still hold the poison */
} ctx_t;

static epx_status_t rank_main(int rank, void *arg) {
  ctx_t *c = arg;
  const int bad = !c->only_rank1 || rank == 1;
#define SPOIL(v, w) \
  if (bad && c->which == (w)) spoil(&(v).struct_size, &(v).struct_version, c->how)
  epx_config_t cfg = tu_config(E, H, K, T);
  SPOIL(cfg, S_CONFIG);
  epx_handle_config_t hc = tu_handle_config(EPX_ALGO_HT, EPX_LAYOUT_TOKEN, 1);
  SPOIL(hc, S_HANDLE);
  const int64_t cap = (int64_t)R * T;
  float *recv = tu_alloc_poison(sizeof(float) * cap * H), *out = tu_alloc_poison(sizeof(float) * T * H);
  epx_routing_t rt = tu_routing(&c->m, rank, 0);
  epx_dispatch_args_t d;
  epx_dispatch_args_init(&d);
  d.x = c->m.x[rank], d.x_dtype = d.recv_dtype = EPX_FLOAT32, d.recv_x = recv, d.recv_capacity = cap;
  SPOIL(d, S_DISPATCH);
  epx_combine_args_t a;
  epx_combine_args_init(&a);
  a.y = recv, a.y_dtype = a.out_dtype = EPX_FLOAT32, a.out = out;
  SPOIL(a, S_COMBINE);
#undef SPOIL
  epx_comm_t *comm = NULL;
  epx_handle_t *h = NULL;
  epx_status_t s = epx_comm_init(c->world, rank, &cfg, &comm);
  if (s == EPX_SUCCESS) s = epx_handle_create(comm, &hc, &h);
  if (s == EPX_SUCCESS) s = epx_dispatch(comm, h, &rt, &d);
  if (s == EPX_SUCCESS) c->untouched[rank] = tu_is_poison(out, sizeof(float) * T * H); /* before the combine */
  if (s == EPX_SUCCESS) s = epx_combine(comm, h, &a);
  c->st[rank] = s;
  snprintf(c->msg[rank], sizeof c->msg[rank], "%s", epx_last_error());
  if (c->which == S_DISPATCH) c->untouched[rank] = tu_is_poison(recv, sizeof(float) * cap * H);
  else if (c->which == S_COMBINE) c->untouched[rank] = c->untouched[rank] && tu_is_poison(out, sizeof(float) * T * H);
  free(recv), free(out);
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  return EPX_SUCCESS;
}

static void collectives(spoil_t how, int which, int only_rank1) {
  static ctx_t c;
  c.how = how, c.which = which, c.only_rank1 = only_rank1;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST, wc.nranks = R;
  if (!CHECK_STATUS(epx_world_create(&wc, &c.world), EPX_SUCCESS, "world")) return;
  int64_t tokens[TU_MAX_RANKS] = {T, T};
  tu_route_opts_t o = tu_route_default();
  tu_moe_random(&c.m, &tu_rng, R, E, H, K, EPX_FLOAT32, tokens, &o, 1);
  epx_run_ranks(R, rank_main, &c, NULL);
  const epx_status_t want = how == OK_PATCH ? EPX_SUCCESS : EPX_ERR_INVALID_ARGUMENT;
  for (int r = 0; r < R; r++) {
    const int spoilt = !only_rank1 || r == 1;
    /* a handle is made locally: a peer's bad handle config is its own failure */
    if (!spoilt && which == S_HANDLE) continue;
    CHECK_STATUS(c.st[r], want, "%s of %s%s, rank %d", spoil_names[how], inits[which], only_rank1 ? " on rank 1" : "", r);
    if (how == OK_PATCH) continue;
    if (spoilt)
      CHECK(tu_contains(c.msg[r], inits[which]), "rank %d: the message names %s: %s", r, inits[which], c.msg[r]);
    if (which >= S_DISPATCH)
      CHECK(c.untouched[r], "rank %d, %s of %s: the outputs are untouched", r, spoil_names[how], inits[which]);
  }
  tu_moe_free(&c.m);
  epx_world_destroy(c.world);
}

int main(void) {
  tu_begin("test_abi");
  inits_and_version();
  for (int how = 0; how < NUM_CASES; how++) {
    worlds((spoil_t)how);
    for (int which = 0; which < NUM_STRUCTS; which++) collectives((spoil_t)how, which, 0);
  }
  /* one rank's mistake fails its peers too, in the collectives */
  for (int which = 0; which < NUM_STRUCTS; which++) collectives(BAD_UNSET, which, 1);
  return tu_end();
}
