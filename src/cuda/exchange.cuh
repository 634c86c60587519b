/* The exchange, as a block-level function: the one-block exchange kernel runs it, and the
 * low-latency kernels run it from their first block. Thread r < nranks talks to rank r.
 *
 * Every rank posts its words to every peer's mailbox, then waits (bounded) for every peer's.
 * Mailboxes are double-buffered by the parity of the exchange's epoch: a rank can be at most
 * one exchange ahead of any peer (it cannot finish exchange e + 1 before every peer posted
 * e + 1, which each does only after finishing e), so parity e & 1 is never overwritten while a
 * slow peer still reads it. */
#ifndef EPX_CUDA_EXCHANGE_CUH
#define EPX_CUDA_EXCHANGE_CUH

#include "cuda/common.cuh"

/* Build with -DEPX_EXCHANGE_TRACE to have every exchange of rank 0 print when each of its steps
 * ended (trace.cuh): where an exchange's microseconds go once its peers have posted. A flag of
 * its own: its printf inside a kernel would shift that kernel's own trace marks. */
#ifdef EPX_EXCHANGE_TRACE
#include "cuda/trace.cuh"
#define EX_TRACE_DECL epxc_trace_t ex_trace_ = {{0}, 0}
#define EX_TRACE() trace_mark(&ex_trace_, threadIdx.x == 0)
#define EX_TRACE_PRINT(what) trace_print(&ex_trace_, threadIdx.x == 0 && g->rank == 0, "extrace " what, phase)
#else
#define EX_TRACE_DECL
#define EX_TRACE() EPXC_NO_TRACE
#define EX_TRACE_PRINT(what) EPXC_NO_TRACE
#endif

static_assert(sizeof(epxc_slot_t) == sizeof(uint64_t) * (1 + EPXC_SLOT_WORDS), "a mailbox is a flag and its words");
static_assert(sizeof(epxc_words_t) == sizeof(uint64_t) * EPXC_PAYLOAD_WORDS, "every kind of words fits a slot");

/* Posts this rank's words and the stamp of the call it opens (all zero: none) to every peer
 * as exchange `epoch` (0: this rank stopped earlier, nothing is posted). Call from every
 * thread of one block; the caller knows the epoch (next_epoch reads it, a low-latency
 * kernel read it at its start: nothing else on its stream moves it meanwhile). The stamp
 * comes by value: a kernel parameter whose address is taken is copied to local memory first. */
static __device__ uint64_t exchange_post(const epxc_group_t *g, int phase, const epxc_words_t *words,
                                         const epxc_stamp_t stamp, uint64_t epoch) {
  EX_TRACE_DECL;
  EX_TRACE();
  const int r = threadIdx.x;
  if (epoch && r == 0) g->state[g->rank]->seq = epoch;
  if (epoch && r < g->nranks) {
    /* the stamp and the phase tag: ranks that disagree on where they are fail loudly */
    epxc_slot_t *slot = &g->state[r]->post[epoch & 1][g->rank];
    for (int i = 0; i < EPXC_PAYLOAD_WORDS; i++) slot->words.word[i] = words->word[i];
    for (int i = 0; i < EPXC_STAMP_WORDS; i++) slot->stamp.word[i] = stamp.word[i];
    slot->phase_tag = EPXC_PHASE_TAG + (uint64_t)phase;
    st_release(&slot->flag, epoch);
  }
  __syncthreads();
  EX_TRACE(); /* 1: posted */
  EX_TRACE_PRINT("exchange_post posted");
  return epoch;
}

/* This rank's next exchange epoch, or 0 when it stopped earlier (its state as thread 0 reads
 * it now). Every thread of the block gets it. */
static __device__ uint64_t next_epoch(const epxc_group_t *g) {
  const epxc_state_t *me = g->state[g->rank];
  __shared__ uint64_t ex_epoch;
  if (threadIdx.x == 0) ex_epoch = me->aborted ? 0 : me->seq + 1;
  __syncthreads();
  return ex_epoch;
}

