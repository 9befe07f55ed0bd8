/*
 * bench-roots -- cost and accuracy of precond's inverse p-th roots.
 *
 * For each size and spectrum it times every method (median of repeats), measures its error
 * against the fp64 root of the fp64 matrix (rel_err) and against the fp64 root of exactly the
 * fp32 input (rel_err_in: the method's own error), and expresses the time in units of one
 * n x n x n sgemm (dgemm for fp64 rows) timed right before the case: gemm_equiv. One row per
 * case; cpu_ms is the process CPU time (all threads), steadier than wall time on a shared
 * machine when --threads 1.
 *
 * Spectra: "well" = G G^T with G n x 1.5n Gaussian (Marchenko-Pastur, condition ~1e2);
 * "shampoo" = G G^T with G n x n/4 (rank n/4) plus the relative ridge 1e-6 (condition ~1e6).
 * Methods: the public ones (newton, newton-textbook, eigh) and, to measure what each change
 * buys, internal Newton variants reached through pc_internal.h (which is why this tool lives
 * next to the numerics and is built with them):
 *   newton-sym          textbook start and steps, one-triangle products (syrk, panels)
 *   newton-scaled-gemm  scaled steps, full gemm products, fp32 throughout
 *   newton-fp32         scaled steps, one-triangle products, fp32 throughout
 *   newton-mixed-4/-3   newton with the fp64 phase ending at 1e-4 / 1e-3 instead of 1e-5
 * fp64 rows exist for newton, newton-textbook and eigh (tolerance 1e-12 for Newton).
 *
 *   bench-roots [--csv] [--sizes 128,256,...] [--repeats N] [--methods a,b] [--precisions
 *               f32,f64] [--spectra well,shampoo] [--threads T] [--p P]
 *
 * --kfac measures K-FAC's damped inverses instead (pc_kfac_inverse_*: cholesky, eigh,
 * newton with p = 1) on K-FAC-like factors, one row per size, factor and method; see
 * kfac_main below. --sizes, --repeats, --threads, --precisions and --csv apply.
 *
 * --ema 1,10,100 measures the steady state instead (pc_inverse_root_warm_f32, fp32): the
 * statistic k EMA steps after the one whose root and eigenbasis are held, each warm variant
 * next to the seeded path, the stale root and cold newton and eigh on the same statistic;
 * see ema_case below. --sizes, --spectra, --repeats, --threads, --p, --methods, --csv apply.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>
#include <lapacke.h>

#include "pc_internal.h"
#include "preconditioner.h"

typedef struct {
  const char *name;
  int f64;           /* 0: fp32, 1: fp64 */
  int public_method; /* 1: pc_inverse_root with method; 0: variant */
  pc_method method;
  pc__newton_variant variant;
} bench_method;

static const bench_method all_methods[] = {
    {"newton", 0, 1, PC_METHOD_NEWTON, {0}},
    {"newton-scaled-gemm",
     0,
     0,
     PC_METHOD_NEWTON,
     {.scaled = 1, .symmetric = 0, .floor = 1e-2, .lo_f32 = 0}},
    {"newton-sym", 0, 0, PC_METHOD_NEWTON, {.scaled = 0, .symmetric = 1, .floor = 0}},
    {"newton-fp32",
     0,
     0,
     PC_METHOD_NEWTON,
     {.scaled = 1, .symmetric = 1, .floor = 1e-2, .lo_f32 = 0}},
    {"newton-mixed-3",
     0,
     0,
     PC_METHOD_NEWTON,
     {.scaled = 1, .symmetric = 1, .floor = 1e-2, .lo_f32 = 1e-3}},
    {"newton-mixed-4",
     0,
     0,
     PC_METHOD_NEWTON,
     {.scaled = 1, .symmetric = 1, .floor = 1e-2, .lo_f32 = 1e-4}},
    {"newton-textbook", 0, 1, PC_METHOD_NEWTON_TEXTBOOK, {0}},
    {"eigh", 0, 1, PC_METHOD_EIGH, {0}},
    {"newton", 1, 1, PC_METHOD_NEWTON, {0}},
    {"newton-textbook", 1, 1, PC_METHOD_NEWTON_TEXTBOOK, {0}},
    {"eigh", 1, 1, PC_METHOD_EIGH, {0}},
};
#define NMETHODS (sizeof all_methods / sizeof *all_methods)

typedef struct {
  size_t sizes[16];
  int nsizes;
  int repeats; /* 0: default (3, or 1 at n >= 2048) */
  int threads;
  int csv;
  int p;
  int kfac;        /* 1: the K-FAC inverse section instead of the roots */
  int sizes_given; /* --sizes was passed */
  char methods[256];
  char precisions[64];
  char spectra[64];
  int methods_set; /* --methods given */
  int ema[8];      /* --ema: EMA step counts of the steady-state case (0 ends the list) */
  double beta2;    /* --beta2 of those steps */
  int ema_fresh;   /* --ema-model fresh (1) or stationary (0) */
} bench_opts;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* CPU time of the whole process (all threads): less sensitive than wall time to other
 * programs sharing the cores, more to OpenBLAS threads spinning while they wait. */
