/*
 * train.c -- the training harness of the benchmark clients: options, loop, progress line,
 * CSV/JSON output, and the optimizers as the clients name their options. Shampoo runs
 * through the trainer library (trainer/trainer.h: accel's worker half joined to precondd);
 * this file only maps the harness's options onto it and reports its figures.
 */
#include "train.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "rpc.h" /* rpc_json_string: the one JSON escaper (proto/json.c says why there) */

const char *tr_strerror(int status) {
  switch (status) {
    case TR_OK:
      return "success";
    case TR_EINVAL:
      return "invalid argument";
    case TR_EIO:
      return "file could not be written";
    case TR_ENOMEM:
      return "out of memory";
    case TR_EACCEL:
      return "accelerator call failed";
    case TR_EDAEMON:
      return "precondd unreachable or refused the call";
    case TR_EMODEL:
      return "model step failed";
    case TR_ENONFINITE:
      return "training loss is not finite";
    case TR_EHELP:
      return "help requested";
  }
  return "unknown status";
}

/* Writes a formatted message into err (if any) and returns status. */
static int tr__fail(tr_error *err, int status, const char *fmt, ...) {
  if (err == NULL) return status;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  return status;
}

static double tr__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU seconds of clock c: the process's (all threads) or the calling thread's. */
static double tr__clock_s(clockid_t c) {
  struct timespec ts;
  clock_gettime(c, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double tr__cpu_now(void) {
  return tr__clock_s(CLOCK_PROCESS_CPUTIME_ID);
}

const char *tr_optimizer_name(tr_optimizer_kind kind) {
  switch (kind) {
    case TR_SGD:
      return "sgd";
    case TR_ADAMW:
      return "adamw";
    case TR_SHAMPOO:
      return "shampoo";
    case TR_KFAC:
      return "kfac";
    case TR_ABS:
      return "abs";
  }
  return "?";
}

/* ==================================================================================== */
/* Options                                                                                */

void tr_options_default(tr_options *o) {
  memset(o, 0, sizeof *o);
  o->model = NULL;
  o->optimizer = TR_ADAMW;
  o->steps = 200;
  o->stop_at = 0;
  o->epochs = 0;
  o->lr = TR_UNSET;
  o->momentum = TR_UNSET;
  o->beta1 = TR_UNSET;
  o->beta2 = TR_UNSET;
  o->eps = 1e-8;
  o->weight_decay = TR_UNSET;
  o->clip = 0;
  o->warmup = -1;
  o->schedule = AC_LR_COSINE;
  o->lr_floor = 0;
  o->step_size = 0;
  o->step_gamma = 0.1;
  o->nesterov = -1;
  /* Shampoo's defaults are accel's (ac_shampoo_opts_default, their one table) */
  ac_shampoo_opts so;
  ac_shampoo_opts_default(&so);
  o->block_size = (long)so.layout.block_size;
  o->stat_beta2 = so.beta2;
  o->shampoo_eps = so.epsilon;
  o->graft = (int)so.graft.kind;
  o->shampoo_momentum = so.momentum;
  o->shampoo_beta1 = TR_UNSET; /* the table's, else so.beta1 (tr_options_resolve) */
  o->shampoo_nesterov = so.beta1_nesterov;
  o->one_sided = so.one_sided;
  o->root_method = so.root_method == PC_METHOD_EIGH;
  o->root_exponent = so.root_exponent;
  o->stat_every = so.stats_interval;
  o->roots_start = so.start_step;
  o->max_staleness = so.max_staleness;
  o->sync_roots = 0;
  o->root_delay = 0;
  o->sync_first = TR_UNSET; /* the table's for one worker (tr_sync_first) */
  o->root_every = TR_UNSET; /* the table's (tr_options_resolve) */
  pc_kfac_opts ko;
  pc_kfac_opts_default(&ko);
  o->kfac_damping = ko.damping;
  o->kfac_decay = ko.factor_decay;
  o->kl_clip = ko.kl_clip;
  o->kl_base_lr = ko.kl_base_lr;
  o->kfac_pi = ko.pi_damping;
  o->inv_every = TR_UNSET; /* the table's, else ko's (tr_options_resolve) */
  o->factor_every = ko.factor_every;
  o->factor_every_first = TR_UNSET; /* the same */
  o->factor_first_epochs = ko.first_epochs;
  o->epoch_steps = 0;
  o->kfac_bf16 = 0;
  pt_options po; /* the trainer's own K-FAC defaults (pt_options_default: one source) */
  pt_options_default(&po, PT_MODE_KFAC);
  o->kfac_a_images = (long)po.kfac.a_images;
  o->kfac_rows = (long)po.kfac.dense_rows;
  o->kfac_row_sample = (int)po.kfac.row_sample;
  const char *addr = getenv("PRECOND_ADDR");
  snprintf(o->daemon, sizeof o->daemon, "%s",
           addr != NULL && addr[0] != '\0' ? addr : "127.0.0.1:50551");
  o->seed = 1;
  o->backend = AC_BACKEND_CPU;
  o->threads = 1;
  o->eval_every = 0;
  o->eval_batches = 0;
  o->quiet = 0;
}

/* The defaults that depend on the model and the optimizer: the one table of them.
 * - ResNet + SGD: momentum 0.9, Nesterov, weight decay 5e-4 (L2), lr 0.1: the CIFAR ResNet
 *   recipe (He et al. 2016) as torchvision's references train it; no warm-up (batch norm).
 * - Transformer + AdamW: betas 0.9/0.99 (beta2 0.99 as nanoGPT's small character-level
 *   models: the second moment follows a fast-moving loss), 100 warm-up steps as the issue's
 *   reference protocol; no weight decay (it measured without).
 * - Shampoo: lr 3e-3 and its graft's betas 0.9/0.999, the measured winners
 *   (docs/optimizers.md; the rest of its defaults are ac_shampoo_opts_default's). On the
 *   Transformer a 50-step warm-up: ahead of 100 from the first evaluation on, about 12
 *   steps earlier to AdamW's final loss on two seeds (docs/optimizers.md, "Session 7"),
 *   while AdamW loses with 50 (its final eval loss 0.013 higher), so each keeps its own.
 *   And a first moment of 0.8 instead of accel's 0.9: 0.013 and 0.002 lower eval loss at
 *   step 500 on seeds 1 and 2, lower at step 550 on three seeds (0.95: 0.014 higher;
 *   docs/optimizers.md, "Session 10"). The ResNet's row keeps accel's 0.9, with which W2
 *   was measured. And the first 25 steps wait for their own roots (--sync-first; a short
 *   run a fortieth of its steps): with asynchronous roots, eval at step 500 0.0065 lower on
 *   average over two alternated pairs on quiet cores (seed 1), and lower on three seeds with
 *   one step of staleness made exact (--root-delay 1), for 0.3%-1% more wall time
 *   (docs/optimizers.md, "Session 11"). A worker alone only: data-parallel workers agree on
 *   asynchronous roots from their first step (pt_create refuses sync_first there).
 *   On the ResNet precondd recomputes a block's roots once per 10 statistics steps
 *   (--root-every, windows offset by block: about 6 of its 61 blocks a step): on two cores
 *   the roots of every push took 85-100 ms of the daemon's CPU per step from a worker that
 *   keeps both cores busy, 10-16 ms at 10 (under load), and the one-epoch accuracy with
 *   asynchronous roots was 0.9048 and 0.9080 on seeds 1 and 2 (docs/optimizers.md, "W2 ...
 *   session 12"). The Transformer keeps every push (W1 was measured so).
 * - K-FAC: SGD's recipe on the preconditioned gradient (momentum 0.9, weight decay 5e-4 as
 *   L2 for the ResNet, KAISA's CIFAR setting); the KL clip bounds the step, so no warm-up
 *   on the ResNet. The Transformer row is SGD's, not tuned, but for its schedule: factors
 *   every 2 steps, 2.8-2.9 ms less CPU a step than every step (docs/kfac.md, "Session
 *   15"), with inverses every 4 pushes (every 8 steps; the numerics core's every step and 10
 *   pushes): deterministic (--sync-roots) at 1000 steps, final eval losses 1.4763 and
 *   1.4630 on seeds 1 and 2 and AdamW's final reached at step 700 on both, where every 5
 *   pushes reached it at 750 on seed 2 and the core's schedule at 750 on seed 1 (finals
 *   1.4902 and 1.4679). The ResNet keeps the core's (not measured with it).
 * - ABS: SGD's row (its step is SGD's at the batch and learning rate the rule sets).
 * - The generic rows (another model) keep each optimizer's textbook defaults.
 * Shampoo's grafted Adam takes beta1/beta2 from its row; the schedule (cosine after the
 * warm-up, tr_options_default) is the same for every optimizer. */
typedef struct {
  const char *model; /* NULL: any model without a row of its own */
  tr_optimizer_kind optimizer;
  double lr, momentum, beta1, beta2, weight_decay;
  int nesterov;
  long warmup;
  double first_moment; /* Shampoo's first moment (--shampoo-beta1); TR_UNSET: accel's default */
  long sync_first;     /* Shampoo: the first steps that wait for their own roots (--sync-first) */
  long root_every;     /* Shampoo: precondd's roots every N steps per block (--root-every) */
  long factor_every_first; /* K-FAC: factors every N steps in the first epochs
                              (--factor-every-first); 0: pc_kfac_opts_default's */
  long inv_every;          /* K-FAC: inverses every N pushes (--inv-every); 0: the same */
} tr__preset;

static const tr__preset tr__presets[] = {
    /* model          optimizer   lr    mom  beta1 beta2  wd   nest warmup fm sync_first root_every fef inv */
    {"resnet", TR_SGD, 0.1, 0.9, 0.9, 0.999, 5e-4, 1, 0, TR_UNSET, 0, 1, 0, 0},
    {"resnet", TR_ADAMW, 1e-3, 0.9, 0.9, 0.999, 0, 0, 0, TR_UNSET, 0, 1, 0, 0},
    {"resnet", TR_SHAMPOO, 3e-3, 0.9, 0.9, 0.999, 0, 0, 0, TR_UNSET, 0, 10, 0, 0},
    {"resnet", TR_KFAC, 0.1, 0.9, 0.9, 0.999, 5e-4, 0, 0, TR_UNSET, 0, 1, 0, 0},
    {"resnet", TR_ABS, 0.1, 0.9, 0.9, 0.999, 5e-4, 1, 0, TR_UNSET, 0, 1, 0, 0},
    {"transformer", TR_SGD, 0.1, 0.9, 0.9, 0.99, 0, 1, 100, TR_UNSET, 0, 1, 0, 0},
    {"transformer", TR_ADAMW, 1e-3, 0.9, 0.9, 0.99, 0, 0, 100, TR_UNSET, 0, 1, 0, 0},
    {"transformer", TR_SHAMPOO, 3e-3, 0.9, 0.9, 0.999, 0, 0, 50, 0.8, 25, 1, 0, 0},
    {"transformer", TR_KFAC, 0.1, 0.9, 0.9, 0.99, 0, 0, 100, TR_UNSET, 0, 1, 2, 4},
    {NULL, TR_SGD, 0.1, 0.9, 0.9, 0.999, 0, 0, 0, TR_UNSET, 0, 1, 0, 0},
    {NULL, TR_ADAMW, 1e-3, 0.9, 0.9, 0.999, 0, 0, 0, TR_UNSET, 0, 1, 0, 0},
    {NULL, TR_SHAMPOO, 3e-3, 0.9, 0.9, 0.999, 0, 0, 0, TR_UNSET, 0, 1, 0, 0},
    {NULL, TR_KFAC, 0.1, 0.9, 0.9, 0.999, 0, 0, 0, TR_UNSET, 0, 1, 0, 0},
    {NULL, TR_ABS, 0.1, 0.9, 0.9, 0.999, 0, 0, 0, TR_UNSET, 0, 1, 0, 0},
};
#define TR__NPRESETS (sizeof tr__presets / sizeof tr__presets[0])

/* The row of (model, optimizer), else the generic row of the optimizer. */
static const tr__preset *tr__preset_of(const char *model, tr_optimizer_kind kind) {
  const tr__preset *generic = &tr__presets[0];
  for (size_t i = 0; i < TR__NPRESETS; i++) {
    const tr__preset *p = &tr__presets[i];
    if (p->optimizer != kind) continue;
    if (p->model == NULL)
      generic = p;
    else if (model != NULL && strcmp(p->model, model) == 0)
      return p;
  }
  return generic;
}

void tr_options_resolve(tr_options *o) {
  const tr__preset *p = tr__preset_of(o->model, o->optimizer);
  if (o->lr < 0) o->lr = p->lr;
  if (o->momentum < 0) o->momentum = p->momentum;
  if (o->beta1 < 0) o->beta1 = p->beta1;
  if (o->beta2 < 0) o->beta2 = p->beta2;
  if (o->weight_decay < 0) o->weight_decay = p->weight_decay;
  if (o->shampoo_beta1 < 0) {
    ac_shampoo_opts so; /* a row without its own first moment takes accel's default */
    ac_shampoo_opts_default(&so);
    o->shampoo_beta1 = p->first_moment >= 0 ? p->first_moment : so.beta1;
  }
  /* Nesterov needs momentum: a run told --momentum 0 drops the table's Nesterov. */
  if (o->nesterov < 0) o->nesterov = p->nesterov && o->momentum > 0;
  if (o->root_every < 0) o->root_every = p->root_every;
  pc_kfac_opts ko; /* a row without its own K-FAC schedule takes the numerics core's */
  pc_kfac_opts_default(&ko);
  if (o->factor_every_first < 0)
    o->factor_every_first =
        p->factor_every_first > 0 ? p->factor_every_first : ko.factor_every_first;
  if (o->inv_every < 0) o->inv_every = p->inv_every > 0 ? p->inv_every : ko.inv_every;
  if (o->warmup < 0) {
    /* The table's warm-up is for full-length runs: a short run warms up for a tenth. */
    long cap = o->steps > 0 ? o->steps / 10 : p->warmup;
    o->warmup = p->warmup < cap ? p->warmup : cap;
  }
}

/* Shampoo's sync_first: the option, else its row's for a worker alone (data-parallel workers
 * take none: pt_create refuses it there), a short run's capped at a fortieth of its steps as
 * the warm-up is at a tenth. Resolved where the workers are known, not in tr_options_resolve. */
long tr_sync_first(const tr_options *o) {
  if (o->sync_first >= 0) return o->sync_first;
  if (o->dp_size > 1) return 0;
  long table = tr__preset_of(o->model, o->optimizer)->sync_first;
  long cap = o->steps > 0 ? o->steps / 40 : table;
  return table < cap ? table : cap;
}

double tr_effective_lr(const tr_options *o) {
  if (o->lr >= 0) return o->lr;
  return tr__preset_of(o->model, o->optimizer)->lr;
}

int tr_schedule(const tr_options *o, long total, ac_lr_schedule *sched) {
  ac_lr_schedule_default(sched, tr_effective_lr(o));
  long decay = total - o->warmup;
  sched->warmup_steps = o->warmup;
  sched->decay = (ac_lr_decay)o->schedule;
  sched->decay_steps = decay > 1 ? decay : 1;
  sched->min_lr = o->lr_floor * sched->base_lr;
  sched->gamma = o->step_gamma;
  sched->step_size = o->step_size > 0 ? o->step_size : decay >= 3 ? decay / 3 : 1;
  return ac_lr_schedule_check(sched) == AC_OK ? TR_OK : TR_EINVAL;
}

/* "constant", "cosine", "step": indexed by ac_lr_decay. */
static const char *const tr__schedules[] = {"constant", "cosine", "step", NULL};
static const char *const tr__root_methods[] = {"newton", "eigh", NULL}; /* root_method */
static const char *const tr__fishers[] = {"empirical", "model", NULL};  /* kfac_fisher */
/* kfac_inverse (the wire's KfacInverse numbering) and kfac_form (pt_kfac_form's). */
static const char *const tr__inverses[] = {"auto", "cholesky", "eigh", "newton", NULL};
static const char *const tr__forms[] = {"daemon", "worker-inverse", "worker-eigen", NULL};
static const char *const tr__row_samples[] = {"prefix", "strided", NULL}; /* pt_kfac_rows */

/* Internal option kinds: the public tr_arg types plus the harness's own. */
enum {
  K_LONG = TR_ARG_LONG,
  K_DOUBLE = TR_ARG_DOUBLE,
  K_STRING = TR_ARG_STRING,
  K_FLAG = TR_ARG_FLAG,
  K_CHOICE = TR_ARG_CHOICE,
  K_OPTIMIZER = 100,
  K_BACKEND,
  K_U64,
  K_INT,
  K_GRAFT
};

typedef struct {
  const char *name;
  int kind;
  void *dest;
  double min, max; /* range; for K_STRING max is the buffer size */
  const char *help;
  const char *const *choices; /* K_CHOICE */
} tr__spec;

#define TR__NCOMMON 64 /* at least the count of tr__common_specs' entries */

/* The harness's options, pointing into o. */
static size_t tr__common_specs(tr_options *o, tr__spec *s) {
  size_t n = 0;
#define SPEC(nm, k, d, lo, hi, h) s[n++] = (tr__spec){nm, k, d, lo, hi, h, NULL}
  SPEC("optimizer", K_OPTIMIZER, &o->optimizer, 0, 0, "sgd, adamw, shampoo, kfac or abs");
  SPEC("steps", K_LONG, &o->steps, 1, 1e9, "training steps");
  SPEC("epochs", K_DOUBLE, &o->epochs, 1e-6, 1e4, "train for this many epochs instead of --steps");
  SPEC("stop-at", K_LONG, &o->stop_at, 0, 1e9,
       "stop after this step, the schedule still over the whole run (0: never)");
  SPEC("lr", K_DOUBLE, &o->lr, 0, 1e3, "base learning rate");
  SPEC("momentum", K_DOUBLE, &o->momentum, 0, 0.999999, "SGD momentum (sgd, kfac)");
  SPEC("beta1", K_DOUBLE, &o->beta1, 0, 0.999999, "AdamW (and Shampoo's grafted Adam) beta1");
  SPEC("beta2", K_DOUBLE, &o->beta2, 0, 0.999999, "AdamW (and Shampoo's grafted Adam) beta2");
  SPEC("eps", K_DOUBLE, &o->eps, 1e-30, 1, "AdamW epsilon");
  SPEC("weight-decay", K_DOUBLE, &o->weight_decay, 0, 10,
       "decoupled weight decay (AdamW, Shampoo); L2 for SGD and K-FAC");
  SPEC("clip", K_DOUBLE, &o->clip, 0, 1e9, "clip the global gradient norm to this (0: off)");
  SPEC("warmup", K_LONG, &o->warmup, 0, 1e9, "linear learning-rate warm-up steps");
  s[n++] = (tr__spec){"schedule",
                      K_CHOICE,
                      &o->schedule,
                      0,
                      0,
                      "learning rate after the warm-up: constant, cosine (to --lr-floor at "
                      "the last step) or step",
                      tr__schedules};
  SPEC("lr-floor", K_DOUBLE, &o->lr_floor, 0, 1, "cosine: the final rate as a fraction of --lr");
  SPEC("step-size", K_LONG, &o->step_size, 0, 1e9,
       "step: steps between decays (0: a third of the steps after the warm-up)");
  SPEC("step-gamma", K_DOUBLE, &o->step_gamma, 1e-6, 1, "step: factor at each decay");
  SPEC("nesterov", K_FLAG, &o->nesterov, 0, 0,
       "Nesterov momentum (sgd; shampoo: on its momentum, else on its first moment); "
       "--no-nesterov");
  SPEC("block-size", K_LONG, &o->block_size, 1, 8192, "Shampoo block size");
  SPEC("stat-beta2", K_DOUBLE, &o->stat_beta2, 1e-6, 1, "Shampoo statistics EMA (1: sum)");
  SPEC("shampoo-eps", K_DOUBLE, &o->shampoo_eps, 1e-12, 1, "Shampoo relative ridge");
  SPEC("graft", K_GRAFT, &o->graft, 0, 0,
       "Shampoo's grafted step: sgd, adagrad, rmsprop-normed, adam-normed, rmsprop, adam");
  SPEC("shampoo-momentum", K_DOUBLE, &o->shampoo_momentum, 0, 0.999999,
       "momentum on Shampoo's grafted direction");
  SPEC("shampoo-beta1", K_DOUBLE, &o->shampoo_beta1, 0, 0.999999,
       "Shampoo's first moment: the filtered gradient, preconditioned and grafted (0: off)");
  SPEC("shampoo-nesterov", K_INT, &o->shampoo_nesterov, 0, 1,
       "Nesterov look-ahead of Shampoo's first moment (1: on, 0: off)");
  SPEC("one-sided", K_FLAG, &o->one_sided, 0, 0,
       "Shampoo: one root per block, L^(-1/2) G or G R^(-1/2) (default: both sides)");
  s[n++] = (tr__spec){"root-method",
                      K_CHOICE,
                      &o->root_method,
                      0,
                      0,
                      "how precondd computes Shampoo's roots: newton (coupled iteration) or "
                      "eigh (eigendecomposition)",
                      tr__root_methods};
  SPEC("root-exponent", K_INT, &o->root_exponent, 1, 64,
       "Shampoo: p of L^(-1/p) G R^(-1/p) (4: the original Shampoo; --one-sided takes 2)");
  SPEC("stat-every", K_LONG, &o->stat_every, 1, 1e9, "push Shampoo statistics every N steps");
  SPEC("precond-start", K_LONG, &o->roots_start, 1, 1e9,
       "first step that may use roots (the grafted step before)");
  SPEC("max-staleness", K_LONG, &o->max_staleness, 0, 1e9,
       "roots older than N steps are not used (grafted step instead); 0: no bound");
  SPEC("sync-roots", K_FLAG, &o->sync_roots, 0, 0,
       "wait for each step's roots (slow, reproducible)");
  SPEC("sync-first", K_LONG, &o->sync_first, 0, 1e9,
       "Shampoo: the first N steps wait for their own roots (fresh first roots), asynchronous "
       "(or --root-delay) after");
  SPEC("root-every", K_LONG, &o->root_every, 1, 100000,
       "Shampoo: precondd recomputes a block's roots when its statistics step enters a new "
       "window of N steps (windows offset by block; every push before its first root), and "
       "--sync-roots waits for the roots of the step's window");
  SPEC("root-delay", K_LONG, &o->root_delay, 0, 1000,
       "--sync-roots, but step t uses the roots of the statistics through step t-K (K steps "
       "of staleness, deterministic)");
  SPEC("kfac-damping", K_DOUBLE, &o->kfac_damping, 1e-12, 1e6,
       "K-FAC: lambda of the Tikhonov damping (A + pi sqrt(lambda) I, G + sqrt(lambda)/pi I)");
  SPEC("kfac-decay", K_DOUBLE, &o->kfac_decay, 0, 0.999999,
       "K-FAC: running average of A and G on the daemon (F <- d F + (1 - d) F_batch)");
  SPEC("kl-clip", K_DOUBLE, &o->kl_clip, 1e-12, 1e6,
       "K-FAC: KL clip c, steps scaled by min(1, sqrt(c / (lr^2 sum <P, grad>)))");
  SPEC("kl-base-lr", K_INT, &o->kl_base_lr, 0, 1,
       "K-FAC: the KL clip's lr (1: --lr, so the schedule scales the clipped step; 0: the "
       "step's scheduled rate)");
  SPEC("kfac-pi", K_INT, &o->kfac_pi, 0, 1, "K-FAC: pi-damping (1: on, 0: pi = 1)");
  SPEC("inv-every", K_LONG, &o->inv_every, 1, 1e9,
       "K-FAC: the daemon recomputes the damped inverses every N pushes");
  SPEC("factor-every", K_LONG, &o->factor_every, 1, 1e9,
       "K-FAC: factors every N steps after the first epochs (Osawa's stale factors)");
  SPEC("factor-every-first", K_LONG, &o->factor_every_first, 1, 1e9,
       "K-FAC: factors every N steps in the first epochs");
  SPEC("factor-first-epochs", K_LONG, &o->factor_first_epochs, 0, 1e9,
       "K-FAC: epochs at --factor-every-first");
  SPEC("epoch-steps", K_LONG, &o->epoch_steps, 0, 1e12,
       "K-FAC: steps per epoch of the factor schedule (0: the training set's)");
  SPEC("kfac-bf16", K_FLAG, &o->kfac_bf16, 0, 0, "K-FAC: push the factors as bf16");
  SPEC("abs-interval", K_LONG, &o->abs_interval, 0, 1e12,
       "ABS: batches between the rule's evaluations (0: an epoch of the data)");
  SPEC("kfac-a-images", K_LONG, &o->kfac_a_images, 0, 1e9,
       "K-FAC: conv layers' A from the first N images of the batch only (0: all)");
  SPEC("kfac-rows", K_LONG, &o->kfac_rows, 0, 1e9,
       "K-FAC: dense layers' A and G from N rows (tokens) of the batch only (0: all)");
  s[n++] = (tr__spec){"kfac-row-sample",
                      K_CHOICE,
                      &o->kfac_row_sample,
                      0,
                      0,
                      "K-FAC: which rows --kfac-rows takes, prefix (the first sequences) or "
                      "strided (every k-th row, the first cycling from step to step)",
                      tr__row_samples};
  s[n++] = (tr__spec){"kfac-fisher",
                      K_CHOICE,
                      &o->kfac_fisher,
                      0,
                      0,
                      "K-FAC: empirical (factors from the batch's backward) or model (from one "
                      "more backward on labels drawn from the model's predictive distribution)",
                      tr__fishers};
  s[n++] = (tr__spec){"kfac-inverse",
                      K_CHOICE,
                      &o->kfac_inverse,
                      0,
                      0,
                      "K-FAC: the daemon's inverse method, auto (by size: Cholesky at every "
                      "size measured), cholesky, eigh or newton",
                      tr__inverses};
  s[n++] = (tr__spec){"kfac-form",
                      K_CHOICE,
                      &o->kfac_form,
                      0,
                      0,
                      "K-FAC: daemon (precondd's damped inverses), worker-inverse (the same "
                      "computed on the worker) or worker-eigen (KAISA's eigen form, on the "
                      "worker; one worker only): docs/kfac.md",
                      tr__forms};
  SPEC("daemon", K_STRING, o->daemon, 0, sizeof o->daemon,
       "precondd address, host:port or unix:/path (or $PRECOND_ADDR)");
  SPEC("job", K_STRING, o->job, 0, sizeof o->job, "job name on the daemon (default: unique)");
  SPEC("poll-ms", K_LONG, &o->poll_ms, 0, 1e6,
       "libprecond's poll for new results, ms (0: half a step; Shampoo with --sync-roots: 20)");
  SPEC("seed", K_U64, &o->seed, 0, 0, "random seed (weights and batches)");
  SPEC("backend", K_BACKEND, &o->backend, 0, 0, "cpu or cuda");
  SPEC("threads", K_INT, &o->threads, 1, 256, "OpenBLAS threads of the cpu backend");
  SPEC("out", K_STRING, o->out, 0, sizeof o->out, "write train.csv and summary.json here");
  SPEC("eval-every", K_LONG, &o->eval_every, 0, 1e9, "evaluate every N steps (0: at the end)");
  SPEC("eval-batches", K_LONG, &o->eval_batches, 0, 1e9,
       "batches per evaluation (0: model default)");
  SPEC("quiet", K_FLAG, &o->quiet, 0, 0, "no progress line");
  SPEC("help", K_FLAG, NULL, 0, 0, "this text");
#undef SPEC
  return n;
}

static void tr__print_value(FILE *f, const tr__spec *s) {
  switch (s->kind) {
    case K_CHOICE:
      fprintf(f, "%s", s->choices[*(const int *)s->dest]);
      break;
    case K_LONG:
      fprintf(f, "%ld", *(const long *)s->dest);
      break;
    case K_INT:
      fprintf(f, "%d", *(const int *)s->dest);
      break;
    case K_DOUBLE:
      fprintf(f, "%g", *(const double *)s->dest);
      break;
    case K_U64:
      fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)s->dest);
      break;
    case K_STRING:
      fprintf(f, "%s", (const char *)s->dest);
      break;
    case K_OPTIMIZER:
      fprintf(f, "%s", tr_optimizer_name(*(const tr_optimizer_kind *)s->dest));
      break;
    case K_BACKEND:
      fprintf(f, "%s", *(const ac_backend_kind *)s->dest == AC_BACKEND_CUDA ? "cuda" : "cpu");
      break;
    case K_GRAFT:
      fprintf(f, "%s", pc_graft_name((pc_graft) * (const int *)s->dest));
      break;
    default:
      break;
  }
}

