/*
 * stats.c -- daemon-wide counters (atomics, so hot paths never lock for them) and a ring of
 * recent compute times for GetStats' percentiles.
 */
#include "precondd.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

double pd_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int pd_stats_init(pd_stats *s) {
  memset(s, 0, sizeof *s);
  if (pthread_mutex_init(&s->lock, NULL) != 0) return PD_ENOMEM;
  s->start_time = pd_now();
  return PD_OK;
}

void pd_stats_destroy(pd_stats *s) {
  pthread_mutex_destroy(&s->lock);
}

void pd_stats_add_compute_ms(pd_stats *s, double ms) {
  pthread_mutex_lock(&s->lock);
  s->ring[s->ring_next] = ms;
  s->ring_next = (s->ring_next + 1) % PD_STATS_WINDOW;
  if (s->ring_len < PD_STATS_WINDOW) s->ring_len++;
  pthread_mutex_unlock(&s->lock);
}

static int pd__cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Nearest-rank percentile of a sorted array. */
static double pd__rank(const double *v, size_t n, double q) {
  size_t k = (size_t)(q * (double)n + 0.999999);
  if (k < 1) k = 1;
  if (k > n) k = n;
  return v[k - 1];
}

void pd_stats_percentiles(pd_stats *s, double *p50, double *p90, double *p99) {
  double v[PD_STATS_WINDOW];
  pthread_mutex_lock(&s->lock);
  size_t n = s->ring_len;
  memcpy(v, s->ring, n * sizeof *v);
  pthread_mutex_unlock(&s->lock);
  *p50 = *p90 = *p99 = 0;
  if (n == 0) return;
  qsort(v, n, sizeof *v, pd__cmp_double);
  *p50 = pd__rank(v, n, 0.50);
  *p90 = pd__rank(v, n, 0.90);
  *p99 = pd__rank(v, n, 0.99);
}

/* ---- staleness -------------------------------------------------------------------------- */

void pd_stale_hist_add(pd_stale_hist *h, uint64_t staleness) {
  size_t k = staleness < PD_STALE_BINS - 1 ? (size_t)staleness : PD_STALE_BINS - 1;
  if (h->bins[k] == UINT32_MAX) /* keep the shape rather than wrap: halve every bin */
    for (size_t i = 0; i < PD_STALE_BINS; i++) h->bins[i] /= 2;
  h->bins[k]++;
  h->count++;
  h->sum += staleness;
  if (staleness > h->max) h->max = staleness;
}

/* The nearest-rank q-quantile; the last bin stands for values above PD_STALE_BINS - 2, of
 * which only the max is known exactly. */
static double pd__stale_rank(const pd_stale_hist *h, uint64_t total, double q) {
  uint64_t want = (uint64_t)(q * (double)total + 0.999999), seen = 0;
  if (want < 1) want = 1;
  for (size_t k = 0; k < PD_STALE_BINS - 1; k++) {
    seen += h->bins[k];
    if (seen >= want) return (double)k;
  }
  return (double)h->max;
}

void pd_stale_hist_summary(const pd_stale_hist *h, pd_stale_summary *out) {
  memset(out, 0, sizeof *out);
  uint64_t total = 0; /* the bins' own total: halving may have made it below count */
  for (size_t k = 0; k < PD_STALE_BINS; k++) total += h->bins[k];
  if (total == 0) return;
  out->p50 = pd__stale_rank(h, total, 0.50);
  out->p90 = pd__stale_rank(h, total, 0.90);
  out->p99 = pd__stale_rank(h, total, 0.99);
  out->max = h->max;
  out->count = h->count;
  out->mean = (double)h->sum / (double)h->count;
}

void pd_stats_add_staleness(pd_stats *s, uint64_t staleness) {
  pthread_mutex_lock(&s->lock);
  pd_stale_hist_add(&s->stale, staleness);
  pthread_mutex_unlock(&s->lock);
}

void pd_stats_staleness(pd_stats *s, pd_stale_summary *out) {
  pthread_mutex_lock(&s->lock);
  pd_stale_hist_summary(&s->stale, out);
  pthread_mutex_unlock(&s->lock);
}
