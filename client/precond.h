/*
 * precond.h -- libprecond, the C client a training worker links: the one public header of
 * client/. Public names carry the prefix precond_; internal ones live in .c files as static
 * functions or with the prefix precond__ (queue.h, format.h: internal, not for outside code).
 *
 * The model
 * - A precond_client talks to one precondd (TCP "127.0.0.1:PORT" or "unix:/path") for one
 *   job. precond_register names the job's tensors and returns the block layout.
 * - precond_push copies a block's packed statistics into a bounded in-memory queue and returns
 *   at once: a background thread sends the queue (PushStatistics), so a training step never
 *   waits on the network. The same thread polls FetchPreconditioners for blocks newer than the
 *   ones it holds and publishes each new version atomically; precond_fetch hands out the
 *   newest version already received and never blocks on the network.
 * - Queue policy when a push arrives (capacity = options.queue_blocks blocks):
 *     1. coalesce: if a push for the same block is still queued (not yet sent), the newer one
 *        replaces it (counted in precond_counters.coalesced). Statistics are increments, so
 *        this skips the older step's increment for that block, like a statistics interval of
 *        2 for that step; the daemon's EMA or sum carries on from the newer one.
 *     2. else, if the queue is full, the oldest queued block is dropped (counted in
 *        precond_counters.dropped) and the new one is queued.
 *   A push is never refused for lack of room and never blocks.
 * - Sends that fail because the daemon is unreachable are retried with exponential backoff
 *   (options.backoff_initial_ms doubling up to backoff_max_ms); the unsent blocks go back to
 *   the front of the queue unless a newer push for the same block has arrived meanwhile. If
 *   the daemon answers NOT_FOUND or FAILED_PRECONDITION to a push or a fetch (it restarted and
 *   lost the job), the thread registers again with the last registration and retries; it then
 *   accepts the new daemon's roots whatever their version numbers (precond_roots.version, the
 *   client's own count, keeps increasing). If that Register is refused with
 *   FAILED_PRECONDITION (the job was ended under the client: precondctl end-job, EndJob, the
 *   daemon's idle expiry; precondd remembers ended names), the client stops there: queued
 *   blocks are dropped (push_errors), nothing is retried, and precond_push (and _begin),
 *   precond_flush, precond_wait_queued and precond_wait_roots return PRECOND_EENDED (the daemon's message in precond_last_error,
 *   logged once to stderr) until precond_register. Blocks the daemon rejects
 *   (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) are dropped and counted in push_errors; the daemon's
 *   message is kept (precond_last_error).
 * - Same-host pushes (a shared region whose daemon offers the doorbell's queue): the
 *   background thread posts a push and does not wait for its answer; it collects it when it
 *   next needs to (before a later push finds no room, before a fetch poll or a push that
 *   goes by gRPC, in precond_flush, at precond_close), so at most every poll_interval_ms.
 *   A slot placed in the region and committed alone while the background thread is idle
 *   is posted by precond_push_commit itself (session 17), which first collects the answers
 *   already in and, with no room, waits for the oldest answer where the daemon is at work
 *   on it (a fold at most, unless the daemon stops in it: then up to call_timeout_ms), else
 *   up to 5 ms for the daemon to take it before it leaves the push to the background
 *   thread.
 *   Nothing is lost meanwhile: the push's blocks are kept until its answer, and one answered
 *   for a transient reason or lost with its region (the daemon restarted) goes back to the
 *   queue and is sent again as any failed send. A refusal for bad input (e.g. values whose
 *   sum overflows; NaN and Inf are refused here already, except in a precond_push_begin
 *   slot placed in the region, see there) is counted in push_errors and its message kept as
 *   before, only seen up to one push (or one poll) later. Pushes are folded in the order they
 *   were made.
 *
 * Conventions
 * - Functions return int: PRECOND_OK (0) or a negative PRECOND_E* code; precond_strerror
 *   turns a code into a static message. Calls that reach the daemon keep its status message;
 *   precond_last_error copies the newest one.
 * - Every function is thread-safe on one client, except precond_close, which must be the
 *   last call on it.
 * - Matrices travel as packed upper triangles, row by row (pc_packed_len(n) values; see
 *   preconditioner.h, pc_pack_f32).
 */
#ifndef PRECOND_CLIENT_PRECOND_H
#define PRECOND_CLIENT_PRECOND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------ */
/* Status codes                                                                           */

