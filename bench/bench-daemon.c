/*
 * bench-daemon.c -- precondd's transport, root latency, pool and snapshot figures, as CSV on
 * stdout: the one daemon benchmark.
 *
 * Against a running daemon (--addr) or daemons it starts itself (--spawn PATH: one on a TCP
 * loopback port, one on a unix socket), it measures:
 *   push   PushStatistics of one n x n block (both packed factors, fp32 or with --bf16 bf16),
 *          (--wire over a unix socket: push-shm and fetch-shm rows too, the matrices through
 *          a shared-memory region, proto/rpc.h: a copy with its checksum each way)
 *          1..16 clients each on its own channel, back to back for --seconds: MB/s and
 *          latency percentiles, next to a single-threaded memcpy of the same bytes (the limit);
 *   fetch  FetchPreconditioners of one n x n block's roots (the same job for every client),
 *          MB/s and latency, next to memcpy of the same bytes;
 *   root   the time from one push to the first fetch that returns roots computed from it
 *          (--reps round trips on one channel, each once the daemon's queue is empty), next
 *          to one thread computing the same two roots in this process;
 *   pool   roots per second of the daemon's worker pool on --pool-blocks blocks of 256
 *          (Gram matrices of Gaussian gradients, default Newton method), next to one thread
 *          computing the same roots in this process with pc_inverse_root_f32;
 *   snapshot-write, snapshot-restore (--snapshot-mb M, with --spawn) the daemon's own times
 *          to write its snapshot of about M MiB of statistics at SIGTERM and to restore it at
 *          the next start;
 *   replicas (--mpirun PATH, with --spawn; alone) daemon replicas: mpirun -np R precondd
 *          for each R of --ranks, one pool thread per rank; per step the --pool-blocks blocks
 *          of 256 (eigh roots) pushed to their owners (or to rank 0: --replica-push first)
 *          through shared memory (--replica-wire bytes: gRPC bytes), timed until every
 *          rank holds every root (GetStats): roots/s (ratio to the R = 1 row before, or
 *          the first row) and p50/p90 of that time over --replica-steps steps; with
 *          --ceiling a "ceiling" row before each: the same roots in R plain processes
 *          pinned to cores 0..R-1, the machine's own limit (docs/replicas.md).
 * All ratios come from the same run. The memcpy rates are measured at the start, before any
 * daemon computes roots, so they are the machine's limit rather than a loaded figure.
 *
 * Rows: bench,transport,block,clients,ops,seconds,mb_per_s,ops_per_s,p50_ms,p90_ms,p99_ms,
 *       baseline,baseline_value,ratio
 * (clients = the daemon's pool threads in pool and snapshot rows; ratio = mb_per_s / memcpy
 * MB/s for push and fetch, ops_per_s / single-thread rate for root and pool; snapshot rows
 * have no baseline). Notes (skipped cells, daemon paths) go to stderr.
 */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET: the ceiling rows pin processes */
#include <dirent.h>
#include <sched.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>
#include <grpc/grpc_security.h>

#include "precond.h"
#include "precond.pb-c.h"
#include "mpirun_proc.h"
#include "precondd_proc.h"
#include "preconditioner.h"
#include "rpc.h"

#define MAX_LIST 16
#define CALL_MS  120000

typedef struct {
  const char *addr;
  const char *spawn;
  size_t sizes[MAX_LIST];
  int nsizes;
  int clients[MAX_LIST];
  int nclients;
  double seconds;
  size_t fetch_max;
  int pool_blocks;
  int threads;
  double max_inflight_mb;
  int transports;      /* bit 1: tcp, bit 2: unix (spawn only) */
  int window_mb;       /* HTTP/2 receive window of the bench's channels; 0: gRPC's default */
  int bf16;            /* statistics pushed and roots fetched as bf16 (else fp32) */
  int reps;            /* root rows: push-to-root round trips per size; 0: none */
  size_t snapshot_mb;  /* snapshot rows: MiB of statistics; 0: none (spawn only) */
  const char *mpirun;  /* replica rows: mpirun's path; NULL: none (spawn only) */
  int ranks[MAX_LIST]; /* replica rows: daemon ranks, e.g. 1,2 */
  int nranks;
  int replica_steps;          /* replica rows: timed steps per R */
  int replica_push_first;     /* replica rows: every block pushed to rank 0 (else to its owner) */
  int replica_bytes;          /* replica rows: gRPC bytes (else a region and the roots area) */
  int ceiling;                /* replica rows: a ceiling row (plain processes) before each */
  double root_noise;          /* root rows: 0 fresh statistics each trip; x > 0: one statistic plus
                          x times a fresh one (a block in its steady state) */
  const char *daemon_args[9]; /* --daemon-arg: more options of the spawned daemons */
  int ndaemon_args;
  double memcpy_mb_s[MAX_LIST];   /* per size, measured before any daemon runs */
  double memcpy_pct[MAX_LIST][3]; /* and the p50/p90/p99 of one copy (ms) */
  int wire;                       /* --wire: push and fetch rows only, pool kept out of them */
  int shm_only;                   /* --shm-only: of those, the shared-memory rows alone */
  int cpu_clock;                  /* --clock cpu: rates per CPU second of bench + daemon */
  int push_shm_only;              /* --push-shm-only: of the region's push rows, push-shm */
  const char *channel_args[8];    /* --channel-arg KEY=INTEGER of the measured channels */
  int nchannel_args;
} bench_opts;

static int g_window_mb;
static const bench_opts *g_opts; /* the measured channels read --channel-arg from here */

/* A channel with the arguments of rpc_channel_create (size limits, transport defaults),
 * then --window-mb as the HTTP/2 receive window (lookahead) and every --channel-arg.
 * Released with rpc_channel_destroy (which gives back this grpc_init). */
static grpc_channel *bench_channel(const char *addr) {
  rpc_args a;
  rpc_args_init(&a, 0);
  if (g_window_mb > 0)
    rpc_args_set_int(&a, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, g_window_mb << 20);
  for (int i = 0; g_opts != NULL && i < g_opts->nchannel_args; i++)
    rpc_args_parse(&a, g_opts->channel_args[i]); /* checked when parsed in main */
  return rpc_channel_create_args(addr, &a);
}

/* CPU seconds (user + system) used so far by process pid (0: this one), from /proc; 0 if
 * it cannot be read. */
static double cpu_s(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid > 0 ? (int)pid : (int)getpid());
  FILE *f = fopen(path, "r");
  if (f == NULL) return 0.0;
  char buf[1024];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
  unsigned long long ut = 0, st = 0;
  if (p == NULL ||
      sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
    return 0.0;
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static double thread_cpu_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* pid's CPU seconds split by thread: CPU_POOL the root pool ("pd-pool"), CPU_REPLICA the
 * replica communication thread ("pd-replica"), CPU_GRPC the server's pollers ("pd-grpc") and
 * gRPC's own threads, CPU_MAIN the main thread, CPU_MPI every other (Open MPI's runtime
 * threads); CPU_RUNS how many times the replica thread ran (its wake-ups);
 * CPU_POOL_FAULTS and CPU_FAULTS the page faults of the pool and of the other threads (each
 * a trip into the kernel, dear on this virtual machine). From each thread's schedstat
 * (nanoseconds on a CPU: the 10 ms ticks of stat are too coarse for a few milliseconds per
 * step; then the count of its runs) and stat (minor faults). */
enum {
  CPU_POOL,
  CPU_REPLICA,
  CPU_GRPC,
  CPU_MAIN,
  CPU_MPI,
  CPU_RUNS,
  CPU_POOL_FAULTS,
  CPU_FAULTS,
  CPU_NSPLIT
};

/* Minor faults of the thread /proc/.../task/TID (stat's 10th field; the name, in
 * parentheses, may hold spaces). */
static double thread_faults(const char *task) {
  char file[700], line[1024];
  snprintf(file, sizeof file, "%s/stat", task);
  FILE *f = fopen(file, "r");
  if (f == NULL) return 0;
  char *p = fgets(line, sizeof line, f) != NULL ? strrchr(line, ')') : NULL;
  fclose(f);
  unsigned long long minflt = 0;
  if (p == NULL || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %llu", &minflt) != 1) return 0;
  return (double)minflt;
}

static int cpu_kind(const char *name, int is_main) {
  static const char *const grpc[] = {"pd-grpc\n",         "default-executo\n", "resolver-execut\n",
                                     "grpc_global_tim\n", "event_engine\n",    "timer_manager\n"};
  if (strcmp(name, "pd-pool\n") == 0) return CPU_POOL;
  if (strcmp(name, "pd-replica\n") == 0) return CPU_REPLICA;
  for (size_t i = 0; i < sizeof grpc / sizeof grpc[0]; i++)
    if (strcmp(name, grpc[i]) == 0) return CPU_GRPC;
  return is_main ? CPU_MAIN : CPU_MPI;
}

static void cpu_split(pid_t pid, double out[CPU_NSPLIT]) {
  for (int k = 0; k < CPU_NSPLIT; k++) out[k] = 0;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char file[600], name[32] = "";
    unsigned long long ns = 0, waited = 0, runs = 0;
    snprintf(file, sizeof file, "%s/%s/comm", path, e->d_name);
    FILE *f = fopen(file, "r");
    if (f == NULL) continue;
    int ok = fgets(name, sizeof name, f) != NULL;
    fclose(f);
    snprintf(file, sizeof file, "%s/%s/schedstat", path, e->d_name);
    if (!ok || (f = fopen(file, "r")) == NULL) continue;
    ok = fscanf(f, "%llu %llu %llu", &ns, &waited, &runs) == 3;
    fclose(f);
    if (!ok) continue;
    int k = cpu_kind(name, atoi(e->d_name) == (int)pid);
    out[k] += 1e-9 * (double)ns;
    if (k == CPU_REPLICA) out[CPU_RUNS] += (double)runs;
    snprintf(file, sizeof file, "%s/%s", path, e->d_name);
    out[k == CPU_POOL ? CPU_POOL_FAULTS : CPU_FAULTS] += thread_faults(file);
  }
  if (d != NULL) closedir(d);
}

/* This process's CPU seconds (every thread), to the nanosecond. */
static double self_cpu_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: bench-daemon (--addr A | --spawn PATH) [options]\n"
          "\n"
          "  --addr A            a running precondd (host:port or unix:/path)\n"
          "  --spawn PATH        start PATH (build/host/precondd) twice: TCP loopback, then\n"
          "                      a unix socket; stopped at the end\n"
          "  --sizes LIST        block sizes n, comma-separated (default 256,1024,4096)\n"
          "  --clients LIST      concurrent clients (default 1,4,16)\n"
          "  --seconds S         per push or fetch cell (default 1)\n"
          "  --fetch-max N       largest n for fetch cells (default 1024: one root of a larger\n"
          "                      block takes the pool minutes on a small machine)\n"
          "  --pool-blocks B     blocks of 256 for the pool rows (default 16; 0 skips them)\n"
          "  --threads T         pool threads of the daemon spawned for the pool rows\n"
          "                      (default: online cores); the push/fetch daemons get 1\n"
          "  --max-inflight-mb M skip cells where clients x request size is above M (256)\n"
          "  --tcp-only          with --spawn, skip the unix socket daemon\n"
          "  --unix-only         with --spawn, skip the TCP daemon\n"
          "  --shm-only          with --wire, the shared-memory rows alone (unix socket)\n"
          "  --window-mb W       HTTP/2 receive window of the client channels in MiB\n"
          "                      (default 0: gRPC's own, which starts at 64 KiB)\n"
          "  --bf16              push statistics and fetch roots as bf16 (rows push-bf16, ...)\n"
          "  --reps R            root rows: push-to-root round trips per size up to\n"
          "                      --fetch-max (default 5; 0 skips them)\n"
          "  --root-noise X      root rows push one statistic plus X times a fresh one each\n"
          "                      trip (a block in its steady state; default 0: fresh ones)\n"
          "  --daemon-arg A      one more option of the spawned daemons (repeat, up to 8;\n"
          "                      e.g. --daemon-arg --warm-roots --daemon-arg on)\n"
          "  --snapshot-mb M     with --spawn, snapshot rows: a daemon holding about M MiB of\n"
          "                      statistics is stopped (snapshot written) and restarted\n"
          "                      (restored); its own times (default: none)\n"
          "  --mpirun PATH       with --spawn, replica rows only: mpirun -np R PATH (one pool\n"
          "                      thread per rank) for each R of --ranks; --pool-blocks blocks\n"
          "                      of 256 pushed per step (eigh roots, p = 2): roots/s, and the\n"
          "                      time from a step's push to every rank holding every root\n"
          "  --ranks LIST        daemon ranks of the replica rows (default 1,2; 1,2,1,2,...\n"
          "                      alternates: each R > 1 row's ratio is to the R = 1 row\n"
          "                      before it, every pair and the median on stderr)\n"
          "  --ceiling           replica rows: before each, the same roots in R plain\n"
          "                      processes pinned to cores 0..R-1 (no daemon): the machine's\n"
          "                      own ceiling; at R = 1 also alone on core 1 (stderr)\n"
          "  --replica-steps N   timed steps of each replica row, after 2 untimed (default 3)\n"
          "  --replica-push owner|first  replica rows: each block pushed to the rank that\n"
          "                      owns it, one thread per rank (default; data-parallel\n"
          "                      workers), or every block to rank 0, which forwards\n"
          "                      the others' (one worker)\n"
          "  --replica-wire shm|bytes  replica rows: pushes through a shared-memory region,\n"
          "                      as a same-host worker's (default), or as gRPC bytes\n");
  fprintf(f,
          "  --wire              the wire alone: per size (default 128,256,...,4096: 64 KiB\n"
          "                      to 64 MiB pushes) a memcpy row, then push and fetch rows per\n"
          "                      transport; with --spawn pushes go to a daemon without a\n"
          "                      pool (--threads 0), fetches to one whose roots were computed\n"
          "                      before the clock starts (fetches queue no work); clients\n"
          "                      default to 1, --fetch-max to 2048; no root or pool rows\n"
          "  --channel-arg K=V   a gRPC argument (integer) of the measured channels over the\n"
          "                      defaults (repeat, up to 8); the daemon's: --daemon-arg\n"
          "                      --grpc-arg --daemon-arg K=V\n"
          "  --json              rows as one JSON array of objects (the CSV header's keys)\n"
          "  --keep-freed-memory the client keeps freed memory for the next message\n"
          "                      (rpc_keep_freed_memory, as precondd does; default: glibc's\n"
          "                      own thresholds, as a worker without it has)\n"
          "  --push-shm-only     with --wire, of the push rows through a region only\n"
          "                      push-shm (no -memcpy, -grpc, -pipe): shorter A/B runs\n"
          "  --account           after each push cell through a region with one client, on\n"
          "                      stderr: the push's CPU per push by part (the client's write\n"
          "                      and the rest, push-lib: the client's other threads, the\n"
          "                      daemon's doorbell thread and its other threads) and both\n"
          "                      threads' sleeps and preemptions per push\n"
          "  --vouch             the push-shm rows open their regions with the promise and\n"
          "                      vouch for their slots (ShmRef.vouched, session 16): the\n"
          "                      daemon's fold without the spare, as push-lib has it\n"
          "  --hist              each cell's calls by latency on stderr, with how many of\n"
          "                      them the client spent mostly on the CPU\n"
          "  --clock wall|cpu    push/fetch and memcpy rates per wall second (default) or per\n"
          "                      CPU second of this process and the daemon (with --spawn; a\n"
          "                      loaded machine's waits left out; percentiles stay wall;\n"
          "                      replica rows: per CPU second of the busiest rank)\n"
          "  --help\n"
          "\n"
          "Pushes leave dirty blocks: the daemon computes their roots afterwards (with --addr,\n"
          "that work stays on the daemon; --wire with --spawn keeps it out). CSV on stdout,\n"
          "notes on stderr.\n");
}

