/*
 * scheduler.c -- the worker pool that turns statistics into published roots.
 *
 * Blocks whose statistics changed wait in one queue; a free worker takes the most urgent by
 * the policy written in precondd.h (no root yet, then the stalest, then the cheapest). The
 * worker copies the statistics under the block lock, runs the drift test (a root whose
 * statistics barely moved is republished as it is), else computes both roots without any
 * lock, checks them (finite, error within the failure threshold) and publishes a new
 * immutable root; on failure the previous root stays and the failure is counted.
 */
#include "precondd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cblas.h>

#include "preconditioner.h"

static double pd__urgency_size(const pd_block *b) {
  double r = (double)b->rows, c = (double)b->cols;
  return r * r * r + c * c * c;
}

int pd_sched_before(pd_block *a, pd_block *b) {
  int ra = atomic_load(&a->has_root), rb = atomic_load(&b->has_root);
  if (ra != rb) return !ra;
  uint64_t sa = atomic_load(&a->stat_step) - atomic_load(&a->root_step);
  uint64_t sb = atomic_load(&b->stat_step) - atomic_load(&b->root_step);
  if (sa != sb) return sa > sb;
  return pd__urgency_size(a) < pd__urgency_size(b);
}

/* ---- the drift test ------------------------------------------------------------------- */

/* The probe vectors' signs: fixed (a hash of probe and index), so the reference and the new
 * statistics are probed alike, and independent of n's history. */
static float pd__probe_sign(unsigned k, size_t i) {
  uint64_t z = ((uint64_t)k << 40) + (uint64_t)i + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return (z & 1) ? 1.0f : -1.0f;
}

/* q[0] = trace(S), q[k] = v_k^T S v_k (k >= 1) of a packed upper S, in one pass over it.
 * v holds (PD_DRIFT_PROBES - 1) * n floats of scratch. */
static void pd__probe(size_t n, const float *packed, float *v, double q[PD_DRIFT_PROBES]) {
  enum { K = PD_DRIFT_PROBES - 1 };
  for (unsigned k = 0; k < K; k++)
    for (size_t i = 0; i < n; i++) v[k * n + i] = pd__probe_sign(k, i);
  for (unsigned k = 0; k < PD_DRIFT_PROBES; k++) q[k] = 0;
  const float *row = packed;
  for (size_t i = 0; i < n; i++) {
    double d = row[0], acc[K] = {0};
    for (size_t j = 1; j < n - i; j++)
      for (unsigned k = 0; k < K; k++) acc[k] += (double)v[k * n + i + j] * row[j];
    q[0] += d;
    for (unsigned k = 0; k < K; k++) q[k + 1] += v[k * n + i] * (d * v[k * n + i] + 2 * acc[k]);
    row += n - i;
  }
}

/* The largest relative change of the probes; 0 when nothing moved, INFINITY from zero.
 * With scale_free, each part's forms are divided by its trace first (a uniform scale of a
 * part is not drift: the mode rescales the kept result for it), and scale[f] gets the
 * part's trace ratio (1 otherwise). */
static double pd__drift(uint32_t nparts, const double q[PD_MAX_PARTS][PD_DRIFT_PROBES],
                        const double ref[PD_MAX_PARTS][PD_DRIFT_PROBES], int scale_free,
                        double scale[PD_MAX_PARTS]) {
  double worst = 0;
  for (uint32_t f = 0; f < nparts; f++) {
    scale[f] = 1;
    double nq = 1, nr = 1;
    if (scale_free) {
      if (!(q[f][0] > 0 && ref[f][0] > 0)) return INFINITY; /* no trace: nothing to scale */
      scale[f] = q[f][0] / ref[f][0];
      nq = q[f][0];
      nr = ref[f][0];
    }
    for (int k = scale_free ? 1 : 0; k < PD_DRIFT_PROBES; k++) {
      double a = q[f][k] / nq, r = ref[f][k] / nr;
      double diff = fabs(a - r), base = fabs(r);
      double rel = diff == 0 ? 0 : base > 0 ? diff / base : INFINITY;
      if (rel > worst) worst = rel;
    }
  }
  return worst;
}

/* Republishes the block's root as of statistics step `step`, each part multiplied by
 * scale[k]^exponent (exponent 0: values copied as they are; roots are immutable).
 * PD_ENOMEM leaves everything as it was. */
