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

/* Posts this rank's words to every peer. Call from every thread of one block. Returns the
 * exchange's epoch, or 0 when this rank stopped earlier. */
static __device__ uint64_t exchange_post(const epxc_group_t *g, int phase, const epxc_words_t *words) {
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
    /* the last word carries the phase: ranks that disagree on where they are fail loudly */
    epxc_slot_t *slot = &g->state[r]->post[epoch & 1][g->rank];
    for (int i = 0; i < EPXC_PAYLOAD_WORDS; i++) slot->words.word[i] = words->word[i];
    slot->phase_tag = EPXC_PHASE_TAG + (uint64_t)phase;
    st_release(&slot->flag, epoch);
  }
  __syncthreads();
  return epoch;
}

/* Waits (bounded) for every peer's post of exchange `epoch`; the payloads land in state->got,
 * group_status gets the first failure any rank reported in its status word. Call from every thread of
 * one block. Returns false when this rank must stop. */
static __device__ bool exchange_wait(const epxc_group_t *g, int phase, uint64_t epoch) {
  epxc_state_t *me = g->state[g->rank];
  __shared__ int ex_failed;
  if (threadIdx.x == 0) ex_failed = epoch == 0;
  __syncthreads();
  if (!epoch) return false;
  const int r = threadIdx.x;
  if (r < g->nranks) {
    volatile epxc_slot_t *in = &me->post[epoch & 1][r];
    if (!wait_flag(g, (const uint64_t *)&in->flag, epoch, r, phase)) {
      ex_failed = 1;
    } else if (in->phase_tag != EPXC_PHASE_TAG + (uint64_t)phase) {
      record_error(g, EPX_ERR_BROKEN, phase, r, (int64_t)(in->phase_tag - EPXC_PHASE_TAG));
      ex_failed = 1;
    } else {
      for (int i = 0; i < EPXC_PAYLOAD_WORDS; i++) me->got[r].word[i] = in->words.word[i];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (ex_failed) {
      me->aborted = 1;
    } else {
      int status = 0, who = -1;
      for (int q = 0; q < g->nranks && !status; q++)
        if ((int32_t)me->got[q].status != 0) status = (int32_t)me->got[q].status, who = q;
      me->group_status = status;
      if (status) record_error(g, status, phase, who, 0);
    }
    __threadfence();
  }
  __syncthreads();
  return !ex_failed;
}

static __device__ bool exchange_block(const epxc_group_t *g, int phase, const epxc_words_t *words) {
  return exchange_wait(g, phase, exchange_post(g, phase, words));
}

#endif
