/* The stamp of a collective call: what each rank tells its peers in a call's first exchange
 * so that a call can only pair with the same call of every peer (internal.h explains the
 * words). Backend-independent: the host backend gathers stamps through its group, a device
 * exchange can carry the four words as they are. */
#include <stdio.h>
#include <string.h>

#include "core/internal.h"

/* ---- packing --------------------------------------------------------------------------- */

/* One field of a digest word: its name, its bits, and how to print it. */
typedef enum { FIELD_INT, FIELD_DTYPE, FIELD_BOOL } field_kind_t;
typedef struct {
  const char *name;
  int word, shift, bits;
  field_kind_t kind;
} stamp_field_t;

/* digest[0]: the handle's settings; digest[1]: the call's own arguments. Dtypes take 4 bits
 * (value + 1, so that 0 means "not part of this call"). */
static const stamp_field_t fields[] = {
    {"handle align", 0, 0, 32, FIELD_INT},
    {"handle algo", 0, 32, 4, FIELD_INT},
    {"handle layout", 0, 36, 2, FIELD_INT},
    {"handle exact", 0, 38, 1, FIELD_BOOL},
    {"part", 1, 0, 2, FIELD_INT},
    {"x_dtype", 1, 2, 4, FIELD_DTYPE},
    {"recv_dtype", 1, 6, 4, FIELD_DTYPE},
    {"y_dtype", 1, 10, 4, FIELD_DTYPE},
    {"out_dtype", 1, 14, 4, FIELD_DTYPE},
    {"weighted", 1, 18, 1, FIELD_BOOL},
    {"scale_by_probs", 1, 19, 1, FIELD_BOOL},
    {"recv_topk_idx given", 1, 20, 1, FIELD_BOOL},
    {"recv_topk_weights given", 1, 21, 1, FIELD_BOOL},
    {"recv_probs given", 1, 22, 1, FIELD_BOOL},
    {"tokens_per_local_expert given", 1, 23, 1, FIELD_BOOL},
    {"num_recv_rows given", 1, 24, 1, FIELD_BOOL},
    {"row_probs given", 1, 25, 1, FIELD_BOOL},
    {"row_weight_grad given", 1, 26, 1, FIELD_BOOL},
};
enum { F_ALIGN, F_ALGO, F_LAYOUT, F_EXACT, F_PART, F_X, F_RECV, F_Y, F_OUT, F_WEIGHTED, F_SCALE, F_RIDX, F_RW,
       F_RPROBS, F_CNT, F_NROWS, F_ROWPROBS, F_WGRAD };

static uint64_t field_mask(const stamp_field_t *f) { return f->bits == 64 ? ~0ull : ((1ull << f->bits) - 1); }

static void put(epxi_stamp_t *s, int id, uint64_t v) {
  const stamp_field_t *f = &fields[id];
  s->digest[f->word] |= (v & field_mask(f)) << f->shift;
}

static uint64_t get(const epxi_stamp_t *s, const stamp_field_t *f) { return (s->digest[f->word] >> f->shift) & field_mask(f); }

static uint64_t dtype_code(epx_dtype_t t) { return (uint64_t)((unsigned)t + 1u) & 15u; }

epxi_stamp_t epxi_stamp_make(epxi_op_t op, uint64_t call, const epx_handle_t *handle) {
  epxi_stamp_t s;
  memset(&s, 0, sizeof s);
  s.call = call;
  s.op = (uint16_t)op;
  if (!handle) return s;
  s.handle = (uint32_t)handle->id;
  put(&s, F_ALIGN, (uint32_t)handle->hc.align);
  put(&s, F_ALGO, (uint64_t)handle->hc.algo);
  put(&s, F_LAYOUT, (uint64_t)handle->hc.layout);
  put(&s, F_EXACT, handle->hc.exact != 0);
  return s;
}

/* COMPLETE reads nothing but its part: the arguments were SEND's. */
void epxi_stamp_dispatch(epxi_stamp_t *s, const epx_dispatch_args_t *a) {
  if (!a) return;
  put(s, F_PART, (uint64_t)a->part);
  if (a->part == EPX_PART_COMPLETE) return;
  put(s, F_X, dtype_code(a->x_dtype));
  put(s, F_RECV, dtype_code(a->recv_dtype));
  put(s, F_SCALE, a->scale_by_probs != 0);
  put(s, F_RIDX, a->recv_topk_idx != NULL);
  put(s, F_RW, a->recv_topk_weights != NULL);
  put(s, F_RPROBS, a->recv_probs != NULL);
  put(s, F_CNT, a->tokens_per_local_expert != NULL);
  put(s, F_NROWS, a->num_recv_rows != NULL);
}

