/* test_mode_shampoo.c -- unit tests of host/mode_shampoo.c through the pool's compute
 * (pd_sched_compute): warm-started roots (--warm-roots on) take the seeded, warm/skipped and
 * cold paths as the statistics move, counted per factor root; their roots stay close to the
 * cold ones; the held eigenbases are counted in the daemon's memory and given back; with
 * warm starts off every root is cold and nothing is held; eigh publishes the root of a
 * low-rank statistic (computed in double); fold_fits admits what cannot overflow, refuses
 * what can. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "precondd.h"
#include "rpc.h"
#include "preconditioner.h"
#include "shampoo_fixture.h"

#define N 48 /* one block of N x N: both factors of order N */

static uint64_t seed = 7;
static float rnd(void) {
  seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((double)(seed >> 11) / 9007199254740992.0) - 0.5f;
}

/* Packed G G^T of a random N x 4N G: a statistic summed over a few steps. */
static void gram(float *packed) {
  size_t k = 4 * N;
  float *g = malloc(N * k * sizeof *g);
  assert_non_null(g);
  for (size_t i = 0; i < N * k; i++) g[i] = rnd();
  assert_int_equal(pc_gram_f32(N, k, g, k, packed, NULL), PC_OK);
  free(g);
}

/* Scales the packed statistic by D on both sides, D = diag(10^(-2 i / (N - 1))): condition
 * times up to 1e4, so that eps32 * kappa is above the warm root's eigh_below and the held
 * basis is rotated (a well-conditioned one takes the eigh route: test_warm_eigh_route). */
static void spread(float *packed) {
  size_t at = 0;
  for (size_t i = 0; i < N; i++)
    for (size_t j = i; j < N; j++)
      packed[at++] *= (float)pow(10.0, -2.0 * (double)(i + j) / (double)(N - 1));
}

static int setup(void **state) {
  fixture *f = shampoo_fixture(N, N, N);
  assert_int_equal(f->job->nblocks, 1);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  pd_store_destroy(&f->store);
  /* Statistics, roots and the held eigenbases all given back. */
  assert_int_equal(atomic_load(&f->stats.memory_bytes), 0);
  pd_stats_destroy(&f->stats);
  free(f);
  return 0;
}

/* Sets both factors of block b to s, or moves them a little towards s: the statistics EMA
 * with beta2 0.99, the steady state of a run. */
static void set_stats(pd_block *b, const float *s, int ema, uint64_t step) {
  for (uint32_t k = 0; k < 2; k++)
    for (size_t i = 0; i < pc_packed_len(N); i++)
      b->stat[k][i] = ema ? 0.99f * b->stat[k][i] + 0.01f * s[i] : s[i];
  atomic_store(&b->stat_step, step);
}

/* max |root - cold root| / max |cold root| over both factors of b's published root. */
static double diff_to_cold(const pd_block *b) {
  float *a = malloc(N * N * 4), *x = malloc(N * N * 4), *p = malloc(pc_packed_len(N) * 4);
  pc_root_opts o;
  pc_root_opts_default(&o, 4);
  double worst = 0;
  for (uint32_t k = 0; k < 2; k++) {
    pc_unpack_f32(N, b->stat[k], a);
    assert_true(pc_inverse_root_f32(N, a, x, &o, NULL) >= 0);
    pc_pack_f32(N, x, p);
    double md = 0, mx = 0;
    for (size_t i = 0; i < pc_packed_len(N); i++) {
      md = fmax(md, fabs((double)p[i] - b->root->part[k][i]));
      mx = fmax(mx, fabs((double)p[i]));
    }
    worst = fmax(worst, md / mx);
  }
  free(a);
  free(x);
  free(p);
  return worst;
}

static void compute(fixture *f, const pd_sched_rules *rules) {
  pd_root_outcome out = (pd_root_outcome)-1;
  assert_int_equal(pd_sched_compute(&f->job->blocks[0], &f->stats, rules, &out), PD_OK);
  assert_int_equal(out, PD_ROOT_PUBLISHED);
}

static uint64_t count(const pd_block *b, int k) {
  return b->mode_counts[k];
}

