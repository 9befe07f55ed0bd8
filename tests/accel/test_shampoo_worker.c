/*
 * test_shampoo_worker.c -- Shampoo's worker half: the block layout it uses (pc_layout_init's),
 * statistics computed on the device against pc_gram_f32, the statistics interval, roots
 * handed in dense or packed and kept by version, and the grafted preconditioned step against
 * a host reference built from the numerics core: D from pc_graft_direction_f32, each block's
 * P from pc_direction_f64 with the same roots, rescaled to |D_b| in fp64; then momentum,
 * Nesterov and weight decay in fp64; fallback counting. Runs on the CPU backend and, where
 * a CUDA device exists, on CUDA against the same references (skipped otherwise).
 */
#include <lapacke.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "accel.h"
#include "test_util.h"

static uint64_t rng_state = 0x853C49E6748FEA9Bull;

static float frand(void) {
  return xorshift_frand(&rng_state);
}

/* ------------------------------------------------------------------------------------ */
/* A set of parameters covering the layout's cases                                         */

/* block_size 4, skip_limit 12:
 *   "a" 5 x 7      -> blocks 4x4, 4x3, 1x4, 1x3
 *   "b" 3 x 2 x 5  -> view 3 x 10, blocks 3x4, 3x4, 3x2
 *   "c" 6          -> rank 1: diagonal
 *   "d" 2 x 13     -> cols above the skip limit: diagonal
 *   "e" 8 x 4      -> blocks 4x4, 4x4 as wide as the tensor: contiguous in it (the worker
 *                     reads and writes them in place) */
enum { NPAR = 5, NBLK = 9 };
static const int ranks[NPAR] = {2, 3, 1, 2, 2};
static const size_t dims[NPAR][3] = {{5, 7, 0}, {3, 2, 5}, {6, 0, 0}, {2, 13, 0}, {8, 4, 0}};
static const char *names[NPAR] = {"a", "b", "c", "d", "e"};

typedef struct {
  ac_backend *be;
  ac_param params[NPAR];
  ac_param *ptrs[NPAR];
  size_t n[NPAR];
  pc_layout lay[NPAR];
  float *g[NPAR]; /* host copies of the grads */
  /* roots per block as handed to the worker (dense float), and as the reference uses
   * them (the same values in fp64); NULL: that side has none */
  float *lf[NBLK], *rf[NBLK];
  double *l64[NBLK], *r64[NBLK];
  uint64_t src[NBLK]; /* their source step */
  /* reference state */
  float *m[NPAR], *v[NPAR]; /* graft moments (pc_graft_direction_f32's) */
  double *buf[NPAR];        /* momentum */
  double *p[NPAR];          /* parameter values */
} world;

static void layout_opts(pc_layout_opts *lo) {
  lo->block_size = 4;
  lo->skip_limit = 12;
}

static void world_init(world *w, ac_backend *be) {
  pc_layout_opts lo;
  layout_opts(&lo);
  memset(w, 0, sizeof *w);
  w->be = be;
  for (int i = 0; i < NPAR; i++) {
    OK(ac_param_init(&w->params[i], be, names[i], ranks[i], dims[i]));
    w->ptrs[i] = &w->params[i];
    w->n[i] = w->params[i].value.numel;
    assert_int_equal(pc_layout_init(&w->lay[i], ranks[i], dims[i], &lo), PC_OK);
    w->g[i] = xcalloc(w->n[i], sizeof(float));
    w->m[i] = xcalloc(w->n[i], sizeof(float));
    w->v[i] = xcalloc(w->n[i], sizeof(float));
    w->buf[i] = xcalloc(w->n[i], sizeof(double));
    w->p[i] = xcalloc(w->n[i], sizeof(double));
    float *host = xcalloc(w->n[i], sizeof(float));
    for (size_t k = 0; k < w->n[i]; k++) w->p[i][k] = host[k] = frand();
    OK(ac_tensor_upload(&w->params[i].value, host));
    free(host);
  }
}

static void world_destroy(world *w) {
  for (int i = 0; i < NPAR; i++) {
    ac_param_destroy(&w->params[i]);
    pc_layout_destroy(&w->lay[i]);
    free(w->g[i]);
    free(w->m[i]);
    free(w->v[i]);
    free(w->buf[i]);
    free(w->p[i]);
  }
  for (int b = 0; b < NBLK; b++) {
    free(w->lf[b]);
    free(w->rf[b]);
    free(w->l64[b]);
    free(w->r64[b]);
  }
}

/* New gradients scaled by scale (0: zero gradients), on the host and the device. */
static void world_grads(world *w, float scale) {
  for (int i = 0; i < NPAR; i++) {
    for (size_t k = 0; k < w->n[i]; k++) w->g[i][k] = scale * frand();
    OK(ac_tensor_upload(&w->params[i].grad, w->g[i]));
  }
}

/* Block id b -> its parameter and pc_block (the worker's numbering, checked elsewhere). */
static const pc_block *block_of(const world *w, int b, int *param) {
  for (int i = 0; i < NPAR; i++) {
    if ((size_t)b < w->lay[i].nblocks) {
      *param = i;
      return &w->lay[i].blocks[b];
    }
    b -= (int)w->lay[i].nblocks;
  }
  fail_msg("no block %d", b);
  return NULL;
}

