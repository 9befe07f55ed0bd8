/*
 * service.c -- the RPCs of precond.v1.Preconditioner and grpc.health.v1.Health/Check.
 *
 * Each handler validates its whole request before it changes anything, and answers every
 * problem with a status code and a message naming the field:
 *   INVALID_ARGUMENT     malformed bytes, wrong sizes or counts, NaN/Inf, bad options
 *   NOT_FOUND            unknown job (Fetch, GetStats) or block id (Push, Fetch)
 *   FAILED_PRECONDITION  push for a job never registered; Register of an existing job with
 *                        different tensors or options, or of an ended job's name
 *   RESOURCE_EXHAUSTED   over the message size, block count or memory limit
 *   UNIMPLEMENTED        modes other than Shampoo and K-FAC
 * Handlers hold a reference to the job they serve (pd_store_get), so an EndJob or an idle
 * expiry meanwhile frees the job only when they are done with it.
 */
#include "precondd.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#include "health.pb-c.h"
#include "precond.pb-c.h"
#include "preconditioner.h"
#include "rpc.h"

const char *const pd_method_paths[PD_M_COUNT] = {
    RPC_METHOD_REGISTER,  RPC_METHOD_PUSH_STATISTICS, RPC_METHOD_FETCH_PRECONDITIONERS,
    RPC_METHOD_GET_STATS, RPC_METHOD_HEALTH_CHECK,    RPC_METHOD_END_JOB,
    RPC_METHOD_OPEN_SHM};

static const ProtobufCMessageDescriptor *const pd__req_desc[PD_M_COUNT] = {
    &precond__v1__register_request__descriptor,
    &precond__v1__push_request__descriptor,
    &precond__v1__fetch_request__descriptor,
    &precond__v1__stats_request__descriptor,
    &grpc__health__v1__health_check_request__descriptor,
    &precond__v1__end_job_request__descriptor,
    &precond__v1__shm_open_request__descriptor};

static void pd__fail(pd_reply *rep, grpc_status_code code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static void pd__fail(pd_reply *rep, grpc_status_code code, const char *fmt, ...) {
  rep->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rep->message, sizeof rep->message, fmt, ap);
  va_end(ap);
}

/* Packs an OK response into rep (or turns rep into an error if that fails). */
static void pd__answer(pd_daemon *d, pd_reply *rep, const ProtobufCMessage *msg) {
  int rc = rpc_pack(msg, d->cfg.max_message_bytes, &rep->payload);
  if (rc == RPC_ETOOBIG) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED,
             "response above the message size limit (%zu bytes, --max-message-mb)",
             d->cfg.max_message_bytes);
    return;
  }
  if (rc != RPC_OK) {
    pd__fail(rep, GRPC_STATUS_INTERNAL, "packing the response failed: %s", rpc_strerror(rc));
    return;
  }
  rep->code = GRPC_STATUS_OK;
  atomic_fetch_add(&d->stats.bytes_out, grpc_byte_buffer_length(rep->payload));
}

/* ---- unknown and ended jobs ----------------------------------------------------------- */

/* "by EndJob at 2026-01-01T12:00:00Z" for an ended name's record. */
static void pd__ended_how(const pd_ended_job *e, char *out, size_t len) {
  time_t t = (time_t)e->ended_at;
  struct tm tm;
  char when[32] = "?";
  if (gmtime_r(&t, &tm)) strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  snprintf(out, len, "%s at %s", e->how == PD_ENDED_IDLE ? "by the idle expiry" : "by EndJob",
           when);
}

/* Fails rep with code for a call naming a job the store does not list: "is not registered"
 * plus hint, or, if the name is one of an ended job, when and how it ended (a worker that
 * registers it again is refused too, see pd__register). */
static void pd__unknown_job(pd_daemon *d, pd_reply *rep, grpc_status_code code, const char *job,
                            const char *hint) {
  pd_ended_job e;
  if (!pd_store_ended(&d->store, job, &e)) {
    pd__fail(rep, code, "job: \"%s\" is not registered%s", job, hint);
    return;
  }
  char how[96];
  pd__ended_how(&e, how, sizeof how);
  pd__fail(rep, code,
           "job: \"%s\" was ended %s; its name is refused until a Register sets "
           "reuse_ended_job",
           job, how);
}

/* ---- Register ------------------------------------------------------------------------- */

/* The daemon's mode ids are the wire's Mode values. */
_Static_assert((int)PD_MODE_SHAMPOO == (int)PRECOND__V1__MODE__MODE_SHAMPOO, "mode ids");
_Static_assert((int)PD_MODE_KFAC == (int)PRECOND__V1__MODE__MODE_KFAC, "mode ids");
_Static_assert((int)PD_MODE_ABS == (int)PRECOND__V1__MODE__MODE_ABS, "mode ids");
/* Methods travel as the wire's Method and are used as pc_method (client.c checks its
 * precond_method against the wire the same way). */
_Static_assert((int)PC_METHOD_NEWTON == (int)PRECOND__V1__METHOD__METHOD_NEWTON, "methods");
_Static_assert((int)PC_METHOD_NEWTON_TEXTBOOK == (int)PRECOND__V1__METHOD__METHOD_NEWTON_TEXTBOOK,
               "methods");
_Static_assert((int)PC_METHOD_EIGH == (int)PRECOND__V1__METHOD__METHOD_EIGH, "methods");
/* K-FAC's inverse methods travel as the wire's KfacInverse. */
_Static_assert((int)PD_KFAC_INVERSE_AUTO == (int)PRECOND__V1__KFAC_INVERSE__KFAC_INVERSE_AUTO &&
                   (int)PD_KFAC_INVERSE_NEWTON ==
                       (int)PRECOND__V1__KFAC_INVERSE__KFAC_INVERSE_NEWTON,
               "K-FAC inverse methods");

/* The request's mode and its options decoded into the daemon's own struct (zeroed first:
 * options compare bytewise; zero fields take the mode's defaults in resolve). PD_EINVAL for
 * a mode the daemon does not serve over the wire; PD_ELIMIT (message in why) for another
 * mode's options in the request. */
static int pd__decode_mode(const Precond__V1__RegisterRequest *req, const pd_mode **mode,
                           unsigned char *opts, char *why, size_t len) {
  memset(opts, 0, PD_MODE_OPTS_MAX);
  if (req->mode == PRECOND__V1__MODE__MODE_SHAMPOO && req->kfac) {
    snprintf(why, len, "kfac: K-FAC options on a Shampoo job (mode MODE_SHAMPOO)");
    return PD_ELIMIT;
  }
  if (req->mode == PRECOND__V1__MODE__MODE_KFAC && req->shampoo) {
    snprintf(why, len, "shampoo: Shampoo options on a K-FAC job (mode MODE_KFAC)");
    return PD_ELIMIT;
  }
  switch (req->mode) {
    case PRECOND__V1__MODE__MODE_KFAC: {
      pd_kfac_opts *o = (pd_kfac_opts *)(void *)opts;
      const Precond__V1__KfacOptions *in = req->kfac;
      if (in) {
        o->factor_decay = in->factor_decay;
        o->damping = in->damping;
        o->inv_every = in->inv_every;
        o->no_pi_damping = in->no_pi_damping ? 1 : 0;
        o->inverse = (int)in->inverse;
        o->max_order = in->max_order;
      }
      *mode = &pd_mode_kfac;
      return PD_OK;
    }
    case PRECOND__V1__MODE__MODE_SHAMPOO: {
      pd_shampoo_opts *o = (pd_shampoo_opts *)(void *)opts;
      const Precond__V1__ShampooOptions *in = req->shampoo;
      if (in) {
        o->block_size = in->block_size;
        o->skip_limit = in->skip_limit;
        o->beta2 = in->beta2;
        o->root_exponent = in->root_exponent;
        o->epsilon = in->epsilon;
        o->method = (int)in->method;
        o->root_every = in->root_every;
      }
      *mode = &pd_mode_shampoo;
      return PD_OK;
    }
    default:
      return PD_EINVAL;
  }
}

