/* check — see check.h. */
#define _GNU_SOURCE
#include "check.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "data.h"
#include "rng.h"

typedef struct {
  atomic_long passed, failed;
} counters_t;

/* In a shared mapping once tu_begin ran (a forked process's checks count there too). */
static counters_t own_counters;
static counters_t *counters = &own_counters;
static atomic_long failed_here; /* this process's failures */
static char label[32];
static const char *test_name = "test";

void check_pass(void) { atomic_fetch_add(&counters->passed, 1); }

static void check_vfail(const char *file, int line, const char *cond, const char *fmt, va_list ap) {
  atomic_fetch_add(&failed_here, 1);
  long n = atomic_fetch_add(&counters->failed, 1);
  if (n >= CHECK_MAX_PRINTED) {
    if (n == CHECK_MAX_PRINTED) printf("(further failures are counted, not printed)\n");
    return;
  }
  char msg[2048];
  vsnprintf(msg, sizeof msg, fmt, ap);
  printf("%s%s%s%s:%d: CHECK(%s) failed: %s\n", label[0] ? "[" : "", label, label[0] ? "] " : "", file, line, cond,
         msg);
  fflush(stdout);
}

void check_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  check_vfail(file, line, cond, fmt, ap);
  va_end(ap);
}

int check_status_at(const char *file, int line, const char *expr, epx_status_t got, epx_status_t want,
                    const char *fmt, ...) {
  if (got == want) {
    check_pass();
    return 1;
  }
  char ctx[1024], cond[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  va_end(ap);
  snprintf(cond, sizeof cond, "%s == %s", expr, epx_status_string(want));
  check_fail(file, line, cond, "%s: got %s (this thread's last error: \"%s\")", ctx, epx_status_string(got), epx_last_error());
  return 0;
}

long check_failures(void) { return atomic_load(&failed_here); }
long check_failures_all(void) { return atomic_load(&counters->failed); }

static uint32_t elem_bits(epx_dtype_t t, const void *p, int64_t i) {
  switch (epx_dtype_size(t)) {
    case 1: return ((const uint8_t *)p)[i];
    case 2: return ((const uint16_t *)p)[i];
    default: return ((const uint32_t *)p)[i];
  }
}

static double elem_value(epx_dtype_t t, const void *p, int64_t i) {
  switch (t) {
    case EPX_FLOAT32: return ((const float *)p)[i];
    case EPX_BFLOAT16: return epx_bf16_to_float(((const uint16_t *)p)[i]);
    case EPX_FP8_E4M3: return epx_e4m3_to_float(((const uint8_t *)p)[i]);
    case EPX_INT32: return ((const int32_t *)p)[i];
    default: return (double)elem_bits(t, p, i);
  }
}

int check_bits_at(const char *file, int line, const char *what, epx_dtype_t t, const void *got, const void *want,
                  int64_t n, int row) {
  const size_t es = epx_dtype_size(t);
  int64_t first = -1, count = 0;
  for (int64_t i = 0; i < n; i++)
    if (memcmp((const uint8_t *)got + i * es, (const uint8_t *)want + i * es, es)) {
      if (first < 0) first = i;
      count++;
    }
  if (row < 1) row = 1;
  if (count == 0) {
    check_pass();
    return 1;
  }
  check_fail(file, line, "same bits", "%s: %lld of %lld %s elements differ; first [%lld][%lld]: got %.9g (0x%x), want %.9g (0x%x)",
             what, (long long)count, (long long)n, tu_dtype(t), (long long)(first / row), (long long)(first % row),
             elem_value(t, got, first), (unsigned)elem_bits(t, got, first), elem_value(t, want, first),
             (unsigned)elem_bits(t, want, first));
  return 0;
}

/* ---- run bookkeeping ---------------------------------------------------------------- */
double tu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void tu_sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

void tu_begin(const char *name) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  test_name = name;
  counters_t *shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared != MAP_FAILED) {
    atomic_init(&shared->passed, atomic_load(&own_counters.passed));
    atomic_init(&shared->failed, atomic_load(&own_counters.failed));
    counters = shared;
  }
  tu_seed_init();
  printf("seed: %llu\n", (unsigned long long)tu_seed);
  printf("(%s: rerun with EPX_TEST_SEED=%llu to reproduce)\n", name, (unsigned long long)tu_seed);
}

int tu_end(void) {
  long p = atomic_load(&counters->passed), f = atomic_load(&counters->failed);
  printf("%s: %ld passed, %ld failed (seed %llu)\n", test_name, p, f, (unsigned long long)tu_seed);
  fflush(stdout);
  return f ? 1 : 0;
}

void tu_enter_process(const char *name) {
  snprintf(label, sizeof label, "%s", name);
  atomic_store(&failed_here, 0);
}

/* ---- messages ------------------------------------------------------------------------- */
int tu_contains(const char *msg, const char *word) {
  const size_t n = strlen(word);
  for (const char *p = msg; *p; p++) {
    size_t i = 0;
    while (i < n && p[i] && tolower((unsigned char)p[i]) == tolower((unsigned char)word[i])) i++;
    if (i == n) return 1;
  }
  return 0;
}

int tu_names_rank(const char *msg, int v) {
  char pat[32];
  snprintf(pat, sizeof pat, "rank %d", v);
  for (const char *p = strstr(msg, pat); p; p = strstr(p + 1, pat)) {
    const char next = p[strlen(pat)];
    if (next < '0' || next > '9') return 1;
  }
  return 0;
}
