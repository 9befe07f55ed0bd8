/*
 * optim_internal.h -- what the optimizer files of accel/ share; outside code must not
 * include it.
 */
#ifndef PRECOND_AC_OPTIM_INTERNAL_H
#define PRECOND_AC_OPTIM_INTERNAL_H

#include "accel.h"

/* Checks a parameter list: nparams >= 1 non-NULL entries whose value and grad are f32 of
 * one numel on one backend. On AC_OK writes that backend (*be) and the largest numel
 * (*max_numel; either may be NULL). AC_EINVAL or AC_EMISMATCH otherwise. */
int ac__optim_params_check(ac_param *const *params, size_t nparams, ac_backend **be,
                           size_t *max_numel);

/* AC_OK if no parameter appears twice in the list (it would be updated twice per step),
 * else AC_EINVAL. Quadratic: for create, not for every step. */
int ac__optim_params_distinct(ac_param *const *params, size_t nparams);

/* A rate or decay factor in [lo, hi). */
int ac__optim_in_range(double x, double lo, double hi);

#endif /* PRECOND_AC_OPTIM_INTERNAL_H */
