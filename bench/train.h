/*
 * train.h -- the training harness shared by the benchmark clients (bench/transformer.c,
 * bench/resnet.c): command-line options, the training loop, the progress line, the CSV and
 * JSON writers, and the optimizers as the clients drive them (Shampoo through the trainer
 * library, trainer/trainer.h, which joins its worker half to precondd).
 * The one public header of bench/train.c; public names carry the prefix tr_.
 *
 * Conventions
 * - Functions return int: TR_OK (0) or a negative TR_E* code; tr_strerror turns a code into
 *   a static message. Calls that can fail for a reason worth telling also write one line into
 *   a caller-provided tr_error (may be NULL).
 * - Structs are caller-allocated; *_init pairs with *_destroy, which is safe on a struct that
 *   failed to initialise or was already destroyed.
 * - Reproducibility: SGD and AdamW runs with the same seed, backend and options give the
 *   same numbers. Shampoo's roots arrive asynchronously, so its runs depend on timing,
 *   except with --sync-roots, which waits for the roots of each step's statistics.
 */
#ifndef PRECOND_BENCH_TRAIN_H
#define PRECOND_BENCH_TRAIN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "trainer.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TR_OK = 0,
  TR_EINVAL = -1,     /* bad argument or option value */
  TR_EIO = -2,        /* a file could not be written */
  TR_ENOMEM = -3,     /* allocation failed */
  TR_EACCEL = -4,     /* an accel call failed */
  TR_EDAEMON = -5,    /* precondd unreachable or refused a call */
  TR_EMODEL = -6,     /* the model's step or evaluation failed */
  TR_ENONFINITE = -7, /* the training loss became NaN or Inf */
  TR_EHELP = -8       /* --help was given (the text is printed): exit 0 */
};

const char *tr_strerror(int status);

typedef struct {
  char msg[512];
} tr_error;

/* ------------------------------------------------------------------------------------ */
/* Options                                                                                */

typedef enum {
  TR_SGD = 0,
  TR_ADAMW = 1,
  TR_SHAMPOO = 2,
  TR_KFAC = 3,
  TR_ABS = 4 /* SGD with ABS's adaptive batch (trainer/abs.c; docs/abs.md) */
} tr_optimizer_kind;

/* "sgd", "adamw", "shampoo", "kfac"; "?" otherwise. */
const char *tr_optimizer_name(tr_optimizer_kind kind);

/* Defaults that depend on the model and the optimizer (the common practice for each) come
 * from one table in train.c, shown by --help: the fields marked "table" below hold
 * TR_UNSET (or -1 for the integers) until tr_options_resolve fills them from the row of
 * (opts->model, opts->optimizer); a value the user gave is kept. */
#define TR_UNSET (-1.0)

