/*
 * trainer.h -- the trainer library: joins an accel model's parameters and the worker half of
 * a second-order optimizer to precondd, for any mode. The one public header of trainer/;
 * public names carry the prefix pt_, internal ones pt__ (trainer_internal.h, not for outside
 * code).
 *
 * Arrows: trainer depends on accel (the optimizer's worker half) and on libprecond (the
 * daemon); neither of those depends on it, and callers (bench/, examples/) need no other
 * link to precondd. This header does not include libprecond's.
 *
 * The model
 * - pt_create builds the mode's worker optimizer over the caller's parameters, connects to
 *   precondd, registers the job with every parameter as a tensor, and takes the daemon's
 *   answer as the layout (the daemon's block ids, in the daemon's order; a worker whose own
 *   cut disagrees is refused, never re-matched).
 * - pt_step, after the backward pass, is one training step: pushes what the mode needs
 *   (Shampoo: G G^T and G^T G of every block, when due), picks up the newest results
 *   libprecond holds, hands them to the worker, and updates the parameters. It never waits
 *   on the network, except with sync_roots (reproducible runs: it waits for the results of
 *   this step's statistics).
 * - A mode is one entry of a small table inside the library (trainer.c) and one file
 *   (shampoo.c today; K-FAC and ABS are additions of the same shape).
 *
 * Conventions
 * - Functions return int: PT_OK (0) or a negative PT_E* code; pt_strerror turns a code into
 *   a static message. Calls that can fail for a reason worth telling also write one line
 *   into a caller-provided pt_error (may be NULL).
 * - The caller owns the pt_trainer (pt_destroy) and keeps the parameters alive until then.
 */
#ifndef PRECOND_TRAINER_TRAINER_H
#define PRECOND_TRAINER_TRAINER_H

#include <stddef.h>
#include <stdint.h>

#include "accel.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
  PT_OK = 0,
  PT_EINVAL = -1,   /* bad argument or option */
  PT_ENOMEM = -2,   /* allocation failed */
  PT_EACCEL = -3,   /* the worker optimizer (accel) failed */
  PT_EDAEMON = -4,  /* precondd unreachable, refused a call, or its layout disagrees */
  PT_ETIMEDOUT = -5 /* sync_roots: the results did not arrive in time */
};

const char *pt_strerror(int status);

typedef struct {
  char msg[512];
} pt_error;

/* The modes the library drives (numbers are the library's own). */
typedef enum { PT_MODE_SHAMPOO = 0, PT_MODE_KFAC = 1 } pt_mode;

/* Where K-FAC's preconditioner comes from (pt_kfac_opts.form). */
typedef enum {
  /* precondd's damped inverses (the default: docs/kfac.md, "The eigen form in training") */
  PT_KFAC_FORM_DAEMON = 0,
  /* the same damped inverses computed on the worker from its own running averages of A and
   * G (of the fp32 factors), at the pushes where precondd computes: with sync_roots and fp32
   * pushes the daemon's run to the bit (the check of the worker path) */
  PT_KFAC_FORM_WORKER_INVERSE = 1,
  /* KAISA's eigen form, Q_G [(Q_G^T grad Q_A) / (v_G v_A^T + lambda)] Q_A^T, computed on the
   * worker the same way: precondd does not publish it (docs/kfac.md says why) */
  PT_KFAC_FORM_WORKER_EIGEN = 2
} pt_kfac_form;

/* Which of a batch's rows a dense layer's factors come from when pt_kfac_opts.dense_rows
 * takes fewer than all (docs/kfac.md, "Session 8"). */
typedef enum {
  /* the first dense_rows rows: a language model's rows are whole sequences one after the
   * other, so a prefix is the first sequences, every position (unbiased when the batch's
   * sequences are drawn independently, as the clients' windows are) */
  PT_KFAC_ROWS_PREFIX = 0,
  /* every (rows / dense_rows)-th row, from a first row that cycles through the stride from
   * one factor step to the next: all sequences, but at a stride that divides the sequence
   * length the same positions of each at one step (unbiased over a cycle, not per step) */
  PT_KFAC_ROWS_STRIDED = 1
} pt_kfac_rows;

