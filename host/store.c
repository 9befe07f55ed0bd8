/*
 * store.c -- jobs, their blocks, statistics and published roots.
 *
 * A job's tensors, options and layout never change after it is added; only the block
 * contents do, each under its own lock. Roots are immutable and refcounted: a reader takes a
 * reference under the block lock (a pointer copy) and never waits for a computation.
 */
#include "precondd.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"

const char *pd_strerror(int code) {
  switch (code) {
  case PD_OK: return "success";
  case PD_EINVAL: return "invalid argument";
  case PD_ENOMEM: return "out of memory";
  case PD_EIO: return "I/O error";
  case PD_ECORRUPT: return "snapshot corrupt";
  case PD_ENOENT: return "no such file";
  case PD_ELIMIT: return "limit exceeded";
  default: return "unknown precondd error";
  }
}

/* ---- roots ---------------------------------------------------------------------------- */

static size_t pd__root_bytes(size_t nl, size_t nr) {
  return sizeof(pd_root) + (pc_packed_len(nl) + pc_packed_len(nr)) * sizeof(float);
}

pd_root *pd_root_new(size_t n_left, size_t n_right, pd_stats *stats) {
  pd_root *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->left = malloc(pc_packed_len(n_left) * sizeof(float));
  r->right = malloc(pc_packed_len(n_right) * sizeof(float));
  if (!r->left || !r->right) {
    free(r->left);
    free(r->right);
    free(r);
    return NULL;
  }
  atomic_init(&r->refs, 1);
  r->n_left = n_left;
  r->n_right = n_right;
  if (stats) atomic_fetch_add(&stats->memory_bytes, (int64_t)pd__root_bytes(n_left, n_right));
  return r;
}

void pd_root_ref(pd_root *r) {
  if (r) atomic_fetch_add(&r->refs, 1);
}

void pd_root_unref(pd_root *r, pd_stats *stats) {
  if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
  if (stats)
    atomic_fetch_sub(&stats->memory_bytes, (int64_t)pd__root_bytes(r->n_left, r->n_right));
  free(r->left);
  free(r->right);
  free(r);
}

/* ---- options and jobs ---------------------------------------------------------------- */

/* A block of n x n takes n(n+1)/2 floats per factor; 8192 keeps one factor at 128 MiB. */
#define PD_MAX_BLOCK_SIZE 8192u
#define PD_MAX_RANK 8
#define PD_MAX_NAME 256 /* job, tensor and worker names, bytes */

int pd_shampoo_opts_resolve(const Precond__V1__ShampooOptions *in, pd_shampoo_opts *out,
                            char *err, size_t errlen) {
  Precond__V1__ShampooOptions zero = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  if (!in) in = &zero;
  out->block_size = in->block_size ? in->block_size : 128;
  out->skip_limit = in->skip_limit ? in->skip_limit : 4096;
  out->beta2 = in->beta2 != 0.0f ? in->beta2 : 1.0f;
  out->root_exponent = in->root_exponent ? in->root_exponent : 4;
  out->epsilon = in->epsilon != 0.0 ? in->epsilon : 1e-6;
  out->method = (int)in->method;
  if (out->block_size > PD_MAX_BLOCK_SIZE) {
    snprintf(err, errlen, "shampoo.block_size: %u is above the limit %u", out->block_size,
             PD_MAX_BLOCK_SIZE);
    return PD_EINVAL;
  }
  if (!(out->beta2 > 0.0f && out->beta2 <= 1.0f)) {
    snprintf(err, errlen, "shampoo.beta2: %g is not in (0, 1]", (double)out->beta2);
    return PD_EINVAL;
  }
  if (out->root_exponent > 64) {
    snprintf(err, errlen, "shampoo.root_exponent: %u is not in [1, 64]", out->root_exponent);
    return PD_EINVAL;
  }
  if (!(out->epsilon > 0.0 && out->epsilon < 1.0)) {
    snprintf(err, errlen, "shampoo.epsilon: %g is not in (0, 1)", out->epsilon);
    return PD_EINVAL;
  }
  if (out->method < PC_METHOD_NEWTON || out->method > PC_METHOD_EIGH) {
    snprintf(err, errlen, "shampoo.method: %d is not a known method", out->method);
    return PD_EINVAL;
  }
  return PD_OK;
}