typedef struct {
  const char *model; /* the table's key: "transformer", "resnet"; NULL: generic rows
                              (static text, not owned) */
  tr_optimizer_kind optimizer;
  long steps;          /* training steps; 0: from epochs */
  long stop_at;        /* stop after this step, the schedule still over steps (an early
                          look at a long run); 0: run them all (default) */
  double epochs;       /* used when steps is 0 (rounded up to whole steps) */
  double lr;           /* base learning rate (table) */
  double momentum;     /* SGD heavy ball (table) */
  double beta1, beta2; /* AdamW, and Shampoo's grafted Adam (table) */
  double eps;          /* AdamW epsilon (1e-8) */
  double weight_decay; /* decoupled for AdamW and Shampoo, L2 for SGD (table) */
  double clip;         /* global gradient-norm clip; 0: off (default 0) */
  long warmup;         /* linear warm-up steps (table; a table value is cut to a tenth
                              of the run) */
  int schedule;        /* ac_lr_decay after the warm-up (default AC_LR_COSINE) */
  double lr_floor;     /* cosine: decays to lr_floor * lr (default 0) */
  long step_size;      /* step: steps between decays; 0: a third of the decay (default) */
  double step_gamma;   /* step: factor per decay (default 0.1) */
  int nesterov;        /* Nesterov momentum (SGD, Shampoo) (table) */
  /* Shampoo */
  long block_size; /* block size, the same on worker and daemon (default 128) */
  /* Shampoo's defaults below are ac_shampoo_opts_default's (accel, the one table) */
  double stat_beta2;       /* EMA of the statistics on the daemon (1 = sum) */
  double shampoo_eps;      /* relative ridge of the roots (default 1e-6) */
  int graft;               /* pc_graft: the grafted step */
  double shampoo_momentum; /* momentum on the grafted direction */
  double shampoo_beta1;    /* Shampoo's first moment of the gradient; 0: off (table) */
  int shampoo_nesterov;    /* 1: Nesterov look-ahead of that first moment */
  int one_sided;           /* 1: one root per block, exponent 1/2 (default: both sides) */
  int root_method;         /* 0: the daemon's coupled Newton, 1: eigh (PC_METHOD_EIGH) */
  int root_exponent;       /* p of L^(-1/p) G R^(-1/p) */
  long stat_every;         /* push statistics every N steps (default 1) */
  long roots_start;        /* first step that may use roots (default 1) */
  long max_staleness;      /* roots older than this many steps are not used; 0: no bound */
  int sync_roots;          /* 1: after each push, wait for roots of that step (reproducible) */
  long sync_first;         /* Shampoo: the first N steps wait for their own roots (0: none);
                              table, resolved when the workers are known (train.c) */
  long root_every;         /* Shampoo: precondd's roots of a block when its statistics step
                              enters a new window of N steps (the job's root_every) (table) */
  long root_delay;         /* with sync_roots: step t uses the roots of the statistics through
                              step t - root_delay (a deterministic stand-in for asynchronous
                              roots; default 0) */
  /* K-FAC (trainer/kfac.c); the defaults are pc_kfac_opts_default's (the one table) */
  double kfac_damping;      /* lambda of the Tikhonov damping */
  double kfac_decay;        /* running average of the factors on the daemon */
  double kl_clip;           /* c of the KL clip */
  int kl_base_lr;           /* 1: the clip's lr is --lr (the schedule scales the clipped step) */
  int kfac_pi;              /* 1: pi-damping (split lambda between A and G) */
  long inv_every;           /* inverses every N pushes (the daemon) */
  long factor_every;        /* factors every N steps after the first epochs */
  long factor_every_first;  /* ... and every N steps in them */
  long factor_first_epochs; /* epochs on factor_every_first */
  long epoch_steps;         /* the schedule's epoch; 0: the data's (tr_train fills it) */
  int kfac_bf16;            /* 1: factors travel as bf16 */
  int kfac_fisher;          /* 0: empirical, 1: the model's (tr_model.set_trainer's pass) */
  long kfac_a_images;       /* conv A from this many images of the batch; 0: all */
  long kfac_rows;           /* dense A and G from this many rows of the batch; 0: all */
  int kfac_row_sample;      /* pt_kfac_rows: 0 a prefix, 1 strided */
  int kfac_inverse;         /* 0: by size (the daemon's rule), else 1 + pc_kfac_inv */
  int kfac_form;            /* pt_kfac_form: 0 precondd's inverses, 1/2 worker inverse/eigen */
  /* ABS (trainer/abs.c) */
  long abs_interval; /* batches (of the model's size) between the rule's evaluations; 0: an
                        epoch of the data, the paper's (short runs evaluate more often) */
  char daemon[256];  /* precondd address (default 127.0.0.1:50551 or $PRECOND_ADDR);
                              %r: the data-parallel rank (docs/replicas.md) */
  char job[128];     /* job name on the daemon; "" : <model>-<optimizer>-<pid> */
  long poll_ms;      /* libprecond's poll period; 0: the trainer's default for the mode */
  /* Run */
  uint64_t seed;           /* default 1 */
  ac_backend_kind backend; /* cpu (default) or cuda */
  int threads;             /* OpenBLAS threads of the CPU backend (default 1) */
  char out[512];           /* output directory; "" : no files */
  long eval_every;         /* evaluate every N steps (and at the end); 0: only at the end */
  long eval_batches;       /* batches per evaluation; 0: the model's default */
  int quiet;               /* 1: no progress line */
  int dp_rank, dp_size;    /* set by tr_train under mpirun (data parallelism); 0, 1 */
  struct pt_dp *dp;        /* set by tr_train under mpirun: the workers; NULL alone */
} tr_options;

