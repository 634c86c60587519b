/* epx-bench's report: the table a person reads, and the JSON a script reads (every figure,
 * its floor, the check, the machine and the command). */
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "bench.h"

const char *const bench_phase_names[PH_COUNT] = {"layout", "notify", "dispatch", "experts", "combine"};

static const char *mode_name(const bench_opts_t *o) { return o->ll ? "ll" : o->a2a ? "a2a" : "ht"; }
static const char *layout_name(const bench_opts_t *o) { return o->ll || o->expert_layout ? "expert" : "token"; }
static int on_gpu(const bench_env_t *env) { return env->backend == EPX_BACKEND_CUDA; }
static double floor_ms(const bench_env_t *env, const bench_result_t *r, int ph) {
  return r->memory[ph] / env->copy_bw * 1e3;
}
/* bytes read + written per SM-second, in GB/s */
static double per_sm(const bench_result_t *r, int ph) {
  return r->sms_in_use > 0 && r->ms[ph] > 0 ? r->memory[ph] / (r->ms[ph] * 1e-3) / r->sms_in_use * 1e-9 : 0.0;
}

static const char *const floor_text =
    "floor: the bytes a phase must read and write in memory (each row read once where it is and written once\n"
    "where it goes, all ranks together) over the copy bandwidth above; no implementation can be faster, so\n"
    "'of floor' near 100% is the best there is";

void bench_print_header(FILE *out, const bench_env_t *env, const bench_opts_t *o) {
  fprintf(out, "epx-bench: backend %s, %d ranks, %d tokens/rank, hidden %d, %d experts, top-%d, %s%s, mode %s, layout %s",
          epx_backend_name(env->backend), o->ranks, o->tokens, o->hidden, o->experts, o->topk,
          epx_dtype_name(o->x_dtype), o->recv_dtype == EPX_FP8_E4M3 ? " (fp8 dispatch)" : "", mode_name(o),
          layout_name(o));
  if (o->expert_layout && !o->ll) fprintf(out, ", align %d", o->align);
  if (on_gpu(env)) fprintf(out, ", %d SMs per rank%s", o->num_sms, o->graph ? ", CUDA graph" : "");
  fprintf(out, ", seed %llu\n", (unsigned long long)o->seed);
}

static void print_phase(FILE *out, const bench_env_t *env, const bench_result_t *r, int ph) {
  fprintf(out, "%-9s %10.3f", bench_phase_names[ph], r->ms[ph]);
  if (r->link[ph] <= 0) {
    fprintf(out, " %14s %10s %10s %8s", "-", "-", "-", "-");
    if (on_gpu(env)) fprintf(out, " %11s", "-");
    fputc('\n', out);
    return;
  }
  const double f = floor_ms(env, r, ph);
  fprintf(out, " %14.0f %10.1f %10.3f %7.0f%%", r->link[ph], r->link[ph] / r->ms[ph] * 1e-6, f, 100.0 * f / r->ms[ph]);
  if (on_gpu(env)) fprintf(out, " %11.1f", per_sm(r, ph));
  fprintf(out, "\n");
}

static int several_nodes(const bench_opts_t *o) { return o->ranks_per_node > 0 && o->ranks_per_node < o->ranks; }

/* The bytes that crossed node boundaries against one crossing per destination rank. */
static void print_nodes(FILE *out, const bench_result_t *r) {
  const epx_node_traffic_t *t = &r->nodes;
  const double d = (double)t->dispatch_bytes, c = (double)t->combine_bytes, dr = (double)t->dispatch_bytes_per_rank,
               cr = (double)t->combine_bytes_per_rank;
  fprintf(out, "nodes: %d of %d ranks; bytes across node boundaries (all ranks, one iteration)%s:\n",
          r->o.ranks / r->o.ranks_per_node, r->o.ranks_per_node, r->o.ll ? ", low-latency: once per rank" : "");
  fprintf(out, "  dispatch %14.0f  one crossing per rank %14.0f  (%.1f%%)\n", d, dr, dr > 0 ? 100.0 * d / dr : 100.0);
  fprintf(out, "  combine  %14.0f  one crossing per rank %14.0f  (%.1f%%)\n", c, cr, cr > 0 ? 100.0 * c / cr : 100.0);
}

