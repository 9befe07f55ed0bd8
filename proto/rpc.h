/*
 * rpc.h -- gRPC core <-> protobuf-c glue shared by precondd, libprecond and precondctl.
 *
 * Prefix rpc_. Functions return int: RPC_OK (0) or a negative RPC_E* code; rpc_strerror
 * turns a code into a static message. Nothing here keeps global state of its own: gRPC's
 * library refcount is taken by rpc_channel_create and given back by rpc_channel_destroy,
 * so a program that only uses channels from here never calls grpc_init itself.
 *
 * Method paths of precond.v1 are the RPC_METHOD_* strings below, e.g.
 * "/precond.v1.Preconditioner/Register".
 *
 * Typical client use:
 *
 *   grpc_channel *ch = rpc_channel_create("127.0.0.1:50551", 0);
 *   Precond__V1__StatsRequest req = PRECOND__V1__STATS_REQUEST__INIT;
 *   ProtobufCMessage *resp = NULL; grpc_status_code code; char *details = NULL;
 *   int rc = rpc_call(ch, RPC_METHOD_GET_STATS, &req.base,
 *                     &precond__v1__stats_response__descriptor, 5000, 0,
 *                     &resp, &code, &details);
 *   if (rc == RPC_OK) { use (Precond__V1__StatsResponse *)resp;
 *                       protobuf_c_message_free_unpacked(resp, NULL); }
 *   else fprintf(stderr, "%s: %s\n", rpc_status_name(code), details);
 *   free(details);
 *   rpc_channel_destroy(ch);
 */
#ifndef PRECOND_RPC_H
#define PRECOND_RPC_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/status.h>
#include <protobuf-c/protobuf-c.h>

/* The wire messages the shared-memory helpers below take, declared, not defined: a file that
 * builds or reads them includes the generated precond.pb-c.h itself, and the rest (in host/,
 * everything but the service layer) stays free of generated headers. */
typedef struct Precond__V1__ShmSession Precond__V1__ShmSession;
typedef struct Precond__V1__PackedMatrix Precond__V1__PackedMatrix;
typedef struct Precond__V1__ShmRef Precond__V1__ShmRef;
typedef struct Precond__V1__FetchResponse Precond__V1__FetchResponse;
typedef struct Precond__V1__FetchRequest Precond__V1__FetchRequest;

#ifdef __cplusplus
extern "C" {
#endif

enum {
  RPC_OK = 0,
  RPC_EINVAL = -1,  /* bad argument (NULL pointer, empty target or method) */
  RPC_ENOMEM = -2,  /* allocation failed */
  RPC_ETOOBIG = -3, /* message above the size limit */
  RPC_EPARSE = -4,  /* bytes are not a valid message of the expected type */
  RPC_ESTATUS = -5, /* the RPC ended with a non-OK gRPC status (see *status, *details) */
  RPC_ECALL = -6    /* gRPC refused to start the call (channel or batch error) */
};

/* Static message for an RPC_* code. Never NULL. */
const char *rpc_strerror(int code);

/* Static upper-case name of a gRPC status code ("OK", "INVALID_ARGUMENT", ...). Never NULL. */
const char *rpc_status_name(grpc_status_code code);

/* Method paths of service precond.v1.Preconditioner and of the standard health check. */
#define RPC_METHOD_REGISTER              "/precond.v1.Preconditioner/Register"
#define RPC_METHOD_PUSH_STATISTICS       "/precond.v1.Preconditioner/PushStatistics"
#define RPC_METHOD_FETCH_PRECONDITIONERS "/precond.v1.Preconditioner/FetchPreconditioners"
#define RPC_METHOD_GET_STATS             "/precond.v1.Preconditioner/GetStats"
#define RPC_METHOD_END_JOB               "/precond.v1.Preconditioner/EndJob"
#define RPC_METHOD_HEALTH_CHECK          "/grpc.health.v1.Health/Check"

/* Default message size limit (both directions): 256 MiB, room for a push of one
 * 4096 x 4096 block (two packed fp32 factors, about 64 MiB) several times over. */
#define RPC_DEFAULT_MAX_MESSAGE_BYTES ((size_t)256 << 20)

/* Largest limit gRPC accepts (its channel arguments are int). */
#define RPC_MAX_MESSAGE_BYTES_CAP ((size_t)0x7fffffff)

/* Fills args (caller-allocated; the array arg must have room for 2 entries) with the
 * receive and send message size limits max_bytes (0: RPC_DEFAULT_MAX_MESSAGE_BYTES; capped
 * at RPC_MAX_MESSAGE_BYTES_CAP). No memory is allocated: the keys are static strings. Used
 * for channels here and for precondd's server. */
void rpc_size_args(grpc_channel_args *args, grpc_arg arg[2], size_t max_bytes);

/* Channel arguments of every channel and server of this project: the message size limits
 * and the transport settings measured for large messages (RPC_TRANSPORT_ARGS in rpc.c; the
 * table and its measurements are in docs/precondd.md, "Wire"), plus what the caller adds.
 * Caller-allocated, nothing allocated: keys are copied into the struct. */
#define RPC_ARGS_MAX      16
#define RPC_ARG_KEY_BYTES 64
typedef struct {
  grpc_arg arg[RPC_ARGS_MAX];
  char key[RPC_ARGS_MAX][RPC_ARG_KEY_BYTES];
  size_t n;
  grpc_channel_args args; /* filled by rpc_args_get */
} rpc_args;

/* The size limits of rpc_size_args (max_bytes as there) and the transport defaults. */
void rpc_args_init(rpc_args *a, size_t max_bytes);

/* Sets integer argument key to value, replacing an earlier value of the same key (the
 * defaults included). RPC_EINVAL for a NULL, empty or too long key (RPC_ARG_KEY_BYTES - 1
 * at most), RPC_ENOMEM when RPC_ARGS_MAX are set. */
int rpc_args_set_int(rpc_args *a, const char *key, int value);

/* "KEY=INTEGER" (precondd's --grpc-arg, bench-daemon's --channel-arg) as rpc_args_set_int;
 * RPC_EINVAL for text of another form or a value outside int. */
int rpc_args_parse(rpc_args *a, const char *key_eq_value);

/* The arguments as gRPC takes them; valid while a lives and is not changed. */
const grpc_channel_args *rpc_args_get(rpc_args *a);

/* rpc_channel_create with the arguments a (insecure). NULL on a NULL or empty target. */
grpc_channel *rpc_channel_create_args(const char *target, rpc_args *a);

/* Serialises msg into a new byte buffer. On RPC_OK the caller owns *out and releases it
 * with grpc_byte_buffer_destroy. Returns RPC_EINVAL (NULL argument), RPC_ETOOBIG (packed
 * size above max_bytes; 0 means RPC_DEFAULT_MAX_MESSAGE_BYTES) or RPC_ENOMEM; *out is NULL
 * then. */
int rpc_pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out);