/* X = (S)^(-1/4) in fp64 for a random well-conditioned SPD S = M M^T / k + 0.1 I. */
static void random_root(size_t n, double *x) {
  const size_t k = n + 3;
  double *mtx = xcalloc(n * k, sizeof(double)), *s = xcalloc(n * n, sizeof(double));
  double *wv = xcalloc(n, sizeof(double));
  for (size_t i = 0; i < n * k; i++) mtx[i] = frand();
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) {
      double acc = i == j ? 0.1 : 0.0;
      for (size_t q = 0; q < k; q++) acc += mtx[i * k + q] * mtx[j * k + q] / (double)k;
      s[i * n + j] = acc;
    }
  assert_int_equal(LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', (lapack_int)n, s, (lapack_int)n, wv),
                   0);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) {
      double acc = 0.0;
      for (size_t q = 0; q < n; q++) acc += s[i * n + q] * s[j * n + q] * pow(wv[q], -0.25);
      x[i * n + j] = acc;
    }
  free(mtx);
  free(s);
  free(wv);
}

/* Makes the roots of block b (sides as asked) in w->lf/rf and w->l64/r64. */
static void make_roots(world *w, int b, int left, int right) {
  int par;
  const pc_block *blk = block_of(w, b, &par);
  size_t sizes[2] = {blk->rows, blk->cols};
  float **f[2] = {&w->lf[b], &w->rf[b]};
  double **d[2] = {&w->l64[b], &w->r64[b]};
  int want[2] = {left, right};
  for (int s = 0; s < 2; s++) {
    free(*f[s]);
    free(*d[s]);
    *f[s] = NULL;
    *d[s] = NULL;
    if (!want[s]) continue;
    size_t n = sizes[s];
    double *x = xcalloc(n * n, sizeof(double));
    random_root(n, x);
    *f[s] = xcalloc(n * n, sizeof(float));
    *d[s] = xcalloc(n * n, sizeof(double));
    for (size_t q = 0; q < n * n; q++) {
      (*f[s])[q] = (float)x[q];
      (*d[s])[q] = (*f[s])[q]; /* the reference uses exactly the values handed over */
    }
    free(x);
  }
}

/* The packed upper triangle of dense (n x n), in a new buffer the caller frees. */
static float *pack(size_t n, const float *dense) {
  float *p = xcalloc(ac_packed_len(n), sizeof(float));
  pc_pack_f32(n, dense, p);
  return p;
}

/* Hands block b's roots to the worker in format fmt, with source step w->src[b]. */
static int give_roots(world *w, ac_shampoo *s, int b, uint64_t version, ac_root_format fmt) {
  int par;
  const pc_block *blk = block_of(w, b, &par);
  const float *l = w->lf[b], *r = w->rf[b];
  float *lp = NULL, *rp = NULL;
  if (fmt == AC_ROOT_PACKED) {
    l = lp = l != NULL ? pack(blk->rows, l) : NULL;
    r = rp = r != NULL ? pack(blk->cols, r) : NULL;
  }
  const ac_shampoo_roots roots = {
      .version = version,
      .source_step = w->src[b],
      .format = fmt,
      .n_left = l != NULL ? blk->rows : 0,
      .left = l,
      .n_right = r != NULL ? blk->cols : 0,
      .right = r,
  };
  int rc = ac_shampoo_set_roots(s, (size_t)b, &roots);
  free(lp);
  free(rp);
  return rc;
}

static double norm2(size_t n, const double *x) {
  double s = 0.0;
  for (size_t i = 0; i < n; i++) s += x[i] * x[i];
  return sqrt(s);
}

/* The reference update of step t: U[i] (fp64) for every parameter, from the host grads,
 * the reference graft state and the roots of blocks that are active at t. */
static void ref_direction(world *w, const ac_shampoo_opts *o, long t, double **u) {
  int b0 = 0;
  for (int i = 0; i < NPAR; i++) {
    const size_t n = w->n[i];
    float *d = xcalloc(n, sizeof(float));
    assert_int_equal(pc_graft_direction_f32(n, w->g[i], &o->graft, t, w->m[i], w->v[i], d), PC_OK);
    for (size_t k = 0; k < n; k++) u[i][k] = d[k];
    const size_t ld = w->lay[i].cols;
    for (size_t q = 0; q < w->lay[i].nblocks && t >= o->start_step; q++) {
      const int b = b0 + (int)q;
      const pc_block *blk = &w->lay[i].blocks[q];
      const size_t r = blk->rows, c = blk->cols;
      const long age = (long)w->src[b] >= t ? 0 : t - (long)w->src[b];
      if ((w->l64[b] == NULL && w->r64[b] == NULL) ||
          (o->max_staleness > 0 && age > o->max_staleness))
        continue;
      double *gb = xcalloc(r * c, sizeof(double)), *pb = xcalloc(r * c, sizeof(double));
      double *db = xcalloc(r * c, sizeof(double));
      for (size_t y = 0; y < r; y++)
        for (size_t x = 0; x < c; x++) {
          gb[y * c + x] = w->g[i][(blk->row0 + y) * ld + blk->col0 + x];
          db[y * c + x] = d[(blk->row0 + y) * ld + blk->col0 + x];
        }
      assert_int_equal(pc_direction_f64(r, c, w->l64[b], gb, c, w->r64[b], pb), PC_OK);
      const double np = norm2(r * c, pb), nd = norm2(r * c, db);
      for (size_t y = 0; y < r; y++)
        for (size_t x = 0; x < c; x++)
          u[i][(blk->row0 + y) * ld + blk->col0 + x] =
              np > 0.0 ? pb[y * c + x] * (nd / np) : db[y * c + x];
      free(gb);
      free(pb);
      free(db);
    }
    b0 += (int)w->lay[i].nblocks;
    free(d);
  }
}

