/*
 * wire.c -- libprecond: FetchPreconditioners answers to roots objects (see wire.h).
 */
#include "wire.h"

#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"
#include "rpc.h"

void precond_roots_release(const precond_roots *roots)
{
  if (roots == NULL)
    return;
  precond__roots_obj *o = (precond__roots_obj *)(void *)(uintptr_t)roots;
  if (atomic_fetch_sub_explicit(&o->refs, 1, memory_order_acq_rel) == 1)
    free(o);
}

/* Decodes one side of a BlockRoots answer of order n (already checked against the block)
 * into out (pc_packed_len(n) floats) with proto/'s codec. Returns 0, or -1 if the bytes do
 * not match n and the encoding. */
static int decode_side(const Precond__V1__PackedMatrix *m, size_t n, float *out)
{
  return rpc_packed_decode((int)m->encoding, m->data.data, m->data.len, pc_packed_len(n),
                           out) == RPC_OK ? 0 : -1;
}

precond__roots_obj *precond__roots_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                             uint32_t cols)
{
  /* The answer's orders must be the block's: they size nothing here. */
  if ((b->left ? b->left->n : 0) != rows || (b->right ? b->right->n : 0) != cols)
    return NULL;
  size_t cl = pc_packed_len(rows), cr = pc_packed_len(cols);
  precond__roots_obj *o = malloc(sizeof(*o) + (cl + cr) * sizeof(float));
  if (o == NULL)
    return NULL;
  if ((b->left && decode_side(b->left, rows, o->values) != 0) ||
      (b->right && decode_side(b->right, cols, o->values + cl) != 0)) {
    free(o);
    return NULL;
  }
  atomic_init(&o->refs, 1);
  o->pub.block_id = b->block_id;
  o->pub.version = 0;  /* set when published */
  o->pub.daemon_version = b->version;
  o->pub.source_step = b->source_step;
  o->pub.error = b->error;
  o->pub.method = (precond_method)b->method;
  o->pub.iterations = b->iterations;
  o->pub.n_left = rows;
  o->pub.n_right = cols;
  o->pub.left = rows ? o->values : NULL;
  o->pub.right = cols ? o->values + cl : NULL;
  return o;
}
