/* TCP bootstrap of a cross-process group, NCCL style.
 *
 * epx_get_unique_id opens a listener and serves it from a detached thread; the id carries
 * (address, port, pid, a 32-byte random secret). The address is this process's choice
 * (socket_address): EPX_BOOTSTRAP_ADDR, else the IPv4 address of the interface EPX_SOCKET_IFNAME,
 * else the loopback address; a rank connects from its own choice, so ranks on several hosts
 * (or, for tests, on several loopback addresses) meet at one listener. The id is the group's
 * only credential: a process that holds it can join the group as a missing rank (and then
 * read what the group exchanges), or make the group fail by joining as a rank twice. Without
 * it, a process can neither join nor stop the group from forming:
 *
 *   handshake  the server sends every new connection a random nonce; the client answers
 *              with HMAC-SHA256(secret, nonce, its own nonce, rank, size, pid) and the
 *              server proves its own knowledge of the secret back the same way. The secret
 *              never crosses the wire.
 *   no waits   one thread polls every connection; each is read as its bytes come, none is
 *              waited on. A connection that has not proved itself within HELLO_MS is
 *              dropped; when the table of such connections is full the oldest goes, and a
 *              real rank whose connection went that way connects again (within its
 *              deadline), so a flood of silent connections delays a rank by a retry, not
 *              the group by a timeout.
 *   users      connections from another user's sockets on this host (sock_diag or
 *              /proc/net/tcp) are dropped at once: other users get no pending slots at all.
 *              A connection from another host has no user this host can see: it must prove
 *              the secret like any other.
 *
 * After the handshake a rank makes exchanges: it sends its bytes, the server waits for every
 * rank's and sends all of them back, rank-major. The server checks what the ranks say (one
 * size, no rank twice) and names the ranks that never joined, or never came to an exchange
 * others are in, when its deadline passes (EPX_TIMEOUT_MS after the last progress; a group
 * between exchanges waits for nothing). A rank ends with a goodbye before it hangs up; one
 * that hangs up without it (its process, or its host, is gone) fails the group at once: every
 * rank waiting in an exchange, and every later one, gets EPX_ERR_PEER_LOST naming it. That is
 * how ranks on other hosts learn of a loss: their connections are the only thing they share.
 * The server ends when every rank has hung up. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"

#define ID_TAG "epxuid2"
#define MSG_MAGIC 0x63707865u /* "expc" */
#define CLIENT_GRACE_MS 2000  /* a client waits this much longer than the server, to hear why */
#define MAX_PENDING 256       /* connections that have not proved themselves yet */
#define HELLO_MS 5000         /* ... and how long each may take (at most the timeout) */
#define MAX_EXCHANGE_BYTES (1u << 20)
#define SECRET_BYTES 32
#define NONCE_BYTES 16
#define GOODBYE_ROUND (-1)    /* a request of this round: the rank is done, and hangs up next */

typedef struct {
  char tag[8];
  uint32_t addr;  /* network order */
  uint16_t port;  /* network order */
  uint16_t pad;
  int32_t pid;    /* of the process serving it */
  uint8_t secret[SECRET_BYTES];
} id_layout_t;

_Static_assert(sizeof(id_layout_t) <= EPX_UNIQUE_ID_BYTES, "id fits");

typedef struct {  /* server -> client, first thing on a connection */
  uint32_t msg_magic, pad;
  uint8_t nonce[NONCE_BYTES];
} challenge_t;

typedef struct {  /* client -> server: who it is, and the proof */
  uint32_t msg_magic;
  int32_t rank, nranks, pid;
  uint8_t nonce[NONCE_BYTES];
  uint8_t mac[EPXI_SHA256_BYTES]; /* of everything before it, keyed by the secret */
} hello_t;

typedef struct {  /* client -> server: one exchange's bytes follow */
  uint32_t msg_magic;
  int32_t rank, round, pad;
  uint64_t bytes;
} request_t;

/* server -> client: the welcome (status 0, the server's proof: 32 bytes), an exchange's
 * answer (status 0, its bytes), or an error (status != 0, a message of `bytes`). */
