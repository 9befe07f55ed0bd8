/*
 * shm.c -- the same-host data path: shared-memory regions the daemon makes for its clients
 * (OpenSharedMemory), found again by id and secret when a push or fetch names one, and
 * freed when their client is gone. The rules both sides share (halves, ring, CRC-32C) are
 * in proto/shm.c; the wire fields are read in service.c, which turns a region's bytes into
 * the same PackedMatrix data a gRPC message carries, so every later check is the same.
 *
 * A region is a file of `bytes` bytes in --shm-dir, mode 0600, mapped here and by its
 * client. The client takes a shared flock on its own open file for as long as it uses the
 * region; a region is in use ("attached") from the first call that names it (the file's
 * name is unlinked then: nothing else can open it any more). Once a second pd_shm_reap
 * tries an exclusive flock on the daemon's descriptor: it succeeds only when no client
 * holds the region, i.e. when its client closed it or died, and the region is freed. A
 * region never attached is freed after PD_SHM_ATTACH_S seconds. Regions count against
 * --memory-limit-mb like jobs (pd_store_reserve_extra).
 */
#include "precondd.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "rpc.h"

#define PD_SHM_ATTACH_S 10.0
/* The spares' alignment: a cache line, what 512-bit streaming stores need. */
#define PD_SHM_SPARE_ALIGN 64

struct pd_shm_session {
  uint64_t id;
  unsigned char secret[RPC_SHM_SECRET_BYTES];
  char path[1100];
  int fd;
  unsigned char *map;
  size_t bytes;
  double created;
  int attached; /* guarded by the registry's lock */
  int listed;   /* in the registry (guarded by its lock) */
  atomic_int refs;
  pthread_mutex_t lock; /* guards out_pos */
  uint64_t out_pos;     /* the daemon's ring in the second half */
  /* Where pushes copy the client's matrices to (pd_shm_in_begin): kept from push to push, so
   * its pages stay mapped; a malloc'd buffer per push cost a page fault per 4 KiB. */
  pthread_mutex_t in_lock; /* held by the push using in_buf */
  unsigned char *in_buf;
  size_t in_cap; /* bytes, counted in the budget and memory_bytes */
  /* Statistics buffers for pushes read in place (pd_shm_spare_take), under in_lock: nspare
   * kept in spare[] (spare_n[] floats each); spare_bytes, counted in the budget and in
   * memory_bytes, is those kept plus those out with a push. */
  float **spare;
  size_t *spare_n;
  size_t nspare, spare_slots, spare_kept, spare_bytes;
  /* The doorbell's thread (pd__shm_bell_main) holds a reference while it runs. */
  pd_shm *reg;
  int bell_on;
  atomic_int bell_stop; /* set when the region is unlisted: the thread ends */
  /* ShmOpenRequest.holds_vouched: set once, before the region's answer goes out. */
  atomic_int holds_vouched;
};

int pd_shm_init(pd_shm *r, const char *dir, pd_store *store, pd_stats *stats) {
  memset(r, 0, sizeof *r);
  if (pthread_mutex_init(&r->lock, NULL) != 0) return PD_ENOMEM;
  snprintf(r->dir, sizeof r->dir, "%s", dir ? dir : "");
  r->store = store;
  r->stats = stats;
  r->next_id = 1;
  r->roots_fd = -1;
  if (pthread_mutex_init(&r->roots_lock, NULL) != 0) {
    pthread_mutex_destroy(&r->lock);
    return PD_ENOMEM;
  }
  r->inited = 1;
  return PD_OK;
}

/* ---- the roots area (rpc.h): one file, published roots, clients map it read-only ---- */

/* Removes roots areas of daemons that died without removing theirs (kill -9): files named
 * precondd-PID-roots-* whose PID is gone. Best effort. */
static void pd__shm_roots_sweep(const char *dir) {
  DIR *dp = opendir(dir);
  struct dirent *e;
  while (dp && (e = readdir(dp)) != NULL) {
    int pid = 0, used = 0;
    if (sscanf(e->d_name, "precondd-%d-roots-%n", &pid, &used) != 1 || used == 0 || pid <= 0)
      continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (unlink(path) == 0) pd_log(PD_LOG_INFO, "shm: removed %s (its daemon is gone)", path);
  }
  if (dp) closedir(dp);
}

