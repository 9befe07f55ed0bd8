/*
 * trainer.c -- the mode-independent part of the trainer library: options, the mode table,
 * connect and register (every parameter as a tensor), counters, errors. The mode files
 * (shampoo.c) hold what differs per mode.
 */
#include "trainer_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The table: a new mode is one file and one line here (and its pt_mode number). */
static const pt__mode *const pt__modes[] = {
    [PT_MODE_SHAMPOO] = &pt__shampoo_mode,
    [PT_MODE_KFAC] = &pt__kfac_mode,
};
#define PT__NMODES (sizeof pt__modes / sizeof pt__modes[0])

static const pt__mode *pt__mode_of(pt_mode mode) {
  return (unsigned)mode < PT__NMODES ? pt__modes[mode] : NULL;
}

const char *pt_strerror(int status) {
  switch (status) {
    case PT_OK:
      return "ok";
    case PT_EINVAL:
      return "invalid argument";
    case PT_ENOMEM:
      return "out of memory";
    case PT_EACCEL:
      return "worker optimizer (accel) failed";
    case PT_EDAEMON:
      return "precondd unreachable, refused the call, or disagrees";
    case PT_ETIMEDOUT:
      return "results did not arrive in time";
    default:
      return "unknown status";
  }
}

const char *pt_mode_name(pt_mode mode) {
  const pt__mode *m = pt__mode_of(mode);
  return m != NULL ? m->name : "?";
}

