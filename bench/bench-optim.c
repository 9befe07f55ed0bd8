/*
 * bench-optim -- cost of one optimizer step on the accel backends, printed as CSV:
 *
 *   backend,model,optimizer,params,blocks,iters,ms_per_step,ratio_to_adamw
 *
 * The "model" is a list of parameter shapes like a Transformer block's (attention and MLP
 * weights, biases, norms). Optimizers: SGD (momentum), AdamW, Shampoo's worker half in three
 * phases: the step before any root arrives (grafted fallback only), the step with roots
 * held for every block, and the statistics computation plus download (compute_stats).
 * Roots are identities scaled by 0.5: the cost does not depend on their values.
 * Compare rows as ratios within one run; absolute numbers depend on the machine's load.
 *
 * With --parts, Shampoo's step with roots is also taken apart (session 11's accounting), each
 * part timed alone with the shapes the step uses:
 *   shampoo-products       the two gemms per block, L G_b then (L G_b) R (ac_sgemm)
 *   shampoo-install        every block's packed roots of a new version checked and unpacked
 *                          (ac_shampoo_set_roots), their source in cache
 *   shampoo-install-cold   the same from a source pool of PARTS_POOL_MB, cycled so that each
 *                          version is read from memory, as roots another core wrote are
 *   gemm-NxNxN             one square product of the block size; its GFLOP/s in ratio's place
 *                          is not a ratio: the column holds GFLOP/s for these rows
 *
 * Usage: bench-optim [--backend cpu|cuda|all] [--threads N] [--dim D] [--clock wall|cpu]
 *                    [--quick] [--parts] [--isa best|avx2]
 *   --threads: OpenBLAS threads of the CPU backend (default 1)
 *   --clock:   wall time (default), or this process's CPU time, steadier for the CPU backend
 *              on a shared machine (with 1 thread it is the work done; wrong for CUDA)
 *   --dim:     model width (default 512; MLP 4x); block size 128
 *   --quick:   width 64 and 3 iterations (CI smoke run)
 *   --isa:     cap of the CPU backend's ISA (ac_backend_opts.cpu_isa): avx2 keeps OpenBLAS for
 *              the small blocks' products, best (default) takes the AVX-512F kernel where the
 *              processor has it (gemm_small.c); run both alternated to compare
 * A backend that cannot be created (no CUDA device) is reported on stderr and skipped.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "accel.h"

enum { NPARAM = 8, PARTS_POOL_MB = 64 };

static clockid_t clock_id = CLOCK_MONOTONIC;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(clock_id, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void check(int rc, const char *what) {
  if (rc != AC_OK) {
    fprintf(stderr, "bench-optim: %s: %s\n", what, ac_strerror(rc));
    exit(1);
  }
}

typedef struct {
  ac_backend *be;
  const char *name;
  int quick, parts;
  size_t dim;
  ac_param params[NPARAM];
  ac_param *ptrs[NPARAM];
  size_t numel;
} bench;

/* A Transformer block's parameters at width d: qkv, proj, mlp in/out weights and biases. */
static void make_params(bench *b) {
  const size_t d = b->dim;
  const size_t shapes[NPARAM][2] = {{3 * d, d}, {3 * d, 1}, {d, d},     {d, 1},
                                    {4 * d, d}, {4 * d, 1}, {d, 4 * d}, {d, 1}};
  const char *names[NPARAM] = {"qkv.w", "qkv.b", "proj.w", "proj.b",
                               "fc1.w", "fc1.b", "fc2.w",  "fc2.b"};
  b->numel = 0;
  for (int i = 0; i < NPARAM; i++) {
    const int rank = shapes[i][1] == 1 ? 1 : 2;
    check(ac_param_init(&b->params[i], b->be, names[i], rank, shapes[i]), "param");
    b->ptrs[i] = &b->params[i];
    size_t n = b->params[i].value.numel;
    check(ac_rand_uniform(b->be, 1, b->numel, n, -1.0f, 1.0f, ac_tensor_f32(&b->params[i].value)),
          "init");
    check(ac_rand_uniform(b->be, 2, b->numel, n, -1e-2f, 1e-2f, ac_tensor_f32(&b->params[i].grad)),
          "grad");
    b->numel += n;
  }
}

static void free_params(bench *b) {
  for (int i = 0; i < NPARAM; i++) ac_param_destroy(&b->params[i]);
}

typedef int (*step_fn)(void *opt);

