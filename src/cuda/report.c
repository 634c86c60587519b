/* Waiting and reporting: a rank's stream waited for (across processes while watching for lost
 * peers), and the error words the kernels record turned into a status and a message. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cuda/backend.h"

static const char *const phase_names[EPXC_PH_COUNT] = {
    [EPXC_PH_NOTIFY] = "notify",
    [EPXC_PH_DISPATCH] = "dispatch",   [EPXC_PH_DISPATCH_DONE] = "dispatch (closing)",
    [EPXC_PH_COMBINE] = "combine",     [EPXC_PH_COMBINE_DONE] = "combine (closing)",
    [EPXC_PH_LL_DISPATCH] = "low-latency dispatch", [EPXC_PH_LL_COMBINE] = "low-latency combine",
    [EPXC_PH_LAYOUT] = "layout",
};

/* ---- across processes: lost peers ------------------------------------------------------------ */

/* A peer whose process is gone (or that left) never posts again: say so in its error word,
 * which every device wait on it checks, so every rank's kernels stop now rather than at the
 * timeout. Its own process can no longer write that word. */
static void mark_lost_peers(const epx_comm_t *c) {
  cuda_world_t *cw = c->world->impl;
  for (int r = 0; r < c->nranks; r++) {
    if (r == c->rank || !epxi_group_peer_lost(c->world->group, r)) continue;
    volatile epxc_error_t *e = &cw->errors_host[r];
    if (fatal_status(e->status)) continue;
    e->phase = -1;
    e->peer = r;
    e->detail = 0;
    atomic_thread_fence(memory_order_seq_cst);
    e->status = EPX_ERR_PEER_LOST;
  }
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Waits for the stream's work. Across processes it polls (busily at first: most waits are
 * short), looking for lost peers every millisecond meanwhile. */
cudaError_t wait_stream(const epx_comm_t *c, cudaStream_t st) {
  if (!((cuda_world_t *)c->world->impl)->shared) return cudaStreamSynchronize(st);
  const int64_t start = now_ns();
  for (int64_t checked = start;;) {
    const cudaError_t e = cudaStreamQuery(st);
    if (e != cudaErrorNotReady) return e;
    const int64_t now = now_ns();
    if (now - checked >= 1000000) {
      mark_lost_peers(c);
      checked = now;
    }
    if (now - start > 200000) {
      const struct timespec nap = {0, 50000L};
      nanosleep(&nap, NULL);
    }
  }
}

/* ---- reports ---------------------------------------------------------------------------- */

static const char *phase_name(int phase) { return phase >= 0 && phase < EPXC_PH_COUNT ? phase_names[phase] : "?"; }

/* The record epx_comm_abort leaves in every rank's word (see cuda_comm_abort). */
static bool abort_record(const volatile epxc_error_t *e) {
  return e->status == EPX_ERR_BROKEN && e->phase == EPXC_PHASE_ABORTED;
}

/* Two stamp words (call; handle, operation) as the exchange carried them. */
static epxi_stamp_t stamp_from(uint64_t call, uint64_t word1) {
  epxi_stamp_t s;
  memset(&s, 0, sizeof s);
  s.call = call;
  memcpy((char *)&s + sizeof s.call, &word1, sizeof word1);
  s.status = 0;
  return s;
}

/* What an exchange's comparison of the stamps recorded (epxc_error_t.about): which ranks,
 * which calls, which field. */
static epx_status_t report_stamps(const epx_comm_t *c, const volatile epxc_error_t *e, const char *ph) {
  const int peer = e->peer;
  const uint64_t about[4] = {e->about[0], e->about[1], e->about[2], e->about[3]};
  if (e->status == EPX_ERR_CONFIG_MISMATCH) {
    const int word = (int)((e->detail >> 8) & 1);
    epxi_stamp_t s0 = stamp_from(about[0], about[1]), sp = s0;
    s0.digest[word] = about[2];
    sp.digest[word] = about[3];
    return epxi_stamp_mismatch(&s0, 0, &sp, peer, c->rank);
  }
  const epxi_stamp_t s0 = stamp_from(about[0], about[1]), sp = stamp_from(about[2], about[3]);
  char call0[96], callp[96];
  epxi_stamp_describe(&s0, call0, sizeof call0);
  epxi_stamp_describe(&sp, callp, sizeof callp);
  return epxi_fail(EPX_ERR_OUT_OF_STEP,
                   "rank %d: %s: the ranks are out of step: rank 0 is in %s at its %s exchange, rank %d in %s at its "
                   "%s exchange; the comm is broken: destroy and re-create it",
                   c->rank, ph, call0, phase_name(e->ref_phase), peer, callp, phase_name(e->peer_phase));
}