/* Makes the area once (lock held), at the first region: a daemon none of whose clients is
 * on its host spends nothing on it. Failure is logged and leaves fetches on the regions. */
static void pd__shm_roots_make(pd_shm *r) {
  if (r->roots_tried) return;
  r->roots_tried = 1;
  pd__shm_roots_sweep(r->dir);
  size_t bytes = (size_t)PD_SHM_ROOTS_BYTES;
  if (pd_store_reserve_extra(r->store, bytes) != PD_OK) {
    pd_log(PD_LOG_INFO,
           "shm: no roots area (%zu bytes do not fit --memory-limit-mb): roots go "
           "through each region",
           bytes);
    return;
  }
  unsigned char name[8];
  int fd = -1;
  if (getrandom(name, sizeof name, 0) == (ssize_t)sizeof name) {
    snprintf(r->roots_path, sizeof r->roots_path,
             "%s/precondd-%d-roots-%02x%02x%02x%02x%02x%02x%02x%02x", r->dir, (int)getpid(),
             name[0], name[1], name[2], name[3], name[4], name[5], name[6], name[7]);
    fd = open(r->roots_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  }
  void *map = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, (off_t)bytes) == 0)
    map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    pd_log(PD_LOG_ERROR, "shm: roots area %s: %s", r->roots_path, strerror(errno));
    if (fd >= 0) {
      unlink(r->roots_path);
      close(fd);
    }
    r->roots_path[0] = '\0';
    pd_store_release_extra(r->store, bytes);
    return;
  }
  r->roots_fd = fd;
  r->roots = map;
  r->roots_bytes = bytes;
  atomic_fetch_add(&r->stats->memory_bytes, (int64_t)bytes);
}

void pd_shm_roots_describe(pd_shm *r, const char **path, size_t *bytes) {
  pthread_mutex_lock(&r->roots_lock);
  *path = r->roots ? r->roots_path : NULL;
  *bytes = r->roots ? r->roots_bytes : 0;
  pthread_mutex_unlock(&r->roots_lock);
}

int pd_shm_root_fits(pd_shm *r, size_t len) {
  pthread_mutex_lock(&r->roots_lock);
  int fits = r->roots && len > 0 && len <= r->roots_bytes - RPC_SHM_ROOTS_DATA;
  pthread_mutex_unlock(&r->roots_lock);
  return fits;
}

static rpc_shm_entry *pd__shm_entry(pd_shm *r, uint64_t seq) {
  return (rpc_shm_entry *)(void *)r->roots + seq % RPC_SHM_ROOTS_ENTRIES;
}

int pd_shm_root_ref(pd_shm *r, pd_root *root, uint32_t k, int enc, const void *src, size_t len,
                    uint64_t *offset, uint64_t *length, uint32_t *crc, uint64_t *seq) {
  if (k >= PD_MAX_PARTS || enc < 0 || enc > 1) return PD_ELIMIT;
  pthread_mutex_lock(&r->roots_lock);
  uint64_t area = r->roots ? r->roots_bytes - RPC_SHM_ROOTS_DATA : 0;
  if (!r->roots || len == 0 || len > area) {
    pthread_mutex_unlock(&r->roots_lock);
    return PD_ELIMIT;
  }
  uint64_t n = root->shm_seq[enc][k];
  rpc_shm_entry *e = n ? pd__shm_entry(r, n) : NULL;
  int there = e && __atomic_load_n(&e->seq, __ATOMIC_RELAXED) == n;
  if (!there && !src) {
    pthread_mutex_unlock(&r->roots_lock);
    return PD_ELIMIT;
  }
  if (!there) {
    /* Not there, or overwritten since: publish it as publication n. */
    n = ++r->roots_seq;
    uint64_t before = r->roots_pos, off = 0;
    rpc_shm_ring_take(&r->roots_pos, area, len, &off);
    int wrapped = off == 0 && before != 0;
    /* Entries whose bytes the new ones overwrite go first (the oldest, in ring order), and
     * the one this publication reuses: seq 0 before any byte changes. */
    while (r->roots_oldest != 0 && r->roots_oldest < n) {
      rpc_shm_entry *old = pd__shm_entry(r, r->roots_oldest);
      int reused = n - r->roots_oldest >= RPC_SHM_ROOTS_ENTRIES;
      int over = old->offset - RPC_SHM_ROOTS_DATA < off + len &&
                 off < old->offset - RPC_SHM_ROOTS_DATA + old->length;
      int behind = wrapped && old->offset - RPC_SHM_ROOTS_DATA >= before;
      if (!reused && !over && !behind && __atomic_load_n(&old->seq, __ATOMIC_RELAXED) != 0) break;
      __atomic_store_n(&old->seq, 0, __ATOMIC_RELAXED);
      r->roots_oldest++;
    }
    if (r->roots_oldest == 0 || r->roots_oldest > n) r->roots_oldest = n;
    e = pd__shm_entry(r, n);
    __atomic_store_n(&e->seq, 0, __ATOMIC_RELAXED);
    /* Release: the zeros above are visible before any byte below is overwritten. */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    e->offset = RPC_SHM_ROOTS_DATA + off;
    e->length = len;
    e->crc32c = rpc_shm_copy_crc(r->roots + RPC_SHM_ROOTS_DATA + off, src, len);
    __atomic_store_n(&e->seq, n, __ATOMIC_RELEASE);
    root->shm_seq[enc][k] = n;
  }
  *offset = e->offset;
  *length = e->length;
  *crc = e->crc32c;
  *seq = n;
  pthread_mutex_unlock(&r->roots_lock);
  return PD_OK;
}

