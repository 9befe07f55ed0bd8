/*
 * optim_internal.h -- what the optimizer files of accel/ share; outside code must not
 * include it.
 */
#ifndef PRECOND_AC_OPTIM_INTERNAL_H
#define PRECOND_AC_OPTIM_INTERNAL_H

#include "optim.h"

/* Checks a parameter list: nparams >= 1 non-NULL entries whose value and grad are f32 of
 * one numel on one backend. On AC_OK writes that backend (*be) and the largest numel
 * (*max_numel; either may be NULL). AC_EINVAL or AC_EMISMATCH otherwise. */
int ac__optim_params_check(ac_param *const *params, size_t nparams, ac_backend **be,
                           size_t *max_numel);

/* ac__optim_params_check, and AC_EINVAL if a parameter appears twice in the list (it would
 * be updated twice per step): what every optimizer's create asks of its parameter list.
 * Quadratic: for create, not for every step. */
int ac__optim_params_usable(ac_param *const *params, size_t nparams, ac_backend **be,
                            size_t *max_numel);

/* A rate or decay factor in [lo, hi). */
int ac__optim_in_range(double x, double lo, double hi);

/* 1 if a learning rate is usable (finite, >= 0), else 0. */
int ac__optim_lr_ok(float lr);

/* 1 if momentum in [0, 1), nesterov 0 or 1 (and then momentum > 0), and weight decay
 * finite and >= 0; else 0. SGD and Shampoo share these options. */
int ac__optim_momentum_opts_ok(float momentum, int nesterov, float weight_decay);

/* Allocates a device buffer of n floats on be, zeroed, into *out; the caller frees it with
 * ac_free. */
int ac__optim_zeros(ac_backend *be, size_t n, float **out);

/* Heavy-ball momentum on n values of direction d: buf = mu buf + d, then the update
 * direction *u is buf, or with nesterov d + mu buf written to out (which may be d). */
int ac__optim_momentum(ac_backend *be, size_t n, float mu, int nesterov, const float *d, float *buf,
                       float *out, const float **u);

#endif /* PRECOND_AC_OPTIM_INTERNAL_H */