/* One step on the worker and on the reference; checks the parameters against it. */
static void step_and_check(world *w, ac_shampoo *s, const ac_shampoo_opts *o, float lr,
                           double tol) {
  const long t = ac_shampoo_steps(s) + 1;
  double *u[NPAR];
  for (int i = 0; i < NPAR; i++) u[i] = xcalloc(w->n[i], sizeof(double));
  ref_direction(w, o, t, u);
  OK(ac_shampoo_step(s, lr));
  assert_int_equal(ac_shampoo_steps(s), t);

  for (int i = 0; i < NPAR; i++) {
    const size_t n = w->n[i];
    double scale = 1e-30, err = 0.0;
    size_t at = 0;
    float *got = xcalloc(n, sizeof(float));
    double *before = xcalloc(n, sizeof(double));
    memcpy(before, w->p[i], n * sizeof(double));
    for (size_t k = 0; k < n; k++) {
      double step = u[i][k];
      if (o->momentum > 0.0f) {
        w->buf[i][k] = o->momentum * w->buf[i][k] + u[i][k];
        step = o->nesterov ? u[i][k] + o->momentum * w->buf[i][k] : w->buf[i][k];
      }
      w->p[i][k] -= lr * (step + o->weight_decay * w->p[i][k]);
    }
    OK(ac_tensor_download(&w->params[i].value, got));
    /* Compare the change of the parameter, relative to the largest change. */
    for (size_t k = 0; k < n; k++)
      if (fabs(w->p[i][k] - before[k]) > scale) scale = fabs(w->p[i][k] - before[k]);
    for (size_t k = 0; k < n; k++)
      if (fabs(got[k] - w->p[i][k]) > err) {
        err = fabs(got[k] - w->p[i][k]);
        at = k;
      }
    if (!(err <= tol * scale))
      fail_msg("step %ld, param %s[%zu]: got %.9g, want %.9g (error %.3g, step size %.3g)", t,
               names[i], at, got[at], w->p[i][at], err, scale);
    /* Keep the reference on the worker's values, so that errors do not compound. */
    for (size_t k = 0; k < n; k++) w->p[i][k] = got[k];
    free(got);
    free(before);
    free(u[i]);
  }
}

static void base_opts(ac_shampoo_opts *o, pc_graft kind) {
  ac_shampoo_opts_default(o);
  layout_opts(&o->layout);
  pc_graft_opts_default(&o->graft, kind);
  o->graft.eps = 1e-6;
  o->momentum = 0.0f;
  o->beta1 = 0.0f; /* the raw gradient: the reference grafts it (first moment: own test) */
  o->beta1_nesterov = 0;
}

/* ------------------------------------------------------------------------------------ */
/* Layout and statistics                                                                   */

/* Right after ac_shampoo_compute_stats, at a due step: ac_shampoo_compute_stats_into gives
 * the same floats in the caller's memory for the blocks given a destination (every other
 * one here), writes nothing past them, leaves the others alone, and invalidates s's own. */
static void stats_into_same(ac_shampoo *s) {
  float *l[NBLK], *r[NBLK];
  const float *gl[NBLK], *gr[NBLK];
  size_t nl[NBLK], nr[NBLK];
  long t = 0;
  assert_int_equal(ac_shampoo_stats_due(s, &t), 1);
  for (size_t b = 0; b < NBLK; b++) {
    ac_shampoo_block info;
    OK(ac_shampoo_block_info(s, b, &info));
    OK(ac_shampoo_block_stats(s, b, &gl[b], &gr[b]));
    nl[b] = ac_packed_len(info.block.rows);
    nr[b] = ac_packed_len(info.block.cols);
    l[b] = b % 2 == 0 ? xcalloc(nl[b] + 1, sizeof(float)) : NULL;
    r[b] = b % 2 == 0 ? xcalloc(nr[b] + 1, sizeof(float)) : NULL;
    if (l[b] != NULL) l[b][nl[b]] = r[b][nr[b]] = -7.0f; /* guards */
  }
  int due = -1;
  long step = 0;
  OK(ac_shampoo_compute_stats_into(s, l, r, &due, &step));
  assert_int_equal(due, 1);
  assert_int_equal(step, t);
  for (size_t b = 0; b < NBLK; b += 2) {
    assert_memory_equal(l[b], gl[b], nl[b] * sizeof(float));
    assert_memory_equal(r[b], gr[b], nr[b] * sizeof(float));
    assert_true(l[b][nl[b]] == -7.0f && r[b][nr[b]] == -7.0f);
    free(l[b]);
    free(r[b]);
  }
  assert_int_equal(ac_shampoo_block_stats(s, 0, NULL, NULL), AC_EINVAL);
  assert_int_equal(ac_shampoo_compute_stats_into(s, NULL, r, &due, NULL), AC_EINVAL);
  l[0] = xcalloc(nl[0], sizeof(float));
  r[0] = NULL; /* a left destination needs a right one */
  assert_int_equal(ac_shampoo_compute_stats_into(s, l, r, NULL, NULL), AC_EINVAL);
  free(l[0]);
}

