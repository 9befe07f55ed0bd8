/*
 * replica.c -- daemon replicas over MPI: the communication thread.
 *
 * Under `mpirun -np R precondd ...` each rank is a whole precondd with its own listen
 * address and state directory. What crosses ranks, all of it on this file's one thread:
 *   JOB   a job registered on one rank (name, mode, options as in snapshots, tensors): every
 *         other rank adds it, so a worker can use any rank;
 *   STAT  statistics pushed on one rank for a unit another owns: the owner folds them;
 *   ROOT  a result the owner published: every other rank publishes it under the owner's
 *         version, so a worker fetches every root from its local daemon. The message is a
 *         header; each part follows as its own message on a second communicator, sent from
 *         the published root itself and received into the root the receiver will publish
 *         (no staging copy on either side);
 *   BYE   this rank sends nothing more (shutdown).
 * Handlers and pool threads only queue copies (the link's hooks) and never call MPI: the
 * thread sends them with MPI_Isend, matches arrivals with MPI_Improbe into MPI_Imrecv, and
 * sleeps between polls when idle (pd__comm says how long). MPI
 * keeps the messages of one sender in order, so a unit's versions arrive in order and a
 * job arrives before anything of it from the same rank; anything for a job not known yet
 * (sent by a third rank) waits in a bounded list until that job arrives.
 *
 * Errors: MPI's default handler on a communicator is MPI_ERRORS_ARE_FATAL (any error aborts
 * every rank of the job). This file sets MPI_ERRORS_RETURN: an MPI error is logged and
 * counted, and the rank goes on alone (pd_replica_link.alone: it computes every unit
 * itself from the statistics it gets, and its workers keep training). Open MPI without
 * ULFM still ends the whole job when a rank dies; docs/replicas.md says what that means.
 */
#include "precondd.h"

#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "preconditioner.h"
#include "rpc.h"

enum { PD__TAG_JOB = 1, PD__TAG_STAT, PD__TAG_ROOT, PD__TAG_BYE, PD__TAG_END };

#define PD__MAX_DEFERRED 4096 /* messages held for a job not known yet */

/* An encoded message; refs: one per send in flight plus the queue's. A ROOT's holds a
 * reference to the root whose parts follow it (sent from there; deferred ones: received). */
typedef struct pd__msg {
  struct pd__msg *next;
  int tag, dest; /* dest -1: every other rank */
  int refs;
  size_t len, cap;
  unsigned char *buf;
  pd_root *root; /* NULL but for ROOT */
} pd__msg;

typedef struct {
  MPI_Request req;
  pd__msg *msg;
} pd__send;

/* A message matched (MPI_Improbe) and being received into buf (MPI_Imrecv); a ROOT's
 * parts then into root (PD__PARTS). */
enum { PD__HEAD, PD__PARTS, PD__DONE }; /* pd__recv.stage */

typedef struct {
  MPI_Request req;
  unsigned char *buf;
  int count, tag, src, stage;
  pd_root *root; /* a ROOT's, from PD__PARTS on (the record's) */
  MPI_Request parts[PD_MAX_PARTS];
} pd__recv;

struct pd_replica {
  pd_replica_link link;
  pd_daemon *d;
  MPI_Comm comm;
  MPI_Comm parts_comm; /* a ROOT's parts, so the wildcard matching on comm never sees them */
  pthread_t thread;
  int started;
  pthread_mutex_t lock; /* guards the queue and stopping */
  pthread_cond_t cond;
  pd__msg *head, *tail;
  int stopping;
  int marking; /* the pool runs: forwarded statistics may queue computations */
  /* The communication thread's own. */
  pd__send *sends;
  size_t nsends, capsends;
  pd__recv *recvs; /* in the order matched, which is the order handled */
  size_t nrecvs, caprecvs;
  pd__msg *deferred, *deferred_tail;
  size_t ndeferred;
  double grace_s;
};

/* ---- encoding (little-endian, as snapshots; floats through the one packed codec) -------- */

static pd__msg *pd__msg_new(int tag, int dest, size_t cap) {
  pd__msg *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  m->buf = malloc(cap ? cap : 1);
  if (!m->buf) {
    free(m);
    return NULL;
  }
  m->tag = tag;
  m->dest = dest;
  m->cap = cap;
  m->refs = 1;
  return m;
}

/* Where roots' bytes are counted: the daemon's, once pd_replica_start gave it (a root
 * restored from a snapshot is published, and queued here, before that). */
static pd_stats *pd__stats(pd_replica *x) {
  return x->d ? &x->d->stats : NULL;
}

static void pd__msg_unref(pd_replica *x, pd__msg *m) {
  if (m && --m->refs == 0) {
    pd_root_unref(m->root, pd__stats(x));
    free(m->buf);
    free(m);
  }
}

/* Appends v as `bytes` little-endian bytes; the capacity was sized by the caller. */
static void pd__put(pd__msg *m, uint64_t v, int bytes) {
  pd_le_put(m->buf + m->len, v, bytes);
  m->len += (size_t)bytes;
}

static void pd__put_f64(pd__msg *m, double x) {
  uint64_t v;
  memcpy(&v, &x, sizeof v);
  pd__put(m, v, 8);
}

static void pd__put_str(pd__msg *m, const char *s) {
  size_t n = strlen(s);
  pd__put(m, n, 4);
  memcpy(m->buf + m->len, s, n);
  m->len += n;
}

static void pd__put_floats(pd__msg *m, uint64_t order, const float *vals) {
  size_t count = pc_packed_len(order);
  pd__put(m, order, 8);
  rpc_packed_encode(0, vals, count, m->buf + m->len); /* fp32: cannot fail */
  m->len += count * 4;
}

/* A bounds-checked reader; any short read sets bad. */
typedef struct {
  const unsigned char *p;
  size_t left;
  int bad;
} pd__rd;

