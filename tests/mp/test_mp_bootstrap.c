/* test_mp_bootstrap: strangers cannot stop a group from forming, nor join it.
 *
 * R rank processes form a group through epx_get_unique_id while an attacker process (a
 * process of this user that knows the listener's port, as anyone can from /proc/net/tcp,
 * but not the id's secret) does, all at once from before the first rank joins:
 *   silent    opens more silent connections than the listener keeps pending
 *   slow      sends a hello one byte every 100 ms
 *   garbage   sends random bytes, and keeps the connection open
 *   wrong     speaks the protocol with a made-up proof: the listener refuses it with a
 *             message about the secret; epx_world_create_rank with a copy of the id whose
 *             secret is wrong fails with EPX_ERR_INVALID_ARGUMENT naming the secret, fast
 *   unix      connects, silently, to every epx unix socket it finds in /proc/net/unix
 *   other     a process of another user (when the test runs as root) connecting to the
 *             listener is dropped without even a challenge; and a group whose ranks run as
 *             two users (through the caller's allgather) fails on both ranks
 * Every rank must form the group within FORM_S (normally it takes well under a second; the
 * timeout is 20 s), agree on the plan of a notify (counts against an independent count), and
 * the attacker's connections must have got nothing but challenges and refusals. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "mp_util.h"

#define R 4
#define H 64
#define K 2
#define L 2
#define MAXT 16
#define FORM_S 3.0     /* the group forms within this, attacks or not */
#define ATTACK_S 4.0   /* how long the attacker keeps at it */
#define SILENT 300     /* more than the listener keeps pending */
#define START_MS 1000  /* the ranks join this late: the attacks are under way by then */
#define CHURN 5        /* new silent connections per 10 ms while the ranks join */

/* The id's layout as the listener's code writes it (src/transport/bootstrap.c): only what a
 * stranger can learn anyway (address, port) is read; the secret is only spoiled. */
#define ID_TAG "epxuid2"
#define ID_ADDR 8
#define ID_PORT 12
#define ID_SECRET 20

static int tcp_connect(const epx_unique_id_t *id) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  memcpy(&a.sin_addr.s_addr, id->internal + ID_ADDR, 4);
  memcpy(&a.sin_port, id->internal + ID_PORT, 2);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) != 0) close(fd), fd = -1;
  return fd;
}

/* Bytes available within ms: what the listener sent (-1: hung up with nothing). */
static ssize_t read_within(int fd, void *buf, size_t n, int ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  if (poll(&p, 1, ms) <= 0) return 0;
  ssize_t k = recv(fd, buf, n, MSG_DONTWAIT);
  return k > 0 ? k : -1;
}

/* Speaks the protocol with a made-up proof (challenge: 24 bytes; hello: 4 words, a nonce of
 * 16 bytes and a proof of 32); the refusal must say the proof is wrong. */
static void wrong_proof(const epx_unique_id_t *id, tu_rng_t *g) {
  int fd = tcp_connect(id);
  CHECK(fd >= 0, "attacker: connect");
  if (fd < 0) return;
  unsigned char chal[24], hello[16 + 16 + 32], reply[600];
  CHECK(read_within(fd, chal, sizeof chal, 2000) == (ssize_t)sizeof chal, "attacker: a challenge comes first");
  memcpy(hello, chal, 4); /* the magic word */
  int32_t who[3] = {1, R, (int32_t)getpid()};
  memcpy(hello + 4, who, sizeof who);
  for (size_t i = 16; i < sizeof hello; i++) hello[i] = (unsigned char)tu_u64(g);
  CHECK(send(fd, hello, sizeof hello, MSG_NOSIGNAL) == (ssize_t)sizeof hello, "attacker: hello sent");
  size_t got = 0;
  ssize_t k;
  while (got < sizeof reply - 1 && (k = read_within(fd, reply + got, sizeof reply - 1 - got, 2000)) > 0) got += (size_t)k;
  reply[got] = '\0';
  CHECK(got > 24 && strstr((char *)reply + 24, "secret") != NULL, "attacker: the refusal names the secret (%zu bytes)",
        got);
  close(fd);
}