static int parse_list(const char *s, size_t *out_sz, int *out_int, int *n) {
  *n = 0;
  while (*s) {
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || v <= 0 || v > 65536 || *n >= MAX_LIST) return -1;
    if (out_sz) out_sz[*n] = (size_t)v;
    if (out_int) out_int[*n] = (int)v;
    (*n)++;
    if (*end == ',')
      end++;
    else if (*end != '\0')
      return -1;
    s = end;
  }
  return *n > 0 ? 0 : -1;
}

/* ------------------------------------------------------------------------------------ */
/* Daemon processes (started with the one starter, support/precondd_proc.h)               */

/* Starts o->spawn with nthreads pool threads on a TCP loopback port or a unix socket in its
 * own directory; the daemon writes to this process's stderr unless log_to_file (then
 * d->log, which the snapshot rows read). extra: more options or NULL. */
static int spawn_daemon(const bench_opts *o, int unix_socket, int nthreads, int log_to_file,
                        const char *const *extra, pdproc *d) {
  memset(d, 0, sizeof *d);
  pdproc_opts po;
  pdproc_opts_default(&po);
  po.path = o->spawn;
  po.threads = nthreads;
  po.grace_period = 1;
  po.log_level = log_to_file ? NULL : "warn";
  po.inherit_stderr = !log_to_file;
  po.state_dir = log_to_file ? NULL : "";
  const char *args[24];
  int nargs = 0;
  for (int i = 0; i < o->ndaemon_args; i++) args[nargs++] = o->daemon_args[i];
  for (int i = 0; extra != NULL && extra[i] != NULL && nargs < 23; i++) args[nargs++] = extra[i];
  args[nargs] = NULL;
  po.extra = args;
  char listen[sizeof d->dir + 16];
  if (unix_socket) {
    /* The directory exists only after a first start: make it here for the socket. */
    snprintf(d->dir, sizeof d->dir, "/tmp/bench-daemon-XXXXXX");
    if (mkdtemp(d->dir) == NULL) return -1;
    d->own_dir = 1;
    snprintf(listen, sizeof listen, "unix:%s/sock", d->dir);
    po.listen = listen;
  }
  int rc = pdproc_start(d, &po);
  if (rc != 0) {
    fprintf(stderr, "bench-daemon: %s did not come up (%d)\n", o->spawn, rc);
    pdproc_destroy(d);
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Requests                                                                               */

/* Packed upper triangle of a diagonally dominant symmetric matrix (diag n, off-diagonal in
 * [-0.5, 0.5)): positive definite by Gershgorin, cheap to make at n = 4096. */
static float *dominant_packed(size_t n, uint64_t seed) {
  float *p = malloc(pc_packed_len(n) * sizeof(float));
  if (p == NULL) return NULL;
  uint64_t s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++) {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      p[k++] = i == j ? (float)n : (float)((double)(s >> 40) / (double)(1ULL << 24)) - 0.5f;
    }
  return p;
}

static int call_ok(grpc_channel *ch, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp) {
  grpc_status_code code;
  char *details = NULL;
  int rc = rpc_call(ch, method, req, desc, CALL_MS, 1, resp, &code, &details);
  if (rc != RPC_OK)
    fprintf(stderr, "bench-daemon: %s: %s: %s\n", method, rpc_status_name(code),
            details ? details : rpc_strerror(rc));
  free(details);
  return rc == RPC_OK ? 0 : -1;
}

/* Registers job with ntensors n x n tensors, block size n: block i is tensor i. Roots by
 * method with exponent p (0, 0: the daemon's defaults, Newton and 4); owner, when not NULL,
 * gets each block's daemon rank (ntensors entries). */
static int register_job_as(grpc_channel *ch, const char *job, size_t n, int ntensors,
                           Precond__V1__Method method, uint32_t p, int *owner) {
  Precond__V1__RegisterRequest req = PRECOND__V1__REGISTER_REQUEST__INIT;
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  Precond__V1__TensorSpec ts[MAX_LIST + 256];
  Precond__V1__TensorSpec *tp[MAX_LIST + 256];
  uint64_t shape[2] = {n, n};
  char names[MAX_LIST + 256][16];
  if (ntensors > MAX_LIST + 256) return -1;
  for (int i = 0; i < ntensors; i++) {
    precond__v1__tensor_spec__init(&ts[i]);
    snprintf(names[i], sizeof names[i], "w%d", i);
    ts[i].name = names[i];
    ts[i].n_shape = 2;
    ts[i].shape = shape;
    tp[i] = &ts[i];
  }
  so.block_size = (uint32_t)n;
  so.skip_limit = (uint32_t)(n > 4096 ? n : 4096);
  req.job = (char *)job;
  req.n_tensors = (size_t)ntensors;
  req.tensors = tp;
  so.method = method;
  so.root_exponent = p;
  req.shampoo = &so;
  req.worker = "bench-daemon";
  ProtobufCMessage *resp = NULL;
  int rc = call_ok(ch, RPC_METHOD_REGISTER, &req.base, &precond__v1__register_response__descriptor,
                   &resp);
  if (resp != NULL) {
    const Precond__V1__RegisterResponse *r = (const Precond__V1__RegisterResponse *)resp;
    if (r->n_blocks != (size_t)ntensors) {
      fprintf(stderr, "bench-daemon: %s: %zu blocks, expected %d\n", job, r->n_blocks, ntensors);
      rc = -1;
    }
    for (size_t i = 0; rc == 0 && owner != NULL && i < r->n_blocks; i++)
      if (r->blocks[i]->block_id < (uint32_t)ntensors)
        owner[r->blocks[i]->block_id] = r->blocks[i]->owner;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  return rc;
}

static int register_job(grpc_channel *ch, const char *job, size_t n, int ntensors) {
  return register_job_as(ch, job, n, ntensors, PRECOND__V1__METHOD__METHOD_NEWTON, 0, NULL);
}

/* One n x n statistic as a request carries it: packed fp32, or its bf16 rounding. */
typedef struct {
  size_t n;
  const void *data; /* packed upper, n(n+1)/2 values */
  size_t bytes;
  int bf16;
} payload;

/* A one-block push request whose two factors both point at the payload. */
typedef struct {
  Precond__V1__PushRequest req;
  Precond__V1__BlockStatistics bs;
  Precond__V1__BlockStatistics *bsp;
  Precond__V1__PackedMatrix l, r;
} push_msg;

static void push_init(push_msg *m, const char *job, uint32_t block, const payload *pl) {
  precond__v1__push_request__init(&m->req);
  precond__v1__block_statistics__init(&m->bs);
  precond__v1__packed_matrix__init(&m->l);
  precond__v1__packed_matrix__init(&m->r);
  m->l.n = m->r.n = (uint32_t)pl->n;
  m->l.data.data = m->r.data.data = (uint8_t *)pl->data;
  m->l.data.len = m->r.data.len = pl->bytes;
  if (pl->bf16) m->l.encoding = m->r.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  m->bs.block_id = block;
  m->bs.left = &m->l;
  m->bs.right = &m->r;
  m->bsp = &m->bs;
  m->req.job = (char *)job;
  m->req.step = 1;
  m->req.n_blocks = 1;
  m->req.blocks = &m->bsp;
}

/* --account: where a same-host push's CPU goes, per push, on stderr after each push-shm
 * and push-lib cell of one client (docs/precondd.md, "Session 12"; push-lib since session
 * 16: the worker thread, its write, and the client's other threads). A thread's use from
 * /proc: CPU nanoseconds and times it got a CPU (schedstat), its user and system ticks
 * (stat), and its voluntary and involuntary context switches (status: sleeps, e.g. a
 * futex wait, and preemptions). */
static int g_account;

/* --vouch (session 16): the push-shm rows' regions are opened with the promise
 * (rpc_shm_open_holding: each row writes a slot again only after its push's answer, the
 * ring's own rule) and their fp32 references vouched for where the payload's every value
 * is below 2^125 (looked at once), as libprecond's push-lib does: the daemon's fold
 * without the spare on the doorbell's own rows. */
static int g_vouch;

/* 1 when every value of the fp32 payload is below 2^125 (ShmRef.vouched). */
static int payload_vouched(const payload *pl) {
  const float *x = pl->data;
  uint32_t out = 0;
  for (size_t i = 0; !pl->bf16 && i < pl->bytes / sizeof(float); i++)
    out |= rpc_f32_unvouched(x[i]);
  return !pl->bf16 && !(out & 0x80000000u);
}

typedef struct {
  double ns, runs, utime, stime, sleeps, preempted;
} thread_use;

/* Adds the use of the thread whose /proc directory is task to *u. */
static void thread_use_add(const char *task, thread_use *u) {
  char file[700], line[1024];
  unsigned long long ns = 0, waited = 0, runs = 0, ut = 0, st = 0, v = 0;
  snprintf(file, sizeof file, "%s/schedstat", task);
  FILE *f = fopen(file, "r");
  if (f != NULL && fscanf(f, "%llu %llu %llu", &ns, &waited, &runs) == 3) {
    u->ns += (double)ns;
    u->runs += (double)runs;
  }
  if (f != NULL) fclose(f);
  snprintf(file, sizeof file, "%s/stat", task);
  char *p =
      (f = fopen(file, "r")) != NULL && fgets(line, sizeof line, f) ? strrchr(line, ')') : NULL;
  if (f != NULL) fclose(f);
  if (p != NULL &&
      sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) == 2) {
    u->utime += (double)ut;
    u->stime += (double)st;
  }
  snprintf(file, sizeof file, "%s/status", task);
  if ((f = fopen(file, "r")) == NULL) return;
  while (fgets(line, sizeof line, f) != NULL) {
    if (sscanf(line, "voluntary_ctxt_switches: %llu", &v) == 1) u->sleeps += (double)v;
    if (sscanf(line, "nonvoluntary_ctxt_switches: %llu", &v) == 1) u->preempted += (double)v;
  }
  fclose(f);
}

/* The calling thread's use. */
static thread_use thread_use_self(void) {
  thread_use u = {0};
  char task[64];
  snprintf(task, sizeof task, "/proc/self/task/%ld", (long)syscall(SYS_gettid));
  thread_use_add(task, &u);
  return u;
}

/* pid's threads named name (e.g. "pd-bell"), up to 16, by thread id. */
typedef struct {
  int n;
  long tid[16];
  thread_use u[16];
} thread_set;

static void thread_set_named(pid_t pid, const char *name, thread_set *t) {
  t->n = 0;
  char path[64], file[600], comm[32];
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL && t->n < 16) {
    if (e->d_name[0] == '.') continue;
    snprintf(file, sizeof file, "%s/%s/comm", path, e->d_name);
    FILE *f = fopen(file, "r");
    int ok = f != NULL && fgets(comm, sizeof comm, f) != NULL;
    if (f != NULL) fclose(f);
    comm[strcspn(comm, "\n")] = '\0';
    if (!ok || strcmp(comm, name) != 0) continue;
    snprintf(file, sizeof file, "%s/%s", path, e->d_name);
    t->tid[t->n] = atol(e->d_name);
    t->u[t->n] = (thread_use){0};
    thread_use_add(file, &t->u[t->n++]);
  }
  if (d != NULL) closedir(d);
}

/* The use between a and b of the threads present in both (an earlier cell's thread that
 * ended meanwhile, or one that started, is left out). */
static thread_use thread_set_used(const thread_set *a, const thread_set *b) {
  thread_use u = {0};
  for (int i = 0; i < b->n; i++)
    for (int j = 0; j < a->n; j++)
      if (a->tid[j] == b->tid[i]) {
        u.ns += b->u[i].ns - a->u[j].ns;
        u.runs += b->u[i].runs - a->u[j].runs;
        u.utime += b->u[i].utime - a->u[j].utime;
        u.stime += b->u[i].stime - a->u[j].stime;
        u.sleeps += b->u[i].sleeps - a->u[j].sleeps;
        u.preempted += b->u[i].preempted - a->u[j].preempted;
      }
  return u;
}

/* ------------------------------------------------------------------------------------ */
/* Client threads                                                                         */

typedef struct {
  const char *addr;
  const char *job;
  uint32_t block;
  const payload *pl; /* shared, read-only */
  int fetch;         /* 0: push, 1: fetch */
  /* Matrices through a shared-memory region (proto/rpc.h): 1, a push rung at its doorbell
   * when the daemon serves it, one at a time (each waits for its answer: rpc_shm_call);
   * 3, the same pipelined (RPC_SHM_QUEUE in flight: rpc_shm_post, its answer collected
   * later) when the daemon offers the queue; 2, a push always sent as a gRPC call; 4, as 1
   * with the bytes written into the slots by a plain memcpy (the write before session 11;
   * rpc_shm_write streams large ones); 5, through libprecond's public API (a worker's
   * path: precond_push_begin, the statistic written into the slot, precond_push_commit;
   * the client's background thread writes the region's slots and posts each push at the
   * doorbell, collecting its answer later), paced by precond_wait_queued so that no push
   * coalesces; the bytes are those the daemon answered OK (precond_counters.bytes_sent),
   * and the client's last answers are collected (precond_flush) inside the cell's time; 6,
   * as 5 with each push's answer awaited (precond_options.push_answer_wait; since session
   * 16 precond_wait_queued waits for it too: one push at a time, as 1). */
  int shm;
  precond_client *lib; /* 5: closed by run_cell once the cell's CPU time is taken */
  double until;        /* stop time */
  pthread_barrier_t *start;
  double *lat; /* latencies in ms */
  double *cpu; /* this thread's CPU time per call in ms (--hist) */
  size_t nlat, caplat;
  uint64_t bytes;
  int failed;
  /* --account (a push through a region): the daemon (its pd-bell threads are read at the
   * start and the end of the calls, while this worker's region is open), this thread's CPU
   * in the slots' write, and both threads' use over the calls. */
  pid_t daemon;
  int account; /* --account and one client: the fields below are taken */
  double write_s;
  thread_use self[2];
  double proc_s[2];   /* this process's CPU (5 and 6: the library's threads besides this) */
  thread_set bell[3]; /* [2]: 300 ms after the last push */
} worker;

/* --account: the use at a push cell's start (at = 0) or end (1) of this thread, the
 * process (push-lib) and the daemon's doorbell threads; at the end also the doorbell
 * threads 300 ms later, the region still open (a thread that napped on while no push came
 * would show there). */
static void account_mark(worker *w, int at) {
  w->self[at] = thread_use_self();
  w->proc_s[at] = cpu_s(0);
  thread_set_named(w->daemon, "pd-bell", &w->bell[at]);
  if (at == 0) return;
  struct timespec idle = {0, 300000000L};
  nanosleep(&idle, NULL);
  thread_set_named(w->daemon, "pd-bell", &w->bell[2]);
}

/* Records one call's latency and this thread's CPU time (from t0 and c0, taken before it),
 * growing the arrays as needed. Returns 0, or -1 with w->failed set on out of memory. */