int pt__fail(pt_error *err, int status, const char *fmt, ...) {
  if (err != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return status;
}

int pt__accel(pt_error *err, int rc, const char *what) {
  if (rc == AC_OK) return PT_OK;
  return pt__fail(err, PT_EACCEL, "%s: %s", what, ac_strerror(rc));
}

int pt__daemon(const pt_trainer *t, pt_error *err, int prc, const char *what) {
  if (prc == PRECOND_OK) return PT_OK;
  char msg[256] = "";
  if (t->client != NULL) precond_last_error(t->client, msg, sizeof msg);
  return pt__fail(err, PT_EDAEMON, "%s: %s%s%s", what, precond_strerror(prc), msg[0] ? ": " : "",
                  msg);
}

double pt__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double pt__cpu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void pt__poll_pace(pt_trainer *t, pt__pace *p) {
  double now = pt__now();
  if (t->opts.poll_interval_ms == 0 && p->last_t > 0.0) {
    double dt = now - p->last_t;
    p->step_s = p->step_s > 0.0 ? 0.8 * p->step_s + 0.2 * dt : dt;
    double want = 500.0 * p->step_s;
    int ms = want < 10.0 ? 10 : want > 1000.0 ? 1000 : (int)want;
    if (4 * abs(ms - p->poll_ms) > p->poll_ms && precond_set_poll_interval(t->client, ms) == 0)
      p->poll_ms = ms;
  }
  p->last_t = now;
}

void pt_options_default(pt_options *opts, pt_mode mode) {
  if (opts == NULL) return;
  memset(opts, 0, sizeof *opts);
  opts->mode = mode;
  opts->connect_timeout_ms = 5000;
  opts->sync_timeout_ms = 60000;
  opts->root_every = 1;
  opts->shard_size = 1;
  ac_shampoo_opts_default(&opts->shampoo);
  pc_kfac_opts_default(&opts->kfac.k);
  ac_sgd_opts_default(&opts->kfac.sgd);
  /* Conv A from 16 images of the batch: the factor step's cost is the A syrk; 16 of 128
   * reached SGD's 1-epoch accuracy in 0.7x its steps (docs/kfac.md, "Tuning"). */
  opts->kfac.a_images = 16;
  /* Dense A and G from 256 rows of the batch, strided: the Transformer's 2048 tokens gave
   * the every-token run's eval loss within 0.002 on two seeds at 1/8 of the syrks
   * (docs/kfac.md, "Session 8"); a batch of at most 256 rows (the ResNet's) uses them all. */
  opts->kfac.dense_rows = 256;
  opts->kfac.row_sample = PT_KFAC_ROWS_STRIDED;
  opts->kfac.sample_seed = 1;
}

/* Registers every parameter as a tensor (a scalar as shape {1}) and keeps the daemon's
 * layout in t->layout. */
static int pt__register(pt_trainer *t, pt_error *err) {
  int rc = PT_OK;
  precond_tensor *tensors = calloc(t->nparams, sizeof *tensors);
  uint64_t *shapes = calloc(t->nparams * AC_MAX_DIMS, sizeof *shapes);
  if (tensors == NULL || shapes == NULL) {
    rc = PT_ENOMEM;
    goto done;
  }
  for (size_t i = 0; i < t->nparams; i++) {
    const ac_tensor *v = &t->params[i]->value;
    int rank = v->ndim < 1 ? 1 : v->ndim;
    uint64_t *shape = &shapes[i * AC_MAX_DIMS];
    for (int d = 0; d < rank; d++) shape[d] = v->ndim < 1 ? 1 : v->shape[d];
    tensors[i] = (precond_tensor){t->params[i]->name, rank, shape};
  }
  precond_shampoo_opts so;
  memset(&so, 0, sizeof so);
  t->mode->register_opts(t, &so);
  int prc = precond_register(t->client, t->job, t->mode->wire, t->opts.worker, t->nparams, tensors,
                             &so, &t->layout);
  if (prc != PRECOND_OK) {
    char what[384];
    snprintf(what, sizeof what, "precondd at %s refused to register job %s",
             t->opts.daemon != NULL ? t->opts.daemon : "(default)", t->job);
    rc = pt__daemon(t, err, prc, what);
  }
done:
  free(tensors);
  free(shapes);
  return rc;
}

static int pt__validate(const pt_options *opts, ac_param *const *params, size_t nparams,
                        pt_error *err) {
  if (opts == NULL || params == NULL || nparams == 0)
    return pt__fail(err, PT_EINVAL, "pt_create: options and parameters are required");
  if (pt__mode_of(opts->mode) == NULL)
    return pt__fail(err, PT_EINVAL, "pt_create: unknown mode %d", (int)opts->mode);
  if (opts->job == NULL || opts->job[0] == '\0' || strlen(opts->job) >= 256)
    return pt__fail(err, PT_EINVAL, "pt_create: a job name of 1 to 255 bytes is required");
  if (opts->shard_size > 1 && (opts->shard_rank < 0 || opts->shard_rank >= opts->shard_size))
    return pt__fail(err, PT_EINVAL, "pt_create: shard_rank %d is not in [0, %d)", opts->shard_rank,
                    opts->shard_size);
  if (opts->poll_interval_ms < 0)
    return pt__fail(err, PT_EINVAL, "pt_create: poll_interval_ms %d is negative",
                    opts->poll_interval_ms);
  if (opts->sync_roots && opts->sync_timeout_ms <= 0)
    return pt__fail(err, PT_EINVAL, "pt_create: sync_roots needs sync_timeout_ms > 0");
  if (opts->sync_first < 0 ||
      (opts->sync_first > 0 && (opts->mode != PT_MODE_SHAMPOO || pt_dp_size(opts->dp) > 1)))
    return pt__fail(err, PT_EINVAL, "pt_create: sync_first %ld needs Shampoo, one worker",
                    opts->sync_first);
  if (opts->root_delay < 0 ||
      (opts->root_delay > 0 &&
       (!opts->sync_roots || opts->mode != PT_MODE_SHAMPOO || pt_dp_size(opts->dp) > 1)))
    return pt__fail(err, PT_EINVAL,
                    "pt_create: root_delay %ld needs Shampoo with sync_roots, one worker",
                    opts->root_delay);
  /* precondd's bound (shampoo.root_every); root_delay stands for roots of every push. */
  if (opts->root_every < 1 || opts->root_every > 100000 ||
      (opts->root_every > 1 && (opts->mode != PT_MODE_SHAMPOO || opts->root_delay > 0)))
    return pt__fail(err, PT_EINVAL,
                    "pt_create: root_every %ld needs [1, 100000], and above 1 Shampoo without "
                    "root_delay",
                    opts->root_every);
  const ac_backend *be = params[0] != NULL ? params[0]->value.be : NULL;
  for (size_t i = 0; i < nparams; i++)
    if (params[i] == NULL || params[i]->value.be != be || params[i]->value.numel == 0)
      return pt__fail(err, PT_EINVAL, "parameter %zu is empty or on another backend", i);
  return PT_OK;
}

int pt_create(pt_trainer **out, const pt_options *opts, ac_param *const *params, size_t nparams,
              pt_error *err) {
  if (out == NULL) return pt__fail(err, PT_EINVAL, "pt_create: out is NULL");
  *out = NULL;
  int rc = pt__validate(opts, params, nparams, err);
  if (rc != PT_OK) return rc;
  pt_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) return PT_ENOMEM;
  t->mode = pt__mode_of(opts->mode);
  t->opts = *opts;
  snprintf(t->job, sizeof t->job, "%s", opts->job);
  t->opts.job = t->job;
  t->opts.daemon = NULL; /* the caller's string is only needed until connected */
  t->params = params;
  t->nparams = nparams;

  rc = t->mode->create(t, err);
  if (rc != PT_OK) goto fail;
  precond_options po;
  precond_options_default(&po);
  if (opts->daemon != NULL) po.addr = opts->daemon;
  po.connect_timeout_ms = opts->connect_timeout_ms;
  if (opts->poll_interval_ms > 0) po.poll_interval_ms = opts->poll_interval_ms;
  /* Every step pushes and fetches the same sizes (Shampoo: 2 MB of statistics on the main
   * job's Transformer): without it glibc hands the freed blocks back and each push's copy
   * takes fresh pages (page faults were most of precond_push's CPU in a perf profile). */
  po.keep_freed_memory = 1;
  po.roots_by_reference = t->mode->roots_by_reference;
  /* K-FAC's inverses whole, expanded on libprecond's thread as it decodes them: the step
   * multiplies by them as they come (trainer/kfac.c, pt__kfac_apply). Shampoo's answers are
   * not affected. */
  po.kfac_dense = 1;
  int prc = precond_connect(&po, &t->client);
  if (prc != PRECOND_OK) {
    rc = pt__fail(err, PT_EDAEMON,
                  "cannot reach precondd at %s: %s (start one with "
                  "build/host/precondd --listen %s)",
                  po.addr, precond_strerror(prc), po.addr);
    goto fail;
  }
  if (!t->mode->lazy_register) rc = pt__register(t, err);
  if (rc == PT_OK && !t->mode->lazy_register) rc = t->mode->bind(t, err);
  if (rc != PT_OK) goto fail;
  *out = t;
  return PT_OK;
fail:
  pt_destroy(t);
  return rc;
}

void pt_destroy(pt_trainer *t) {
  if (t == NULL) return;
  t->mode->destroy(t);
  precond_layout_destroy(&t->layout);
  precond_close(t->client);
  free(t);
}

int pt_step(pt_trainer *t, long step, double lr, pt_step_info *info, pt_error *err) {
  if (t == NULL || step < 1 || !(lr >= 0) || lr > 1e30)
    return pt__fail(err, PT_EINVAL, "pt_step: bad arguments (step %ld, lr %g)", step, lr);
  if (info != NULL) *info = (pt_step_info){0, 0, 0, (double)NAN, -1, (double)NAN};
  return t->mode->step(t, step, lr, info, err);
}

void pt_get_counters(const pt_trainer *t, pt_counters *out) {
  if (out == NULL) return;
  memset(out, 0, sizeof *out);
  if (t == NULL) return;
  precond_counters c;
  memset(&c, 0, sizeof c);
  precond_get_counters(t->client, &c);
  out->pushed = c.pushed;
  out->dropped = c.dropped;
  out->coalesced = c.coalesced;
  out->push_errors = c.push_errors;
  out->daemon_restarts = c.reregistered;
  out->resumed_step = t->layout.resumed_step;
  t->mode->counters(t, out);
}