/* Records a difference between rank 0's post and rank q's (see epxc_error_t.about): the phase
 * tag or stamp words 0, 1 (EPX_ERR_OUT_OF_STEP), or the digest (EPX_ERR_CONFIG_MISMATCH). */
static __device__ __noinline__ void record_stamp_error(const epxc_group_t *g, int status, int phase, int q,
                                                       const uint64_t *tag, const epxc_stamp_t *stamp) {
  epxc_error_t *e = claim_error(g, status);
  if (!e) return;
  const epxc_stamp_t *a = &stamp[0], *b = &stamp[q];
  e->phase = phase;
  e->peer = q;
  e->ref_phase = (int16_t)(tag[0] - EPXC_PHASE_TAG);
  e->peer_phase = (int16_t)(tag[q] - EPXC_PHASE_TAG);
  e->about[0] = a->word[0];
  e->about[1] = a->word[1];
  if (status == EPX_ERR_OUT_OF_STEP) {
    e->detail = 0;
    e->about[2] = b->word[0];
    e->about[3] = b->word[1];
  } else {
    const int w = a->word[2] != b->word[2] ? 0 : 1; /* the first digest word that differs */
    const uint64_t x = a->word[2 + w] ^ b->word[2 + w];
    e->detail = ((int64_t)w << 8) | (int64_t)(__ffsll((long long)x) - 1);
    e->about[2] = a->word[2 + w];
    e->about[3] = b->word[2 + w];
  }
  __threadfence_system();
}

/* ---- a late rank: the verdicts ---------------------------------------------------------- */

/* This rank's wait on exchange `epoch` ran out (`late`: this thread's peer is one it waited
 * for): it tells every peer that it is deciding, looks at the late ranks' flags once more,
 * then tells every peer whether it gave up (and records the timeout). The fence pairs with
 * the one a poster makes between its post and its reading of the verdicts (exchange_wait):
 * a late rank is either seen here after all, or it sees this rank deciding and waits for the
 * verdict; so no rank passes an exchange that a peer gave up on. (A third rank that sees the
 * late rank's post to it might still read this verdict a few hundred nanoseconds before it is
 * written; framed operations then stop it at their closing exchange.) Call from every thread
 * of one block. Returns whether every late rank arrived after all. */
static __device__ bool give_up_or_not(const epxc_group_t *g, uint64_t epoch, int phase, bool late) {
  epxc_state_t *me = g->state[g->rank];
  const int R = g->nranks, r = threadIdx.x;
  __shared__ int gu_missing; /* the lowest rank still missing */
  if (r == 0) gu_missing = R;
  __syncthreads();
  uint64_t *verdict = r < R && r != g->rank ? &g->state[r]->post[epoch & 1][g->rank].verdict : NULL;
  if (verdict) st_release(verdict, EPXC_VERDICT(epoch, EPXC_VERDICT_DECIDING));
  fence_sc();
  if (late && ld_acquire(&me->post[epoch & 1][r].flag) < epoch) atomicMin(&gu_missing, r);
  __syncthreads();
  const bool arrived = gu_missing == R;
  if (verdict) st_release(verdict, EPXC_VERDICT(epoch, arrived ? EPXC_VERDICT_DONE : EPXC_VERDICT_GAVE_UP));
  if (!arrived && r == 0) record_error(g, EPX_ERR_TIMEOUT, phase, gu_missing, (int64_t)(g->timeout_ns / 1000000));
  __syncthreads();
  return arrived;
}

/* Peer r's verdict on exchange `epoch`, whose post has arrived (v: the verdict as read with
 * the post): false (recorded) when it gave up on it, having waited for this rank past the
 * timeout. A deciding peer takes a few loads; one whose record turns fatal meanwhile has
 * stopped. */
