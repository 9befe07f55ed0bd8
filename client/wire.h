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

/* The daemon's roots area (rpc_shm.roots), mapped read-only, once roots handed out by
 * reference point into it (precond_options.roots_by_reference): the client's region holds
 * one reference and each such roots object one, and the last release unmaps it, so a
 * region closed (a daemon restart) never pulls the bytes from under a reader. */
typedef struct {
  atomic_int refs;
  const unsigned char *map;
  size_t bytes;
} precond__area;

/* A holder of the mapping (map, bytes) with one reference; NULL when memory runs out (the
 * mapping is then still the caller's). */
precond__area *precond__area_new(const unsigned char *map, size_t bytes);
/* Drops one reference; the last one unmaps the area and frees the holder. NULL: no-op. */
void precond__area_release(precond__area *a);

/* A published version of a block's roots: the public view first, so a precond_roots pointer
 * is also a precond__roots_obj pointer. Freed by precond_roots_release when refs reach 0.
 * By reference (area set): pub's sides point into the area, at the publications ref names,
 * and values is empty. */
typedef struct {
  precond_roots pub;
  atomic_int refs;
  precond__area *area;        /* by reference: one reference held; NULL: a copy in values */
  Precond__V1__ShmRef ref[2]; /* by reference: the entries of the two sides */
  float values[];             /* left, then right (K-FAC: a_inv, then g_inv) */
} precond__roots_obj;

/* Decodes one BlockRoots answer for a block whose registered factors are rows x rows and
 * cols x cols. Returns a new object with one reference (the caller owns it and releases it
 * with precond_roots_release), or NULL when the answer is malformed (an order that is not
 * the block's, a side missing unless its order is 0, a byte count that does not match the order and encoding,
 * an unknown encoding) or memory runs out. The size allocated is decided by rows and cols,
 * never by the answer. pub.version is 0: the caller numbers what it publishes. */
precond__roots_obj *precond__roots_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                             uint32_t cols);

/* A Shampoo answer for a block of rows x cols whose two sides lie in the daemon's roots
 * area (rpc_shm_fetch_in pointed their data there: ShmRef.seq set), fp32 and float-aligned,
 * of the block's orders: a new object (one reference) whose pub.left and pub.right point at
 * those bytes, no copy, holding a reference to area (the area they lie in). NULL when the
 * answer is not such (the caller decodes a copy: precond__roots_from_wire) or memory runs
 * out. precond_roots_intact then says whether the bytes are still the ones published. */
precond__roots_obj *precond__roots_by_ref(const Precond__V1__BlockRoots *b, uint32_t rows,
                                          uint32_t cols, precond__area *area);

/* The same for one K-FAC layer of rows x cols (G of order rows, A of order cols): both
 * a_inv (order cols) and g_inv (order rows) are required and no Shampoo side may be present;
 * pub.a_inv, pub.g_inv, pub.pi and pub.inverse are filled, left and right stay NULL. NULL
 * when malformed (an unknown inverse method or a non-finite pi included) or out of memory.
 * dense 1: both inverses whole (pub.kfac_dense; precond_options.kfac_dense), the same
 * floats as the packed ones in both triangles. */
precond__roots_obj *precond__kfac_from_wire(const Precond__V1__BlockRoots *b, uint32_t rows,
                                            uint32_t cols, int dense);

#endif /* PRECOND_CLIENT_WIRE_H */
