/*
 * mode_identity.c -- a toy mode: the whole of what adding a mode to precondd takes (this
 * file and one line in modes.c's table). Not on the wire (the .proto has no value for it):
 * tests/host/test_modes.c drives it through the store, the pool and a snapshot.
 *
 * One unit per tensor with one part of order dims[0] (tensors with dims[0] above 256 get
 * none); a push adds its increment; the result is scale times the sum.
 */
#include "precondd.h"

#include <math.h>
#include <string.h>

#include "preconditioner.h"

typedef struct {
  float scale; /* 0: the default 1 */
} identity_opts;

_Static_assert(sizeof(identity_opts) <= PD_MODE_OPTS_MAX, "identity_opts too large");

#define IDENTITY_MAX_ORDER 256u

static int identity_resolve(void *opts, char *err, size_t errlen) {
  identity_opts *o = opts;
  if (o->scale == 0.0f) o->scale = 1.0f;
  if (!isfinite(o->scale)) {
    snprintf(err, errlen, "identity.scale: %g is not finite", (double)o->scale);
    return PD_EINVAL;
  }
  return PD_OK;
}

static int identity_layout(const void *opts, size_t ntensors, const pd_tensor *tensors,
                           uint32_t max_units, pd_unit_shape *units, size_t *nunits, uint32_t *diag,
                           size_t *ndiag, char *err, size_t errlen) {
  (void)opts;
  size_t n = 0, nd = 0;
  for (size_t i = 0; i < ntensors; i++) {
    if (tensors[i].dims[0] > IDENTITY_MAX_ORDER) {
      if (units) diag[nd++] = (uint32_t)i;
      continue;
    }
    if (n + 1 > max_units) {
      snprintf(err, errlen, "tensors[%zu]: the job would have more than %u units", i, max_units);
      return PD_ELIMIT;
    }
    if (units)
      units[n] = (pd_unit_shape){.tensor = (uint32_t)i,
                                 .rows = tensors[i].dims[0],
                                 .cols = 1,
                                 .nparts = 1,
                                 .order = {tensors[i].dims[0]}};
    n++;
  }
  *nunits = n;
  if (units) *ndiag = nd;
  return PD_OK;
}

static void identity_fold(const void *opts, const pd_block *u, float *const *state,
                          const float *const *inc) {
  (void)opts;
  for (size_t i = 0; i < pc_packed_len(u->order[0]); i++) state[0][i] += inc[0][i];
}

static int identity_fold_fits(const void *opts, const pd_block *u, const float *const *state,
                              const float *const *inc) {
  (void)opts;
  for (size_t i = 0; i < pc_packed_len(u->order[0]); i++)
    if (!isfinite(state[0][i] + inc[0][i])) return 0;
  return 1;
}

static int identity_compute(const void *opts, const pd_block *u, const float *const *state,
                            void **unit_state, float *const *out, pd_compute_info *info) {
  (void)unit_state;
  float scale = ((const identity_opts *)opts)->scale;
  for (size_t i = 0; i < pc_packed_len(u->order[0]); i++) out[0][i] = scale * state[0][i];
  *info = (pd_compute_info){.error = 0, .iterations = 0, .method = 0, .failed_part = -1};
  return PC_OK;
}

static int identity_publishable(const void *opts, const pd_block *u, int status,
                                const pd_compute_info *info, const float *const *out,
                                double failure_threshold) {
  (void)opts;
  (void)info;
  (void)failure_threshold;
  return status >= 0 && pc_all_finite_f32(pc_packed_len(u->order[0]), out[0]);
}

static void identity_snap_write(const void *opts, unsigned char *out) {
  uint32_t bits;
  memcpy(&bits, &((const identity_opts *)opts)->scale, 4);
  pd_le_put(out, bits, 4);
}

static void identity_snap_read(const unsigned char *in, void *opts) {
  uint32_t bits = (uint32_t)pd_le_get(in, 4);
  memcpy(&((identity_opts *)opts)->scale, &bits, 4);
}

static void identity_describe(const void *opts, char *buf, size_t len) {
  snprintf(buf, len, "scale %g", (double)((const identity_opts *)opts)->scale);
}

const pd_mode pd_mode_identity = {
    .name = "identity",
    .id = PD_MODE_IDENTITY,
    .part_names = {"sum"},
    .opts_size = sizeof(identity_opts),
    .resolve = identity_resolve,
    .layout = identity_layout,
    .fold = identity_fold,
    .fold_fits = identity_fold_fits,
    .compute = identity_compute,
    .unit_free = NULL,
    .publishable = identity_publishable,
    .snap_bytes = 4,
    .snap_write = identity_snap_write,
    .snap_read = identity_snap_read,
    .describe = identity_describe,
    .drift_test = 0,
};