static double cpu_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int k) {
  qsort(v, (size_t)k, sizeof *v, cmp_double);
  return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

/* Is name in the comma-separated list? */
static int listed(const char *list, const char *name) {
  size_t len = strlen(name);
  for (const char *s = list; *s;) {
    const char *e = strchr(s, ',');
    size_t l = e ? (size_t)(e - s) : strlen(s);
    if (l == len && strncmp(s, name, l) == 0) return 1;
    if (!e) break;
    s = e + 1;
  }
  return 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: bench-roots [options]\n"
          "  --csv                 CSV rows on stdout (default: a readable table)\n"
          "  --sizes LIST          matrix sizes (default 128,256,512,1024,2048)\n"
          "  --repeats N           timed repeats per case, median reported (default 3; 1 at\n"
          "                        n >= 2048)\n"
          "  --methods LIST        any of newton,newton-fp32,newton-scaled-gemm,newton-sym,\n"
          "                        newton-mixed-4,newton-mixed-3,newton-textbook,eigh\n"
          "                        (default: all but the newton-mixed-* ones)\n"
          "  --precisions LIST     f32,f64 (default both; fp64 rows: newton, textbook, eigh)\n"
          "  --spectra LIST        well,shampoo (default both)\n"
          "  --threads T           OpenBLAS threads (default: all cores)\n"
          "  --p P                 root order (default 4)\n"
          "  --ema LIST            the steady-state case instead: the statistic after k EMA\n"
          "                        steps (each k of LIST, e.g. 1,10,100) from the one whose\n"
          "                        root and eigenbasis are held; methods warm, warm-rotate\n"
          "                        (the eigh route off), warm-reuse, warm-noskip,\n"
          "                        warm-narrow, warm-2sweeps, seed, stale, newton, eigh\n"
          "                        (default: all); fp32\n"
          "  --beta2 B             EMA factor of --ema (default 0.999)\n"
          "  --ema-model M         stationary (default: gradients from a fixed distribution\n"
          "                        with the held statistic's spectrum) or fresh (isotropic\n"
          "                        gradients filling its null space)\n"
          "  --kfac                K-FAC damped inverses (cholesky, eigh, newton p = 1) on\n"
          "                        K-FAC-like factors A and G instead (default sizes\n"
          "                        64,128,256,512,1024)\n"
          "  --help                this text\n"
          "Progress goes to stderr.\n");
}

static int parse(int argc, char **argv, bench_opts *o) {
  const size_t def[] = {128, 256, 512, 1024, 2048};
  memset(o, 0, sizeof *o);
  for (int i = 0; i < 5; i++) o->sizes[i] = def[i];
  o->nsizes = 5;
  o->threads = openblas_get_num_procs();
  o->p = 4;
  o->beta2 = 0.999;
  strcpy(o->methods, "newton,newton-fp32,newton-scaled-gemm,newton-sym,newton-textbook,eigh");
  strcpy(o->precisions, "f32,f64");
  strcpy(o->spectra, "well,shampoo");
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      exit(0);
    } else if (!strcmp(a, "--csv")) {
      o->csv = 1;
    } else if (!strcmp(a, "--kfac")) {
      o->kfac = 1;
    } else if (v && !strcmp(a, "--sizes")) {
      o->nsizes = 0;
      o->sizes_given = 1;
      for (char *s = argv[++i]; *s && o->nsizes < 16;) {
        char *end;
        long n = strtol(s, &end, 10);
        if (end == s || n < 1 || n > 16384) return -1;
        o->sizes[o->nsizes++] = (size_t)n;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
      }
    } else if (v && !strcmp(a, "--repeats")) {
      o->repeats = atoi(argv[++i]);
      if (o->repeats < 1 || o->repeats > 1000) return -1;
    } else if (v && !strcmp(a, "--threads")) {
      o->threads = atoi(argv[++i]);
      if (o->threads < 1 || o->threads > 1024) return -1;
    } else if (v && !strcmp(a, "--p")) {
      o->p = atoi(argv[++i]);
      if (o->p < 1 || o->p > 64) return -1;
    } else if (v && !strcmp(a, "--methods") && strlen(v) < sizeof o->methods) {
      strcpy(o->methods, argv[++i]);
      o->methods_set = 1;
    } else if (v && !strcmp(a, "--ema")) {
      int k = 0;
      for (char *s = argv[++i]; *s && k < 7;) {
        char *end;
        long e = strtol(s, &end, 10);
        if (end == s || e < 1 || e > 100000 || (*end && *end != ',')) return -1;
        o->ema[k++] = (int)e;
        s = *end == ',' ? end + 1 : end;
      }
      o->ema[k] = 0;
    } else if (v && !strcmp(a, "--ema-model")) {
      o->ema_fresh = !strcmp(argv[++i], "fresh");
      if (!o->ema_fresh && strcmp(argv[i], "stationary")) return -1;
    } else if (v && !strcmp(a, "--beta2")) {
      o->beta2 = atof(argv[++i]);
      if (!(o->beta2 > 0.0 && o->beta2 < 1.0)) return -1;
    } else if (v && !strcmp(a, "--precisions") && strlen(v) < sizeof o->precisions) {
      strcpy(o->precisions, argv[++i]);
    } else if (v && !strcmp(a, "--spectra") && strlen(v) < sizeof o->spectra) {
      strcpy(o->spectra, argv[++i]);
    } else {
      return -1;
    }
  }
  return 0;
}