static int pd__republish(pd_block *b, uint64_t step, const double *scale, double exponent,
                         pd_stats *stats) {
  pd_root *old = pd_block_root(b);
  if (!old) return PD_OK;
  int rc = PD_OK;
  if (step > old->source_step) {
    pd_root *r = pd_root_new(old->nparts, old->order, stats);
    if (!r) {
      rc = PD_ENOMEM;
    } else {
      for (uint32_t k = 0; k < old->nparts; k++) {
        size_t n = pc_packed_len(old->order[k]);
        float c = exponent != 0 ? (float)pow(scale[k], exponent) : 1.0f;
        if (c == 1.0f)
          memcpy(r->part[k], old->part[k], n * sizeof(float));
        else
          for (size_t i = 0; i < n; i++) r->part[k][i] = c * old->part[k][i];
      }
      r->source_step = step;
      r->error = old->error;
      r->method = old->method;
      r->iterations = old->iterations;
      pd_block_publish(b, r, stats);
    }
  }
  pd_root_unref(old, stats);
  return rc;
}

/* ---- computing roots ------------------------------------------------------------------ */

/* Records a failed computation of b: counts, the error (NaN when the computation itself
 * failed, so stats never show a failure as error 0), and a reason in last_failure. After
 * PD_FAILURES_BEFORE_RESET failures in a row the statistics are zeroed, since pushes only
 * add to a statistic that is already unusable (indefinite, or badly conditioned). Returns 1
 * when it reset them. */
static int pd__note_failure(pd_block *b, int status, const pd_compute_info *info, double ms,
                            double failure_threshold) {
  const pd_mode *mode = b->job->mode;
  double err = status >= 0 ? info->error : NAN;
  pthread_mutex_lock(&b->lock);
  b->roots_failed++;
  b->last_error = isfinite(err) ? err : NAN;
  b->last_compute_ms = ms;
  if (status < 0)
    snprintf(b->last_failure, sizeof b->last_failure, "%s: %s",
             info->failed_part >= 0 && info->failed_part < (int)b->nparts
                 ? mode->part_names[info->failed_part]
                 : mode->name,
             pc_strerror(status));
  else if (!isfinite(err))
    snprintf(b->last_failure, sizeof b->last_failure, "non-finite result or error");
  else
    snprintf(b->last_failure, sizeof b->last_failure, "error %g above the threshold %g", err,
             failure_threshold);
  int reset = ++b->failures_in_row >= PD_FAILURES_BEFORE_RESET;
  if (reset) {
    for (uint32_t k = 0; k < b->nparts; k++)
      memset(b->stat[k], 0, pc_packed_len(b->order[k]) * sizeof(float));
    b->failures_in_row = 0;
    b->resets++;
    b->has_drift_ref = 0; /* nothing published is a reference for what comes next */
  }
  pthread_mutex_unlock(&b->lock);
  return reset;
}

