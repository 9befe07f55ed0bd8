/* test_mode_kfac.c -- unit tests of host/mode_kfac.c, the K-FAC entry of the mode table,
 * driven through the table, the store and the pool: layout (layers, diagonal tensors),
 * option defaults from pc_kfac_opts_default, the fold (first push as is, then the running
 * average), the damped inverses against LAPACK in double, pi-damping, inv_every, and a
 * failed inverse keeping the previous one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "precondd.h"
#include "preconditioner.h"

typedef struct {
  pd_stats stats;
  pd_store st;
} fixture;

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  if (!f || pd_stats_init(&f->stats) != PD_OK ||
      pd_store_init(&f->st, &f->stats, (size_t)1 << 30, 100) != PD_OK)
    return -1;
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  pd_store_destroy(&f->st);
  pd_stats_destroy(&f->stats);
  free(f);
  return 0;
}

/* A K-FAC job: fc [4, 6] (out 4, in 5 + bias) -> A 6, G 4; conv [3, 2, 2, 2] -> A 8, G 3;
 * bn [3] -> diagonal. */
static pd_job *kfac_job(fixture *f, pd_kfac_opts *o) {
  const pd_mode *m = pd_mode_find(PD_MODE_KFAC);
  assert_non_null(m);
  char err[256];
  _Alignas(max_align_t) unsigned char opts[PD_MODE_OPTS_MAX] = {0};
  memcpy(opts, o, sizeof *o);
  assert_int_equal(m->resolve(opts, err, sizeof err), PD_OK);
  memcpy(o, opts, sizeof *o);
  uint64_t d0[2] = {4, 6}, d1[4] = {3, 2, 2, 2}, d2[1] = {3};
  pd_tensor t[3] = {{(char *)"fc", 2, d0}, {(char *)"conv", 4, d1}, {(char *)"bn", 1, d2}};
  pd_job *job = NULL, *existing = NULL;
  assert_int_equal(pd_job_build("k", m, opts, 3, t, 100, &job, err, sizeof err), PD_OK);
  assert_int_equal(pd_store_add(&f->st, job, &existing), PD_OK);
  return job;
}

/* A packed SPD factor of order n: M M^T / k + 0.1 I from a fixed pseudo-random M. */
static void spd(size_t n, unsigned seed, float *packed) {
  double m[16][16];
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < 16; j++) {
      seed = seed * 1103515245u + 12345u;
      m[i][j] = (double)((seed >> 8) & 0xffff) / 65536.0 - 0.5;
    }
  size_t p = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++) {
      double s = i == j ? 0.1 : 0.0;
      for (size_t k = 0; k < 16; k++) s += m[i][k] * m[j][k] / 16.0;
      packed[p++] = (float)s;
    }
}

/* (F + d I)^-1 in double by LAPACK (potrf + potri), dense n x n both triangles. */
static void lapack_inverse(size_t n, const float *packed, double d, double *x) {
  size_t p = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++) {
      x[i * n + j] = x[j * n + i] = packed[p++];
      if (i == j) x[i * n + i] += d;
    }
  assert_int_equal(LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'U', (lapack_int)n, x, (lapack_int)n), 0);
  assert_int_equal(LAPACKE_dpotri(LAPACK_ROW_MAJOR, 'U', (lapack_int)n, x, (lapack_int)n), 0);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++) x[j * n + i] = x[i * n + j];
}

static double trace(size_t n, const float *packed) {
  double t = 0;
  for (size_t i = 0, p = 0; i < n; p += n - i, i++) t += packed[p];
  return t;
}

