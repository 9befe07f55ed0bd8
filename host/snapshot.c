/*
 * snapshot.c -- the store on disk: written atomically, checked before anything is loaded.
 *
 * File layout (all integers little-endian; floats as their IEEE 754 bits):
 *   header, 32 bytes:
 *     magic "PCDSNAP1" | u32 format (6; 1 to 5 are still read) | u32 reserved (0) |
 *     u64 payload bytes |
 *     u32 CRC-32 of the payload | u32 CRC-32 of the 28 header bytes before it
 *   payload:
 *     (format 5 on) the origin: u32 rank | u32 nranks | u64 run (the daemon replica that
 *       wrote it, of how many, and the run of the daemon job: the ranks of one run share one
 *       ownership plan; earlier formats take rank and count from precondd.replicas)
 *     u32 jobs, then per job:
 *       str name | u32 mode | the mode's options section (its snap_bytes; Shampoo:
 *       u32 block_size | u32 skip_limit | f32 beta2 | u32 p | f64 epsilon | u32 method |
 *       (format 6 on) u32 root_every; up to format 5 a mode's snap_bytes_f5 bytes) |
 *       u64 last_step |
 *       u32 tensors, each: str name | u32 rank | u64 dims[rank] |
 *       u32 workers, each: str name |
 *       u32 blocks, each: u32 id | u64 rows | u64 cols | u64 stat_step | u64 pushes |
 *         u64 roots_computed | u64 roots_failed | f64 last_error | f64 last_compute_ms |
 *         (format 3 only: u64 resets | u32 failures_in_row | str last_failure; earlier
 *         formats read them as 0 and "") |
 *         f32 part[k][order_k(order_k+1)/2] for each of the unit's parts (Shampoo: L, R) |
 *         u8 has_root, and if 1: u64 version | u64 source_step | f64 error | u32 method |
 *           u32 iterations | f64 aux[PD_MODE_AUX] (format 2 on: the mode's figures of the
 *           result, K-FAC's pi and dampings; format 1 reads them as 0) |
 *           f32 part[k][...] for each part
 *     (format 4 on) u32 ended, each: str name | u64 unix time it ended | u32 how (the names
 *       of ended jobs, oldest first, that Register refuses; earlier formats hold none)
 *   (str = u32 length, then that many bytes, no terminator)
 *
 * Reading checks the header, the size and the payload CRC in a first pass, then parses into
 * jobs that are added to the store only once all of them parsed: a damaged file loads
 * nothing. Statistics are stored as their exact bits, so a restore is bit-exact.
 */
#include "precondd.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <zlib.h>

#include "preconditioner.h"

#define PD_SNAP_MAGIC              "PCDSNAP1"
#define PD_SNAP_FORMAT             6u
#define PD_SNAP_FORMAT_NO_AUX      1u /* before results kept their aux figures */
#define PD_SNAP_FORMAT_NO_FAILURES 2u /* before blocks kept resets and the last failure */
#define PD_SNAP_FORMAT_NO_ENDED    3u /* before the names of ended jobs were kept */
#define PD_SNAP_FORMAT_NO_ORIGIN   4u /* before the origin (rank, count, run) was kept */
#define PD_SNAP_FORMAT_OPTS_F5     5u /* up to it, modes' sections of snap_bytes_f5 bytes */
_Static_assert(PD_MODE_AUX == 3, "snapshot format 2 holds 3 aux figures per result");
#define PD_SNAP_HEADER 32

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define PD_BIG_ENDIAN 1
#else
#define PD_BIG_ENDIAN 0
#endif

/* ---- writing --------------------------------------------------------------------------- */

typedef struct {
  FILE *f;
  uLong crc;
  uint64_t n;
  int err;
} pd__w;

static void pd__put(pd__w *w, const void *p, size_t n) {
  if (w->err || n == 0) return;
  if (fwrite(p, 1, n, w->f) != n) {
    w->err = 1;
    return;
  }
  /* zlib's crc32 takes uInt lengths: feed large arrays in pieces. */
  const unsigned char *b = p;
  while (n) {
    uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
    w->crc = crc32(w->crc, b, k);
    b += k;
    n -= k;
    w->n += k;
  }
}

void pd_le_put(unsigned char *out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) out[i] = (unsigned char)(v >> (8 * i));
}

static void pd__u8(pd__w *w, unsigned v) {
  unsigned char b = (unsigned char)v;
  pd__put(w, &b, 1);
}
static void pd__u32(pd__w *w, uint32_t v) {
  unsigned char b[4];
  pd_le_put(b, v, 4);
  pd__put(w, b, 4);
}
static void pd__u64(pd__w *w, uint64_t v) {
  unsigned char b[8];
  pd_le_put(b, v, 8);
  pd__put(w, b, 8);
}
static void pd__f64(pd__w *w, double v) {
  uint64_t u;
  memcpy(&u, &v, 8);
  pd__u64(w, u);
}
static void pd__str(pd__w *w, const char *s) {
  size_t n = strlen(s);
  pd__u32(w, (uint32_t)n);
  pd__put(w, s, n);
}
static void pd__f32s(pd__w *w, const float *v, size_t n) {
#if PD_BIG_ENDIAN
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &v[i], 4);
    pd__u32(w, u);
  }
#else
  pd__put(w, v, n * sizeof *v);
#endif
}

static int pd__fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  close(fd);
  return rc;
}