int pd_sched_compute(pd_block *b, pd_stats *stats, const pd_sched_rules *rules,
                     pd_root_outcome *outcome) {
  const pd_job *job = b->job;
  const pd_mode *mode = job->mode;
  float *state[PD_MAX_PARTS] = {NULL};
  uint64_t nmax = 1;
  int ok = 1;
  for (uint32_t k = 0; k < b->nparts; k++) {
    ok &= (state[k] = malloc(pc_packed_len(b->order[k]) * sizeof(float))) != NULL;
    if (b->order[k] > nmax) nmax = b->order[k];
  }
  float *probe = malloc((PD_DRIFT_PROBES - 1) * nmax * sizeof *probe);
  pd_root *r = NULL;
  int rc = PD_ENOMEM;
  if (!ok || !probe) goto cleanup;

  pthread_mutex_lock(&b->lock);
  for (uint32_t k = 0; k < b->nparts; k++)
    memcpy(state[k], b->stat[k], pc_packed_len(b->order[k]) * sizeof(float));
  uint64_t step = atomic_load(&b->stat_step);
  int has_ref = b->has_drift_ref && b->root != NULL;
  double ref[PD_MAX_PARTS][PD_DRIFT_PROBES];
  memcpy(ref, b->drift_ref, sizeof ref);
  pthread_mutex_unlock(&b->lock);

  /* The drift test. */
  double q[PD_MAX_PARTS][PD_DRIFT_PROBES] = {{0}};
  if (mode->drift_test)
    for (uint32_t k = 0; k < b->nparts; k++) pd__probe(b->order[k], state[k], probe, q[k]);
  if (mode->drift_test && has_ref) {
    double exponent = mode->scale_exponent ? mode->scale_exponent(job->opts) : 0;
    double scale[PD_MAX_PARTS];
    double drift = pd__drift(b->nparts, (const double(*)[PD_DRIFT_PROBES])q,
                             (const double(*)[PD_DRIFT_PROBES])ref, exponent != 0, scale);
    int skip = rules->drift_threshold > 0 && drift < rules->drift_threshold;
    if (skip && pd__republish(b, step, scale, exponent, stats) != PD_OK) goto cleanup;
    pthread_mutex_lock(&b->lock);
    b->last_drift = drift;
    if (skip) b->roots_skipped++;
    pthread_mutex_unlock(&b->lock);
    if (skip) {
      atomic_fetch_add(&stats->roots_skipped, 1);
      *outcome = PD_ROOT_SKIPPED;
      rc = PD_OK;
      goto cleanup;
    }
  }

  r = pd_root_new(b->nparts, b->order, stats);
  if (!r) goto cleanup;
  double t0 = pd_now();
  pd_compute_info info;
  memset(&info, 0, sizeof info);
  /* Only this thread computes b now, so mode_state needs no lock. */
  int status = mode->compute(job->opts, b, (const float *const *)state,
                             rules->warm_start ? &b->mode_state : NULL, r->part, &info);
  double ms = 1e3 * (pd_now() - t0);
  pd_stats_add_compute_ms(stats, ms);
  if (info.state_bytes) atomic_fetch_add(&stats->memory_bytes, info.state_bytes);
  pthread_mutex_lock(&b->lock);
  for (int k = 0; k < PD_MODE_COUNTS; k++) b->mode_counts[k] += info.counts[k];
  pthread_mutex_unlock(&b->lock);

  if (mode->publishable(job->opts, b, status, &info, (const float *const *)r->part,
                        rules->failure_threshold)) {
    r->source_step = step;
    r->error = info.error;
    r->method = info.method;
    r->iterations = info.iterations;
    memcpy(r->aux, info.aux, sizeof r->aux);
    pthread_mutex_lock(&b->lock);
    b->roots_computed++;
    b->last_error = info.error;
    b->last_compute_ms = ms;
    b->failures_in_row = 0;
    memcpy(b->drift_ref, q, sizeof q);
    b->has_drift_ref = mode->drift_test;
    pthread_mutex_unlock(&b->lock);
    pd_block_publish(b, r, stats);
    r = NULL;
    atomic_fetch_add(&stats->roots_computed, 1);
    *outcome = PD_ROOT_PUBLISHED;
  } else {
    int reset = pd__note_failure(b, status, &info, ms, rules->failure_threshold);
    atomic_fetch_add(&stats->roots_failed, 1);
    pd_log(PD_LOG_WARN, "job %s block %u: root not published (%s); the previous root stays%s",
           job->name, b->id, b->last_failure,
           reset ? "; statistics reset after repeated failures" : "");
    *outcome = PD_ROOT_FAILED;
  }
  rc = PD_OK;

cleanup:
  if (rc != PD_OK)
    pd_log(PD_LOG_ERROR, "job %s block %u: out of memory computing roots", job->name, b->id);
  pd_root_unref(r, stats);
  for (uint32_t k = 0; k < PD_MAX_PARTS; k++) free(state[k]);
  free(probe);
  return rc;
}

/* The warm route's own buffers per n^2 bytes (preconditioner/warm_impl.h, warm_route: B in
 * fp64, 8; N, V1 and G in fp32, 12; the fp64 Rayleigh products, 24; 4 more cover its 20 n
 * bytes of vectors for n >= 5). They stay allocated while the route falls back to a cold
 * root, so they come on top of the cold bound; the seeding eigendecomposition (syevd, about
 * 8 n^2) and the guard's sampled residual (8 n^2) fit in the cold bound's share. */
#define PD_WARM_SCRATCH_N2 48

size_t pd_unit_scratch_bytes(const pd_block *u, int warm) {
  size_t nmax = 1, parts = 0;
  for (uint32_t k = 0; k < u->nparts; k++) {
    if (u->order[k] > nmax) nmax = (size_t)u->order[k];
    parts += pc_packed_len(u->order[k]);
  }
  /* Only a mode that keeps per-unit state (Shampoo's eigenbases) has a warm route. */
  size_t per_n2 = 80 + (warm && u->job->mode->unit_free ? PD_WARM_SCRATCH_N2 : 0);
  /* The state's copy and the new result (parts), the drift probes, the dense numerics. */
  return 2 * parts * sizeof(float) + PD_DRIFT_PROBES * nmax * sizeof(float) + per_n2 * nmax * nmax;
}

/* The queue entry a free worker takes (the policy above) among those whose scratch fits in
 * the budget's free room, or any when nothing runs (one computation always may: Register
 * kept room for it); s->len when none may start now. *need gets its scratch. Under lock. */