static uint64_t pd__get(pd__rd *r, int bytes) {
  if (r->bad || r->left < (size_t)bytes) {
    r->bad = 1;
    return 0;
  }
  uint64_t v = pd_le_get(r->p, bytes);
  r->p += bytes;
  r->left -= (size_t)bytes;
  return v;
}

static double pd__get_f64(pd__rd *r) {
  uint64_t v = pd__get(r, 8);
  double x;
  memcpy(&x, &v, sizeof x);
  return x;
}

/* A copy of the next string (malloc'd; NULL when bad). */
static char *pd__get_str(pd__rd *r) {
  uint64_t n = pd__get(r, 4);
  if (r->bad || n > r->left || n > 4096) {
    r->bad = 1;
    return NULL;
  }
  char *s = malloc(n + 1);
  if (!s) {
    r->bad = 1;
    return NULL;
  }
  memcpy(s, r->p, n);
  s[n] = '\0';
  r->p += n;
  r->left -= n;
  return s;
}

/* Decodes the next packed part of the expected order into out. */
static int pd__get_floats(pd__rd *r, uint64_t order, float *out) {
  uint64_t n = pd__get(r, 8);
  size_t count = pc_packed_len(order);
  if (r->bad || n != order || r->left < count * 4) {
    r->bad = 1;
    return -1;
  }
  rpc_packed_decode(0, r->p, count * 4, count, out);
  r->p += count * 4;
  r->left -= count * 4;
  return 0;
}

/* A ROOT's header after the unit's name and id: the root's fields and its parts' orders. */
#define PD__ROOT_HEAD_BYTES (8 * 3 + 4 + 4 + 8 * PD_MODE_AUX + 4 + 8 * PD_MAX_PARTS)

static void pd__put_root_head(pd__msg *m, const pd_root *r) {
  pd__put(m, r->version, 8);
  pd__put(m, r->source_step, 8);
  pd__put_f64(m, r->error);
  pd__put(m, (uint32_t)r->method, 4);
  pd__put(m, r->iterations, 4);
  for (int k = 0; k < PD_MODE_AUX; k++) pd__put_f64(m, r->aux[k]);
  pd__put(m, r->nparts, 4);
  for (uint32_t k = 0; k < r->nparts; k++) pd__put(m, r->order[k], 8);
}

/* Reads what pd__put_root_head wrote into h (no parts); -1 when malformed or a part would
 * not fit one MPI message of floats. */
static int pd__get_root_head(pd__rd *r, pd_root *h) {
  h->version = pd__get(r, 8);
  h->source_step = pd__get(r, 8);
  h->error = pd__get_f64(r);
  h->method = (int)(uint32_t)pd__get(r, 4);
  h->iterations = (uint32_t)pd__get(r, 4);
  for (int k = 0; k < PD_MODE_AUX; k++) h->aux[k] = pd__get_f64(r);
  h->nparts = (uint32_t)pd__get(r, 4);
  if (r->bad || h->nparts > PD_MAX_PARTS) return -1;
  for (uint32_t k = 0; k < h->nparts; k++) {
    h->order[k] = pd__get(r, 8);
    if (h->order[k] > (1u << 20) || pc_packed_len(h->order[k]) > INT_MAX) r->bad = 1;
  }
  return r->bad ? -1 : 0;
}

static size_t pd__parts_bytes(uint32_t nparts, const uint64_t *order) {
  size_t n = 0;
  for (uint32_t k = 0; k < nparts; k++) n += 8 + pc_packed_len(order[k]) * 4;
  return n;
}

/* ---- the queue (any thread) ---------------------------------------------------------- */

static void pd__enqueue(pd_replica *x, pd__msg *m) {
  pthread_mutex_lock(&x->lock);
  if (x->tail)
    x->tail->next = m;
  else
    x->head = m;
  x->tail = m;
  pthread_cond_signal(&x->cond);
  pthread_mutex_unlock(&x->lock);
}

static void pd__hook_job(void *ctx, const pd_job *job) {
  pd_replica *x = ctx;
  const pd_mode *mode = job->mode;
  size_t cap = 16 + mode->snap_bytes + 4 + strlen(job->name) + 4;
  for (size_t i = 0; i < job->ntensors; i++)
    cap += 8 + strlen(job->tensors[i].name) + 8 * (size_t)job->tensors[i].rank;
  pd__msg *m = pd__msg_new(PD__TAG_JOB, -1, cap);
  if (!m) {
    pd_log(PD_LOG_ERROR, "replicas: out of memory sending job %s", job->name);
    return;
  }
  pd__put(m, (uint64_t)mode->id, 4);
  pd__put(m, mode->snap_bytes, 4);
  mode->snap_write(job->opts, m->buf + m->len);
  m->len += mode->snap_bytes;
  pd__put_str(m, job->name);
  pd__put(m, job->ntensors, 4);
  for (size_t i = 0; i < job->ntensors; i++) {
    pd__put_str(m, job->tensors[i].name);
    pd__put(m, (uint64_t)job->tensors[i].rank, 4);
    for (int k = 0; k < job->tensors[i].rank; k++) pd__put(m, job->tensors[i].dims[k], 8);
  }
  pd__enqueue(x, m);
}

static void pd__hook_end(void *ctx, const char *name) {
  pd_replica *x = ctx;
  pd__msg *m = pd__msg_new(PD__TAG_END, -1, 4 + strlen(name));
  if (!m) {
    pd_log(PD_LOG_ERROR, "replicas: out of memory sending the end of job %s", name);
    return;
  }
  pd__put_str(m, name);
  pd__enqueue(x, m);
}

/* The header only: the parts go from r itself (a reference held until every send of them
 * completed), so the pool thread that published r copies nothing. */