static void test_layout_and_defaults(void **state) {
  fixture *f = *state;
  pd_kfac_opts o = {0};
  pd_job *job = kfac_job(f, &o);
  pc_kfac_opts def;
  pc_kfac_opts_default(&def);
  assert_true(o.factor_decay == def.factor_decay);
  assert_true(o.damping == def.damping);
  assert_int_equal(o.inv_every, def.inv_every);
  assert_int_equal(o.no_pi_damping, 0);
  assert_int_equal(job->nblocks, 2);
  assert_int_equal(job->ndiag, 1);
  assert_int_equal(job->diag[0], 2);
  assert_int_equal(job->blocks[0].order[0], 6); /* A: in + bias */
  assert_int_equal(job->blocks[0].order[1], 4); /* G: out */
  assert_int_equal(job->blocks[1].order[0], 8);
  assert_int_equal(job->blocks[1].order[1], 3);

  /* Refused options name their field. */
  const pd_mode *m = pd_mode_find(PD_MODE_KFAC);
  char err[256];
  pd_kfac_opts bad = {.factor_decay = 1.5};
  assert_int_equal(m->resolve(&bad, err, sizeof err), PD_EINVAL);
  assert_non_null(strstr(err, "kfac.factor_decay"));
  bad = (pd_kfac_opts){.damping = -1};
  assert_int_equal(m->resolve(&bad, err, sizeof err), PD_EINVAL);
  assert_non_null(strstr(err, "kfac.damping"));
  bad = (pd_kfac_opts){.inverse = 9};
  assert_int_equal(m->resolve(&bad, err, sizeof err), PD_EINVAL);
  assert_non_null(strstr(err, "kfac.inverse"));

  /* The snapshot section round-trips the resolved options. */
  unsigned char sec[64];
  assert_true(m->snap_bytes <= sizeof sec);
  _Alignas(max_align_t) unsigned char back[PD_MODE_OPTS_MAX] = {0};
  m->snap_write(job->opts, sec);
  m->snap_read(sec, back);
  assert_memory_equal(back, job->opts, m->opts_size);
}

static void test_fold(void **state) {
  fixture *f = *state;
  pd_kfac_opts o = {.factor_decay = 0.5};
  pd_job *job = kfac_job(f, &o);
  pd_block *b = &job->blocks[0];
  float a1[21], g1[10], a2[21], g2[10];
  spd(6, 1, a1);
  spd(4, 2, g1);
  spd(6, 3, a2);
  spd(4, 4, g2);
  const float *p1[2] = {a1, g1}, *p2[2] = {a2, g2};
  pd_block_update(b, p1, 1, &f->stats);
  assert_memory_equal(b->stat[0], a1, sizeof a1); /* the first push as is */
  assert_memory_equal(b->stat[1], g1, sizeof g1);
  pd_block_update(b, p2, 2, &f->stats);
  for (int i = 0; i < 21; i++) assert_float_equal(b->stat[0][i], 0.5f * (a1[i] + a2[i]), 1e-6);
  for (int i = 0; i < 10; i++) assert_float_equal(b->stat[1][i], 0.5f * (g1[i] + g2[i]), 1e-6);
}

/* One layer's published inverses against LAPACK in double with the hand-computed
 * pi-damping; with pi-damping off the split is sqrt(lambda) on both sides. */
static void check_inverses(fixture *f, int no_pi) {
  pd_kfac_opts o = {.damping = 1e-2, .no_pi_damping = no_pi};
  pd_job *job = kfac_job(f, &o);
  pd_block *b = &job->blocks[1];
  float a[36], g[6];
  spd(8, 5, a);
  spd(3, 6, g);
  for (int i = 0; i < 6; i++) g[i] *= 40.0f; /* traces far apart: pi far from 1 */
  const float *p[2] = {a, g};
  pd_block_update(b, p, 7, &f->stats);
  pd_sched_rules rules = {0.1, 0.0, NULL, 0, 0};
  pd_root_outcome out;
  assert_int_equal(pd_sched_compute(b, &f->stats, &rules, &out), PD_OK);
  assert_int_equal(out, PD_ROOT_PUBLISHED);
  pd_root *r = b->root;
  assert_int_equal(r->source_step, 7);
  assert_int_equal(r->method, PC_KFAC_INV_CHOLESKY); /* the measured default */
  double pi = no_pi ? 1.0 : sqrt((trace(8, a) / 8) / (trace(3, g) / 3));
  if (!no_pi) assert_true(pi < 0.5); /* the case exercises the split */
  assert_float_equal(r->aux[PD_KFAC_AUX_PI], pi, 1e-9 * pi);
  double damp[2] = {pi * sqrt(1e-2), sqrt(1e-2) / pi};
  assert_float_equal(r->aux[PD_KFAC_AUX_DAMP_A], damp[0], 1e-12);
  assert_float_equal(r->aux[PD_KFAC_AUX_DAMP_G], damp[1], 1e-12);
  const float *fac[2] = {a, g};
  for (int k = 0; k < 2; k++) {
    size_t n = b->order[k];
    double x[64];
    lapack_inverse(n, fac[k], damp[k], x);
    double maxabs = 0, maxerr = 0;
    for (size_t i = 0, q = 0; i < n; i++)
      for (size_t j = i; j < n; j++, q++) {
        maxabs = fmax(maxabs, fabs(x[i * n + j]));
        maxerr = fmax(maxerr, fabs(x[i * n + j] - (double)r->part[k][q]));
      }
    assert_true(maxerr <= 1e-4 * maxabs); /* fp32 against double */
  }
}