/* Turns this rank's error word into a status and message. Fatal ones only, unless `all`. */
epx_status_t report(epx_comm_t *c, bool all) {
  cuda_world_t *cw = c->world->impl;
  volatile epxc_error_t *e = &cw->errors_host[c->rank];
  int status = e->status;
  if (!status) return EPX_SUCCESS;
  bool fatal = fatal_status(status);
  if (!fatal && !all) return EPX_SUCCESS;
  const int phase = e->phase, peer = e->peer;
  const long long detail = (long long)e->detail;
  const char *ph = phase_name(phase);
  /* The rank a fatal failure started at: the one waited for, or, when this rank stopped
   * because a peer failed first, whatever that peer stopped on, and so on. */
  int root = peer;
  for (int hops = 0; fatal && hops < c->nranks && root >= 0 && root < c->nranks && root != c->rank; hops++) {
    if (cw->shared && epxi_group_peer_lost(c->world->group, root)) break;
    const volatile epxc_error_t *pe = &cw->errors_host[root];
    if ((pe->status != EPX_ERR_BROKEN && pe->status != EPX_ERR_TIMEOUT) || pe->peer == root) break;
    root = pe->peer;
  }
  epx_status_t s;
  if (fatal && root >= 0 && root < c->nranks && abort_record(&cw->errors_host[root]) && root == c->rank)
    s = epxi_fail(EPX_ERR_BROKEN, "ABORTED: rank %d aborted the comm (epx_comm_abort)", root);
  else if (fatal && root >= 0 && root < c->nranks && abort_record(&cw->errors_host[root]))
    s = epxi_fail(EPX_ERR_BROKEN, "ABORTED: rank %d aborted the comm (epx_comm_abort); rank %d's %s stopped", root,
                  c->rank, phase == EPXC_PHASE_ABORTED ? "call" : ph);
  else if (fatal && cw->shared && root != c->rank && epxi_group_peer_lost(c->world->group, root))
    s = epxi_fail(EPX_ERR_PEER_LOST, "rank %d: %s stopped: rank %d's process is gone (it died or left the group)",
                  c->rank, ph, root);
  else if (status == EPX_ERR_OUT_OF_STEP || (status == EPX_ERR_CONFIG_MISMATCH && e->about[0]))
    s = report_stamps(c, e, ph); /* about[0] = 0: a peer posted the status, it has no stamps */
  else if (status == EPX_ERR_TIMEOUT)
    s = epxi_fail(EPX_ERR_TIMEOUT, "rank %d: %s timed out after %lld ms waiting for rank %d", c->rank, ph, detail, peer);
  else if (status == EPX_ERR_BROKEN && fatal && root == c->rank && peer != c->rank && peer >= 0 && peer < c->nranks)
    s = epxi_fail(EPX_ERR_BROKEN, "rank %d: %s stopped: rank %d gave up waiting for this rank (%s) before it arrived; "
                  "the comm is broken: destroy and re-create it", c->rank, ph, peer,
                  epx_status_string((epx_status_t)cw->errors_host[peer].status));
  else if (status == EPX_ERR_BROKEN && root != peer && root >= 0 && root < c->nranks)
    s = epxi_fail(EPX_ERR_BROKEN, "rank %d: %s stopped: rank %d failed first (it stopped on rank %d: %s)", c->rank, ph,
                  peer, root, epx_status_string((epx_status_t)cw->errors_host[root].status));
  else if (status == EPX_ERR_BROKEN)
    s = epxi_fail(EPX_ERR_BROKEN, "rank %d: %s stopped: rank %d failed first (%s)", c->rank, ph, peer,
                  epx_status_string((epx_status_t)detail));
  else if (status == EPX_ERR_OUTPUT_TOO_SMALL)
    s = epxi_fail(EPX_ERR_OUTPUT_TOO_SMALL, "rank %d: %s: %lld rows arrive but recv_capacity is smaller; nothing written",
                  c->rank, ph, detail);
  else
    s = epxi_fail((epx_status_t)status, "rank %d: %s: rank %d failed (%s)", c->rank, ph, peer,
                  epx_status_string((epx_status_t)status));
  if (!fatal) e->status = 0; /* reported; the comm stays usable */
  return s;
}