/* scratch holds room for the largest unit's parts. */
static void pd__write_block(pd__w *w, pd_block *b, float *const *scratch) {
  /* Copy under the lock, write without it: pushes to this block wait only for a memcpy. */
  pthread_mutex_lock(&b->lock);
  for (uint32_t k = 0; k < b->nparts; k++)
    memcpy(scratch[k], b->stat[k], pc_packed_len(b->order[k]) * sizeof(float));
  uint64_t stat_step = atomic_load(&b->stat_step), pushes = b->pushes;
  uint64_t computed = b->roots_computed, failed = b->roots_failed;
  double last_error = b->last_error, last_ms = b->last_compute_ms;
  uint64_t resets = b->resets;
  uint32_t in_row = b->failures_in_row;
  char why[sizeof b->last_failure];
  memcpy(why, b->last_failure, sizeof why);
  why[sizeof why - 1] = '\0';
  pd_root *r = b->root;
  pd_root_ref(r);
  pthread_mutex_unlock(&b->lock);

  pd__u32(w, b->id);
  pd__u64(w, b->rows);
  pd__u64(w, b->cols);
  pd__u64(w, stat_step);
  pd__u64(w, pushes);
  pd__u64(w, computed);
  pd__u64(w, failed);
  pd__f64(w, last_error);
  pd__f64(w, last_ms);
  pd__u64(w, resets);
  pd__u32(w, in_row);
  pd__str(w, why);
  for (uint32_t k = 0; k < b->nparts; k++) pd__f32s(w, scratch[k], pc_packed_len(b->order[k]));
  pd__u8(w, r != NULL);
  if (r) {
    pd__u64(w, r->version);
    pd__u64(w, r->source_step);
    pd__f64(w, r->error);
    pd__u32(w, (uint32_t)r->method);
    pd__u32(w, r->iterations);
    for (int k = 0; k < PD_MODE_AUX; k++) pd__f64(w, r->aux[k]);
    for (uint32_t k = 0; k < r->nparts; k++) pd__f32s(w, r->part[k], pc_packed_len(r->order[k]));
  }
  pd_root_unref(r, NULL);
}

static void pd__write_job(pd__w *w, pd_job *j, float *const *scratch) {
  pd__str(w, j->name);
  pd__u32(w, (uint32_t)j->mode->id);
  unsigned char section[PD_MODE_OPTS_MAX * 2];
  j->mode->snap_write(j->opts, section);
  pd__put(w, section, j->mode->snap_bytes);
  pthread_mutex_lock(&j->lock);
  uint64_t last_step = j->last_step;
  size_t nworkers = j->nworkers;
  pthread_mutex_unlock(&j->lock);
  pd__u64(w, last_step);
  pd__u32(w, (uint32_t)j->ntensors);
  for (size_t i = 0; i < j->ntensors; i++) {
    pd__str(w, j->tensors[i].name);
    pd__u32(w, (uint32_t)j->tensors[i].rank);
    for (int k = 0; k < j->tensors[i].rank; k++) pd__u64(w, j->tensors[i].dims[k]);
  }
  /* Worker names are only appended, so the first nworkers are stable without the lock. */
  pd__u32(w, (uint32_t)nworkers);
  for (size_t i = 0; i < nworkers; i++) pd__str(w, j->workers[i]);
  pd__u32(w, (uint32_t)j->nblocks);
  for (size_t i = 0; i < j->nblocks; i++) pd__write_block(w, &j->blocks[i], scratch);
}

int pd_snapshot_write(pd_store *st, const char *dir) {
  char path[1200], tmp[1200];
  snprintf(path, sizeof path, "%s/%s", dir, PD_SNAPSHOT_FILE);
  snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, PD_SNAPSHOT_FILE);

  /* The jobs listed now, each referenced, and the ended names, under one lock: a job ended
   * meanwhile is still written whole without its end (it is gone from the next snapshot,
   * which its removal asks for), never both. */
  size_t njobs = 0, nended = 0;
  pd_job **jobs = NULL;
  pd_ended_job *ended = pd_store_list_ended(st, &nended, &jobs, &njobs);
  if (!ended) return PD_ENOMEM;

  uint64_t nmax = 1;
  for (size_t i = 0; i < njobs; i++)
    for (size_t k = 0; k < jobs[i]->nblocks; k++)
      for (uint32_t p = 0; p < jobs[i]->blocks[k].nparts; p++)
        if (jobs[i]->blocks[k].order[p] > nmax) nmax = jobs[i]->blocks[k].order[p];
  float *scratch[PD_MAX_PARTS] = {NULL};
  int ok = 1;
  for (int p = 0; p < PD_MAX_PARTS; p++)
    ok &= (scratch[p] = malloc(pc_packed_len(nmax) * sizeof(float))) != NULL;
  int rc = PD_OK;
  pd__w w = {NULL, crc32(0L, Z_NULL, 0), 0, 0};
  if (!ok) {
    rc = PD_ENOMEM;
    goto cleanup;
  }
  /* 0600 like the state directory: statistics are the job's data, not the world's. */
  unlink(tmp); /* a leftover from a crash keeps its old mode through O_CREAT */
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  w.f = fd >= 0 ? fdopen(fd, "wb") : NULL;
  if (!w.f) {
    if (fd >= 0) close(fd);
    pd_log(PD_LOG_ERROR, "snapshot: cannot create %s: %s", tmp, strerror(errno));
    rc = PD_EIO;
    goto cleanup;
  }
  unsigned char header[PD_SNAP_HEADER];
  memset(header, 0, sizeof header);
  if (fwrite(header, 1, sizeof header, w.f) != sizeof header) w.err = 1;
  pd__u32(&w, st->link ? (uint32_t)st->link->rank : 0);
  pd__u32(&w, st->link ? (uint32_t)st->link->nranks : 1);
  pd__u64(&w, st->run);
  pd__u32(&w, (uint32_t)njobs);
  for (size_t i = 0; i < njobs; i++) pd__write_job(&w, jobs[i], scratch);
  pd__u32(&w, (uint32_t)nended);
  for (size_t i = 0; i < nended; i++) {
    pd__str(&w, ended[i].name);
    pd__u64(&w, (uint64_t)ended[i].ended_at);
    pd__u32(&w, ended[i].how);
  }

  memcpy(header, PD_SNAP_MAGIC, 8);
  pd_le_put(header + 8, PD_SNAP_FORMAT, 4);
  pd_le_put(header + 12, 0, 4);
  pd_le_put(header + 16, w.n, 8);
  pd_le_put(header + 24, w.crc, 4);
  pd_le_put(header + 28, crc32(crc32(0L, Z_NULL, 0), header, 28), 4);
  if (!w.err && (fseek(w.f, 0, SEEK_SET) != 0 || fwrite(header, 1, sizeof header, w.f) != 32))
    w.err = 1;
  if (!w.err && (fflush(w.f) != 0 || fsync(fileno(w.f)) != 0)) w.err = 1;
  if (fclose(w.f) != 0) w.err = 1;
  w.f = NULL;
  if (w.err) {
    pd_log(PD_LOG_ERROR, "snapshot: writing %s failed: %s", tmp, strerror(errno));
    unlink(tmp);
    rc = PD_EIO;
    goto cleanup;
  }
  if (rename(tmp, path) != 0) {
    pd_log(PD_LOG_ERROR, "snapshot: rename %s -> %s failed: %s", tmp, path, strerror(errno));
    unlink(tmp);
    rc = PD_EIO;
    goto cleanup;
  }
  if (pd__fsync_dir(dir) != 0)
    pd_log(PD_LOG_WARN, "snapshot: fsync of %s failed: %s", dir, strerror(errno));
  pd_log(PD_LOG_DEBUG, "snapshot: wrote %s (%llu bytes, %zu jobs)", path,
         (unsigned long long)(w.n + PD_SNAP_HEADER), njobs);

