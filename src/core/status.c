/* Status strings, the thread-local last-error message, logging and environment knobs. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <pthread.h>

#include "core/internal.h"

static const char *const status_strings[EPX_NUM_STATUS] = {
    [EPX_SUCCESS] = "EPX_SUCCESS: no error",
    [EPX_ERR_INVALID_ARGUMENT] = "EPX_ERR_INVALID_ARGUMENT: an argument is out of its domain",
    [EPX_ERR_NULL_POINTER] = "EPX_ERR_NULL_POINTER: a required pointer is NULL",
    [EPX_ERR_EXPERT_OUT_OF_RANGE] = "EPX_ERR_EXPERT_OUT_OF_RANGE: an expert id is < -1 or >= num_experts",
    [EPX_ERR_EXPERTS_NOT_DIVISIBLE] = "EPX_ERR_EXPERTS_NOT_DIVISIBLE: num_experts is not a multiple of the group size",
    [EPX_ERR_TOPK_RANGE] = "EPX_ERR_TOPK_RANGE: topk out of range, or a routing row with more than topk experts",
    [EPX_ERR_HIDDEN_RANGE] = "EPX_ERR_HIDDEN_RANGE: hidden size out of range",
    [EPX_ERR_ROW_ALIGNMENT] = "EPX_ERR_ROW_ALIGNMENT: a row is not a multiple of 16 bytes, or its buffer not 16-byte aligned",
    [EPX_ERR_OUTPUT_TOO_SMALL] = "EPX_ERR_OUTPUT_TOO_SMALL: an output cannot hold what the operation writes",
    [EPX_ERR_LL_OVERFLOW] = "EPX_ERR_LL_OVERFLOW: more tokens than max_tokens_per_rank in low-latency mode",
    [EPX_ERR_CONFIG_MISMATCH] = "EPX_ERR_CONFIG_MISMATCH: ranks of one group passed different configs",
    [EPX_ERR_TIMEOUT] = "EPX_ERR_TIMEOUT: a peer did not arrive in time",
    [EPX_ERR_PEER_LOST] = "EPX_ERR_PEER_LOST: a peer left the group",
    [EPX_ERR_UNSUPPORTED] = "EPX_ERR_UNSUPPORTED: not available in this build or on this machine",
    [EPX_ERR_OUT_OF_MEMORY] = "EPX_ERR_OUT_OF_MEMORY: an allocation failed",
    [EPX_ERR_SYSTEM] = "EPX_ERR_SYSTEM: an operating-system call failed",
    [EPX_ERR_CUDA] = "EPX_ERR_CUDA: a CUDA call failed",
    [EPX_ERR_BROKEN] = "EPX_ERR_BROKEN: the comm is unusable after an earlier failure of the group",
    [EPX_ERR_INTERNAL] = "EPX_ERR_INTERNAL: internal error",
    [EPX_ERR_OUT_OF_STEP] = "EPX_ERR_OUT_OF_STEP: the ranks are in different collective calls",
    [EPX_ERR_BUSY] = "EPX_ERR_BUSY: the object is in use (another thread's call, or live comms or handles)",
};

const char *epx_status_string(epx_status_t status) {
  if ((int)status < 0 || status >= EPX_NUM_STATUS) return "EPX_ERR_UNKNOWN: not an epx status";
  return status_strings[status];
}

static _Thread_local char last_error[1024];

const char *epx_last_error(void) { return last_error; }

void epxi_clear_error(void) { last_error[0] = '\0'; }

epx_status_t epxi_fail(epx_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  EPX_INFO("%s (%s)", last_error, epx_status_string(status));
  return status;
}

/* ---- environment, read once --------------------------------------------------------- */

static epxi_env_t env;
static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static int env_int(const char *name, int fallback, int lo, int hi) {
  const char *v = getenv(name);
  if (!v || !*v) return fallback;
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || x < lo || x > hi) {
    fprintf(stderr, "epx WARN %s=%s is not an integer in [%d, %d]; using %d\n", name, v, lo, hi, fallback);
    return fallback;
  }
  return (int)x;
}

static void env_read(void) {
  env.timeout_ms = env_int("EPX_TIMEOUT_MS", 30000, 1, 86400000);
  env.num_sms = env_int("EPX_NUM_SMS", 16, 1, 1024);
  env.arena_mb = env_int("EPX_ARENA_MB", env_int("EPX_IPC_ARENA_MB", 0, 0, 1 << 22), 0, 1 << 22);
  env.ht_pipelined = env_int("EPX_HT_PIPELINED", 1, 0, 1);
  const char *d = getenv("EPX_DEBUG");
  env.log = EPXI_LOG_NONE;
  if (d && !strcasecmp(d, "WARN")) env.log = EPXI_LOG_WARN;
  if (d && !strcasecmp(d, "INFO")) env.log = EPXI_LOG_INFO;
}

const epxi_env_t *epxi_env(void) {
  pthread_once(&env_once, env_read);
  return &env;
}

void epxi_log(epxi_log_level_t level, const char *fmt, ...) {
  if (epxi_env()->log < level) return;
  char line[1200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "epx %s %s\n", level == EPXI_LOG_WARN ? "WARN" : "INFO", line);
}