enum {
  PRECOND_OK = 0,
  PRECOND_EINVAL = -1,       /* bad argument (NULL, size, state: e.g. push before register) */
  PRECOND_ENOMEM = -2,       /* allocation failed */
  PRECOND_EUNAVAILABLE = -3, /* daemon unreachable or shutting down (gRPC UNAVAILABLE) */
  PRECOND_ETIMEDOUT = -4,    /* deadline passed (a call's, or precond_flush's) */
  PRECOND_EREJECTED = -5,    /* daemon refused the request (INVALID_ARGUMENT, OUT_OF_RANGE) */
  PRECOND_ENOTFOUND = -6,    /* unknown job or block (NOT_FOUND) */
  PRECOND_ESTATE = -7,       /* FAILED_PRECONDITION: e.g. push before register */
  PRECOND_ELIMIT = -8,       /* RESOURCE_EXHAUSTED: size limit or memory budget */
  PRECOND_EAUTH = -9,        /* UNAUTHENTICATED or PERMISSION_DENIED: token missing/wrong */
  PRECOND_EPROTO = -10,      /* malformed answer, or another gRPC status */
  PRECOND_ETHREAD = -11,     /* could not start the background thread */
  PRECOND_EENDED = -12       /* the daemon refuses the job for good: it was ended (EndJob,
                                precondctl end-job, idle expiry); see precond_last_error */
};

/* Static, human-readable message for a status code. Never returns NULL. */
const char *precond_strerror(int status);

/* ------------------------------------------------------------------------------------ */
/* Wire enums (same numbers as precond.v1)                                                */

typedef enum { PRECOND_MODE_SHAMPOO = 0, PRECOND_MODE_KFAC = 1, PRECOND_MODE_ABS = 2 } precond_mode;
typedef enum { PRECOND_FP32 = 0, PRECOND_BF16 = 1 } precond_encoding;
typedef enum {
  PRECOND_METHOD_NEWTON = 0,
  PRECOND_METHOD_NEWTON_TEXTBOOK = 1,
  PRECOND_METHOD_EIGH = 2
} precond_method;
/* K-FAC's inverse method per factor (the wire's KfacInverse). AUTO: the daemon chooses by
 * size (Cholesky at every size measured; docs/kfac.md). */
typedef enum {
  PRECOND_KFAC_INVERSE_AUTO = 0,
  PRECOND_KFAC_INVERSE_CHOLESKY = 1,
  PRECOND_KFAC_INVERSE_EIGH = 2,
  PRECOND_KFAC_INVERSE_NEWTON = 3
} precond_kfac_inverse;

/* ------------------------------------------------------------------------------------ */
/* Connection                                                                             */

/* How statistics and roots travel (docs/precondd.md, "Shared memory"). */
typedef enum {
  PRECOND_TRANSPORT_AUTO = 0, /* shared memory for a "unix:" address when the daemon offers
                                 it (same host), else gRPC bytes; a region lost (daemon
                                 restart) is replaced, bytes meanwhile */
  PRECOND_TRANSPORT_GRPC = 1, /* always bytes in the gRPC messages */
  PRECOND_TRANSPORT_SHM = 2   /* shared memory whatever the address; calls fail
                                 (PRECOND_ESTATE, retried) while no region can be had */
} precond_transport;