/* Parses buf (not consumed; the caller still owns it) as a message of type desc. On RPC_OK
 * the caller owns *out and frees it with protobuf_c_message_free_unpacked(*out, NULL).
 * A NULL buf (no message received) is RPC_EPARSE. Returns RPC_ETOOBIG if the (decompressed)
 * payload is above max_bytes (0: the default), RPC_EPARSE on bytes that do not parse,
 * RPC_EINVAL, RPC_ENOMEM; *out is NULL then. */
int rpc_unpack(grpc_byte_buffer *buf, const ProtobufCMessageDescriptor *desc, size_t max_bytes,
               ProtobufCMessage **out);

/* Internal (rpc_unpack's way with a message of many slices; declared for its test): parses
 * the n slices s as a message of type desc, each large singular bytes field gathered out of
 * the slices into its own buffer (one copy; protobuf-c would copy it from a flattened copy).
 * RPC_OK: *out as rpc_unpack's; RPC_EPARSE: not parsed this way (bytes that do not parse,
 * or a group, a oneof, a singular message or bytes field twice in one message: the caller
 * parses the flattened bytes), *out NULL. No size limit: the caller checks it. */
int rpc__lift_unpack(const grpc_slice *s, size_t n, const ProtobufCMessageDescriptor *desc,
                     ProtobufCMessage **out);

/* Makes glibc's malloc keep freed memory for the next large message instead of returning
 * it at once: a 4 MB message otherwise takes fresh pages (a page fault per 4 KiB, cleared
 * by the kernel) for gRPC's receive slices, the flattened copy and protobuf-c's bytes, at
 * every call; measured 3-10x the CPU of a 4 MB call over TCP (docs/precondd.md, "Wire").
 * Process-wide: precondd calls it at start; bench-daemon with --keep-freed-memory; a
 * worker may. Up to 256 MiB of free memory stays mapped. RPC_OK (also where it is not
 * glibc), RPC_EINVAL if glibc refused. */
int rpc_keep_freed_memory(void);

/* Opens an insecure channel to target: "host:port" (e.g. "127.0.0.1:50551") or
 * "unix:/path/to.sock", with send and receive limits of max_message_bytes (0: the default).
 * Takes a reference on the gRPC library (grpc_init). Returns NULL on a NULL or empty target.
 * The channel connects lazily: creating it succeeds even if nothing listens yet.
 * Release it with rpc_channel_destroy. */
grpc_channel *rpc_channel_create(const char *target, size_t max_message_bytes);

/* rpc_channel_create over TLS: root_pem (PEM text of the CA that signed the server's
 * certificate; NULL for gRPC's default roots) and optionally the client's own cert_pem and
 * key_pem (both or neither, for a server that requires client certificates). The strings are
 * copied by gRPC. NULL on a bad argument. Release with rpc_channel_destroy. */
grpc_channel *rpc_channel_create_tls(const char *target, size_t max_message_bytes,
                                     const char *root_pem, const char *cert_pem,
                                     const char *key_pem);

/* Destroys a channel from rpc_channel_create and drops its gRPC library reference.
 * NULL is a no-op. No call on the channel may be in flight. */
void rpc_channel_destroy(grpc_channel *channel);

/* Blocking unary call of method (an RPC_METHOD_* path) on channel with request req;
 * the response is parsed as resp_desc. deadline_ms > 0 bounds the whole call (<= 0: no
 * deadline). wait_for_ready != 0 waits for the server to come up (until the deadline)
 * instead of failing at once with UNAVAILABLE.
 *
 * Outputs (each may be NULL if not wanted, except resp):
 * - *resp: on RPC_OK the parsed response, owned by the caller
 *   (protobuf_c_message_free_unpacked(*resp, NULL)); NULL on any failure.
 * - *status: the gRPC status; local failures map to a code too (INVALID_ARGUMENT for bad
 *   arguments, RESOURCE_EXHAUSTED for a request above the limit or out of memory,
 *   INTERNAL for an unparsable response or a call gRPC refused to start).
 * - *details: a malloc'd message (caller frees it with free()), "" when OK; NULL only if
 *   even that allocation failed.
 * Returns RPC_OK only when the status is OK and the response parsed; otherwise RPC_ESTATUS
 * (the server or transport returned a non-OK status), RPC_EPARSE, RPC_ETOOBIG, RPC_EINVAL,
 * RPC_ENOMEM or RPC_ECALL. Thread-safe: many threads may call on one channel at once.
 * The size limit applied to the request here is the default; the channel's own limits
 * apply on the wire. */
int rpc_call(grpc_channel *channel, const char *method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, long deadline_ms, int wait_for_ready,
             ProtobufCMessage **resp, grpc_status_code *status, char **details);

/* rpc_call with a bearer token: sends metadata "authorization: Bearer TOKEN" when token is
 * neither NULL nor empty (precondd's --token-file). Otherwise identical to rpc_call. */
int rpc_call_token(grpc_channel *channel, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, long deadline_ms,
                   int wait_for_ready, const char *token, ProtobufCMessage **resp,
                   grpc_status_code *status, char **details);

/* The same call with request bytes as they are (len bytes at bytes, copied) and the raw
 * response: on RPC_OK the caller owns *resp (grpc_byte_buffer_destroy). For tests that send
 * malformed messages, and for forwarding. Other outputs as in rpc_call. */
int rpc_call_raw(grpc_channel *channel, const char *method, const void *bytes, size_t len,
                 long deadline_ms, int wait_for_ready, const char *token, grpc_byte_buffer **resp,
                 grpc_status_code *status, char **details);

/* ---- codec.c: PackedMatrix.data, the one codec of every side (daemon, client, tools) ---- */
/*
 * Values travel little-endian whatever the host: fp32 (encoding 0, the wire's ENCODING_FP32)
 * as their IEEE 754 bits, bf16 (encoding 1) as the top half of an fp32, rounded to nearest
 * even (preconditioner's pc_f32_to_bf16). The encoding numbers are the wire's Encoding.
 */

/* Bytes per value of an encoding: 4 (fp32), 2 (bf16), 0 if unknown. */
size_t rpc_packed_width(int encoding);

/* 1 if bytes of this encoding are the host's own float array (fp32 on a little-endian
 * host): a reader may point into aligned data, a writer may send its floats as they are. */
int rpc_packed_native(int encoding);

/* Decodes count values from data (len bytes) into out. RPC_EINVAL for an unknown encoding
 * or len != count * width; RPC_ENOMEM. */
