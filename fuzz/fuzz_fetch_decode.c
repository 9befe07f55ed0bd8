/*
 * fuzz_fetch_decode.c -- libFuzzer harness: libprecond's decoding of FetchPreconditioners
 * answers (client/wire.c), i.e. what a broken or hostile daemon can make a training worker
 * do. The input is parsed as a FetchResponse; every BlockRoots is decoded against a fixed
 * table of block shapes, and what decodes must have exactly those shapes.
 */
#include <stdint.h>
#include <stdlib.h>

#include "precond.pb-c.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const uint32_t g_orders[8] = {1, 2, 3, 4, 7, 8, 16, 33};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  Precond__V1__FetchResponse *r = (Precond__V1__FetchResponse *)protobuf_c_message_unpack(
      &precond__v1__fetch_response__descriptor, NULL, size, data);
  if (!r) return 0;
  for (size_t i = 0; i < r->n_preconditioners; i++) {
    const Precond__V1__BlockRoots *b = r->preconditioners[i];
    uint32_t rows = g_orders[b->block_id % 8], cols = g_orders[(b->block_id / 8) % 8];
    precond__roots_obj *o = precond__roots_from_wire(b, rows, cols);
    if (!o) continue;
    if (o->pub.n_left != rows || o->pub.n_right != cols) abort();
    volatile float sink = o->pub.left[0] + o->pub.right[0]; /* both sides readable */
    (void)sink;
    precond_roots_release(&o->pub);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}