typedef struct {
  uint32_t msg_magic;
  int32_t status, round, pad;
  uint64_t bytes;
} reply_t;

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Bytes from the kernel's random source: 0, or -1 when it has none to give. */
static int random_bytes(void *out, size_t n) {
  uint8_t *p = out;
  while (n > 0) {
    ssize_t k = getrandom(p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* HMAC-SHA256(secret, label | a | b): labels keep the two directions' proofs apart. */
static void mac_of(const uint8_t *secret, const char *label, const void *a, size_t an, const void *b, size_t bn,
                   uint8_t out[EPXI_SHA256_BYTES]) {
  uint8_t msg[256];
  size_t ln = strlen(label);
  memcpy(msg, label, ln);
  memcpy(msg + ln, a, an);
  memcpy(msg + ln + an, b, bn);
  epxi_hmac_sha256(secret, SECRET_BYTES, msg, ln + an + bn, out);
}

static void hello_mac(const uint8_t *secret, const uint8_t *server_nonce, const hello_t *h,
                      uint8_t out[EPXI_SHA256_BYTES]) {
  mac_of(secret, "epx-hello", server_nonce, NONCE_BYTES, h, offsetof(hello_t, mac), out);
}

static void welcome_mac(const uint8_t *secret, const uint8_t *server_nonce, const hello_t *h,
                        uint8_t out[EPXI_SHA256_BYTES]) {
  mac_of(secret, "epx-welcome", server_nonce, NONCE_BYTES, h, offsetof(hello_t, mac), out);
}

/* Reads or writes exactly n bytes before the deadline: 1 done, 0 timeout, -1 error or EOF. */
static int io_full(int fd, void *buf, size_t n, int64_t deadline, bool writing) {
  char *p = buf;
  while (n > 0) {
    ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
      continue;
    }
    if (k == 0 && !writing) return -1;
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    int64_t left = deadline - now_ms();
    if (left <= 0) return 0;
    struct pollfd pf = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
    int rc = poll(&pf, 1, (int)(left > 1000000 ? 1000000 : left));
    if (rc < 0 && errno != EINTR) return -1;
  }
  return 1;
}

static void list_ranks(const bool *in, int n, bool want, char *buf, size_t size) {
  size_t len = 0;
  int count = 0;
  buf[0] = '\0';
  for (int r = 0; r < n; r++) {
    if (in[r] != want) continue;
    if (count++ < 8 && len < size) len += snprintf(buf + len, size - len, "%s%d", count > 1 ? ", " : "", r);
  }
  if (count > 8 && len < size) snprintf(buf + len, size - len, " and %d more", count - 8);
}

/* The owner of the client end (peer -> local) of a loopback TCP connection, asked of the
 * kernel by its address (sock_diag: one exact lookup, however many sockets exist): 1 this
 * user, 0 another user, -1 unknown (no sock_diag here). */
static int diag_same_user(const struct sockaddr_in *peer, const struct sockaddr_in *local, uid_t me) {
  int nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (nl < 0) return -1;
  struct {
    struct nlmsghdr nh;
    struct inet_diag_req_v2 req;
  } q;
  memset(&q, 0, sizeof q);
  q.nh.nlmsg_len = sizeof q;
  q.nh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  q.nh.nlmsg_flags = NLM_F_REQUEST;
  q.req.sdiag_family = AF_INET;
  q.req.sdiag_protocol = IPPROTO_TCP;
  q.req.idiag_states = ~0u;
  q.req.id.idiag_sport = peer->sin_port;
  q.req.id.idiag_dport = local->sin_port;
  q.req.id.idiag_src[0] = peer->sin_addr.s_addr;
  q.req.id.idiag_dst[0] = local->sin_addr.s_addr;
  q.req.id.idiag_cookie[0] = q.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  int found = -1;
  struct timeval tv = {.tv_sec = 0, .tv_usec = 100000};
  setsockopt(nl, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (send(nl, &q, sizeof q, 0) == (ssize_t)sizeof q) {
    long buf[2048];
    ssize_t n = recv(nl, buf, sizeof buf, 0);
    const struct nlmsghdr *h = (const struct nlmsghdr *)buf;
    if (n >= (ssize_t)NLMSG_LENGTH(sizeof(struct inet_diag_msg)) && NLMSG_OK(h, (size_t)n) &&
        h->nlmsg_type == SOCK_DIAG_BY_FAMILY) {
      const struct inet_diag_msg *m = NLMSG_DATA(h);
      found = m->idiag_uid == (uint32_t)me;
    }
  }
  close(nl);
  return found;
}

/* The same from the kernel's socket table in /proc/net/tcp, where sock_diag is missing. */
static int table_same_user(const struct sockaddr_in *peer, const struct sockaddr_in *local, uid_t me) {
  FILE *f = fopen("/proc/net/tcp", "re");
  if (!f) return -1;
  /* the client's line: local = its end, remote = ours (each address printed as its raw
   * 32-bit word in hex), found by a plain search, as a flood makes the table long */
  char needle[40], line[512];
  snprintf(needle, sizeof needle, " %08X:%04X %08X:%04X ", (unsigned)peer->sin_addr.s_addr, ntohs(peer->sin_port),
           (unsigned)local->sin_addr.s_addr, ntohs(local->sin_port));
  int found = -1;
  while (found < 0 && fgets(line, sizeof line, f)) {
    const char *at = strstr(line, needle);
    unsigned long uid;
    /* after the addresses: "st tx:rx tr:when retrnsmt uid" */
    if (at && sscanf(at + strlen(needle), "%*X %*X:%*X %*X:%*X %*X %lu", &uid) == 1) found = uid == (unsigned long)me;
  }
  fclose(f);
  return found;
}

/* Whether the other end of a loopback TCP connection belongs to this user: 1 yes, 0 another
 * user, -1 unknown. */
static int peer_same_user(int fd, uid_t me) {
  struct sockaddr_in peer, local;
  socklen_t pl = sizeof peer, ll = sizeof local;
  if (getpeername(fd, (struct sockaddr *)&peer, &pl) != 0 || getsockname(fd, (struct sockaddr *)&local, &ll) != 0 ||
      peer.sin_family != AF_INET)
    return -1;
  int found = diag_same_user(&peer, &local, me);
  return found >= 0 ? found : table_same_user(&peer, &local, me);
}

/* ---- the server ------------------------------------------------------------------------ */

typedef struct {     /* a connection that has not proved itself yet */
  int fd;
  int64_t deadline;
  uint8_t nonce[NONCE_BYTES];
  hello_t in;
  size_t got;
} pending_t;

typedef struct {
  int listener;
  uint8_t secret[SECRET_BYTES];
  int timeout_ms, hello_ms;
  uid_t uid;
  pending_t pending[MAX_PENDING];
  int npending;
  /* ranks: connections by rank (-1 before the hello and after hang-up), and the message
   * each is sending */
  int fd[EPX_MAX_RANKS];
  request_t req[EPX_MAX_RANKS];
  size_t req_got[EPX_MAX_RANKS], data_got[EPX_MAX_RANKS];
  bool joined[EPX_MAX_RANKS], closed[EPX_MAX_RANKS], goodbye[EPX_MAX_RANKS];
  int nranks, njoined, nclosed;
  int local_rank;           /* the rank in this process, answered last: once it has its answer, */
                            /* the process may exit and take this thread with it */
  /* the exchange in progress */
  int round;
  int64_t bytes;            /* -1 until the first rank sent */
  bool have[EPX_MAX_RANKS];
  int nhave;
  char *buf;
  /* after a failure the server lingers, telling every late joiner why */
  bool failed;
  epx_status_t fail_status;
  char fail_msg[512];
} server_t;

/* Closes without a reset where it can: a reset may cost the client the error just sent. */
static void close_gently(int fd) {
  shutdown(fd, SHUT_WR);
  char junk[4096];
  for (int i = 0; i < 64 && recv(fd, junk, sizeof junk, MSG_DONTWAIT) > 0; i++) {
  }
  close(fd);
}

static void send_message(int fd, epx_status_t status, int round, const char *msg, int64_t deadline) {
  reply_t r = {.msg_magic = MSG_MAGIC, .status = status, .round = round, .bytes = strlen(msg)};
  if (io_full(fd, &r, sizeof r, deadline, true) == 1) io_full(fd, (void *)msg, r.bytes, deadline, true);
}

static void send_error(int fd, const server_t *s, int64_t deadline) {
  send_message(fd, s->fail_status, s->round, s->fail_msg, deadline);
}

/* The order in which to answer the ranks: this process's rank last. */
static int answer_order(const server_t *s, int i) {
  if (s->local_rank < 0) return i;
  if (i == EPX_MAX_RANKS - 1) return s->local_rank;
  return i < s->local_rank ? i : i + 1;
}

/* Sends `extra` (an authenticated connection without a rank, or -1) and every joined rank an
 * error and hangs up on them; from now on the server only tells late joiners the same,
 * until it ends. */
static void server_fail(server_t *s, int extra, epx_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void server_fail(server_t *s, int extra, epx_status_t status, const char *fmt, ...) {
  if (s->failed) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->fail_msg, sizeof s->fail_msg, fmt, ap);
  va_end(ap);
  s->failed = true;
  s->fail_status = status;
  int64_t deadline = now_ms() + 1000;
  if (extra >= 0) {
    send_error(extra, s, deadline);
    close_gently(extra);
  }
  for (int i = 0; i < EPX_MAX_RANKS; i++) {
    int q = answer_order(s, i);
    if (s->fd[q] >= 0) {
      send_error(s->fd[q], s, deadline);
      close_gently(s->fd[q]);
      s->fd[q] = -1;
    }
  }
}

static void server_drop_rank(server_t *s, int r) {
  close(s->fd[r]);
  s->fd[r] = -1;
  s->closed[r] = true;
  s->nclosed++;
}

/* A rank hung up (or garbled its message). Fine after its goodbye, unless others wait for it
 * in an exchange; a failure otherwise. */
static void rank_hung_up(server_t *s, int r, bool mid_message) {
  const bool awaited = s->nhave > 0 && !s->have[r];
  server_drop_rank(s, r);
  if (s->njoined < s->nranks)
    server_fail(s, -1, EPX_ERR_PEER_LOST, "rank %d left the bootstrap before every rank had joined", r);
  else if (mid_message)
    server_fail(s, -1, EPX_ERR_PEER_LOST, "rank %d left the bootstrap in the middle of exchange %d", r, s->round);
  else if (awaited)
    server_fail(s, -1, EPX_ERR_PEER_LOST, "rank %d left the bootstrap during exchange %d (its process exited?)", r,
                s->round);
  else if (!s->goodbye[r])
    server_fail(s, -1, EPX_ERR_PEER_LOST,
                "rank %d left the group without its goodbye, after exchange %d (its process, or its host, is gone)", r,
                s->round - 1);
}

/* A rank's request header is in: checks it against the exchange in progress. */
static bool check_request(server_t *s, int r) {
  const request_t *q = &s->req[r];
  if (q->msg_magic != MSG_MAGIC || q->rank != r) {
    server_fail(s, -1, EPX_ERR_INTERNAL, "rank %d sent a malformed bootstrap message", r);
    return false;
  }
  if (q->round != s->round || s->have[r]) {
    server_fail(s, -1, EPX_ERR_INTERNAL, "rank %d sent exchange %d while exchange %d was in progress", r, q->round,
                s->round);
    return false;
  }
  if (q->bytes > MAX_EXCHANGE_BYTES || (s->bytes >= 0 && (int64_t)q->bytes != s->bytes)) {
    server_fail(s, -1, EPX_ERR_CONFIG_MISMATCH,
                "exchange %d: rank %d sent %llu bytes, another rank %lld (different epx versions?)", s->round, r,
                (unsigned long long)q->bytes, (long long)s->bytes);
    return false;
  }
  if (s->bytes < 0) {
    s->bytes = (int64_t)q->bytes;
    s->buf = malloc((size_t)s->bytes * s->nranks + 1);
    if (!s->buf) {
      server_fail(s, -1, EPX_ERR_OUT_OF_MEMORY, "the bootstrap server is out of memory");
      return false;
    }
  }
  return true;
}

/* Every rank's bytes are in: answers all, then starts the next exchange. */
static void answer_all(server_t *s) {
  reply_t rep = {.msg_magic = MSG_MAGIC, .status = 0, .round = s->round, .bytes = (uint64_t)s->bytes * s->nranks};
  int64_t send_deadline = now_ms() + s->timeout_ms;
  for (int i = 0; i < EPX_MAX_RANKS; i++) {
    int r = answer_order(s, i);
    if (r >= s->nranks || s->fd[r] < 0) continue;
    if (io_full(s->fd[r], &rep, sizeof rep, send_deadline, true) != 1 ||
        io_full(s->fd[r], s->buf, rep.bytes, send_deadline, true) != 1)
      server_drop_rank(s, r); /* its own exchange fails; the others learn it next time */
  }
  free(s->buf);
  s->buf = NULL;
  s->bytes = -1;
  s->nhave = 0;
  memset(s->have, 0, sizeof s->have);
  s->round++;
}

/* Reads what a rank's connection has for us, without waiting. 1: bytes came; 0: none yet;
 * -1: it hung up or failed (handled). */
static int rank_recv(server_t *s, int r, void *into, size_t n, bool mid_message) {
  ssize_t k = recv(s->fd[r], into, n, MSG_DONTWAIT);
  if (k > 0) return (int)k; /* at most MAX_EXCHANGE_BYTES */
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  rank_hung_up(s, r, mid_message);
  return -1;
}

/* A rank's connection is readable: takes in what has come of its message. */
static void server_rank_input(server_t *s, int r) {
  for (;;) {
    if (s->req_got[r] < sizeof(request_t)) {
      int k = rank_recv(s, r, (char *)&s->req[r] + s->req_got[r], sizeof(request_t) - s->req_got[r], s->req_got[r] > 0);
      if (k <= 0) return;
      s->req_got[r] += (size_t)k;
      if (s->req_got[r] < sizeof(request_t)) continue;
      if (s->req[r].msg_magic == MSG_MAGIC && s->req[r].rank == r && s->req[r].round == GOODBYE_ROUND) {
        s->goodbye[r] = true; /* what follows is its hang-up */
        s->req_got[r] = 0;
        continue;
      }
      if (!check_request(s, r)) return;
    }
    size_t want = (size_t)s->bytes - s->data_got[r];
    if (want > 0) {
      int k = rank_recv(s, r, s->buf + (size_t)s->bytes * r + s->data_got[r], want, true);
      if (k <= 0) return;
      s->data_got[r] += (size_t)k;
      if (s->data_got[r] < (size_t)s->bytes) continue;
    }
    s->have[r] = true;
    s->req_got[r] = s->data_got[r] = 0;
    if (++s->nhave == s->nranks) answer_all(s);
    return;
  }
}

/* ---- connections that have not proved themselves ---------------------------------------- */

static void drop_pending(server_t *s, int k, bool close_it) {
  if (close_it) close(s->pending[k].fd);
  s->pending[k] = s->pending[--s->npending];
}

/* The pending connection whose time runs out first: the one a full table gives up. */
static int oldest_pending(const server_t *s) {
  int o = 0;
  for (int k = 1; k < s->npending; k++)
    if (s->pending[k].deadline < s->pending[o].deadline) o = k;
  return o;
}

/* Takes new connections: another user's are closed at once; each other one gets its
 * challenge (a few bytes into an empty socket buffer: never waits). */
static void server_accept(server_t *s) {
  for (int burst = 0; burst < 64; burst++) {
    int fd = accept4(s->listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    if (peer_same_user(fd, s->uid) == 0) {
      close(fd);
      continue;
    }
    if (s->npending == MAX_PENDING) drop_pending(s, oldest_pending(s), true);
    pending_t *p = &s->pending[s->npending];
    memset(p, 0, sizeof *p);
    p->fd = fd;
    p->deadline = now_ms() + s->hello_ms;
    challenge_t c = {.msg_magic = MSG_MAGIC};
    if (random_bytes(p->nonce, sizeof p->nonce) != 0) {
      close(fd);
      continue;
    }
    memcpy(c.nonce, p->nonce, sizeof c.nonce);
    if (send(fd, &c, sizeof c, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof c) {
      close(fd);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    s->npending++;
  }
}

/* A complete hello: a rank joins once it proved it holds the secret (and gets the server's
 * proof back). Anything else is closed; only a proven client hears why it was refused. */
static void server_hello(server_t *s, const pending_t *p) {
  const hello_t *q = &p->in;
  const int fd = p->fd;
  const int64_t deadline = now_ms() + 1000;
  uint8_t want[EPXI_SHA256_BYTES];
  hello_mac(s->secret, p->nonce, q, want);
  if (!epxi_equal_ct(want, q->mac, sizeof want)) {
    /* the refusal tells nothing a stranger did not know */
    send_message(fd, EPX_ERR_INVALID_ARGUMENT, -1,
                 "the bootstrap listener refused the hello: it does not prove the id's secret (an id of another "
                 "epx_get_unique_id, or a damaged copy)", now_ms() + 50);
    close(fd);
    return;
  }
  if (q->nranks < 1 || q->nranks > EPX_MAX_RANKS || q->rank < 0 || q->rank >= q->nranks) {
    close(fd); /* the client checked this already */
    return;
  }
  if (s->failed) { /* a late joiner of a failed group */
    send_error(fd, s, deadline);
    close_gently(fd);
    return;
  }
  if (s->nranks < 0) s->nranks = q->nranks;
  if (q->nranks != s->nranks || s->joined[q->rank]) {
    if (q->nranks != s->nranks)
      server_fail(s, fd, EPX_ERR_CONFIG_MISMATCH, "rank %d says the group has %d ranks, the ranks before it said %d",
                  q->rank, q->nranks, s->nranks);
    else
      server_fail(s, fd, EPX_ERR_INVALID_ARGUMENT, "two processes joined the bootstrap as rank %d", q->rank);
    return;
  }
  struct {
    reply_t r;
    uint8_t mac[EPXI_SHA256_BYTES];
  } w = {.r = {.msg_magic = MSG_MAGIC, .status = 0, .round = -1, .bytes = EPXI_SHA256_BYTES}};
  welcome_mac(s->secret, p->nonce, q, w.mac);
  if (io_full(fd, &w, sizeof w, deadline, true) != 1) {
    close(fd);
    return;
  }
  if (q->pid == (int32_t)getpid()) s->local_rank = q->rank;
  s->fd[q->rank] = fd;
  s->joined[q->rank] = true;
  s->njoined++;
}

/* A pending connection is readable: takes in its hello as it comes. */
static void server_pending_input(server_t *s, int k) {
  pending_t *p = &s->pending[k];
  ssize_t n = recv(p->fd, (char *)&p->in + p->got, sizeof p->in - p->got, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {
    drop_pending(s, k, true);
    return;
  }
  p->got += (size_t)n;
  if (p->got >= sizeof p->in.msg_magic && p->in.msg_magic != MSG_MAGIC) { /* garbage: no need to hear the rest */
    drop_pending(s, k, true);
    return;
  }
  if (p->got < sizeof p->in) return;
  pending_t done = *p;
  drop_pending(s, k, false);
  server_hello(s, &done);
}

/* Drops the pending connections whose time ran out; returns the nearest deadline left. */
static int64_t expire_pending(server_t *s, int64_t until) {
  const int64_t now = now_ms();
  for (int k = s->npending - 1; k >= 0; k--) {
    if (s->pending[k].deadline <= now)
      drop_pending(s, k, true);
    else if (s->pending[k].deadline < until)
      until = s->pending[k].deadline;
  }
  return until;
}

/* ---- the server's loop ---------------------------------------------------------------- */

/* The deadline passed with no progress: names who the group waits for. */
static void server_timed_out(server_t *s) {
  char list[160];
  if (s->njoined < s->nranks) {
    list_ranks(s->joined, s->nranks, false, list, sizeof list);
    server_fail(s, -1, EPX_ERR_TIMEOUT, "bootstrap timed out after %d ms: rank %s never joined (%d of %d ranks joined)",
                s->timeout_ms, list, s->njoined, s->nranks);
  } else {
    bool waiting[EPX_MAX_RANKS];
    for (int r = 0; r < s->nranks; r++) waiting[r] = !s->have[r];
    list_ranks(waiting, s->nranks, true, list, sizeof list);
    server_fail(s, -1, EPX_ERR_TIMEOUT, "bootstrap timed out after %d ms in exchange %d waiting for rank %s",
                s->timeout_ms, s->round, list);
  }
}

/* Handles what poll found: ranks, then pending connections (backwards: a removal moves the
 * last one into the hole, which was handled already), then new connections. */
static void server_handle(server_t *s, const struct pollfd *pf, const int *who, int n) {
  for (int i = n - 1; i >= 0; i--) {
    if (!pf[i].revents) continue;
    if (who[i] == -1)
      server_accept(s);
    else if (who[i] <= -2)
      server_pending_input(s, -2 - who[i]);
    else if (s->fd[who[i]] >= 0)
      server_rank_input(s, who[i]);
  }
}

static void server_free(server_t *s) {
  if (s->listener >= 0) close(s->listener);
  for (int i = 0; i < s->npending; i++) close(s->pending[i].fd);
  for (int r = 0; r < EPX_MAX_RANKS; r++)
    if (s->fd[r] >= 0) close(s->fd[r]);
  free(s->buf);
  memset(s->secret, 0, sizeof s->secret);
  free(s);
}

static void *server_main(void *arg) {
  server_t *s = arg;
  int64_t deadline = now_ms() + s->timeout_ms;
  struct pollfd pf[1 + MAX_PENDING + EPX_MAX_RANKS];
  int who[1 + MAX_PENDING + EPX_MAX_RANKS]; /* -1 listener, -2 - i pending i, r rank */
  for (;;) {
    if (!s->failed && s->nranks > 0 && s->njoined == s->nranks && s->nclosed == s->nranks) break; /* done */
    if (!s->failed && s->nranks > 0 && s->njoined == s->nranks && s->listener >= 0) {
      close(s->listener); /* nobody else may join */
      s->listener = -1;
      while (s->npending > 0) drop_pending(s, 0, true);
    }
    if (!s->failed && s->nranks > 0 && s->njoined == s->nranks && s->nhave == 0)
      deadline = now_ms() + s->timeout_ms; /* between exchanges the group waits for nobody */
    const int64_t wake = expire_pending(s, deadline); /* before the list: it removes entries */
    int n = 0;
    if (s->listener >= 0) pf[n] = (struct pollfd){.fd = s->listener, .events = POLLIN}, who[n++] = -1;
    for (int i = 0; i < s->npending; i++)
      pf[n] = (struct pollfd){.fd = s->pending[i].fd, .events = POLLIN}, who[n++] = -2 - i;
    for (int r = 0; r < EPX_MAX_RANKS; r++)
      if (s->fd[r] >= 0) pf[n] = (struct pollfd){.fd = s->fd[r], .events = POLLIN}, who[n++] = r;
    int64_t left = wake - now_ms();
    int rc = left > 0 ? poll(pf, (nfds_t)n, (int)(left > 1000000 ? 1000000 : left)) : 0;
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) {
      server_fail(s, -1, EPX_ERR_SYSTEM, "the bootstrap server failed: poll: %s", strerror(errno));
      break;
    }
    if (rc == 0) {
      if (now_ms() < deadline) continue; /* a pending connection's time ran out, or a spurious wake */
      if (s->failed || s->nranks < 0) break; /* done lingering, or nobody came */
      server_timed_out(s);
      deadline = now_ms() + s->timeout_ms; /* linger */
      continue;
    }
    const bool was_failed = s->failed;
    const int old_njoined = s->njoined, old_round = s->round;
    server_handle(s, pf, who, n);
    if (s->failed && !was_failed)
      deadline = now_ms() + s->timeout_ms; /* linger */
    else if (!s->failed && (s->njoined != old_njoined || s->round != old_round))
      deadline = now_ms() + s->timeout_ms; /* progress */
  }
  server_free(s);
  return NULL;
}

/* ---- addresses ------------------------------------------------------------------------ */

/* The address this process's bootstrap sockets use: EPX_BOOTSTRAP_ADDR (an IPv4 address), else
 * the first IPv4 address of the interface EPX_SOCKET_IFNAME, else the loopback address
 * (*chosen false). Read at each call, not once: it is where this process is, not a setting
 * of the group. */
static epx_status_t socket_address(struct in_addr *out, bool *chosen, const char *who) {
  const char *addr = getenv("EPX_BOOTSTRAP_ADDR"), *ifname = getenv("EPX_SOCKET_IFNAME");
  *chosen = true;
  if (addr && *addr) {
    if (inet_pton(AF_INET, addr, out) != 1)
      return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: EPX_BOOTSTRAP_ADDR=%s is not an IPv4 address", who, addr);
    return EPX_SUCCESS;
  }
  if (ifname && *ifname) {
    struct ifaddrs *all;
    if (getifaddrs(&all) != 0)
      return epxi_fail(EPX_ERR_SYSTEM, "%s: getifaddrs (for EPX_SOCKET_IFNAME=%s): %s", who, ifname, strerror(errno));
    bool found = false;
    for (const struct ifaddrs *i = all; i && !found; i = i->ifa_next)
      if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && !strcmp(i->ifa_name, ifname)) {
        *out = ((const struct sockaddr_in *)i->ifa_addr)->sin_addr;
        found = true;
      }
    freeifaddrs(all);
    if (!found)
      return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "%s: EPX_SOCKET_IFNAME=%s names no interface with an IPv4 address",
                       who, ifname);
    return EPX_SUCCESS;
  }
  *chosen = false;
  out->s_addr = htonl(INADDR_LOOPBACK);
  return EPX_SUCCESS;
}

epx_status_t epx_get_unique_id(epx_unique_id_t *id) {
  epxi_clear_error();
  if (!id) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_get_unique_id: id is NULL");
  struct in_addr where;
  bool chosen;
  EPX_CHECK(socket_address(&where, &chosen, "epx_get_unique_id"));
  server_t *s = calloc(1, sizeof *s);
  if (!s) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "epx_get_unique_id");
  if (random_bytes(s->secret, sizeof s->secret) != 0) {
    free(s);
    return epxi_fail(EPX_ERR_SYSTEM, "epx_get_unique_id: the kernel gave no random bytes for the id's secret: %s",
                     strerror(errno));
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    free(s);
    return epxi_fail(EPX_ERR_SYSTEM, "epx_get_unique_id: socket: %s", strerror(errno));
  }
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0, .sin_addr = where};
  socklen_t alen = sizeof a;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &alen) != 0) {
    int e = errno;
    close(fd);
    free(s);
    char text[INET_ADDRSTRLEN];
    return epxi_fail(EPX_ERR_SYSTEM, "epx_get_unique_id: could not listen on %s%s: %s",
                     inet_ntop(AF_INET, &where, text, sizeof text), chosen ? "" : " (the loopback address)", strerror(e));
  }
  s->listener = fd;
  s->timeout_ms = epxi_env()->timeout_ms;
  s->hello_ms = s->timeout_ms < HELLO_MS ? s->timeout_ms : HELLO_MS;
  s->uid = getuid();
  s->nranks = -1;
  s->local_rank = -1;
  s->bytes = -1;
  for (int r = 0; r < EPX_MAX_RANKS; r++) s->fd[r] = -1;

  id_layout_t l;
  memset(&l, 0, sizeof l);
  memcpy(l.tag, ID_TAG, sizeof l.tag);
  memcpy(l.secret, s->secret, sizeof l.secret);
  l.addr = a.sin_addr.s_addr;
  l.port = a.sin_port;
  l.pid = (int32_t)getpid();

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t tid;
  int rc = pthread_create(&tid, &attr, server_main, s);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    server_free(s);
    return epxi_fail(EPX_ERR_SYSTEM, "epx_get_unique_id: could not start the bootstrap thread: %s", strerror(rc));
  }
  memset(id, 0, sizeof *id);
  memcpy(id->internal, &l, sizeof l);
  memset(&l, 0, sizeof l);
  return EPX_SUCCESS;
}

