/*
 * mode_kfac.c -- K-FAC (Martens & Grosse 2015), the second entry of the mode table.
 *
 * Units are layers: one per tensor of rank >= 2, whose shape is the layer's gradient matrix
 * [out, in...] with the bias, if any, as one more input column (the layout of
 * preconditioner.h's K-FAC section), so A has order in (+1 with a bias) = the product of
 * dims[1..] and G order out = dims[0]. Rank-1 tensors (biases on their own, batch norm's
 * gamma and beta) and layers with a factor above max_order have no unit: batch norm's
 * diagonal Fisher is computed and applied on the worker, the daemon never sees it.
 *
 * Two parts: A and G, running averages of the pushed batch factors (pc_kfac_fold: the
 * first push is taken as is). A computation gives the damped inverses (A + pi sqrt(lambda)
 * I)^-1 and (G + sqrt(lambda)/pi I)^-1 (pi-damping, pc_kfac_damping_split), published like
 * roots; it is queued every inv_every pushes (and at every push until the first inverse is
 * published: a worker without one cannot precondition at all). A failed inverse keeps the
 * previous one and is counted (the pool's rule). Every default comes from
 * pc_kfac_opts_default: this file holds no number of its own but the size limit.
 */
#include "precondd.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"

_Static_assert(sizeof(pd_kfac_opts) <= PD_MODE_OPTS_MAX, "pd_kfac_opts too large");

/* A factor of order n takes n(n+1)/2 floats; 8192 keeps one at 128 MiB (as Shampoo's). */
#define PD_KFAC_MAX_ORDER 8192u

/* The library's options for ours: the defaults and rules of pc_kfac_opts stay one source. */
static void kfac_lib_opts(const pd_kfac_opts *o, pc_kfac_opts *po) {
  pc_kfac_opts_default(po);
  po->factor_decay = o->factor_decay;
  po->damping = o->damping;
  po->pi_damping = !o->no_pi_damping;
  po->inv_every = (long)o->inv_every;
}

static int kfac_resolve(void *opts, char *err, size_t errlen) {
  pd_kfac_opts *o = opts;
  pc_kfac_opts def;
  pc_kfac_opts_default(&def);
  /* Zero (unset on the wire) takes the library's default (pi-damping on: no_pi_damping
   * is 0). */
  if (o->factor_decay == 0.0) o->factor_decay = def.factor_decay;
  if (o->damping == 0.0) o->damping = def.damping;
  if (!o->inv_every) o->inv_every = (uint32_t)def.inv_every;
  if (!o->max_order) o->max_order = 4096;
  if (o->no_pi_damping != 0 && o->no_pi_damping != 1) {
    snprintf(err, errlen, "kfac.no_pi_damping: %d is not a boolean", o->no_pi_damping);
    return PD_EINVAL;
  }
  pc_kfac_opts po;
  kfac_lib_opts(o, &po);
  if (!(o->factor_decay >= 0.0 && o->factor_decay < 1.0)) {
    snprintf(err, errlen, "kfac.factor_decay: %g is not in [0, 1)", o->factor_decay);
    return PD_EINVAL;
  }
  if (!(o->damping > 0.0 && isfinite(o->damping))) {
    snprintf(err, errlen, "kfac.damping: %g is not positive and finite", o->damping);
    return PD_EINVAL;
  }
  if (o->max_order > PD_KFAC_MAX_ORDER) {
    snprintf(err, errlen, "kfac.max_order: %u is above the limit %u", o->max_order,
             PD_KFAC_MAX_ORDER);
    return PD_EINVAL;
  }
  if (o->inverse < PD_KFAC_INVERSE_AUTO || o->inverse > PD_KFAC_INVERSE_NEWTON) {
    snprintf(err, errlen, "kfac.inverse: %d is not a known method", o->inverse);
    return PD_EINVAL;
  }
  if (pc_kfac_opts_check(&po) != PC_OK) { /* any rule of the library's not restated here */
    snprintf(err, errlen, "kfac: options refused by pc_kfac_opts_check");
    return PD_EINVAL;
  }
  return PD_OK;
}

/* A's and G's orders of tensor t, or 0 when the tensor has no unit (rank 1, a factor
 * above max_order, or a zero dim). Products of dims are bounded by the store's checks. */