static void pd__hook_root(void *ctx, const pd_block *b, pd_root *r) {
  pd_replica *x = ctx;
  size_t cap = 4 + strlen(b->job->name) + 4 + PD__ROOT_HEAD_BYTES;
  pd__msg *m = pd__msg_new(PD__TAG_ROOT, -1, cap);
  if (!m) {
    pd_log(PD_LOG_ERROR, "replicas: out of memory sending a root of job %s block %u", b->job->name,
           b->id);
    return;
  }
  pd__put_str(m, b->job->name);
  pd__put(m, b->id, 4);
  pd__put_root_head(m, r);
  pd_root_ref(r);
  m->root = r;
  atomic_fetch_add(&x->link.roots_sent, 1);
  pd__enqueue(x, m);
}

static int pd__hook_stat(void *ctx, const pd_block *b, const float *const *parts, uint64_t step) {
  pd_replica *x = ctx;
  size_t cap = 4 + strlen(b->job->name) + 4 + 8 + 4 + pd__parts_bytes(b->nparts, b->order);
  pd__msg *m = pd__msg_new(PD__TAG_STAT, (int)b->owner, cap);
  if (!m) return PD_ENOMEM;
  pd__put_str(m, b->job->name);
  pd__put(m, b->id, 4);
  pd__put(m, step, 8);
  pd__put(m, b->nparts, 4);
  for (uint32_t k = 0; k < b->nparts; k++) pd__put_floats(m, b->order[k], parts[k]);
  atomic_fetch_add(&x->link.stats_forwarded, 1);
  pd__enqueue(x, m);
  return PD_OK;
}

/* ---- handling what arrives (communication thread) ------------------------------------ */

/* Adds the job a JOB message describes. */
static void pd__on_job(pd_replica *x, pd__rd *r) {
  pd_daemon *d = x->d;
  int mode_id = (int)pd__get(r, 4);
  size_t snap = (size_t)pd__get(r, 4);
  const pd_mode *mode = pd_mode_find(mode_id);
  char *name = NULL, why[400] = "";
  pd_tensor *t = NULL;
  size_t nt = 0;
  pd_job *job = NULL;
  _Alignas(max_align_t) unsigned char opts[PD_MODE_OPTS_MAX];
  if (!mode || snap != mode->snap_bytes || r->left < snap) {
    snprintf(why, sizeof why, "unknown mode %d or options of %zu bytes", mode_id, snap);
    goto bad;
  }
  memset(opts, 0, sizeof opts);
  mode->snap_read(r->p, opts);
  r->p += snap;
  r->left -= snap;
  name = pd__get_str(r);
  nt = (size_t)pd__get(r, 4);
  if (r->bad || nt == 0 || nt > PD_MAX_TENSORS || mode->resolve(opts, why, sizeof why) != PD_OK)
    goto bad;
  t = calloc(nt, sizeof *t);
  if (!t) goto bad;
  for (size_t i = 0; i < nt && !r->bad; i++) {
    t[i].name = pd__get_str(r);
    t[i].rank = (int)pd__get(r, 4);
    if (t[i].rank < 1 || t[i].rank > PD_MAX_RANK) {
      r->bad = 1;
      break;
    }
    t[i].dims = calloc((size_t)t[i].rank, sizeof *t[i].dims);
    if (!t[i].dims) r->bad = 1;
    for (int k = 0; k < t[i].rank && !r->bad; k++) t[i].dims[k] = pd__get(r, 8);
  }
  if (r->bad) goto bad;
  if (pd_job_build(name, mode, opts, nt, t, d->cfg.max_blocks_per_job, &job, why, sizeof why) !=
      PD_OK)
    goto bad;
  pd_job *existing = NULL;
  int rc = pd_store_add(&d->store, job, &existing);
  if (rc != PD_OK) {
    snprintf(why, sizeof why, "%s", pd_strerror(rc));
    goto bad;
  }
  if (existing) {
    if (!pd_job_same(existing, job))
      pd_log(PD_LOG_ERROR,
             "replicas: job %s came from another rank with different tensors or "
             "options than the one registered here; this rank keeps its own",
             name);
    pd_job_unref(existing, &d->stats);
    pd_job_free(job, &d->stats);
  } else {
    pd_log(PD_LOG_INFO, "replicas: job %s (%zu units) registered by another rank", name,
           job->nblocks);
  }
  job = NULL;
  goto done;
bad:
  pd_log(PD_LOG_ERROR, "replicas: a job from another rank was not added: %s",
         *why ? why : "malformed message");
done:
  if (job) pd_job_free(job, &d->stats);
  for (size_t i = 0; t && i < nt; i++) {
    free(t[i].name);
    free(t[i].dims);
  }
  free(t);
  free(name);
}

/* The unit a STAT or ROOT message names, with a reference to its job in *job (the caller
 * drops it); NULL with *unknown_job set when the job is not here yet, NULL alone when the
 * unit does not exist. Traffic counts as the job's activity: a rank whose workers never
 * call for a job still keeps it while the others use it. */
static pd_block *pd__unit_of(pd_replica *x, pd__rd *r, pd_job **job, int *unknown_job) {
  *unknown_job = 0;
  char *name = pd__get_str(r);
  uint32_t id = (uint32_t)pd__get(r, 4);
  *job = name && !r->bad ? pd_store_get(&x->d->store, name, 1) : NULL;
  free(name);
  if (r->bad) return NULL;
  if (!*job) {
    *unknown_job = 1;
    return NULL;
  }
  return id < (*job)->nblocks ? &(*job)->blocks[id] : NULL;
}