int rpc_packed_decode(int encoding, const void *data, size_t len, size_t count, float *out);

/* Encodes count values of in into out (count * width bytes, any alignment). RPC_EINVAL for
 * an unknown encoding. */
int rpc_packed_encode(int encoding, const float *in, size_t count, void *out);

/* ---- shm.c: the same-host shared-memory data path, the rules both sides share ---- */
/*
 * A region (ShmOpenResponse) of R bytes has two halves: [0, R/2) the client writes (push
 * statistics), [R/2, R) the daemon writes (fetched roots). Each half is a ring: a matrix
 * takes the next RPC_SHM_ALIGN-aligned bytes after the previous one, wrapping to the half's
 * start when it does not fit before its end. A matrix there is named by a ShmRef
 * (offset from the region's start, length, CRC-32C); a reader checks the reference against
 * the half it must lie in and the checksum against the bytes it copied, so bytes a wrap
 * overwrote are refused, never used.
 */
#define RPC_METHOD_OPEN_SHM  "/precond.v1.Preconditioner/OpenSharedMemory"
#define RPC_SHM_ALIGN        64
#define RPC_SHM_SECRET_BYTES 16

/* CRC-32C (Castagnoli) of len bytes, continuing crc (0 to start). Hardware where the CPU
 * has it (SSE 4.2), else tables. Thread-safe. */
uint32_t rpc_crc32c(uint32_t crc, const void *data, size_t len);

/* Copies len bytes from src to dst (not overlapping) and returns the CRC-32C of the bytes
 * written to dst, in one pass over memory. */
uint32_t rpc_shm_copy_crc(void *dst, const void *src, size_t len);

/* What count fp32 values are, in one branch-free pass: RPC_F32_BOUNDED when every one is
 * below 2^126 in magnitude (so a fold whose weights sum to at most 2, Shampoo's EMA or sum,
 * of two such values stays finite: precondd's overflow check needs no pass of its own),
 * RPC_F32_FINITE when all are finite but some is not below 2^126, RPC_F32_BAD when one is
 * NaN or Inf. The one definition of both tests (libprecond, precondd). */
enum { RPC_F32_BAD = 0, RPC_F32_FINITE = 1, RPC_F32_BOUNDED = 2 };
int rpc_f32_scan(size_t count, const float *x);

/* Bit 31 set when |x| >= 2^126, NaN and Inf included (the exponent's bits plus three carry
 * into the sign bit): OR it over many values and test once, a loop with no branch that
 * vectorizes. rpc_f32_scan's bound, for loops that compute the values themselves. */
static inline uint32_t rpc_f32_big(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x7f800000u) + 0x01800000u;
}

/* Bit 31 set when |x| >= 2^125, NaN and Inf included (four carry into the sign bit): a
 * value outside a push's vouch (ShmRef.vouched), which libprecond tests in its copy into a
 * slot and precondd in its fold without a spare. Below 2^125 (the increment) and 2^126 (the
 * statistic), a fold whose weights sum to at most 2 stays below 2^127: finite. */
static inline uint32_t rpc_f32_unvouched(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x7f800000u) + 0x02000000u;
}

/* Bit 31 set when x is NaN or Inf (the exponent's bits plus one carry into it): the same
 * use as rpc_f32_big, rpc_f32_scan's other test. */
static inline uint32_t rpc_f32_nonfinite(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x7f800000u) + 0x00800000u;
}

/* rpc_shm_copy_crc that also looks at the values in the same pass, the bytes taken as fp32
 * values: *finite gets their rpc_f32_scan when they are whole, aligned (dst) floats, else
 * RPC_F32_BAD (0: a NaN or Inf, or bytes that are not such floats: check them some other
 * way). */
uint32_t rpc_shm_copy_crc_finite(void *dst, const void *src, size_t len, int *finite);

/* The CRC-32C of len bytes as rpc_shm_copy_crc gives it, without copying. */
uint32_t rpc_shm_crc(const void *data, size_t len);

/* A copy that looks for NaN and Inf in the same pass, without a checksum (an unchecked
 * push reference: ShmRef.unchecked): *finite as rpc_shm_copy_crc_finite's. */
void rpc_shm_copy_finite(void *dst, const void *src, size_t len, int *finite);

/* The daemon's roots area (ShmOpenResponse.roots_path): one file per daemon, written by the
 * daemon alone and mapped read-only by its clients, where each root a fetch through a region
 * asks for is published once (not per fetch) and referenced by ShmRef.seq. Its first
 * RPC_SHM_ROOTS_ENTRIES * RPC_SHM_ALIGN bytes are a table of entries (rpc_shm_entry), the
 * rest a ring of root bytes. Publication n uses entry n % RPC_SHM_ROOTS_ENTRIES: its seq is
 * set to 0 before any of the bytes it guards are overwritten (the entry's own reuse and the
 * ring wrapping over them) and to n after its bytes are written. A reader copies the bytes
 * while the entry holds n before and after the copy (a seqlock: rpc_shm_fetch_in,
 * rpc_shm_fetch_intact); the CRC-32C in the reference was computed once, at publication,
 * for whoever wants to check it. */
#define RPC_SHM_ROOTS_ENTRIES 4096
typedef struct {
  uint64_t seq; /* 0: free or being written; read and written with __atomic builtins */
  uint64_t offset, length;
  uint32_t crc32c;
  unsigned char pad[RPC_SHM_ALIGN - 3 * sizeof(uint64_t) - sizeof(uint32_t)];
} rpc_shm_entry;
#define RPC_SHM_ROOTS_DATA ((uint64_t)RPC_SHM_ROOTS_ENTRIES * sizeof(rpc_shm_entry))

/* 1 when the entry of ref (seq set) in the area of bytes bytes holds ref->seq and names
 * the same bytes, else 0 (overwritten, being written, or a reference out of place). */
int rpc_shm_entry_holds(const unsigned char *area, size_t bytes, const Precond__V1__ShmRef *ref);

/* Takes len bytes from a ring of area bytes whose next free offset (relative to the ring)
 * is *pos: *off gets where they start, *pos moves past them. RPC_ETOOBIG if len > area;
 * RPC_EINVAL for NULL pointers. */
int rpc_shm_ring_take(uint64_t *pos, uint64_t area, uint64_t len, uint64_t *off);

/* RPC_OK when [offset, offset + length) lies within [lo, hi) of a region of region bytes
 * and length is expect (the bytes the matrix's order and encoding give), else RPC_EINVAL.
 * No overflow for any input. */
int rpc_shm_ref_check(uint64_t region, uint64_t lo, uint64_t hi, uint64_t offset, uint64_t length,
                      size_t expect);