static int sgd_step(void *o) {
  return ac_sgd_step(o, 1e-3f);
}
static int adamw_step(void *o) {
  return ac_adamw_step(o, 1e-3f);
}
static int shampoo_step(void *o) {
  return ac_shampoo_step(o, 1e-3f);
}
static int shampoo_stats(void *o) {
  return ac_shampoo_compute_stats(o, NULL, NULL);
}

/* ms per call of fn: iterations for about 0.25 s from one warm-up call (3 in --quick). */
static double time_ms(bench *b, step_fn fn, void *opt, int *iters) {
  check(ac_sync(b->be), "sync");
  double t0 = now_s();
  check(fn(opt), "warm-up step");
  check(ac_sync(b->be), "sync");
  double warm = now_s() - t0;
  int n = b->quick ? 3 : (int)(0.25 / (warm > 1e-7 ? warm : 1e-7));
  n = n < 3 ? 3 : n > 2000 ? 2000 : n;
  t0 = now_s();
  for (int i = 0; i < n; i++) check(fn(opt), "step");
  check(ac_sync(b->be), "sync");
  *iters = n;
  return (now_s() - t0) * 1e3 / n;
}

static void row(bench *b, const char *opt, size_t blocks, int iters, double ms, double adamw);

/* --parts: the step's products, block by block, as precondition_block makes them. */
typedef struct {
  bench *b;
  ac_shampoo *sh;
  float *l, *r, *t, *p;     /* dense roots, L G_b, the product: the largest block's size */
  const float *const *grad; /* per parameter */
  size_t ld[NPARAM];
} products_ctx;

static int products_step(void *o) {
  products_ctx *c = o;
  int rc = AC_OK;
  for (size_t k = 0; k < ac_shampoo_nblocks(c->sh) && rc == AC_OK; k++) {
    ac_shampoo_block info;
    rc = ac_shampoo_block_info(c->sh, k, &info);
    const size_t r = info.block.rows, n = info.block.cols, ld = c->ld[info.param];
    if (rc != AC_OK || c->b->params[info.param].value.ndim < 2) continue; /* diagonal */
    const float *g = c->grad[info.param] + info.block.row0 * ld + info.block.col0;
    rc = ac_sgemm(c->b->be, AC_NO_TRANS, AC_NO_TRANS, r, n, r, 1.0f, c->l, r, g, ld, 0.0f, c->t, n);
    if (rc == AC_OK)
      rc = ac_sgemm(c->b->be, AC_NO_TRANS, AC_NO_TRANS, r, n, n, 1.0f, c->t, n, c->r, n, 0.0f, c->p,
                    n);
  }
  return rc;
}

/* --parts: one square product of the block size (128) from the products' buffers. */
static int gemm_one(void *o) {
  products_ctx *c = o;
  return ac_sgemm(c->b->be, AC_NO_TRANS, AC_NO_TRANS, 128, 128, 128, 1.0f, c->l, 128, c->r, 128,
                  0.0f, c->p, 128);
}

/* --parts: every block's packed roots handed over as a new version, from pool slot `next`. */
typedef struct {
  ac_shampoo *sh;
  float *pool; /* nslots copies of one set of packed roots (every block, both sides) */
  size_t set_len, nslots, next;
  uint64_t version;
} install_ctx;

static int install_step(void *o) {
  install_ctx *c = o;
  const float *src = c->pool + c->next * c->set_len;
  c->next = (c->next + 1) % c->nslots;
  c->version++;
  int rc = AC_OK;
  for (size_t k = 0; k < ac_shampoo_nblocks(c->sh) && rc == AC_OK; k++) {
    ac_shampoo_block info;
    rc = ac_shampoo_block_info(c->sh, k, &info);
    const size_t r = info.block.rows, n = info.block.cols;
    const ac_shampoo_roots roots = {.version = c->version,
                                    .source_step = c->version,
                                    .format = AC_ROOT_PACKED,
                                    .n_left = r,
                                    .left = src,
                                    .n_right = n,
                                    .right = src + ac_packed_len(r)};
    if (rc == AC_OK) rc = ac_shampoo_set_roots(c->sh, k, &roots);
    src += ac_packed_len(r) + ac_packed_len(n);
  }
  return rc;
}

