/* TCP bootstrap of a cross-process group, NCCL style.
 *
 * epx_get_unique_id opens a listener on the loopback address and serves it from a detached
 * thread; the id carries (address, port, a random magic). Every rank connects, says hello
 * (magic, rank, group size) and then makes a few exchanges: it sends its bytes, the server
 * waits for every rank's and sends all of them back, rank-major. The server checks what
 * the ranks say (one size, no rank twice), names the ranks that never joined when its
 * deadline passes (EPX_TIMEOUT_MS after the last progress), and ends when every rank has
 * hung up. Only loopback addresses are ever contacted. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"

#define ID_TAG "epxuid1"
#define MSG_MAGIC 0x65707862u /* "epxb" */
#define CLIENT_GRACE_MS 2000  /* a client waits this much longer than the server, to hear why */
#define MAX_PENDING 256
#define MAX_EXCHANGE_BYTES (1u << 20)

typedef struct {
  char tag[8];
  uint64_t magic;
  uint32_t addr;  /* network order */
  uint16_t port;  /* network order */
  uint16_t pad;
  int32_t pid;    /* of the process serving it */
} id_layout_t;

_Static_assert(sizeof(id_layout_t) <= EPX_UNIQUE_ID_BYTES, "id fits");

enum { KIND_HELLO = 1, KIND_DATA = 2 };

typedef struct {  /* client -> server */
  uint32_t msg_magic;
  int32_t kind, rank, nranks, round, pid;
  uint64_t magic, bytes;
} request_t;

typedef struct {  /* server -> client: bytes of data, or of an error message when status != 0 */
  uint32_t msg_magic;
  int32_t status, round, pad;
  uint64_t bytes;
} reply_t;

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t random_magic(void) {
  uint64_t x = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, &x, sizeof x) != (ssize_t)sizeof x) x = 0;
    close(fd);
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return x ^ ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40);
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

/* ---- the server ------------------------------------------------------------------------ */