typedef struct {
  const char *addr;         /* "host:port" or "unix:/path"; default "127.0.0.1:50551" */
  const char *token;        /* shared token sent as "authorization: Bearer TOKEN"; NULL:
                                  none. Copied by precond_connect. */
  int wait_for_ready;       /* 1 (default): calls wait (up to their deadline) for the
                                  daemon to come up instead of failing at once */
  int connect_timeout_ms;   /* precond_connect waits this long for the channel; <= 0:
                                  don't wait (the first call finds out). Default 5000 */
  int call_timeout_ms;      /* deadline of each RPC; default 10000 */
  size_t queue_blocks;      /* push queue capacity in blocks; default 1024 */
  size_t max_message_bytes; /* gRPC send/receive limit and push batch size; default 256 MiB */
  int poll_interval_ms;     /* FetchPreconditioners poll period; default 20 */
  int backoff_initial_ms;   /* first retry delay after an unreachable daemon; default 50 */
  int backoff_max_ms;       /* retry delay cap; default 2000 */
  precond_encoding fetch_encoding; /* encoding asked for roots (decoded to fp32 on arrival);
                                      default PRECOND_FP32 */
  int kfac_dense;                  /* 1: K-FAC inverses are handed out whole (n x n,
                                  row-major, both triangles: precond_roots.kfac_dense),
                                  expanded by the background thread as it decodes them, so
                                  a worker that multiplies by them needs no unpacking pass of
                                  its own. Default 0: packed upper, as on the wire */
  int background;                  /* 1 (default): start the push/fetch thread. 0: no thread;
                                  precond_push and precond_fetch then fail with EINVAL
                                  (for tools such as precondctl that only read stats) */
  int reuse_ended_job;             /* 1: precond_register may take the name of a job that was
                                  ended (precondd refuses it otherwise, FAILED_PRECONDITION:
                                  PRECOND_ESTATE), starting it again from zero. Sent only by
                                  precond_register, never when the client registers again by
                                  itself. Default 0 */
  precond_transport transport;     /* how matrices travel; default PRECOND_TRANSPORT_AUTO */
  size_t shm_bytes;                /* shared-memory region asked for (its two halves: pushes,
                                  roots); 0 (default): the daemon's (64 MiB). A matrix
                                  larger than a half travels as bytes */
  int keep_freed_memory;           /* 1: at precond_connect, make this process's malloc keep
                                  freed memory for the next large message (glibc: up to
                                  256 MiB kept, blocks up to 32 MiB from the heap; whole
                                  process, for good). Over TCP a 4 MB answer otherwise
                                  takes fresh pages every call: 3-10x its CPU time
                                  (docs/precondd.md, "Wire"). Default 0 */
  int roots_by_reference;          /* 1: Shampoo roots that come through the daemon's roots
                                  area (shared memory) are handed out pointing into it, with
                                  no copy of the client's; their bytes can then be
                                  overwritten by the daemon once its ring wraps (many
                                  answers later), so a reader calls precond_roots_intact
                                  after reading them and discards what it read on 0.
                                  Default 0: every version is a copy of the client's */
  int push_answer_wait;            /* 1: a push through a shared region waits for its answer
                                  before the next call (the client before session 14; a
                                  refusal is then seen at once); precond_push_begin's slots
                                  are in the region all the same (session 15);
                                  precond_wait_queued waits for answers too (session 16);
                                  a slot's push committed alone while nothing else is
                                  queued or in flight is rung by the committing thread
                                  itself, which returns once it is answered
                                  (counters.pushes_direct; session 16). Default 0:
                                  posted, its answer collected later (see "Same-host
                                  pushes" above) */
} precond_options;

/* Fills the defaults above. */
void precond_options_default(precond_options *opts);

typedef struct precond_client precond_client;

/* Creates a client for the daemon at opts->addr (opts NULL: defaults) and starts its
 * background thread. If connect_timeout_ms > 0, waits that long for the channel to become
 * ready and returns PRECOND_EUNAVAILABLE if it does not (nothing is left allocated).
 * On success *out is owned by the caller and must be released with precond_close. */
int precond_connect(const precond_options *opts, precond_client **out);

/* Stops the background thread (pending pushes not yet sent are discarded: call
 * precond_flush first to send them), cancels nothing the daemon already holds, and frees the
 * client and every internal buffer. Roots handed out by precond_fetch stay valid until
 * released. NULL is a no-op. */
void precond_close(precond_client *client);

/* Sets the FetchPreconditioners poll period to ms (> 0) from the next poll on (a worker
 * that knows its step time polls about as often as it can use a result). PRECOND_EINVAL
 * for ms <= 0. */
int precond_set_poll_interval(precond_client *client, int ms);

/* Copies the newest daemon or transport error message into buf (always NUL-terminated when
 * len > 0; "" if none). */
void precond_last_error(precond_client *client, char *buf, size_t len);

/* ------------------------------------------------------------------------------------ */
/* Register                                                                               */

typedef struct {
  const char *name;      /* unique within the job */
  int rank;              /* >= 1 */
  const uint64_t *shape; /* rank dims, row-major */
} precond_tensor;

typedef struct {
  uint32_t block_size;    /* 0: daemon default (128) */
  uint32_t skip_limit;    /* 0: daemon default (4096) */
  float beta2;            /* statistic EMA; 1 = sum; 0: default 1 */
  uint32_t root_exponent; /* p in A^(-1/p); 0: default 4 */
  double epsilon;         /* relative ridge; 0: default 1e-6 */
  precond_method method;
  uint32_t root_every; /* a block's roots recomputed when its statistics step enters a new
                        * window of this many steps (offset by block id), and at every push
                        * until its first root; 0: default 1 (every push) */
} precond_shampoo_opts;