/* ---- the client ------------------------------------------------------------------------ */

struct epxi_bootstrap {
  int fd;
  int rank, nranks, round, timeout_ms;
  uint16_t port;
  char at[INET_ADDRSTRLEN + 8]; /* the listener, "address:port", for messages */
  struct in_addr from;          /* this process's own address, when it chose one (own_address) */
  bool own_address;
};

/* An error reply: the failure, in the server's words. */
static epx_status_t reply_error(epxi_bootstrap_t *b, const reply_t *r) {
  char msg[600];
  size_t n = r->bytes < sizeof msg - 1 ? (size_t)r->bytes : sizeof msg - 1;
  if (io_full(b->fd, msg, n, now_ms() + 1000, false) != 1) n = 0;
  msg[n] = '\0';
  epx_status_t st = r->status > 0 && r->status < EPX_NUM_STATUS ? (epx_status_t)r->status : EPX_ERR_INTERNAL;
  return epxi_fail(st, "rank %d, bootstrap: %s", b->rank, n ? msg : "the listener reported an error");
}

/* Reads a reply header; an error reply becomes the failure (with the server's words). */
static epx_status_t read_reply(epxi_bootstrap_t *b, reply_t *r, int64_t deadline) {
  int rc = io_full(b->fd, r, sizeof *r, deadline, false);
  if (rc == 0)
    return epxi_fail(EPX_ERR_TIMEOUT, "rank %d, bootstrap: no answer from the listener at %s within %d ms (exchange %d)",
                     b->rank, b->at, b->timeout_ms + CLIENT_GRACE_MS, b->round);
  if (rc < 0 || r->msg_magic != MSG_MAGIC)
    return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: the listener at %s hung up (exchange %d)",
                     b->rank, b->at, b->round);
  return r->status != 0 ? reply_error(b, r) : EPX_SUCCESS;
}