static void test_inverses_against_lapack(void **state) {
  check_inverses(*state, 0);
}
static void test_inverses_without_pi(void **state) {
  check_inverses(*state, 1);
}

static void test_inv_every(void **state) {
  fixture *f = *state;
  pd_kfac_opts o = {.inv_every = 3};
  kfac_job(f, &o);
  const pd_mode *m = pd_mode_find(PD_MODE_KFAC);
  assert_non_null(m->compute_due);
  assert_true(m->compute_due(&o, NULL, 1, 1, 0, 0)); /* no inverse yet: every push */
  assert_true(m->compute_due(&o, NULL, 2, 2, 0, 0));
  assert_false(m->compute_due(&o, NULL, 1, 1, 0, 1));
  assert_false(m->compute_due(&o, NULL, 2, 2, 0, 1));
  assert_true(m->compute_due(&o, NULL, 3, 3, 0, 1));
  assert_false(m->compute_due(&o, NULL, 4, 4, 0, 1));
  assert_true(m->compute_due(&o, NULL, 6, 6, 0, 1));
}

/* A factor that is not positive definite even damped: Cholesky fails, the previous
 * inverses stay published, the failure is counted and named. */
static void test_failed_inverse_keeps_previous(void **state) {
  fixture *f = *state;
  pd_kfac_opts o = {.factor_decay = 0.5};
  pd_job *job = kfac_job(f, &o);
  pd_block *b = &job->blocks[0];
  float a[21], g[10];
  spd(6, 7, a);
  spd(4, 8, g);
  const float *p[2] = {a, g};
  pd_block_update(b, p, 1, &f->stats);
  pd_sched_rules rules = {0.1, 0.0, NULL, 0, 0};
  pd_root_outcome out;
  assert_int_equal(pd_sched_compute(b, &f->stats, &rules, &out), PD_OK);
  assert_int_equal(out, PD_ROOT_PUBLISHED);
  pd_root *first = b->root;
  float kept[21];
  memcpy(kept, first->part[0], sizeof kept);

  float neg[21];
  for (int i = 0; i < 21; i++) neg[i] = -1000.0f * a[i];
  const float *pn[2] = {neg, g};
  pd_block_update(b, pn, 2, &f->stats);
  assert_int_equal(pd_sched_compute(b, &f->stats, &rules, &out), PD_OK);
  assert_int_equal(out, PD_ROOT_FAILED);
  assert_ptr_equal(b->root, first);
  assert_int_equal(b->root->version, 1);
  assert_memory_equal(b->root->part[0], kept, sizeof kept);
  assert_int_equal(b->roots_failed, 1);
  assert_non_null(strstr(b->last_failure, "A factor"));
  assert_int_equal(atomic_load(&f->stats.roots_failed), 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_layout_and_defaults, setup, teardown),
      cmocka_unit_test_setup_teardown(test_fold, setup, teardown),
      cmocka_unit_test_setup_teardown(test_inverses_against_lapack, setup, teardown),
      cmocka_unit_test_setup_teardown(test_inverses_without_pi, setup, teardown),
      cmocka_unit_test_setup_teardown(test_inv_every, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_inverse_keeps_previous, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