/* K-FAC's options (mode PRECOND_MODE_KFAC); 0 takes the daemon's default, which is
 * preconditioner.h's pc_kfac_opts_default (one source). */
typedef struct {
  double factor_decay; /* running average of A and G; 0: 0.95 */
  double damping;      /* lambda of the Tikhonov damping; 0: 1e-3 */
  uint32_t inv_every;  /* damped inverses recomputed every this many pushes; 0: 10 */
  int no_pi_damping;   /* 1: pi = 1 (no pi-damping) */
  precond_kfac_inverse inverse;
  uint32_t max_order; /* layers with a larger factor are diagonal; 0: 4096 */
} precond_kfac_opts;

/* One unit of the daemon's layout. Shampoo: a block of a tensor's 2-D view. K-FAC: one
 * layer (a tensor of rank >= 2 whose shape is its gradient matrix [out, in...], the bias, if
 * any, as one more input column): rows = the order of G (out), cols = the order of A (the
 * product of the other dims), row0 = col0 = 0. */
typedef struct {
  uint32_t block_id;
  uint32_t tensor; /* index into the registered tensors */
  uint64_t row0, rows, col0, cols;
  int32_t owner; /* replica computing its roots */
} precond_block;

typedef struct {
  size_t nblocks;
  precond_block *blocks; /* owned by the layout */
  size_t ndiagonal;
  uint32_t *diagonal_tensors; /* tensors with no blocks (Shampoo: grafted step only;
                                  K-FAC: rank-1 tensors such as batch norm's, and layers
                                  above max_order: the worker's own diagonal); owned */
  uint64_t resumed_step;      /* last step whose statistics the daemon holds (0: new) */
} precond_layout;

/* Registers job (mode, worker name, tensors, Shampoo options; opts NULL: defaults) with the
 * daemon, blocking up to the call deadline. On success fills *layout, which the caller owns
 * and frees with precond_layout_destroy; the client remembers the job (later pushes and
 * fetches are for it) and the request (to register again if the daemon loses the job).
 * worker may be NULL. Registering again replaces the job and drops the roots held.
 * With mode PRECOND_MODE_KFAC, opts must be NULL (the daemon's K-FAC defaults; use
 * precond_register_kfac to set them). */
int precond_register(precond_client *client, const char *job, precond_mode mode, const char *worker,
                     size_t ntensors, const precond_tensor *tensors,
                     const precond_shampoo_opts *opts, precond_layout *layout);

/* precond_register for a K-FAC job (mode PRECOND_MODE_KFAC) with K-FAC options (opts NULL:
 * the daemon's defaults). The layout has one block per layer (see precond_block); the daemon
 * refuses bad options with PRECOND_EREJECTED and a message naming the field
 * (precond_last_error, e.g. "kfac.damping: -1 is not positive and finite"). */
int precond_register_kfac(precond_client *client, const char *job, const char *worker,
                          size_t ntensors, const precond_tensor *tensors,
                          const precond_kfac_opts *opts, precond_layout *layout);

/* Frees what precond_register put in layout; NULL or a zeroed layout is a no-op. */
void precond_layout_destroy(precond_layout *layout);

/* ------------------------------------------------------------------------------------ */
/* Push statistics (never blocks on the network)                                          */

/* Queues the statistics increment of one block at a step: left is the packed upper triangle
 * of G G^T (n_left x n_left, n_left = the block's rows), right of G^T G (n_right = its
 * cols); both are required (precondd stores a Shampoo block's two factors together). Values
 * are copied (and converted to bf16 if enc is PRECOND_BF16), so the caller may reuse its
 * buffers at once. Returns PRECOND_OK, PRECOND_EINVAL (sizes that do not match the layout,
 * NULL, NaN or Inf in the values, no job registered, block id outside the layout, a client
 * without background thread) or PRECOND_ENOMEM. The queue policy is described at the top of
 * this header. */
int precond_push(precond_client *client, uint64_t step, uint32_t block_id, uint32_t n_left,
                 const float *left, uint32_t n_right, const float *right, precond_encoding enc);

/* K-FAC: queues one layer's batch factors at a step: a is the packed upper triangle of A
 * (n_a = the layer's cols), g of G (n_g = its rows); both are required. The daemon folds
 * them into its running averages (the first push taken as is). Same copying, encoding,
 * errors and queue policy as precond_push; PRECOND_EINVAL also on a job that is not K-FAC
 * (and precond_push on a K-FAC job). */
