/*
 * precondd.h -- internal header of precondd, the per-host preconditioner daemon.
 *
 * The daemon's parts, one file each:
 *   main.c      options, signals, the periodic snapshot loop
 *   config.c    the defaults of every option
 *   log.c       leveled, timestamped logging to stderr
 *   server.c    gRPC core plumbing: completion-queue pollers, armed calls, auth, shutdown
 *   service.c   the RPCs: Register, PushStatistics, FetchPreconditioners, GetStats, Health
 *   store.c     jobs, units (blocks), their state and refcounted immutable results
 *   modes.c     the mode table; mode_shampoo.c, mode_identity.c: its entries
 *   scheduler.c the pool computing results (no root first, then stalest, then cheapest)
 *   snapshot.c  atomic, checksummed snapshots of the store and their restore
 *   stats.c     daemon-wide counters and compute-time percentiles
 *   limits.c    per-method request size and count limits, checked before parsing
 *   replica_plan.c  which replica (MPI rank) computes each unit; the replica link
 *   replica.c   daemon replicas over MPI: the communication thread (built with MPI only)
 *
 * No file here but service.c includes a generated wire header: the service decodes requests
 * into the daemon's own types.
 *
 * Prefix pd_. Functions return int: PD_OK (0) or a negative PD_E* code, with pd_strerror.
 * Locking order, where two locks nest: scheduler lock, then a block's lock. The store's
 * job-list lock is never held while taking either.
 */
#ifndef PRECOND_HOST_PRECONDD_H
#define PRECOND_HOST_PRECONDD_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <grpc/grpc.h>
#include <grpc/status.h>

#define PD_VERSION "0.1.0"

enum {
  PD_OK = 0,
  PD_EINVAL = -1,   /* bad argument or input */
  PD_ENOMEM = -2,   /* allocation failed */
  PD_EIO = -3,      /* file or socket error (errno-style detail is logged) */
  PD_ECORRUPT = -4, /* a snapshot failed its checks */
  PD_ENOENT = -5,   /* no such file (no snapshot yet) */
  PD_ELIMIT = -6,   /* a configured limit would be exceeded */
  PD_EENDED = -7    /* the job's name belongs to a job that was ended (EndJob, idle expiry) */
};

const char *pd_strerror(int code);

/* ------------------------------------------------------------------------------------ */
/* log.c                                                                                  */

typedef enum { PD_LOG_ERROR = 0, PD_LOG_WARN, PD_LOG_INFO, PD_LOG_DEBUG } pd_log_level;

/* Names the calling thread (at most 15 characters; Linux: the comm of
 * /proc/PID/task/TID, elsewhere nothing), so per-thread CPU can be told apart from outside:
 * "pd-pool" (root workers) and "pd-replica" (the communication thread), which
 * bench-daemon's replica rows sum per rank, and "pd-bell" (a region's doorbell thread),
 * which its --account lines report. */
void pd_thread_name(const char *name);

