/* mp_util — see mp_util.h. */
#define _GNU_SOURCE
#include "mp_util.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

uint64_t mp_seed;
int mp_rank_label = -1;
static const char *test_name = "test";

typedef struct {
  _Atomic long passed, failed, printed;
} counters_t;
static counters_t *counters;

double mp_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int mp_names_rank(const char *msg, int v) {
  char pat[32];
  snprintf(pat, sizeof pat, "rank %d", v);
  for (const char *p = strstr(msg, pat); p; p = strstr(p + 1, pat)) {
    const char next = p[strlen(pat)];
    if (next < '0' || next > '9') return 1;
  }
  return 0;
}

void mp_begin(const char *name) {
  test_name = name;
  setvbuf(stdout, NULL, _IOLBF, 0);
  counters = mmap(NULL, sizeof *counters, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (counters == MAP_FAILED) {
    perror("mmap");
    exit(2);
  }
  memset(counters, 0, sizeof *counters);
  const char *s = getenv("EPX_TEST_SEED");
  if (s && *s) {
    mp_seed = strtoull(s, NULL, 10);
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    mp_seed = ((uint64_t)ts.tv_sec * 1000003u) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    mp_seed %= 1000000000000ull;
  }
  printf("%s: seed: %llu (rerun with EPX_TEST_SEED=%llu)\n", name, (unsigned long long)mp_seed,
         (unsigned long long)mp_seed);
}

int mp_end(void) {
  long p = atomic_load(&counters->passed), f = atomic_load(&counters->failed);
  printf("%s: seed %llu\n", test_name, (unsigned long long)mp_seed);
  printf("%s: %ld passed, %ld failed\n", test_name, p, f);
  return f ? 1 : 0;
}

void mp_pass(void) { atomic_fetch_add(&counters->passed, 1); }
long mp_failures(void) { return atomic_load(&counters->failed); }

static void vfail(const char *file, int line, const char *cond, const char *fmt, va_list ap) {
  atomic_fetch_add(&counters->failed, 1);
  if (atomic_fetch_add(&counters->printed, 1) >= 60) return;
  char msg[1400];
  vsnprintf(msg, sizeof msg, fmt, ap);
  char who[32] = "parent";
  if (mp_rank_label >= 0) snprintf(who, sizeof who, "proc %d", mp_rank_label);
  printf("[%s] %s:%d: CHECK(%s) failed: %s\n", who, file, line, cond, msg);
  fflush(stdout);
}

void mp_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(file, line, cond, fmt, ap);
  va_end(ap);
}

int mp_check_status(const char *file, int line, const char *expr, epx_status_t got, epx_status_t want, const char *fmt,
                    ...) {
  if (got == want) {
    mp_pass();
    return 1;
  }
  char what[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  mp_fail(file, line, expr, "%s: got %s, want %s; last error: %s", what, epx_status_string(got),
          epx_status_string(want), epx_last_error());
  return 0;
}

const char *mp_boot_name(mp_boot_t b) { return b == MP_BOOT_ID ? "unique-id" : "callback"; }

/* ---- the callback bootstrap: an allgather served by the parent --------------------------- */

static int io_all(int fd, void *buf, size_t n, int writing, int timeout_ms) {
  char *p = buf;
  double deadline = mp_now() + timeout_ms / 1000.0;
  while (n > 0) {
    ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k, n -= (size_t)k;
      continue;
    }
    if (k == 0) return -1;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    double left = deadline - mp_now();
    if (left <= 0) return -1;
    struct pollfd pf = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
    poll(&pf, 1, (int)(left * 1000) + 1);
  }
  return 0;
}

/* The user-style allgather: this process's bytes to the parent, everyone's back. */
static int hub_allgather(const void *mine, void *all, size_t bytes, void *vctx) {
  mp_ctx_t *c = vctx;
  uint64_t n = bytes;
  if (io_all(c->hub_fd, &n, sizeof n, 1, 30000) || io_all(c->hub_fd, (void *)mine, bytes, 1, 30000)) return -1;
  if (io_all(c->hub_fd, all, bytes * (size_t)c->nprocs, 0, 30000)) return -2;
  return 0;
}

epx_status_t mp_world_create_with(mp_ctx_t *ctx, const epx_world_config_t *wc, int rank, epx_world_t **world) {
  if (ctx->boot == MP_BOOT_ID) return epx_world_create_rank(wc, &ctx->id, rank, world);
  return epx_world_create_rank_with(wc, rank, hub_allgather, ctx, world);
}