static void test_warm_paths(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  const pd_sched_rules warm = {0.1, 0, NULL, 1,
                               0}; /* drift test off: every compute reaches the mode */
  float *s = malloc(pc_packed_len(N) * sizeof *s);
  assert_non_null(s);
  assert_string_equal(pd_mode_shampoo.count_names[PD_SHAMPOO_WARM], "warm");

  /* No basis held: one eigendecomposition per factor seeds it, held in the daemon's memory. */
  gram(s);
  spread(s);
  set_stats(b, s, 0, 1);
  int64_t before = atomic_load(&f->stats.memory_bytes);
  compute(f, &warm);
  assert_int_equal(count(b, PD_SHAMPOO_SEEDED), 2);
  assert_non_null(b->mode_state);
  assert_true(atomic_load(&f->stats.memory_bytes) - before >=
              (int64_t)(2 * pc_eigbasis_bytes_f32(N)));
  assert_true(diff_to_cold(b) < 1e-2);

  /* The steady state: small EMA steps start from the held basis, warm or skipped. */
  for (uint64_t step = 2; step <= 6; step++) {
    gram(s);
    spread(s);
    set_stats(b, s, 1, step);
    compute(f, &warm);
    assert_true(diff_to_cold(b) < 1e-2);
  }
  assert_int_equal(count(b, PD_SHAMPOO_WARM) + count(b, PD_SHAMPOO_SKIPPED), 10);
  assert_true(count(b, PD_SHAMPOO_WARM) > 0);
  assert_int_equal(count(b, PD_SHAMPOO_SEEDED), 2);
  assert_int_equal(count(b, PD_SHAMPOO_COLD), 0);

  /* A statistic unrelated to the held basis: the guard falls back to the cold method and
   * drops the basis, so the next root is seeded again. */
  gram(s);
  spread(s);
  for (size_t i = 0; i < N; i++) s[i * N - i * (i - 1) / 2] *= (float)(1 + 20 * (i % 3));
  set_stats(b, s, 0, 7);
  compute(f, &warm);
  assert_int_equal(count(b, PD_SHAMPOO_COLD), 2);
  assert_true(diff_to_cold(b) < 1e-5);
  set_stats(b, s, 1, 8);
  compute(f, &warm);
  assert_int_equal(count(b, PD_SHAMPOO_SEEDED), 4);
  free(s);
}

/* steps computations of block 0 on fresh well-conditioned statistics (gram), the first set,
 * the next ones EMA steps towards them; each root within tol of the cold root. */
static void run_steps(fixture *f, const pd_sched_rules *rules, uint64_t steps, double tol) {
  pd_block *b = &f->job->blocks[0];
  float *s = malloc(pc_packed_len(N) * sizeof *s);
  assert_non_null(s);
  for (uint64_t step = 1; step <= steps; step++) {
    gram(s);
    set_stats(b, s, step > 1, step);
    compute(f, rules);
    assert_true(diff_to_cold(b) < tol);
  }
  free(s);
}

/* A well-conditioned statistic (4N samples of N rows): the held eigenvalues put eps32 *
 * kappa below eigh_below, so every steady-state root takes the eigh route (a fresh syevd,
 * no rotation), counted as seeded, and stays as close to the cold root. */
static void test_warm_eigh_route(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  const pd_sched_rules warm = {0.1, 0, NULL, 1, 0};
  run_steps(f, &warm, 4, 1e-2);
  assert_int_equal(count(b, PD_SHAMPOO_SEEDED), 8);
  assert_int_equal(
      count(b, PD_SHAMPOO_WARM) + count(b, PD_SHAMPOO_SKIPPED) + count(b, PD_SHAMPOO_COLD), 0);
}

static void test_warm_off(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  const pd_sched_rules cold = {0.1, 0, NULL, 0, 0};
  run_steps(f, &cold, 3, 1e-5); /* the cold root itself */
  assert_int_equal(count(b, PD_SHAMPOO_COLD), 6);
  assert_int_equal(
      count(b, PD_SHAMPOO_WARM) + count(b, PD_SHAMPOO_SKIPPED) + count(b, PD_SHAMPOO_SEEDED), 0);
  assert_null(b->mode_state);
}