/* The server dropped the connection before it answered (its table of unproven connections
 * was full): the caller connects again. */
static epx_status_t dropped(epxi_bootstrap_t *b, bool *retry) {
  *retry = true;
  return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: the listener at %s hung up before the handshake ended",
                   b->rank, b->at);
}

/* The handshake on a fresh connection; *retry says a failure is worth another connection. */
static epx_status_t handshake(epxi_bootstrap_t *b, const id_layout_t *l, int64_t deadline, bool *retry) {
  challenge_t c;
  int rc = io_full(b->fd, &c, sizeof c, deadline, false);
  if (rc < 0) return dropped(b, retry);
  if (rc == 0)
    return epxi_fail(EPX_ERR_TIMEOUT, "rank %d, bootstrap: the listener at %s sent no challenge within %d ms",
                     b->rank, b->at, b->timeout_ms);
  if (c.msg_magic != MSG_MAGIC)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "rank %d, bootstrap: %s is not an epx bootstrap listener of this version", b->rank, b->at);
  hello_t h = {.msg_magic = MSG_MAGIC, .rank = b->rank, .nranks = b->nranks, .pid = (int32_t)getpid()};
  if (random_bytes(h.nonce, sizeof h.nonce) != 0)
    return epxi_fail(EPX_ERR_SYSTEM, "rank %d, bootstrap: the kernel gave no random bytes", b->rank);
  hello_mac(l->secret, c.nonce, &h, h.mac);
  if (io_full(b->fd, &h, sizeof h, deadline, true) != 1) return dropped(b, retry);
  reply_t r;
  rc = io_full(b->fd, &r, sizeof r, deadline, false);
  if (rc < 0) return dropped(b, retry);
  if (rc == 0 || r.msg_magic != MSG_MAGIC)
    return epxi_fail(rc == 0 ? EPX_ERR_TIMEOUT : EPX_ERR_INVALID_ARGUMENT,
                     "rank %d, bootstrap: the listener at %s %s", b->rank, b->at,
                     rc == 0 ? "did not answer the hello" : "answered the hello with garbage");
  if (r.status != 0) return reply_error(b, &r);
  uint8_t mac[EPXI_SHA256_BYTES], want[EPXI_SHA256_BYTES];
  welcome_mac(l->secret, c.nonce, &h, want);
  if (r.bytes != sizeof mac || io_full(b->fd, mac, sizeof mac, deadline, false) != 1 ||
      !epxi_equal_ct(mac, want, sizeof mac))
    return epxi_fail(EPX_ERR_SYSTEM,
                     "rank %d, bootstrap: the listener at %s could not prove it holds the id's secret (the "
                     "port is not the id's listener)", b->rank, b->at);
  return EPX_SUCCESS;
}