/* Pushes a client may have rung through a region's doorbell and not yet collected
 * (rpc_shm_post): two, so the client writes push k + 1 while the daemon folds push k. */
#define RPC_SHM_QUEUE 2

/* How one side of the doorbell waits for the other's word (session 12). A futex wake from
 * the other core cost the waker about 30 us of CPU and the sleeper about 60 us on this
 * project's VM (twice a push), against a few us on one core (docs/precondd.md, "Session
 * 12"). So a side whose last wait was short (at most RPC_SHM_SPIN_US: small pushes
 * arriving back to back) and whose other side last ran on another core first spins, for
 * at most RPC_SHM_SPIN_US, and sleeps on the futex, flagged so that the other side wakes
 * it, only after that; the other side wakes it only when the flag says it sleeps. Naps on
 * this core's own timer (a nanosleep of the expected wait, then a quarter of it at a time,
 * for up to twice the expected wait) are there for waits up to nap_max_us, 0 (off) unless
 * PRECOND_SHM_NAP_US says otherwise (rpc_shm_nap_max_us): on the loaded VM they cost more
 * than the futex, quiet cores are to say. A wait longer than either (pushes stopped) goes
 * to the futex at once next time: nothing spins or naps while idle. */
#define RPC_SHM_SPIN_US 20.0
typedef struct {
  double expect_us;  /* how long this side expects to wait (0: not known) */
  double t0_us;      /* when the wait under way started (rpc_shm_nap) */
  double nap_max_us; /* the longest expected wait napped through (0: no naps) */
} rpc_shm_pace;

/* PRECOND_SHM_NAP_US of the environment, read once: rpc_shm_pace.nap_max_us for the
 * client's regions (rpc_shm_open) and the daemon's doorbell threads; 0 when unset or not a
 * number from 0 to 100000. */
double rpc_shm_nap_max_us(void);

/* The mode of a large write into the region (session 16): streamed (rpc_shm_write's
 * non-temporal stores) or plain (memcpy), chosen by measurement on the machine, in the
 * pushes themselves. Which costs less depends on the host: session 11's paid 3.5x for a
 * plain write across cores, session 16's reads plain-written lines from the shared L3
 * cheaper than streamed ones from memory (docs/precondd.md, "Session 16"). The writer times
 * each large write on its thread's clock (ns per byte, by mode), the daemon's doorbell
 * thread says what each push cost it (PushResponse.bell_cpu_ns: that push's read and fold,
 * ns per byte of the push's large writes, credited to the mode they were all written in;
 * a push mixing modes is not credited), and the mode with the lower sum is taken. Until
 * the daemon's first figure (an older daemon never sends one) the rule before it stays
 * (rpc_shm_streams_at). From the first figure on, RPC_SHM_MODE_BLOCK writes at a time go
 * in each mode in turn for RPC_SHM_MODE_PROBE blocks (the first two, which first touch the
 * slots' pages, not counted), then the cheaper mode is taken (the rule before if some
 * figure is still missing, e.g. every push mixed modes); a block in the other mode comes 8
 * blocks later, then at gaps doubling to one block in RPC_SHM_MODE_EVERY (back to 8 after
 * each change of choice), so that a choice the figures got wrong is soon undone and a
 * change of placement or load followed.
 * Writes below RPC_SHM_STREAM_MIN stay plain and are not counted. Thread-safe (its own spin
 * lock: a region's workers write slots while its background thread reads answers). */
#define RPC_SHM_MODE_BLOCK     16   /* large writes of one mode in a row while probing */
#define RPC_SHM_MODE_SETTLE    4    /* writes after a change of mode not counted */
#define RPC_SHM_MODE_PROBE     8    /* blocks alternated before the first choice */
#define RPC_SHM_MODE_EVERY     64   /* once chosen: one block in this many in the other mode */
#define RPC_SHM_MODE_MARGIN    0.03 /* the other mode must cost this much less to be taken */
#define RPC_SHM_PLAIN          0    /* rpc_shm_mode_pick's answers, the indexes below */
#define RPC_SHM_STREAMED       1
#define RPC_SHM_UNSETTLED      2 /* rpc_shm_mode_pick's bit: a write after a change of mode */
#define RPC_SHM_FORCE_PLAIN    1 /* rpc_shm_mode.force (0: measured) */
#define RPC_SHM_FORCE_STREAMED 2
typedef struct {
  int force;                       /* 0, RPC_SHM_FORCE_PLAIN or _STREAMED (PRECOND_SHM_WRITE) */
  unsigned char busy;              /* the spin lock */
  uint64_t ticks;                  /* large writes decided by measurement (the probes' clock) */
  uint64_t heard;                  /* answers that carried the daemon's figure */
  double write[2];                 /* by mode: the writer's ns per byte, a moving average */
  double read[2];                  /* by mode: the daemon's ns per byte, a moving average */
  double wlast[2][2], rlast[2][2]; /* by mode: the last two figures of each (a median) */
  uint32_t nwrite[2], nread[2];    /* figures taken into each */
  uint64_t count[2]; /* large writes by mode, whatever chose them (rpc_shm_mode_wrote) */
  int chosen;        /* 1 + the mode measurement chose last (0: none yet) */
  int last;          /* 1 + the mode of the last write measured (0: none yet) */
  int run;           /* writes in that mode in a row, up to RPC_SHM_MODE_SETTLE */
  uint64_t probe_at; /* the block of the next probe in the other mode (0: none yet) */
  uint64_t gap;      /* blocks from the last probe to it: 8, doubling to EVERY */
  uint64_t switches; /* times that choice changed (the first included) */
} rpc_shm_mode;

/* PRECOND_SHM_WRITE of the environment, read once: "streamed" RPC_SHM_FORCE_STREAMED,
 * "plain" RPC_SHM_FORCE_PLAIN, anything else or unset 0 (measured). For benchmarks and for
 * hosts where the measurement misleads. */
int rpc_shm_write_force(void);

/* The mode of a write of len bytes into the region mapped at map (the rule before, while
 * the daemon's figures are not known): RPC_SHM_STREAMED or RPC_SHM_PLAIN, with
 * RPC_SHM_UNSETTLED for one of the first RPC_SHM_MODE_SETTLE writes after a change of mode
 * (the slots are as the other mode left them: its figures, the writer's and the daemon's
 * for its push, are not counted). The writer passes the pick on as it is to
 * rpc_shm_mode_wrote and rpc_shm_wrote; its stores are pick & RPC_SHM_STREAMED. */
