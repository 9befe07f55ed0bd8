/*
 * wire.c -- libprecond: FetchPreconditioners answers to roots objects (see wire.h).
 */
#include "wire.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "preconditioner.h"
#include "rpc.h"

precond__area *precond__area_new(const unsigned char *map, size_t bytes) {
  precond__area *a = malloc(sizeof *a);
  if (a == NULL) return NULL;
  atomic_init(&a->refs, 1);
  a->map = map;
  a->bytes = bytes;
  return a;
}

void precond__area_release(precond__area *a) {
  if (a == NULL || atomic_fetch_sub_explicit(&a->refs, 1, memory_order_acq_rel) != 1) return;
  munmap((void *)(uintptr_t)a->map, a->bytes);
  free(a);
}

void precond_roots_release(const precond_roots *roots) {
  if (roots == NULL) return;
  precond__roots_obj *o = (precond__roots_obj *)(void *)(uintptr_t)roots;
  if (atomic_fetch_sub_explicit(&o->refs, 1, memory_order_acq_rel) != 1) return;
  precond__area_release(o->area);
  free(o);
}

int precond_roots_intact(const precond_roots *roots) {
  if (roots == NULL) return 0;
  const precond__roots_obj *o = (const precond__roots_obj *)(const void *)roots;
  if (o->area == NULL) return 1; /* a copy of its own */
  /* Acquire: the caller's reads of the sides are ordered before these loads (the seqlock's
   * second look, as rpc_shm_fetch_intact's). */
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  return rpc_shm_entry_holds(o->area->map, o->area->bytes, &o->ref[0]) &&
         rpc_shm_entry_holds(o->area->map, o->area->bytes, &o->ref[1]);
}

/* Decodes one side of a BlockRoots answer of order n (already checked against the block)
 * into out (pc_packed_len(n) floats) with proto/'s codec. Returns 0, or -1 if the bytes do
 * not match n and the encoding. */
static int decode_side(const Precond__V1__PackedMatrix *m, size_t n, float *out) {
  return rpc_packed_decode((int)m->encoding, m->data.data, m->data.len, pc_packed_len(n), out) ==
                 RPC_OK
             ? 0
             : -1;
}

/* The packed upper triangle of order n held in the last pc_packed_len(n) floats of d (n x
 * n) made whole in place: each packed row moved to its place on and right of the diagonal,
 * in row order (row i's packed values start at or after where its whole row starts, and
 * the rows still to move lie past what the moved ones cover), then the lower triangle
 * copied from the upper by 32 x 32 tiles, so that neither side's accesses stride through
 * memory one float per row. The floats are copied, never computed: the same values as
 * ac_unpack_sym's of the packed ones. */
static void unpack_in_place(size_t n, float *d) {
  const float *src = d + n * n - pc_packed_len(n);
  for (size_t i = 0, p = 0; i < n; p += n - i, i++)
    memmove(d + i * n + i, src + p, (n - i) * sizeof(float));
  enum { TILE = 32 };
  for (size_t i0 = 0; i0 < n; i0 += TILE)
    for (size_t j0 = 0; j0 <= i0; j0 += TILE)
      for (size_t i = i0; i < i0 + TILE && i < n; i++)
        for (size_t j = j0; j < j0 + TILE && j < i; j++) d[i * n + j] = d[j * n + i];
}

/* The floats a side of order n takes: its packed triangle, or n x n when whole. */
static size_t side_len(size_t n, int dense) {
  return dense ? n * n : pc_packed_len(n);
}

/* A new object with room for two sides of orders n0 and n1 (packed, or whole when dense),
 * both decoded from m0 and m1 (NULL: that side is absent, its order must be 0), and the
 * fields every mode shares filled from b. NULL when a side does not decode or memory runs
 * out. */
