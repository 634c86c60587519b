/* Cross-process rendezvous: one rank per process, every process on this host.
 *
 * Memory. Each rank owns one anonymous shared-memory file (memfd: it never has a name in
 * /dev/shm, so nothing is left behind whatever happens to the processes). Its first page is
 * the rank's header (barrier counter, state, share sizes); the second page of rank 0's file
 * is the group's common page (epxi_group_common); share slot i lives at offset
 * (i + 1) * SLOT_SPAN, a sparse region grown on demand (ftruncate) and mapped by the peers
 * at the size they need. The ranks pass their files to each other once, over unix sockets in
 * the abstract namespace (no file-system names either), and keep those connections open:
 * they are how a rank learns that a peer's process has gone.
 *
 * Barriers. Rank r's header counts the barriers r has entered; barrier g is complete for r
 * when every peer's count is >= g. Only the owner writes its counter (release), the others
 * read it (acquire) and sleep on it through a futex with a short timeout, checking the
 * deadline, the peers' states and their liveness (socket hang-up, kill(pid, 0)) in between.
 *
 * Shares. A share is a barrier whose arrival first copies the caller's bytes into its next
 * slot; slots restart at 0 after each plain barrier, so every share made since the caller's
 * last barrier stays readable by the peers until its next one (a peer can only pass barrier
 * g + 1 after this rank entered it).
 *
 * Failure. A wait that times out, a peer that died or left, or a local error marks the group
 * broken for good and publishes the reason in the rank's header, so the peers waiting on it
 * fail at once with that reason instead of waiting for their own timeouts. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"

#define SHM_TAG 0x3170786568736d65ull  /* "emshexp1" */
#define HDR_BYTES 4096
#define COMMON_BYTES 4096              /* the group's common page: rank 0's file, after its header */
#define SLOTS 4                        /* shares between two barriers */
#define SLOT_SPAN ((off_t)1 << 36)     /* 64 GiB of file offsets per slot (sparse) */
#define SLOT_MIN_CAP ((size_t)1 << 16)
#define SPIN_ROUNDS 64                 /* sched_yield polls before sleeping on the futex */
#define NAP_NS 2000000L                /* futex sleep between liveness checks: 2 ms */

/* STATE_GIVING_UP: the rank's wait on barrier `broken_gen` ran out and it is checking, once
 * more, whether the late peers arrived meanwhile; it then goes back to STATE_OK (they did: the
 * barrier completes for everyone) or on to STATE_BROKEN (they did not: the barrier fails for
 * everyone). A peer that completes that barrier waits for the outcome, so no rank can pass a
 * barrier that another gave up on. */
enum { STATE_OK = 0, STATE_BROKEN = 1, STATE_LEFT = 2, STATE_GIVING_UP = 3 };

/* One rank's header, the first page of its file. */
typedef struct {
  uint64_t tag;
  int32_t rank, nranks, pid, header_bytes;
  _Atomic uint32_t reached;  /* barriers entered (futex word) */
  _Atomic uint32_t waiters;  /* peers sleeping on `reached` */
  _Atomic uint32_t state;    /* STATE_* */
  _Atomic uint32_t broken_gen; /* the barrier it gave up on (written before state) */
  _Atomic uint32_t claim;    /* 1 once a thread is writing status, why and broken_gen (written once) */
  int32_t status;            /* why it broke: an epx_status_t ... */
  char why[512];             /* ... and the message (written before state) */
  struct {
    uint32_t gen;            /* barrier number of the share that filled the slot */
    uint32_t pad;
    uint64_t bytes;
  } slot[SLOTS];
} shm_header_t;

_Static_assert(sizeof(shm_header_t) <= HDR_BYTES, "header fits its page");

typedef struct {
  void *ptr;
  size_t len;
} mapping_t;

typedef struct {
  epxi_group_t base;
  int rank;
  int fd[EPX_MAX_RANKS];      /* every rank's file (own included) */
  int sock[EPX_MAX_RANKS];    /* connection to each peer, -1 for self */
  pid_t pid[EPX_MAX_RANKS];   /* as this process sees it; 0 = unknown (other pid namespace) */
  int pidfd[EPX_MAX_RANKS];   /* readable once the peer's process exits (-1: kernel without pidfd) */
  unsigned long long start[EPX_MAX_RANKS]; /* the peer's start time (/proc), against pid reuse */
  _Atomic int abort_req;      /* epx_comm_abort, from any thread: the owner's waits end */
  shm_header_t *hdr[EPX_MAX_RANKS];
  mapping_t map[EPX_MAX_RANKS][SLOTS]; /* own slots read-write, peers' read-only */
  off_t file_bytes;           /* size of the own file */
  void *common;               /* the group's common page, mapped on first use */
  uint32_t gen;               /* barriers this rank entered */
  uint32_t waiting;           /* the barrier this rank is waiting on, 0 outside arrive_and_wait */
  int next_slot;              /* shares since the last plain barrier */
  bool broken;                /* the owner thread's: why holds the reason */
  char why[512];
} shm_group_t;

static const epxi_group_ops_t shm_ops;

/* ---- small helpers -------------------------------------------------------------------- */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint64_t random_u64(void) {
  uint64_t x = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, &x, sizeof x) != (ssize_t)sizeof x) x = 0;
    close(fd);
  }
  static _Atomic uint64_t counter;
  x ^= (uint64_t)now_ns() * 0x9e3779b97f4a7c15ull ^ ((uint64_t)getpid() << 32) ^ atomic_fetch_add(&counter, 1);
  return x;
}

