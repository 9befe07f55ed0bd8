/*
 * client.c -- libprecond: connection, register, the push/fetch background thread, the
 * published roots, stats and health (see precond.h for the model and the queue policy).
 *
 * Locking: one mutex per client guards the job, the queue, the roots table, the counters and
 * the error message. The background thread never holds it across a network call: it takes a
 * batch out of the queue (or copies the held versions), unlocks, calls, relocks and
 * publishes. Published roots are immutable and reference-counted, so a reader keeps using
 * the version it holds while a newer one is swapped in (the double buffer of the design).
 *
 * Channel: created here rather than with rpc_channel_create because the client sets gRPC's
 * reconnect backoff (its default grows to 120 s, far too slow after a daemon restart) next
 * to rpc_args_init's message limits and transport defaults. Calls go through rpc_call_token (proto/rpc.h).
 */
#include "precond.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

#include "health.pb-c.h"
#include "precond.pb-c.h"
#include "preconditioner.h"
#include "queue.h"
#include "rpc.h"
#include "wire.h"

/* The public enums are the wire's values (and pc_method's: host/service.c checks those). */
_Static_assert((int)PRECOND_MODE_SHAMPOO == (int)PRECOND__V1__MODE__MODE_SHAMPOO, "modes");
_Static_assert((int)PRECOND_MODE_KFAC == (int)PRECOND__V1__MODE__MODE_KFAC, "modes");
_Static_assert((int)PRECOND_MODE_ABS == (int)PRECOND__V1__MODE__MODE_ABS, "modes");
_Static_assert((int)PRECOND_METHOD_NEWTON == (int)PRECOND__V1__METHOD__METHOD_NEWTON, "methods");
_Static_assert((int)PRECOND_METHOD_NEWTON_TEXTBOOK ==
                   (int)PRECOND__V1__METHOD__METHOD_NEWTON_TEXTBOOK,
               "methods");
_Static_assert((int)PRECOND_METHOD_EIGH == (int)PRECOND__V1__METHOD__METHOD_EIGH, "methods");
_Static_assert(
    (int)PRECOND_KFAC_INVERSE_AUTO == (int)PRECOND__V1__KFAC_INVERSE__KFAC_INVERSE_AUTO &&
        (int)PRECOND_KFAC_INVERSE_CHOLESKY ==
            (int)PRECOND__V1__KFAC_INVERSE__KFAC_INVERSE_CHOLESKY &&
        (int)PRECOND_KFAC_INVERSE_EIGH == (int)PRECOND__V1__KFAC_INVERSE__KFAC_INVERSE_EIGH &&
        (int)PRECOND_KFAC_INVERSE_NEWTON == (int)PRECOND__V1__KFAC_INVERSE__KFAC_INVERSE_NEWTON,
    "K-FAC inverse methods");
_Static_assert((int)PRECOND_FP32 == (int)PRECOND__V1__ENCODING__ENCODING_FP32, "encodings");
_Static_assert((int)PRECOND_BF16 == (int)PRECOND__V1__ENCODING__ENCODING_BF16, "encodings");

/* A push batch: items taken from the queue for one PushRequest, and what settling its
 * answer needs. While it is posted at the region's doorbell (pipelined, below) the batch
 * keeps its items, so that a push answered for a transient reason, or lost with its region,
 * is sent again as today. */
#define PUSH_BATCH_ITEMS 256
typedef struct {
  precond__item *items[PUSH_BATCH_ITEMS];
  size_t n;
  uint64_t gen;       /* the job generation it was taken for */
  char *job;          /* its job's name, owned */
  precond_mode mode;  /* its job's mode */
  uint64_t bytes;     /* payload bytes */
  uint64_t shm_bytes; /* of them, those that went through the region */
} push_batch;

/* Worker slots in a region (session 15): the part of its push ring past rpc_shm.lim, where
 * precond_push_begin hands out the place a push's statistics are written, so that they are
 * written once, by the worker, and posted from there (no copy into the ring, no NaN/Inf
 * scan of the client's: the daemon's fold checks every value and refuses the push whole).
 * Places are taken in order around the part (a wrap leaves the rest of the part unused for
 * that lap) and given back in the same order: a slot's place comes back when its item is
 * freed (answered, accepted or refused; cancelled, coalesced, dropped) and every older
 * slot's has, so a slot cancelled or coalesced early is skipped until the older ones are
 * done, and no place is taken again while an item names it (one whose push is in flight or
 * back in the queue after a transient failure: its answer not yet in). Taken in order, the
 * places rotate through the part, so the worker writes lines the daemon read long ago (out
 * of its core's caches) rather than the ones it just read: first fit (the same two places
 * again and again) cost 2x the CPU per push across cores (docs/precondd.md, "Session 15").
 * A lap is short, though (session 17): once it holds WIN_LAP_MIN bytes and RPC_SHM_QUEUE + 1
 * slots of the size taken, the next slot goes to the part's start where that place is free,
 * so the places in turn are the fewest the posted pushes need (three of a 1024 block's, not
 * the five a 64 MiB region's part holds): a place the daemon read two folds ago has left its
 * core's L2 but is still in the shared L3, where the worker's plain stores find its lines; five
 * places apart they came from memory, and both the write and the next fold paid
 * (docs/precondd.md, "Session 17: the real push's plain penalty").
 * Slots may be posted in any order: the daemon folds each block's pushes in the order
 * posted, which is the queue's (the push order).
 * The window holds the mapping: one reference for the client while the region is its own,
 * one per slot; a region closed (lost, reopened, the client closed) leaves the mapping to
 * the window, unmapped with its last slot, so a worker writing a slot never writes into
 * memory that went away. Its lock is a leaf (taken under the client's mu, never the other
 * way). */
#define WIN_SLOTS   64
#define WIN_LAP_MIN ((uint64_t)8 << 20) /* 4x a core's L2 on the project's VM */
typedef struct {
  pthread_mutex_t mu;
  unsigned char *map; /* the region's mapping (the window's to unmap once owns is set) */
  size_t bytes;
  int owns;    /* the region was closed: the mapping is the window's */
  int refs;    /* the client's (while the region is open) + one per slot */
  uint64_t lo; /* the part: [lo, lo + len) of the region */
  uint64_t len;
  uint64_t taken;   /* bytes of the part ever taken (wraps' skipped rests included) */
  uint64_t head, n; /* the slots not given back, oldest first: ent[head % WIN_SLOTS] ... */
  struct {
    uint64_t start; /* in the count of taken */
    int done;
  } ent[WIN_SLOTS];
  rpc_shm_mode mode; /* its large writes' mode (session 16), the region's (rpc_shm.mode):
                      * measured on the workers' writes and the daemon's answers */
} shm_window;

struct precond_client {
  precond_options opts;
  int poll_reset; /* precond_set_poll_interval changed the period: poll now, then at it */
  char *addr, *token;
  grpc_channel *channel;

  pthread_mutex_t mu;
  pthread_cond_t wake;     /* the thread: work queued, stop, or a new job */
  pthread_cond_t progress; /* waiters: a send finished, roots arrived */
  pthread_t thread;
  int thread_started, stop;
  /* The region and the calls (rpc_shm, win's opening and closing, posted[] and nposted,
   * area) are used by one thread at a time: the one that set busy under mu while it was 0.
   * That is the background thread in a round of calls for the job, or a thread in
   * precond_push_commit ringing its own push (push_direct: awaited since session 16,
   * posted since session 17, when it also collects the posted answers already in); the
   * holder reads and writes them with mu released, the others wait (the background thread
   * at its loop's top, bell_waits set, woken on wake; a committer does not wait: it queues
   * its push for the holder or the background thread). */
  int busy;       /* a thread is in a round of calls for the job (mu released) */
  int bell_waits; /* the background thread waits for busy to clear */

  /* the job (under mu) */
  char *job;
  precond_mode mode;     /* of the job: where a push's two parts go on the wire */
  uint64_t job_gen;      /* bumped by each precond_register: stale sends are discarded */
  uint8_t *register_msg; /* the packed RegisterRequest, to register again */
  size_t register_len;
  uint32_t nblocks;
  uint32_t *block_rows, *block_cols;
  precond__queue queue;
  size_t inflight;            /* items taken out for a send not yet answered (posted
                               * ones included) */
  int flushing;               /* precond_flush calls waiting: collect what is posted */
  int queue_waiters;          /* precond_wait_queued calls waiting: tell them of a take */
  precond__roots_obj **roots; /* nblocks slots: newest version held, or NULL */
  uint64_t *daemon_have;      /* nblocks: daemon version asked about (0 after re-register) */
  uint64_t newest_step;       /* newest step pushed, sent with fetches for staleness stats */

  precond_counters counters;
  /* Shared memory (the busy holder's, see busy; rpc.h rpc_shm_*): the region, and when to try
   * to get one again after a failure. */
  rpc_shm shm;
  push_batch posted[RPC_SHM_QUEUE]; /* posted at its doorbell, not yet collected, oldest
                                     * first (push_some, collect_posted) */
  uint32_t nposted;
  precond__area *area; /* shm's roots area once roots_by_reference shares it (wire.h) */
  shm_window *win;     /* shm's worker slots (set by the background thread under mu; NULL:
                        * precond_push_begin hands out queue entries) */
  struct timespec shm_retry;
  uint64_t daemon_epoch; /* of the last answer; 0 before one (or without a state dir) */
  int refused;           /* the daemon refused to register the job again (it was ended):
                          * nothing is sent for it until precond_register */
  char error[512];       /* room for the daemon's message naming an ended job */
};

/* ------------------------------------------------------------------------------------ */
/* Status codes                                                                           */

const char *precond_strerror(int status) {
  switch (status) {
    case PRECOND_OK:
      return "success";
    case PRECOND_EINVAL:
      return "invalid argument";
    case PRECOND_ENOMEM:
      return "out of memory";
    case PRECOND_EUNAVAILABLE:
      return "daemon unavailable";
    case PRECOND_ETIMEDOUT:
      return "deadline exceeded";
    case PRECOND_EREJECTED:
      return "request rejected by the daemon";
    case PRECOND_ENOTFOUND:
      return "unknown job or block";
    case PRECOND_ESTATE:
      return "failed precondition (not registered?)";
    case PRECOND_ELIMIT:
      return "size limit or memory budget exceeded";
    case PRECOND_EAUTH:
      return "authentication failed (token missing or wrong)";
    case PRECOND_EPROTO:
      return "unexpected answer from the daemon";
    case PRECOND_ETHREAD:
      return "could not start the background thread";
    case PRECOND_EENDED:
      return "the daemon ended the job and refuses it";
    default:
      return "unknown error";
  }
}

static int from_grpc(grpc_status_code code) {
  switch (code) {
    case GRPC_STATUS_OK:
      return PRECOND_OK;
    case GRPC_STATUS_UNAVAILABLE:
      return PRECOND_EUNAVAILABLE;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
      return PRECOND_ETIMEDOUT;
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_OUT_OF_RANGE:
      return PRECOND_EREJECTED;
    case GRPC_STATUS_NOT_FOUND:
      return PRECOND_ENOTFOUND;
    case GRPC_STATUS_FAILED_PRECONDITION:
      return PRECOND_ESTATE;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
      return PRECOND_ELIMIT;
    case GRPC_STATUS_UNAUTHENTICATED:
    case GRPC_STATUS_PERMISSION_DENIED:
      return PRECOND_EAUTH;
    case GRPC_STATUS_DATA_LOSS:
      /* A vouched push refused torn (session 16): folded in part already, so neither sent
       * again nor split into one block a push (settle), only counted. */
      return PRECOND_EINVAL;
    default:
      return PRECOND_EPROTO;
  }
}

/* ------------------------------------------------------------------------------------ */
/* Small helpers                                                                          */

static char *dup_str(const char *s) {
  if (s == NULL) return NULL;
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d != NULL) memcpy(d, s, n);
  return d;
}

static void set_error(precond_client *c, const char *what, const char *detail) {
  pthread_mutex_lock(&c->mu);
  snprintf(c->error, sizeof c->error, "%s: %s", what, detail ? detail : "");
  pthread_mutex_unlock(&c->mu);
}

/* Absolute CLOCK_MONOTONIC time ms from now, for pthread_cond_timedwait. */
static struct timespec deadline_in(long ms) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  t.tv_sec += ms / 1000;
  t.tv_nsec += (ms % 1000) * 1000000L;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec++;
    t.tv_nsec -= 1000000000L;
  }
  return t;
}

static int passed(const struct timespec *t) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return now.tv_sec > t->tv_sec || (now.tv_sec == t->tv_sec && now.tv_nsec >= t->tv_nsec);
}

/* rpc_call's outcome as a PRECOND_* status, the error kept for precond_last_error; frees
 * details. */
static int call_status(precond_client *c, const char *method, int rc, grpc_status_code code,
                       char *details) {
  int st = PRECOND_OK;
  if (rc != RPC_OK) {
    if (rc == RPC_ESTATUS)
      st = from_grpc(code);
    else if (rc == RPC_ENOMEM)
      st = PRECOND_ENOMEM;
    else if (rc == RPC_ETOOBIG)
      st = PRECOND_ELIMIT;
    else
      st = PRECOND_EPROTO;
    char what[160];
    snprintf(what, sizeof what, "%s: %s", method, rpc_status_name(code));
    set_error(c, what, details ? details : rpc_strerror(rc));
  }
  free(details);
  return st;
}