static void pd__on_stat(pd_replica *x, pd_block *b, pd__rd *r) {
  pd_daemon *d = x->d;
  uint64_t step = pd__get(r, 8);
  uint32_t nparts = (uint32_t)pd__get(r, 4);
  float *inc[PD_MAX_PARTS] = {NULL};
  int ok = !r->bad && nparts == b->nparts;
  for (uint32_t k = 0; ok && k < nparts; k++)
    ok = (inc[k] = malloc(pc_packed_len(b->order[k]) * sizeof(float))) != NULL &&
         pd__get_floats(r, b->order[k], inc[k]) == 0;
  if (ok) {
    size_t bad = 0;
    pd_block *one[1] = {b};
    int rc = pd_job_push(b->job, 1, one, (const float *const *)inc, step, &d->stats, &bad);
    if (rc == PD_OK) {
      atomic_fetch_add(&x->link.stats_received, 1);
      pthread_mutex_lock(&b->job->lock);
      if (step > b->job->last_step) b->job->last_step = step;
      pthread_mutex_unlock(&b->job->lock);
      atomic_fetch_add(&d->store.generation, 1);
      /* Under the queue's lock: pd_replica_quiesce waits for a mark in progress, so none
       * reaches the pool once it is stopping. */
      pthread_mutex_lock(&x->lock);
      if (x->marking && pd_block_due(b) && pd_sched_mark(&d->sched, b) != PD_OK)
        pd_log(PD_LOG_ERROR, "job %s block %u: out of memory queueing it", b->job->name, b->id);
      pthread_mutex_unlock(&x->lock);
    } else {
      atomic_fetch_add(&d->stats.rejected_pushes, 1);
      pd_log(PD_LOG_WARN, "replicas: forwarded statistics of job %s block %u refused: %s",
             b->job->name, b->id, rc == PD_EINVAL ? "they would overflow to Inf" : "out of memory");
    }
  } else {
    pd_log(PD_LOG_ERROR, "replicas: malformed statistics for job %s block %u", b->job->name, b->id);
  }
  for (uint32_t k = 0; k < PD_MAX_PARTS; k++) free(inc[k]);
}

/* An EndJob on another rank: the job ends here too (snapshotted without it at once, as
 * after an EndJob here). Messages of it still in flight then find no job: a ROOT or STAT
 * waits among the deferred ones until it ages out. */
static void pd__on_end(pd_replica *x, pd__rd *r) {
  char *name = pd__get_str(r);
  pd_job_ended info;
  if (!name || r->bad)
    pd_log(PD_LOG_ERROR, "replicas: malformed end of a job");
  else if (pd_service_end_job(x->d, name, 0, 0, &info) == PD_OK)
    pd_log(PD_LOG_INFO, "replicas: job %s ended by another rank", name);
  free(name);
}

/* Publishes root (received whole: header fields and parts; the reference passes here) as
 * unit b's if its shape is b's. */
static void pd__on_root(pd_replica *x, pd_block *b, pd_root *root) {
  pd_daemon *d = x->d;
  int ok = root->nparts == b->nparts;
  for (uint32_t k = 0; ok && k < b->nparts; k++) ok = root->order[k] == b->order[k];
  if (!ok) {
    pd_log(PD_LOG_ERROR, "replicas: a root of another shape for job %s block %u", b->job->name,
           b->id);
    pd_root_unref(root, &d->stats);
    return;
  }
  if (pd_block_publish_as(b, root, &d->stats)) atomic_fetch_add(&x->link.roots_received, 1);
}

/* Handles one STAT or ROOT message (a ROOT's root received whole: the reference passes
 * here, to the block or released); 1 when its job is not here yet (keep both). */
static int pd__on_unit_msg(pd_replica *x, int tag, const unsigned char *buf, size_t len,
                           pd_root *root) {
  pd__rd r = {buf, len, 0};
  int unknown = 0;
  pd_job *job = NULL;
  pd_block *b = pd__unit_of(x, &r, &job, &unknown);
  if (unknown) return 1;
  if (!b) {
    pd_log(PD_LOG_ERROR, "replicas: a message for a unit that does not exist (tag %d)", tag);
    pd_root_unref(root, &x->d->stats);
  } else if (tag == PD__TAG_STAT) {
    pd__on_stat(x, b, &r);
  } else {
    pd__on_root(x, b, root);
  }
  pd_job_unref(job, &x->d->stats);
  return 0;
}

/* Keeps a message for a job not known yet, with its root for a ROOT (both pass here; the
 * oldest goes beyond PD__MAX_DEFERRED). */
static void pd__defer(pd_replica *x, int tag, unsigned char *buf, size_t len, pd_root *root) {
  pd__msg *m = calloc(1, sizeof *m);
  if (!m) {
    free(buf);
    pd_root_unref(root, &x->d->stats);
    return;
  }
  m->tag = tag;
  m->buf = buf;
  m->len = len;
  m->refs = 1;
  m->root = root;
  if (x->deferred_tail)
    x->deferred_tail->next = m;
  else
    x->deferred = m;
  x->deferred_tail = m;
  if (++x->ndeferred > PD__MAX_DEFERRED) {
    pd__msg *old = x->deferred;
    x->deferred = old->next;
    x->ndeferred--;
    pd_log(PD_LOG_WARN, "replicas: dropped a message for a job this rank never received");
    pd__msg_unref(x, old);
  }
}

/* Retries the deferred messages after a job arrived. */
static void pd__retry_deferred(pd_replica *x) {
  pd__msg *list = x->deferred;
  x->deferred = x->deferred_tail = NULL;
  x->ndeferred = 0;
  while (list) {
    pd__msg *m = list;
    list = m->next;
    m->next = NULL;
    if (pd__on_unit_msg(x, m->tag, m->buf, m->len, m->root)) {
      pd__defer(x, m->tag, m->buf, m->len, m->root);
      m->buf = NULL;
    }
    m->root = NULL; /* passed on */
    pd__msg_unref(x, m);
  }
}