static void kfac_orders(const pd_kfac_opts *o, const pd_tensor *t, uint64_t *na, uint64_t *ng) {
  *na = *ng = 0;
  if (t->rank < 2) return;
  uint64_t in = 1;
  for (int k = 1; k < t->rank; k++) in *= t->dims[k];
  if (in == 0 || t->dims[0] == 0 || in > o->max_order || t->dims[0] > o->max_order) return;
  *na = in;
  *ng = t->dims[0];
}

static int kfac_layout(const void *opts, size_t ntensors, const pd_tensor *tensors,
                       uint32_t max_units, pd_unit_shape *units, size_t *nunits, uint32_t *diag,
                       size_t *ndiag, char *err, size_t errlen) {
  const pd_kfac_opts *o = opts;
  size_t n = 0, nd = 0;
  for (size_t i = 0; i < ntensors; i++) {
    uint64_t na, ng;
    kfac_orders(o, &tensors[i], &na, &ng);
    if (!na) {
      if (units) diag[nd++] = (uint32_t)i;
      continue;
    }
    if (n + 1 > max_units) {
      snprintf(err, errlen, "tensors[%zu]: the job would have more than %u layers", i, max_units);
      return PD_ELIMIT;
    }
    /* rows x cols is the layer's gradient matrix (out x in), as Shampoo's block of it. */
    if (units)
      units[n] = (pd_unit_shape){.tensor = (uint32_t)i,
                                 .row0 = 0,
                                 .rows = ng,
                                 .col0 = 0,
                                 .cols = na,
                                 .nparts = 2,
                                 .order = {na, ng}};
    n++;
  }
  *nunits = n;
  if (units) *ndiag = nd;
  return PD_OK;
}

static void kfac_fold(const void *opts, const pd_block *u, float *const *state,
                      const float *const *inc) {
  double decay = ((const pd_kfac_opts *)opts)->factor_decay;
  for (uint32_t k = 0; k < u->nparts; k++)
    pc_kfac_fold_f32(pc_packed_len(u->order[k]), state[k], inc[k], decay, u->pushes == 0);
}

/* 1 if the fold keeps every value finite: a convex combination of finite floats cannot
 * overflow but for rounding at the very top of the range, hence the same margin below
 * FLT_MAX as Shampoo's test. */
static int kfac_fold_fits(const void *opts, const pd_block *u, const float *const *state,
                          const float *const *inc) {
  double decay = ((const pd_kfac_opts *)opts)->factor_decay;
  const double limit = (double)FLT_MAX * (1.0 - 1.0 / 1048576.0);
  double b = u->pushes == 0 ? 0.0 : decay, w = u->pushes == 0 ? 1.0 : 1.0 - decay;
  for (uint32_t k = 0; k < u->nparts; k++)
    for (size_t i = 0; i < pc_packed_len(u->order[k]); i++)
      if (!(fabs(b * (double)state[k][i] + w * (double)inc[k][i]) <= limit)) return 0;
  return 1;
}

static pc_kfac_inv kfac_method(const pd_kfac_opts *o, size_t n) {
  if (o->inverse == PD_KFAC_INVERSE_AUTO) {
    pc_kfac_opts po;
    kfac_lib_opts(o, &po);
    return pc_kfac_inv_for_size(&po, n);
  }
  return (pc_kfac_inv)(o->inverse - 1);
}