/* Fills the defaults listed above (table fields unset; model NULL). */
void tr_options_default(tr_options *opts);

/* Fills every unset table field of opts from the row of (opts->model, opts->optimizer), or
 * the generic row of the optimizer when the model has none. Idempotent. tr_parse_args calls
 * it; so do tr_optimizer_init and tr_train on their copies. */
void tr_options_resolve(tr_options *opts);

/* The learning-rate schedule of a run of total steps: warm-up opts->warmup, then
 * opts->schedule over the remaining steps (cosine reaches lr_floor * lr at the last step).
 * opts must be resolved. Returns TR_OK or TR_EINVAL (a field out of range). */
int tr_schedule(const tr_options *opts, long total, ac_lr_schedule *sched);

/* A client-specific option (model sizes, batch): the parser stores its value through dest.
 * TR_ARG_LONG: dest is long*, value in [min, max]; TR_ARG_DOUBLE: double*, in [min, max];
 * TR_ARG_STRING: char* of size max bytes (value must fit). */
typedef enum {
  TR_ARG_LONG = 0,
  TR_ARG_DOUBLE = 1,
  TR_ARG_STRING = 2,
  TR_ARG_FLAG = 3,  /* dest is int*: --name sets 1, --no-name sets 0 */
  TR_ARG_CHOICE = 4 /* dest is int*: the index of the value in choices */
} tr_arg_type;

typedef struct {
  const char *name; /* without the dashes: "d-model" */
  tr_arg_type type;
  void *dest;
  double min, max;
  const char *help;           /* one line */
  const char *const *choices; /* TR_ARG_CHOICE: the names, NULL-terminated */
} tr_arg;

/* Parses argv[1..argc-1] ("--name value" or "--name=value"; a flag "--name" or
 * "--no-name") into opts (which holds the defaults on entry) and the extra options, then
 * tr_options_resolve(opts). Prints usage to stdout for --help and returns
 * TR_EHELP. Returns TR_OK, or TR_EINVAL with a message naming the option in err: an unknown
 * option, a missing or malformed value, a value out of range, a positional argument.
 * prog and summary head the usage text. */
int tr_parse_args(tr_options *opts, const tr_arg *extra, size_t nextra, int argc, char **argv,
                  const char *prog, const char *summary, tr_error *err);

/* Prints the usage text (common and extra options with their defaults) to f. */
void tr_usage(FILE *f, const tr_options *defaults, const tr_arg *extra, size_t nextra,
              const char *prog, const char *summary);

/* Shampoo's sync_first as the trainer gets it: the option, else the table's for a worker
 * alone (0 for data-parallel workers, opts->dp_size > 1), capped at a fortieth of a short
 * run's steps. */
long tr_sync_first(const tr_options *opts);

/* The base learning rate the run uses: opts->lr, or the table's when unset. */
double tr_effective_lr(const tr_options *opts);

/* ------------------------------------------------------------------------------------ */
/* Progress, ETA, statistics                                                              */

/* Seconds left to finish total steps after done steps took elapsed seconds, assuming the
 * same pace; -1 when unknown (done == 0). 0 when done >= total. */
double tr_eta(double elapsed_s, long done, long total);

/* "12s", "3m05s", "2h01m" (negative: "?"). Writes into buf (always NUL-terminated). */
void tr_format_duration(char *buf, size_t len, double seconds);

/* One progress line without a newline: step, loss, throughput in unit per second, elapsed,
 * ETA. Example: "step 120/1000  loss 2.3456  18.2k tok/s  elapsed 14s  eta 1m43s". */
void tr_format_progress(char *buf, size_t len, long step, long total, double loss,
                        double items_per_s, const char *unit, double elapsed_s, double eta_s);