/* eigh on a statistic of rank N/4 (a few steps of a block with fewer samples than rows):
 * in float its eigenvalues near the ridge are noise and the residual fails the threshold;
 * the mode computes it in double, so the root is published and matches an fp64 reference. */
static void test_eigh_low_rank(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  pd_shampoo_opts *o = (pd_shampoo_opts *)f->job->opts;
  o->method = PC_METHOD_EIGH;
  const pd_sched_rules cold = {0.1, 0, NULL, 0, 0};
  float *s = malloc(pc_packed_len(N) * sizeof *s), *g = malloc(N * (N / 4) * sizeof *g);
  double *a = malloc(N * N * sizeof *a), *x = malloc(N * N * sizeof *x);
  assert_true(s && g && a && x);
  for (size_t i = 0; i < N * (N / 4); i++) g[i] = rnd();
  assert_int_equal(pc_gram_f32(N, N / 4, g, N / 4, s, NULL), PC_OK);
  set_stats(b, s, 0, 1);
  compute(f, &cold); /* published */
  pc_root_opts ro;
  pc_root_opts_default(&ro, 4);
  ro.method = PC_METHOD_EIGH;
  for (size_t i = 0, p = 0; i < N; i++)
    for (size_t j = i; j < N; j++, p++) a[i * N + j] = a[j * N + i] = s[p];
  assert_true(pc_inverse_root_f64(N, a, x, &ro, NULL) >= 0);
  double md = 0, mx = 0;
  for (uint32_t k = 0; k < 2; k++)
    for (size_t i = 0, p = 0; i < N; i++)
      for (size_t j = i; j < N; j++, p++) {
        md = fmax(md, fabs(x[i * N + j] - (double)b->root->part[k][p]));
        mx = fmax(mx, fabs(x[i * N + j]));
      }
  assert_true(md < 1e-5 * mx);
  free(s);
  free(g);
  free(a);
  free(x);
}

/* fold_fits: a float pass admits values below 2^126 (a sum of two stays below 2^127);
 * larger ones go to the exact check, which admits what stays below the limit and refuses
 * the rest, for a mix (beta2 < 1) and a sum (beta2 = 1). */
static void test_fold_fits(void **state) {
  fixture *f = *state;
  const pd_block *b = &f->job->blocks[0];
  size_t len = pc_packed_len(N);
  float *s = malloc(len * sizeof *s), *x = malloc(len * sizeof *x);
  assert_non_null(s);
  assert_non_null(x);
  const float *st[2] = {s, s}, *in[2] = {x, x};
  pd_shampoo_opts o = {.beta2 = 1.0f};
  for (size_t i = 0; i < len; i++) s[i] = x[i] = -8.0e37f; /* below 2^126 (8.5e37) */
  assert_true(pd_mode_shampoo.fold_fits(&o, b, st, in));
  x[len - 1] = 2.0e38f; /* above it: the exact check, the sum 1.2e38 finite */
  assert_true(pd_mode_shampoo.fold_fits(&o, b, st, in));
  s[len - 1] = 2.0e38f; /* the sum 4e38 is not */
  assert_false(pd_mode_shampoo.fold_fits(&o, b, st, in));
  o.beta2 = 0.5f; /* a mix of 2e38 and 2e38 is */
  assert_true(pd_mode_shampoo.fold_fits(&o, b, st, in));
  s[len - 1] = x[len - 1] = FLT_MAX; /* the mix is FLT_MAX: past the margin */
  assert_false(pd_mode_shampoo.fold_fits(&o, b, st, in));
  free(s);
  free(x);
}

/* A part's buffer of len floats at byte offset off past a 64-byte boundary (0: aligned, as
 * precondd's spares; 16: as a malloc'd statistic may be); free with free_at. */
static float *alloc_at(size_t len, size_t off) {
  unsigned char *p = aligned_alloc(64, (len * sizeof(float) + 128) / 64 * 64);
  assert_non_null(p);
  return (float *)(void *)(p + off);
}

