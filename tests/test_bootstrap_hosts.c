/* test_bootstrap_hosts: the bootstrap across hosts, loopback addresses standing in for hosts.
 * Four rank processes: ranks 0 and 1 on "host A" (EPX_BOOTSTRAP_ADDR=127.0.0.2), ranks 2 and 3 on
 * "host B" (127.0.0.3); the listener is host A's (epx_get_unique_id in the parent, which is no
 * rank, with 127.0.0.2). The bootstrap is internal to libepx, so its sources are compiled in.
 *   form     every rank connects from its host's address (its socket, as /proc/net/tcp shows
 *            it, goes from that address to the id's listener) and the ranks exchange their
 *            ranks: every rank gets every rank's, in rank order
 *   lost     host B's processes are killed (SIGKILL) while host A's ranks wait in an exchange:
 *            both get EPX_ERR_PEER_LOST naming a rank of host B within a second of the kill
 *   idle     host B's processes are killed between exchanges: host A's next exchange fails at
 *            once (within a second of the kill) with EPX_ERR_PEER_LOST naming a rank of host B
 *   iface    the same group as form, the listener on an interface's address
 *            (EPX_SOCKET_IFNAME=lo): every rank closes after its last exchange, with no failure
 *   refused  EPX_BOOTSTRAP_ADDR that is no address, EPX_SOCKET_IFNAME that names no interface:
 *            EPX_ERR_INVALID_ARGUMENT naming the variable */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "testutil.h"

#define R 4
#define HOST_A "127.0.0.2"
#define HOST_B "127.0.0.3"
#define LOST_WITHIN_S 1.0

typedef enum { FORM, LOST, IDLE } scenario_t;

/* What the parent and the ranks share: the kill's time, and who is where. */
typedef struct {
  volatile double killed_at; /* tu_now() of the kill, 0 before */
  volatile int ready;        /* host B ranks past their first exchange */
  volatile int waiting;      /* host A ranks about to wait (LOST) or idle (IDLE) */
} shared_t;

static const char *host_of(int rank) { return rank < R / 2 ? HOST_A : HOST_B; }

/* Whether this host has an established TCP connection from `from` to the id's listener (the
 * id's layout: tag[8], then address and port, both in network order). */
static int connected_from(const char *from, const epx_unique_id_t *id) {
  struct in_addr f, t;
  uint16_t port;
  memcpy(&t.s_addr, id->internal + 8, sizeof t.s_addr);
  memcpy(&port, id->internal + 12, sizeof port);
  port = ntohs(port);
  inet_pton(AF_INET, from, &f);
  char needle[64], line[512];
  snprintf(needle, sizeof needle, " %08X:", (unsigned)f.s_addr);
  char remote[32];
  snprintf(remote, sizeof remote, " %08X:%04X 01 ", (unsigned)t.s_addr, port); /* 01: established */
  FILE *fp = fopen("/proc/net/tcp", "re");
  int found = 0;
  while (fp && !found && fgets(line, sizeof line, fp)) {
    const char *at = strstr(line, needle);
    found = at && strstr(at, remote) != NULL;
  }
  if (fp) fclose(fp);
  return found;
}

/* Exchange's failure names a rank of host B. */
static int names_host_b(const char *msg) { return strstr(msg, "rank 2") || strstr(msg, "rank 3"); }