static void tr__usage_line(FILE *f, const tr__spec *s) {
  char left[64];
  const char *meta =
      s->kind == K_FLAG     ? ""
      : s->kind == K_STRING ? " S"
      : s->kind == K_DOUBLE ? " X"
      : s->kind == K_OPTIMIZER || s->kind == K_BACKEND || s->kind == K_GRAFT || s->kind == K_CHOICE
          ? " NAME"
          : " N";
  snprintf(left, sizeof left, "  --%s%s", s->name, meta);
  fprintf(f, "%-26s %s", left, s->help);
  /* A table field still unset: its value depends on the model and optimizer. */
  int unset = s->dest != NULL && ((s->kind == K_DOUBLE && *(const double *)s->dest < 0) ||
                                  (s->kind == K_LONG && *(const long *)s->dest < 0) ||
                                  (s->kind == K_FLAG && *(const int *)s->dest < 0));
  int show = s->dest != NULL && s->kind != K_FLAG &&
             !(s->kind == K_STRING && ((const char *)s->dest)[0] == '\0');
  if (unset) {
    fprintf(f, " [table]");
  } else if (show) {
    fprintf(f, " [");
    tr__print_value(f, s);
    fprintf(f, "]");
  }
  fprintf(f, "\n");
}

void tr_usage(FILE *f, const tr_options *defaults, const tr_arg *extra, size_t nextra,
              const char *prog, const char *summary) {
  tr_options d = *defaults;
  tr__spec specs[TR__NCOMMON];
  size_t n = tr__common_specs(&d, specs);
  fprintf(f, "Usage: %s [OPTION]...\n%s\n\n", prog, summary != NULL ? summary : "");
  if (nextra > 0) fprintf(f, "Model and data:\n");
  for (size_t i = 0; i < nextra; i++) {
    tr__spec s = {extra[i].name, (int)extra[i].type, extra[i].dest,   extra[i].min,
                  extra[i].max,  extra[i].help,      extra[i].choices};
    tr__usage_line(f, &s);
  }
  fprintf(f, "Training:\n");
  for (size_t i = 0; i < n; i++) tr__usage_line(f, &specs[i]);
  fprintf(f, "\n[table]: the default depends on the optimizer (%s):\n",
          d.model != NULL ? d.model : "generic");
  fprintf(f, "  %-9s %-7s %-8s %-10s %-12s %-8s %s\n", "optimizer", "lr", "momentum", "betas",
          "weight-decay", "nesterov", "warmup (at most a tenth of the run)");
  for (int k = TR_SGD; k <= TR_ABS; k++) {
    const tr__preset *p = tr__preset_of(d.model, (tr_optimizer_kind)k);
    char betas[32];
    snprintf(betas, sizeof betas, "%g/%g", p->beta1, p->beta2);
    fprintf(f, "  %-9s %-7g %-8g %-10s %-12g %-8s %ld\n", tr_optimizer_name(p->optimizer), p->lr,
            p->momentum, betas, p->weight_decay, p->nesterov ? "yes" : "no", p->warmup);
  }
  tr_options sh = d; /* Shampoo's first moment, from its row or accel's default */
  sh.optimizer = TR_SHAMPOO;
  tr_options_resolve(&sh);
  fprintf(f, "  shampoo's first moment (--shampoo-beta1): %g\n", sh.shampoo_beta1);
  fprintf(f,
          "  shampoo's first steps waiting for their own roots (--sync-first; a worker alone, at "
          "most a fortieth of the run): %ld\n",
          tr__preset_of(d.model, TR_SHAMPOO)->sync_first);
  fprintf(f, "  shampoo's roots of a block every N steps (--root-every): %ld\n",
          tr__preset_of(d.model, TR_SHAMPOO)->root_every);
  tr_options kf = d; /* K-FAC's schedule, from its row or the numerics core's default */
  kf.optimizer = TR_KFAC;
  tr_options_resolve(&kf);
  fprintf(f,
          "  kfac's factors every N steps in the first epochs (--factor-every-first): %ld, "
          "inverses every N pushes (--inv-every): %ld\n",
          kf.factor_every_first, kf.inv_every);
  fprintf(f,
          "\nOutputs: a progress line on stderr; with --out, OUT/train.csv (one row per step:\n"
          "%s)\nand OUT/summary.json. Shampoo and K-FAC need a running precondd (--daemon).\n",
          TR_CSV_HEADER);
}