static int kfac_compute(const void *opts, const pd_block *u, const float *const *state,
                        void **unit_state, float *const *out, pd_compute_info *info) {
  (void)unit_state;
  const pd_kfac_opts *o = opts;
  memset(info, 0, sizeof *info);
  info->failed_part = -1;
  pc_kfac_damping dmp;
  int rc = pc_kfac_damping_split(u->order[0], pc_kfac_trace_f32(u->order[0], state[0]), u->order[1],
                                 pc_kfac_trace_f32(u->order[1], state[1]), o->damping,
                                 !o->no_pi_damping, &dmp);
  if (rc < 0) {
    info->error = NAN;
    return rc;
  }
  info->aux[PD_KFAC_AUX_PI] = dmp.pi;
  info->aux[PD_KFAC_AUX_DAMP_A] = dmp.damp_a;
  info->aux[PD_KFAC_AUX_DAMP_G] = dmp.damp_g;
  uint64_t nmax = u->order[0] > u->order[1] ? u->order[0] : u->order[1];
  float *x = malloc(nmax * nmax * sizeof *x);
  if (!x) return PC_ENOMEM;
  const double damp[2] = {dmp.damp_a, dmp.damp_g};
  /* A, then G; the worst error stands for both, the method is A's (both sizes usually pick
   * the same one; describe and stats name the option). */
  for (uint32_t k = 0; k < u->nparts && rc >= 0; k++) {
    size_t n = u->order[k];
    pc_kfac_inv method = kfac_method(o, n);
    pc_kfac_inv_info ii;
    memset(&ii, 0, sizeof ii);
    int rk = pc_kfac_inverse_f32(n, state[k], damp[k], method, x, &ii);
    if (rk >= 0) pc_pack_f32(n, x, out[k]);
    if (rk != PC_OK) rc = rk;
    if (rk < 0) info->failed_part = (int)k;
    if (k == 0) info->method = (int)method;
    if (!(ii.error <= info->error)) info->error = ii.error; /* NaN wins */
    if ((uint32_t)ii.iters > info->iterations) info->iterations = (uint32_t)ii.iters;
  }
  free(x);
  return rc;
}

static int kfac_compute_due(const void *opts, const pd_block *u, uint64_t pushes, uint64_t step,
                            uint64_t due_step, int has_root) {
  (void)u, (void)step, (void)due_step;
  uint32_t every = ((const pd_kfac_opts *)opts)->inv_every;
  return !has_root || pushes % every == 0;
}

/* Snapshot section: f64 factor_decay | f64 damping | u32 inv_every | u32 no_pi_damping |
 * u32 inverse | u32 max_order (32 bytes). */
static void kfac_snap_write(const void *opts, unsigned char *out) {
  const pd_kfac_opts *o = opts;
  uint64_t decay, damping;
  memcpy(&decay, &o->factor_decay, 8);
  memcpy(&damping, &o->damping, 8);
  pd_le_put(out, decay, 8);
  pd_le_put(out + 8, damping, 8);
  pd_le_put(out + 16, o->inv_every, 4);
  pd_le_put(out + 20, (uint32_t)o->no_pi_damping, 4);
  pd_le_put(out + 24, (uint32_t)o->inverse, 4);
  pd_le_put(out + 28, o->max_order, 4);
}

static void kfac_snap_read(const unsigned char *in, void *opts) {
  pd_kfac_opts *o = opts;
  uint64_t decay = pd_le_get(in, 8), damping = pd_le_get(in + 8, 8);
  memcpy(&o->factor_decay, &decay, 8);
  memcpy(&o->damping, &damping, 8);
  o->inv_every = (uint32_t)pd_le_get(in + 16, 4);
  o->no_pi_damping = (int)(int32_t)(uint32_t)pd_le_get(in + 20, 4);
  o->inverse = (int)(int32_t)(uint32_t)pd_le_get(in + 24, 4);
  o->max_order = (uint32_t)pd_le_get(in + 28, 4);
}

static void kfac_describe(const void *opts, char *buf, size_t len) {
  const pd_kfac_opts *o = opts;
  snprintf(buf, len,
           "factor decay %g, damping %g, pi-damping %s, inverses every %u pushes, method %s, "
           "max order %u",
           o->factor_decay, o->damping, o->no_pi_damping ? "off" : "on", o->inv_every,
           o->inverse == PD_KFAC_INVERSE_AUTO ? "by size"
                                              : pc_kfac_inv_name((pc_kfac_inv)(o->inverse - 1)),
           o->max_order);
}

const pd_mode pd_mode_kfac = {
    .name = "kfac",
    .id = PD_MODE_KFAC,
    .part_names = {"A factor", "G factor"},
    .opts_size = sizeof(pd_kfac_opts),
    .resolve = kfac_resolve,
    .layout = kfac_layout,
    .fold = kfac_fold,
    .fold_fits = kfac_fold_fits,
    .compute = kfac_compute,
    .unit_free = NULL,
    .publishable = pd_publishable_finite, /* Shampoo's rule: the same for inverses */
    .snap_bytes = 32,
    .snap_write = kfac_snap_write,
    .snap_read = kfac_snap_read,
    .describe = kfac_describe,
    /* (A + d I)^-1 does not scale with A, and inv_every already spaces the computations. */
    .drift_test = 0,
    .compute_due = kfac_compute_due,
};
