/*
 * datasets.c -- the King James Bible (byte-level) and Fashion-MNIST for the benchmark
 * clients: loading with checks, splits, seeded samplers.
 *
 * A damaged file must stop a benchmark with a message that names the file, never feed it
 * garbage: a run that trains on a truncated corpus still produces plausible numbers.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "datasets.h"

const char *ds_strerror(int status) {
  switch (status) {
    case DS_OK:
      return "success";
    case DS_EINVAL:
      return "invalid argument";
    case DS_EIO:
      return "file missing or unreadable";
    case DS_EFORMAT:
      return "file damaged or not in the expected format";
    case DS_ENOMEM:
      return "out of memory";
    case DS_ECMD:
      return "the bible command failed (are bible-kjv and bible-kjv-text installed?)";
  }
  return "unknown status";
}

/* Writes "<path>: <message>" into err (if any) and returns status, so that a failure
 * reads: return fail(err, status, path, "...", ...). */
static int fail(ds_error *err, int status, const char *path, const char *fmt, ...) {
  if (err == NULL) return status;
  int n = snprintf(err->msg, sizeof err->msg, "%s: ", path != NULL ? path : "(none)");
  if (n < 0 || (size_t)n >= sizeof err->msg) return status;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg + n, sizeof err->msg - (size_t)n, fmt, ap);
  va_end(ap);
  return status;
}

/* ------------------------------------------------------------------------------------ */
/* Random numbers                                                                         */

void ds_rng_seed(ds_rng *rng, uint64_t seed) {
  if (rng != NULL) rng->state = seed;
}