int rpc_shm_mode_pick(rpc_shm_mode *m, const void *map, size_t len);
/* The writer's CPU for a write of len bytes as picked (ignored below RPC_SHM_STREAM_MIN). */
void rpc_shm_mode_wrote(rpc_shm_mode *m, int pick, size_t len, uint64_t ns);
/* The daemon's figure for a push (ns; 0: none) whose large writes were bytes[mode]. */
void rpc_shm_mode_read(rpc_shm_mode *m, const uint64_t bytes[2], uint64_t ns);
/* The mode measurement chose at the last large write (write + read per byte), or -1:
 * none yet (still probing, forced, or no figure from the daemon). */
int rpc_shm_mode_chosen(rpc_shm_mode *m);

/* The calling thread's CPU time in ns (CLOCK_THREAD_CPUTIME_ID; 0 where unknown). */
uint64_t rpc_shm_thread_ns(void);

/* The client's side of a region (libprecond's background thread and bench-daemon's shm
 * rows): one thread uses a region at a time. */
typedef struct {
  uint64_t id;
  uint8_t secret[RPC_SHM_SECRET_BYTES];
  unsigned char *map; /* NULL: no region */
  size_t bytes;
  int fd;
  uint64_t in_pos;            /* next free byte of the client's push ring, from its start */
  uint64_t in_laps;           /* times the push ring wrapped (its slots' stamps) */
  const unsigned char *roots; /* the daemon's roots area, read-only; NULL: none */
  size_t roots_bytes;
  int bell;      /* the daemon serves this region's doorbell (ShmOpenResponse.doorbell) */
  uint32_t rung; /* requests rung so far (rpc_shm_head.bell) */
  int queue;     /* the daemon marks requests taken (ShmOpenResponse.doorbell_queue) */
  /* Pushes rung and not yet collected, oldest first (rpc_shm_post, rpc_shm_collect): the
   * bell each was rung with, where its answer goes, and where its first slot starts in
   * bytes of the ring ever taken (nothing from there on may be taken again until it is
   * collected). */
  uint32_t npend;
  struct {
    uint32_t bell, cap; /* cap: its answer's room */
    uint64_t reply, start;
    uint64_t wrote[2]; /* its large writes' bytes by mode (rpc_shm_mode_read) */
    int unsettled;     /* some of them RPC_SHM_UNSETTLED: its figure not counted */
  } pend[RPC_SHM_QUEUE];
  uint64_t push_start; /* where the push being written starts (rpc_shm_begin), same count */
  uint64_t push_end;   /* where the place rpc_shm_begin reserved for it ends; 0: none */
  rpc_shm_pace pace;   /* its waits for answers (rpc_shm_collect) */
  uint64_t lim;       /* the ring's first lim bytes are all that rpc_shm_slot, rpc_shm_begin and the
                 * doorbell's requests take (0: the whole ring); the rest is the caller's own
                 * (libprecond's worker slots, session 15). Set after rpc_shm_open; the stamps
                 * still count whole laps, so rpc_shm_push_intact is unchanged */
  rpc_shm_mode wmode; /* the mode of its large writes (force from PRECOND_SHM_WRITE) */
  rpc_shm_mode *mode; /* the one rpc_shm_put and the answers use: NULL, wmode; else the
                       * caller's, shared with writers outside (libprecond's worker slots) */
  uint64_t wrote[2];  /* the push being written: its large writes' bytes by mode
                       * (rpc_shm_put's, and rpc_shm_wrote's), moved to pend[] as it rings */
  int unsettled;      /* of them, some RPC_SHM_UNSETTLED */
} rpc_shm;

/* Counts len bytes written as picked (rpc_shm_mode_pick) into the push being written by a
 * writer outside rpc_shm_put (libprecond's worker slots), so that the daemon's figure for
 * that push is credited to the mode (rpc_shm_mode_read). */
void rpc_shm_wrote(rpc_shm *s, int pick, uint64_t len);

/* Asks the daemon on ch for a region of want bytes (0: its default), opens the file it
 * names, takes a shared flock on it (held until rpc_shm_close: the daemon frees the
 * region when no lock is left, e.g. when this process dies) and maps it. On RPC_OK *s is
 * ready; otherwise *s is closed, *code has the gRPC status (UNIMPLEMENTED: a daemon without
 * shared memory) and err a message. token as rpc_call_token's. Owns its mapping and
 * descriptor until rpc_shm_close. */
/* rpc_shm_open that makes the promise of ShmOpenRequest.holds_vouched when holds_vouched is
 * set: the caller writes no vouched reference's bytes (ShmRef.vouched) until that push is
 * answered or the region given up. rpc_shm_open makes none. */
int rpc_shm_open_holding(grpc_channel *ch, const char *token, long deadline_ms, uint64_t want,
                         int holds_vouched, rpc_shm *s, grpc_status_code *code, char *err,
                         size_t errlen);
int rpc_shm_open(grpc_channel *ch, const char *token, long deadline_ms, uint64_t want, rpc_shm *s,
                 grpc_status_code *code, char *err, size_t errlen);

/* Unmaps and closes (dropping the lock) and unmaps the roots area. A closed or zeroed *s
 * is a no-op. */
void rpc_shm_close(rpc_shm *s);

/* The session fields a request carries. */
void rpc_shm_session(const rpc_shm *s, Precond__V1__ShmSession *w);

/* The client's half as a push ring with a stamp. Its first RPC_SHM_PUSH_RING bytes hold
 * the ring's head (a uint64_t the client stores atomically): where the last slot taken ends,
 * counted in bytes of the ring ever taken (wraps' skipped ends included), set before that
 * slot's bytes are written; the ring is the rest of the half. A push reference's seq is 1 +
 * where its slot starts in the same count (0: an unstamped reference, an older client's),
 * so its offset is RPC_SHM_PUSH_RING + (seq - 1) % ring. Its bytes are as the client wrote
 * them while the head is at most seq - 1 + ring: no later slot reached around the ring onto
 * them (a push whose call the client gave up on, and its ring wrapped while the daemon still
 * read it). The daemon checks that after reading (rpc_shm_push_intact). */
#define RPC_SHM_PUSH_RING RPC_SHM_ALIGN

/* 1 when the push reference (offset, seq) into the client's half of the region map (bytes
 * long) is intact as above, or unstamped (seq 0); 0 when a later slot was taken over it, or
 * offset is not where seq puts it. Call after reading the bytes: the load is ordered after
 * them (acquire). */
int rpc_shm_push_intact(const unsigned char *map, size_t bytes, uint64_t offset, uint64_t seq);

/* Takes len bytes of the client's push ring for push matrix m and returns where the caller
 * writes m's bytes before the call (e.g. the kernel producing the statistic, with no copy of
 * its own): sets m->shm to *ref (caller-provided, lives until the call is sent; unchecked: no
 * checksum pass; stamped: seq) and empties m->data. NULL when len is 0 or above the ring
 * (m unchanged: send its bytes). The bytes must stay as written until the call returns. */