static uint64_t rng_next(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s;
}

static double rng_normal(uint64_t *s) {
  double u1 = ((double)(rng_next(s) >> 11) + 1.0) * 0x1.0p-53;
  double u2 = (double)(rng_next(s) >> 11) * 0x1.0p-53;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* g: n x k Gaussian from seed (the same seed gives the same G). */
static double *gaussian(size_t n, size_t k, uint64_t seed) {
  double *g = malloc(n * k * sizeof *g);
  if (!g) abort();
  for (size_t i = 0; i < n * k; i++) g[i] = rng_normal(&seed);
  return g;
}

/* a = G G^T / k with G n x k Gaussian, in fp64. */
static void gram(size_t n, size_t k, uint64_t seed, double *a) {
  double *g = gaussian(n, k, seed);
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)n, (int)k, 1.0 / (double)k, g, (int)k,
              0.0, a, (int)n);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++) a[j * n + i] = a[i * n + j];
  free(g);
}

/* Eigendecomposition of an fp64 matrix, kept to build roots for any ridge. */
typedef struct {
  size_t n;
  double *vt; /* row j: eigenvector j */
  double *w;
} eig64;

static void eig_init(eig64 *e, size_t n, const double *a) {
  e->n = n;
  e->vt = malloc(n * n * sizeof *e->vt);
  e->w = malloc(n * sizeof *e->w);
  if (!e->vt || !e->w) abort();
  memcpy(e->vt, a, n * n * sizeof *e->vt);
  if (LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'L', (lapack_int)n, e->vt, (lapack_int)n, e->w))
    abort();
}

static void eig_destroy(eig64 *e) {
  free(e->vt);
  free(e->w);
}

/* The references of a case: e of the fp64 matrix a, e_in of its fp32 rounding a_in. Returns
 * a's condition number with the default relative ridge 1e-6. */
static double refs_init(size_t n, const double *a, const double *a_in, eig64 *e, eig64 *e_in) {
  eig_init(e, n, a);
  eig_init(e_in, n, a_in);
  double lmax = e->w[n - 1], ridge0 = 1e-6 * lmax;
  return (lmax + ridge0) / ((e->w[0] > 0 ? e->w[0] : 0.0) + ridge0);
}

/* x = V diag((max(w,0) + ridge)^(-1/p)) V^T, the fp64 reference root. scratch: n x n. */
static void eig_root(const eig64 *e, double ridge, int p, double *scratch, double *x) {
  size_t n = e->n;
  for (size_t j = 0; j < n; j++) {
    double d = pow((e->w[j] > 0 ? e->w[j] : 0.0) + ridge, -0.5 / p);
    for (size_t i = 0; i < n; i++) scratch[j * n + i] = d * e->vt[j * n + i];
  }
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)n, 1.0, scratch, (int)n, 0.0, x,
              (int)n);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++) x[j * n + i] = x[i * n + j];
}

static double rel_err(size_t n, const float *x32, const double *x64, const double *ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n * n; i++) {
    double v = x32 ? (double)x32[i] : x64[i];
    num += (v - ref[i]) * (v - ref[i]);
    den += ref[i] * ref[i];
  }
  return sqrt(num / den);
}

/* Median wall and CPU time of one n x n x n gemm in the given precision. */
static void time_gemm(size_t n, int f64, int repeats, double *wall, double *cpu) {
  double t[64], c[64];
  int ni = (int)n;
  void *a = calloc(n * n, f64 ? 8 : 4), *b = calloc(n * n, f64 ? 8 : 4),
       *cc = calloc(n * n, f64 ? 8 : 4);
  if (!a || !b || !cc) abort();
  if (f64) {
    for (size_t i = 0; i < n * n; i++) ((double *)a)[i] = ((double *)b)[i] = 1.0 / (1 + i % 7);
  } else {
    for (size_t i = 0; i < n * n; i++) ((float *)a)[i] = ((float *)b)[i] = 1.0f / (1 + i % 7);
  }
  int k = repeats + 2 > 64 ? 64 : repeats + 2;
  for (int r = 0; r <= k; r++) { /* the first call warms up */
    double t0 = now_s(), c0 = cpu_s();
    if (f64)
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1, a, ni, b, ni, 0, cc,
                  ni);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1, a, ni, b, ni, 0, cc,
                  ni);
    if (r > 0) {
      t[r - 1] = now_s() - t0;
      c[r - 1] = cpu_s() - c0;
    }
  }
  free(a);
  free(b);
  free(cc);
  *wall = median(t, k);
  *cpu = median(c, k);
}

