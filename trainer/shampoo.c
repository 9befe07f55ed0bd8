/*
 * shampoo.c -- the Shampoo mode of the trainer library. The worker half is accel's
 * ac_shampoo (statistics on the device, roots applied there); the daemon computes the
 * inverse roots. Per step: statistics of every block computed into libprecond's push slots
 * when due, the newest roots libprecond holds handed to ac_shampoo, then ac_shampoo_step.
 */
#include "trainer_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The root exponent of the worker's formula (accel.h): ac_shampoo applies
 * L^(-1/p) G R^(-1/p) with p = root_exponent, or one side's ^(-1/2) when one_sided. */
static uint32_t pt__shampoo_root_exponent(const ac_shampoo_opts *so) {
  return so->one_sided ? 2 : (uint32_t)so->root_exponent;
}

/* root_delay: one version of a block's roots held on the worker until the step that may
 * use it (its source step + root_delay). */
typedef struct {
  uint64_t version, source_step;
  size_t n_left, n_right; /* 0: the roots lack that side */
  float *left, *right;    /* packed upper copies (owned), capacities below */
  size_t cap_left, cap_right;
} pt__held;

typedef struct {
  ac_shampoo *opt; /* owned */
  size_t nblocks;
  uint32_t *block_id;       /* per worker block: the daemon's id (its layout, same order) */
  uint64_t *version;        /* per block: libprecond version handed to ac_shampoo; 0: none */
  uint64_t *source_step;    /* per block: statistics step those roots come from */
  uint64_t *daemon_version; /* per block: precondd's version of those roots (the owner's,
                               the same on every daemon rank; libprecond's own numbering is
                               per client) */
  uint8_t *mine;            /* per block: this worker computes and pushes its statistics */
  float **left, **right;    /* per block: where its statistics go this step (push slots) */
  precond_push_slot **slot; /* per block: libprecond's slot open this step; NULL between */
  size_t nmine;
  double stats_s; /* CPU seconds of this thread: 2 cores shared, wall is noise */
  pt__pace pace;  /* asynchronous roots: libprecond's poll, half a step (pt__poll_pace) */
  /* root_delay > 0: per block a FIFO of held versions, delay + 1 places from
   * held[b * (delay + 1)]; version and source_step above are then those fetched, not those
   * handed to ac_shampoo. NULL without a delay. */
  pt__held *held;
  size_t *held_first, *held_count;
  size_t held_cap;
  uint64_t applied, rejected;
} pt__shampoo;

/* This worker's share of the blocks (pt_options.shard_*, pt__unit_worker): the blocks whose
 * statistics it computes and pushes (the others get no push slot, so accel skips them). */
static void pt__shampoo_shard(pt_trainer *t) {
  pt__shampoo *s = t->state;
  int w = t->opts.shard_rank, nw = t->opts.shard_size > 1 ? t->opts.shard_size : 1;
  s->nmine = 0;
  for (size_t b = 0; b < s->nblocks; b++) {
    s->mine[b] = nw == 1 || pt__unit_worker(t, b) == w;
    s->nmine += s->mine[b];
  }
}

static int pt__shampoo_create(pt_trainer *t, pt_error *err) {
  pt__shampoo *s = calloc(1, sizeof *s);
  if (s == NULL) return PT_ENOMEM;
  t->state = s;
  return pt__accel(err, ac_shampoo_create(&s->opt, t->params, t->nparams, &t->opts.shampoo),
                   "Shampoo worker");
}

static void pt__shampoo_register_opts(const pt_trainer *t, precond_shampoo_opts *out) {
  const ac_shampoo_opts *so = &t->opts.shampoo;
  out->block_size = (uint32_t)so->layout.block_size;
  out->skip_limit = (uint32_t)so->layout.skip_limit;
  out->beta2 = so->beta2;
  out->root_exponent = pt__shampoo_root_exponent(so);
  out->epsilon = so->epsilon;
  out->method = so->root_method == PC_METHOD_EIGH ? PRECOND_METHOD_EIGH : PRECOND_METHOD_NEWTON;
  out->root_every = (uint32_t)t->opts.root_every;
}

/* Takes the daemon's block ids. Both sides number blocks tensor by tensor with the same
 * layout rule, so block k of the daemon is block k of the worker; a difference (another
 * block size, skip limit or daemon version) is refused rather than papered over. */