static void pd__mpi_failed(pd_replica *x, const char *what, int err) {
  char text[MPI_MAX_ERROR_STRING] = "";
  int n = 0;
  MPI_Error_string(err, text, &n);
  atomic_fetch_add(&x->link.mpi_errors, 1);
  if (!atomic_exchange(&x->link.alone, 1))
    pd_log(PD_LOG_ERROR, "replicas: %s failed (%s): rank %d now computes every unit itself", what,
           text, x->link.rank);
}

/* arr (n records used of *cap, each size bytes) with room for one more: arr itself, or
 * moved and doubled when full. NULL (arr unchanged) after counting the failure as MPI's:
 * the rank goes on alone. */
static void *pd__room(pd_replica *x, void *arr, size_t *cap, size_t n, size_t size,
                      const char *what) {
  if (n < *cap) return arr;
  size_t ncap = *cap ? 2 * *cap : 64;
  void *na = realloc(arr, ncap * size);
  if (!na) {
    pd__mpi_failed(x, what, MPI_ERR_NO_MEM);
    return NULL;
  }
  *cap = ncap;
  return na;
}

/* Handles one message received (takes buf and a ROOT's root). Counts BYEs in *byes. */
static void pd__handle(pd_replica *x, int tag, unsigned char *buf, int count, pd_root *root,
                       int *byes) {
  if (tag == PD__TAG_BYE) {
    (*byes)++;
    free(buf);
  } else if (tag == PD__TAG_JOB) {
    pd__rd r = {buf, (size_t)count, 0};
    pd__on_job(x, &r);
    free(buf);
    pd__retry_deferred(x);
  } else if (tag == PD__TAG_END) {
    pd__rd r = {buf, (size_t)count, 0};
    pd__on_end(x, &r);
    free(buf);
  } else if (pd__on_unit_msg(x, tag, buf, (size_t)count, root)) {
    pd__defer(x, tag, buf, (size_t)count, root);
  } else {
    free(buf);
  }
}

/* A ROOT header received (r->buf): receives its parts from r->src straight into the root
 * it will publish (a fresh one, fields from the header). The parts were sent on
 * parts_comm in the order of their headers, and headers are taken here in the order
 * matched: the receives match them in order. -1 (the rank goes on alone) when that order
 * cannot be kept: a malformed header, out of memory, an MPI error. */
static int pd__recv_parts(pd_replica *x, pd__recv *r) {
  pd__rd rd = {r->buf, (size_t)r->count, 0};
  pd_root h = {0};
  free(pd__get_str(&rd)); /* the unit: looked up once the root is whole */
  pd__get(&rd, 4);
  if (pd__get_root_head(&rd, &h) != 0) {
    pd__mpi_failed(x, "a root's header (malformed)", MPI_ERR_TRUNCATE);
    return -1;
  }
  r->root = pd_root_new(h.nparts, h.order, &x->d->stats);
  if (!r->root) {
    pd__mpi_failed(x, "a root to receive into", MPI_ERR_NO_MEM);
    return -1;
  }
  r->root->version = h.version;
  r->root->source_step = h.source_step;
  r->root->error = h.error;
  r->root->method = h.method;
  r->root->iterations = h.iterations;
  memcpy(r->root->aux, h.aux, sizeof h.aux);
  for (uint32_t k = 0; k < h.nparts; k++) {
    int err = MPI_Irecv(r->root->part[k], (int)pc_packed_len(h.order[k]), MPI_FLOAT, r->src, (int)k,
                        x->parts_comm, &r->parts[k]);
    if (err != MPI_SUCCESS) {
      for (uint32_t i = 0; i < k; i++) MPI_Request_free(&r->parts[i]);
      pd__mpi_failed(x, "MPI_Irecv", err);
      return -1;
    }
  }
  return 0;
}

/* Matches everything that has arrived, each into a nonblocking receive (a blocking
 * MPI_Recv would spin in Open MPI until a large message's sender made progress: up to a
 * poll interval of CPU on another host's rendezvous), starts the part receives of ROOT
 * headers received, in the order matched, then handles the messages that are whole, in
 * the order matched (MPI's order per sender: a job before its units, a unit's versions in
 * order), stopping at the first still in flight. Counts BYEs in *byes. Returns 1 if
 * anything was matched or handled. */
static int pd__receive(pd_replica *x, int *byes) {
  int any = 0;
  while (!atomic_load(&x->link.alone)) {
    int flag = 0, count = 0;
    MPI_Message msg;
    MPI_Status st;
    int err = MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, x->comm, &flag, &msg, &st);
    if (err != MPI_SUCCESS) {
      pd__mpi_failed(x, "MPI_Improbe", err);
      break;
    }
    if (!flag) break;
    MPI_Get_count(&st, MPI_BYTE, &count);
    pd__recv *nr = pd__room(x, x->recvs, &x->caprecvs, x->nrecvs, sizeof *nr, "a receive record");
    if (!nr) break;
    x->recvs = nr;
    pd__recv *r = &x->recvs[x->nrecvs];
    *r = (pd__recv){.count = count, .tag = st.MPI_TAG, .src = st.MPI_SOURCE, .stage = PD__HEAD};
    r->buf = malloc(count > 0 ? (size_t)count : 1);
    if (!r->buf) {
      pd__mpi_failed(x, "a receive buffer", MPI_ERR_NO_MEM);
      break;
    }
    err = MPI_Imrecv(r->buf, count, MPI_BYTE, &msg, &r->req);
    if (err != MPI_SUCCESS) {
      free(r->buf);
      pd__mpi_failed(x, "MPI_Imrecv", err);
      break;
    }
    x->nrecvs++;
    any = 1;
  }
  /* Headers first, in the order matched, stopping at the first in flight (a ROOT's part
   * receives must be started in that order). */
  for (size_t i = 0; i < x->nrecvs && !atomic_load(&x->link.alone); i++) {
    pd__recv *r = &x->recvs[i];
    if (r->stage != PD__HEAD) continue;
    int flag = 0;
    int err = MPI_Test(&r->req, &flag, MPI_STATUS_IGNORE);
    if (err != MPI_SUCCESS) {
      pd__mpi_failed(x, "MPI_Test", err);
      break;
    }
    if (!flag) break;
    if (r->tag == PD__TAG_ROOT && pd__recv_parts(x, r) != 0) break;
    r->stage = r->tag == PD__TAG_ROOT ? PD__PARTS : PD__DONE;
    any = 1;
  }
  size_t done = 0;
  while (done < x->nrecvs && !atomic_load(&x->link.alone)) {
    pd__recv *r = &x->recvs[done];
    if (r->stage == PD__PARTS) {
      int flag = 0;
      int err = MPI_Testall((int)r->root->nparts, r->parts, &flag, MPI_STATUSES_IGNORE);
      if (err != MPI_SUCCESS) {
        pd__mpi_failed(x, "MPI_Testall", err);
        break;
      }
      if (flag) r->stage = PD__DONE;
    }
    if (r->stage != PD__DONE) break;
    done++;
    pd__handle(x, r->tag, r->buf, r->count, r->root, byes);
    any = 1;
  }
  if (done > 0) {
    x->nrecvs -= done;
    memmove(x->recvs, x->recvs + done, x->nrecvs * sizeof *x->recvs);
  }
  return any;
}