static int futex_wait(_Atomic uint32_t *word, uint32_t val, long ns) {
  struct timespec ts = {.tv_sec = ns / 1000000000L, .tv_nsec = ns % 1000000000L};
  return (int)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word) { syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

/* a >= b for wrapping counters */
static bool reached(uint32_t a, uint32_t b) { return (int32_t)(a - b) >= 0; }

static size_t round_cap(size_t bytes) {
  size_t c = SLOT_MIN_CAP;
  while (c < bytes) c <<= 1;
  return c;
}

static off_t slot_offset(int slot) { return SLOT_SPAN * (off_t)(slot + 1); }

/* An anonymous shared file: memfd, or (old kernels) a POSIX segment unlinked at once. */
static int anon_shared_file(int rank) {
  char name[64];
  snprintf(name, sizeof name, "epx-rank%d", rank);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd >= 0 || errno != ENOSYS) return fd;
  for (int tries = 0; tries < 16; tries++) {
    snprintf(name, sizeof name, "/epx-%d-%016llx", (int)getpid(), (unsigned long long)random_u64());
    fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) {
      shm_unlink(name);
      return fd;
    }
    if (errno != EEXIST) return -1;
  }
  return -1;
}

/* ---- failure ------------------------------------------------------------------------- */

/* Publishes why this rank broke to the peers, and on which barrier (`gen`), once: the owner's
 * thread and an aborting one may race, the first claim wins. The owner leaves
 * STATE_GIVING_UP only by compare-and-swap (give_up_or_not), so it never hides this. */
static void publish(shm_header_t *me, epx_status_t status, const char *why, uint32_t gen) {
  if (!me) return;
  uint32_t st = atomic_load(&me->state);
  if ((st != STATE_OK && st != STATE_GIVING_UP) || atomic_exchange(&me->claim, 1)) return;
  me->status = status;
  snprintf(me->why, sizeof me->why, "%s", why);
  atomic_store(&me->broken_gen, gen);
  atomic_store(&me->state, STATE_BROKEN);
  futex_wake(&me->reached);
}

/* Breaks the group for good, publishes why to the peers and records the message. */
static epx_status_t break_group(shm_group_t *g, epx_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static epx_status_t break_group(shm_group_t *g, epx_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->why, sizeof g->why, fmt, ap);
  va_end(ap);
  if (!g->broken) {
    g->broken = true;
    /* outside a wait it will never enter the next barrier */
    publish(g->hdr[g->rank], status, g->why, g->waiting ? g->waiting : g->gen + 1);
  }
  return epxi_fail(status, "%s", g->why);
}

/* Whether peer r's process is gone: its end of our connection hung up, or its pid is no
 * more. (A zombie still has a pid, but its sockets are closed; a child that inherited the
 * sockets keeps them open, but the pid is gone.) */
/* The start time (field 22 of /proc/<pid>/stat) and state of a process: 0 when it has none
 * (gone), and *zombie when it exited but is not reaped yet. */
static unsigned long long proc_start(pid_t pid, bool *zombie) {
  char path[64], buf[1024];
  *zombie = false;
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
  if (!p || p[1] != ' ') return 0;
  *zombie = p[2] == 'Z' || p[2] == 'X';
  p += 2;
  for (int field = 3; field < 22 && p; field++) { /* p is at field 3 (state) */
    p = strchr(p, ' ');
    if (p) p++;
  }
  return p ? strtoull(p, NULL, 10) : 0;
}

/* Whether peer r's process is gone. Its end of our connection hanging up says so at once;
 * but a forked child may hold the peer's sockets open after the peer died, so the process
 * itself is watched too: its pidfd (readable once it exited, zombie or not), or where the
 * kernel has none, its /proc entry (gone, a zombie, or another process's start time). */
static bool peer_gone(const shm_group_t *g, int r) {
  if (g->sock[r] >= 0) {
    struct pollfd p = {.fd = g->sock[r], .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLRDHUP | POLLERR | POLLNVAL))) return true;
  }
  if (g->pidfd[r] >= 0) {
    struct pollfd p = {.fd = g->pidfd[r], .events = POLLIN};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR));
  }
  if (g->pid[r] <= 0) return false;
  if (kill(g->pid[r], 0) != 0 && errno == ESRCH) return true;
  bool zombie;
  unsigned long long st = proc_start(g->pid[r], &zombie);
  return zombie || (g->start[r] && st != g->start[r]);
}

/* Starts watching peer r's process (pid as this process sees it). */
static void watch_peer(shm_group_t *g, int r, pid_t pid) {
  g->pid[r] = pid;
  if (pid <= 0) return;
#ifdef SYS_pidfd_open
  g->pidfd[r] = (int)syscall(SYS_pidfd_open, pid, 0);
#endif
  bool zombie;
  g->start[r] = proc_start(pid, &zombie);
}

/* Lists ranks in a message: "2, 5 and 3 more". */
static void list_ranks(const int *ranks, int n, char *buf, size_t size) {
  size_t len = 0;
  buf[0] = '\0';
  for (int i = 0; i < n && i < 8 && len < size; i++)
    len += snprintf(buf + len, size - len, "%s%d", i ? ", " : "", ranks[i]);
  if (n > 8 && len < size) snprintf(buf + len, size - len, " and %d more", n - 8);
}

/* ---- barrier --------------------------------------------------------------------------- */

/* Enters barrier g->gen + 1 (after the caller filled any slot) and waits for every peer. */
/* Peer r's verdict on barrier `target`, which it has entered: 1 it gave up on it, -1 it is
 * still deciding, 0 neither. A rank that broke on an earlier barrier and still entered this
 * one was aborted from another thread while it entered: that gives up on this one too. */
static int peer_verdict(const shm_group_t *g, int r, uint32_t target) {
  uint32_t st = atomic_load(&g->hdr[r]->state);
  if (st != STATE_BROKEN && st != STATE_GIVING_UP) return 0;
  if (!reached(target, atomic_load(&g->hdr[r]->broken_gen))) return 0; /* it broke on a later one */
  return st == STATE_BROKEN ? 1 : -1;
}

/* This rank's wait on `target` ran out with `late` ranks missing: it says so, then looks at
 * them once more (seq_cst on both sides: a peer that arrives meanwhile either is seen here or
 * sees this rank giving up). True when they all arrived after all. */