/* Parses one value into s->dest. Returns 0 or -1 with err set. */
static int tr__set(const tr__spec *s, const char *v, tr_error *err) {
  char *end = NULL;
  errno = 0;
  switch (s->kind) {
    case K_LONG:
    case K_INT: {
      long x = strtol(v, &end, 10);
      if (errno || end == v || *end != '\0' || (double)x < s->min || (double)x > s->max) {
        tr__fail(err, TR_EINVAL, "--%s: '%s' is not an integer in [%.0f, %.0f]", s->name, v, s->min,
                 s->max);
        return -1;
      }
      if (s->kind == K_LONG)
        *(long *)s->dest = x;
      else
        *(int *)s->dest = (int)x;
      return 0;
    }
    case K_U64: {
      if (v[0] == '-') break;
      unsigned long long x = strtoull(v, &end, 10);
      if (errno || end == v || *end != '\0') break;
      *(uint64_t *)s->dest = (uint64_t)x;
      return 0;
    }
    case K_DOUBLE: {
      double x = strtod(v, &end);
      if (errno || end == v || *end != '\0' || !isfinite(x) || x < s->min || x > s->max) {
        tr__fail(err, TR_EINVAL, "--%s: '%s' is not a number in [%g, %g]", s->name, v, s->min,
                 s->max);
        return -1;
      }
      *(double *)s->dest = x;
      return 0;
    }
    case K_STRING: {
      size_t len = strlen(v);
      if (len + 1 > (size_t)s->max) {
        tr__fail(err, TR_EINVAL, "--%s: value longer than %.0f bytes", s->name, s->max - 1);
        return -1;
      }
      memcpy(s->dest, v, len + 1);
      return 0;
    }
    case K_OPTIMIZER: {
      for (int k = TR_SGD; k <= TR_ABS; k++) {
        if (strcmp(v, tr_optimizer_name((tr_optimizer_kind)k)) == 0) {
          *(tr_optimizer_kind *)s->dest = (tr_optimizer_kind)k;
          return 0;
        }
      }
      tr__fail(err, TR_EINVAL, "--optimizer: '%s' is not one of sgd, adamw, shampoo, kfac, abs", v);
      return -1;
    }
    case K_CHOICE: {
      for (int k = 0; s->choices[k] != NULL; k++) {
        if (strcmp(v, s->choices[k]) == 0) {
          *(int *)s->dest = k;
          return 0;
        }
      }
      char list[256] = "";
      for (int k = 0; s->choices[k] != NULL; k++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", k ? ", " : "",
                 s->choices[k]);
      tr__fail(err, TR_EINVAL, "--%s: '%s' is not one of %s", s->name, v, list);
      return -1;
    }
    case K_GRAFT: {
      for (int k = PC_GRAFT_SGD; k < PC_GRAFT_COUNT; k++) {
        if (strcmp(v, pc_graft_name((pc_graft)k)) == 0) {
          *(int *)s->dest = k;
          return 0;
        }
      }
      tr__fail(err, TR_EINVAL,
               "--graft: '%s' is not one of sgd, adagrad, rmsprop-normed, "
               "adam-normed, rmsprop, adam",
               v);
      return -1;
    }
    case K_BACKEND: {
      if (strcmp(v, "cpu") == 0)
        *(ac_backend_kind *)s->dest = AC_BACKEND_CPU;
      else if (strcmp(v, "cuda") == 0)
        *(ac_backend_kind *)s->dest = AC_BACKEND_CUDA;
      else {
        tr__fail(err, TR_EINVAL, "--backend: '%s' is not one of cpu, cuda", v);
        return -1;
      }
      return 0;
    }
    default:
      break;
  }
  tr__fail(err, TR_EINVAL, "--%s: '%s' is not a valid value", s->name, v);
  return -1;
}