cleanup:
  pd_store_list_free(jobs, njobs, st->stats);
  pd_ended_free(ended, nended);
  for (int p = 0; p < PD_MAX_PARTS; p++) free(scratch[p]);
  return rc;
}

/* ---- reading --------------------------------------------------------------------------- */

typedef struct {
  FILE *f;
  uint64_t left; /* payload bytes not read yet */
  int err;
  uint32_t format;
} pd__r;

static void pd__get(pd__r *r, void *p, size_t n) {
  if (r->err) goto fail;
  if (n > r->left || fread(p, 1, n, r->f) != n) {
    r->err = 1;
    goto fail;
  }
  r->left -= n;
  return;
fail:
  memset(p, 0, n);
}

uint64_t pd_le_get(const unsigned char *b, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; i--) v = (v << 8) | b[i];
  return v;
}
static uint32_t pd__ru32(pd__r *r) {
  unsigned char b[4];
  pd__get(r, b, 4);
  return (uint32_t)pd_le_get(b, 4);
}
static uint64_t pd__ru64(pd__r *r) {
  unsigned char b[8];
  pd__get(r, b, 8);
  return pd_le_get(b, 8);
}
static unsigned pd__ru8(pd__r *r) {
  unsigned char b;
  pd__get(r, &b, 1);
  return b;
}
static double pd__rf64(pd__r *r) {
  uint64_t u = pd__ru64(r);
  double v;
  memcpy(&v, &u, 8);
  return v;
}
/* A malloc'd string, or NULL (r->err set) when its length exceeds max or the data. */
static char *pd__rstr(pd__r *r, uint32_t max) {
  uint32_t n = pd__ru32(r);
  if (r->err || n > max || n > r->left) {
    r->err = 1;
    return NULL;
  }
  char *s = malloc((size_t)n + 1);
  if (!s) {
    r->err = 1;
    return NULL;
  }
  pd__get(r, s, n);
  s[n] = '\0';
  return s;
}
static void pd__rf32s(pd__r *r, float *v, size_t n) {
  if (r->err || n > r->left / 4) {
    r->err = 1;
    return;
  }
#if PD_BIG_ENDIAN
  for (size_t i = 0; i < n; i++) {
    uint32_t u = pd__ru32(r);
    memcpy(&v[i], &u, 4);
  }
#else
  pd__get(r, v, n * sizeof *v);
#endif
}

/* First pass: header fields, file size and payload CRC. */
static int pd__verify(FILE *f, uint64_t *payload, uint32_t *format_out, char *err, size_t errlen) {
  unsigned char h[PD_SNAP_HEADER];
  if (fread(h, 1, sizeof h, f) != sizeof h) {
    snprintf(err, errlen, "truncated header (file shorter than %d bytes)", PD_SNAP_HEADER);
    return PD_ECORRUPT;
  }
  if (memcmp(h, PD_SNAP_MAGIC, 8) != 0) {
    snprintf(err, errlen, "bad magic (not a precondd snapshot)");
    return PD_ECORRUPT;
  }
  if ((uint32_t)pd_le_get(h + 28, 4) != (uint32_t)crc32(crc32(0L, Z_NULL, 0), h, 28)) {
    snprintf(err, errlen, "header checksum mismatch");
    return PD_ECORRUPT;
  }
  uint32_t format = (uint32_t)pd_le_get(h + 8, 4);
  if (format < PD_SNAP_FORMAT_NO_AUX || format > PD_SNAP_FORMAT) {
    snprintf(err, errlen, "unknown format %u (this precondd reads %u to %u)", format,
             PD_SNAP_FORMAT_NO_AUX, PD_SNAP_FORMAT);
    return PD_ECORRUPT;
  }
  *format_out = format;
  *payload = pd_le_get(h + 16, 8);
  uint32_t want = (uint32_t)pd_le_get(h + 24, 4);
  uLong crc = crc32(0L, Z_NULL, 0);
  unsigned char buf[1 << 16];
  uint64_t total = 0;
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
    crc = crc32(crc, buf, (uInt)n);
    total += n;
  }
  if (total != *payload) {
    snprintf(err, errlen, "payload is %llu bytes, header says %llu (truncated or extended)",
             (unsigned long long)total, (unsigned long long)*payload);
    return PD_ECORRUPT;
  }
  if ((uint32_t)crc != want) {
    snprintf(err, errlen, "payload checksum mismatch (crc32 %08x, header says %08x)", (unsigned)crc,
             (unsigned)want);
    return PD_ECORRUPT;
  }
  return PD_OK;
}

#define PD_SNAP_MAX_NAME 4096u

/* Second pass, one job. On PD_OK *out holds a job with statistics and roots filled in
 * (memory not yet counted: pd_store_add counts statistics, roots are counted here). */