/* Frees a session nothing references any more: unmaps, closes, gives the budget back. */
static void pd__shm_free(pd_shm *r, pd_shm_session *s) {
  if (!s->attached && s->path[0] && s->fd >= 0) unlink(s->path); /* only a file made here */
  if (s->map) munmap(s->map, s->bytes);
  if (s->fd >= 0) close(s->fd);
  for (size_t i = 0; i < s->nspare; i++) free(s->spare[i]);
  free(s->spare);
  free(s->spare_n);
  pd_store_release_extra(r->store, s->bytes + s->in_cap + s->spare_bytes);
  atomic_fetch_sub(&r->stats->memory_bytes, (int64_t)(s->bytes + s->in_cap + s->spare_bytes));
  free(s->in_buf);
  pthread_mutex_destroy(&s->in_lock);
  pthread_mutex_destroy(&s->lock);
  free(s);
}

void pd_shm_put(pd_shm *r, pd_shm_session *s) {
  if (s && atomic_fetch_sub(&s->refs, 1) == 1) pd__shm_free(r, s);
}

/* Takes s out of the registry (lock held) and drops the registry's reference. */
static void pd__shm_unlist_locked(pd_shm *r, size_t i) {
  pd_shm_session *s = r->s[i];
  r->s[i] = r->s[--r->n];
  s->listed = 0;
  if (s->bell_on) {
    atomic_store(&s->bell_stop, 1);
    rpc_shm_futex_wake(&((rpc_shm_head *)(void *)s->map)->bell);
  }
  if (!s->attached && s->path[0]) {
    unlink(s->path);
    s->path[0] = '\0';
  }
  pd_shm_put(r, s);
}

void pd_shm_destroy(pd_shm *r) {
  if (!r->inited) return;
  pthread_mutex_lock(&r->lock);
  while (r->n > 0) pd__shm_unlist_locked(r, r->n - 1);
  pthread_mutex_unlock(&r->lock);
  /* The doorbell threads finish the request they serve (it may look regions up) and end. */
  for (int i = 0; atomic_load(&r->bells) > 0 && i < 30000; i++) usleep(1000);
  pthread_mutex_destroy(&r->lock);
  if (r->roots) {
    munmap(r->roots, r->roots_bytes);
    close(r->roots_fd);
    unlink(r->roots_path);
    pd_store_release_extra(r->store, r->roots_bytes);
    atomic_fetch_sub(&r->stats->memory_bytes, (int64_t)r->roots_bytes);
    r->roots = NULL;
  }
  pthread_mutex_destroy(&r->roots_lock);
  r->inited = 0;
}

void pd_shm_serve_bells(pd_shm *r, pd_shm_bell_fn fn, void *ctx) {
  r->bell = fn;
  r->bell_ctx = ctx;
}

int pd_shm_bell_served(const pd_shm_session *s) {
  return s->bell_on;
}

void pd_shm_set_holds_vouched(pd_shm_session *s, int holds) {
  atomic_store(&s->holds_vouched, holds != 0);
}

int pd_shm_holds_vouched(const pd_shm_session *s) {
  return atomic_load(&s->holds_vouched);
}