int tr_parse_args(tr_options *opts, const tr_arg *extra, size_t nextra, int argc, char **argv,
                  const char *prog, const char *summary, tr_error *err) {
  if (opts == NULL || (extra == NULL && nextra > 0) || argc < 0 || (argv == NULL && argc > 0))
    return tr__fail(err, TR_EINVAL, "tr_parse_args: bad arguments");
  tr_options defaults = *opts;
  tr__spec specs[TR__NCOMMON];
  size_t n = tr__common_specs(opts, specs);
  int saw_steps = 0, saw_epochs = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strncmp(a, "--", 2) != 0 || a[2] == '\0')
      return tr__fail(err, TR_EINVAL, "unexpected argument '%s' (options start with --)", a);
    const char *name = a + 2;
    const char *eq = strchr(name, '=');
    size_t nlen = eq != NULL ? (size_t)(eq - name) : strlen(name);
    tr__spec found = {0};
    int have = 0;
    for (size_t k = 0; k < nextra && !have; k++) {
      if (strlen(extra[k].name) == nlen && strncmp(extra[k].name, name, nlen) == 0) {
        found = (tr__spec){extra[k].name, (int)extra[k].type, extra[k].dest,   extra[k].min,
                           extra[k].max,  extra[k].help,      extra[k].choices};
        have = 1;
      }
    }
    for (size_t k = 0; k < n && !have; k++) {
      if (strlen(specs[k].name) == nlen && strncmp(specs[k].name, name, nlen) == 0) {
        found = specs[k];
        have = 1;
      }
    }
    /* --no-NAME turns the flag NAME off. */
    int negated = 0;
    for (size_t k = 0; k < nextra + n && !have && nlen > 3 && strncmp(name, "no-", 3) == 0; k++) {
      const char *fn = k < nextra ? extra[k].name : specs[k - nextra].name;
      int kind = k < nextra ? (int)extra[k].type : specs[k - nextra].kind;
      void *dest = k < nextra ? extra[k].dest : specs[k - nextra].dest;
      if (kind == K_FLAG && dest != NULL && strlen(fn) == nlen - 3 &&
          strncmp(fn, name + 3, nlen - 3) == 0) {
        found = (tr__spec){fn, K_FLAG, dest, 0, 0, NULL, NULL};
        have = negated = 1;
      }
    }
    if (!have)
      return tr__fail(err, TR_EINVAL, "unknown option '--%.*s' (see --help)", (int)nlen, name);
    if (found.kind == K_FLAG) {
      if (eq != NULL) return tr__fail(err, TR_EINVAL, "--%.*s takes no value", (int)nlen, name);
      if (found.dest == NULL) {
        tr_usage(stdout, &defaults, extra, nextra, prog, summary);
        return TR_EHELP;
      }
      *(int *)found.dest = !negated;
      continue;
    }
    const char *v;
    if (eq != NULL) {
      v = eq + 1;
    } else {
      if (i + 1 >= argc) return tr__fail(err, TR_EINVAL, "--%s needs a value", found.name);
      v = argv[++i];
    }
    if (tr__set(&found, v, err) != 0) return TR_EINVAL;
    if (found.dest == &opts->steps) saw_steps = 1;
    if (found.dest == &opts->epochs) saw_epochs = 1;
  }
  if (saw_steps && saw_epochs)
    return tr__fail(err, TR_EINVAL, "give --steps or --epochs, not both");
  if (saw_epochs) opts->steps = 0;
  if (opts->steps == 0 && !(opts->epochs > 0))
    return tr__fail(err, TR_EINVAL, "no training length: give --steps or --epochs");
  tr_options_resolve(opts);
  if (opts->nesterov && opts->optimizer == TR_SGD && !(opts->momentum > 0))
    return tr__fail(err, TR_EINVAL, "--nesterov needs --momentum > 0");
  if (opts->nesterov && opts->optimizer == TR_SHAMPOO && !(opts->shampoo_momentum > 0))
    return tr__fail(err, TR_EINVAL, "--nesterov needs --shampoo-momentum > 0");
  if ((opts->optimizer == TR_SHAMPOO || opts->optimizer == TR_KFAC) && opts->daemon[0] == '\0')
    return tr__fail(err, TR_EINVAL, "--optimizer %s needs --daemon ADDRESS",
                    tr_optimizer_name(opts->optimizer));
  return TR_OK;
}

/* ==================================================================================== */
/* Progress, ETA, statistics                                                              */

double tr_eta(double elapsed_s, long done, long total) {
  if (done >= total) return 0;
  if (done <= 0 || !(elapsed_s >= 0)) return -1;
  return elapsed_s / (double)done * (double)(total - done);
}

void tr_format_duration(char *buf, size_t len, double s) {
  if (len == 0) return;
  if (!(s >= 0) || !isfinite(s)) {
    snprintf(buf, len, "?");
    return;
  }
  long t = (long)(s + 0.5);
  if (t < 60)
    snprintf(buf, len, "%lds", t);
  else if (t < 3600)
    snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
  else
    snprintf(buf, len, "%ldh%02ldm", t / 3600, (t % 3600) / 60);
}

void tr_format_progress(char *buf, size_t len, long step, long total, double loss,
                        double items_per_s, const char *unit, double elapsed_s, double eta_s) {
  char el[32], eta[32], rate[32];
  tr_format_duration(el, sizeof el, elapsed_s);
  tr_format_duration(eta, sizeof eta, eta_s);
  if (!(items_per_s >= 0) || !isfinite(items_per_s))
    snprintf(rate, sizeof rate, "?");
  else if (items_per_s >= 1e6)
    snprintf(rate, sizeof rate, "%.1fM", items_per_s / 1e6);
  else if (items_per_s >= 1e4)
    snprintf(rate, sizeof rate, "%.1fk", items_per_s / 1e3);
  else
    snprintf(rate, sizeof rate, "%.1f", items_per_s);
  snprintf(buf, len, "step %ld/%ld  loss %.4f  %s %s/s  elapsed %s  eta %s", step, total, loss,
           rate, unit != NULL ? unit : "items", el, eta);
}

