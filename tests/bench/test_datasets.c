/* test_datasets.c -- the KJV and Fashion-MNIST loaders against the installed package files,
 * the samplers, and damaged or missing files in a temporary directory.
 *
 * Expected figures were computed independently of datasets.c with /usr/bin/python3:
 *   t = subprocess.run(['bible', 'gen1:1-rev22:21'], capture_output=True).stdout
 *   len(t), zlib.crc32(t), zlib.crc32(t[:4096]), zlib.crc32(t[len(t)*9//10:][:4096])
 *   im = gzip.open(dir + 'train-images-idx3-ubyte.gz').read()[16:]   (and t10k, labels [8:])
 *   zlib.crc32(im[:784]), zlib.crc32(im[:78400]), zlib.crc32(im[-784:]), sum(im[:784]),
 *   list(labels[:12]), zlib.crc32(labels)
 * with bible-kjv / bible-kjv-text 4.38 and dataset-fashion-mnist as installed here. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <zlib.h>

#include "datasets.h"

/* A scratch directory per test run, removed at the end. */
static char tmpdir[64];

static void path_in(char *buf, size_t n, const char *name) {
  snprintf(buf, n, "%s/%s", tmpdir, name);
}

static void write_bytes(const char *path, const void *b, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(b, 1, n, f), n);
  assert_int_equal(fclose(f), 0);
}

static uint8_t *read_bytes(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  assert_int_equal(fseek(f, 0, SEEK_END), 0);
  long sz = ftell(f);
  assert_true(sz >= 0);
  rewind(f);
  uint8_t *b = malloc((size_t)sz + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)sz, f), (size_t)sz);
  fclose(f);
  *n = (size_t)sz;
  return b;
}

static uint32_t crc(const void *b, size_t n) {
  return (uint32_t)crc32(crc32(0L, Z_NULL, 0), b, (uInt)n);
}

