/*
 * check.h — the tests' assertion macro.
 *
 *   CHECK(cond, fmt, ...)   records a pass, or prints "file:line: CHECK(cond) failed: msg" and
 *                           records a failure; the test goes on. Safe from any thread.
 *   CHECK_STATUS(expr, want, fmt, ...)  CHECK that a call returned status `want`, printing
 *                           both status names and epx_last_error() when it did not.
 *   check_summary(name)     prints "name: N passed, M failed" and returns the exit code.
 *
 * The counters live in testutil.c (one pair per test program). Only the first
 * CHECK_MAX_PRINTED failures are printed; every one is counted.
 */
#ifndef EPX_TEST_CHECK_H
#define EPX_TEST_CHECK_H

#include <stdio.h>

#include "epx.h"

#if defined(__GNUC__)
#define CHECK_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define CHECK_PRINTF(a, b)
#endif

#define CHECK_MAX_PRINTED 60

void check_pass(void);
void check_fail(const char *file, int line, const char *cond, const char *fmt, ...) CHECK_PRINTF(4, 5);
/* CHECK_STATUS's helper: records, and returns 1 when got == want. */
int check_status_at(const char *file, int line, const char *expr, epx_status_t got, epx_status_t want,
                    const char *fmt, ...) CHECK_PRINTF(6, 7);
long check_failures(void);
int check_summary(const char *name);

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (cond)                                             \
      check_pass();                                       \
    else                                                  \
      check_fail(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)

#define CHECK_STATUS(expr, want, ...) check_status_at(__FILE__, __LINE__, #expr, (expr), (want), __VA_ARGS__)

#endif /* EPX_TEST_CHECK_H */