void bench_print_table(FILE *out, const bench_env_t *env, const bench_result_t *r) {
  const bench_opts_t *o = &r->o;
  fprintf(out, "copy bandwidth (read + write): %.0f GB/s, %s\n", env->copy_bw * 1e-9,
          on_gpu(env) ? "cudaMemcpy of 2 GiB on the device" : "memcpy of 256 MiB on this CPU");
  fprintf(out, "%-9s %10s %14s %10s %10s %8s", "phase", "time ms", "link bytes", "link GB/s", "floor ms", "of floor");
  if (on_gpu(env)) fprintf(out, " %11s", "GB/s/SM");
  fputc('\n', out);
  const int shown[] = {PH_LAYOUT, PH_NOTIFY, PH_DISPATCH, PH_COMBINE};
  for (int i = 0; i < 4; i++) print_phase(out, env, r, shown[i]);
  fprintf(out, "%s.\nlink bytes: rows that cross between ranks (a token crosses to a rank once);\ntimes: median over "
               "%d iterations, %s\n",
          floor_text, o->iters, r->shared_clock ? "from the last rank's start to the last rank's end" : "the slowest rank's own");
  fprintf(out, "experts: %.3f ms between dispatch and combine ran a stand-in for the experts (each scales its rows\n"
               "by its own constant, so a misrouted row changes the checked result): not epx's work, not in the table\n",
          r->ms[PH_STANDIN]);
  if (on_gpu(env)) {
    fprintf(out, "GB/s/SM: bytes read + written per SM-second (%d SMs in use: %d ranks x %d); the better of two copy\n"
                 "kernels on %d blocks (16-byte loads, 4 in flight per thread; bulk copies through 24 KB stages) run now\n"
                 "moves %.1f GB/s per SM: dispatch %.0f%%, combine %.0f%% of it\n",
            r->sms_in_use, o->ranks, o->num_sms, r->sms_in_use, r->sm_copy_bw * 1e-9,
            100.0 * per_sm(r, PH_DISPATCH) / (r->sm_copy_bw * 1e-9), 100.0 * per_sm(r, PH_COMBINE) / (r->sm_copy_bw * 1e-9));
    const double dl = r->nvlink_ms[PH_DISPATCH], cl = r->nvlink_ms[PH_COMBINE];
    fprintf(out, "with a GPU per rank the floor is the link instead (NVLink 450 GB/s each way, the busiest rank's\n"
                 "rows): dispatch %.3f ms (%.0f%% of it reached), combine %.3f ms (%.0f%%)%s\n",
            dl, 100.0 * dl / r->ms[PH_DISPATCH], cl, 100.0 * cl / r->ms[PH_COMBINE],
            r->devices > 1 ? "" : "\n(this run emulates the group on one GPU: the memory floor above is the one that applies)");
  }
  if (several_nodes(o)) print_nodes(out, r);
  if (r->check >= 0) fprintf(out, "check: %s\n", r->check_detail);
}

/* ---- JSON -------------------------------------------------------------------------------- */

static void jstr_raw(FILE *out, const char *s) {
  fputc('"', out);
  for (; *s; s++) {
    const unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(out, "\\%c", c);
    else if (c == '\n') fputc(' ', out); /* the table's line breaks */
    else if (c < 0x20) fprintf(out, "\\u%04x", c);
    else fputc(c, out);
  }
  fputc('"', out);
}
static void jkey(FILE *out, const char *k) {
  fputc(',', out);
  jstr_raw(out, k);
  fputc(':', out);
}
static void jstr(FILE *out, const char *k, const char *v) { jkey(out, k), jstr_raw(out, v); }
static void jint(FILE *out, const char *k, long long v) { jkey(out, k), fprintf(out, "%lld", v); }
static void jnum(FILE *out, const char *k, double v) { jkey(out, k), fprintf(out, "%.6g", v); }
static void jphase(FILE *out, const char *phase, const char *what, double v) {
  char k[64];
  snprintf(k, sizeof k, "%s_%s", phase, what);
  jnum(out, k, v);
}

static void jarray(FILE *out, const char *phase, const char *what, const double *v, int n) {
  char k[64];
  snprintf(k, sizeof k, "%s_%s", phase, what);
  jkey(out, k);
  for (int i = 0; i < n; i++) fprintf(out, "%c%.6g", i ? ',' : '[', v[i]);
  fputc(']', out);
}

static void json_shape(FILE *out, const bench_env_t *env, const bench_opts_t *o) {
  fprintf(out, "\"backend\":");
  jstr_raw(out, epx_backend_name(env->backend));
  jint(out, "ranks", o->ranks), jint(out, "tokens", o->tokens), jint(out, "hidden", o->hidden);
  jint(out, "experts", o->experts), jint(out, "topk", o->topk);
  jstr(out, "dtype", epx_dtype_name(o->x_dtype)), jstr(out, "recv_dtype", epx_dtype_name(o->recv_dtype));
  jstr(out, "mode", mode_name(o)), jstr(out, "layout", layout_name(o)), jint(out, "align", o->align);
  if (on_gpu(env)) jint(out, "num_sms", o->num_sms), jint(out, "graph", o->graph);
  jint(out, "iters", o->iters), jint(out, "warmup", o->warmup);
  jkey(out, "seed"), fprintf(out, "%llu", (unsigned long long)o->seed);
}