/* K-FAC (trainer/kfac.c, docs/kfac.md). The worker computes each layer's factors A and G
 * through the layers' curvature hooks (install pt_kfac_hook's hook on the model), pushes
 * them, and preconditions with the newest damped inverses: G^-1 grad A^-1 per dense or conv
 * layer, grad / (F + lambda) per batch norm with its diagonal Fisher kept on the worker,
 * then the KL clip over all of them, then SGD with momentum and weight decay. Every other
 * parameter (embeddings, layer norms, a layer with no hook) takes the SGD step on its plain
 * gradient, as does every layer until its first inverses arrive (counted as fallback). */
typedef struct {
  pc_kfac_opts k;          /* decay, damping (lambda), pi-damping, KL clip, inv_every, the
                              factor schedule: pc_kfac_opts_default (one source) */
  long steps_per_epoch;    /* the schedule's epoch (factors every factor_every_first steps
                              in the first first_epochs epochs); required, >= 1 */
  ac_sgd_opts sgd;         /* momentum and weight decay of the final step
                              (ac_sgd_opts_default) */
  float loss_scale;        /* the count the loss is a mean over; 0: each layer's batch
                              (images, or rows: tokens for a language model) */
  int push_bf16;           /* 1: factors travel as bf16 (half the bytes); default 0 */
  size_t a_images;         /* conv layers: A from the first a_images images of the batch
                              only (KFC's expectation from a subset: the A syrk is most
                              of a factor step's cost); default 16; 0: the whole batch */
  size_t dense_rows;       /* dense layers: A and G from dense_rows of the batch's rows
                              (tokens of a language model) only: the syrks are most of a
                              factor step; default 256; 0: every row. Data-parallel: of
                              the global batch, each worker its 1/W of them */
  pt_kfac_rows row_sample; /* which rows when dense_rows takes fewer than all (default
                              strided) */
  int quiet;               /* 1: do not list each layer's treatment on stderr at start */
  double base_lr;          /* the run's base (peak) rate, for k.kl_base_lr; 0: the largest
                              rate pt_step has been given so far */
  int model_fisher;        /* 1: the model's Fisher, factors from a backward pass on labels
                              drawn from the model's predictive distribution (the client
                              runs it: pt_kfac_model_fisher); 0 (default): the empirical
                              Fisher, factors from the batch's own backward pass */
  uint64_t sample_seed;    /* the draws' seed (ac_rand_uniform's counter-based numbers) */
  int inverse;             /* the inverse method: 0 (default) by size (pc_kfac_inv_for_size,
                              Cholesky at every size measured), else 1 + a pc_kfac_inv (the
                              wire's KfacInverse numbering) */
  pt_kfac_form form;       /* PT_KFAC_FORM_DAEMON (default); the worker forms refuse data
                              parallelism (shard_size > 1) */
} pt_kfac_opts;

/* "shampoo", "kfac"; "?" otherwise. */
const char *pt_mode_name(pt_mode mode);