static bool give_up_or_not(shm_group_t *g, uint32_t target, const int *late, int nlate) {
  shm_header_t *mine = g->hdr[g->rank];
  /* compare-and-swap both ways: an abort from another thread may publish STATE_BROKEN meanwhile */
  uint32_t ok = STATE_OK, giving_up = STATE_GIVING_UP;
  if (atomic_load(&mine->claim)) return false;
  atomic_store(&mine->broken_gen, target);
  if (!atomic_compare_exchange_strong(&mine->state, &ok, STATE_GIVING_UP)) return false;
  for (int i = 0; i < nlate; i++)
    if (!reached(atomic_load(&g->hdr[late[i]]->reached), target)) return false;
  return atomic_compare_exchange_strong(&mine->state, &giving_up, STATE_OK);
}

static epx_status_t arrive_and_wait_on(shm_group_t *g, const char *phase, int timeout_ms, uint32_t target);

/* Fails as broken peer r did, with its reason. */
static epx_status_t peer_gave_up(shm_group_t *g, int r, const char *phase) {
  char why[sizeof g->hdr[r]->why];
  memcpy(why, g->hdr[r]->why, sizeof why);
  why[sizeof why - 1] = '\0';
  epx_status_t s = g->hdr[r]->status;
  if (s != EPX_ERR_TIMEOUT && s != EPX_ERR_PEER_LOST && s != EPX_ERR_BROKEN) s = EPX_ERR_PEER_LOST;
  return break_group(g, s, "rank %d, phase %s: rank %d gave up (%s)", g->rank, phase, r, why);
}

static epx_status_t arrive_and_wait(shm_group_t *g, const char *phase, int timeout_ms) {
  const uint32_t target = ++g->gen;
  g->waiting = target;
  epx_status_t s = arrive_and_wait_on(g, phase, timeout_ms, target);
  g->waiting = 0;
  return s;
}

static epx_status_t arrive_and_wait_on(shm_group_t *g, const char *phase, int timeout_ms, uint32_t target) {
  const int R = g->base.nranks, me = g->rank;
  shm_header_t *mine = g->hdr[me];
  atomic_store(&mine->reached, target); /* seq_cst: ordered before the load of waiters */
  if (atomic_load(&mine->waiters)) futex_wake(&mine->reached);

  const int64_t start = now_ns(), deadline = start + (int64_t)timeout_ms * 1000000LL;
  for (int round = 0;; round++) {
    if (atomic_load_explicit(&g->abort_req, memory_order_acquire))
      return break_group(g, EPX_ERR_BROKEN, "ABORTED: rank %d, phase %s: this rank aborted the comm (epx_comm_abort)",
                         me, phase);
    int missing = -1;
    uint32_t seen = 0;
    for (int r = 0; r < R && missing < 0; r++) {
      if (r == me) continue;
      uint32_t v = atomic_load_explicit(&g->hdr[r]->reached, memory_order_acquire);
      if (!reached(v, target)) missing = r, seen = v;
    }
    /* Every peer entered the barrier: it is complete unless one of them gave up on it. */
    int deciding = -1;
    for (int r = 0; r < R; r++) {
      if (r == me || !reached(atomic_load(&g->hdr[r]->reached), target)) continue;
      int v = peer_verdict(g, r, target);
      if (v < 0) deciding = r;
      if (v > 0) return peer_gave_up(g, r, phase);
    }
    if (missing < 0 && deciding < 0) return EPX_SUCCESS;
    if (missing < 0) { /* a peer is deciding: it takes a few loads, unless it died or stopped meanwhile */
      if (peer_gone(g, deciding))
        return break_group(g, EPX_ERR_PEER_LOST, "rank %d, phase %s: peer rank %d lost while it gave up", me, phase,
                           deciding);
      if (now_ns() >= deadline)
        return break_group(g, EPX_ERR_TIMEOUT, "rank %d, phase %s timed out after %d ms waiting for rank %d to decide",
                           me, phase, timeout_ms, deciding);
      sched_yield();
      continue;
    }

    /* A peer that gave up tells why; one that left or died will never arrive. */
    for (int r = 0; r < R; r++) {
      if (r == me || reached(atomic_load_explicit(&g->hdr[r]->reached, memory_order_acquire), target)) continue;
      uint32_t st = atomic_load_explicit(&g->hdr[r]->state, memory_order_acquire);
      if (st == STATE_GIVING_UP) continue; /* undecided: it may yet see everyone */
      if (st == STATE_BROKEN) return peer_gave_up(g, r, phase);
      if (st == STATE_LEFT)
        return break_group(g, EPX_ERR_PEER_LOST, "rank %d, phase %s: rank %d left the group (it destroyed its world)",
                           me, phase, r);
    }
    if (round < SPIN_ROUNDS) {
      sched_yield();
      continue;
    }
    int gone[EPX_MAX_RANKS], ngone = 0, late[EPX_MAX_RANKS], nlate = 0;
    for (int r = 0; r < R; r++) {
      if (r == me || reached(atomic_load_explicit(&g->hdr[r]->reached, memory_order_acquire), target)) continue;
      if (peer_gone(g, r)) gone[ngone++] = r;
      late[nlate++] = r;
    }
    /* Re-read after the liveness check: a peer may have arrived, then exited cleanly. */
    int still = 0;
    for (int i = 0; i < ngone; i++)
      if (!reached(atomic_load_explicit(&g->hdr[gone[i]]->reached, memory_order_acquire), target))
        gone[still++] = gone[i];
    if (still > 0) {
      char list[160];
      list_ranks(gone, still, list, sizeof list);
      int r0 = gone[0];
      return break_group(g, EPX_ERR_PEER_LOST,
                         "rank %d, phase %s: peer rank %s lost: its process (pid %d%s) exited before arriving", me,
                         phase, list, (int)g->pid[r0], still > 1 ? ", ..." : "");
    }
    int64_t now = now_ns();
    if (now >= deadline) {
      if (nlate == 0) continue; /* everyone arrived meanwhile */
      if (give_up_or_not(g, target, late, nlate)) continue;
      if (atomic_load(&g->abort_req)) continue; /* an abort came meanwhile: the loop's first check says so */
      char list[160];
      list_ranks(late, nlate, list, sizeof list);
      return break_group(g, EPX_ERR_TIMEOUT, "rank %d, phase %s timed out after %d ms waiting for rank %s", me, phase,
                         timeout_ms, list);
    }
    long nap = NAP_NS;
    if (deadline - now < nap) nap = (long)(deadline - now);
    shm_header_t *peer = g->hdr[missing];
    atomic_fetch_add(&peer->waiters, 1);
    if (atomic_load(&peer->reached) == seen) futex_wait(&peer->reached, seen, nap);
    atomic_fetch_sub(&peer->waiters, 1);
  }
}

