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
#include <sys/mman.h>

#include "preconditioner.h"
#include "rpc.h"
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

/* A K-FAC answer (A of order 40, past one 32-tile of the expansion, in fp32; G of order 3
 * in bf16) decoded packed and whole: the whole one holds the packed floats in both
 * triangles, bit for bit (pc_unpack_f32's matrix), with pub.kfac_dense set; a malformed
 * answer is refused either way. */
static void test_kfac_dense(void **state) {
  (void)state;
  enum { NA = 40, NG = 3 };
  float a[NA * (NA + 1) / 2], g[NG * (NG + 1) / 2];
  for (size_t i = 0; i < sizeof a / sizeof a[0]; i++) a[i] = 1.0f / (float)(i + 3);
  for (size_t i = 0; i < sizeof g / sizeof g[0]; i++) g[i] = (float)i - 2.5f;
  uint16_t g16[sizeof g / sizeof g[0]];
  pc_f32_to_bf16(sizeof g / sizeof g[0], g, g16);
  Precond__V1__PackedMatrix ma = PRECOND__V1__PACKED_MATRIX__INIT;
  Precond__V1__PackedMatrix mg = PRECOND__V1__PACKED_MATRIX__INIT;
  ma.n = NA;
  ma.data.data = (uint8_t *)a;
  ma.data.len = sizeof a;
  mg.n = NG;
  mg.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  mg.data.data = (uint8_t *)g16;
  mg.data.len = sizeof g16;
  Precond__V1__BlockRoots b = PRECOND__V1__BLOCK_ROOTS__INIT;
  b.block_id = 1;
  b.a_inv = &ma;
  b.g_inv = &mg;
  b.pi = 2.0;
  precond__roots_obj *p = precond__kfac_from_wire(&b, NG, NA, 0);
  precond__roots_obj *d = precond__kfac_from_wire(&b, NG, NA, 1);
  assert_non_null(p);
  assert_non_null(d);
  assert_int_equal(p->pub.kfac_dense, 0);
  assert_int_equal(d->pub.kfac_dense, 1);
  assert_memory_equal(p->pub.a_inv, a, sizeof a);
  float wa[NA * NA], wg[NG * NG];
  pc_unpack_f32(NA, p->pub.a_inv, wa);
  pc_unpack_f32(NG, p->pub.g_inv, wg);
  assert_memory_equal(d->pub.a_inv, wa, sizeof wa);
  assert_memory_equal(d->pub.g_inv, wg, sizeof wg);
  assert_true(d->pub.g_inv[1 * NG + 0] == d->pub.g_inv[0 * NG + 1]);
  assert_true(d->pub.pi == 2.0 && d->pub.n_a == NA && d->pub.n_g == NG);
  precond_roots_release(&p->pub);
  precond_roots_release(&d->pub);
  ma.data.len = sizeof a - 4;
  assert_null(precond__kfac_from_wire(&b, NG, NA, 1));
  ma.data.len = sizeof a;
  assert_null(precond__kfac_from_wire(&b, NG, NA + 1, 1));
}

/* Roots by reference: an answer whose sides lie in the roots area (as rpc_shm_fetch_in
 * leaves them) becomes an object pointing there, intact while both entries hold their seq,
 * keeping the area mapped after the client's own reference is gone; anything else (bf16,
 * no seq, an order that is not the block's, misaligned bytes, no area) is NULL: decode a
 * copy instead. */
static void test_by_reference(void **state) {
  (void)state;
  const size_t A = (size_t)RPC_SHM_ROOTS_DATA + 4096;
  unsigned char *map = mmap(NULL, A, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(map != MAP_FAILED);
  rpc_shm_entry *e = (rpc_shm_entry *)(void *)map;
  const float lv[3] = {1.0f, 0.5f, 2.0f}, rv[1] = {4.0f};
  Precond__V1__ShmRef ref[2];
  Precond__V1__PackedMatrix m[2];
  for (int k = 0; k < 2; k++) {
    rpc_shm_entry *ek = e + 5 + k;
    ek->offset = RPC_SHM_ROOTS_DATA + 128 * (size_t)k;
    ek->length = k == 0 ? sizeof lv : sizeof rv;
    memcpy(map + ek->offset, k == 0 ? (const void *)lv : (const void *)rv, ek->length);
    ek->crc32c = rpc_shm_crc(map + ek->offset, ek->length);
    ek->seq = 5 + (uint64_t)k;
    precond__v1__shm_ref__init(&ref[k]);
    ref[k].offset = ek->offset;
    ref[k].length = ek->length;
    ref[k].crc32c = ek->crc32c;
    ref[k].seq = ek->seq;
    precond__v1__packed_matrix__init(&m[k]);
    m[k].n = k == 0 ? 2 : 1;
    m[k].shm = &ref[k];
    m[k].data.data = map + ek->offset;
    m[k].data.len = ek->length;
  }
  Precond__V1__BlockRoots b = PRECOND__V1__BLOCK_ROOTS__INIT;
  b.block_id = 3;
  b.version = 7;
  b.source_step = 11;
  b.left = &m[0];
  b.right = &m[1];
  precond__area *area = precond__area_new(map, A);
  assert_non_null(area);
  precond__roots_obj *o = precond__roots_by_ref(&b, 2, 1, area);
  assert_non_null(o);
  assert_ptr_equal(o->pub.left, map + ref[0].offset);
  assert_ptr_equal(o->pub.right, map + ref[1].offset);
  assert_int_equal(o->pub.daemon_version, 7);
  assert_int_equal(o->pub.source_step, 11);
  assert_int_equal(o->pub.n_left, 2);
  assert_int_equal(o->pub.n_right, 1);
  assert_int_equal(precond_roots_intact(&o->pub), 1);
  e[6].seq = 0; /* the daemon reuses the right side's place */
  assert_int_equal(precond_roots_intact(&o->pub), 0);
  e[6].seq = 6;
  assert_int_equal(precond_roots_intact(&o->pub), 1);
  assert_int_equal(precond_roots_intact(NULL), 0);

  assert_null(precond__roots_by_ref(&b, 2, 1, NULL));
  assert_null(precond__roots_by_ref(&b, 3, 1, area));
  m[1].encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  assert_null(precond__roots_by_ref(&b, 2, 1, area));
  m[1].encoding = PRECOND__V1__ENCODING__ENCODING_FP32;
  ref[0].seq = 0; /* the daemon's half of a region, not the roots area */
  assert_null(precond__roots_by_ref(&b, 2, 1, area));
  ref[0].seq = 5;
  m[0].data.data = map + ref[0].offset + 1;
  assert_null(precond__roots_by_ref(&b, 2, 1, area));
  m[0].data.data = map + ref[0].offset;
  b.right = NULL;
  assert_null(precond__roots_by_ref(&b, 2, 1, area));

  /* The client's reference goes (its region closed): the object's keeps the area mapped. */
  precond__area_release(area);
  assert_true(o->pub.left[2] == 2.0f && o->pub.right[0] == 4.0f);
  precond_roots_release(&o->pub); /* the last reference: unmapped */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_decode),
      cmocka_unit_test(test_kfac_dense),
      cmocka_unit_test(test_by_reference),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
