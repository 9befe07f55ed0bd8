/*
 * store.c -- jobs, their blocks, statistics and published roots.
 *
 * A job's tensors, options and layout never change after it is added; only the block
 * contents do, each under its own lock. Roots are immutable and refcounted: a reader takes a
 * reference under the block lock (a pointer copy) and never waits for a computation. Jobs
 * are refcounted too: removing one from the store (EndJob, idle expiry) drops the store's
 * reference, and the call or computation that holds the last one frees it.
 */
#include "precondd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "preconditioner.h"
#include "rpc.h"

const char *pd_strerror(int code) {
  switch (code) {
    case PD_OK:
      return "success";
    case PD_EINVAL:
      return "invalid argument";
    case PD_ENOMEM:
      return "out of memory";
    case PD_EIO:
      return "I/O error";
    case PD_ECORRUPT:
      return "snapshot corrupt";
    case PD_ENOENT:
      return "no such file";
    case PD_ELIMIT:
      return "limit exceeded";
    case PD_EENDED:
      return "the job was ended";
    default:
      return "unknown precondd error";
  }
}

/* ---- roots ---------------------------------------------------------------------------- */

/* Floats of the parts of a unit or result. */
static size_t pd__parts_len(uint32_t nparts, const uint64_t *order) {
  size_t n = 0;
  for (uint32_t k = 0; k < nparts; k++) n += pc_packed_len(order[k]);
  return n;
}

static size_t pd__root_bytes(const pd_root *r) {
  return sizeof(pd_root) + pd__parts_len(r->nparts, r->order) * sizeof(float);
}

pd_root *pd_root_new(uint32_t nparts, const uint64_t *order, pd_stats *stats) {
  if (nparts > PD_MAX_PARTS) return NULL;
  pd_root *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->nparts = nparts;
  for (uint32_t k = 0; k < nparts; k++) {
    r->order[k] = order[k];
    r->part[k] = malloc(pc_packed_len(order[k]) * sizeof(float));
    if (!r->part[k]) {
      for (uint32_t i = 0; i < k; i++) free(r->part[i]);
      free(r);
      return NULL;
    }
  }
  atomic_init(&r->refs, 1);
  if (stats) atomic_fetch_add(&stats->memory_bytes, (int64_t)pd__root_bytes(r));
  return r;
}

void pd_root_ref(pd_root *r) {
  if (r) atomic_fetch_add(&r->refs, 1);
}

void pd_root_unref(pd_root *r, pd_stats *stats) {
  if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
  if (stats) atomic_fetch_sub(&stats->memory_bytes, (int64_t)pd__root_bytes(r));
  for (uint32_t k = 0; k < r->nparts; k++) free(r->part[k]);
  free(r);
}

/* ---- options and jobs ---------------------------------------------------------------- */

#define PD_MAX_NAME 256 /* job, tensor and worker names, bytes */

/* Bytes of a job's own records: names, shapes, block records. A job of rank-1 tensors has
 * no statistics at all, and these are all it holds: counted, so that such jobs cannot grow
 * the daemon without limit. */
static size_t pd__meta_bytes(const pd_job *job) {
  size_t total = sizeof *job + strlen(job->name) + 1 + job->nblocks * sizeof(pd_block) +
                 job->ntensors * (sizeof(pd_tensor) + sizeof(uint32_t));
  for (size_t i = 0; i < job->ntensors; i++)
    total += strlen(job->tensors[i].name) + 1 + (size_t)job->tensors[i].rank * sizeof(uint64_t);
  return total;
}

/* Statistics are counted in stats only once their job is in the store (count_stats). */
static void pd__block_free(pd_block *b, pd_stats *stats, int count_stats) {
  if (b->stat[0] && stats && count_stats)
    atomic_fetch_sub(&stats->memory_bytes,
                     (int64_t)(pd__parts_len(b->nparts, b->order) * sizeof(float)));
  for (uint32_t k = 0; k < b->nparts; k++) free(b->stat[k]);
  pd_root_unref(b->root, stats);
  if (b->mode_state && b->job->mode->unit_free) {
    size_t held = b->job->mode->unit_free(b->mode_state);
    if (stats) atomic_fetch_sub(&stats->memory_bytes, (int64_t)held);
  }
  pthread_mutex_destroy(&b->lock);
}