typedef struct {
  pt_mode mode;
  const char *daemon;     /* "host:port" or "unix:/path"; NULL: libprecond's default */
  const char *job;        /* job name on the daemon (required, copied) */
  const char *worker;     /* worker name sent at register; may be NULL */
  int connect_timeout_ms; /* wait this long for the daemon at pt_create (default 5000) */
  int sync_roots;         /* 1: a step that pushes waits for the results of its own
                              statistics before updating (reproducible; default 0) */
  int sync_timeout_ms;    /* sync_roots' bound per wait (default 60000) */
  long root_delay;        /* Shampoo with sync_roots: step t uses the roots of the statistics
                              through step t - root_delay (held on the worker until then), a
                              deterministic stand-in for asynchronous roots that are
                              root_delay steps old; 0 (default): its own step's */
  long root_every;        /* Shampoo: precondd recomputes a block's roots when its statistics
                              step enters a new window of root_every steps (the job's
                              shampoo.root_every), so with sync_roots a step waits for roots
                              at most root_every - 1 steps old. 1 (default): every push */
  long sync_first;        /* Shampoo: steps 1..sync_first wait for their own roots as
                              sync_roots does (root_delay starts after them), so the first
                              roots, made while the statistics move fastest, are fresh; the
                              later steps are asynchronous. 0 (default): none */
  int poll_interval_ms;   /* libprecond's FetchPreconditioners poll period, ms; 0 (default):
                              the mode's: Shampoo libprecond's 20; K-FAC half its mean step
                              wall time, within 10..1000 (trainer/kfac.c) */
  /* Data-parallel workers (pt_dp): this worker computes and pushes the statistics of its
   * share of the units only, and fetches every result. shard_size 1 (default): all. The
   * share: with as many daemon replicas as workers (the layout's owners), the units the
   * daemon of rank shard_rank owns; otherwise unit ids i with i % shard_size == shard_rank
   * (the daemon forwards them to their owners). */
  int shard_rank, shard_size;
  /* Data-parallel workers (borrowed; NULL: alone): without sync_roots every worker hands
   * its optimizer a block's roots only when all workers hold the same version (one
   * agreement per step, pt_dp_agree), so that every one applies the same update. */
  struct pt_dp *dp;
  /* Shampoo: the worker's options, and the ones it registers with the daemon (block size,
   * skip limit, statistics EMA beta2, ridge epsilon): one struct configures both halves. */
  ac_shampoo_opts shampoo;
  pt_kfac_opts kfac; /* K-FAC's (PT_MODE_KFAC) */
} pt_options;

/* Fills the defaults above for mode (Shampoo: ac_shampoo_opts_default; K-FAC:
 * pc_kfac_opts_default, ac_sgd_opts_default). */
void pt_options_default(pt_options *opts, pt_mode mode);

typedef struct pt_trainer pt_trainer;

/* Creates the trainer: the mode's worker optimizer over params[0..nparams-1] (borrowed: they
 * must outlive the trainer; every one on the same backend), the connection, the job. On
 * PT_OK the caller owns *out (pt_destroy). PT_EINVAL, PT_ENOMEM, PT_EACCEL, PT_EDAEMON (the
 * daemon is unreachable, refused the job, or cut the tensors otherwise than the worker: err
 * says which); then *out is NULL. */
int pt_create(pt_trainer **out, const pt_options *opts, ac_param *const *params, size_t nparams,
              pt_error *err);

void pt_destroy(pt_trainer *t);

/* What one step did. */
typedef struct {
  int pushed;            /* statistics of this step were queued for the daemon */
  size_t preconditioned; /* units (Shampoo: blocks) that used the daemon's results */
  size_t fallback;       /* units that took the fallback step (no usable results) */
  double staleness_mean; /* steps between the results used and this step; NaN: none */
  long staleness_max;    /* -1: none used */
  double kl_scale;       /* K-FAC: the KL clip's factor nu applied this step (1: no clip); NaN:
                            Shampoo, or nothing preconditioned */
} pt_step_info;

/* One training step at step (1-based, consecutive) with learning rate lr (finite, >= 0),
 * after the backward pass filled every parameter's grad. info may be NULL. */
int pt_step(pt_trainer *t, long step, double lr, pt_step_info *info, pt_error *err);