static void rank_proc(int rank, const epx_unique_id_t *id, scenario_t sc, shared_t *sh) {
  char label[16];
  snprintf(label, sizeof label, "rank %d", rank);
  tu_enter_process(label);
  setenv("EPX_BOOTSTRAP_ADDR", host_of(rank), 1);
  epxi_bootstrap_t *b = NULL;
  epx_status_t s = epxi_bootstrap_connect(id, rank, R, 10000, &b);
  CHECK(s == EPX_SUCCESS, "connect: %s", epx_last_error());
  if (s != EPX_SUCCESS) _exit(1);
  CHECK(connected_from(host_of(rank), id), "no connection from %s to the listener", host_of(rank));
  int32_t mine = rank, all[R];
  s = epxi_bootstrap_exchange(&mine, all, sizeof mine, b);
  CHECK(s == EPX_SUCCESS, "first exchange: %s", epx_last_error());
  for (int r = 0; r < R && s == EPX_SUCCESS; r++) CHECK(all[r] == r, "position %d holds %d", r, all[r]);
  const int on_b = rank >= R / 2;
  if (sc == LOST || sc == IDLE) {
    if (on_b) {
      __sync_fetch_and_add(&sh->ready, 1);
      for (;;) pause(); /* until the parent kills this "host" */
    }
    __sync_fetch_and_add(&sh->waiting, 1);
    if (sc == IDLE)
      while (sh->killed_at == 0) usleep(1000);
    s = epxi_bootstrap_exchange(&mine, all, sizeof mine, b);
    const double late = tu_now() - sh->killed_at;
    CHECK(s == EPX_ERR_PEER_LOST, "after host B was lost: %s (%s)", epx_status_string(s), epx_last_error());
    CHECK(names_host_b(epx_last_error()), "the failure names no rank of host B: %s", epx_last_error());
    CHECK(sh->killed_at > 0 && late < LOST_WITHIN_S, "the loss was seen %.3f s after the kill", late);
  } else {
    for (int i = 0; i < 3 && s == EPX_SUCCESS; i++) {
      mine = rank * 10 + i;
      s = epxi_bootstrap_exchange(&mine, all, sizeof mine, b);
      CHECK(s == EPX_SUCCESS, "exchange %d: %s", i, epx_last_error());
      for (int r = 0; r < R && s == EPX_SUCCESS; r++) CHECK(all[r] == r * 10 + i, "position %d holds %d", r, all[r]);
    }
  }
  epxi_bootstrap_close(b);
  _exit(check_failures() ? 1 : 0);
}

/* One group: the listener from the parent, the ranks forked; host B killed when the scenario
 * says. */
static void run_group(scenario_t sc, const char *name) {
  shared_t *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(sh, 0, sizeof *sh);
  epx_unique_id_t id;
  CHECK_STATUS(epx_get_unique_id(&id), EPX_SUCCESS, "%s: epx_get_unique_id", name);
  pid_t pid[R];
  for (int r = 0; r < R; r++) {
    pid[r] = fork();
    if (pid[r] == 0) rank_proc(r, &id, sc, sh);
  }
  if (sc == LOST || sc == IDLE) {
    const double until = tu_now() + 20;
    while ((sh->ready < R / 2 || sh->waiting < R / 2) && tu_now() < until) usleep(1000);
    if (sc == LOST) usleep(200000); /* host A's ranks are in their exchange by now */
    sh->killed_at = tu_now();
    for (int r = R / 2; r < R; r++) kill(pid[r], SIGKILL);
  }
  for (int r = 0; r < R; r++) {
    int st = 0;
    waitpid(pid[r], &st, 0);
    const int killed = (sc == LOST || sc == IDLE) && r >= R / 2;
    if (killed)
      CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "%s: rank %d did not die of the kill", name, r);
    else
      CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: rank %d ended with status %d", name, r, st);
  }
  munmap(sh, sizeof *sh);
}

static void refused(void) {
  epx_unique_id_t id;
  setenv("EPX_BOOTSTRAP_ADDR", "not-an-address", 1);
  CHECK_STATUS(epx_get_unique_id(&id), EPX_ERR_INVALID_ARGUMENT, "EPX_BOOTSTRAP_ADDR=not-an-address");
  CHECK(strstr(epx_last_error(), "EPX_BOOTSTRAP_ADDR") != NULL, "the message names the variable: %s", epx_last_error());
  unsetenv("EPX_BOOTSTRAP_ADDR");
  setenv("EPX_SOCKET_IFNAME", "epx-no-such-if0", 1);
  CHECK_STATUS(epx_get_unique_id(&id), EPX_ERR_INVALID_ARGUMENT, "EPX_SOCKET_IFNAME=epx-no-such-if0");
  CHECK(strstr(epx_last_error(), "EPX_SOCKET_IFNAME") != NULL, "the message names the variable: %s", epx_last_error());
  unsetenv("EPX_SOCKET_IFNAME");
}

int main(void) {
  tu_begin("test_bootstrap_hosts");
  signal(SIGPIPE, SIG_IGN);
  setenv("EPX_BOOTSTRAP_ADDR", HOST_A, 1);
  run_group(FORM, "form");
  run_group(LOST, "lost");
  run_group(IDLE, "idle");
  unsetenv("EPX_BOOTSTRAP_ADDR");
  setenv("EPX_SOCKET_IFNAME", "lo", 1);
  run_group(FORM, "iface");
  unsetenv("EPX_SOCKET_IFNAME");
  refused();
  return tu_end();
}