static int tr__cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int tr_median(const double *vals, size_t n, double *out) {
  *out = NAN;
  if (n == 0) return TR_OK;
  double *c = malloc(n * sizeof *c);
  if (c == NULL) return TR_ENOMEM;
  memcpy(c, vals, n * sizeof *c);
  qsort(c, n, sizeof *c, tr__cmp_double);
  *out = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
  free(c);
  return TR_OK;
}

/* ==================================================================================== */
/* CSV and JSON                                                                           */

int tr_csv_header(FILE *f) {
  return fprintf(f, "%s\n", TR_CSV_HEADER) < 0 ? TR_EIO : TR_OK;
}

/* A CSV field: empty for NaN, else %.*g. */
static void tr__csv_num(FILE *f, double v, int digits) {
  if (isfinite(v))
    fprintf(f, "%.*g", digits, v);
  else if (!isnan(v))
    fprintf(f, "%s", v > 0 ? "inf" : "-inf");
}

int tr_csv_row(FILE *f, const tr_row *r) {
  fprintf(f, "%ld,", r->step);
  tr__csv_num(f, r->wall_s, 6);
  fputc(',', f);
  tr__csv_num(f, r->step_ms, 5);
  fputc(',', f);
  tr__csv_num(f, r->train_loss, 7);
  fputc(',', f);
  tr__csv_num(f, r->eval_loss, 7);
  fputc(',', f);
  tr__csv_num(f, r->eval_accuracy, 6);
  fputc(',', f);
  tr__csv_num(f, r->lr, 6);
  fputc(',', f);
  tr__csv_num(f, r->staleness, 4);
  fprintf(f, ",%d,", r->fallback ? 1 : 0);
  tr__csv_num(f, r->cpu_ms, 5);
  fputc(',', f);
  tr__csv_num(f, r->kl_scale, 5);
  fputc(',', f);
  tr__csv_num(f, r->opt_cpu_ms, 5);
  fputc(',', f);
  tr__csv_num(f, r->thread_cpu_ms, 5);
  return fputc('\n', f) == EOF ? TR_EIO : TR_OK;
}

static void tr__json_num(FILE *f, const char *key, double v, int last) {
  fprintf(f, "  \"%s\": ", key);
  if (isfinite(v))
    fprintf(f, "%.9g", v);
  else
    fputs("null", f);
  fputs(last ? "\n" : ",\n", f);
}

static void tr__json_int(FILE *f, const char *key, long long v) {
  fprintf(f, "  \"%s\": %lld,\n", key, v);
}

static void tr__json_str(FILE *f, const char *key, const char *v) {
  fprintf(f, "  \"%s\": ", key);
  rpc_json_string(f, v);
  fputs(",\n", f);
}

int tr_json_summary(FILE *f, const tr_summary *s) {
  fputs("{\n", f);
  tr__json_str(f, "model", s->model);
  tr__json_str(f, "optimizer", s->optimizer);
  tr__json_str(f, "backend", s->backend);
  tr__json_str(f, "status", s->status != NULL ? s->status : "ok");
  tr__json_int(f, "seed", (long long)s->seed);
  tr__json_num(f, "lr", s->lr, 0);
  tr__json_str(f, "schedule", s->schedule != NULL ? s->schedule : "?");
  tr__json_int(f, "warmup", s->warmup);
  tr__json_int(f, "steps", s->steps);
  tr__json_int(f, "params", s->params);
  tr__json_num(f, "final_train_loss", s->final_train_loss, 0);
  tr__json_num(f, "final_eval_loss", s->final_eval_loss, 0);
  tr__json_num(f, "final_eval_accuracy", s->final_eval_accuracy, 0);
  tr__json_num(f, "best_eval_loss", s->best_eval_loss, 0);
  tr__json_num(f, "wall_s", s->wall_s, 0);
  tr__json_num(f, "total_s", s->total_s, 0);
  tr__json_num(f, "median_step_ms", s->median_step_ms, 0);
  tr__json_num(f, "mean_step_ms", s->mean_step_ms, 0);
  tr__json_num(f, "median_step_cpu_ms", s->median_step_cpu_ms, 0);
  tr__json_num(f, "items_per_s", s->items_per_s, 0);
  tr__json_str(f, "item_unit", s->item_unit);
  tr__json_num(f, "staleness_mean", s->staleness_mean, 0);
  tr__json_num(f, "staleness_median", s->staleness_median, 0);
  tr__json_int(f, "staleness_max", s->staleness_max);
  tr__json_num(f, "staleness_p50", s->staleness_p50, 0);
  tr__json_num(f, "staleness_p90", s->staleness_p90, 0);
  tr__json_num(f, "staleness_p99", s->staleness_p99, 0);
  tr__json_int(f, "staleness_uses", (long long)s->staleness_uses);
  /* hist[s] for s = 0 .. the last non-empty bucket (the last bucket holds s >= it) */
  size_t last = 0;
  for (size_t k = 0; k < TR_STALENESS_BUCKETS; k++)
    if (s->staleness_hist[k] > 0) last = k + 1;
  fputs("  \"staleness_hist\": [", f);
  for (size_t k = 0; k < last; k++)
    fprintf(f, "%s%llu", k ? ", " : "", (unsigned long long)s->staleness_hist[k]);
  fputs("],\n", f);
  tr__json_int(f, "fallback_steps", s->fallback_steps);
  tr__json_int(f, "blocks", s->blocks);
  tr__json_int(f, "stats_pushed", (long long)s->stats_pushed);
  tr__json_int(f, "stats_dropped", (long long)s->stats_dropped);
  tr__json_int(f, "stats_coalesced", (long long)s->stats_coalesced);
  fprintf(f, "  \"roots_received\": %llu\n}\n", (unsigned long long)s->roots_received);
  return ferror(f) ? TR_EIO : TR_OK;
}

int tr_mkdirs(const char *path) {
  char buf[1024];
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof buf) return TR_EIO;
  memcpy(buf, path, len + 1);
  for (size_t i = 1; i <= len; i++) {
    if (buf[i] == '/' || buf[i] == '\0') {
      char c = buf[i];
      buf[i] = '\0';
      if (mkdir(buf, 0777) != 0 && errno != EEXIST) return TR_EIO;
      buf[i] = c;
    }
  }
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode) ? TR_OK : TR_EIO;
}

/* ==================================================================================== */
/* Optimizers                                                                             */

static int tr__accel(tr_error *err, int rc, const char *what) {
  if (rc == AC_OK) return TR_OK;
  return tr__fail(err, TR_EACCEL, "%s: %s", what, ac_strerror(rc));
}

int tr_backend_create(const tr_options *opts, ac_backend **out, tr_error *err) {
  ac_backend_opts bo;
  ac_backend_opts_default(&bo);
  bo.kind = opts->backend;
  bo.threads = opts->threads;
  int rc = ac_backend_create(out, &bo);
  if (rc == AC_OK) return TR_OK;
  return tr__fail(err, TR_EACCEL, "backend %s: %s (%s)",
                  opts->backend == AC_BACKEND_CUDA ? "cuda" : "cpu", ac_strerror(rc),
                  ac_backend_describe(NULL));
}

/* The trainer library's statuses as the harness reports them. */
static int tr__trainer(tr_error *err, int prc, const pt_error *perr) {
  if (prc == PT_OK) return TR_OK;
  int rc = prc == PT_EINVAL   ? TR_EINVAL
           : prc == PT_ENOMEM ? TR_ENOMEM
           : prc == PT_EACCEL ? TR_EACCEL
                              : TR_EDAEMON;
  return tr__fail(err, rc, "%s", perr->msg[0] ? perr->msg : pt_strerror(prc));
}

/* The trainer library's options every mode shares: the mode's defaults, the daemon, the
 * job (opts->job, or MODEL-MODE-PID written into job), the worker name, sync_roots, the
 * data-parallel worker (pt_dp and its share). */
static void tr__trainer_opts(const tr_optimizer *o, pt_mode mode, const char *model_name, char *job,
                             size_t joblen, pt_options *po) {
  const tr_options *opts = &o->opts;
  if (opts->job[0] != '\0')
    snprintf(job, joblen, "%s", opts->job);
  else
    snprintf(job, joblen, "%s-%s-%ld", model_name, pt_mode_name(mode), (long)getpid());
  pt_options_default(po, mode);
  po->daemon = opts->daemon;
  po->job = job;
  po->worker = model_name;
  po->sync_roots = opts->sync_roots || opts->root_delay > 0; /* a delay is sync_roots' */
  po->root_delay = opts->root_delay;
  po->sync_first = tr_sync_first(opts);
  po->root_every = mode == PT_MODE_SHAMPOO ? opts->root_every : 1;
  po->shard_rank = opts->dp_rank; /* data parallelism: statistics and factors sharded */
  po->shard_size = opts->dp_size;
  po->dp = opts->dp;
  if (opts->poll_ms > 0) po->poll_interval_ms = (int)opts->poll_ms;
}

/* Shampoo's options as the harness names them, for the trainer library. */
static int tr__shampoo_init(tr_optimizer *o, const char *model_name, tr_error *err) {
  const tr_options *opts = &o->opts;
  char job[160];
  pt_options po;
  tr__trainer_opts(o, PT_MODE_SHAMPOO, model_name, job, sizeof job, &po);
  ac_shampoo_opts *so = &po.shampoo;
  so->layout.block_size = (size_t)opts->block_size;
  pc_graft_opts_default(&so->graft, (pc_graft)opts->graft);
  so->graft.beta1 = opts->beta1;
  so->graft.beta2 = opts->beta2;
  so->graft.eps = opts->eps;
  so->momentum = (float)opts->shampoo_momentum;
  so->nesterov = opts->nesterov && opts->shampoo_momentum > 0;
  so->beta1 = (float)opts->shampoo_beta1;
  so->beta1_nesterov = opts->shampoo_nesterov && so->beta1 > 0.0f;
  so->one_sided = opts->one_sided;
  so->root_method = opts->root_method ? PC_METHOD_EIGH : PC_METHOD_NEWTON;
  so->root_exponent = opts->root_exponent;
  so->weight_decay = (float)opts->weight_decay;
  so->stats_interval = opts->stat_every;
  so->start_step = opts->roots_start;
  so->max_staleness = opts->max_staleness;
  so->beta2 = (float)opts->stat_beta2;
  so->epsilon = opts->shampoo_eps;
  pt_error perr = {""};
  return tr__trainer(err, pt_create(&o->trainer, &po, o->params, o->nparams, &perr), &perr);
}

