/* epx-bench's command line: every value checked whole, every error naming the argument and
 * the values it takes, nothing silently replaced. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: epx-bench [options]\n"
          "  --backend auto|host|cuda   where the ranks run (default auto: CUDA when a GPU is there)\n"
          "  --ranks R                  ranks of the group, 1..%d (default 8)\n"
          "  --tokens T                 tokens per rank, 0..1048576 (default 512)\n"
          "  --hidden H                 1..%d (default 7168)\n"
          "  --experts E                1..%d, a multiple of R (default 256)\n"
          "  --topk K                   1..min(%d, E) (default 8)\n"
          "  --dtype bf16|fp32|fp8      fp8 dispatches bf16 tokens as e4m3 with a scale per %d channels;\n"
          "                             combine stays bf16 (default bf16)\n"
          "  --mode ht|ll|a2a           high-throughput, low-latency (always the expert layout), or the\n"
          "                             permute -> all-to-all -> sort baseline (default ht)\n"
          "  --layout token|expert      what dispatch hands the receiver (default token; ll: expert)\n"
          "  --align A                  expert layout: each expert's rows padded to a multiple, 1..65536\n"
          "  --iters N, --warmup N      timed iterations 1..100000 (default 3), untimed before them (default 1)\n"
          "  --num-sms S                CUDA: SM budget of each rank's launches, 1..1024 (default 16)\n"
          "  --ranks-per-node P         host: the ranks in nodes of P (a divisor of R; default one node):\n"
          "                             the node-aware combine, and the bytes that cross node boundaries\n"
          "  --graph                    CUDA: capture the layer once, time graph replays\n"
          "  --seed N                   inputs' random seed (default: from the clock, printed)\n"
          "  --check                    compare the result bit for bit with a dense one-process reference\n"
          "  --json [FILE]              every figure as one line of JSON, to FILE or, without one, to\n"
          "                             stdout (the table then goes to stderr)\n"
          "  --sweep sms|tokens         CUDA sms: 2, 4, .. 16 SMs per rank; tokens: 128, 256, .. up to\n"
          "                             --tokens (default 8192) tokens per rank; one JSON object holds all\n"
          "  --help                     this text\n",
          EPX_MAX_RANKS, EPX_MAX_HIDDEN, EPX_MAX_EXPERTS, EPX_MAX_TOPK, EPX_FP8_BLOCK);
}

static int bad(const char *arg, const char *value, const char *takes) {
  if (value)
    fprintf(stderr, "epx-bench: %s takes %s, not '%s'\n", arg, takes, value);
  else
    fprintf(stderr, "epx-bench: %s needs a value: %s\n", arg, takes);
  return -1;
}

/* A whole decimal integer in [lo, hi], or an error naming the argument and the range. */
static int int_arg(const char *arg, const char *v, long lo, long hi, int *out) {
  char takes[96];
  snprintf(takes, sizeof takes, "an integer in [%ld, %ld]", lo, hi);
  if (!v) return bad(arg, v, takes);
  char *end = NULL;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi) return bad(arg, v, takes);
  *out = (int)x;
  return 0;
}

/* v is one of the names (a NULL-terminated list): its index, or an error listing them. */
static int choice_arg(const char *arg, const char *v, const char *const *names, int *out) {
  char takes[160] = "one of";
  for (int i = 0; names[i]; i++) {
    if (v && !strcmp(v, names[i])) return *out = i, 0;
    strncat(takes, i ? ", " : " ", sizeof takes - strlen(takes) - 1);
    strncat(takes, names[i], sizeof takes - strlen(takes) - 1);
  }
  return bad(arg, v, takes);
}

typedef struct {
  int layout_given, align_given, mode;
} seen_t;