static int pd__read_job(pd__r *r, pd_store *st, pd_job **out, char *err, size_t errlen) {
  *out = NULL;
  pd_tensor *tensors = NULL;
  uint32_t ntensors = 0;
  pd_job *job = NULL;
  int rc = PD_ECORRUPT;
  char *name = pd__rstr(r, PD_SNAP_MAX_NAME);
  uint32_t mode_id = pd__ru32(r);
  const pd_mode *mode = pd_mode_find((int)mode_id);
  if (!r->err && !mode) {
    snprintf(err, errlen, "job \"%s\": unknown mode %u", name ? name : "?", mode_id);
    goto bad_quiet;
  }
  _Alignas(max_align_t) unsigned char opts[PD_MODE_OPTS_MAX];
  unsigned char section[PD_MODE_OPTS_MAX * 2];
  memset(opts, 0, sizeof opts);
  memset(section, 0, sizeof section); /* fields an older format lacks read as 0 */
  if (mode) {
    size_t bytes = r->format <= PD_SNAP_FORMAT_OPTS_F5 && mode->snap_bytes_f5 ? mode->snap_bytes_f5
                                                                              : mode->snap_bytes;
    pd__get(r, section, bytes);
    mode->snap_read(section, opts);
  }
  uint64_t last_step = pd__ru64(r);
  ntensors = pd__ru32(r);
  /* Everything read is held to the limits of a request (bad_quiet names them). */
  if (r->err || ntensors > r->left / 8 || ntensors > PD_MAX_TENSORS || last_step > PD_MAX_STEP)
    goto bad;
  tensors = calloc(ntensors ? ntensors : 1, sizeof *tensors);
  if (!tensors) goto bad;
  for (uint32_t i = 0; i < ntensors && !r->err; i++) {
    tensors[i].name = pd__rstr(r, PD_SNAP_MAX_NAME);
    uint32_t rank = pd__ru32(r);
    if (r->err || rank < 1 || rank > 8) {
      r->err = 1;
      break;
    }
    tensors[i].rank = (int)rank;
    tensors[i].dims = calloc(rank, sizeof(uint64_t));
    if (!tensors[i].dims) {
      r->err = 1;
      break;
    }
    for (uint32_t k = 0; k < rank; k++) tensors[i].dims[k] = pd__ru64(r);
  }
  if (r->err) goto bad;

  char why[256];
  if (mode->resolve(opts, why, sizeof why) != PD_OK ||
      pd_job_build(name, mode, opts, ntensors, tensors, st->max_blocks_per_job, &job, why,
                   sizeof why) != PD_OK) {
    snprintf(err, errlen, "job \"%s\": %s", name ? name : "?", why);
    goto bad_quiet;
  }
  job->last_step = last_step;
  job->resumed_step = last_step;
  uint32_t nworkers = pd__ru32(r);
  for (uint32_t i = 0; i < nworkers && !r->err; i++) {
    char *wname = pd__rstr(r, PD_SNAP_MAX_NAME);
    if (wname) pd_job_note_worker(job, wname);
    free(wname);
  }
  uint32_t nblocks = pd__ru32(r);
  if (r->err || nblocks != job->nblocks) {
    snprintf(err, errlen, "job \"%s\": %u blocks stored, the layout gives %zu", job->name, nblocks,
             job->nblocks);
    goto bad_quiet;
  }
  for (uint32_t i = 0; i < nblocks && !r->err; i++) {
    pd_block *b = &job->blocks[i];
    uint32_t id = pd__ru32(r);
    uint64_t rows = pd__ru64(r), cols = pd__ru64(r);
    if (r->err || id != b->id || rows != b->rows || cols != b->cols) {
      snprintf(err, errlen,
               "job \"%s\" block %u: stored shape %llux%llu does not match the "
               "layout's %llux%llu",
               job->name, i, (unsigned long long)rows, (unsigned long long)cols,
               (unsigned long long)b->rows, (unsigned long long)b->cols);
      goto bad_quiet;
    }
    uint64_t stat_step = pd__ru64(r);
    atomic_store(&b->stat_step, stat_step);
    b->pushes = pd__ru64(r);
    b->roots_computed = pd__ru64(r);
    b->roots_failed = pd__ru64(r);
    b->last_error = pd__rf64(r);
    b->last_compute_ms = pd__rf64(r);
    if (r->format > PD_SNAP_FORMAT_NO_FAILURES) {
      b->resets = pd__ru64(r);
      b->failures_in_row = pd__ru32(r);
      char *reason = pd__rstr(r, sizeof b->last_failure - 1);
      if (reason) memcpy(b->last_failure, reason, strlen(reason) + 1);
      free(reason);
      if (b->failures_in_row >= PD_FAILURES_BEFORE_RESET) r->err = 1;
    }
    size_t state_len = 0;
    for (uint32_t k = 0; k < b->nparts; k++) state_len += pc_packed_len(b->order[k]);
    /* Allocate only what the file really holds: a header that claims a huge block in a
     * tiny file costs nothing. */
    if (r->err || stat_step > PD_MAX_STEP || state_len > r->left / sizeof(float)) goto bad;
    for (uint32_t k = 0; k < b->nparts; k++) {
      b->stat[k] = malloc(pc_packed_len(b->order[k]) * sizeof(float));
      if (!b->stat[k]) {
        rc = PD_ENOMEM;
        snprintf(err, errlen, "out of memory");
        goto bad_quiet;
      }
      pd__rf32s(r, b->stat[k], pc_packed_len(b->order[k]));
    }
    unsigned has_root = pd__ru8(r);
    if (has_root > 1) r->err = 1;
    if (has_root == 1 && !r->err) {
      if (state_len > r->left / sizeof(float)) goto bad;
      pd_root *root = pd_root_new(b->nparts, b->order, st->stats);
      if (!root) {
        rc = PD_ENOMEM;
        snprintf(err, errlen, "out of memory");
        goto bad_quiet;
      }
      b->root = root;
      root->version = pd__ru64(r);
      root->source_step = pd__ru64(r);
      root->error = pd__rf64(r);
      root->method = (int)pd__ru32(r);
      root->iterations = pd__ru32(r);
      for (int k = 0; r->format != PD_SNAP_FORMAT_NO_AUX && k < PD_MODE_AUX; k++)
        root->aux[k] = pd__rf64(r);
      for (uint32_t k = 0; k < root->nparts; k++)
        pd__rf32s(r, root->part[k], pc_packed_len(root->order[k]));
      atomic_store(&b->root_step, root->source_step);
      atomic_store(&b->has_root, 1);
    }
  }
  if (r->err) goto bad;
  *out = job;
  job = NULL;
  rc = PD_OK;
  goto cleanup;

bad:
  snprintf(err, errlen, "job \"%s\": truncated or malformed record", name ? name : "?");
bad_quiet:
  pd_job_free(job, st->stats);
cleanup:
  for (uint32_t i = 0; tensors && i < ntensors; i++) {
    free(tensors[i].name);
    free(tensors[i].dims);
  }
  free(tensors);
  free(name);
  return rc;
}