static epx_status_t check_usable(shm_group_t *g, int rank, const char *phase) {
  if (rank != g->rank)
    return epxi_fail(EPX_ERR_INTERNAL, "phase %s: rank %d called the group of rank %d", phase, rank, g->rank);
  if (!g->broken && atomic_load(&g->abort_req))
    return break_group(g, EPX_ERR_BROKEN, "ABORTED: rank %d, phase %s: this rank aborted the comm (epx_comm_abort)",
                       rank, phase);
  if (g->broken)
    return epxi_fail(EPX_ERR_BROKEN, "rank %d, phase %s: the group broke earlier (%s)", rank, phase, g->why);
  return EPX_SUCCESS;
}

static epx_status_t shm_barrier(epxi_group_t *base, int rank, const char *phase, int timeout_ms) {
  shm_group_t *g = (shm_group_t *)base;
  EPX_CHECK(check_usable(g, rank, phase));
  g->next_slot = 0; /* every peer is done with the shares before this barrier once it completes */
  return arrive_and_wait(g, phase, timeout_ms);
}

/* ---- share ----------------------------------------------------------------------------- */

/* Maps [slot_offset, +len) of rank r's file, replacing a smaller mapping. */
static epx_status_t map_slot(shm_group_t *g, int r, int slot, size_t bytes, const char *phase) {
  mapping_t *m = &g->map[r][slot];
  if (m->ptr && m->len >= bytes) return EPX_SUCCESS;
  size_t len = round_cap(bytes);
  int prot = r == g->rank ? PROT_READ | PROT_WRITE : PROT_READ;
  void *p = mmap(NULL, len, prot, MAP_SHARED, g->fd[r], slot_offset(slot));
  if (p == MAP_FAILED)
    return break_group(g, errno == ENOMEM ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_SYSTEM,
                       "rank %d, phase %s: could not map %zu bytes of rank %d's shared segment: %s", g->rank, phase,
                       len, r, strerror(errno));
  if (m->ptr) munmap(m->ptr, m->len);
  m->ptr = p;
  m->len = len;
  return EPX_SUCCESS;
}

static epx_status_t shm_share(epxi_group_t *base, int rank, const char *phase, int timeout_ms, const void *mine,
                              size_t bytes, const void **all) {
  shm_group_t *g = (shm_group_t *)base;
  EPX_CHECK(check_usable(g, rank, phase));
  const int R = g->base.nranks, me = g->rank;
  const int slot = g->next_slot;
  if (slot >= SLOTS)
    return break_group(g, EPX_ERR_INTERNAL, "rank %d, phase %s: more than %d shares without a barrier", me, phase, SLOTS);
  if (bytes > (size_t)SLOT_SPAN)
    return break_group(g, EPX_ERR_OUT_OF_MEMORY,
                       "rank %d, phase %s: a share of %zu bytes exceeds the cross-process limit of %lld bytes", me,
                       phase, bytes, (long long)SLOT_SPAN);
  g->next_slot++;

  /* Copy into the own slot, growing the file first. */
  shm_header_t *h = g->hdr[me];
  if (bytes > 0) {
    off_t end = slot_offset(slot) + (off_t)round_cap(bytes);
    if (end > g->file_bytes) {
      if (ftruncate(g->fd[me], end) != 0)
        return break_group(g, EPX_ERR_OUT_OF_MEMORY, "rank %d, phase %s: could not grow the shared segment to %lld bytes: %s",
                           me, phase, (long long)end, strerror(errno));
      g->file_bytes = end;
    }
    EPX_CHECK(map_slot(g, me, slot, bytes, phase));
    memcpy(g->map[me][slot].ptr, mine, bytes);
  }
  h->slot[slot].bytes = bytes;
  h->slot[slot].gen = g->gen + 1;
  EPX_CHECK(arrive_and_wait(g, phase, timeout_ms));

  /* Every peer filled its slot for this barrier (the release of its counter covers it). */
  for (int r = 0; r < R; r++) {
    if (r == me) {
      all[r] = bytes ? g->map[me][slot].ptr : mine;
      continue;
    }
    const shm_header_t *ph = g->hdr[r];
    if (ph->slot[slot].gen != g->gen)
      return break_group(g, EPX_ERR_INTERNAL,
                         "rank %d, phase %s: rank %d is in another collective (its share %d is from barrier %u, this is "
                         "barrier %u)",
                         me, phase, r, slot, ph->slot[slot].gen, g->gen);
    size_t n = ph->slot[slot].bytes;
    all[r] = NULL;
    if (n == 0) continue;
    EPX_CHECK(map_slot(g, r, slot, n, phase));
    all[r] = g->map[r][slot].ptr;
  }
  return EPX_SUCCESS;
}

static bool shm_broken(const epxi_group_t *base) {
  const shm_group_t *g = (const shm_group_t *)base;
  return g->broken || atomic_load(&((shm_group_t *)g)->abort_req);
}

/* Any thread: the waits of the owner end at their next check (milliseconds), the peers'
 * once they read this rank's published state. */