static int pt__shampoo_bind(pt_trainer *t, pt_error *err) {
  pt__shampoo *s = t->state;
  const precond_layout *lay = &t->layout;
  s->nblocks = ac_shampoo_nblocks(s->opt);
  if (lay->nblocks != s->nblocks)
    return pt__fail(err, PT_EDAEMON,
                    "precondd cut the tensors into %zu blocks, the worker "
                    "into %zu (different block size or skip limit?)",
                    lay->nblocks, s->nblocks);
  size_t nb = s->nblocks > 0 ? s->nblocks : 1;
  s->block_id = calloc(nb, sizeof *s->block_id);
  s->version = calloc(nb, sizeof *s->version);
  s->source_step = calloc(nb, sizeof *s->source_step);
  s->mine = calloc(nb, sizeof *s->mine);
  s->daemon_version = calloc(nb, sizeof *s->daemon_version);
  s->left = calloc(nb, sizeof *s->left);
  s->right = calloc(nb, sizeof *s->right);
  s->slot = calloc(nb, sizeof *s->slot);
  if (s->block_id == NULL || s->version == NULL || s->source_step == NULL || s->mine == NULL ||
      s->daemon_version == NULL || s->left == NULL || s->right == NULL || s->slot == NULL)
    return PT_ENOMEM;
  if (t->opts.root_delay > 0) {
    s->held_cap = (size_t)t->opts.root_delay + 1;
    s->held = calloc(nb * s->held_cap, sizeof *s->held);
    s->held_first = calloc(nb, sizeof *s->held_first);
    s->held_count = calloc(nb, sizeof *s->held_count);
    if (s->held == NULL || s->held_first == NULL || s->held_count == NULL) return PT_ENOMEM;
  }
  for (size_t b = 0; b < s->nblocks; b++) {
    ac_shampoo_block bi;
    int rc = pt__accel(err, ac_shampoo_block_info(s->opt, b, &bi), "ac_shampoo_block_info");
    if (rc != PT_OK) return rc;
    const precond_block *pb = &lay->blocks[b];
    if (pb->tensor != bi.param || pb->row0 != bi.block.row0 || pb->rows != bi.block.rows ||
        pb->col0 != bi.block.col0 || pb->cols != bi.block.cols)
      return pt__fail(err, PT_EDAEMON,
                      "precondd's block %zu (tensor %u, rows %llu+%llu, "
                      "cols %llu+%llu) is not the worker's (%s, rows %zu+%zu, cols %zu+%zu)",
                      b, pb->tensor, (unsigned long long)pb->row0, (unsigned long long)pb->rows,
                      (unsigned long long)pb->col0, (unsigned long long)pb->cols,
                      t->params[bi.param]->name, bi.block.row0, bi.block.rows, bi.block.col0,
                      bi.block.cols);
    s->block_id[b] = pb->block_id;
  }
  pt__shampoo_shard(t);
  return PT_OK;
}

/* One version of packed roots as ac_shampoo_set_roots takes it (a side of order 0 absent). */
static ac_shampoo_roots pt__packed_roots(uint64_t version, uint64_t source_step, size_t n_left,
                                         const float *left, size_t n_right, const float *right) {
  return (ac_shampoo_roots){.version = version,
                            .source_step = source_step,
                            .format = AC_ROOT_PACKED,
                            .n_left = n_left,
                            .left = n_left > 0 ? left : NULL,
                            .n_right = n_right,
                            .right = n_right > 0 ? right : NULL};
}

/* Copies the packed values of order n at src (none if NULL) into *dst (capacity *cap, grown). */
static int pt__held_side(float **dst, size_t *cap, const float *src, size_t n) {
  size_t len = src != NULL && n > 0 ? ac_packed_len(n) : 0;
  if (len > *cap) {
    float *p = realloc(*dst, len * sizeof *p);
    if (p == NULL) return PT_ENOMEM;
    *dst = p;
    *cap = len;
  }
  if (len > 0) memcpy(*dst, src, len * sizeof *src);
  return PT_OK;
}

/* root_delay: keeps a copy of roots r (released here) at the end of block b's FIFO. Roots
 * found changed while copied (roots by reference) are counted as rejected, not held. */