static int pd__cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The ended names (format 4 on), bounded like a request: at most PD_MAX_ENDED_JOBS, names of
 * at most PD_SNAP_MAX_NAME bytes, none twice, none also a stored job's (a consistent writer
 * never holds both). PD_OK with *out (oldest first, owned by the caller) and *n, or
 * PD_ECORRUPT / PD_ENOMEM. */
static int pd__read_ended(pd__r *r, pd_job *const *jobs, uint32_t njobs, pd_ended_job **out,
                          size_t *n, char *err, size_t errlen) {
  *out = NULL;
  *n = 0;
  if (r->format <= PD_SNAP_FORMAT_NO_ENDED) return PD_OK;
  uint32_t count = pd__ru32(r);
  /* each takes at least 16 bytes: checked before anything is allocated for them */
  if (r->err || count > PD_MAX_ENDED_JOBS || count > r->left / 16) {
    snprintf(err, errlen, "bad count of ended jobs (%u)", count);
    return PD_ECORRUPT;
  }
  pd_ended_job *e = calloc(count ? count : 1, sizeof *e);
  const char **names = malloc(((size_t)count + njobs + 1) * sizeof *names);
  int rc = e && names ? PD_OK : PD_ENOMEM;
  for (uint32_t k = 0; k < count && rc == PD_OK; k++) {
    e[k].name = pd__rstr(r, PD_SNAP_MAX_NAME);
    e[k].ended_at = (int64_t)pd__ru64(r);
    e[k].how = pd__ru32(r);
    if (r->err || !*e[k].name || e[k].how > PD_ENDED_IDLE) {
      snprintf(err, errlen, "ended job %u: truncated, empty or of unknown kind", k);
      rc = PD_ECORRUPT;
    }
  }
  /* Sorted together, a name stored twice is next to itself. */
  size_t m = 0;
  for (uint32_t k = 0; k < count && rc == PD_OK; k++) names[m++] = e[k].name;
  for (uint32_t i = 0; i < njobs && rc == PD_OK; i++) names[m++] = jobs[i]->name;
  if (count == 0) m = 0; /* jobs alone: pd__check_jobs reports one stored twice */
  if (rc == PD_OK) qsort(names, m, sizeof *names, pd__cmp_str);
  for (size_t i = 1; i < m && rc == PD_OK; i++)
    if (strcmp(names[i - 1], names[i]) == 0) {
      snprintf(err, errlen, "ended job \"%s\": listed twice, or also a stored job", names[i]);
      rc = PD_ECORRUPT;
    }
  free(names);
  if (rc != PD_OK) {
    pd_ended_free(e, e ? count : 0);
    return rc;
  }
  *out = e;
  *n = count;
  return PD_OK;
}

static int pd__cmp_job_name(const void *a, const void *b) {
  return strcmp((*(pd_job *const *)a)->name, (*(pd_job *const *)b)->name);
}

/* Before any parsed job is added: a name stored twice is damage (PD_ECORRUPT, so the file is
 * set aside and the daemon really starts empty); jobs that together pass the memory limit
 * (lowered since the write), or one job over the per-job limit, are PD_ELIMIT, which stops the start with the file in place.
 * Sorts jobs by name. */
static int pd__check_jobs(pd_store *st, pd_job **jobs, uint32_t njobs, char *err, size_t errlen) {
  qsort(jobs, njobs, sizeof *jobs, pd__cmp_job_name);
  size_t total = 0, scratch = 0;
  for (uint32_t i = 0; i < njobs; i++) {
    size_t need = pd_job_scratch_bytes(jobs[i], st->warm_roots);
    if (need > scratch) scratch = need;
    if (i > 0 && strcmp(jobs[i - 1]->name, jobs[i]->name) == 0) {
      snprintf(err, errlen, "job \"%s\": stored twice", jobs[i]->name);
      return PD_ECORRUPT;
    }
    total += pd_job_bytes(jobs[i]);
    if (pd_store_job_over_limit(st, jobs[i])) {
      snprintf(err, errlen,
               "job \"%s\" needs %zu bytes, over the per-job memory limit of %zu "
               "bytes",
               jobs[i]->name, pd_job_bytes(jobs[i]), st->job_memory_limit);
      return PD_ELIMIT;
    }
  }
  if (total + scratch > st->memory_limit) {
    snprintf(err, errlen,
             "its jobs need %zu bytes and %zu of scratch for their largest block, "
             "over the memory limit of %zu bytes",
             total, scratch, st->memory_limit);
    return PD_ELIMIT;
  }
  return PD_OK;
}

/* The rank count a format-4 (or older) snapshot was written under: DIR/precondd.replicas,
 * "RANK NRANKS", which daemons of that time wrote at each start. 0, or -1 when absent or
 * not that. */
static int pd__legacy_origin(const char *dir, pd_snap_origin *o) {
  char path[1200];
  snprintf(path, sizeof path, "%s/precondd.replicas", dir);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  int rank = 0, nranks = 0;
  int ok = fscanf(f, "%d %d", &rank, &nranks) == 2 && nranks >= 1 && rank >= 0 && rank < nranks;
  fclose(f);
  if (!ok) return -1;
  o->rank = rank;
  o->nranks = nranks;
  return 0;
}

#define PD_SNAP_MAX_RANKS 65536 /* an origin claiming more is damage */

/* Opens dir's snapshot (or reads src, an open stream of its bytes, when not NULL: then dir
 * only names it and holds a format-4 snapshot's origin file), verifies it (pd__verify) and
 * reads its origin and job count: on PD_OK *f and *r stand at the first job. PD_ENOENT when
 * there is none; PD_ECORRUPT or PD_EIO with a reason in err (*f closed, src too). */
