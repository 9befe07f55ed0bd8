/*
 * bench-accel-prims -- throughput of the accel primitives that dominate a training step
 * (sgemm, batched sgemm, syrk into packed statistics, elementwise, softmax, reductions,
 * im2col, AdamW, batch norm's passes), on every backend asked for, printed as CSV:
 *
 *   backend,primitive,shape,iters,ms_per_iter,rate,unit
 *
 * rate is GFLOP/s for BLAS-like primitives and GB/s (bytes read + written) for the rest.
 * Compare rows as ratios within one run; absolute numbers depend on the machine's load.
 *
 * Usage: bench-accel-prims [--backend cpu|cuda|all] [--threads N] [--quick]
 *   --threads: OpenBLAS threads of the CPU backend (default 1)
 *   --quick:   small shapes and few iterations (CI smoke run)
 * A backend that cannot be created (no CUDA device) is reported on stderr and skipped.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "accel.h"

typedef struct {
  ac_backend *be;
  const char *name;
  int quick;
} bench;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float *dev_random(bench *b, size_t n, uint64_t seed) {
  void *p = NULL;
  if (ac_malloc(b->be, (n ? n : 1) * sizeof(float), &p) != AC_OK) {
    fprintf(stderr, "bench: out of device memory for %zu floats\n", n);
    exit(1);
  }
  if (ac_rand_uniform(b->be, seed, 0, n, -1.0f, 1.0f, p) != AC_OK) {
    fprintf(stderr, "bench: ac_rand_uniform failed\n");
    exit(1);
  }
  return p;
}

static void check(int rc, const char *what) {
  if (rc != AC_OK) {
    fprintf(stderr, "bench: %s: %s\n", what, ac_strerror(rc));
    exit(1);
  }
}

static void report(bench *b, const char *prim, const char *shape, int iters, double secs,
                   double work, const char *unit) {
  double per = secs / iters;
  printf("%s,%s,%s,%d,%.4f,%.2f,%s\n", b->name, prim, shape, iters, per * 1e3, work / per / 1e9,
         unit);
  fflush(stdout);
}

/* Iterations for about 0.25 s, from the time of one warm-up call; 3 in --quick. */
static int iters_for(bench *b, double warm_s) {
  if (b->quick) return 3;
  double it = 0.25 / (warm_s > 1e-7 ? warm_s : 1e-7);
  return it < 3 ? 3 : (it > 2000 ? 2000 : (int)it);
}

/* Times one warm-up call, picks iters, runs body iters times, syncs; secs is the total. */
#define TIMED(b, iters, secs, body)           \
  do {                                        \
    check(ac_sync((b)->be), "sync");          \
    double w0_ = now_s();                     \
    body;                                     \
    check(ac_sync((b)->be), "sync");          \
    (iters) = iters_for((b), now_s() - w0_);  \
    double t0_ = now_s();                     \
    for (int it_ = 0; it_ < (iters); it_++) { \
      body;                                   \
    }                                         \
    check(ac_sync((b)->be), "sync");          \
    (secs) = now_s() - t0_;                   \
  } while (0)

static void bench_gemm(bench *b, size_t n) {
  float *x = dev_random(b, n * n, 1), *y = dev_random(b, n * n, 2), *z = dev_random(b, n * n, 3);
  double flops = 2.0 * n * n * n, secs;
  int iters = 0;
  char shape[64];
  TIMED(b, iters, secs,
        check(ac_sgemm(b->be, AC_NO_TRANS, AC_TRANS, n, n, n, 1.0f, x, n, y, n, 0.0f, z, n),
              "sgemm"));
  snprintf(shape, sizeof shape, "%zux%zux%zu", n, n, n);
  report(b, "sgemm", shape, iters, secs, flops, "GFLOP/s");
  ac_free(b->be, x);
  ac_free(b->be, y);
  ac_free(b->be, z);
}

/* Attention-shaped batched gemm: (B*H) x (T x Dh) (Dh x T). */
static void bench_gemm_batched(bench *b, size_t batch, size_t t, size_t dh) {
  float *q = dev_random(b, batch * t * dh, 4), *k = dev_random(b, batch * t * dh, 5);
  float *s = dev_random(b, batch * t * t, 6);
  double flops = 2.0 * batch * t * t * dh, secs;
  int iters = 0;
  char shape[64];
  TIMED(b, iters, secs,
        check(ac_sgemm_batched(b->be, AC_NO_TRANS, AC_TRANS, t, t, dh, 0.125f, q, dh, t * dh, k, dh,
                               t * dh, 0.0f, s, t, t * t, batch),
              "sgemm_batched"));
  snprintf(shape, sizeof shape, "%zux(%zux%zux%zu)", batch, t, t, dh);
  report(b, "sgemm_batched", shape, iters, secs, flops, "GFLOP/s");
  TIMED(b, iters, secs, check(ac_softmax_rows(b->be, batch * t, t, s, s), "softmax"));
  snprintf(shape, sizeof shape, "%zux%zu", batch * t, t);
  report(b, "softmax_rows", shape, iters, secs, 2.0 * batch * t * t * sizeof(float), "GB/s");
  ac_free(b->be, q);
  ac_free(b->be, k);
  ac_free(b->be, s);
}