typedef struct {
  int listener;
  uint64_t magic;
  int timeout_ms;
  /* connections */
  int pending[MAX_PENDING]; /* accepted, no hello yet */
  int npending;
  int fd[EPX_MAX_RANKS];    /* by rank; -1 before hello and after hang-up */
  bool joined[EPX_MAX_RANKS], closed[EPX_MAX_RANKS];
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

static void send_error(int fd, const server_t *s, int64_t deadline) {
  reply_t r = {.msg_magic = MSG_MAGIC, .status = s->fail_status, .round = s->round, .bytes = strlen(s->fail_msg)};
  if (io_full(fd, &r, sizeof r, deadline, true) == 1) io_full(fd, (void *)s->fail_msg, r.bytes, deadline, true);
}

/* The order in which to answer the ranks: this process's rank last. */
static int answer_order(const server_t *s, int i) {
  if (s->local_rank < 0) return i;
  if (i == EPX_MAX_RANKS - 1) return s->local_rank;
  return i < s->local_rank ? i : i + 1;
}

/* Sends `extra` (a connection without a rank, or -1) and every joined rank an error and
 * hangs up on them; from now on the server only tells late joiners the same, until it
 * ends. */
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

/* Handles one message on a rank's connection: false ends the service. */
static bool server_rank_message(server_t *s, int r, int64_t deadline) {
  request_t q;
  int rc = io_full(s->fd[r], &q, sizeof q, deadline, false);
  if (rc != 1) {
    /* Hung up (or garbled). Fine after its last exchange; not while others need it. */
    server_drop_rank(s, r);
    if (s->njoined < s->nranks) {
      server_fail(s, -1, EPX_ERR_PEER_LOST, "rank %d left the bootstrap before every rank had joined", r);
      return false;
    }
    if (s->nhave > 0 && !s->have[r]) {
      server_fail(s, -1, EPX_ERR_PEER_LOST, "rank %d left the bootstrap during exchange %d (its process exited?)", r,
                  s->round);
      return false;
    }
    return true;
  }
  if (q.msg_magic != MSG_MAGIC || q.kind != KIND_DATA || q.magic != s->magic || q.rank != r) {
    server_fail(s, -1, EPX_ERR_INTERNAL, "rank %d sent a malformed bootstrap message", r);
    return false;
  }
  if (q.round != s->round || s->have[r]) {
    server_fail(s, -1, EPX_ERR_INTERNAL, "rank %d sent exchange %d while exchange %d was in progress", r, q.round, s->round);
    return false;
  }
  if (q.bytes > MAX_EXCHANGE_BYTES || (s->bytes >= 0 && (int64_t)q.bytes != s->bytes)) {
    server_fail(s, -1, EPX_ERR_CONFIG_MISMATCH,
                "exchange %d: rank %d sent %llu bytes, another rank %lld (different epx versions?)", s->round, r,
                (unsigned long long)q.bytes, (long long)s->bytes);
    return false;
  }
  if (s->bytes < 0) {
    s->bytes = (int64_t)q.bytes;
    s->buf = malloc((size_t)s->bytes * s->nranks + 1);
    if (!s->buf) {
      server_fail(s, -1, EPX_ERR_OUT_OF_MEMORY, "the bootstrap server is out of memory");
      return false;
    }
  }
  if (io_full(s->fd[r], s->buf + (size_t)s->bytes * r, (size_t)s->bytes, deadline, false) != 1) {
    server_drop_rank(s, r);
    server_fail(s, -1, EPX_ERR_PEER_LOST, "rank %d left the bootstrap in the middle of exchange %d", r, s->round);
    return false;
  }
  s->have[r] = true;
  if (++s->nhave < s->nranks) return true;

  /* Everyone's in: answer all. */
  reply_t rep = {.msg_magic = MSG_MAGIC, .status = 0, .round = s->round, .bytes = (uint64_t)s->bytes * s->nranks};
  int64_t send_deadline = now_ms() + s->timeout_ms;
  for (int i = 0; i < EPX_MAX_RANKS; i++) {
    int q2 = answer_order(s, i);
    if (q2 >= s->nranks || s->fd[q2] < 0) continue;
    if (io_full(s->fd[q2], &rep, sizeof rep, send_deadline, true) != 1 ||
        io_full(s->fd[q2], s->buf, rep.bytes, send_deadline, true) != 1)
      server_drop_rank(s, q2); /* its own exchange fails; the others learn it next time */
  }
  free(s->buf);
  s->buf = NULL;
  s->bytes = -1;
  s->nhave = 0;
  memset(s->have, 0, sizeof s->have);
  s->round++;
  return true;
}

/* A hello on a new connection: false ends the service. */
static bool server_hello(server_t *s, int fd, int64_t deadline) {
  request_t q;
  if (io_full(fd, &q, sizeof q, deadline, false) != 1 || q.msg_magic != MSG_MAGIC || q.kind != KIND_HELLO ||
      q.magic != s->magic) {
    close(fd); /* a stray or stale connection: not ours */
    return true;
  }
  if (q.nranks < 1 || q.nranks > EPX_MAX_RANKS || q.rank < 0 || q.rank >= q.nranks) {
    close(fd);
    return true; /* the client checked this already; ignore */
  }
  if (s->failed) { /* a late joiner of a failed group */
    send_error(fd, s, deadline);
    close_gently(fd);
    return true;
  }
  if (s->nranks < 0) s->nranks = q.nranks;
  if (q.nranks != s->nranks || s->joined[q.rank]) {
    if (q.nranks != s->nranks)
      server_fail(s, fd, EPX_ERR_CONFIG_MISMATCH, "rank %d says the group has %d ranks, the ranks before it said %d",
                  q.rank, q.nranks, s->nranks);
    else
      server_fail(s, fd, EPX_ERR_INVALID_ARGUMENT, "two processes joined the bootstrap as rank %d", q.rank);
    return false;
  }
  (void)deadline;
  if (q.pid == (int32_t)getpid()) s->local_rank = q.rank;
  s->fd[q.rank] = fd;
  s->joined[q.rank] = true;
  s->njoined++;
  return true;
}

static void *server_main(void *arg) {
  server_t *s = arg;
  int64_t deadline = now_ms() + s->timeout_ms;
  for (;;) {
    if (!s->failed && s->nranks > 0 && s->njoined == s->nranks && s->nclosed == s->nranks) break; /* done */
    if (!s->failed && s->nranks > 0 && s->njoined == s->nranks && s->listener >= 0) {
      close(s->listener); /* nobody else may join */
      s->listener = -1;
    }
    struct pollfd pf[1 + MAX_PENDING + EPX_MAX_RANKS];
    int who[1 + MAX_PENDING + EPX_MAX_RANKS]; /* -1 listener, -2 - i pending i, r rank */
    int n = 0;
    if (s->listener >= 0) pf[n] = (struct pollfd){.fd = s->listener, .events = POLLIN}, who[n++] = -1;
    for (int i = 0; i < s->npending; i++) pf[n] = (struct pollfd){.fd = s->pending[i], .events = POLLIN}, who[n++] = -2 - i;
    for (int r = 0; r < EPX_MAX_RANKS; r++)
      if (s->fd[r] >= 0) pf[n] = (struct pollfd){.fd = s->fd[r], .events = POLLIN}, who[n++] = r;
    int64_t left = deadline - now_ms();
    int rc = left > 0 ? poll(pf, (nfds_t)n, (int)(left > 1000000 ? 1000000 : left)) : 0;
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) {
      server_fail(s, -1, EPX_ERR_SYSTEM, "the bootstrap server failed: poll: %s", strerror(errno));
      break;
    }
    if (rc == 0) {
      if (now_ms() < deadline) continue;
      if (s->failed || s->nranks < 0) break; /* done lingering, or nobody came */
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
      deadline = now_ms() + s->timeout_ms; /* linger */
      continue;
    }
    const bool was_failed = s->failed;
    const int64_t io_deadline = now_ms() + s->timeout_ms;
    int old_njoined = s->njoined, old_round = s->round;
    for (int i = n - 1; i >= 0; i--) { /* backwards: pending removals keep indices valid */
      if (!pf[i].revents) continue;
      if (who[i] == -1) {
        int fd = accept(s->listener, NULL, NULL);
        if (fd < 0) continue;
        if (s->npending == MAX_PENDING) {
          close(fd);
          continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        s->pending[s->npending++] = fd;
      } else if (who[i] <= -2) {
        int k = -2 - who[i];
        int fd = s->pending[k];
        s->pending[k] = s->pending[--s->npending];
        server_hello(s, fd, io_deadline);
      } else if (s->fd[who[i]] >= 0) {
        server_rank_message(s, who[i], io_deadline);
      }
    }
    if (s->failed && !was_failed) deadline = now_ms() + s->timeout_ms; /* linger */
    else if (!s->failed && (s->njoined != old_njoined || s->round != old_round))
      deadline = now_ms() + s->timeout_ms; /* progress */
  }
  if (s->listener >= 0) close(s->listener);
  for (int i = 0; i < s->npending; i++) close(s->pending[i]);
  for (int r = 0; r < EPX_MAX_RANKS; r++)
    if (s->fd[r] >= 0) close(s->fd[r]);
  free(s->buf);
  free(s);
  return NULL;
}

epx_status_t epx_get_unique_id(epx_unique_id_t *id) {
  epxi_clear_error();
  if (!id) return epxi_fail(EPX_ERR_NULL_POINTER, "epx_get_unique_id: id is NULL");
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return epxi_fail(EPX_ERR_SYSTEM, "epx_get_unique_id: socket: %s", strerror(errno));
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 2 * EPX_MAX_RANKS) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &alen) != 0) {
    int e = errno;
    close(fd);
    return epxi_fail(EPX_ERR_SYSTEM, "epx_get_unique_id: could not listen on the loopback address: %s", strerror(e));
  }
  server_t *s = calloc(1, sizeof *s);
  if (!s) {
    close(fd);
    return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "epx_get_unique_id");
  }
  s->listener = fd;
  s->magic = random_magic();
  s->timeout_ms = epxi_env()->timeout_ms;
  s->nranks = -1;
  s->local_rank = -1;
  s->bytes = -1;
  for (int r = 0; r < EPX_MAX_RANKS; r++) s->fd[r] = -1;

  id_layout_t l;
  memset(&l, 0, sizeof l);
  memcpy(l.tag, ID_TAG, sizeof l.tag);
  l.magic = s->magic;
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
    close(fd);
    free(s);
    return epxi_fail(EPX_ERR_SYSTEM, "epx_get_unique_id: could not start the bootstrap thread: %s", strerror(rc));
  }
  memset(id, 0, sizeof *id);
  memcpy(id->internal, &l, sizeof l);
  return EPX_SUCCESS;
}

