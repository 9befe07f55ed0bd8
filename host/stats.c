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

void pd_stats_destroy(pd_stats *s) { pthread_mutex_destroy(&s->lock); }

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