void pd_job_ref(pd_job *job) {
  atomic_fetch_add(&job->refs, 1);
}

void pd_job_unref(pd_job *job, pd_stats *stats) {
  if (job && atomic_fetch_sub(&job->refs, 1) == 1) pd_job_free(job, stats);
}

void pd_job_free(pd_job *job, pd_stats *stats) {
  if (!job) return;
  if (job->in_store && stats) atomic_fetch_sub(&stats->memory_bytes, (int64_t)pd__meta_bytes(job));
  for (size_t i = 0; i < job->nblocks; i++) pd__block_free(&job->blocks[i], stats, job->in_store);
  free(job->blocks);
  for (size_t i = 0; i < job->ntensors; i++) {
    free(job->tensors[i].name);
    free(job->tensors[i].dims);
  }
  free(job->tensors);
  free(job->diag);
  free(job->rank_load);
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
    snprintf(err, errlen, "tensors: %zu tensors is above the limit %u", ntensors, PD_MAX_TENSORS);
    return PD_ELIMIT;
  }
  for (size_t i = 0; i < ntensors; i++) {
    if (!t[i].name || !*t[i].name || strlen(t[i].name) > PD_MAX_NAME) {
      snprintf(err, errlen, "tensors[%zu].name: empty or longer than %d bytes", i, PD_MAX_NAME);
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

int pd_job_build(const char *name, const pd_mode *mode, const void *opts, size_t ntensors,
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
  /* Counted first, so an absurd shape costs nothing. */
  size_t nunits = 0, ndiag = 0;
  rc = mode->layout(opts, ntensors, tensors, max_blocks, NULL, &nunits, NULL, NULL, err, errlen);
  if (rc != PD_OK) return rc;

  pd_unit_shape *units = NULL;
  pd_job *job = calloc(1, sizeof *job);
  if (job && pthread_mutex_init(&job->lock, NULL) != 0) {
    free(job); /* pd_job_free would destroy the lock that failed */
    job = NULL;
  }
  if (!job) goto nomem;
  atomic_init(&job->refs, 1);
  job->mode = mode;
  memcpy(job->opts, opts, mode->opts_size);
  job->name = pd__strdup(name);
  job->tensors = calloc(ntensors, sizeof *job->tensors);
  job->diag = calloc(ntensors, sizeof *job->diag);
  units = calloc(nunits ? nunits : 1, sizeof *units);
  job->blocks = calloc(nunits ? nunits : 1, sizeof *job->blocks);
  if (!job->name || !job->tensors || !job->diag || !units || !job->blocks) goto nomem;
  job->ntensors = ntensors;
  for (size_t i = 0; i < ntensors; i++) {
    job->tensors[i].rank = tensors[i].rank;
    job->tensors[i].name = pd__strdup(tensors[i].name);
    job->tensors[i].dims = malloc((size_t)tensors[i].rank * sizeof(uint64_t));
    if (!job->tensors[i].name || !job->tensors[i].dims) goto nomem;
    memcpy(job->tensors[i].dims, tensors[i].dims, (size_t)tensors[i].rank * sizeof(uint64_t));
  }
  size_t got = 0;
  rc = mode->layout(opts, ntensors, tensors, (uint32_t)nunits, units, &got, job->diag, &ndiag, err,
                    errlen);
  if (rc != PD_OK || got != nunits) {
    if (rc == PD_OK) {
      snprintf(err, errlen, "tensors: the %s layout counted %zu units, then gave %zu", mode->name,
               nunits, got);
      rc = PD_EINVAL;
    }
    free(units);
    pd_job_free(job, NULL);
    return rc;
  }
  job->ndiag = ndiag;
  for (size_t k = 0; k < nunits; k++) {
    pd_block *b = &job->blocks[k];
    if (pthread_mutex_init(&b->lock, NULL) != 0) goto nomem; /* job->nblocks: the ones to free */
    b->last_drift = NAN;
    b->job = job;
    b->id = (uint32_t)k;
    b->tensor = units[k].tensor;
    b->row0 = units[k].row0;
    b->rows = units[k].rows;
    b->col0 = units[k].col0;
    b->cols = units[k].cols;
    b->nparts = units[k].nparts;
    memcpy(b->order, units[k].order, sizeof b->order);
    job->nblocks++;
  }
  job->scratch_max = pd_job_scratch_bytes(job, 0);
  free(units);
  *out = job;
  return PD_OK;

nomem:
  snprintf(err, errlen, "out of memory building the job (or no lock could be made)");
  free(units);
  pd_job_free(job, NULL);
  return PD_ENOMEM;
}

int pd_job_same(const pd_job *a, const pd_job *b) {
  if (a->mode != b->mode || a->ntensors != b->ntensors) return 0;
  if (memcmp(a->opts, b->opts, a->mode->opts_size) != 0) return 0;
  for (size_t i = 0; i < a->ntensors; i++) {
    const pd_tensor *x = &a->tensors[i], *y = &b->tensors[i];
    if (strcmp(x->name, y->name) != 0 || x->rank != y->rank) return 0;
    if (memcmp(x->dims, y->dims, (size_t)x->rank * sizeof *x->dims) != 0) return 0;
  }
  return 1;
}

size_t pd_job_scratch_bytes(const pd_job *job, int warm) {
  size_t most = 0;
  for (size_t i = 0; i < job->nblocks; i++) {
    size_t n = pd_unit_scratch_bytes(&job->blocks[i], warm);
    if (n > most) most = n;
  }
  return most;
}

size_t pd_job_bytes(const pd_job *job) {
  size_t total = pd__meta_bytes(job);
  for (size_t i = 0; i < job->nblocks; i++) {
    const pd_block *b = &job->blocks[i];
    /* statistics, plus one root pair */
    total += 2 * pd__parts_len(b->nparts, b->order) * sizeof(float);
  }
  return total;
}

/* ---- the store ------------------------------------------------------------------------ */

int pd_store_init(pd_store *st, pd_stats *stats, size_t memory_limit, uint32_t max_blocks_per_job) {
  memset(st, 0, sizeof *st);
  if (pthread_rwlock_init(&st->lock, NULL) != 0) return PD_ENOMEM;
  st->stats = stats;
  st->memory_limit = memory_limit;
  st->max_blocks_per_job = max_blocks_per_job;
  return PD_OK;
}

void pd_store_destroy(pd_store *st) {
  for (size_t i = 0; i < st->njobs; i++) pd_job_unref(st->jobs[i], st->stats);
  free(st->jobs);
  pd_ended_free(st->ended, st->nended);
  pthread_rwlock_destroy(&st->lock);
}

static pd_job *pd__find_locked(pd_store *st, const char *name) {
  for (size_t i = 0; i < st->njobs; i++)
    if (strcmp(st->jobs[i]->name, name) == 0) return st->jobs[i];
  return NULL;
}

pd_job *pd_store_get(pd_store *st, const char *name, int touch) {
  if (!name) return NULL;
  pthread_rwlock_rdlock(&st->lock);
  pd_job *j = pd__find_locked(st, name);
  if (j) {
    pd_job_ref(j);
    /* Under the list lock: an expiry (write lock) sees the touch or runs before the get. */
    if (touch) atomic_store(&j->last_active, pd_now());
  }
  pthread_rwlock_unlock(&st->lock);
  return j;
}

/* pd_store_list's work with the store's lock held. */
static pd_job **pd__list_locked(pd_store *st, size_t *n) {
  *n = st->njobs;
  pd_job **jobs = malloc((*n ? *n : 1) * sizeof *jobs);
  for (size_t i = 0; jobs && i < *n; i++) {
    jobs[i] = st->jobs[i];
    pd_job_ref(jobs[i]);
  }
  if (!jobs) *n = 0;
  return jobs;
}

pd_job **pd_store_list(pd_store *st, size_t *n) {
  pthread_rwlock_rdlock(&st->lock);
  pd_job **jobs = pd__list_locked(st, n);
  pthread_rwlock_unlock(&st->lock);
  return jobs;
}

/* ---- ended jobs ----------------------------------------------------------------------- */

void pd_ended_free(pd_ended_job *ended, size_t n) {
  for (size_t i = 0; ended && i < n; i++) free(ended[i].name);
  free(ended);
}

static size_t pd__ended_find_locked(const pd_store *st, const char *name) {
  for (size_t i = 0; i < st->nended; i++)
    if (strcmp(st->ended[i].name, name) == 0) return i;
  return st->nended;
}

static void pd__ended_drop_locked(pd_store *st, size_t i) {
  free(st->ended[i].name);
  memmove(&st->ended[i], &st->ended[i + 1], (st->nended - i - 1) * sizeof *st->ended);
  st->nended--;
}

/* Remembers e (its name is taken) as the newest ended name, forgetting the oldest beyond
 * ended_max; with ended_max 0, or out of memory, frees the name (the job can then come back:
 * logged). */
static void pd__ended_add_locked(pd_store *st, pd_ended_job e) {
  if (st->ended_max == 0 || !e.name) {
    free(e.name);
    return;
  }
  size_t old = pd__ended_find_locked(st, e.name);
  if (old < st->nended) pd__ended_drop_locked(st, old);
  while (st->nended >= st->ended_max) pd__ended_drop_locked(st, 0);
  if (!st->ended) {
    st->ended = malloc(st->ended_max * sizeof *st->ended);
    if (!st->ended) {
      pd_log(PD_LOG_WARN, "out of memory remembering that job %s ended: it can be registered again",
             e.name);
      free(e.name);
      return;
    }
  }
  st->ended[st->nended++] = e;
}

int pd_store_ended(pd_store *st, const char *name, pd_ended_job *out) {
  if (!name) return 0;
  pthread_rwlock_rdlock(&st->lock);
  size_t i = pd__ended_find_locked(st, name);
  int found = i < st->nended;
  if (found && out) *out = (pd_ended_job){NULL, st->ended[i].ended_at, st->ended[i].how};
  pthread_rwlock_unlock(&st->lock);
  return found;
}

pd_ended_job *pd_store_list_ended(pd_store *st, size_t *nended, pd_job ***jobs, size_t *njobs) {
  pthread_rwlock_rdlock(&st->lock);
  size_t n = st->nended;
  pd_ended_job *out = calloc(n ? n : 1, sizeof *out);
  int ok = out != NULL;
  for (size_t i = 0; ok && i < n; i++) {
    out[i] = st->ended[i];
    ok = (out[i].name = pd__strdup(st->ended[i].name)) != NULL;
  }
  if (ok && jobs) ok = (*jobs = pd__list_locked(st, njobs)) != NULL;
  pthread_rwlock_unlock(&st->lock);
  if (!ok) {
    pd_ended_free(out, n);
    return NULL;
  }
  *nended = n;
  return out;
}

void pd_store_restore_ended(pd_store *st, pd_ended_job *ended, size_t n) {
  pthread_rwlock_wrlock(&st->lock);
  for (size_t i = 0; i < n; i++) pd__ended_add_locked(st, ended[i]);
  pthread_rwlock_unlock(&st->lock);
  free(ended);
}

void pd_store_list_free(pd_job **jobs, size_t n, pd_stats *stats) {
  for (size_t i = 0; jobs && i < n; i++) pd_job_unref(jobs[i], stats);
  free(jobs);
}

pd_job *pd_store_remove(pd_store *st, const char *name, double idle_s, double now) {
  pthread_rwlock_wrlock(&st->lock);
  pd_job *j = NULL;
  for (size_t i = 0; i < st->njobs && !j; i++) {
    pd_job *c = st->jobs[i];
    if (name && strcmp(c->name, name) != 0) continue;
    if (idle_s > 0 && !(now - atomic_load(&c->last_active) > idle_s)) continue;
    j = c;
    memmove(&st->jobs[i], &st->jobs[i + 1], (st->njobs - i - 1) * sizeof *st->jobs);
    st->njobs--; /* the others keep their order (stats list jobs in it) */
  }
  if (j) {
    size_t held = st->extra, scratch = 0;
    for (size_t i = 0; i < st->njobs; i++) {
      held += pd_job_bytes(st->jobs[i]);
      if (st->jobs[i]->scratch_max > scratch) scratch = st->jobs[i]->scratch_max;
    }
    atomic_store(&st->reserved, held);
    atomic_store(&st->scratch_max, scratch);
    atomic_store(&j->ended, 1);
    /* Under the same lock as the removal: no Register can slip in between. */
    pd__ended_add_locked(st, (pd_ended_job){pd__strdup(j->name), (int64_t)time(NULL),
                                            idle_s > 0 ? PD_ENDED_IDLE : PD_ENDED_BY_CALL});
    atomic_fetch_add(&st->generation, 1);
    atomic_fetch_add(&st->removed, 1);
  }
  pthread_rwlock_unlock(&st->lock);
  return j;
}

/* Allocates zeroed statistics for every block of job; frees them all on failure. */
static int pd__alloc_stats(pd_job *job) {
  for (size_t i = 0; i < job->nblocks; i++) {
    pd_block *b = &job->blocks[i];
    if (b->stat[0]) continue;
    int ok = 1;
    for (uint32_t p = 0; p < b->nparts; p++)
      ok &= (b->stat[p] = calloc(pc_packed_len(b->order[p]), sizeof(float))) != NULL;
    if (!ok) {
      for (size_t k = 0; k <= i; k++)
        for (uint32_t p = 0; p < job->blocks[k].nparts; p++) {
          free(job->blocks[k].stat[p]);
          job->blocks[k].stat[p] = NULL;
        }
      return PD_ENOMEM;
    }
  }
  return PD_OK;
}

static size_t pd__stat_bytes(const pd_job *job) {
  size_t total = 0;
  for (size_t i = 0; i < job->nblocks; i++)
    total += pd__parts_len(job->blocks[i].nparts, job->blocks[i].order) * sizeof(float);
  return total;
}

int pd_store_job_over_limit(const pd_store *st, const pd_job *job) {
  return st->job_memory_limit > 0 && pd_job_bytes(job) > st->job_memory_limit;
}

int pd_store_reserve_extra(pd_store *st, size_t bytes) {
  pthread_rwlock_wrlock(&st->lock);
  size_t held = st->extra;
  for (size_t i = 0; i < st->njobs; i++) held += pd_job_bytes(st->jobs[i]);
  int rc = held + bytes + atomic_load(&st->scratch_max) > st->memory_limit ? PD_ELIMIT : PD_OK;
  if (rc == PD_OK) {
    st->extra += bytes;
    atomic_store(&st->reserved, held + bytes);
  }
  pthread_rwlock_unlock(&st->lock);
  return rc;
}

void pd_store_release_extra(pd_store *st, size_t bytes) {
  pthread_rwlock_wrlock(&st->lock);
  st->extra -= bytes < st->extra ? bytes : st->extra;
  atomic_fetch_sub(&st->reserved, bytes);
  pthread_rwlock_unlock(&st->lock);
}

int pd_store_add(pd_store *st, pd_job *job, pd_job **existing) {
  return pd_store_register(st, job, 1, existing, NULL);
}

int pd_store_register(pd_store *st, pd_job *job, int reuse_ended, pd_job **existing,
                      pd_ended_job *ended) {
  *existing = NULL;
  pthread_rwlock_wrlock(&st->lock);
  int rc = PD_OK;
  pd_job *old = pd__find_locked(st, job->name);
  if (old) {
    pd_job_ref(old);
    atomic_store(&old->last_active, pd_now()); /* a worker registering again is activity */
    *existing = old;
    goto done;
  }
  /* The pool's rule decides the scratch it keeps room for (warm roots take more). */
  job->scratch_max = pd_job_scratch_bytes(job, st->warm_roots);
  size_t tomb = pd__ended_find_locked(st, job->name);
  if (tomb < st->nended && !reuse_ended) {
    if (ended) *ended = (pd_ended_job){NULL, st->ended[tomb].ended_at, st->ended[tomb].how};
    rc = PD_EENDED;
    goto done;
  }
  /* The memory limit is checked against the budget the job can reach (statistics and a
   * root pair per block), so a running job never fails for memory later. */
  /* Room is kept for the scratch of one computation of the largest unit, so the pool can
   * always compute (scheduler.c admits more at once only within what is left). */
  size_t held = st->extra, scratch = atomic_load(&st->scratch_max);
  for (size_t i = 0; i < st->njobs; i++) held += pd_job_bytes(st->jobs[i]);
  if (job->scratch_max > scratch) scratch = job->scratch_max;
  if (held + pd_job_bytes(job) + scratch > st->memory_limit || st->njobs >= PD_MAX_JOBS ||
      pd_store_job_over_limit(st, job)) {
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
  /* Every rank plans the same ownership from the same layout (replica_plan.c). */
  rc = pd_replica_plan(job, st->link ? st->link->nranks : 1);
  if (rc != PD_OK) goto done;
  rc = pd__alloc_stats(job);
  if (rc != PD_OK) goto done;
  if (st->stats)
    atomic_fetch_add(&st->stats->memory_bytes,
                     (int64_t)(pd__stat_bytes(job) + pd__meta_bytes(job)));
  if (tomb < st->nended) pd__ended_drop_locked(st, tomb); /* reused: a job again */
  job->in_store = 1;
  job->version_base = st->epoch << 40;
  atomic_store(&st->reserved, held + pd_job_bytes(job));
  atomic_store(&st->scratch_max, scratch);
  job->link = st->link;
  atomic_store(&job->last_active, pd_now()); /* a restored job's idle clock starts now */
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

/* A push folded into b (lock held): its count and step. Returns 1 and the age in *age when
 * the push is a staleness sample (to be added to the daemon's stats once the lock is
 * released). */
static int pd__pushed_locked(pd_block *b, uint64_t step, uint64_t *age) {
  int sampled = 0;
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

/* pd_block_update's work with b's lock held (pd__pushed_locked's result). */
static int pd__apply_locked(pd_block *b, const float *const *inc, uint64_t step, uint64_t *age) {
  const pd_job *job = b->job;
  if (job->mode->fold_bounded)
    job->mode->fold_bounded(job->opts, b, b->stat, inc, b->stat_bounded);
  else
    job->mode->fold(job->opts, b, b->stat, inc);
  return pd__pushed_locked(b, step, age);
}

void pd_block_update(pd_block *b, const float *const *inc, uint64_t step, pd_stats *stats) {
  uint64_t age = 0;
  pthread_mutex_lock(&b->lock);
  int sampled = pd__apply_locked(b, inc, step, &age);
  pthread_mutex_unlock(&b->lock);
  if (sampled && stats) pd_stats_add_staleness(stats, age);
}

typedef struct {
  uint32_t id;
  size_t index;
} pd__by_id;

static int pd__cmp_by_id(const void *a, const void *b) {
  uint32_t x = ((const pd__by_id *)a)->id, y = ((const pd__by_id *)b)->id;
  return (x > y) - (x < y);
}

int pd_job_push(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                uint64_t step, pd_stats *stats, size_t *bad) {
  return pd_job_push_scanned(job, n, blocks, inc, NULL, step, stats, bad);
}

/* Every lock of a push at once, in id order (no two pushes can deadlock): a check and the
 * update it admits see the same statistic. order gets the blocks in id order. */
static int pd__lock_all(size_t n, pd_block *const *blocks, pd__by_id **order) {
  *order = malloc((n ? n : 1) * sizeof **order);
  if (!*order) return PD_ENOMEM;
  for (size_t i = 0; i < n; i++) (*order)[i] = (pd__by_id){blocks[i]->id, i};
  qsort(*order, n, sizeof **order, pd__cmp_by_id);
  for (size_t k = 0; k < n; k++) pthread_mutex_lock(&blocks[(*order)[k].index]->lock);
  return PD_OK;
}

static void pd__unlock_all(size_t n, pd_block *const *blocks, pd__by_id *order) {
  for (size_t k = n; k-- > 0;) pthread_mutex_unlock(&blocks[order[k].index]->lock);
  free(order);
}

int pd_job_push_into(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                     float **out, uint64_t step, pd_stats *stats, int (*intact)(void *ctx),
                     void *ctx, pd_push_refusal *refusal) {
  const pd_mode *mode = job->mode;
  memset(refusal, 0, sizeof *refusal);
  if (!mode->fold_into) {
    size_t bad = 0;
    int rc = pd_job_push(job, n, blocks, inc, step, stats, &bad);
    *refusal = (pd_push_refusal){bad, 0, PD_FOLD_OVERFLOW, 0};
    return rc;
  }
  pd__by_id *order = NULL;
  uint64_t *ages = malloc((n ? n : 1) * sizeof *ages);
  uint8_t *bounded = malloc((n ? n : 1) * PD_MAX_PARTS);
  uint8_t *in_place = malloc((n ? n : 1) * PD_MAX_PARTS);
  if (!ages || !bounded || !in_place || pd__lock_all(n, blocks, &order) != PD_OK) {
    free(ages);
    free(bounded);
    free(in_place);
    return PD_ENOMEM;
  }
  /* Every block is folded even after a refusal: a NaN or Inf is reported before an overflow
   * wherever they are, as the bytes path's checks (NaN at decoding) do. */
  int first[PD_FOLD_OVERFLOW + 1] = {0};
  pd_push_refusal found[PD_FOLD_OVERFLOW + 1];
  for (size_t i = 0; i < n; i++) {
    uint32_t part = 0;
    int why = mode->fold_into(job->opts, blocks[i], blocks[i]->stat, &inc[PD_MAX_PARTS * i],
                              &out[PD_MAX_PARTS * i], &bounded[PD_MAX_PARTS * i],
                              &in_place[PD_MAX_PARTS * i], &part);
    if (why != PD_FOLD_OK && !first[why]) {
      first[why] = 1;
      found[why] = (pd_push_refusal){i, part, why, 0};
    }
  }
  int rc = PD_OK;
  if (first[PD_FOLD_NONFINITE] || first[PD_FOLD_OVERFLOW]) {
    *refusal = found[first[PD_FOLD_NONFINITE] ? PD_FOLD_NONFINITE : PD_FOLD_OVERFLOW];
    rc = PD_EINVAL;
  } else if (intact && !intact(ctx)) {
    *refusal = (pd_push_refusal){0, 0, PD_FOLD_CHANGED, 0};
    rc = PD_EINVAL;
  }
  /* Kept: a part folded into out swaps in; dropped: a part folded in place swaps its old
   * values back (pd_mode.fold_into). */
  size_t nages = 0;
  for (size_t i = 0; i < n; i++) {
    pd_block *b = blocks[i];
    for (uint32_t k = 0; k < b->nparts; k++) {
      size_t at = PD_MAX_PARTS * i + k;
      if ((rc == PD_OK) == !in_place[at]) {
        float *old = b->stat[k];
        b->stat[k] = out[at];
        out[at] = old;
      }
      if (rc == PD_OK) b->stat_bounded[k] = bounded[at];
    }
    if (rc == PD_OK) nages += (size_t)pd__pushed_locked(b, step, &ages[nages]);
  }
  pd__unlock_all(n, blocks, order);
  for (size_t i = 0; stats && i < nages; i++) pd_stats_add_staleness(stats, ages[i]);
  free(ages);
  free(bounded);
  free(in_place);
  return rc;
}

/* 1 when every statistic part of the n blocks is known below 2^126 (their locks held). */
static int pd__all_bounded(size_t n, pd_block *const *blocks) {
  for (size_t i = 0; i < n; i++)
    for (uint32_t k = 0; k < blocks[i]->nparts; k++)
      if (!blocks[i]->stat_bounded[k]) return 0;
  return 1;
}

int pd_job_push_vouched(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                        float **out, uint64_t step, pd_stats *stats, int (*intact)(void *ctx),
                        void *ctx, pd_push_refusal *refusal) {
  const pd_mode *mode = job->mode;
  if (!mode->fold_vouched)
    return pd_job_push_into(job, n, blocks, inc, out, step, stats, intact, ctx, refusal);
  memset(refusal, 0, sizeof *refusal);
  pd__by_id *order = NULL;
  uint64_t *ages = malloc((n ? n : 1) * sizeof *ages);
  uint8_t *bounded = malloc((n ? n : 1) * PD_MAX_PARTS);
  if (!ages || !bounded || pd__lock_all(n, blocks, &order) != PD_OK) {
    free(ages);
    free(bounded);
    return PD_ENOMEM;
  }
  if (!pd__all_bounded(n, blocks)) { /* a statistic not known bounded: the fold with a spare */
    pd__unlock_all(n, blocks, order);
    free(ages);
    free(bounded);
    return pd_job_push_into(job, n, blocks, inc, out, step, stats, intact, ctx, refusal);
  }
  /* No refusal can come from a true vouch: every block is folded, a false one noted. */
  if (stats) atomic_fetch_add(&stats->vouched_pushes, 1);
  int rc = PD_OK;
  for (size_t i = 0; i < n; i++) {
    uint32_t part = 0;
    if (mode->fold_vouched(job->opts, blocks[i], blocks[i]->stat, &inc[PD_MAX_PARTS * i],
                           &bounded[PD_MAX_PARTS * i], &part) &&
        rc == PD_OK) {
      *refusal = (pd_push_refusal){i, part, PD_FOLD_VOUCH, 1};
      rc = PD_EINVAL;
    }
    memcpy(blocks[i]->stat_bounded, &bounded[PD_MAX_PARTS * i], blocks[i]->nparts);
  }
  if (rc == PD_OK && intact && !intact(ctx)) {
    *refusal = (pd_push_refusal){0, 0, PD_FOLD_CHANGED, 1};
    rc = PD_EINVAL;
  }
  size_t nages = 0;
  for (size_t i = 0; rc == PD_OK && i < n; i++)
    nages += (size_t)pd__pushed_locked(blocks[i], step, &ages[nages]);
  pd__unlock_all(n, blocks, order);
  for (size_t i = 0; stats && i < nages; i++) pd_stats_add_staleness(stats, ages[i]);
  free(ages);
  free(bounded);
  return rc;
}

/* 1 when block b's fold of increments whose scans are scan (NULL: unknown) cannot
 * overflow by the mode's promise (pd_mode.fold_bounded), with no pass over the values. */
static int pd__fold_bounded(const pd_block *b, const uint8_t *scan) {
  if (!b->job->mode->fold_bounded || !scan) return 0;
  for (uint32_t k = 0; k < b->nparts; k++)
    if (!b->stat_bounded[k] || scan[k] != RPC_F32_BOUNDED) return 0;
  return 1;
}

int pd_job_push_scanned(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                        const uint8_t *inc_scan, uint64_t step, pd_stats *stats, size_t *bad) {
  *bad = 0;
  pd__by_id *order = NULL;
  uint64_t *ages = malloc((n ? n : 1) * sizeof *ages);
  size_t nages = 0;
  if (!ages || pd__lock_all(n, blocks, &order) != PD_OK) {
    free(ages);
    return PD_ENOMEM;
  }
  const pd_mode *mode = job->mode;
  int rc = PD_OK;
  for (size_t i = 0; i < n && rc == PD_OK; i++) {
    if (pd__fold_bounded(blocks[i], inc_scan ? &inc_scan[PD_MAX_PARTS * i] : NULL)) continue;
    if (!mode->fold_fits(job->opts, blocks[i], (const float *const *)blocks[i]->stat,
                         &inc[PD_MAX_PARTS * i])) {
      *bad = i;
      rc = PD_EINVAL;
    }
  }
  for (size_t i = 0; i < n && rc == PD_OK; i++)
    nages += (size_t)pd__apply_locked(blocks[i], &inc[PD_MAX_PARTS * i], step, &ages[nages]);
  pd__unlock_all(n, blocks, order);
  for (size_t i = 0; stats && i < nages; i++) pd_stats_add_staleness(stats, ages[i]);
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

/* Installs r as b's root with b's lock held; returns the root it replaces. */
static pd_root *pd__install_locked(pd_block *b, pd_root *r) {
  pd_root *old = b->root;
  b->root = r;
  atomic_store(&b->root_step, r->source_step);
  atomic_store(&b->has_root, 1);
  return old;
}

void pd_block_publish(pd_block *b, pd_root *r, pd_stats *stats) {
  const pd_replica_link *link = b->job->link;
  pthread_mutex_lock(&b->lock);
  uint64_t base = b->job->version_base;
  r->version = b->root && b->root->version > base ? b->root->version + 1 : base + 1;
  pd_root *old = pd__install_locked(b, r);
  int share = link && link->nranks > 1 && !atomic_load(&link->alone);
  if (share) pd_root_ref(r);
  pthread_mutex_unlock(&b->lock);
  pd_root_unref(old, stats);
  /* The owner's result goes to the other replicas: queued by reference, never sent from here.
   * One pool thread computes a unit at a time, so its versions are queued in order. */
  if (share) {
    link->published(link->ctx, b, r);
    pd_root_unref(r, stats);
  }
}

int pd_block_publish_as(pd_block *b, pd_root *r, pd_stats *stats) {
  pthread_mutex_lock(&b->lock);
  int newer = !b->root || r->version > b->root->version;
  pd_root *old = newer ? pd__install_locked(b, r) : r;
  pthread_mutex_unlock(&b->lock);
  pd_root_unref(old, stats);
  return newer;
}

int pd_block_due(pd_block *b) {
  const pd_job *job = b->job;
  if (!job->mode->compute_due) return 1;
  pthread_mutex_lock(&b->lock);
  uint64_t step = atomic_load(&b->stat_step);
  int due =
      job->mode->compute_due(job->opts, b, b->pushes, step, b->due_step, atomic_load(&b->has_root));
  if (due) b->due_step = step;
  pthread_mutex_unlock(&b->lock);
  return due;
}
