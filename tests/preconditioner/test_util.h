/*
 * test_util.h -- the random generator the Shampoo and grafting tests of tests/preconditioner/
 * share. Header-only, so that each test stays one executable built from one file. Each test
 * seeds rng_state itself, so that its values do not depend on the tests run before it.
 */
#ifndef PRECOND_TESTS_PC_TEST_UTIL_H
#define PRECOND_TESTS_PC_TEST_UTIL_H

#include <stdint.h>

static uint64_t rng_state;

static inline double uniform(void) { /* xorshift64*, in [-1, 1) */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  uint64_t r = rng_state * 2685821657736338717ull;
  return (double)(r >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

#endif /* PRECOND_TESTS_PC_TEST_UTIL_H */