static void pd__register(pd_daemon *d, const Precond__V1__RegisterRequest *req, pd_reply *rep) {
  char why[400];
  if (!req->job || !*req->job) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "job: empty");
    return;
  }
  const pd_mode *mode = NULL;
  _Alignas(max_align_t) unsigned char opts[PD_MODE_OPTS_MAX];
  int drc = pd__decode_mode(req, &mode, opts, why, sizeof why);
  if (drc == PD_ELIMIT) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "%s", why);
    return;
  }
  if (drc != PD_OK) {
    pd__fail(rep, GRPC_STATUS_UNIMPLEMENTED, "mode: %d is not implemented (Shampoo and K-FAC only)",
             (int)req->mode);
    return;
  }
  if (mode->resolve(opts, why, sizeof why) != PD_OK) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "%s", why);
    return;
  }
  pd_tensor *tensors = calloc(req->n_tensors ? req->n_tensors : 1, sizeof *tensors);
  pd_job *job = NULL;  /* built here, until the store takes it */
  pd_job *held = NULL; /* this call's reference to the job in the store */
  Precond__V1__BlockInfo *infos = NULL;
  Precond__V1__BlockInfo **info_ptrs = NULL;
  if (!tensors) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  for (size_t i = 0; i < req->n_tensors; i++) {
    tensors[i].name = req->tensors[i]->name;
    tensors[i].rank = req->tensors[i]->n_shape > 64 ? 65 : (int)req->tensors[i]->n_shape;
    tensors[i].dims = req->tensors[i]->shape;
  }
  int rc = pd_job_build(req->job, mode, opts, req->n_tensors, tensors, d->cfg.max_blocks_per_job,
                        &job, why, sizeof why);
  if (rc != PD_OK) {
    pd__fail(rep, rc == PD_EINVAL ? GRPC_STATUS_INVALID_ARGUMENT : GRPC_STATUS_RESOURCE_EXHAUSTED,
             "%s", why);
    goto cleanup;
  }
  const pd_replica_link *link = d->store.link;
  if (link && link->nranks > 1 && job->nblocks < (size_t)link->nranks) {
    pd__fail(rep, GRPC_STATUS_FAILED_PRECONDITION,
             "tensors: the job has %zu units for %d daemon replicas: every replica needs at "
             "least one (start fewer ranks: mpirun -np %zu at most)",
             job->nblocks, link->nranks, job->nblocks);
    goto cleanup;
  }
  if (pd_store_job_over_limit(&d->store, job)) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED,
             "job \"%s\": needs %zu bytes for its records, statistics and roots, above the "
             "per-job memory limit of %zu bytes (--job-memory-limit-mb)",
             req->job, pd_job_bytes(job), d->store.job_memory_limit);
    goto cleanup;
  }
  pd_job *existing = NULL;
  pd_ended_job ended;
  rc = pd_store_register(&d->store, job, req->reuse_ended_job, &existing, &ended);
  if (rc == PD_EENDED) {
    char how[96];
    pd__ended_how(&ended, how, sizeof how);
    pd__fail(rep, GRPC_STATUS_FAILED_PRECONDITION,
             "job: \"%s\" was ended %s, and its name is refused so that a worker still "
             "running cannot bring it back; to start it again from zero set "
             "reuse_ended_job (libprecond: precond_options.reuse_ended_job), or use another "
             "job name",
             req->job, how);
    goto cleanup;
  }
  if (rc == PD_ELIMIT) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED,
             "tensors: the job needs %zu bytes for its records, statistics and roots (and %zu "
             "of scratch to compute its largest block), above what is left of the memory "
             "limit of %zu bytes (--memory-limit-mb), or the daemon holds %u jobs already",
             pd_job_bytes(job), job->scratch_max, d->cfg.memory_limit_bytes, PD_MAX_JOBS);
    goto cleanup;
  }
  if (rc != PD_OK) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory registering the job");
    goto cleanup;
  }
  if (existing) {
    held = existing; /* the reference pd_store_add took for us */
    if (!pd_job_same(existing, job)) {
      pd__fail(rep, GRPC_STATUS_FAILED_PRECONDITION,
               "job: \"%s\" is already registered with different tensors or options", req->job);
      goto cleanup;
    }
    pd_job_free(job, &d->stats); /* a restarted worker: answer with the job we hold */
  } else {
    held = job; /* owned by the store now; this call takes its own reference */
    pd_job_ref(held);
    char how[256];
    held->mode->describe(held->opts, how, sizeof how);
    pd_log(PD_LOG_INFO, "registered job %s (%s: %s): %zu tensors, %zu units, %zu diagonal",
           held->name, held->mode->name, how, held->ntensors, held->nblocks, held->ndiag);
    if (link && link->nranks > 1) link->job_added(link->ctx, held); /* the other replicas */
  }
  job = NULL;
  pd_job_note_worker(held, req->worker);

  Precond__V1__RegisterResponse resp = PRECOND__V1__REGISTER_RESPONSE__INIT;
  infos = calloc(held->nblocks ? held->nblocks : 1, sizeof *infos);
  info_ptrs = calloc(held->nblocks ? held->nblocks : 1, sizeof *info_ptrs);
  if (!infos || !info_ptrs) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto cleanup;
  }
  for (size_t i = 0; i < held->nblocks; i++) {
    const pd_block *b = &held->blocks[i];
    precond__v1__block_info__init(&infos[i]);
    infos[i].block_id = b->id;
    infos[i].tensor = b->tensor;
    infos[i].row0 = b->row0;
    infos[i].rows = b->rows;
    infos[i].col0 = b->col0;
    infos[i].cols = b->cols;
    infos[i].owner = (int32_t)b->owner;
    info_ptrs[i] = &infos[i];
  }
  resp.n_blocks = held->nblocks;
  resp.blocks = info_ptrs;
  resp.n_diagonal_tensors = held->ndiag;
  resp.diagonal_tensors = held->diag;
  pthread_mutex_lock(&held->lock);
  resp.resumed_step = held->last_step;
  resp.daemon_epoch = d->store.epoch;
  pthread_mutex_unlock(&held->lock);
  pd__answer(d, rep, &resp.base);

cleanup:
  if (job) pd_job_free(job, &d->stats);
  pd_job_unref(held, &d->stats);
  free(tensors);
  free(infos);
  free(info_ptrs);
}

/* ---- PushStatistics ------------------------------------------------------------------- */

/* The wire's fields of a unit's parts, by index: BlockStatistics and BlockRoots carry part 0
 * as left and part 1 as right (Shampoo), as a and g, a_inv and g_inv (K-FAC). */
static const char *const pd__part_names[PD_MAX_PARTS] = {"left", "right"};
static const char *const pd__kfac_part_names[PD_MAX_PARTS] = {"a", "g"};

/* Where block i of a push keeps its parts for a job of mode id, in wire[] and their field
 * names in names[]; 1, else 0 with rep failed when the block carries the other mode's
 * fields (the request is refused whole, nothing stored). */
static int pd__push_parts(const pd_job *job, const Precond__V1__BlockStatistics *bs, size_t i,
                          const Precond__V1__PackedMatrix **wire, const char *const **names,
                          pd_reply *rep) {
  int kfac = job->mode->id == PD_MODE_KFAC;
  const Precond__V1__PackedMatrix *foreign =
      kfac ? (bs->left ? bs->left : bs->right) : (bs->a ? bs->a : bs->g);
  if (foreign) {
    const char *field = kfac ? (bs->left ? "left" : "right") : (bs->a ? "a" : "g");
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
             "blocks[%zu].%s: a %s field on a %s job; nothing of this push was stored", i, field,
             kfac ? "Shampoo" : "K-FAC", job->mode->name);
    return 0;
  }
  wire[0] = kfac ? bs->a : bs->left;
  wire[1] = kfac ? bs->g : bs->right;
  *names = kfac ? pd__kfac_part_names : pd__part_names;
  return 1;
}

/* Decodes one packed factor into fp32. *vals points into m's bytes when they can be used
 * as they are (fp32 on a little-endian host, aligned), else into a buffer put in *owned.
 * *scan: the values' rpc_f32_scan, taken here unless known (nonzero: a region's copy found
 * them finite already) says it; a NaN or Inf fails the push. */