epx_status_t mp_world_create(mp_ctx_t *ctx, int nranks, int rank, epx_world_t **world) {
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST;
  wc.nranks = nranks;
  return mp_world_create_with(ctx, &wc, rank, world);
}

typedef struct {
  int fd;
  int have;     /* sent this round */
  char *data;
  uint64_t bytes;
} hub_peer_t;

/* Serves whatever the children sent; closes every connection when the exchange cannot go on
 * (a child left mid-exchange, sizes differ): the children's allgathers then fail. */
static void hub_serve(hub_peer_t *peers, int n) {
  struct pollfd pf[MP_MAX_PROCS];
  int who[MP_MAX_PROCS], m = 0;
  for (int i = 0; i < n; i++)
    if (peers[i].fd >= 0) pf[m] = (struct pollfd){.fd = peers[i].fd, .events = POLLIN}, who[m++] = i;
  if (m == 0 || poll(pf, (nfds_t)m, 10) <= 0) return;
  bool broken = false;
  for (int j = 0; j < m; j++) {
    if (!pf[j].revents) continue;
    hub_peer_t *p = &peers[who[j]];
    uint64_t bytes;
    if (p->have || io_all(p->fd, &bytes, sizeof bytes, 0, 5000)) {
      /* EOF: fine when no exchange is open. */
      bool open = false;
      for (int i = 0; i < n; i++) open |= peers[i].have;
      close(p->fd);
      p->fd = -1;
      if (open && !p->have) broken = true;
      continue;
    }
    p->data = malloc(bytes ? bytes : 1);
    p->bytes = bytes;
    if (io_all(p->fd, p->data, bytes, 0, 5000)) {
      broken = true;
      continue;
    }
    p->have = 1;
  }
  int count = 0, first = -1;
  for (int i = 0; i < n; i++)
    if (peers[i].have) {
      count++;
      if (first < 0) first = i;
      if (peers[i].bytes != peers[first].bytes) broken = true;
    }
  if (!broken && count == n) {
    size_t b = peers[0].bytes;
    char *all = malloc(b * n + 1);
    for (int i = 0; i < n; i++) memcpy(all + b * i, peers[i].data, b);
    for (int i = 0; i < n; i++)
      if (peers[i].fd >= 0) io_all(peers[i].fd, all, b * n, 1, 5000);
    free(all);
  }
  if (broken || count == n)
    for (int i = 0; i < n; i++) {
      free(peers[i].data);
      peers[i].data = NULL;
      peers[i].have = 0;
      if (broken && peers[i].fd >= 0) close(peers[i].fd), peers[i].fd = -1;
    }
}

/* ---- launching --------------------------------------------------------------------------- */

static void child_main(mp_ctx_t *ctx, mp_proc_fn fn) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  mp_rank_label = ctx->proc;
  fn(ctx);
  if (ctx->hub_fd >= 0) close(ctx->hub_fd);
  fflush(stdout);
  exit(0);
}

