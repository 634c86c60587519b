/* The exchange: the only kernel that waits on peers. One block; thread r talks to rank r. */
#include "cuda/common.cuh"

typedef struct {
  uint64_t w[EPXC_SLOT_WORDS];
} words_t;

static __global__ void exchange_kernel(epxc_group_t g, int phase, words_t words, const int32_t *status_dev) {
  epxc_state_t *me = g.state[g.rank];
  __shared__ uint64_t epoch;
  __shared__ int stopped, failed;
  if (threadIdx.x == 0) {
    epoch = me->seq + 1;
    me->seq = epoch;
    stopped = me->aborted;
    failed = 0;
  }
  __syncthreads();
  if (stopped) return;
  if (status_dev) words.w[0] = (uint64_t)(uint32_t)*status_dev;
  const int p = (int)(epoch & 1), r = threadIdx.x;
  if (r < g.nranks) {
    epxc_slot_t *slot = &g.state[r]->post[p][g.rank];
    for (int i = 0; i < EPXC_SLOT_WORDS; i++) slot->word[i] = words.w[i];
    st_release(&slot->flag, epoch);
    volatile epxc_slot_t *in = &me->post[p][r];
    if (wait_flag(&g, (const uint64_t *)&in->flag, epoch, r, phase))
      for (int i = 0; i < EPXC_SLOT_WORDS; i++) me->got[r][i] = in->word[i];
    else
      failed = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (failed) {
      me->aborted = 1;
      return;
    }
    int status = 0, who = -1;
    for (int q = 0; q < g.nranks && !status; q++)
      if ((int32_t)me->got[q][0] != 0) status = (int32_t)me->got[q][0], who = q;
    me->group_status = status;
    if (status) record_error(&g, status, phase, who, 0);
    __threadfence();
  }
}

extern "C" int epxc_exchange(const epxc_group_t *g, int phase, const uint64_t *words, const int32_t *status_dev,
                             void *stream) {
  words_t w;
  for (int i = 0; i < EPXC_SLOT_WORDS; i++) w.w[i] = words ? words[i] : 0;
  exchange_kernel<<<1, 64, 0, (cudaStream_t)stream>>>(*g, phase, w, status_dev);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_exchange(void) {
  struct cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)exchange_kernel);
  return (int)e;
}
