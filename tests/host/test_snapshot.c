/* test_snapshot.c -- unit tests of host/snapshot.c: a bit-exact round trip, and every kind
 * of damage (flipped bytes anywhere, truncation, extension, empty file) refused with a
 * reason and nothing loaded; resuming under another rank count. */
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

#include <zlib.h>

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
  assert_int_equal(pd_job_build(name, &pd_mode_shampoo, &o, 2, t, 1000, &job, err, sizeof err),
                   PD_OK);
  assert_int_equal(pd_store_add(st, job, &existing), PD_OK);
  job->last_step = 42;
  pd_job_note_worker(job, "worker-a");
  for (size_t i = 0; i < job->nblocks; i++) {
    pd_block *b = &job->blocks[i];
    for (size_t k = 0; k < pc_packed_len(b->rows); k++) b->stat[0][k] = rnd();
    for (size_t k = 0; k < pc_packed_len(b->cols); k++) b->stat[1][k] = rnd();
    atomic_store(&b->stat_step, 40 + i);
    b->pushes = 3 + i;
    /* Failure history: it used to restart at zero, so a block that kept failing looked new. */
    b->resets = 2 + i;
    b->failures_in_row = (uint32_t)(i % 3);
    snprintf(b->last_failure, sizeof b->last_failure, "left: not converged (%zu)", i);
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
      assert_int_equal(y->resets, x->resets);
      assert_int_equal(y->failures_in_row, x->failures_in_row);
      assert_string_equal(y->last_failure, x->last_failure);
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

/* A snapshot whose job is above a per-job memory limit lowered since it was written stops
 * the start (PD_ELIMIT naming the job), loading nothing, like the daemon-wide limit. */
static void test_job_over_lowered_limit(void **state) {
  fixture *f = *state;
  pd_stats stats;
  pd_store st;
  char err[256] = "";
  pd_stats_init(&stats);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  st.job_memory_limit = pd_job_bytes(f->store.jobs[0]) - 1; /* alpha no longer fits */
  assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_ELIMIT);
  assert_non_null(strstr(err, "alpha"));
  assert_non_null(strstr(err, "per-job"));
  assert_int_equal(st.njobs, 0);
  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
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

/* The origin (rank, count, run) that format 5 puts before the job count. */
#define ORIGIN 16

/* A payload under construction, little-endian like the file. */
typedef struct {
  unsigned char *p;
  size_t n, cap;
} wbuf;

static void put(wbuf *b, const void *src, size_t n) {
  if (b->n + n > b->cap) {
    b->cap = 2 * (b->n + n) + 64;
    b->p = realloc(b->p, b->cap);
    assert_non_null(b->p);
  }
  memcpy(b->p + b->n, src, n);
  b->n += n;
}
static void put_le(wbuf *b, uint64_t v, int bytes) {
  unsigned char x[8];
  for (int i = 0; i < bytes; i++) x[i] = (unsigned char)(v >> (8 * i));
  put(b, x, (size_t)bytes);
}
static void put_str(wbuf *b, const char *s) {
  put_le(b, strlen(s), 4);
  put(b, s, strlen(s));
}
/* One entry of the ended-names section: the name, when it ended (a fixed time), how (kind). */
static void put_ended(wbuf *b, const char *name, uint32_t kind) {
  put_str(b, name);
  put_le(b, 1764590400, 8);
  put_le(b, kind, 4);
}

/* A Shampoo job record of this daemon's files (format 6: its options section 32 bytes) as
 * formats 5 and older hold it (28 bytes: no root_every), in place; returns its new length. */
static size_t job_as_f5(unsigned char *job, size_t len) {
  size_t name = (size_t)job[0] | (size_t)job[1] << 8 | (size_t)job[2] << 16 | (size_t)job[3] << 24;
  size_t at = 4 + name + 4 + 28; /* name, mode, the section up to root_every */
  assert_true(len > at + 4);
  memmove(job + at, job + at + 4, len - at - 4);
  return len - 4;
}

/* Writes payload as f's snapshot of that format with a valid header: magic, format, length
 * and both checksums right, so that only the parser can object. */
static void seal_as(const fixture *f, const wbuf *payload, uint32_t format) {
  wbuf file = {0};
  put(&file, "PCDSNAP1", 8);
  put_le(&file, format, 4);
  put_le(&file, 0, 4);
  put_le(&file, payload->n, 8);
  put_le(&file, crc32(crc32(0L, Z_NULL, 0), payload->p, (uInt)payload->n), 4);
  put_le(&file, crc32(crc32(0L, Z_NULL, 0), file.p, 28), 4);
  put(&file, payload->p, payload->n);
  char path[128];
  path_of(f, path, sizeof path);
  spit(path, file.p, file.n);
  free(file.p);
}

static void seal(const fixture *f, const wbuf *payload) {
  seal_as(f, payload, 1);
}

/* The header of one job record (options, last_step, one rank-2 tensor, no workers) up to
 * and including its block count. */
static void put_job_head(wbuf *b, const char *name, uint32_t block_size, uint64_t last_step,
                         uint64_t rows, uint64_t cols, uint32_t nblocks) {
  put_str(b, name);
  put_le(b, 0, 4); /* mode */
  put_le(b, block_size, 4);
  put_le(b, 0, 4);          /* skip_limit: default */
  put_le(b, 0x3f800000, 4); /* beta2 1.0f */
  put_le(b, 4, 4);          /* p */
  double eps = 1e-6;
  uint64_t u;
  memcpy(&u, &eps, 8);
  put_le(b, u, 8);
  put_le(b, 0, 4); /* method */
  put_le(b, last_step, 8);
  put_le(b, 1, 4); /* tensors */
  put_str(b, "w");
  put_le(b, 2, 4);
  put_le(b, rows, 8);
  put_le(b, cols, 8);
  put_le(b, 0, 4); /* workers */
  put_le(b, nblocks, 4);
}

/* The names of ended jobs are snapshotted (format 4): a restart, a crash included, still
 * refuses them; a daemon that keeps fewer keeps the newest; format 3 files hold none. */
static void test_ended_names(void **state) {
  fixture *f = *state;
  f->store.ended_max = 8;
  pd_job_unref(pd_store_remove(&f->store, "beta", 0, 0), &f->stats);
  add_job(&f->store, "gamma", 3, 3, 8);
  pd_job_unref(pd_store_remove(&f->store, "gamma", 0, 0), &f->stats);
  assert_int_equal(pd_snapshot_write(&f->store, f->dir), PD_OK);
  pd_stats stats;
  pd_store st;
  char err[256] = "";
  pd_stats_init(&stats);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  st.ended_max = 8;
  assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_OK);
  assert_int_equal(st.njobs, 1);
  pd_ended_job e;
  assert_int_equal(pd_store_ended(&st, "beta", &e), 1);
  assert_int_equal(e.how, PD_ENDED_BY_CALL);
  assert_int_equal(pd_store_ended(&st, "gamma", NULL), 1);
  assert_int_equal(pd_store_ended(&st, "alpha", NULL), 0);
  pd_store_destroy(&st);
  /* Kept by a daemon that remembers one: the newest. */
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  st.ended_max = 1;
  assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_OK);
  assert_int_equal(pd_store_ended(&st, "beta", NULL), 0);
  assert_int_equal(pd_store_ended(&st, "gamma", NULL), 1);
  pd_store_destroy(&st);
  /* The same file as format 3 (without the count of ended names): none remembered. */
  char path[128];
  path_of(f, path, sizeof path);
  size_t n;
  unsigned char *file = slurp(path, &n);
  wbuf b = {0};
  size_t jobs_end = n;
  /* the ended section: u32 2, then "beta" and "gamma" with their time and kind */
  jobs_end -= 4 + (4 + 4 + 12) + (4 + 5 + 12);
  put(&b, file + 32 + ORIGIN, jobs_end - 32 - ORIGIN);
  b.n = 4 + job_as_f5(b.p + 4, b.n - 4); /* the job count, then the one job */
  seal_as(f, &b, 3);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  st.ended_max = 8;
  assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_OK);
  assert_int_equal(st.njobs, 1);
  assert_int_equal(st.nended, 0);
  /* Its options section had no root_every: the default, every push. */
  assert_int_equal(((const pd_shampoo_opts *)(const void *)st.jobs[0]->opts)->root_every, 1);
  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
  free(b.p);
  free(file);
}