/* Connects once to every epx unix socket in /proc/net/unix not seen yet; keeps them open. */
static int squat_unix(int *fds, int n, int max, char seen[][64]) {
  FILE *f = fopen("/proc/net/unix", "re");
  if (!f) return n;
  char line[512];
  while (n < max && fgets(line, sizeof line, f)) {
    char *at = strstr(line, " @epx.");
    if (!at) continue;
    char name[64];
    snprintf(name, sizeof name, "%s", at + 2);
    name[strcspn(name, "\n")] = '\0';
    int dup = 0;
    for (int i = 0; i < n && !dup; i++) dup = !strcmp(seen[i], name);
    if (dup) continue;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    size_t len = strlen(name);
    memcpy(a.sun_path + 1, name, len);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len)) == 0) {
      snprintf(seen[n], 64, "%s", name);
      fds[n++] = fd;
    } else if (fd >= 0) {
      close(fd);
    }
  }
  fclose(f);
  return n;
}

/* A process of another user: the listener must drop it before any challenge. Returns its
 * pid (0 when the test cannot become another user); other_user_verdict waits for it. */
static pid_t other_user(const epx_unique_id_t *id) {
  if (geteuid() != 0) return 0; /* needs root to become someone else */
  pid_t c = fork();
  if (c == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    int fd = tcp_connect(id);
    if (fd < 0) _exit(3);
    unsigned char buf[64];
    _exit(read_within(fd, buf, sizeof buf, 3000) < 0 ? 0 : 4); /* hung up with nothing: 0 */
  }
  return c;
}