/* Shampoo statistics of a rows x cols block: both Gram matrices, EMA into packed storage. */
static void bench_syrk(bench *b, size_t rows, size_t cols) {
  float *g = dev_random(b, rows * cols, 7);
  float *l = dev_random(b, ac_packed_len(rows), 8), *r = dev_random(b, ac_packed_len(cols), 9);
  double flops = 1.0 * rows * rows * cols + 1.0 * cols * cols * rows, secs;
  int iters = 0;
  char shape[64];
  TIMED(b, iters, secs, {
    check(ac_syrk_packed(b->be, AC_NO_TRANS, rows, cols, 0.01f, g, cols, 0.99f, l), "syrk L");
    check(ac_syrk_packed(b->be, AC_TRANS, cols, rows, 0.01f, g, cols, 0.99f, r), "syrk R");
  });
  snprintf(shape, sizeof shape, "%zux%zu", rows, cols);
  report(b, "syrk_packed_LR", shape, iters, secs, flops, "GFLOP/s");
  ac_free(b->be, g);
  ac_free(b->be, l);
  ac_free(b->be, r);
}

static void bench_elementwise(bench *b, size_t n) {
  float *x = dev_random(b, n, 10), *y = dev_random(b, n, 11), *m = dev_random(b, n, 12);
  float *v = dev_random(b, n, 13);
  double secs;
  int iters = 0;
  char shape[64];
  snprintf(shape, sizeof shape, "%zu", n);
  TIMED(b, iters, secs, check(ac_axpby(b->be, n, 0.5f, x, 0.5f, y, y), "axpby"));
  report(b, "axpby", shape, iters, secs, 3.0 * n * sizeof(float), "GB/s");
  TIMED(b, iters, secs, check(ac_unary(b->be, AC_UNARY_GELU, n, x, y), "gelu"));
  report(b, "gelu", shape, iters, secs, 2.0 * n * sizeof(float), "GB/s");
  check(ac_unary(b->be, AC_UNARY_ABS, n, v, v), "abs");
  ac_adamw_args a = {
      .lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f, .step = 10};
  TIMED(b, iters, secs, check(ac_adamw_update(b->be, n, x, y, m, v, &a), "adamw"));
  report(b, "adamw_update", shape, iters, secs, 7.0 * n * sizeof(float), "GB/s");
  double s;
  TIMED(b, iters, secs, check(ac_sumsq_to_host(b->be, n, x, &s), "sumsq"));
  report(b, "sumsq_to_host", shape, iters, secs, 1.0 * n * sizeof(float), "GB/s");
  /* Layer-norm statistics shape: rows of 1024. */
  size_t rows = n / 1024;
  TIMED(b, iters, secs,
        check(ac_reduce(b->be, AC_REDUCE_SUM, 1, rows, 1024, 1.0f / 1024, x, 0.0f, m), "reduce"));
  snprintf(shape, sizeof shape, "%zux1024", rows);
  report(b, "reduce_rows", shape, iters, secs, 1.0 * n * sizeof(float), "GB/s");
  ac_free(b->be, x);
  ac_free(b->be, y);
  ac_free(b->be, m);
  ac_free(b->be, v);
}

static void bench_im2col(bench *b, size_t n, size_t c, size_t hw) {
  ac_conv2d_geom g = {.n = n,
                      .c = c,
                      .h = hw,
                      .w = hw,
                      .kh = 3,
                      .kw = 3,
                      .stride_h = 1,
                      .stride_w = 1,
                      .pad_h = 1,
                      .pad_w = 1};
  size_t oh, ow;
  check(ac_conv2d_out_hw(&g, &oh, &ow), "geometry");
  size_t ncol = n * c * 9 * oh * ow;
  float *x = dev_random(b, n * c * hw * hw, 14), *col = dev_random(b, ncol, 15);
  double secs;
  int iters = 0;
  char shape[64];
  TIMED(b, iters, secs, check(ac_im2col(b->be, &g, x, col), "im2col"));
  snprintf(shape, sizeof shape, "%zux%zux%zux%zu,k3", n, c, hw, hw);
  report(b, "im2col", shape, iters, secs, (double)ncol * sizeof(float), "GB/s");
  /* The conv layer's layout: one (c 9, n oh ow) matrix for the batch. */
  TIMED(b, iters, secs, check(ac_im2col_batch(b->be, &g, x, col), "im2col_batch"));
  report(b, "im2col_batch", shape, iters, secs, (double)ncol * sizeof(float), "GB/s");
  ac_free(b->be, x);
  ac_free(b->be, col);
}

/* Batch norm's passes on one (n, c, hw) activation (a ResNet-20 stage-1 batch norm by
 * default): the moments, the masked gradient sums (with gout, as a block's second batch
 * norm; without, as its first), the dx combine, the affine + residual + ReLU. GB/s of the
 * bytes each reads and writes. */