static int pt__shampoo_hold(pt_trainer *t, size_t b, const precond_roots *r) {
  pt__shampoo *s = t->state;
  size_t *first = &s->held_first[b], *count = &s->held_count[b];
  if (*count == s->held_cap) { /* not in the protocol (one version a push): the oldest goes */
    *first = (*first + 1) % s->held_cap;
    (*count)--;
  }
  pt__held *h = &s->held[b * s->held_cap + (*first + *count) % s->held_cap];
  int rc = pt__held_side(&h->left, &h->cap_left, r->left, r->n_left);
  if (rc == PT_OK) rc = pt__held_side(&h->right, &h->cap_right, r->right, r->n_right);
  s->version[b] = r->version; /* fetched: not offered again */
  if (rc == PT_OK && precond_roots_intact(r)) {
    h->version = r->version;
    h->source_step = r->source_step;
    h->n_left = r->left != NULL ? r->n_left : 0;
    h->n_right = r->right != NULL ? r->n_right : 0;
    s->source_step[b] = r->source_step;
    s->daemon_version[b] = r->daemon_version;
    (*count)++;
  } else if (rc == PT_OK) {
    s->rejected++;
  }
  precond_roots_release(r);
  return rc;
}

/* root_delay: hands block b the newest held version whose source step is at least delay
 * steps behind step, and forgets it and the older ones. */
static int pt__shampoo_release_held(pt_trainer *t, size_t b, long step, long delay, pt_error *err) {
  pt__shampoo *s = t->state;
  size_t *first = &s->held_first[b], *count = &s->held_count[b];
  const pt__held *use = NULL;
  while (*count > 0) {
    const pt__held *h = &s->held[b * s->held_cap + *first];
    if (h->source_step + (uint64_t)delay > (uint64_t)step) break;
    use = h;
    *first = (*first + 1) % s->held_cap;
    (*count)--;
  }
  if (use == NULL) return PT_OK;
  const ac_shampoo_roots roots = pt__packed_roots(use->version, use->source_step, use->n_left,
                                                  use->left, use->n_right, use->right);
  int arc = ac_shampoo_set_roots(s->opt, b, &roots);
  if (arc == AC_OK) {
    s->applied++;
  } else if (arc == AC_EINVAL || arc == AC_EMISMATCH) {
    s->rejected++;
    arc = AC_OK;
  }
  return pt__accel(err, arc, "ac_shampoo_set_roots");
}

/* Hands block b roots r (a reference from precond_fetch, released here; NULL: nothing), or
 * with root_delay holds them for later. Roots the worker refuses (non-finite, wrong size)
 * are counted and skipped: the block keeps its previous roots or the grafted step. */
static int pt__shampoo_apply(pt_trainer *t, size_t b, const precond_roots *r, pt_error *err) {
  pt__shampoo *s = t->state;
  if (r == NULL) return PT_OK;
  if (s->held != NULL) return pt__shampoo_hold(t, b, r);
  const ac_shampoo_roots roots =
      pt__packed_roots(r->version, r->source_step, r->n_left, r->left, r->n_right, r->right);
  int arc = ac_shampoo_set_roots(s->opt, b, &roots);
  /* Roots by reference: read straight from precondd's roots area into the worker's dense
   * roots (one copy, no decode copy in libprecond). The daemon reuses a place in that area
   * only after many later publications; if it did while they were read, the block forgets
   * them (the grafted step) until its next version, counted as rejected. */
  if (arc == AC_OK && !precond_roots_intact(r)) {
    arc = ac_shampoo_drop_roots(s->opt, b);
    if (arc == AC_OK) arc = AC_EINVAL;
  }
  if (arc == AC_OK) {
    s->version[b] = r->version;
    s->source_step[b] = r->source_step;
    s->daemon_version[b] = r->daemon_version;
    s->applied++;
  } else if (arc == AC_EINVAL || arc == AC_EMISMATCH) {
    s->rejected++;
    s->version[b] = r->version; /* do not offer the same bad version again */
    arc = AC_OK;
  }
  precond_roots_release(r);
  return pt__accel(err, arc, "ac_shampoo_set_roots");
}

/* Hands block b the newest roots libprecond holds, if newer than those it has. */
static int pt__shampoo_refresh(pt_trainer *t, size_t b, pt_error *err) {
  pt__shampoo *s = t->state;
  const precond_roots *r = NULL;
  int rc = pt__daemon(t, err, precond_fetch(t->client, s->block_id[b], s->version[b], &r),
                      "precond_fetch");
  return rc == PT_OK ? pt__shampoo_apply(t, b, r, err) : rc;
}