/* One connection and its handshake; *retry as for handshake. */
static epx_status_t connect_once(epxi_bootstrap_t *b, const id_layout_t *l, int64_t deadline, bool *retry) {
  *retry = false;
  b->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (b->fd < 0) return epxi_fail(EPX_ERR_SYSTEM, "rank %d, bootstrap: socket: %s", b->rank, strerror(errno));
  /* from this process's own address, when it chose one: where the listener sees it come from */
  struct sockaddr_in own = {.sin_family = AF_INET, .sin_port = 0, .sin_addr = b->from};
  if (b->own_address && bind(b->fd, (struct sockaddr *)&own, sizeof own) != 0) {
    int e = errno;
    close(b->fd);
    b->fd = -1;
    char text[INET_ADDRSTRLEN];
    return epxi_fail(EPX_ERR_SYSTEM, "rank %d, bootstrap: could not bind to this process's address %s: %s", b->rank,
                     inet_ntop(AF_INET, &b->from, text, sizeof text), strerror(e));
  }
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = l->port, .sin_addr.s_addr = l->addr};
  int rc;
  do rc = connect(b->fd, (struct sockaddr *)&a, sizeof a);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int e = errno;
    close(b->fd);
    b->fd = -1;
    return epxi_fail(e == ECONNREFUSED ? EPX_ERR_PEER_LOST : EPX_ERR_SYSTEM,
                     "rank %d, bootstrap: could not reach the listener of the id at %s: %s (the process "
                     "that made the id exited, or its group already formed or timed out)",
                     b->rank, b->at, strerror(e));
  }
  int one = 1;
  setsockopt(b->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  epx_status_t s = handshake(b, l, deadline, retry);
  if (s != EPX_SUCCESS) {
    close(b->fd);
    b->fd = -1;
  }
  return s;
}