/* Median of n values (copied; vals untouched); NAN when n == 0. Returns TR_ENOMEM if the
 * copy cannot be allocated (then *out is NAN). */
int tr_median(const double *vals, size_t n, double *out);

/* ------------------------------------------------------------------------------------ */
/* CSV log and JSON summary                                                               */

/* One row per training step. Eval columns are empty except on evaluation steps; NaN values
 * are written empty; staleness is empty when no root was used. */
typedef struct {
  long step;
  double wall_s;  /* training time so far (evaluation excluded) */
  double step_ms; /* this step: batch, forward, backward, optimizer */
  double train_loss;
  double eval_loss;     /* NAN: not evaluated at this step */
  double eval_accuracy; /* NAN: not evaluated, or not a classifier */
  double lr;
  double staleness;     /* mean over the blocks that used a root; NAN: none */
  int fallback;         /* 1 if a preconditioned block used the grafted step */
  double cpu_ms;        /* CPU time of the whole worker process (all its threads, libprecond's
                           included) during this step: unlike step_ms, it does not grow when
                           other processes compete for the cores */
  double kl_scale;      /* K-FAC: the KL clip's factor nu (1: not clipped); NAN: other optimizers */
  double opt_cpu_ms;    /* of cpu_ms, the optimizer's step (after backward): with the rest of the
                           step measured in the same run, K-FAC's cost apart from the machine's
                           load of the moment */
  double thread_cpu_ms; /* of cpu_ms, the training thread's own CPU time
                           (CLOCK_THREAD_CPUTIME_ID): cpu_ms less libprecond's thread, the
                           daemon client's and any other thread of the process */
} tr_row;

#define TR_CSV_HEADER                                                                             \
  "step,wall_s,step_ms,train_loss,eval_loss,eval_accuracy,lr,staleness,fallback,cpu_ms,kl_scale," \
  "opt_cpu_ms,thread_cpu_ms"

/* Writes the header (tr_csv_header) or one row to f. Returns TR_OK or TR_EIO. */
int tr_csv_header(FILE *f);
int tr_csv_row(FILE *f, const tr_row *row);

#define TR_STALENESS_BUCKETS 257

/* The end-of-run figures (summary.json). */
typedef struct {
  const char *model; /* "transformer", "resnet" */
  const char *optimizer;
  const char *backend;
  uint64_t seed;
  double lr;               /* the base rate */
  const char *schedule;    /* "constant", "cosine", "step" (after the warm-up) */
  long warmup;             /* warm-up steps */
  long steps;              /* steps completed */
  long params;             /* trainable values */
  double final_train_loss; /* mean over the last min(steps, 20) steps */
  double final_eval_loss;
  double final_eval_accuracy; /* NAN for the language model */
  double best_eval_loss;
  double wall_s;  /* training time (evaluation excluded) */
  double total_s; /* whole run */
  double median_step_ms;
  double mean_step_ms;
  double median_step_cpu_ms; /* process CPU time per step (see tr_row.cpu_ms) */
  double items_per_s;
  const char *item_unit;
  /* Shampoo (zero for the others) */
  double staleness_mean; /* over the steps that used roots */
  double staleness_median;
  long staleness_max;
  /* The distribution over block-steps (each use of a root by a block at a step): the
   * percentiles, and hist[s] = block-steps with staleness s (the last bucket: s >= it). */
  double staleness_p50, staleness_p90, staleness_p99;
  uint64_t staleness_hist[TR_STALENESS_BUCKETS];
  uint64_t staleness_uses; /* block-steps in hist */
  long fallback_steps;     /* steps where some block used the grafted step */
  long blocks;             /* preconditioned blocks */
  uint64_t stats_pushed, stats_dropped, stats_coalesced, roots_received;
  const char *status; /* "ok", or why the run stopped early */
} tr_summary;

/* Writes the summary as one JSON object (NaN as null) to f. Returns TR_OK or TR_EIO. */
int tr_json_summary(FILE *f, const tr_summary *s);

/* ------------------------------------------------------------------------------------ */
/* Optimizers                                                                             */