static int setup(void **state) {
  (void)state;
  strcpy(tmpdir, "/tmp/precond-ds-test-XXXXXX");
  return mkdtemp(tmpdir) == NULL ? -1 : 0;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  /* only the directory this run made */
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------------------------ */
/* Text                                                                                   */

#define KJV_LEN           4298239u
#define KJV_CRC           0x79262628u
#define KJV_CRC_HEAD      0xa47fcb0fu /* first 4096 bytes */
#define KJV_TRAIN_LEN     3868415u    /* len * 9 // 10 */
#define KJV_CRC_EVAL_HEAD 0x9a33d01cu /* first 4096 bytes of the eval split */

static void test_text_cache_and_splits(void **state) {
  (void)state;
  char path[256];
  ds_error err;
  ds_text t;
  path_in(path, sizeof path, "sub/kjv.txt"); /* the parent is created too */
  assert_int_equal(ds_text_load(&t, path, 0, &err), DS_EIO);
  assert_non_null(strstr(err.msg, path));
  assert_int_equal(ds_text_load(&t, path, 1, &err), DS_OK);
  assert_int_equal(t.len, KJV_LEN);
  assert_int_equal(crc(t.bytes, t.len), KJV_CRC);
  assert_int_equal(crc(t.bytes, 4096), KJV_CRC_HEAD);
  assert_int_equal(t.train_len, KJV_TRAIN_LEN);

  size_t ntr, nev;
  const uint8_t *tr = ds_text_split(&t, DS_SPLIT_TRAIN, &ntr);
  const uint8_t *ev = ds_text_split(&t, DS_SPLIT_EVAL, &nev);
  assert_ptr_equal(tr, t.bytes);
  assert_int_equal(ntr, KJV_TRAIN_LEN);
  assert_int_equal(nev, KJV_LEN - KJV_TRAIN_LEN);
  assert_ptr_equal(ev, t.bytes + ntr);
  assert_int_equal(crc(ev, 4096), KJV_CRC_EVAL_HEAD);
  ds_text_destroy(&t);
  assert_null(t.bytes);

  /* The cache is a plain file that reads back the same without running bible. */
  assert_int_equal(ds_text_load(&t, path, 0, NULL), DS_OK);
  assert_int_equal(crc(t.bytes, t.len), KJV_CRC);
  ds_text_destroy(&t);
  ds_text_destroy(&t); /* twice is harmless */

  /* The default path follows $PRECOND_DATA_DIR. */
  char def[256];
  assert_int_equal(setenv("PRECOND_DATA_DIR", tmpdir, 1), 0);
  assert_int_equal(ds_text_default_cache(def, sizeof def), DS_OK);
  path_in(path, sizeof path, "kjv.txt");
  assert_string_equal(def, path);
  assert_int_equal(ds_text_cache_create(NULL, NULL), DS_OK);
  assert_int_equal(ds_text_load(&t, NULL, 0, NULL), DS_OK);
  assert_int_equal(t.len, KJV_LEN);
  ds_text_destroy(&t);
  assert_int_equal(unsetenv("PRECOND_DATA_DIR"), 0);
  assert_int_equal(ds_text_default_cache(def, sizeof def), DS_OK);
  assert_string_equal(def, "data/kjv.txt");
  assert_int_equal(ds_text_default_cache(def, 5), DS_EINVAL);
}

static void test_text_damaged(void **state) {
  (void)state;
  char good[256], bad[256];
  ds_error err;
  ds_text t;
  path_in(good, sizeof good, "good-kjv.txt");
  assert_int_equal(ds_text_cache_create(good, &err), DS_OK);
  size_t n;
  uint8_t *b = read_bytes(good, &n);
  assert_int_equal(n, KJV_LEN);

  path_in(bad, sizeof bad, "bad-kjv.txt");
  write_bytes(bad, b, n / 2); /* truncated */
  assert_int_equal(ds_text_load(&t, bad, 1, &err), DS_EFORMAT);
  assert_non_null(strstr(err.msg, bad));
  assert_null(t.bytes);
  write_bytes(bad, b, n - 3); /* last verse cut */
  assert_int_equal(ds_text_load(&t, bad, 0, &err), DS_EFORMAT);
  assert_non_null(strstr(err.msg, "truncated"));
  b[1000] = 0xe9; /* not ASCII */
  write_bytes(bad, b, n);
  assert_int_equal(ds_text_load(&t, bad, 0, &err), DS_EFORMAT);
  assert_non_null(strstr(err.msg, "ASCII"));
  b[1000] = 'a';
  b[1] = 'X'; /* a foreign file */
  write_bytes(bad, b, n);
  assert_int_equal(ds_text_load(&t, bad, 0, &err), DS_EFORMAT);
  write_bytes(bad, "", 0);
  assert_int_equal(ds_text_load(&t, bad, 0, &err), DS_EFORMAT);
  free(b);

  /* a directory is not a cache */
  assert_int_equal(ds_text_load(&t, tmpdir, 0, &err), DS_EIO);
  assert_int_equal(ds_text_load(NULL, good, 0, &err), DS_EINVAL);

  /* bible not on PATH: a clear DS_ECMD, and no cache file left behind */
  const char *old = getenv("PATH");
  char *saved = old != NULL ? strdup(old) : NULL;
  assert_int_equal(setenv("PATH", tmpdir, 1), 0);
  path_in(bad, sizeof bad, "never-kjv.txt");
  fprintf(stderr, "(a 'bible: not found' message from sh is expected next)\n");
  assert_int_equal(ds_text_cache_create(bad, &err), DS_ECMD);
  assert_non_null(strstr(err.msg, "bible"));
  assert_int_equal(access(bad, F_OK), -1);
  if (saved != NULL) {
    assert_int_equal(setenv("PATH", saved, 1), 0);
    free(saved);
  }
  assert_true(strlen(ds_strerror(DS_ECMD)) > 0);
  assert_string_equal(ds_strerror(12345), "unknown status");
}

static void test_text_sampler(void **state) {
  (void)state;
  char path[256];
  ds_text t;
  path_in(path, sizeof path, "sampler-kjv.txt");
  assert_int_equal(ds_text_load(&t, path, 1, NULL), DS_OK);
  enum { B = 8, C = 64 };
  uint8_t in[B * C], tg[B * C], in2[B * C], tg2[B * C];
  ds_text_sampler s, s2;

  for (int split = 0; split < 2; split++) {
    size_t n;
    const uint8_t *d = ds_text_split(&t, (ds_split)split, &n);
    assert_int_equal(ds_text_sampler_init(&s, &t, (ds_split)split, C, 7), DS_OK);
    assert_int_equal(ds_text_sampler_init(&s2, &t, (ds_split)split, C, 7), DS_OK);
    assert_int_equal(ds_text_sampler_next(&s, B, in, tg), DS_OK);
    assert_int_equal(ds_text_sampler_next(&s2, B, in2, tg2), DS_OK);
    assert_memory_equal(in, in2, sizeof in); /* same seed, same windows */
    assert_memory_equal(tg, tg2, sizeof tg);
    for (size_t i = 0; i < B; i++) {
      /* target is the input shifted by one, and the window comes from this split */
      assert_memory_equal(in + i * C + 1, tg + i * C, C - 1);
      const uint8_t *at = NULL;
      for (size_t k = 0; k + C < n && at == NULL; k++)
        if (d[k] == in[i * C] && memcmp(d + k, in + i * C, C) == 0 && d[k + C] == tg[i * C + C - 1])
          at = d + k;
      assert_non_null(at);
    }
    assert_int_equal(ds_text_sampler_init(&s2, &t, (ds_split)split, C, 8), DS_OK);
    assert_int_equal(ds_text_sampler_next(&s2, B, in2, tg2), DS_OK);
    assert_memory_not_equal(in, in2, sizeof in); /* another seed, other windows */
  }

  /* The whole split is reachable: a window may end on the split's last byte. */
  size_t nev;
  const uint8_t *ev = ds_text_split(&t, DS_SPLIT_EVAL, &nev);
  uint8_t *wi = malloc(nev), *wt = malloc(nev);
  assert_true(wi && wt);
  assert_int_equal(ds_text_sampler_init(&s, &t, DS_SPLIT_EVAL, nev - 1, 1), DS_OK);
  assert_int_equal(ds_text_sampler_next(&s, 1, wi, wt), DS_OK);
  assert_memory_equal(wi, ev, nev - 1);
  assert_memory_equal(wt, ev + 1, nev - 1);
  free(wi);
  free(wt);

  assert_int_equal(ds_text_sampler_init(&s, &t, DS_SPLIT_EVAL, nev, 1), DS_EINVAL);
  assert_int_equal(ds_text_sampler_init(&s, &t, DS_SPLIT_TRAIN, 0, 1), DS_EINVAL);
  assert_int_equal(ds_text_sampler_init(&s, &t, (ds_split)5, 8, 1), DS_EINVAL);
  assert_int_equal(ds_text_sampler_init(NULL, &t, DS_SPLIT_TRAIN, 8, 1), DS_EINVAL);
  assert_int_equal(ds_text_sampler_init(&s, &t, DS_SPLIT_TRAIN, C, 1), DS_OK);
  assert_int_equal(ds_text_sampler_next(&s, 0, in, tg), DS_EINVAL);
  assert_int_equal(ds_text_sampler_next(&s, 1, NULL, tg), DS_EINVAL);
  ds_text_destroy(&t);
}

static void test_rng(void **state) {
  (void)state;
  ds_rng r;
  ds_rng_seed(&r, 0);
  enum { K = 10, DRAWS = 100000 };
  size_t hist[K] = {0};
  for (int i = 0; i < DRAWS; i++) hist[ds_rng_below(&r, K)]++;
  for (int k = 0; k < K; k++) /* 5 sigma is about 475 */
    assert_true(hist[k] > DRAWS / K - 500 && hist[k] < DRAWS / K + 500);
  assert_int_equal(ds_rng_below(&r, 1), 0);
}

/* ------------------------------------------------------------------------------------ */
/* Fashion-MNIST                                                                          */

static void test_fmnist_package(void **state) {
  (void)state;
  ds_images s;
  ds_error err;
  static const uint8_t train_first[12] = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5, 0, 9};
  static const uint8_t eval_first[12] = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7, 4, 5};

  assert_int_equal(ds_fmnist_load(&s, NULL, DS_SPLIT_TRAIN, &err), DS_OK);
  assert_int_equal(s.count, 60000);
  assert_int_equal(s.rows, 28);
  assert_int_equal(s.cols, 28);
  assert_memory_equal(s.labels, train_first, sizeof train_first);
  assert_int_equal(crc(s.pixels, 784), 0xf270beb5u);
  assert_int_equal(crc(s.pixels, 78400), 0xe0f208c6u);
  assert_int_equal(crc(s.pixels + 59999 * 784, 784), 0x6d595368u);
  assert_int_equal(crc(s.labels, 60000), 0x2ed6e46au);
  ds_images_destroy(&s);

  assert_int_equal(ds_fmnist_load(&s, DS_FMNIST_DIR, DS_SPLIT_EVAL, &err), DS_OK);
  assert_int_equal(s.count, 10000);
  assert_memory_equal(s.labels, eval_first, sizeof eval_first);
  assert_int_equal(crc(s.pixels, 784), 0x52830860u);
  assert_int_equal(crc(s.pixels, 78400), 0xde315fc0u);
  assert_int_equal(crc(s.pixels + 9999 * 784, 784), 0x4c5edc96u);
  assert_int_equal(crc(s.labels, 10000), 0x242bc73fu);

  /* floats: pixel / 255 in [0, 1]; the first test image's pixels sum to 33456 */
  float x[2 * 784];
  uint8_t y[2];
  assert_int_equal(ds_images_batch(&s, 0, 2, x, y), DS_OK);
  double sum = 0.0;
  for (size_t i = 0; i < 784; i++) {
    assert_true(x[i] >= 0.0f && x[i] <= 1.0f);
    assert_true(x[i] * 255.0f - (float)s.pixels[i] < 1e-3f);
    sum += x[i];
  }
  assert_true(sum * 255.0 > 33456.0 - 0.5 && sum * 255.0 < 33456.0 + 0.5);
  assert_int_equal(y[0], 9);
  assert_int_equal(y[1], 2);
  assert_int_equal(ds_images_batch(&s, 9999, 2, x, y), DS_EINVAL);
  assert_int_equal(ds_images_batch(&s, 9998, 2, NULL, y), DS_OK);
  ds_images_destroy(&s);
  ds_images_destroy(&s);
}