void epxi_stamp_combine(epxi_stamp_t *s, const epx_combine_args_t *a) {
  if (!a) return;
  put(s, F_PART, (uint64_t)a->part);
  if (a->part == EPX_PART_COMPLETE) return;
  put(s, F_Y, dtype_code(a->y_dtype));
  put(s, F_OUT, dtype_code(a->out_dtype));
  put(s, F_WEIGHTED, a->weighted != 0);
  put(s, F_ROWPROBS, a->row_probs != NULL);
  put(s, F_WGRAD, a->row_weight_grad != NULL);
}

epx_part_t epxi_stamp_part(const epxi_stamp_t *s) { return (epx_part_t)get(s, &fields[F_PART]); }

const char *epxi_stamp_field(int word, int bit) {
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
    if (fields[i].word == word && bit >= fields[i].shift && bit < fields[i].shift + fields[i].bits) return fields[i].name;
  return "an unknown field";
}

/* ---- comparing ------------------------------------------------------------------------- */

const char *epxi_op_name(epxi_op_t op) {
  switch (op) {
    case EPXI_OP_NOTIFY: return "epx_notify";
    case EPXI_OP_DISPATCH: return "epx_dispatch";
    case EPXI_OP_NOTIFY_DISPATCH: return "epx_dispatch with a routing";
    case EPXI_OP_COMBINE: return "epx_combine";
  }
  return "an unknown operation";
}

/* "epx_combine (call 7, handle 2)" */
void epxi_stamp_describe(const epxi_stamp_t *s, char *buf, size_t n) {
  if (!s->call)
    snprintf(buf, n, "no collective call's opening exchange");
  else if (s->handle)
    snprintf(buf, n, "%s (call %llu, handle %u)", epxi_op_name((epxi_op_t)s->op), (unsigned long long)s->call,
             (unsigned)s->handle);
  else
    snprintf(buf, n, "%s (call %llu, no valid handle)", epxi_op_name((epxi_op_t)s->op), (unsigned long long)s->call);
}

static void describe_value(const stamp_field_t *f, uint64_t v, char *buf, size_t n) {
  if (f->kind == FIELD_DTYPE)
    snprintf(buf, n, "%s", v == 0 ? "none" : epx_dtype_name((epx_dtype_t)(v - 1)));
  else if (f->kind == FIELD_BOOL)
    snprintf(buf, n, "%s", v ? "yes" : "no");
  else
    snprintf(buf, n, "%llu", (unsigned long long)v);
}

epx_status_t epxi_stamp_mismatch(const epxi_stamp_t *s0, int r0, const epxi_stamp_t *sr, int r, int me) {
  char call0[96], callr[96], v0[32], vr[32];
  epxi_stamp_describe(s0, call0, sizeof call0);
  epxi_stamp_describe(sr, callr, sizeof callr);
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    const stamp_field_t *f = &fields[i];
    if (get(s0, f) == get(sr, f)) continue;
    describe_value(f, get(s0, f), v0, sizeof v0);
    describe_value(f, get(sr, f), vr, sizeof vr);
    return epxi_fail(EPX_ERR_CONFIG_MISMATCH,
                     "rank %d: the ranks' calls differ in '%s': %s on rank %d in %s, %s on rank %d in %s", me, f->name,
                     v0, r0, call0, vr, r, callr);
  }
  return epxi_fail(EPX_ERR_INTERNAL, "rank %d: stamps of ranks %d and %d differ in no known field", me, r0, r);
}

epx_status_t epxi_stamp_compare(const epxi_stamp_t *all, int nranks, int me, const char *phase) {
  /* A rank that refused its arguments: it keeps its own message, its peers learn who. */
  for (int r = 0; r < nranks; r++) {
    if (all[r].status == EPX_SUCCESS) continue;
    if (r == me) return (epx_status_t)all[r].status;
    char call[96];
    epxi_stamp_describe(&all[r], call, sizeof call);
    return epxi_fail((epx_status_t)all[r].status, "%s on rank %d: rank %d failed %s (%s)", phase, me, r, call,
                     epx_status_string((epx_status_t)all[r].status));
  }
  for (int r = 1; r < nranks; r++) {
    if (all[r].op == all[0].op && all[r].call == all[0].call && all[r].handle == all[0].handle) continue;
    char call0[96], callr[96];
    epxi_stamp_describe(&all[0], call0, sizeof call0);
    epxi_stamp_describe(&all[r], callr, sizeof callr);
    return epxi_fail(EPX_ERR_OUT_OF_STEP, "%s on rank %d: the ranks are out of step: rank 0 is in %s, rank %d in %s",
                     phase, me, call0, r, callr);
  }
  for (int r = 1; r < nranks; r++)
    if (memcmp(all[r].digest, all[0].digest, sizeof all[0].digest) != 0)
      return epxi_stamp_mismatch(&all[0], 0, &all[r], r, me);
  return EPX_SUCCESS;
}