int mp_launch(const mp_launch_t *l, mp_proc_fn fn, void *arg) {
  const int n = l->nprocs;
  pid_t pid[MP_MAX_PROCS];
  int done[MP_MAX_PROCS] = {0}, wstatus[MP_MAX_PROCS] = {0};
  hub_peer_t hub[MP_MAX_PROCS];
  int child_fd[MP_MAX_PROCS];
  for (int i = 0; i < n; i++) hub[i] = (hub_peer_t){.fd = -1}, child_fd[i] = -1, pid[i] = -1;
  if (l->boot == MP_BOOT_CALLBACK)
    for (int i = 0; i < n; i++) {
      int sv[2];
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        exit(2);
      }
      hub[i].fd = sv[0];
      child_fd[i] = sv[1];
    }

  mp_ctx_t base = {.nprocs = n, .boot = l->boot, .hub_fd = -1, .arg = arg};
  int idpipe[2] = {-1, -1};
  if (l->boot == MP_BOOT_ID && pipe(idpipe) != 0) {
    perror("pipe");
    exit(2);
  }
  int bad = 0;
  for (int i = 0; i < n; i++) {
    mp_ctx_t ctx = base;
    ctx.proc = i;
    ctx.hub_fd = child_fd[i];
    fflush(stdout);
    pid[i] = fork();
    if (pid[i] < 0) {
      perror("fork");
      exit(2);
    }
    if (pid[i] == 0) {
      for (int j = 0; j < n; j++) {
        if (hub[j].fd >= 0) close(hub[j].fd);
        if (j != i && child_fd[j] >= 0) close(child_fd[j]);
      }
      if (l->boot == MP_BOOT_ID) {
        close(idpipe[0]);
        if (i == 0) {
          epx_status_t s = epx_get_unique_id(&ctx.id);
          CHECK_STATUS(s, EPX_SUCCESS, "epx_get_unique_id");
          if (s != EPX_SUCCESS) memset(&ctx.id, 0, sizeof ctx.id);
          if (write(idpipe[1], &ctx.id, sizeof ctx.id) != (ssize_t)sizeof ctx.id) _exit(3);
        }
        close(idpipe[1]);
      }
      child_main(&ctx, fn);
    }
    if (child_fd[i] >= 0) close(child_fd[i]), child_fd[i] = -1;
    if (l->boot == MP_BOOT_ID && i == 0) {
      close(idpipe[1]);
      struct pollfd pf = {.fd = idpipe[0], .events = POLLIN};
      ssize_t k = -1;
      if (poll(&pf, 1, 30000) == 1) k = read(idpipe[0], &base.id, sizeof base.id);
      close(idpipe[0]);
      if (k != (ssize_t)sizeof base.id) {
        CHECK(0, "process 0 did not hand over the unique id");
        memset(&base.id, 0, sizeof base.id);
      }
    }
  }

  /* Wait (serving the callback bootstrap meanwhile) under the watchdog. */
  const double start = mp_now(), deadline = start + l->limit_s;
  int left = n;
  bool killed = false, shot[MP_MAX_PROCS] = {false};
  while (left > 0) {
    for (int i = 0; i < n; i++)
      if (l->kill_after_s[i] > 0 && !shot[i] && !done[i] && mp_now() - start >= l->kill_after_s[i]) {
        kill(pid[i], SIGKILL);
        shot[i] = true;
      }
    if (l->boot == MP_BOOT_CALLBACK)
      hub_serve(hub, n);
    else {
      struct timespec ts = {0, 2000000L};
      nanosleep(&ts, NULL);
    }
    int st;
    pid_t w;
    while ((w = waitpid(-1, &st, WNOHANG)) > 0)
      for (int i = 0; i < n; i++)
        if (pid[i] == w) done[i] = 1, wstatus[i] = st, left--;
    if (left > 0 && !killed && mp_now() > deadline) {
      for (int i = 0; i < n; i++)
        if (!done[i]) {
          CHECK(0, "process %d still running after %.0f s: killed (a hang)", i, l->limit_s);
          kill(pid[i], SIGKILL);
          bad++;
        }
      killed = true;
    }
  }
  for (int i = 0; i < n; i++) {
    if (hub[i].fd >= 0) close(hub[i].fd);
    free(hub[i].data);
  }

  for (int i = 0; i < n; i++) {
    int want = l->expect_signal[i];
    int st = wstatus[i];
    if (want == 0) {
      bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      CHECK(ok, "process %d ended with %s %d, not exit 0", i, WIFEXITED(st) ? "exit code" : "signal",
            WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
      bad += !ok;
    } else {
      bool ok = WIFSIGNALED(st) && WTERMSIG(st) == want;
      CHECK(ok, "process %d ended with %s %d, not signal %d", i, WIFEXITED(st) ? "exit code" : "signal",
            WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), want);
      bad += !ok;
    }
  }
  return bad;
}

/* ---- the system's view ------------------------------------------------------------------- */

int mp_count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own descriptor */
}

int mp_count_epx_maps(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[1024];
  int n = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, "memfd:epx-") || strstr(line, "/dev/shm/epx")) n++;
  fclose(f);
  return n;
}

int mp_shm_list(char *names, size_t size) {
  if (names && size) names[0] = '\0';
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int n = 0;
  size_t len = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strstr(e->d_name, "epx")) continue;
    n++;
    if (names && len + strlen(e->d_name) + 2 < size) len += (size_t)snprintf(names + len, size - len, "%s\n", e->d_name);
  }
  closedir(d);
  return n;
}

int mp_shm_new(const char *before, char *out, size_t size) {
  char now[8192];
  mp_shm_list(now, sizeof now);
  int n = 0;
  size_t len = 0;
  if (out && size) out[0] = '\0';
  for (char *line = now; *line;) {
    char *nl = strchr(line, '\n');
    if (!nl) break;
    *nl = '\0';
    bool seen = false; /* a whole line of before equal to this one */
    size_t ll = strlen(line);
    for (const char *q = before; q && (q = strstr(q, line)); q += ll)
      if ((q == before || q[-1] == '\n') && q[ll] == '\n') seen = true;
    if (!seen) {
      n++;
      if (out && len + strlen(line) + 2 < size) len += (size_t)snprintf(out + len, size - len, "%s ", line);
    }
    line = nl + 1;
  }
  return n;
}

