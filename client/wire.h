/*
 * wire.h -- libprecond internal: decoding the daemon's FetchPreconditioners answers into
 * published roots objects. Not part of the public API (prefix precond__); used by client.c,
 * the unit tests and the fuzz harness (fuzz/fuzz_fetch_decode.c). Nothing here touches the
 * network: the input is a parsed response, which a broken or hostile daemon controls whole.
 */
#ifndef PRECOND_CLIENT_WIRE_H
#define PRECOND_CLIENT_WIRE_H

#include <stdatomic.h>
#include <stdint.h>

#include "precond.h"
#include "precond.pb-c.h"

/* A published version of a block's roots: the public view first, so a precond_roots pointer
 * is also a precond__roots_obj pointer. Freed by precond_roots_release when refs reach 0. */
typedef struct {
  precond_roots pub;
  atomic_int refs;
  float values[]; /* left, then right (K-FAC: a_inv, then g_inv) */
} precond__roots_obj;

/* Decodes one BlockRoots answer for a block whose registered factors are rows x rows and
 * cols x cols. Returns a new object with one reference (the caller owns it and releases it
 * with precond_roots_release), or NULL when the answer is malformed (an order that is not
 * the block's, a side missing unless its order is 0, a byte count that does not match the order and encoding,
 * an unknown encoding) or memory runs out. The size allocated is decided by rows and cols,
 * never by the answer. pub.version is 0: the caller numbers what it publishes. */
precond__roots_obj *precond__roots_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                             uint32_t cols);

/* The same for one K-FAC layer of rows x cols (G of order rows, A of order cols): both
 * a_inv (order cols) and g_inv (order rows) are required and no Shampoo side may be present;
 * pub.a_inv, pub.g_inv, pub.pi and pub.inverse are filled, left and right stay NULL. NULL
 * when malformed (an unknown inverse method or a non-finite pi included) or out of memory. */
precond__roots_obj *precond__kfac_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                            uint32_t cols);

#endif /* PRECOND_CLIENT_WIRE_H */