/* K-FAC's options as the harness names them, for the trainer library. */
static int tr__kfac_init(tr_optimizer *o, const char *model_name, tr_error *err) {
  const tr_options *opts = &o->opts;
  char job[160];
  pt_options po;
  tr__trainer_opts(o, PT_MODE_KFAC, model_name, job, sizeof job, &po);
  pt_kfac_opts *ko = &po.kfac;
  ko->k.damping = opts->kfac_damping;
  ko->k.factor_decay = opts->kfac_decay;
  ko->k.kl_clip = opts->kl_clip;
  ko->k.kl_base_lr = opts->kl_base_lr;
  ko->base_lr = tr_effective_lr(opts);
  ko->k.pi_damping = opts->kfac_pi;
  ko->k.inv_every = opts->inv_every;
  ko->k.factor_every = opts->factor_every;
  ko->k.factor_every_first = opts->factor_every_first;
  ko->k.first_epochs = opts->factor_first_epochs;
  ko->steps_per_epoch = opts->epoch_steps > 0 ? opts->epoch_steps : 1;
  ko->sgd.momentum = (float)opts->momentum;
  ko->sgd.nesterov = opts->nesterov && opts->momentum > 0;
  ko->sgd.weight_decay = (float)opts->weight_decay;
  ko->push_bf16 = opts->kfac_bf16;
  ko->a_images = (size_t)opts->kfac_a_images;
  ko->dense_rows = (size_t)opts->kfac_rows;
  ko->row_sample = (pt_kfac_rows)opts->kfac_row_sample;
  ko->model_fisher = opts->kfac_fisher;
  ko->inverse = opts->kfac_inverse;
  ko->form = (pt_kfac_form)opts->kfac_form;
  ko->sample_seed = opts->seed;
  /* Each parameter's treatment is listed at start even with --quiet (no progress line):
   * nothing falls back silently (issue 10). Once: by the first worker only. */
  ko->quiet = opts->dp_rank > 0;
  pt_error perr = {""};
  return tr__trainer(err, pt_create(&o->trainer, &po, o->params, o->nparams, &perr), &perr);
}

typedef struct {
  ac_celoss *xent;
  int32_t *drawn;
  int (*backward)(void *ctx);
  void *ctx;
} tr__drawn_pass;

/* The model's backward with the loss reading the drawn labels for this pass only. */
static int tr__drawn_backward(void *ctx) {
  tr__drawn_pass *d = ctx;
  const int32_t *own = d->xent->labels;
  d->xent->labels = d->drawn;
  int rc = d->backward(d->ctx);
  d->xent->labels = own;
  return rc;
}

int tr_kfac_model_fisher(pt_trainer *t, ac_celoss *xent, int32_t *drawn, ac_param_list *params,
                         int (*backward)(void *ctx), void *ctx) {
  if (t == NULL) return 0;
  tr__drawn_pass d = {xent, drawn, backward, ctx};
  int ran = 0, rc = ac_memcpy_d2d(xent->be, drawn, xent->labels, xent->rows * sizeof(int32_t));
  pt_error err = {""};
  if (rc == AC_OK && pt_kfac_model_fisher(t, xent->rows, xent->classes, xent->probs, drawn,
                                          tr__drawn_backward, &d, &ran, &err) != PT_OK) {
    fprintf(stderr, "K-FAC model Fisher: %s\n", err.msg);
    return -1;
  }
  if (rc == AC_OK && ran) rc = ac_param_list_zero_grad(params);
  if (rc != AC_OK) fprintf(stderr, "K-FAC model Fisher: %s\n", ac_strerror(rc));
  return rc == AC_OK ? 0 : -1;
}

/* Shampoo's part of the staleness distribution of a step: a block used its root at this
 * step when it holds one and its fallback count did not move. */
static int tr__shampoo_hist(tr_optimizer *o, long step, tr_error *err) {
  const ac_shampoo *sh = pt_shampoo(o->trainer);
  size_t nb = ac_shampoo_nblocks(sh);
  if (o->fallbacks == NULL &&
      (o->fallbacks = calloc(nb > 0 ? nb : 1, sizeof *o->fallbacks)) == NULL)
    return TR_ENOMEM;
  for (size_t b = 0; b < nb; b++) {
    ac_shampoo_block bi;
    int rc = tr__accel(err, ac_shampoo_block_info(sh, b, &bi), "ac_shampoo_block_info");
    if (rc != TR_OK) return rc;
    if (step >= o->opts.roots_start && bi.version > 0 && bi.staleness >= 0 &&
        bi.fallback_steps == o->fallbacks[b]) {
      long k = bi.staleness < TR_STALENESS_BUCKETS - 1 ? bi.staleness : TR_STALENESS_BUCKETS - 1;
      o->hist[k]++;
      o->uses++;
    }
    o->fallbacks[b] = bi.fallback_steps;
  }
  return TR_OK;
}

/* K-FAC's: each preconditioned layer at the step's mean age (the layers' inverses come from
 * the same pushes, so their ages agree but for a late one). */
static void tr__kfac_hist(tr_optimizer *o, const pt_step_info *si) {
  if (si->preconditioned == 0 || !(si->staleness_mean >= 0)) return;
  long k = lround(si->staleness_mean);
  if (k > TR_STALENESS_BUCKETS - 1) k = TR_STALENESS_BUCKETS - 1;
  o->hist[k] += si->preconditioned;
  o->uses += si->preconditioned;
}

/* One step of an optimizer of the trainer library (Shampoo, K-FAC): pt_step, the staleness
 * distribution, info. */
static int tr__trainer_step(tr_optimizer *o, long step, double lr, tr_step_info *info,
                            tr_error *err) {
  pt_step_info si;
  pt_error perr = {""};
  int rc = tr__trainer(err, pt_step(o->trainer, step, lr, &si, &perr), &perr);
  if (rc == TR_OK && o->kind == TR_SHAMPOO) rc = tr__shampoo_hist(o, step, err);
  if (rc == TR_OK && o->kind == TR_KFAC) tr__kfac_hist(o, &si);
  if (rc == TR_OK && info != NULL) {
    info->staleness = si.staleness_mean;
    info->staleness_max = si.staleness_max;
    info->fallback = si.fallback > 0;
    info->kl_scale = si.kl_scale;
  }
  return rc;
}

int tr_optimizer_init(tr_optimizer *o, const tr_options *opts, ac_backend *be, ac_param **params,
                      size_t nparams, const char *model_name, tr_error *err) {
  if (o == NULL) return TR_EINVAL;
  memset(o, 0, sizeof *o);
  if (opts == NULL || be == NULL || params == NULL || nparams == 0 || model_name == NULL)
    return tr__fail(err, TR_EINVAL, "tr_optimizer_init: bad arguments");
  for (size_t i = 0; i < nparams; i++)
    if (params[i] == NULL || params[i]->value.be != be || params[i]->value.numel == 0)
      return tr__fail(err, TR_EINVAL, "parameter %zu is empty or on another backend", i);
  o->kind = opts->optimizer;
  o->be = be;
  o->params = params;
  o->nparams = nparams;
  o->opts = *opts;
  tr_options_resolve(&o->opts);
  opts = &o->opts;
  int rc;
  if (o->kind == TR_SGD || o->kind == TR_ABS) {
    ac_sgd_opts so;
    ac_sgd_opts_default(&so);
    so.momentum = (float)opts->momentum;
    so.nesterov = opts->nesterov;
    so.weight_decay = (float)opts->weight_decay;
    rc = tr__accel(err, ac_sgd_create(&o->sgd, params, nparams, &so), "SGD");
    if (rc == TR_OK && o->kind == TR_ABS) {
      pc_abs_opts abs;
      pc_abs_opts_default(&abs);
      abs.adv_fraction = 0; /* ABS; ABSA's FGSM examples are not built yet (docs/abs.md) */
      pt_error perr = {""};
      rc = tr__trainer(err, pt_abs_create(&o->abs, params, nparams, &abs, &perr), &perr);
    }
  } else if (o->kind == TR_ADAMW) {
    ac_adamw_opts ao;
    ac_adamw_opts_default(&ao);
    ao.beta1 = (float)opts->beta1;
    ao.beta2 = (float)opts->beta2;
    ao.eps = (float)opts->eps;
    ao.weight_decay = (float)opts->weight_decay;
    rc = tr__accel(err, ac_adamw_create(&o->adamw, params, nparams, &ao), "AdamW");
  } else if (o->kind == TR_KFAC) {
    rc = tr__kfac_init(o, model_name, err);
  } else {
    rc = tr__shampoo_init(o, model_name, err);
  }
  if (rc != TR_OK) tr_optimizer_destroy(o);
  return rc;
}

int tr_optimizer_step(tr_optimizer *o, long step, double lr, tr_step_info *info, tr_error *err) {
  if (o == NULL || o->params == NULL || step < 1 || !(lr >= 0) || !isfinite(lr))
    return tr__fail(err, TR_EINVAL, "tr_optimizer_step: bad arguments");
  if (info != NULL) *info = (tr_step_info){NAN, -1, 0, NAN};
  switch (o->kind) {
    case TR_SGD:
    case TR_ABS:
      return tr__accel(err, ac_sgd_step(o->sgd, (float)lr), "SGD step");
    case TR_ADAMW:
      return tr__accel(err, ac_adamw_step(o->adamw, (float)lr), "AdamW step");
    case TR_SHAMPOO:
    case TR_KFAC:
      return tr__trainer_step(o, step, lr, info, err);
  }
  return TR_EINVAL;
}

void tr_optimizer_counters(const tr_optimizer *o, long *blocks, uint64_t *pushed, uint64_t *dropped,
                           uint64_t *coalesced, uint64_t *roots_received) {
  pt_counters c;
  pt_get_counters(o != NULL ? o->trainer : NULL, &c);
  if (blocks) *blocks = (long)c.units;
  if (pushed) *pushed = c.pushed;
  if (dropped) *dropped = c.dropped;
  if (coalesced) *coalesced = c.coalesced;
  if (roots_received) *roots_received = c.results_applied;
}

/* The smallest staleness s with at least q of the uses at or below it. */
static double tr__hist_quantile(const uint64_t *hist, uint64_t uses, double q) {
  uint64_t need = (uint64_t)ceil(q * (double)uses), acc = 0;
  for (size_t k = 0; k < TR_STALENESS_BUCKETS; k++) {
    acc += hist[k];
    if (acc >= need && acc > 0) return (double)k;
  }
  return NAN;
}