/* ---- data -------------------------------------------------------------------------------- */

mp_rng_t mp_rng(uint64_t seed, uint64_t stream) {
  mp_rng_t g = {seed * 0x9e3779b97f4a7c15ull + stream * 0xbf58476d1ce4e5b9ull + 1};
  return g;
}

uint64_t mp_u64(mp_rng_t *g) {
  uint64_t z = (g->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int mp_int(mp_rng_t *g, int lo, int hi) { return lo + (int)(mp_u64(g) % (uint64_t)(hi - lo + 1)); }

static double unit(mp_rng_t *g) { return (double)(mp_u64(g) >> 11) * (1.0 / 9007199254740992.0); }

float mp_load(epx_dtype_t t, const void *base, size_t i) {
  if (t == EPX_BFLOAT16) return epx_bf16_to_float(((const uint16_t *)base)[i]);
  return ((const float *)base)[i];
}

void mp_store(epx_dtype_t t, void *base, size_t i, float v) {
  if (t == EPX_BFLOAT16)
    ((uint16_t *)base)[i] = epx_float_to_bf16(v);
  else
    ((float *)base)[i] = v;
}

void mp_moe_make(mp_moe_t *m, uint64_t seed, uint64_t stream, int R, int E, int H, int K, epx_dtype_t x_dtype,
                 int max_tokens) {
  memset(m, 0, sizeof *m);
  m->R = R, m->E = E, m->H = H, m->K = K, m->L = E / R, m->x_dtype = x_dtype;
  mp_rng_t g = mp_rng(seed, stream);
  int empty = mp_int(&g, 0, R); /* one rank (or none, when == R) sends nothing */
  for (int r = 0; r < R; r++) {
    int64_t T = r == empty ? 0 : mp_int(&g, 1, max_tokens);
    m->T[r] = T;
    m->x[r] = malloc((size_t)(T * H) * epx_dtype_size(x_dtype) + 1);
    m->idx[r] = malloc(sizeof(int32_t) * (size_t)(T * K) + 1);
    m->w[r] = malloc(sizeof(float) * (size_t)(T * K) + 1);
    for (int64_t i = 0; i < T * H; i++) {
      double mag = ldexp(1.0 + unit(&g), mp_int(&g, -6, 3));
      mp_store(x_dtype, m->x[r], (size_t)i, (float)(mp_u64(&g) & 1 ? mag : -mag));
    }
    int *perm = malloc(sizeof(int) * (size_t)E);
    for (int64_t t = 0; t < T; t++) {
      for (int e = 0; e < E; e++) perm[e] = e;
      for (int k = 0; k < K; k++) { /* distinct experts, unsorted; some slots empty */
        int j = mp_int(&g, k, E - 1);
        int tmp = perm[k];
        perm[k] = perm[j], perm[j] = tmp;
        m->idx[r][t * K + k] = unit(&g) < 0.15 ? -1 : perm[k];
        m->w[r][t * K + k] = (float)(0.01 + 0.99 * unit(&g));
      }
    }
    free(perm);
  }
}

void mp_moe_free(mp_moe_t *m) {
  for (int r = 0; r < m->R; r++) free(m->x[r]), free(m->idx[r]), free(m->w[r]);
}

void *mp_dense_out(const mp_moe_t *m, int rank, epx_dtype_t recv_dtype, epx_dtype_t y_dtype, epx_dtype_t out_dtype,
                   int expert_layout) {
  dense_cfg_t cfg = {.nranks = m->R, .num_experts = m->E, .hidden = m->H, .topk = m->K, .x_dtype = m->x_dtype,
                     .recv_dtype = recv_dtype, .y_dtype = y_dtype, .out_dtype = out_dtype,
                     .expert_layout = expert_layout, .ranks_per_node = m->ranks_per_node};
  void *out[MP_MAX_PROCS];
  for (int r = 0; r < m->R; r++) out[r] = malloc((size_t)(m->T[r] * m->H) * epx_dtype_size(out_dtype) + 1);
  int rc = dense_moe(&cfg, m->T, (const void *const *)m->x, (const int32_t *const *)m->idx,
                     (const float *const *)m->w, out);
  CHECK(rc == 0, "dense_moe failed");
  for (int r = 0; r < m->R; r++)
    if (r != rank) free(out[r]);
  return out[rank];
}