/* Snapshots whose checksums are right but whose contents are hostile: each is refused as
 * damage, nothing stays loaded, and nothing is allocated for sizes the file cannot hold. */
static void test_hostile_contents(void **state) {
  fixture *f = *state;
  char path[128];
  path_of(f, path, sizeof path);
  size_t n;
  unsigned char *orig = slurp(path, &n);
  /* The real file's first job twice: refused whole (it used to keep one of them). */
  wbuf b = {0};
  put_le(&b, 2, 4);
  size_t job_len = 0;
  unsigned char *one_job = NULL; /* the bytes of job "twice" */
  {
    pd_store one;
    pd_stats st1;
    pd_stats_init(&st1);
    pd_store_init(&one, &st1, (size_t)1 << 30, 1000);
    add_job(&one, "twice", 6, 5, 4);
    assert_int_equal(pd_snapshot_write(&one, f->dir), PD_OK);
    pd_store_destroy(&one);
    pd_stats_destroy(&st1);
    size_t m;
    unsigned char *single = slurp(path, &m);
    /* less the origin, the job count and the count of ended names */
    job_len = m - 32 - ORIGIN - 4 - 4;
    one_job = malloc(job_len);
    assert_non_null(one_job);
    memcpy(one_job, single + 36 + ORIGIN, job_len);
    job_len = job_as_f5(one_job, job_len);
    put(&b, one_job, job_len);
    put(&b, one_job, job_len);
    put_le(&b, 0, 4);
    free(single);
  }
  seal_as(f, &b, 4); /* the format it was written in, less the origin and root_every */
  expect_corrupt(f, "one job stored twice");
  b.n = 0;
  /* More blocks than the store's limit (1000): refused before the layout is built. */
  put_le(&b, 1, 4);
  put_job_head(&b, "many", 1, 0, 100, 100, 10000);
  seal(f, &b);
  expect_corrupt(f, "10000 blocks");
  b.n = 0;
  /* One 8192 x 8192 block in a file of a hundred bytes: no 256 MiB allocation first. */
  put_le(&b, 1, 4);
  put_job_head(&b, "huge", 8192, 0, 8192, 8192, 1);
  put_le(&b, 0, 4);
  put_le(&b, 8192, 8);
  put_le(&b, 8192, 8);
  for (int k = 0; k < 4; k++) put_le(&b, 0, 8);
  put_le(&b, 0, 8);
  put_le(&b, 0, 8);
  seal(f, &b);
  expect_corrupt(f, "8192 block in a tiny file");
  b.n = 0;
  /* A step no request may carry. */
  put_le(&b, 1, 4);
  put_job_head(&b, "late", 4, UINT64_MAX, 4, 4, 1);
  seal(f, &b);
  expect_corrupt(f, "last_step 2^64-1");
  /* Ended names (format 4): one also a stored job, one twice, more than any daemon keeps,
   * an unknown kind. */
  b.n = 0;
  put_le(&b, 1, 4);
  put(&b, one_job, job_len);
  put_le(&b, 1, 4);
  put_ended(&b, "twice", 0);
  seal_as(f, &b, 4);
  expect_corrupt(f, "a job and its end");
  b.n = 0;
  put_le(&b, 0, 4);
  put_le(&b, 2, 4);
  for (int k = 0; k < 2; k++) {
    put_ended(&b, "gone", 0);
  }
  seal_as(f, &b, 4);
  expect_corrupt(f, "an ended name twice");
  b.n = 0;
  put_le(&b, 0, 4);
  put_le(&b, PD_MAX_ENDED_JOBS + 1, 4);
  for (uint32_t k = 0; k < PD_MAX_ENDED_JOBS + 1; k++) {
    char name[16];
    snprintf(name, sizeof name, "e%u", k);
    put_ended(&b, name, 0);
  }
  seal_as(f, &b, 4);
  expect_corrupt(f, "more ended names than PD_MAX_ENDED_JOBS");
  b.n = 0;
  put_le(&b, 0, 4);
  put_le(&b, 1, 4);
  put_ended(&b, "gone", 7);
  seal_as(f, &b, 4);
  expect_corrupt(f, "an ended name of unknown kind");
  /* The same job with no ended name parses: the refusals above are the ended section's. */
  b.n = 0;
  put_le(&b, 1, 4);
  put(&b, one_job, job_len);
  put_le(&b, 0, 4);
  seal_as(f, &b, 4);
  {
    pd_stats stats;
    pd_store st;
    char err[256] = "";
    pd_stats_init(&stats);
    pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
    assert_int_equal(pd_snapshot_read(&st, f->dir, err, sizeof err), PD_OK);
    assert_int_equal(st.njobs, 1);
    pd_store_destroy(&st);
    pd_stats_destroy(&stats);
  }
  free(one_job);
  free(b.p);
  spit(path, orig, n);
  free(orig);
}