static void shm_abort(epxi_group_t *base, int rank) {
  shm_group_t *g = (shm_group_t *)base;
  if (atomic_exchange(&g->abort_req, 1)) return;
  char why[128];
  snprintf(why, sizeof why, "ABORTED: rank %d aborted the comm (epx_comm_abort)", rank);
  /* the barrier the owner entered last: the one it waits on, if it waits (peer_verdict) */
  shm_header_t *me = g->hdr[g->rank];
  publish(me, EPX_ERR_BROKEN, why, me ? atomic_load(&me->reached) : 0);
}

/* Any thread, never waits: reads only what is published (headers) or fixed (sockets, pids). */
static epx_status_t shm_error(const epxi_group_t *base, int rank, char *why, size_t size) {
  shm_group_t *g = (shm_group_t *)base;
  const int R = g->base.nranks;
  const shm_header_t *mine = g->hdr[rank];
  if (mine && atomic_load_explicit(&((shm_header_t *)mine)->state, memory_order_acquire) == STATE_BROKEN) {
    snprintf(why, size, "%.*s", (int)sizeof mine->why, mine->why);
    return mine->status;
  }
  /* a dead process first: it is the cause, the peers that gave up or left are its effects */
  for (int r = 0; r < R; r++)
    if (r != rank && g->hdr[r] && atomic_load(&g->hdr[r]->state) != STATE_LEFT && peer_gone(g, r)) {
      snprintf(why, size, "peer rank %d lost: its process (pid %d) exited", r, (int)g->pid[r]);
      return EPX_ERR_PEER_LOST;
    }
  for (int r = 0; r < R; r++) {
    const shm_header_t *h = g->hdr[r];
    if (!h || r == rank) continue;
    uint32_t st = atomic_load_explicit(&((shm_header_t *)h)->state, memory_order_acquire);
    if (st == STATE_BROKEN) {
      epx_status_t s = h->status;
      if (s != EPX_ERR_TIMEOUT && s != EPX_ERR_PEER_LOST && s != EPX_ERR_BROKEN) s = EPX_ERR_PEER_LOST;
      snprintf(why, size, "a peer gave up: %.*s", (int)sizeof h->why, h->why);
      return s;
    }
    if (st == STATE_LEFT) {
      snprintf(why, size, "rank %d left the group (it destroyed its world)", r);
      return EPX_ERR_PEER_LOST;
    }
  }
  return EPX_SUCCESS;
}

static void *shm_common(epxi_group_t *base, size_t *bytes) {
  shm_group_t *g = (shm_group_t *)base;
  if (!g->common) {
    void *p = mmap(NULL, COMMON_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, g->fd[0], HDR_BYTES);
    if (p == MAP_FAILED) {
      epxi_fail(EPX_ERR_SYSTEM, "rank %d: could not map the group's common page: %s", g->rank, strerror(errno));
      return NULL;
    }
    g->common = p;
  }
  *bytes = COMMON_BYTES;
  return g->common;
}

static bool shm_peer_lost(const epxi_group_t *base, int r) {
  const shm_group_t *g = (const shm_group_t *)base;
  if (r == g->rank || !g->hdr[r]) return false;
  return atomic_load_explicit(&g->hdr[r]->state, memory_order_acquire) == STATE_LEFT || peer_gone(g, r);
}

static void shm_destroy(epxi_group_t *base) {
  shm_group_t *g = (shm_group_t *)base;
  const int R = g->base.nranks;
  shm_header_t *me = g->hdr[g->rank];
  if (me) {
    uint32_t ok = STATE_OK;
    atomic_compare_exchange_strong(&me->state, &ok, STATE_LEFT);
    futex_wake(&me->reached);
  }
  if (g->common) munmap(g->common, COMMON_BYTES);
  for (int r = 0; r < R; r++) {
    for (int s = 0; s < SLOTS; s++)
      if (g->map[r][s].ptr) munmap(g->map[r][s].ptr, g->map[r][s].len);
    if (g->hdr[r]) munmap(g->hdr[r], HDR_BYTES);
    if (g->fd[r] >= 0) close(g->fd[r]);
    if (g->sock[r] >= 0) close(g->sock[r]);
    if (g->pidfd[r] >= 0) close(g->pidfd[r]);
  }
  free(g);
}

static const epxi_group_ops_t shm_ops = {
    .name = "cross-process",
    .destroy = shm_destroy,
    .barrier = shm_barrier,
    .share = shm_share,
    .broken = shm_broken,
    .common = shm_common,
    .peer_lost = shm_peer_lost,
    .abort = shm_abort,
    .error = shm_error,
};

/* ---- creation -------------------------------------------------------------------------- */

/* What every rank tells the others through the bootstrap exchange. */
typedef struct {
  char tag[8];
  int32_t rank, nranks, backend, pid;
  int32_t status;      /* EPX_SUCCESS, or why this rank could not set up */
  uint32_t uid;
  uint64_t nonce;      /* proves a connecting peer took part in this exchange */
  char boot_id[48];    /* same host */
  char sock[48];       /* abstract unix socket name, without the leading NUL */
} shm_info_t;

#define INFO_TAG "epxshm1"

/* What a rank sends over each connection, with its file descriptor. */
typedef struct {
  uint64_t tag;
  int32_t from, to;
  uint64_t nonce;      /* the receiver's nonce */
} hello_t;

static void read_boot_id(char *out, size_t n) {
  memset(out, 0, n);
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t k = read(fd, out, n - 1);
    close(fd);
    if (k > 0) {
      while (k > 0 && (out[k - 1] == '\n' || out[k - 1] == ' ')) out[--k] = '\0';
      return;
    }
  }
  if (gethostname(out, n - 1) != 0) out[0] = '\0';
}

static socklen_t abstract_addr(const char *name, struct sockaddr_un *a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  size_t len = strnlen(name, sizeof a->sun_path - 2);
  memcpy(a->sun_path + 1, name, len);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
}

