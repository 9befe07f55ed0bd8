/*
 * schedule.c -- learning-rate schedules as pure functions of the step: linear warmup,
 * cosine decay (Loshchilov and Hutter, SGDR), step decay, and a warmup-then-decay
 * composition. Pure so that every worker of a job computes the same rate without state.
 */
#include <math.h>

#include "optim.h"

#define PI 3.14159265358979323846

double ac_lr_linear_warmup(double base_lr, long step, long warmup_steps) {
  if (warmup_steps <= 0 || step >= warmup_steps) return base_lr;
  if (step < 0) step = 0;
  return base_lr * (double)step / (double)warmup_steps;
}

double ac_lr_cosine_decay(double base_lr, double min_lr, long step, long decay_steps) {
  if (decay_steps <= 0) return base_lr;
  if (step < 0) step = 0;
  if (step > decay_steps) step = decay_steps;
  return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + cos(PI * (double)step / (double)decay_steps));
}

double ac_lr_step_decay(double base_lr, double gamma, long step, long step_size) {
  if (step_size <= 0 || step < 0) return base_lr;
  return base_lr * pow(gamma, (double)(step / step_size));
}

void ac_lr_schedule_default(ac_lr_schedule *sched, double base_lr) {
  if (sched == NULL) return;
  sched->base_lr = base_lr;
  sched->warmup_steps = 0;
  sched->decay = AC_LR_CONSTANT;
  sched->decay_steps = 1;
  sched->min_lr = 0.0;
  sched->step_size = 1;
  sched->gamma = 1.0;
}

int ac_lr_schedule_check(const ac_lr_schedule *sched) {
  if (sched == NULL || !(sched->base_lr > 0.0) || !isfinite(sched->base_lr) ||
      sched->warmup_steps < 0)
    return AC_EINVAL;
  switch (sched->decay) {
    case AC_LR_CONSTANT:
      return AC_OK;
    case AC_LR_COSINE:
      if (sched->decay_steps <= 0 || !(sched->min_lr >= 0.0 && sched->min_lr <= sched->base_lr))
        return AC_EINVAL;
      return AC_OK;
    case AC_LR_STEP:
      if (sched->step_size <= 0 || !(sched->gamma > 0.0 && sched->gamma <= 1.0)) return AC_EINVAL;
      return AC_OK;
  }
  return AC_EINVAL;
}

double ac_lr_schedule_at(const ac_lr_schedule *sched, long step) {
  if (step <= sched->warmup_steps)
    return ac_lr_linear_warmup(sched->base_lr, step, sched->warmup_steps);
  const long s = step - sched->warmup_steps;
  switch (sched->decay) {
    case AC_LR_COSINE:
      return ac_lr_cosine_decay(sched->base_lr, sched->min_lr, s, sched->decay_steps);
    case AC_LR_STEP:
      return ac_lr_step_decay(sched->base_lr, sched->gamma, s, sched->step_size);
    default:
      return sched->base_lr;
  }
}
