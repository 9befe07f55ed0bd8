/*
 * modes.c -- the mode table: one entry per mode precondd serves. Adding a mode is a file
 * host/mode_NAME.c defining its pd_mode and one line here (see mode_identity.c). K-FAC
 * (issue 10) comes in as mode_kfac.c: units per layer with parts A and G, results their
 * damped inverses; ABS as mode_abs.c with one job-level unit (tensor UINT32_MAX).
 */
#include "precondd.h"

#include <math.h>

#include "preconditioner.h"

extern const pd_mode pd_mode_identity;

static const pd_mode *const pd__modes[] = {
    &pd_mode_shampoo,
    &pd_mode_kfac,
    &pd_mode_identity,
};

const pd_mode *pd_mode_find(int id) {
  for (size_t i = 0; i < sizeof pd__modes / sizeof pd__modes[0]; i++)
    if ((int)pd__modes[i]->id == id) return pd__modes[i];
  return NULL;
}

int pd_publishable_finite(const void *opts, const pd_block *u, int status,
                          const pd_compute_info *info, const float *const *out,
                          double failure_threshold) {
  (void)opts;
  if (status < 0 || !isfinite(info->error) || !(info->error <= failure_threshold)) return 0;
  for (uint32_t k = 0; k < u->nparts; k++)
    if (!pc_all_finite_f32(pc_packed_len(u->order[k]), out[k])) return 0;
  return 1;
}
