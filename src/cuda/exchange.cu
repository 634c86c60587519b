/* The exchange kernel: an exchange on its own, for the operations whose work kernels do not end
 * in one (dispatch and combine of the high-throughput and all-to-all paths). */
#include "cuda/exchange.cuh"

static __global__ void exchange_kernel(const __grid_constant__ epxc_group_t g, int phase, epxc_words_t words,
                                       epxc_stamp_t stamp, const int32_t *status_dev) {
  if (status_dev) words.status = (uint64_t)(uint32_t)*status_dev;
  exchange_block(&g, phase, &words, stamp, next_epoch(&g), NULL);
}

extern "C" int epxc_exchange(const epxc_group_t *g, int phase, const epxc_words_t *words, const int32_t *status_dev,
                             const epxc_stamp_t *stamp, void *stream) {
  epxc_words_t w;
  epxc_stamp_t sw;
  for (int i = 0; i < EPXC_PAYLOAD_WORDS; i++) w.word[i] = words ? words->word[i] : 0;
  for (int i = 0; i < EPXC_STAMP_WORDS; i++) sw.word[i] = stamp ? stamp->word[i] : 0;
  exchange_kernel<<<1, EPXC_EXCHANGE_THREADS, 0, (cudaStream_t)stream>>>(*g, phase, w, sw, status_dev);
  return (int)cudaGetLastError();
}

extern "C" int epxc_preload_exchange(size_t *stack) {
  const void *const kernels[] = {(const void *)exchange_kernel};
  return (int)preload_kernels(kernels, sizeof kernels / sizeof *kernels, stack);
}
