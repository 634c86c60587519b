/* mp_util — see mp_util.h. */
#define _GNU_SOURCE
#include "mp_util.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *mp_boot_name(mp_boot_t b) { return b == MP_BOOT_ID ? "unique-id" : "callback"; }

/* ---- the callback bootstrap: an allgather served by the parent --------------------------- */

static int io_all(int fd, void *buf, size_t n, int writing, int timeout_ms) {
  char *p = buf;
  double deadline = tu_now() + timeout_ms / 1000.0;
  while (n > 0) {
    ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k, n -= (size_t)k;
      continue;
    }
    if (k == 0) return -1;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    double left = deadline - tu_now();
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
  char label[32];
  snprintf(label, sizeof label, "proc %d", ctx->proc);
  tu_enter_process(label);
  fn(ctx);
  if (ctx->hub_fd >= 0) close(ctx->hub_fd);
  fflush(stdout);
  exit(0);
}

/* One launch's processes as the parent sees them. */
typedef struct {
  const char *file; /* the caller's place, for the launch's checks */
  int line;
  const mp_launch_t *l;
  pid_t pid[MP_MAX_PROCS];
  int done[MP_MAX_PROCS], wstatus[MP_MAX_PROCS];
  hub_peer_t hub[MP_MAX_PROCS];
  int bad;
} launch_t;

/* Forks the processes: for MP_BOOT_ID process 0 first, whose unique id the others get. */
static void launch_fork(launch_t *L, mp_proc_fn fn, void *arg) {
  const mp_launch_t *l = L->l;
  const int n = l->nprocs;
  int child_fd[MP_MAX_PROCS];
  for (int i = 0; i < n; i++) L->hub[i] = (hub_peer_t){.fd = -1}, child_fd[i] = -1, L->pid[i] = -1;
  if (l->boot == MP_BOOT_CALLBACK)
    for (int i = 0; i < n; i++) {
      int sv[2];
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        exit(2);
      }
      L->hub[i].fd = sv[0];
      child_fd[i] = sv[1];
    }

  mp_ctx_t base = {.nprocs = n, .boot = l->boot, .hub_fd = -1, .arg = arg};
  int idpipe[2] = {-1, -1};
  if (l->boot == MP_BOOT_ID && pipe(idpipe) != 0) {
    perror("pipe");
    exit(2);
  }
  for (int i = 0; i < n; i++) {
    mp_ctx_t ctx = base;
    ctx.proc = i;
    ctx.hub_fd = child_fd[i];
    fflush(stdout);
    L->pid[i] = fork();
    if (L->pid[i] < 0) {
      perror("fork");
      exit(2);
    }
    if (L->pid[i] == 0) {
      for (int j = 0; j < n; j++) {
        if (L->hub[j].fd >= 0) close(L->hub[j].fd);
        if (j != i && child_fd[j] >= 0) close(child_fd[j]);
      }
      if (l->boot == MP_BOOT_ID) {
        close(idpipe[0]);
        if (i == 0) {
          epx_status_t s = epx_get_unique_id(&ctx.id);
          check_status_at(L->file, L->line, "epx_get_unique_id", s, EPX_SUCCESS, "epx_get_unique_id");
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
        check_fail(L->file, L->line, "unique id", "process 0 did not hand over the unique id");
        memset(&base.id, 0, sizeof base.id);
      }
    }
  }
}

/* Waits for every process (serving the callback bootstrap meanwhile) under the watchdog. */
static void launch_wait(launch_t *L) {
  const mp_launch_t *l = L->l;
  const int n = l->nprocs;
  const double start = tu_now(), deadline = start + l->limit_s;
  int left = n;
  bool killed = false, shot[MP_MAX_PROCS] = {false};
  while (left > 0) {
    for (int i = 0; i < n; i++)
      if (l->kill_after_s[i] > 0 && !shot[i] && !L->done[i] && tu_now() - start >= l->kill_after_s[i]) {
        kill(L->pid[i], SIGKILL);
        shot[i] = true;
      }
    if (l->boot == MP_BOOT_CALLBACK)
      hub_serve(L->hub, n);
    else {
      struct timespec ts = {0, 2000000L};
      nanosleep(&ts, NULL);
    }
    for (int i = 0; i < n; i++) { /* by pid: a process to be reaped late stays a zombie meanwhile */
      int st;
      if (L->done[i] || (l->reap_after_s[i] > 0 && tu_now() - start < l->reap_after_s[i])) continue;
      if (waitpid(L->pid[i], &st, WNOHANG) == L->pid[i]) L->done[i] = 1, L->wstatus[i] = st, left--;
    }
    if (left > 0 && !killed && tu_now() > deadline) {
      for (int i = 0; i < n; i++)
        if (!L->done[i]) {
          check_fail(L->file, L->line, "no hang", "process %d still running after %.0f s: killed (a hang)", i,
                     l->limit_s);
          kill(L->pid[i], SIGKILL);
          L->bad++;
        }
      killed = true;
    }
  }
  for (int i = 0; i < n; i++) {
    if (L->hub[i].fd >= 0) close(L->hub[i].fd);
    free(L->hub[i].data);
  }
}

/* Whether each process ended as the launch expects: exit 0, or the signal asked for. */
static void launch_judge(launch_t *L) {
  for (int i = 0; i < L->l->nprocs; i++) {
    const int want = L->l->expect_signal[i], st = L->wstatus[i];
    const bool ok = want == 0 ? WIFEXITED(st) && WEXITSTATUS(st) == 0 : WIFSIGNALED(st) && WTERMSIG(st) == want;
    const char *how = WIFEXITED(st) ? "exit code" : "signal";
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st);
    if (ok)
      check_pass();
    else if (want == 0)
      check_fail(L->file, L->line, "exit 0", "process %d ended with %s %d, not exit 0", i, how, code);
    else
      check_fail(L->file, L->line, "killed", "process %d ended with %s %d, not signal %d", i, how, code, want);
    L->bad += !ok;
  }
}

int mp_launch_at(const char *file, int line, const mp_launch_t *l, mp_proc_fn fn, void *arg) {
  launch_t L;
  memset(&L, 0, sizeof L);
  L.file = file, L.line = line, L.l = l;
  launch_fork(&L, fn, arg);
  launch_wait(&L);
  launch_judge(&L);
  return L.bad;
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

/* ---- a comm ------------------------------------------------------------------------------- */

int mp_comm_open(epx_world_t *world, int rank, const tu_moe_t *m, int max_tokens, int timeout_ms, const char *tag,
                 epx_comm_t **comm, epx_handle_t **h) {
  epx_config_t cfg;
  epx_config_init(&cfg);
  cfg.num_experts = m->E, cfg.hidden = m->H, cfg.topk = m->K, cfg.max_tokens_per_rank = max_tokens;
  cfg.timeout_ms = timeout_ms;
  epx_handle_config_t hc;
  epx_handle_config_init(&hc);
  *comm = NULL, *h = NULL;
  return CHECK_STATUS(epx_comm_init(world, rank, &cfg, comm), EPX_SUCCESS, "%s comm", tag) &&
         CHECK_STATUS(epx_handle_create(*comm, &hc, h), EPX_SUCCESS, "%s handle", tag);
}
