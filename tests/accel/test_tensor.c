/*
 * test_tensor.c -- ac_tensor and ac_param: shapes, zero fill, views, upload/download, names,
 * and bad input (overflowing shapes, bad dtypes, names) rejected with AC_EINVAL.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "accel.h"

static int setup(void **state) {
  ac_backend *be = NULL;
  if (ac_backend_create(&be, NULL) != AC_OK) return -1;
  *state = be;
  return 0;
}

static int teardown(void **state) {
  ac_backend_destroy(*state);
  return 0;
}

static void test_tensor_init_upload(void **state) {
  ac_backend *be = *state;
  ac_tensor t;
  const size_t shape[3] = {2, 3, 4};
  assert_int_equal(ac_tensor_init(&t, be, AC_F32, 3, shape), AC_OK);
  assert_int_equal(t.numel, 24);
  assert_int_equal(t.ndim, 3);
  assert_int_equal(t.shape[2], 4);
  assert_int_equal(t.shape[5], 1);
  assert_int_equal(ac_tensor_bytes(&t), 24 * sizeof(float));
  assert_non_null(ac_tensor_f32(&t));
  assert_null(ac_tensor_i32(&t));

  float host[24], back[24];
  assert_int_equal(ac_tensor_download(&t, back), AC_OK);
  for (int i = 0; i < 24; i++) {
    assert_true(back[i] == 0.0f); /* zero-filled */
    host[i] = (float)i * 0.5f;
  }
  assert_int_equal(ac_tensor_upload(&t, host), AC_OK);
  assert_int_equal(ac_tensor_download(&t, back), AC_OK);
  assert_memory_equal(back, host, sizeof host);

  /* A view of the second half, as a (3, 4) tensor; destroying it frees nothing. */
  ac_tensor v;
  const size_t vs[2] = {3, 4};
  assert_int_equal(ac_tensor_view(&v, be, AC_F32, 2, vs, ac_tensor_f32(&t) + 12), AC_OK);
  assert_int_equal(v.owns, 0);
  assert_int_equal(ac_tensor_download(&v, back), AC_OK);
  assert_memory_equal(back, host + 12, 12 * sizeof(float));
  ac_tensor_destroy(&v);
  assert_null(v.data);

  ac_tensor_destroy(&t);
  assert_null(t.data);
  ac_tensor_destroy(&t); /* twice is safe */

  /* Scalar and empty tensors. */
  assert_int_equal(ac_tensor_init(&t, be, AC_I32, 0, NULL), AC_OK);
  assert_int_equal(t.numel, 1);
  assert_non_null(ac_tensor_i32(&t));
  ac_tensor_destroy(&t);
  const size_t empty[2] = {0, 5};
  assert_int_equal(ac_tensor_init(&t, be, AC_F32, 2, empty), AC_OK);
  assert_int_equal(t.numel, 0);
  assert_null(t.data);
  assert_int_equal(ac_tensor_upload(&t, NULL), AC_OK);
  ac_tensor_destroy(&t);
}

static void test_tensor_bad_input(void **state) {
  ac_backend *be = *state;
  ac_tensor t;
  const size_t huge[2] = {SIZE_MAX / 2, 4};
  const size_t ok[1] = {4};
  assert_int_equal(ac_tensor_init(&t, be, AC_F32, 2, huge), AC_EINVAL);
  assert_null(t.data);
  assert_int_equal(ac_tensor_init(&t, be, (ac_dtype)9, 1, ok), AC_EINVAL);
  assert_int_equal(ac_tensor_init(&t, be, AC_F32, AC_MAX_DIMS + 1, ok), AC_EINVAL);
  assert_int_equal(ac_tensor_init(&t, be, AC_F32, 1, NULL), AC_EINVAL);
  assert_int_equal(ac_tensor_init(&t, NULL, AC_F32, 1, ok), AC_EINVAL);
  assert_int_equal(ac_tensor_init(NULL, be, AC_F32, 1, ok), AC_EINVAL);
  assert_int_equal(ac_tensor_view(&t, be, AC_F32, 1, ok, NULL), AC_EINVAL);
  assert_int_equal(ac_tensor_upload(NULL, ok), AC_EINVAL);
  ac_tensor_destroy(&t);
  ac_tensor_destroy(NULL);
}

static void test_param(void **state) {
  ac_backend *be = *state;
  ac_param p;
  const size_t shape[2] = {8, 16};
  assert_int_equal(ac_param_init(&p, be, "block0.attn.qkv.weight", 2, shape), AC_OK);
  assert_string_equal(p.name, "block0.attn.qkv.weight");
  assert_int_equal(p.value.numel, 128);
  assert_int_equal(p.grad.numel, 128);
  assert_ptr_not_equal(p.value.data, p.grad.data);
  float back[128];
  assert_int_equal(ac_tensor_download(&p.grad, back), AC_OK);
  for (int i = 0; i < 128; i++) assert_true(back[i] == 0.0f);
  ac_param_destroy(&p);
  assert_null(p.name);
  ac_param_destroy(&p);

  char longname[300];
  memset(longname, 'a', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  assert_int_equal(ac_param_init(&p, be, longname, 2, shape), AC_EINVAL);
  assert_int_equal(ac_param_init(&p, be, "", 2, shape), AC_EINVAL);
  assert_int_equal(ac_param_init(&p, be, NULL, 2, shape), AC_EINVAL);
  const size_t huge[2] = {SIZE_MAX / 2, 4};
  assert_int_equal(ac_param_init(&p, be, "w", 2, huge), AC_EINVAL);
  assert_null(p.name); /* left empty, nothing leaked */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tensor_init_upload),
      cmocka_unit_test(test_tensor_bad_input),
      cmocka_unit_test(test_param),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