/* Data-parallel workers without sync_roots: the blocks' roots by pt__refresh_agreed. */
static int pt__shampoo_unit(pt_trainer *t, size_t b, uint32_t *block_id, uint64_t *version,
                            uint64_t *daemon_version) {
  const pt__shampoo *s = t->state;
  *block_id = s->block_id[b];
  *version = s->version[b];
  *daemon_version = s->daemon_version[b];
  return 1;
}

static int pt__shampoo_refresh_agreed(pt_trainer *t, pt_error *err) {
  static const pt__agreed_units units = {pt__shampoo_unit, pt__shampoo_apply, "root"};
  return pt__refresh_agreed(t, ((pt__shampoo *)t->state)->nblocks, &units, err);
}

/* sync_roots: waits until block b holds roots computed from the statistics of step, or with
 * root_every k > 1 from those of the step's window: precondd computes a block's roots once
 * per window of k steps, at its first push in it, the windows offset by the block's id
 * (host/mode_shampoo.c, shampoo_compute_due), so the window's roots are the only ones with
 * a source step at or after its start. (Before a block's first root the daemon computes at
 * every push: any root is that window's then.) */
static int pt__shampoo_wait(pt_trainer *t, size_t b, long step, pt_error *err) {
  pt__shampoo *s = t->state;
  double deadline = pt__now() + t->opts.sync_timeout_ms / 1000.0;
  uint64_t start =
      pc_root_window_start((uint64_t)step, s->block_id[b], (uint64_t)t->opts.root_every);
  for (;;) {
    int rc = pt__shampoo_refresh(t, b, err);
    if (rc != PT_OK) return rc;
    if (s->version[b] > 0 && s->source_step[b] >= start) return PT_OK;
    int left_ms = (int)((deadline - pt__now()) * 1000.0);
    if (left_ms <= 0 ||
        precond_wait_roots(t->client, s->block_id[b], s->version[b], left_ms) == PRECOND_ETIMEDOUT)
      return pt__fail(err, PT_ETIMEDOUT,
                      "sync_roots: no roots of step %ld for block %u "
                      "within %d ms",
                      step, s->block_id[b], t->opts.sync_timeout_ms);
  }
}

/* When statistics are due: this worker's blocks' statistics computed straight into
 * libprecond's push slots (no copy on this thread: the CPU backend's syrk packs into them,
 * CUDA's download lands there), then queued. Every slot opened is committed or cancelled
 * exactly once, also on failure. */
static int pt__shampoo_push(pt_trainer *t, int *due, long *stat_step, pt_error *err) {
  pt__shampoo *s = t->state;
  *due = ac_shampoo_stats_due(s->opt, stat_step);
  if (!*due) return PT_OK;
  int rc = PT_OK;
  for (size_t b = 0; b < s->nblocks; b++) s->left[b] = s->right[b] = NULL;
  for (size_t b = 0; b < s->nblocks && rc == PT_OK; b++) {
    if (!s->mine[b]) continue; /* another worker's share */
    const precond_block *pb = &t->layout.blocks[b];
    rc = pt__daemon(
        t, err,
        precond_push_begin(t->client, (uint64_t)*stat_step, s->block_id[b], (uint32_t)pb->rows,
                           (uint32_t)pb->cols, &s->left[b], &s->right[b], &s->slot[b]),
        "precond_push_begin");
  }
  if (rc == PT_OK)
    rc = pt__accel(err, ac_shampoo_compute_stats_into(s->opt, s->left, s->right, NULL, NULL),
                   "Shampoo statistics");
  /* G G^T and G^T G as syrk computed them (accel/optim.h): Gram matrices, so each part's
   * diagonal vouches for it and precondd folds a slot in its region without the spare
   * (precond_push_vouch_gram; a no-op for queue memory). */
  for (size_t b = 0; b < s->nblocks && rc == PT_OK; b++)
    if (s->slot[b] != NULL) (void)precond_push_vouch_gram(s->slot[b]);
  /* All at once: the step's blocks leave in one push (precond_push_commit_all). */
  if (rc == PT_OK)
    rc = pt__daemon(t, err, precond_push_commit_all(t->client, s->slot, s->nblocks),
                    "precond_push_commit_all");
  else
    for (size_t b = 0; b < s->nblocks; b++)
      if (s->slot[b] != NULL) precond_push_cancel(s->slot[b]);
  for (size_t b = 0; b < s->nblocks; b++) s->slot[b] = NULL;
  return rc;
}