static int record_call(worker *w, double t0, double c0) {
  if (w->nlat == w->caplat) {
    size_t cap = w->caplat ? 2 * w->caplat : 1024;
    double *nl = realloc(w->lat, cap * sizeof(double));
    if (nl != NULL) w->lat = nl;
    double *nc = nl != NULL ? realloc(w->cpu, cap * sizeof(double)) : NULL;
    if (nc == NULL) {
      w->failed = 1;
      return -1;
    }
    w->cpu = nc;
    w->caplat = cap;
  }
  w->cpu[w->nlat] = 1e3 * (thread_cpu_s() - c0);
  w->lat[w->nlat++] = 1e3 * (now_s() - t0);
  return 0;
}

/* The push-lib cell's client (worker 5 above): connected, its job registered (one n x n
 * block) before the clock starts. NULL on failure (said on stderr). */
static precond_client *lib_client(const worker *w) {
  precond_options o;
  precond_options_default(&o);
  o.addr = w->addr;
  o.transport = PRECOND_TRANSPORT_SHM;
  /* The daemon's default region (64 MiB, as a worker gets it) unless the block needs more:
   * its ring then holds a worker's slots in flight (session 15: at 16 parts, 3 of a 1024
   * block's fit the worker slots' three quarters and a fourth push fell back to a queue
   * entry about one push in five). */
  o.shm_bytes =
      16 * w->pl->bytes + (1 << 20) > ((size_t)64 << 20) ? 16 * w->pl->bytes + (1 << 20) : 0;
  o.connect_timeout_ms = CALL_MS;
  o.push_answer_wait = w->shm == 6;
  precond_client *c = NULL;
  if (precond_connect(&o, &c) != PRECOND_OK) {
    fprintf(stderr, "bench-daemon: push-lib: cannot connect to %s\n", w->addr);
    return NULL;
  }
  char job[160];
  snprintf(job, sizeof job, "%s-lib%u", w->job, (unsigned)w->block);
  const uint64_t shape[2] = {w->pl->n, w->pl->n};
  precond_tensor t = {"w0", 2, shape};
  precond_shampoo_opts so = {.block_size = (uint32_t)w->pl->n,
                             .skip_limit = (uint32_t)(w->pl->n > 4096 ? w->pl->n : 4096)};
  precond_layout layout;
  int st = precond_register(c, job, PRECOND_MODE_SHAMPOO, "bench-daemon", 1, &t, &so, &layout);
  if (st == PRECOND_OK && layout.nblocks != 1) st = PRECOND_EPROTO;
  precond_layout_destroy(&layout);
  if (st != PRECOND_OK) {
    char e[256];
    precond_last_error(c, e, sizeof e);
    fprintf(stderr, "bench-daemon: push-lib: register: %s (%s)\n", precond_strerror(st), e);
    precond_close(c);
    return NULL;
  }
  return c;
}

/* One push of the push-lib cell: the statistic written where precond_push_begin says (as
 * a worker's kernel writes it), committed, then the wait until the background thread took
 * it. 0 or -1. */
static int lib_push(worker *w, uint64_t step) {
  float *p0 = NULL, *p1 = NULL;
  precond_push_slot *slot = NULL;
  uint32_t n = (uint32_t)w->pl->n;
  int st = precond_push_begin(w->lib, step, 0, n, n, &p0, &p1, &slot);
  if (st == PRECOND_OK) {
    /* the kernel's copy into the slot, the library's write for it (session 15: streamed
     * where the slot is in the region, as the background thread's copy was) */
    double cw = w->account ? thread_cpu_s() : 0.0;
    precond_push_copy(slot, p0, (const float *)w->pl->data, w->pl->bytes / sizeof(float));
    precond_push_copy(slot, p1, (const float *)w->pl->data, w->pl->bytes / sizeof(float));
    if (w->account) w->write_s += thread_cpu_s() - cw;
    st = precond_push_commit(w->lib, slot);
  }
  if (st == PRECOND_OK) st = precond_wait_queued(w->lib, 0, CALL_MS);
  if (st != PRECOND_OK) fprintf(stderr, "bench-daemon: push-lib: %s\n", precond_strerror(st));
  return st == PRECOND_OK ? 0 : -1;
}

/* The push-lib cell's end, inside its time: every answer collected; the bytes the daemon
 * took. 0 or -1 (a push refused or dropped). */
static int lib_finish(worker *w) {
  int st = precond_flush(w->lib, CALL_MS);
  precond_counters k;
  precond_get_counters(w->lib, &k);
  w->bytes = k.bytes_sent - w->bytes;
  if (st != PRECOND_OK || k.push_errors > 0 || k.dropped > 0 || k.coalesced > 0 ||
      (k.pushes_posted > 0) != (w->shm == 5)) {
    char e[256];
    precond_last_error(w->lib, e, sizeof e);
    fprintf(stderr,
            "bench-daemon: push-lib: flush %s, errors %llu, dropped %llu, coalesced %llu, "
            "posted %llu (%s)\n",
            precond_strerror(st), (unsigned long long)k.push_errors, (unsigned long long)k.dropped,
            (unsigned long long)k.coalesced, (unsigned long long)k.pushes_posted, e);
    return -1;
  }
  /* how many pushes the client placed in the region itself (session 15; awaited too) */
  fprintf(stderr,
          "bench-daemon: %s: %llu of %llu pushes written in the region (streamed %llu, "
          "plain %llu), %llu rung by the committing thread\n",
          w->shm == 5 ? "push-lib" : "push-lib-wait", (unsigned long long)k.region_slots,
          (unsigned long long)k.pushed, (unsigned long long)k.region_streamed,
          (unsigned long long)k.region_plain, (unsigned long long)k.pushes_direct);
  return 0;
}