static void free_at(float *p, size_t off) {
  free((unsigned char *)p - off);
}

/* fold_into of both parts of b on copies of st (at offset off, alloc_at), checked: where a
 * part was folded in place its out holds the copy's values before, bit for bit; where it
 * was not, the copy is unchanged; on PD_FOLD_OK the folded part (the copy or out) is want,
 * bit for bit. Returns fold_into's result; n_in_place counts the parts folded in place. */
static int fold_into_checked(const pd_shampoo_opts *o, const pd_block *b, const float *const *st,
                             const float *const *in, const float *want, size_t off,
                             uint8_t *bounded, uint32_t *part, int *n_in_place) {
  size_t len = pc_packed_len(N);
  float *copy[2], *out[2];
  uint8_t in_place[2] = {9, 9};
  for (int k = 0; k < 2; k++) {
    copy[k] = alloc_at(len, off);
    out[k] = alloc_at(len, off);
    memcpy(copy[k], st[k], len * sizeof(float));
    memset(out[k], 0xA5, len * sizeof(float));
  }
  int why = pd_mode_shampoo.fold_into(o, b, copy, in, out, bounded, in_place, part);
  for (int k = 0; k < 2; k++) {
    assert_true(in_place[k] <= 1);
    *n_in_place += in_place[k];
    if (off % 64) assert_int_equal(in_place[k], 0); /* streaming stores need alignment */
    assert_memory_equal(in_place[k] ? out[k] : copy[k], st[k], len * sizeof(float));
    if (why == PD_FOLD_OK)
      assert_memory_equal(in_place[k] ? copy[k] : out[k], want, len * sizeof(float));
    free_at(copy[k], off);
    free_at(out[k], off);
  }
  return why;
}

/* fold_into and fold_bounded: bit for bit the statistics update of pc_stat_update_f32 (a
 * mix and a sum), with each part's bound found in the same pass; fold_into's refusals; and the store trusts the bound only where
 * the update itself set it: a statistic written otherwise (flag 0) still gets the exact
 * overflow check, even with an increment below 2^126. */