int precond_push_kfac(precond_client *client, uint64_t step, uint32_t block_id, uint32_t n_a,
                      const float *a, uint32_t n_g, const float *g, precond_encoding enc);

/* A push without a copy of the caller's: precond_push_begin hands out where the caller
 * writes one block's packed statistics itself (e.g. the kernel computing them writes its
 * output there): *part0 gets room for pc_packed_len(n0) floats, *part1 for n1's right after
 * them (*part1 == *part0 + pc_packed_len(n0): one span the caller may treat whole), in
 * precond_push's order (left, right) or precond_push_kfac's (a, g) as the registered job's
 * mode is. precond_push_commit then queues them as precond_push would have (fp32 on the wire,
 * the same checks, queue policy and counters, PRECOND_EINVAL for a NaN or Inf or a job
 * replaced meanwhile); precond_push_cancel drops them. The memory is the client's and is
 * valid from begin until commit or cancel, one of which the caller calls exactly once (also
 * when commit fails: the slot is gone then). begin: PRECOND_OK, PRECOND_EINVAL (as
 * precond_push), PRECOND_EENDED, PRECOND_ENOMEM. Thread-safe, as precond_push.
 * Same-host (session 15): where the client holds a shared region whose daemon offers the
 * doorbell's queue (posted or, push_answer_wait, awaited), begin hands out a place in the region
 * itself when the block is not queued already and the region has room (counted in
 * precond_counters.region_slots at commit): the values are posted from where the caller
 * wrote them, with no copy, and commit does not look at them: a NaN or Inf there is refused
 * by the daemon, which checks every value as it folds and refuses that push whole, counted
 * in push_errors with its message one push later (as an overflow is), the other pushes kept
 * (a batch so refused goes again one block a push). On that path PRECOND_EINVAL from commit
 * means a job replaced since begin, never a NaN. Otherwise (no region yet, TCP, the block
 * queued, no room, the region lost) begin hands out queue memory and commit scans as above. */
typedef struct precond_push_slot precond_push_slot;
int precond_push_begin(precond_client *client, uint64_t step, uint32_t block_id, uint32_t n0,
                       uint32_t n1, float **part0, float **part1, precond_push_slot **slot);
int precond_push_commit(precond_client *client, precond_push_slot *slot);
/* precond_push_commit of n slots at once (NULL entries skipped): each is checked and queued
 * as precond_push_commit would, and every slot is consumed (queued or dropped) whatever the
 * outcome, also for a NULL client. The queued ones are handed to the background thread
 * together, so they leave in one call rather than in as many calls as the thread wakes for
 * (a worker pushing a step's blocks commits them this way). Returns PRECOND_OK when all
 * were queued, else the first failure's code (PRECOND_EINVAL: a NaN or Inf in that slot, a
 * job replaced since begin; PRECOND_ENOMEM); the others are queued all the same. */
int precond_push_commit_all(precond_client *client, precond_push_slot *const *slots, size_t n);
void precond_push_cancel(precond_push_slot *slot);
/* Copies count floats from src into dst, a place inside slot's parts (begin's *part0 ..
 * end of *part1), in the write that costs least for this write and the daemon's read
 * together: where the slot lies in the shared region (session 15) and the copy is large
 * (1 MiB and up), streaming stores that go straight to memory or a plain memcpy, whichever
 * measures cheaper on this machine (session 16: the copy's CPU on this thread's clock
 * against the daemon's CPU for each push, told in its answer; a few pushes in the other
 * mode now and then follow a change; the rule of session 11, streaming when the daemon's
 * thread last ran on another CPU, until the daemon's first figure or with an older daemon;
 * PRECOND_SHM_WRITE=streamed or =plain in the environment forces one; counted in
 * precond_counters.region_streamed and region_plain; docs/client.md); else memcpy. For a
 * kernel that computes its statistic elsewhere and then copies it into the slot. */