/* The store of old rank k of R of a daemon job (run 7) that saw add_job's statistics: the
 * statistics of the units it owns, every root (published to every rank), written to dir. */
static void write_old_rank(const char *dir, int k, int R) {
  pd_stats stats;
  pd_store st;
  pd_replica_link link;
  memset(&link, 0, sizeof link);
  link.rank = k;
  link.nranks = R;
  atomic_store(&link.alone, 1); /* nothing to send while it is filled */
  pd_stats_init(&stats);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  st.link = &link;
  st.run = 7;
  seed = 12345;
  pd_job *jobs[2] = {add_job(&st, "alpha", 10, 7, 4), add_job(&st, "beta", 3, 3, 8)};
  for (int j = 0; j < 2; j++)
    for (size_t i = 0; i < jobs[j]->nblocks; i++) {
      pd_block *b = &jobs[j]->blocks[i];
      if ((int)b->owner == k) continue;
      memset(b->stat[0], 0, pc_packed_len(b->rows) * 4);
      memset(b->stat[1], 0, pc_packed_len(b->cols) * 4);
      b->pushes = 0;
    }
  mkdir(dir, 0700);
  assert_int_equal(pd_snapshot_write(&st, dir), PD_OK);
  pd_store_destroy(&st);
  pd_stats_destroy(&stats);
}

