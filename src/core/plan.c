/* Where rows land, from the counts every rank learns in notify. The host backend uses these
 * directly; the CUDA kernels compute the same sums on the device. */
#include "core/internal.h"

int64_t epxi_token_base(const epxi_counts_t *c, int d, int s) {
  int64_t n = 0;
  for (int q = 0; q < s; q++) n += c->tok[q * c->nranks + d];
  return n;
}

int64_t epxi_recv_tokens(const epxi_counts_t *c, int d) { return epxi_token_base(c, d, c->nranks); }

int64_t epxi_expert_source_base(const epxi_counts_t *c, int d, int l, int s) {
  int64_t n = 0;
  int e = d * c->num_local + l;
  for (int q = 0; q < s; q++) n += c->pair[q * c->num_experts + e];
  return n;
}

int64_t epxi_expert_pairs(const epxi_counts_t *c, int d, int l) {
  return epxi_expert_source_base(c, d, l, c->nranks);
}

void epxi_expert_blocks(const epxi_counts_t *c, int d, int align, int64_t *block) {
  block[0] = 0;
  for (int l = 0; l < c->num_local; l++) block[l + 1] = block[l] + epxi_round_up(epxi_expert_pairs(c, d, l), align);
}