/* ---- the client ------------------------------------------------------------------------ */

struct epxi_bootstrap {
  int fd;
  int rank, nranks, round, timeout_ms;
  uint64_t magic;
  uint16_t port;
};

static epx_status_t send_failed(epxi_bootstrap_t *b);

epx_status_t epxi_bootstrap_connect(const epx_unique_id_t *id, int rank, int nranks, int timeout_ms,
                                    epxi_bootstrap_t **conn) {
  *conn = NULL;
  id_layout_t l;
  memcpy(&l, id->internal, sizeof l);
  if (memcmp(l.tag, ID_TAG, sizeof l.tag) != 0)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT, "rank %d: the id is not an epx unique id (make it with epx_get_unique_id)",
                     rank);
  if ((ntohl(l.addr) >> 24) != 127)
    return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                     "rank %d: the id names a non-loopback address; epx bootstraps on this host only", rank);
  epxi_bootstrap_t *b = calloc(1, sizeof *b);
  if (!b) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "bootstrap");
  b->rank = rank, b->nranks = nranks, b->timeout_ms = timeout_ms, b->magic = l.magic, b->port = ntohs(l.port);
  b->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (b->fd < 0) {
    free(b);
    return epxi_fail(EPX_ERR_SYSTEM, "rank %d, bootstrap: socket: %s", rank, strerror(errno));
  }
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = l.port, .sin_addr.s_addr = l.addr};
  int rc;
  do rc = connect(b->fd, (struct sockaddr *)&a, sizeof a);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int e = errno;
    close(b->fd);
    free(b);
    return epxi_fail(e == ECONNREFUSED ? EPX_ERR_PEER_LOST : EPX_ERR_SYSTEM,
                     "rank %d, bootstrap: could not reach the listener of the id at 127.0.0.1:%d: %s (the process that "
                     "made the id exited, or its group already formed or timed out)",
                     rank, (int)ntohs(l.port), strerror(e));
  }
  int one = 1;
  setsockopt(b->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  request_t q = {.msg_magic = MSG_MAGIC, .kind = KIND_HELLO, .rank = rank, .nranks = nranks, .magic = b->magic,
                 .pid = (int32_t)getpid()};
  if (io_full(b->fd, &q, sizeof q, now_ms() + timeout_ms, true) != 1) {
    epx_status_t s = send_failed(b);
    close(b->fd);
    free(b);
    return s;
  }
  *conn = b;
  return EPX_SUCCESS;
}

