/*
 * datasets.h -- the real data the benchmark clients train on: the King James Bible as a
 * byte-level language-modelling corpus, and Fashion-MNIST images. The one public header
 * of bench/datasets.c; public names carry the prefix ds_.
 *
 * Conventions
 * - Functions return int: DS_OK (0) or a negative DS_E* code; ds_strerror turns a code
 *   into a static message. Loaders also take an optional ds_error (may be NULL) that
 *   receives a one-line description naming the file and what was wrong with it.
 * - Structs are caller-allocated; a successful *_load / *_init must be paired with the
 *   matching *_destroy, which frees what the struct owns. On failure nothing is owned and
 *   the struct is left empty, so *_destroy on it is harmless.
 * - Samplers are seeded and deterministic: the same seed gives the same batches on every
 *   machine. They borrow the dataset they sample from: keep it alive while sampling.
 * - No globals: everything is reentrant.
 */
#ifndef PRECOND_BENCH_DATASETS_H
#define PRECOND_BENCH_DATASETS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  DS_OK = 0,
  DS_EINVAL = -1,  /* bad argument (NULL, zero size, batch larger than the data) */
  DS_EIO = -2,     /* a file is missing or cannot be read or written */
  DS_EFORMAT = -3, /* a file is damaged: bad magic, size, count, truncation, checksum */
  DS_ENOMEM = -4,  /* allocation failed */
  DS_ECMD = -5     /* the `bible` command failed or is not installed */
};

/* Static message for a status code. Never NULL. */
const char *ds_strerror(int status);

/* Details of the last failure of the call it was passed to: "<path>: <what>". */
typedef struct {
  char msg[512];
} ds_error;

typedef enum {
  DS_SPLIT_TRAIN = 0,
  DS_SPLIT_EVAL /* the text's last 10%; Fashion-MNIST's 10,000-image test set */
} ds_split;

/* Seeded generator (splitmix64) shared by the samplers; exposed so that clients can draw
 * reproducible numbers of their own (weight initialisation, dropout) the same way. */
typedef struct {
  uint64_t state;
} ds_rng;

void ds_rng_seed(ds_rng *rng, uint64_t seed);
uint64_t ds_rng_next(ds_rng *rng);
/* Uniform in [0, n) without modulo bias; n >= 1. */
uint64_t ds_rng_below(ds_rng *rng, uint64_t n);

/* ------------------------------------------------------------------------------------ */
/* Text: the King James Bible, byte-level                                                 */

#define DS_TEXT_VOCAB      256 /* a token is a byte */
#define DS_TEXT_CACHE_NAME "kjv.txt"

/* The corpus is the output of `bible -l79 "gen1:1-rev22:21"` (packages bible-kjv and
 * bible-kjv-text): 79 columns is the program's default width, fixed here because bible
 * otherwise follows $COLUMNS and the corpus must not depend on the terminal. It is cached
 * as a plain text file so that benchmarks read it without running bible. */
typedef struct {
  uint8_t *bytes; /* len bytes, owned; freed by ds_text_destroy */
  size_t len;
  size_t train_len; /* len * 9 / 10: train = bytes[0, train_len), eval = the rest */
} ds_text;

/* Writes the default cache path into buf (bufsize bytes, NUL-terminated):
 * $PRECOND_DATA_DIR/kjv.txt if that variable is set and not empty, else data/kjv.txt
 * (relative to the working directory). Returns DS_OK, or DS_EINVAL if it does not fit. */
int ds_text_default_cache(char *buf, size_t bufsize);

/* Runs `bible` through popen and writes its output to path (NULL: the default),
 * atomically: a temporary file in the same directory, checked as ds_text_load checks a
 * cache, then renamed. Creates the parent directory if it is missing (one level).
 * Returns DS_OK, DS_ECMD (bible missing or failed), DS_EFORMAT (its output is not a
 * complete KJV), DS_EIO, DS_ENOMEM. */
int ds_text_cache_create(const char *path, ds_error *err);

/* Loads the corpus from the cache at path (NULL: the default). If the file is missing and
 * create is non-zero, creates it first with ds_text_cache_create. The cache is checked:
 * 7-bit ASCII, at least 1 MiB, starting "\nGenesis 1\n" and ending "Amen.\n" (the last
 * verse), so a truncated or foreign file is refused with DS_EFORMAT rather than trained
 * on. Returns DS_OK (caller owns t; ds_text_destroy), DS_EIO (missing, create == 0),
 * DS_EFORMAT, DS_ENOMEM, or what ds_text_cache_create returns. */