/* Counters since pt_create. */
typedef struct {
  size_t units;              /* Shampoo: preconditioned blocks; K-FAC: layers the daemon serves */
  uint64_t pushed;           /* statistics blocks queued */
  uint64_t dropped;          /* dropped by a full queue */
  uint64_t coalesced;        /* replaced in the queue by a newer push of the same block */
  uint64_t push_errors;      /* blocks the daemon rejected */
  uint64_t results_applied;  /* result versions handed to the worker */
  uint64_t results_rejected; /* versions the worker refused (non-finite, wrong size) */
  uint64_t daemon_restarts;  /* times the job was registered again (daemon lost it) */
  uint64_t resumed_step;     /* last step whose statistics the daemon held at register */
  size_t units_mine;         /* units whose statistics this worker computes (shards) */
  double stats_s;            /* seconds spent computing and queueing statistics (K-FAC:
                                factors, without the reductions across workers) */
} pt_counters;

void pt_get_counters(const pt_trainer *t, pt_counters *out);

/* ---- data parallelism (dp.c) ---- */
/*
 * Workers started by `mpirun -np W` train one model: each takes its share of the global
 * batch, pt_dp_average averages the gradients (and the loss) over the workers so that every
 * one applies the same update, and pt_options.shard_rank / shard_size split the statistics.
 * MPI is initialised only when an MPI launcher started the process (as precondd does);
 * a worker started alone gets no pt_dp and trains alone.
 */
typedef struct pt_dp pt_dp;

/* *out: NULL when not started by an MPI launcher (one worker); else owned (pt_dp_finalize).
 * PT_EINVAL when started by one with W > 1 but built without MPI. */
int pt_dp_init(pt_dp **out, pt_error *err);
/* This worker's rank and the worker count (0 and 1 for NULL). */
int pt_dp_rank(const pt_dp *dp);
int pt_dp_size(const pt_dp *dp);
/* Averages every params[i]->grad over the workers, in buckets of at most 4 MiB (one
 * MPI_Allreduce each), and *loss with them. A no-op for NULL. PT_EACCEL, PT_EINVAL (MPI). */
int pt_dp_average(pt_dp *dp, ac_backend *be, ac_param *const *params, size_t nparams, double *loss,
                  pt_error *err);
/* For each i: v[i] where every worker passed the same value, else 0 (on every worker). A
 * no-op for NULL. PT_EINVAL (MPI). */
int pt_dp_agree(pt_dp *dp, uint64_t *v, size_t n);
/* *flag = 1 on every worker if any worker passed a non-zero one, else 0 (a stop asked of
 * one worker: all stop after the same step). A no-op for NULL. PT_EINVAL (MPI). */
int pt_dp_any(pt_dp *dp, int *flag);
/* Rank 0's value of *v on every worker (a job name's number, a seed). */
int pt_dp_broadcast(pt_dp *dp, long *v);
/* Seconds spent in pt_dp_average. */
double pt_dp_seconds(const pt_dp *dp);
/* Batch norm across the workers (sync BN): fills *out with the reduction accel's batch norm
 * calls (ac_bn_sync: the mean over the workers of n device floats, through host memory of
 * dp on be; ac_resnet_set_sync installs it). dp and be must outlive its use; calls come
 * in the same order on every worker (one forward and one backward pass each). dp NULL:
 * out->fn NULL (one worker: the share is the batch). */
void pt_dp_bn_sync(pt_dp *dp, ac_backend *be, ac_bn_sync *out);
/* On worker root: the mean over the workers of h (n host floats, each worker's own); the
 * others' h are left as they were (K-FAC factors reduced to the worker that pushes that
 * layer). Every worker calls it with the same n and root. A no-op for NULL. PT_EINVAL (MPI). */
int pt_dp_mean_to(pt_dp *dp, float *h, size_t n, int root);
/* Seconds spent in the sync BN reduction and pt_dp_mean_to, and how many calls. */
double pt_dp_reduce_seconds(const pt_dp *dp, long *calls);
void pt_dp_finalize(pt_dp *dp);

/* The worker optimizer of a Shampoo trainer (owned by t), for inspection; NULL otherwise. */
ac_shampoo *pt_shampoo(const pt_trainer *t);