/* A region's doorbell (rpc.h, rpc_shm_head): waits on the head's bell word, serves each
 * request rung through r->bell and answers in the region, until the region is unlisted.
 * Holds a reference to s. */
static void *pd__shm_bell_main(void *arg) {
  pd_shm_session *s = arg;
  pd_shm *r = s->reg;
  rpc_shm_head *h = (void *)s->map;
  pd_thread_name("pd-bell"); /* per-thread CPU tells the doorbell apart (bench-daemon) */
  /* The region is new (its file made zeroed): 0 rung. Not the word's value now: the client
   * may have rung before this thread first ran. */
  uint32_t seen = 0;
  /* The answer is made here, then copied into the room (the client's memory is never read
   * back by the daemon). A push's answer is tens of bytes; a fetch's grows with the job's
   * blocks: a larger buffer is kept once a room asks for it, up to RPC_SHM_BELL_REPLY_MAX. */
  unsigned char small[RPC_SHM_BELL_REPLY], *out = small;
  size_t out_cap = sizeof small;
  /* While small pushes arrive back to back from another core the thread spins briefly (and
   * naps, PRECOND_SHM_NAP_US) before it sleeps on the futex, and the client wakes it only
   * when it sleeps there (rpc.h, rpc_shm_nap). */
  rpc_shm_pace pace = {.nap_max_us = rpc_shm_nap_max_us()};
  __atomic_store_n(&h->bell_wait, RPC_SHM_WAIT_FLAGGED, __ATOMIC_SEQ_CST);
  while (!atomic_load(&s->bell_stop)) {
    if (__atomic_load_n(&h->bell, __ATOMIC_ACQUIRE) == seen) {
      /* The client's CPU when it rang last (rpc.h, rpc_shm_head.answer_wait). */
      uint32_t c = __atomic_load_n(&h->answer_wait, __ATOMIC_RELAXED) >> RPC_SHM_WAIT_CPU;
      int same = c != 0 && (int)(c - 1) == rpc_shm_cpu();
      if (!rpc_shm_nap(&h->bell, seen + 1, &pace, 0, same) && !atomic_load(&s->bell_stop)) {
        /* A timed sleep only as a safety net: the unlisting wakes it (a wake sent while
         * the thread spun or napped is made up for by the look at bell_stop above). */
        if (rpc_shm_sleep(&h->bell, seen + 1, &h->bell_wait, 1000) == 1)
          rpc_shm_paced(&pace);
        else
          pace.expect_us = 0; /* idle: to the futex at once, no nap, until the next bell */
      }
      continue;
    }
    rpc_shm_bell b;
    int ok = rpc_shm_bell_read(s->map, s->bytes, &b) == RPC_OK;
    seen = b.bell;
    /* The head is read (b holds it): the client may fill it for its next push while this
     * one is served (ShmOpenResponse.doorbell_queue). A wake (a system call) only when the
     * client waits for it, which it rarely does (rpc.h, rpc_shm_head.taken_wait). */
    __atomic_store_n(&h->taken, b.bell, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&h->taken_wait, __ATOMIC_SEQ_CST)) rpc_shm_futex_wake(&h->taken);
    uint32_t code = GRPC_STATUS_INVALID_ARGUMENT;
    size_t n;
    size_t want = b.reply_cap < RPC_SHM_BELL_REPLY_MAX ? b.reply_cap : RPC_SHM_BELL_REPLY_MAX;
    if (ok && want > out_cap) {
      unsigned char *big = malloc(want);
      if (big != NULL) {
        if (out != small) free(out);
        out = big;
        out_cap = want;
      }
    }
    if (ok) {
      /* What the push cost this thread (its read and fold of the slots included), in its
       * answer: the client weighs it against its own write's CPU to choose streamed or
       * plain stores (rpc.h, rpc_shm_mode). */
      size_t room = (want < out_cap ? want : out_cap) - RPC_SHM_REPLY_HEAD;
      uint64_t t0 = rpc_shm_thread_ns();
      n = r->bell(r->bell_ctx, b.method, s->map + b.req_offset, b.req_length, &code, out, room);
      uint64_t t1 = rpc_shm_thread_ns();
      if (b.method == RPC_SHM_BELL_PUSH && code == GRPC_STATUS_OK && t1 > t0)
        n = rpc_shm_bell_cpu_append(out, n, room, t1 - t0);
    } else
      n = (size_t)snprintf((char *)out, out_cap,
                           "shm doorbell: the request or its answer's room lies outside the "
                           "region's push ring, or the method (%u) is unknown",
                           (unsigned)b.method);
    /* Where this thread ran: the client streams its large slots only when it writes them
     * on another core (rpc_shm_streams). */
    int cpu = rpc_shm_cpu();
    __atomic_store_n(&h->daemon_cpu, cpu < 0 ? 0u : (uint32_t)cpu + 1, __ATOMIC_RELAXED);
    rpc_shm_bell_answer(s->map, s->bytes, &b, code, out, n);
  }
  if (out != small) free(out);
  pd_shm_put(r, s);
  atomic_fetch_sub(&r->bells, 1);
  return NULL;
}