static int pd__decode(const Precond__V1__PackedMatrix *m, size_t n, size_t i, const char *side,
                      int known, const float **vals, float **owned, uint8_t *scan, pd_reply *rep) {
  *vals = NULL;
  *owned = NULL;
  if (!m) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "blocks[%zu].%s: missing", i, side);
    return -1;
  }
  if (m->n != n) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
             "blocks[%zu].%s.n: %u, but the block's factor is %zu x %zu", i, side, m->n, n, n);
    return -1;
  }
  size_t count = pc_packed_len(n);
  size_t width = rpc_packed_width((int)m->encoding);
  if (width == 0) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "blocks[%zu].%s.encoding: %d is unknown", i, side,
             (int)m->encoding);
    return -1;
  }
  if (m->data.len != count * width) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
             "blocks[%zu].%s.data: %zu bytes, expected %zu (%zu values of %zu bytes)", i, side,
             m->data.len, count * width, count, width);
    return -1;
  }
  /* The wire's bytes are the values themselves where the codec says so: no copy. */
  if (rpc_packed_native((int)m->encoding) && ((uintptr_t)m->data.data % _Alignof(float)) == 0) {
    *vals = (const float *)(const void *)m->data.data;
  } else {
    float *buf = malloc(count * sizeof *buf);
    if (!buf || rpc_packed_decode((int)m->encoding, m->data.data, m->data.len, count, buf)) {
      free(buf);
      pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory decoding blocks[%zu]", i);
      return -1;
    }
    *vals = buf;
    *owned = buf;
  }
  *scan = (uint8_t)(known != RPC_F32_BAD ? known : rpc_f32_scan(count, *vals));
  if (*scan == RPC_F32_BAD) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
             "blocks[%zu].%s.data: NaN or Inf in the statistics; nothing of this push was "
             "stored",
             i, side);
    return -1;
  }
  return 0;
}

/* ---- shared memory (the same-host data path, host/shm.c) -------------------------------- */

/* The region a request names, with a reference (pd_shm_put), or NULL with rep failed. */
static pd_shm_session *pd__shm_session(pd_daemon *d, const Precond__V1__ShmSession *w,
                                       pd_reply *rep) {
  pd_shm_session *s = pd_shm_get(&d->shm, w->id, w->secret.data, w->secret.len);
  if (!s)
    pd__fail(rep, GRPC_STATUS_FAILED_PRECONDITION,
             "shm: no region %llu with this secret here (freed, or another daemon's): open a "
             "new one or send the bytes",
             (unsigned long long)w->id);
  return s;
}

/* A push's matrices in a region: the session, their copies, and what the copy found in
 * each (rpc_f32_scan's RPC_F32_*; PD_SHM_PARTS per block, in pd__shm_part_names' order).
 * A push read in place (direct: pd_job_push_into) has, instead of copies of its unchecked
 * fp32 matrices, pointers into the region (PD__IN_PLACE in finite[]), and out[]: a buffer
 * from the session's spares per part of each block (PD_MAX_PARTS per block) for the folded
 * statistics. */
#define PD_SHM_PARTS 4
#define PD__IN_PLACE 3 /* finite[]: read in place, checked in the fold */
static const char *const pd__shm_part_names[PD_SHM_PARTS] = {"left", "right", "a", "g"};
typedef struct {
  pd_shm_session *s;
  pd_shm_in in;
  uint8_t *finite;
  int direct;
  int vouched; /* direct, every part read in place and vouched, the region holds such slots */
  float **out;
  size_t nout;
  Precond__V1__PushRequest *req; /* for pd__shm_intact */
  size_t changed;                /* the block pd__shm_intact found overwritten */
  const char *changed_part;
} pd__shm_push;

static void pd__shm_parts(Precond__V1__BlockStatistics *bs,
                          Precond__V1__PackedMatrix *part[PD_SHM_PARTS]) {
  part[0] = bs->left;
  part[1] = bs->right;
  part[2] = bs->a;
  part[3] = bs->g;
}

/* Whether a push of job can be read in place: its mode folds with the checks in one pass
 * and every block it names is folded here (none forwarded to another replica). */
static int pd__push_direct_ok(const pd_job *job, const Precond__V1__PushRequest *req) {
  if (!job || !job->mode->fold_into) return 0;
  for (size_t i = 0; i < req->n_blocks; i++) {
    uint32_t id = req->blocks[i]->block_id;
    if (id >= job->nblocks || !pd_replica_owns(job->link, &job->blocks[id])) return 0;
  }
  return 1;
}

/* The spares of a push read in place: a buffer per part the job's mode folds, of the order
 * the part names (checked against the block's later; a wrong one fails there). 0, or -1 when
 * the session cannot give them all (the push is copied instead). */
static int pd__shm_take_out(pd_daemon *d, const pd_job *job, Precond__V1__PushRequest *req,
                            pd__shm_push *sp) {
  sp->nout = PD_MAX_PARTS * req->n_blocks;
  sp->out = calloc(sp->nout ? sp->nout : 1, sizeof *sp->out);
  if (!sp->out) return -1;
  int first = job->mode->id == PD_MODE_KFAC ? 2 : 0;
  for (size_t i = 0; i < req->n_blocks; i++) {
    Precond__V1__PackedMatrix *part[PD_SHM_PARTS];
    pd__shm_parts(req->blocks[i], part);
    for (int k = 0; k < PD_MAX_PARTS; k++) {
      const Precond__V1__PackedMatrix *m = part[first + k];
      const pd_block *b = &job->blocks[req->blocks[i]->block_id];
      if (k >= (int)b->nparts || !m) continue; /* refused at decoding */
      if (m->n != b->order[k] || !(sp->out[PD_MAX_PARTS * i + k] =
                                       pd_shm_spare_take(&d->shm, &sp->in, pc_packed_len(m->n))))
        return -1;
    }
  }
  return 0;
}

/* Gives the push's spares back (those it took, or the statistics they replaced). */
static void pd__shm_give_out(pd_daemon *d, Precond__V1__PushRequest *req, pd__shm_push *sp,
                             const pd_job *job) {
  int first = job && job->mode->id == PD_MODE_KFAC ? 2 : 0;
  for (size_t i = 0; sp->out && i < req->n_blocks; i++) {
    Precond__V1__PackedMatrix *part[PD_SHM_PARTS];
    pd__shm_parts(req->blocks[i], part);
    for (int k = 0; k < PD_MAX_PARTS; k++)
      if (sp->out[PD_MAX_PARTS * i + k]) /* of its part's order, which the take checked */
        pd_shm_spare_give(&d->shm, &sp->in, sp->out[PD_MAX_PARTS * i + k],
                          pc_packed_len(part[first + k]->n));
  }
  free(sp->out);
  sp->out = NULL;
}

/* pd_job_push_into's intact: every stamped reference of the push still the client's. */
static int pd__shm_intact(void *ctx) {
  pd__shm_push *sp = ctx;
  for (size_t i = 0; i < sp->req->n_blocks; i++) {
    Precond__V1__PackedMatrix *part[PD_SHM_PARTS];
    pd__shm_parts(sp->req->blocks[i], part);
    for (int k = 0; k < PD_SHM_PARTS; k++)
      if (part[k] && part[k]->shm &&
          !pd_shm_intact(&sp->in, part[k]->shm->offset, part[k]->shm->seq)) {
        sp->changed = i;
        sp->changed_part = pd__shm_part_names[k];
        return 0;
      }
  }
  return 1;
}

/* Replaces every shm reference of a push by the bytes it names: read in place when the push
 * can be (direct_ok, pd__push_direct_ok, and the session's spares are free: unchecked fp32
 * references, checked in the fold that reads them), else copied out of the region and
 * checked against their CRC-32C. From here on the request is what a gRPC push of the same
 * bytes would be, and pd__push's own checks (sizes, encodings, NaN/Inf) apply to it
 * unchanged; the NaN/Inf check (and the overflow bound) is taken in the copy for fp32
 * matrices found all finite (sp->finite), and again in pd__decode for the rest, so a bad
 * value is reported where the bytes path reports it. 0, or -1 with rep failed naming the
 * field. The copies are the session's (sp->in) or the request's; pd__shm_push_done, always,
 * after the push. */
