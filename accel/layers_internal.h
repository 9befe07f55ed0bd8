/*
 * layers_internal.h -- helpers shared by the layer and model files (accel/layers_*.c,
 * accel/model.c). Not part of the public API; outside code must not include it.
 */
#ifndef PRECOND_ACCEL_LAYERS_INTERNAL_H
#define PRECOND_ACCEL_LAYERS_INTERNAL_H

#include "layers.h"

/* Runs a status-returning call and jumps to the function's one cleanup label on error. */
#define AC__TRY(expr)           \
  do {                          \
    rc = (expr);                \
    if (rc != AC_OK) goto fail; \
  } while (0)

/* n floats of device memory into *out (NULL for n == 0); the caller frees with
 * ac__layer_free. */
int ac__layer_alloc(ac_backend *be, size_t n, float **out);
/* Frees *p (if not NULL) and sets it to NULL. */
void ac__layer_free(ac_backend *be, float **p);

/* Initialises p as "<prefix>.<suffix>" with the given shape (value and grad zero).
 * AC_EINVAL if the joined name is too long. */
int ac__param_named(ac_param *p, ac_backend *be, const char *prefix, const char *suffix, int ndim,
                    const size_t *shape);

/* Joins "<prefix>.<suffix>" into buf (size bytes); AC_EINVAL if it does not fit. */
int ac__join_name(char *buf, size_t size, const char *prefix, const char *suffix);

/* A seed for sub-layer i of a layer or model seeded with seed (distinct streams). */
uint64_t ac__sub_seed(uint64_t seed, uint64_t i);

#endif