static precond__roots_obj *obj_from_wire(const Precond__V1__BlockRoots *b,
                                         const Precond__V1__PackedMatrix *m0, uint32_t n0,
                                         const Precond__V1__PackedMatrix *m1, uint32_t n1,
                                         int dense) {
  size_t c0 = side_len(n0, dense), c1 = side_len(n1, dense);
  precond__roots_obj *o = malloc(sizeof(*o) + (c0 + c1) * sizeof(float));
  if (o == NULL) return NULL;
  /* Whole: each side decoded into the tail of its square, then spread over it. */
  float *d0 = o->values + c0 - pc_packed_len(n0), *d1 = o->values + c0 + c1 - pc_packed_len(n1);
  if ((m0 && decode_side(m0, n0, d0) != 0) || (m1 && decode_side(m1, n1, d1) != 0)) {
    free(o);
    return NULL;
  }
  if (dense && m0) unpack_in_place(n0, o->values);
  if (dense && m1) unpack_in_place(n1, o->values + c0);
  memset(&o->pub, 0, sizeof o->pub);
  atomic_init(&o->refs, 1);
  o->area = NULL;
  o->pub.block_id = b->block_id;
  o->pub.version = 0; /* set when published */
  o->pub.daemon_version = b->version;
  o->pub.source_step = b->source_step;
  o->pub.error = b->error;
  o->pub.iterations = b->iterations;
  return o;
}

precond__roots_obj *precond__roots_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                             uint32_t cols) {
  /* The answer's orders must be the block's: they size nothing here. */
  if ((b->left ? b->left->n : 0) != rows || (b->right ? b->right->n : 0) != cols) return NULL;
  precond__roots_obj *o = obj_from_wire(b, b->left, rows, b->right, cols, 0);
  if (o == NULL) return NULL;
  o->pub.method = (precond_method)b->method;
  o->pub.n_left = rows;
  o->pub.n_right = cols;
  o->pub.left = rows ? o->values : NULL;
  o->pub.right = cols ? o->values + pc_packed_len(rows) : NULL;
  return o;
}

/* 1 when side m lies in the roots area as by-reference roots need it: n, fp32, the bytes of
 * a packed n, and aligned for floats. */
static int side_in_area(const Precond__V1__PackedMatrix *m, uint32_t n) {
  return m != NULL && n > 0 && m->n == n && m->encoding == PRECOND__V1__ENCODING__ENCODING_FP32 &&
         m->shm != NULL && m->shm->seq != 0 && m->data.data != NULL &&
         m->data.len == pc_packed_len(n) * sizeof(float) &&
         (uintptr_t)m->data.data % _Alignof(float) == 0;
}

precond__roots_obj *precond__roots_by_ref(const Precond__V1__BlockRoots *b, uint32_t rows,
                                          uint32_t cols, precond__area *area) {
  if (area == NULL || !side_in_area(b->left, rows) || !side_in_area(b->right, cols)) return NULL;
  precond__roots_obj *o = obj_from_wire(b, NULL, 0, NULL, 0, 0);
  if (o == NULL) return NULL;
  const Precond__V1__PackedMatrix *side[2] = {b->left, b->right};
  for (int k = 0; k < 2; k++) {
    precond__v1__shm_ref__init(&o->ref[k]);
    o->ref[k].offset = side[k]->shm->offset;
    o->ref[k].length = side[k]->shm->length;
    o->ref[k].crc32c = side[k]->shm->crc32c;
    o->ref[k].seq = side[k]->shm->seq;
  }
  atomic_fetch_add_explicit(&area->refs, 1, memory_order_relaxed);
  o->area = area;
  o->pub.method = (precond_method)b->method;
  o->pub.n_left = rows;
  o->pub.n_right = cols;
  o->pub.left = (const float *)(const void *)b->left->data.data;
  o->pub.right = (const float *)(const void *)b->right->data.data;
  return o;
}

precond__roots_obj *precond__kfac_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                            uint32_t cols, int dense) {
  /* Both inverses of the layer's orders, nothing of Shampoo's, a known method, a usable pi. */
  if (b->a_inv == NULL || b->g_inv == NULL || b->a_inv->n != cols || b->g_inv->n != rows ||
      b->left != NULL || b->right != NULL || rows == 0 || cols == 0 ||
      (int)b->inverse < (int)PRECOND_KFAC_INVERSE_AUTO ||
      (int)b->inverse > (int)PRECOND_KFAC_INVERSE_NEWTON || !(b->pi > 0.0 && b->pi < HUGE_VAL))
    return NULL;
  dense = dense != 0;
  precond__roots_obj *o = obj_from_wire(b, b->a_inv, cols, b->g_inv, rows, dense);
  if (o == NULL) return NULL;
  o->pub.n_a = cols;
  o->pub.n_g = rows;
  o->pub.a_inv = o->values;
  o->pub.g_inv = o->values + side_len(cols, dense);
  o->pub.kfac_dense = dense;
  o->pub.pi = b->pi;
  o->pub.inverse = (precond_kfac_inverse)b->inverse;
  return o;
}