static __device__ bool peer_kept(const epxc_group_t *g, const volatile epxc_slot_t *in, uint64_t v, uint64_t epoch,
                                 int r, int phase) {
  const uint64_t deciding = EPXC_VERDICT(epoch, EPXC_VERDICT_DECIDING);
  const uint64_t gave_up = EPXC_VERDICT(epoch, EPXC_VERDICT_GAVE_UP);
  const volatile epxc_error_t *peer_err = &g->errors[r];
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 0; v == deciding; spin++) {
    if ((spin & EPXC_POLL_MASK) == EPXC_POLL_MASK &&
        (fatal_status(peer_err->status) || globaltimer_ns() - start > g->timeout_ns))
      v = gave_up;
    else
      v = in->verdict;
  }
  if (v != gave_up) return true;
  record_error(g, EPX_ERR_BROKEN, phase, r, EPX_ERR_TIMEOUT);
  return false;
}

/* ---- the wait ------------------------------------------------------------------------------ */

/* What a wait hands the thread that runs it, in registers: the group's status (EPX_ERR_BROKEN
 * when this rank stopped) to thread 0 and, when the wait returns true, rank r's words to thread
 * r < nranks. The same words and status land in this rank's state (got, aborted, group_status)
 * for later kernels; a caller that goes on in the same block reads them here, a round trip
 * sooner. */
typedef struct {
  epxc_words_t words;
  int32_t status;
} epxc_met_t;

/* Thread r < R compares rank r's post with rank 0's: the lowest rank whose phase tag, call
 * number or operation differs (ex_step), else whose handle differs (ex_handle), else whose
 * digest differs (ex_differ). */
static __device__ void compare_posts(const uint64_t *tag, const epxc_stamp_t *stamp, int R, int *step, int *handle,
                                     int *differ) {
  const int r = threadIdx.x;
  if (r >= R) return;
  const epxc_stamp_t *a = &stamp[0], *b = &stamp[r];
  const uint64_t word1 = a->word[1] ^ b->word[1], handle_bits = 0xffffffffull;
  if (tag[r] != tag[0] || b->word[0] != a->word[0] || (word1 & ~handle_bits))
    atomicMin(step, r);
  else if (word1 & handle_bits)
    atomicMin(handle, r);
  else if (b->word[2] != a->word[2] || b->word[3] != a->word[3])
    atomicMin(differ, r);
}

/* Waits (bounded) for every peer's post of exchange `epoch`; the payloads land in state->got.
 * Every rank compares every post with rank 0's, so every rank reaches the same verdict: a
 * phase tag, or a stamp's call number or operation that differs stops this rank
 * (EPX_ERR_OUT_OF_STEP); otherwise group_status gets the first failure any rank reported in
 * its status word (a rank that refused its call posts it whatever handle it had, as the host
 * backend's comparison does); otherwise a handle that differs stops this rank too
 * (EPX_ERR_OUT_OF_STEP), and digests that differ give EPX_ERR_CONFIG_MISMATCH. A wait that
 * runs out decides with its peers whether the late ranks count (give_up_or_not), and a post
 * whose poster gave up on this exchange fails this rank. Call from every thread of one block.
 * Returns false when this rank must stop; met (see epxc_met_t) may be NULL. */