void precond_push_copy(const precond_push_slot *slot, float *dst, const float *src, size_t count);
/* The caller's word that each part it wrote into slot itself (a kernel's output, not
 * precond_push_copy's) is a Gram matrix G^T G as computed in fp32 (syrk), or a nonnegative
 * combination of such: every entry is then bounded by the part's diagonal, and a NaN or Inf
 * anywhere in G shows on it. Reads each part's n diagonal values (not its n(n+1)/2) and
 * vouches for a part whose diagonal is finite, nonnegative and below 2^124 as
 * precond_push_copy vouches for a part it copied (docs/client.md, "Vouched slots"), so
 * that precondd folds the push without its spare; a part whose diagonal does not pass
 * loses its vouch (its push keeps the fold that refuses it whole). Call it after the last
 * write into the slot and before commit. Returns how many parts it vouched for (0, 1 or
 * 2), 0 for a slot outside the shared region (queue memory: nothing to vouch), or
 * PRECOND_EINVAL for a NULL slot. A false claim is harmless to the daemon and to other
 * pushes (a value outside the vouch is left unfolded: the push is refused torn, counted
 * in precond_stats.torn_pushes, the statistic finite) but loses that push. */
int precond_push_vouch_gram(precond_push_slot *slot);

/* Waits until the queue is empty and no send is in flight (every queued block answered by
 * the daemon, accepted or not, or dropped), or timeout_ms passes: PRECOND_OK or
 * PRECOND_ETIMEDOUT. Pushes posted through a shared region and not yet collected (see
 * "Same-host pushes" above) count as in flight: flush has the background thread collect
 * their answers. Pushes from other threads meanwhile extend the wait. */
int precond_flush(precond_client *client, int timeout_ms);

/* Waits until at most max_queued blocks wait in the queue (the others taken by the
 * background thread to be sent, or dropped), or timeout_ms passes: PRECOND_OK,
 * PRECOND_ETIMEDOUT, or PRECOND_EENDED as precond_flush. Unlike precond_flush it does not
 * wait for answers, except with push_answer_wait (session 16): there the blocks taken and
 * not yet answered count as queued, so a worker pacing itself with it writes its next
 * statistic only once the daemon folded the last one (the two passes over a large block
 * at once cost both sides CPU across cores). A worker that makes statistics faster than
 * they leave paces itself with it instead of having its pushes coalesce (bench-daemon's
 * push-lib rows do). */
int precond_wait_queued(precond_client *client, size_t max_queued, int timeout_ms);

/* ------------------------------------------------------------------------------------ */
/* Fetch preconditioners (never blocks on the network)                                    */

/* One published version of one block's roots (Shampoo) or one layer's damped inverses
 * (K-FAC). Immutable and reference-counted: whoever receives one from precond_fetch owns one
 * reference and gives it back with precond_roots_release; the data stays valid until then,
 * even after newer versions arrive or the client is closed. A K-FAC layer's update is
 * g_inv * grad * a_inv (grad: its rows x cols gradient matrix). */
typedef struct {
  uint32_t block_id;
  uint64_t version;        /* this client's count of roots received for the block: 1, 2,
                                  ...; keeps increasing across daemon restarts */
  uint64_t daemon_version; /* the daemon's version number of these roots */
  uint64_t source_step;    /* step of the newest statistics the roots come from */
  double error;            /* residual error reported by the method */
  precond_method method;
  uint32_t iterations;
  uint32_t n_left, n_right; /* 0 where that side has no root */
  const float *left;        /* packed upper L^(-1/p), pc_packed_len(n_left) values */
  const float *right;       /* packed upper R^(-1/p) */
  /* K-FAC jobs (then n_left = n_right = 0, left = right = NULL; Shampoo: all 0/NULL): */
  uint32_t n_a, n_g;            /* the layer's cols and rows */
  const float *a_inv;           /* packed upper (A + pi sqrt(lambda) I)^-1 (or whole) */
  const float *g_inv;           /* packed upper (G + sqrt(lambda) / pi I)^-1 (or whole) */
  double pi;                    /* of the damping split (1 without pi-damping) */
  precond_kfac_inverse inverse; /* the method of A's inverse */
  int kfac_dense;               /* 1: a_inv and g_inv are whole, n_a x n_a and n_g x n_g
                                   row-major, both triangles (options.kfac_dense); 0: packed */
} precond_roots;

/* If the client holds a version of block_id newer than have_version, stores a new reference
 * to it in *out (release with precond_roots_release); else stores NULL. Returns PRECOND_OK
 * in both cases, PRECOND_EINVAL for a block outside the layout. */
int precond_fetch(precond_client *client, uint32_t block_id, uint64_t have_version,
                  const precond_roots **out);

/* Gives back one reference from precond_fetch. NULL is a no-op. */
void precond_roots_release(const precond_roots *roots);