/* Starts one send of m's (buf: count items of type) to dest, recorded with a reference
 * to m. -1 (the rank goes on alone) on failure. */
static int pd__isend(pd_replica *x, pd__msg *m, const void *buf, int count, MPI_Datatype type,
                     int dest, int tag, MPI_Comm comm) {
  pd__send *ns = pd__room(x, x->sends, &x->capsends, x->nsends, sizeof *ns, "a send record");
  if (!ns) return -1;
  x->sends = ns;
  pd__send *s = &x->sends[x->nsends];
  int err = MPI_Isend(buf, count, type, dest, tag, comm, &s->req);
  if (err != MPI_SUCCESS) {
    pd__mpi_failed(x, "MPI_Isend", err);
    return -1;
  }
  s->msg = m;
  m->refs++;
  x->nsends++;
  return 0;
}

/* Starts the sends of every queued message. Returns 1 if there were any. */
static int pd__send_queued(pd_replica *x) {
  pthread_mutex_lock(&x->lock);
  pd__msg *list = x->head;
  x->head = x->tail = NULL;
  pthread_mutex_unlock(&x->lock);
  int any = list != NULL;
  while (list) {
    pd__msg *m = list;
    list = m->next;
    for (int dest = 0; dest < x->link.nranks && !atomic_load(&x->link.alone); dest++) {
      if (dest == x->link.rank || (m->dest >= 0 && dest != m->dest)) continue;
      if (pd__isend(x, m, m->buf, (int)m->len, MPI_BYTE, dest, m->tag, x->comm) != 0) break;
      /* A ROOT's parts: from the root itself, after its header (the receiver matches them
       * in that order). */
      for (uint32_t k = 0; m->root && k < m->root->nparts; k++)
        if (pd__isend(x, m, m->root->part[k], (int)pc_packed_len(m->root->order[k]), MPI_FLOAT,
                      dest, (int)k, x->parts_comm) != 0)
          break;
    }
    pd__msg_unref(x, m);
  }
  return any;
}

/* Completes finished sends. Returns 1 if any finished. */
static int pd__test_sends(pd_replica *x) {
  int any = 0;
  for (size_t i = 0; i < x->nsends;) {
    int done = 0;
    int err = MPI_Test(&x->sends[i].req, &done, MPI_STATUS_IGNORE);
    if (err != MPI_SUCCESS) {
      pd__mpi_failed(x, "MPI_Test", err);
      done = 1;
    }
    if (done) {
      pd__msg_unref(x, x->sends[i].msg);
      x->sends[i] = x->sends[--x->nsends];
      any = 1;
    } else {
      i++;
    }
  }
  return any;
}