static void test_image_sampler(void **state) {
  (void)state;
  ds_images s;
  assert_int_equal(ds_fmnist_load(&s, NULL, DS_SPLIT_EVAL, NULL), DS_OK);
  enum { B = 1000 };
  float *x = malloc(B * 784 * sizeof *x), *x2 = malloc(B * 784 * sizeof *x2);
  uint8_t y[B], y2[B];
  assert_true(x && x2);

  double total = 0.0; /* every pixel of the set, once */
  for (size_t i = 0; i < s.count * 784; i++) total += s.pixels[i];

  ds_image_sampler a, b;
  assert_int_equal(ds_image_sampler_init(&a, &s, 3), DS_OK);
  assert_int_equal(ds_image_sampler_init(&b, &s, 3), DS_OK);
  size_t classes[10] = {0};
  double seen = 0.0;
  int in_order = 1;
  for (int k = 0; k < 10; k++) { /* one epoch exactly */
    assert_int_equal(ds_image_sampler_next(&a, B, x, y), DS_OK);
    assert_int_equal(ds_image_sampler_next(&b, B, x2, y2), DS_OK);
    assert_memory_equal(x, x2, B * 784 * sizeof *x);
    assert_memory_equal(y, y2, sizeof y);
    for (size_t i = 0; i < B; i++) {
      classes[y[i]]++;
      if (y[i] != s.labels[k * B + i]) in_order = 0;
    }
    for (size_t i = 0; i < B * 784; i++) seen += (double)lrintf(x[i] * 255.0f);
  }
  assert_int_equal(a.epoch, 0);
  for (int c = 0; c < 10; c++) assert_int_equal(classes[c], 1000);
  assert_true(seen == total);
  assert_false(in_order); /* shuffled */

  /* the next batch starts a new epoch with a new permutation */
  assert_int_equal(ds_image_sampler_next(&a, B, x, y), DS_OK);
  assert_int_equal(a.epoch, 1);
  ds_image_sampler_destroy(&b);
  assert_int_equal(ds_image_sampler_init(&b, &s, 4), DS_OK);
  assert_int_equal(ds_image_sampler_next(&b, B, x2, y2), DS_OK);
  assert_memory_not_equal(y, y2, sizeof y);

  /* a batch that does not divide the set: no batch straddles an epoch */
  ds_image_sampler_destroy(&b);
  assert_int_equal(ds_image_sampler_init(&b, &s, 5), DS_OK);
  for (int k = 0; k < 3; k++) assert_int_equal(ds_image_sampler_next(&b, 999, x2, y2), DS_OK);
  assert_int_equal(b.epoch, 0);
  for (int k = 0; k < 7; k++) assert_int_equal(ds_image_sampler_next(&b, 999, x2, y2), DS_OK);
  assert_int_equal(b.epoch, 0); /* 10 x 999 = 9990 <= 10000 */
  assert_int_equal(ds_image_sampler_next(&b, 999, x2, y2), DS_OK);
  assert_int_equal(b.epoch, 1);

  assert_int_equal(ds_image_sampler_next(&b, 10001, x2, y2), DS_EINVAL);
  assert_int_equal(ds_image_sampler_next(&b, 0, x2, y2), DS_EINVAL);
  assert_int_equal(ds_image_sampler_next(&b, 1, NULL, y2), DS_EINVAL);
  ds_image_sampler_destroy(&b);
  assert_int_equal(ds_image_sampler_init(&b, NULL, 1), DS_EINVAL);
  ds_image_sampler_destroy(&b); /* harmless after a failed init */
  ds_image_sampler_destroy(&a);
  free(x);
  free(x2);
  ds_images_destroy(&s);
}