/* ------------------------------------------------------------------------------------ */
/* --kfac: K-FAC's damped inverses                                                          */
/*                                                                                          */
/* Factors like a convolution's: A = (1/m) X^T X over m = 2n im2col-like patch rows, X =     */
/* ReLU(Z M) with Z Gaussian and M a random mixing with decaying column scales (correlated    */
/* inputs, a mean offset from the ReLU: one large eigenvalue and a decaying tail); G = (1/k)  */
/* B B^T with B n x k Gaussian, k = n/8, scaled by 1e-4 (per-example output gradients: low    */
/* rank, small). Each is damped as K-FAC does, pi-damping between the two factors of one    */
/* size, with the default lambda 1e-3 (well conditioned after damping) and with 1e-6 (an   */
/* ill-conditioned case: a small lambda or large factors), to see if the choice moves. The error is |X - X_ref|_F / |X_ref|_F against the fp64 inverse of   */
/* exactly the input (fp32 inputs widened), by syevd.                                        */

static void kfac_factor_a(size_t n, uint64_t seed, double *a) {
  size_t m = 2 * n;
  double *z = malloc(m * n * sizeof *z), *mix = malloc(n * n * sizeof *mix);
  double *x = malloc(m * n * sizeof *x);
  if (!z || !mix || !x) abort();
  for (size_t i = 0; i < m * n; i++) z[i] = rng_normal(&seed);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) mix[i * n + j] = rng_normal(&seed) / (1.0 + 0.1 * (double)j);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)n,
              1.0 / sqrt((double)n), z, (int)n, mix, (int)n, 0.0, x, (int)n);
  for (size_t i = 0; i < m * n; i++) x[i] = x[i] > 0 ? x[i] : 0.0;
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)m, 1.0 / (double)m, x, (int)n,
              0.0, a, (int)n);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++) a[j * n + i] = a[i * n + j];
  free(z);
  free(mix);
  free(x);
}

static void kfac_factor_g(size_t n, uint64_t seed, double *g) {
  size_t k = n / 8 > 0 ? n / 8 : 1;
  gram(n, k, seed, g);
  for (size_t i = 0; i < n * n; i++) g[i] *= 1e-4;
}

static const pc_kfac_inv kfac_methods[] = {PC_KFAC_INV_CHOLESKY, PC_KFAC_INV_EIGH,
                                           PC_KFAC_INV_NEWTON};

/* One factor (dense fp64 f, damping d) through every method in each listed precision.
 * Returns the number of cases that failed (an error status, or rel_err above 1e-3: far
 * beyond any fp32 result at these conditions), so that the quick test can fail. */
static int kfac_case(const bench_opts *o, size_t n, const char *name, const double *f,
                     double lambda, double d, int repeats) {
  size_t nn = n * n, np = pc_packed_len(n);
  double *f32in = malloc(nn * sizeof *f32in), *ref = malloc(nn * sizeof *ref);
  double *ref64 = malloc(nn * sizeof *ref64), *scratch = malloc(nn * sizeof *scratch);
  double *p64 = malloc(np * sizeof *p64), *x64 = malloc(nn * sizeof *x64);
  float *p32 = malloc(np * sizeof *p32), *x32 = malloc(nn * sizeof *x32);
  if (!f32in || !ref || !ref64 || !scratch || !p64 || !x64 || !p32 || !x32) abort();
  for (size_t i = 0; i < nn; i++) f32in[i] = (float)f[i];
  pc_pack_f64(n, f, p64);
  for (size_t i = 0; i < np; i++) p32[i] = (float)p64[i];
  eig64 e, e32;
  eig_init(&e, n, f);
  eig_init(&e32, n, f32in);
  eig_root(&e, d, 1, scratch, ref64);
  eig_root(&e32, d, 1, scratch, ref);
  double lmax = e.w[n - 1], cond = (lmax + d) / ((e.w[0] > 0 ? e.w[0] : 0.0) + d);
  int failed = 0;
  for (int prec = 0; prec < 2; prec++) {
    if (!listed(o->precisions, prec ? "f64" : "f32")) continue;
    for (size_t mi = 0; mi < sizeof kfac_methods / sizeof *kfac_methods; mi++) {
      pc_kfac_inv m = kfac_methods[mi];
      double gms, gcpu;
      time_gemm(n, prec, repeats, &gms, &gcpu);
      gms *= 1e3;
      gcpu *= 1e3;
      double t[64], c[64];
      pc_kfac_inv_info info;
      int st = PC_OK;
      int k = repeats < 64 ? repeats : 64;
      for (int r = 0; r < k; r++) {
        double t0 = now_s(), c0 = cpu_s();
        st = prec ? pc_kfac_inverse_f64(n, p64, d, m, x64, &info)
                  : pc_kfac_inverse_f32(n, p32, d, m, x32, &info);
        t[r] = now_s() - t0;
        c[r] = cpu_s() - c0;
      }
      double ms = 1e3 * median(t, k), cpu_ms = 1e3 * median(c, k);
      double rel = st >= 0 ? rel_err(n, prec ? NULL : x32, x64, prec ? ref64 : ref) : NAN;
      const char *pn = prec ? "fp64" : "fp32";
      if (o->csv)
        printf("%zu,%s,%.3g,%.3g,%.3g,%s,%s,%d,%.3f,%.3f,%d,%d,%.3g,%.3g,%.3f,%.2f,%.3f,%.2f\n", n,
               name, lambda, d, cond, pc_kfac_inv_name(m), pn, o->threads, ms, cpu_ms, info.iters,
               st, info.error, rel, gms, ms / gms, gcpu, cpu_ms / gcpu);
      else
        printf("%5zu %-2s %7.1g %9.3g %9.3g %-9s %-4s %9.2f %9.2f %5d %8.2g %9.3g %7.2f %7.2f\n", n,
               name, lambda, d, cond, pc_kfac_inv_name(m), pn, ms, cpu_ms, info.iters, info.error,
               rel, ms / gms, cpu_ms / gcpu);
      fflush(stdout);
      fprintf(stderr, "bench-roots --kfac: n=%zu %s %s %s: %.1f ms, status %d\n", n, name,
              pc_kfac_inv_name(m), pn, ms, st);
      failed += st < 0 || !(rel <= 1e-3);
    }
  }
  eig_destroy(&e);
  eig_destroy(&e32);
  free(f32in);
  free(ref);
  free(ref64);
  free(scratch);
  free(p64);
  free(x64);
  free(p32);
  free(x32);
  return failed;
}