static __device__ bool exchange_wait(const epxc_group_t *g, int phase, uint64_t epoch, epxc_met_t *met) {
  EX_TRACE_DECL;
  EX_TRACE();
  epxc_state_t *me = g->state[g->rank];
  __shared__ int ex_failed, ex_late;
  __shared__ int ex_step, ex_handle, ex_differ; /* see compare_posts */
  __shared__ uint64_t ex_tag[EPX_MAX_RANKS];
  __shared__ int32_t ex_status[EPX_MAX_RANKS]; /* each post's status word, for thread 0's look below */
  __shared__ epxc_stamp_t ex_stamp[EPX_MAX_RANKS];
  const int R = g->nranks, r = threadIdx.x;
  if (r == 0) {
    ex_failed = epoch == 0;
    ex_late = 0;
    ex_step = ex_handle = ex_differ = R;
  }
  if (met && r == 0) met->status = EPX_ERR_BROKEN;
  __syncthreads();
  if (!epoch) return false;
  /* Threads past R point at slot 0 and never use it: never a null pointer, which nvcc 13.0
   * (sm_90) was seen to load from when the test was on the pointer itself. */
  const bool mine = r < R;
  volatile epxc_slot_t *in = &me->post[epoch & 1][mine ? r : 0];
  int got = WAIT_ARRIVED;
  if (mine) {
    fence_sc(); /* this rank's post before its reading of the verdicts (see give_up_or_not) */
    EX_TRACE(); /* 1: thread 0 fenced */
    got = wait_flag(g, (const uint64_t *)&in->flag, epoch, r, phase);
    if (got == WAIT_FAILED) ex_failed = 1;
    if (got == WAIT_LATE) ex_late = 1;
  }
  __syncthreads();
  EX_TRACE(); /* 2: every flag seen */
  const bool failed = ex_failed, late = ex_late; /* read before any thread writes ex_failed again */
  const bool ok = !failed && (!late || give_up_or_not(g, epoch, phase, got == WAIT_LATE));
  if (mine && ok) {
    /* the whole post and the verdict in one round trip: every load issued before any is used */
    epxc_words_t words;
    epxc_stamp_t stamp;
#pragma unroll
    for (int i = 0; i < EPXC_PAYLOAD_WORDS; i++) words.word[i] = in->words.word[i];
#pragma unroll
    for (int i = 0; i < EPXC_STAMP_WORDS; i++) stamp.word[i] = in->stamp.word[i];
    const uint64_t tag = in->phase_tag, verdict = in->verdict;
    if (r != g->rank && !peer_kept(g, in, verdict, epoch, r, phase)) ex_failed = 1;
    ex_tag[r] = tag;
    ex_stamp[r] = stamp;
    ex_status[r] = (int32_t)words.status;
    me->got[r] = words;
    if (met) met->words = words;
  }
  if (!ok && r == 0) ex_failed = 1;
  __syncthreads();
  EX_TRACE(); /* 3: posts read */
  if (!ex_failed) compare_posts(ex_tag, ex_stamp, R, &ex_step, &ex_handle, &ex_differ);
  __syncthreads();
  EX_TRACE(); /* 4: compared */
  if (r == 0) {
    if (!ex_failed && ex_step < R) {
      record_stamp_error(g, EPX_ERR_OUT_OF_STEP, phase, ex_step, ex_tag, ex_stamp);
      ex_failed = 1;
    }
    int status = 0, who = -1;
    for (int q = 0; q < R && !status && !ex_failed; q++)
      if (ex_status[q] != 0) status = ex_status[q], who = q;
    if (status) {
      record_error(g, status, phase, who, 0);
    } else if (!ex_failed && ex_handle < R) {
      record_stamp_error(g, EPX_ERR_OUT_OF_STEP, phase, ex_handle, ex_tag, ex_stamp);
      ex_failed = 1;
    } else if (!ex_failed && ex_differ < R) {
      status = EPX_ERR_CONFIG_MISMATCH;
      record_stamp_error(g, status, phase, ex_differ, ex_tag, ex_stamp);
    }
    if (ex_failed)
      me->aborted = 1;
    else
      me->group_status = status;
    if (met && !ex_failed) met->status = status;
    __threadfence();
  }
  EX_TRACE(); /* 5: thread 0 decided */
  __syncthreads();
  EX_TRACE(); /* 6: done */
  EX_TRACE_PRINT("exchange_wait fenced flags read compared decided done");
  return !ex_failed;
}

/* A whole exchange, `epoch` as next_epoch gives it (a caller may read it sooner, beside other
 * loads). Out of line: with two copies of it inlined in one kernel (notify's, when it still
 * closed with a second exchange; nvcc 13.0, sm_90) threads past nranks loaded a mailbox flag
 * at address 0 in the second (found with compute-sanitizer); a call per exchange costs nothing
 * next to its wait. A kernel that calls it takes its group as a __grid_constant__ parameter:
 * passing the address of a plain one makes every thread copy the 1 KB group to local memory
 * first. */
static __device__ __noinline__ bool exchange_block(const epxc_group_t *g, int phase, const epxc_words_t *words,
                                                   const epxc_stamp_t stamp, uint64_t epoch, epxc_met_t *met) {
  return exchange_wait(g, phase, exchange_post(g, phase, words, stamp, epoch), met);
}

#endif