int ds_text_load(ds_text *t, const char *path, int create, ds_error *err);
void ds_text_destroy(ds_text *t);

/* The bytes of one split: returns a pointer into t (not owned) and writes its length. */
const uint8_t *ds_text_split(const ds_text *t, ds_split split, size_t *len);

/* Draws windows of context bytes from one split: for a start s uniform in
 * [0, split_len - context - 1], input = x[s .. s+context-1] and target = x[s+1 .. s+context]
 * (the next byte of every position). */
typedef struct {
  const uint8_t *data; /* borrowed from the ds_text */
  size_t len;
  size_t context;
  ds_rng rng;
} ds_text_sampler;

/* Returns DS_EINVAL for a NULL argument, an unknown split, context 0, or a split shorter
 * than context + 1 bytes. Owns nothing (no destroy needed). */
int ds_text_sampler_init(ds_text_sampler *s, const ds_text *t, ds_split split, size_t context,
                         uint64_t seed);

/* Fills batch windows: input and target are batch x context, row-major, caller-allocated.
 * Returns DS_OK or DS_EINVAL (NULL, batch 0). */
int ds_text_sampler_next(ds_text_sampler *s, size_t batch, uint8_t *input, uint8_t *target);

/* ------------------------------------------------------------------------------------ */
/* Images: Fashion-MNIST                                                                  */

#define DS_FMNIST_DIR         "/usr/share/datasets/fashion-mnist"
#define DS_FMNIST_SIDE        28
#define DS_FMNIST_PIXELS      (DS_FMNIST_SIDE * DS_FMNIST_SIDE)
#define DS_FMNIST_CLASSES     10
#define DS_FMNIST_TRAIN_COUNT 60000
#define DS_FMNIST_EVAL_COUNT  10000

typedef struct {
  size_t count;      /* 60,000 (train) or 10,000 (eval) */
  size_t rows, cols; /* 28 x 28 */
  uint8_t *pixels;   /* count * rows * cols, row-major per image, owned */
  uint8_t *labels;   /* count, each 0..9, owned */
} ds_images;

/* Loads one split from dir (NULL: DS_FMNIST_DIR): {train,t10k}-{images-idx3,labels-idx1}
 * -ubyte.gz, read with zlib (an uncompressed file of the same name also reads). Checks the
 * IDX magic numbers (0x00000803 images, 0x00000801 labels), 28 x 28, the count
 * (60,000 or 10,000, the same in both files), labels 0..9, the gzip checksum, and that the
 * data ends where the header says. Returns DS_OK (caller owns set; ds_images_destroy),
 * DS_EIO (missing or unreadable), DS_EFORMAT (damaged), DS_ENOMEM, DS_EINVAL. */
int ds_fmnist_load(ds_images *set, const char *dir, ds_split split, ds_error *err);
void ds_images_destroy(ds_images *set);

/* Images first .. first+n-1 in file order as floats x = pixel / 255 in [0, 1]
 * (n * rows * cols values) and their labels (n; either output may be NULL). For
 * evaluation passes. Returns DS_EINVAL if the range is outside the set. */
int ds_images_batch(const ds_images *set, size_t first, size_t n, float *x, uint8_t *y);

/* Shuffling sampler: each epoch visits a fresh seeded permutation of the set; a batch
 * never straddles two epochs (the remainder of an epoch that does not fill a batch is
 * skipped, and the next epoch starts). */
typedef struct {
  const ds_images *set; /* borrowed */
  uint32_t *perm;       /* count entries, owned */
  size_t pos;           /* next index into perm */
  uint64_t epoch;       /* the current epoch, from 0 */
  ds_rng rng;
} ds_image_sampler;

/* Returns DS_OK (call ds_image_sampler_destroy), DS_EINVAL, DS_ENOMEM. */
int ds_image_sampler_init(ds_image_sampler *s, const ds_images *set, uint64_t seed);
void ds_image_sampler_destroy(ds_image_sampler *s);

/* Next batch: x (batch * rows * cols floats in [0, 1]) and y (batch labels; may be NULL).
 * Returns DS_OK or DS_EINVAL (NULL, batch 0 or larger than the set). */
int ds_image_sampler_next(ds_image_sampler *s, size_t batch, float *x, uint8_t *y);

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_BENCH_DATASETS_H */