/* 1 when the values of roots are the ones published: always for a copy of the client's;
 * for roots handed out by reference (precond_options.roots_by_reference), 1 while the
 * daemon has not reused their place in its roots area. Reading them and then seeing 1 here
 * means what was read is intact (a seqlock's second look); on 0 the reader discards what it
 * read (the block's next version comes as usual). The mapping itself stays valid until the
 * release, also after the client's region is closed. NULL: 0. */
int precond_roots_intact(const precond_roots *roots);

/* Waits until the client holds a version of block_id newer than have_version, or timeout_ms
 * passes (PRECOND_ETIMEDOUT). For tests and for workers that choose to wait for a bounded
 * staleness; the training step itself should use precond_fetch. */
int precond_wait_roots(precond_client *client, uint32_t block_id, uint64_t have_version,
                       int timeout_ms);

/* ------------------------------------------------------------------------------------ */
/* Counters of this client                                                                */

typedef struct {
  uint64_t pushed;             /* blocks accepted into the queue */
  uint64_t sent;               /* blocks the daemon answered for */
  uint64_t coalesced;          /* queued blocks replaced by a newer push of the same block */
  uint64_t dropped;            /* queued blocks dropped because the queue was full */
  uint64_t push_errors;        /* blocks the daemon rejected */
  uint64_t retries;            /* send or poll attempts that failed and were retried */
  uint64_t reregistered;       /* times the job was registered again after NOT_FOUND */
  uint64_t fetch_calls;        /* FetchPreconditioners calls, counted as each ends */
  uint64_t fetch_rung;         /* of fetch_calls, those rung at the shared region's doorbell
                                  instead of sent over gRPC (docs/precondd.md, "Shared
                                  memory") */
  uint64_t roots_received;     /* block versions received */
  uint64_t bytes_sent;         /* statistics payload bytes sent */
  uint64_t bytes_received;     /* roots payload bytes received */
  uint64_t shm_bytes;          /* of bytes_sent and bytes_received, those that went through
                                  shared memory */
  uint64_t roots_by_reference; /* of roots_received, those handed out by reference into
                                  the daemon's roots area (options.roots_by_reference) */
  size_t queued;               /* blocks in the queue now */
  uint64_t daemon_restarts;    /* times the daemon's epoch changed under this client (a
                                  restart: what was pushed after resumed_step was lost;
                                  logged once to stderr each time) */
  uint64_t resumed_step;       /* the step the daemon resumed the job from at the last such
                                  restart (0: none seen) */
  uint64_t pushes_posted;      /* PushStatistics calls posted at a shared region's doorbell
                                  without waiting, their answers collected later (see
                                  "Same-host pushes" at the top) */
  uint64_t pushes_direct;      /* pushes of a worker slot rung by the committing thread
                                  itself (precond_push_commit of it alone: nothing else
                                  queued, the background thread idle), whatever their
                                  answer: with push_answer_wait (session 16; nothing in
                                  flight either) answered when commit returns; posted
                                  (session 17; counted in pushes_posted too) with the
                                  answers already in collected there first, and, without
                                  room, the oldest awaited where the daemon took it (else
                                  up to 5 ms); the others go through the background
                                  thread as before */
  uint64_t region_slots;       /* of pushed, those precond_push_begin placed in the shared
                                  region itself (written there by the caller, posted from
                                  there: no copy, no NaN/Inf scan of the client's) */
  uint64_t region_streamed;    /* of sent, blocks with a part of 1 MiB or more written into
                                  the shared region by streaming (non-temporal) stores */
  uint64_t region_plain;       /* ... by plain stores. Which is chosen by measurement
                                  (precond_push_copy; PRECOND_SHM_WRITE forces one) */
} precond_counters;

void precond_get_counters(precond_client *client, precond_counters *out);

/* ------------------------------------------------------------------------------------ */
/* Ending a job (blocking, up to the call deadline)                                       */

/* What an ended job held. */
typedef struct {
  uint32_t blocks;    /* its units */
  uint64_t last_step; /* its newest step pushed */
  uint64_t bytes;     /* its reservation under the daemon's memory limit, now free */
} precond_ended;