static void test_fold_bounded(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  size_t len = pc_packed_len(N);
  float *s = malloc(len * sizeof *s), *ref = malloc(len * sizeof *ref),
        *x = malloc(len * sizeof *x);
  assert_non_null(s);
  assert_non_null(ref);
  assert_non_null(x);
  const float betas[] = {0.999f, 0.9f, 1.0f};
  for (size_t t = 0; t < sizeof betas / sizeof *betas; t++) {
    for (size_t i = 0; i < len; i++) {
      s[i] = ref[i] = (float)((i * 7919 + t) % 1000) * 1.37e-3f - 0.5f;
      x[i] = (float)((i * 104729) % 977) * 3.1e-2f;
    }
    pd_shampoo_opts o = {.beta2 = betas[t]};
    float *st[2] = {s, s};
    const float *in[2] = {x, x};
    uint8_t bounded[2] = {9, 9};
    pd_block one = *b;
    one.nparts = 1;
    /* fold_into first (on copies: in place where aligned, else into out), then
     * fold_bounded in place. */
    const float *sts[2] = {s, s};
    uint32_t part = 9;
    int n_in_place = 0;
    pc_stat_update_f32(len, ref, x, betas[t]);
    for (size_t off = 0; off <= 16; off += 16) {
      assert_int_equal(fold_into_checked(&o, b, sts, in, ref, off, bounded, &part, &n_in_place),
                       PD_FOLD_OK);
      assert_int_equal(bounded[0], 1);
      assert_int_equal(bounded[1], 1);
    }
#if defined(__GNUC__) && defined(__x86_64__)
    /* Aligned buffers are folded in place wherever the CPU can stream them. */
    assert_int_equal(n_in_place, __builtin_cpu_supports("avx512f") ? 2 : 0);
#endif
    /* A NaN in the second part's increment, then an overflow in the first part's fold:
     * the NaN is named first, the overflow alone otherwise; each way undoable. */
    float *x2 = malloc(len * sizeof *x2);
    assert_non_null(x2);
    memcpy(x2, x, len * sizeof *x2);
    x2[len - 1] = NAN;
    const float *in2[2] = {x, x2};
    float *big = malloc(len * sizeof *big);
    assert_non_null(big);
    memcpy(big, s, len * sizeof *big);
    big[1] = x[1] = betas[t] == 1.0f ? FLT_MAX : FLT_MAX / 2; /* a sum overflows, a mix not */
    const float *stb[2] = {big, s};
    const float *in3[2] = {x, x};
    for (size_t off = 0; off <= 16; off += 16) {
      assert_int_equal(fold_into_checked(&o, b, stb, in2, NULL, off, bounded, &part, &n_in_place),
                       PD_FOLD_NONFINITE);
      assert_int_equal(part, 1);
      int why = betas[t] == 1.0f ? PD_FOLD_OVERFLOW : PD_FOLD_OK;
      float *want = malloc(len * sizeof *want);
      assert_non_null(want);
      memcpy(want, big, len * sizeof *want);
      pc_stat_update_f32(len, want, x, betas[t]);
      /* The mix's second part is s's fold: compare part 0 only where it is the one checked. */
      if (why == PD_FOLD_OK) {
        const float *stbb[2] = {big, big};
        assert_int_equal(
            fold_into_checked(&o, b, stbb, in3, want, off, bounded, &part, &n_in_place), why);
        assert_int_equal(bounded[0], 0); /* finite, at or above 2^126 */
      } else {
        assert_int_equal(fold_into_checked(&o, b, stb, in3, NULL, off, bounded, &part, &n_in_place),
                         why);
        assert_int_equal(part, 0);
      }
      free(want);
    }
    x[1] = (float)((1 * 104729) % 977) * 3.1e-2f;
    free(x2);
    free(big);
    pd_mode_shampoo.fold_bounded(&o, &one, st, in, bounded);
    assert_memory_equal(s, ref, len * sizeof *s);
    assert_int_equal(bounded[0], 1);
    x[len / 2] = 1.0e38f; /* the sum or mix lands at or above 2^126 (8.5e37) */
    s[len / 2] = 1.0e38f;
    pd_mode_shampoo.fold_bounded(&o, &one, st, in, bounded);
    assert_int_equal(bounded[0], 0);
  }

  /* The store: a statistic near FLT_MAX not written by a fold is not known bounded, so an
   * increment the scan calls bounded still meets the exact check and is refused. */
  for (uint32_t k = 0; k < 2; k++)
    for (size_t i = 0; i < len; i++) b->stat[k][i] = 0.0f;
  for (size_t i = 0; i < len; i++) x[i] = 1.0e37f;
  const float *inc[2] = {x, x};
  uint8_t scan[2] = {RPC_F32_BOUNDED, RPC_F32_BOUNDED};
  size_t bad = 9;
  pd_block *blocks[1] = {b};
  assert_int_equal(pd_job_push_scanned(f->job, 1, blocks, inc, scan, 1, NULL, &bad), PD_OK);
  assert_int_equal(b->stat_bounded[0], 1);
  assert_int_equal(b->stat_bounded[1], 1);
  b->stat_bounded[0] = 0; /* as a restore or a test writing the statistic leaves it */
  b->stat[0][3] = FLT_MAX;
  assert_int_equal(pd_job_push_scanned(f->job, 1, blocks, inc, scan, 2, NULL, &bad), PD_EINVAL);
  assert_int_equal(bad, 0);
  assert_true(b->stat[0][3] == FLT_MAX); /* nothing stored */
  free(s);
  free(ref);
  free(x);
}

int main(void) {
  pd_log_set_level(PD_LOG_ERROR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_warm_paths, setup, teardown),
      cmocka_unit_test_setup_teardown(test_warm_eigh_route, setup, teardown),
      cmocka_unit_test_setup_teardown(test_warm_off, setup, teardown),
      cmocka_unit_test_setup_teardown(test_eigh_low_rank, setup, teardown),
      cmocka_unit_test_setup_teardown(test_fold_fits, setup, teardown),
      cmocka_unit_test_setup_teardown(test_fold_bounded, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