/* Waits until fd is ready for `events` or the deadline passes; 1 ready, 0 timeout, -1 error. */
static int wait_fd(int fd, short events, int64_t deadline) {
  for (;;) {
    int64_t left = deadline - now_ns();
    if (left <= 0) return 0;
    struct pollfd p = {.fd = fd, .events = events};
    int ms = (int)((left + 999999) / 1000000);
    int rc = poll(&p, 1, ms);
    if (rc > 0) return 1;
    if (rc < 0 && errno != EINTR) return -1;
  }
}

static int send_hello(int sock, const hello_t *h, int fd, int64_t deadline) {
  char ctrl[CMSG_SPACE(sizeof(int))];
  memset(ctrl, 0, sizeof ctrl);
  struct iovec iov = {.iov_base = (void *)h, .iov_len = sizeof *h};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctrl, .msg_controllen = sizeof ctrl};
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof(int));
  for (;;) {
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n == (ssize_t)sizeof *h) return 0;
    if (n >= 0) return -1; /* a short datagram of a stream: should not happen for 24 bytes */
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (wait_fd(sock, POLLOUT, deadline) <= 0) return -1;
  }
}

/* Receives one hello and its descriptor; returns 1, 0 on timeout, -1 on error or EOF. */
static int recv_hello(int sock, hello_t *h, int *fd, int64_t deadline) {
  *fd = -1;
  for (;;) {
    char ctrl[CMSG_SPACE(sizeof(int) * 4)];
    struct iovec iov = {.iov_base = h, .iov_len = sizeof *h};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctrl, .msg_controllen = sizeof ctrl};
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int w = wait_fd(sock, POLLIN, deadline);
      if (w <= 0) return w;
      continue;
    }
    for (struct cmsghdr *c = n > 0 ? CMSG_FIRSTHDR(&msg) : NULL; c; c = CMSG_NXTHDR(&msg, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < nfds; i++) {
          int f;
          memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
          if (*fd < 0)
            *fd = f;
          else
            close(f);
        }
      }
    if (n == (ssize_t)sizeof *h && *fd >= 0) return 1;
    if (*fd >= 0) close(*fd);
    *fd = -1;
    return -1;
  }
}

static pid_t peer_pid(int sock) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return 0;
  return cred.pid;
}

/* Whether the process at the other end of a unix socket is rank r as the exchange
 * described it: this process's user, and rank r's pid (the kernel's word, not the peer's). */
static bool cred_is_rank(int sock, const shm_info_t *info) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  return cred.uid == getuid() && cred.pid == (pid_t)info->pid;
}

/* Whether the process at the other end may be one of the lower ranks still expected. */
static bool cred_is_lower_rank(const shm_group_t *g, int sock, const shm_info_t *infos) {
  for (int j = 0; j < g->rank; j++)
    if (g->sock[j] < 0 && cred_is_rank(sock, &infos[j])) return true;
  return false;
}

/* The file and socket exchange: rank i connects to every j > i, accepts every j < i; on each
 * connection both send a hello with their file. Nobody waits on a send, so there is no
 * cycle: connects queue in the listener's backlog. */
static epx_status_t exchange_files(shm_group_t *g, int listener, const shm_info_t *infos, int64_t deadline,
                                   int timeout_ms) {
  const int R = g->base.nranks, me = g->rank;
  const uint64_t my_nonce = infos[me].nonce;
  char list[160];

  for (int j = me + 1; j < R; j++) {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0) return epxi_fail(EPX_ERR_SYSTEM, "rank %d, bootstrap: socket: %s", me, strerror(errno));
    g->sock[j] = s;
    struct sockaddr_un a;
    socklen_t alen = abstract_addr(infos[j].sock, &a);
    for (;;) {
      if (connect(s, (struct sockaddr *)&a, alen) == 0) break;
      if (errno == EINTR || errno == EAGAIN) {
        if (now_ns() >= deadline)
          return epxi_fail(EPX_ERR_TIMEOUT, "rank %d, bootstrap: rank %d did not accept a connection within %d ms", me,
                           j, timeout_ms);
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
        continue;
      }
      return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: could not connect to rank %d (pid %d): %s", me, j,
                       (int)infos[j].pid, strerror(errno));
    }
    if (!cred_is_rank(s, &infos[j]))
      return epxi_fail(EPX_ERR_SYSTEM,
                       "rank %d, bootstrap: the unix socket of rank %d is held by a process other than rank %d's "
                       "(pid %d, user %u)", me, j, j, (int)infos[j].pid, (unsigned)infos[j].uid);
    hello_t h = {.tag = SHM_TAG, .from = me, .to = j, .nonce = infos[j].nonce};
    if (send_hello(s, &h, g->fd[me], deadline) != 0)
      return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: could not send the shared segment to rank %d: %s", me, j,
                       strerror(errno));
  }

  /* Connections from the lower ranks (others are strays: dropped). */
  int pending = me;
  while (pending > 0) {
    int w = wait_fd(listener, POLLIN, deadline);
    if (w <= 0) {
      int miss[EPX_MAX_RANKS], n = 0;
      for (int j = 0; j < me; j++)
        if (g->sock[j] < 0) miss[n++] = j;
      list_ranks(miss, n, list, sizeof list);
      return epxi_fail(w == 0 ? EPX_ERR_TIMEOUT : EPX_ERR_SYSTEM,
                       "rank %d, bootstrap: rank %s did not connect within %d ms", me, list, timeout_ms);
    }
    int s = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (s < 0) continue;
    if (!cred_is_lower_rank(g, s, infos)) { /* a stranger (its name is in /proc/net/unix): dropped unheard */
      close(s);
      continue;
    }
    hello_t h;
    int fd;
    int rc = recv_hello(s, &h, &fd, deadline);
    if (rc != 1 || h.tag != SHM_TAG || h.to != me || h.nonce != my_nonce || h.from < 0 || h.from >= me ||
        g->sock[h.from] >= 0) {
      if (fd >= 0) close(fd);
      close(s);
      continue;
    }
    g->sock[h.from] = s;
    g->fd[h.from] = fd;
    pending--;
    hello_t back = {.tag = SHM_TAG, .from = me, .to = h.from, .nonce = infos[h.from].nonce};
    if (send_hello(s, &back, g->fd[me], deadline) != 0)
      return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: could not send the shared segment to rank %d: %s", me,
                       h.from, strerror(errno));
  }

  /* The higher ranks' answers. */
  for (int j = me + 1; j < R; j++) {
    hello_t h;
    int fd;
    int rc = recv_hello(g->sock[j], &h, &fd, deadline);
    if (rc == 0)
      return epxi_fail(EPX_ERR_TIMEOUT, "rank %d, bootstrap: rank %d did not answer within %d ms", me, j, timeout_ms);
    if (rc < 0 || h.tag != SHM_TAG || h.from != j || h.to != me || h.nonce != my_nonce) {
      if (fd >= 0) close(fd);
      return epxi_fail(EPX_ERR_PEER_LOST, "rank %d, bootstrap: rank %d (pid %d) closed the connection or answered garbage",
                       me, j, (int)infos[j].pid);
    }
    g->fd[j] = fd;
  }

  /* Liveness: the pid as this process sees it (0 when the peer is in another pid namespace). */
  for (int j = 0; j < R; j++)
    if (j != me) watch_peer(g, j, peer_pid(g->sock[j]));
  g->pid[me] = getpid();
  return EPX_SUCCESS;
}