static void test_layout_and_stats(void **state) {
  ac_backend *be = backend(state);
  world w;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;
  int due = -1;
  long step = 0;

  world_init(&w, be);
  base_opts(&o, PC_GRAFT_SGD);
  o.stats_interval = 3;
  OK(ac_shampoo_create(&s, w.ptrs, NPAR, &o));
  assert_int_equal(ac_shampoo_nblocks(s), NBLK);
  assert_int_equal(ac_shampoo_block_stats(s, 0, NULL, NULL), AC_EINVAL); /* none yet */

  /* The worker's layouts are pc_layout_init's, block for block, numbered in order. */
  size_t b = 0;
  for (int i = 0; i < NPAR; i++) {
    const pc_layout *l = ac_shampoo_layout(s, (size_t)i);
    assert_non_null(l);
    assert_int_equal(l->diagonal, w.lay[i].diagonal);
    assert_int_equal(l->rows, w.lay[i].rows);
    assert_int_equal(l->cols, w.lay[i].cols);
    assert_int_equal(l->nblocks, w.lay[i].nblocks);
    for (size_t q = 0; q < l->nblocks; q++, b++) {
      ac_shampoo_block info;
      OK(ac_shampoo_block_info(s, b, &info));
      assert_int_equal(info.param, i);
      assert_int_equal(info.index, q);
      assert_memory_equal(&info.block, &w.lay[i].blocks[q], sizeof(pc_block));
      assert_int_equal(info.version, 0);
      assert_int_equal(info.fallback_steps, 0);
    }
  }
  assert_true(w.lay[2].diagonal && w.lay[3].diagonal);
  assert_null(ac_shampoo_layout(s, NPAR));
  ac_shampoo_block bad;
  assert_int_equal(ac_shampoo_block_info(s, NBLK, &bad), AC_EINVAL);

  for (long t = 1; t <= 7; t++) {
    world_grads(&w, 1.0f);
    OK(ac_shampoo_compute_stats(s, &due, &step));
    assert_int_equal(step, t);
    assert_int_equal(due, (t - 1) % 3 == 0);
    if (due) {
      /* Device G G^T and G^T G, packed, against pc_gram_f32 on the host. */
      for (b = 0; b < NBLK; b++) {
        int par;
        const pc_block *blk = block_of(&w, (int)b, &par);
        const size_t ld = w.lay[par].cols;
        float *l = xcalloc(ac_packed_len(blk->rows), sizeof(float));
        float *r = xcalloc(ac_packed_len(blk->cols), sizeof(float));
        const float *gl = NULL, *gr = NULL;
        assert_int_equal(
            pc_gram_f32(blk->rows, blk->cols, w.g[par] + blk->row0 * ld + blk->col0, ld, l, r),
            PC_OK);
        OK(ac_shampoo_block_stats(s, b, &gl, &gr));
        for (size_t k = 0; k < ac_packed_len(blk->rows); k++)
          assert_true(fabsf(gl[k] - l[k]) <= 1e-5f * (1.0f + fabsf(l[k])));
        for (size_t k = 0; k < ac_packed_len(blk->cols); k++)
          assert_true(fabsf(gr[k] - r[k]) <= 1e-5f * (1.0f + fabsf(r[k])));
        free(l);
        free(r);
      }
      stats_into_same(s);
    } else {
      assert_int_equal(ac_shampoo_stats_due(s, &step), 0);
      OK(ac_shampoo_compute_stats_into(s, NULL, NULL, &due, &step)); /* not due: nothing read */
      assert_int_equal(due, 0);
      assert_int_equal(step, t);
    }
    OK(ac_shampoo_step(s, 0.0f));
  }
  assert_int_equal(ac_shampoo_block_stats(s, NBLK, NULL, NULL), AC_EINVAL);
  ac_shampoo_destroy(s);
  world_destroy(&w);
}

/* ------------------------------------------------------------------------------------ */
/* The step against the reference                                                         */

/* Blocks' roots: both sides dense, both packed, left only, right only, none (fallback),
 * then both for the rank-3 tensor's blocks, then both (dense, packed) for "e"'s. */
static void give_all_roots(world *w, ac_shampoo *s, uint64_t version) {
  const int left[NBLK] = {1, 1, 1, 0, 0, 1, 1, 1, 1}, right[NBLK] = {1, 1, 0, 1, 0, 1, 1, 1, 1};
  for (int b = 0; b < NBLK; b++) {
    make_roots(w, b, left[b], right[b]);
    if (left[b] || right[b])
      OK(give_roots(w, s, b, version, b % 2 ? AC_ROOT_PACKED : AC_ROOT_DENSE));
  }
}

static void test_apply_each_graft(void **state) {
  ac_backend *be = backend(state);
  const pc_graft kinds[] = {PC_GRAFT_SGD,         PC_GRAFT_ADAGRAD, PC_GRAFT_RMSPROP_NORMED,
                            PC_GRAFT_ADAM_NORMED, PC_GRAFT_RMSPROP, PC_GRAFT_ADAM};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    world w;
    ac_shampoo *s = NULL;
    ac_shampoo_opts o;
    world_init(&w, be);
    base_opts(&o, kinds[k]);
    OK(ac_shampoo_create(&s, w.ptrs, NPAR, &o));
    give_all_roots(&w, s, 1);
    for (int t = 1; t <= 4; t++) {
      world_grads(&w, 0.5f);
      step_and_check(&w, s, &o, 0.05f, 2e-5);
    }
    /* Block 4 has no roots: it took the fallback every step, no other block did. */
    for (size_t b = 0; b < NBLK; b++) {
      ac_shampoo_block info;
      OK(ac_shampoo_block_info(s, b, &info));
      assert_int_equal(info.fallback_steps, b == 4 ? 4 : 0);
      assert_int_equal(info.version, b == 4 ? 0 : 1);
    }
    assert_int_equal(ac_shampoo_fallback_total(s), 4);
    ac_shampoo_destroy(s);
    world_destroy(&w);
  }
}

static void test_momentum_decay_start(void **state) {
  ac_backend *be = backend(state);
  world w;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;

  for (int nesterov = 0; nesterov <= 1; nesterov++) {
    world_init(&w, be);
    base_opts(&o, PC_GRAFT_ADAGRAD);
    o.momentum = 0.9f;
    o.nesterov = nesterov;
    o.weight_decay = 0.1f;
    o.start_step = 3;
    OK(ac_shampoo_create(&s, w.ptrs, NPAR, &o));
    give_all_roots(&w, s, 7);
    for (int t = 1; t <= 5; t++) {
      world_grads(&w, 0.5f);
      step_and_check(&w, s, &o, 0.05f, 2e-5);
    }
    /* Steps 1-2 fall back everywhere (before start_step); block 4 always. */
    for (size_t b = 0; b < NBLK; b++) {
      ac_shampoo_block info;
      OK(ac_shampoo_block_info(s, b, &info));
      assert_int_equal(info.fallback_steps, b == 4 ? 5 : 2);
    }
    assert_int_equal(ac_shampoo_fallback_total(s), NBLK * 2 + 3);
    ac_shampoo_destroy(s);
    world_destroy(&w);
  }
}