static int kfac_main(const bench_opts *o) {
  static const size_t def[] = {64, 128, 256, 512, 1024};
  const size_t *sizes = o->sizes_given ? o->sizes : def;
  int nsizes = o->sizes_given ? o->nsizes : 5, failed = 0;
  if (o->csv)
    printf(
        "n,factor,lambda,damping,cond,method,precision,threads,ms,cpu_ms,iterations,status,error,"
        "rel_err,gemm_ms,gemm_equiv,gemm_cpu_ms,gemm_equiv_cpu\n");
  else
    printf("%5s %-2s %7s %9s %9s %-9s %-4s %9s %9s %5s %8s %9s %7s %7s\n", "n", "f", "lambda",
           "damping", "cond", "method", "prec", "ms", "cpu_ms", "iters", "error", "rel_err",
           "gemm_eq", "eq_cpu");
  for (int si = 0; si < nsizes; si++) {
    size_t n = sizes[si];
    int repeats = o->repeats ? o->repeats : 3;
    double *a = malloc(n * n * sizeof *a), *g = malloc(n * n * sizeof *g);
    if (!a || !g) abort();
    kfac_factor_a(n, 2000 + n, a);
    kfac_factor_g(n, 3000 + n, g);
    double tr_a = 0, tr_g = 0;
    for (size_t i = 0; i < n; i++) tr_a += a[i * n + i], tr_g += g[i * n + i];
    pc_kfac_opts ko;
    pc_kfac_opts_default(&ko);
    const double lambdas[2] = {ko.damping, 1e-6};
    for (int li = 0; li < 2; li++) {
      pc_kfac_damping dmp;
      if (pc_kfac_damping_split(n, tr_a, n, tr_g, lambdas[li], 1, &dmp) != PC_OK) abort();
      failed += kfac_case(o, n, "A", a, lambdas[li], dmp.damp_a, repeats);
      failed += kfac_case(o, n, "G", g, lambdas[li], dmp.damp_g, repeats);
    }
    free(a);
    free(g);
  }
  if (failed) fprintf(stderr, "bench-roots --kfac: %d case(s) failed\n", failed);
  return failed ? 1 : 0;
}

static void print_header(const bench_opts *o) {
  if (o->ema[0] && o->csv) {
    printf(
        "n,spectrum,cond,p,ema_k,method,path,threads,ms,cpu_ms,status,offdiag,change,residual,"
        "rel_err,rel_err_in,gemm_ms,gemm_equiv,gemm_cpu_ms,gemm_equiv_cpu\n");
  } else if (o->ema[0]) {
    printf("%5s %-8s %8s %5s %-13s %-8s %9s %9s %9s %9s %9s %9s %7s %7s\n", "n", "spectrum", "cond",
           "ema_k", "method", "path", "ms", "cpu_ms", "offdiag", "change", "resid", "rel_err",
           "gemm_eq", "eq_cpu");
  } else if (o->csv) {
    printf(
        "n,spectrum,cond,p,method,precision,threads,ms,ms_min,cpu_ms,iterations,status,"
        "error,rel_err,rel_err_in,gemm_ms,gemm_equiv,gemm_cpu_ms,gemm_equiv_cpu\n");
  } else {
    printf("%5s %-8s %8s %-19s %-4s %10s %5s %8s %9s %9s %9s %7s\n", "n", "spectrum", "cond",
           "method", "prec", "ms", "iters", "error", "rel_err", "rel_in", "gemm_ms", "gemm_eq");
  }
}

/* ------------------------------------------------------------------------------------ */
/* The steady-state case (--ema)                                                          */

/* Rows of the steady-state case. kind: 0 warm from the held basis, 1 seeded (no basis held:
 * syevd and one refinement), 2 the stale root (the held one, as it is), 3 a cold root. */
typedef struct {
  const char *name;
  int kind;
  pc_method method; /* kind 3 */
  double skip_tol;  /* < 0: default */
  int reuse_root, wide, sweeps;
  double eigh_below; /* < 0: default */
} ema_method;