epx_status_t epxi_bootstrap_connect(const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                                    epxi_bootstrap_t **conn) {
  *conn = NULL;
  id_layout_t l;
  memcpy(&l, id->internal, sizeof l);
  if (memcmp(l.tag, ID_TAG, sizeof l.tag) != 0)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: the id is not an epx unique id (make it with epx_get_unique_id)",
                     rank);
  epxi_bootstrap_t *b = calloc(1, sizeof *b);
  if (!b) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "bootstrap");
  b->rank = rank, b->nranks = nranks, b->timeout_ms = timeout_ms, b->port = ntohs(l.port), b->fd = -1;
  epx_status_t where = socket_address(&b->from, &b->own_address, "bootstrap"); /* once, not per attempt */
  if (where != EPX_SUCCESS) {
    memset(&l, 0, sizeof l);
    free(b);
    return where;
  }
  char text[INET_ADDRSTRLEN];
  struct in_addr listener = {.s_addr = l.addr};
  snprintf(b->at, sizeof b->at, "%s:%d", inet_ntop(AF_INET, &listener, text, sizeof text), (int)b->port);
  const int64_t deadline = now_ms() + timeout_ms;
  bool retry;
  epx_status_t s;
  for (int attempt = 1; (s = connect_once(b, &l, deadline, &retry)) != EPX_SUCCESS && retry; attempt++) {
    if (now_ms() >= deadline) {
      s = epxi_fail(EPX_ERR_TIMEOUT,
                    "rank %d, bootstrap: the listener at %s dropped this rank's connection %d times before "
                    "its handshake ended (flooded by other connections?)", rank, b->at, attempt);
      break;
    }
    nap_ms(attempt < 20 ? attempt : 20);
  }
  memset(&l, 0, sizeof l);
  if (s != EPX_SUCCESS) {
    free(b);
    return s;
  }
  *conn = b;
  return EPX_SUCCESS;
}

