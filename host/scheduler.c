/*
 * scheduler.c -- the worker pool that turns statistics into published roots.
 *
 * Blocks whose statistics changed wait in one queue. A free worker takes the most urgent:
 * blocks with no root yet first, then the stalest (newest statistics step minus the step of
 * the published root), then the largest (n^3 cost). The worker copies the statistics under
 * the block lock, computes both roots without any lock, checks them (finite, error within the
 * failure threshold) and publishes a new immutable root; on failure the previous root stays
 * and the failure is counted.
 */
#include "precondd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define PD_HAVE_MXCSR 1
#endif

#include "preconditioner.h"

/* Late Newton iterations underflow into subnormals, which are very slow on x86: flush them
 * to zero in the threads that compute roots. */
static void pd__flush_denormals(void) {
#ifdef PD_HAVE_MXCSR
  _mm_setcsr(_mm_getcsr() | 0x8040); /* FTZ | DAZ */
#endif
}

static double pd__urgency_size(const pd_block *b) {
  double r = (double)b->rows, c = (double)b->cols;
  return r * r * r + c * c * c;
}

/* 1 if a should be computed before b. */
static int pd__before(pd_block *a, pd_block *b) {
  int ra = atomic_load(&a->has_root), rb = atomic_load(&b->has_root);
  if (ra != rb) return !ra;
  uint64_t sa = atomic_load(&a->stat_step) - atomic_load(&a->root_step);
  uint64_t sb = atomic_load(&b->stat_step) - atomic_load(&b->root_step);
  if (sa != sb) return sa > sb;
  return pd__urgency_size(a) > pd__urgency_size(b);
}

/* One factor: packed statistic -> packed root. Returns the pc_ status; info filled. */
static int pd__factor_root(size_t n, const float *stat_packed, const pd_shampoo_opts *o,
                           float *dense_a, float *dense_x, float *root_packed,
                           pc_root_info *info) {
  pc_root_opts ro;
  pc_root_opts_default(&ro, (int)o->root_exponent);
  ro.epsilon = o->epsilon;
  ro.method = (pc_method)o->method;
  pc_unpack_f32(n, stat_packed, dense_a);
  int rc = pc_inverse_root_f32(n, dense_a, dense_x, &ro, info);
  if (rc >= 0) pc_pack_f32(n, dense_x, root_packed);
  return rc;
}

/* Records a failed computation of b: counts, the error (NaN when the computation itself
 * failed, so stats never show a failure as error 0), and a reason in last_failure. After
 * PD_FAILURES_BEFORE_RESET failures in a row the statistics are zeroed, since pushes only
 * add to a statistic that is already unusable (indefinite, or badly conditioned). Returns 1
 * when it reset them. */
static int pd__note_failure(pd_block *b, int rcl, int rcr, double err, double ms,
                            double failure_threshold) {
  pthread_mutex_lock(&b->lock);
  b->roots_failed++;
  b->last_error = isfinite(err) ? err : NAN;
  b->last_compute_ms = ms;
  if (rcl < 0 || rcr < 0)
    snprintf(b->last_failure, sizeof b->last_failure, "%s factor: %s",
             rcl < 0 ? "left" : "right", pc_strerror(rcl < 0 ? rcl : rcr));
  else if (!isfinite(err))
    snprintf(b->last_failure, sizeof b->last_failure, "non-finite root or error");
  else
    snprintf(b->last_failure, sizeof b->last_failure, "error %g above the threshold %g", err,
             failure_threshold);
  int reset = ++b->failures_in_row >= PD_FAILURES_BEFORE_RESET;
  if (reset) {
    memset(b->stat_left, 0, pc_packed_len(b->rows) * sizeof *b->stat_left);
    memset(b->stat_right, 0, pc_packed_len(b->cols) * sizeof *b->stat_right);
    b->failures_in_row = 0;
    b->resets++;
  }
  pthread_mutex_unlock(&b->lock);
  return reset;
}