/* Writes a gzipped IDX file: the header words, then n payload bytes. */
static void write_idx_gz(const char *path, const uint32_t *words, int nwords,
                         const uint8_t *payload, size_t n) {
  gzFile f = gzopen(path, "wb");
  assert_non_null(f);
  for (int i = 0; i < nwords; i++) {
    uint8_t be[4] = {(uint8_t)(words[i] >> 24), (uint8_t)(words[i] >> 16), (uint8_t)(words[i] >> 8),
                     (uint8_t)words[i]};
    assert_int_equal(gzwrite(f, be, 4), 4);
  }
  if (n > 0) assert_int_equal(gzwrite(f, payload, (unsigned)n), (int)n);
  assert_int_equal(gzclose(f), Z_OK);
}

static void copy_file(const char *from, const char *to) {
  size_t n;
  uint8_t *b = read_bytes(from, &n);
  write_bytes(to, b, n);
  free(b);
}

#define expect_damaged(want, file, word) expect_damaged_at(__LINE__, want, file, word)

static void expect_damaged_at(int line, int want, const char *file_in_msg,
                              const char *word_in_msg) {
  ds_images s;
  ds_error err;
  memset(&err, 0, sizeof err);
  int rc = ds_fmnist_load(&s, tmpdir, DS_SPLIT_EVAL, &err);
  if (rc != want) fail_msg("case at line %d: status %d, want %d (%s)", line, rc, want, err.msg);
  assert_null(s.pixels);
  assert_null(s.labels);
  assert_non_null(strstr(err.msg, file_in_msg));
  if (word_in_msg != NULL && strstr(err.msg, word_in_msg) == NULL) fail_msg("message: %s", err.msg);
  ds_images_destroy(&s);
}