static int pt__shampoo_step(pt_trainer *t, long step, double lr, pt_step_info *info,
                            pt_error *err) {
  pt__shampoo *s = t->state;
  int due = 0;
  long stat_step = 0;
  /* With sync_roots (and in the first sync_first steps) each step waits on the poll for its
   * roots: there it keeps its short period (the wall time is what waiting pays anyway). */
  int sync = t->opts.sync_roots || step <= t->opts.sync_first;
  long delay = step <= t->opts.sync_first ? 0 : t->opts.root_delay;
  if (!sync) pt__poll_pace(t, &s->pace);
  double t0 = pt__cpu_now();
  int rc = pt__shampoo_push(t, &due, &stat_step, err);
  s->stats_s += pt__cpu_now() - t0;
  if (rc != PT_OK) return rc;
  /* Waiting before start_step would only slow the steps whose update ignores roots (with
   * root_delay those of step start_step - root_delay are the first used). */
  int wait = due && sync && step + delay >= t->opts.shampoo.start_step;
  if (wait && precond_flush(t->client, t->opts.sync_timeout_ms) != PRECOND_OK)
    return pt__fail(err, PT_ETIMEDOUT, "sync_roots: statistics not sent within %d ms",
                    t->opts.sync_timeout_ms);
  int agreed = !wait && pt_dp_size(t->opts.dp) > 1; /* pt_dp_size(NULL) is 1 */
  if (agreed) rc = pt__shampoo_refresh_agreed(t, err);
  for (size_t b = 0; b < s->nblocks && rc == PT_OK && !agreed; b++)
    rc = wait ? pt__shampoo_wait(t, b, stat_step, err) : pt__shampoo_refresh(t, b, err);
  for (size_t b = 0; b < s->nblocks && rc == PT_OK && s->held != NULL; b++)
    rc = pt__shampoo_release_held(t, b, step, delay, err);
  if (rc == PT_OK) rc = pt__accel(err, ac_shampoo_step(s->opt, (float)lr), "Shampoo step");
  if (rc != PT_OK || info == NULL) return rc;
  ac_shampoo_step_info si;
  rc = pt__accel(err, ac_shampoo_last_step(s->opt, &si), "ac_shampoo_last_step");
  if (rc != PT_OK) return rc;
  info->pushed = due;
  info->preconditioned = si.preconditioned;
  info->fallback = si.fallback;
  info->staleness_mean = si.preconditioned > 0 ? si.staleness_mean : (double)NAN;
  info->staleness_max = si.staleness_max;
  return PT_OK;
}

static void pt__shampoo_counters(const pt_trainer *t, pt_counters *out) {
  const pt__shampoo *s = t->state;
  out->units = s->nblocks;
  out->results_applied = s->applied;
  out->results_rejected = s->rejected;
  out->units_mine = s->nmine;
  out->stats_s = s->stats_s;
}

static void pt__shampoo_destroy(pt_trainer *t) {
  pt__shampoo *s = t->state;
  if (s == NULL) return;
  ac_shampoo_destroy(s->opt);
  free(s->block_id);
  free(s->version);
  free(s->source_step);
  free(s->mine);
  free(s->daemon_version);
  free(s->left);
  free(s->right);
  free(s->slot);
  for (size_t i = 0; s->held != NULL && i < s->nblocks * s->held_cap; i++) {
    free(s->held[i].left);
    free(s->held[i].right);
  }
  free(s->held);
  free(s->held_first);
  free(s->held_count);
  free(s);
  t->state = NULL;
}

const pt__mode pt__shampoo_mode = {
    .name = "shampoo",
    .wire = PRECOND_MODE_SHAMPOO,
    .create = pt__shampoo_create,
    .register_opts = pt__shampoo_register_opts,
    .bind = pt__shampoo_bind,
    .step = pt__shampoo_step,
    .counters = pt__shampoo_counters,
    .destroy = pt__shampoo_destroy,
    .roots_by_reference = 1,
};

ac_shampoo *pt_shampoo(const pt_trainer *t) {
  if (t == NULL || t->mode != &pt__shampoo_mode || t->state == NULL) return NULL;
  return ((const pt__shampoo *)t->state)->opt;
}
