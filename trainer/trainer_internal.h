/*
 * trainer_internal.h -- what trainer.c (the mode-independent part) and the mode files
 * (shampoo.c) share. Internal names carry the prefix pt__; not for outside code.
 */
#ifndef PRECOND_TRAINER_INTERNAL_H
#define PRECOND_TRAINER_INTERNAL_H

#include "precond.h"
#include "trainer.h"

/* One mode: what the library does differently for Shampoo, K-FAC or ABS. trainer.c calls
 * these in this order: create (the worker optimizer), register_opts (what the mode tells
 * the daemon at register), bind (take the daemon's layout), then step per training step,
 * and destroy (safe after any failed stage). */
typedef struct {
  const char *name;
  precond_mode wire;
  int (*create)(pt_trainer *t, pt_error *err);
  void (*register_opts)(const pt_trainer *t, precond_shampoo_opts *out);
  int (*bind)(pt_trainer *t, pt_error *err);
  int (*step)(pt_trainer *t, long step, double lr, pt_step_info *info, pt_error *err);
  void (*counters)(const pt_trainer *t, pt_counters *out);
  void (*destroy)(pt_trainer *t);
  /* 1: pt_create neither registers nor binds; the mode does both in its first step (K-FAC:
   * its layers are known only after a backward pass through the hooks). */
  int lazy_register;
  /* 1: the mode reads roots by reference (precond_options.roots_by_reference) and checks
   * precond_roots_intact after each install. */
  int roots_by_reference;
} pt__mode;

struct pt_trainer {
  const pt__mode *mode;
  pt_options opts; /* copy; opts.job points at job below */
  char job[256];
  ac_param *const *params; /* borrowed */
  size_t nparams;
  precond_client *client; /* owned */
  precond_layout layout;  /* the daemon's answer to register; owned */
  void *state;            /* the mode's; owned by it (destroy) */
};

extern const pt__mode pt__shampoo_mode;
extern const pt__mode pt__kfac_mode;

/* Writes the formatted message into err (when not NULL) and returns status. */
int pt__fail(pt_error *err, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* PT_OK for AC_OK, else PT_EACCEL with "what: accel's message" in err. */
int pt__accel(pt_error *err, int rc, const char *what);

/* PT_OK for PRECOND_OK, else PT_EDAEMON with "what: libprecond's and the daemon's message". */
int pt__daemon(const pt_trainer *t, pt_error *err, int prc, const char *what);

/* Monotonic seconds. */
double pt__now(void);

/* CPU seconds of the calling thread (statistics and factors are computed on it; with cores
 * shared, wall time is noise). */
double pt__cpu_now(void);

/* libprecond's poll for results follows the step (pt__poll_pace). */
typedef struct {
  double last_t, step_s; /* wall time of the last call; mean step time (EMA), s */
  int poll_ms;           /* the poll period last given to libprecond (0: its default) */
} pt__pace;

/* Called once per step: with poll_interval_ms 0, sets libprecond's poll period to half the
 * mean step's wall time (10 ms to 1 s). libprecond polls every 20 ms by default: 50 calls a
 * second whatever a step costs, each a full RPC (about 40 ms of the client's CPU per ResNet
 * step for K-FAC, a tenth of the Transformer client's CPU for Shampoo under load: perf), and
 * more the slower the wall clock runs. A new version waits at most half a step more. */
void pt__poll_pace(pt_trainer *t, pt__pace *p);

/* Data parallelism (dp.c): the worker (0 .. shard_size - 1) that computes and pushes unit b
 * of t->layout: with one daemon replica per worker, the worker of the rank whose daemon
 * owns it (nothing is forwarded); else every shard_size-th unit. 0 with one worker. */
int pt__unit_worker(const pt_trainer *t, size_t b);

/* A mode's units whose results data-parallel workers agree on (pt__refresh_agreed). */
typedef struct {
  /* Unit i's daemon block id, the libprecond version it holds and that version's daemon
   * version; returns 0 for a unit with no results to fetch. */
  int (*unit)(pt_trainer *t, size_t i, uint32_t *block_id, uint64_t *version,
              uint64_t *daemon_version);
  /* Hands unit i the results r (owned: apply releases them). */
  int (*apply)(pt_trainer *t, size_t i, const precond_roots *r, pt_error *err);
  const char *what; /* "root", "inverse": for the error message */
} pt__agreed_units;

/* Data-parallel workers without sync_roots (dp.c): each of the n units takes the daemon version
 * of its results that every worker holds (libprecond's newest here, agreed with pt_dp_agree),
 * else keeps what it has. The references taken before the agreement are the ones applied, so a
 * version arriving meanwhile cannot make one worker apply other results than the rest. */
int pt__refresh_agreed(pt_trainer *t, size_t n, const pt__agreed_units *u, pt_error *err);

#endif /* PRECOND_TRAINER_INTERNAL_H */