void tr_optimizer_staleness(const tr_optimizer *o, tr_summary *sm) {
  memset(sm->staleness_hist, 0, sizeof sm->staleness_hist);
  sm->staleness_uses = o != NULL ? o->uses : 0;
  sm->staleness_p50 = sm->staleness_p90 = sm->staleness_p99 = NAN;
  if (o == NULL || o->uses == 0) return;
  memcpy(sm->staleness_hist, o->hist, sizeof sm->staleness_hist);
  sm->staleness_p50 = tr__hist_quantile(o->hist, o->uses, 0.50);
  sm->staleness_p90 = tr__hist_quantile(o->hist, o->uses, 0.90);
  sm->staleness_p99 = tr__hist_quantile(o->hist, o->uses, 0.99);
}

void tr_optimizer_destroy(tr_optimizer *o) {
  if (o == NULL) return;
  pt_destroy(o->trainer);
  pt_abs_destroy(o->abs);
  free(o->fallbacks);
  ac_sgd_destroy(o->sgd);
  ac_adamw_destroy(o->adamw);
  memset(o, 0, sizeof *o);
}

/* ==================================================================================== */
/* The loop                                                                               */

long tr_total_steps(const tr_options *opts, const tr_model *model) {
  if (opts->steps > 0) return opts->steps;
  double spe = model != NULL && model->steps_per_epoch > 0 ? (double)model->steps_per_epoch : 1;
  double t = ceil(opts->epochs * spe);
  return t < 1 ? 1 : t > 1e12 ? (long)1e12 : (long)t;
}

void tr_print_start(const tr_options *opts, const ac_backend *be, const tr_model *model) {
  if (opts->quiet) return;
  size_t numel = 0;
  for (size_t i = 0; i < model->nparams; i++) numel += model->params[i]->value.numel;
  fprintf(stderr, "%s: %zu parameters in %zu tensors, %s, %s, %ld steps\n", model->name, numel,
          model->nparams, ac_backend_describe(be), tr_optimizer_name(opts->optimizer),
          tr_total_steps(opts, model));
}

void tr_print_result_end(const tr_options *opts, const tr_summary *summary) {
  if (opts->optimizer == TR_SHAMPOO || opts->optimizer == TR_KFAC)
    printf(", staleness mean %.2f p50/p90/p99 %.0f/%.0f/%.0f max %ld steps, %ld fallback steps",
           summary->staleness_mean, summary->staleness_p50, summary->staleness_p90,
           summary->staleness_p99, summary->staleness_max, summary->fallback_steps);
  printf("\n");
}

/* The progress line: redrawn in place on a terminal (at most 4 times a second), one line
 * per tenth of the run otherwise (logs stay short). */
typedef struct {
  int tty;
  double last;
  long every;
  int drawn;
} tr__progress;

static void tr__progress_show(tr__progress *p, const tr_model *m, long step, long total,
                              double loss, double train_s, int final) {
  double now = tr__now();
  int show = p->tty ? (final || now - p->last >= 0.25) : (final || step % p->every == 0);
  if (!show) return;
  p->last = now;
  char line[200];
  double rate = train_s > 0 ? m->items_per_step * (double)step / train_s : NAN;
  tr_format_progress(line, sizeof line, step, total, loss, rate, m->item_unit, train_s,
                     tr_eta(train_s, step, total));
  if (p->tty) {
    fprintf(stderr, "\r%-78s", line);
    p->drawn = 1;
    if (final) {
      fputc('\n', stderr);
      p->drawn = 0;
    }
  } else {
    fprintf(stderr, "%s\n", line);
  }
  fflush(stderr);
}

static void tr__progress_note(tr__progress *p, const char *fmt, ...) {
  if (p->drawn) fputc('\n', stderr);
  p->drawn = 0;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fflush(stderr);
}

/* Under mpirun: joins the data-parallel workers (pt_dp), gives the model its share of the
 * batch, makes the job name (rank 0's pid) and the daemon address (%r: this rank) each
 * worker's, and lets rank 0 alone print progress and write --out. Alone: *dp = NULL. */
static int tr__data_parallel(tr_options *o, ac_backend *be, const tr_model *model, pt_dp **dp,
                             tr_error *err) {
  pt_error perr = {""};
  int rc = tr__trainer(err, pt_dp_init(dp, &perr), &perr);
  if (rc != TR_OK || *dp == NULL) return rc;
  o->dp = *dp;
  o->dp_rank = pt_dp_rank(*dp);
  o->dp_size = pt_dp_size(*dp);
  ac_bn_sync sync;
  pt_dp_bn_sync(*dp, be, &sync);
  if (model->shard == NULL || model->shard(model->ctx, o->dp_rank, o->dp_size, &sync) != 0) {
    rc = tr__fail(
        err, TR_EINVAL, "%s: %s with %d data-parallel workers", model->name,
        model->shard == NULL ? "cannot be trained data-parallel" : "its batch does not divide",
        o->dp_size);
    pt_dp_finalize(*dp);
    *dp = NULL;
    return rc;
  }
  long id = (long)getpid();
  pt_dp_broadcast(*dp, &id);
  if (o->job[0] == '\0') snprintf(o->job, sizeof o->job, "%s-dp-%ld", model->name, id);
  char addr[sizeof o->daemon];
  size_t n = 0;
  for (const char *p = o->daemon; *p && n + 12 < sizeof addr; p++) {
    if (p[0] == '%' && p[1] == 'r') {
      n += (size_t)snprintf(addr + n, sizeof addr - n, "%d", o->dp_rank);
      p++;
    } else {
      addr[n++] = *p;
    }
  }
  addr[n] = '\0';
  snprintf(o->daemon, sizeof o->daemon, "%s", addr);
  if (o->dp_rank > 0) {
    o->quiet = 1;
    o->out[0] = '\0';
  }
  return TR_OK;
}

/* Set by SIGTERM or SIGINT during tr_train: stop after the step in progress. */
static volatile sig_atomic_t tr__stop_asked;

static void tr__on_stop(int sig) {
  (void)sig;
  tr__stop_asked = 1;
}

/* ABS at the end of an epoch (epoch, 1-based; an --abs-interval): the eigenvalue, the rule,
 * and the batch factor and lr scale of the coming updates. */
static int tr__abs_epoch(tr_optimizer *o, const tr_model *model, long epoch, long *factor,
                         double *lr_scale, tr__progress *prog, tr_error *err) {
  pt_abs_directive d;
  pt_error perr = {""};
  double t0 = tr__now();
  int rc = tr__trainer(err, pt_abs_epoch(o->abs, model->hv_grad, model->ctx, &d, &perr), &perr);
  if (rc != TR_OK) return rc;
  pc_abs_opts def;
  pc_abs_opts_default(&def);
  long k = (long)(d.batch / def.base_batch);
  if (k != *factor && model->set_batch_factor(model->ctx, k) != 0)
    return tr__fail(err, TR_EMODEL, "ABS: the model refused a batch of %ld batches", k);
  *factor = k;
  *lr_scale = d.lr_scale;
  if (!o->opts.quiet)
    tr__progress_note(prog,
                      "abs after epoch %ld: lambda %.4g (%d products%s, %.1f s), %s: batch %u, "
                      "lr x%g\n",
                      epoch, d.lambda, d.power_iters, d.converged ? "" : ", not converged",
                      tr__now() - t0, pc_abs_decision_name(d.decision), d.batch, d.lr_scale);
  return TR_OK;
}