/* Per-step figures an optimizer reports. */
typedef struct {
  double staleness;   /* mean staleness of the roots used (NAN: none used) */
  long staleness_max; /* -1 if none used */
  int fallback;       /* some preconditioned block used the grafted step */
  double kl_scale;    /* K-FAC: the KL clip's factor (NAN: other optimizers) */
} tr_step_info;

/* The optimizers are accel's (ac_sgd, ac_adamw) or, for Shampoo, the trainer library's
 * (accel's worker half joined to precondd); this wraps the one chosen. */
typedef struct {
  tr_optimizer_kind kind;
  ac_backend *be; /* borrowed */
  size_t nparams;
  ac_param **params; /* borrowed array of borrowed params */
  tr_options opts;   /* copy */
  ac_sgd *sgd;       /* owned; the one of kind, others NULL */
  ac_adamw *adamw;
  pt_trainer *trainer; /* Shampoo, K-FAC: worker half and precondd link */
  pt_abs *abs;         /* ABS: the eigenvalue and the rule (with sgd for the step) */
  uint64_t *fallbacks; /* Shampoo, owned: per block, its fallback count one step ago */
  uint64_t hist[TR_STALENESS_BUCKETS]; /* Shampoo: block-steps that used a root, by staleness */
  uint64_t uses;                       /* Shampoo: the sum of hist */
} tr_optimizer;

/* Creates the backend opts->backend asks for, with opts->threads. On TR_OK *out is a new
 * backend the caller owns (ac_backend_destroy); on TR_EACCEL *out is NULL and err says
 * which backend and why. */
int tr_backend_create(const tr_options *opts, ac_backend **out, tr_error *err);

/* Sets up the optimizer for the nparams parameters params[] (borrowed: they must outlive
 * the optimizer). For Shampoo it creates a trainer (pt_create) for opts->daemon and the job
 * opts->job, or model_name-shampoo-PID. Returns TR_OK (call tr_optimizer_destroy), TR_EINVAL,
 * TR_ENOMEM, TR_EACCEL, TR_EDAEMON (with the daemon's message in err). */
int tr_optimizer_init(tr_optimizer *o, const tr_options *opts, ac_backend *be, ac_param **params,
                      size_t nparams, const char *model_name, tr_error *err);

/* One update from the gradients in params[i]->grad at step (1-based, consecutive); lr is
 * the rate of this step (warm-up applied by the caller). Shampoo: pt_step (statistics
 * pushed every stat_every steps, the newest roots applied: P = L^(-1/4) G R^(-1/4) per
 * block, grafted to the norm of the grafted step of the same block; blocks without roots
 * take the grafted step itself, the fallback). info (may be NULL) gets the staleness of the roots used and whether any
 * block fell back. */
int tr_optimizer_step(tr_optimizer *o, long step, double lr, tr_step_info *info, tr_error *err);

/* The staleness distribution of the Shampoo glue so far into s (staleness_p50/p90/p99,
 * staleness_hist, staleness_uses; NAN and zeros for the others or when no root was used). */
void tr_optimizer_staleness(const tr_optimizer *o, tr_summary *s);

/* Counters of the Shampoo trainer (zeros for the others). */
void tr_optimizer_counters(const tr_optimizer *o, long *blocks, uint64_t *pushed, uint64_t *dropped,
                           uint64_t *coalesced, uint64_t *roots_received);

void tr_optimizer_destroy(tr_optimizer *o);

/* ------------------------------------------------------------------------------------ */
/* Models and the loop                                                                    */