/* Roots from source step 2 with max_staleness 3: used up to step 5 (staleness 3; at steps
 * 1-2 they count as fresh), then every block falls back until newer roots arrive. */
static void test_staleness(void **state) {
  ac_backend *be = backend(state);
  world w;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;
  ac_shampoo_step_info si;
  ac_shampoo_block info;

  world_init(&w, be);
  base_opts(&o, PC_GRAFT_ADAGRAD);
  o.max_staleness = 3;
  OK(ac_shampoo_create(&s, w.ptrs, NPAR, &o));
  OK(ac_shampoo_last_step(s, &si));
  assert_int_equal(si.step, 0);
  for (int b = 0; b < NBLK; b++) w.src[b] = 2;
  give_all_roots(&w, s, 1);
  OK(ac_shampoo_block_info(s, 0, &info));
  assert_int_equal(info.source_step, 2);
  assert_int_equal(info.staleness, -1);
  for (long t = 1; t <= 7; t++) {
    if (t == 7) {
      for (int b = 0; b < NBLK; b++) w.src[b] = 6;
      give_all_roots(&w, s, 2);
    }
    world_grads(&w, 0.5f);
    step_and_check(&w, s, &o, 0.05f, 2e-5);
    OK(ac_shampoo_last_step(s, &si));
    assert_int_equal(si.step, t);
    const long age = t <= 2 ? 0 : t == 7 ? 1 : t - 2;
    const int used = t <= 5 || t == 7;
    assert_int_equal(si.preconditioned, used ? NBLK - 1 : 0); /* block 4 has no roots */
    assert_int_equal(si.fallback, used ? 1 : NBLK);
    assert_int_equal(si.staleness_max, used ? age : -1);
    if (used)
      assert_true(si.staleness_mean == (double)age);
    else
      assert_true(isnan(si.staleness_mean));
  }
  OK(ac_shampoo_block_info(s, 0, &info));
  assert_int_equal(info.staleness, 1);
  assert_int_equal(info.fallback_steps, 1); /* step 6 */
  OK(ac_shampoo_block_info(s, 4, &info));
  assert_int_equal(info.staleness, -1);
  assert_int_equal(info.fallback_steps, 7);
  assert_int_equal(ac_shampoo_last_step(s, NULL), AC_EINVAL);
  ac_shampoo_destroy(s);
  world_destroy(&w);
}

/* Zero gradients after some steps: P_b = 0 has no norm, so blocks take D_b (Adam's
 * momentum keeps it non-zero); nothing becomes NaN. Tiny gradients stay finite too. */
static void test_zero_and_tiny_grads(void **state) {
  ac_backend *be = backend(state);
  world w;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;

  world_init(&w, be);
  base_opts(&o, PC_GRAFT_ADAM_NORMED);
  OK(ac_shampoo_create(&s, w.ptrs, NPAR, &o));
  give_all_roots(&w, s, 1);
  world_grads(&w, 0.5f);
  step_and_check(&w, s, &o, 0.05f, 2e-5);
  world_grads(&w, 0.0f);
  step_and_check(&w, s, &o, 0.05f, 2e-5);
  world_grads(&w, 1e-41f); /* subnormal: |g| < FLT_MIN */
  OK(ac_shampoo_step(s, 0.05f));
  for (int i = 0; i < NPAR; i++) {
    float *got = xcalloc(w.n[i], sizeof(float));
    OK(ac_tensor_download(&w.params[i].value, got));
    for (size_t k = 0; k < w.n[i]; k++) assert_true(isfinite(got[k]));
    free(got);
  }
  ac_shampoo_destroy(s);
  world_destroy(&w);
}

/* ------------------------------------------------------------------------------------ */
/* Roots: versions and bad input                                                           */

/* Block 0 gets new roots (the left side, the right too if right) packed as version, which
 * it holds then; one step checked against the reference. */
static void roots_then_step(world *w, ac_shampoo *s, const ac_shampoo_opts *o, int right,
                            uint64_t version) {
  ac_shampoo_block info;
  make_roots(w, 0, 1, right);
  OK(give_roots(w, s, 0, version, AC_ROOT_PACKED));
  OK(ac_shampoo_block_info(s, 0, &info));
  assert_int_equal(info.version, version);
  world_grads(w, 0.5f);
  step_and_check(w, s, o, 0.1f, 2e-5);
}