static const ema_method ema_methods[] = {
    {"warm", 0, PC_METHOD_NEWTON, -1, 0, 1, 1, -1},
    {"warm-rotate", 0, PC_METHOD_NEWTON, -1, 0, 1, 1, 0}, /* eigh route off */
    {"warm-reuse", 0, PC_METHOD_NEWTON, -1, 1, 1, 1, -1},
    {"warm-noskip", 0, PC_METHOD_NEWTON, 0, 0, 1, 1, -1},
    {"warm-narrow", 0, PC_METHOD_NEWTON, -1, 0, 0, 1, -1},
    {"warm-2sweeps", 0, PC_METHOD_NEWTON, -1, 0, 1, 2, -1},
    {"seed", 1, PC_METHOD_NEWTON, -1, 0, 1, 1, -1},
    {"stale", 2, PC_METHOD_NEWTON, -1, 0, 1, 1, -1},
    {"newton", 3, PC_METHOD_NEWTON, -1, 0, 1, 1, -1},
    {"eigh", 3, PC_METHOD_EIGH, -1, 0, 1, 1, -1},
};
#define NEMA (sizeof ema_methods / sizeof *ema_methods)

/* The statistic after steps EMA steps A <- beta2 A + (1 - beta2) g g^T / m from
 * a0 = G G^T / k (gram's G, same seed), with gradients g of m = 64 columns:
 * - stationary (fresh == 0): g = G W / sqrt(k), W k x m Gaussian, so every g g^T / m has
 *   expectation a0: gradients from a fixed distribution with a0's spectrum and range, and A
 *   moves by the sampling noise alone (the steady state). Kept in G's coordinates:
 *   A = G M G^T / k, M_0 = I, M <- beta2 M + (1 - beta2) W W^T / m.
 * - fresh (fresh == 1): g n x m Gaussian, isotropic, mostly outside a0's range: the null
 *   space of a rank-deficient a0 fills (a transient, the stress case for a held basis).
 * The same seed continues the same path, so the k = 10 statistic extends the k = 1 one. */
static void ema_statistic(size_t n, size_t k, uint64_t seed, int steps, double beta2, int fresh,
                          double *a) {
  const size_t m = 64;
  if (fresh) {
    double *w = malloc(n * m * sizeof *w);
    if (!w) abort();
    gram(n, k, seed, a);
    uint64_t ws = seed ^ 0xf4e54ull;
    for (int t = 0; t < steps; t++) {
      for (size_t i = 0; i < n * m; i++) w[i] = rng_normal(&ws);
      cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)n, (int)m, (1.0 - beta2) / m, w,
                  (int)m, beta2, a, (int)n);
    }
    for (size_t i = 0; i < n; i++)
      for (size_t j = i + 1; j < n; j++) a[j * n + i] = a[i * n + j];
    free(w);
    return;
  }
  double *g = gaussian(n, k, seed);
  double *mk = calloc(k * k, sizeof *mk), *w = malloc(k * m * sizeof *w);
  double *gm = malloc(n * k * sizeof *gm);
  if (!mk || !w || !gm) abort();
  for (size_t i = 0; i < k; i++) mk[i * k + i] = 1.0;
  uint64_t ws = seed ^ 0x5eedf00dull;
  for (int t = 0; t < steps; t++) {
    for (size_t i = 0; i < k * m; i++) w[i] = rng_normal(&ws);
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)k, (int)m, (1.0 - beta2) / m, w,
                (int)m, beta2, mk, (int)k);
  }
  for (size_t i = 0; i < k; i++)
    for (size_t j = i + 1; j < k; j++) mk[j * k + i] = mk[i * k + j];
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)k, (int)k, 1.0, g, (int)k, mk,
              (int)k, 0.0, gm, (int)k);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)k, 1.0 / (double)k, gm,
              (int)k, g, (int)k, 0.0, a, (int)n);
  for (size_t i = 0; i < n; i++) /* exactly symmetric, as a statistic is */
    for (size_t j = i + 1; j < n; j++)
      a[i * n + j] = a[j * n + i] = 0.5 * (a[i * n + j] + a[j * n + i]);
  free(g);
  free(mk);
  free(w);
  free(gm);
}

static void basis_copy(pc_eigbasis_f32 *dst, const pc_eigbasis_f32 *src) {
  memcpy(dst->vt, src->vt, src->n * src->n * sizeof *dst->vt);
  memcpy(dst->w, src->w, src->n * sizeof *dst->w);
  dst->valid = src->valid;
}

/* One steady-state block: seed the basis on a0 (fp32), then for each k of --ema time every
 * row on the statistic k steps later, from the same held basis every repeat. */