unsigned char *rpc_shm_slot(rpc_shm *s, Precond__V1__PackedMatrix *m, size_t len,
                            Precond__V1__ShmRef *ref);

/* The producer's write of a push's bytes into a slot (rpc_shm_put's; a kernel writing its
 * statistic into rpc_shm_slot's place may use it too): len bytes from src to dst, bit for
 * bit. From RPC_SHM_STREAM_MIN bytes on (and where the processor has AVX or AVX-512) the
 * 64-byte lines go by non-temporal stores, straight to memory, then a store fence: the
 * daemon, on another core, then reads them from memory instead of taking each line from
 * this core's caches, and this core does not first fetch the lines the daemon read last
 * time (bench/bench-xcore.c: 1.8-2.1x less CPU for the write and the fold together across
 * two cores at 1-4 MB, a loss below 1 MiB or with both on one core; docs/precondd.md,
 * "Session 11"). Below it, a plain memcpy. */
#define RPC_SHM_STREAM_MIN ((size_t)1 << 20)
void rpc_shm_write(void *dst, const void *src, size_t len);

/* The CPU the calling thread runs on now, or -1 where that cannot be known. */
int rpc_shm_cpu(void);

/* 1 when rpc_shm_put would stream a slot of len bytes into s: len is at least
 * RPC_SHM_STREAM_MIN, the processor can, and the daemon's thread did not serve the region's
 * last request on the caller's own CPU (rpc_shm_head.daemon_cpu; not known counts as
 * another): streaming helps when the daemon reads the bytes on another core (1.3-1.8x per
 * CPU second for a 1024 block's push) and costs 5-12% when both share one core, where
 * plain stores keep the lines in that core's caches (docs/precondd.md, "Session 11"). */
int rpc_shm_streams(const rpc_shm *s, size_t len);
/* rpc_shm_streams' rule for a write into the region mapped at map (its head first; NULL:
 * not known, streams), for a writer that holds the mapping but not the rpc_shm (libprecond's
 * worker writing its slot, precond_push_copy). */
int rpc_shm_streams_at(const void *map, size_t len);
/* Copies count floats from src to dst, streamed as rpc_shm_write streams (when stream is set
 * and count is large), else plainly, and says in the same pass whether the values may be
 * vouched for (ShmRef.vouched): 1 when every one is below 2^125 in magnitude
 * (rpc_f32_unvouched), else 0. */
int rpc_shm_write_vouched(float *dst, const float *src, size_t count, int stream);

/* rpc_shm_slot for m's own bytes, copied there (rpc_shm_write when the region's mode says
 * so, rpc_shm_mode_pick, else a plain memcpy; timed on the thread's clock for the mode's
 * measurement). Returns the bytes moved (0: m keeps its bytes). */
size_t rpc_shm_put(rpc_shm *s, Precond__V1__PackedMatrix *m, Precond__V1__ShmRef *ref);

/* After the daemon answered a push (it read every slot the push named before answering):
 * the next slot starts at the ring's start again, so a worker's pushes reuse the same
 * bytes, still in the caches of both processes, instead of walking the whole ring through
 * memory (docs/precondd.md, "Wire"). The stamps count the skipped rest of the ring as taken,
 * so rpc_shm_push_intact stays exact: a slot still being read (the caller rewound after a
 * call it gave up on) is refused, not read mixed. A no-op on an empty ring. */
void rpc_shm_rewind(rpc_shm *s);

/* The doorbell (session 9): a push rung in the region instead of sent as a gRPC call, so
 * gRPC carries only the region's opening and the calls that do not fit. The push ring's
 * head (the RPC_SHM_PUSH_RING bytes before the ring) is laid out as rpc_shm_head. The
 * client packs the PushRequest it would send (references into the ring, as for gRPC) into a
 * slot of the ring followed by RPC_SHM_BELL_REPLY bytes for the answer, fills the head's
 * request fields, then adds 1 to bell (release) and wakes the daemon's futex on it. The
 * daemon's thread for the region reads the head once (rpc_shm_bell_read: the request and
 * the answer must lie in the ring), copies the request out and serves it exactly as the
 * gRPC method's handler (the same admission, parse, validation, status codes and messages),
 * writes the answer (rpc_shm_bell_answer: a uint32_t status code, a uint32_t length, then
 * the packed response on OK or the message otherwise) and then stores bell's value in
 * answered (release) and wakes the client's futex on it. The daemon serves a region's
 * requests one at a time, in the order rung (one client thread uses a region). A daemon
 * that offers the queue (ShmOpenResponse.doorbell_queue, session 10) also stores each bell's
 * value in taken (sequentially consistent; a futex wake when taken_wait says the client
 * waits) as soon as it read the head's fields, before it serves the request: the client may then fill the head for the next request while this
 * one is served (rpc_shm_post), up to RPC_SHM_QUEUE rung and not yet collected. The region
 * was opened by an authenticated OpenSharedMemory call and the request names the region's
 * secret, as over gRPC. */
typedef struct {
  uint64_t ring_head;    /* the push ring's head (above), the client's */
  uint32_t bell;         /* futex word: requests rung, the client's */
  uint32_t answered;     /* futex word: the last bell answered, the daemon's */
  uint64_t req_offset;   /* the packed request, from the region's start */
  uint32_t req_length;   /* bytes */
  uint32_t method;       /* RPC_SHM_BELL_PUSH */
  uint64_t reply_offset; /* where the answer goes, from the region's start */
  uint32_t reply_cap;    /* bytes there, RPC_SHM_REPLY_HEAD included */
  uint32_t taken;        /* futex word: the last bell whose fields above the daemon read */
  uint32_t taken_wait;   /* the client: 1 while it waits on taken (only then is it woken) */
  uint32_t daemon_cpu;   /* the daemon: 1 + the CPU its thread served the last request on
                          * (0: not known: no request rung yet, or an older daemon);
                          * before the daemon's figures are known (rpc_shm_mode),
                          * rpc_shm_put streams large slots only when it is not the
                          * client's own (rpc_shm_streams) */
  uint32_t bell_wait;    /* the daemon's (session 12): RPC_SHM_WAIT_FLAGGED once its thread
                          * flags its sleeps, | RPC_SHM_WAIT_ASLEEP while that thread may
                          * sleep in the kernel on bell: only then does a ring wake it
                          * (0, an older daemon: every ring wakes it) */
  uint32_t answer_wait;  /* the client's: the same for its sleeps on answered, and in bits
                          * 8 up 1 + the CPU it rang the last request on (0: not known) */
} rpc_shm_head;
/* The wait words' bits (rpc_shm_head.bell_wait, answer_wait, taken_wait). */
#define RPC_SHM_WAIT_ASLEEP  1u
#define RPC_SHM_WAIT_FLAGGED 2u
#define RPC_SHM_WAIT_CPU     8  /* answer_wait: the client's CPU's shift */
#define RPC_SHM_BELL_PUSH    1u /* PushStatistics */
#define RPC_SHM_BELL_FETCH   2u /* FetchPreconditioners (session 10: the poll without gRPC) */
#define RPC_SHM_BELL_REPLY   1024u
/* The largest answer room a daemon serves (a fetch's answer of references grows with the
 * job's blocks, ~100 bytes each); a larger room is answered in this much. */