static void pd__sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* How long the idle communication thread waits before it polls MPI again. MPI cannot wake
 * a sleeping thread (a blocking receive would spin: Open MPI polls inside it), so arrivals
 * are polled; each wake-up costs some 50 us of CPU here (a timed wait, MPI_Iprobe's
 * progress pass), a core the pools need when every rank has one (docs/replicas.md).
 * Within PD__HOT_S of the last message either way it polls every PD__HOT_US (an arrival
 * waits at most that: well below a worker's 20 ms fetch poll), but every PD__BUSY_US while
 * this rank's pool computes: the core is the pool's then, and a root arriving meanwhile is
 * not late for anything (this rank's own roots of the step are not done yet); a publication
 * here (it wakes the thread) brings back PD__HOT_US for one wait, so the pool's last root
 * of a step is followed by fast polls once the pool is idle. After PD__HOT_S without a
 * message it polls every PD__COLD_US, so an idle rank costs about 0.1% of a core. A
 * message queued here wakes the thread at once either way. */
#define PD__HOT_US  2000L
#define PD__BUSY_US 10000L
#define PD__COLD_US 20000L
#define PD__HOT_S   1.0

static void *pd__comm(void *arg) {
  pd_replica *x = arg;
  pd_thread_name("pd-replica");
  int byes = 0;
  double last = pd_now(); /* of the last message sent, received or completed */
  for (;;) {
    int busy = pd__receive(x, &byes);
    int sent = pd__send_queued(x);
    busy |= sent | pd__test_sends(x);
    double now = pd_now();
    if (busy) last = now;
    /* Receives and sends in flight need MPI's progress: hot until they end. */
    long wait_us =
        now - last < PD__HOT_S || x->nrecvs > 0 || x->nsends > 0 ? PD__HOT_US : PD__COLD_US;
    if (wait_us == PD__HOT_US && !sent && atomic_load(&x->d->sched.busy) > 0) wait_us = PD__BUSY_US;
    pthread_mutex_lock(&x->lock);
    int stop = x->stopping && !x->head;
    if (!stop && !x->head) {
      /* Nothing queued: sleep until a message is queued here or the next poll is due. */
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += wait_us * 1000;
      until.tv_sec += until.tv_nsec / 1000000000;
      until.tv_nsec %= 1000000000;
      pthread_cond_timedwait(&x->cond, &x->lock, &until);
    }
    pthread_mutex_unlock(&x->lock);
    if (stop) break;
  }
  /* Shutdown: BYE after everything this rank sent (MPI keeps them in order); then take what
   * the others send until each said BYE, and finish the sends (a peer keeps receiving
   * until it has our BYE, so they complete). */
  pd__msg *bye = pd__msg_new(PD__TAG_BYE, -1, 1);
  if (bye) {
    pd__enqueue(x, bye);
    pd__send_queued(x);
  }
  double until = pd_now() + x->grace_s;
  /* Receives in flight too: a peer's root parts complete only once received here. */
  while (!atomic_load(&x->link.alone) &&
         (byes < x->link.nranks - 1 || x->nsends > 0 || x->nrecvs > 0)) {
    if (pd_now() > until) {
      pd_log(PD_LOG_WARN,
             "replicas: %d of %d other ranks did not finish within %.0f s; "
             "stopping without them",
             x->link.nranks - 1 - byes, x->link.nranks - 1, x->grace_s);
      break;
    }
    int busy = pd__receive(x, &byes) | pd__test_sends(x);
    if (!busy) pd__sleep_us(500);
  }
  return NULL;
}

/* ---- lifecycle (main thread) ---------------------------------------------------------- */

int pd_replica_init(int *argc, char ***argv, pd_replica **out, int *rank, int *nranks) {
  *out = NULL;
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    pd_log(PD_LOG_ERROR, "replicas: MPI_Init_thread failed");
    return PD_EIO;
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    pd_log(PD_LOG_ERROR,
           "replicas: this MPI library gives thread level %d, below "
           "MPI_THREAD_SERIALIZED (the communication thread is not the main thread)",
           provided);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return PD_EIO;
  }
  pd_replica *x = calloc(1, sizeof *x);
  if (!x || pthread_mutex_init(&x->lock, NULL) != 0 || pthread_cond_init(&x->cond, NULL) != 0) {
    pd_log(PD_LOG_ERROR, "replicas: out of memory");
    MPI_Abort(MPI_COMM_WORLD, 1);
    return PD_EIO;
  }
  /* Our own communicator, so no library traffic can match our wildcard receives; its
   * errors come back to us (the default, MPI_ERRORS_ARE_FATAL, aborts every rank). */
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_dup(MPI_COMM_WORLD, &x->comm);
  MPI_Comm_set_errhandler(x->comm, MPI_ERRORS_RETURN);
  MPI_Comm_dup(MPI_COMM_WORLD, &x->parts_comm);
  MPI_Comm_set_errhandler(x->parts_comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(x->comm, &x->link.rank);
  MPI_Comm_size(x->comm, &x->link.nranks);
  x->link.ctx = x;
  x->link.job_added = pd__hook_job;
  x->link.job_ended = pd__hook_end;
  x->link.published = pd__hook_root;
  x->link.forward = pd__hook_stat;
  x->grace_s = 10;
  *rank = x->link.rank;
  *nranks = x->link.nranks;
  *out = x;
  return PD_OK;
}

pd_replica_link *pd_replica_link_of(pd_replica *x) {
  return &x->link;
}

int pd_replica_agree(pd_replica *x, int ok) {
  int mine = ok ? 1 : 0, all = 0;
  if (MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, x->comm) != MPI_SUCCESS) return 0;
  return all;
}

int pd_replica_exchange(pd_replica *x, const pd_replica_view *mine, pd_replica_view *all) {
  if (MPI_Allgather(mine, (int)sizeof *mine, MPI_BYTE, all, (int)sizeof *mine, MPI_BYTE, x->comm) !=
      MPI_SUCCESS) {
    pd_log(PD_LOG_ERROR, "replicas: MPI_Allgather of the state directories' contents failed");
    return PD_EIO;
  }
  return PD_OK;
}

int pd_replica_share_snapshots(pd_replica *x, const char *const *dirs, int old_nranks,
                               pd_snap_bytes *out, uint64_t *floor, int *received) {
  const int me = x->link.rank, n = x->link.nranks;
  unsigned char *have = calloc((size_t)n * (size_t)old_nranks, 1);
  int rc = have && dirs && out ? PD_OK : PD_ENOMEM;
  *received = 0;
  if (rc == PD_OK)
    for (int k = 0; k < old_nranks; k++) out[k] = (pd_snap_bytes){NULL, 0};
  /* Which old files each rank can read: every rank must call every collective below in the
   * same order, so a failure is agreed on before each step, never met alone. */
  unsigned char *mine = rc == PD_OK ? have + (size_t)me * (size_t)old_nranks : NULL;
  for (int k = 0; mine && k < old_nranks; k++) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dirs[k], PD_SNAPSHOT_FILE);
    mine[k] = access(path, R_OK) == 0;
  }
  if (!pd_replica_agree(x, rc == PD_OK)) {
    free(have);
    return rc == PD_OK ? PD_ENOMEM : rc;
  }
  uint64_t top = 0;
  if (MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, have, old_nranks, MPI_UNSIGNED_CHAR,
                    x->comm) != MPI_SUCCESS ||
      MPI_Allreduce(floor, &top, 1, MPI_UINT64_T, MPI_MAX, x->comm) != MPI_SUCCESS)
    rc = PD_EIO;
  *floor = top;
  for (int k = 0; rc == PD_OK && k < old_nranks; k++) {
    /* The sender: old rank k's own successor when it has the file (its directory is its
     * own), else the lowest rank that has it; none: missing (the reader says so). */
    int from = k < n && have[(size_t)k * (size_t)old_nranks + (size_t)k] ? k : -1;
    for (int r = 0; from < 0 && r < n; r++)
      if (have[(size_t)r * (size_t)old_nranks + (size_t)k]) from = r;
    if (from < 0) continue;
    uint64_t len = UINT64_MAX; /* the sender could not read it after all */
    if (from == me) {
      char err[1400];
      if (pd_snapshot_load(dirs[k], &out[k].data, &out[k].len, err, sizeof err) == PD_OK)
        len = out[k].len;
      else
        pd_log(PD_LOG_ERROR, "%s", err);
    }
    if (MPI_Bcast(&len, 1, MPI_UINT64_T, from, x->comm) != MPI_SUCCESS) {
      rc = PD_EIO;
      break;
    }
    if (len == UINT64_MAX) continue; /* missing for every rank */
    if (from != me) {
      out[k].data = malloc(len ? (size_t)len : 1);
      out[k].len = (size_t)len;
    }
    if (!pd_replica_agree(x, out[k].data != NULL)) {
      rc = PD_ENOMEM;
      break;
    }
    /* In pieces of at most 1 GiB: MPI counts are ints. */
    for (uint64_t at = 0; rc == PD_OK && at < len; at += (uint64_t)1 << 30) {
      uint64_t piece = len - at < ((uint64_t)1 << 30) ? len - at : (uint64_t)1 << 30;
      if (MPI_Bcast(out[k].data + at, (int)piece, MPI_BYTE, from, x->comm) != MPI_SUCCESS)
        rc = PD_EIO;
    }
    *received += from != me;
  }
  free(have);
  if (rc != PD_OK) {
    pd_log(PD_LOG_ERROR, "replicas: the old snapshots could not be shared among the ranks: %s",
           pd_strerror(rc));
    for (int k = 0; out && k < old_nranks; k++) {
      free(out[k].data);
      out[k] = (pd_snap_bytes){NULL, 0};
    }
  }
  return rc;
}