static void test_roots_versions_and_errors(void **state) {
  ac_backend *be = backend(state);
  world w;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;
  ac_shampoo_block info;

  world_init(&w, be);
  base_opts(&o, PC_GRAFT_SGD);
  OK(ac_shampoo_create(&s, w.ptrs, NPAR, &o));
  give_all_roots(&w, s, 5);

  /* An older or equal version is ignored: the roots of version 5 stay in use. */
  float *keep_l = w.lf[0], *keep_r = w.rf[0];
  double *keep_l64 = w.l64[0], *keep_r64 = w.r64[0];
  w.lf[0] = w.rf[0] = NULL;
  w.l64[0] = w.r64[0] = NULL;
  make_roots(&w, 0, 1, 1);
  OK(give_roots(&w, s, 0, 3, AC_ROOT_DENSE));
  OK(give_roots(&w, s, 0, 5, AC_ROOT_PACKED));
  OK(ac_shampoo_block_info(s, 0, &info));
  assert_int_equal(info.version, 5);
  free(w.lf[0]);
  free(w.rf[0]);
  free(w.l64[0]);
  free(w.r64[0]);
  w.lf[0] = keep_l;
  w.rf[0] = keep_r;
  w.l64[0] = keep_l64;
  w.r64[0] = keep_r64;
  world_grads(&w, 0.5f);
  step_and_check(&w, s, &o, 0.1f, 2e-5);

  /* A newer one-sided version replaces both sides: the right becomes the identity. */
  roots_then_step(&w, s, &o, 0, 6);

  /* Bad input changes nothing. */
  float l16[16], l10[10];
  for (int i = 0; i < 16; i++) l16[i] = i == 0 || i == 5 || i == 10 || i == 15 ? 1.0f : 0.0f;
  for (int i = 0; i < 10; i++) l10[i] = 1.0f;
  const ac_shampoo_roots ok4 = {.version = 9, .format = AC_ROOT_DENSE, .n_left = 4, .left = l16};
  ac_shampoo_roots r;
  r = ok4, r.n_left = 3;
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EMISMATCH);
  r = ok4, r.n_right = 4; /* a size without its matrix */
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EMISMATCH);
  r = ok4, r.right = l16, r.n_right = 3; /* the block is 4 x 4 */
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EMISMATCH);
  r = ok4, r.left = NULL, r.n_left = 0;
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EINVAL);
  r = ok4, r.version = 0;
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EINVAL);
  r = ok4, r.format = (ac_root_format)3;
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EINVAL);
  assert_int_equal(ac_shampoo_set_roots(s, NBLK, &ok4), AC_EINVAL);
  assert_int_equal(ac_shampoo_set_roots(NULL, 0, &ok4), AC_EINVAL);
  assert_int_equal(ac_shampoo_set_roots(s, 0, NULL), AC_EINVAL);
  l10[7] = NAN;
  r = ok4, r.format = AC_ROOT_PACKED, r.left = l10;
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EINVAL);
  l10[7] = 1.0f;
  /* Both sides packed, only the right one bad: the left is not installed either (the CPU
   * backend checks while it unpacks into spare buffers). */
  float r10[10];
  for (int i = 0; i < 10; i++) r10[i] = i == 9 ? NAN : 1.0f;
  r = ok4, r.format = AC_ROOT_PACKED, r.left = l10, r.right = r10, r.n_right = 4;
  assert_int_equal(ac_shampoo_set_roots(s, 0, &r), AC_EINVAL);
  l16[3] = INFINITY;
  assert_int_equal(ac_shampoo_set_roots(s, 0, &ok4), AC_EINVAL);
  OK(ac_shampoo_block_info(s, 0, &info));
  assert_int_equal(info.version, 6);
  world_grads(&w, 0.5f);
  step_and_check(&w, s, &o, 0.1f, 2e-5);

  /* Dropped roots (read torn by reference): the grafted step until a version comes again,
   * the same version included. */
  OK(ac_shampoo_drop_roots(s, 0));
  OK(ac_shampoo_block_info(s, 0, &info));
  assert_int_equal(info.version, 0);
  make_roots(&w, 0, 0, 0); /* the reference: no roots, the fallback */
  world_grads(&w, 0.5f);
  step_and_check(&w, s, &o, 0.1f, 2e-5);
  roots_then_step(&w, s, &o, 1, 6);
  assert_int_equal(ac_shampoo_drop_roots(s, NBLK), AC_EINVAL);
  assert_int_equal(ac_shampoo_drop_roots(NULL, 0), AC_EINVAL);

  ac_shampoo_destroy(s);
  world_destroy(&w);
}

static void test_create_errors(void **state) {
  ac_backend *be = backend(state);
  world w;
  ac_shampoo *s = NULL;
  ac_shampoo_opts good, o;

  world_init(&w, be);
  base_opts(&good, PC_GRAFT_ADAM_NORMED);
  good.momentum = 0.9f;

#define BAD(field, value)                                                 \
  do {                                                                    \
    o = good;                                                             \
    o.field = value;                                                      \
    s = (ac_shampoo *)&w;                                                 \
    assert_int_equal(ac_shampoo_create(&s, w.ptrs, NPAR, &o), AC_EINVAL); \
    assert_null(s);                                                       \
  } while (0)
  BAD(layout.block_size, 0);
  BAD(layout.skip_limit, 0);
  BAD(momentum, 1.0f);
  BAD(momentum, -0.1f);
  BAD(weight_decay, -1.0f);
  BAD(weight_decay, NAN);
  BAD(stats_interval, 0);
  BAD(start_step, 0);
  BAD(max_staleness, -1);
  BAD(beta2, 1.5f);
  BAD(epsilon, 0.0);
  BAD(graft.kind, (pc_graft)9);
  BAD(graft.eps, 0.0);
  BAD(graft.eps, 1e-50); /* zero as a float */
  BAD(graft.beta1, 1.0);
  BAD(graft.beta2, -0.5);
  BAD(root_method, PC_METHOD_NEWTON_TEXTBOOK); /* a comparison iteration, not a run's */
  BAD(root_method, (pc_method)7);
  BAD(root_exponent, 0);
  BAD(root_exponent, 65);
#undef BAD
  o = good;
  o.momentum = 0.0f;
  o.nesterov = 1;
  assert_int_equal(ac_shampoo_create(&s, w.ptrs, NPAR, &o), AC_EINVAL);
  o = good;
  o.beta1_nesterov = 1; /* needs beta1 > 0 */
  assert_int_equal(ac_shampoo_create(&s, w.ptrs, NPAR, &o), AC_EINVAL);
  o.beta1 = 1.0f;
  assert_int_equal(ac_shampoo_create(&s, w.ptrs, NPAR, &o), AC_EINVAL);
  o.beta1 = 0.9f; /* the normed grafts take the raw gradient only */
  assert_int_equal(ac_shampoo_create(&s, w.ptrs, NPAR, &o), AC_EINVAL);
  o.graft.kind = PC_GRAFT_ADAM;
  OK(ac_shampoo_create(&s, w.ptrs, NPAR, &o));
  ac_shampoo_destroy(s);
  s = NULL;
  o.one_sided = 2;
  assert_int_equal(ac_shampoo_create(&s, w.ptrs, NPAR, &o), AC_EINVAL);
  assert_int_equal(ac_shampoo_create(NULL, w.ptrs, NPAR, &good), AC_EINVAL);
  assert_int_equal(ac_shampoo_create(&s, NULL, NPAR, &good), AC_EINVAL);
  assert_int_equal(ac_shampoo_create(&s, w.ptrs, 0, &good), AC_EINVAL);

  OK(ac_shampoo_create(&s, w.ptrs, NPAR, NULL)); /* defaults */
  assert_int_equal(ac_shampoo_step(s, -1.0f), AC_EINVAL);
  assert_int_equal(ac_shampoo_step(s, NAN), AC_EINVAL);
  assert_int_equal(ac_shampoo_step(NULL, 0.1f), AC_EINVAL);
  assert_int_equal(ac_shampoo_compute_stats(NULL, NULL, NULL), AC_EINVAL);
  assert_int_equal(ac_shampoo_steps(s), 0);
  assert_int_equal(ac_shampoo_nblocks(NULL), 0);
  ac_shampoo_destroy(s);
  ac_shampoo_destroy(NULL);
  world_destroy(&w);
}