#define RPC_SHM_BELL_REPLY_MAX (4u << 20)
#define RPC_SHM_REPLY_HEAD     8u
#define RPC_SHM_NO_ANSWER      0xffffffffu /* the status the client leaves before ringing */

/* One rung request as the daemon read it (rpc_shm_bell_read), checked against the region. */
typedef struct {
  uint32_t bell, method, req_length, reply_cap;
  uint64_t req_offset, reply_offset;
} rpc_shm_bell;

/* Reads the head of the region map (bytes long) once into *b: RPC_OK when the request and
 * the answer's room lie in the push ring (no overflow for any values), the method is known
 * and the room holds at least RPC_SHM_REPLY_HEAD bytes; RPC_EINVAL otherwise (the request
 * cannot be served; when reply_offset/reply_cap alone are sound, the caller may still
 * answer). Call after seeing bell move (the load of bell was an acquire). */
int rpc_shm_bell_read(const unsigned char *map, size_t bytes, rpc_shm_bell *b);

/* Writes the answer to b (code, then len bytes of msg, cut to the room), then publishes it:
 * answered = b->bell (release) and a futex wake. b's reply fields must have passed
 * rpc_shm_bell_read; with them unsound only answered moves (the client reports a malformed
 * answer). */
void rpc_shm_bell_answer(unsigned char *map, size_t bytes, const rpc_shm_bell *b, uint32_t code,
                         const void *msg, size_t len);

/* The daemon's figure for a push it served at the doorbell (session 16): appends to the
 * packed PushResponse in out (len bytes, cap its room) the field bell_cpu_ns = ns, which a
 * protobuf parser merges into the message (the encoding is a sequence of fields); an older
 * client skips it. Returns the new length (len: ns is 0 or the room is too small). */
size_t rpc_shm_bell_cpu_append(unsigned char *out, size_t len, size_t cap, uint64_t ns);

/* The waiting side, before sleeping: spins or naps as pace says (above), unless same_core
 * (the other side last ran on this CPU: it could not run meanwhile), until *word - want >= 0
 * (counts wrap), or until_us (monotonic microseconds, 0: no limit) passes. 1
 * when the word got there, 0 when the caller must sleep (rpc_shm_sleep until the word gets
 * there, then rpc_shm_paced). Resets pace's start. */
int rpc_shm_nap(const uint32_t *word, uint32_t want, rpc_shm_pace *pace, double until_us,
                int same_core);

/* The sleep after rpc_shm_nap returned 0: sets ASLEEP in *wait (the sleeper's wait word,
 * e.g. rpc_shm_head.bell_wait), looks at *word again, sleeps on its futex up to timeout_ms
 * while it has not reached want, clears ASLEEP. 1 when *word reached want, -1 when the
 * sleep timed out without it (with rpc_shm_signal's wake that cannot happen unless the
 * other side is gone), 0 otherwise (woken early, or a signal): look again. */
int rpc_shm_sleep(uint32_t *word, uint32_t want, uint32_t *wait, long timeout_ms);

/* The end of a wait that slept (rpc_shm_nap returned 0): its length is the next expect. */
void rpc_shm_paced(rpc_shm_pace *pace);

/* The other side: stores v in *word (sequentially consistent) and wakes the futex on it
 * unless *wait (the sleeper's wait word) has RPC_SHM_WAIT_FLAGGED without
 * RPC_SHM_WAIT_ASLEEP. */
void rpc_shm_signal(uint32_t *word, uint32_t v, const uint32_t *wait);

/* Monotonic microseconds. */
double rpc_shm_now_us(void);

/* Waits while *word == val, up to timeout_ms (< 0: no limit), on a futex shared between
 * processes (a MAP_SHARED mapping): returns at a wake, a change, the timeout (then 1, else
 * 0) or a signal; the caller checks the word again. Wakes every waiter on word. */
int rpc_shm_futex_wait(uint32_t *word, uint32_t val, long timeout_ms);
void rpc_shm_futex_wake(uint32_t *word);

/* The daemon's mark of life on a region (for the doorbell's waits): an open file
 * description's write lock on the file's first byte (F_OFD_SETLK, Linux; independent of the
 * clients' flock), taken by the daemon when it makes the region and dropped by the kernel
 * when the daemon closes it or dies. rpc_shm_alive_mark: the daemon's side, RPC_OK or
 * RPC_EINVAL; rpc_shm_alive: the client's, 0 when nobody holds the mark (the daemon is gone),
 * 1 when it is held or this cannot be known. */
int rpc_shm_alive_mark(int fd);
int rpc_shm_alive(int fd);

/* rpc_call of PushStatistics through s's doorbell (above), with rpc_call's outputs and
 * returns. RPC_EINVAL when s serves no doorbell and RPC_ETOOBIG when the request and its
 * answer do not fit before the ring's end (send the call over gRPC instead: nothing was
 * rung). No answer by deadline_ms (> 0) gives RPC_ECALL with DEADLINE_EXCEEDED, and a
 * daemon gone meanwhile (rpc_shm_alive, looked at every 100 ms of waiting) RPC_ECALL with
 * UNAVAILABLE, as a gRPC call would; either way the region must then be closed (a late
 * answer may still land in the ring). */
int rpc_shm_call(rpc_shm *s, const ProtobufCMessage *req,
                 const ProtobufCMessageDescriptor *resp_desc, long deadline_ms,
                 ProtobufCMessage **resp, grpc_status_code *status, char **details);

/* rpc_shm_call of method (RPC_SHM_BELL_PUSH or RPC_SHM_BELL_FETCH) with reply_cap bytes of
 * room for the answer (at least RPC_SHM_BELL_REPLY; the daemon serves at most
 * RPC_SHM_BELL_REPLY_MAX). An answer that does not fit the room comes back as
 * RESOURCE_EXHAUSTED ("does not fit the doorbell's room"): send the call over gRPC then. */
