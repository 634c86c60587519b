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

static_assert(sizeof(epxc_slot_t) == sizeof(uint64_t) * (1 + EPXC_SLOT_WORDS), "a mailbox is a flag and its words");
static_assert(sizeof(epxc_words_t) == sizeof(uint64_t) * EPXC_PAYLOAD_WORDS, "every kind of words fits a slot");

/* Posts this rank's words and the stamp of the call it opens (all zero: none) to every peer.
 * Call from every thread of one block. Returns the exchange's epoch, or 0 when this rank
 * stopped earlier. The stamp comes by value: a kernel parameter whose address is taken is
 * copied to local memory first. */
static __device__ uint64_t exchange_post(const epxc_group_t *g, int phase, const epxc_words_t *words,
                                         const epxc_stamp_t stamp) {
  epxc_state_t *me = g->state[g->rank];
  __shared__ uint64_t ex_epoch;
  if (threadIdx.x == 0) {
    ex_epoch = me->aborted ? 0 : me->seq + 1;
    if (ex_epoch) me->seq = ex_epoch;
  }
  __syncthreads();
  const uint64_t epoch = ex_epoch;
  const int r = threadIdx.x;
  if (epoch && r < g->nranks) {
    /* the stamp and the phase tag: ranks that disagree on where they are fail loudly */
    epxc_slot_t *slot = &g->state[r]->post[epoch & 1][g->rank];
    for (int i = 0; i < EPXC_PAYLOAD_WORDS; i++) slot->words.word[i] = words->word[i];
    for (int i = 0; i < EPXC_STAMP_WORDS; i++) slot->stamp.word[i] = stamp.word[i];
    slot->phase_tag = EPXC_PHASE_TAG + (uint64_t)phase;
    st_release(&slot->flag, epoch);
  }
  __syncthreads();
  return epoch;
}

/* Records a difference between rank 0's post and rank q's (see epxc_error_t.about): the phase
 * tag or stamp words 0, 1 (EPX_ERR_OUT_OF_STEP), or the digest (EPX_ERR_CONFIG_MISMATCH). */
static __device__ void record_stamp_error(const epxc_group_t *g, int status, int phase, int q, const uint64_t *tag,
                                          const epxc_stamp_t *stamp) {
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

/* Waits (bounded) for every peer's post of exchange `epoch`; the payloads land in state->got.
 * Every rank compares every post with rank 0's, so every rank reaches the same verdict: a
 * phase tag or a stamp's call, handle or operation that differs stops this rank
 * (EPX_ERR_OUT_OF_STEP); otherwise group_status gets the first failure any rank reported in
 * its status word, or EPX_ERR_CONFIG_MISMATCH when the stamps' digests differ. Call from every
 * thread of one block. Returns false when this rank must stop. */
static __device__ bool exchange_wait(const epxc_group_t *g, int phase, uint64_t epoch) {
  epxc_state_t *me = g->state[g->rank];
  __shared__ int ex_failed;
  __shared__ int ex_step, ex_differ; /* the lowest rank out of step with rank 0, whose digest differs */
  __shared__ uint64_t ex_tag[EPX_MAX_RANKS];
  __shared__ epxc_stamp_t ex_stamp[EPX_MAX_RANKS];
  const int R = g->nranks, r = threadIdx.x;
  if (r == 0) {
    ex_failed = epoch == 0;
    ex_step = ex_differ = R;
  }
  __syncthreads();
  if (!epoch) return false;
  if (r < R) {
    volatile epxc_slot_t *in = &me->post[epoch & 1][r];
    if (!wait_flag(g, (const uint64_t *)&in->flag, epoch, r, phase)) {
      ex_failed = 1;
    } else {
      ex_tag[r] = in->phase_tag;
      for (int i = 0; i < EPXC_STAMP_WORDS; i++) ex_stamp[r].word[i] = in->stamp.word[i];
      for (int i = 0; i < EPXC_PAYLOAD_WORDS; i++) me->got[r].word[i] = in->words.word[i];
    }
  }
  __syncthreads();
  if (r < R && !ex_failed) {
    const epxc_stamp_t *a = &ex_stamp[0], *b = &ex_stamp[r];
    if (ex_tag[r] != ex_tag[0] || b->word[0] != a->word[0] || b->word[1] != a->word[1])
      atomicMin(&ex_step, r);
    else if (b->word[2] != a->word[2] || b->word[3] != a->word[3])
      atomicMin(&ex_differ, r);
  }
  __syncthreads();
  if (r == 0) {
    if (!ex_failed && ex_step < R) {
      record_stamp_error(g, EPX_ERR_OUT_OF_STEP, phase, ex_step, ex_tag, ex_stamp);
      ex_failed = 1;
    }
    if (ex_failed) {
      me->aborted = 1;
    } else {
      int status = 0, who = -1;
      for (int q = 0; q < R && !status; q++)
        if ((int32_t)me->got[q].status != 0) status = (int32_t)me->got[q].status, who = q;
      if (status) {
        record_error(g, status, phase, who, 0);
      } else if (ex_differ < R) {
        status = EPX_ERR_CONFIG_MISMATCH;
        record_stamp_error(g, status, phase, ex_differ, ex_tag, ex_stamp);
      }
      me->group_status = status;
    }
    __threadfence();
  }
  __syncthreads();
  return !ex_failed;
}

static __device__ bool exchange_block(const epxc_group_t *g, int phase, const epxc_words_t *words,
                                      const epxc_stamp_t stamp) {
  return exchange_wait(g, phase, exchange_post(g, phase, words, stamp));
}

#endif