int pd_replica_start(pd_replica *x, pd_daemon *d) {
  x->d = d;
  x->marking = 1;
  /* One rank (mpirun -np 1) has no one to talk to: no hook queues anything (the store and
   * the service call them only with more ranks), so no thread either. */
  if (x->link.nranks < 2) return PD_OK;
  /* Roots restored from this rank's snapshot go out again: the others may hold older ones
   * (their own snapshots), and nothing else would send them before the next push. */
  size_t njobs = 0;
  pd_job **jobs = pd_store_list(&d->store, &njobs); /* the server runs: jobs may come, go */
  if (!jobs) return PD_ENOMEM;
  for (size_t i = 0; i < njobs; i++) {
    pd_job *job = jobs[i];
    for (size_t k = 0; k < job->nblocks; k++) {
      pd_block *b = &job->blocks[k];
      if ((int)b->owner != x->link.rank) continue;
      pd_root *r = pd_block_root(b);
      if (r) pd__hook_root(x, b, r);
      pd_root_unref(r, &d->stats);
    }
  }
  pd_store_list_free(jobs, njobs, &d->stats);
  if (pthread_create(&x->thread, NULL, pd__comm, x) != 0) return PD_ENOMEM;
  x->started = 1;
  return PD_OK;
}

void pd_replica_quiesce(pd_replica *x) {
  if (!x) return;
  pthread_mutex_lock(&x->lock);
  x->marking = 0;
  pthread_mutex_unlock(&x->lock);
}

void pd_replica_stop(pd_replica *x, double grace_s) {
  if (!x || !x->started) return;
  pthread_mutex_lock(&x->lock);
  x->stopping = 1;
  x->grace_s = grace_s;
  pthread_cond_signal(&x->cond);
  pthread_mutex_unlock(&x->lock);
  pthread_join(x->thread, NULL);
  x->started = 0;
}

void pd_replica_finalize(pd_replica *x) {
  if (!x) return;
  /* Sends still in flight (a peer gone) are cancelled before their buffers go. */
  for (size_t i = 0; i < x->nsends; i++) {
    MPI_Cancel(&x->sends[i].req);
    MPI_Request_free(&x->sends[i].req);
    pd__msg_unref(x, x->sends[i].msg);
  }
  free(x->sends);
  /* Receives still in flight (a peer gone mid-message) cannot be cancelled once matched:
   * their requests are freed, their buffers only after MPI_Finalize, when nothing can
   * write them any more. */
  for (size_t i = 0; i < x->nrecvs; i++) {
    pd__recv *r = &x->recvs[i];
    if (r->stage == PD__HEAD) MPI_Request_free(&r->req);
    for (uint32_t k = 0; r->stage == PD__PARTS && k < r->root->nparts; k++)
      MPI_Request_free(&r->parts[k]);
  }
  while (x->head) {
    pd__msg *m = x->head;
    x->head = m->next;
    pd__msg_unref(x, m);
  }
  while (x->deferred) {
    pd__msg *m = x->deferred;
    x->deferred = m->next;
    pd__msg_unref(x, m);
  }
  MPI_Comm_free(&x->parts_comm);
  MPI_Comm_free(&x->comm);
  MPI_Finalize();
  for (size_t i = 0; i < x->nrecvs; i++) {
    free(x->recvs[i].buf);
    pd_root_unref(x->recvs[i].root, pd__stats(x));
  }
  free(x->recvs);
  pthread_cond_destroy(&x->cond);
  pthread_mutex_destroy(&x->lock);
  free(x);
}