/* Reads a reply header; an error reply becomes the failure (with the server's words). */
static epx_status_t read_reply(epxi_bootstrap_t *b, reply_t *r, int64_t deadline) {
  int rc = io_full(b->fd, r, sizeof *r, deadline, false);
  if (rc == 0)
    return epxi_fail(EPX_ERR_TIMEOUT, "rank %d, bootstrap: no answer from the listener at 127.0.0.1:%d within %d ms (exchange %d)",
                     b->rank, b->port, b->timeout_ms + CLIENT_GRACE_MS, b->round);
  if (rc < 0 || r->msg_magic != MSG_MAGIC)
    return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: the listener at 127.0.0.1:%d hung up (exchange %d)",
                     b->rank, b->port, b->round);
  if (r->status != 0) {
    char msg[600];
    size_t n = r->bytes < sizeof msg - 1 ? (size_t)r->bytes : sizeof msg - 1;
    if (io_full(b->fd, msg, n, now_ms() + 1000, false) != 1) n = 0;
    msg[n] = '\0';
    epx_status_t st = r->status > 0 && r->status < EPX_NUM_STATUS ? (epx_status_t)r->status : EPX_ERR_INTERNAL;
    return epxi_fail(st, "rank %d, bootstrap: %s", b->rank, n ? msg : "the listener reported an error");
  }
  return EPX_SUCCESS;
}

/* A send failed: the server may have said why before it hung up. */
static epx_status_t send_failed(epxi_bootstrap_t *b) {
  reply_t r = {0};
  if (read_reply(b, &r, now_ms() + 500) != EPX_SUCCESS && r.msg_magic == MSG_MAGIC && r.status != 0)
    return (epx_status_t)(r.status > 0 && r.status < EPX_NUM_STATUS ? r.status : EPX_ERR_INTERNAL);
  return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: the listener at 127.0.0.1:%d hung up", b->rank, b->port);
}

epx_status_t epxi_bootstrap_exchange(const void *mine, void *all, size_t bytes, void *ctx) {
  epxi_bootstrap_t *b = ctx;
  const int64_t deadline = now_ms() + b->timeout_ms + CLIENT_GRACE_MS;
  request_t q = {.msg_magic = MSG_MAGIC, .kind = KIND_DATA, .rank = b->rank, .nranks = b->nranks, .round = b->round,
                 .magic = b->magic, .bytes = bytes};
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

void epxi_bootstrap_close(epxi_bootstrap_t *b) {
  if (!b) return;
  close(b->fd);
  free(b);
}