/* Resumed as rank `rank` of nranks from the old ranks' directories (from_bytes: from their
 * files' bytes, as the ranks share them over MPI, the directories then named but absent):
 * each unit this rank owns now has the statistics one daemon that saw everything has, bit
 * for bit, the others none, and every unit its root under the old version; the origin says
 * the new count. */
static void check_resharded(const fixture *f, int old_nranks, int rank, int nranks,
                            int from_bytes) {
  char dirs[4][96];
  const char *names[4];
  pd_snap_bytes bytes[4];
  char err[512] = "";
  for (int k = 0; k < old_nranks; k++) {
    snprintf(dirs[k], sizeof dirs[k], "%s/old-%d-%d", f->dir, old_nranks, k);
    names[k] = dirs[k];
    if (from_bytes) {
      assert_int_equal(pd_snapshot_load(dirs[k], &bytes[k].data, &bytes[k].len, err, sizeof err),
                       PD_OK);
      snprintf(dirs[k], sizeof dirs[k], "%s/elsewhere-%d", f->dir, k);
    }
  }
  pd_stats stats;
  pd_store ref, st;
  pd_replica_link link;
  memset(&link, 0, sizeof link);
  link.rank = rank;
  link.nranks = nranks;
  pd_stats_init(&stats);
  pd_store_init(&ref, &stats, (size_t)1 << 30, 1000);
  seed = 12345;
  add_job(&ref, "alpha", 10, 7, 4);
  add_job(&ref, "beta", 3, 3, 8);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  st.link = &link;
  assert_int_equal(pd_snapshot_read_resharded(&st, names, from_bytes ? bytes : NULL, old_nranks, 7,
                                              rank, nranks, err, sizeof err),
                   PD_OK);
  for (int k = 0; from_bytes && k < old_nranks; k++) free(bytes[k].data);
  assert_int_equal(st.njobs, 2);
  size_t owned = 0;
  for (int j = 0; j < 2; j++) {
    pd_job *a = ref.jobs[j], *b = st.jobs[j];
    assert_string_equal(a->name, b->name);
    assert_int_equal(b->resumed_step, 42);
    for (size_t i = 0; i < a->nblocks; i++) {
      pd_block *x = &a->blocks[i], *y = &b->blocks[i];
      if (nranks == 1 || (int)y->owner == rank) {
        owned++;
        assert_memory_equal(x->stat[0], y->stat[0], pc_packed_len(x->rows) * 4);
        assert_memory_equal(x->stat[1], y->stat[1], pc_packed_len(x->cols) * 4);
        assert_int_equal(y->pushes, x->pushes);
        assert_int_equal(atomic_load(&y->stat_step), atomic_load(&x->stat_step));
      } else {
        for (size_t k = 0; k < pc_packed_len(y->rows); k++) assert_true(y->stat[0][k] == 0);
        assert_int_equal(y->pushes, 0);
      }
      assert_int_equal(!x->root, !y->root);
      if (x->root) {
        assert_int_equal(y->root->version, x->root->version);
        assert_memory_equal(x->root->part[0], y->root->part[0], pc_packed_len(x->rows) * 4);
      }
    }
  }
  assert_true(owned > 0);
  st.run = 8;
  char mine[96];
  snprintf(mine, sizeof mine, "%s/new", f->dir);
  mkdir(mine, 0700);
  assert_int_equal(pd_snapshot_write(&st, mine), PD_OK);
  pd_snap_origin o;
  assert_int_equal(pd_snapshot_peek(mine, &o, err, sizeof err), PD_OK);
  assert_int_equal(o.rank, rank);
  assert_int_equal(o.nranks, nranks);
  assert_int_equal(o.run, 8);
  assert_int_equal(o.njobs, 2);
  pd_store_destroy(&st);
  pd_store_destroy(&ref);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
}

