/*
 * dp.c -- data-parallel workers over MPI (trainer.h, "data parallelism"): one model trained
 * by W processes, each on its share of the global batch; the gradients are averaged with
 * MPI_Allreduce so every worker applies the same update.
 *
 * Gradients go through host buckets of at most PT__BUCKET floats: one MPI_Allreduce per
 * bucket instead of one per parameter (a Transformer has dozens of small ones: latency, not
 * bandwidth, dominates them), and the device copies are one per parameter either way. The
 * reduction runs after the backward pass (not overlapped: docs/replicas.md, benchmarks).
 * Batch norm across workers (sync BN) is accel's, with pt_dp_reduce's averaging as its
 * reduction, so accel itself needs no MPI.
 * MPI's default error handler (MPI_ERRORS_ARE_FATAL) is kept: a worker cannot go on alone
 * with a model the others no longer match.
 */
#include "trainer_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef PT_HAVE_MPI
#include <mpi.h>
#endif

#define PT__BUCKET ((size_t)1 << 20) /* floats: 4 MiB */

struct pt_dp {
  int rank, size;
  float *bucket;
  double seconds;
  ac_backend *be; /* pt_dp_reduce's */
  double reduce_seconds;
  long reduce_calls;
};

/* 1 when an MPI launcher started this process, with its world size in *size. */
static int pt__launched(int *size) {
  const char *v = getenv("OMPI_COMM_WORLD_SIZE");
  if (v == NULL || *v == '\0') v = getenv("PMI_SIZE");
  *size = v != NULL && *v != '\0' ? atoi(v) : 1;
  return v != NULL && *v != '\0';
}

static double pt__wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int pt_dp_init(pt_dp **out, pt_error *err) {
  *out = NULL;
  int size = 1;
  if (!pt__launched(&size)) return PT_OK;
#ifdef PT_HAVE_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited && MPI_Init(NULL, NULL) != MPI_SUCCESS)
    return pt__fail(err, PT_EINVAL, "data parallelism: MPI_Init failed");
  pt_dp *dp = calloc(1, sizeof *dp);
  if (dp == NULL || (dp->bucket = malloc(PT__BUCKET * sizeof(float))) == NULL) {
    free(dp);
    return PT_ENOMEM;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &dp->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &dp->size);
  *out = dp;
  return PT_OK;
#else
  if (size > 1)
    return pt__fail(err, PT_EINVAL,
                    "started by an MPI launcher with %d workers, but built "
                    "without MPI (meson -Dmpi=enabled with libopenmpi-dev): each would train "
                    "alone",
                    size);
  return PT_OK;
#endif
}

int pt_dp_rank(const pt_dp *dp) {
  return dp != NULL ? dp->rank : 0;
}
int pt_dp_size(const pt_dp *dp) {
  return dp != NULL ? dp->size : 1;
}
double pt_dp_seconds(const pt_dp *dp) {
  return dp != NULL ? dp->seconds : 0;
}

#ifdef PT_HAVE_MPI
/* Sums bucket[0..n) over the workers, divides by their count, and copies the pieces back
 * into the gradients they came from (params[first..last], offsets in off). */
static int pt__flush(pt_dp *dp, ac_backend *be, ac_param *const *params, size_t first, size_t last,
                     size_t n, pt_error *err) {
  if (n == 0) return PT_OK;
  if (MPI_Allreduce(MPI_IN_PLACE, dp->bucket, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) !=
      MPI_SUCCESS)
    return pt__fail(err, PT_EINVAL, "data parallelism: MPI_Allreduce failed");
  const float scale = 1.0f / (float)dp->size;
  for (size_t i = 0; i < n; i++) dp->bucket[i] *= scale;
  size_t at = 0;
  for (size_t p = first; p <= last; p++) {
    size_t k = params[p]->grad.numel;
    int rc = pt__accel(
        err, ac_memcpy_h2d(be, ac_tensor_f32(&params[p]->grad), dp->bucket + at, k * sizeof(float)),
        "data parallelism: gradient upload");
    if (rc != PT_OK) return rc;
    at += k;
  }
  return PT_OK;
}
#endif