int pd_sched_compute(pd_block *b, pd_stats *stats, double failure_threshold) {
  size_t nl = b->rows, nr = b->cols, nmax = nl > nr ? nl : nr;
  size_t ll = pc_packed_len(nl), lr = pc_packed_len(nr);
  float *sl = malloc(ll * sizeof *sl), *sr = malloc(lr * sizeof *sr);
  float *a = malloc(nmax * nmax * sizeof *a), *x = malloc(nmax * nmax * sizeof *x);
  pd_root *r = pd_root_new(nl, nr, stats);
  int result = -1;
  if (!sl || !sr || !a || !x || !r) goto cleanup;

  pthread_mutex_lock(&b->lock);
  memcpy(sl, b->stat_left, ll * sizeof *sl);
  memcpy(sr, b->stat_right, lr * sizeof *sr);
  uint64_t step = atomic_load(&b->stat_step);
  pthread_mutex_unlock(&b->lock);

  const pd_shampoo_opts *o = &b->job->opts;
  double t0 = pd_now();
  pc_root_info il, ir;
  memset(&il, 0, sizeof il);
  memset(&ir, 0, sizeof ir);
  int rcl = pd__factor_root(nl, sl, o, a, x, r->left, &il);
  int rcr = rcl >= 0 ? pd__factor_root(nr, sr, o, a, x, r->right, &ir) : rcl;
  double ms = 1e3 * (pd_now() - t0);

  double err = fmax(il.error, ir.error);
  /* The failure rule: no error code, a finite result, an error within the threshold. */
  int ok = rcl >= 0 && rcr >= 0 && isfinite(il.error) && isfinite(ir.error) &&
           err <= failure_threshold && pc_all_finite_f32(ll, r->left) &&
           pc_all_finite_f32(lr, r->right);
  pd_stats_add_compute_ms(stats, ms);

  if (ok) {
    r->source_step = step;
    r->error = err;
    r->method = o->method;
    r->iterations = (uint32_t)(il.iters > ir.iters ? il.iters : ir.iters);
    pthread_mutex_lock(&b->lock);
    b->roots_computed++;
    b->last_error = err;
    b->last_compute_ms = ms;
    b->failures_in_row = 0;
    pthread_mutex_unlock(&b->lock);
    pd_block_publish(b, r, stats);
    r = NULL;
    atomic_fetch_add(&stats->roots_computed, 1);
    result = 1;
  } else {
    int reset = pd__note_failure(b, rcl, rcr, rcl >= 0 && rcr >= 0 ? err : NAN, ms,
                                 failure_threshold);
    atomic_fetch_add(&stats->roots_failed, 1);
    pd_log(PD_LOG_WARN, "job %s block %u: root not published (%s); the previous root stays%s",
           b->job->name, b->id, b->last_failure,
           reset ? "; statistics reset after repeated failures" : "");
    result = 0;
  }

cleanup:
  if (result < 0) pd_log(PD_LOG_ERROR, "job %s block %u: out of memory computing roots",
                         b->job->name, b->id);
  pd_root_unref(r, stats);
  free(sl);
  free(sr);
  free(a);
  free(x);
  return result;
}

static void *pd__worker(void *arg) {
  pd_sched *s = arg;
  pd__flush_denormals();
  pthread_mutex_lock(&s->lock);
  for (;;) {
    while (!s->stopping && s->len == 0) pthread_cond_wait(&s->cond, &s->lock);
    if (s->stopping) break;
    size_t best = 0;
    for (size_t i = 1; i < s->len; i++)
      if (pd__before(s->queue[i], s->queue[best])) best = i;
    pd_block *b = s->queue[best];
    s->queue[best] = s->queue[--s->len];
    b->queued = 0;
    b->computing = 1;
    atomic_fetch_add(&s->busy, 1);
    pthread_mutex_unlock(&s->lock);

    pd_sched_compute(b, s->stats, s->failure_threshold);

    pthread_mutex_lock(&s->lock);
    atomic_fetch_sub(&s->busy, 1);
    b->computing = 0;
    if (b->redo && !s->stopping) {
      b->redo = 0;
      b->queued = 1;
      s->queue[s->len++] = b; /* room: the slot this block left is still counted in cap */
    }
  }
  pthread_mutex_unlock(&s->lock);
  return NULL;
}

int pd_sched_start(pd_sched *s, int nthreads, pd_stats *stats, double failure_threshold) {
  memset(s, 0, sizeof *s);
  if (nthreads < 1) nthreads = 1;
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->cond, NULL);
  s->stats = stats;
  s->failure_threshold = failure_threshold;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores < 1) cores = 1;
  /* Workers run independent roots; BLAS threads inside each would only compete with the
   * other workers for the same cores. */
  int blas = (int)(cores / nthreads);
  if (blas < 1) blas = 1;
  openblas_set_num_threads(blas);
  s->threads = calloc((size_t)nthreads, sizeof *s->threads);
  if (!s->threads) return PD_ENOMEM;
  for (int i = 0; i < nthreads; i++) {
    if (pthread_create(&s->threads[i], NULL, pd__worker, s) != 0) {
      pd_sched_stop(s);
      return PD_ENOMEM;
    }
    s->nthreads++;
  }
  pd_log(PD_LOG_INFO, "scheduler: %d root workers, %d BLAS thread(s) each, %ld cores",
         nthreads, blas, cores);
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

void pd_sched_stop(pd_sched *s) {
  pthread_mutex_lock(&s->lock);
  s->stopping = 1;
  for (size_t i = 0; i < s->len; i++) s->queue[i]->queued = 0;
  s->len = 0;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  for (int i = 0; i < s->nthreads; i++) pthread_join(s->threads[i], NULL);
  free(s->threads);
  free(s->queue);
  s->threads = NULL;
  s->queue = NULL;
  s->nthreads = 0;
  pthread_cond_destroy(&s->cond);
  pthread_mutex_destroy(&s->lock);
}