/* One unary call; maps the outcome to a PRECOND_* code and keeps the daemon's message. */
static int call(precond_client *c, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *desc, int wait_for_ready,
                ProtobufCMessage **resp) {
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  char *details = NULL;
  int rc = rpc_call_token(c->channel, method, req, desc, c->opts.call_timeout_ms, wait_for_ready,
                          c->token, resp, &code, &details);
  return call_status(c, method, rc, code, details);
}

/* ------------------------------------------------------------------------------------ */
/* Roots                                                                                  */

int precond_fetch(precond_client *c, uint32_t block_id, uint64_t have_version,
                  const precond_roots **out) {
  if (c == NULL || out == NULL) return PRECOND_EINVAL;
  *out = NULL;
  pthread_mutex_lock(&c->mu);
  int st = PRECOND_OK;
  if (c->roots == NULL || block_id >= c->nblocks) {
    st = PRECOND_EINVAL;
  } else {
    precond__roots_obj *o = c->roots[block_id];
    if (o != NULL && o->pub.version > have_version) {
      atomic_fetch_add_explicit(&o->refs, 1, memory_order_relaxed);
      *out = &o->pub;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return st;
}

int precond_wait_roots(precond_client *c, uint32_t block_id, uint64_t have_version,
                       int timeout_ms) {
  if (c == NULL) return PRECOND_EINVAL;
  struct timespec until = deadline_in(timeout_ms > 0 ? timeout_ms : 0);
  int st = PRECOND_ETIMEDOUT;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    if (c->roots == NULL || block_id >= c->nblocks) {
      st = PRECOND_EINVAL;
      break;
    }
    if (c->refused) {
      st = PRECOND_EENDED;
      break;
    }
    if (c->roots[block_id] != NULL && c->roots[block_id]->pub.version > have_version) {
      st = PRECOND_OK;
      break;
    }
    if (pthread_cond_timedwait(&c->progress, &c->mu, &until) == ETIMEDOUT) break;
  }
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* ------------------------------------------------------------------------------------ */
/* Job state                                                                              */

/* Frees the job's queue, roots and layout copy; caller holds mu (or is the only user). */
static void job_clear(precond_client *c) {
  precond__queue_destroy(&c->queue);
  if (c->roots != NULL)
    for (uint32_t i = 0; i < c->nblocks; i++)
      if (c->roots[i] != NULL) precond_roots_release(&c->roots[i]->pub);
  free(c->roots);
  free(c->daemon_have);
  c->daemon_have = NULL;
  free(c->block_rows);
  free(c->block_cols);
  free(c->job);
  free(c->register_msg);
  c->roots = NULL;
  c->block_rows = c->block_cols = NULL;
  c->job = NULL;
  c->register_msg = NULL;
  c->register_len = 0;
  c->nblocks = 0;
  c->newest_step = 0;
}

/* ------------------------------------------------------------------------------------ */
/* The background thread                                                                  */

/* Notes the daemon epoch and resumed step of an answer: a changed epoch is a daemon
 * restart, counted and logged once. Caller holds mu. */
static void note_daemon(precond_client *c, uint64_t epoch, uint64_t resumed_step) {
  if (epoch == 0 || epoch == c->daemon_epoch) return;
  if (c->daemon_epoch != 0) {
    c->counters.daemon_restarts++;
    c->counters.resumed_step = resumed_step;
    fprintf(stderr,
            "libprecond: precondd at %s restarted (epoch %llu -> %llu); job %s "
            "resumed from step %llu: statistics pushed after it were lost\n",
            c->addr, (unsigned long long)c->daemon_epoch, (unsigned long long)epoch,
            c->job ? c->job : "?", (unsigned long long)resumed_step);
  }
  c->daemon_epoch = epoch;
}

/* Sends items as one PushRequest of job. An item's two parts travel as left and right
 * (Shampoo) or as a and g (K-FAC). Returns a PRECOND_* code; on PRECOND_OK daemon[0] and
 * daemon[1] get the answer's daemon epoch and resumed step. */
/* ---- shared memory ---------------------------------------------------------------------- */

/* 1 if calls should use a region: a unix socket under AUTO, or SHM. */
static int shm_wanted(const precond_client *c) {
  return c->opts.transport == PRECOND_TRANSPORT_SHM ||
         (c->opts.transport == PRECOND_TRANSPORT_AUTO && strncmp(c->addr, "unix:", 5) == 0);
}

/* Drops one reference of w: the last one unmaps the region if it is the window's. */
static void window_release(shm_window *w) {
  pthread_mutex_lock(&w->mu);
  int last = --w->refs == 0, owns = w->owns;
  pthread_mutex_unlock(&w->mu);
  if (!last) return;
  if (owns) munmap(w->map, w->bytes);
  pthread_mutex_destroy(&w->mu);
  free(w);
}

/* Takes need bytes of w's part for a slot right after the newest slot, wrapping to the
 * part's start when the rest is too short (that rest counts as taken), as long as it stays
 * clear of the oldest slot not given back; at the start again once every slot was given
 * back, or once the lap is long enough (the window's comment) and the start is clear. The
 * slots held always lie in [oldest's start, taken), less than a lap. 1 with *off (from the
 * region's start) and *slot (its number), or 0: no room, or WIN_SLOTS held. */
static int window_take(shm_window *w, uint64_t need, uint64_t *off, uint64_t *slot) {
  need = (need + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  pthread_mutex_lock(&w->mu);
  int ok = 0;
  if (need <= w->len && w->n < WIN_SLOTS) {
    uint64_t pos = w->taken, lap = (pos + w->len - 1) / w->len * w->len;
    uint64_t oldest = w->n ? w->ent[w->head % WIN_SLOTS].start : 0;
    uint64_t lap_min = (RPC_SHM_QUEUE + 1) * need;
    if (lap_min < WIN_LAP_MIN) lap_min = WIN_LAP_MIN;
    if (w->n == 0 || w->len - pos % w->len < need ||
        (pos % w->len >= lap_min && lap + need <= oldest + w->len))
      pos = lap;
    ok = w->n == 0 || pos + need <= oldest + w->len;
    if (ok) {
      *slot = w->head + w->n;
      w->ent[*slot % WIN_SLOTS].start = pos;
      w->ent[*slot % WIN_SLOTS].done = 0;
      w->n++;
      w->taken = pos + need;
      w->refs++;
      *off = w->lo + pos % w->len;
    }
  }
  pthread_mutex_unlock(&w->mu);
  return ok;
}

/* Gives slot's place back (window_take's), and its reference. */
static void window_give(shm_window *w, uint64_t slot) {
  pthread_mutex_lock(&w->mu);
  w->ent[slot % WIN_SLOTS].done = 1;
  while (w->n > 0 && w->ent[w->head % WIN_SLOTS].done) {
    w->head++;
    w->n--;
  }
  pthread_mutex_unlock(&w->mu);
  window_release(w);
}

/* An item in a window's slot, freed (precond__item.release). */
static void window_item_release(precond__item *it) {
  window_give(it->owner, it->slot);
}

/* 1 when item it lies in the open region's worker slots (its parts are referenced where
 * they are). Background thread. */
static int item_in_region(const precond_client *c, const precond__item *it) {
  return it->owner != NULL && it->owner == c->win;
}

/* After a region with the doorbell's queue opened: its ring's first quarter stays the
 * background thread's (its requests, the copies of queue entries, fetches), the rest is
 * worker slots (a window published under mu). Also with push_answer_wait (session 15,
 * later): its batches are ring calls (send_batch) naming the slots as posts do, each answer
 * awaited before the next call, so a slot is still held until its answer. Background
 * thread, mu not held. */
static void shm_window_open(precond_client *c) {
  if (!c->shm.bell || !c->shm.queue) return;
  uint64_t ring = c->shm.bytes / 2 - RPC_SHM_PUSH_RING;
  uint64_t lim = ring / 4 / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  uint64_t len = (ring - lim) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  if (lim == 0 || len == 0) return;
  shm_window *w = calloc(1, sizeof *w);
  if (w == NULL) return; /* no worker slots: queue entries */
  if (pthread_mutex_init(&w->mu, NULL) != 0) {
    free(w);
    return;
  }
  w->map = c->shm.map;
  w->bytes = c->shm.bytes;
  w->refs = 1;
  w->lo = RPC_SHM_PUSH_RING + lim;
  w->len = len;
  w->mode.force = rpc_shm_write_force();
  c->shm.lim = lim;
  c->shm.mode = &w->mode; /* one measurement for the workers' slots and rpc_shm_put's */
  pthread_mutex_lock(&c->mu);
  c->win = w;
  pthread_mutex_unlock(&c->mu);
}

/* The region, opened if wanted and none is held (at most every 10 s after a failure):
 * PRECOND_OK with c->shm.map set, PRECOND_OK with it NULL (bytes: AUTO without a region),
 * or PRECOND_ESTATE (SHM without a region). Background thread, mu not held. */
static int shm_ensure(precond_client *c) {
  if (!shm_wanted(c) || c->shm.map != NULL) return PRECOND_OK;
  if (passed(&c->shm_retry)) {
    grpc_status_code code;
    char err[200];
    /* The promise holds: a worker slot, the only place a vouched reference names, is held
     * until its push's answer (window_give at the item's free), also after a call given up
     * (the region is then dropped, its slots never handed out again). */
    if (rpc_shm_open_holding(c->channel, c->token, c->opts.call_timeout_ms, c->opts.shm_bytes, 1,
                             &c->shm, &code, err, sizeof err) != RPC_OK) {
      c->shm_retry = deadline_in(10000);
      set_error(c, "shared memory", err);
    } else {
      if (c->opts.roots_by_reference && c->shm.roots != NULL)
        c->area = precond__area_new(c->shm.roots, c->shm.roots_bytes); /* NULL: copies */
      shm_window_open(c);
    }
  }
  return c->shm.map != NULL || c->opts.transport != PRECOND_TRANSPORT_SHM ? PRECOND_OK
                                                                          : PRECOND_ESTATE;
}

/* After a call that named the region failed with FAILED_PRECONDITION: the daemon may not
 * know the region (it restarted): drop it; the next call opens a new one. */
/* Closes the region; a roots area that roots handed out by reference share stays mapped
 * until the last of them is released (precond__area). */
static void shm_close(precond_client *c) {
  if (c->win != NULL) {
    /* No new slot from here; the slots still named keep the mapping (the window's now). */
    pthread_mutex_lock(&c->mu);
    shm_window *w = c->win;
    c->win = NULL;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&w->mu);
    w->owns = 1;
    pthread_mutex_unlock(&w->mu);
    c->shm.map = NULL;
    if (c->shm.fd >= 0) close(c->shm.fd); /* drops the flock: the daemon frees the region */
    c->shm.fd = -1;
    window_release(w);
  }
  if (c->area != NULL) {
    c->shm.roots = NULL; /* the holder's to unmap now */
    c->shm.roots_bytes = 0;
    precond__area_release(c->area);
    c->area = NULL;
  }
  rpc_shm_close(&c->shm);
}

static void shm_lost(precond_client *c) {
  shm_close(c);
  c->shm_retry = deadline_in(0);
}

/* A push through the region's doorbell (rpc_shm_call) where the daemon serves it and the
 * request fits before the ring's end, else the gRPC call. A doorbell left unanswered spoils
 * the region (a late answer would land in the ring): it is closed, the next call opens one. */
static int call_push(precond_client *c, const ProtobufCMessage *req, ProtobufCMessage **resp) {
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  char *details = NULL;
  int rc = c->shm.bell ? rpc_shm_call(&c->shm, req, &precond__v1__push_response__descriptor,
                                      c->opts.call_timeout_ms, resp, &code, &details)
                       : RPC_ETOOBIG;
  if (rc == RPC_ETOOBIG) {
    free(details);
    return call(c, RPC_METHOD_PUSH_STATISTICS, req, &precond__v1__push_response__descriptor, 0,
                resp);
  }
  if (rc == RPC_ECALL) { /* no answer in time: DEADLINE_EXCEEDED, as a gRPC call says it */
    shm_lost(c);
    rc = RPC_ESTATUS;
  }
  return call_status(c, RPC_METHOD_PUSH_STATISTICS, rc, code, details);
}

/* A fetch through the region's doorbell where the daemon serves it (session 10: the poll
 * is no gRPC call; the daemon's fetch handler answers it as it answers the gRPC method, so
 * versions, errors and restarts read the same), else, or when the request or its answer do
 * not fit the ring or the room, the gRPC call. The room: ~100 bytes per block answered by
 * reference, twice that for safety. *rung: 1 when the doorbell answered. An unanswered
 * doorbell spoils the region (call_push's rule). */
static int call_fetch(precond_client *c, const ProtobufCMessage *req, uint32_t nblocks, int *rung,
                      ProtobufCMessage **resp) {
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  char *details = NULL;
  uint64_t room = RPC_SHM_BELL_REPLY + 192 * (uint64_t)nblocks;
  *rung = 0;
  int rc = c->shm.bell && room <= RPC_SHM_BELL_REPLY_MAX
               ? rpc_shm_call_method(&c->shm, RPC_SHM_BELL_FETCH, (uint32_t)room, req,
                                     &precond__v1__fetch_response__descriptor,
                                     c->opts.call_timeout_ms, resp, &code, &details)
               : RPC_ETOOBIG;
  if (rc == RPC_ETOOBIG || (rc == RPC_ESTATUS && code == GRPC_STATUS_RESOURCE_EXHAUSTED)) {
    free(details);
    return call(c, RPC_METHOD_FETCH_PRECONDITIONERS, req, &precond__v1__fetch_response__descriptor,
                0, resp);
  }
  *rung = 1;
  if (rc == RPC_ECALL) {
    shm_lost(c);
    rc = RPC_ESTATUS;
  }
  return call_status(c, RPC_METHOD_FETCH_PRECONDITIONERS, rc, code, details);
}

static int is_transient(int st) {
  return st == PRECOND_EUNAVAILABLE || st == PRECOND_ETIMEDOUT || st == PRECOND_ENOMEM ||
         st == PRECOND_ENOTFOUND || st == PRECOND_ESTATE;
}

/* A PushRequest over a batch's items: their bytes referenced where they lie, not copied. */
typedef struct {
  Precond__V1__PushRequest req;
  Precond__V1__BlockStatistics *bs, **bp;
  Precond__V1__PackedMatrix *pm; /* 2n: each item's two parts */
  Precond__V1__ShmRef *refs;     /* 2n when through a region, else NULL */
  Precond__V1__ShmSession sess;
} push_req;

static void push_req_free(push_req *r) {
  free(r->bs);
  free(r->bp);
  free(r->pm);
  free(r->refs);
}

/* Builds r over n items of job (mode: where the two parts go); with_refs: room for the
 * region's references. PRECOND_OK or PRECOND_ENOMEM (r freed either way by push_req_free). */
static int push_req_init(push_req *r, const char *job, precond_mode mode, precond__item **items,
                         size_t n, int with_refs) {
  memset(r, 0, sizeof *r);
  precond__v1__push_request__init(&r->req);
  r->bs = calloc(n, sizeof(*r->bs));
  r->bp = calloc(n, sizeof(*r->bp));
  r->pm = calloc(2 * n, sizeof(*r->pm));
  r->refs = with_refs ? calloc(2 * n, sizeof(*r->refs)) : NULL;
  if (r->bs == NULL || r->bp == NULL || r->pm == NULL || (with_refs && r->refs == NULL))
    return PRECOND_ENOMEM;
  r->req.job = (char *)job;
  r->req.step = 0;
  for (size_t i = 0; i < n; i++) {
    precond__item *it = items[i];
    Precond__V1__BlockStatistics *b = &r->bs[i];
    precond__v1__block_statistics__init(b);
    b->block_id = it->block_id;
    if (it->step > r->req.step) r->req.step = it->step;
    if (it->n_left) {
      Precond__V1__PackedMatrix *m = &r->pm[2 * i];
      precond__v1__packed_matrix__init(m);
      m->n = it->n_left;
      m->encoding = (Precond__V1__Encoding)it->encoding;
      m->data.data = it->data;
      m->data.len = it->left_bytes;
      if (mode == PRECOND_MODE_KFAC)
        b->a = m;
      else
        b->left = m;
    }
    if (it->n_right) {
      Precond__V1__PackedMatrix *m = &r->pm[2 * i + 1];
      precond__v1__packed_matrix__init(m);
      m->n = it->n_right;
      m->encoding = (Precond__V1__Encoding)it->encoding;
      m->data.data = it->data + it->left_bytes;
      m->data.len = it->right_bytes;
      if (mode == PRECOND_MODE_KFAC)
        b->g = m;
      else
        b->right = m;
    }
    r->bp[i] = b;
  }
  r->req.n_blocks = n;
  r->req.blocks = r->bp;
  return PRECOND_OK;
}

/* Names in r the region's bytes of every part of r's items (their n items): a worker
 * slot's where it lies (no copy: unstamped, as its place is not taken again before the
 * answer), any other's written into a slot of the ring (rpc_shm_put); the region named in
 * the request. The bytes that go through the region (0: none, the request carries its
 * bytes). */
static uint64_t push_req_put(precond_client *c, push_req *r, precond__item *const *items) {
  uint64_t moved = 0;
  for (size_t i = 0; i < 2 * r->req.n_blocks; i++) {
    Precond__V1__PackedMatrix *m = &r->pm[i];
    if (m->data.len == 0) continue;
    precond__item *it = items[i / 2];
    if (!item_in_region(c, it)) {
      uint64_t before[2] = {c->shm.wrote[0], c->shm.wrote[1]};
      moved += rpc_shm_put(&c->shm, m, &r->refs[i]);
      for (int k = 0; k < 2; k++) it->wrote[k] += c->shm.wrote[k] - before[k];
      continue;
    }
    /* A worker slot: what precond_push_copy wrote there is this push's (once an item). */
    for (int k = 0; i % 2 == 0 && k < 2; k++)
      rpc_shm_wrote(&c->shm, k | (it->wmode & RPC_SHM_UNSETTLED),
                    __atomic_load_n(&it->wrote[k], __ATOMIC_RELAXED));
    Precond__V1__ShmRef *ref = &r->refs[i];
    precond__v1__shm_ref__init(ref);
    ref->offset = (uint64_t)(m->data.data - c->win->map);
    ref->length = m->data.len;
    ref->unchecked = 1; /* the daemon's fold checks every value */
    ref->vouched = (atomic_load(&items[i / 2]->vouched) >> (i % 2)) & 1u; /* slot_vouch */
    moved += m->data.len;
    m->shm = ref;
    m->data.data = NULL;
    m->data.len = 0;
  }
  if (moved > 0) {
    rpc_shm_session(&c->shm, &r->sess);
    r->req.shm = &r->sess;
  }
  return moved;
}

static int send_batch_once(precond_client *c, const char *job, precond_mode mode,
                           precond__item **items, size_t n, int use_shm, uint64_t daemon[2],
                           uint64_t *shm_bytes);

/* Sends a push batch, through the region when there is one; a push the daemon refused for
 * the region's sake goes again as bytes at once. */
static int send_batch(precond_client *c, const char *job, precond_mode mode, precond__item **items,
                      size_t n, uint64_t daemon[2], uint64_t *shm_bytes) {
  *shm_bytes = 0;
  int st = shm_ensure(c);
  if (st != PRECOND_OK) return st;
  int use = c->shm.map != NULL;
  st = send_batch_once(c, job, mode, items, n, use, daemon, shm_bytes);
  if (use && st == PRECOND_ESTATE) {
    shm_lost(c);
    *shm_bytes = 0;
    if (c->opts.transport != PRECOND_TRANSPORT_SHM)
      st = send_batch_once(c, job, mode, items, n, 0, daemon, shm_bytes);
  }
  return st;
}

static int send_batch_once(precond_client *c, const char *job, precond_mode mode,
                           precond__item **items, size_t n, int use_shm, uint64_t daemon[2],
                           uint64_t *shm_bytes) {
  push_req r;
  int st = push_req_init(&r, job, mode, items, n, use_shm);
  if (st != PRECOND_OK) goto cleanup;
  if (use_shm) *shm_bytes = push_req_put(c, &r, items);
  ProtobufCMessage *resp = NULL;
  st = *shm_bytes > 0 ? call_push(c, &r.req.base, &resp)
                      : call(c, RPC_METHOD_PUSH_STATISTICS, &r.req.base,
                             &precond__v1__push_response__descriptor, 0, &resp);
  if (st == PRECOND_OK && *shm_bytes > 0) rpc_shm_rewind(&c->shm); /* slots read: reuse them */
  if (resp != NULL) {
    daemon[0] = ((Precond__V1__PushResponse *)resp)->daemon_epoch;
    daemon[1] = ((Precond__V1__PushResponse *)resp)->resumed_step;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
cleanup:
  push_req_free(&r);
  return st;
}

/* ---- the pipelined doorbell (session 14) ------------------------------------------------
 * Where the daemon offers the doorbell's queue (rpc.h, rpc_shm_post), a batch is written
 * into the region and rung without waiting for its answer (posted): the thread goes back
 * to its queue while the daemon folds it, and collects the answer when it next needs to,
 * with no sleep then if the answer is there: before posting a push that would find no room
 * (RPC_SHM_QUEUE posted, or the ring's room), before any gRPC push, ring call or fetch
 * poll (which see a posted push only once collected), when precond_flush waits and when
 * the client closes. A push answered one at a time took two cross-core hand-offs (the ring
 * wakes the daemon, the answer wakes the client, about 65 us of system time a side);
 * posted, the answer finds the client awake and wakes nobody (docs/precondd.md, "Session
 * 14"). Settling an answer is what push_some did at once before: an OK counts the batch
 * sent, a refusal for bad input counts it in push_errors with the daemon's message (so
 * such a refusal is seen one push later than before), and a transient one (the daemon away,
 * the job or the region lost) puts the batch back at the queue's head, oldest first, to be
 * sent again as bytes or through a new region as any failed send is. */

/* The ring bytes rpc_shm_begin must reserve for batch b: its parts' slots, its request
 * (every field at its widest: a block's two parts with their references take under 128
 * bytes, the request's own fields under 64 and the job's name) and the answer's room.
 * 1 when b can be posted (a region with the doorbell's queue whose ring holds it). */
static int batch_need(const precond_client *c, const push_batch *b, uint64_t *need) {
  uint64_t n = 0;
  for (size_t i = 0; i < b->n; i++)
    if (!item_in_region(c, b->items[i])) /* a worker slot's bytes are where they are */
      n += (b->items[i]->left_bytes + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN +
           (b->items[i]->right_bytes + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  n += 128 * (uint64_t)b->n + 64 + strlen(b->job) + 8 + RPC_SHM_BELL_REPLY;
  *need = n;
  return c->shm.map != NULL && c->shm.bell && c->shm.queue && !c->opts.push_answer_wait &&
         n <= (c->shm.lim ? c->shm.lim : c->shm.bytes / 2 - RPC_SHM_PUSH_RING);
}

/* What an answer means for batch b (status st, daemon: its epoch and resumed step, or
 * NULL): sent, rejected, or back into the queue (transient, same job, not stopping). Frees
 * what b owns except the items requeued. Caller holds mu. Returns st when transient. */
static int settle(precond_client *c, push_batch *b, int st, const uint64_t *daemon) {
  if (daemon != NULL) note_daemon(c, daemon[0], daemon[1]);
  c->inflight -= b->n;
  int transient = is_transient(st);
  /* A batch refused for bad input (the daemon refuses a push whole) goes again one block
   * a push, so that only the bad block is lost (worker slots are not scanned here). */
  int split = st == PRECOND_EREJECTED && b->n > 1;
  if ((transient || split) && c->job_gen == b->gen && !c->stop) {
    for (size_t i = 0; split && i < b->n; i++) b->items[i]->alone = 1;
    precond__queue_requeue(&c->queue, b->items, b->n, &c->counters.coalesced, &c->counters.dropped);
  } else {
    if (st == PRECOND_OK) {
      c->counters.sent += b->n;
      c->counters.bytes_sent += b->bytes;
      c->counters.shm_bytes += b->shm_bytes;
      for (size_t i = 0; i < b->n; i++) {
        c->counters.region_streamed +=
            __atomic_load_n(&b->items[i]->wrote[RPC_SHM_STREAMED], __ATOMIC_RELAXED) > 0;
        c->counters.region_plain +=
            __atomic_load_n(&b->items[i]->wrote[RPC_SHM_PLAIN], __ATOMIC_RELAXED) > 0;
      }
    } else if (c->job_gen == b->gen) {
      c->counters.push_errors += b->n;
    }
    for (size_t i = 0; i < b->n; i++) precond__item_free(b->items[i]);
  }
  b->n = 0;
  free(b->job);
  b->job = NULL;
  return transient ? st : PRECOND_OK;
}

/* Waits for the oldest posted push's answer: its PRECOND_* status; daemon gets the
 * answer's epoch and resumed step; *lost: no answer came (the daemon gone, or the
 * deadline), the region is spoilt. The busy holder, mu not held. */
static int collect_one(precond_client *c, uint64_t daemon[2], int *lost) {
  ProtobufCMessage *resp = NULL;
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  char *details = NULL;
  int rc = rpc_shm_collect(&c->shm, &precond__v1__push_response__descriptor,
                           c->opts.call_timeout_ms, &resp, &code, &details);
  *lost = rc == RPC_ECALL;
  if (rc == RPC_ECALL) rc = RPC_ESTATUS; /* UNAVAILABLE or DEADLINE_EXCEEDED, as a call's */
  if (resp != NULL) {
    daemon[0] = ((Precond__V1__PushResponse *)resp)->daemon_epoch;
    daemon[1] = ((Precond__V1__PushResponse *)resp)->resumed_step;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  return call_status(c, RPC_METHOD_PUSH_STATISTICS, rc, code, details);
}

/* Collects posted pushes' answers, oldest first, and settles them: the oldest (all = 0)
 * or every one (all = 1), and every one anyway once one comes back transient; gone (a
 * transient status, 0: none): the region is spoilt, nothing is collected, every posted push
 * settles with gone. A batch refused for the region's sake (FAILED_PRECONDITION) goes
 * again as bytes at once, as send_batch does. With next (the batch about to be sent, newer
 * than every posted one, or NULL) and a transient outcome, next is put back first, so that
 * the queue keeps their order (*next_done = 1). Returns the oldest transient status, else
 * PRECOND_OK. The busy holder, mu not held. */
static int collect_posted(precond_client *c, int all, int gone, push_batch *next, int *next_done) {
  int sts[RPC_SHM_QUEUE];
  uint64_t daemon[RPC_SHM_QUEUE][2];
  uint32_t k = 0;
  int transient = 0;
  for (; k < c->nposted; k++) {
    daemon[k][0] = daemon[k][1] = 0;
    int lost = 0;
    sts[k] = gone ? gone : collect_one(c, daemon[k], &lost);
    if (lost) gone = sts[k];
    transient |= is_transient(sts[k]);
    if (!all && !transient) {
      k++;
      break;
    }
  }
  int refused_region = 0;
  for (uint32_t i = 0; i < k; i++) refused_region |= !gone && sts[i] == PRECOND_ESTATE;
  if (gone || refused_region) shm_lost(c); /* every posted push is collected by now */
  for (uint32_t i = 0; refused_region && c->opts.transport != PRECOND_TRANSPORT_SHM && i < k; i++) {
    push_batch *b = &c->posted[i];
    if (sts[i] != PRECOND_ESTATE) continue;
    b->shm_bytes = 0;
    sts[i] = b->job
                 ? send_batch_once(c, b->job, b->mode, b->items, b->n, 0, daemon[i], &b->shm_bytes)
                 : PRECOND_ENOMEM;
  }
  pthread_mutex_lock(&c->mu);
  int first = PRECOND_OK;
  for (uint32_t i = 0; next != NULL && !*next_done && i < k; i++)
    if (is_transient(sts[i])) {
      settle(c, next, sts[i], NULL);
      *next_done = 1;
    }
  for (uint32_t i = k; i-- > 0;) { /* newest first: the requeued keep their order */
    int t = settle(c, &c->posted[i], sts[i], daemon[i]);
    if (t != PRECOND_OK) first = t;
  }
  c->nposted -= k;
  memmove(&c->posted[0], &c->posted[k], c->nposted * sizeof c->posted[0]);
  pthread_cond_broadcast(&c->progress);
  pthread_mutex_unlock(&c->mu);
  return first;
}

/* Writes batch b into the region's ring at the place rpc_shm_begin reserves (need bytes,
 * which rpc_shm_fits said are free) and rings it without waiting for its answer: PRECOND_OK
 * when posted. A daemon gone, or not taking the previous request in time, spoils the
 * region: *gone gets the status, and nothing was rung. The busy holder, mu not held. */
static int post_batch(precond_client *c, push_batch *b, uint64_t need, int *gone) {
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  char *details = NULL;
  *gone = 0;
  push_req r;
  int st = push_req_init(&r, b->job, b->mode, b->items, b->n, 1);
  if (st != PRECOND_OK) {
    push_req_free(&r);
    return st;
  }
  int rc = rpc_shm_begin(&c->shm, need, c->opts.call_timeout_ms, &code, &details);
  if (rc == RPC_OK) {
    b->shm_bytes = push_req_put(c, &r, b->items);
    rc = b->shm_bytes == b->bytes ? RPC_OK : RPC_ETOOBIG; /* need counted every part */
  }
  if (rc == RPC_OK)
    rc = rpc_shm_post(&c->shm, &r.req.base, c->opts.call_timeout_ms, &code, &details);
  push_req_free(&r);
  if (rc == RPC_OK) {
    free(details);
    return PRECOND_OK;
  }
  if (rc == RPC_ECALL) rc = RPC_ESTATUS;
  /* A request larger than batch_need's bound cannot happen; if it did, say so. */
  if (rc == RPC_ETOOBIG && details == NULL)
    details = strdup("a push outgrew its place in the ring");
  st = call_status(c, RPC_METHOD_PUSH_STATISTICS, rc, code, details);
  if (is_transient(st)) *gone = st;
  return st;
}

/* Registers again with the kept request after the daemon lost the job. */
static int reregister(precond_client *c, const uint8_t *msg, size_t len) {
  ProtobufCMessage *req =
      protobuf_c_message_unpack(&precond__v1__register_request__descriptor, NULL, len, msg);
  if (req == NULL) return PRECOND_ENOMEM;
  /* Never take over an ended job by ourselves: that is precond_register's call alone. */
  ((Precond__V1__RegisterRequest *)req)->reuse_ended_job = 0;
  ProtobufCMessage *resp = NULL;
  int st = call(c, RPC_METHOD_REGISTER, req, &precond__v1__register_response__descriptor, 0, &resp);
  if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
  protobuf_c_message_free_unpacked(req, NULL);
  return st;
}

/* Fetch step: asks for blocks newer than the held versions and publishes the answers.
 * Called with mu held; returns with mu held. */
static int poll_roots(precond_client *c) {
  uint64_t gen = c->job_gen;
  char *job = dup_str(c->job);
  int kfac = c->mode == PRECOND_MODE_KFAC;
  uint32_t nb = c->nblocks;
  Precond__V1__BlockVersion *bv = calloc(nb ? nb : 1, sizeof(*bv));
  Precond__V1__BlockVersion **bvp = calloc(nb ? nb : 1, sizeof(*bvp));
  /* The layout, copied: answers are decoded outside the lock, against the block shapes of
   * the job they were asked for. */
  uint32_t *shape = malloc(2 * (nb ? nb : 1) * sizeof(*shape));
  if (job == NULL || bv == NULL || bvp == NULL || shape == NULL) {
    free(job);
    free(bv);
    free(bvp);
    free(shape);
    return PRECOND_ENOMEM;
  }
  memcpy(shape, c->block_rows, nb * sizeof(*shape));
  memcpy(shape + nb, c->block_cols, nb * sizeof(*shape));
  Precond__V1__FetchRequest req = PRECOND__V1__FETCH_REQUEST__INIT;
  req.job = job;
  req.encoding = (Precond__V1__Encoding)c->opts.fetch_encoding;
  req.step = c->newest_step;
  for (uint32_t i = 0; i < nb; i++) {
    if (c->daemon_have[i] == 0) continue;
    precond__v1__block_version__init(&bv[req.n_have]);
    bv[req.n_have].block_id = i;
    bv[req.n_have].version = c->daemon_have[i];
    bvp[req.n_have] = &bv[req.n_have];
    req.n_have++;
  }
  req.have = bvp;
  pthread_mutex_unlock(&c->mu);

  ProtobufCMessage *msg = NULL;
  Precond__V1__ShmSession sess;
  int st = shm_ensure(c), use_shm = c->shm.map != NULL, rung = 0;
  if (use_shm) rpc_shm_fetch_request(&c->shm, &sess, &req);
  if (st == PRECOND_OK && use_shm)
    st = call_fetch(c, &req.base, nb, &rung, &msg);
  else if (st == PRECOND_OK)
    st = call(c, RPC_METHOD_FETCH_PRECONDITIONERS, &req.base,
              &precond__v1__fetch_response__descriptor, 0, &msg);
  if (use_shm && st == PRECOND_ESTATE) shm_lost(c); /* the next poll opens a new one */
  /* Roots in the region are checked first (and decoded from there below); a reference
   * out of place or a checksum that differs spoils the whole answer. */
  long long shm_in = 0;
  if (msg != NULL && use_shm) {
    char err[160];
    shm_in = rpc_shm_fetch_in(&c->shm, (Precond__V1__FetchResponse *)msg, err, sizeof err);
    if (shm_in < 0) {
      set_error(c, "FetchPreconditioners", err);
      rpc_shm_fetch_done((Precond__V1__FetchResponse *)msg);
      protobuf_c_message_free_unpacked(msg, NULL);
      msg = NULL;
      st = PRECOND_EPROTO;
      shm_in = 0;
    }
  }
  /* Decode outside the lock: the copies are the expensive part. */
  Precond__V1__FetchResponse *resp = (Precond__V1__FetchResponse *)msg;
  size_t nr = resp ? resp->n_preconditioners : 0;
  precond__roots_obj **got = calloc(nr ? nr : 1, sizeof(*got));
  size_t bad = 0;
  uint64_t bytes = 0;
  int torn = 0;
  for (size_t i = 0; got != NULL && i < nr; i++) {
    const Precond__V1__BlockRoots *b = resp->preconditioners[i];
    if (b->block_id >= nb)
      got[i] = NULL;
    else if (kfac)
      got[i] = precond__kfac_from_wire(b, shape[b->block_id], shape[nb + b->block_id],
                                       c->opts.kfac_dense);
    else {
      /* By reference into the roots area when asked and possible (no copy), else decoded. */
      uint32_t rows = shape[b->block_id], cols = shape[nb + b->block_id];
      got[i] = use_shm ? precond__roots_by_ref(b, rows, cols, c->area) : NULL;
      if (got[i] == NULL) got[i] = precond__roots_from_wire(b, rows, cols);
    }
    if (got[i] == NULL) bad++;
    const Precond__V1__PackedMatrix *sides[4] = {b->left, b->right, b->a_inv, b->g_inv};
    for (int k = 0; k < 4; k++) bytes += sides[k] ? sides[k]->data.len : 0;
  }
  /* Roots decoded from the daemon's roots area count only if it did not overwrite them
   * meanwhile (its ring wrapped): else they are dropped, and the next poll asks again. */
  if (got != NULL && use_shm && resp != NULL && !rpc_shm_fetch_intact(&c->shm, resp)) {
    for (size_t i = 0; i < nr; i++)
      if (got[i] != NULL) precond_roots_release(&got[i]->pub);
    memset(got, 0, nr * sizeof(*got));
    torn = 1;
  }

  pthread_mutex_lock(&c->mu);
  c->counters.retries += (uint64_t)torn;
  /* Counted as the call ends, beside fetch_rung: a snapshot (precond_get_counters) taken
   * while a poll is in flight used to see it among the calls but not yet among the rung
   * ones (test_shm_same_roots_as_bytes's flake under load). */
  c->counters.fetch_calls++;
  c->counters.fetch_rung += (uint64_t)rung;
  if (resp != NULL) note_daemon(c, resp->daemon_epoch, resp->resumed_step);
  size_t published = 0;
  for (size_t i = 0; got != NULL && i < nr; i++) {
    precond__roots_obj *o = got[i];
    if (o == NULL) continue;
    uint32_t id = o->pub.block_id;
    if (c->job_gen == gen && o->pub.daemon_version > c->daemon_have[id]) {
      precond__roots_obj *old = c->roots[id];
      o->pub.version = old != NULL ? old->pub.version + 1 : 1;
      c->daemon_have[id] = o->pub.daemon_version;
      c->roots[id] = o;
      published++;
      c->counters.roots_by_reference += o->area != NULL;
      if (old != NULL) precond_roots_release(&old->pub);
    } else {
      precond_roots_release(&o->pub);
    }
  }
  c->counters.roots_received += published;
  c->counters.bytes_received += bytes;
  c->counters.shm_bytes += (uint64_t)shm_in;
  if (bad > 0) {
    snprintf(c->error, sizeof c->error, "FetchPreconditioners: %zu malformed block answers", bad);
    if (st == PRECOND_OK) st = PRECOND_EPROTO;
  }
  if (published > 0) pthread_cond_broadcast(&c->progress);
  if (got == NULL && st == PRECOND_OK) st = PRECOND_ENOMEM;
  free(got);
  if (msg != NULL && use_shm) rpc_shm_fetch_done((Precond__V1__FetchResponse *)msg);
  if (msg != NULL) protobuf_c_message_free_unpacked(msg, NULL);
  free(job);
  free(bv);
  free(bvp);
  free(shape);
  return st;
}

/* Push step: one batch from the queue, posted at the region's doorbell where it can be
 * (its answer collected later: collect_posted), else sent and answered at once. Called with
 * mu held; returns with mu held. On a transient failure (daemon away, or lost the job) the
 * batch goes back into the queue and the status is returned so the caller can back off or
 * register again. */
static int push_some(precond_client *c) {
  push_batch b;
  b.n = precond__queue_take(&c->queue, b.items, PUSH_BATCH_ITEMS, c->opts.max_message_bytes / 2);
  if (b.n == 0) return PRECOND_OK;
  b.gen = c->job_gen;
  b.job = dup_str(c->job);
  b.mode = c->mode;
  b.bytes = b.shm_bytes = 0;
  for (size_t i = 0; i < b.n; i++) b.bytes += precond__item_bytes(b.items[i]);
  c->inflight += b.n;
  /* A take is news to precond_wait_queued's waiters only when posting: awaited, they wait
   * for the answer (the take moves blocks from the queue to the inflight count they add
   * up), and waking one here only put it back to sleep, a futex round trip across cores
   * per push. */
  if (c->queue_waiters > 0 && !c->opts.push_answer_wait) pthread_cond_broadcast(&c->progress);
  pthread_mutex_unlock(&c->mu);

  uint64_t daemon[2] = {0, 0}, need = 0;
  int st = PRECOND_ENOMEM, done = 0, posted = 0, gone = 0;
  if (b.job != NULL) {
    st = PRECOND_OK;
    int pipe = batch_need(c, &b, &need);
    /* Room first: the oldest posted answers while the ring has none clear of them, every
     * one before a push that is not posted (a ring call or a gRPC push sees only what was
     * collected). */
    while (st == PRECOND_OK && !done && c->nposted > 0 && (!pipe || !rpc_shm_fits(&c->shm, need))) {
      st = collect_posted(c, !pipe, 0, &b, &done);
      pipe = pipe && c->shm.map != NULL;
    }
    if (st == PRECOND_OK && !done && pipe) {
      st = post_batch(c, &b, need, &gone);
      posted = st == PRECOND_OK;
      if (gone) {
        /* No answer can come through the region now: what was posted goes back to the
         * queue, with b first. */
        collect_posted(c, 1, gone, &b, &done);
        if (!done) st = gone;
      }
    } else if (st == PRECOND_OK && !done) {
      st = send_batch(c, b.job, b.mode, b.items, b.n, daemon, &b.shm_bytes);
    }
  }

  pthread_mutex_lock(&c->mu);
  if (posted) {
    c->posted[c->nposted++] = b;
    c->counters.pushes_posted++;
    return PRECOND_OK;
  }
  if (!done) st = settle(c, &b, st, daemon);
  pthread_cond_broadcast(&c->progress);
  return is_transient(st) ? st : PRECOND_OK;
}

/* The daemon lost the job (restart without its state): register again with the kept
 * request, and forget the daemon versions held so its new roots are accepted whatever
 * their numbers. Called with mu held; returns with mu held. */
static int recover_job(precond_client *c) {
  if (c->job == NULL)
    return PRECOND_OK; /* ended meanwhile (precond_end_job): nothing to bring back */
  uint64_t gen = c->job_gen;
  size_t len = c->register_len;
  uint8_t *reg = malloc(len ? len : 1);
  if (reg == NULL) return PRECOND_ENOMEM;
  memcpy(reg, c->register_msg, len);
  pthread_mutex_unlock(&c->mu);
  int st = reregister(c, reg, len);
  free(reg);
  pthread_mutex_lock(&c->mu);
  if (st == PRECOND_OK && c->job_gen == gen) {
    memset(c->daemon_have, 0, c->nblocks * sizeof(*c->daemon_have));
    c->counters.reregistered++;
  }
  if (st == PRECOND_ESTATE && c->job_gen == gen) {
    /* Refused for good (the job was ended under us): trying again would only loop. The
     * queued blocks can never be sent; the caller hears PRECOND_EENDED. */
    c->refused = 1;
    precond__item *items[256];
    size_t n;
    while ((n = precond__queue_take(&c->queue, items, 256, SIZE_MAX)) > 0) {
      c->counters.push_errors += n;
      for (size_t i = 0; i < n; i++) precond__item_free(items[i]);
    }
    fprintf(stderr, "libprecond: precondd at %s refuses job %s; stopped sending it (%s)\n", c->addr,
            c->job, c->error);
  }
  return st;
}

static int channel_wait_ready(grpc_channel *ch, int timeout_ms);

/* The backoff after an unreachable daemon, spent polling the channel until it is READY
 * (returns 1) or until passes (0), in slices so that a stop is seen. With no call in flight
 * nothing else polls the channel's connection attempts: gRPC's backup poller looks every 5 s
 * (GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS), so a connect to a restarted daemon was seen
 * 2.5-5 s late (traced: "connection refused" after 2.5 s, a connect of 5 s) and new roots
 * came 5-10 s after a restart. Called with mu held; returns with mu held. */
static int wait_reconnect(precond_client *c, const struct timespec *until) {
  for (;;) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long ms = (until->tv_sec - now.tv_sec) * 1000L + (until->tv_nsec - now.tv_nsec) / 1000000L;
    if (c->stop || ms <= 0) return 0;
    pthread_mutex_unlock(&c->mu);
    int ready = channel_wait_ready(c->channel, ms < 100 ? (int)ms : 100);
    pthread_mutex_lock(&c->mu);
    if (ready) return 1;
  }
}

/* collect_posted of every posted push, called with mu held; returns with mu held. */
static int collect_locked(precond_client *c) {
  pthread_mutex_unlock(&c->mu);
  int st = collect_posted(c, 1, 0, NULL, NULL);
  pthread_mutex_lock(&c->mu);
  return st;
}

static void *thread_main(void *arg) {
  precond_client *c = arg;
  long backoff = 0;
  struct timespec next_poll = deadline_in(0);
  pthread_mutex_lock(&c->mu);
  while (!c->stop) {
    if (c->job == NULL || c->refused) {
      pthread_cond_wait(&c->wake, &c->mu);
      continue;
    }
    if (c->busy) { /* a committing thread rings its own push (push_direct) */
      c->bell_waits = 1;
      pthread_cond_wait(&c->wake, &c->mu);
      c->bell_waits = 0;
      continue;
    }
    int st = PRECOND_OK, worked = 0;
    c->busy = 1;
    if (c->poll_reset) {
      c->poll_reset = 0;
      next_poll = deadline_in(0);
    }
    if (passed(&next_poll)) {
      /* A poll sees the posted pushes only once collected (the fetch's own doorbell call
       * needs none pending). */
      if (c->nposted > 0) st = collect_locked(c);
      if (st == PRECOND_OK) st = poll_roots(c);
      next_poll = deadline_in(c->opts.poll_interval_ms);
      worked = 1;
    } else if (c->queue.length > 0) {
      st = push_some(c);
      worked = 1;
    } else if (c->nposted > 0 && c->flushing > 0) {
      st = collect_locked(c);
      worked = 1;
    }
    int retry = st == PRECOND_EUNAVAILABLE || st == PRECOND_ETIMEDOUT || st == PRECOND_ENOMEM;
    if (st == PRECOND_ENOTFOUND || st == PRECOND_ESTATE) {
      /* The daemon lost the job: register again, then retry after the backoff below (also
       * when registering worked, so a daemon that keeps refusing is not hammered); a
       * refusal of the Register itself stops the job (recover_job). */
      recover_job(c);
      retry = !c->refused;
    }
    c->busy = 0;
    pthread_cond_broadcast(&c->progress);
    if (retry) {
      /* The daemon is away (or has not got the job yet): back off before trying again,
       * doubling up to the cap; a successful call resets it. */
      c->counters.retries++;
      backoff = backoff == 0 ? c->opts.backoff_initial_ms : 2 * backoff;
      if (backoff > c->opts.backoff_max_ms) backoff = c->opts.backoff_max_ms;
      struct timespec until = deadline_in(backoff);
      if (st == PRECOND_EUNAVAILABLE && wait_reconnect(c, &until)) until = deadline_in(0);
      while (!c->stop && pthread_cond_timedwait(&c->wake, &c->mu, &until) != ETIMEDOUT) {
      }
      next_poll = deadline_in(0);
      continue;
    }
    if (st == PRECOND_OK) backoff = 0;
    if (!worked && !c->stop && c->queue.length == 0)
      pthread_cond_timedwait(&c->wake, &c->mu, &next_poll);
  }
  if (c->nposted > 0) collect_locked(c); /* closing: their answers, counted, not resent */
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

/* ------------------------------------------------------------------------------------ */
/* Connection                                                                             */

int precond_set_poll_interval(precond_client *c, int ms) {
  if (c == NULL || ms <= 0) return PRECOND_EINVAL;
  pthread_mutex_lock(&c->mu);
  if (c->opts.poll_interval_ms != ms) {
    c->opts.poll_interval_ms = ms;
    c->poll_reset = 1; /* a wait for the old period's next poll ends now */
    pthread_cond_broadcast(&c->wake);
  }
  pthread_mutex_unlock(&c->mu);
  return PRECOND_OK;
}

void precond_options_default(precond_options *o) {
  memset(o, 0, sizeof(*o));
  o->addr = "127.0.0.1:50551";
  o->token = NULL;
  o->wait_for_ready = 1;
  o->connect_timeout_ms = 5000;
  o->call_timeout_ms = 10000;
  o->queue_blocks = 1024;
  o->max_message_bytes = RPC_DEFAULT_MAX_MESSAGE_BYTES;
  o->poll_interval_ms = 20;
  o->backoff_initial_ms = 50;
  o->backoff_max_ms = 2000;
  o->fetch_encoding = PRECOND_FP32;
  o->background = 1;
}

static int options_check(const precond_options *o) {
  if (o->addr == NULL || o->addr[0] == '\0' || o->call_timeout_ms <= 0 || o->queue_blocks == 0 ||
      o->poll_interval_ms <= 0 || o->backoff_initial_ms <= 0 ||
      o->backoff_max_ms < o->backoff_initial_ms || o->max_message_bytes < 1024 ||
      o->max_message_bytes > RPC_MAX_MESSAGE_BYTES_CAP ||
      (o->fetch_encoding != PRECOND_FP32 && o->fetch_encoding != PRECOND_BF16) ||
      (o->transport != PRECOND_TRANSPORT_AUTO && o->transport != PRECOND_TRANSPORT_GRPC &&
       o->transport != PRECOND_TRANSPORT_SHM))
    return PRECOND_EINVAL;
  return PRECOND_OK;
}

static grpc_channel *channel_create(const precond_options *o) {
  rpc_args ca; /* size limits and the transport defaults (proto/rpc.c) */
  rpc_args_init(&ca, o->max_message_bytes);
  /* Reconnect quickly after a daemon restart; the thread's own backoff paces the calls.
   * GRPC_ARG_MIN_RECONNECT_BACKOFF_MS stays at its default: it is also the time a
   * connection attempt gets to finish its handshake, and at 50 ms a loaded machine never
   * connects (seen under ThreadSanitizer: "tcp handshaker shutdown" forever). */
  rpc_args_set_int(&ca, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, o->backoff_initial_ms);
  rpc_args_set_int(&ca, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, o->backoff_max_ms);
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(o->addr, creds, rpc_args_get(&ca));
  grpc_channel_credentials_release(creds);
  return ch;
}

/* Waits until the channel is READY or timeout_ms passes. */
static int channel_wait_ready(grpc_channel *ch, int timeout_ms) {
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  gpr_timespec until =
      gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
  int ready = 0;
  for (;;) {
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(ch, 1);
    if (s == GRPC_CHANNEL_READY) {
      ready = 1;
      break;
    }
    if (gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), until) >= 0 || s == GRPC_CHANNEL_SHUTDOWN) break;
    grpc_channel_watch_connectivity_state(ch, s, until, cq, NULL);
    grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
  }
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return ready;
}

int precond_connect(const precond_options *opts, precond_client **out) {
  precond_options defaults;
  if (opts == NULL) {
    precond_options_default(&defaults);
    opts = &defaults;
  }
  if (out == NULL || options_check(opts) != PRECOND_OK) return PRECOND_EINVAL;
  *out = NULL;
  precond_client *c = calloc(1, sizeof(*c));
  if (c == NULL) return PRECOND_ENOMEM;
  int st = PRECOND_ENOMEM;
  int mu_ok = 0, wake_ok = 0, progress_ok = 0, grpc_ok = 0;
  c->opts = *opts;
  c->shm.fd = -1;
  c->addr = dup_str(opts->addr);
  c->token = opts->token && opts->token[0] ? dup_str(opts->token) : NULL;
  c->opts.addr = c->addr;
  c->opts.token = c->token;
  if (c->addr == NULL || (opts->token && opts->token[0] && c->token == NULL)) goto fail;
  mu_ok = pthread_mutex_init(&c->mu, NULL) == 0;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  wake_ok = pthread_cond_init(&c->wake, &ca) == 0;
  progress_ok = pthread_cond_init(&c->progress, &ca) == 0;
  pthread_condattr_destroy(&ca);
  if (!mu_ok || !wake_ok || !progress_ok) goto fail;
  if (opts->keep_freed_memory) rpc_keep_freed_memory(); /* glibc's refusal: its defaults */
  grpc_init();
  grpc_ok = 1;
  c->channel = channel_create(&c->opts);
  if (c->channel == NULL) goto fail;
  if (opts->connect_timeout_ms > 0 && !channel_wait_ready(c->channel, opts->connect_timeout_ms)) {
    st = PRECOND_EUNAVAILABLE;
    goto fail;
  }
  if (opts->background) {
    if (pthread_create(&c->thread, NULL, thread_main, c) != 0) {
      st = PRECOND_ETHREAD;
      goto fail;
    }
    c->thread_started = 1;
  }
  *out = c;
  return PRECOND_OK;

fail:
  if (c->channel != NULL) grpc_channel_destroy(c->channel);
  if (grpc_ok) grpc_shutdown();
  if (progress_ok) pthread_cond_destroy(&c->progress);
  if (wake_ok) pthread_cond_destroy(&c->wake);
  if (mu_ok) pthread_mutex_destroy(&c->mu);
  free(c->addr);
  free(c->token);
  free(c);
  return st;
}

void precond_close(precond_client *c) {
  if (c == NULL) return;
  if (c->thread_started) {
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_broadcast(&c->wake);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
  }
  job_clear(c);
  shm_close(c); /* the thread, its only user, is gone */
  grpc_channel_destroy(c->channel);
  grpc_shutdown();
  pthread_cond_destroy(&c->progress);
  pthread_cond_destroy(&c->wake);
  pthread_mutex_destroy(&c->mu);
  free(c->addr);
  free(c->token);
  free(c);
}

void precond_last_error(precond_client *c, char *buf, size_t len) {
  if (buf == NULL || len == 0) return;
  buf[0] = '\0';
  if (c == NULL) return;
  pthread_mutex_lock(&c->mu);
  snprintf(buf, len, "%s", c->error);
  pthread_mutex_unlock(&c->mu);
}

void precond_get_counters(precond_client *c, precond_counters *out) {
  if (c == NULL || out == NULL) return;
  pthread_mutex_lock(&c->mu);
  *out = c->counters;
  out->queued = c->queue.length;
  pthread_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------------------------------ */
/* Register                                                                               */

static int register_check(const char *job, size_t ntensors, const precond_tensor *tensors,
                          const precond_layout *layout) {
  if (job == NULL || job[0] == '\0' || layout == NULL || ntensors == 0 || tensors == NULL)
    return PRECOND_EINVAL;
  for (size_t i = 0; i < ntensors; i++) {
    if (tensors[i].name == NULL || tensors[i].rank < 1 || tensors[i].shape == NULL)
      return PRECOND_EINVAL;
    for (int d = 0; d < tensors[i].rank; d++)
      if (tensors[i].shape[d] == 0) return PRECOND_EINVAL;
  }
  return PRECOND_OK;
}

void precond_layout_destroy(precond_layout *layout) {
  if (layout == NULL) return;
  free(layout->blocks);
  free(layout->diagonal_tensors);
  memset(layout, 0, sizeof(*layout));
}

/* Register of either mode: a Shampoo job always carries Shampoo options (opts NULL: all
 * zero, the daemon's defaults), a K-FAC job its options when kopts is not NULL. */
static int register_job(precond_client *c, const char *job, precond_mode mode, const char *worker,
                        size_t ntensors, const precond_tensor *tensors,
                        const precond_shampoo_opts *opts, const precond_kfac_opts *kopts,
                        precond_layout *layout) {
  if (c == NULL || register_check(job, ntensors, tensors, layout) != PRECOND_OK ||
      (mode == PRECOND_MODE_KFAC && opts != NULL) || (mode != PRECOND_MODE_KFAC && kopts != NULL))
    return PRECOND_EINVAL;
  memset(layout, 0, sizeof(*layout));
  Precond__V1__RegisterRequest req = PRECOND__V1__REGISTER_REQUEST__INIT;
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  Precond__V1__KfacOptions ko = PRECOND__V1__KFAC_OPTIONS__INIT;
  Precond__V1__TensorSpec *ts = calloc(ntensors, sizeof(*ts));
  Precond__V1__TensorSpec **tp = calloc(ntensors, sizeof(*tp));
  ProtobufCMessage *msg = NULL;
  uint8_t *packed = NULL;
  precond__queue q = {0};
  precond__roots_obj **roots = NULL;
  uint64_t *have = NULL;
  uint32_t *rows = NULL, *cols = NULL;
  char *job_copy = dup_str(job);
  int st = PRECOND_ENOMEM;
  if (ts == NULL || tp == NULL || job_copy == NULL) goto cleanup;
  for (size_t i = 0; i < ntensors; i++) {
    precond__v1__tensor_spec__init(&ts[i]);
    ts[i].name = (char *)tensors[i].name;
    ts[i].n_shape = (size_t)tensors[i].rank;
    ts[i].shape = (uint64_t *)tensors[i].shape;
    tp[i] = &ts[i];
  }
  if (opts != NULL) {
    so.block_size = opts->block_size;
    so.skip_limit = opts->skip_limit;
    so.beta2 = opts->beta2;
    so.root_exponent = opts->root_exponent;
    so.epsilon = opts->epsilon;
    so.method = (Precond__V1__Method)opts->method;
    so.root_every = opts->root_every;
  }
  req.job = (char *)job;
  req.mode = (Precond__V1__Mode)mode;
  req.n_tensors = ntensors;
  req.tensors = tp;
  if (kopts != NULL) {
    ko.factor_decay = kopts->factor_decay;
    ko.damping = kopts->damping;
    ko.inv_every = kopts->inv_every;
    ko.no_pi_damping = kopts->no_pi_damping != 0;
    ko.inverse = (Precond__V1__KfacInverse)kopts->inverse;
    ko.max_order = kopts->max_order;
    req.kfac = &ko;
  }
  if (mode != PRECOND_MODE_KFAC) req.shampoo = &so;
  req.worker = (char *)(worker ? worker : "");
  req.reuse_ended_job = c->opts.reuse_ended_job != 0;
  size_t plen = protobuf_c_message_get_packed_size(&req.base);
  packed = malloc(plen ? plen : 1);
  if (packed == NULL) goto cleanup;
  protobuf_c_message_pack(&req.base, packed);

  st = call(c, RPC_METHOD_REGISTER, &req.base, &precond__v1__register_response__descriptor,
            c->opts.wait_for_ready, &msg);
  if (st != PRECOND_OK) goto cleanup;
  const Precond__V1__RegisterResponse *resp = (const Precond__V1__RegisterResponse *)msg;
  size_t nb = resp->n_blocks;
  st = PRECOND_EPROTO;
  /* Block ids index the job's block list: the daemon must number them 0..n-1 in order, and
   * their shape must fit in a PackedMatrix's uint32 n. */
  for (size_t i = 0; i < nb; i++) {
    const Precond__V1__BlockInfo *b = resp->blocks[i];
    if (b->block_id != i || b->tensor >= ntensors || b->rows > UINT32_MAX || b->cols > UINT32_MAX) {
      set_error(c, "Register", "daemon answered a block layout that is not 0..n-1");
      goto cleanup;
    }
  }
  st = PRECOND_ENOMEM;
  layout->blocks = calloc(nb ? nb : 1, sizeof(*layout->blocks));
  layout->diagonal_tensors =
      calloc(resp->n_diagonal_tensors ? resp->n_diagonal_tensors : 1, sizeof(uint32_t));
  roots = calloc(nb ? nb : 1, sizeof(*roots));
  have = calloc(nb ? nb : 1, sizeof(*have));
  rows = calloc(nb ? nb : 1, sizeof(*rows));
  cols = calloc(nb ? nb : 1, sizeof(*cols));
  if (layout->blocks == NULL || layout->diagonal_tensors == NULL || roots == NULL || have == NULL ||
      rows == NULL || cols == NULL ||
      precond__queue_init(&q, c->opts.queue_blocks, (uint32_t)nb) != 0) {
    precond_layout_destroy(layout);
    goto cleanup;
  }
  for (size_t i = 0; i < nb; i++) {
    const Precond__V1__BlockInfo *b = resp->blocks[i];
    layout->blocks[i] = (precond_block){.block_id = b->block_id,
                                        .tensor = b->tensor,
                                        .row0 = b->row0,
                                        .rows = b->rows,
                                        .col0 = b->col0,
                                        .cols = b->cols,
                                        .owner = b->owner};
    rows[i] = (uint32_t)b->rows;
    cols[i] = (uint32_t)b->cols;
  }
  layout->nblocks = nb;
  layout->ndiagonal = resp->n_diagonal_tensors;
  if (resp->n_diagonal_tensors > 0) /* none: the field is NULL, which memcpy may not take */
    memcpy(layout->diagonal_tensors, resp->diagonal_tensors,
           resp->n_diagonal_tensors * sizeof(uint32_t));
  layout->resumed_step = resp->resumed_step;

  /* Swap the new job in; the old one's queue and roots are freed with it. */
  pthread_mutex_lock(&c->mu);
  job_clear(c);
  c->refused = 0;
  c->job = job_copy;
  c->mode = mode;
  c->register_msg = packed;
  c->register_len = plen;
  c->nblocks = (uint32_t)nb;
  c->block_rows = rows;
  c->block_cols = cols;
  c->roots = roots;
  c->daemon_have = have;
  c->queue = q;
  c->job_gen++;
  pthread_cond_broadcast(&c->wake);
  pthread_mutex_unlock(&c->mu);
  job_copy = NULL;
  packed = NULL;
  rows = cols = NULL;
  roots = NULL;
  have = NULL;
  q = (precond__queue){0};
  st = PRECOND_OK;

cleanup:
  precond__queue_destroy(&q);
  free(roots);
  free(have);
  free(rows);
  free(cols);
  free(packed);
  free(job_copy);
  free(ts);
  free(tp);
  if (msg != NULL) protobuf_c_message_free_unpacked(msg, NULL);
  return st;
}

int precond_register(precond_client *c, const char *job, precond_mode mode, const char *worker,
                     size_t ntensors, const precond_tensor *tensors,
                     const precond_shampoo_opts *opts, precond_layout *layout) {
  return register_job(c, job, mode, worker, ntensors, tensors, opts, NULL, layout);
}

int precond_register_kfac(precond_client *c, const char *job, const char *worker, size_t ntensors,
                          const precond_tensor *tensors, const precond_kfac_opts *opts,
                          precond_layout *layout) {
  return register_job(c, job, PRECOND_MODE_KFAC, worker, ntensors, tensors, NULL, opts, layout);
}

/* ------------------------------------------------------------------------------------ */
/* Push and flush                                                                         */

/* 1 if the current job is of a mode whose push parts are kfac's (kfac = 1: A of order cols,
 * then G of order rows) or Shampoo's (left of order rows, then right of order cols), and the
 * block exists with parts of orders n0 and n1. Caller holds mu. */
static int push_fits(const precond_client *c, int kfac, uint32_t block_id, uint32_t n0,
                     uint32_t n1) {
  if (c->job == NULL || block_id >= c->nblocks || (c->mode == PRECOND_MODE_KFAC) != kfac) return 0;
  uint32_t rows = c->block_rows[block_id], cols = c->block_cols[block_id];
  return kfac ? n0 == cols && n1 == rows : n0 == rows && n1 == cols;
}

static int push_queue(precond_client *c, int kfac, precond__item *it);

/* Whether the client's job is a K-FAC job (its parts' order follows; see push_fits). */
static int client_is_kfac(precond_client *c) {
  pthread_mutex_lock(&c->mu);
  int kfac = c->mode == PRECOND_MODE_KFAC;
  pthread_mutex_unlock(&c->mu);
  return kfac;
}

/* Whether a push of these part orders may be queued now: PRECOND_OK, PRECOND_EENDED (the
 * job was ended) or PRECOND_EINVAL (no thread, no job of that mode, sizes off the layout). */
static int push_admits(precond_client *c, int kfac, uint32_t block_id, uint32_t n0, uint32_t n1) {
  pthread_mutex_lock(&c->mu);
  int ok = c->thread_started && push_fits(c, kfac, block_id, n0, n1);
  int refused = c->refused;
  pthread_mutex_unlock(&c->mu);
  if (ok && refused) return PRECOND_EENDED;
  return ok ? PRECOND_OK : PRECOND_EINVAL;
}

/* Queues one block's two packed parts (see push_fits for their order): the body of
 * precond_push and precond_push_kfac. */
static int push_parts(precond_client *c, int kfac, uint64_t step, uint32_t block_id,
                      uint32_t n_left, const float *left, uint32_t n_right, const float *right,
                      precond_encoding enc) {
  if (c == NULL || left == NULL || right == NULL || n_left == 0 || n_right == 0 ||
      (enc != PRECOND_FP32 && enc != PRECOND_BF16))
    return PRECOND_EINVAL;
  int st = push_admits(c, kfac, block_id, n_left, n_right);
  if (st != PRECOND_OK) return st;
  size_t cl = pc_packed_len(n_left), cr = pc_packed_len(n_right);
  /* A NaN or Inf would make the daemon refuse the whole batch it travels in. */
  if (!pc_all_finite_f32(cl, left) || !pc_all_finite_f32(cr, right)) return PRECOND_EINVAL;
  size_t es = rpc_packed_width((int)enc);
  precond__item *it =
      precond__item_new(block_id, step, (int)enc, n_left, cl * es, n_right, cr * es);
  if (it == NULL) return PRECOND_ENOMEM;
  rpc_packed_encode((int)enc, left, cl, it->data); /* enc checked above */
  rpc_packed_encode((int)enc, right, cr, it->data + cl * es);
  return push_queue(c, kfac, it);
}

/* push_queue's body with mu held, without the wake: frees it when the job no longer fits. */
static int push_queue_locked(precond_client *c, int kfac, precond__item *it) {
  uint64_t step = it->step;
  /* The job may have been replaced while copying: check again. */
  if (!push_fits(c, kfac, it->block_id, it->n_left, it->n_right)) {
    precond__item_free(it);
    return PRECOND_EINVAL;
  }
  int r = precond__queue_put(&c->queue, it);
  c->counters.pushed++;
  c->counters.region_slots += it->owner != NULL;
  if (r == PRECOND__COALESCED)
    c->counters.coalesced++;
  else if (r == PRECOND__DROPPED_OLDEST)
    c->counters.dropped++;
  if (step > c->newest_step) c->newest_step = step;
  return PRECOND_OK;
}

/* Queues a filled item (owned from here) of a push: the tail of push_parts and
 * precond_push_commit. */
static int push_queue(precond_client *c, int kfac, precond__item *it) {
  pthread_mutex_lock(&c->mu);
  int st = push_queue_locked(c, kfac, it);
  if (st == PRECOND_OK) pthread_cond_signal(&c->wake);
  pthread_mutex_unlock(&c->mu);
  return st;
}

int precond_push(precond_client *c, uint64_t step, uint32_t block_id, uint32_t n_left,
                 const float *left, uint32_t n_right, const float *right, precond_encoding enc) {
  return push_parts(c, 0, step, block_id, n_left, left, n_right, right, enc);
}

int precond_push_kfac(precond_client *c, uint64_t step, uint32_t block_id, uint32_t n_a,
                      const float *a, uint32_t n_g, const float *g, precond_encoding enc) {
  return push_parts(c, 1, step, block_id, n_a, a, n_g, g, enc);
}

/* A precond_push_slot is the queue item itself (the type is never defined: a pointer to it is
 * the item's), fp32, filled by the caller: the values are written once, where the background
 * thread sends them from: a worker slot in the region (shm_window) where one can be had, else
 * the item's own payload. */
_Static_assert(offsetof(precond__item, payload) % _Alignof(float) == 0,
               "an item's payload holds floats");
_Static_assert(RPC_SHM_ALIGN % _Alignof(float) == 0, "a worker slot holds floats");

/* An item whose bytes are a worker slot of the open region (shm_window), or NULL where none
 * can be had: no region with the doorbell's queue (yet), the block queued already (its push
 * would coalesce into the queued entry's place), no room left. bytes: both parts'. */
static precond__item *region_item(precond_client *c, uint64_t step, uint32_t block_id, uint32_t n0,
                                  size_t b0, uint32_t n1, size_t b1) {
  uint64_t off = 0, slot = 0;
  pthread_mutex_lock(&c->mu);
  shm_window *w = c->win;
  int ok = w != NULL && block_id < c->queue.nblocks && c->queue.by_block[block_id] == NULL &&
           window_take(w, b0 + b1, &off, &slot);
  pthread_mutex_unlock(&c->mu);
  if (!ok) return NULL;
  precond__item *it =
      precond__item_wrap(block_id, step, (int)PRECOND_FP32, n0, b0, n1, b1, w->map + off);
  if (it == NULL) {
    window_give(w, slot);
    return NULL;
  }
  it->owner = w;
  it->slot = slot;
  it->release = window_item_release;
  /* One mode for the push's large parts (precond_push_copy): its daemon's figure then
   * tells that mode's cost (rpc.h, rpc_shm_mode). */
  it->wmode = rpc_shm_mode_pick(&w->mode, w->map, b0 > b1 ? b0 : b1);
  return it;
}

int precond_push_begin(precond_client *c, uint64_t step, uint32_t block_id, uint32_t n0,
                       uint32_t n1, float **part0, float **part1, precond_push_slot **slot) {
  if (slot) *slot = NULL;
  if (c == NULL || part0 == NULL || part1 == NULL || slot == NULL || n0 == 0 || n1 == 0)
    return PRECOND_EINVAL;
  int kfac = client_is_kfac(c);
  int st = push_admits(c, kfac, block_id, n0, n1);
  if (st != PRECOND_OK) return st;
  size_t c0 = pc_packed_len(n0), c1 = pc_packed_len(n1);
  precond__item *it =
      region_item(c, step, block_id, n0, c0 * sizeof(float), n1, c1 * sizeof(float));
  if (it == NULL)
    it = precond__item_new(block_id, step, (int)PRECOND_FP32, n0, c0 * sizeof(float), n1,
                           c1 * sizeof(float));
  if (it == NULL) return PRECOND_ENOMEM;
  /* Floats: the payload follows the header at a float's alignment, a slot at 64 bytes. */
  *part0 = (float *)(void *)it->data;
  *part1 = *part0 + c0;
  *slot = (precond_push_slot *)(void *)it;
  return PRECOND_OK;
}

/* A slot's values are finite: else it is freed (the caller's commit fails). A worker slot
 * in the region is not looked at: the daemon's fold checks every value and refuses the push
 * whole (its own post), counted in push_errors one push later, as an overflow is. */
static int slot_finite(precond__item *it) {
  if (it->owner != NULL) return 1;
  const float *p0 = (const float *)(const void *)it->data;
  size_t c0 = pc_packed_len(it->n_left), c1 = pc_packed_len(it->n_right);
  if (pc_all_finite_f32(c0, p0) && pc_all_finite_f32(c1, p0 + c0)) return 1;
  precond__item_free(it);
  return 0;
}

/* How long a posted push rung by the committing thread waits for the daemon to take its
 * oldest pending request's head (push_direct), and its naps meanwhile. Waiting in the commit
 * measured better than leaving a push without room to the background thread at once:
 * handed off, the thread then held busy while it waited for the room itself, so the commits
 * after it were handed off too (6-52% rung directly against 97-99%; docs/precondd.md,
 * "Session 17: the posted push without the hand-off"). A wait for a request the daemon took
 * is a wait for its fold (rpc_shm_collect's own, bounded by the fold unless the daemon stops
 * in it); one the daemon has not taken may never end (a stopped daemon), so it is bounded
 * here: past it, the push is the background thread's as before. Its naps (about 20 us of
 * CPU each on this VM) start at DIRECT_NAP_US and double. */
#define DIRECT_WAIT_US 5000L
#define DIRECT_NAP_US  50L

/* Microseconds since t0 (CLOCK_MONOTONIC). */
static long elapsed_us(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (t.tv_sec - t0->tv_sec) * 1000000L + (t.tv_nsec - t0->tv_nsec) / 1000L;
}

/* A push rung by the committing thread (session 16: awaited; session 17: posted): item
 * it, just queued and the only thing queued for the job, in the open region's worker
 * slots, while no thread is busy (the background thread idle), is sent by the caller as
 * the background thread would (push_some: the same request, the same ring rules, the same
 * settling, posted[] and pushes_posted alike; a transient failure puts it back at the
 * queue's head for the background thread, woken here). The hand-off to the background
 * thread cost a futex wake and a sleep on each side a push (docs/precondd.md, "Session 16:
 * the awaited push without the hand-off" and "Session 17: the posted push without the
 * hand-off").
 * Awaited (push_answer_wait): only with nothing in flight or posted; its answer is awaited
 * here. Posted: pushes posted before it may be pending (older, already rung: the daemon
 * serves a region's requests in the order rung, so each block's order holds); first every
 * posted answer already there is collected without waiting (rpc_shm_answered), so their
 * slots come back at once, then it is posted. With no room left (RPC_SHM_QUEUE pending,
 * the ring's, or the daemon not yet at the last request's head) it waits here: for the
 * oldest answer where the daemon took that request (collect_posted, as the background
 * thread waits: the region's pace), else in naps up to DIRECT_WAIT_US (above), after which
 * the push is left to the background thread.
 * Pushes committed meanwhile queue behind it (busy holds the background thread back): taken
 * with it when queued before its take, else sent by the background thread, woken here.
 * 1 when sent here (it may be freed by now), 0: the background thread's to
 * send (not woken yet). Caller holds mu; returns with mu held. */
static int push_direct(precond_client *c, const precond__item *it) {
  int wait = c->opts.push_answer_wait;
  if (!c->thread_started || c->busy || c->stop || c->refused || c->job == NULL || c->win == NULL ||
      it->owner != c->win || c->queue.length != 1 || it->block_id >= c->queue.nblocks ||
      c->queue.by_block[it->block_id] != it || (wait && (c->inflight != 0 || c->nposted != 0)))
    return 0;
  uint64_t need = 0;
  if (!wait) {
    /* posted only where the background thread would post it (batch_need's "pipe") */
    push_batch one = {.n = 1, .job = c->job};
    one.items[0] = (precond__item *)(uintptr_t)it;
    if (!batch_need(c, &one, &need)) return 0;
  }
  c->busy = 1;
  int mine = 1;
  if (!wait && c->nposted > 0) {
    pthread_mutex_unlock(&c->mu); /* posted[] and the region are this thread's while busy */
    int st = PRECOND_OK, room = 0;
    long nap_us = DIRECT_NAP_US;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (st == PRECOND_OK) {
      if (rpc_shm_answered(&c->shm)) {
        st = collect_posted(c, 0, 0, NULL, NULL); /* there: no wait */
        continue;
      }
      /* rpc_shm_fits counts the RPC_SHM_QUEUE pending too */
      room = rpc_shm_fits(&c->shm, need) && rpc_shm_taken(&c->shm, c->shm.npend - 1);
      if (room) break;
      if (rpc_shm_taken(&c->shm, 0)) {
        /* the daemon is at the oldest: its answer follows the fold; waited for as the
         * background thread waits (the region's pace: futex or naps, PRECOND_SHM_NAP_US) */
        st = collect_posted(c, 0, 0, NULL, NULL);
        continue;
      }
      long left = DIRECT_WAIT_US - elapsed_us(&t0);
      if (left <= 0) break;
      /* doubling: a daemon waking from its sleep takes a few hundred us to get there */
      struct timespec nap = {0, 1000L * (nap_us < left ? nap_us : left)};
      nanosleep(&nap, NULL);
      nap_us *= 2;
    }
    pthread_mutex_lock(&c->mu);
    /* A transient answer (the region or the job lost) is the background thread's to act on
     * (backoff, a new region, registering again); so is a push still without room. */
    mine = st == PRECOND_OK && room && c->shm.map != NULL && c->queue.length > 0 && !c->stop;
  }
  if (mine) {
    c->counters.pushes_direct++;
    push_some(c); /* mu released while it calls; a transient failure requeues */
  }
  c->busy = 0;
  if (mine && (c->queue.length > 0 || c->bell_waits)) pthread_cond_signal(&c->wake);
  pthread_cond_broadcast(&c->progress); /* precond_end_job waits for busy to clear */
  return mine;
}

int precond_push_commit(precond_client *c, precond_push_slot *slot) {
  if (c == NULL || slot == NULL) return PRECOND_EINVAL;
  precond__item *it = (precond__item *)(void *)slot;
  if (!slot_finite(it)) return PRECOND_EINVAL;
  int kfac = client_is_kfac(c);
  pthread_mutex_lock(&c->mu);
  int st = push_queue_locked(c, kfac, it); /* the job replaced since begin: PRECOND_EINVAL */
  if (st == PRECOND_OK && !push_direct(c, it)) pthread_cond_signal(&c->wake);
  pthread_mutex_unlock(&c->mu);
  return st;
}

int precond_push_commit_all(precond_client *c, precond_push_slot *const *slots, size_t n) {
  if (c == NULL) {
    for (size_t i = 0; slots != NULL && i < n; i++)
      precond__item_free((precond__item *)(void *)slots[i]);
    return PRECOND_EINVAL;
  }
  if (slots == NULL) return n == 0 ? PRECOND_OK : PRECOND_EINVAL;
  int st = PRECOND_OK, kfac = client_is_kfac(c);
  size_t keep = 0;
  /* The values are checked outside the lock; what passes is queued under one lock and one
   * wake, so the background thread sends the whole step in one call instead of waking at
   * every block (session 10: about ten push calls a step became one). */
  precond__item **ok = malloc((n ? n : 1) * sizeof(*ok));
  for (size_t i = 0; i < n; i++) {
    precond__item *it = (precond__item *)(void *)slots[i];
    if (it == NULL) continue;
    if (ok == NULL) {
      precond__item_free(it);
      st = PRECOND_ENOMEM;
    } else if (!slot_finite(it)) {
      if (st == PRECOND_OK) st = PRECOND_EINVAL;
    } else {
      ok[keep++] = it;
    }
  }
  if (keep > 0) {
    pthread_mutex_lock(&c->mu);
    int queued = 0;
    for (size_t i = 0; i < keep; i++) {
      int q = push_queue_locked(c, kfac, ok[i]);
      queued |= q == PRECOND_OK;
      if (q != PRECOND_OK && st == PRECOND_OK) st = q;
    }
    if (queued && !(keep == 1 && push_direct(c, ok[0]))) pthread_cond_signal(&c->wake);
    pthread_mutex_unlock(&c->mu);
  }
  free(ok);
  return st;
}

/* Part k's vouch given (good) or taken away: the one place a slot's vouch bits change. */
static void part_vouch(precond__item *it, unsigned k, int good) {
  if (good)
    atomic_fetch_or(&it->vouched, 1u << k);
  else
    atomic_fetch_and(&it->vouched, ~(1u << k));
}

/* A region slot's vouch after a copy of count floats to dst (good: all below 2^125): part k
 * is vouched for once a copy wrote it whole with such values; any other copy into it (a
 * part, or a value outside) takes its vouch away. */
static void slot_vouch(precond__item *it, const float *dst, size_t count, int good) {
  const unsigned char *lo = (const unsigned char *)dst, *hi = lo + count * sizeof(float);
  const unsigned char *part[3] = {it->data, it->data + it->left_bytes,
                                  it->data + it->left_bytes + it->right_bytes};
  for (unsigned k = 0; k < 2; k++)
    if (hi > part[k] && lo < part[k + 1])
      part_vouch(it, k, good && lo <= part[k] && hi >= part[k + 1]);
}

/* 1 when the packed n x n Gram part's diagonal vouches for the whole part. Why a diagonal
 * below 2^124 keeps every entry below 2^125 (the vouch): exactly, |S_ij| <= sqrt(S_ii S_jj)
 * (Cauchy-Schwarz); syrk's fp32 rounding, in any summation order, moves an entry by at most
 * gamma_k sum_l |G_li G_lj| <= gamma_k sqrt(S_ii S_jj) (gamma_k = k u / (1 - k u), u = 2^-24,
 * k the inner dimension), and a computed diagonal is at least (1 - gamma_k) its exact value;
 * so |fl(S_ij)| <= (1 + gamma_k) / (1 - gamma_k) max fl(S_ii) < 2 * 2^124 while k < 2^21
 * (a nonnegative combination of such matrices keeps the bound, each sum rounding by (1 + u)).
 * A NaN or Inf in G reaches the diagonal (S_jj sums G_lj^2), as does a product that
 * overflows (|G_li G_lj| <= max(G_li^2, G_lj^2)). A negative diagonal is no Gram matrix.
 * Row i of the packed upper triangle (preconditioner.h) starts at its diagonal and holds
 * n - i values. */
static int gram_diagonal_ok(size_t n, const float *packed) {
  int ok = 1;
  for (size_t i = 0; i < n; packed += n - i, i++) ok &= packed[0] >= 0.0f && packed[0] < 0x1p124f;
  return ok;
}

int precond_push_vouch_gram(precond_push_slot *slot) {
  if (slot == NULL) return PRECOND_EINVAL;
  precond__item *it = (precond__item *)(void *)slot;
  if (it->owner == NULL) return 0; /* queue memory: copied, never vouched for */
  const float *part[2] = {(const float *)(const void *)it->data,
                          (const float *)(const void *)(it->data + it->left_bytes)};
  const uint32_t n[2] = {it->n_left, it->n_right};
  int vouched = 0;
  for (unsigned k = 0; k < 2; k++) {
    int good = gram_diagonal_ok(n[k], part[k]);
    part_vouch(it, k, good);
    vouched += good;
  }
  return vouched;
}

void precond_push_copy(const precond_push_slot *slot, float *dst, const float *src, size_t count) {
  /* The slot is the caller's between begin and commit: its vouch, and the counts of what
   * was written in each mode (atomic: workers may copy parts of one slot at once), are
   * written here. */
  precond__item *it = (precond__item *)(uintptr_t)(const void *)slot;
  size_t len = count * sizeof(float);
  if (it == NULL || it->owner == NULL) {
    if (len > 0) memcpy(dst, src, len);
    return;
  }
  shm_window *w = it->owner;
  int large = len >= RPC_SHM_STREAM_MIN, mode = large ? it->wmode & RPC_SHM_STREAMED : 0;
  uint64_t t0 = large ? rpc_shm_thread_ns() : 0;
  int good = rpc_shm_write_vouched(dst, src, count, mode == RPC_SHM_STREAMED);
  if (large) {
    rpc_shm_mode_wrote(&w->mode, it->wmode, len, rpc_shm_thread_ns() - t0);
    __atomic_fetch_add(&it->wrote[mode], (uint64_t)len, __ATOMIC_RELAXED);
  }
  slot_vouch(it, dst, count, good);
}

void precond_push_cancel(precond_push_slot *slot) {
  precond__item_free((precond__item *)(void *)slot);
}

int precond_flush(precond_client *c, int timeout_ms) {
  if (c == NULL) return PRECOND_EINVAL;
  struct timespec until = deadline_in(timeout_ms > 0 ? timeout_ms : 0);
  int st = PRECOND_ETIMEDOUT;
  pthread_mutex_lock(&c->mu);
  c->flushing++; /* the background thread collects what it posted (collect_posted) */
  pthread_cond_signal(&c->wake);
  for (;;) {
    if (c->refused) {
      st = PRECOND_EENDED;
      break;
    }
    if (c->queue.length == 0 && c->inflight == 0) {
      st = PRECOND_OK;
      break;
    }
    if (pthread_cond_timedwait(&c->progress, &c->mu, &until) == ETIMEDOUT) break;
  }
  c->flushing--;
  pthread_mutex_unlock(&c->mu);
  return st;
}

int precond_wait_queued(precond_client *c, size_t max_queued, int timeout_ms) {
  if (c == NULL) return PRECOND_EINVAL;
  struct timespec until = deadline_in(timeout_ms > 0 ? timeout_ms : 0);
  int st = PRECOND_ETIMEDOUT;
  pthread_mutex_lock(&c->mu);
  c->queue_waiters++; /* push_some wakes us when it takes a batch */
  for (;;) {
    if (c->refused) {
      st = PRECOND_EENDED;
      break;
    }
    /* Awaited (push_answer_wait), the blocks taken and not yet answered count too: a
     * worker pacing itself here writes its next statistic once the daemon folded this one,
     * never while it folds (the two passes at once cost both sides CPU across cores), and
     * into the place just folded (the window's slots all given back: its part's start;
     * docs/precondd.md, "Session 16"). */
    if (c->queue.length + (c->opts.push_answer_wait ? c->inflight : 0) <= max_queued) {
      st = PRECOND_OK;
      break;
    }
    if (pthread_cond_timedwait(&c->progress, &c->mu, &until) == ETIMEDOUT) break;
  }
  c->queue_waiters--;
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* ------------------------------------------------------------------------------------ */
/* Stats and health                                                                       */

void precond_stats_destroy(precond_stats *s) {
  if (s == NULL) return;
  for (size_t i = 0; i < s->njobs && s->job_stats; i++) {
    free(s->job_stats[i].job);
    free(s->job_stats[i].rank_load);
  }
  for (size_t i = 0; i < s->nblocks && s->block_stats; i++) {
    free(s->block_stats[i].job);
    free(s->block_stats[i].tensor);
  }
  free(s->job_stats);
  free(s->block_stats);
  free(s->version);
  memset(s, 0, sizeof(*s));
}

static void staleness_copy(const Precond__V1__StalenessStats *w, precond_staleness *s) {
  if (w == NULL) return; /* an older daemon: no samples */
  s->samples = w->samples;
  s->max = w->max;
  s->p50 = w->p50;
  s->p90 = w->p90;
  s->p99 = w->p99;
  s->mean = w->mean;
}

/* Deep copy of a StatsResponse into the public struct. */
static int stats_copy(const Precond__V1__StatsResponse *r, precond_stats *s) {
  memset(s, 0, sizeof(*s));
  s->version = dup_str(r->version ? r->version : "");
  s->uptime_s = r->uptime_s;
  s->jobs = r->jobs;
  s->threads = r->threads;
  s->replicas = r->replicas;
  s->rank = r->rank;
  if (r->replica != NULL)
    s->replica = (precond_replica_stats){r->replica->roots_sent,      r->replica->roots_received,
                                         r->replica->stats_forwarded, r->replica->stats_received,
                                         r->replica->mpi_errors,      r->replica->alone != 0};
  s->queue_depth = r->queue_depth;
  s->roots_computed = r->roots_computed;
  s->roots_failed = r->roots_failed;
  s->roots_skipped = r->roots_skipped;
  s->drift_threshold = r->drift_threshold;
  staleness_copy(r->staleness, &s->staleness);
  s->compute_ms_p50 = r->compute_ms_p50;
  s->compute_ms_p90 = r->compute_ms_p90;
  s->compute_ms_p99 = r->compute_ms_p99;
  s->bytes_in = r->bytes_in;
  s->bytes_out = r->bytes_out;
  s->memory_bytes = r->memory_bytes;
  s->rejected_pushes = r->rejected_pushes;
  s->torn_pushes = r->torn_pushes;
  s->vouched_pushes = r->vouched_pushes;
  s->snapshots_written = r->snapshots_written;
  s->last_snapshot_age_s = r->last_snapshot_age_s;
  s->job_stats = calloc(r->n_job_stats ? r->n_job_stats : 1, sizeof(*s->job_stats));
  s->block_stats = calloc(r->n_block_stats ? r->n_block_stats : 1, sizeof(*s->block_stats));
  if (s->version == NULL || s->job_stats == NULL || s->block_stats == NULL) goto fail;
  for (size_t i = 0; i < r->n_job_stats; i++) {
    const Precond__V1__JobStats *j = r->job_stats[i];
    precond_job_stats *d = &s->job_stats[i];
    s->njobs = i + 1;
    d->job = dup_str(j->job ? j->job : "");
    d->mode = (precond_mode)j->mode;
    d->blocks = j->blocks;
    d->workers = j->workers;
    d->last_step = j->last_step;
    if (d->job == NULL) goto fail;
    if (j->n_rank_load > 0) {
      d->rank_load = malloc(j->n_rank_load * sizeof *d->rank_load);
      if (d->rank_load == NULL) goto fail;
      memcpy(d->rank_load, j->rank_load, j->n_rank_load * sizeof *d->rank_load);
      d->nrank_load = j->n_rank_load;
    }
  }
  for (size_t i = 0; i < r->n_block_stats; i++) {
    const Precond__V1__BlockStats *b = r->block_stats[i];
    precond_block_stats *d = &s->block_stats[i];
    s->nblocks = i + 1;
    d->job = dup_str(b->job ? b->job : "");
    d->tensor = dup_str(b->tensor ? b->tensor : "");
    d->block_id = b->block_id;
    d->rows = b->rows;
    d->cols = b->cols;
    d->version = b->version;
    d->stat_step = b->stat_step;
    d->root_step = b->root_step;
    d->staleness = b->staleness;
    d->roots_computed = b->roots_computed;
    d->roots_failed = b->roots_failed;
    d->roots_skipped = b->roots_skipped;
    d->last_drift = b->last_drift;
    staleness_copy(b->staleness_dist, &d->staleness_dist);
    d->last_error = b->last_error;
    d->last_compute_ms = b->last_compute_ms;
    d->owner = b->owner;
    d->a_order = b->a_order;
    d->g_order = b->g_order;
    d->pi = b->pi;
    d->damping_a = b->damping_a;
    d->damping_g = b->damping_g;
    d->roots_warm = b->roots_warm;
    d->roots_warm_skipped = b->roots_warm_skipped;
    d->roots_seeded = b->roots_seeded;
    d->roots_cold = b->roots_cold;
    if (d->job == NULL || d->tensor == NULL) goto fail;
  }
  return PRECOND_OK;
fail:
  precond_stats_destroy(s);
  return PRECOND_ENOMEM;
}

int precond_end_job(precond_client *c, const char *job, precond_ended *out) {
  if (c == NULL) return PRECOND_EINVAL;
  pthread_mutex_lock(&c->mu);
  const char *target = job != NULL ? job : c->job;
  char *name = dup_str(target);
  if (name == NULL) {
    pthread_mutex_unlock(&c->mu);
    return target == NULL ? PRECOND_EINVAL : PRECOND_ENOMEM;
  }
  if (c->job != NULL && strcmp(name, c->job) == 0) {
    /* Our own job: forget it, and let a round of calls in flight for it finish, so the
     * background thread cannot register it again after the daemon ended it. */
    job_clear(c);
    c->job_gen++;
    struct timespec until = deadline_in(c->opts.call_timeout_ms);
    while (c->busy && pthread_cond_timedwait(&c->progress, &c->mu, &until) != ETIMEDOUT) {
    }
  }
  pthread_mutex_unlock(&c->mu);
  Precond__V1__EndJobRequest req = PRECOND__V1__END_JOB_REQUEST__INIT;
  req.job = name;
  ProtobufCMessage *msg = NULL;
  int st = call(c, RPC_METHOD_END_JOB, &req.base, &precond__v1__end_job_response__descriptor,
                c->opts.wait_for_ready, &msg);
  if (st == PRECOND_OK && out != NULL) {
    const Precond__V1__EndJobResponse *r = (const Precond__V1__EndJobResponse *)msg;
    *out = (precond_ended){.blocks = r->blocks, .last_step = r->last_step, .bytes = r->bytes};
  }
  if (msg != NULL) protobuf_c_message_free_unpacked(msg, NULL);
  free(name);
  return st;
}

int precond_get_stats(precond_client *c, const char *job, int blocks, precond_stats *out) {
  if (c == NULL || out == NULL) return PRECOND_EINVAL;
  memset(out, 0, sizeof(*out));
  Precond__V1__StatsRequest req = PRECOND__V1__STATS_REQUEST__INIT;
  req.job = (char *)(job ? job : "");
  req.blocks = blocks != 0;
  ProtobufCMessage *msg = NULL;
  int st = call(c, RPC_METHOD_GET_STATS, &req.base, &precond__v1__stats_response__descriptor,
                c->opts.wait_for_ready, &msg);
  if (st == PRECOND_OK) st = stats_copy((const Precond__V1__StatsResponse *)msg, out);
  if (msg != NULL) protobuf_c_message_free_unpacked(msg, NULL);
  return st;
}

int precond_health(precond_client *c, const char *service, int *serving, const char **status_name) {
  if (c == NULL || serving == NULL) return PRECOND_EINVAL;
  *serving = 0;
  if (status_name != NULL) *status_name = "UNKNOWN";
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = (char *)(service ? service : "");
  ProtobufCMessage *msg = NULL;
  int st = call(c, RPC_METHOD_HEALTH_CHECK, &req.base,
                &grpc__health__v1__health_check_response__descriptor, c->opts.wait_for_ready, &msg);
  if (st == PRECOND_OK) {
    const Grpc__Health__V1__HealthCheckResponse *r =
        (const Grpc__Health__V1__HealthCheckResponse *)msg;
    switch (r->status) {
      case GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING:
        *serving = 1;
        if (status_name != NULL) *status_name = "SERVING";
        break;
      case GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING:
        if (status_name != NULL) *status_name = "NOT_SERVING";
        break;
      case GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN:
        if (status_name != NULL) *status_name = "SERVICE_UNKNOWN";
        break;
      default:
        break;
    }
  }
  if (msg != NULL) protobuf_c_message_free_unpacked(msg, NULL);
  return st;
}