int pt_dp_average(pt_dp *dp, ac_backend *be, ac_param *const *params, size_t nparams, double *loss,
                  pt_error *err) {
  if (dp == NULL) return PT_OK;
#ifdef PT_HAVE_MPI
  double t0 = pt__wall();
  int rc = PT_OK;
  size_t first = 0, n = 0;
  for (size_t p = 0; p < nparams && rc == PT_OK; p++) {
    size_t k = params[p]->grad.numel;
    if (n > 0 && n + k > PT__BUCKET) { /* full: reduce what it holds first */
      rc = pt__flush(dp, be, params, first, p - 1, n, err);
      first = p;
      n = 0;
    }
    if (rc == PT_OK && k > PT__BUCKET) { /* a parameter larger than a bucket: by itself */
      float *g = malloc(k * sizeof *g);
      rc =
          g == NULL
              ? PT_ENOMEM
              : pt__accel(err, ac_memcpy_d2h(be, g, ac_tensor_f32(&params[p]->grad), k * sizeof *g),
                          "gradient download");
      if (rc == PT_OK &&
          MPI_Allreduce(MPI_IN_PLACE, g, (int)k, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS)
        rc = pt__fail(err, PT_EINVAL, "data parallelism: MPI_Allreduce failed");
      for (size_t i = 0; rc == PT_OK && i < k; i++) g[i] /= (float)dp->size;
      if (rc == PT_OK)
        rc = pt__accel(err, ac_memcpy_h2d(be, ac_tensor_f32(&params[p]->grad), g, k * sizeof *g),
                       "gradient upload");
      free(g);
      first = p + 1;
      continue;
    }
    if (rc == PT_OK)
      rc = pt__accel(
          err,
          ac_memcpy_d2h(be, dp->bucket + n, ac_tensor_f32(&params[p]->grad), k * sizeof(float)),
          "gradient download");
    n += k;
  }
  if (rc == PT_OK && n > 0) rc = pt__flush(dp, be, params, first, nparams - 1, n, err);
  if (rc == PT_OK && loss != NULL) {
    double sum = 0;
    MPI_Allreduce(loss, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    *loss = sum / dp->size;
  }
  dp->seconds += pt__wall() - t0;
  return rc;
#else
  (void)be;
  (void)params;
  (void)nparams;
  (void)loss;
  return pt__fail(err, PT_EINVAL, "data parallelism: built without MPI");
#endif
}

#ifdef PT_HAVE_MPI
/* ac_bn_sync's fn: v (n device floats) becomes its mean over the workers. Through the
 * bucket when it fits (a batch norm's 2c floats always do here), else a buffer of its own.
 * An AC_E* code: AC_EDEVICE when MPI fails (accel has no code of its own for it). */
static int pt__dp_mean(void *ctx, float *v, size_t n) {
  pt_dp *dp = ctx;
  double t0 = pt__wall();
  float *h = n <= PT__BUCKET ? dp->bucket : malloc(n * sizeof *h);
  if (h == NULL) return AC_ENOMEM;
  int rc = ac_memcpy_d2h(dp->be, h, v, n * sizeof *h);
  if (rc == AC_OK &&
      MPI_Allreduce(MPI_IN_PLACE, h, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS)
    rc = AC_EDEVICE;
  const float scale = 1.0f / (float)dp->size;
  for (size_t i = 0; rc == AC_OK && i < n; i++) h[i] *= scale;
  if (rc == AC_OK) rc = ac_memcpy_h2d(dp->be, v, h, n * sizeof *h);
  if (h != dp->bucket) free(h);
  dp->reduce_seconds += pt__wall() - t0;
  dp->reduce_calls++;
  return rc;
}
#endif

void pt_dp_bn_sync(pt_dp *dp, ac_backend *be, ac_bn_sync *out) {
  *out = (ac_bn_sync){NULL, NULL, 1};
  if (dp == NULL) return;
#ifdef PT_HAVE_MPI
  dp->be = be;
  *out = (ac_bn_sync){pt__dp_mean, dp, dp->size};
#else
  (void)be;
#endif
}

double pt_dp_reduce_seconds(const pt_dp *dp, long *calls) {
  if (calls != NULL) *calls = dp != NULL ? dp->reduce_calls : 0;
  return dp != NULL ? dp->reduce_seconds : 0;
}

int pt__unit_worker(const pt_trainer *t, size_t b) {
  int nw = t->opts.shard_size > 1 ? t->opts.shard_size : 1;
  if (nw == 1 || b >= t->layout.nblocks) return 0;
  int32_t replicas = 0;
  for (size_t i = 0; i < t->layout.nblocks; i++)
    if (t->layout.blocks[i].owner + 1 > replicas) replicas = t->layout.blocks[i].owner + 1;
  return replicas == nw ? (int)t->layout.blocks[b].owner : (int)(b % (size_t)nw);
}

int pt__refresh_agreed(pt_trainer *t, size_t n, const pt__agreed_units *u, pt_error *err) {
  const precond_roots **held = calloc(n ? n : 1, sizeof *held);
  uint64_t *v = calloc(n ? n : 1, sizeof *v);
  int rc = held != NULL && v != NULL ? PT_OK : PT_ENOMEM;
  for (size_t i = 0; rc == PT_OK && i < n; i++) {
    uint32_t id;
    uint64_t version, daemon_version;
    if (u->unit(t, i, &id, &version, &daemon_version))
      rc = pt__daemon(t, err, precond_fetch(t->client, id, version, &held[i]), "precond_fetch");
    v[i] = held[i] != NULL ? held[i]->daemon_version : daemon_version;
  }
  if (rc == PT_OK && pt_dp_agree(t->opts.dp, v, n) != PT_OK)
    rc =
        pt__fail(err, PT_EINVAL,
                 "data parallelism: the workers' %s versions could not be compared (MPI)", u->what);
  for (size_t i = 0; i < n && held != NULL; i++) {
    if (rc == PT_OK && held[i] != NULL && held[i]->daemon_version == v[i])
      rc = u->apply(t, i, held[i], err); /* releases it */
    else
      precond_roots_release(held[i]);
  }
  free(held);
  free(v);
  return rc;
}

int pt_dp_mean_to(pt_dp *dp, float *h, size_t n, int root) {
  if (dp == NULL || n == 0) return PT_OK;
#ifdef PT_HAVE_MPI
  double t0 = pt__wall();
  int rc = MPI_Reduce(dp->rank == root ? MPI_IN_PLACE : h, h, (int)n, MPI_FLOAT, MPI_SUM, root,
                      MPI_COMM_WORLD) == MPI_SUCCESS
               ? PT_OK
               : PT_EINVAL;
  const float scale = 1.0f / (float)dp->size;
  for (size_t i = 0; rc == PT_OK && dp->rank == root && i < n; i++) h[i] *= scale;
  dp->reduce_seconds += pt__wall() - t0;
  dp->reduce_calls++;
  return rc;
#else
  (void)h;
  (void)root;
  return PT_EINVAL;
#endif
}

int pt_dp_agree(pt_dp *dp, uint64_t *v, size_t n) {
  if (dp == NULL || n == 0) return PT_OK;
#ifdef PT_HAVE_MPI
  uint64_t *lo = malloc(2 * n * sizeof *lo);
  if (lo == NULL) return PT_ENOMEM;
  uint64_t *hi = lo + n;
  int ok = MPI_Allreduce(v, lo, (int)n, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD) == MPI_SUCCESS &&
           MPI_Allreduce(v, hi, (int)n, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD) == MPI_SUCCESS;
  for (size_t i = 0; ok && i < n; i++) v[i] = lo[i] == hi[i] ? lo[i] : 0;
  free(lo);
  return ok ? PT_OK : PT_EINVAL;
#else
  (void)v;
  return PT_EINVAL;
#endif
}

int pt_dp_any(pt_dp *dp, int *flag) {
  if (dp == NULL) return PT_OK;
#ifdef PT_HAVE_MPI
  int mine = *flag != 0;
  return MPI_Allreduce(&mine, flag, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD) == MPI_SUCCESS ? PT_OK
                                                                                        : PT_EINVAL;
#else
  (void)flag;
  return PT_EINVAL;
#endif
}

int pt_dp_broadcast(pt_dp *dp, long *v) {
  if (dp == NULL) return PT_OK;
#ifdef PT_HAVE_MPI
  return MPI_Bcast(v, 1, MPI_LONG, 0, MPI_COMM_WORLD) == MPI_SUCCESS ? PT_OK : PT_EINVAL;
#else
  (void)v;
  return PT_EINVAL;
#endif
}

void pt_dp_finalize(pt_dp *dp) {
  if (dp == NULL) return;
#ifdef PT_HAVE_MPI
  MPI_Finalize();
#endif
  free(dp->bucket);
  free(dp);
}