epx_status_t cuda_poll(epx_comm_t *c) { return report(c, false); }

epx_status_t cuda_synchronize(epx_comm_t *c) {
  CUDA_TRY(cudaSetDevice(CC(c)->device), "cudaSetDevice");
  CUDA_TRY(wait_stream(c, stream_of(c)), "cudaStreamSynchronize");
  return report(c, true);
}

/* The caller returns this rank's failure with its own message: drop the device's record of
 * the same thing (the exchange recorded it as "rank r failed"), and nothing else. */
void forget_own_report(epx_comm_t *c, epx_status_t status, cudaStream_t st) {
  if (capturing(st)) return; /* the record then stays, for epx_comm_synchronize to report */
  wait_stream(c, st);
  volatile epxc_error_t *e = &((cuda_world_t *)c->world->impl)->errors_host[c->rank];
  if (e->status == (int32_t)status && e->peer == c->rank) e->status = 0;
}

/* ---- the watchdog's calls: any thread, never waiting ------------------------------------- */

/* Fields first, then the status, as the kernels read them (see mark_lost_peers). */
static void write_abort(volatile epxc_error_t *e, int rank) {
  e->phase = EPXC_PHASE_ABORTED;
  e->peer = rank;
  e->detail = EPX_ERR_BROKEN;
  for (int i = 0; i < 4; i++) e->about[i] = 0;
  atomic_thread_fence(memory_order_seq_cst);
  e->status = EPX_ERR_BROKEN;
}

/* Ends the group's host waits, then records the abort in every rank's error word that holds
 * no fatal record yet: a device wait polls only the word of the rank it waits for, so every
 * word must say it for every wait on every rank to end (across processes the words are the
 * group's shared page). This rank's first, so that a report that follows any other word
 * finds the cause. No CUDA call: another thread may be inside wait_stream on this comm. */
epx_status_t cuda_comm_abort(epx_comm_t *c) {
  EPX_CHECK(epxi_comm_abort_group(c));
  volatile epxc_error_t *words = ((cuda_world_t *)c->world->impl)->errors_host;
  if (!fatal_status(words[c->rank].status)) write_abort(&words[c->rank], c->rank);
  for (int r = 0; r < c->nranks; r++)
    if (r != c->rank && !fatal_status(words[r].status)) write_abort(&words[r], c->rank);
  return EPX_SUCCESS;
}

/* report()'s message without its leading "rank r: " (the caller adds it). */
static const char *without_rank(const char *msg, int rank) {
  char prefix[32];
  const int n = snprintf(prefix, sizeof prefix, "rank %d: ", rank);
  return strncmp(msg, prefix, (size_t)n) == 0 ? msg + n : msg;
}

/* This rank's fatal device record (report() only reads one: it clears recoverable ones
 * alone), else the group's failure or lost peer. No stream wait, no comm lock. */
epx_status_t cuda_async_error(epx_comm_t *c, char *why, size_t size) {
  const volatile epxc_error_t *mine = &((cuda_world_t *)c->world->impl)->errors_host[c->rank];
  if (fatal_status(mine->status)) {
    const epx_status_t s = report(c, false);
    if (s != EPX_SUCCESS) {
      snprintf(why, size, "%s", without_rank(epx_last_error(), c->rank));
      return s;
    }
  }
  return epxi_comm_group_error(c, why, size);
}