static size_t pd__pick(pd_sched *s, size_t *need) {
  size_t avail = SIZE_MAX;
  if (s->rules.budget) {
    size_t limit = s->rules.budget->memory_limit;
    size_t used = atomic_load(&s->rules.budget->reserved) + s->scratch_in_use;
    avail = limit > used ? limit - used : 0;
  }
  size_t best = s->len;
  for (size_t i = 0; i < s->len; i++) {
    size_t n = pd_unit_scratch_bytes(s->queue[i], s->rules.warm_start);
    if (n > avail && s->scratch_in_use > 0) continue;
    if (best == s->len || pd_sched_before(s->queue[i], s->queue[best])) {
      best = i;
      *need = n;
    }
  }
  return best;
}

int pd_sched_blas_threads(uint32_t order, int wide) {
  return order >= PD_BLAS_WIDE_ORDER && wide > 1 ? wide : 1;
}

/* Sets OpenBLAS's threads for b's computation when they change. Under lock: the setting is
 * process-wide, so blas_now must say what OpenBLAS holds. */
static void pd__blas_for(pd_sched *s, const pd_block *b) {
  uint32_t order = 0;
  for (uint32_t k = 0; k < b->nparts; k++)
    if (b->order[k] > order) order = b->order[k];
  int want = pd_sched_blas_threads(order, s->blas_wide);
  if (want == s->blas_now) return;
  openblas_set_num_threads(want);
  s->blas_now = want;
}

static void *pd__worker(void *arg) {
  pd_sched *s = arg; /* subnormals: pc_inverse_root_* flushes them in the computing thread */
  pd_thread_name("pd-pool");
  /* Linux's nice is per thread: this one only, not the daemon's I/O threads. */
  if (s->rules.pool_nice > 0 &&
      setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), s->rules.pool_nice) != 0)
    pd_log(PD_LOG_WARN, "scheduler: cannot set a root worker's nice value to %d",
           s->rules.pool_nice);
  pthread_mutex_lock(&s->lock);
  for (;;) {
    while (!s->stopping && s->len == 0) pthread_cond_wait(&s->cond, &s->lock);
    if (s->stopping) break;
    size_t need = 0, best = pd__pick(s, &need);
    if (best == s->len) { /* no room for any queued computation: wait for one to end */
      atomic_fetch_add(&s->stats->scratch_waits, 1);
      pthread_cond_wait(&s->cond, &s->lock);
      continue;
    }
    pd_block *b = s->queue[best];
    s->queue[best] = s->queue[--s->len];
    b->queued = 0;
    b->computing = 1;
    atomic_fetch_add(&s->busy, 1);
    s->scratch_in_use += need;
    uint64_t now = atomic_fetch_add(&s->stats->scratch_bytes, need) + need;
    for (uint64_t peak = atomic_load(&s->stats->scratch_peak);
         now > peak && !atomic_compare_exchange_weak(&s->stats->scratch_peak, &peak, now);) {
    }
    pd__blas_for(s, b);
    pthread_mutex_unlock(&s->lock);

    pd_root_outcome outcome;
    if (!atomic_load(&b->job->ended)) /* an ended job's roots would go nowhere */
      pd_sched_compute(b, s->stats, &s->rules, &outcome); /* no memory: logged, retried at
                                                            * the block's next push */

    pthread_mutex_lock(&s->lock);
    atomic_fetch_sub(&s->busy, 1);
    s->scratch_in_use -= need;
    atomic_fetch_sub(&s->stats->scratch_bytes, need);
    if (s->rules.budget) pthread_cond_broadcast(&s->cond); /* room for a waiting worker */
    b->computing = 0;
    if (b->redo && !s->stopping && !atomic_load(&b->job->ended)) {
      b->redo = 0;
      b->queued = 1;
      s->queue[s->len++] = b; /* room: the slot this block left is still counted in cap;
                               * the queue entry keeps the job reference */
    } else {
      b->redo = 0;
      /* The entry's job reference; the last one frees an ended job, not under the lock. */
      pthread_mutex_unlock(&s->lock);
      pd_job_unref(b->job, s->stats);
      pthread_mutex_lock(&s->lock);
    }
  }
  pthread_mutex_unlock(&s->lock);
  return NULL;
}