static void bench_channel(bench *b, size_t n, size_t c, size_t hw) {
  size_t len = n * c * hw;
  float *x = dev_random(b, len, 16), *dy = dev_random(b, len, 17), *y = dev_random(b, len, 18);
  float *g = dev_random(b, len, 19), *p = dev_random(b, 6 * c, 20);
  double secs, bytes = (double)len * sizeof(float);
  int iters = 0;
  char shape[64];
  snprintf(shape, sizeof shape, "%zux%zux%zu", n, c, hw);
  TIMED(b, iters, secs, check(ac_channel_moments(b->be, n, c, hw, x, p, p + c), "moments"));
  report(b, "channel_moments", shape, iters, secs, bytes, "GB/s");
  TIMED(b, iters, secs,
        check(ac_channel_grad_sums(b->be, n, c, hw, dy, y, x, p, g, p + 2 * c, p + 3 * c),
              "grad_sums"));
  report(b, "channel_grad_sums_mask_gout", shape, iters, secs, 4.0 * bytes, "GB/s");
  TIMED(b, iters, secs,
        check(ac_channel_grad_sums(b->be, n, c, hw, dy, y, x, p, NULL, p + 2 * c, p + 3 * c),
              "grad_sums"));
  report(b, "channel_grad_sums_mask", shape, iters, secs, 3.0 * bytes, "GB/s");
  TIMED(b, iters, secs,
        check(ac_channel_combine(b->be, n, c, hw, dy, y, x, p, p + c, p + 2 * c, g), "combine"));
  report(b, "channel_combine_mask", shape, iters, secs, 4.0 * bytes, "GB/s");
  TIMED(b, iters, secs, check(ac_channel_affine(b->be, n, c, hw, x, p, p + c, dy, 1, g), "affine"));
  report(b, "channel_affine_res_relu", shape, iters, secs, 3.0 * bytes, "GB/s");
  ac_free(b->be, x);
  ac_free(b->be, dy);
  ac_free(b->be, y);
  ac_free(b->be, g);
  ac_free(b->be, p);
}

static void run(bench *b) {
  if (b->quick) {
    bench_gemm(b, 128);
    bench_gemm_batched(b, 8, 64, 32);
    bench_syrk(b, 128, 64);
    bench_elementwise(b, 1 << 16);
    bench_im2col(b, 2, 8, 16);
    bench_channel(b, 2, 4, 49);
    return;
  }
  int gpu = strcmp(b->name, "cuda") == 0;
  bench_gemm(b, 512);
  bench_gemm(b, gpu ? 4096 : 1024);
  bench_gemm_batched(b, gpu ? 96 : 12, gpu ? 512 : 128, 64);
  bench_syrk(b, 1024, 1024);
  bench_syrk(b, gpu ? 4096 : 2048, gpu ? 1024 : 512);
  bench_elementwise(b, gpu ? (size_t)1 << 26 : (size_t)1 << 22);
  bench_im2col(b, gpu ? 64 : 8, 64, 32);
  bench_channel(b, 128, 16, 784);
}

int main(int argc, char **argv) {
  const char *which = "all";
  int threads = 1, quick = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
      which = argv[++i];
    else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
      threads = atoi(argv[++i]);
    else if (strcmp(argv[i], "--quick") == 0)
      quick = 1;
    else {
      fprintf(stderr, "usage: %s [--backend cpu|cuda|all] [--threads N] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (threads < 1 ||
      (strcmp(which, "cpu") != 0 && strcmp(which, "cuda") != 0 && strcmp(which, "all") != 0)) {
    fprintf(stderr, "bench-accel-prims: bad --backend or --threads\n");
    return 2;
  }
  printf("backend,primitive,shape,iters,ms_per_iter,rate,unit\n");
  int ran = 0;
  for (int k = 0; k < 2; k++) {
    ac_backend_kind kind = k == 0 ? AC_BACKEND_CPU : AC_BACKEND_CUDA;
    const char *name = k == 0 ? "cpu" : "cuda";
    if (strcmp(which, "all") != 0 && strcmp(which, name) != 0) continue;
    ac_backend_opts opts;
    ac_backend_opts_default(&opts);
    opts.kind = kind;
    opts.threads = threads;
    bench b = {.name = name, .quick = quick};
    int rc = ac_backend_create(&b.be, &opts);
    if (rc != AC_OK) {
      fprintf(stderr, "bench-accel-prims: %s backend skipped: %s (%s)\n", name, ac_strerror(rc),
              ac_backend_describe(NULL));
      continue;
    }
    fprintf(stderr, "bench-accel-prims: %s\n", ac_backend_describe(b.be));
    run(&b);
    ac_backend_destroy(b.be);
    ran++;
  }
  /* Asking for one backend by name and not getting it is a failure. */
  return ran > 0 || strcmp(which, "all") == 0 ? 0 : 1;
}
