/*
 * The test harness of the CPU, multi-process and GPU tests:
 *   check.h  CHECK / CHECK_STATUS / CHECK_BITS naming the caller's file and line, pass and fail
 *            counts shared with forked processes, the seed printed by tu_begin, tu_end's summary
 *   rng.h    the random source (EPX_TEST_SEED replays a run), per-process streams
 *   data.h   elements, poisoned buffers, random routings, one MoE input over R ranks
 *   ref.h    the dense reference's output, the rows each rank must receive, stand-in experts
 */
#ifndef EPX_TEST_HARNESS_H
#define EPX_TEST_HARNESS_H

#include "check.h"
#include "data.h"
#include "ref.h"
#include "rng.h"

#endif /* EPX_TEST_HARNESS_H */