int tr_train(const tr_options *opts, ac_backend *be, const tr_model *model, tr_summary *summary,
             tr_error *err) {
  if (opts == NULL || be == NULL || model == NULL || model->train_step == NULL ||
      model->evaluate == NULL || model->params == NULL || model->nparams == 0)
    return tr__fail(err, TR_EINVAL, "tr_train: bad arguments");
  double t_start = tr__now();
  tr_options ropts = *opts;
  tr_options_resolve(&ropts);
  if (ropts.epoch_steps == 0) ropts.epoch_steps = model->steps_per_epoch;
  opts = &ropts;
  pt_dp *dp = NULL;
  int drc = tr__data_parallel(&ropts, be, model, &dp, err);
  if (drc != TR_OK) return drc;
  long total = tr_total_steps(opts, model);
  double base_lr = tr_effective_lr(opts);
  ac_lr_schedule sched;
  if (tr_schedule(opts, total, &sched) != TR_OK)
    return tr__fail(err, TR_EINVAL,
                    "the learning-rate schedule is invalid (--lr %g, "
                    "--lr-floor %g, --step-gamma %g)",
                    base_lr, opts->lr_floor, opts->step_gamma);
  int rc = TR_OK;
  FILE *csv = NULL;
  double *step_ms = NULL, *cpu_ms = NULL, *losses = NULL, *stale = NULL;
  long nstale = 0;
  tr_optimizer opt;
  memset(&opt, 0, sizeof opt);
  tr_summary sm;
  memset(&sm, 0, sizeof sm);
  sm.model = model->name;
  sm.optimizer = tr_optimizer_name(opts->optimizer);
  sm.backend = ac_backend_name(be);
  sm.seed = opts->seed;
  sm.lr = base_lr;
  sm.schedule = tr__schedules[opts->schedule];
  sm.warmup = opts->warmup;
  sm.item_unit = model->item_unit;
  sm.final_eval_loss = sm.final_eval_accuracy = sm.best_eval_loss = NAN;
  sm.staleness_mean = sm.staleness_median = NAN;
  sm.median_step_ms = sm.mean_step_ms = sm.median_step_cpu_ms = NAN;
  sm.staleness_max = -1;
  sm.staleness_p50 = sm.staleness_p90 = sm.staleness_p99 = NAN;
  sm.status = "ok";
  for (size_t i = 0; i < model->nparams; i++) sm.params += (long)model->params[i]->value.numel;

  step_ms = malloc((size_t)total * sizeof *step_ms);
  cpu_ms = malloc((size_t)total * sizeof *cpu_ms);
  losses = malloc((size_t)total * sizeof *losses);
  stale = malloc((size_t)total * sizeof *stale);
  if (step_ms == NULL || cpu_ms == NULL || losses == NULL || stale == NULL) {
    rc = tr__fail(err, TR_ENOMEM, "no memory for %ld steps of figures", total);
    goto done;
  }
  if (opts->out[0] != '\0') {
    char path[1100];
    if (tr_mkdirs(opts->out) != TR_OK) {
      rc = tr__fail(err, TR_EIO, "--out %s: cannot create the directory: %s", opts->out,
                    strerror(errno));
      goto done;
    }
    snprintf(path, sizeof path, "%s/train.csv", opts->out);
    csv = fopen(path, "w");
    /* A line per step as it ends: a live run can be followed (tests/replica does). */
    if (csv != NULL) setvbuf(csv, NULL, _IOLBF, 0);
    if (csv == NULL || tr_csv_header(csv) != TR_OK) {
      rc = tr__fail(err, TR_EIO, "%s: %s", path, strerror(errno));
      goto done;
    }
  }
  if (opts->optimizer == TR_KFAC && model->set_hook == NULL) {
    rc = tr__fail(err, TR_EINVAL, "--optimizer kfac: the %s model has no curvature hooks",
                  model->name);
    goto done;
  }
  rc = tr_optimizer_init(&opt, opts, be, model->params, model->nparams, model->name, err);
  if (rc != TR_OK) goto done;
  if (opts->optimizer == TR_KFAC) { /* the hook computes the factors in backward */
    ac_hook hook;
    if (pt_kfac_hook(opt.trainer, &hook) != PT_OK) {
      rc = tr__fail(err, TR_EINVAL, "K-FAC: no hook");
      goto done;
    }
    model->set_hook(model->ctx, &hook);
    if (opts->kfac_fisher) {
      if (model->set_trainer == NULL) {
        rc = tr__fail(err, TR_EINVAL, "--kfac-fisher model: the %s model has no such pass",
                      model->name);
        goto done;
      }
      model->set_trainer(model->ctx, opt.trainer);
    }
  }

  /* ABS: an update takes `factor` batches; the run and its epochs are counted in batches
   * of the base size (base_done), the schedule too, so that a run of --epochs sees the same
   * data whatever the rule decides; the rule's lr_scale multiplies the schedule's rate. */
  long factor = 1, base_done = 0,
       epoch_len = opts->abs_interval > 0       ? opts->abs_interval
                   : model->steps_per_epoch > 0 ? model->steps_per_epoch
                                                : total;
  long next_epoch = epoch_len;
  double lr_scale = 1.0;
  if (opt.abs != NULL && (model->set_batch_factor == NULL || model->hv_grad == NULL || dp)) {
    rc = tr__fail(err, TR_EINVAL, "--optimizer abs: the %s model %s", model->name,
                  dp ? "cannot run it data-parallel yet" : "has no adaptive batch");
    goto done;
  }

  tr__progress prog = {isatty(STDERR_FILENO), 0, total >= 10 ? total / 10 : 1, 0};
  double train_s = 0;
  long step = 0;
  struct sigaction stop_sa, old_term, old_int;
  memset(&stop_sa, 0, sizeof stop_sa);
  stop_sa.sa_handler = tr__on_stop;
  sigemptyset(&stop_sa.sa_mask);
  tr__stop_asked = 0;
  sigaction(SIGTERM, &stop_sa, &old_term);
  sigaction(SIGINT, &stop_sa, &old_int);
  while (base_done < total) { /* base_done >= step: an update takes factor >= 1 batches */
    step++;
    base_done += factor;
    double t0 = tr__now(), c0 = tr__cpu_now(), h0 = tr__clock_s(CLOCK_THREAD_CPUTIME_ID);
    double loss = NAN;
    int mrc = model->train_step(model->ctx, &loss);
    if (mrc != 0) {
      rc = tr__fail(err, TR_EMODEL, "step %ld: the model's training step failed (%d)", step, mrc);
      sm.status = "model error";
      step--;
      break;
    }
    if (!isfinite(loss)) {
      rc = tr__fail(err, TR_ENONFINITE, "step %ld: training loss is %g; stopping", step, loss);
      sm.status = "diverged";
    }
    if (rc == TR_OK && dp != NULL) {
      pt_error perr = {""};
      rc = tr__trainer(err, pt_dp_average(dp, be, model->params, model->nparams, &loss, &perr),
                       &perr);
    }
    double lr = ac_lr_schedule_at(&sched, base_done) * lr_scale; /* without ABS: step, x1 */
    tr_step_info info = {NAN, -1, 0, NAN};
    if (rc == TR_OK && opts->clip > 0)
      rc = tr__accel(err, ac_clip_grad_norm(model->params, model->nparams, opts->clip, NULL),
                     "gradient clipping");
    double c1 = tr__cpu_now();
    if (rc == TR_OK) rc = tr_optimizer_step(&opt, step, lr, &info, err);
    if (rc == TR_OK) rc = tr__accel(err, ac_sync(be), "ac_sync");
    double dco = tr__cpu_now() - c1;
    if (rc == TR_OK && opt.abs != NULL && base_done >= next_epoch && base_done < total) {
      rc = tr__abs_epoch(&opt, model, base_done / epoch_len, &factor, &lr_scale, &prog, err);
      next_epoch += epoch_len;
    }
    int stop = tr__stop_asked != 0 || (opts->stop_at > 0 && step >= opts->stop_at);
    if (rc == TR_OK && pt_dp_any(dp, &stop) != PT_OK)
      rc = tr__fail(err, TR_EINVAL, "step %ld: the workers could not agree to stop (MPI)", step);
    stop = stop && rc == TR_OK && base_done < total;
    if (stop) sm.status = "stopped";
    double dh = tr__clock_s(CLOCK_THREAD_CPUTIME_ID) - h0;
    double dt = tr__now() - t0, dc = tr__cpu_now() - c0;
    train_s += dt;
    step_ms[step - 1] = dt * 1e3;
    cpu_ms[step - 1] = dc * 1e3;
    losses[step - 1] = loss;
    if (isfinite(info.staleness)) {
      stale[nstale++] = info.staleness;
      if (info.staleness_max > sm.staleness_max) sm.staleness_max = info.staleness_max;
    }
    if (info.fallback) sm.fallback_steps++;
    sm.steps = step;

    tr_row row = {step,           train_s,       dt * 1e3, loss,          NAN,       NAN,     lr,
                  info.staleness, info.fallback, dc * 1e3, info.kl_scale, dco * 1e3, dh * 1e3};
    int eval_now = rc == TR_OK && (base_done >= total || stop ||
                                   (opts->eval_every > 0 && step % opts->eval_every == 0));
    if (!opts->quiet)
      tr__progress_show(&prog, model, base_done, total, loss, train_s, base_done >= total || stop);
    if (eval_now) {
      double el = NAN, ea = NAN;
      if (model->evaluate(model->ctx, opts->eval_batches, &el, &ea) != 0) {
        rc = tr__fail(err, TR_EMODEL, "step %ld: evaluation failed", step);
        sm.status = "model error";
      } else {
        row.eval_loss = el;
        row.eval_accuracy = ea;
        sm.final_eval_loss = el;
        sm.final_eval_accuracy = ea;
        if (isfinite(el) && !(el >= sm.best_eval_loss)) sm.best_eval_loss = el;
        if (!opts->quiet) {
          if (isfinite(ea))
            tr__progress_note(&prog, "eval at step %ld: loss %.4f  accuracy %.4f\n", step, el, ea);
          else
            tr__progress_note(&prog, "eval at step %ld: loss %.4f\n", step, el);
        }
      }
    }
    if (csv != NULL && tr_csv_row(csv, &row) != TR_OK) {
      rc = tr__fail(err, TR_EIO, "%s/train.csv: write failed", opts->out);
      break;
    }
    if (rc != TR_OK) break;
    if (stop) {
      if (!opts->quiet)
        tr__progress_note(&prog, "stopped (%s) after step %ld\n",
                          tr__stop_asked ? "a signal" : "--stop-at", step);
      break;
    }
  }
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGINT, &old_int, NULL);
  if (prog.drawn) fputc('\n', stderr);

  sm.wall_s = train_s;
  long tail = sm.steps < 20 ? sm.steps : 20;
  double acc = 0;
  for (long i = sm.steps - tail; i < sm.steps; i++) acc += losses[i];
  sm.final_train_loss = tail > 0 ? acc / (double)tail : NAN;
  tr_median(step_ms, (size_t)sm.steps, &sm.median_step_ms);
  tr_median(cpu_ms, (size_t)sm.steps, &sm.median_step_cpu_ms);
  sm.mean_step_ms = sm.steps > 0 ? train_s * 1e3 / (double)sm.steps : NAN;
  sm.items_per_s = train_s > 0 ? model->items_per_step * (double)base_done / train_s : NAN;
  if (nstale > 0) {
    double ssum = 0;
    for (long i = 0; i < nstale; i++) ssum += stale[i];
    sm.staleness_mean = ssum / (double)nstale;
    tr_median(stale, (size_t)nstale, &sm.staleness_median);
  }
  tr_optimizer_counters(&opt, &sm.blocks, &sm.stats_pushed, &sm.stats_dropped, &sm.stats_coalesced,
                        &sm.roots_received);
  tr_optimizer_staleness(&opt, &sm);
  if (rc != TR_OK && strcmp(sm.status, "ok") == 0) sm.status = tr_strerror(rc);

  if (dp != NULL && sm.steps > 0) {
    pt_counters pc = {0};
    if (opt.trainer != NULL) pt_get_counters(opt.trainer, &pc);
    printf(
        "data-parallel worker %d of %d: statistics %.3f ms CPU per step (%zu of %zu "
        "blocks), gradient averaging %.3f ms per step\n",
        pt_dp_rank(dp), pt_dp_size(dp), pc.stats_s * 1e3 / (double)sm.steps, pc.units_mine,
        pc.units, pt_dp_seconds(dp) * 1e3 / (double)sm.steps);
    long calls = 0;
    double bn_s = pt_dp_reduce_seconds(dp, &calls);
    if (calls > 0)
      printf(
          "data-parallel worker %d of %d: reductions across workers (batch norm, K-FAC "
          "factors) %.3f ms per step (%ld calls)\n",
          pt_dp_rank(dp), pt_dp_size(dp), bn_s * 1e3 / (double)sm.steps, calls);
  }

done:
  if (opts->optimizer == TR_KFAC && model->set_hook != NULL)
    model->set_hook(model->ctx, NULL); /* the hook's trainer goes next */
  tr_optimizer_destroy(&opt);
  pt_dp_finalize(dp);
  sm.total_s = tr__now() - t_start;
  if (csv != NULL && fclose(csv) != 0 && rc == TR_OK)
    rc = tr__fail(err, TR_EIO, "%s/train.csv: write failed", opts->out);
  if (opts->out[0] != '\0' && step_ms != NULL && (rc == TR_OK || sm.steps > 0)) {
    char path[1100];
    snprintf(path, sizeof path, "%s/summary.json", opts->out);
    FILE *f = fopen(path, "w");
    int wrc = f != NULL ? tr_json_summary(f, &sm) : TR_EIO;
    if (f != NULL && fclose(f) != 0) wrc = TR_EIO;
    if (wrc != TR_OK && rc == TR_OK) rc = tr__fail(err, TR_EIO, "%s: write failed", path);
  }
  free(step_ms);
  free(cpu_ms);
  free(losses);
  free(stale);
  if (summary != NULL) *summary = sm;
  return rc;
}