static int pd__shm_push_in(pd_daemon *d, Precond__V1__PushRequest *req, const pd_job *job,
                           int direct_ok, pd__shm_push *sp, pd_reply *rep) {
  memset(sp, 0, sizeof *sp);
  sp->req = req;
  size_t total = 0, any = 0;
  for (size_t i = 0; i < req->n_blocks; i++) {
    Precond__V1__PackedMatrix *part[PD_SHM_PARTS];
    pd__shm_parts(req->blocks[i], part);
    for (int k = 0; k < PD_SHM_PARTS; k++) {
      if (!part[k] || !part[k]->shm) continue;
      if (part[k]->data.len > 0) {
        pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "blocks[%zu].%s: both data and shm are set", i,
                 pd__shm_part_names[k]);
        return -1;
      }
      if (!req->shm) {
        pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
                 "blocks[%zu].%s.shm: the request names no region (shm)", i, pd__shm_part_names[k]);
        return -1;
      }
      any++;
      uint64_t len = part[k]->shm->length;
      /* Sums past the half go to malloc'd copies (pd_shm_in_begin): no overflow here. */
      total += len > ((uint64_t)1 << 40)
                   ? ((size_t)1 << 40)
                   : (size_t)(len + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
    }
  }
  if (any == 0) return 0;
  if (!(sp->s = pd__shm_session(d, req->shm, rep))) return -1;
  sp->finite = calloc(PD_SHM_PARTS * req->n_blocks, 1);
  if (!sp->finite) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return -1;
  }
  if (direct_ok && pd_shm_in_hold(sp->s, &sp->in)) {
    sp->direct = pd__shm_take_out(d, job, req, sp) == 0;
    if (!sp->direct) {
      pd__shm_give_out(d, req, sp, job);
      pd_shm_in_end(&sp->in);
    }
  }
  if (!sp->direct) pd_shm_in_begin(&d->shm, sp->s, total, &sp->in);
  size_t nparts = 0, nvouched = 0;
  for (size_t i = 0; i < req->n_blocks; i++) {
    Precond__V1__PackedMatrix *part[PD_SHM_PARTS];
    pd__shm_parts(req->blocks[i], part);
    for (int k = 0; k < PD_SHM_PARTS; k++) {
      Precond__V1__PackedMatrix *m = part[k];
      nparts += m != NULL;
      if (!m || !m->shm) continue;
      const char *why = NULL;
      uint8_t *bytes = NULL;
      int finite = 0;
      int fp32 = rpc_packed_native((int)m->encoding);
      const Precond__V1__ShmRef *ref = m->shm;
      int e;
      if (sp->direct && ref->unchecked && fp32) {
        const uint8_t *at = NULL;
        e = pd_shm_ref_in(&sp->in, ref->offset, ref->length, (size_t)ref->length, &at, &why);
        bytes = (uint8_t *)(uintptr_t)at;
        finite = PD__IN_PLACE;
        nvouched += ref->vouched;
      } else {
        e = pd_shm_copy_in(&sp->in, ref->offset, ref->length, ref->seq,
                           ref->unchecked ? NULL : &ref->crc32c, (size_t)ref->length, fp32, &bytes,
                           &finite, &why);
      }
      if (e != PD_OK) {
        pd__fail(rep,
                 e == PD_ENOMEM ? GRPC_STATUS_RESOURCE_EXHAUSTED : GRPC_STATUS_INVALID_ARGUMENT,
                 "blocks[%zu].%s.shm: %s; nothing of this push was stored", i,
                 pd__shm_part_names[k], why);
        return -1;
      }
      m->data.data = bytes;
      m->data.len = (size_t)m->shm->length;
      sp->finite[PD_SHM_PARTS * i + k] = (uint8_t)finite;
    }
  }
  sp->vouched = nvouched > 0 && nvouched == nparts && pd_shm_holds_vouched(sp->s);
  return 0;
}

/* After a push (whatever its outcome): bytes in the session's buffer or read in place are
 * detached from the request (the rest are the request's, freed with it), the spares given
 * back, the buffer and the session let go. */
static void pd__shm_push_done(pd_daemon *d, Precond__V1__PushRequest *req, const pd_job *job,
                              pd__shm_push *sp) {
  for (size_t i = 0; sp->finite && i < req->n_blocks; i++) {
    Precond__V1__PackedMatrix *part[PD_SHM_PARTS];
    pd__shm_parts(req->blocks[i], part);
    for (int k = 0; k < PD_SHM_PARTS; k++)
      if (part[k] && part[k]->shm &&
          (sp->in.buf || sp->finite[PD_SHM_PARTS * i + k] == PD__IN_PLACE)) {
        part[k]->data.data = NULL;
        part[k]->data.len = 0;
      }
  }
  if (sp->out) pd__shm_give_out(d, req, sp, job);
  if (sp->s) pd_shm_in_end(&sp->in);
  pd_shm_put(&d->shm, sp->s);
  free(sp->finite);
  memset(sp, 0, sizeof *sp);
}

static void pd__open_shm(pd_daemon *d, const Precond__V1__ShmOpenRequest *req, pd_reply *rep) {
  pd_shm_session *s = NULL;
  char err[256];
  int rc = pd_shm_open(&d->shm, req->bytes, &s, err, sizeof err);
  if (rc != PD_OK) {
    pd__fail(rep,
             rc == PD_EINVAL && d->shm.dir[0] ? GRPC_STATUS_INVALID_ARGUMENT
             : rc == PD_EINVAL                ? GRPC_STATUS_UNIMPLEMENTED
             : rc == PD_EIO                   ? GRPC_STATUS_INTERNAL
                                              : GRPC_STATUS_RESOURCE_EXHAUSTED,
             "%s", err);
    return;
  }
  Precond__V1__ShmOpenResponse resp = PRECOND__V1__SHM_OPEN_RESPONSE__INIT;
  const unsigned char *secret;
  const char *path;
  size_t bytes;
  pd_shm_describe(s, &resp.id, &secret, &path, &bytes);
  resp.secret.data = (uint8_t *)(uintptr_t)secret;
  resp.secret.len = RPC_SHM_SECRET_BYTES;
  resp.path = (char *)(uintptr_t)path;
  resp.bytes = bytes;
  const char *roots_path = NULL;
  size_t roots_bytes = 0;
  pd_shm_roots_describe(&d->shm, &roots_path, &roots_bytes);
  resp.roots_path = (char *)(uintptr_t)(roots_path ? roots_path : "");
  resp.roots_bytes = roots_bytes;
  resp.doorbell = pd_shm_bell_served(s);
  resp.doorbell_queue = resp.doorbell;
  pd_shm_set_holds_vouched(s, req->holds_vouched);
  pd__answer(d, rep, &resp.base);
  pd_shm_put(&d->shm, s);
}

