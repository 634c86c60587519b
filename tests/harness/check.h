/*
 * check.h — the tests' checks and run bookkeeping, shared by the CPU, multi-process and GPU
 * tests. Every failure names the file and line of the check that the test wrote.
 *
 *   CHECK(cond, fmt, ...)   records a pass, or prints "file:line: CHECK(cond) failed: msg" and
 *                           records a failure; the test goes on. Safe from any thread.
 *   CHECK_STATUS(expr, want, fmt, ...)  CHECK that a call returned status `want`, printing
 *                           both status names and epx_last_error() when it did not; returns 1
 *                           when it did.
 *   CHECK_BITS(what, dtype, got, want, n, row)  CHECK that [n] elements hold the same bits,
 *                           printing the count and the first difference ([row][col] with rows
 *                           of `row` elements) and both values; returns 1 when they do.
 *   tu_begin(name)          seeds tu_rng (EPX_TEST_SEED or the clock) and prints the seed
 *   tu_end()                prints "name: N passed, M failed" and returns the exit code
 *
 * The counters live in memory shared with forked processes, so the checks of a test's rank
 * processes count in its summary; tu_enter_process labels a forked process's failures
 * ("[proc 3] file:line: ...") and starts its own failure count (check_failures). A helper
 * that checks on a test's behalf takes the test's file and line (TU_HERE) and passes them on.
 * Only the first CHECK_MAX_PRINTED failures are printed; every one is counted.
 */
#ifndef EPX_TEST_CHECK_H
#define EPX_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>

#include "epx.h"

#if defined(__GNUC__)
#define CHECK_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define CHECK_PRINTF(a, b)
#endif

#define CHECK_MAX_PRINTED 60

/* The caller's place, for helpers that check on its behalf: f(TU_HERE, ...). */
#define TU_HERE __FILE__, __LINE__

void check_pass(void);
void check_fail(const char *file, int line, const char *cond, const char *fmt, ...) CHECK_PRINTF(4, 5);
/* CHECK_STATUS's helper: records, and returns 1 when got == want. */
int check_status_at(const char *file, int line, const char *expr, epx_status_t got, epx_status_t want,
                    const char *fmt, ...) CHECK_PRINTF(6, 7);
/* CHECK_BITS's helper. */
int check_bits_at(const char *file, int line, const char *what, epx_dtype_t t, const void *got, const void *want,
                  int64_t n, int row);
/* Failures this process recorded (since tu_enter_process in a forked one). */
long check_failures(void);
/* Failures of the whole test, forked processes' included. */
long check_failures_all(void);

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (cond)                                             \
      check_pass();                                       \
    else                                                  \
      check_fail(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)

#define CHECK_STATUS(expr, want, ...) check_status_at(__FILE__, __LINE__, #expr, (expr), (want), __VA_ARGS__)
#define CHECK_BITS(what, t, got, want, n, row) check_bits_at(__FILE__, __LINE__, (what), (t), (got), (want), (n), (row))

/* ---- run bookkeeping ---------------------------------------------------------------- */
void tu_begin(const char *name);
int tu_end(void);
/* In a process forked by the test: its label for failure messages, its own failure count. */
void tu_enter_process(const char *label);
double tu_now(void); /* monotonic seconds */
void tu_sleep_ms(long ms);

/* ---- messages ------------------------------------------------------------------------- */
int tu_contains(const char *msg, const char *word); /* word in msg, any case */
int tu_names_rank(const char *msg, int v);          /* "rank v" in msg, not followed by a digit */

#endif /* EPX_TEST_CHECK_H */