int pd_sched_start(pd_sched *s, int nthreads, pd_stats *stats, const pd_sched_rules *rules) {
  memset(s, 0, sizeof *s);
  /* 0 threads: a daemon without a pool (--threads 0): blocks are queued, never computed. */
  if (nthreads < 0) nthreads = 0;
  if (pthread_mutex_init(&s->lock, NULL) != 0) return PD_ENOMEM;
  if (pthread_cond_init(&s->cond, NULL) != 0) {
    pthread_mutex_destroy(&s->lock);
    return PD_ENOMEM;
  }
  s->stats = stats;
  s->rules = *rules;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores < 1) cores = 1;
  /* Workers run independent roots; BLAS threads inside each would only compete with the
   * other workers for the same cores. Small blocks take 1 (pd__blas_for). */
  int blas = (int)(cores / (nthreads > 0 ? nthreads : 1));
  if (blas < 1) blas = 1;
  s->blas_wide = blas;
  s->blas_now = blas;
  openblas_set_num_threads(blas);
  s->threads = calloc(nthreads > 0 ? (size_t)nthreads : 1, sizeof *s->threads);
  if (!s->threads) {
    pd_sched_stop(s); /* joins none, releases the lock and condition */
    return PD_ENOMEM;
  }
  for (int i = 0; i < nthreads; i++) {
    if (pthread_create(&s->threads[i], NULL, pd__worker, s) != 0) {
      pd_sched_stop(s);
      return PD_ENOMEM;
    }
    s->nthreads++;
  }
  pd_log(PD_LOG_INFO,
         "scheduler: %d root workers, %d BLAS thread(s) each from order %u (1 below), %ld cores",
         nthreads, blas, PD_BLAS_WIDE_ORDER, cores);
  return PD_OK;
}

int pd_sched_mark(pd_sched *s, pd_block *b) {
  int rc = PD_OK;
  pthread_mutex_lock(&s->lock);
  if (b->queued) goto done;
  if (b->computing) {
    b->redo = 1;
    goto done;
  }
  /* Capacity covers queued and computing blocks, so a redo never needs to grow it. */
  size_t need = s->len + atomic_load(&s->busy) + 1;
  if (need > s->cap) {
    size_t ncap = s->cap ? 2 * s->cap : 64;
    while (ncap < need) ncap *= 2;
    pd_block **nq = realloc(s->queue, ncap * sizeof *nq);
    if (!nq) {
      rc = PD_ENOMEM;
      goto done;
    }
    s->queue = nq;
    s->cap = ncap;
  }
  b->queued = 1;
  pd_job_ref(b->job); /* dropped when the computation ends: the job outlives its entries */
  s->queue[s->len++] = b;
  pthread_cond_signal(&s->cond);
done:
  pthread_mutex_unlock(&s->lock);
  return rc;
}

uint64_t pd_sched_depth(pd_sched *s) {
  pthread_mutex_lock(&s->lock);
  uint64_t n = s->len + atomic_load(&s->busy);
  pthread_mutex_unlock(&s->lock);
  return n;
}

/* Drops the job references of queue entries taken out (their blocks unqueued under the
 * lock); called without the lock, since a last reference frees the job. */
static void pd__drop_entries(pd_sched *s, pd_block **taken, size_t n) {
  for (size_t i = 0; i < n; i++) pd_job_unref(taken[i]->job, s->stats);
}

void pd_sched_forget(pd_sched *s, pd_job *job) {
  pthread_mutex_lock(&s->lock);
  /* The entries of job are taken out under the lock and their references dropped after. */
  size_t keep = 0, n = 0;
  pd_block **taken = malloc((s->len ? s->len : 1) * sizeof *taken);
  for (size_t i = 0; i < s->len; i++) {
    pd_block *b = s->queue[i];
    if (b->job == job && taken) {
      b->queued = 0;
      taken[n++] = b;
    } else {
      s->queue[keep++] = b;
    }
  }
  s->len = keep;
  for (size_t i = 0; i < job->nblocks; i++) job->blocks[i].redo = 0;
  pthread_mutex_unlock(&s->lock);
  /* Without memory for the list, the entries stay and the workers skip them (ended). */
  pd__drop_entries(s, taken, n);
  free(taken);
}

void pd_sched_stop(pd_sched *s) {
  pthread_mutex_lock(&s->lock);
  s->stopping = 1;
  pd_block **taken = s->queue;
  size_t n = s->len;
  for (size_t i = 0; i < n; i++) taken[i]->queued = 0;
  s->queue = NULL;
  s->cap = 0;
  s->len = 0;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  pd__drop_entries(s, taken, n);
  free(taken);
  for (int i = 0; i < s->nthreads; i++) pthread_join(s->threads[i], NULL);
  free(s->threads);
  free(s->queue);
  s->threads = NULL;
  s->queue = NULL;
  s->nthreads = 0;
  pthread_cond_destroy(&s->cond);
  pthread_mutex_destroy(&s->lock);
}