/* --parts rows: products, install (warm and cold), and one block-size gemm's GFLOP/s. */
static void parts(bench *b, ac_shampoo *sh, double adamw_ms) {
  const size_t nb = ac_shampoo_nblocks(sh), bs = 128;
  int iters = 0;
  size_t set_len = 0, max_order = 1;
  for (size_t k = 0; k < nb; k++) {
    ac_shampoo_block info;
    check(ac_shampoo_block_info(sh, k, &info), "block info");
    set_len += ac_packed_len(info.block.rows) + ac_packed_len(info.block.cols);
    if (info.block.rows > max_order) max_order = info.block.rows;
    if (info.block.cols > max_order) max_order = info.block.cols;
  }
  const float *grad[NPARAM];
  products_ctx pc = {.b = b, .sh = sh, .grad = grad};
  for (int i = 0; i < NPARAM; i++) {
    grad[i] = ac_tensor_f32(&b->params[i].grad);
    pc.ld[i] = b->params[i].value.ndim < 2 ? 1 : b->params[i].value.shape[1];
  }
  float **bufs[] = {&pc.l, &pc.r, &pc.t, &pc.p};
  for (size_t i = 0; i < 4; i++) {
    check(ac_malloc(b->be, max_order * max_order * sizeof(float), (void **)bufs[i]), "scratch");
    check(ac_rand_uniform(b->be, 3 + i, 0, max_order * max_order, -0.1f, 0.1f, *bufs[i]), "init");
  }
  double ms = time_ms(b, products_step, &pc, &iters);
  row(b, "shampoo-products", nb, iters, ms, adamw_ms);

  /* gemm of the block size: 2 n^3 flops; GFLOP/s printed in the ratio column */
  products_ctx one = pc;
  ms = time_ms(b, gemm_one, &one, &iters);
  char name[32];
  snprintf(name, sizeof name, "gemm-%zux%zux%zu", bs, bs, bs);
  printf("%s,block-d%zu,%s,%zu,%d,%d,%.4f,%.1f\n", b->name, b->dim, name, bs * bs, 1, iters, ms,
         2.0 * (double)bs * bs * bs / (ms * 1e6));
  for (size_t i = 0; i < 4; i++) ac_free(b->be, *bufs[i]);

  /* install: the roots are 0.5 I packed (finite; the values do not change the cost) */
  install_ctx ic = {.sh = sh, .set_len = set_len, .version = 1000};
  for (int cold = 0; cold < 2; cold++) {
    ic.nslots = cold ? (PARTS_POOL_MB << 20) / (set_len * sizeof(float)) + 1 : 1;
    ic.pool = malloc(ic.nslots * set_len * sizeof(float));
    if (ic.pool == NULL) check(AC_ENOMEM, "root pool");
    for (size_t j = 0; j < ic.nslots * set_len; j++) ic.pool[j] = 0.5f;
    ic.next = 0;
    ms = time_ms(b, install_step, &ic, &iters);
    row(b, cold ? "shampoo-install-cold" : "shampoo-install", nb, iters, ms, adamw_ms);
    free(ic.pool);
  }
}

static void row(bench *b, const char *opt, size_t blocks, int iters, double ms, double adamw) {
  printf("%s,block-d%zu,%s,%zu,%zu,%d,%.4f,%.3f\n", b->name, b->dim, opt, b->numel, blocks, iters,
         ms, ms / adamw);
  fflush(stdout);
}

/* 0.5 I of order n (caller frees). */
static float *half_eye(size_t n) {
  float *x = calloc(n * n, sizeof *x);
  if (x == NULL) check(AC_ENOMEM, "roots");
  for (size_t i = 0; i < n; i++) x[i * n + i] = 0.5f;
  return x;
}

/* Hands every block 0.5 I on both sides. */
static void give_roots(ac_shampoo *s) {
  for (size_t k = 0; k < ac_shampoo_nblocks(s); k++) {
    ac_shampoo_block info;
    check(ac_shampoo_block_info(s, k, &info), "block info");
    const size_t r = info.block.rows, c = info.block.cols;
    float *l = half_eye(r), *rr = half_eye(c);
    const ac_shampoo_roots roots = {.version = 1,
                                    .source_step = 1,
                                    .format = AC_ROOT_DENSE,
                                    .n_left = r,
                                    .left = l,
                                    .n_right = c,
                                    .right = rr};
    check(ac_shampoo_set_roots(s, k, &roots), "roots");
    free(l);
    free(rr);
  }
}