static void *worker_main(void *arg) {
  worker *w = arg;
  if (w->shm >= 5) {
    w->lib = lib_client(w);
    w->failed = w->lib == NULL;
    /* Warm before the clock starts, as the other rows warm their connection: a region, its
     * ring's two places, the client's queue entries and the daemon's statistic are first
     * touched here (page faults a cell of few pushes on a loaded machine would count). */
    uint64_t step = 1;
    for (int i = 0; i < 3 && !w->failed; i++) w->failed = lib_push(w, step++) != 0;
    w->failed = w->failed || precond_flush(w->lib, CALL_MS) != PRECOND_OK;
    precond_counters k0;
    precond_get_counters(w->lib, &k0);
    w->bytes = k0.bytes_sent; /* lib_finish counts from here */
    pthread_barrier_wait(w->start);
    if (w->account) account_mark(w, 0);
    while (!w->failed && (w->nlat == 0 || now_s() < w->until)) {
      double t0 = now_s(), c0 = thread_cpu_s();
      if (lib_push(w, step++) != 0) w->failed = 1;
      if (record_call(w, t0, c0) != 0) break;
    }
    if (!w->failed && lib_finish(w) != 0) w->failed = 1;
    if (w->account) account_mark(w, 1);
    return NULL;
  }
  grpc_channel *ch = bench_channel(w->addr);
  push_msg pm;
  push_init(&pm, w->job, w->block, w->pl);
  Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
  fr.job = (char *)w->job;
  if (w->pl->bf16) fr.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  /* Shared memory: a region with room for four of this cell's messages in each half. */
  rpc_shm shm = {.fd = -1};
  Precond__V1__ShmSession sess;
  Precond__V1__ShmRef refs[2];
  if (w->shm && ch != NULL) {
    grpc_status_code code;
    char err[256];
    if (rpc_shm_open_holding(ch, NULL, CALL_MS, 16 * w->pl->bytes + (1 << 20), g_vouch, &shm, &code,
                             err, sizeof err) != RPC_OK) {
      fprintf(stderr, "bench-daemon: %s\n", err);
      w->failed = 1;
    }
    rpc_shm_session(&shm, &sess);
    pm.req.shm = &sess;
    rpc_shm_fetch_request(&shm, &sess, &fr);
  }
  /* Where a fetch's roots are copied, as a worker copies them into its own (libprecond's
   * decode): every fetch row pays that copy, whichever way the bytes came. */
  unsigned char *sink = w->fetch ? malloc(2 * w->pl->bytes) : NULL;
  if (w->fetch && sink == NULL) w->failed = 1;
  /* Warm the connection before the clock starts. */
  Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
  sr.job = (char *)w->job;
  ProtobufCMessage *resp = NULL;
  if (ch == NULL || call_ok(ch, RPC_METHOD_GET_STATS, &sr.base,
                            &precond__v1__stats_response__descriptor, &resp) != 0)
    w->failed = 1;
  if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
  pthread_barrier_wait(w->start);
  int account = w->account && w->shm && !w->fetch;
  if (account) account_mark(w, 0);
  uint64_t step = 1;
  while (!w->failed && (w->nlat == 0 || now_s() < w->until)) {
    double t0 = now_s(), c0 = thread_cpu_s();
    resp = NULL;
    if (w->fetch) {
      if (call_ok(ch, RPC_METHOD_FETCH_PRECONDITIONERS, &fr.base,
                  &precond__v1__fetch_response__descriptor, &resp) != 0) {
        w->failed = 1;
        break;
      }
      Precond__V1__FetchResponse *r = (Precond__V1__FetchResponse *)resp;
      char err[160];
      if (w->shm && rpc_shm_fetch_in(&shm, r, err, sizeof err) < 0) {
        fprintf(stderr, "bench-daemon: %s\n", err);
        w->failed = 1;
      }
      for (size_t i = 0; !w->failed && i < r->n_preconditioners; i++) {
        const Precond__V1__BlockRoots *b = r->preconditioners[i];
        const Precond__V1__PackedMatrix *side[2] = {b->left, b->right};
        size_t at = 0;
        for (int k = 0; k < 2; k++)
          if (side[k] != NULL && at + side[k]->data.len <= 2 * w->pl->bytes) {
            memcpy(sink + at, side[k]->data.data, side[k]->data.len);
            at += side[k]->data.len;
          }
        w->bytes += at;
      }
      if (w->shm && !w->failed && !rpc_shm_fetch_intact(&shm, r)) {
        fprintf(stderr, "bench-daemon: roots overwritten in the roots area during the copy\n");
        w->failed = 1;
      }
      if (w->shm) rpc_shm_fetch_done(r);
    } else {
      pm.req.step = step++;
      int piped = w->shm == 3 && shm.queue;
      if (piped) {
        /* Room for this push's two slots, its request (a few hundred bytes) and its answer's
         * room (RPC_SHM_BELL_REPLY), collecting the oldest answers while RPC_SHM_QUEUE are in
         * flight. */
        grpc_status_code code;
        char *details = NULL;
        uint64_t slot = (w->pl->bytes + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
        int rc = rpc_shm_begin(&shm, 2 * slot + 2048, CALL_MS, &code, &details);
        if (rc != RPC_OK)
          fprintf(stderr, "bench-daemon: PushStatistics (doorbell, pipelined): %s: %s\n",
                  rpc_status_name(code), details ? details : rpc_strerror(rc));
        free(details);
        if (rc != RPC_OK) {
          w->failed = 1;
          break;
        }
      }
      if (w->shm) {
        /* Each push writes its two factors into the region's slots (libprecond's write,
         * rpc_shm_write, where a worker's kernel writes the statistic; 4: a plain memcpy);
         * the messages carry the references only. */
        pm.l.data.data = pm.r.data.data = (uint8_t *)w->pl->data;
        pm.l.data.len = pm.r.data.len = w->pl->bytes;
        pm.l.shm = pm.r.shm = NULL;
        int put = 1, vouched = g_vouch && payload_vouched(w->pl);
        double cw = account ? thread_cpu_s() : 0.0;
        for (int f = 0; f < 2 && put; f++) {
          Precond__V1__PackedMatrix *m = f ? &pm.r : &pm.l;
          if (w->shm != 4) {
            put = rpc_shm_put(&shm, m, &refs[f]) > 0;
          } else {
            unsigned char *at = rpc_shm_slot(&shm, m, w->pl->bytes, &refs[f]);
            if (at != NULL) memcpy(at, w->pl->data, w->pl->bytes);
            put = at != NULL;
          }
          refs[f].vouched = vouched;
        }
        if (account) w->write_s += thread_cpu_s() - cw;
        if (!put) {
          fprintf(stderr, "bench-daemon: a factor does not fit the region\n");
          w->failed = 1;
          break;
        }
      }
      int bad;
      if (piped) {
        grpc_status_code code;
        char *details = NULL;
        int rc = rpc_shm_post(&shm, &pm.req.base, CALL_MS, &code, &details);
        if (rc != RPC_OK)
          fprintf(stderr, "bench-daemon: PushStatistics (doorbell, pipelined): %s: %s\n",
                  rpc_status_name(code), details ? details : rpc_strerror(rc));
        free(details);
        bad = rc != RPC_OK;
      } else if ((w->shm == 1 || w->shm == 3 || w->shm == 4) && shm.bell) {
        grpc_status_code code;
        char *details = NULL;
        int rc = rpc_shm_call(&shm, &pm.req.base, &precond__v1__push_response__descriptor, CALL_MS,
                              &resp, &code, &details);
        if (rc != RPC_OK)
          fprintf(stderr, "bench-daemon: PushStatistics (doorbell): %s: %s\n",
                  rpc_status_name(code), details ? details : rpc_strerror(rc));
        free(details);
        bad = rc != RPC_OK;
      } else {
        bad = call_ok(ch, RPC_METHOD_PUSH_STATISTICS, &pm.req.base,
                      &precond__v1__push_response__descriptor, &resp) != 0;
      }
      if (bad) {
        w->failed = 1;
        break;
      }
      /* Answered: the daemon read the slots, the next push reuses them (libprecond too);
       * pipelined, rpc_shm_begin places the next push clear of those in flight. */
      if (w->shm && !piped) rpc_shm_rewind(&shm);
      w->bytes += 2 * w->pl->bytes;
    }
    if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
    if (record_call(w, t0, c0) != 0) break;
  }
  /* The pipelined pushes still in flight are collected inside the cell's time: every byte
   * counted was folded and answered OK. */
  while (shm.npend > 0) {
    grpc_status_code code;
    char *details = NULL;
    resp = NULL;
    int rc = rpc_shm_collect(&shm, &precond__v1__push_response__descriptor, CALL_MS, &resp, &code,
                             &details);
    if (rc != RPC_OK) {
      fprintf(stderr, "bench-daemon: PushStatistics (doorbell, pipelined): %s: %s\n",
              rpc_status_name(code), details ? details : rpc_strerror(rc));
      w->failed = 1;
    }
    free(details);
    if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
    if (rc == RPC_ECALL) break;
  }
  if (account) account_mark(w, 1);
  /* The mode rpc_shm_put took for the large slots, and why (rpc.h, rpc_shm_mode). */
  const rpc_shm_mode *md = &shm.wmode;
  if ((w->shm == 1 || w->shm == 3) && md->count[0] + md->count[1] > 0)
    fprintf(stderr,
            "bench-daemon: push-shm%s: large writes streamed %llu, plain %llu; ns per byte "
            "streamed %.3f + %.3f, plain %.3f + %.3f (write + daemon)\n",
            w->shm == 3 ? "-pipe" : "", (unsigned long long)md->count[RPC_SHM_STREAMED],
            (unsigned long long)md->count[RPC_SHM_PLAIN], md->write[RPC_SHM_STREAMED],
            md->read[RPC_SHM_STREAMED], md->write[RPC_SHM_PLAIN], md->read[RPC_SHM_PLAIN]);
  rpc_shm_close(&shm);
  rpc_channel_destroy(ch);
  free(sink);
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double percentile(const double *sorted, size_t n, double q) {
  if (n == 0) return 0.0;
  size_t i = (size_t)(q * (double)(n - 1) + 0.5);
  return sorted[i < n ? i : n - 1];
}

/* Single-threaded memcpy MB/s of bytes (the best of five rounds of about 40 ms); pct (NULL:
 * not wanted) gets the p50/p90/p99 of one copy in ms. */
static int g_cpu_clock; /* --clock cpu */

static double memcpy_mb_s(size_t bytes, double pct[3]) {
  enum { MAXLAT = 1 << 16 };
  unsigned char *a = malloc(bytes), *b = malloc(bytes);
  double *lat = malloc(MAXLAT * sizeof(double));
  if (a == NULL || b == NULL || lat == NULL) {
    free(a);
    free(b);
    free(lat);
    return 0.0;
  }
  memset(a, 1, bytes);
  memset(b, 0, bytes);
  /* Five rounds of about 40 ms; the best round's rate is the limit (on a shared machine
   * the others measure the neighbours too). */
  size_t reps = 0;
  double mbs = 0.0, t = now_s();
  for (int round = 0; round < 5; round++) {
    size_t r0 = reps;
    double t0 = t, cpu0 = thread_cpu_s();
    do {
      double c0 = t;
      memcpy(b, a, bytes);
      a[reps % bytes] = b[(reps * 7) % bytes]; /* keep the copies observable */
      t = now_s();
      if (reps < MAXLAT) lat[reps] = 1e3 * (t - c0);
      reps++;
    } while (t - t0 < 0.04 || reps - r0 < 3);
    double secs = g_cpu_clock ? thread_cpu_s() - cpu0 : t - t0;
    double rate = secs > 0 ? (double)bytes * (double)(reps - r0) / secs / 1e6 : 0.0;
    if (rate > mbs) mbs = rate;
  }
  if (pct != NULL) {
    size_t m = reps < MAXLAT ? reps : MAXLAT;
    qsort(lat, m, sizeof(double), cmp_double);
    pct[0] = percentile(lat, m, 0.5);
    pct[1] = percentile(lat, m, 0.9);
    pct[2] = percentile(lat, m, 0.99);
  }
  free(a);
  free(b);
  free(lat);
  return mbs;
}

static int g_json, g_rows; /* --json: rows as objects of one array; rows printed so far */

/* One row, CSV or (--json) an object with the CSV header's keys. payload_bytes: bytes of
 * statistics or roots one operation carries (0 where rows count no bytes). */
static void print_row(const char *bench, const char *transport, size_t n, int clients, uint64_t ops,
                      double secs, double mbs, double ops_s, const double *p, const char *baseline,
                      double base_value, size_t payload_bytes) {
  double ratio =
      base_value > 0 ? (strcmp(baseline, "memcpy") == 0 ? mbs : ops_s) / base_value : 0.0;
  if (g_json)
    printf(
        "%s{\"bench\":\"%s\",\"transport\":\"%s\",\"block\":%zu,\"clients\":%d,"
        "\"ops\":%llu,\"seconds\":%.3f,\"mb_per_s\":%.1f,\"ops_per_s\":%.1f,"
        "\"p50_ms\":%.3f,\"p90_ms\":%.3f,\"p99_ms\":%.3f,\"baseline\":\"%s\","
        "\"baseline_value\":%.1f,\"ratio\":%.4f,\"payload_bytes\":%zu}",
        g_rows ? ",\n" : "", bench, transport, n, clients, (unsigned long long)ops, secs, mbs,
        ops_s, p[0], p[1], p[2], baseline, base_value, ratio, payload_bytes);
  else
    printf("%s,%s,%zu,%d,%llu,%.3f,%.1f,%.1f,%.3f,%.3f,%.3f,%s,%.1f,%.4f,%zu\n", bench, transport,
           n, clients, (unsigned long long)ops, secs, mbs, ops_s, p[0], p[1], p[2], baseline,
           base_value, ratio, payload_bytes);
  g_rows++;
  fflush(stdout);
}

/* The account line of a one-client cell: per push, microseconds of CPU and counts. */
static void print_account(const char *name, size_t n, const worker *w, double daemon_s) {
  double pushes = w->nlat > 0 ? (double)w->nlat : 1.0, tick = (double)sysconf(_SC_CLK_TCK);
  const thread_use *c = w->self, b = thread_set_used(&w->bell[0], &w->bell[1]);
  double cl = (c[1].ns - c[0].ns) * 1e-9, bl = b.ns * 1e-9;
  double cu = c[1].utime - c[0].utime, cs = c[1].stime - c[0].stime;
  double bu = b.utime, bs = b.stime;
  thread_use idle = thread_set_used(&w->bell[1], &w->bell[2]);
  /* push-lib: the client's other threads (libprecond's background thread, gRPC's) from the
   * process's CPU (clock ticks) less this thread's */
  double others = w->shm >= 5 ? w->proc_s[1] - w->proc_s[0] - cl : 0.0;
  fprintf(stderr,
          "account %s n=%zu pushes=%zu: per push, us of CPU: client %.1f (write %.1f, the rest "
          "%.1f; system %.0f%%), client's other threads %.1f, bell thread %.1f (system %.0f%%), "
          "daemon's other threads %.1f; "
          "client sleeps %.2f preempted %.2f, bell sleeps %.2f preempted %.2f (ticks %.0f/s); "
          "idle 300 ms after: bell thread %.1f us of CPU, %.0f sleeps\n",
          name, n, w->nlat, 1e6 * cl / pushes, 1e6 * w->write_s / pushes,
          1e6 * (cl - w->write_s) / pushes, cu + cs > 0 ? 100 * cs / (cu + cs) : 0.0,
          1e6 * others / pushes, 1e6 * bl / pushes, bu + bs > 0 ? 100 * bs / (bu + bs) : 0.0,
          1e6 * (daemon_s - bl) / pushes, (c[1].sleeps - c[0].sleeps) / pushes,
          (c[1].preempted - c[0].preempted) / pushes, b.sleeps / pushes, b.preempted / pushes, tick,
          1e-3 * idle.ns, idle.sleeps);
}

/* --hist: a cell's calls by wall-clock latency (buckets doubling from 0.05 ms) on stderr,
 * with how many of each bucket the calling thread spent on the CPU for at least half their
 * time: a slow call that did not run was waiting (for the daemon, a wake-up, or the
 * neighbours on a shared machine), a slow call that ran was working. */
static int g_hist;

static void print_hist(const char *name, const char *transport, size_t n, const worker *w, int k) {
  enum { NB = 12 };
  size_t calls[NB] = {0}, busy[NB] = {0};
  double cpu_sum[NB] = {0};
  for (int i = 0; i < k; i++)
    for (size_t j = 0; j < w[i].nlat; j++) {
      int b = 0;
      for (double edge = 0.05; b < NB - 1 && w[i].lat[j] >= edge; edge *= 2) b++;
      calls[b]++;
      busy[b] += w[i].cpu[j] >= 0.5 * w[i].lat[j];
      cpu_sum[b] += w[i].cpu[j];
    }
  fprintf(stderr, "hist %s %s n=%zu: ms_below,calls,mostly_on_cpu,mean_client_cpu_ms\n", name,
          transport, n);
  double edge = 0.05;
  for (int b = 0; b < NB; b++, edge *= 2)
    if (calls[b] > 0)
      fprintf(stderr, "  %s%.2f,%zu,%zu,%.3f\n", b == NB - 1 ? ">" : "",
              b == NB - 1 ? edge / 2 : edge, calls[b], busy[b], cpu_sum[b] / (double)calls[b]);
}

/* The memcpy-xcore reference row (--wire): the bare hand-off of a push's bytes from one core
 * to another, with no validation and no call: a writer thread copies them into a shared
 * buffer (as a worker writes its slot), then a reader thread copies them out (as the daemon
 * reads the slot), turn by turn (a condition variable, futex hand-offs as the doorbell's),
 * each rate in bytes per second of the two threads' CPU time (--clock cpu) or of the wall
 * clock. Issue 13's target stays the ratio to the one-core memcpy row; this row says how
 * much of that a same-host push could reach at most here (docs/precondd.md, "Wire"). */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  unsigned char *src, *shared, *dst;
  size_t bytes, rounds;
  int turn; /* 0: the writer's, 1: the reader's */
  double cpu[2];
} xcore;

static void *xcore_side(xcore *x, int me) {
  double c0 = thread_cpu_s();
  for (size_t r = 0; r < x->rounds; r++) {
    pthread_mutex_lock(&x->mu);
    while (x->turn != me) pthread_cond_wait(&x->cv, &x->mu);
    pthread_mutex_unlock(&x->mu);
    if (me == 0) {
      memcpy(x->shared, x->src, x->bytes);
      x->src[r % x->bytes]++; /* keep the copies observable */
    } else {
      memcpy(x->dst, x->shared, x->bytes);
    }
    pthread_mutex_lock(&x->mu);
    x->turn = !me;
    pthread_cond_signal(&x->cv);
    pthread_mutex_unlock(&x->mu);
  }
  x->cpu[me] = thread_cpu_s() - c0;
  return NULL;
}

static void *xcore_reader(void *arg) {
  return xcore_side(arg, 1);
}

/* Best of five rounds of about 40 ms, as memcpy_mb_s; 0 if threads cannot be had. */
static double xcore_mb_s(size_t bytes) {
  xcore x = {.bytes = bytes};
  x.src = malloc(bytes);
  x.shared = malloc(bytes);
  x.dst = malloc(bytes);
  double best = 0.0;
  if (x.src && x.shared && x.dst && pthread_mutex_init(&x.mu, NULL) == 0) {
    if (pthread_cond_init(&x.cv, NULL) == 0) {
      memset(x.src, 1, bytes);
      memset(x.shared, 0, bytes);
      memset(x.dst, 0, bytes);
      /* Rounds per 40 ms from a one-core copy's speed: a hand-off is at most that fast. */
      x.rounds = (size_t)(0.04 * memcpy_mb_s(bytes, NULL) * 1e6 / (double)bytes / 2) + 3;
      for (int round = 0; round < 5; round++) {
        pthread_t t;
        x.turn = 0;
        double t0 = now_s();
        if (pthread_create(&t, NULL, xcore_reader, &x) != 0) break;
        xcore_side(&x, 0);
        pthread_join(t, NULL);
        double secs = g_cpu_clock ? x.cpu[0] + x.cpu[1] : now_s() - t0;
        double rate = secs > 0 ? (double)bytes * (double)x.rounds / secs / 1e6 : 0.0;
        if (rate > best) best = rate;
      }
      pthread_cond_destroy(&x.cv);
    }
    pthread_mutex_destroy(&x.mu);
  }
  free(x.src);
  free(x.shared);
  free(x.dst);
  return best;
}

/* One push or fetch cell: k clients for o->seconds. */
static int run_cell(const bench_opts *o, const char *addr, pid_t daemon, const char *transport,
                    int fetch, int shm, const char *job, int k, const payload *pl,
                    double memcpy_rate) {
  worker *w = calloc((size_t)k, sizeof(*w));
  pthread_t *th = calloc((size_t)k, sizeof(*th));
  pthread_barrier_t start;
  int rc = -1, started = 0;
  if (w == NULL || th == NULL || pthread_barrier_init(&start, NULL, (unsigned)k + 1) != 0) {
    free(w);
    free(th);
    return -1;
  }
  for (int i = 0; i < k; i++) {
    w[i] = (worker){.addr = addr,
                    .job = job,
                    .block = fetch ? 0 : (uint32_t)i,
                    .pl = pl,
                    .fetch = fetch,
                    .shm = shm,
                    .start = &start,
                    .daemon = k == 1 ? daemon : 0,
                    .account = g_account && k == 1 && daemon > 0};
    if (pthread_create(&th[i], NULL, worker_main, &w[i]) != 0) break;
    started++;
  }
  if (started < k) {
    /* Can't release a barrier sized for k + 1 with fewer parties: give up loudly. */
    fprintf(stderr, "bench-daemon: could not start %d threads\n", k);
    exit(1);
  }
  /* --wire: the memcpy limit again right before the cell, so that the ratio compares two
   * figures taken under the same load of a shared machine. */
  if (o->wire) memcpy_rate = memcpy_mb_s(2 * pl->bytes, NULL);
  double t0 = now_s();
  for (int i = 0; i < k; i++) w[i].until = t0 + o->seconds;
  pthread_barrier_wait(&start);
  t0 = now_s();
  double d0 = daemon > 0 ? cpu_s(daemon) : 0.0, c0 = cpu_s(0) + d0;
  for (int i = 0; i < k; i++) pthread_join(th[i], NULL);
  double secs = now_s() - t0;
  /* --clock cpu: this process's and the daemon's CPU time instead of the wall clock, so a
   * loaded machine's waits do not count (the latency percentiles stay wall-clock). */
  if (o->cpu_clock) secs = cpu_s(0) + (daemon > 0 ? cpu_s(daemon) : 0.0) - c0;
  pthread_barrier_destroy(&start);
  for (int i = 0; i < k; i++) precond_close(w[i].lib);

  size_t total = 0;
  uint64_t bytes = 0;
  int failed = 0;
  for (int i = 0; i < k; i++) {
    total += w[i].nlat;
    bytes += w[i].bytes;
    failed |= w[i].failed;
  }
  double *all = malloc((total ? total : 1) * sizeof(double));
  if (all != NULL && !failed) {
    size_t m = 0;
    for (int i = 0; i < k; i++) {
      memcpy(all + m, w[i].lat, w[i].nlat * sizeof(double));
      m += w[i].nlat;
    }
    char name[32];
    snprintf(name, sizeof name, "%s%s%s", fetch ? "fetch" : "push", pl->bf16 ? "-bf16" : "",
             shm == 2   ? "-shm-grpc"
             : shm == 3 ? "-shm-pipe"
             : shm == 4 ? "-shm-memcpy"
             : shm == 5 ? "-lib"
             : shm == 6 ? "-lib-wait"
             : shm      ? "-shm"
                        : "");
    if (g_hist) print_hist(name, transport, pl->n, w, k);
    if (w[0].account && shm && !fetch) print_account(name, pl->n, &w[0], cpu_s(daemon) - d0);
    qsort(all, total, sizeof(double), cmp_double);
    double p[3] = {percentile(all, total, 0.5), percentile(all, total, 0.9),
                   percentile(all, total, 0.99)};
    print_row(name, transport, pl->n, k, total, secs, (double)bytes / secs / 1e6,
              (double)total / secs, p, "memcpy", memcpy_rate, 2 * pl->bytes);
    rc = 0;
  }
  free(all);
  for (int i = 0; i < k; i++) {
    free(w[i].lat);
    free(w[i].cpu);
  }
  free(w);
  free(th);
  return rc;
}

/* What one client knows of a job's roots on one daemon: the versions (0: none yet) and
 * their source steps, kept from poll to poll (so a fetch brings each root once, as a
 * worker's libprecond does), by fetches or (by_stats) by GetStats, which moves no root. */
typedef struct {
  grpc_channel *ch;
  int by_stats;
  const int *owner; /* with rank: own_ms is when the blocks this rank owns were seen done */
  int rank;
  double own_ms;
  uint64_t polls; /* calls made */
  uint64_t ver[256], src[256];
} roots_view;

/* The versions and source steps of job's blocks by GetStats, into v: what the daemon
 * holds, without the roots themselves. 0 or -1. */
static int stats_roots(roots_view *v, const char *job, size_t nblocks) {
  Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
  sr.job = (char *)job;
  sr.blocks = 1;
  ProtobufCMessage *resp = NULL;
  if (call_ok(v->ch, RPC_METHOD_GET_STATS, &sr.base, &precond__v1__stats_response__descriptor,
              &resp) != 0)
    return -1;
  const Precond__V1__StatsResponse *r = (const Precond__V1__StatsResponse *)resp;
  for (size_t i = 0; i < r->n_block_stats; i++) {
    const Precond__V1__BlockStats *b = r->block_stats[i];
    if (b->block_id < nblocks) {
      v->ver[b->block_id] = b->version;
      v->src[b->block_id] = b->root_step;
    }
  }
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

/* One fetch of job's first nblocks blocks (bf16: only the versions matter here) past the
 * versions v holds, which it updates. 0 or -1. */
static int fetch_roots(roots_view *v, const char *job, size_t nblocks) {
  Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
  Precond__V1__BlockVersion bv[256], *bvp[256];
  fr.job = (char *)job;
  fr.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  for (size_t i = 0; i < nblocks; i++) {
    precond__v1__block_version__init(&bv[i]);
    bv[i].block_id = (uint32_t)i;
    bv[i].version = v->ver[i];
    bvp[fr.n_have++] = &bv[i];
  }
  fr.have = bvp;
  ProtobufCMessage *resp = NULL;
  if (call_ok(v->ch, RPC_METHOD_FETCH_PRECONDITIONERS, &fr.base,
              &precond__v1__fetch_response__descriptor, &resp) != 0)
    return -1;
  const Precond__V1__FetchResponse *r = (const Precond__V1__FetchResponse *)resp;
  for (size_t i = 0; i < r->n_preconditioners; i++) {
    const Precond__V1__BlockRoots *b = r->preconditioners[i];
    if (b->block_id < nblocks) {
      v->ver[b->block_id] = b->version;
      v->src[b->block_id] = b->source_step;
    }
  }
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

/* How many of job's first nblocks blocks hold roots of step or later on v's daemon (by
 * GetStats or a fetch, as v says), or -1. */
static int poll_roots(roots_view *v, const char *job, size_t nblocks, uint64_t step) {
  if (nblocks > 256) return -1;
  v->polls++;
  if ((v->by_stats ? stats_roots(v, job, nblocks) : fetch_roots(v, job, nblocks)) != 0) return -1;
  int done = 0;
  for (size_t i = 0; i < nblocks; i++) done += v->src[i] >= step && v->ver[i] > 0;
  return done;
}

/* Waits until each of the nv daemons of v holds roots of step (or later) for the first
 * nblocks blocks of job, polling every one not done yet in turn every 5 ms (so each is
 * polled alike), the first time quiet_s after t0 (0: at once); done_ms[c] (may be NULL): when
 * daemon c was seen done, ms after t0. 0, or -1 (message on stderr) after timeout_s. */
static int wait_roots_all(roots_view *v, int nv, const char *job, size_t nblocks, uint64_t step,
                          double timeout_s, double t0, double quiet_s, double *done_ms) {
  enum { MAXCH = 64 };
  int done[MAXCH] = {0}, left = nv;
  if (nv > MAXCH || nblocks > 256) return -1;
  for (int c = 0; c < nv; c++) v[c].own_ms = -1;
  double until = now_s() + timeout_s, first = t0 + quiet_s - now_s();
  if (first > 0) {
    struct timespec t = {(time_t)first, (long)((first - (double)(time_t)first) * 1e9)};
    nanosleep(&t, NULL);
  }
  while (left > 0 && now_s() < until) {
    for (int c = 0; c < nv; c++) {
      if (done[c]) continue;
      int n = poll_roots(&v[c], job, nblocks, step);
      if (n < 0) return -1;
      int own = v[c].owner != NULL && v[c].own_ms < 0;
      for (size_t i = 0; own && i < nblocks; i++)
        own = v[c].owner[i] != v[c].rank || (v[c].src[i] >= step && v[c].ver[i] > 0);
      if (own) v[c].own_ms = 1e3 * (now_s() - t0);
      if ((size_t)n == nblocks) {
        done[c] = 1;
        left--;
        if (done_ms != NULL) done_ms[c] = 1e3 * (now_s() - t0);
      }
    }
    if (left == 0) return 0;
    struct timespec t = {0, 5000000};
    nanosleep(&t, NULL);
  }
  if (left == 0) return 0;
  fprintf(stderr, "bench-daemon: %s: roots not ready within %.0f s\n", job, timeout_s);
  return -1;
}

/* Waits until the daemon has a root of every block of job computed from step or later. */
static int wait_roots(grpc_channel *ch, const char *job, size_t nblocks, uint64_t step,
                      double timeout_s) {
  roots_view v = {.ch = ch};
  return wait_roots_all(&v, 1, job, nblocks, step, timeout_s, now_s(), 0, NULL);
}

/* A block's two packed statistics: left = G1 G1^T with G1 n x k, right = G2^T G2 with G2
 * k x n, G1 and G2 Gaussian-ish (sums of 4 uniforms; g: k n floats of scratch). k = n gives
 * the conditioning of one square gradient's Gram matrix; k = 4n that of a sum over four
 * steps, well enough conditioned for its bf16 rounding to stay positive definite. New ones
 * from every seed *s (which advances). */
static void random_gram(size_t n, size_t k, uint64_t *s, float *g, float *left, float *right) {
  for (int f = 0; f < 2; f++) {
    for (size_t i = 0; i < n * k; i++) {
      double acc = 0;
      for (int d = 0; d < 4; d++) {
        *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
        acc += (double)(*s >> 40) / (double)(1ULL << 24) - 0.5;
      }
      g[i] = (float)acc;
    }
    if (f == 0)
      pc_gram_f32(n, k, g, k, left, NULL);
    else
      pc_gram_f32(k, n, g, n, NULL, right);
  }
}

/* Pushes the statistics of blocks 0..B-1 of job (packed n x n, block b's at lp/rp + b len)
 * at step in one request; with owner, only the blocks of rank `only`; with shm, each
 * matrix copied into the region (as a same-host worker's libprecond sends them) and the
 * request carrying references. 0 or -1. */
static int push_some(grpc_channel *ch, rpc_shm *shm, const char *job, size_t n, int B,
                     const float *lp, const float *rp, uint64_t step, const int *owner, int only) {
  size_t len = pc_packed_len(n);
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  Precond__V1__BlockStatistics *bs = calloc((size_t)B, sizeof(*bs));
  Precond__V1__BlockStatistics **bsp = calloc((size_t)B, sizeof(*bsp));
  Precond__V1__PackedMatrix *pm = calloc(2 * (size_t)B, sizeof(*pm));
  Precond__V1__ShmRef *refs = calloc(2 * (size_t)B, sizeof(*refs));
  Precond__V1__ShmSession sess;
  int rc = -1;
  size_t nb = 0;
  if (bs != NULL && bsp != NULL && pm != NULL && refs != NULL) {
    for (int b = 0; b < B; b++) {
      if (owner != NULL && owner[b] != only) continue;
      precond__v1__block_statistics__init(&bs[b]);
      precond__v1__packed_matrix__init(&pm[2 * b]);
      precond__v1__packed_matrix__init(&pm[2 * b + 1]);
      pm[2 * b].n = pm[2 * b + 1].n = (uint32_t)n;
      pm[2 * b].data.data = (uint8_t *)(uintptr_t)(lp + (size_t)b * len);
      pm[2 * b + 1].data.data = (uint8_t *)(uintptr_t)(rp + (size_t)b * len);
      pm[2 * b].data.len = pm[2 * b + 1].data.len = len * sizeof(float);
      bs[b].block_id = (uint32_t)b;
      bs[b].left = &pm[2 * b];
      bs[b].right = &pm[2 * b + 1];
      bsp[nb++] = &bs[b];
      if (shm != NULL) {
        rpc_shm_put(shm, &pm[2 * b], &refs[2 * b]);
        rpc_shm_put(shm, &pm[2 * b + 1], &refs[2 * b + 1]);
      }
    }
    if (shm != NULL) {
      rpc_shm_session(shm, &sess);
      req.shm = &sess;
    }
    req.job = (char *)job;
    req.step = step;
    req.n_blocks = nb;
    req.blocks = bsp;
    ProtobufCMessage *resp = NULL;
    rc = call_ok(ch, RPC_METHOD_PUSH_STATISTICS, &req.base, &precond__v1__push_response__descriptor,
                 &resp);
    if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
  }
  free(bs);
  free(bsp);
  free(pm);
  free(refs);
  return rc;
}

static int push_all(grpc_channel *ch, const char *job, size_t n, int B, const float *lp,
                    const float *rp, uint64_t step) {
  return push_some(ch, NULL, job, n, B, lp, rp, step, NULL, 0);
}

/* Pool rows: the daemon's roots/s on B blocks of 256 against one thread here. */
static int run_pool(const bench_opts *o, const char *addr, const char *transport) {
  const size_t n = 256;
  int B = o->pool_blocks;
  size_t len = pc_packed_len(n);
  float *g = malloc(n * n * sizeof(float));
  float *lp = malloc((size_t)B * len * sizeof(float)),
        *rp = malloc((size_t)B * len * sizeof(float));
  float *dense = malloc(n * n * sizeof(float)), *x = malloc(n * n * sizeof(float));
  grpc_channel *ch = NULL;
  int rc = -1;
  if (g == NULL || lp == NULL || rp == NULL || dense == NULL || x == NULL) goto cleanup;
  uint64_t s = 12345;
  for (int b = 0; b < B; b++) random_gram(n, n, &s, g, lp + (size_t)b * len, rp + (size_t)b * len);

  /* One thread in this process: both roots of every block. */
  openblas_set_num_threads(1);
  pc_root_opts ro;
  pc_root_opts_default(&ro, 4);
  double t0 = now_s();
  for (int b = 0; b < B; b++) {
    pc_unpack_f32(n, lp + (size_t)b * len, dense);
    if (pc_inverse_root_f32(n, dense, x, &ro, NULL) < 0)
      fprintf(stderr, "bench-daemon: local root failed\n");
    pc_unpack_f32(n, rp + (size_t)b * len, dense);
    if (pc_inverse_root_f32(n, dense, x, &ro, NULL) < 0)
      fprintf(stderr, "bench-daemon: local root failed\n");
  }
  double local_s = now_s() - t0;
  double local_rate = (double)B / local_s;

  /* The daemon: one push of all B blocks, then until every block has its root. */
  ch = rpc_channel_create(addr, 0);
  char job[64];
  snprintf(job, sizeof job, "bench-pool-%d-%s", (int)getpid(), transport);
  if (ch == NULL || register_job(ch, job, n, B) != 0) goto cleanup;
  int pool_threads = 0; /* as the daemon reports it */
  {
    Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
    ProtobufCMessage *st = NULL;
    if (call_ok(ch, RPC_METHOD_GET_STATS, &sr.base, &precond__v1__stats_response__descriptor,
                &st) != 0)
      goto cleanup;
    pool_threads = (int)((const Precond__V1__StatsResponse *)st)->threads;
    protobuf_c_message_free_unpacked(st, NULL);
  }
  t0 = now_s();
  if (push_all(ch, job, n, B, lp, rp, 1) != 0 || wait_roots(ch, job, (size_t)B, 1, 600.0) != 0)
    goto cleanup;
  double daemon_s = now_s() - t0;
  double zero[3] = {0, 0, 0};
  print_row("pool", transport, n, pool_threads, (uint64_t)B, daemon_s, 0.0, (double)B / daemon_s,
            zero, "single_thread", local_rate, 0);
  rc = 0;

cleanup:
  if (ch != NULL) rpc_channel_destroy(ch);
  free(g);
  free(lp);
  free(rp);
  free(dense);
  free(x);
  return rc;
}

/* Blocks waiting for or in a root computation, as the daemon reports them. */
static int queue_depth(grpc_channel *ch, uint64_t *depth) {
  Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
  ProtobufCMessage *resp = NULL;
  if (call_ok(ch, RPC_METHOD_GET_STATS, &sr.base, &precond__v1__stats_response__descriptor,
              &resp) != 0)
    return -1;
  *depth = ((const Precond__V1__StatsResponse *)resp)->queue_depth;
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

/* The newest roots of block 0 of job newer than *version: updates *version and *source
 * (both untouched when nothing newer came). */
static int fetch_newer(grpc_channel *ch, const char *job, int bf16, uint64_t *version,
                       uint64_t *source) {
  Precond__V1__BlockVersion bv = PRECOND__V1__BLOCK_VERSION__INIT;
  Precond__V1__BlockVersion *bvp = &bv;
  Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
  bv.version = *version;
  fr.job = (char *)job;
  fr.n_have = 1;
  fr.have = &bvp;
  if (bf16) fr.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  ProtobufCMessage *resp = NULL;
  if (call_ok(ch, RPC_METHOD_FETCH_PRECONDITIONERS, &fr.base,
              &precond__v1__fetch_response__descriptor, &resp) != 0)
    return -1;
  const Precond__V1__FetchResponse *r = (const Precond__V1__FetchResponse *)resp;
  if (r->n_preconditioners > 0) {
    *version = r->preconditioners[0]->version;
    *source = r->preconditioners[0]->source_step;
  }
  protobuf_c_message_free_unpacked(resp, NULL);
  return 0;
}

/* Root rows: the time from a push of one block's statistics to the first fetch that returns
 * roots computed from them, o->reps times, each once the daemon's queue is empty (the cells
 * before leave dirty blocks) and with new Gram statistics (the same ones again would pass the
 * daemon's drift test and be skipped), against one thread computing the first two roots
 * here. bf16 as the payload says. */
static int run_root(const bench_opts *o, grpc_channel *ch, const char *transport,
                    const payload *like) {
  size_t n = like->n, len = pc_packed_len(n);
  char job[96];
  snprintf(job, sizeof job, "bench-root-%d-%s-%zu", (int)getpid(), transport, n);
  double *lat = calloc((size_t)o->reps, sizeof(double));
  float *g = malloc(4 * n * n * sizeof(float)), *x = malloc(n * n * sizeof(float));
  float *side[2] = {malloc(len * sizeof(float)), malloc(len * sizeof(float))};
  uint16_t *half[2] = {malloc(len * sizeof(uint16_t)), malloc(len * sizeof(uint16_t))};
  float *base[2] = {NULL, NULL}; /* --root-noise: the steady statistic */
  int rc = -1, done = 0;
  if (lat == NULL || g == NULL || x == NULL || side[0] == NULL || side[1] == NULL ||
      half[0] == NULL || half[1] == NULL || register_job(ch, job, n, 1) != 0)
    goto cleanup;
  openblas_set_num_threads(1);
  pc_root_opts ro;
  pc_root_opts_default(&ro, 4);
  uint64_t seed = 777, version = 0, source = 0;
  double local_s = 0;
  if (o->root_noise > 0) {
    base[0] = malloc(len * sizeof(float));
    base[1] = malloc(len * sizeof(float));
    if (base[0] == NULL || base[1] == NULL) goto cleanup;
    random_gram(n, 4 * n, &seed, g, base[0], base[1]);
  }
  for (; done < o->reps; done++) {
    random_gram(n, 4 * n, &seed, g, side[0], side[1]);
    for (int f = 0; base[0] != NULL && f < 2; f++)
      for (size_t i = 0; i < len; i++) side[f][i] = base[f][i] + (float)o->root_noise * side[f][i];
    if (done == 0) {
      double t0 = now_s();
      for (int f = 0; f < 2; f++) {
        pc_unpack_f32(n, side[f], g);
        if (pc_inverse_root_f32(n, g, x, &ro, NULL) < 0)
          fprintf(stderr, "bench-daemon: local root failed\n");
      }
      local_s = now_s() - t0;
    }
    payload pl[2];
    for (int f = 0; f < 2; f++) {
      pl[f] = (payload){n, side[f], len * sizeof(float), 0};
      if (like->bf16) {
        pc_f32_to_bf16(len, side[f], half[f]);
        pl[f] = (payload){n, half[f], len * sizeof(uint16_t), 1};
      }
    }
    push_msg pm;
    push_init(&pm, job, 0, &pl[0]);
    pm.r.data.data = (uint8_t *)pl[1].data;
    pm.req.step = (uint64_t)done + 1;
    uint64_t depth = 1;
    double until = now_s() + 600;
    while (now_s() < until && queue_depth(ch, &depth) == 0 && depth > 0) {
      struct timespec t = {0, 2 * 1000000L};
      nanosleep(&t, NULL);
    }
    if (depth > 0 || fetch_newer(ch, job, like->bf16, &version, &source) != 0) goto cleanup;
    ProtobufCMessage *resp = NULL;
    double t0 = now_s();
    if (call_ok(ch, RPC_METHOD_PUSH_STATISTICS, &pm.req.base,
                &precond__v1__push_response__descriptor, &resp) != 0)
      goto cleanup;
    protobuf_c_message_free_unpacked(resp, NULL);
    while (source < pm.req.step && now_s() - t0 < 600) {
      if (fetch_newer(ch, job, like->bf16, &version, &source) != 0) goto cleanup;
      if (source < pm.req.step) {
        struct timespec t = {0, 1000000L}; /* 1 ms between polls, as a worker's poller */
        nanosleep(&t, NULL);
      }
    }
    if (source < pm.req.step) {
      fprintf(stderr, "bench-daemon: %s: no root within 600 s\n", job);
      goto cleanup;
    }
    lat[done] = 1e3 * (now_s() - t0);
  }
  double sum_ms = 0;
  for (int i = 0; i < done; i++) sum_ms += lat[i];
  qsort(lat, (size_t)done, sizeof(double), cmp_double);
  double p[3] = {percentile(lat, (size_t)done, 0.5), percentile(lat, (size_t)done, 0.9),
                 percentile(lat, (size_t)done, 0.99)};
  print_row(like->bf16 ? "root-bf16" : "root", transport, n, 1, (uint64_t)done, sum_ms / 1e3, 0.0,
            1e3 * done / sum_ms, p, "single_thread", 1.0 / local_s, 0);
  rc = 0;

cleanup:
  free(lat);
  free(g);
  free(x);
  for (int f = 0; f < 2; f++) {
    free(side[f]);
    free(half[f]);
    free(base[f]);
  }
  return rc;
}

/* The seconds of the last line of the log that holds key and ends "in X s"; -1 if none. */
static double log_seconds(const char *log, const char *key) {
  char line[2048];
  double out = -1;
  FILE *f = fopen(log, "r");
  while (f != NULL && fgets(line, sizeof line, f) != NULL) {
    const char *in = strstr(line, key) != NULL ? strstr(line, " in ") : NULL;
    if (in != NULL) out = atof(in + 4);
  }
  if (f != NULL) fclose(f);
  return out;
}

/* Bytes of the regular files in dir (the snapshot and its epoch file). */
static double dir_mb(const char *dir) {
  DIR *d = opendir(dir);
  double bytes = 0;
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL) {
    char path[512];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) bytes += (double)st.st_size;
  }
  if (d != NULL) closedir(d);
  return bytes / 1048576.0;
}

/* Snapshot rows: a daemon of its own holds about o->snapshot_mb MiB of statistics (blocks of
 * 256 x 256, one push each; roots computed meanwhile are saved too), is stopped with SIGTERM
 * (the snapshot is written) and started again (it is restored); the times are the daemon's
 * own, from its log. mb_per_s is the file's size over that time. */
static int run_snapshot(const bench_opts *o) {
  const size_t n = 256;
  size_t per_block = 2 * pc_packed_len(n) * sizeof(float);
  size_t nblocks = (o->snapshot_mb << 20) / per_block + 1;
  char mem[32];
  snprintf(mem, sizeof mem, "%zu", 2 * o->snapshot_mb + 64); /* statistics and roots */
  const char *extra[] = {"--memory-limit-mb", mem, "--snapshot-interval", "0", NULL};
  pdproc d;
  if (spawn_daemon(o, 0, o->threads, 1, extra, &d) != 0) return -1;
  int rc = -1;
  float *packed = dominant_packed(n, 7);
  grpc_channel *ch = rpc_channel_create(d.addr, 0);
  if (packed == NULL || ch == NULL) goto cleanup;
  /* One tensor of 256 rows and 256 nblocks columns: nblocks blocks of 256 x 256. */
  {
    uint64_t shape[2] = {n, n * (uint64_t)nblocks};
    Precond__V1__TensorSpec t = PRECOND__V1__TENSOR_SPEC__INIT;
    Precond__V1__TensorSpec *tp = &t;
    Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
    Precond__V1__RegisterRequest rr = PRECOND__V1__REGISTER_REQUEST__INIT;
    t.name = (char *)"w";
    t.n_shape = 2;
    t.shape = shape;
    so.block_size = (uint32_t)n;
    so.skip_limit = (uint32_t)(n * nblocks);
    rr.job = (char *)"snap";
    rr.n_tensors = 1;
    rr.tensors = &tp;
    rr.shampoo = &so;
    ProtobufCMessage *resp = NULL;
    if (call_ok(ch, RPC_METHOD_REGISTER, &rr.base, &precond__v1__register_response__descriptor,
                &resp) != 0)
      goto cleanup;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  payload pl = {n, packed, pc_packed_len(n) * sizeof(float), 0};
  enum { B = 8 };
  push_msg pm[B];
  Precond__V1__BlockStatistics *bsp[B];
  for (size_t i = 0; i < nblocks; i += B) {
    size_t k = 0;
    for (; k < B && i + k < nblocks; k++) {
      push_init(&pm[k], "snap", (uint32_t)(i + k), &pl);
      bsp[k] = &pm[k].bs;
    }
    pm[0].req.n_blocks = k;
    pm[0].req.blocks = bsp;
    ProtobufCMessage *resp = NULL;
    if (call_ok(ch, RPC_METHOD_PUSH_STATISTICS, &pm[0].req.base,
                &precond__v1__push_response__descriptor, &resp) != 0)
      goto cleanup;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  rpc_channel_destroy(ch);
  ch = NULL;
  if (pdproc_stop(&d, SIGTERM) != 0) goto cleanup;
  double write_s = log_seconds(d.log, "snapshot written");
  char state[200];
  snprintf(state, sizeof state, "%s/state", d.dir);
  double file_mb = dir_mb(state);
  pdproc_opts po;
  pdproc_opts_default(&po);
  po.path = o->spawn;
  po.threads = o->threads;
  po.extra = extra;
  if (pdproc_start(&d, &po) != 0 || pdproc_stop(&d, SIGTERM) != 0) goto cleanup;
  double restore_s = log_seconds(d.log, "restored");
  double zero[3] = {0, 0, 0};
  print_row("snapshot-write", "tcp", n, o->threads, nblocks, write_s, file_mb * 1.048576 / write_s,
            (double)nblocks / write_s, zero, "none", 0.0, 0);
  print_row("snapshot-restore", "tcp", n, o->threads, nblocks, restore_s,
            file_mb * 1.048576 / restore_s, (double)nblocks / restore_s, zero, "none", 0.0, 0);
  rc = write_s > 0 && restore_s > 0 ? 0 : -1;

cleanup:
  if (ch != NULL) rpc_channel_destroy(ch);
  free(packed);
  pdproc_destroy(&d);
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Replica rows (docs/replicas.md)                                                        */

/* Starts `mpirun -np R precondd` in m (support/mpirun_proc.h; unix sockets dir/r-K.sock,
 * one pool thread per rank) and waits (60 s) for every rank's port file; 0, or -1 (then no
 * rank runs). */
static int start_ranks(const bench_opts *o, const char *dir, int R, mprun *m) {
  char sock[160], port[160];
  snprintf(sock, sizeof sock, "unix:%s/r-%%r.sock", dir);
  snprintf(port, sizeof port, "%s/p-%%r", dir);
  const char *const argv[] = {o->spawn, "--listen",    sock,   "--port-file",
                              port,     "--threads",   "1",    "--drift-threshold",
                              "0",      "--log-level", "warn", "--grace-period",
                              "1",      NULL};
  if (mprun_start(m, o->mpirun, R, argv, NULL) != 0) return -1;
  if (mprun_wait_files(m, port, 60000) == 0) return 0;
  fprintf(stderr, "bench-daemon: %d ranks did not all listen\n", R);
  mprun_stop(m, SIGKILL, 10000);
  return -1;
}

enum { REPLICA_WARMUP = 2 }; /* untimed steps before a replica row's timed ones */
#define REPLICA_QUIET 0.85   /* of the fastest step so far: not polled before */

/* One rank's share of a replica round's push (a thread per rank, as data-parallel workers
 * push at once, each to its own daemon). */
typedef struct {
  grpc_channel *ch;
  rpc_shm *shm;
  const char *job;
  size_t n;
  int B, rank, rc;
  const float *lp, *rp;
  const int *owner;
  uint64_t step;
  double ms;
} replica_push;

static void *replica_push_run(void *arg) {
  replica_push *p = arg;
  double t0 = now_s();
  p->rc = push_some(p->ch, p->shm, p->job, p->n, p->B, p->lp, p->rp, p->step, p->owner, p->rank);
  p->ms = 1e3 * (now_s() - t0);
  return NULL;
}

/* The machine's own ceiling for the replica rows (--ceiling): the same roots (B blocks of 256,
 * both factors, eigh in double with p = 2, as the daemon's pool computes them) in R plain
 * processes, each pinned to core r as mpirun pins rank r, each computing every root of a step
 * --replica-steps times, started together. No daemon, no messages, no polls: R processes'
 * roots per second against one's is what the cores themselves give (shared caches, memory
 * bandwidth, and what the hypervisor runs beside them), the fair reference beside the 1.8x
 * target. At R = 1 the same process also runs alone on core 1 (stderr), to show how far the
 * two cores differ. Each process writes its wall and CPU seconds to a pipe. */
/* The ratio of every row with R > 1 to the latest R = 1 row before it (--ranks 1,2,1,2,...:
 * each pair measured minutes apart at most, so a slow phase of the machine hits both sides),
 * summarised at the end of the rows: each pair and the median. */
typedef struct {
  double v[MAX_LIST];
  int n;
} pair_ratios;

static void pair_ratio_add(pair_ratios *pr, int R, double rate, double rate1) {
  if (R > 1 && rate1 > 0 && pr->n < MAX_LIST) pr->v[pr->n++] = rate / rate1;
}

static void pair_ratio_print(const char *what, const pair_ratios *pr) {
  if (pr->n == 0) return;
  double v[MAX_LIST];
  fprintf(stderr, "bench-daemon: %s pairs:", what);
  for (int i = 0; i < pr->n; i++) fprintf(stderr, " %.3f", v[i] = pr->v[i]);
  qsort(v, (size_t)pr->n, sizeof v[0], cmp_double);
  double med = pr->n % 2 ? v[pr->n / 2] : 0.5 * (v[pr->n / 2 - 1] + v[pr->n / 2]);
  fprintf(stderr, "; median %.3f of %d\n", med, pr->n);
}

typedef struct {
  double wall, cpu;
} ceiling_res;

static void ceiling_child(int core, int go, int res, const double *a, size_t n, int nmat,
                          int steps) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  ceiling_res out = {-1, -1};
  double *w = malloc(n * n * sizeof *w), *x = malloc(n * n * sizeof *x);
  char c;
  if (sched_setaffinity(0, sizeof set, &set) == 0 && w != NULL && x != NULL &&
      read(go, &c, 1) == 1) {
    pc_root_opts ro;
    pc_root_opts_default(&ro, 2);
    ro.method = PC_METHOD_EIGH;
    double t0 = now_s(), c0 = self_cpu_s();
    int ok = 1;
    for (int k = 0; ok && k < steps; k++)
      for (int m = 0; ok && m < nmat; m++) {
        memcpy(w, a + (size_t)m * n * n, n * n * sizeof *w); /* eigh overwrites its input */
        pc_root_info ri;
        ok = pc_inverse_root_f64(n, w, x, &ro, &ri) >= 0;
      }
    if (ok) out = (ceiling_res){now_s() - t0, self_cpu_s() - c0};
  }
  free(w);
  free(x);
  _exit(write(res, &out, sizeof out) == (ssize_t)sizeof out ? 0 : 1);
}

/* Runs one process per core of cores[0..np) at once; fills res; -1 on a failure. */
static int ceiling_round(const int *cores, int np, const double *a, size_t n, int nmat, int steps,
                         ceiling_res *res) {
  int go[2], back[2];
  if (pipe(go) != 0) return -1;
  if (pipe(back) != 0) {
    close(go[0]);
    close(go[1]);
    return -1;
  }
  int started = 0, rc = 0;
  pid_t pid[64];
  fflush(NULL);
  for (; started < np; started++) {
    pid[started] = fork();
    if (pid[started] < 0) break;
    if (pid[started] == 0) {
      close(go[1]);
      close(back[0]);
      ceiling_child(cores[started], go[0], back[1], a, n, nmat, steps);
    }
  }
  close(go[0]);
  close(back[1]);
  /* One byte per process: they start as close together as one write allows. */
  char bytes[64] = {0};
  if (started < np || write(go[1], bytes, (size_t)started) != (ssize_t)started) rc = -1;
  close(go[1]);
  for (int i = 0; i < started; i++)
    if (read(back[0], &res[i], sizeof res[i]) != (ssize_t)sizeof res[i] || res[i].wall < 0) rc = -1;
  close(back[0]);
  for (int i = 0; i < started; i++) {
    int st;
    waitpid(pid[i], &st, 0);
  }
  return rc;
}

/* One ceiling row at R (1 or more processes); *rate1 is the latest R = 1 row's rate, the
 * baseline of the rows after it. */
static int run_ceiling_row(const bench_opts *o, int R, const double *a, size_t n, int B,
                           double *rate1, pair_ratios *pr) {
  const int steps = o->replica_steps, nmat = 2 * B;
  int cores[64];
  ceiling_res res[64];
  for (int r = 0; r < R; r++) cores[r] = r % (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (ceiling_round(cores, R, a, n, nmat, steps, res) != 0) {
    fprintf(stderr, "bench-daemon: ceiling R=%d failed\n", R);
    return -1;
  }
  double wall = 0, busiest = 0;
  for (int r = 0; r < R; r++) {
    wall = fmax(wall, res[r].wall);
    busiest = fmax(busiest, res[r].cpu);
    fprintf(stderr,
            "bench-daemon: ceiling R=%d process %d on core %d: %.1f ms per step, %.1f CPU ms\n", R,
            r, cores[r], 1e3 * res[r].wall / steps, 1e3 * res[r].cpu / steps);
  }
  if (R == 1) {
    int other = 1 % (int)sysconf(_SC_NPROCESSORS_ONLN);
    ceiling_res alone;
    if (ceiling_round(&other, 1, a, n, nmat, steps, &alone) == 0)
      fprintf(stderr,
              "bench-daemon: ceiling R=1 alone on core %d: %.1f ms per step, %.1f CPU ms "
              "(core 0 / core %d: %.3f)\n",
              other, 1e3 * alone.wall / steps, 1e3 * alone.cpu / steps, other,
              res[0].cpu / alone.cpu);
  }
  double total = o->cpu_clock ? busiest : wall;
  /* p50: the time per B roots, as a replica row's step */
  double rate = (double)B * R * steps / total, pct[3] = {1e3 * total / (R * steps), 0, 0};
  if (R == 1) *rate1 = rate;
  pair_ratio_add(pr, R, rate, *rate1);
  print_row("ceiling", "none", n, R, (uint64_t)B * R * steps, total, 0.0, rate, pct,
            "ranks1_row_before", *rate1, 0);
  return 0;
}

/* Replica rows: for each R of --ranks, B blocks of 256 (equal costs: B/R per rank), roots by
 * eigh in double with p = 2 (what a worker asks for by default), new statistics at each of
 * --replica-steps steps after REPLICA_WARMUP untimed ones. --replica-push owner (default):
 * each rank's blocks pushed to that rank, one thread per rank at once (data-parallel
 * workers); first: all of them to rank 0, which forwards the others' (one worker). Pushes
 * go as a same-host worker's libprecond sends them, through a shared-memory region
 * (--replica-wire bytes: gRPC bytes). Timed from the push until every rank holds every root
 * of that step, seen by GetStats every 5 ms: a fetch would time the serving of the roots
 * too, and with one fetching client per rank here, R times as much of it at R ranks (each
 * rank serves every root), on the cores the roots need. Per step the phases go to stderr,
 * per row each rank's CPU (pool, replica thread, the rest) and the bench's own. */
static int run_replicas(const bench_opts *o) {
  const size_t n = 256;
  const int B = o->pool_blocks > 0 ? o->pool_blocks : 16, steps = o->replica_steps;
  size_t len = pc_packed_len(n);
  float *g = malloc(n * n * sizeof(float));
  float *lp = malloc((size_t)B * len * sizeof(float)),
        *rp = malloc((size_t)B * len * sizeof(float));
  double *ms = malloc((size_t)steps * sizeof(double));
  int *owner = malloc((size_t)B * sizeof(int));
  roots_view *view = calloc(64, sizeof *view);
  rpc_shm *shm = calloc(64, sizeof *shm);
  int rc = g != NULL && lp != NULL && rp != NULL && ms != NULL && owner != NULL && view != NULL &&
                   shm != NULL
               ? 0
               : -1;
  double rate1 = 0;
  /* The statistics made here between steps on one thread: OpenBLAS's other threads keep
   * spinning (sched_yield) for a while after each of its calls, into the timed step, on
   * the cores the ranks need (at R = 1 a core is spare for them, at R = 2 none is). */
  openblas_set_num_threads(1);
  /* --ceiling: the same statistics as dense doubles for the ceiling rows, one before each
   * replica row at the same R (the same minutes of the machine). */
  pair_ratios pairs = {{0}, 0}, cpairs = {{0}, 0};
  double crate1 = 0, *dense = NULL;
  if (rc == 0 && o->ceiling) {
    uint64_t cs = 777;
    dense = malloc((size_t)2 * B * n * n * sizeof *dense);
    float *f = malloc(n * n * sizeof *f);
    rc = dense != NULL && f != NULL ? 0 : -1;
    for (int b = 0; rc == 0 && b < B; b++) {
      random_gram(n, n, &cs, g, lp, rp);
      for (int k = 0; k < 2; k++) {
        pc_unpack_f32(n, k ? rp : lp, f);
        for (size_t i = 0; i < n * n; i++) dense[(size_t)(2 * b + k) * n * n + i] = f[i];
      }
    }
    free(f);
  }
  for (int ri = 0; rc == 0 && ri < o->nranks; ri++) {
    int R = o->ranks[ri];
    if (o->ceiling && run_ceiling_row(o, R, dense, n, B, &crate1, &cpairs) != 0) {
      rc = -1;
      break;
    }
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/bench-replicas-XXXXXX");
    if (R < 1 || R > 64 || mkdtemp(dir) == NULL) {
      rc = -1;
      break;
    }
    mprun m;
    int up = start_ranks(o, dir, R, &m) == 0;
    char job[64];
    snprintf(job, sizeof job, "bench-replicas-%d", (int)getpid());
    double total = 0;
    memset(view, 0, 64 * sizeof *view);
    for (int r = 0; r < 64; r++) shm[r] = (rpc_shm){.fd = -1};
    for (int r = 0; up && r < R; r++) {
      char addr[160];
      snprintf(addr, sizeof addr, "unix:%s/r-%d.sock", dir, r);
      view[r].ch = rpc_channel_create(addr, 0);
      view[r].by_stats = 1;
      view[r].owner = owner;
      view[r].rank = r;
      grpc_status_code code;
      char err[256];
      /* Room for a whole push of B blocks in the region's half (its ring). */
      if (!o->replica_bytes && view[r].ch != NULL) {
        if (rpc_shm_open(view[r].ch, NULL, CALL_MS, 2 * (2 * (uint64_t)B * len * 4 + (1 << 20)),
                         &shm[r], &code, err, sizeof err) != RPC_OK) {
          fprintf(stderr, "bench-daemon: rank %d: %s\n", r, err);
          up = 0;
        }
      }
    }
    int registered = up && register_job_as(view[0].ch, job, n, B, PRECOND__V1__METHOD__METHOD_EIGH,
                                           2, owner) == 0;
    rc = registered ? 0 : -1;
    uint64_t s = 777;
    /* Untimed warm-up steps first: the first large messages of a connection crawl through
     * HTTP/2 flow-control windows that gRPC grows only over its first calls, and the
     * daemons fault in their memory: 400-500 ms more per push at the first two steps
     * here, the same for any R, which would hide the steady state a training job sees. */
    double cpu0[64][CPU_NSPLIT] = {{0}}, cpu[64][CPU_NSPLIT] = {{0}}, self_cpu = 0,
           fastest = INFINITY;
    int early = 0;
    for (int k = -REPLICA_WARMUP; rc == 0 && k < steps; k++) {
      if (k == 0)
        for (int r = 0; r < R; r++) {
          cpu_split(mprun_rank_pid(&m, r), cpu0[r]);
          view[r].polls = 0;
        }
      for (int b = 0; b < B; b++)
        random_gram(n, n, &s, g, lp + (size_t)b * len, rp + (size_t)b * len);
      replica_push push[64];
      pthread_t th[64];
      int np = o->replica_push_first ? 1 : R;
      double t0 = now_s(), done[64], c0 = self_cpu_s();
      for (int r = 0; r < np; r++) {
        push[r] = (replica_push){view[r].ch,
                                 o->replica_bytes ? NULL : &shm[r],
                                 job,
                                 n,
                                 B,
                                 r,
                                 -1,
                                 lp,
                                 rp,
                                 np > 1 ? owner : NULL,
                                 (uint64_t)(k + REPLICA_WARMUP + 1),
                                 0};
        if (pthread_create(&th[r], NULL, replica_push_run, &push[r]) != 0) {
          np = r;
          rc = -1;
        }
      }
      for (int r = 0; r < np; r++) {
        pthread_join(th[r], NULL);
        if (push[r].rc != 0) rc = -1;
      }
      /* Polls cost CPU on the cores the ranks need (a GetStats poll: 0.08 ms of a rank's gRPC
       * threads and 0.1 ms of the bench's, measured below): none before REPLICA_QUIET of
       * the fastest step so far, then every 5 ms. A step done before that is timed at the
       * first poll (late, never early: the rule can only understate a row) and counted. */
      double quiet = fastest < INFINITY ? REPLICA_QUIET * fastest : 0;
      if (rc == 0)
        rc = wait_roots_all(view, R, job, (size_t)B, push[0].step, 600.0, t0, quiet, done);
      double took = now_s() - t0;
      /* Seen done at the first poll: the step may have been shorter. */
      if (k >= 0 && took < quiet + 0.004) early++;
      if (took < fastest) fastest = took;
      if (k < 0) continue;
      ms[k] = 1e3 * took;
      self_cpu += self_cpu_s() - c0;
      total += ms[k] / 1e3;
      if (rc == 0) {
        fprintf(stderr, "bench-daemon: replicas R=%d step %d: push %.1f ms", R, k + 1, push[0].ms);
        for (int r = 1; r < np; r++) fprintf(stderr, "/%.1f", push[r].ms);
        for (int r = 0; r < R; r++)
          fprintf(stderr, ", rank %d own roots %.1f ms, all %.1f ms", r, view[r].own_ms, done[r]);
        fprintf(stderr, "\n");
      }
    }
    /* The busiest rank's CPU seconds: with --clock cpu the row's time (what the steps
     * would take with a core per rank and nothing else running, less the waits between
     * ranks), as the load of the other programs on the machine leaves it out. The split
     * says what besides the roots each rank spends, and the bench's own CPU what its
     * pushes and polls take from the same cores. */
    double busiest = 0;
    for (int r = 0; rc == 0 && r < R; r++) {
      cpu_split(mprun_rank_pid(&m, r), cpu[r]);
      double t[CPU_RUNS], all = 0;
      for (int k = 0; k < CPU_RUNS; k++) all += t[k] = 1e3 * (cpu[r][k] - cpu0[r][k]) / steps;
      fprintf(stderr,
              "bench-daemon: replicas R=%d rank %d: %.1f CPU ms per step (pool %.1f, replica "
              "thread %.1f in %.1f runs, other threads %.1f: gRPC %.1f, main %.1f, MPI "
              "runtime %.1f); page faults per step: pool %.0f, other threads %.0f\n",
              R, r, all, t[CPU_POOL], t[CPU_REPLICA],
              (cpu[r][CPU_RUNS] - cpu0[r][CPU_RUNS]) / steps,
              t[CPU_GRPC] + t[CPU_MAIN] + t[CPU_MPI], t[CPU_GRPC], t[CPU_MAIN], t[CPU_MPI],
              (cpu[r][CPU_POOL_FAULTS] - cpu0[r][CPU_POOL_FAULTS]) / steps,
              (cpu[r][CPU_FAULTS] - cpu0[r][CPU_FAULTS]) / steps);
      if (all * steps / 1e3 > busiest) busiest = all * steps / 1e3;
    }
    if (rc == 0)
      fprintf(stderr,
              "bench-daemon: replicas R=%d bench (pushes, polls): %.1f CPU ms per step; %d of %d "
              "steps done at the first poll\n",
              R, 1e3 * self_cpu / steps, early, steps);
    /* What one of those polls costs, measured apart after the steps (nothing else runs on
     * the ranks then): CPU per poll of rank 0's gRPC threads and of the bench. */
    if (rc == 0) {
      enum { NPOLL = 50 };
      double a[CPU_NSPLIT], b[CPU_NSPLIT], c0 = self_cpu_s();
      uint64_t polls = 0;
      for (int r = 0; r < R; r++) polls += view[r].polls;
      cpu_split(mprun_rank_pid(&m, 0), a);
      for (int i = 0; i < NPOLL && rc == 0; i++) rc = stats_roots(&view[0], job, (size_t)B);
      double bench_ms = 1e3 * (self_cpu_s() - c0) / NPOLL;
      cpu_split(mprun_rank_pid(&m, 0), b);
      fprintf(stderr,
              "bench-daemon: replicas R=%d: %.1f polls per step (all ranks); one costs %.3f CPU "
              "ms of a rank's gRPC threads and %.3f of the bench's\n",
              R, (double)polls / steps, 1e3 * (b[CPU_GRPC] - a[CPU_GRPC]) / NPOLL, bench_ms);
    }
    if (rc == 0 && o->cpu_clock) total = busiest;
    if (rc == 0) {
      double rate = (double)B * steps / total;
      if (ri == 0 || R == 1) rate1 = rate;
      pair_ratio_add(&pairs, R, rate, rate1);
      qsort(ms, (size_t)steps, sizeof ms[0], cmp_double);
      double pct[3] = {ms[steps / 2], ms[(steps * 9) / 10], ms[steps - 1]};
      print_row("replicas", "unix", n, R, (uint64_t)B * steps, total, 0.0, rate, pct,
                "ranks1_row_before", rate1, 0);
    }
    for (int r = 0; r < R; r++) {
      rpc_shm_close(&shm[r]);
      if (view[r].ch != NULL) rpc_channel_destroy(view[r].ch);
    }
    if (up) mprun_stop(&m, SIGTERM, 60000);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench-daemon: could not remove %s\n", dir);
  }
  pair_ratio_print("ceiling (R > 1 / the R = 1 row before)", &cpairs);
  pair_ratio_print("replicas (R > 1 / the R = 1 row before)", &pairs);
  /* Each replica pair against the ceiling pair measured just before it: the share of what
   * the cores gave at that moment that the daemons got. */
  if (o->ceiling && cpairs.n == pairs.n) {
    pair_ratios eff = pairs;
    for (int i = 0; i < eff.n; i++) eff.v[i] /= cpairs.v[i];
    pair_ratio_print("replicas / ceiling", &eff);
  }
  free(dense);
  free(g);
  free(lp);
  free(rp);
  free(ms);
  free(owner);
  free(view);
  free(shm);
  return rc;
}

/* Every push and fetch cell of one transport: pushes to push_addr, fetches from fetch_addr
 * (the same daemon but with --wire --spawn), root rows on push_addr. */
static int run_transport(const bench_opts *o, const char *push_addr, pid_t push_pid,
                         const char *fetch_addr, pid_t fetch_pid, const char *transport) {
  int rc = 0;
  for (int si = 0; si < o->nsizes; si++) {
    size_t n = o->sizes[si];
    size_t req_bytes = 2 * pc_packed_len(n) * (o->bf16 ? 2 : 4);
    /* The push job has one block per client of the largest cell that runs at this size
     * (the daemon allocates statistics for every registered block). */
    int maxc = 1;
    for (int i = 0; i < o->nclients; i++)
      if (o->clients[i] > maxc &&
          (double)o->clients[i] * (double)req_bytes / 1e6 <= o->max_inflight_mb)
        maxc = o->clients[i];
    float *packed = dominant_packed(n, n);
    uint16_t *half = o->bf16 ? malloc(pc_packed_len(n) * sizeof(uint16_t)) : NULL;
    if (packed == NULL || (o->bf16 && half == NULL)) {
      free(packed);
      return -1;
    }
    payload pl = {n, packed, pc_packed_len(n) * sizeof(float), 0};
    if (o->bf16) {
      pc_f32_to_bf16(pc_packed_len(n), packed, half);
      pl = (payload){n, half, pc_packed_len(n) * sizeof(uint16_t), 1};
    }
    double mc = o->memcpy_mb_s[si];
    grpc_channel *ch = rpc_channel_create(push_addr, 0);
    grpc_channel *fch = strcmp(push_addr, fetch_addr) == 0 ? ch : rpc_channel_create(fetch_addr, 0);
    char pjob[96], fjob[96];
    snprintf(pjob, sizeof pjob, "bench-push-%d-%s-%zu", (int)getpid(), transport, n);
    snprintf(fjob, sizeof fjob, "bench-fetch-%d-%s-%zu", (int)getpid(), transport, n);
    int have_fetch = 0;
    if (ch == NULL || register_job(ch, pjob, n, maxc) != 0) {
      rc = -1;
    } else if (n <= o->fetch_max && fch != NULL && register_job(fch, fjob, n, 1) == 0) {
      push_msg pm;
      push_init(&pm, fjob, 0, &pl);
      ProtobufCMessage *resp = NULL;
      uint64_t depth = 1;
      if (call_ok(fch, RPC_METHOD_PUSH_STATISTICS, &pm.req.base,
                  &precond__v1__push_response__descriptor, &resp) == 0 &&
          wait_roots(fch, fjob, 1, 1, 600.0) == 0 && queue_depth(fch, &depth) == 0)
        have_fetch = 1;
      if (have_fetch && depth > 0)
        fprintf(stderr, "bench-daemon: fetch daemon still has %llu blocks queued\n",
                (unsigned long long)depth);
      if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
    } else if (n > o->fetch_max) {
      fprintf(stderr, "bench-daemon: no fetch rows for n = %zu (above --fetch-max %zu)\n", n,
              o->fetch_max);
    }
    for (int ci = 0; ci < o->nclients && ch != NULL; ci++) {
      int k = o->clients[ci];
      if ((double)k * (double)req_bytes / 1e6 > o->max_inflight_mb) {
        fprintf(stderr,
                "bench-daemon: skip n = %zu with %d clients (%.0f MB in flight > "
                "--max-inflight-mb %.0f)\n",
                n, k, (double)k * (double)req_bytes / 1e6, o->max_inflight_mb);
        continue;
      }
      /* --wire over a unix socket: the shared-memory path next to the gRPC bytes. */
      for (int shm = o->shm_only; shm <= (o->wire && strcmp(transport, "unix") == 0); shm++) {
        if (have_fetch &&
            run_cell(o, fetch_addr, fetch_pid, transport, 1, shm, fjob, k, &pl, mc) != 0)
          rc = -1;
        if (run_cell(o, push_addr, push_pid, transport, 0, shm, pjob, k, &pl, mc) != 0) rc = -1;
        /* The same push with the slots written by a plain memcpy (before session 11): the
         * streaming write's gain in this run. */
        if (shm && !o->push_shm_only &&
            run_cell(o, push_addr, push_pid, transport, 0, 4, pjob, k, &pl, mc) != 0)
          rc = -1;
        /* The region's push with its control as a gRPC call (before the doorbell): the
         * doorbell's gain in this run. */
        if (shm && !o->push_shm_only &&
            run_cell(o, push_addr, push_pid, transport, 0, 2, pjob, k, &pl, mc) != 0)
          rc = -1;
        /* The doorbell pipelined (two pushes in flight): the overlap's cost or gain in this
         * run, next to push-shm's one at a time. */
        if (shm && !o->push_shm_only &&
            run_cell(o, push_addr, push_pid, transport, 0, 3, pjob, k, &pl, mc) != 0)
          rc = -1;
        /* Through libprecond's public API, as a worker pushes (session 14): its background
         * thread posts each push and collects the answer later. Kept with --push-shm-only:
         * the two are the target's rows. fp32 only (precond_push_begin's). */
        if (shm && !pl.bf16 &&
            run_cell(o, push_addr, push_pid, transport, 0, 5, pjob, k, &pl, mc) != 0)
          rc = -1;
        /* The same with each push's answer awaited (precond_options.push_answer_wait, the
         * client before session 14): what posting gains in this run. */
        if (shm && !pl.bf16 &&
            run_cell(o, push_addr, push_pid, transport, 0, 6, pjob, k, &pl, mc) != 0)
          rc = -1;
      }
    }
    if (ch != NULL && o->reps > 0 && n <= o->fetch_max && run_root(o, ch, transport, &pl) != 0)
      rc = -1;
    if (fch != NULL && fch != ch) rpc_channel_destroy(fch);
    if (ch != NULL) rpc_channel_destroy(ch);
    free(packed);
    free(half);
  }
  return rc;
}

int main(int argc, char **argv) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  bench_opts o = {.seconds = 1.0,
                  .fetch_max = 1024,
                  .pool_blocks = 16,
                  .threads = cores > 0 ? (int)cores : 1,
                  .max_inflight_mb = 256,
                  .transports = 3,
                  .reps = 5,
                  .replica_steps = 3};
  int sizes_set = 0, clients_set = 0, fetch_set = 0;
  parse_list("1,2", NULL, o.ranks, &o.nranks);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = 0;
    if (strcmp(a, "--help") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--tcp-only") == 0) {
      o.transports = 1;
      continue;
    } else if (strcmp(a, "--unix-only") == 0) {
      o.transports = 2;
      continue;
    } else if (strcmp(a, "--shm-only") == 0) {
      o.transports = 2;
      o.shm_only = 1;
      continue;
    } else if (strcmp(a, "--bf16") == 0) {
      o.bf16 = 1;
      continue;
    } else if (strcmp(a, "--wire") == 0) {
      o.wire = 1;
      continue;
    } else if (strcmp(a, "--ceiling") == 0) {
      o.ceiling = 1;
      continue;
    } else if (strcmp(a, "--json") == 0) {
      g_json = 1;
      continue;
    } else if (strcmp(a, "--push-shm-only") == 0) {
      o.push_shm_only = 1;
      continue;
    } else if (strcmp(a, "--account") == 0) {
      g_account = 1;
      continue;
    } else if (strcmp(a, "--vouch") == 0) {
      g_vouch = 1;
      continue;
    } else if (strcmp(a, "--hist") == 0) {
      g_hist = 1;
      continue;
    } else if (strcmp(a, "--keep-freed-memory") == 0) {
      rpc_keep_freed_memory(); /* this process, the client side (precondd does it itself) */
      continue;
    }
    if (strcmp(a, "--clock") == 0 && v != NULL && strcmp(v, "cpu") == 0) {
      o.cpu_clock = g_cpu_clock = 1;
      i++;
      continue;
    } else if (strcmp(a, "--clock") == 0 && v != NULL && strcmp(v, "wall") == 0) {
      i++;
      continue;
    }
    if (v == NULL) {
      fprintf(stderr, "bench-daemon: %s needs a value (see --help)\n", a);
      return 2;
    }
    i++;
    if (strcmp(a, "--addr") == 0)
      o.addr = v;
    else if (strcmp(a, "--spawn") == 0)
      o.spawn = v;
    else if (strcmp(a, "--sizes") == 0)
      bad = parse_list(v, o.sizes, NULL, &o.nsizes) || !(sizes_set = 1);
    else if (strcmp(a, "--clients") == 0)
      bad = parse_list(v, NULL, o.clients, &o.nclients) || !(clients_set = 1);
    else if (strcmp(a, "--seconds") == 0)
      bad = (o.seconds = atof(v)) <= 0 || o.seconds > 3600;
    else if (strcmp(a, "--fetch-max") == 0)
      bad = (o.fetch_max = (size_t)atol(v)) == 0 || !(fetch_set = 1);
    else if (strcmp(a, "--pool-blocks") == 0)
      bad = (o.pool_blocks = atoi(v)) < 0 || o.pool_blocks > 256;
    else if (strcmp(a, "--threads") == 0)
      bad = (o.threads = atoi(v)) < 1 || o.threads > 1024;
    else if (strcmp(a, "--window-mb") == 0)
      bad = (o.window_mb = atoi(v)) < 0 || o.window_mb > 1024;
    else if (strcmp(a, "--root-noise") == 0)
      bad = !((o.root_noise = atof(v)) >= 0) || o.root_noise > 1e6;
    else if (strcmp(a, "--channel-arg") == 0) {
      rpc_args check;
      rpc_args_init(&check, 0);
      bad = o.nchannel_args == 8 || rpc_args_parse(&check, v) != RPC_OK;
      if (!bad) o.channel_args[o.nchannel_args++] = v;
    } else if (strcmp(a, "--daemon-arg") == 0) {
      bad = o.ndaemon_args == 8;
      if (!bad) o.daemon_args[o.ndaemon_args++] = v;
    } else if (strcmp(a, "--reps") == 0)
      bad = (o.reps = atoi(v)) < 0 || o.reps > 1000;
    else if (strcmp(a, "--snapshot-mb") == 0)
      bad = (o.snapshot_mb = (size_t)atol(v)) == 0 || o.snapshot_mb > 4096;
    else if (strcmp(a, "--mpirun") == 0)
      o.mpirun = v;
    else if (strcmp(a, "--ranks") == 0)
      bad = parse_list(v, NULL, o.ranks, &o.nranks);
    else if (strcmp(a, "--replica-steps") == 0)
      bad = (o.replica_steps = atoi(v)) < 1 || o.replica_steps > 1000;
    else if (strcmp(a, "--replica-wire") == 0) {
      o.replica_bytes = strcmp(v, "bytes") == 0;
      bad = !o.replica_bytes && strcmp(v, "shm") != 0;
    } else if (strcmp(a, "--replica-push") == 0) {
      o.replica_push_first = strcmp(v, "first") == 0;
      bad = !o.replica_push_first && strcmp(v, "owner") != 0;
    } else if (strcmp(a, "--max-inflight-mb") == 0)
      bad = (o.max_inflight_mb = atof(v)) <= 0;
    else {
      fprintf(stderr, "bench-daemon: unknown option %s (see --help)\n", a);
      return 2;
    }
    if (bad) {
      fprintf(stderr, "bench-daemon: bad value for %s: '%s'\n", a, v);
      return 2;
    }
  }
  /* --wire: message sizes 64 KiB (n = 128: 2 x 33 KB) to 64 MiB (n = 4096), one client,
   * and only the wire's rows. */
  if (!sizes_set)
    parse_list(o.wire ? "128,256,512,1024,2048,4096" : "256,1024,4096", o.sizes, NULL, &o.nsizes);
  if (!clients_set) parse_list(o.wire ? "1" : "1,4,16", NULL, o.clients, &o.nclients);
  if (o.wire && !fetch_set) o.fetch_max = 2048;
  if (o.wire) o.reps = o.pool_blocks = 0;
  for (int i = 0; i < o.nclients; i++)
    if (o.clients[i] > MAX_LIST * 16) {
      fprintf(stderr, "bench-daemon: at most %d clients\n", MAX_LIST * 16);
      return 2;
    }
  if ((o.addr == NULL) == (o.spawn == NULL)) {
    fprintf(stderr, "bench-daemon: give exactly one of --addr and --spawn (see --help)\n");
    return 2;
  }
  if (o.mpirun != NULL && o.spawn == NULL) {
    fprintf(stderr, "bench-daemon: --mpirun needs --spawn (the precondd it starts)\n");
    return 2;
  }
  if (o.snapshot_mb > 0 && o.spawn == NULL) {
    fprintf(stderr, "bench-daemon: --snapshot-mb needs --spawn (it restarts the daemon)\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  g_window_mb = o.window_mb;
  g_opts = &o;
  /* The memcpy limit is taken first, before any daemon computes roots on this machine. */
  for (int si = 0; si < o.nsizes; si++)
    o.memcpy_mb_s[si] =
        memcpy_mb_s(2 * pc_packed_len(o.sizes[si]) * (o.bf16 ? 2 : 4), o.memcpy_pct[si]);
  if (g_json)
    printf("[\n");
  else
    printf(
        "bench,transport,block,clients,ops,seconds,mb_per_s,ops_per_s,p50_ms,p90_ms,p99_ms,"
        "baseline,baseline_value,ratio,payload_bytes\n");
  for (int si = 0; o.wire && si < o.nsizes; si++) {
    size_t bytes = 2 * pc_packed_len(o.sizes[si]) * (o.bf16 ? 2 : 4);
    print_row("memcpy", "-", o.sizes[si], 1, 0, 0.2, o.memcpy_mb_s[si],
              o.memcpy_mb_s[si] * 1e6 / (double)bytes, o.memcpy_pct[si], "none", 0.0, bytes);
    /* The cross-core reference, next to the memcpy it is a ratio of (measured again). */
    double mc = memcpy_mb_s(bytes, NULL), xc = xcore_mb_s(bytes);
    double none[3] = {0, 0, 0};
    print_row("memcpy-xcore", "-", o.sizes[si], 2, 0, 0.2, xc, xc * 1e6 / (double)bytes, none,
              "memcpy", mc, bytes);
  }
  int rc = 0;
  if (o.mpirun != NULL) {
    rc = run_replicas(&o);
  } else if (o.addr != NULL) {
    const char *transport = strncmp(o.addr, "unix:", 5) == 0 ? "unix" : "tcp";
    if (o.pool_blocks > 0 && run_pool(&o, o.addr, transport) != 0) rc = -1;
    if (run_transport(&o, o.addr, 0, o.addr, 0, transport) != 0) rc = -1;
  } else if (o.wire) {
    /* Pushes to a daemon without a pool, so that no root competes with the transport for
     * the cores; fetches from one with a pool thread, idle once the fetched roots exist. */
    for (int t = 0; t < 2; t++) {
      pdproc dp, df;
      if (!(o.transports & (1 << t))) continue;
      if (spawn_daemon(&o, t == 1, 0, 0, NULL, &dp) != 0) {
        rc = -1;
        continue;
      }
      if (spawn_daemon(&o, t == 1, 1, 0, NULL, &df) != 0) {
        pdproc_destroy(&dp);
        rc = -1;
        continue;
      }
      fprintf(stderr, "bench-daemon: %s daemons: push %s (pid %d), fetch %s (pid %d)\n",
              t ? "unix" : "tcp", dp.addr, (int)dp.pid, df.addr, (int)df.pid);
      if (run_transport(&o, dp.addr, dp.pid, df.addr, df.pid, t ? "unix" : "tcp") != 0) rc = -1;
      pdproc_destroy(&dp);
      pdproc_destroy(&df);
    }
  } else {
    /* The pool rows get a daemon of their own with all its threads; the push and fetch
     * daemons get one pool thread, so the roots their pushes trigger leave a core to the
     * transport being measured. */
    pdproc d;
    if (o.pool_blocks > 0) {
      if (spawn_daemon(&o, 0, o.threads, 0, NULL, &d) != 0 || run_pool(&o, d.addr, "tcp") != 0)
        rc = -1;
      pdproc_destroy(&d);
    }
    for (int t = 0; t < 2; t++) {
      if (!(o.transports & (1 << t))) continue;
      if (spawn_daemon(&o, t == 1, 1, 0, NULL, &d) != 0) {
        rc = -1;
        continue;
      }
      fprintf(stderr, "bench-daemon: %s daemon at %s (pid %d)\n", t ? "unix" : "tcp", d.addr,
              (int)d.pid);
      if (run_transport(&o, d.addr, d.pid, d.addr, d.pid, t ? "unix" : "tcp") != 0) rc = -1;
      pdproc_destroy(&d);
    }
    if (o.snapshot_mb > 0 && run_snapshot(&o) != 0) rc = -1;
  }
  if (g_json) printf("\n]\n");
  return rc == 0 ? 0 : 1;
}
