/* test_snapshot.c -- unit tests of host/snapshot.c: a bit-exact round trip, and every kind
 * of damage (flipped bytes anywhere, truncation, extension, empty file) refused with a
 * reason and nothing loaded. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "precondd.h"
#include "preconditioner.h"

typedef struct {
  char dir[64];
  pd_stats stats;
  pd_store store;
} fixture;

static uint64_t seed = 12345;
static float rnd(void) {
  seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((double)(seed >> 11) / 9007199254740992.0) - 0.5f;
}

static pd_job *add_job(pd_store *st, const char *name, uint64_t rows, uint64_t cols,
                       uint32_t block_size) {
  char err[256];
  pd_shampoo_opts o = {0};
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_OK);
  o.block_size = block_size;
  o.beta2 = 0.99f;
  uint64_t dims[2] = {rows, cols};
  uint64_t bias[1] = {cols};
  pd_tensor t[2] = {{(char *)"w", 2, dims}, {(char *)"b", 1, bias}};
  pd_job *job = NULL, *existing = NULL;
  assert_int_equal(pd_job_build(name, &pd_mode_shampoo, &o, 2, t, 1000, &job, err, sizeof err), PD_OK);
  assert_int_equal(pd_store_add(st, job, &existing), PD_OK);
  job->last_step = 42;
  pd_job_note_worker(job, "worker-a");
  for (size_t i = 0; i < job->nblocks; i++) {
    pd_block *b = &job->blocks[i];
    for (size_t k = 0; k < pc_packed_len(b->rows); k++) b->stat[0][k] = rnd();
    for (size_t k = 0; k < pc_packed_len(b->cols); k++) b->stat[1][k] = rnd();
    atomic_store(&b->stat_step, 40 + i);
    b->pushes = 3 + i;
    if (i % 2 == 0) {
      pd_root *r = pd_root_new(b->nparts, b->order, st->stats);
      for (size_t k = 0; k < pc_packed_len(b->rows); k++) r->part[0][k] = rnd();
      for (size_t k = 0; k < pc_packed_len(b->cols); k++) r->part[1][k] = rnd();
      r->source_step = 39;
      r->error = 1e-3 * (double)i;
      r->iterations = 7;
      r->method = 2;
      pd_block_publish(b, r, st->stats);
    }
  }
  return job;
}

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  snprintf(f->dir, sizeof f->dir, "/tmp/pd-snap-XXXXXX");
  assert_non_null(mkdtemp(f->dir));
  pd_stats_init(&f->stats);
  pd_store_init(&f->store, &f->stats, (size_t)1 << 30, 1000);
  add_job(&f->store, "alpha", 10, 7, 4);
  add_job(&f->store, "beta", 3, 3, 8);
  assert_int_equal(pd_snapshot_write(&f->store, f->dir), PD_OK);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  pd_store_destroy(&f->store);
  pd_stats_destroy(&f->stats);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", f->dir);
  if (system(cmd) != 0) return -1;
  free(f);
  return 0;
}

static void path_of(const fixture *f, char *out, size_t len) {
  snprintf(out, len, "%s/%s", f->dir, PD_SNAPSHOT_FILE);
}

static void test_roundtrip_bit_exact(void **state) {
  fixture *f = *state;
  pd_stats stats;
  pd_store st;
  char err[256] = "";
  pd_stats_init(&stats);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_OK);
  assert_int_equal(st.njobs, 2);
  for (size_t j = 0; j < 2; j++) {
    pd_job *a = f->store.jobs[j], *b = st.jobs[j];
    assert_string_equal(a->name, b->name);
    assert_true(pd_job_same(a, b));
    assert_int_equal(b->last_step, 42);
    assert_int_equal(b->nworkers, 1);
    assert_int_equal(a->nblocks, b->nblocks);
    for (size_t i = 0; i < a->nblocks; i++) {
      pd_block *x = &a->blocks[i], *y = &b->blocks[i];
      assert_memory_equal(x->stat[0], y->stat[0], pc_packed_len(x->rows) * 4);
      assert_memory_equal(x->stat[1], y->stat[1], pc_packed_len(x->cols) * 4);
      assert_int_equal(atomic_load(&y->stat_step), atomic_load(&x->stat_step));
      assert_int_equal(y->pushes, x->pushes);
      assert_int_equal(!x->root, !y->root);
      if (x->root) {
        assert_int_equal(y->root->version, x->root->version);
        assert_int_equal(y->root->source_step, 39);
        assert_true(y->root->error == x->root->error);
        assert_int_equal(y->root->iterations, 7);
        assert_memory_equal(x->root->part[0], y->root->part[0], pc_packed_len(x->rows) * 4);
        assert_memory_equal(x->root->part[1], y->root->part[1], pc_packed_len(x->cols) * 4);
        assert_int_equal(atomic_load(&y->root_step), 39);
      }
    }
  }
  /* Both stores hold the same bytes. */
  assert_int_equal(atomic_load(&stats.memory_bytes), atomic_load(&f->stats.memory_bytes));
  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
}