static void pd__push(pd_daemon *d, Precond__V1__PushRequest *req, pd_reply *rep) {
  pd__shm_push sp;
  memset(&sp, 0, sizeof sp);
  if (!req->job || !*req->job) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "job: empty");
    goto rejected;
  }
  if (req->step > PD_MAX_STEP) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "step: %llu is above the limit 2^53",
             (unsigned long long)req->step);
    goto rejected;
  }
  pd_job *job = pd_store_get(&d->store, req->job, 1);
  if (pd__shm_push_in(d, req, job, pd__push_direct_ok(job, req), &sp, rep) != 0) {
    pd__shm_push_done(d, req, job, &sp);
    pd_job_unref(job, &d->stats);
    goto rejected;
  }
  if (!job) {
    pd__unknown_job(d, rep, GRPC_STATUS_FAILED_PRECONDITION, req->job,
                    " (call Register before PushStatistics)");
    pd__shm_push_done(d, req, job, &sp);
    goto rejected;
  }
  size_t nb = req->n_blocks;
  /* parts[PD_MAX_PARTS * i + k]: part k of the i-th block pushed, fp32. */
  const float **parts = calloc(nb ? PD_MAX_PARTS * nb : 1, sizeof *parts);
  const float **local = calloc(nb ? PD_MAX_PARTS * nb : 1, sizeof *local); /* folded here */
  uint8_t *scan = calloc(nb ? PD_MAX_PARTS * nb : 1, 1);       /* rpc_f32_scan of parts[] */
  uint8_t *local_scan = calloc(nb ? PD_MAX_PARTS * nb : 1, 1); /* of local[] */
  float **owned = calloc(nb ? PD_MAX_PARTS * nb : 1, sizeof *owned);
  uint8_t *seen = calloc(job->nblocks ? job->nblocks : 1, 1);
  pd_block **blocks = calloc(nb ? nb : 1, sizeof *blocks);
  int ok = 0;
  if (!parts || !local || !scan || !local_scan || !owned || !seen || !blocks) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto cleanup;
  }
  /* The whole request is checked before any of it is stored. */
  for (size_t i = 0; i < nb; i++) {
    const Precond__V1__BlockStatistics *bs = req->blocks[i];
    if (bs->block_id >= job->nblocks) {
      pd__fail(rep, GRPC_STATUS_NOT_FOUND,
               "blocks[%zu].block_id: %u is not a block of job \"%s\" (it has %zu)", i,
               bs->block_id, job->name, job->nblocks);
      goto cleanup;
    }
    if (seen[bs->block_id]) {
      pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
               "blocks[%zu].block_id: %u appears twice in one push", i, bs->block_id);
      goto cleanup;
    }
    seen[bs->block_id] = 1;
    const pd_block *b = &job->blocks[bs->block_id];
    const Precond__V1__PackedMatrix *wire[PD_MAX_PARTS];
    const char *const *names;
    if (!pd__push_parts(job, bs, i, wire, &names, rep)) goto cleanup;
    /* Part k is left or right (Shampoo), a or g (K-FAC) in the region's order. */
    size_t first = PD_SHM_PARTS * i + (job->mode->id == PD_MODE_KFAC ? 2 : 0);
    for (uint32_t k = 0; k < b->nparts; k++)
      if (pd__decode(wire[k], b->order[k], i, names[k],
                     sp.direct   ? PD__IN_PLACE
                     : sp.finite ? sp.finite[first + k]
                                 : 0,
                     &parts[PD_MAX_PARTS * i + k], &owned[PD_MAX_PARTS * i + k],
                     &scan[PD_MAX_PARTS * i + k], rep) != 0)
        goto cleanup;
  }
  /* Units another replica owns go to it (replica_plan.c); the rest are folded here. */
  size_t nlocal = 0;
  for (size_t i = 0; i < nb; i++) {
    pd_block *b = &job->blocks[req->blocks[i]->block_id];
    if (!pd_replica_owns(job->link, b)) continue;
    memcpy(&local[PD_MAX_PARTS * nlocal], &parts[PD_MAX_PARTS * i], sizeof *parts * PD_MAX_PARTS);
    memcpy(&local_scan[PD_MAX_PARTS * nlocal], &scan[PD_MAX_PARTS * i], PD_MAX_PARTS);
    blocks[nlocal++] = b;
  }
  pd_push_refusal no = {0, 0, PD_FOLD_OVERFLOW, 0};
  int prc;
  if (sp.direct) /* every block local (pd__push_direct_ok): local[] is parts[] */
    prc = (sp.vouched ? pd_job_push_vouched : pd_job_push_into)(
        job, nlocal, blocks, local, sp.out, req->step, &d->stats, pd__shm_intact, &sp, &no);
  else
    prc = pd_job_push_scanned(job, nlocal, blocks, local, local_scan, req->step, &d->stats,
                              &no.block);
  if (prc != PD_OK) {
    const char *const *names = job->mode->id == PD_MODE_KFAC ? pd__kfac_part_names : pd__part_names;
    if (no.torn) { /* folded with no spare: nothing to undo, the statistics stay finite */
      atomic_fetch_add(&d->stats.torn_pushes, 1);
      atomic_fetch_add(&d->store.generation, 1);
    }
    if (prc == PD_ENOMEM)
      pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    else if (no.why == PD_FOLD_VOUCH) /* DATA_LOSS: folded in part, not to be sent again */
      pd__fail(rep, GRPC_STATUS_DATA_LOSS,
               "blocks[%zu].%s.shm.vouched: a value at or above 2^125 in magnitude, NaN or Inf "
               "under the vouch; the push is refused torn: its values within the vouch were "
               "folded, the statistic kept its own elsewhere (all finite)",
               no.block, names[no.part]);
    else if (no.why == PD_FOLD_CHANGED && no.torn)
      pd__fail(rep, GRPC_STATUS_DATA_LOSS,
               "blocks[%zu].%s.shm.vouched: " PD_SHM_OVERWRITTEN
               " against the region's promise (holds_vouched); the push is refused torn: it "
               "was folded as read (all finite)",
               sp.changed, sp.changed_part);
    else if (no.why == PD_FOLD_NONFINITE) /* as pd__decode says it */
      pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
               "blocks[%zu].%s.data: NaN or Inf in the statistics; nothing of this push was "
               "stored",
               no.block, names[no.part]);
    else if (no.why == PD_FOLD_CHANGED)
      pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
               "blocks[%zu].%s.shm: " PD_SHM_OVERWRITTEN "; nothing of this push was stored",
               sp.changed, sp.changed_part);
    else
      pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT,
               "block %u: adding these statistics would overflow the stored statistic to "
               "Inf; nothing of this push was stored",
               blocks[no.block]->id);
    goto cleanup;
  }
  /* The owner folds forwarded statistics under its own overflow check: past this point a
   * push is stored here and queued for the others, not all or nothing across replicas. */
  for (size_t i = 0; i < nb; i++) {
    pd_block *b = &job->blocks[req->blocks[i]->block_id];
    if (pd_replica_owns(job->link, b)) continue;
    if (job->link->forward(job->link->ctx, b, &parts[PD_MAX_PARTS * i], req->step) != PD_OK)
      pd_log(PD_LOG_ERROR, "job %s block %u: out of memory forwarding statistics to rank %u",
             job->name, b->id, b->owner);
  }
  for (size_t i = 0; i < nlocal; i++)
    if (pd_block_due(blocks[i]) && pd_sched_mark(&d->sched, blocks[i]) != PD_OK)
      pd_log(PD_LOG_ERROR, "job %s block %u: out of memory queueing it", job->name, blocks[i]->id);
  pthread_mutex_lock(&job->lock);
  if (req->step > job->last_step) job->last_step = req->step;
  pthread_mutex_unlock(&job->lock);
  atomic_fetch_add(&d->store.generation, 1);
  ok = 1;

  Precond__V1__PushResponse resp = PRECOND__V1__PUSH_RESPONSE__INIT;
  resp.accepted = (uint32_t)nb;
  resp.daemon_epoch = d->store.epoch;
  resp.resumed_step = job->resumed_step;
  pd__answer(d, rep, &resp.base);

cleanup:
  for (size_t i = 0; owned && i < PD_MAX_PARTS * nb; i++) free(owned[i]);
  free(owned);
  free(parts);
  free(local);
  free(scan);
  free(local_scan);
  free(seen);
  free(blocks);
  pd__shm_push_done(d, req, job, &sp);
  pd_job_unref(job, &d->stats);
  if (ok) return;
rejected:
  atomic_fetch_add(&d->stats.rejected_pushes, 1);
  pd_log(PD_LOG_DEBUG, "push rejected: %s", rep->message);
}

/* ---- FetchPreconditioners -------------------------------------------------------------- */

/* Fills m with root values of order n in the asked encoding: borrows vals where the codec's
 * bytes are the floats themselves (the root is referenced until the response is packed),
 * else encodes into *owned. */
static int pd__encode(Precond__V1__PackedMatrix *m, size_t n, const float *vals,
                      Precond__V1__Encoding enc, uint8_t **owned) {
  size_t count = pc_packed_len(n), width = rpc_packed_width((int)enc);
  precond__v1__packed_matrix__init(m);
  m->n = (uint32_t)n;
  m->encoding = enc;
  m->data.len = count * width;
  *owned = NULL;
  if (rpc_packed_native((int)enc)) {
    m->data.data = (uint8_t *)(uintptr_t)vals;
    return 0;
  }
  uint8_t *bytes = malloc(m->data.len ? m->data.len : 1);
  if (!bytes || rpc_packed_encode((int)enc, vals, count, bytes) != RPC_OK) {
    free(bytes);
    return -1;
  }
  *owned = bytes;
  m->data.data = bytes;
  return 0;
}