static void other_user_verdict(pid_t c) {
  if (c <= 0) return;
  int st = 0;
  waitpid(c, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "attacker: another user's connection was not dropped unheard (%d)",
        WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

static void attacker(mp_ctx_t *ctx) {
  tu_rng_t g = tu_rng_stream(tu_seed, 77);
  static int silent[SILENT], slow[8], garbage[8], squat[256];
  static char seen[256][64];
  int nsquat = 0;
  for (int i = 0; i < SILENT; i++) silent[i] = tcp_connect(&ctx->id);
  for (int i = 0; i < 8; i++) slow[i] = tcp_connect(&ctx->id);
  for (int i = 0; i < 8; i++) {
    garbage[i] = tcp_connect(&ctx->id);
    unsigned char junk[200];
    for (size_t j = 0; j < sizeof junk; j++) junk[j] = (unsigned char)tu_u64(&g);
    if (garbage[i] >= 0) send(garbage[i], junk, sizeof junk, MSG_NOSIGNAL);
  }
  double tw = tu_now();
  wrong_proof(&ctx->id, &g);
  printf("attacker: the wrong proof took %.3f s\n", tu_now() - tw);
  pid_t other = other_user(&ctx->id);
  /* the id with a spoiled secret, as rank 1 */
  epx_unique_id_t bad = ctx->id;
  CHECK(memcmp(bad.internal, ID_TAG, 8) == 0, "attacker: the id's layout is the one this test knows");
  bad.internal[ID_SECRET + 5] ^= 0x40;
  epx_world_config_t wc;
  epx_world_config_init(&wc);
  wc.backend = EPX_BACKEND_HOST, wc.nranks = R;
  epx_world_t *w = NULL;
  double t0 = tu_now();
  CHECK_STATUS(epx_world_create_rank(&wc, &bad, 1, &w), EPX_ERR_INVALID_ARGUMENT, "attacker: joining with a wrong secret");
  CHECK(strstr(epx_last_error(), "secret") != NULL && tu_now() - t0 < 2.0, "attacker: refused at once (%.3f s): %s",
        tu_now() - t0, epx_last_error());
  CHECK(w == NULL, "attacker: no world");
  const double end = tu_now() + ATTACK_S;
  int next = 0; /* the silent connections turn over: always SILENT open, CHURN new per tick */
  for (int tick = 0; tu_now() < end; tick++) {
    for (int i = 0; i < 8; i++) /* one byte of a plausible hello per 100 ms */
      if (slow[i] >= 0 && tick % 10 == 0) send(slow[i], "c", 1, MSG_NOSIGNAL);
    for (int i = 0; i < CHURN; i++, next = (next + 1) % SILENT) {
      if (silent[next] >= 0) close(silent[next]);
      silent[next] = tcp_connect(&ctx->id);
    }
    nsquat = squat_unix(squat, nsquat, 256, seen);
    tu_sleep_ms(10);
  }
  other_user_verdict(other);
  for (int i = 0; i < SILENT; i++)
    if (silent[i] >= 0) close(silent[i]);
  for (int i = 0; i < 8; i++) {
    if (slow[i] >= 0) close(slow[i]);
    if (garbage[i] >= 0) close(garbage[i]);
  }
  for (int i = 0; i < nsquat; i++) close(squat[i]);
  printf("attacker: %d silent, 8 slow, 8 garbage, 1 wrong proof, 1 wrong secret, %d unix squats\n", SILENT, nsquat);
}

/* Tokens (and pairs) of every rank's routing that land on rank d: the notify's plan. */
static void expected_counts(const tu_moe_t *m, int d, int64_t *tokens, int64_t *pairs) {
  *tokens = *pairs = 0;
  for (int s = 0; s < R; s++)
    for (int64_t t = 0; t < m->T[s]; t++) {
      int here = 0;
      for (int k = 0; k < K; k++) {
        int e = m->idx[s][t * K + k];
        if (e >= 0 && e / L == d) here = 1, ++*pairs;
      }
      *tokens += here;
    }
}

static void rank_proc(mp_ctx_t *ctx) {
  const int me = ctx->proc;
  tu_sleep_ms(START_MS);
  epx_world_t *world = NULL;
  double t0 = tu_now();
  epx_status_t s = mp_world_create(ctx, R, me, &world);
  double secs = tu_now() - t0;
  if (!CHECK_STATUS(s, EPX_SUCCESS, "rank %d: world under attack", me)) return;
  CHECK(secs < FORM_S, "rank %d: the group took %.3f s to form under attack (bound %.1f s)", me, secs, FORM_S);
  printf("rank %d: formed in %.3f s\n", me, secs);
  epx_comm_t *comm;
  epx_handle_t *h;
  tu_moe_t m;
  tu_moe_stream(&m, tu_seed, 5, R, R * L, H, K, EPX_BFLOAT16, MAXT);
  char tag[32];
  snprintf(tag, sizeof tag, "rank %d:", me);
  if (mp_comm_open(world, me, &m, MAXT, 0, tag, &comm, &h)) {
    epx_routing_t rt = tu_routing(&m, me, TU_FORM_TOPK32);
    epx_handle_info_t info;
    int64_t tokens, pairs;
    expected_counts(&m, me, &tokens, &pairs);
    if (CHECK_STATUS(epx_notify(comm, h, &rt), EPX_SUCCESS, "rank %d: notify", me) &&
        CHECK_STATUS(epx_handle_info(h, &info, NULL), EPX_SUCCESS, "rank %d: info", me))
      CHECK(info.num_recv_tokens == tokens && info.num_recv_pairs == pairs,
            "rank %d: plan %lld tokens %lld pairs, want %lld %lld", me, (long long)info.num_recv_tokens,
            (long long)info.num_recv_pairs, (long long)tokens, (long long)pairs);
  }
  tu_moe_free(&m);
  epx_handle_destroy(h);
  epx_comm_destroy(comm);
  epx_world_destroy(world);
}

static void proc_main(mp_ctx_t *ctx) {
  if (ctx->proc == R)
    attacker(ctx);
  else
    rank_proc(ctx);
}

/* Two ranks through the caller's allgather, rank 1 running as another user: both fail with
 * EPX_ERR_UNSUPPORTED naming the users (the allgather does not check who is on it; epx does). */
static void mixed_users(mp_ctx_t *ctx) {
  if (ctx->proc == 1 && (setgid(65534) != 0 || setuid(65534) != 0)) {
    CHECK(0, "rank 1: could not become another user");
    return;
  }
  epx_world_t *w = NULL;
  double t0 = tu_now();
  epx_status_t s = mp_world_create(ctx, 2, ctx->proc, &w);
  CHECK_STATUS(s, EPX_ERR_UNSUPPORTED, "rank %d: a group of two users", ctx->proc);
  CHECK(strstr(epx_last_error(), "user") != NULL && tu_now() - t0 < 5.0, "rank %d: says so at once (%.3f s): %s",
        ctx->proc, tu_now() - t0, epx_last_error());
  CHECK(w == NULL, "rank %d: no world", ctx->proc);
}

int main(void) {
  tu_begin("test_mp_bootstrap");
  setenv("EPX_TIMEOUT_MS", "20000", 1);
  signal(SIGPIPE, SIG_IGN);
  mp_launch_t l = {.nprocs = R + 1, .boot = MP_BOOT_ID, .limit_s = 60};
  double t0 = tu_now();
  mp_launch(&l, proc_main, NULL);
  printf("%.2f s\n", tu_now() - t0);
  if (geteuid() == 0) { /* becoming another user needs root */
    mp_launch_t l2 = {.nprocs = 2, .boot = MP_BOOT_CALLBACK, .limit_s = 60};
    mp_launch(&l2, mixed_users, NULL);
  }
  return tu_end();
}