/* Starts s's doorbell thread when the daemon serves bells (s->bell_on). */
static void pd__shm_bell_start(pd_shm *r, pd_shm_session *s) {
  if (!r->bell || s->bytes / 2 <= RPC_SHM_PUSH_RING) return;
  s->reg = r;
  atomic_fetch_add(&s->refs, 1);
  atomic_fetch_add(&r->bells, 1);
  pthread_attr_t at;
  pthread_t t;
  int ok = pthread_attr_init(&at) == 0;
  if (ok) {
    ok = pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED) == 0 &&
         pthread_create(&t, &at, pd__shm_bell_main, s) == 0;
    pthread_attr_destroy(&at);
  }
  if (ok) {
    s->bell_on = 1;
    return;
  }
  pd_log(PD_LOG_WARN, "shm: region %llu: no doorbell thread (pushes go over gRPC)",
         (unsigned long long)s->id);
  atomic_fetch_sub(&r->bells, 1);
  atomic_fetch_sub(&s->refs, 1);
}

int pd_shm_open(pd_shm *r, uint64_t want, pd_shm_session **out, char *err, size_t errlen) {
  *out = NULL;
  if (!r->inited || !r->dir[0]) {
    snprintf(err, errlen, "shared memory is off on this daemon (--shm-dir off)");
    return PD_EINVAL;
  }
  if (want == 0) want = PD_SHM_DEFAULT_BYTES;
  if (want < 2 * RPC_SHM_ALIGN || want > PD_SHM_MAX_BYTES) {
    snprintf(err, errlen, "bytes: %llu, expected %d to %llu (0: the default %llu)",
             (unsigned long long)want, 2 * RPC_SHM_ALIGN, (unsigned long long)PD_SHM_MAX_BYTES,
             (unsigned long long)PD_SHM_DEFAULT_BYTES);
    return PD_EINVAL;
  }
  pthread_mutex_lock(&r->roots_lock);
  pd__shm_roots_make(r);
  pthread_mutex_unlock(&r->roots_lock);
  size_t bytes = (size_t)(want + 2 * RPC_SHM_ALIGN - 1) / (2 * RPC_SHM_ALIGN) * (2 * RPC_SHM_ALIGN);
  pd_shm_session *s = calloc(1, sizeof *s);
  if (!s || pthread_mutex_init(&s->lock, NULL) != 0) {
    free(s);
    snprintf(err, errlen, "out of memory");
    return PD_ENOMEM;
  }
  if (pthread_mutex_init(&s->in_lock, NULL) != 0) {
    pthread_mutex_destroy(&s->lock);
    free(s);
    snprintf(err, errlen, "out of memory");
    return PD_ENOMEM;
  }
  s->fd = -1;
  atomic_init(&s->refs, 2); /* the registry's and the caller's */
  int rc = PD_OK;
  pthread_mutex_lock(&r->lock);
  if (r->n == PD_SHM_MAX_SESSIONS) {
    pthread_mutex_unlock(&r->lock);
    snprintf(err, errlen, "%d shared-memory regions open already (the most a daemon keeps)",
             PD_SHM_MAX_SESSIONS);
    pthread_mutex_destroy(&s->in_lock);
    pthread_mutex_destroy(&s->lock);
    free(s);
    return PD_ELIMIT;
  }
  s->id = r->next_id++;
  pthread_mutex_unlock(&r->lock);
  if (pd_store_reserve_extra(r->store, bytes) != PD_OK) {
    snprintf(err, errlen, "bytes: a region of %zu bytes does not fit --memory-limit-mb", bytes);
    pthread_mutex_destroy(&s->in_lock);
    pthread_mutex_destroy(&s->lock);
    free(s);
    return PD_ELIMIT;
  }
  s->bytes = bytes;
  atomic_fetch_add(&r->stats->memory_bytes, (int64_t)bytes);
  if (getrandom(s->secret, sizeof s->secret, 0) != (ssize_t)sizeof s->secret) {
    snprintf(err, errlen, "no random bytes for the region's secret");
    rc = PD_EIO;
    goto fail;
  }
  unsigned char name[8];
  if (getrandom(name, sizeof name, 0) != (ssize_t)sizeof name) {
    snprintf(err, errlen, "no random bytes for the region's name");
    rc = PD_EIO;
    goto fail;
  }
  snprintf(s->path, sizeof s->path, "%s/precondd-%d-%llu-%02x%02x%02x%02x%02x%02x%02x%02x", r->dir,
           (int)getpid(), (unsigned long long)s->id, name[0], name[1], name[2], name[3], name[4],
           name[5], name[6], name[7]);
  s->fd = open(s->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (s->fd < 0 || ftruncate(s->fd, (off_t)bytes) != 0) {
    pd_log(PD_LOG_ERROR, "shm: %s: %s", s->path, strerror(errno));
    snprintf(err, errlen, "the daemon cannot create a region in --shm-dir (see its log)");
    rc = PD_EIO;
    goto fail;
  }
  /* Held while the daemon has the file open: clients waiting at the doorbell see it
   * dropped if the daemon dies (rpc_shm_alive). */
  if (rpc_shm_alive_mark(s->fd) != RPC_OK)
    pd_log(PD_LOG_WARN, "shm: %s: no lock marking the daemon alive: %s", s->path, strerror(errno));
  s->map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
  if (s->map == MAP_FAILED) {
    s->map = NULL;
    pd_log(PD_LOG_ERROR, "shm: mmap of %zu bytes: %s", bytes, strerror(errno));
    snprintf(err, errlen, "the daemon cannot map a region of %zu bytes", bytes);
    rc = PD_ENOMEM;
    goto fail;
  }
  s->created = pd_now();
  pthread_mutex_lock(&r->lock);
  if (r->n == PD_SHM_MAX_SESSIONS) {
    pthread_mutex_unlock(&r->lock);
    snprintf(err, errlen, "%d shared-memory regions open already", PD_SHM_MAX_SESSIONS);
    rc = PD_ELIMIT;
    goto fail;
  }
  s->listed = 1;
  r->s[r->n++] = s;
  pd__shm_bell_start(r, s); /* under the lock: bell_on is set before any unlisting reads it */
  pthread_mutex_unlock(&r->lock);
  atomic_fetch_add(&r->opened, 1);
  *out = s;
  return PD_OK;

fail:
  atomic_store(&s->refs, 1);
  pd_shm_put(r, s); /* unlinks, unmaps, closes, gives the budget back */
  return rc;
}

void pd_shm_describe(const pd_shm_session *s, uint64_t *id, const unsigned char **secret,
                     const char **path, size_t *bytes) {
  *id = s->id;
  *secret = s->secret;
  *path = s->path;
  *bytes = s->bytes;
}

pd_shm_session *pd_shm_get(pd_shm *r, uint64_t id, const void *secret, size_t len) {
  if (!r->inited) return NULL;
  pd_shm_session *found = NULL;
  pthread_mutex_lock(&r->lock);
  for (size_t i = 0; i < r->n; i++) {
    pd_shm_session *s = r->s[i];
    if (s->id != id) continue;
    /* Same time whatever bytes match: the secret must not leak through timing. */
    unsigned char diff = len != sizeof s->secret;
    for (size_t k = 0; k < sizeof s->secret; k++)
      diff |= (unsigned char)(s->secret[k] ^ (k < len ? ((const unsigned char *)secret)[k] : 0));
    if (diff) break;
    if (!s->attached) {
      /* The client has it open (and locked) by now: nobody else needs the name. */
      s->attached = 1;
      unlink(s->path);
    }
    atomic_fetch_add(&s->refs, 1);
    found = s;
    break;
  }
  pthread_mutex_unlock(&r->lock);
  return found;
}

void pd_shm_in_begin(pd_shm *r, pd_shm_session *s, size_t total, pd_shm_in *in) {
  memset(in, 0, sizeof *in);
  in->s = s;
  /* More than the client's half is no push a client makes (references that overlap): those
   * go to malloc'd copies, as when another push of the region holds the buffer. */
  if (total == 0 || total > s->bytes / 2 || pthread_mutex_trylock(&s->in_lock) != 0) return;
  in->held = 1;
  if (s->in_cap < total) {
    /* Grown to this push's size (at most the half), the budget first. */
    free(s->in_buf);
    s->in_buf = NULL;
    pd_store_release_extra(r->store, s->in_cap);
    atomic_fetch_sub(&r->stats->memory_bytes, (int64_t)s->in_cap);
    s->in_cap = 0;
    if (pd_store_reserve_extra(r->store, total) != PD_OK) {
      pd_shm_in_end(in);
      return;
    }
    s->in_buf = malloc(total);
    if (!s->in_buf) {
      pd_store_release_extra(r->store, total);
      pd_shm_in_end(in);
      return;
    }
    s->in_cap = total;
    atomic_fetch_add(&r->stats->memory_bytes, (int64_t)total);
  }
  in->buf = s->in_buf;
  in->cap = total;
}

int pd_shm_in_hold(pd_shm_session *s, pd_shm_in *in) {
  memset(in, 0, sizeof *in);
  in->s = s;
  in->held = pthread_mutex_trylock(&s->in_lock) == 0;
  return in->held;
}

void pd_shm_in_end(pd_shm_in *in) {
  if (in->held) pthread_mutex_unlock(&in->s->in_lock);
  in->held = 0;
  in->buf = NULL;
}

int pd_shm_ref_in(const pd_shm_in *in, uint64_t offset, uint64_t length, size_t expect,
                  const uint8_t **at, const char **why) {
  const pd_shm_session *s = in->s;
  *at = NULL;
  if (rpc_shm_ref_check(s->bytes, 0, s->bytes / 2, offset, length, expect) != RPC_OK) {
    *why = "outside the client's half of the region, or not the matrix's byte count";
    return PD_EINVAL;
  }
  *at = s->map + offset;
  return PD_OK;
}

int pd_shm_intact(const pd_shm_in *in, uint64_t offset, uint64_t seq) {
  return rpc_shm_push_intact(in->s->map, in->s->bytes, offset, seq);
}

float *pd_shm_spare_take(pd_shm *r, pd_shm_in *in, size_t count) {
  pd_shm_session *s = in->s;
  for (size_t i = s->nspare; in->held && i-- > 0;) {
    if (s->spare_n[i] != count) continue;
    float *buf = s->spare[i];
    s->spare[i] = s->spare[--s->nspare];
    s->spare_n[i] = s->spare_n[s->nspare];
    s->spare_kept -= count * sizeof(float);
    return buf;
  }
  size_t bytes = count * sizeof(float);
  if (!in->held || count == 0 || pd_store_reserve_extra(r->store, bytes) != PD_OK) return NULL;
  /* Aligned for the fold's streaming stores (pd_mode.fold_into folds in place into an
   * aligned statistic, its old values streamed to an aligned spare). */
  float *buf = aligned_alloc(PD_SHM_SPARE_ALIGN, (bytes + PD_SHM_SPARE_ALIGN - 1) /
                                                     PD_SHM_SPARE_ALIGN * PD_SHM_SPARE_ALIGN);
  if (!buf) {
    pd_store_release_extra(r->store, bytes);
    return NULL;
  }
  s->spare_bytes += bytes;
  atomic_fetch_add(&r->stats->memory_bytes, (int64_t)bytes);
  return buf;
}

void pd_shm_spare_give(pd_shm *r, pd_shm_in *in, float *buf, size_t count) {
  pd_shm_session *s = in->s;
  size_t bytes = count * sizeof(float);
  if (!buf) return;
  /* Kept while the spares are at most the client's half: no push read in place needs more
   * (its matrices lie in that half); and only aligned ones (a statistic allocated elsewhere
   * that a fold swapped out is let go, so the block's statistics end up in aligned ones). */
  if (s->spare_kept + bytes <= s->bytes / 2 && (uintptr_t)buf % PD_SHM_SPARE_ALIGN == 0) {
    if (s->nspare == s->spare_slots) {
      size_t slots = s->spare_slots ? 2 * s->spare_slots : 8;
      float **sp = realloc(s->spare, slots * sizeof *sp);
      if (sp) s->spare = sp;
      size_t *sn = sp ? realloc(s->spare_n, slots * sizeof *sn) : NULL;
      if (sn) s->spare_n = sn;
      if (sp && sn) s->spare_slots = slots;
    }
    if (s->nspare < s->spare_slots) {
      s->spare[s->nspare] = buf;
      s->spare_n[s->nspare++] = count;
      s->spare_kept += bytes;
      return;
    }
  }
  free(buf);
  s->spare_bytes -= bytes;
  pd_store_release_extra(r->store, bytes);
  atomic_fetch_sub(&r->stats->memory_bytes, (int64_t)bytes);
}

int pd_shm_copy_in(pd_shm_in *in, uint64_t offset, uint64_t length, uint64_t seq,
                   const uint32_t *crc, size_t expect, int fp32, uint8_t **out, int *finite,
                   const char **why) {
  const pd_shm_session *s = in->s;
  *out = NULL;
  *finite = 0;
  if (rpc_shm_ref_check(s->bytes, 0, s->bytes / 2, offset, length, expect) != RPC_OK) {
    *why = "outside the client's half of the region, or not the matrix's byte count";
    return PD_EINVAL;
  }
  size_t slot = ((size_t)length + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  uint8_t *buf;
  if (in->buf && in->cap - in->used >= slot) {
    buf = in->buf + in->used;
  } else if (in->buf) {
    *why = "more bytes than the push announced"; /* the caller's sum was wrong: a bug */
    return PD_EINVAL;
  } else if (!(buf = malloc(length ? (size_t)length : 1))) {
    *why = "out of memory";
    return PD_ENOMEM;
  }
  int ok = 0;
  if (crc == NULL && fp32)
    rpc_shm_copy_finite(buf, s->map + offset, (size_t)length, &ok);
  else if (crc == NULL)
    memcpy(buf, s->map + offset, (size_t)length);
  else if (*crc != (fp32 ? rpc_shm_copy_crc_finite(buf, s->map + offset, (size_t)length, &ok)
                         : rpc_shm_copy_crc(buf, s->map + offset, (size_t)length))) {
    if (!in->buf) free(buf);
    *why = "checksum mismatch (CRC-32C of the region's bytes)";
    return PD_EINVAL;
  }
  if (!pd_shm_intact(in, offset, seq)) {
    if (!in->buf) free(buf);
    *why = PD_SHM_OVERWRITTEN;
    return PD_EINVAL;
  }
  if (in->buf) in->used += slot;
  *out = buf;
  *finite = ok;
  return PD_OK;
}

int pd_shm_write_out(pd_shm_session *s, const void *src, size_t len, uint64_t *offset,
                     uint32_t *crc) {
  uint64_t half = s->bytes / 2, off = 0;
  pthread_mutex_lock(&s->lock);
  int rc = rpc_shm_ring_take(&s->out_pos, half, len, &off);
  pthread_mutex_unlock(&s->lock);
  if (rc != RPC_OK) return PD_ELIMIT;
  *offset = half + off;
  *crc = rpc_shm_copy_crc(s->map + half + off, src, len);
  return PD_OK;
}

size_t pd_shm_reap(pd_shm *r, double now) {
  if (!r->inited) return 0;
  size_t freed = 0;
  pthread_mutex_lock(&r->lock);
  for (size_t i = r->n; i-- > 0;) {
    pd_shm_session *s = r->s[i];
    int gone;
    if (s->attached) {
      /* Succeeds only when no client holds its shared lock any more. */
      gone = flock(s->fd, LOCK_EX | LOCK_NB) == 0;
      if (gone) flock(s->fd, LOCK_UN);
    } else {
      gone = now - s->created > PD_SHM_ATTACH_S;
    }
    if (gone) {
      pd_log(PD_LOG_INFO, "shm: region %llu (%zu bytes) freed: %s", (unsigned long long)s->id,
             s->bytes, s->attached ? "its client closed it or exited" : "never used");
      pd__shm_unlist_locked(r, i);
      freed++;
    }
  }
  pthread_mutex_unlock(&r->lock);
  atomic_fetch_add(&r->reaped, freed);
  return freed;
}

size_t pd_shm_count(pd_shm *r) {
  if (!r->inited) return 0;
  pthread_mutex_lock(&r->lock);
  size_t n = r->n;
  pthread_mutex_unlock(&r->lock);
  return n;
}
