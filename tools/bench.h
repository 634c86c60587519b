/* epx-bench's parts: the options (bench_args.c), one measured run (epx_bench.c) and its
 * report as a table and as JSON (bench_report.c). */
#ifndef EPX_BENCH_H
#define EPX_BENCH_H

#include <stdint.h>
#include <stdio.h>

#include "bench_dev.h"
#include "epx.h"

typedef enum { SWEEP_NONE = 0, SWEEP_SMS, SWEEP_TOKENS } bench_sweep_t;

typedef struct {
  epx_backend_t backend;
  int ranks, tokens, hidden, experts, topk, align, iters, warmup, check;
  int ll, a2a, expert_layout, num_sms, graph;
  epx_dtype_t x_dtype, recv_dtype;
  uint64_t seed;
  int json;              /* --json given: JSON to json_path, or to stdout when it is NULL */
  const char *json_path;
  bench_sweep_t sweep;
  int given_tokens, given_num_sms; /* set on the command line (sweeps start from them) */
  int ranks_per_node;    /* --ranks-per-node: 0 = one node */
} bench_opts_t;

/* Parses argv: 0 to run, 1 when --help was printed (stdout), -1 after an error message on
 * stderr that names the argument and what it takes. */
int bench_parse(int argc, char **argv, bench_opts_t *o);
/* Refuses (-1, with a message) what the resolved backend cannot do: graphs and SMs on the host. */
int bench_check_backend(const bench_opts_t *o, epx_backend_t backend);

enum { PH_LAYOUT, PH_NOTIFY, PH_DISPATCH, PH_STANDIN, PH_COMBINE, PH_COUNT };
extern const char *const bench_phase_names[PH_COUNT];

/* What the process measured once, before any run: the floors' references. */
typedef struct {
  const bench_dev_t *dev;
  epx_backend_t backend;    /* resolved */
  double copy_bw;           /* bytes read + written per second, large copy, whole device */
  char machine[512];        /* JSON object text: host, CPUs, device, epx version */
  char command[2048];       /* the command line, shell-quoted */
} bench_env_t;

/* One run's figures. */
typedef struct {
  bench_opts_t o;
  double ms[PH_COUNT];      /* median over iterations */
  /* each rank's part of a phase, medians over iterations: when it started after the phase's
     first rank (shared clock; 0 otherwise) and its own time, start to end */
  double rank_start_ms[PH_COUNT][EPX_MAX_RANKS], rank_own_ms[PH_COUNT][EPX_MAX_RANKS];
  double memory[PH_COUNT];  /* bytes the phase must read plus write, all ranks */
  double link[PH_COUNT];    /* bytes that cross between ranks */
  double sm_copy_bw;        /* CUDA: the best copy kernel's bytes read + written per SM-second, 0 elsewhere */
  int sms_in_use;           /* CUDA: SMs of every rank together (ranks x num_sms) */
  int devices;              /* devices the ranks are on */
  double nvlink_ms[PH_COUNT]; /* CUDA: the link floor with a GPU per rank (dispatch, combine) */
  int check;                /* -1 not run, 0 bit for bit, 1 mismatch or failure */
  char check_detail[256];
  int shared_clock;
  epx_node_traffic_t nodes; /* several nodes: the bytes across node boundaries, all ranks, one iteration */
} bench_result_t;

/* Fills env->machine: this host, its CPUs, the device text given, epx's version. */
void bench_describe_machine(bench_env_t *env, const char *device);
/* The human report of one run, to out. */
void bench_print_table(FILE *out, const bench_env_t *env, const bench_result_t *r);
void bench_print_header(FILE *out, const bench_env_t *env, const bench_opts_t *o);
/* One line of JSON: a run's object, or a sweep's object holding every run. */
void bench_write_json(FILE *out, const bench_env_t *env, const bench_result_t *runs, int nruns);

#endif
