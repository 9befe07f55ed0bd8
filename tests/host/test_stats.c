/* test_stats.c -- unit tests of host/stats.c: compute-time percentiles over a bounded
 * window, and the clock. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <string.h>

#include "precondd.h"

static void test_stats_percentiles(void **state) {
  (void)state;
  pd_stats s;
  assert_int_equal(pd_stats_init(&s), PD_OK);
  double p50, p90, p99;
  pd_stats_percentiles(&s, &p50, &p90, &p99);
  assert_true(p50 == 0 && p99 == 0);
  for (int i = 1; i <= 100; i++) pd_stats_add_compute_ms(&s, (double)i);
  pd_stats_percentiles(&s, &p50, &p90, &p99);
  assert_true(p50 == 50 && p90 == 90 && p99 == 99);
  for (int i = 0; i < 2 * PD_STATS_WINDOW; i++) pd_stats_add_compute_ms(&s, 1000);
  pd_stats_percentiles(&s, &p50, &p90, &p99);
  assert_true(p50 == 1000); /* the window forgot the old ones */
  pd_stats_destroy(&s);
}

static void test_clock(void **state) {
  (void)state;
  double a = pd_now(), b = pd_now();
  assert_true(a > 0 && b >= a);
  pd_stats s;
  assert_int_equal(pd_stats_init(&s), PD_OK);
  assert_true(s.start_time > 0 && s.start_time <= pd_now());
  assert_int_equal(atomic_load(&s.memory_bytes), 0);
  pd_stats_destroy(&s);
}

/* Staleness histogram: exact percentiles below the last bin, the exact max above it. */
static void test_staleness_histogram(void **state) {
  (void)state;
  pd_stale_hist h;
  memset(&h, 0, sizeof h);
  pd_stale_summary sum;
  pd_stale_hist_summary(&h, &sum);
  assert_true(sum.p50 == 0 && sum.mean == 0 && sum.count == 0 && sum.max == 0);
  for (uint64_t v = 0; v < 100; v++) pd_stale_hist_add(&h, 99 - v);
  pd_stale_hist_summary(&h, &sum);
  assert_true(sum.p50 == 49); /* the 50th smallest of 0..99 */
  assert_true(sum.p90 == 99); /* 89 lies in the open last bin: its max stands for it */
  assert_int_equal(sum.max, 99);
  assert_int_equal(sum.count, 100);
  assert_true(sum.mean == 49.5);
  /* A bin about to overflow halves them all instead of wrapping. */
  h.bins[3] = UINT32_MAX;
  pd_stale_hist_add(&h, 3);
  assert_int_equal(h.bins[3], UINT32_MAX / 2 + 1);
  assert_int_equal(h.bins[4], 0); /* 1 / 2 */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stats_percentiles),
      cmocka_unit_test(test_clock),
      cmocka_unit_test(test_staleness_histogram),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
