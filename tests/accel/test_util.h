/*
 * test_util.h -- what the tests of tests/accel/ share: the group fixture that runs every
 * test on the CPU backend and again on CUDA (a missing CUDA backend skips its group with a
 * message), a reproducible random generator and checked allocation. Header-only (static
 * inline) so that each test stays one executable built from one file. Include it after
 * <cmocka.h> and "accel.h".
 */
#ifndef PRECOND_TESTS_ACCEL_TEST_UTIL_H
#define PRECOND_TESTS_ACCEL_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define OK(call) assert_int_equal((call), AC_OK)

typedef struct {
  ac_backend *be;  /* backend under test; NULL: unavailable, its tests skip */
  ac_backend *cpu; /* CUDA group with a device: a CPU backend to compare against; else NULL */
} fixture;

/* The group's backend; skips the test when it does not exist (the setup said why). */
static inline ac_backend *backend(void **state) {
  ac_backend *be = ((fixture *)*state)->be;
  if (be == NULL) skip();
  return be;
}

/* xorshift64 on *state: the next value in [-1, 1), with 24 random bits. Each test file
 * keeps its own state, so that its values do not depend on the other files. */
static inline float xorshift_frand(uint64_t *state) {
  *state ^= *state << 13;
  *state ^= *state >> 7;
  *state ^= *state << 17;
  return (float)((*state >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

/* calloc that fails the test instead of returning NULL; n == 0 still gives a pointer. */
static inline void *xcalloc(size_t n, size_t sz) {
  void *p = calloc(n ? n : 1, sz);
  assert_non_null(p);
  return p;
}

/* Group setup: a backend of the kind asked, or NULL (with a message) where there is none.
 * The CPU backend always exists, so its absence fails the group; so does a missing CUDA
 * backend under AC_REQUIRE_CUDA (bench/device-check.sh: on a GPU machine every CUDA-vs-CPU
 * test must run). A CUDA group with a device also gets a CPU backend to compare against. */
static inline int setup_kind(void **state, ac_backend_kind kind) {
  static fixture fx[2];
  const char *name = kind == AC_BACKEND_CUDA ? "CUDA" : "CPU";
  ac_backend_opts opts;
  ac_backend_opts_default(&opts);
  opts.kind = kind;
  fixture *f = &fx[kind == AC_BACKEND_CUDA];
  f->be = NULL;
  f->cpu = NULL;
  *state = f;
  int rc = ac_backend_create(&f->be, &opts);
  if (rc != AC_OK) {
    if (kind == AC_BACKEND_CPU || getenv("AC_REQUIRE_CUDA") != NULL) {
      print_error("%s backend required but unavailable: %s: %s\n", name, ac_strerror(rc),
                  ac_backend_describe(NULL));
      return -1;
    }
    print_message("[  SKIP    ] %s backend unavailable (%s: %s): its tests are skipped\n", name,
                  ac_strerror(rc), ac_backend_describe(NULL));
    return 0;
  }
  if (kind == AC_BACKEND_CUDA && ac_backend_create(&f->cpu, NULL) != AC_OK) {
    ac_backend_destroy(f->be);
    f->be = NULL;
    return -1;
  }
  return 0;
}

static inline int setup_cpu(void **state) {
  return setup_kind(state, AC_BACKEND_CPU);
}

static inline int setup_cuda(void **state) {
  return setup_kind(state, AC_BACKEND_CUDA);
}

static inline int teardown(void **state) {
  fixture *f = *state;
  ac_backend_destroy(f->be);
  ac_backend_destroy(f->cpu);
  f->be = NULL;
  f->cpu = NULL;
  return 0;
}

#endif /* PRECOND_TESTS_ACCEL_TEST_UTIL_H */