/* A send failed: the server may have said why before it hung up. */
static epx_status_t send_failed(epxi_bootstrap_t *b) {
  reply_t r = {0};
  epx_status_t s = read_reply(b, &r, now_ms() + 500);
  if (s != EPX_SUCCESS && r.msg_magic == MSG_MAGIC && r.status != 0) return s;
  return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: the listener at %s hung up", b->rank, b->at);
}

epx_status_t epxi_bootstrap_exchange(const void *mine, void *all, size_t bytes, void *ctx) {
  epxi_bootstrap_t *b = ctx;
  const int64_t deadline = now_ms() + b->timeout_ms + CLIENT_GRACE_MS;
  request_t q = {.msg_magic = MSG_MAGIC, .rank = b->rank, .round = b->round, .bytes = bytes};
  if (io_full(b->fd, &q, sizeof q, deadline, true) != 1 || io_full(b->fd, (void *)mine, bytes, deadline, true) != 1)
    return send_failed(b);
  reply_t r;
  EPX_CHECK(read_reply(b, &r, deadline));
  if (r.bytes != (uint64_t)bytes * b->nranks)
    return epxi_fail(EPX_ERR_INTERNAL, "rank %d, bootstrap: the listener answered %llu bytes, not %zu", b->rank,
                     (unsigned long long)r.bytes, bytes * b->nranks);
  if (io_full(b->fd, all, (size_t)r.bytes, deadline, false) != 1)
    return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: the listener hung up mid-answer", b->rank);
  b->round++;
  return EPX_SUCCESS;
}

/* The goodbye first (unanswered, best effort): a hang-up without it fails the group. */
void epxi_bootstrap_close(epxi_bootstrap_t *b) {
  if (!b) return;
  if (b->fd >= 0) {
    request_t q = {.msg_magic = MSG_MAGIC, .rank = b->rank, .round = GOODBYE_ROUND, .bytes = 0};
    io_full(b->fd, &q, sizeof q, now_ms() + 1000, true);
    close(b->fd);
  }
  free(b);
}
