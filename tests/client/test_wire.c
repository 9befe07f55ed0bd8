/* test_wire.c -- unit tests of client/wire.c: FetchPreconditioners answers decoded against
 * the block's registered shape; anything else (a wrong order, a byte count that does not
 * match, a missing side, an unknown encoding) is refused without allocating what the answer
 * claims. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"
#include "wire.h"

static void test_decode(void **state) {
  (void)state;
  float l[3] = {1.0f, 0.5f, 2.0f}, r[1] = {4.0f};
  uint16_t r16[1];
  pc_f32_to_bf16(1, r, r16);
  Precond__V1__PackedMatrix ml = PRECOND__V1__PACKED_MATRIX__INIT;
  Precond__V1__PackedMatrix mr = PRECOND__V1__PACKED_MATRIX__INIT;
  ml.n = 2;
  ml.data.data = (uint8_t *)l;
  ml.data.len = sizeof l;
  mr.n = 1;
  mr.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  mr.data.data = (uint8_t *)r16;
  mr.data.len = sizeof r16;
  Precond__V1__BlockRoots b = PRECOND__V1__BLOCK_ROOTS__INIT;
  b.block_id = 3;
  b.version = 7;
  b.source_step = 11;
  b.left = &ml;
  b.right = &mr;
  precond__roots_obj *o = precond__roots_from_wire(&b, 2, 1);
  assert_non_null(o);
  assert_int_equal(o->pub.block_id, 3);
  assert_int_equal(o->pub.daemon_version, 7);
  assert_int_equal(o->pub.source_step, 11);
  assert_int_equal(o->pub.version, 0);
  assert_memory_equal(o->pub.left, l, sizeof l);
  assert_true(o->pub.right[0] == 4.0f);
  precond_roots_release(&o->pub);

  /* Orders are the block's, not the answer's: a daemon claiming 2^32-1 sizes nothing. */
  assert_null(precond__roots_from_wire(&b, 3, 1));
  ml.n = 0xffffffffu;
  assert_null(precond__roots_from_wire(&b, 2, 1));
  ml.n = 2;
  ml.data.len = sizeof l - 4;
  assert_null(precond__roots_from_wire(&b, 2, 1));
  ml.data.len = sizeof l;
  mr.encoding = (Precond__V1__Encoding)9;
  assert_null(precond__roots_from_wire(&b, 2, 1));
  mr.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  b.right = NULL;
  assert_null(precond__roots_from_wire(&b, 2, 1));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_decode),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