/* Sets the threshold (messages above it are dropped). Thread-safe. */
void pd_log_set_level(pd_log_level level);
/* Under mpirun: every line names the rank ("precondd[1]: ..."); -1 (the default): none. */
void pd_log_set_rank(int rank);
/* Parses "error", "warn", "info", "debug"; returns 0 or -1. */
int pd_log_parse_level(const char *s, pd_log_level *out);
/* One line "2026-01-01T12:00:00.123Z LEVEL message" to stderr; thread-safe. */
void pd_log(pd_log_level level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ------------------------------------------------------------------------------------ */
/* Configuration (main.c fills it; everything else reads it)                              */

typedef struct {
  char listen[512];         /* "127.0.0.1:50551", "unix:/path", "[::1]:0" */
  char state_dir[1024];     /* "" : no snapshots */
  char token[512];          /* "" : no token required */
  char port_file[1024];     /* "" : none; else the bound port is written here */
  char *tls_cert, *tls_key; /* PEM text (malloc'd) of the server's chain and key, or NULL */
  char *tls_client_ca;      /* PEM text: clients must present a certificate it signed */
  int threads;              /* root workers */
  int io_threads;           /* completion-queue pollers */
  size_t max_message_bytes;
  size_t memory_limit_bytes;     /* statistics and roots held */
  size_t job_memory_limit_bytes; /* what one job may reserve (pd_job_bytes); 0: no limit
                                 * beyond memory_limit_bytes */
  uint32_t max_blocks_per_job;
  double snapshot_interval_s; /* <= 0: only at shutdown */
  double failure_threshold;   /* roots with a larger error are not published */
  double drift_threshold;     /* statistics that moved less keep their root (scheduler.c) */
  int warm_roots;             /* 1: modes keep per-unit state between computations (Shampoo:
                                 * the eigenbasis of the last roots, a warm start); 0: cold */
  int pool_nice;              /* the pool threads' nice value (pd_sched_rules.pool_nice) */
  double grace_s;             /* calls in flight get this long at shutdown */
  double job_idle_expiry_s;   /* a job with no Register, push or fetch for this long is
                                 * ended (main.c checks once a second); <= 0: never */
  uint32_t ended_jobs;        /* names of ended jobs remembered (Register refuses them) */
  pd_log_level log_level;
  char shm_dir[1024];     /* --shm-dir: where same-host clients' regions are made; "": off */
  char grpc_args[8][128]; /* --grpc-arg KEY=INTEGER: server channel arguments over the
                           * defaults (proto/rpc.c), checked by main.c */
  int ngrpc_args;
} pd_config;

void pd_config_default(pd_config *cfg);

/* ------------------------------------------------------------------------------------ */
/* stats.c                                                                                */

#define PD_STATS_WINDOW 1024 /* compute times kept for percentiles */

/* Staleness samples: how many steps old the published root of a block was when a push of
 * a newer step arrived (push step minus the root's source step), the age the worker sees.
 * Exact counts for 0 .. PD_STALE_BINS - 2, the last bin holds everything larger (its
 * percentiles report the exact max). Not thread-safe: the owner's lock guards it. */
#define PD_STALE_BINS 64

typedef struct {
  uint32_t bins[PD_STALE_BINS];
  uint64_t count, sum, max;
} pd_stale_hist;

typedef struct {
  double p50, p90, p99, mean;
  uint64_t max, count;
} pd_stale_summary;

void pd_stale_hist_add(pd_stale_hist *h, uint64_t staleness);
/* Nearest-rank percentiles and the mean; all 0 when there are no samples. */
void pd_stale_hist_summary(const pd_stale_hist *h, pd_stale_summary *out);

typedef struct {
  _Atomic uint64_t roots_computed;
  _Atomic uint64_t roots_failed;
  _Atomic uint64_t roots_skipped; /* drift test: the statistics barely moved (scheduler.c) */
  _Atomic uint64_t bytes_in;
  _Atomic uint64_t bytes_out;
  _Atomic uint64_t rejected_pushes;
  _Atomic uint64_t torn_pushes;    /* vouched pushes refused torn (pd_push_refusal.torn) */
  _Atomic uint64_t vouched_pushes; /* pushes folded without the spare (pd_job_push_vouched) */
  _Atomic uint64_t snapshots_written;
  _Atomic uint64_t scratch_bytes; /* pool scratch of the computations running now (bound) */
  _Atomic uint64_t scratch_peak;  /* the most scratch_bytes has been */
  _Atomic uint64_t scratch_waits; /* times a pool thread waited for scratch room */
  _Atomic uint64_t jobs_ended;    /* by EndJob */
  _Atomic uint64_t jobs_expired;  /* by the idle expiry */
  _Atomic int64_t memory_bytes;   /* statistics and roots currently allocated */
  pthread_mutex_t lock;           /* guards the ring and the staleness histogram below */
  double ring[PD_STATS_WINDOW];
  size_t ring_len, ring_next;
  pd_stale_hist stale;               /* daemon-wide, all blocks of all jobs */
  double start_time;                 /* monotonic seconds */
  _Atomic double last_snapshot_time; /* monotonic seconds; 0: never */
} pd_stats;

int pd_stats_init(pd_stats *s);
void pd_stats_destroy(pd_stats *s);
void pd_stats_add_compute_ms(pd_stats *s, double ms);
/* Percentiles (q in [0,1]) of the last PD_STATS_WINDOW compute times; 0 when none. */
void pd_stats_percentiles(pd_stats *s, double *p50, double *p90, double *p99);
void pd_stats_add_staleness(pd_stats *s, uint64_t staleness);
void pd_stats_staleness(pd_stats *s, pd_stale_summary *out);
/* Monotonic clock in seconds. */
double pd_now(void);

/* ------------------------------------------------------------------------------------ */
/* store.c                                                                                */

/* A unit's state and its published result are PD_MAX_PARTS at most packed symmetric matrices
 * (upper triangle, row by row, pc_packed_len(order) floats each): Shampoo's L and R and their
 * inverse roots; K-FAC's A and G and their damped inverses. Which part means what is the
 * mode's business; the store, pool, snapshots and service move parts by index. */
#define PD_MAX_PARTS 2

/* Figures a mode reports with a result besides its error (pd_compute_info.aux). */
#define PD_MODE_AUX 3

/* Tallies a mode keeps per unit (pd_compute_info.counts, pd_block.mode_counts; Shampoo: how
 * its factor roots were computed: warm, skipped, seeded, cold). */
#define PD_MODE_COUNTS 4

/* An immutable published result of one unit (Shampoo: the root pair); shared by readers
 * through a reference count and freed by the last pd_root_unref. */
typedef struct {
  _Atomic int refs;
  uint64_t version;     /* 1, 2, ... per unit */
  uint64_t source_step; /* statistics step it stands for (a drift-test skip republishes
                          * a root as of a newer step: within drift_threshold of it) */
  double error;         /* the mode's residual error (Shampoo: max over the factors) */
  int method;           /* the mode's method (Shampoo: pc_method) */
  uint32_t iterations;
  double aux[PD_MODE_AUX]; /* pd_compute_info.aux of the computation (in snapshots) */
  uint32_t nparts;
  uint64_t order[PD_MAX_PARTS];
  float *part[PD_MAX_PARTS];
  /* Where each part is published in the shared-memory roots area, per encoding (fp32,
   * bf16): its sequence number there, 0 for none (host/shm.c, under its roots lock). */
  uint64_t shm_seq[2][PD_MAX_PARTS];
} pd_root;

/* A fresh result with refs = 1 and uninitialised parts of the given orders (nparts <=
 * PD_MAX_PARTS); NULL on out of memory. Counts its bytes in stats (may be NULL). */
pd_root *pd_root_new(uint32_t nparts, const uint64_t *order, pd_stats *stats);
void pd_root_ref(pd_root *r);
void pd_root_unref(pd_root *r, pd_stats *stats);

typedef struct pd_job pd_job;

/* Probes of the drift test (scheduler.c): the trace and three fixed random quadratic forms
 * of each part. */
#define PD_DRIFT_PROBES 4

/* One unit of work (a Shampoo block; a K-FAC layer; ABS's one job-level state). */
typedef struct {
  pd_job *job;
  uint32_t id;
  uint32_t tensor; /* UINT32_MAX: a job-level unit */
  uint64_t row0, rows, col0, cols;
  uint32_t nparts;
  uint64_t order[PD_MAX_PARTS];       /* of each part of the state and of the result */
  uint32_t owner;                     /* the replica (MPI rank) computing its results; 0 alone */
  pthread_mutex_t lock;               /* guards stat, root, counters below */
  float *stat[PD_MAX_PARTS];          /* the state pushes are folded into */
  uint8_t stat_bounded[PD_MAX_PARTS]; /* 1: every value of stat[k] is below 2^126, as the
                                       * mode's fold_bounded found it; 0: not known */
  uint64_t pushes;                    /* statistics updates received */
  uint64_t due_step;                  /* statistics step of the push that last queued a
                                       * computation (pd_block_due); 0: none since the
                                       * daemon started */
  pd_root *root;                      /* latest published; NULL before the first */
  uint64_t roots_computed, roots_failed, roots_skipped;
  double last_error, last_compute_ms; /* last_error NaN: the computation itself failed */
  double last_drift;                  /* of the last drift test; NAN before one */
  int has_drift_ref;                  /* drift_ref holds the published root's probes */
  double drift_ref[PD_MAX_PARTS][PD_DRIFT_PROBES];
  pd_stale_hist stale;                  /* staleness at each push of a newer step */
  uint32_t failures_in_row;             /* reset to 0 by a published root */
  uint64_t resets;                      /* statistics zeroed after PD_FAILURES_BEFORE_RESET */
  char last_failure[160];               /* why the last root was not published; "" if none */
  uint64_t mode_counts[PD_MODE_COUNTS]; /* the mode's tallies (pd_mode.count_names), summed
                                 * over computations; not in snapshots */
  /* The mode's own per-unit state (e.g. a warm start): only the thread computing the unit
   * touches it (one computation per unit at a time); freed by the mode's unit_free. */
  void *mode_state;
  /* Read by the scheduler without the block lock. */
  _Atomic uint64_t stat_step; /* newest statistics step */
  _Atomic uint64_t root_step; /* source step of the published root */
  _Atomic int has_root;
  /* Guarded by the scheduler lock. */
  int queued, computing, redo;
} pd_block;

#define PD_MAX_RANK 8 /* tensors of a job: rank 1 .. PD_MAX_RANK (checked by the store) */

typedef struct {
  char *name;
  int rank;
  uint64_t *dims;
} pd_tensor;

/* ---- modes (modes.c, mode_*.c) -------------------------------------------------------- */

/* Mode ids: the wire's Mode values where the wire has the mode (service.c checks them at
 * compile time); modes the wire cannot name (test modes) from 100 up. */
typedef enum {
  PD_MODE_SHAMPOO = 0,
  PD_MODE_KFAC = 1,
  PD_MODE_ABS = 2,
  PD_MODE_IDENTITY = 100
} pd_mode_id;

#define PD_MODE_OPTS_MAX 128 /* bytes of a mode's resolved options in pd_job */

/* The shape of one unit, as a mode's layout gives it. */
typedef struct {
  uint32_t tensor;
  uint64_t row0, rows, col0, cols;
  uint32_t nparts;
  uint64_t order[PD_MAX_PARTS];
} pd_unit_shape;

/* What one computation reports besides its parts. */
typedef struct {
  double error;
  uint32_t iterations;
  int method;
  int failed_part;                 /* when compute returns < 0: the part it failed on, or -1 */
  double aux[PD_MODE_AUX];         /* the mode's own figures of this result (K-FAC: pi, damping) */
  uint32_t counts[PD_MODE_COUNTS]; /* added to the unit's mode_counts */
  int64_t state_bytes;             /* bytes the unit's mode_state grew by (counted in the daemon's
                            * memory; unit_free returns what it held) */
} pd_compute_info;

/* One entry of the mode table: everything precondd does that depends on the mode. The store,
 * pool, snapshots and service call these and know no mode's fields. Options are a plain
 * struct of at most PD_MODE_OPTS_MAX bytes, compared bytewise (decoders zero them first). */
typedef struct {
  const char *name;
  pd_mode_id id;
  const char *part_names[PD_MAX_PARTS]; /* for messages ("left", "right") */
  size_t opts_size;
  /* Fills the defaults of zero fields of *opts and validates them: PD_OK, or PD_EINVAL with
   * a message naming the field in err. */
  int (*resolve)(void *opts, char *err, size_t errlen);
  /* Lays out a job's units. With units == NULL only counts them (before anything is
   * allocated: PD_ELIMIT above max_units); else fills units[*nunits] and the tensors with
   * no unit in diag[*ndiag] (room for ntensors). PD_EINVAL/PD_ELIMIT/PD_ENOMEM with err. */
  int (*layout)(const void *opts, size_t ntensors, const pd_tensor *tensors, uint32_t max_units,
                pd_unit_shape *units, size_t *nunits, uint32_t *diag, size_t *ndiag, char *err,
                size_t errlen);
  /* Folds one validated increment (fp32 parts of the unit's orders) into state. Called
   * under the unit's lock: a memcpy-sized operation. */
  void (*fold)(const void *opts, const pd_block *u, float *const *state, const float *const *inc);
  /* 1 if fold would leave every value of state finite (a sum of large finite pushes can
   * overflow); called under the unit's lock before any unit of a push is folded. */
  int (*fold_fits)(const void *opts, const pd_block *u, const float *const *state,
                   const float *const *inc);
  /* Optional (NULL: fold alone): fold, bit for bit, in the same pass setting bounded[k] to
   * 1 when every value of the folded part k is below 2^126 in magnitude, else 0. A mode that
   * has it promises that a state part below 2^126 folded with an increment part below 2^126
   * (rpc_f32_scan's RPC_F32_BOUNDED) stays finite: the store then skips fold_fits, a pass
   * over the state and the increment (pd_block.stat_bounded). */
  void (*fold_bounded)(const void *opts, const pd_block *u, float *const *state,
                       const float *const *inc, uint8_t *bounded);
  /* Optional (NULL: fold_fits and fold): the checks and the fold of one unit in one pass
   * that reads each increment value once (they may lie in a client's memory, which can
   * change meanwhile: what is checked is what is folded). Per part k, one of two ways, told
   * by in_place[k]: 0, the folded state is written to out[k] (state[k] unchanged; out[k] is
   * fold's part k bit for bit); 1, state[k] is folded in place (fold's part k bit for bit)
   * and its values before the fold are written to out[k], bit for bit, so that swapping
   * state[k] and out[k] undoes the fold. Either way the caller keeps the result by a swap
   * of state[k] and out[k] where in_place[k] is 0, and drops it by a swap where it is 1.
   * Returns PD_FOLD_OK with bounded[k] as fold_bounded sets it; PD_FOLD_NONFINITE with
   * *part the first increment part holding a NaN or Inf; PD_FOLD_OVERFLOW with *part the
   * first part whose fold would hold an Inf (in_place[] set in every case). */
  int (*fold_into)(const void *opts, const pd_block *u, float *const *state,
                   const float *const *inc, float *const *out, uint8_t *bounded, uint8_t *in_place,
                   uint32_t *part);
  /* Optional (NULL: vouched pushes take fold_into): the fold of a vouched increment
   * (ShmRef.vouched: every value below 2^125 in magnitude) into a state whose every part is
   * known below 2^126 (pd_block.stat_bounded), in place with nothing kept to undo it: of
   * such values no result can be NaN, Inf or overflow. Where an increment value is not
   * below 2^125 (NaN and Inf included: the vouch was false) the state keeps its old value
   * and the fold goes on, so the state stays finite whatever the increment holds; every
   * other value is fold's, bit for bit. bounded[k] as fold_bounded sets it. Returns 0, or 1
   * (torn) with *part the first part where a value was outside the vouch. */
  int (*fold_vouched)(const void *opts, const pd_block *u, float *const *state,
                      const float *const *inc, uint8_t *bounded, uint32_t *part);
  /* Computes a unit's result from a private copy of its state into out (parts of the
   * unit's orders) on a pool thread with no lock held; *unit_state is pd_block.mode_state,
   * which the mode may allocate and keep (reporting its bytes in info->state_bytes), or
   * unit_state is NULL when the daemon keeps no per-unit state (--warm-roots off).
   * info is zeroed by the caller. Returns a pc_ status: >= 0 when out holds a result (its
   * quality in info), < 0 when it does not (out of memory included: counted as a failed
   * computation). */
  int (*compute)(const void *opts, const pd_block *u, const float *const *state, void **unit_state,
                 float *const *out, pd_compute_info *info);
  /* Frees a unit's mode_state and returns the bytes it held (NULL when the mode keeps
   * none). */
  size_t (*unit_free)(void *unit_state);
  /* Names of the mode's per-unit tallies (pd_block.mode_counts); NULL: unused. */
  const char *count_names[PD_MODE_COUNTS];
  /* The publication rule: 1 if a result that compute returned status for may be published
   * (Shampoo: no error code, finite, error within failure_threshold). */
  int (*publishable)(const void *opts, const pd_block *u, int status, const pd_compute_info *info,
                     const float *const *out, double failure_threshold);
  /* The mode's section of a snapshot: snap_bytes bytes, little-endian. */
  size_t snap_bytes;
  void (*snap_write)(const void *opts, unsigned char *out);
  /* Decodes a section (then resolve validates it). */
  void (*snap_read)(const unsigned char *in, void *opts);
  /* A one-line account of the options, for logs and stats. */
  void (*describe)(const void *opts, char *buf, size_t len);
  /* 1: the pool's drift test applies (parts are statistics that a small relative change
   * leaves the result close); 0: every push computes. */
  int drift_test;
  /* The exponent e with result(c S) = c^e result(S) for a scalar c > 0, exactly (Shampoo with
   * its relative ridge: -1/p); then the drift test ignores a part's uniform scale and
   * rescales a kept result by it. NULL, or 0: a scale change is drift like any other. */
  double (*scale_exponent)(const void *opts);
  /* 1 if a push that brought unit u to `pushes` pushes and its statistics to step `step`
   * queues a computation; due_step is the statistics step of the push that last queued one
   * (0: none since the daemon started). K-FAC: every inv_every pushes; Shampoo: when step
   * enters a new window of root_every steps. Both: every push before the first result.
   * NULL: every push. */
  int (*compute_due)(const void *opts, const pd_block *u, uint64_t pushes, uint64_t step,
                     uint64_t due_step, int has_root);
  /* The options section's size in snapshots of format 5 and older (0: snap_bytes); the
   * fields past it read as 0 there (resolve gives them their defaults). */
  size_t snap_bytes_f5;
} pd_mode;

/* The mode of that id, or NULL. */
const pd_mode *pd_mode_find(int id);

/* The publication rule of Shampoo and K-FAC (pd_mode.publishable): no error status, a
 * finite error within failure_threshold, every value of every part finite. */
int pd_publishable_finite(const void *opts, const pd_block *u, int status,
                          const pd_compute_info *info, const float *const *out,
                          double failure_threshold);

/* Shampoo's options (mode_shampoo.c); service.c decodes the wire's into them. */
typedef struct {
  uint32_t block_size;
  uint32_t skip_limit;
  float beta2;
  uint32_t root_exponent;
  double epsilon;
  int method;
  uint32_t root_every; /* roots when the statistics step enters a new window of this many
                        * steps (shampoo_compute_due); 1: every push */
} pd_shampoo_opts;

extern const pd_mode pd_mode_shampoo;

/* Shampoo's per-block tallies (pd_block.mode_counts), one per factor root: warm-started,
 * skipped by the warm path's skip test, seeded (no basis held), cold (the job's method). */
enum { PD_SHAMPOO_WARM = 0, PD_SHAMPOO_SKIPPED = 1, PD_SHAMPOO_SEEDED = 2, PD_SHAMPOO_COLD = 3 };

/* K-FAC's options (mode_kfac.c); zero fields take pc_kfac_opts_default's values. */
enum { /* inverse method: the wire's KfacInverse; pc_kfac_inv + 1 for the explicit ones */
       PD_KFAC_INVERSE_AUTO = 0, /* pc_kfac_inv_for_size (Cholesky at every size, measured) */
       PD_KFAC_INVERSE_CHOLESKY,
       PD_KFAC_INVERSE_EIGH,
       PD_KFAC_INVERSE_NEWTON
};
enum { PD_KFAC_AUX_PI = 0, PD_KFAC_AUX_DAMP_A, PD_KFAC_AUX_DAMP_G }; /* pd_root.aux */

typedef struct {
  double factor_decay;
  double damping;     /* lambda */
  uint32_t inv_every; /* pushes between inverse computations */
  int no_pi_damping;  /* 1: pi = 1 */
  int inverse;        /* PD_KFAC_INVERSE_* */
  uint32_t max_order; /* layers with a larger factor get no unit (0: 4096) */
} pd_kfac_opts;

extern const pd_mode pd_mode_kfac;

/* Little-endian fields of snapshot sections (snapshot.c). */
void pd_le_put(unsigned char *out, uint64_t v, int bytes);
uint64_t pd_le_get(const unsigned char *in, int bytes);

/* ---- jobs and the store --------------------------------------------------------------- */

#define PD_MAX_WORKER_NAMES 64

/* A job is reference-counted: the store holds one reference while the job is listed, and
 * every call or queued computation that uses it holds one (pd_store_get, pd_job_ref), so an
 * ended job is freed by whoever drops the last reference, never under a reader. */
struct pd_job {
  _Atomic int refs;           /* 1 from pd_job_build: its builder's */
  _Atomic int ended;          /* removed from the store: queued work for it is skipped */
  _Atomic double last_active; /* pd_now() of its last Register, push or fetch */
  char *name;
  const pd_mode *mode;
  _Alignas(max_align_t) unsigned char opts[PD_MODE_OPTS_MAX]; /* the mode's, resolved */
  size_t ntensors;
  pd_tensor *tensors;
  size_t nblocks;
  pd_block *blocks;
  size_t ndiag;
  uint32_t *diag;                     /* tensors with no units */
  int in_store;                       /* its statistics are counted in the daemon's memory */
  size_t scratch_max;                 /* pd_unit_scratch_bytes of its largest unit (cold from
                                       * pd_job_build; the store's warm rule once added) */
  uint64_t version_base;              /* the store's epoch << 40: root versions start above it */
  const struct pd_replica_link *link; /* the store's (NULL: one daemon) */
  double *rank_load;                  /* estimated cost owned per rank (pd_replica_plan) */
  uint64_t resumed_step;              /* last_step in the snapshot it was restored from; 0 */
  pthread_mutex_t lock;               /* guards last_step, workers */
  uint64_t last_step;
  size_t nworkers;
  char *workers[PD_MAX_WORKER_NAMES];
};

/* The name of a job that was ended: Register refuses it (PD_EENDED) unless the request
 * asks to reuse it, so that a worker still running cannot bring back a job an operator
 * ended (libprecond registers again by itself when the daemon lost its job). */
typedef enum { PD_ENDED_BY_CALL = 0, PD_ENDED_IDLE = 1 } pd_ended_how;

typedef struct {
  char *name;       /* owned by the store (or by the array that holds the copy) */
  int64_t ended_at; /* unix time, seconds */
  uint32_t how;     /* pd_ended_how */
} pd_ended_job;

#define PD_MAX_ENDED_JOBS 65536u /* --ended-jobs at most; a snapshot holding more is damaged */

typedef struct {
  pthread_rwlock_t lock; /* guards the job list (each listed job: one reference) and ended */
  size_t njobs, cap;
  pd_job **jobs;
  pd_stats *stats;
  size_t memory_limit;
  size_t job_memory_limit; /* 0: none; set after pd_store_init (main.c) */
  /* The budget the pool computes in (scheduler.c): memory_limit minus the listed jobs'
   * reservations. Register keeps room in it for the largest unit's scratch of any job, so
   * one computation always fits; more run at once only while their scratch fits too. */
  _Atomic size_t reserved;    /* pd_job_bytes of the listed jobs */
  _Atomic size_t scratch_max; /* the largest scratch_max of the listed jobs */
  int warm_roots;             /* the pool warm-starts roots (--warm-roots): their scratch
                               * bound is the warm one (set after pd_store_init) */
  uint32_t max_blocks_per_job;
  _Atomic uint64_t generation; /* bumped by every change: snapshots skip when unchanged */
  uint64_t epoch;              /* daemon starts with this state dir (main.c); 0 without */
  uint64_t run; /* the daemon job's run (pd_resume_plan.run), written into snapshots; 0 */
  const struct pd_replica_link *link; /* daemon replicas (set before any job is added) */
  _Atomic uint64_t removed;           /* jobs removed (ended or expired): main.c snapshots soon */
  /* Names of ended jobs, oldest first, at most ended_max (set after pd_store_init; 0: none
   * are remembered and an ended job can be registered again at once). */
  pd_ended_job *ended;
  size_t nended, ended_max;
  size_t extra; /* pd_store_reserve_extra's bytes, in reserved too; guarded by lock */
} pd_store;

int pd_store_init(pd_store *st, pd_stats *stats, size_t memory_limit, uint32_t max_blocks_per_job);
void pd_store_destroy(pd_store *st);

/* Builds a job of mode with options opts (mode->opts_size bytes, resolved: the job copies
 * them), units from the mode's layout, without adding it to the store. On PD_OK the caller
 * owns *out (pd_job_free or pd_store_add). PD_EINVAL / PD_ELIMIT with a message in err.
 * Memory for statistics is counted only when added. */
int pd_job_build(const char *name, const pd_mode *mode, const void *opts, size_t ntensors,
                 const pd_tensor *tensors, uint32_t max_blocks, pd_job **out, char *err,
                 size_t errlen);
/* Frees a job whose only reference its caller holds (one it built and did not add, or one
 * nothing else can reach any more). NULL is a no-op. */
void pd_job_free(pd_job *job, pd_stats *stats);
/* Takes one more reference to job. */
void pd_job_ref(pd_job *job);
/* Drops one reference; the last frees the job (pd_job_free, its memory uncounted from
 * stats). NULL is a no-op. */
void pd_job_unref(pd_job *job, pd_stats *stats);

/* Returns 1 when two jobs have the same mode, options and tensors. */
int pd_job_same(const pd_job *a, const pd_job *b);

/* Bytes the job needs: its records (names, shapes, blocks), statistics and one result per
 * unit. */
size_t pd_job_bytes(const pd_job *job);

/* The largest pd_unit_scratch_bytes(u, warm) of the job's units. */
size_t pd_job_scratch_bytes(const pd_job *job, int warm);

/* 1 if job's reservation (pd_job_bytes) is above the store's per-job limit. */
int pd_store_job_over_limit(const pd_store *st, const pd_job *job);

/* Reserves bytes besides the jobs' (shared-memory regions) in the memory budget, with the
 * same room kept for the pool's scratch as pd_store_add keeps: PD_ELIMIT if they do not
 * fit. Released with pd_store_release_extra. */
int pd_store_reserve_extra(pd_store *st, size_t bytes);
void pd_store_release_extra(pd_store *st, size_t bytes);

/* Adds job (ownership passes to the store on PD_OK; on error the caller keeps it): allocates
 * its zeroed statistics if they are not allocated yet. *existing gets a new reference to a
 * job of the same name if there is one (then nothing is added, PD_OK is returned, the caller
 * keeps job and drops *existing with pd_job_unref; the lookup is that job's activity).
 * PD_ELIMIT when over the memory limit, the per-job limit or PD_MAX_JOBS, PD_ENOMEM. */
int pd_store_add(pd_store *st, pd_job *job, pd_job **existing);

/* pd_store_add for a Register: when no job of that name is listed but the name is one of an
 * ended job, PD_EENDED (nothing added; *ended, if not NULL, gets when and how it ended, its
 * name NULL) unless reuse_ended, which forgets the ended name and adds the job. pd_store_add
 * (a restore, a replica's copy) always forgets it. */
int pd_store_register(pd_store *st, pd_job *job, int reuse_ended, pd_job **existing,
                      pd_ended_job *ended);

/* 1 with *out filled (its name NULL) if name is one of an ended job, else 0. */
int pd_store_ended(pd_store *st, const char *name, pd_ended_job *out);

/* The ended names now, oldest first, copied (free with pd_ended_free), and with jobs not
 * NULL the listed jobs as pd_store_list gives them, both under one lock (a snapshot never
 * holds a job and its end). *nended gets their count; NULL on out of memory. */
pd_ended_job *pd_store_list_ended(pd_store *st, size_t *nended, pd_job ***jobs, size_t *njobs);
void pd_ended_free(pd_ended_job *ended, size_t n);

/* Remembers ended names read from a snapshot (oldest first; ownership of the array and its
 * names passes to the store): only the newest ended_max are kept. */
void pd_store_restore_ended(pd_store *st, pd_ended_job *ended, size_t n);

/* A new reference to the job of that name (release it with pd_job_unref), or NULL. With
 * touch, the lookup counts as the job's activity (its idle clock restarts): workers' calls
 * touch, GetStats does not. */
pd_job *pd_store_get(pd_store *st, const char *name, int touch);

/* The jobs listed now, in the store's order, each with a new reference; *n gets their
 * count. NULL on out of memory. The caller releases them with pd_store_list_free. */
pd_job **pd_store_list(pd_store *st, size_t *n);
void pd_store_list_free(pd_job **jobs, size_t n, pd_stats *stats);

/* Removes the job of that name from the store and returns the store's reference to it (the
 * caller drops it with pd_job_unref once nothing is queued for it), or NULL if there is none.
 * With idle_s > 0 only a job idle for longer than idle_s at time now is removed, and name
 * NULL takes the first such job. The job is marked ended and its name remembered as ended
 * (PD_ENDED_IDLE with idle_s > 0); generation and removed count it. */
pd_job *pd_store_remove(pd_store *st, const char *name, double idle_s, double now);

/* Records a worker name for the job's stats (bounded). */
void pd_job_note_worker(pd_job *job, const char *worker);

/* Folds one validated increment into unit b through its mode (parts already fp32, of the
 * unit's orders). A push of a step newer than the published root's source step is a
 * staleness sample, counted in the unit and in stats (may be NULL). */
void pd_block_update(pd_block *b, const float *const *inc, uint64_t step, pd_stats *stats);

/* Applies one push to n distinct blocks of job, all or nothing: blocks[i] gets the
 * validated increment parts inc[PD_MAX_PARTS * i + k] (pd_block_update's rule). If any
 * updated statistic would hold a non-finite value (the sum of large finite pushes
 * overflows: the mode's fold_fits), nothing is stored and PD_EINVAL is returned with
 * *bad = that i. Staleness samples go to stats (may be NULL) as in pd_block_update.
 * PD_ENOMEM. */
int pd_job_push(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                uint64_t step, pd_stats *stats, size_t *bad);

/* pd_job_push with what the caller's NaN/Inf pass found: inc_scan[PD_MAX_PARTS * i + k]
 * is rpc_f32_scan's result for inc[PD_MAX_PARTS * i + k] (NULL: none known). Where an
 * increment part is RPC_F32_BOUNDED and the block's statistic part is known bounded, the
 * mode's overflow check is decided without a pass (pd_mode.fold_bounded). */
int pd_job_push_scanned(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                        const uint8_t *inc_scan, uint64_t step, pd_stats *stats, size_t *bad);

/* pd_mode.fold_into's results; PD_FOLD_VOUCH: pd_mode.fold_vouched found a value outside
 * the vouch. */
enum {
  PD_FOLD_OK = 0,
  PD_FOLD_NONFINITE = 1,
  PD_FOLD_OVERFLOW = 2,
  PD_FOLD_CHANGED = 3,
  PD_FOLD_VOUCH = 4
};

/* Why pd_job_push_into refused a push: the block (index into blocks) and part, and a
 * PD_FOLD_* (PD_FOLD_CHANGED: intact said the increments' memory changed meanwhile).
 * torn: the push was folded without a spare (pd_job_push_vouched) and could not be undone:
 * the statistics hold its values where they were within the vouch, their old ones
 * elsewhere, all finite. */
typedef struct {
  size_t block;
  uint32_t part;
  int why;
  int torn;
} pd_push_refusal;

/* pd_job_push for a job whose mode has fold_into (pd_job_push otherwise), all or nothing,
 * reading each increment value once: per block, under every block's lock, the checks and the
 * fold (pd_mode.fold_into: into out[PD_MAX_PARTS * i + k], or in place with the statistic's
 * old values copied there; pc_packed_len(order) floats each, the caller's, not aliasing
 * anything); then intact(ctx) (NULL: none) is asked whether the increments' memory stayed as
 * read, and only if every block passed are the folded statistics kept, else every block's
 * statistics are as before. Either way out[] then holds buffers of the same sizes, the
 * caller's (their values unspecified). PD_EINVAL with *refusal (NaN or Inf first, then
 * overflow, in block order; nothing stored), a refusal of intact's, or PD_ENOMEM. Staleness
 * as in pd_block_update. */
int pd_job_push_into(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                     float **out, uint64_t step, pd_stats *stats, int (*intact)(void *ctx),
                     void *ctx, pd_push_refusal *refusal);

/* pd_job_push_into for a push whose every increment part the client vouched for (ShmRef.
 * vouched, from a client that holds vouched slots until answered): where the job's mode has
 * fold_vouched and every block's statistic parts are known below 2^126, each block is
 * folded in place with no spare (out[] unused), so no refusal can come from a client whose
 * vouch is true; a false vouch (a value outside it) or intact's refusal then leaves the
 * push torn (PD_EINVAL, refusal->torn set; nothing can be undone, the statistics stay
 * finite, the pushes' counts and steps unchanged). Otherwise exactly pd_job_push_into. */
int pd_job_push_vouched(pd_job *job, size_t n, pd_block *const *blocks, const float *const *inc,
                        float **out, uint64_t step, pd_stats *stats, int (*intact)(void *ctx),
                        void *ctx, pd_push_refusal *refusal);

/* A new reference to the block's root (NULL if none): release with pd_root_unref. */
pd_root *pd_block_root(pd_block *b);

/* Publishes r (its reference passes to the block) with version = previous + 1, or, for the
 * first root of this daemon run, version_base + 1: versions never go backwards across a
 * restart, whatever the clients held when the daemon died. */
void pd_block_publish(pd_block *b, pd_root *r, pd_stats *stats);

/* Publishes r, a result another replica computed, under its owner's version r->version
 * (never renumbered, never sent on). Returns 1 when published (the reference passes to the
 * block); 0 when the block already holds that version or a newer one (r is released). */
int pd_block_publish_as(pd_block *b, pd_root *r, pd_stats *stats);

/* 1 if a push that brought unit b to its current push count and statistics step queues a
 * computation (the mode's compute_due; every push without one); then that step is the
 * block's due_step. */
int pd_block_due(pd_block *b);

/* ------------------------------------------------------------------------------------ */
/* replica_plan.c: daemon replicas (docs/replicas.md)                                     */
/*
 * Under mpirun each rank runs one precondd. Every rank computes the same ownership from a
 * job's layout (pd_replica_plan), computes results only for the units it owns, sends each
 * one to every other rank, and forwards statistics pushed to it for a unit it does not own
 * to that unit's owner. A worker thus pushes to and fetches from its local daemon only.
 * The MPI side lives in replica.c; the store and the service see it only through this link,
 * so that they (and their unit tests) need no MPI.
 */

typedef struct pd_replica_link {
  int rank, nranks;
  void *ctx;
  /* A job registered here first: every other rank gets it too. Never blocks. */
  void (*job_added)(void *ctx, const pd_job *job);
  /* A job ended here by EndJob: every other rank ends it too. Never blocks. */
  void (*job_ended)(void *ctx, const char *name);
  /* This rank published r for unit b (its owner): it goes to every other rank. r is
   * immutable: the hook may keep a reference (pd_root_ref) to send its parts from. */
  void (*published)(void *ctx, const pd_block *b, pd_root *r);
  /* Statistics pushed here for a unit another rank owns (fp32 parts of its orders, copied
   * before it returns): they go to the owner. PD_OK or PD_ENOMEM. */
  int (*forward)(void *ctx, const pd_block *b, const float *const *parts, uint64_t step);
  /* 1 once MPI failed on this rank: it then computes every unit itself (results of the
   * other ranks no longer arrive). */
  _Atomic int alone;
  _Atomic uint64_t roots_sent, roots_received, stats_forwarded, stats_received, mpi_errors;
} pd_replica_link;

/* 1 if this daemon computes unit b's results: no link, MPI gone, or b's owner. */
int pd_replica_owns(const pd_replica_link *link, const pd_block *b);

/* The estimated cost of computing unit b's result: the sum of its parts' order^3 (an
 * inverse root, an inverse, an eigendecomposition of order n: O(n^3) each). */
double pd_replica_cost(const pd_block *b);

/* Assigns every unit of job an owner among nranks >= 1 ranks, deterministically from the
 * layout alone (so every rank agrees without talking): units by decreasing cost (ties: lower
 * id first) each to the rank with the least cost so far (ties: lower rank). Greedy bound:
 * the most loaded rank exceeds the least loaded by at most the largest unit's cost. Fills
 * b->owner and job->rank_load (nranks entries, allocated here, freed with the job).
 * PD_OK, PD_EINVAL (nranks < 1), PD_ENOMEM. */
int pd_replica_plan(pd_job *job, int nranks);

/* 1 when this process was started by an MPI launcher (OMPI_COMM_WORLD_SIZE or PMI_SIZE in
 * the environment), with the world size it announces in *size. */
int pd_replica_launched(int *size);

/* Replaces every "%r" in s (capacity cap) by rank. -1 when the result does not fit. */
int pd_replica_subst(char *s, size_t cap, int rank);

/* Resuming the daemon job from its state directories (main.c, docs/replicas.md). Each rank
 * reports what its own directory holds (pd_snapshot_peek), the ranks exchange these views,
 * and every rank derives the same plan from them: the same rank count and run as the
 * snapshots found: each rank restores its own (pd_snapshot_read); another count: every rank
 * reads the old ranks' snapshots and takes the units it owns now
 * (pd_snapshot_read_resharded). Fixed-size: exchanged as bytes between ranks of one build. */
/* An old rank's snapshot file as bytes (pd_snapshot_load; over MPI: pd_replica_share_snapshots).
 * data NULL: no rank could read it. */
typedef struct {
  unsigned char *data;
  size_t len;
} pd_snap_bytes;

enum { PD_VIEW_NONE = 0, PD_VIEW_EMPTY, PD_VIEW_JOBS, PD_VIEW_BAD, PD_VIEW_FAILED };
typedef struct {
  int32_t state;        /* PD_VIEW_*: no snapshot, one without jobs, with jobs, damaged,
                          * the directory unusable (this rank stops) */
  int32_t rank, nranks; /* the snapshot's origin; nranks 0: not known (an older daemon) */
  uint64_t run;         /* the snapshot's run; 0: not known */
  uint64_t propose;     /* a fresh run id (rank 0's is taken when nothing is resumed) */
} pd_replica_view;

typedef struct {
  int reshard;    /* 1: resume under another rank count */
  int old_nranks; /* the count the snapshots were written under (reshard) */
  uint64_t old_run;
  uint64_t run; /* this run's id, written into every snapshot it takes */
} pd_resume_plan;

/* The plan from every rank's view (views[r] of rank r, nranks of them). Resumed as before
 * (each rank its own directory) when no rank holds jobs, when the origin is not known
 * (snapshots of older daemons), or when every snapshot holding jobs was written by this rank
 * under this count in one run; otherwise resharded from the count (and run) of rank 0's
 * snapshot (or, if rank 0 holds none, the lowest rank's with jobs). Never fails. */
void pd_replica_resume_plan(const pd_replica_view *views, int nranks, pd_resume_plan *out);

/* ---- replica.c (only when precondd is built with MPI) ---- */

typedef struct pd_replica pd_replica;
typedef struct pd_daemon pd_daemon;

/* Initialises MPI (MPI_THREAD_SERIALIZED: only one thread calls MPI at a time: the main
 * thread before pd_replica_start and after pd_replica_stop, the communication thread in
 * between), with MPI_ERRORS_RETURN on its communicator. *out (owned; pd_replica_finalize)
 * holds the link; *rank and *nranks are set. PD_EIO with a message logged. */
int pd_replica_init(int *argc, char ***argv, pd_replica **out, int *rank, int *nranks);
pd_replica_link *pd_replica_link_of(pd_replica *x);
/* Collective over all ranks: 1 if every rank passes ok != 0 (startup agreement: a rank that
 * failed to start makes them all stop instead of waiting for it). */
int pd_replica_agree(pd_replica *x, int ok);
/* Collective over all ranks, main thread, before pd_replica_start: all[r] = rank r's mine.
 * PD_OK or PD_EIO (logged). */
int pd_replica_exchange(pd_replica *x, const pd_replica_view *mine, pd_replica_view *all);
/* Collective over all ranks, main thread, before pd_replica_start: every old rank k's
 * snapshot (dirs[k]/precondd.snap, k < old_nranks) to every rank, so that a resume under
 * another rank count needs no shared state directories: it is read by the rank whose own
 * directory it is (rank k) if that rank can read it, else by the lowest rank that can, and
 * broadcast. out[k] (owned by the caller: free each data) gets its bytes, data NULL when no
 * rank could read it. *floor: this rank's highest old epoch in, every rank's out.
 * *received: how many came from another rank. PD_OK, PD_ENOMEM, PD_EIO (logged). */
int pd_replica_share_snapshots(pd_replica *x, const char *const *dirs, int old_nranks,
                               pd_snap_bytes *out, uint64_t *floor, int *received);
/* Starts the communication thread serving d (its pool running), after queueing this rank's
 * restored roots for the others. PD_OK or PD_ENOMEM. */
int pd_replica_start(pd_replica *x, pd_daemon *d);
/* Before the pool stops: statistics received from then on are folded but queue nothing. */
void pd_replica_quiesce(pd_replica *x);
/* Sends what is queued, tells every rank this one is done, takes what they still send until
 * each said so (at most grace_s seconds), and joins the thread. */
void pd_replica_stop(pd_replica *x, double grace_s);
/* MPI_Finalize and free. */
void pd_replica_finalize(pd_replica *x);

/* ------------------------------------------------------------------------------------ */
/* scheduler.c                                                                            */
/*
 * Policy of the root pool. A push queues each block it touched (once; a block being
 * computed is queued again when that computation ends). A free worker takes, in order:
 *   1. blocks with no root yet (a worker cannot precondition them at all);
 *   2. then the stalest: the largest stat_step - root_step, the steps since the statistics
 *      its current root came from (so under load every block's age stays bounded by about
 *      one pass over the queue instead of the hot blocks starving the rest);
 *   3. then the cheapest (smallest rows^3 + cols^3): among equally stale blocks, shortest
 *      first minimises the mean wait, hence the mean staleness.
 * Drift test: before the O(n^3) roots, the worker computes in O(n^2) the trace and three
 * fixed random quadratic forms v^T S v of each part and compares them with those of the
 * statistics the published root came from. For a mode whose result scales exactly with
 * its statistics (Shampoo: (c S)^(-1/p) = c^(-1/p) S^(-1/p) with a relative ridge), the
 * forms are compared divided by the trace: a statistic that only grew (an EMA filling up,
 * a sum) has not drifted, and its kept root is rescaled by the trace ratio^(-1/p). If every
 * form moved by less than drift_threshold (relative), the roots would move by about a
 * quarter of that (for p = 4), under the 1-3% at which any fp32 root already sits from the
 * exact one: the root is kept, republished as of the new step (next version, so workers
 * and --sync-roots see it is current) and counted as skipped. The reference is not moved
 * by a skip, so drift that accumulates over several pushes still triggers a computation.
 */

typedef struct {
  double failure_threshold; /* a root with a larger error, or non-finite, is not published */
  double drift_threshold;   /* <= 0: always compute */
  pd_store *budget;         /* scratch admitted within its free budget; NULL: no limit */
  int warm_start;           /* 1: compute gets the unit's mode_state to keep between
                             * computations (--warm-roots on); 0: NULL, every one is cold */
  int pool_nice;            /* 1-19: each pool thread lowers its own nice value to this
                             * (--pool-nice), below a same-host worker's threads; 0: as
                             * the daemon's */
} pd_sched_rules;

/* A bound on the memory one computation of unit u takes besides the unit's own state and
 * its published result: the pool's private copy of the state and the new result, and the
 * dense numerics (80 n^2 bytes for the largest order n: the fp32 Newton keeps five n x n
 * fp64 iterates and an fp64 copy for its residual, the mode two fp32 n x n matrices; eigh
 * and K-FAC's inverses take less). With warm (--warm-roots on) and a mode that keeps
 * per-unit state, 48 n^2 more: the warm route's own buffers, held while its cold fallback
 * runs (scheduler.c). */
size_t pd_unit_scratch_bytes(const pd_block *u, int warm);

typedef enum {
  PD_ROOT_PUBLISHED = 0, /* computed and published */
  PD_ROOT_FAILED,        /* computed, refused by the failure rule; the previous root stays */
  PD_ROOT_SKIPPED        /* drift below the threshold: the previous root republished */
} pd_root_outcome;

typedef struct {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  pd_block **queue;
  size_t len, cap;
  int stopping;
  int nthreads;
  pthread_t *threads;
  pd_stats *stats;
  pd_sched_rules rules;
  _Atomic uint64_t busy;
  size_t scratch_in_use; /* of the computations running now; guarded by lock */
  int blas_wide;         /* OpenBLAS threads of a large block: cores / workers, at least 1 */
  int blas_now;          /* what the pool last set (process-wide); guarded by lock */
} pd_sched;

/* Below this order (the largest side of a unit) a root computation runs on one OpenBLAS
 * thread. Its level-3 calls are too small to split: on a loaded host the second thread
 * spins waiting for its share (52% of a --threads 1 daemon's samples were in the kernel's
 * scheduler, session 4). Measured with bench-roots (fp32 Newton and fp64 eigh, p = 2) on
 * the shared 2-core host, 1 against 2 threads, two interleaved runs: 2 threads lost at
 * orders 64, 128 and 256 in wall and CPU time (eigh fp64 at 128: 0.87-0.89 ms against
 * 2.1-7.0 ms); at 512 each won some (docs/optimizers.md, precondd's BLAS threads). */
#define PD_BLAS_WIDE_ORDER 512u

/* The OpenBLAS threads the pool gives a computation whose largest order is order: wide
 * (the pool's cores / workers) from PD_BLAS_WIDE_ORDER on, else 1. */
int pd_sched_blas_threads(uint32_t order, int wide);

/* A block whose roots failed this many times in a row has its statistics zeroed (counted
 * in resets, logged): nothing a later push adds could otherwise bring it back. */
#define PD_FAILURES_BEFORE_RESET 4u

/* Starts nthreads workers. OpenBLAS's thread count is process-wide: a worker sets it before
 * each computation (pd_sched_blas_threads, under the pool's lock), never above cores /
 * workers, so workers times BLAS threads does not exceed the online cores. With several
 * workers a small block's 1 may briefly narrow a large block computing beside it: a cost in
 * speed only. */
int pd_sched_start(pd_sched *s, int nthreads, pd_stats *stats, const pd_sched_rules *rules);
/* Queues a block whose statistics changed (no-op when already queued; a block being
 * computed is queued again when that computation ends). PD_ENOMEM if the queue cannot grow. */
int pd_sched_mark(pd_sched *s, pd_block *b);
/* Blocks waiting plus being computed. */
uint64_t pd_sched_depth(pd_sched *s);
/* Stops the workers after their current computation; queued blocks stay unqueued. */
void pd_sched_stop(pd_sched *s);
/* Unqueues every block of job (an ended job) and drops the references their queue entries
 * held; a block being computed finishes and is not queued again. */
void pd_sched_forget(pd_sched *s, pd_job *job);
/* Runs the drift test and, unless it skips, computes the roots of b now, on the calling
 * thread, publishing them if they pass the failure rule. PD_OK with *outcome set, or
 * PD_ENOMEM (nothing changed). */
int pd_sched_compute(pd_block *b, pd_stats *stats, const pd_sched_rules *rules,
                     pd_root_outcome *outcome);
/* 1 if the pool takes a before b (the policy above); exposed for its unit test. */
int pd_sched_before(pd_block *a, pd_block *b);

/* ------------------------------------------------------------------------------------ */
/* snapshot.c                                                                             */

#define PD_SNAPSHOT_FILE "precondd.snap"

/* Writes the whole store to dir/precondd.snap atomically (temporary file, fsync, rename,
 * fsync of the directory), CRC-32 checked. Statistics are copied block by block under the
 * block lock: each block is consistent, pushes are not blocked for the whole write. */
int pd_snapshot_write(pd_store *st, const char *dir);

/* Restores dir/precondd.snap into an empty store. PD_ENOENT when there is none. On
 * PD_ECORRUPT nothing is loaded and a reason is in err; the caller sets the file aside
 * with pd_snapshot_set_aside. */
int pd_snapshot_read(pd_store *st, const char *dir, char *err, size_t errlen);

/* Where a snapshot comes from: the rank that wrote it, of how many, in which run of the
 * daemon job (format 5; format 4 and older: rank and count from the precondd.replicas file
 * their daemons wrote beside it, run 0; rank -1 and nranks 0 when neither says). */
typedef struct {
  int rank, nranks;
  uint64_t run;
  uint32_t njobs;
} pd_snap_origin;

/* Verifies dir/precondd.snap (as pd_snapshot_read does) and reads its origin and job count.
 * PD_OK, PD_ENOENT, or PD_ECORRUPT / PD_EIO with a reason in err. */
int pd_snapshot_peek(const char *dir, pd_snap_origin *o, char *err, size_t errlen);

/* Resumes a daemon job written by old_nranks ranks (run old_run; 0: any) as rank `rank` of
 * nranks: dirs[k] is old rank k's state directory; bytes, when not NULL, holds old rank k's
 * snapshot file at bytes[k] (read from dirs[k] by some rank; then dirs only name them, and
 * format-4 snapshots' origin files are looked for there). Every old snapshot must be there and from
 * that run; each job is taken whole (layout, last step, workers), each unit's statistics
 * (and counters) from its old owner's snapshot (pd_replica_plan under old_nranks) when this
 * rank owns it under nranks, zero otherwise, and every unit's newest root (by version) from
 * whichever snapshot holds it; ended names from all. Into an empty store; on failure nothing
 * is loaded: PD_ENOENT (a snapshot missing), PD_EINVAL (another run, or a job that differs
 * between snapshots), PD_ECORRUPT, PD_EIO, PD_ELIMIT, PD_ENOMEM, with err naming the file. */
int pd_snapshot_read_resharded(pd_store *st, const char *const *dirs, const pd_snap_bytes *bytes,
                               int old_nranks, uint64_t old_run, int rank, int nranks, char *err,
                               size_t errlen);

/* Reads dir/precondd.snap whole, unchecked (pd_snapshot_read_resharded checks it), into *data
 * (malloc'd, the caller frees it) of *len bytes. PD_ENOENT, PD_EIO, PD_ENOMEM (err says). */
int pd_snapshot_load(const char *dir, unsigned char **data, size_t *len, char *err, size_t errlen);

/* Renames dir/precondd.snap to dir/precondd.snap.corrupt-<unix seconds>; the new name is
 * written to newname. */
int pd_snapshot_set_aside(const char *dir, char *newname, size_t len);
/* The same as precondd.snap.stale-<unix seconds>: a snapshot of an earlier run of the daemon
 * job, in the directory of a rank that the run resumed from did not have. */
int pd_snapshot_set_aside_stale(const char *dir, char *newname, size_t len);

/* ------------------------------------------------------------------------------------ */
/* service.c and server.c                                                                 */

/* ------------------------------------------------------------------------------------ */
/* shm.c: shared-memory regions of same-host clients (docs/precondd.md, "Shared memory")   */

#define PD_SHM_MAX_SESSIONS  64
#define PD_SHM_DEFAULT_BYTES ((uint64_t)64 << 20) /* two 32 MiB halves */
/* Why a push reference is refused whose bytes a later push took over (rpc_shm_push_intact). */
#define PD_SHM_OVERWRITTEN                                                                  \
  "overwritten by a later push of the client while the daemon read it (the client gave up " \
  "on this call and its ring wrapped)"
/* The roots area every client maps (rpc.h): made with the first region, 128 MiB of roots
 * (a 4096 block's pair is 67 MB) past its entry table. */
#define PD_SHM_ROOTS_BYTES (RPC_SHM_ROOTS_DATA + ((uint64_t)128 << 20))
#define PD_SHM_MAX_BYTES   ((uint64_t)1 << 31)

typedef struct pd_shm_session pd_shm_session;

/* Serves one request rung at a region's doorbell (rpc.h, rpc_shm_head): method
 * RPC_SHM_BELL_*, its len packed bytes at req (in the region: the callee copies them once
 * before reading them); puts the answer's gRPC status in *code and its bytes (the packed
 * response on OK, the message otherwise) in out (cap bytes), returning how many. service.c's
 * pd_service_bell, which serves it as the gRPC method's handler does. */
typedef size_t (*pd_shm_bell_fn)(void *ctx, uint32_t method, const void *req, size_t len,
                                 uint32_t *code, unsigned char *out, size_t cap);

typedef struct {
  int inited;           /* 0 (a zeroed struct): shared memory is off */
  char dir[1024];       /* where regions are made; "": off */
  pthread_mutex_t lock; /* guards the list, next_id and every session's attached flag */
  pd_shm_session *s[PD_SHM_MAX_SESSIONS];
  size_t n;
  uint64_t next_id;
  pd_store *store; /* regions reserve their bytes in its budget */
  pd_stats *stats; /* and count in memory_bytes */
  _Atomic uint64_t opened, reaped;
  /* The roots area (made with the first region; roots == NULL: none, or it failed). */
  pthread_mutex_t roots_lock; /* guards the rest and every pd_root's shm_seq */
  char roots_path[1100];
  int roots_fd, roots_tried;
  unsigned char *roots;
  size_t roots_bytes;
  uint64_t roots_seq;    /* the last publication's sequence number */
  uint64_t roots_oldest; /* the oldest publication whose entry may still be valid */
  uint64_t roots_pos;    /* the ring's next free byte, from the data's start */
  /* The doorbell (pd_shm_serve_bells): one thread per region serves it while listed. */
  pd_shm_bell_fn bell;
  void *bell_ctx;
  atomic_int bells; /* threads alive; pd_shm_destroy waits for none */
} pd_shm;

/* Sets r up to make regions in dir ("" or NULL: off; OpenSharedMemory is then refused). */
int pd_shm_init(pd_shm *r, const char *dir, pd_store *store, pd_stats *stats);
/* Frees every region (sessions still referenced are freed by their last pd_shm_put), after
 * the doorbell threads have ended (a request being served is finished first). */
void pd_shm_destroy(pd_shm *r);
/* Regions made from now on serve their doorbell with fn(ctx, ...): a thread per region
 * waits on its futex while the region is listed. Before the first pd_shm_open. */
void pd_shm_serve_bells(pd_shm *r, pd_shm_bell_fn fn, void *ctx);
/* 1 when s's doorbell is served (ShmOpenResponse.doorbell). */
int pd_shm_bell_served(const pd_shm_session *s);
/* The client's promise at ShmOpen (ShmOpenRequest.holds_vouched): it writes no vouched
 * reference's bytes before that push's answer. Set before the region's answer is sent. */
void pd_shm_set_holds_vouched(pd_shm_session *s, int holds);
int pd_shm_holds_vouched(const pd_shm_session *s);
/* Makes a region of want bytes (0: PD_SHM_DEFAULT_BYTES; rounded up to whole ring slots)
 * and lists it. On PD_OK *out holds one reference for the caller (pd_shm_put). PD_EINVAL
 * (off, or a size outside the limits), PD_ELIMIT (too many regions, or over the memory
 * budget), PD_EIO, PD_ENOMEM, with a message in err. */
int pd_shm_open(pd_shm *r, uint64_t want, pd_shm_session **out, char *err, size_t errlen);
/* What the client needs to attach: pointers into s, valid while the caller's reference. */
void pd_shm_describe(const pd_shm_session *s, uint64_t *id, const unsigned char **secret,
                     const char **path, size_t *bytes);
/* The listed region with this id and secret (compared in constant time), with a new
 * reference (pd_shm_put); the first such call marks it attached. NULL otherwise. */
pd_shm_session *pd_shm_get(pd_shm *r, uint64_t id, const void *secret, size_t len);
void pd_shm_put(pd_shm *r, pd_shm_session *s);
/* A push's copies of the matrices its client wrote: into a buffer the session keeps from
 * push to push (its pages stay mapped), or malloc'd ones when another push of the session
 * holds it, the budget has no room for it or total is above the client's half. */
typedef struct {
  pd_shm_session *s;
  unsigned char *buf; /* the session's buffer, held until pd_shm_in_end; NULL: malloc'd */
  size_t cap, used;
  int held; /* the session's push lock (its buffer and spares) is this push's */
} pd_shm_in;
/* Starts the copies of one push of total bytes (each matrix's rounded up to RPC_SHM_ALIGN).
 * The caller holds a reference to s until pd_shm_in_end. */
void pd_shm_in_begin(pd_shm *r, pd_shm_session *s, size_t total, pd_shm_in *in);
/* Starts a push whose matrices are read in place (pd_shm_ref_in, no copies): 1 when it holds
 * the session's push lock (its spares are this push's until pd_shm_in_end), 0 when another
 * push of the session does (copy that push instead: pd_shm_in_begin). */
int pd_shm_in_hold(pd_shm_session *s, pd_shm_in *in);
/* Ends them: the session's buffer (in->buf, when set) is free for the next push; copies
 * into it must not be used or freed any more. */
void pd_shm_in_end(pd_shm_in *in);
/* A matrix the client wrote, to be read in place: the reference checked as pd_shm_copy_in
 * checks it, *at pointing into the region (the client's memory: whoever reads it reads each
 * value once and validates what it read, pd_job_push_into, then asks pd_shm_intact). */
int pd_shm_ref_in(const pd_shm_in *in, uint64_t offset, uint64_t length, size_t expect,
                  const uint8_t **at, const char **why);
/* 1 when the bytes of push reference (offset, seq) were the client's as sent all along
 * (rpc_shm_push_intact: its ring did not wrap over them meanwhile); call after reading. */
int pd_shm_intact(const pd_shm_in *in, uint64_t offset, uint64_t seq);
/* With the push lock held (pd_shm_in_hold): a buffer of count floats, 64-byte aligned, for a
 * statistic a push folds into (pd_job_push_into), from the session's spares (statistics
 * earlier pushes replaced) or allocated within the budget; NULL when neither can be had.
 * Owned by the caller until given back. */
float *pd_shm_spare_take(pd_shm *r, pd_shm_in *in, size_t count);
/* Gives back a buffer of count floats that pd_shm_spare_take handed out, or one of the same
 * size (the statistic it replaced): kept for the next push, or freed when it is not 64-byte
 * aligned or the spares hold the client's half's worth already. */
void pd_shm_spare_give(pd_shm *r, pd_shm_in *in, float *buf, size_t count);
/* A matrix the client wrote: [offset, offset + length) must lie in the region's first half
 * and length be expect bytes. crc: the CRC-32C the copy must have (a checked reference), or
 * NULL (ShmRef.unchecked: no checksum pass; the copy is what is validated and used). On PD_OK
 * *out is its copy: in in->buf
 * when that is set (the session's: not to be freed), else malloc'd (the caller owns it).
 * fp32: the bytes are fp32 values, and *finite gets the copy's rpc_f32_scan of them
 * (RPC_F32_BAD, 0, also when not looked at). seq: the reference's stamp (0: none), checked
 * after the copy (pd_shm_intact). PD_EINVAL with *why (a static phrase) when the reference
 * is out of place, overwritten or the checksum differs; PD_ENOMEM. */
int pd_shm_copy_in(pd_shm_in *in, uint64_t offset, uint64_t length, uint64_t seq,
                   const uint32_t *crc, size_t expect, int fp32, uint8_t **out, int *finite,
                   const char **why);
/* Writes len bytes of src to the next place of the region's second half (its ring): the
 * offset from the region's start and the CRC-32C out. PD_ELIMIT if len is above the half. */
int pd_shm_write_out(pd_shm_session *s, const void *src, size_t len, uint64_t *offset,
                     uint32_t *crc);
/* The roots area's path and size for an OpenSharedMemory answer (NULL, 0: none). */
void pd_shm_roots_describe(pd_shm *r, const char **path, size_t *bytes);
/* Publishes part k of root (encoding enc: 0 fp32, 1 bf16; its len bytes at src) in the
 * roots area, unless it is there already: ref gets the offset, length, CRC-32C and
 * sequence number a fetch answers. PD_ELIMIT when there is no area or len does not fit it
 * (send the bytes another way), or with src NULL when it is not there already (encode it
 * and call again). */
int pd_shm_root_ref(pd_shm *r, pd_root *root, uint32_t k, int enc, const void *src, size_t len,
                    uint64_t *offset, uint64_t *length, uint32_t *crc, uint64_t *seq);
/* 1 when a matrix of len bytes can go to the roots area (pd_shm_root_ref will not refuse
 * it), else 0. */
int pd_shm_root_fits(pd_shm *r, size_t len);
/* Frees regions whose client is gone (no shared flock left) or that were never used within
 * 10 s of their making; returns how many. main.c's once-a-second loop (pd_service_expire). */
size_t pd_shm_reap(pd_shm *r, double now);
/* Regions listed now. */
size_t pd_shm_count(pd_shm *r);

struct pd_daemon {
  pd_config cfg;
  pd_stats stats;
  pd_store store;
  pd_sched sched;
  pd_shm shm;
};

typedef enum {
  PD_M_REGISTER = 0,
  PD_M_PUSH,
  PD_M_FETCH,
  PD_M_STATS,
  PD_M_HEALTH,
  PD_M_END_JOB, /* after the first five: the fuzz corpus picks methods by index */
  PD_M_OPEN_SHM,
  PD_M_COUNT
} pd_method;

/* gRPC paths by pd_method. */
extern const char *const pd_method_paths[PD_M_COUNT];

/* The answer to one call: code and message, and on OK the packed response (owned). */
typedef struct {
  grpc_status_code code;
  char message[512];
  grpc_byte_buffer *payload; /* owned by the reply until sent */
} pd_reply;

/* Handles one unary call of method m with request bytes payload (may be NULL); fills
 * reply. Never fails otherwise: every error becomes a status. */
void pd_service_handle(pd_daemon *d, pd_method m, grpc_byte_buffer *payload, pd_reply *reply);

/* A pd_shm_bell_fn (ctx: the pd_daemon): serves a push or a fetch rung at a region's
 * doorbell through pd_service_handle, as a PushStatistics or FetchPreconditioners call with
 * those bytes. An answer larger than cap is RESOURCE_EXHAUSTED (the client asks over gRPC). */
size_t pd_service_bell(void *ctx, uint32_t method, const void *req, size_t len, uint32_t *code,
                       unsigned char *out, size_t cap);

/* What an ended job held, for the EndJob answer and the log. */
typedef struct {
  uint32_t blocks;
  uint64_t last_step;
  uint64_t bytes; /* pd_job_bytes: its reservation under the memory limit, now free */
} pd_job_ended;

/* Ends the job of that name (or with idle_s > 0, the first job idle for longer than idle_s
 * at time now, when name is NULL): removed from the store, its queued computations dropped,
 * freed once the calls in flight for it finish; counted in stats (ended or expired) and
 * logged. PD_OK with *out filled, or PD_ENOENT. */
int pd_service_end_job(pd_daemon *d, const char *name, double idle_s, double now,
                       pd_job_ended *out);

/* Ends every job idle for longer than cfg.job_idle_expiry_s at time now (no-op when that is
 * off); returns how many. main.c calls it once a second. */
size_t pd_service_expire(pd_daemon *d, double now);

typedef struct pd_server pd_server;

/* Binds cfg->listen and starts cfg->io_threads pollers. *port gets the bound port (0 for a
 * unix socket). */
int pd_server_start(pd_daemon *d, pd_server **out, int *port);
/* Stops accepting calls, lets calls in flight finish for up to grace_s, cancels the rest,
 * joins the pollers and frees the server. */
void pd_server_stop(pd_server *srv, double grace_s);

/* ------------------------------------------------------------------------------------ */
/* limits.c                                                                               */

#define PD_MAX_TENSORS 65536u              /* tensors in one job */
#define PD_MAX_JOBS    1024u               /* jobs in the store */
#define PD_MAX_STEP    ((uint64_t)1 << 53) /* steps above are refused: exact in a double */

/* The size limit of method m's requests: its own, never above cfg->max_message_bytes. */
size_t pd_request_max_bytes(const pd_config *cfg, pd_method m);

/* Checks payload (may be NULL; not consumed) against method m's size limit and the count
 * limit of its repeated field (Register tensors, Push blocks, Fetch have) without parsing
 * it. PD_OK, or PD_ELIMIT with a message in err. Allocates nothing but gRPC's reader. */
int pd_request_admit(const pd_config *cfg, pd_method m, grpc_byte_buffer *payload, char *err,
                     size_t errlen);

#endif /* PRECOND_HOST_PRECONDD_H */