/* A model as the loop drives it; the client fills it from its model and data. */
typedef struct {
  const char *name; /* "transformer", "resnet" */
  void *ctx;
  size_t nparams;
  ac_param **params; /* borrowed */
  /* Draws the next training batch, runs forward and backward: the gradients of the mean
   * loss are written into every params[i]->grad; the mean loss into *loss. */
  int (*train_step)(void *ctx, double *loss);
  /* Held-out evaluation over batches batches (0: model default): mean loss and accuracy
   * (NAN if not a classifier). */
  int (*evaluate)(void *ctx, long batches, double *loss, double *accuracy);
  double items_per_step; /* for the throughput: tokens or images per step */
  const char *item_unit; /* "tok", "img" */
  long steps_per_epoch;  /* for --epochs */
  /* Data parallelism (mpirun -np W): from now on train_step takes worker rank's share of
   * each global batch (the loss and gradients of its mean over that share). sync: the
   * workers' sync BN reduction (pt_dp_bn_sync) for a model with batch norm to install
   * (borrowed, valid for the run). NULL: the model cannot be trained data-parallel.
   * Non-zero when size does not divide the batch. */
  int (*shard)(void *ctx, int rank, int size, const ac_bn_sync *sync);
  /* Sets a curvature hook on the model's layers (ac_resnet_set_hook, ac_lm_set_hook); NULL:
   * the model has none (K-FAC is then refused). */
  void (*set_hook)(void *ctx, const ac_hook *hook);
  /* K-FAC's model Fisher (--kfac-fisher model): hands the model the trainer, whose
   * pt_kfac_model_fisher train_step then calls between its forward and backward passes.
   * NULL: the model has no such pass (the option is then refused). */
  void (*set_trainer)(void *ctx, pt_trainer *t);
  /* ABS (docs/abs.md): from now on train_step takes k batches (k >= 1) and trains on their
   * mean gradient (one update of k times the batch); non-zero on failure. NULL: the model
   * cannot run ABS. */
  int (*set_batch_factor)(void *ctx, long k);
  /* ABS: the loss gradient into the params' grads on one fixed batch of the training set,
   * the model in evaluation mode (ac_hvp_compute's callback). NULL: no ABS. */
  int (*hv_grad)(void *ctx);
} tr_model;

/* K-FAC's model Fisher for a model whose loss is xent, called by its train_step between
 * forward and backward (t: the trainer set_trainer gave; NULL: nothing to do): when the
 * factors are due, labels drawn into drawn (device int32, xent's max_rows; the batch's
 * labels copied first, so ignored rows stay ignored), backward(ctx) run with xent reading
 * them, then the grads zeroed for the batch's own backward (pt_kfac_model_fisher). 0, or
 * -1 with the message on stderr. */
int tr_kfac_model_fisher(pt_trainer *t, ac_celoss *xent, int32_t *drawn, ac_param_list *params,
                         int (*backward)(void *ctx), void *ctx);

/* Steps the run will take: opts->steps, or ceil(epochs * steps_per_epoch). */
long tr_total_steps(const tr_options *opts, const tr_model *model);

/* Unless opts->quiet: the line on stderr that opens a client's run ("<model>: N parameters
 * in M tensors, <backend>, <optimizer>, S steps"). */
void tr_print_start(const tr_options *opts, const ac_backend *be, const tr_model *model);

/* Ends a client's result line on stdout: for Shampoo the staleness (mean, p50/p90/p99,
 * max) and fallback figures of summary, then the newline. */
void tr_print_result_end(const tr_options *opts, const tr_summary *summary);

/* Runs the whole training: builds the optimizer, trains for tr_total_steps steps with the
 * progress line on stderr, evaluates every eval_every steps and at the end, writes
 * OUT/train.csv and OUT/summary.json when opts->out is set (the directory is created), and
 * fills *summary (may be NULL; its strings point at static or opts-owned text). A loss that
 * becomes NaN or Inf stops the run with TR_ENONFINITE after writing what was done. SIGTERM
 * or SIGINT during the run (handlers installed for its length) ends it after the step in
 * progress, evaluated and written like a last step, status "stopped", TR_OK; data-parallel
 * workers agree on it each step (pt_dp_any), so a signal to any stops all after the same
 * step. */
int tr_train(const tr_options *opts, ac_backend *be, const tr_model *model, tr_summary *summary,
             tr_error *err);

/* Creates directory path and its missing parents (mode 0777 before umask). TR_OK or TR_EIO. */
int tr_mkdirs(const char *path);

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_BENCH_TRAIN_H */