static int pd__open(const char *dir, FILE *src, FILE **fp, pd__r *r, pd_snap_origin *o, char *err,
                    size_t errlen) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s", dir, PD_SNAPSHOT_FILE);
  memset(o, 0, sizeof *o);
  o->rank = -1; /* unknown */
  FILE *f = src ? src : fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) return PD_ENOENT;
    snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
    return PD_EIO;
  }
  uint64_t payload = 0;
  uint32_t format = 0;
  int rc = pd__verify(f, &payload, &format, err, errlen);
  if (rc == PD_OK && fseek(f, PD_SNAP_HEADER, SEEK_SET) != 0) {
    snprintf(err, errlen, "cannot seek in %s", path);
    rc = PD_EIO;
  }
  if (rc != PD_OK) {
    fclose(f);
    return rc;
  }
  *r = (pd__r){f, payload, 0, format};
  if (format > PD_SNAP_FORMAT_NO_ORIGIN) {
    o->rank = (int)pd__ru32(r);
    o->nranks = (int)pd__ru32(r);
    o->run = pd__ru64(r);
    if (r->err || o->nranks < 1 || o->nranks > PD_SNAP_MAX_RANKS || o->rank < 0 ||
        o->rank >= o->nranks) {
      snprintf(err, errlen, "bad origin (rank %d of %d)", o->rank, o->nranks);
      fclose(f);
      return PD_ECORRUPT;
    }
  } else if (pd__legacy_origin(dir, o) != 0) {
    o->rank = -1;
    o->nranks = 0;
  }
  o->njobs = pd__ru32(r);
  if (r->err || o->njobs > payload / 8) {
    snprintf(err, errlen, "bad job count");
    fclose(f);
    return PD_ECORRUPT;
  }
  *fp = f;
  return PD_OK;
}

int pd_snapshot_peek(const char *dir, pd_snap_origin *o, char *err, size_t errlen) {
  FILE *f = NULL;
  pd__r r;
  int rc = pd__open(dir, NULL, &f, &r, o, err, errlen);
  if (rc == PD_OK) fclose(f);
  return rc;
}

int pd_snapshot_load(const char *dir, unsigned char **data, size_t *len, char *err, size_t errlen) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s", dir, PD_SNAPSHOT_FILE);
  *data = NULL;
  *len = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) return PD_ENOENT;
    snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
    return PD_EIO;
  }
  int rc = PD_EIO;
  long end = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  unsigned char *buf = end >= 0 ? malloc(end ? (size_t)end : 1) : NULL;
  if (end >= 0 && !buf) rc = PD_ENOMEM;
  if (buf && fseek(f, 0, SEEK_SET) == 0 && fread(buf, 1, (size_t)end, f) == (size_t)end) {
    *data = buf;
    *len = (size_t)end;
    buf = NULL;
    rc = PD_OK;
  }
  if (rc != PD_OK) snprintf(err, errlen, "cannot read %s: %s", path, pd_strerror(rc));
  free(buf);
  fclose(f);
  return rc;
}

/* A snapshot file parsed, nothing of it in a store yet. */
typedef struct {
  pd_snap_origin origin;
  pd_job **jobs; /* njobs entries; an entry taken by the caller is set to NULL */
  pd_ended_job *ended;
  size_t nended;
} pd__file;

static void pd__file_free(pd__file *p, pd_stats *stats) {
  for (uint32_t i = 0; p->jobs && i < p->origin.njobs; i++) pd_job_free(p->jobs[i], stats);
  free(p->jobs);
  pd_ended_free(p->ended, p->nended);
  memset(p, 0, sizeof *p);
}

/* Parses dir's snapshot (src: its bytes, as pd__open) whole into *p (the caller frees it
 * with pd__file_free, also on error). PD_ENOENT, PD_ECORRUPT, PD_EIO, PD_ENOMEM with a reason
 * in err. */
static int pd__parse(pd_store *st, const char *dir, FILE *src, pd__file *p, char *err,
                     size_t errlen) {
  memset(p, 0, sizeof *p);
  FILE *f = NULL;
  pd__r r;
  int rc = pd__open(dir, src, &f, &r, &p->origin, err, errlen);
  if (rc != PD_OK) return rc;
  uint32_t njobs = p->origin.njobs;
  p->origin.njobs = 0; /* the jobs parsed so far, for pd__file_free */
  p->jobs = calloc(njobs ? njobs : 1, sizeof *p->jobs);
  if (!p->jobs) {
    rc = PD_ENOMEM;
    goto done;
  }
  for (uint32_t i = 0; i < njobs; i++) {
    rc = pd__read_job(&r, st, &p->jobs[i], err, errlen);
    if (rc != PD_OK) goto done;
    p->origin.njobs = i + 1;
  }
  rc = pd__read_ended(&r, p->jobs, njobs, &p->ended, &p->nended, err, errlen);
  if (rc != PD_OK) goto done;
  if (r.left != 0) {
    snprintf(err, errlen, "%llu bytes left over after the last job", (unsigned long long)r.left);
    rc = PD_ECORRUPT;
  }
done:
  fclose(f);
  return rc;
}

/* Checks the parsed jobs (pd__check_jobs) and adds them and the ended names to the store;
 * takes jobs (njobs entries, the array too) and ended in every case. */
static int pd__install(pd_store *st, pd_job **jobs, uint32_t njobs, pd_ended_job *ended,
                       size_t nended, char *err, size_t errlen) {
  int rc = pd__check_jobs(st, jobs, njobs, err, errlen);
  uint32_t i = 0;
  for (; rc == PD_OK && i < njobs; i++) {
    pd_job *existing = NULL;
    rc = pd_store_add(st, jobs[i], &existing);
    if (rc != PD_OK || existing) {
      /* Only out of memory gets here (pd__check_jobs ruled out the rest); jobs added so
       * far stay, and the caller stops. */
      snprintf(err, errlen, "job \"%s\": %s", jobs[i]->name, pd_strerror(rc));
      if (rc == PD_OK) rc = PD_ENOMEM;
      pd_job_unref(existing, st->stats);
      break;
    }
  }
  for (; i < njobs; i++) pd_job_free(jobs[i], st->stats);
  free(jobs);
  if (rc == PD_OK)
    pd_store_restore_ended(st, ended, nended);
  else
    pd_ended_free(ended, nended);
  return rc;
}