/* A scalar parameter (rank 0) is laid out as shape {1}: diagonal, grafted step only. */
static void test_scalar_param(void **state) {
  ac_backend *be = backend(state);
  ac_param p;
  ac_param *ptr = &p;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;
  const float v0 = 2.0f, g = 0.5f;
  float v = 0.0f;

  OK(ac_param_init(&p, be, "scale", 0, NULL));
  OK(ac_tensor_upload(&p.value, &v0));
  OK(ac_tensor_upload(&p.grad, &g));
  base_opts(&o, PC_GRAFT_SGD);
  OK(ac_shampoo_create(&s, &ptr, 1, &o));
  assert_int_equal(ac_shampoo_nblocks(s), 0);
  assert_true(ac_shampoo_layout(s, 0)->diagonal);
  int due = -1;
  OK(ac_shampoo_compute_stats(s, &due, NULL)); /* due, with nothing to compute */
  assert_int_equal(due, 1);
  OK(ac_shampoo_step(s, 0.1f));
  OK(ac_tensor_download(&p.value, &v));
  assert_true(fabsf(v - (v0 - 0.1f * g)) <= 1e-6f);
  assert_int_equal(ac_shampoo_fallback_total(s), 0);
  ac_shampoo_destroy(s);
  ac_param_destroy(&p);
}

/* ------------------------------------------------------------------------------------ */
/* First moment                                                                            */

/* One 2 x 2 parameter (one block), grads g1 then g2, beta1 0.5, SGD graft (D = M), and a
 * left root diag(1, 2) from step 1: each step must be -lr * P with P = L M rescaled to |M|,
 * M the bias-corrected first moment worked out by hand below. */
static void check_first_moment(ac_backend *be, int nesterov) {
  static const float g[2][4] = {{1, 2, 3, 4}, {3, 2, 1, 0}};
  /* f1 = 0.5 g1 = (.5, 1, 1.5, 2); f2 = 0.5 f1 + 0.5 g2 = (1.75, 1.5, 1.25, 1).
   * Plain:    M1 = f1 / 0.5 = g1;  M2 = f2 / 0.75.
   * Nesterov: M_t = 0.5 f_t / (1 - 0.5^(t+1)) + 0.5 g_t / (1 - 0.5^t):
   *           M1 = f1 / 1.5 + g1;  M2 = f2 / 1.75 + g2 / 1.5. */
  static const double plain[2][4] = {{1, 2, 3, 4},
                                     {1.75 / 0.75, 1.5 / 0.75, 1.25 / 0.75, 1.0 / 0.75}};
  static const double nest[2][4] = {
      {0.5 / 1.5 + 1, 1 / 1.5 + 2, 1.5 / 1.5 + 3, 2 / 1.5 + 4},
      {1.75 / 1.75 + 2, 1.5 / 1.75 + 2 / 1.5, 1.25 / 1.75 + 1 / 1.5, 1.0 / 1.75}};
  const size_t shape[2] = {2, 2};
  const float lroot[4] = {1, 0, 0, 2}, lr = 0.1f;
  ac_param p;
  ac_param *ptr = &p;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;
  float v[4] = {0}, before[4] = {0};

  OK(ac_param_init(&p, be, "w", 2, shape));
  OK(ac_tensor_upload(&p.value, v));
  base_opts(&o, PC_GRAFT_SGD);
  o.beta1 = 0.5f;
  o.beta1_nesterov = nesterov;
  OK(ac_shampoo_create(&s, &ptr, 1, &o));
  const ac_shampoo_roots roots = {
      .version = 1, .source_step = 1, .format = AC_ROOT_DENSE, .n_left = 2, .left = lroot};
  OK(ac_shampoo_set_roots(s, 0, &roots));
  for (int t = 0; t < 2; t++) {
    const double *m = nesterov ? nest[t] : plain[t];
    double lm[4], nm = 0.0, nlm = 0.0;
    for (int k = 0; k < 4; k++) {
      lm[k] = m[k] * (k < 2 ? 1.0 : 2.0); /* diag(1, 2) scales the second row */
      nm += m[k] * m[k];
      nlm += lm[k] * lm[k];
    }
    OK(ac_tensor_upload(&p.grad, g[t]));
    memcpy(before, v, sizeof v);
    OK(ac_shampoo_step(s, lr));
    OK(ac_tensor_download(&p.value, v));
    for (int k = 0; k < 4; k++) {
      const double want = -lr * lm[k] * sqrt(nm / nlm);
      if (!(fabs((v[k] - before[k]) - want) <= 1e-5 * fabs(want) + 1e-7))
        fail_msg("nesterov %d, step %d, [%d]: step %.9g, want %.9g", nesterov, t + 1, k,
                 v[k] - before[k], want);
    }
  }
  ac_shampoo_destroy(s);
  ac_param_destroy(&p);
}