/* Statistics are counted in stats only once their job is in the store (count_stats). */
static void pd__block_free(pd_block *b, pd_stats *stats, int count_stats) {
  free(b->stat_left);
  free(b->stat_right);
  if (b->stat_left && stats && count_stats)
    atomic_fetch_sub(&stats->memory_bytes,
                     (int64_t)((pc_packed_len(b->rows) + pc_packed_len(b->cols)) * 4));
  pd_root_unref(b->root, stats);
  pthread_mutex_destroy(&b->lock);
}

void pd_job_free(pd_job *job, pd_stats *stats) {
  if (!job) return;
  for (size_t i = 0; i < job->nblocks; i++) pd__block_free(&job->blocks[i], stats, job->in_store);
  free(job->blocks);
  for (size_t i = 0; i < job->ntensors; i++) {
    free(job->tensors[i].name);
    free(job->tensors[i].dims);
  }
  free(job->tensors);
  free(job->diag);
  for (size_t i = 0; i < job->nworkers; i++) free(job->workers[i]);
  pthread_mutex_destroy(&job->lock);
  free(job->name);
  free(job);
}

static char *pd__strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

static int pd__cmp_name(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks names and shapes before any layout is computed. */
static int pd__tensors_check(size_t ntensors, const pd_tensor *t, char *err, size_t errlen) {
  if (ntensors == 0) {
    snprintf(err, errlen, "tensors: at least one tensor is required");
    return PD_EINVAL;
  }
  if (ntensors > PD_MAX_TENSORS) {
    snprintf(err, errlen, "tensors: %zu tensors is above the limit %u", ntensors,
             PD_MAX_TENSORS);
    return PD_ELIMIT;
  }
  for (size_t i = 0; i < ntensors; i++) {
    if (!t[i].name || !*t[i].name || strlen(t[i].name) > PD_MAX_NAME) {
      snprintf(err, errlen, "tensors[%zu].name: empty or longer than %d bytes", i,
               PD_MAX_NAME);
      return PD_EINVAL;
    }
    if (t[i].rank < 1 || t[i].rank > PD_MAX_RANK) {
      snprintf(err, errlen, "tensors[%zu].shape: rank %d is not in [1, %d]", i, t[i].rank,
               PD_MAX_RANK);
      return PD_EINVAL;
    }
    uint64_t total = 1;
    for (int k = 0; k < t[i].rank; k++) {
      uint64_t d = t[i].dims[k];
      if (d == 0 || d > ((uint64_t)1 << 40) || total > ((uint64_t)1 << 48) / d) {
        snprintf(err, errlen, "tensors[%zu].shape[%d]: %llu is zero or too large", i, k,
                 (unsigned long long)d);
        return PD_EINVAL;
      }
      total *= d;
    }
  }
  /* Unique names: sort a copy of the pointers and compare neighbours. */
  const char **names = malloc(ntensors * sizeof *names);
  if (!names) {
    snprintf(err, errlen, "out of memory");
    return PD_ENOMEM;
  }
  for (size_t i = 0; i < ntensors; i++) names[i] = t[i].name;
  qsort(names, ntensors, sizeof *names, pd__cmp_name);
  int rc = PD_OK;
  for (size_t i = 1; i < ntensors && rc == PD_OK; i++) {
    if (strcmp(names[i - 1], names[i]) == 0) {
      snprintf(err, errlen, "tensors: name \"%s\" appears more than once", names[i]);
      rc = PD_EINVAL;
    }
  }
  free(names);
  return rc;
}

/* Counts the blocks the layout will produce (its documented rule: rows = dims[0], cols = the
 * product of the rest, diagonal for rank 1 or a side above skip_limit, tiles of block_size)
 * before any layout is allocated, so an absurd shape costs nothing. */
static int pd__count_check(const pd_shampoo_opts *o, size_t ntensors, const pd_tensor *t,
                           uint32_t max_blocks, char *err, size_t errlen) {
  uint64_t total = 0, bs = o->block_size ? o->block_size : 1;
  for (size_t i = 0; i < ntensors; i++) {
    if (t[i].rank < 2) continue;
    uint64_t rows = t[i].dims[0], cols = 1;
    for (int k = 1; k < t[i].rank; k++) cols *= t[i].dims[k]; /* <= 2^48: checked */
    if (rows > o->skip_limit || cols > o->skip_limit) continue;
    uint64_t tr = (rows + bs - 1) / bs, tc = (cols + bs - 1) / bs;
    if (tr > max_blocks || tc > max_blocks || (total += tr * tc) > max_blocks) {
      snprintf(err, errlen, "tensors[%zu]: the job would have more than %u blocks", i,
               max_blocks);
      return PD_ELIMIT;
    }
  }
  return PD_OK;
}

int pd_job_build(const char *name, int mode, const pd_shampoo_opts *opts, size_t ntensors,
                 const pd_tensor *tensors, uint32_t max_blocks, pd_job **out, char *err,
                 size_t errlen) {
  *out = NULL;
  if (!name || !*name) {
    snprintf(err, errlen, "job: empty");
    return PD_EINVAL;
  }
  if (strlen(name) > PD_MAX_NAME) {
    snprintf(err, errlen, "job: name longer than %d bytes", PD_MAX_NAME);
    return PD_EINVAL;
  }
  int rc = pd__tensors_check(ntensors, tensors, err, errlen);
  if (rc != PD_OK) return rc;
  rc = pd__count_check(opts, ntensors, tensors, max_blocks, err, errlen);
  if (rc != PD_OK) return rc;

  pd_job *job = calloc(1, sizeof *job);
  if (!job) goto nomem;
  pthread_mutex_init(&job->lock, NULL);
  job->mode = mode;
  job->opts = *opts;
  job->name = pd__strdup(name);
  job->tensors = calloc(ntensors, sizeof *job->tensors);
  job->diag = calloc(ntensors, sizeof *job->diag);
  if (!job->name || !job->tensors || !job->diag) goto nomem;
  job->ntensors = ntensors;
  for (size_t i = 0; i < ntensors; i++) {
    job->tensors[i].rank = tensors[i].rank;
    job->tensors[i].name = pd__strdup(tensors[i].name);
    job->tensors[i].dims = malloc((size_t)tensors[i].rank * sizeof(uint64_t));
    if (!job->tensors[i].name || !job->tensors[i].dims) goto nomem;
    memcpy(job->tensors[i].dims, tensors[i].dims, (size_t)tensors[i].rank * sizeof(uint64_t));
  }

  /* Block ids are numbered in tensor order, tiles row-major within a tensor (the layout's
   * own order), so every worker and replica derives the same ids. */
  pc_layout_opts lo;
  pc_layout_opts_default(&lo);
  lo.block_size = opts->block_size;
  lo.skip_limit = opts->skip_limit;
  size_t cap = 0;
  for (size_t i = 0; i < ntensors; i++) {
    size_t dims[PD_MAX_RANK];
    for (int k = 0; k < tensors[i].rank; k++) dims[k] = (size_t)tensors[i].dims[k];
    pc_layout lay;
    int prc = pc_layout_init(&lay, tensors[i].rank, dims, &lo);
    if (prc != PC_OK) {
      snprintf(err, errlen, "tensors[%zu].shape: layout failed: %s", i, pc_strerror(prc));
      pd_job_free(job, NULL);
      return prc == PC_ENOMEM ? PD_ENOMEM : PD_EINVAL;
    }
    if (lay.diagonal || lay.nblocks == 0) {
      job->diag[job->ndiag++] = (uint32_t)i;
    } else if (job->nblocks + lay.nblocks > max_blocks) {
      snprintf(err, errlen, "tensors[%zu]: the job would have more than %u blocks", i,
               max_blocks);
      pc_layout_destroy(&lay);
      pd_job_free(job, NULL);
      return PD_ELIMIT;
    } else {
      if (job->nblocks + lay.nblocks > cap) {
        size_t ncap = cap ? cap : 16;
        while (ncap < job->nblocks + lay.nblocks) ncap *= 2;
        pd_block *nb = realloc(job->blocks, ncap * sizeof *nb);
        if (!nb) {
          pc_layout_destroy(&lay);
          goto nomem;
        }
        job->blocks = nb;
        cap = ncap;
      }
      for (size_t k = 0; k < lay.nblocks; k++) {
        pd_block *b = &job->blocks[job->nblocks];
        memset(b, 0, sizeof *b);
        pthread_mutex_init(&b->lock, NULL);
        b->last_drift = NAN;
        b->job = job;
        b->id = (uint32_t)job->nblocks;
        b->tensor = (uint32_t)i;
        b->row0 = lay.blocks[k].row0;
        b->rows = lay.blocks[k].rows;
        b->col0 = lay.blocks[k].col0;
        b->cols = lay.blocks[k].cols;
        job->nblocks++;
      }
    }
    pc_layout_destroy(&lay);
  }
  *out = job;
  return PD_OK;

nomem:
  snprintf(err, errlen, "out of memory building the job");
  pd_job_free(job, NULL);
  return PD_ENOMEM;
}

int pd_job_same(const pd_job *a, const pd_job *b) {
  if (a->mode != b->mode || a->ntensors != b->ntensors) return 0;
  if (a->opts.block_size != b->opts.block_size || a->opts.skip_limit != b->opts.skip_limit || a->opts.beta2 != b->opts.beta2 ||
      a->opts.root_exponent != b->opts.root_exponent || a->opts.epsilon != b->opts.epsilon ||
      a->opts.method != b->opts.method)
    return 0;
  for (size_t i = 0; i < a->ntensors; i++) {
    const pd_tensor *x = &a->tensors[i], *y = &b->tensors[i];
    if (strcmp(x->name, y->name) != 0 || x->rank != y->rank) return 0;
    if (memcmp(x->dims, y->dims, (size_t)x->rank * sizeof *x->dims) != 0) return 0;
  }
  return 1;
}

size_t pd_job_bytes(const pd_job *job) {
  size_t total = 0;
  for (size_t i = 0; i < job->nblocks; i++) {
    const pd_block *b = &job->blocks[i];
    /* statistics, plus one root pair */
    total += 2 * (pc_packed_len(b->rows) + pc_packed_len(b->cols)) * sizeof(float);
  }
  return total;
}

/* ---- the store ------------------------------------------------------------------------ */

int pd_store_init(pd_store *st, pd_stats *stats, size_t memory_limit,
                  uint32_t max_blocks_per_job) {
  memset(st, 0, sizeof *st);
  if (pthread_rwlock_init(&st->lock, NULL) != 0) return PD_ENOMEM;
  st->stats = stats;
  st->memory_limit = memory_limit;
  st->max_blocks_per_job = max_blocks_per_job;
  return PD_OK;
}

void pd_store_destroy(pd_store *st) {
  for (size_t i = 0; i < st->njobs; i++) pd_job_free(st->jobs[i], st->stats);
  free(st->jobs);
  pthread_rwlock_destroy(&st->lock);
}

static pd_job *pd__find_locked(pd_store *st, const char *name) {
  for (size_t i = 0; i < st->njobs; i++)
    if (strcmp(st->jobs[i]->name, name) == 0) return st->jobs[i];
  return NULL;
}

pd_job *pd_store_find(pd_store *st, const char *name) {
  if (!name) return NULL;
  pthread_rwlock_rdlock(&st->lock);
  pd_job *j = pd__find_locked(st, name);
  pthread_rwlock_unlock(&st->lock);
  return j;
}

/* Allocates zeroed statistics for every block of job; frees them all on failure. */
static int pd__alloc_stats(pd_job *job) {
  for (size_t i = 0; i < job->nblocks; i++) {
    pd_block *b = &job->blocks[i];
    if (b->stat_left) continue;
    b->stat_left = calloc(pc_packed_len(b->rows), sizeof(float));
    b->stat_right = calloc(pc_packed_len(b->cols), sizeof(float));
    if (!b->stat_left || !b->stat_right) {
      for (size_t k = 0; k <= i; k++) {
        free(job->blocks[k].stat_left);
        free(job->blocks[k].stat_right);
        job->blocks[k].stat_left = job->blocks[k].stat_right = NULL;
      }
      return PD_ENOMEM;
    }
  }
  return PD_OK;
}

static size_t pd__stat_bytes(const pd_job *job) {
  size_t total = 0;
  for (size_t i = 0; i < job->nblocks; i++)
    total += (pc_packed_len(job->blocks[i].rows) + pc_packed_len(job->blocks[i].cols)) * 4;
  return total;
}

int pd_store_add(pd_store *st, pd_job *job, pd_job **existing) {
  *existing = NULL;
  pthread_rwlock_wrlock(&st->lock);
  int rc = PD_OK;
  pd_job *old = pd__find_locked(st, job->name);
  if (old) {
    *existing = old;
    goto done;
  }
  /* The memory limit is checked against the budget the job can reach (statistics and a
   * root pair per block), so a running job never fails for memory later. */
  size_t held = 0;
  for (size_t i = 0; i < st->njobs; i++) held += pd_job_bytes(st->jobs[i]);
  if (held + pd_job_bytes(job) > st->memory_limit) {
    rc = PD_ELIMIT;
    goto done;
  }
  if (st->njobs == st->cap) {
    size_t ncap = st->cap ? 2 * st->cap : 8;
    pd_job **nj = realloc(st->jobs, ncap * sizeof *nj);
    if (!nj) {
      rc = PD_ENOMEM;
      goto done;
    }
    st->jobs = nj;
    st->cap = ncap;
  }
  rc = pd__alloc_stats(job);
  if (rc != PD_OK) goto done;
  if (st->stats) atomic_fetch_add(&st->stats->memory_bytes, (int64_t)pd__stat_bytes(job));
  job->in_store = 1;
  st->jobs[st->njobs++] = job;
  atomic_fetch_add(&st->generation, 1);
done:
  pthread_rwlock_unlock(&st->lock);
  return rc;
}

void pd_job_note_worker(pd_job *job, const char *worker) {
  if (!worker || !*worker || strlen(worker) > PD_MAX_NAME) return;
  pthread_mutex_lock(&job->lock);
  int seen = 0;
  for (size_t i = 0; i < job->nworkers && !seen; i++) seen = strcmp(job->workers[i], worker) == 0;
  if (!seen && job->nworkers < PD_MAX_WORKER_NAMES) {
    char *w = pd__strdup(worker);
    if (w) job->workers[job->nworkers++] = w;
  }
  pthread_mutex_unlock(&job->lock);
}

/* ---- blocks --------------------------------------------------------------------------- */

/* pd_block_update's work with b's lock held. Returns 1 and the age in *age when the push
 * is a staleness sample (to be added to the daemon's stats once the lock is released). */
static int pd__apply_locked(pd_block *b, const float *left, const float *right, uint64_t step,
                            uint64_t *age) {
  float beta2 = b->job->opts.beta2;
  int sampled = 0;
  pc_stat_update_f32(pc_packed_len(b->rows), b->stat_left, left, beta2);
  pc_stat_update_f32(pc_packed_len(b->cols), b->stat_right, right, beta2);
  b->pushes++;
  if (step > atomic_load(&b->stat_step)) {
    atomic_store(&b->stat_step, step);
    /* The worker of this step has the published root at best: its age now is what that
     * worker sees (one sample per block and step; a repeated step is not sampled again). */
    if (b->root && step > b->root->source_step) {
      *age = step - b->root->source_step;
      pd_stale_hist_add(&b->stale, *age);
      sampled = 1;
    }
  }
  return sampled;
}

void pd_block_update(pd_block *b, const float *left, const float *right, uint64_t step,
                     pd_stats *stats) {
  uint64_t age = 0;
  pthread_mutex_lock(&b->lock);
  int sampled = pd__apply_locked(b, left, right, step, &age);
  pthread_mutex_unlock(&b->lock);
  if (sampled && stats) pd_stats_add_staleness(stats, age);
}

/* 1 if the statistic updated with inc (pc_stat_update's rule) stays finite. Computed in
 * double with a margin of 2^-20 below FLT_MAX, more than the rounding of the float kernel,
 * so a statistic this admits can never become Inf when pc_stat_update_f32 applies inc. */
static int pd__update_stays_finite(size_t count, const float *s, const float *inc,
                                   float beta2) {
  const double limit = (double)FLT_MAX * (1.0 - 1.0 / 1048576.0);
  const double b = beta2, w = beta2 == 1.0f ? 1.0 : 1.0 - (double)beta2;
  for (size_t i = 0; i < count; i++)
    if (!(fabs(b * (double)s[i] + w * (double)inc[i]) <= limit)) return 0;
  return 1;
}

typedef struct {
  uint32_t id;
  size_t index;
} pd__by_id;

static int pd__cmp_by_id(const void *a, const void *b) {
  uint32_t x = ((const pd__by_id *)a)->id, y = ((const pd__by_id *)b)->id;
  return (x > y) - (x < y);
}

int pd_job_push(pd_job *job, size_t n, pd_block *const *blocks, const float *const *left,
                const float *const *right, uint64_t step, pd_stats *stats, size_t *bad) {
  *bad = 0;
  pd__by_id *order = malloc((n ? n : 1) * sizeof *order);
  uint64_t *ages = malloc((n ? n : 1) * sizeof *ages);
  size_t nages = 0;
  if (!order || !ages) {
    free(order);
    free(ages);
    return PD_ENOMEM;
  }
  for (size_t i = 0; i < n; i++) order[i] = (pd__by_id){blocks[i]->id, i};
  qsort(order, n, sizeof *order, pd__cmp_by_id);
  /* Every lock of the push at once, in id order (no two pushes can deadlock): a check and
   * the update it admits see the same statistic. */
  for (size_t k = 0; k < n; k++) pthread_mutex_lock(&blocks[order[k].index]->lock);
  float beta2 = job->opts.beta2;
  int rc = PD_OK;
  for (size_t i = 0; i < n && rc == PD_OK; i++) {
    const pd_block *b = blocks[i];
    if (!pd__update_stays_finite(pc_packed_len(b->rows), b->stat_left, left[i], beta2) ||
        !pd__update_stays_finite(pc_packed_len(b->cols), b->stat_right, right[i], beta2)) {
      *bad = i;
      rc = PD_EINVAL;
    }
  }
  for (size_t i = 0; i < n && rc == PD_OK; i++)
    nages += (size_t)pd__apply_locked(blocks[i], left[i], right[i], step, &ages[nages]);
  for (size_t k = n; k-- > 0;) pthread_mutex_unlock(&blocks[order[k].index]->lock);
  for (size_t i = 0; stats && i < nages; i++) pd_stats_add_staleness(stats, ages[i]);
  free(order);
  free(ages);
  return rc;
}

pd_root *pd_block_root(pd_block *b) {
  pthread_mutex_lock(&b->lock);
  pd_root *r = b->root;
  pd_root_ref(r);
  pthread_mutex_unlock(&b->lock);
  return r;
}

void pd_block_publish(pd_block *b, pd_root *r, pd_stats *stats) {
  pthread_mutex_lock(&b->lock);
  pd_root *old = b->root;
  r->version = old ? old->version + 1 : 1;
  b->root = r;
  atomic_store(&b->root_step, r->source_step);
  atomic_store(&b->has_root, 1);
  pthread_mutex_unlock(&b->lock);
  pd_root_unref(old, stats);
}