static void test_fmnist_damaged(void **state) {
  (void)state;
  char im[256], lb[256];
  path_in(im, sizeof im, "t10k-images-idx3-ubyte.gz");
  path_in(lb, sizeof lb, "t10k-labels-idx1-ubyte.gz");

  /* missing */
  expect_damaged(DS_EIO, "t10k-images", "cannot open");
  copy_file(DS_FMNIST_DIR "/t10k-images-idx3-ubyte.gz", im);
  expect_damaged(DS_EIO, "t10k-labels", "cannot open");
  copy_file(DS_FMNIST_DIR "/t10k-labels-idx1-ubyte.gz", lb);
  ds_images s;
  assert_int_equal(ds_fmnist_load(&s, tmpdir, DS_SPLIT_EVAL, NULL), DS_OK); /* the good copy */
  ds_images_destroy(&s);

  size_t n;
  uint8_t *gz = read_bytes(DS_FMNIST_DIR "/t10k-images-idx3-ubyte.gz", &n);
  /* truncated copy */
  write_bytes(im, gz, n / 2);
  expect_damaged(DS_EFORMAT, "t10k-images", NULL);
  /* only the gzip trailer (CRC, length) missing: the pixels are all there */
  write_bytes(im, gz, n - 8);
  expect_damaged(DS_EFORMAT, "t10k-images", NULL);
  /* a corrupted byte inside the compressed data */
  gz[n / 2] ^= 0x5a;
  write_bytes(im, gz, n);
  expect_damaged(DS_EFORMAT, "t10k-images", NULL);
  free(gz);

  /* bad magic, wrong count, wrong size, short payload, data past the end */
  uint8_t *px = calloc(10001 * 784, 1);
  assert_non_null(px);
  write_idx_gz(im, (const uint32_t[]){0x00000801, 10000, 28, 28}, 4, px, 10000 * 784);
  expect_damaged(DS_EFORMAT, "t10k-images", "magic");
  write_idx_gz(im, (const uint32_t[]){0x00000803, 9999, 28, 28}, 4, px, 9999 * 784);
  expect_damaged(DS_EFORMAT, "t10k-images", "expected 10000");
  write_idx_gz(im, (const uint32_t[]){0x00000803, 10000, 32, 32}, 4, px, 10000 * 784);
  expect_damaged(DS_EFORMAT, "t10k-images", "28 x 28");
  write_idx_gz(im, (const uint32_t[]){0x00000803, 10000, 28, 28}, 4, px, 10000 * 784 - 1);
  expect_damaged(DS_EFORMAT, "t10k-images", "truncated");
  write_idx_gz(im, (const uint32_t[]){0x00000803, 10000, 28, 28}, 4, px, 10001 * 784);
  expect_damaged(DS_EFORMAT, "t10k-images", "past");
  write_idx_gz(im, (const uint32_t[]){0x00000803}, 1, px, 0);
  expect_damaged(DS_EFORMAT, "t10k-images", "header");
  /* a zero-length file */
  write_bytes(im, "", 0);
  expect_damaged(DS_EFORMAT, "t10k-images", NULL);
  free(px);

  /* labels: with good images, bad magic, count, range */
  copy_file(DS_FMNIST_DIR "/t10k-images-idx3-ubyte.gz", im);
  uint8_t lab[10000];
  for (size_t i = 0; i < sizeof lab; i++) lab[i] = (uint8_t)(i % 10);
  write_idx_gz(lb, (const uint32_t[]){0x00000803, 10000}, 2, lab, sizeof lab);
  expect_damaged(DS_EFORMAT, "t10k-labels", "magic");
  write_idx_gz(lb, (const uint32_t[]){0x00000801, 60000}, 2, lab, sizeof lab);
  expect_damaged(DS_EFORMAT, "t10k-labels", "expected 10000");
  lab[1234] = 10;
  write_idx_gz(lb, (const uint32_t[]){0x00000801, 10000}, 2, lab, sizeof lab);
  expect_damaged(DS_EFORMAT, "t10k-labels", "outside");
  lab[1234] = 4;
  write_idx_gz(lb, (const uint32_t[]){0x00000801, 10000}, 2, lab, sizeof lab);
  assert_int_equal(ds_fmnist_load(&s, tmpdir, DS_SPLIT_EVAL, NULL), DS_OK);
  assert_int_equal(s.labels[1234], 4);
  ds_images_destroy(&s);

  assert_int_equal(ds_fmnist_load(NULL, tmpdir, DS_SPLIT_EVAL, NULL), DS_EINVAL);
  assert_int_equal(ds_fmnist_load(&s, tmpdir, (ds_split)9, NULL), DS_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_text_cache_and_splits), cmocka_unit_test(test_text_damaged),
      cmocka_unit_test(test_text_sampler),          cmocka_unit_test(test_rng),
      cmocka_unit_test(test_fmnist_package),        cmocka_unit_test(test_image_sampler),
      cmocka_unit_test(test_fmnist_damaged),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