/* Checks what every rank said about itself; every rank sees the same list, so they all fail
 * alike. */
static epx_status_t check_infos(const shm_info_t *infos, int R, int me) {
  for (int r = 0; r < R; r++) {
    const shm_info_t *i = &infos[r];
    if (memcmp(i->tag, INFO_TAG, sizeof i->tag) != 0)
      return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                       "rank %d, bootstrap: the allgather gave no epx data at position %d (is it rank-major, of the "
                       "size asked?)", me, r);
    if (i->status != EPX_SUCCESS)
      return epxi_fail((epx_status_t)i->status == EPX_ERR_OUT_OF_MEMORY ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_PEER_LOST,
                       "rank %d, bootstrap: rank %d could not set up its side of the group (%s)", me, r,
                       epx_status_string((epx_status_t)i->status));
    if (i->nranks != R)
      return epxi_fail(EPX_ERR_CONFIG_MISMATCH, "bootstrap: rank %d says the group has %d ranks, rank %d says %d",
                       me, R, i->rank, i->nranks);
    if (i->rank != r)
      return epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                       "bootstrap: position %d of the allgather holds rank %d (two processes claim one rank, or the "
                       "allgather is not rank-major)", r, i->rank);
  }
  for (int r = 1; r < R; r++) {
    if (infos[r].uid != infos[0].uid)
      return epxi_fail(EPX_ERR_UNSUPPORTED,
                       "bootstrap: rank 0 runs as user %u but rank %d as user %u; a cross-process group needs every "
                       "rank to run as one user", (unsigned)infos[0].uid, r, (unsigned)infos[r].uid);
    if (infos[r].backend != infos[0].backend)
      return epxi_fail(EPX_ERR_CONFIG_MISMATCH, "bootstrap: rank 0 uses the %s backend but rank %d uses %s",
                       epx_backend_name((epx_backend_t)infos[0].backend), r,
                       epx_backend_name((epx_backend_t)infos[r].backend));
    if (strncmp(infos[r].boot_id, infos[0].boot_id, sizeof infos[0].boot_id) != 0)
      return epxi_fail(EPX_ERR_UNSUPPORTED,
                       "bootstrap: rank %d runs on another host than rank 0; a cross-process group needs every rank "
                       "on one host", r);
  }
  return EPX_SUCCESS;
}

/* A group with no descriptors yet, so that shm_destroy can undo any partial setup. */
static shm_group_t *new_shm_group(int nranks, int rank) {
  shm_group_t *g = calloc(1, sizeof *g);
  if (!g) return NULL;
  g->base = (epxi_group_t){.ops = &shm_ops, .nranks = nranks, .first_rank = rank, .num_local = 1};
  g->rank = rank;
  for (int r = 0; r < EPX_MAX_RANKS; r++) g->fd[r] = g->sock[r] = g->pidfd[r] = -1;
  return g;
}

/* This rank's own file, sized and with its header mapped and filled; the group owns whatever
 * was made, also on failure. */
static epx_status_t create_own_segment(shm_group_t *g, int nranks, int rank) {
  g->fd[rank] = anon_shared_file(rank);
  /* sized before any peer can map it: touching a page past the end would be SIGBUS */
  const int sized = g->fd[rank] >= 0 && ftruncate(g->fd[rank], HDR_BYTES + COMMON_BYTES) == 0;
  g->file_bytes = HDR_BYTES + COMMON_BYTES;
  if (!sized)
    return epxi_fail(EPX_ERR_SYSTEM, "rank %d: could not create its shared segment: %s", rank, strerror(errno));
  void *p = mmap(NULL, HDR_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, g->fd[rank], 0);
  if (p == MAP_FAILED)
    return epxi_fail(EPX_ERR_SYSTEM, "rank %d: could not map its shared segment: %s", rank, strerror(errno));
  g->hdr[rank] = p;
  shm_header_t *h = g->hdr[rank];
  h->tag = SHM_TAG;
  h->rank = rank;
  h->nranks = nranks;
  h->pid = (int32_t)getpid();
  h->header_bytes = (int32_t)sizeof *h;
  return EPX_SUCCESS;
}

/* What this rank tells the others in round 1; filled even on a rank that has already failed,
 * since that rank still takes part to report its status. */
static void describe_self(shm_info_t *mine, int rank, int nranks, int backend) {
  memcpy(mine->tag, INFO_TAG, sizeof mine->tag);
  mine->rank = rank;
  mine->nranks = nranks;
  mine->backend = backend;
  mine->pid = (int32_t)getpid();
  mine->uid = (uint32_t)getuid();
  mine->nonce = random_u64();
  read_boot_id(mine->boot_id, sizeof mine->boot_id);
}