/* EndJob: the daemon frees job (NULL: this client's registered job) and leaves it out of its
 * snapshots; PRECOND_ENOTFOUND if it holds no such job. When it is this client's job, the
 * client forgets it first (pushes still queued are discarded, roots held stay valid until
 * released; push and fetch then fail with EINVAL until precond_register), so its background
 * thread does not register it again. The daemon remembers the ended name (--ended-jobs):
 * another client still working on the job is refused when it registers it again (its push
 * and flush then return PRECOND_EENDED), and a new precond_register of that name needs
 * precond_options.reuse_ended_job. out may be NULL. */
int precond_end_job(precond_client *client, const char *job, precond_ended *out);

/* ------------------------------------------------------------------------------------ */
/* Daemon stats and health (blocking, up to the call deadline)                            */

/* How many steps old a block's root was when a push of a newer step arrived (the age a
 * worker of that step sees): nearest-rank percentiles, max and mean over the samples. */
typedef struct {
  uint64_t samples, max;
  double p50, p90, p99, mean;
} precond_staleness;

typedef struct {
  char *job;
  uint32_t block_id;
  char *tensor;
  uint64_t rows, cols, version, stat_step, root_step, staleness;
  uint64_t roots_computed, roots_failed;
  uint64_t roots_skipped; /* drift test: the statistics barely moved */
  double last_error, last_compute_ms;
  double last_drift; /* relative, of the last drift test; NaN before one */
  precond_staleness staleness_dist;
  int32_t owner;
  /* K-FAC layers (0 for Shampoo blocks): factor orders, and pi and the dampings of the
   * published inverses (0 before the first). The inverse's age is staleness. */
  uint64_t a_order, g_order;
  double pi, damping_a, damping_g;
  /* Shampoo blocks: how their factor roots were computed, one count per factor root (the
   * wire's BlockStats fields of the same names): warm-started from the block's last
   * eigenbasis, skipped by the warm path's skip test, seeded (no basis held), cold. */
  uint64_t roots_warm, roots_warm_skipped, roots_seeded, roots_cold;
} precond_block_stats;

typedef struct {
  char *job;
  precond_mode mode;
  uint32_t blocks, workers;
  uint64_t last_step;
  /* Daemon replicas: the estimated cost (sum of order^3) of the units each rank owns,
   * nrank_load (= replicas) entries; 0 and NULL from a daemon alone. */
  size_t nrank_load;
  double *rank_load;
} precond_job_stats;

/* Daemon replicas (docs/replicas.md): what the answering rank sent and received. */
typedef struct {
  uint64_t roots_sent;      /* results it computed, sent to each other rank */
  uint64_t roots_received;  /* results of other ranks published here */
  uint64_t stats_forwarded; /* pushed blocks another rank owns, sent to it */
  uint64_t stats_received;  /* forwarded statistics folded here */
  uint64_t mpi_errors;
  int alone; /* MPI failed: this rank computes every unit itself */
} precond_replica_stats;

typedef struct {
  char *version;
  double uptime_s;
  uint32_t jobs, threads, replicas;
  int32_t rank;
  precond_replica_stats replica; /* zero unless replicas > 1 */
  uint64_t queue_depth, roots_computed, roots_failed, roots_skipped;
  double drift_threshold;
  precond_staleness staleness; /* daemon-wide, every block's samples */
  double compute_ms_p50, compute_ms_p90, compute_ms_p99;
  uint64_t bytes_in, bytes_out, memory_bytes, rejected_pushes, snapshots_written;
  uint64_t torn_pushes;    /* vouched pushes refused torn (docs/client.md, "Vouched slots") */
  uint64_t vouched_pushes; /* pushes folded without the spare (every part vouched; session 16) */
  double last_snapshot_age_s;
  size_t njobs;
  precond_job_stats *job_stats; /* owned by the stats */
  size_t nblocks;
  precond_block_stats *block_stats; /* owned by the stats; empty unless asked */
} precond_stats;

/* GetStats for job (NULL or "": all jobs), with per-block figures if blocks is non-zero.
 * On success the caller owns *out and frees it with precond_stats_destroy. */
int precond_get_stats(precond_client *client, const char *job, int blocks, precond_stats *out);

/* Frees what precond_get_stats put in stats; a zeroed struct is a no-op. */
void precond_stats_destroy(precond_stats *stats);

/* grpc.health.v1 Check of service ("" : the whole daemon). *serving is set to 1 if the
 * daemon answers SERVING, else 0; *status_name (may be NULL) to a static name of the answer
 * ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", "UNKNOWN"). */
int precond_health(precond_client *client, const char *service, int *serving,
                   const char **status_name);

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_CLIENT_PRECOND_H */