static void ema_case(const bench_opts *o, size_t n, const char *spectrum, size_t k, int repeats) {
  const size_t nn = n * n;
  double *a = malloc(nn * sizeof *a), *a_in = malloc(nn * sizeof *a_in);
  double *ref = malloc(nn * sizeof *ref), *scratch = malloc(nn * sizeof *scratch);
  float *a32 = malloc(nn * sizeof *a32), *x0 = malloc(nn * sizeof *x0);
  float *x32 = malloc(nn * sizeof *x32);
  if (!a || !a_in || !ref || !scratch || !a32 || !x0 || !x32) abort();
  pc_eigbasis_f32 held, work;
  if (pc_eigbasis_init_f32(&held, n) || pc_eigbasis_init_f32(&work, n)) abort();
  pc_root_opts ro;
  pc_root_opts_default(&ro, o->p);
  pc_warm_info wi;
  gram(n, k, 1000 + n + (uint64_t)(strcmp(spectrum, "shampoo") == 0), a);
  for (size_t i = 0; i < nn; i++) a32[i] = (float)a[i];
  if (pc_inverse_root_warm_f32(n, a32, x0, &ro, NULL, &held, &wi) != PC_OK || !held.valid) abort();
  const double ridge_held = wi.root.ridge;
  for (int ki = 0; o->ema[ki]; ki++) {
    int steps = o->ema[ki];
    fprintf(stderr, "bench-roots: n=%zu %s ema %d: building statistic and references\n", n,
            spectrum, steps);
    ema_statistic(n, k, 1000 + n + (uint64_t)(strcmp(spectrum, "shampoo") == 0), steps, o->beta2,
                  o->ema_fresh, a);
    for (size_t i = 0; i < nn; i++) a_in[i] = a32[i] = (float)a[i];
    eig64 e, e_in;
    double cond = refs_init(n, a, a_in, &e, &e_in);
    for (size_t mi = 0; mi < NEMA; mi++) {
      const ema_method *m = &ema_methods[mi];
      if (o->methods_set && !listed(o->methods, m->name)) continue;
      pc_root_opts co = ro;
      co.method = m->method;
      pc_warm_opts wo;
      pc_warm_opts_default(&wo);
      if (m->skip_tol >= 0) wo.skip_tol = m->skip_tol;
      if (m->eigh_below >= 0) wo.eigh_below = m->eigh_below;
      wo.reuse_root = m->reuse_root;
      wo.wide = m->wide;
      wo.sweeps = m->sweeps;
      double gms, gcpu;
      time_gemm(n, 0, repeats, &gms, &gcpu);
      gms *= 1e3;
      gcpu *= 1e3;
      double t[64], c[64];
      int st = PC_OK, reps = repeats < 64 ? repeats : 64;
      memset(&wi, 0, sizeof wi);
      wi.offdiag = wi.change = wi.residual = NAN;
      for (int r = 0; r < reps; r++) {
        basis_copy(&work, &held);
        if (m->kind == 1) work.valid = 0;
        if (m->kind == 2 || m->reuse_root) memcpy(x32, x0, nn * sizeof *x32);
        double t0 = now_s(), c0 = cpu_s();
        if (m->kind == 0 || m->kind == 1)
          st = pc_inverse_root_warm_f32(n, a32, x32, &ro, &wo, &work, &wi);
        else if (m->kind == 3)
          st = pc_inverse_root_f32(n, a32, x32, &co, &wi.root);
        t[r] = now_s() - t0;
        c[r] = cpu_s() - c0;
      }
      if (m->kind == 2) wi.root.ridge = ridge_held;
      double ms = 1e3 * median(t, reps), cpu_ms = 1e3 * median(c, reps);
      double rel = NAN, rel_in = NAN, resid = NAN;
      if (st >= 0) {
        if (pc__sampled_residual_f32(n, a32, wi.root.ridge, x32, o->p, &resid)) abort();
        eig_root(&e, wi.root.ridge, o->p, scratch, ref);
        rel = rel_err(n, x32, NULL, ref);
        eig_root(&e_in, wi.root.ridge, o->p, scratch, ref);
        rel_in = rel_err(n, x32, NULL, ref);
      }
      const char *path = m->kind <= 1 ? pc_warm_path_name(wi.path) : "-";
      if (o->csv)
        printf(
            "%zu,%s,%.3g,%d,%d,%s,%s,%d,%.3f,%.3f,%d,%.3g,%.3g,%.3g,%.3g,%.3g,%.3f,%.2f,"
            "%.3f,%.2f\n",
            n, spectrum, cond, o->p, steps, m->name, path, o->threads, ms, cpu_ms, st, wi.offdiag,
            wi.change, resid, rel, rel_in, gms, ms / gms, gcpu, cpu_ms / gcpu);
      else
        printf("%5zu %-8s %8.2g %5d %-13s %-8s %9.2f %9.2f %9.3g %9.3g %9.3g %9.3g %7.2f %7.2f\n",
               n, spectrum, cond, steps, m->name, path, ms, cpu_ms, wi.offdiag, wi.change, resid,
               rel, ms / gms, cpu_ms / gcpu);
      fflush(stdout);
      fprintf(stderr, "bench-roots: n=%zu %s ema %d %s: %.1f ms, path %s, status %d\n", n, spectrum,
              steps, m->name, ms, path, st);
    }
    eig_destroy(&e);
    eig_destroy(&e_in);
  }
  pc_eigbasis_destroy_f32(&held);
  pc_eigbasis_destroy_f32(&work);
  free(a);
  free(a_in);
  free(ref);
  free(scratch);
  free(a32);
  free(x0);
  free(x32);
}