static void pd__fetch(pd_daemon *d, const Precond__V1__FetchRequest *req, pd_reply *rep) {
  if (!req->job || !*req->job) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "job: empty");
    return;
  }
  if (rpc_packed_width((int)req->encoding) == 0) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "encoding: %d is unknown", (int)req->encoding);
    return;
  }
  pd_shm_session *shm = req->shm ? pd__shm_session(d, req->shm, rep) : NULL;
  if (req->shm && !shm) return;
  pd_job *job = pd_store_get(&d->store, req->job, 1);
  if (!job) {
    pd__unknown_job(d, rep, GRPC_STATUS_NOT_FOUND, req->job, "");
    pd_shm_put(&d->shm, shm);
    return;
  }
  size_t nb = job->nblocks;
  Precond__V1__ShmRef *refs = calloc(nb ? PD_MAX_PARTS * nb : 1, sizeof *refs);
  uint64_t *have = calloc(nb ? nb : 1, sizeof *have);
  pd_root **roots = calloc(nb ? nb : 1, sizeof *roots);
  Precond__V1__BlockRoots *out = calloc(nb ? nb : 1, sizeof *out);
  Precond__V1__BlockRoots **ptrs = calloc(nb ? nb : 1, sizeof *ptrs);
  Precond__V1__PackedMatrix *mats = calloc(nb ? PD_MAX_PARTS * nb : 1, sizeof *mats);
  uint8_t **owned = calloc(nb ? PD_MAX_PARTS * nb : 1, sizeof *owned);
  size_t nout = 0;
  if (!have || !roots || !out || !ptrs || !mats || !owned || !refs) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto cleanup;
  }
  for (size_t i = 0; i < req->n_have; i++) {
    if (req->have[i]->block_id >= nb) {
      pd__fail(rep, GRPC_STATUS_NOT_FOUND,
               "have[%zu].block_id: %u is not a block of job \"%s\" (it has %zu)", i,
               req->have[i]->block_id, job->name, nb);
      goto cleanup;
    }
    have[req->have[i]->block_id] = req->have[i]->version;
  }
  /* Newer roots until the response would pass the size limit; the rest come next fetch. */
  size_t budget = d->cfg.max_message_bytes - d->cfg.max_message_bytes / 16, used = 0;
  size_t width = rpc_packed_width((int)req->encoding);
  /* With a region, roots go to the roots area when the client has it mapped (published
   * once, whoever fetches them), else to the region's answer half while this answer's fit
   * there (a wrap within one answer would overwrite its own first roots); the rest travel
   * as bytes. */
  uint64_t shm_half = 0, shm_used = 0;
  int area = shm && req->roots_area;
  if (shm) {
    const unsigned char *secret;
    const char *path;
    size_t rbytes;
    uint64_t id;
    pd_shm_describe(shm, &id, &secret, &path, &rbytes);
    shm_half = rbytes / 2;
  }
  for (size_t i = 0; i < nb; i++) {
    pd_root *r = pd_block_root(&job->blocks[i]);
    if (!r || r->version <= have[i]) {
      pd_root_unref(r, &d->stats);
      continue;
    }
    size_t bytes = 128, in_shm = 0;
    int to_shm[PD_MAX_PARTS] = {0};
    for (uint32_t k = 0; k < r->nparts; k++) {
      size_t len = pc_packed_len(r->order[k]) * width;
      size_t slot = (len + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
      if (area && pd_shm_root_fits(&d->shm, len)) {
        to_shm[k] = 2;
      } else if (shm && shm_used + in_shm + slot <= shm_half) {
        to_shm[k] = 1;
        in_shm += slot;
      } else {
        bytes += len;
      }
    }
    if (used + bytes > budget && nout > 0) {
      pd_root_unref(r, &d->stats);
      break;
    }
    used += bytes;
    shm_used += in_shm;
    roots[nout] = r;
    Precond__V1__BlockRoots *br = &out[nout];
    precond__v1__block_roots__init(br);
    br->block_id = (uint32_t)i;
    br->version = r->version;
    br->source_step = r->source_step;
    br->error = r->error;
    br->method = (Precond__V1__Method)r->method;
    br->iterations = r->iterations;
    Precond__V1__PackedMatrix **wire[PD_MAX_PARTS] = {&br->left, &br->right};
    if (job->mode->id == PD_MODE_KFAC) {
      br->method = PRECOND__V1__METHOD__METHOD_NEWTON; /* Shampoo's field: unused */
      br->inverse = (Precond__V1__KfacInverse)(r->method + 1);
      br->pi = r->aux[PD_KFAC_AUX_PI];
      wire[0] = &br->a_inv;
      wire[1] = &br->g_inv;
    }
    for (uint32_t k = 0; k < r->nparts; k++) {
      size_t m = PD_MAX_PARTS * nout + k, len = pc_packed_len(r->order[k]) * width;
      uint64_t off = 0, got = 0, seq = 0;
      uint32_t crc = 0;
      int enc = req->encoding == PRECOND__V1__ENCODING__ENCODING_BF16;
      /* A root published already needs no encoding (for bf16 a pass over it). */
      int cached = to_shm[k] == 2 &&
                   pd_shm_root_ref(&d->shm, r, k, enc, NULL, len, &off, &got, &crc, &seq) == PD_OK;
      if (cached) {
        precond__v1__packed_matrix__init(&mats[m]);
        mats[m].n = (uint32_t)r->order[k];
        mats[m].encoding = req->encoding;
        mats[m].data.len = len;
      } else if (pd__encode(&mats[m], r->order[k], r->part[k], req->encoding, &owned[m])) {
        nout++;
        pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory encoding roots");
        goto cleanup;
      }
      if (cached ||
          (to_shm[k] == 2 && pd_shm_root_ref(&d->shm, r, k, enc, mats[m].data.data, len, &off, &got,
                                             &crc, &seq) == PD_OK) ||
          (to_shm[k] == 1 && pd_shm_write_out(shm, mats[m].data.data, len, &off, &crc) == PD_OK)) {
        precond__v1__shm_ref__init(&refs[m]);
        refs[m].offset = off;
        refs[m].length = len;
        refs[m].crc32c = crc;
        refs[m].seq = seq;
        mats[m].shm = &refs[m];
        mats[m].data.data = NULL;
        mats[m].data.len = 0;
      }
      *wire[k] = &mats[m];
    }
    ptrs[nout] = br;
    nout++;
  }
  Precond__V1__FetchResponse resp = PRECOND__V1__FETCH_RESPONSE__INIT;
  resp.n_preconditioners = nout;
  resp.preconditioners = ptrs;
  resp.daemon_epoch = d->store.epoch;
  resp.resumed_step = job->resumed_step;
  pd__answer(d, rep, &resp.base);

cleanup:
  for (size_t i = 0; roots && i < nout; i++) pd_root_unref(roots[i], &d->stats);
  for (size_t i = 0; owned && i < PD_MAX_PARTS * nout; i++) free(owned[i]);
  pd_shm_put(&d->shm, shm);
  free(refs);
  free(have);
  free(roots);
  free(out);
  free(ptrs);
  free(mats);
  free(owned);
  pd_job_unref(job, &d->stats);
}

/* ---- GetStats ------------------------------------------------------------------------- */

static void pd__stale_wire(const pd_stale_summary *s, Precond__V1__StalenessStats *w) {
  w->samples = s->count;
  w->p50 = s->p50;
  w->p90 = s->p90;
  w->p99 = s->p99;
  w->max = s->max;
  w->mean = s->mean;
}

