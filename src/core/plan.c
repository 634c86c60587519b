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

int64_t epxi_budget_keep(const epxi_counts_t *c, int d, int align, int64_t budget, int32_t *kept) {
  const int L = c->num_local, R = c->nranks;
  int64_t used = 0, dropped = 0;
  for (int l = 0; l < L; l++) {
    int64_t want = epxi_expert_pairs(c, d, l), keep = want;
    if (budget > 0) {
      int64_t room = budget - used > 0 ? (budget - used) / align * align : 0;
      keep = want < room ? want : room;
    }
    used += epxi_round_up(keep, align);
    dropped += want - keep;
    /* the first `keep` pairs in (source rank, source token) order stay */
    for (int s = 0; s < R; s++) {
      int64_t base = epxi_expert_source_base(c, d, l, s), n = c->pair[s * c->num_experts + d * L + l];
      int64_t k = keep - base;
      kept[s * L + l] = (int32_t)(k <= 0 ? 0 : k < n ? k : n);
    }
  }
  return dropped;
}

void epxi_expert_blocks(const epxi_counts_t *c, int d, int align, int64_t *block) {
  block[0] = 0;
  for (int l = 0; l < c->num_local; l++) block[l + 1] = block[l] + epxi_round_up(epxi_expert_pairs(c, d, l), align);
}