/* Listener in the abstract namespace: gone with the process, never in the file system. Its
 * name goes into mine->sock; *listener is this rank's to close, also on failure. */
static epx_status_t open_listener(shm_info_t *mine, int rank, int *listener) {
  *listener = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (*listener < 0) return epxi_fail(EPX_ERR_SYSTEM, "rank %d: socket: %s", rank, strerror(errno));
  for (int tries = 0;; tries++) {
    snprintf(mine->sock, sizeof mine->sock, "epx.%d.%016llx", (int)getpid(), (unsigned long long)random_u64());
    struct sockaddr_un a;
    socklen_t alen = abstract_addr(mine->sock, &a);
    if (bind(*listener, (struct sockaddr *)&a, alen) == 0 && listen(*listener, EPX_MAX_RANKS) == 0)
      return EPX_SUCCESS;
    if (errno != EADDRINUSE || tries > 8)
      return epxi_fail(EPX_ERR_SYSTEM, "rank %d: could not listen on a unix socket: %s", rank, strerror(errno));
  }
}

/* Maps every peer's header (its file came over the sockets) and checks that it is ours. */
static epx_status_t map_peer_headers(shm_group_t *g, int nranks, int rank) {
  for (int r = 0; r < nranks; r++) {
    if (r == rank) continue;
    void *p = mmap(NULL, HDR_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, g->fd[r], 0);
    if (p == MAP_FAILED)
      return epxi_fail(EPX_ERR_SYSTEM, "rank %d: could not map rank %d's shared segment: %s", rank, r,
                       strerror(errno));
    g->hdr[r] = p;
    if (g->hdr[r]->tag != SHM_TAG || g->hdr[r]->rank != r || g->hdr[r]->nranks != nranks ||
        g->hdr[r]->header_bytes != (int32_t)sizeof(shm_header_t))
      return epxi_fail(EPX_ERR_INTERNAL, "rank %d: rank %d's shared segment has a foreign header (another epx version?)",
                       rank, r);
  }
  return EPX_SUCCESS;
}

/* A rank that failed hangs up before round 2, so that peers still waiting on it in
 * exchange_files see it at once. */
static void hang_up(shm_group_t *g, int nranks, int *listener) {
  close(*listener);
  *listener = -1;
  for (int r = 0; r < nranks; r++)
    if (g->sock[r] >= 0) close(g->sock[r]), g->sock[r] = -1;
}

/* Round 2: everyone attached, or everyone fails. s is this rank's status so far; the result is
 * the group's. */
static epx_status_t vote_on_join(epx_status_t s, int nranks, int rank, epxi_exchange_fn exchange, void *ctx) {
  const epx_status_t before = s;
  int32_t vote = s, *votes = calloc((size_t)nranks, sizeof *votes);
  if (!votes) {
    if (s == EPX_SUCCESS) s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "bootstrap votes");
    return s;
  }
  char keep[1024];
  snprintf(keep, sizeof keep, "%s", epx_last_error());
  epx_status_t x = exchange(&vote, votes, sizeof vote, ctx);
  if (s == EPX_SUCCESS && x != EPX_SUCCESS) s = x;
  if (before != EPX_SUCCESS) epxi_fail(before, "%s", keep); /* this rank's own reason comes first */
  for (int r = 0; r < nranks && s == EPX_SUCCESS; r++)
    if (votes[r] != EPX_SUCCESS)
      s = epxi_fail(votes[r] == EPX_ERR_TIMEOUT ? EPX_ERR_TIMEOUT : EPX_ERR_PEER_LOST,
                    "rank %d, bootstrap: rank %d could not join the group (%s)", rank, r,
                    epx_status_string((epx_status_t)votes[r]));
  free(votes);
  return s;
}

epx_status_t epxi_shm_group_create(int nranks, int rank, int backend, epxi_exchange_fn exchange, void *ctx,
                                   int timeout_ms, epxi_group_t **group) {
  *group = NULL;
  shm_group_t *g = new_shm_group(nranks, rank);
  if (!g) return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "cross-process group");

  epx_status_t s = EPX_SUCCESS;
  int listener = -1;
  int64_t deadline;
  shm_info_t mine, *infos = calloc((size_t)nranks, sizeof *infos);
  memset(&mine, 0, sizeof mine);
  if (!infos) s = epxi_fail(EPX_ERR_OUT_OF_MEMORY, "bootstrap table");

  if (s == EPX_SUCCESS) s = create_own_segment(g, nranks, rank);
  describe_self(&mine, rank, nranks, backend);
  if (s == EPX_SUCCESS) s = open_listener(&mine, rank, &listener);

  /* Round 1: who is who. A rank that failed so far still takes part (with its status), so
   * that the others fail at once rather than at their timeouts. */
  mine.status = s;
  if (infos) {
    epx_status_t x = exchange(&mine, infos, sizeof mine, ctx);
    if (s == EPX_SUCCESS) s = x;
    if (x != EPX_SUCCESS) goto out; /* no agreement possible */
  } else {
    goto out;
  }
  if (s == EPX_SUCCESS) s = check_infos(infos, nranks, rank);

  /* The files, over the sockets; then the peers' headers. The clock starts now: joining may
   * have taken the first exchange a while. */
  deadline = now_ns() + (int64_t)timeout_ms * 1000000LL;
  if (s == EPX_SUCCESS) s = exchange_files(g, listener, infos, deadline, timeout_ms);
  if (s == EPX_SUCCESS) s = map_peer_headers(g, nranks, rank);

  if (s != EPX_SUCCESS) hang_up(g, nranks, &listener);
  s = vote_on_join(s, nranks, rank, exchange, ctx);

out:
  if (listener >= 0) close(listener);
  free(infos);
  if (s != EPX_SUCCESS) {
    shm_destroy(&g->base);
    return s;
  }
  *group = &g->base;
  return EPX_SUCCESS;
}