static void pd__stats(pd_daemon *d, const Precond__V1__StatsRequest *req, pd_reply *rep) {
  /* Every job listed, or the one asked for, each referenced until the answer is packed. */
  size_t njobs = 0, total_jobs;
  pd_job **jobs = NULL;
  if (req->job && *req->job) {
    pd_job *only = pd_store_get(&d->store, req->job, 0); /* a look is no activity */
    if (!only) {
      pd__unknown_job(d, rep, GRPC_STATUS_NOT_FOUND, req->job, "");
      return;
    }
    if ((jobs = malloc(sizeof *jobs)) != NULL) {
      jobs[0] = only;
      njobs = 1;
    } else {
      pd_job_unref(only, &d->stats);
    }
    pthread_rwlock_rdlock(&d->store.lock);
    total_jobs = d->store.njobs;
    pthread_rwlock_unlock(&d->store.lock);
  } else {
    jobs = pd_store_list(&d->store, &njobs);
    total_jobs = njobs;
  }
  double now = pd_now();
  size_t nblk = 0;
  for (size_t i = 0; jobs && req->blocks && i < njobs; i++) nblk += jobs[i]->nblocks;
  Precond__V1__JobStats *js = calloc(njobs ? njobs : 1, sizeof *js);
  Precond__V1__JobStats **jsp = calloc(njobs ? njobs : 1, sizeof *jsp);
  Precond__V1__BlockStats *bs = calloc(nblk ? nblk : 1, sizeof *bs);
  Precond__V1__BlockStats **bsp = calloc(nblk ? nblk : 1, sizeof *bsp);
  char *texts = calloc(nblk ? nblk : 1, sizeof jobs[0]->blocks[0].last_failure);
  Precond__V1__StalenessStats *bst = calloc(nblk ? nblk : 1, sizeof *bst);
  if (!jobs || !js || !jsp || !bs || !bsp || !texts || !bst) {
    pd__fail(rep, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto cleanup;
  }
  Precond__V1__StatsResponse resp = PRECOND__V1__STATS_RESPONSE__INIT;
  resp.version = (char *)PD_VERSION;
  resp.uptime_s = pd_now() - d->stats.start_time;
  resp.jobs = (uint32_t)total_jobs;
  resp.queue_depth = pd_sched_depth(&d->sched);
  resp.roots_computed = atomic_load(&d->stats.roots_computed);
  resp.roots_failed = atomic_load(&d->stats.roots_failed);
  pd_stats_percentiles(&d->stats, &resp.compute_ms_p50, &resp.compute_ms_p90, &resp.compute_ms_p99);
  resp.bytes_in = atomic_load(&d->stats.bytes_in);
  resp.bytes_out = atomic_load(&d->stats.bytes_out);
  int64_t mem = atomic_load(&d->stats.memory_bytes);
  resp.memory_bytes = mem > 0 ? (uint64_t)mem : 0;
  resp.rejected_pushes = atomic_load(&d->stats.rejected_pushes);
  resp.torn_pushes = atomic_load(&d->stats.torn_pushes);
  resp.vouched_pushes = atomic_load(&d->stats.vouched_pushes);
  resp.threads = (uint32_t)d->cfg.threads;
  const pd_replica_link *link = d->store.link;
  resp.replicas = link ? (uint32_t)link->nranks : 1;
  resp.rank = link ? link->rank : 0;
  resp.roots_skipped = atomic_load(&d->stats.roots_skipped);
  resp.drift_threshold = d->cfg.drift_threshold;
  Precond__V1__ReplicaStats rs = PRECOND__V1__REPLICA_STATS__INIT;
  if (link && link->nranks > 1) {
    rs.roots_sent = atomic_load(&link->roots_sent);
    rs.roots_received = atomic_load(&link->roots_received);
    rs.stats_forwarded = atomic_load(&link->stats_forwarded);
    rs.stats_received = atomic_load(&link->stats_received);
    rs.mpi_errors = atomic_load(&link->mpi_errors);
    rs.alone = atomic_load(&link->alone) != 0;
    resp.replica = &rs;
  }
  pd_stale_summary all;
  pd_stats_staleness(&d->stats, &all);
  Precond__V1__StalenessStats all_w = PRECOND__V1__STALENESS_STATS__INIT;
  pd__stale_wire(&all, &all_w);
  resp.staleness = &all_w;
  resp.snapshots_written = atomic_load(&d->stats.snapshots_written);
  double snap = atomic_load(&d->stats.last_snapshot_time);
  resp.last_snapshot_age_s = snap > 0 ? pd_now() - snap : 0;
  resp.jobs_ended = atomic_load(&d->stats.jobs_ended);
  resp.jobs_expired = atomic_load(&d->stats.jobs_expired);
  resp.job_idle_expiry_s = d->cfg.job_idle_expiry_s > 0 ? d->cfg.job_idle_expiry_s : 0;
  resp.job_memory_limit_bytes = d->store.job_memory_limit;
  resp.scratch_bytes = atomic_load(&d->stats.scratch_bytes);
  resp.scratch_peak_bytes = atomic_load(&d->stats.scratch_peak);
  resp.scratch_waits = atomic_load(&d->stats.scratch_waits);
  resp.shm_regions = (uint32_t)pd_shm_count(&d->shm);

  size_t k = 0;
  for (size_t i = 0; i < njobs; i++) {
    pd_job *j = jobs[i];
    precond__v1__job_stats__init(&js[i]);
    js[i].job = j->name;
    js[i].mode = (Precond__V1__Mode)j->mode->id;
    js[i].blocks = (uint32_t)j->nblocks;
    js[i].idle_s = now - atomic_load(&j->last_active);
    js[i].memory_bytes = pd_job_bytes(j);
    js[i].n_rank_load = j->rank_load ? (size_t)(link ? link->nranks : 1) : 0;
    js[i].rank_load = j->rank_load;
    pthread_mutex_lock(&j->lock);
    js[i].workers = (uint32_t)j->nworkers;
    js[i].last_step = j->last_step;
    pthread_mutex_unlock(&j->lock);
    jsp[i] = &js[i];
    for (size_t b = 0; req->blocks && b < j->nblocks; b++, k++) {
      pd_block *blk = &j->blocks[b];
      Precond__V1__BlockStats *o = &bs[k];
      precond__v1__block_stats__init(o);
      o->job = j->name;
      o->block_id = blk->id;
      o->tensor = j->tensors[blk->tensor].name;
      o->rows = blk->rows;
      o->cols = blk->cols;
      pthread_mutex_lock(&blk->lock);
      o->version = blk->root ? blk->root->version : 0;
      o->roots_computed = blk->roots_computed;
      o->roots_failed = blk->roots_failed;
      o->last_error = blk->last_error;
      o->last_compute_ms = blk->last_compute_ms;
      o->resets = blk->resets;
      char *why = texts + k * sizeof blk->last_failure;
      memcpy(why, blk->last_failure, sizeof blk->last_failure);
      o->roots_skipped = blk->roots_skipped;
      o->last_drift = blk->last_drift;
      if (j->mode->id == PD_MODE_SHAMPOO) {
        o->roots_warm = blk->mode_counts[PD_SHAMPOO_WARM];
        o->roots_warm_skipped = blk->mode_counts[PD_SHAMPOO_SKIPPED];
        o->roots_seeded = blk->mode_counts[PD_SHAMPOO_SEEDED];
        o->roots_cold = blk->mode_counts[PD_SHAMPOO_COLD];
      }
      if (j->mode->id == PD_MODE_KFAC) {
        o->a_order = blk->order[0];
        o->g_order = blk->order[1];
        if (blk->root) {
          o->pi = blk->root->aux[PD_KFAC_AUX_PI];
          o->damping_a = blk->root->aux[PD_KFAC_AUX_DAMP_A];
          o->damping_g = blk->root->aux[PD_KFAC_AUX_DAMP_G];
        }
      }
      pd_stale_summary sum;
      pd_stale_hist_summary(&blk->stale, &sum);
      pthread_mutex_unlock(&blk->lock);
      o->last_failure = why;
      precond__v1__staleness_stats__init(&bst[k]);
      pd__stale_wire(&sum, &bst[k]);
      o->staleness_dist = &bst[k];
      o->stat_step = atomic_load(&blk->stat_step);
      o->root_step = atomic_load(&blk->root_step);
      o->staleness = o->stat_step > o->root_step ? o->stat_step - o->root_step : 0;
      o->owner = (int32_t)blk->owner;
      bsp[k] = o;
    }
  }
  resp.n_job_stats = njobs;
  resp.job_stats = jsp;
  resp.n_block_stats = k;
  resp.block_stats = bsp;
  pd__answer(d, rep, &resp.base);

cleanup:
  pd_store_list_free(jobs, njobs, &d->stats);
  free(js);
  free(jsp);
  free(bs);
  free(bsp);
  free(texts);
  free(bst);
}

/* ---- EndJob and the idle expiry -------------------------------------------------------- */

int pd_service_end_job(pd_daemon *d, const char *name, double idle_s, double now,
                       pd_job_ended *out) {
  pd_job *job = pd_store_remove(&d->store, name, idle_s, now);
  if (!job) return PD_ENOENT;
  pthread_mutex_lock(&job->lock);
  out->last_step = job->last_step;
  pthread_mutex_unlock(&job->lock);
  out->blocks = (uint32_t)job->nblocks;
  out->bytes = pd_job_bytes(job);
  int expired = idle_s > 0;
  atomic_fetch_add(expired ? &d->stats.jobs_expired : &d->stats.jobs_ended, 1);
  if (expired)
    pd_log(PD_LOG_INFO,
           "job %s expired: idle for %.1f s (--job-idle-expiry %g); %u units, "
           "last step %llu, %llu bytes freed",
           job->name, now - atomic_load(&job->last_active), idle_s, out->blocks,
           (unsigned long long)out->last_step, (unsigned long long)out->bytes);
  else
    pd_log(PD_LOG_INFO, "job %s ended: %u units, last step %llu, %llu bytes freed", job->name,
           out->blocks, (unsigned long long)out->last_step, (unsigned long long)out->bytes);
  /* Queued roots of the job are dropped; calls in flight keep their references, and the
   * last one frees the job. */
  pd_sched_forget(&d->sched, job);
  pd_job_unref(job, &d->stats);
  return PD_OK;
}

size_t pd_service_expire(pd_daemon *d, double now) {
  size_t n = 0;
  pd_job_ended info;
  while (d->cfg.job_idle_expiry_s > 0 &&
         pd_service_end_job(d, NULL, d->cfg.job_idle_expiry_s, now, &info) == PD_OK)
    n++;
  pd_shm_reap(&d->shm, now); /* regions whose client is gone */
  return n;
}

static void pd__end_job(pd_daemon *d, const Precond__V1__EndJobRequest *req, pd_reply *rep) {
  if (!req->job || !*req->job) {
    pd__fail(rep, GRPC_STATUS_INVALID_ARGUMENT, "job: empty");
    return;
  }
  pd_job_ended info;
  if (pd_service_end_job(d, req->job, 0, 0, &info) != PD_OK) {
    pd__unknown_job(d, rep, GRPC_STATUS_NOT_FOUND, req->job, "");
    return;
  }
  const pd_replica_link *link = d->store.link;
  if (link && link->nranks > 1) link->job_ended(link->ctx, req->job); /* the other replicas */
  Precond__V1__EndJobResponse resp = PRECOND__V1__END_JOB_RESPONSE__INIT;
  resp.blocks = info.blocks;
  resp.last_step = info.last_step;
  resp.bytes = info.bytes;
  pd__answer(d, rep, &resp.base);
}

/* ---- dispatch ------------------------------------------------------------------------- */

void pd_service_handle(pd_daemon *d, pd_method m, grpc_byte_buffer *payload, pd_reply *reply) {
  reply->code = GRPC_STATUS_OK;
  reply->message[0] = '\0';
  reply->payload = NULL;
  if (payload) atomic_fetch_add(&d->stats.bytes_in, grpc_byte_buffer_length(payload));
  ProtobufCMessage *req = NULL;
  if (pd_request_admit(&d->cfg, m, payload, reply->message, sizeof reply->message) != PD_OK) {
    reply->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    if (m == PD_M_PUSH) atomic_fetch_add(&d->stats.rejected_pushes, 1);
    return;
  }
  int rc = rpc_unpack(payload, pd__req_desc[m], d->cfg.max_message_bytes, &req);
  if (rc != RPC_OK) {
    if (rc == RPC_ETOOBIG)
      pd__fail(reply, GRPC_STATUS_RESOURCE_EXHAUSTED,
               "request above the message size limit (%zu bytes, --max-message-mb)",
               d->cfg.max_message_bytes);
    else
      pd__fail(reply, GRPC_STATUS_INVALID_ARGUMENT, "request: does not parse as %s",
               pd__req_desc[m]->name);
    if (m == PD_M_PUSH) atomic_fetch_add(&d->stats.rejected_pushes, 1);
    return;
  }
  switch (m) {
    case PD_M_REGISTER:
      pd__register(d, (Precond__V1__RegisterRequest *)req, reply);
      break;
    case PD_M_PUSH:
      pd__push(d, (Precond__V1__PushRequest *)req, reply);
      break;
    case PD_M_FETCH:
      pd__fetch(d, (Precond__V1__FetchRequest *)req, reply);
      break;
    case PD_M_STATS:
      pd__stats(d, (Precond__V1__StatsRequest *)req, reply);
      break;
    case PD_M_END_JOB:
      pd__end_job(d, (Precond__V1__EndJobRequest *)req, reply);
      break;
    case PD_M_OPEN_SHM:
      pd__open_shm(d, (Precond__V1__ShmOpenRequest *)req, reply);
      break;
    case PD_M_HEALTH: {
      Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
      resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
      pd__answer(d, reply, &resp.base);
      break;
    }
    default:
      pd__fail(reply, GRPC_STATUS_UNIMPLEMENTED, "unknown method");
      break;
  }
  protobuf_c_message_free_unpacked(req, NULL);
}

/* ---- the doorbell: a push rung in a region (rpc.h, rpc_shm_head; host/shm.c's thread) ---- */

size_t pd_service_bell(void *ctx, uint32_t method, const void *req, size_t len, uint32_t *code,
                       unsigned char *out, size_t cap) {
  pd_daemon *d = ctx;
  pd_reply rep;
  memset(&rep, 0, sizeof rep);
  /* rpc_shm_bell_read lets no other method through. */
  int m = method == RPC_SHM_BELL_PUSH ? PD_M_PUSH : method == RPC_SHM_BELL_FETCH ? PD_M_FETCH : -1;
  if (m < 0) {
    pd__fail(&rep, GRPC_STATUS_UNIMPLEMENTED, "unknown method");
  } else if (len > d->cfg.max_message_bytes) { /* gRPC's own check, before any copy */
    pd__fail(&rep, GRPC_STATUS_RESOURCE_EXHAUSTED,
             "request above the message size limit (%zu bytes, --max-message-mb)",
             d->cfg.max_message_bytes);
    if (m == PD_M_PUSH) atomic_fetch_add(&d->stats.rejected_pushes, 1);
  } else {
    /* The one copy of the request's bytes (the client's memory); from here on it is the
     * gRPC method's own handling, so every check, code and message is the same. */
    grpc_slice sl = grpc_slice_from_copied_buffer(req, len);
    grpc_byte_buffer *payload = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    pd_service_handle(d, (pd_method)m, payload, &rep);
    grpc_byte_buffer_destroy(payload);
  }
  *code = (uint32_t)rep.code;
  size_t n = 0;
  if (rep.code != GRPC_STATUS_OK) {
    pd_log(PD_LOG_DEBUG, "%s (doorbell): %s: %s", pd_method_paths[m < 0 ? PD_M_PUSH : m],
           rpc_status_name(rep.code), rep.message);
    n = strnlen(rep.message, sizeof rep.message);
    if (n > cap) n = cap;
    memcpy(out, rep.message, n);
  } else if (rep.payload) {
    grpc_byte_buffer_reader rd;
    grpc_slice sl;
    if (grpc_byte_buffer_reader_init(&rd, rep.payload)) {
      while (grpc_byte_buffer_reader_next(&rd, &sl)) {
        size_t k = GRPC_SLICE_LENGTH(sl);
        if (n + k > cap) { /* a push's answer never; a fetch's of a huge job: gRPC then */
          *code = GRPC_STATUS_RESOURCE_EXHAUSTED;
          n = (size_t)snprintf((char *)out, cap, "the response does not fit the doorbell's room");
          grpc_slice_unref(sl);
          break;
        }
        memcpy(out + n, GRPC_SLICE_START_PTR(sl), k);
        n += k;
        grpc_slice_unref(sl);
      }
      grpc_byte_buffer_reader_destroy(&rd);
    }
  }
  if (rep.payload) grpc_byte_buffer_destroy(rep.payload);
  return n;
}