/* Reads the snapshot and expects PD_ECORRUPT with nothing loaded. */
static void expect_corrupt(const fixture *f, const char *what) {
  pd_stats stats;
  pd_store st;
  char err[256] = "";
  pd_stats_init(&stats);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  int rc = pd_snapshot_read(&st, f->dir, err, sizeof err);
  if (rc != PD_ECORRUPT) fail_msg("%s: got %d (%s), expected PD_ECORRUPT", what, rc, err);
  assert_true(strlen(err) > 0);
  assert_int_equal(st.njobs, 0);
  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
}

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *fp = fopen(path, "rb");
  assert_non_null(fp);
  fseek(fp, 0, SEEK_END);
  *n = (size_t)ftell(fp);
  fseek(fp, 0, SEEK_SET);
  unsigned char *buf = malloc(*n + 1);
  assert_int_equal(fread(buf, 1, *n, fp), *n);
  fclose(fp);
  return buf;
}

static void spit(const char *path, const unsigned char *buf, size_t n) {
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  assert_int_equal(fwrite(buf, 1, n, fp), n);
  fclose(fp);
}

static void test_damage_detected(void **state) {
  fixture *f = *state;
  char path[128];
  path_of(f, path, sizeof path);
  size_t n;
  unsigned char *orig = slurp(path, &n);
  unsigned char *buf = malloc(n + 1);
  /* One flipped bit at positions spread over header and payload. */
  for (size_t pos = 0; pos < n; pos += (pos < 64 ? 1 : n / 37 + 1)) {
    memcpy(buf, orig, n);
    buf[pos] ^= 0x04;
    spit(path, buf, n);
    char what[64];
    snprintf(what, sizeof what, "bit flipped at byte %zu", pos);
    expect_corrupt(f, what);
  }
  /* Truncations, one extra byte, an empty file. */
  size_t cuts[] = {0, 10, 31, 32, 33, n / 2, n - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
    spit(path, orig, cuts[i]);
    expect_corrupt(f, "truncated");
  }
  memcpy(buf, orig, n);
  buf[n] = 0;
  spit(path, buf, n + 1);
  expect_corrupt(f, "extended");

  /* Set aside: the file moves, and a read then finds nothing. */
  char aside[300];
  assert_int_equal(pd_snapshot_set_aside(f->dir, aside, sizeof aside), PD_OK);
  assert_non_null(strstr(aside, ".corrupt-"));
  assert_int_equal(access(aside, F_OK), 0);
  assert_int_equal(access(path, F_OK), -1);
  pd_store st;
  char err[64];
  pd_store_init(&st, &f->stats, 1 << 20, 10);
  assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_ENOENT);
  pd_store_destroy(&st);
  spit(path, orig, n); /* restored: reads again */
  free(orig);
  free(buf);
}

static void test_rewrite_replaces(void **state) {
  fixture *f = *state;
  /* A second write replaces the file and leaves no temporary behind. */
  atomic_store(&f->store.jobs[0]->blocks[0].stat_step, 99);
  assert_int_equal(pd_snapshot_write(&f->store, f->dir), PD_OK);
  char tmp[128];
  snprintf(tmp, sizeof tmp, "%s/%s.tmp", f->dir, PD_SNAPSHOT_FILE);
  assert_int_equal(access(tmp, F_OK), -1);
  pd_stats stats;
  pd_store st;
  char err[256];
  pd_stats_init(&stats);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_OK);
  assert_int_equal(atomic_load(&st.jobs[0]->blocks[0].stat_step), 99);
  pd_store_destroy(&st);
  pd_stats_destroy(&stats);
  /* An unwritable directory is an error, not a crash. */
  assert_int_equal(pd_snapshot_write(&f->store, "/nonexistent/dir"), PD_EIO);
}

int main(void) {
  pd_log_set_level(PD_LOG_ERROR + 0);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_roundtrip_bit_exact, setup, teardown),
      cmocka_unit_test_setup_teardown(test_damage_detected, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rewrite_replaces, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