/* The Adam graft with the first moment on: D = M / (sqrt(v / c2) + eps), v the second
 * moment of the raw gradient, M the shared first moment (no second filtering). The
 * parameter takes D: it has no factors (rank 1). */
static void check_adam_graft_first_moment(ac_backend *be) {
  static const float g[2][4] = {{1, 2, 3, 4}, {3, 2, 1, 0}};
  /* beta1 = beta2 = 0.5: M as in check_first_moment; v1 = .5 g1^2, v1 / c2 = g1^2, so
   * D1 = 1; v2 = .25 g1^2 + .5 g2^2 = (4.75, 3, 2.75, 4), c2 = .75. */
  static const double v2[4] = {4.75, 3, 2.75, 4};
  static const double m2[4] = {1.75 / 0.75, 1.5 / 0.75, 1.25 / 0.75, 1.0 / 0.75};
  const size_t shape[1] = {4};
  const float lr = 0.1f;
  ac_param p;
  ac_param *ptr = &p;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;
  float v[4] = {0}, before[4];

  OK(ac_param_init(&p, be, "b", 1, shape));
  OK(ac_tensor_upload(&p.value, v));
  base_opts(&o, PC_GRAFT_ADAM);
  o.graft.beta2 = 0.5;
  o.graft.eps = 1e-12;
  o.beta1 = 0.5f;
  OK(ac_shampoo_create(&s, &ptr, 1, &o));
  for (int t = 0; t < 2; t++) {
    OK(ac_tensor_upload(&p.grad, g[t]));
    memcpy(before, v, sizeof v);
    OK(ac_shampoo_step(s, lr));
    OK(ac_tensor_download(&p.value, v));
    for (int k = 0; k < 4; k++) {
      const double d = t == 0 ? 1.0 : m2[k] / sqrt(v2[k] / 0.75), want = -lr * d;
      if (!(fabs((v[k] - before[k]) - want) <= 1e-5 * fabs(want)))
        fail_msg("step %d, [%d]: step %.9g, want %.9g", t + 1, k, v[k] - before[k], want);
    }
  }
  ac_shampoo_destroy(s);
  ac_param_destroy(&p);
}

static void test_first_moment(void **state) {
  ac_backend *be = backend(state);
  check_first_moment(be, 0);
  check_first_moment(be, 1);
  check_adam_graft_first_moment(be);
}

/* One-sided: only the root of the smaller side (of order > 1) is applied. A 2 x 4 block with
 * roots on both sides uses the left one only; the right root here would change the result. */
static void test_one_sided(void **state) {
  ac_backend *be = backend(state);
  const size_t shape[2] = {2, 4};
  const float g[8] = {1, 2, 3, 4, 5, 6, 7, 8}, lroot[4] = {1, 0, 0, 3}, lr = 0.5f;
  float rroot[16] = {0}, v[8] = {0};
  for (int k = 0; k < 4; k++) rroot[k * 4 + k] = (float)(k + 1);
  ac_param p;
  ac_param *ptr = &p;
  ac_shampoo *s = NULL;
  ac_shampoo_opts o;

  OK(ac_param_init(&p, be, "w", 2, shape));
  OK(ac_tensor_upload(&p.value, v));
  OK(ac_tensor_upload(&p.grad, g));
  base_opts(&o, PC_GRAFT_SGD);
  o.one_sided = 1;
  OK(ac_shampoo_create(&s, &ptr, 1, &o));
  const ac_shampoo_roots roots = {.version = 1,
                                  .source_step = 1,
                                  .format = AC_ROOT_DENSE,
                                  .n_left = 2,
                                  .left = lroot,
                                  .n_right = 4,
                                  .right = rroot};
  OK(ac_shampoo_set_roots(s, 0, &roots));
  OK(ac_shampoo_step(s, lr));
  OK(ac_tensor_download(&p.value, v));
  /* P = diag(1, 3) G rescaled to |G| */
  double ng = 0.0, np = 0.0;
  for (int k = 0; k < 8; k++) {
    const double pk = g[k] * (k < 4 ? 1.0 : 3.0);
    ng += (double)g[k] * g[k];
    np += pk * pk;
  }
  for (int k = 0; k < 8; k++) {
    const double want = -lr * g[k] * (k < 4 ? 1.0 : 3.0) * sqrt(ng / np);
    assert_true(fabs(v[k] - want) <= 1e-5 * fabs(want));
  }
  ac_shampoo_destroy(s);
  ac_param_destroy(&p);
}

/* ------------------------------------------------------------------------------------ */
/* Groups                                                                                  */

#define WORKER_TESTS                                                                          \
  cmocka_unit_test(test_layout_and_stats), cmocka_unit_test(test_apply_each_graft),           \
      cmocka_unit_test(test_momentum_decay_start), cmocka_unit_test(test_staleness),          \
      cmocka_unit_test(test_zero_and_tiny_grads),                                             \
      cmocka_unit_test(test_roots_versions_and_errors), cmocka_unit_test(test_create_errors), \
      cmocka_unit_test(test_scalar_param), cmocka_unit_test(test_first_moment),               \
      cmocka_unit_test(test_one_sided)

int main(void) {
  const struct CMUnitTest cpu[] = {WORKER_TESTS};
  const struct CMUnitTest cuda[] = {WORKER_TESTS};
  int failed = cmocka_run_group_tests_name("cpu", cpu, setup_cpu, teardown);
  failed += cmocka_run_group_tests_name("cuda", cuda, setup_cuda, teardown);
  return failed;
}