/* Resuming under another rank count: 2 -> 1, 2 -> 3, 1 -> 2; a missing old snapshot, and
 * one of another run, are refused naming the file, nothing loaded. */
static void test_resharded(void **state) {
  fixture *f = *state;
  for (int k = 0; k < 2; k++) {
    char d[96];
    snprintf(d, sizeof d, "%s/old-2-%d", f->dir, k);
    write_old_rank(d, k, 2);
  }
  char one[96];
  snprintf(one, sizeof one, "%s/old-1-0", f->dir);
  write_old_rank(one, 0, 1);
  for (int b = 0; b < 2; b++) {
    check_resharded(f, 2, 0, 1, b);
    for (int r = 0; r < 3; r++) check_resharded(f, 2, r, 3, b);
    for (int r = 0; r < 2; r++) check_resharded(f, 1, r, 2, b);
  }

  pd_stats stats;
  pd_store st;
  pd_stats_init(&stats);
  pd_store_init(&st, &stats, (size_t)1 << 30, 1000);
  char d0[96], d1[96], err[512] = "";
  snprintf(d0, sizeof d0, "%s/old-2-0", f->dir);
  snprintf(d1, sizeof d1, "%s/nowhere", f->dir);
  const char *names[2] = {d0, d1};
  assert_int_equal(pd_snapshot_read_resharded(&st, names, NULL, 2, 7, 0, 1, err, sizeof err),
                   PD_ENOENT);
  assert_non_null(strstr(err, "nowhere/precondd.snap"));
  assert_non_null(strstr(err, "rank 1 of 2"));
  snprintf(d1, sizeof d1, "%s/old-2-1", f->dir);
  assert_int_equal(pd_snapshot_read_resharded(&st, names, NULL, 2, 9, 0, 1, err, sizeof err),
                   PD_EINVAL);
  assert_non_null(strstr(err, "another run"));
  names[1] = d0; /* rank 0's snapshot where rank 1's should be */
  assert_int_equal(pd_snapshot_read_resharded(&st, names, NULL, 2, 7, 0, 1, err, sizeof err),
                   PD_EINVAL);
  assert_non_null(strstr(err, "written by rank 0 of 2"));
  /* From bytes: one no rank could read is missing, damaged bytes are named as the file. */
  names[1] = d1;
  pd_snap_bytes bytes[2] = {{NULL, 0}, {NULL, 0}};
  assert_int_equal(pd_snapshot_load(d0, &bytes[0].data, &bytes[0].len, err, sizeof err), PD_OK);
  assert_int_equal(pd_snapshot_read_resharded(&st, names, bytes, 2, 7, 0, 1, err, sizeof err),
                   PD_ENOENT);
  assert_non_null(strstr(err, "the snapshot of rank 1 of 2"));
  assert_non_null(strstr(err, "is missing"));
  assert_int_equal(pd_snapshot_load(d1, &bytes[1].data, &bytes[1].len, err, sizeof err), PD_OK);
  bytes[1].data[bytes[1].len / 2] ^= 0x40;
  assert_int_equal(pd_snapshot_read_resharded(&st, names, bytes, 2, 7, 0, 1, err, sizeof err),
                   PD_ECORRUPT);
  assert_non_null(strstr(err, "old-2-1/precondd.snap"));
  assert_non_null(strstr(err, "checksum"));
  for (int k = 0; k < 2; k++) free(bytes[k].data);
  snprintf(d1, sizeof d1, "%s/nowhere", f->dir);
  assert_int_equal(pd_snapshot_load(d1, &bytes[0].data, &bytes[0].len, err, sizeof err), PD_ENOENT);
  assert_int_equal(st.njobs, 0);
  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
}

int main(void) {
  pd_log_set_level(PD_LOG_ERROR + 0);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_roundtrip_bit_exact, setup, teardown),
      cmocka_unit_test_setup_teardown(test_damage_detected, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rewrite_replaces, setup, teardown),
      cmocka_unit_test_setup_teardown(test_job_over_lowered_limit, setup, teardown),
      cmocka_unit_test_setup_teardown(test_hostile_contents, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ended_names, setup, teardown),
      cmocka_unit_test_setup_teardown(test_resharded, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
