/*
 * test_schedule.c -- learning-rate schedules against their closed forms, evaluated here
 * independently, and the validation of a schedule struct.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "accel.h"

#define PI 3.14159265358979323846

static void assert_close(double got, double want) {
  if (fabs(got - want) > 1e-12 * (1.0 + fabs(want))) fail_msg("got %.17g, want %.17g", got, want);
}

static void test_linear_warmup(void **state) {
  (void)state;
  assert_close(ac_lr_linear_warmup(0.5, 0, 10), 0.0);
  assert_close(ac_lr_linear_warmup(0.5, 1, 10), 0.05);
  assert_close(ac_lr_linear_warmup(0.5, 7, 10), 0.35);
  assert_close(ac_lr_linear_warmup(0.5, 10, 10), 0.5);
  assert_close(ac_lr_linear_warmup(0.5, 11, 10), 0.5);
  assert_close(ac_lr_linear_warmup(0.5, -3, 10), 0.0);
  assert_close(ac_lr_linear_warmup(0.5, 3, 0), 0.5); /* no warmup */
  assert_close(ac_lr_linear_warmup(0.5, 3, -2), 0.5);
}

static void test_cosine_decay(void **state) {
  (void)state;
  const double base = 1e-3, lo = 1e-5;
  for (long s = 0; s <= 100; s += 7)
    assert_close(ac_lr_cosine_decay(base, lo, s, 100),
                 lo + (base - lo) * 0.5 * (1.0 + cos(PI * (double)s / 100.0)));
  assert_close(ac_lr_cosine_decay(base, lo, 0, 100), base);
  assert_close(ac_lr_cosine_decay(base, lo, 50, 100), 0.5 * (base + lo));
  assert_close(ac_lr_cosine_decay(base, lo, 100, 100), lo);
  assert_close(ac_lr_cosine_decay(base, lo, 1000, 100), lo); /* stays at the floor */
  assert_close(ac_lr_cosine_decay(base, lo, -5, 100), base);
  assert_close(ac_lr_cosine_decay(base, lo, 5, 0), base); /* no decay */
  /* monotone non-increasing */
  for (long s = 1; s <= 120; s++)
    assert_true(ac_lr_cosine_decay(base, lo, s, 100) <= ac_lr_cosine_decay(base, lo, s - 1, 100));
}

static void test_step_decay(void **state) {
  (void)state;
  assert_close(ac_lr_step_decay(0.1, 0.5, 0, 30), 0.1);
  assert_close(ac_lr_step_decay(0.1, 0.5, 29, 30), 0.1);
  assert_close(ac_lr_step_decay(0.1, 0.5, 30, 30), 0.05);
  assert_close(ac_lr_step_decay(0.1, 0.5, 89, 30), 0.025);
  assert_close(ac_lr_step_decay(0.1, 0.5, 90, 30), 0.0125);
  assert_close(ac_lr_step_decay(0.1, 0.5, 90, 0), 0.1);
  assert_close(ac_lr_step_decay(0.1, 0.5, -1, 30), 0.1);
}

static void test_schedule_composed(void **state) {
  (void)state;
  ac_lr_schedule s;
  ac_lr_schedule_default(&s, 0.2);
  assert_int_equal(ac_lr_schedule_check(&s), AC_OK);
  for (long t = 1; t < 50; t += 5) assert_close(ac_lr_schedule_at(&s, t), 0.2);

  s.warmup_steps = 10;
  s.decay = AC_LR_COSINE;
  s.decay_steps = 90;
  s.min_lr = 0.002;
  assert_int_equal(ac_lr_schedule_check(&s), AC_OK);
  assert_close(ac_lr_schedule_at(&s, 1), 0.02);
  assert_close(ac_lr_schedule_at(&s, 10), 0.2);
  for (long t = 11; t <= 120; t += 3) {
    double u = (double)(t - 10 > 90 ? 90 : t - 10) / 90.0;
    assert_close(ac_lr_schedule_at(&s, t), 0.002 + 0.198 * 0.5 * (1.0 + cos(PI * u)));
  }

  s.decay = AC_LR_STEP;
  s.step_size = 20;
  s.gamma = 0.1;
  assert_int_equal(ac_lr_schedule_check(&s), AC_OK);
  assert_close(ac_lr_schedule_at(&s, 5), 0.1);
  assert_close(ac_lr_schedule_at(&s, 29), 0.2);
  assert_close(ac_lr_schedule_at(&s, 30), 0.2 * 0.1);
  assert_close(ac_lr_schedule_at(&s, 50), 0.2 * 0.01);
}

/* The clients' default protocol for a 1000-step run (bench/train.c, tr_schedule): 100
 * warm-up steps, then cosine to 0 over the 900 left: the base rate where the warm-up ends,
 * half of it at the decay's midpoint, 0 at the last step and a little above just before. */
static void test_schedule_run_protocol(void **state) {
  (void)state;
  ac_lr_schedule s;
  ac_lr_schedule_default(&s, 3e-3);
  s.warmup_steps = 100;
  s.decay = AC_LR_COSINE;
  s.decay_steps = 900;
  assert_int_equal(ac_lr_schedule_check(&s), AC_OK);
  assert_close(ac_lr_schedule_at(&s, 99), 3e-3 * 0.99);
  assert_close(ac_lr_schedule_at(&s, 100), 3e-3);
  assert_close(ac_lr_schedule_at(&s, 101), 3e-3 * 0.5 * (1.0 + cos(PI / 900.0)));
  assert_close(ac_lr_schedule_at(&s, 550), 1.5e-3);
  assert_close(ac_lr_schedule_at(&s, 1000), 0.0);
  double before = ac_lr_schedule_at(&s, 999);
  assert_true(before > 0.0 && before < 1e-7);
}

static void test_schedule_check(void **state) {
  (void)state;
  ac_lr_schedule s, bad;
  assert_int_equal(ac_lr_schedule_check(NULL), AC_EINVAL);
  ac_lr_schedule_default(NULL, 1.0); /* no-op, no crash */
  ac_lr_schedule_default(&s, 0.1);

  bad = s;
  bad.base_lr = 0.0;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.base_lr = NAN;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.base_lr = INFINITY;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.warmup_steps = -1;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.decay = AC_LR_COSINE;
  bad.decay_steps = 0;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.decay = AC_LR_COSINE;
  bad.min_lr = 0.2;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.decay = AC_LR_STEP;
  bad.step_size = 0;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.decay = AC_LR_STEP;
  bad.gamma = 1.5;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
  bad = s;
  bad.decay = (ac_lr_decay)7;
  assert_int_equal(ac_lr_schedule_check(&bad), AC_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_linear_warmup),
      cmocka_unit_test(test_cosine_decay),
      cmocka_unit_test(test_step_decay),
      cmocka_unit_test(test_schedule_composed),
      cmocka_unit_test(test_schedule_run_protocol),
      cmocka_unit_test(test_schedule_check),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