static void run(bench *b) {
  int iters = 0;
  make_params(b);

  ac_adamw *adam = NULL;
  check(ac_adamw_create(&adam, b->ptrs, NPARAM, NULL), "adamw");
  const double adamw_ms = time_ms(b, adamw_step, adam, &iters);
  row(b, "adamw", 0, iters, adamw_ms, adamw_ms);
  ac_adamw_destroy(adam);

  ac_sgd *sgd = NULL;
  check(ac_sgd_create(&sgd, b->ptrs, NPARAM, NULL), "sgd");
  double ms = time_ms(b, sgd_step, sgd, &iters);
  row(b, "sgd-momentum", 0, iters, ms, adamw_ms);
  ac_sgd_destroy(sgd);

  ac_shampoo_opts o;
  ac_shampoo_opts_default(&o); /* the clients' Shampoo */
  ac_shampoo *sh = NULL;
  check(ac_shampoo_create(&sh, b->ptrs, NPARAM, &o), "shampoo");
  const size_t nb = ac_shampoo_nblocks(sh);
  ms = time_ms(b, shampoo_step, sh, &iters);
  row(b, "shampoo-fallback", nb, iters, ms, adamw_ms);
  give_roots(sh);
  ms = time_ms(b, shampoo_step, sh, &iters);
  row(b, "shampoo-roots", nb, iters, ms, adamw_ms);
  ms = time_ms(b, shampoo_stats, sh, &iters);
  row(b, "shampoo-stats", nb, iters, ms, adamw_ms);
  if (b->parts) parts(b, sh, adamw_ms);
  ac_shampoo_destroy(sh);
  free_params(b);
}

int main(int argc, char **argv) {
  const char *which = "cpu";
  int threads = 1, quick = 0, parts_rows = 0, isa = AC_CPU_ISA_BEST;
  size_t dim = 512;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
      which = argv[++i];
    else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
      threads = atoi(argv[++i]);
    else if (strcmp(argv[i], "--dim") == 0 && i + 1 < argc)
      dim = (size_t)strtoul(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--clock") == 0 && i + 1 < argc && strcmp(argv[i + 1], "cpu") == 0)
      clock_id = CLOCK_PROCESS_CPUTIME_ID, i++;
    else if (strcmp(argv[i], "--clock") == 0 && i + 1 < argc && strcmp(argv[i + 1], "wall") == 0)
      clock_id = CLOCK_MONOTONIC, i++;
    else if (strcmp(argv[i], "--quick") == 0)
      quick = 1;
    else if (strcmp(argv[i], "--parts") == 0)
      parts_rows = 1;
    else if (strcmp(argv[i], "--isa") == 0 && i + 1 < argc && strcmp(argv[i + 1], "avx2") == 0)
      isa = AC_CPU_ISA_AVX2, i++;
    else if (strcmp(argv[i], "--isa") == 0 && i + 1 < argc && strcmp(argv[i + 1], "best") == 0)
      isa = AC_CPU_ISA_BEST, i++;
    else {
      fprintf(stderr,
              "usage: bench-optim [--backend cpu|cuda|all] [--threads N] [--dim D] "
              "[--clock wall|cpu] [--quick] [--parts] [--isa best|avx2]\n");
      return 2;
    }
  }
  if (threads < 1 || dim < 1 || dim > 8192) {
    fprintf(stderr, "bench-optim: --threads must be >= 1 and --dim in 1..8192\n");
    return 2;
  }
  if (quick) dim = 64;
  printf("backend,model,optimizer,params,blocks,iters,ms_per_step,ratio_to_adamw\n");
  const ac_backend_kind kinds[2] = {AC_BACKEND_CPU, AC_BACKEND_CUDA};
  const char *names[2] = {"cpu", "cuda"};
  for (int k = 0; k < 2; k++) {
    if (strcmp(which, "all") != 0 && strcmp(which, names[k]) != 0) continue;
    ac_backend_opts bo;
    ac_backend_opts_default(&bo);
    bo.kind = kinds[k];
    bo.threads = threads;
    bo.cpu_isa = isa;
    bench b = {.name = names[k], .quick = quick, .parts = parts_rows, .dim = dim};
    int rc = ac_backend_create(&b.be, &bo);
    if (rc != AC_OK) {
      fprintf(stderr, "bench-optim: %s backend skipped: %s (%s)\n", names[k], ac_strerror(rc),
              ac_backend_describe(NULL));
      continue;
    }
    run(&b);
    ac_backend_destroy(b.be);
  }
  return 0;
}