int pd_snapshot_read(pd_store *st, const char *dir, char *err, size_t errlen) {
  pd__file p;
  int rc = pd__parse(st, dir, NULL, &p, err, errlen);
  if (rc != PD_OK) {
    pd__file_free(&p, st->stats);
    return rc;
  }
  return pd__install(st, p.jobs, p.origin.njobs, p.ended, p.nended, err, errlen);
}

/* ---- resuming under another rank count ------------------------------------------------- */

/* Moves the statistics and their counters between two records of one unit. */
static void pd__swap_stats(pd_block *a, pd_block *b) {
  pd_block t;
  memcpy(t.stat, a->stat, sizeof t.stat);
  memcpy(a->stat, b->stat, sizeof t.stat);
  memcpy(b->stat, t.stat, sizeof t.stat);
  uint64_t step = atomic_load(&a->stat_step);
  atomic_store(&a->stat_step, atomic_load(&b->stat_step));
  atomic_store(&b->stat_step, step);
#define PD__SWAP(f) (t.f = a->f, a->f = b->f, b->f = t.f)
  PD__SWAP(pushes);
  PD__SWAP(roots_computed);
  PD__SWAP(roots_failed);
  PD__SWAP(last_error);
  PD__SWAP(last_compute_ms);
  PD__SWAP(resets);
  PD__SWAP(failures_in_row);
#undef PD__SWAP
  memcpy(t.last_failure, a->last_failure, sizeof t.last_failure);
  memcpy(a->last_failure, b->last_failure, sizeof t.last_failure);
  memcpy(b->last_failure, t.last_failure, sizeof t.last_failure);
}

/* A unit this rank does not own, or whose old owner never had its job: no statistics. */
static void pd__clear_stats(pd_block *b) {
  for (uint32_t k = 0; k < b->nparts; k++)
    memset(b->stat[k], 0, pc_packed_len(b->order[k]) * sizeof(float));
  atomic_store(&b->stat_step, 0);
  b->pushes = b->roots_computed = b->roots_failed = b->resets = 0;
  b->last_error = b->last_compute_ms = 0;
  b->failures_in_row = 0;
  b->last_failure[0] = '\0';
}

/* Moves the root (with its step) between two records of one unit. */
static void pd__swap_root(pd_block *a, pd_block *b) {
  pd_root *r = a->root;
  a->root = b->root;
  b->root = r;
  uint64_t step = atomic_load(&a->root_step);
  atomic_store(&a->root_step, atomic_load(&b->root_step));
  atomic_store(&b->root_step, step);
  int has = atomic_load(&a->has_root);
  atomic_store(&a->has_root, atomic_load(&b->has_root));
  atomic_store(&b->has_root, has);
}

/* The record of job name in file k (base when it came from there), or NULL. */
static pd_job *pd__record(pd__file *files, int k, int base_file, pd_job *base) {
  if (k == base_file) return base;
  for (uint32_t i = 0; i < files[k].origin.njobs; i++)
    if (files[k].jobs[i] && strcmp(files[k].jobs[i]->name, base->name) == 0)
      return files[k].jobs[i];
  return NULL;
}

/* Merges the records of base (taken from file base_file) across the old ranks' files into
 * base: each unit's statistics from its old owner's file when this rank owns it now, the
 * newest root of every unit from whichever file holds it. */
static int pd__merge_job(pd__file *files, int old_nranks, int base_file, pd_job *base, int rank,
                         int nranks, char *err, size_t errlen) {
  uint32_t *old_owner = malloc((base->nblocks ? base->nblocks : 1) * sizeof *old_owner);
  if (!old_owner) return PD_ENOMEM;
  int rc = pd_replica_plan(base, old_nranks);
  for (size_t i = 0; rc == PD_OK && i < base->nblocks; i++) old_owner[i] = base->blocks[i].owner;
  if (rc == PD_OK) rc = pd_replica_plan(base, nranks);
  for (int k = 0; rc == PD_OK && k < old_nranks; k++) {
    pd_job *o = pd__record(files, k, base_file, base);
    if (!o || o == base) continue;
    if (!pd_job_same(o, base)) {
      snprintf(err, errlen,
               "job \"%s\" has other tensors or options in the snapshot of rank %d "
               "than in that of rank %d",
               base->name, k, base_file);
      rc = PD_EINVAL;
      break;
    }
    if (o->last_step > base->last_step) base->last_step = o->last_step;
    for (size_t w = 0; w < o->nworkers; w++) pd_job_note_worker(base, o->workers[w]);
  }
  for (size_t i = 0; rc == PD_OK && i < base->nblocks; i++) {
    pd_block *b = &base->blocks[i];
    pd_job *src = pd__record(files, (int)old_owner[i], base_file, base);
    if ((nranks > 1 && (int)b->owner != rank) || !src)
      pd__clear_stats(b);
    else if (src != base)
      pd__swap_stats(b, &src->blocks[i]);
    pd_block *newest = b;
    for (int k = 0; k < old_nranks; k++) {
      pd_job *o = pd__record(files, k, base_file, base);
      pd_block *c = o ? &o->blocks[i] : NULL;
      if (c && c->root && (!newest->root || c->root->version > newest->root->version)) newest = c;
    }
    if (newest != b) pd__swap_root(b, newest);
  }
  base->resumed_step = base->last_step;
  free(old_owner);
  return rc;
}