static void json_run(FILE *out, const bench_env_t *env, const bench_result_t *r) {
  fputc('{', out);
  json_shape(out, env, &r->o);
  jnum(out, "copy_gbps", env->copy_bw * 1e-9);
  for (int ph = 0; ph < PH_COUNT; ph++) {
    const char *n = ph == PH_STANDIN ? "standin_experts" : bench_phase_names[ph];
    jphase(out, n, "ms", r->ms[ph]);
    if (r->o.ranks > 1) {
      jarray(out, n, "rank_start_ms", r->rank_start_ms[ph], r->o.ranks);
      jarray(out, n, "rank_own_ms", r->rank_own_ms[ph], r->o.ranks);
    }
    if (ph == PH_STANDIN) continue;
    jphase(out, n, "link_bytes", r->link[ph]), jphase(out, n, "memory_bytes", r->memory[ph]);
    jphase(out, n, "floor_ms", floor_ms(env, r, ph));
    if (r->link[ph] <= 0) continue;
    jphase(out, n, "link_gbps", r->link[ph] / r->ms[ph] * 1e-6);
    jphase(out, n, "of_floor", floor_ms(env, r, ph) / r->ms[ph]);
    if (!on_gpu(env)) continue;
    jphase(out, n, "gbps_per_sm", per_sm(r, ph));
    jphase(out, n, "nvlink_floor_ms", r->nvlink_ms[ph]);
    jphase(out, n, "nvlink_gbps_per_gpu", r->nvlink_ms[ph] * 450e9 * 1e-3 / (r->ms[ph] * 1e-3) * 1e-9);
  }
  if (on_gpu(env)) jnum(out, "sm_copy_gbps_per_sm", r->sm_copy_bw * 1e-9), jint(out, "sms_in_use", r->sms_in_use);
  jint(out, "devices", r->devices);
  if (several_nodes(&r->o)) {
    jint(out, "ranks_per_node", r->o.ranks_per_node);
    jint(out, "node_dispatch_bytes", (long long)r->nodes.dispatch_bytes);
    jint(out, "node_combine_bytes", (long long)r->nodes.combine_bytes);
    jint(out, "node_dispatch_bytes_per_rank", (long long)r->nodes.dispatch_bytes_per_rank);
    jint(out, "node_combine_bytes_per_rank", (long long)r->nodes.combine_bytes_per_rank);
  }
  jstr(out, "timing", r->shared_clock ? "last rank's start to last rank's end, median" : "slowest rank's own, median");
  jstr(out, "check", r->check < 0 ? "not run" : r->check ? "mismatch" : "ok");
  if (r->check >= 0) jstr(out, "check_detail", r->check_detail);
}

static void json_context(FILE *out, const bench_env_t *env) {
  jstr(out, "floor", floor_text);
  jstr(out, "command", env->command);
  jkey(out, "machine"), fputs(env->machine, out);
}

void bench_write_json(FILE *out, const bench_env_t *env, const bench_result_t *runs, int nruns) {
  if (runs[0].o.sweep == SWEEP_NONE) {
    json_run(out, env, &runs[0]);
    json_context(out, env);
    fputs("}\n", out);
    return;
  }
  fputs("{\"sweep\":", out);
  jstr_raw(out, runs[0].o.sweep == SWEEP_SMS ? "sms" : "tokens");
  json_context(out, env);
  jkey(out, "runs"), fputc('[', out);
  for (int i = 0; i < nruns; i++) {
    if (i) fputc(',', out);
    json_run(out, env, &runs[i]);
    fputc('}', out);
  }
  fputs("]}\n", out);
}

/* The CPU's model name from /proc/cpuinfo, or "". */
static void cpu_model(char *out, size_t n) {
  out[0] = 0;
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    char *colon = strchr(line, ':');
    if (strncmp(line, "model name", 10) || !colon) continue;
    snprintf(out, n, "%s", colon + 2);
    out[strcspn(out, "\n")] = 0;
    break;
  }
  fclose(f);
}

void bench_describe_machine(bench_env_t *env, const char *device) {
  char host[256] = "", cpu[256];
  gethostname(host, sizeof host - 1);
  cpu_model(cpu, sizeof cpu);
  struct utsname u;
  if (uname(&u)) memset(&u, 0, sizeof u);
  char version[32];
  snprintf(version, sizeof version, "%d.%d.%d", epx_get_version() / 10000, epx_get_version() / 100 % 100,
           epx_get_version() % 100);
  FILE *out = fmemopen(env->machine, sizeof env->machine, "w");
  if (!out) return;
  fprintf(out, "{\"host\":");
  jstr_raw(out, host);
  jstr(out, "os", u.sysname), jstr(out, "kernel", u.release), jstr(out, "cpu", cpu);
  jint(out, "cpus", sysconf(_SC_NPROCESSORS_ONLN));
  if (device[0]) jstr(out, "device", device);
  jstr(out, "epx_version", version);
  fputc('}', out);
  fclose(out);
}