/* One option at argv[*i] (its value, if any, at argv[*i + 1]). */
static int parse_one(int argc, char **argv, int *i, bench_opts_t *o, seen_t *seen) {
  const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
  static const char *const backends[] = {"host", "cuda", "auto", NULL}, *const dtypes[] = {"bf16", "fp32", "fp8", NULL},
                           *const modes[] = {"ht", "ll", "a2a", NULL}, *const layouts[] = {"token", "expert", NULL},
                           *const sweeps[] = {"none", "sms", "tokens", NULL};
  int k = 0, rc = 0;
  ++*i; /* most options take the next argument; the flags give it back */
  if (!strcmp(a, "--ranks")) rc = int_arg(a, v, 1, EPX_MAX_RANKS, &o->ranks);
  else if (!strcmp(a, "--tokens")) rc = int_arg(a, v, 0, 1 << 20, &o->tokens), o->given_tokens = 1;
  else if (!strcmp(a, "--hidden")) rc = int_arg(a, v, 1, EPX_MAX_HIDDEN, &o->hidden);
  else if (!strcmp(a, "--experts")) rc = int_arg(a, v, 1, EPX_MAX_EXPERTS, &o->experts);
  else if (!strcmp(a, "--topk")) rc = int_arg(a, v, 1, EPX_MAX_TOPK, &o->topk);
  else if (!strcmp(a, "--align")) rc = int_arg(a, v, 1, 65536, &o->align), seen->align_given = 1;
  else if (!strcmp(a, "--iters")) rc = int_arg(a, v, 1, 100000, &o->iters);
  else if (!strcmp(a, "--warmup")) rc = int_arg(a, v, 0, 100000, &o->warmup);
  else if (!strcmp(a, "--num-sms")) rc = int_arg(a, v, 1, 1024, &o->num_sms), o->given_num_sms = 1;
  else if (!strcmp(a, "--ranks-per-node")) rc = int_arg(a, v, 0, EPX_MAX_RANKS, &o->ranks_per_node);
  else if (!strcmp(a, "--seed")) {
    char *end = NULL;
    errno = 0;
    if (!v || v[0] == '-') return bad(a, v, "an integer in [0, 2^64)");
    o->seed = strtoull(v, &end, 10);
    if (errno || end == v || *end) return bad(a, v, "an integer in [0, 2^64)");
  } else if (!strcmp(a, "--backend")) {
    if (!(rc = choice_arg(a, v, backends, &k))) o->backend = (epx_backend_t)(k == 0 ? EPX_BACKEND_HOST : k == 1 ? EPX_BACKEND_CUDA : EPX_BACKEND_AUTO);
  } else if (!strcmp(a, "--dtype")) {
    if (!(rc = choice_arg(a, v, dtypes, &k))) {
      o->x_dtype = k == 1 ? EPX_FLOAT32 : EPX_BFLOAT16;
      o->recv_dtype = k == 2 ? EPX_FP8_E4M3 : o->x_dtype;
    }
  } else if (!strcmp(a, "--mode")) {
    if (!(rc = choice_arg(a, v, modes, &seen->mode))) o->ll = seen->mode == 1, o->a2a = seen->mode == 2;
  } else if (!strcmp(a, "--layout")) {
    if (!(rc = choice_arg(a, v, layouts, &o->expert_layout))) seen->layout_given = 1;
  } else if (!strcmp(a, "--sweep")) {
    if (!(rc = choice_arg(a, v, sweeps, &k))) o->sweep = (bench_sweep_t)k;
  } else {
    --*i; /* a flag: no value */
    if (!strcmp(a, "--check")) o->check = 1;
    else if (!strcmp(a, "--graph")) o->graph = 1;
    else if (!strcmp(a, "--json")) {
      o->json = 1;
      if (v && !strcmp(v, "-")) ++*i;                      /* "-": stdout, as with no file */
      else if (v && v[0] != '-') o->json_path = v, ++*i; /* a file */
    } else {
      fprintf(stderr, "epx-bench: unknown argument '%s' (--help lists the options)\n", a);
      return -1;
    }
  }
  return rc;
}

/* Combinations that cannot be honoured as asked are refused, never replaced. */
static int check_combination(const bench_opts_t *o, const seen_t *seen) {
  if (o->ll && seen->layout_given && !o->expert_layout)
    return fprintf(stderr, "epx-bench: --mode ll always delivers the expert layout: --layout token cannot be honoured "
                           "(drop it, or use --mode ht)\n"), -1;
  if (o->ll && seen->align_given && o->align != 1)
    return fprintf(stderr, "epx-bench: --mode ll packs each expert's rows without padding: --align %d cannot be "
                           "honoured (drop it)\n", o->align), -1;
  if (seen->align_given && o->align != 1 && !o->expert_layout)
    return fprintf(stderr, "epx-bench: --align pads the expert layout's blocks: add --layout expert or drop it\n"), -1;
  if (o->topk > o->experts)
    return fprintf(stderr, "epx-bench: --topk %d: a token chooses distinct experts, at most --experts (%d)\n", o->topk,
                   o->experts), -1;
  if (o->experts % o->ranks)
    return fprintf(stderr, "epx-bench: --experts %d is not a multiple of --ranks %d\n", o->experts, o->ranks), -1;
  if (o->ranks_per_node && (o->ranks_per_node > o->ranks || o->ranks % o->ranks_per_node))
    return fprintf(stderr, "epx-bench: --ranks-per-node %d does not divide --ranks %d\n", o->ranks_per_node,
                   o->ranks), -1;
  if (o->backend == EPX_BACKEND_HOST) return bench_check_backend(o, EPX_BACKEND_HOST);
  if (o->sweep == SWEEP_SMS && o->given_num_sms)
    return fprintf(stderr, "epx-bench: --sweep sms chooses the SMs per rank itself: drop --num-sms\n"), -1;
  return 0;
}

int bench_parse(int argc, char **argv, bench_opts_t *o) {
  *o = (bench_opts_t){.backend = EPX_BACKEND_AUTO, .ranks = 8, .tokens = 512, .hidden = 7168, .experts = 256,
                      .topk = 8, .align = 1, .iters = 3, .warmup = 1, .num_sms = 16, .x_dtype = EPX_BFLOAT16,
                      .recv_dtype = EPX_BFLOAT16};
  o->seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
  seen_t seen = {0};
  for (int i = 1; i < argc;) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return usage(stdout), 1;
    if (parse_one(argc, argv, &i, o, &seen)) return -1;
    i++;
  }
  if (check_combination(o, &seen)) return -1;
  if (o->ll) o->expert_layout = 1;
  if (o->sweep == SWEEP_TOKENS && !o->given_tokens) o->tokens = 8192;
  return 0;
}

int bench_check_backend(const bench_opts_t *o, epx_backend_t backend) {
  if (backend == EPX_BACKEND_HOST && (o->graph || o->given_num_sms || o->sweep == SWEEP_SMS))
    return fprintf(stderr, "epx-bench: %s needs the CUDA backend (the host backend has no graphs and no SMs)\n",
                   o->graph ? "--graph" : o->sweep == SWEEP_SMS ? "--sweep sms" : "--num-sms"), -1;
  return 0;
}