int pd_snapshot_read_resharded(pd_store *st, const char *const *dirs, const pd_snap_bytes *bytes,
                               int old_nranks, uint64_t old_run, int rank, int nranks, char *err,
                               size_t errlen) {
  pd__file *files = calloc((size_t)old_nranks, sizeof *files);
  pd_job **jobs = NULL;
  pd_ended_job *ended = NULL;
  size_t njobs = 0, nended = 0, cap = 0, ecap = 0;
  char why[400] = "";
  int rc = files ? PD_OK : PD_ENOMEM;
  for (int k = 0; rc == PD_OK && k < old_nranks; k++) {
    if (bytes && !bytes[k].data) {
      rc = PD_ENOENT; /* no rank could read it */
    } else if (bytes) {
      /* A stream over the bytes: the parser reads them as it reads a file. */
      FILE *src = fmemopen(bytes[k].data, bytes[k].len, "rb");
      rc = src ? pd__parse(st, dirs[k], src, &files[k], why, sizeof why) : PD_ENOMEM;
    } else {
      rc = pd__parse(st, dirs[k], NULL, &files[k], why, sizeof why);
    }
    const pd_snap_origin *o = &files[k].origin;
    if (rc == PD_ENOENT)
      snprintf(err, errlen, "the snapshot of rank %d of %d, %s/%s, is missing", k, old_nranks,
               dirs[k], PD_SNAPSHOT_FILE);
    else if (rc != PD_OK)
      snprintf(err, errlen, "the snapshot of rank %d of %d, %s/%s: %s", k, old_nranks, dirs[k],
               PD_SNAPSHOT_FILE, why);
    else if (o->rank != k || o->nranks != old_nranks || (old_run && o->run && o->run != old_run)) {
      snprintf(err, errlen,
               "%s/%s was written by rank %d of %d (run %016llx), not by rank %d of %d (run "
               "%016llx) as rank 0's snapshot says: it is from another run of the daemon job",
               dirs[k], PD_SNAPSHOT_FILE, o->rank, o->nranks, (unsigned long long)o->run, k,
               old_nranks, (unsigned long long)old_run);
      rc = PD_EINVAL;
    }
  }
  /* The jobs: every name stored by some old rank, each taken from the first file holding it.
   * A name stored as a job in one file and ended in another stays a job: the snapshots were
   * written at different times, and keeping statistics loses nothing an EndJob cannot
   * end again. */
  for (int k = 0; rc == PD_OK && k < old_nranks; k++)
    for (uint32_t i = 0; rc == PD_OK && i < files[k].origin.njobs; i++) {
      pd_job *j = files[k].jobs[i];
      int dup = 0;
      for (size_t m = 0; m < njobs && !dup; m++) dup = strcmp(jobs[m]->name, j->name) == 0;
      if (dup) continue;
      if (njobs == cap) {
        cap = cap ? 2 * cap : 8;
        pd_job **nj = realloc(jobs, cap * sizeof *jobs);
        if (!nj) {
          rc = PD_ENOMEM;
          break;
        }
        jobs = nj;
      }
      files[k].jobs[i] = NULL;
      jobs[njobs++] = j;
      rc = pd__merge_job(files, old_nranks, k, j, rank, nranks, err, errlen);
    }
  /* The ended names of every file, each once (the newest end), oldest first; none that is
   * also a job. */
  for (int k = 0; rc == PD_OK && k < old_nranks; k++)
    for (size_t i = 0; rc == PD_OK && i < files[k].nended; i++) {
      pd_ended_job *e = &files[k].ended[i];
      int seen = 0;
      for (size_t m = 0; m < njobs && !seen; m++) seen = strcmp(jobs[m]->name, e->name) == 0;
      for (size_t m = 0; m < nended && !seen; m++)
        if (strcmp(ended[m].name, e->name) == 0) {
          seen = 1;
          if (e->ended_at > ended[m].ended_at) {
            ended[m].ended_at = e->ended_at;
            ended[m].how = e->how;
          }
        }
      if (seen) continue;
      if (nended == ecap) {
        ecap = ecap ? 2 * ecap : 16;
        pd_ended_job *ne = realloc(ended, ecap * sizeof *ended);
        if (!ne) {
          rc = PD_ENOMEM;
          break;
        }
        ended = ne;
      }
      ended[nended++] = *e;
      e->name = NULL; /* moved */
    }
  for (size_t i = 1; rc == PD_OK && i < nended; i++) /* insertion sort: oldest first */
    for (size_t m = i; m > 0 && ended[m - 1].ended_at > ended[m].ended_at; m--) {
      pd_ended_job t = ended[m];
      ended[m] = ended[m - 1];
      ended[m - 1] = t;
    }
  if (rc == PD_OK && nended > PD_MAX_ENDED_JOBS) { /* keep the newest */
    for (size_t i = 0; i < nended - PD_MAX_ENDED_JOBS; i++) free(ended[i].name);
    memmove(ended, ended + (nended - PD_MAX_ENDED_JOBS), PD_MAX_ENDED_JOBS * sizeof *ended);
    nended = PD_MAX_ENDED_JOBS;
  }
  for (int k = 0; files && k < old_nranks; k++) pd__file_free(&files[k], st->stats);
  free(files);
  if (rc == PD_ENOMEM && !*err) snprintf(err, errlen, "out of memory");
  if (rc != PD_OK) {
    for (size_t i = 0; i < njobs; i++) pd_job_free(jobs[i], st->stats);
    free(jobs);
    pd_ended_free(ended, nended);
    return rc;
  }
  return pd__install(st, jobs, (uint32_t)njobs, ended, nended, err, errlen);
}

/* Renames dir/precondd.snap to dir/precondd.snap.KIND-<unix seconds>[-k]. */
static int pd__set_aside(const char *dir, const char *kind, char *newname, size_t len) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s", dir, PD_SNAPSHOT_FILE);
  long long now = (long long)time(NULL);
  /* Never overwrite an earlier file set aside: it may be all that is left of a run. */
  for (int k = 0; k < 1000; k++) {
    if (k == 0)
      snprintf(newname, len, "%s/%s.%s-%lld", dir, PD_SNAPSHOT_FILE, kind, now);
    else
      snprintf(newname, len, "%s/%s.%s-%lld-%d", dir, PD_SNAPSHOT_FILE, kind, now, k);
    struct stat sb;
    if (stat(newname, &sb) == 0) continue;
    if (rename(path, newname) != 0) return PD_EIO;
    pd__fsync_dir(dir);
    return PD_OK;
  }
  return PD_EIO;
}

int pd_snapshot_set_aside(const char *dir, char *newname, size_t len) {
  return pd__set_aside(dir, "corrupt", newname, len);
}

int pd_snapshot_set_aside_stale(const char *dir, char *newname, size_t len) {
  return pd__set_aside(dir, "stale", newname, len);
}
