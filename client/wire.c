/*
 * wire.c -- libprecond: FetchPreconditioners answers to roots objects (see wire.h).
 */
#include "wire.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"
#include "rpc.h"

void precond_roots_release(const precond_roots *roots) {
  if (roots == NULL) return;
  precond__roots_obj *o = (precond__roots_obj *)(void *)(uintptr_t)roots;
  if (atomic_fetch_sub_explicit(&o->refs, 1, memory_order_acq_rel) == 1) free(o);
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

/* A new object with room for two packed sides of orders n0 and n1, both decoded from m0
 * and m1 (NULL: that side is absent, its order must be 0), and the fields every mode shares
 * filled from b. NULL when a side does not decode or memory runs out. */
static precond__roots_obj *obj_from_wire(const Precond__V1__BlockRoots *b,
                                         const Precond__V1__PackedMatrix *m0, uint32_t n0,
                                         const Precond__V1__PackedMatrix *m1, uint32_t n1) {
  size_t c0 = pc_packed_len(n0), c1 = pc_packed_len(n1);
  precond__roots_obj *o = malloc(sizeof(*o) + (c0 + c1) * sizeof(float));
  if (o == NULL) return NULL;
  if ((m0 && decode_side(m0, n0, o->values) != 0) ||
      (m1 && decode_side(m1, n1, o->values + c0) != 0)) {
    free(o);
    return NULL;
  }
  memset(&o->pub, 0, sizeof o->pub);
  atomic_init(&o->refs, 1);
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
  precond__roots_obj *o = obj_from_wire(b, b->left, rows, b->right, cols);
  if (o == NULL) return NULL;
  o->pub.method = (precond_method)b->method;
  o->pub.n_left = rows;
  o->pub.n_right = cols;
  o->pub.left = rows ? o->values : NULL;
  o->pub.right = cols ? o->values + pc_packed_len(rows) : NULL;
  return o;
}

precond__roots_obj *precond__kfac_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                            uint32_t cols) {
  /* Both inverses of the layer's orders, nothing of Shampoo's, a known method, a usable pi. */
  if (b->a_inv == NULL || b->g_inv == NULL || b->a_inv->n != cols || b->g_inv->n != rows ||
      b->left != NULL || b->right != NULL || rows == 0 || cols == 0 ||
      (int)b->inverse < (int)PRECOND_KFAC_INVERSE_AUTO ||
      (int)b->inverse > (int)PRECOND_KFAC_INVERSE_NEWTON || !(b->pi > 0.0 && b->pi < HUGE_VAL))
    return NULL;
  precond__roots_obj *o = obj_from_wire(b, b->a_inv, cols, b->g_inv, rows);
  if (o == NULL) return NULL;
  o->pub.n_a = cols;
  o->pub.n_g = rows;
  o->pub.a_inv = o->values;
  o->pub.g_inv = o->values + pc_packed_len(cols);
  o->pub.pi = b->pi;
  o->pub.inverse = (precond_kfac_inverse)b->inverse;
  return o;
}