int main(int argc, char **argv) {
  bench_opts o;
  if (parse(argc, argv, &o) != 0) {
    usage(stderr);
    return 2;
  }
  openblas_set_num_threads(o.threads);
  if (o.kfac) return kfac_main(&o);
  print_header(&o);
  const char *spectra[] = {"well", "shampoo"};
  for (int si = 0; si < o.nsizes; si++) {
    size_t n = o.sizes[si];
    int repeats = o.repeats ? o.repeats : (n >= 2048 ? 1 : 3);
    for (int sp = 0; sp < 2; sp++) {
      if (!listed(o.spectra, spectra[sp])) continue;
      if (o.ema[0]) {
        ema_case(&o, n, spectra[sp], sp == 0 ? n + n / 2 : (n / 4 > 0 ? n / 4 : 1), repeats);
        continue;
      }
      fprintf(stderr, "bench-roots: n=%zu spectrum=%s: building matrix and references\n", n,
              spectra[sp]);
      double *a = malloc(n * n * sizeof *a), *ref = malloc(n * n * sizeof *ref);
      double *scratch = malloc(n * n * sizeof *scratch), *x64 = malloc(n * n * sizeof *x64);
      double *a_in = malloc(n * n * sizeof *a_in);
      float *a32 = malloc(n * n * sizeof *a32), *x32 = malloc(n * n * sizeof *x32);
      if (!a || !ref || !scratch || !x64 || !a_in || !a32 || !x32) abort();
      size_t k = sp == 0 ? n + n / 2 : (n / 4 > 0 ? n / 4 : 1);
      gram(n, k, 1000 + n + (uint64_t)sp, a);
      for (size_t i = 0; i < n * n; i++) {
        a32[i] = (float)a[i];
        a_in[i] = a32[i];
      }
      eig64 e, e_in;
      double cond = refs_init(n, a, a_in, &e, &e_in);
      for (size_t mi = 0; mi < NMETHODS; mi++) {
        const bench_method *m = &all_methods[mi];
        if (!listed(o.methods, m->name) || !listed(o.precisions, m->f64 ? "f64" : "f32")) continue;
        pc_root_opts ro;
        pc_root_opts_default(&ro, o.p);
        ro.method = m->method;
        if (m->f64) ro.tol = 1e-12;
        /* The reference product is timed next to each case, so that both see the same load
         * from whatever else runs on the machine. */
        double gms, gcpu;
        time_gemm(n, m->f64, repeats, &gms, &gcpu);
        gms *= 1e3;
        gcpu *= 1e3;
        double t[64], c[64], tmin = INFINITY;
        pc_root_info info;
        int st = PC_OK;
        for (int r = 0; r < repeats && r < 64; r++) {
          double t0 = now_s(), c0 = cpu_s();
          if (m->public_method)
            st = m->f64 ? pc_inverse_root_f64(n, a, x64, &ro, &info)
                        : pc_inverse_root_f32(n, a32, x32, &ro, &info);
          else
            st = m->f64 ? pc__newton_root_f64(n, a, x64, &ro, &m->variant, &info)
                        : pc__newton_root_f32(n, a32, x32, &ro, &m->variant, &info);
          t[r] = now_s() - t0;
          c[r] = cpu_s() - c0;
          tmin = t[r] < tmin ? t[r] : tmin;
        }
        double ms = 1e3 * median(t, repeats < 64 ? repeats : 64);
        double cpu_ms = 1e3 * median(c, repeats < 64 ? repeats : 64);
        double rel = NAN, rel_in = NAN;
        if (st >= 0) {
          eig_root(&e, info.ridge, o.p, scratch, ref);
          rel = rel_err(n, m->f64 ? NULL : x32, x64, ref);
          if (!m->f64) {
            eig_root(&e_in, info.ridge, o.p, scratch, ref);
            rel_in = rel_err(n, x32, NULL, ref);
          }
        }
        const char *prec = m->f64 ? "fp64" : "fp32";
        if (o.csv)
          printf(
              "%zu,%s,%.3g,%d,%s,%s,%d,%.3f,%.3f,%.3f,%d,%d,%.3g,%.3g,%.3g,%.3f,%.2f,%.3f,"
              "%.2f\n",
              n, spectra[sp], cond, o.p, m->name, prec, o.threads, ms, 1e3 * tmin, cpu_ms,
              info.iters, st, info.error, rel, rel_in, gms, ms / gms, gcpu, cpu_ms / gcpu);
        else
          printf("%5zu %-8s %8.2g %-19s %-4s %10.2f %5d %8.2g %9.3g %9.3g %9.3f %7.2f\n", n,
                 spectra[sp], cond, m->name, prec, ms, info.iters, info.error, rel, rel_in, gms,
                 ms / gms);
        fflush(stdout);
        fprintf(stderr, "bench-roots: n=%zu %s %s %s: %.1f ms, status %d\n", n, spectra[sp],
                m->name, prec, ms, st);
      }
      eig_destroy(&e);
      eig_destroy(&e_in);
      free(a);
      free(ref);
      free(scratch);
      free(x64);
      free(a_in);
      free(a32);
      free(x32);
    }
  }
  return 0;
}