int rpc_shm_call_method(rpc_shm *s, uint32_t method, uint32_t reply_cap,
                        const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                        long deadline_ms, ProtobufCMessage **resp, grpc_status_code *status,
                        char **details);

/* The pipelined doorbell (session 10; needs s->queue): a push is written (rpc_shm_begin,
 * then its slots, rpc_shm_slot/put), rung (rpc_shm_post, which returns once the daemon can
 * see it) and its answer collected later (rpc_shm_collect), so the client writes push k + 1
 * while the daemon folds push k. Error surfacing: nothing is lost: every push posted has
 * its own answer (status code, message naming the field, the same as rpc_shm_call's), which
 * rpc_shm_collect returns, oldest first; rpc_shm_begin collects by itself when the queue is
 * full or the ring has no room, and stops at the first answer that is not OK (returning it,
 * as rpc_shm_collect would) so that the caller sees every failure. Ordering: the daemon
 * serves a region's pushes in the order posted, each whole (its whole-request validation
 * holds); a fetch or a gRPC push sees a posted push only once it was collected (collect all
 * before either). A daemon gone with pushes in flight: the wait of begin,
 * post or collect reports UNAVAILABLE (looked at every 100 ms), no answer by deadline_ms
 * DEADLINE_EXCEEDED (RPC_ECALL): the region must then be closed, the pushes in flight are
 * lost with it and the caller learns so from that return.
 *
 * rpc_shm_begin: reserves need bytes of the ring for a push: its slots (each slot's length
 * rounded up to RPC_SHM_ALIGN), its packed request (8-aligned) and RPC_SHM_BELL_REPLY; it
 * collects answers (oldest first) while RPC_SHM_QUEUE are pending or the ring has no room
 * clear of the pending pushes, then places the push at the ring's start when that is clear
 * (the same bytes again and again, in the caches) or after the previous push. RPC_OK when
 * placed; RPC_ETOOBIG when need exceeds the ring (nothing collected); a collected failure as
 * rpc_shm_collect returns it (*resp freed; call again for the room). */
int rpc_shm_begin(rpc_shm *s, uint64_t need, long deadline_ms, grpc_status_code *status,
                  char **details);

/* 1 when rpc_shm_begin(s, need) would place the push at once, collecting nothing (fewer
 * than RPC_SHM_QUEUE pending, and room clear of them); 0 otherwise, or need above the
 * ring. A caller that keeps each push's answer for itself (libprecond) collects with
 * rpc_shm_collect until this says 1, so that rpc_shm_begin never collects on its own. */
int rpc_shm_fits(const rpc_shm *s, uint64_t need);

/* Rings req (a PushRequest whose slots the caller wrote since rpc_shm_begin) without
 * waiting for its answer: waits (deadline_ms, the daemon's mark of life) only until the
 * daemon took the previous request's head, packs req after the slots (with
 * RPC_SHM_BELL_REPLY bytes for the answer) and rings; the push then holds all of the place
 * rpc_shm_begin reserved (so pushes of one size alternate between two places). RPC_OK:
 * posted (s->npend grew); RPC_ETOOBIG: the request and its answer's room do not fit in the
 * reserved place (nothing rung); RPC_EINVAL: no queue and one pending, or RPC_SHM_QUEUE
 * pending; RPC_ECALL as above. */
int rpc_shm_post(rpc_shm *s, const ProtobufCMessage *req, long deadline_ms,
                 grpc_status_code *status, char **details);

/* Waits for the oldest pending push's answer and returns it as rpc_shm_call does (resp,
 * status, details; the caller frees *resp and *details). RPC_EINVAL when none is pending. */
int rpc_shm_collect(rpc_shm *s, const ProtobufCMessageDescriptor *resp_desc, long deadline_ms,
                    ProtobufCMessage **resp, grpc_status_code *status, char **details);

/* Looks, no waits (session 17: libprecond's committing thread collects what is done and
 * posts only where nothing would hold it up, else waits for an answer the daemon is at work
 * on, or leaves the push to its background thread). rpc_shm_answered: 1 when the oldest
 * pending push is answered (rpc_shm_collect would return it at once); 0 when none is pending
 * or its answer is not there yet. rpc_shm_taken: 1 when the daemon took the head of pending
 * push i (0: the oldest, being served or answered; s->npend - 1: the last rung, so
 * rpc_shm_post would not wait for the head), or i is not pending (none pending: i = npend -
 * 1 wraps above it); 0 otherwise. */
int rpc_shm_answered(const rpc_shm *s);
int rpc_shm_taken(const rpc_shm *s, uint32_t i);

/* Sets the fields of a fetch through s: the session, and roots_area when s has the roots
 * area mapped. */
void rpc_shm_fetch_request(const rpc_shm *s, Precond__V1__ShmSession *w,
                           Precond__V1__FetchRequest *req);

/* For every matrix of a fetch answer that names the region: checks that the reference lies
 * in the daemon's half and that the bytes there have its CRC-32C, or (seq set) that it lies
 * in the roots area and its entry holds seq, and points data at the bytes (no copy: the
 * caller decodes them into its own roots, the one copy the bytes path makes too; then
 * rpc_shm_fetch_intact says whether roots-area bytes stayed as published meanwhile).
 * Returns the bytes referenced, or -1 with a message naming the field in err (a reference
 * out of place, a checksum that differs: the answer must not be used). Either way
 * rpc_shm_fetch_done(r) must run before r is freed. */
long long rpc_shm_fetch_in(const rpc_shm *s, Precond__V1__FetchResponse *r, char *err,
                           size_t errlen);

/* After the caller copied or decoded r's roots (rpc_shm_fetch_in): 1 when every
 * roots-area reference's entry still holds its seq, i.e. the copies are of the bytes
 * published; 0 when the daemon overwrote some meanwhile (its ring wrapped: drop the
 * copies and fetch again; rare, the area holds many answers). */
int rpc_shm_fetch_intact(const rpc_shm *s, const Precond__V1__FetchResponse *r);

/* Detaches the data pointers rpc_shm_fetch_in set (they are the region's, not the
 * answer's), so protobuf_c_message_free_unpacked(r) frees only what is r's. */
void rpc_shm_fetch_done(Precond__V1__FetchResponse *r);

/* ---- json.c: the JSON string escaper of precondctl and the benchmark clients ---------- */

/* Writes s to f as a JSON string literal: quotes, backslash escapes for '"', '\\', \n, \r,
 * \t and \u00XX for the other control characters; other bytes (UTF-8 included) as they
 * are. NULL writes "". Write errors are left in f's error flag (ferror). */
void rpc_json_string(FILE *f, const char *s);

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_RPC_H */