/* splitmix64 (Steele, Lea, Flood 2014): any seed, 0 included, gives a good stream. */
uint64_t ds_rng_next(ds_rng *rng) {
  uint64_t z = (rng->state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t ds_rng_below(ds_rng *rng, uint64_t n) {
  if (n <= 1) return 0;
  /* Reject the low 2^64 mod n values so that every residue is equally likely. */
  uint64_t threshold = (0 - n) % n, r;
  do r = ds_rng_next(rng);
  while (r < threshold);
  return r % n;
}

/* ------------------------------------------------------------------------------------ */
/* Text                                                                                   */

#define KJV_COMMAND "bible -l79 'gen1:1-rev22:21'"
#define KJV_HEAD    "\nGenesis 1\n"
#define KJV_TAIL    "Amen.\n"
#define KJV_MIN_LEN ((size_t)1 << 20)

int ds_text_default_cache(char *buf, size_t bufsize) {
  if (buf == NULL || bufsize == 0) return DS_EINVAL;
  const char *dir = getenv("PRECOND_DATA_DIR");
  if (dir == NULL || dir[0] == '\0') dir = "data";
  int n = snprintf(buf, bufsize, "%s/%s", dir, DS_TEXT_CACHE_NAME);
  if (n < 0 || (size_t)n >= bufsize) return DS_EINVAL;
  return DS_OK;
}

/* Is this the complete KJV as bible prints it? Cheap checks that catch a truncated
 * cache (an interrupted copy) and a foreign file (a wrong path). */
static int text_check(const uint8_t *b, size_t len, const char *path, ds_error *err) {
  size_t nh = strlen(KJV_HEAD), nt = strlen(KJV_TAIL);
  if (len < KJV_MIN_LEN)
    return fail(err, DS_EFORMAT, path, "%zu bytes, too short for the KJV (truncated?)", len);
  if (memcmp(b, KJV_HEAD, nh) != 0)
    return fail(err, DS_EFORMAT, path, "does not start with Genesis 1");
  if (memcmp(b + len - nt, KJV_TAIL, nt) != 0)
    return fail(err, DS_EFORMAT, path, "does not end with Revelation 22:21 (truncated?)");
  for (size_t i = 0; i < len; i++)
    if (b[i] >= 0x80) return fail(err, DS_EFORMAT, path, "byte %zu is not 7-bit ASCII", i);
  return DS_OK;
}

/* Reads the whole file; *out is malloc'ed and owned by the caller on DS_OK. */
static int read_whole(const char *path, uint8_t **out, size_t *len, ds_error *err) {
  int rc = DS_OK;
  uint8_t *b = NULL;
  FILE *f = fopen(path, "rb");
  if (f == NULL) return fail(err, DS_EIO, path, "cannot open: %s", strerror(errno));
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
    rc = fail(err, DS_EIO, path, "not a regular file");
    goto cleanup;
  }
  size_t n = (size_t)st.st_size;
  b = malloc(n > 0 ? n : 1);
  if (b == NULL) {
    rc = fail(err, DS_ENOMEM, path, "cannot allocate %zu bytes", n);
    goto cleanup;
  }
  if (fread(b, 1, n, f) != n) {
    rc = fail(err, DS_EIO, path, "read error");
    goto cleanup;
  }
  *out = b;
  *len = n;
  b = NULL;
cleanup:
  free(b);
  fclose(f);
  return rc;
}

/* Runs bible and returns its output (malloc'ed, owned by the caller on DS_OK). */
static int run_bible(uint8_t **out, size_t *len, const char *path, ds_error *err) {
  int rc = DS_OK;
  size_t cap = (size_t)8 << 20, n = 0;
  uint8_t *b = malloc(cap);
  if (b == NULL) return fail(err, DS_ENOMEM, path, "cannot allocate %zu bytes", cap);
  FILE *p = popen(KJV_COMMAND, "r");
  if (p == NULL) {
    free(b);
    return fail(err, DS_ECMD, path, "cannot run `%s`: %s", KJV_COMMAND, strerror(errno));
  }
  for (;;) {
    if (n == cap) {
      uint8_t *nb = realloc(b, cap * 2);
      if (nb == NULL) {
        rc = fail(err, DS_ENOMEM, path, "cannot allocate %zu bytes", cap * 2);
        break;
      }
      b = nb;
      cap *= 2;
    }
    size_t got = fread(b + n, 1, cap - n, p);
    n += got;
    if (got == 0) break;
  }
  int st = pclose(p);
  if (rc == DS_OK && (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0))
    rc = fail(err, DS_ECMD, path, "`%s` failed (exit status %d)", KJV_COMMAND,
              st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  if (rc != DS_OK) {
    free(b);
    return rc;
  }
  *out = b;
  *len = n;
  return DS_OK;
}

/* mkdir of the directory part of path, if it has one; an existing one is fine. */
static int make_parent(const char *path, ds_error *err) {
  const char *slash = strrchr(path, '/');
  if (slash == NULL || slash == path) return DS_OK;
  size_t n = (size_t)(slash - path);
  char *dir = malloc(n + 1);
  if (dir == NULL) return fail(err, DS_ENOMEM, path, "out of memory");
  memcpy(dir, path, n);
  dir[n] = '\0';
  int rc = DS_OK;
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    rc = fail(err, DS_EIO, path, "cannot create directory %s: %s", dir, strerror(errno));
  free(dir);
  return rc;
}

static int write_all(int fd, const uint8_t *b, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, b, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

int ds_text_cache_create(const char *path, ds_error *err) {
  char defpath[4096], *tmp = NULL;
  uint8_t *b = NULL;
  size_t len = 0;
  int fd = -1, rc;
  if (path == NULL) {
    if (ds_text_default_cache(defpath, sizeof defpath) != DS_OK)
      return fail(err, DS_EINVAL, NULL, "$PRECOND_DATA_DIR is too long");
    path = defpath;
  }
  if ((rc = run_bible(&b, &len, path, err)) != DS_OK) goto cleanup;
  if ((rc = text_check(b, len, KJV_COMMAND, err)) != DS_OK) goto cleanup;
  if ((rc = make_parent(path, err)) != DS_OK) goto cleanup;

  /* Write beside the target and rename: readers never see half a cache. */
  size_t nt = strlen(path) + sizeof ".tmp.XXXXXX";
  tmp = malloc(nt);
  if (tmp == NULL) {
    rc = fail(err, DS_ENOMEM, path, "out of memory");
    goto cleanup;
  }
  snprintf(tmp, nt, "%s.tmp.XXXXXX", path);
  fd = mkstemp(tmp);
  if (fd < 0) {
    rc = fail(err, DS_EIO, path, "cannot create a temporary file: %s", strerror(errno));
    free(tmp);
    tmp = NULL;
    goto cleanup;
  }
  if (write_all(fd, b, len) != 0 || fsync(fd) != 0) {
    rc = fail(err, DS_EIO, tmp, "cannot write: %s", strerror(errno));
    goto cleanup;
  }
  if (close(fd) != 0) {
    fd = -1;
    rc = fail(err, DS_EIO, tmp, "cannot write: %s", strerror(errno));
    goto cleanup;
  }
  fd = -1;
  /* mkstemp makes the file 0600; a cache is for everyone on the machine to read. */
  chmod(tmp, 0644);
  if (rename(tmp, path) != 0) {
    rc = fail(err, DS_EIO, path, "cannot rename %s into place: %s", tmp, strerror(errno));
    goto cleanup;
  }
  free(tmp);
  tmp = NULL;
cleanup:
  if (fd >= 0) close(fd);
  if (tmp != NULL) {
    unlink(tmp);
    free(tmp);
  }
  free(b);
  return rc;
}

int ds_text_load(ds_text *t, const char *path, int create, ds_error *err) {
  char defpath[4096];
  uint8_t *b = NULL;
  size_t len = 0;
  if (t != NULL) memset(t, 0, sizeof *t);
  if (t == NULL) return fail(err, DS_EINVAL, path, "no ds_text given");
  if (path == NULL) {
    if (ds_text_default_cache(defpath, sizeof defpath) != DS_OK)
      return fail(err, DS_EINVAL, NULL, "$PRECOND_DATA_DIR is too long");
    path = defpath;
  }
  if (create && access(path, F_OK) != 0 && errno == ENOENT) {
    int rc = ds_text_cache_create(path, err);
    if (rc != DS_OK) return rc;
  }
  int rc = read_whole(path, &b, &len, err);
  if (rc != DS_OK) return rc;
  if ((rc = text_check(b, len, path, err)) != DS_OK) {
    free(b);
    return rc;
  }
  t->bytes = b;
  t->len = len;
  t->train_len = len / 10 * 9 + len % 10 * 9 / 10;
  return DS_OK;
}

void ds_text_destroy(ds_text *t) {
  if (t == NULL) return;
  free(t->bytes);
  memset(t, 0, sizeof *t);
}

const uint8_t *ds_text_split(const ds_text *t, ds_split split, size_t *len) {
  if (t == NULL || t->bytes == NULL) {
    if (len != NULL) *len = 0;
    return NULL;
  }
  size_t off = split == DS_SPLIT_TRAIN ? 0 : t->train_len;
  size_t n = split == DS_SPLIT_TRAIN ? t->train_len : t->len - t->train_len;
  if (len != NULL) *len = n;
  return t->bytes + off;
}

int ds_text_sampler_init(ds_text_sampler *s, const ds_text *t, ds_split split, size_t context,
                         uint64_t seed) {
  if (s == NULL || t == NULL || t->bytes == NULL || context == 0) return DS_EINVAL;
  if (split != DS_SPLIT_TRAIN && split != DS_SPLIT_EVAL) return DS_EINVAL;
  size_t len;
  const uint8_t *d = ds_text_split(t, split, &len);
  if (len < context + 1 || context == SIZE_MAX) return DS_EINVAL;
  s->data = d;
  s->len = len;
  s->context = context;
  ds_rng_seed(&s->rng, seed);
  return DS_OK;
}

int ds_text_sampler_next(ds_text_sampler *s, size_t batch, uint8_t *input, uint8_t *target) {
  if (s == NULL || s->data == NULL || batch == 0 || input == NULL || target == NULL)
    return DS_EINVAL;
  const size_t c = s->context, starts = s->len - c; /* s in [0, len - c - 1] */
  for (size_t i = 0; i < batch; i++) {
    size_t at = (size_t)ds_rng_below(&s->rng, starts);
    memcpy(input + i * c, s->data + at, c);
    memcpy(target + i * c, s->data + at + 1, c);
  }
  return DS_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Fashion-MNIST                                                                          */

#define IDX_MAGIC_IMAGES 0x00000803u /* unsigned byte, 3 dimensions */
#define IDX_MAGIC_LABELS 0x00000801u /* unsigned byte, 1 dimension */

static uint32_t be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* zlib's own word for what went wrong, or "truncated" when it has none. */
static const char *gz_reason(gzFile f) {
  int errnum = Z_OK;
  const char *m = gzerror(f, &errnum);
  return errnum != Z_OK && m != NULL && m[0] != '\0' ? m : "truncated";
}

/* Reads exactly n bytes. gzread takes an unsigned count: read in chunks. */
static int gz_read_exact(gzFile f, void *buf, size_t n, const char *path, const char *what,
                         ds_error *err) {
  uint8_t *p = buf;
  size_t done = 0;
  while (done < n) {
    size_t want = n - done < ((size_t)1 << 24) ? n - done : ((size_t)1 << 24);
    int got = gzread(f, p + done, (unsigned)want);
    if (got <= 0)
      return fail(err, DS_EFORMAT, path, "%s: %s after %zu of %zu bytes", what, gz_reason(f), done,
                  n);
    done += (size_t)got;
  }
  return DS_OK;
}

/* The data must end where the header says; reading past it also makes zlib check the
 * gzip trailer (CRC-32 and length). */
static int gz_expect_end(gzFile f, const char *path, ds_error *err) {
  uint8_t extra;
  int got = gzread(f, &extra, 1);
  if (got > 0) return fail(err, DS_EFORMAT, path, "data continues past the declared count");
  int errnum = Z_OK;
  gzerror(f, &errnum);
  if (got < 0 || (errnum != Z_OK && errnum != Z_STREAM_END))
    return fail(err, DS_EFORMAT, path, "%s", gz_reason(f));
  return DS_OK;
}

/* zlib checks the gzip trailer (CRC-32 and length of the data) when it is there, but
 * reads a file whose trailer was cut off as if it were whole. So the trailer is checked
 * here too, against what was read: crc and total cover every decompressed byte. Assumes
 * one gzip member, as the dataset's files are; an uncompressed file has no trailer. */
static int gz_check_trailer(gzFile f, const char *path, uint32_t crc, uint64_t total,
                            ds_error *err) {
  if (gzdirect(f)) return DS_OK;
  uint8_t t[8];
  FILE *raw = fopen(path, "rb");
  if (raw == NULL) return fail(err, DS_EIO, path, "cannot reopen: %s", strerror(errno));
  int ok = fseek(raw, -8, SEEK_END) == 0 && fread(t, 1, 8, raw) == 8;
  fclose(raw);
  uint32_t tcrc =
      (uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24;
  uint32_t tlen =
      (uint32_t)t[4] | (uint32_t)t[5] << 8 | (uint32_t)t[6] << 16 | (uint32_t)t[7] << 24;
  if (!ok || tcrc != crc || tlen != (uint32_t)total)
    return fail(err, DS_EFORMAT, path, "gzip trailer missing or wrong (truncated?)");
  return DS_OK;
}

static uint32_t crc_of(uint32_t crc, const uint8_t *b, size_t n) {
  while (n > 0) { /* crc32 takes an unsigned count */
    uInt k = n < ((size_t)1 << 30) ? (uInt)n : (uInt)1 << 30;
    crc = (uint32_t)crc32(crc, b, k);
    b += k;
    n -= k;
  }
  return crc;
}

static gzFile gz_open(const char *path, int *rc, ds_error *err) {
  errno = 0;
  gzFile f = gzopen(path, "rb");
  if (f == NULL) {
    *rc = fail(err, errno == ENOMEM ? DS_ENOMEM : DS_EIO, path, "cannot open: %s",
               errno != 0 ? strerror(errno) : "zlib could not open it");
    return NULL;
  }
  gzbuffer(f, 1u << 17);
  *rc = DS_OK;
  return f;
}

static int load_images(ds_images *set, const char *path, size_t want, ds_error *err) {
  int rc;
  uint8_t h[16];
  gzFile f = gz_open(path, &rc, err);
  if (f == NULL) return rc;
  if ((rc = gz_read_exact(f, h, sizeof h, path, "header", err)) != DS_OK) goto cleanup;
  if (be32(h) != IDX_MAGIC_IMAGES) {
    rc = fail(err, DS_EFORMAT, path, "bad magic 0x%08x (images are 0x%08x)", be32(h),
              IDX_MAGIC_IMAGES);
    goto cleanup;
  }
  if (be32(h + 4) != want) {
    rc = fail(err, DS_EFORMAT, path, "%u images, expected %zu", be32(h + 4), want);
    goto cleanup;
  }
  if (be32(h + 8) != DS_FMNIST_SIDE || be32(h + 12) != DS_FMNIST_SIDE) {
    rc = fail(err, DS_EFORMAT, path, "images are %u x %u, expected %d x %d", be32(h + 8),
              be32(h + 12), DS_FMNIST_SIDE, DS_FMNIST_SIDE);
    goto cleanup;
  }
  set->pixels = malloc(want * DS_FMNIST_PIXELS);
  if (set->pixels == NULL) {
    rc = fail(err, DS_ENOMEM, path, "cannot allocate the pixels");
    goto cleanup;
  }
  if ((rc = gz_read_exact(f, set->pixels, want * DS_FMNIST_PIXELS, path, "pixels", err)) != DS_OK)
    goto cleanup;
  if ((rc = gz_expect_end(f, path, err)) != DS_OK) goto cleanup;
  uint32_t crc = crc_of(crc_of(0, h, sizeof h), set->pixels, want * DS_FMNIST_PIXELS);
  rc = gz_check_trailer(f, path, crc, sizeof h + (uint64_t)want * DS_FMNIST_PIXELS, err);
cleanup:
  gzclose(f);
  return rc;
}

static int load_labels(ds_images *set, const char *path, size_t want, ds_error *err) {
  int rc;
  uint8_t h[8];
  gzFile f = gz_open(path, &rc, err);
  if (f == NULL) return rc;
  if ((rc = gz_read_exact(f, h, sizeof h, path, "header", err)) != DS_OK) goto cleanup;
  if (be32(h) != IDX_MAGIC_LABELS) {
    rc = fail(err, DS_EFORMAT, path, "bad magic 0x%08x (labels are 0x%08x)", be32(h),
              IDX_MAGIC_LABELS);
    goto cleanup;
  }
  if (be32(h + 4) != want) {
    rc = fail(err, DS_EFORMAT, path, "%u labels, expected %zu", be32(h + 4), want);
    goto cleanup;
  }
  set->labels = malloc(want);
  if (set->labels == NULL) {
    rc = fail(err, DS_ENOMEM, path, "cannot allocate the labels");
    goto cleanup;
  }
  if ((rc = gz_read_exact(f, set->labels, want, path, "labels", err)) != DS_OK) goto cleanup;
  if ((rc = gz_expect_end(f, path, err)) != DS_OK) goto cleanup;
  uint32_t crc = crc_of(crc_of(0, h, sizeof h), set->labels, want);
  if ((rc = gz_check_trailer(f, path, crc, sizeof h + (uint64_t)want, err)) != DS_OK) goto cleanup;
  for (size_t i = 0; i < want; i++)
    if (set->labels[i] >= DS_FMNIST_CLASSES) {
      rc = fail(err, DS_EFORMAT, path, "label %zu is %u, outside 0..9", i, set->labels[i]);
      goto cleanup;
    }
cleanup:
  gzclose(f);
  return rc;
}

int ds_fmnist_load(ds_images *set, const char *dir, ds_split split, ds_error *err) {
  char path[4096];
  if (set != NULL) memset(set, 0, sizeof *set);
  if (set == NULL || (split != DS_SPLIT_TRAIN && split != DS_SPLIT_EVAL))
    return fail(err, DS_EINVAL, dir, "no ds_images given, or an unknown split");
  if (dir == NULL) dir = DS_FMNIST_DIR;
  const char *prefix = split == DS_SPLIT_TRAIN ? "train" : "t10k";
  size_t want = split == DS_SPLIT_TRAIN ? DS_FMNIST_TRAIN_COUNT : DS_FMNIST_EVAL_COUNT;

  int rc, n = snprintf(path, sizeof path, "%s/%s-images-idx3-ubyte.gz", dir, prefix);
  if (n < 0 || (size_t)n >= sizeof path) return fail(err, DS_EINVAL, dir, "path too long");
  if ((rc = load_images(set, path, want, err)) != DS_OK) goto cleanup;
  snprintf(path, sizeof path, "%s/%s-labels-idx1-ubyte.gz", dir, prefix);
  if ((rc = load_labels(set, path, want, err)) != DS_OK) goto cleanup;
  set->count = want;
  set->rows = set->cols = DS_FMNIST_SIDE;
  return DS_OK;
cleanup:
  ds_images_destroy(set);
  return rc;
}

void ds_images_destroy(ds_images *set) {
  if (set == NULL) return;
  free(set->pixels);
  free(set->labels);
  memset(set, 0, sizeof *set);
}

/* Image k of the set as floats in [0, 1]. */
static void image_to_float(const ds_images *set, size_t k, float *x) {
  const size_t np = set->rows * set->cols;
  const uint8_t *p = set->pixels + k * np;
  for (size_t i = 0; i < np; i++) x[i] = (float)p[i] / 255.0f;
}

int ds_images_batch(const ds_images *set, size_t first, size_t n, float *x, uint8_t *y) {
  if (set == NULL || set->pixels == NULL || first > set->count || n > set->count - first)
    return DS_EINVAL;
  const size_t np = set->rows * set->cols;
  for (size_t i = 0; i < n; i++) {
    if (x != NULL) image_to_float(set, first + i, x + i * np);
    if (y != NULL) y[i] = set->labels[first + i];
  }
  return DS_OK;
}

/* Fisher-Yates over the whole permutation. */
static void shuffle(uint32_t *perm, size_t n, ds_rng *rng) {
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = (size_t)ds_rng_below(rng, (uint64_t)i + 1);
    uint32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
}

int ds_image_sampler_init(ds_image_sampler *s, const ds_images *set, uint64_t seed) {
  if (s != NULL) memset(s, 0, sizeof *s);
  if (s == NULL || set == NULL || set->pixels == NULL || set->count == 0 || set->count > UINT32_MAX)
    return DS_EINVAL;
  s->perm = malloc(set->count * sizeof *s->perm);
  if (s->perm == NULL) return DS_ENOMEM;
  for (size_t i = 0; i < set->count; i++) s->perm[i] = (uint32_t)i;
  s->set = set;
  ds_rng_seed(&s->rng, seed);
  shuffle(s->perm, set->count, &s->rng);
  return DS_OK;
}

void ds_image_sampler_destroy(ds_image_sampler *s) {
  if (s == NULL) return;
  free(s->perm);
  memset(s, 0, sizeof *s);
}

int ds_image_sampler_next(ds_image_sampler *s, size_t batch, float *x, uint8_t *y) {
  if (s == NULL || s->perm == NULL || x == NULL || batch == 0 || batch > s->set->count)
    return DS_EINVAL;
  if (s->set->count - s->pos < batch) {
    shuffle(s->perm, s->set->count, &s->rng);
    s->pos = 0;
    s->epoch++;
  }
  const size_t np = s->set->rows * s->set->cols;
  for (size_t i = 0; i < batch; i++) {
    uint32_t k = s->perm[s->pos + i];
    image_to_float(s->set, k, x + i * np);
    if (y != NULL) y[i] = s->set->labels[k];
  }
  s->pos += batch;
  return DS_OK;
}