/* K-FAC: the curvature hook to install on the model's layers (ac_resnet_set_hook,
 * ac_lm_set_hook, or a layer's hook field) before the first backward pass. The hook
 * computes factors in backward on the steps the schedule makes due (and does nothing on
 * the others). A K-FAC job registers with precondd at the first pt_step, once that
 * backward pass has shown which parameters are dense, conv and batch-norm layers; the
 * treatment of every parameter is then listed on stderr (unless kfac.quiet). pt_step
 * overwrites the grads of preconditioned parameters with their preconditioned values.
 * PT_EINVAL for a trainer of another mode. */
int pt_kfac_hook(pt_trainer *t, ac_hook *out);

/* K-FAC's model Fisher (kfac.model_fisher). Call after the forward pass of step's batch and
 * before its backward. When the factors of the coming step are due: labels (device int32,
 * rows; on entry the batch's own, so a loss's ignored rows stay ignored) get one draw per
 * row from probs (device, rows x cols, the loss's softmax) by ac_sample_rows, the caller's
 * backward(ctx) runs on them with the hook computing the factors, and *ran = 1: the caller
 * then zeroes the grads and runs its own backward on the batch's labels, during which the
 * hook does nothing. Otherwise (the empirical Fisher, or no factors due) nothing happens,
 * *ran = 0, and the one backward computes the factors as usual. labels, probs and ctx stay
 * the caller's. PT_EINVAL for a trainer of another mode; backward's nonzero return is
 * PT_EACCEL. */
int pt_kfac_model_fisher(pt_trainer *t, size_t rows, size_t cols, const float *probs,
                         int32_t *labels, int (*backward)(void *ctx), void *ctx, int *ran,
                         pt_error *err);

/* ---- ABS / ABSA (trainer/abs.c; docs/abs.md) ------------------------------------------ */

/* ABS's worker half, run in the worker for now: at each epoch boundary the top Hessian
 * eigenvalue by power iteration over Hessian-vector products (ac_hvp, central differences)
 * and the adaptive-batch rule (pc_abs_rule) give the directive for the next epoch. The
 * power-iteration state and the rule move into precondd with mode_abs.c (docs/abs.md,
 * "What is left"); this interface stays the worker's. */
typedef struct pt_abs pt_abs;

/* One epoch boundary's directive. */
typedef struct {
  uint32_t batch;      /* the batch size of the coming epoch */
  double lr_scale;     /* the learning rate's factor (batch / base batch) */
  double adv_fraction; /* ABSA's FGSM share before the second-half cut
                              (pc_abs_adv_fraction) */
  double lambda;       /* the eigenvalue measured; NAN when the rule no longer runs */
  int power_iters;     /* Hessian-vector products taken (0: none) */
  int converged;       /* 1: the estimate met power_tol within power_max_iters */
  pc_abs_decision decision;
} pt_abs_directive;

/* Builds ABS's worker half over params (one backend; kept by the caller until
 * pt_abs_destroy) with opts (pc_abs_opts_check'd; copied). *out is the caller's. */
int pt_abs_create(pt_abs **out, ac_param *const *params, size_t nparams, const pc_abs_opts *opts,
                  pt_error *err);
void pt_abs_destroy(pt_abs *a);

/* The start's directive (base batch, lr_scale 1, the options' adversarial share). */
void pt_abs_initial(const pt_abs *a, pt_abs_directive *d);

/* An epoch boundary: while the rule runs, estimates the top eigenvalue with grad(ctx)
 * computing the loss gradient into the params' grads on one fixed batch (the caller's:
 * hv_batch samples, model in evaluation mode; see ac_hvp_compute), applies the rule and
 * writes the directive. The weights come back bit for bit and the grads are left zero.
 * The k-th estimate starts from the probe of seed + k. */
int pt_abs_epoch(pt_abs *a, int (*grad)(void *ctx), void *ctx, pt_abs_directive *d, pt_error *err);

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_TRAINER_TRAINER_H */
