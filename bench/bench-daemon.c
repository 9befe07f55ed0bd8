/*
 * bench-daemon.c -- precondd's transport and pool throughput, as CSV on stdout.
 *
 * Against a running daemon (--addr) or daemons it starts itself (--spawn PATH: one on a TCP
 * loopback port, one on a unix socket), it measures:
 *   push   PushStatistics of one n x n block (both packed fp32 factors), 1..16 clients
 *          each on its own channel, back to back for --seconds: MB/s and latency
 *          percentiles, next to a single-threaded memcpy of the same bytes (the limit);
 *   fetch  FetchPreconditioners of one n x n block's roots (the same job for every client),
 *          MB/s and latency, next to memcpy of the same bytes;
 *   pool   roots per second of the daemon's worker pool on --pool-blocks blocks of 256
 *          (Gram matrices of Gaussian gradients, default Newton method), next to one thread
 *          computing the same roots in this process with pc_inverse_root_f32.
 * All ratios come from the same run. The memcpy rates are measured at the start, before any
 * daemon computes roots, so they are the machine's limit rather than a loaded figure.
 *
 * Rows (clients = the daemon's pool threads in pool rows): bench,transport,block,clients,ops,seconds,mb_per_s,ops_per_s,p50_ms,p90_ms,p99_ms,
 *       baseline,baseline_value,ratio
 * (ratio = mb_per_s / memcpy MB/s for push and fetch, ops_per_s / single-thread roots/s for
 * pool). Notes (skipped cells, daemon paths) go to stderr.
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>
#include <grpc/grpc_security.h>

#include "precond.pb-c.h"
#include "preconditioner.h"
#include "rpc.h"

#define MAX_LIST 16
#define CALL_MS 120000

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
  int transports;  /* bit 1: tcp, bit 2: unix (spawn only) */
  int window_mb;   /* HTTP/2 receive window of the bench's channels; 0: gRPC's default */
  double memcpy_mb_s[MAX_LIST];  /* per size, measured before any daemon runs */
} bench_opts;

static int g_window_mb;

/* A channel with the size limits of rpc_channel_create and, with --window-mb, a larger
 * HTTP/2 receive window (lookahead): a big answer then needs fewer WINDOW_UPDATE round
 * trips. Released with rpc_channel_destroy (which gives back this grpc_init). */
static grpc_channel *bench_channel(const char *addr)
{
  if (g_window_mb <= 0)
    return rpc_channel_create(addr, 0);
  grpc_arg args[3];
  grpc_channel_args ca;
  rpc_size_args(&ca, args, 0);
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES;
  args[2].value.integer = g_window_mb << 20;
  ca.num_args = 3;
  ca.args = args;
  grpc_init();
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(addr, creds, &ca);
  grpc_channel_credentials_release(creds);
  return ch;
}

static double now_s(void)
{
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void usage(FILE *f)
{
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
          "  --window-mb W       HTTP/2 receive window of the client channels in MiB\n"
          "                      (default 0: gRPC's own, which starts at 64 KiB)\n"
          "  --help\n"
          "\n"
          "Pushes leave dirty blocks: the daemon computes their roots afterwards (with --addr,\n"
          "that work stays on the daemon). CSV on stdout, notes on stderr.\n");
}

static int parse_list(const char *s, size_t *out_sz, int *out_int, int *n)
{
  *n = 0;
  while (*s) {
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || v <= 0 || v > 65536 || *n >= MAX_LIST)
      return -1;
    if (out_sz)
      out_sz[*n] = (size_t)v;
    if (out_int)
      out_int[*n] = (int)v;
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
/* Daemon processes                                                                       */

typedef struct {
  pid_t pid;
  char addr[160];
  char sock[128];
  char port_file[128];
} daemon_proc;

static int spawn_daemon(const bench_opts *o, int unix_socket, int nthreads, daemon_proc *d)
{
  memset(d, 0, sizeof *d);
  char listen[160], threads[16];
  snprintf(threads, sizeof threads, "%d", nthreads);
  snprintf(d->port_file, sizeof d->port_file, "/tmp/bench-daemon-%d.port", (int)getpid());
  unlink(d->port_file);
  if (unix_socket) {
    snprintf(d->sock, sizeof d->sock, "/tmp/bench-daemon-%d.sock", (int)getpid());
    unlink(d->sock);
    snprintf(listen, sizeof listen, "unix:%s", d->sock);
    snprintf(d->addr, sizeof d->addr, "%s", listen);
  } else {
    snprintf(listen, sizeof listen, "127.0.0.1:0");
  }
  fflush(NULL);
  d->pid = fork();
  if (d->pid < 0)
    return -1;
  if (d->pid == 0) {
    execl(o->spawn, o->spawn, "--listen", listen, "--port-file", d->port_file, "--threads",
          threads, "--grace-period", "1", "--log-level", "warn", (char *)NULL);
    perror("bench-daemon: exec");
    _exit(127);
  }
  /* Ready when the port file appears (TCP) or the socket exists (unix). */
  for (int i = 0; i < 400; i++) {
    struct stat st;
    int status;
    if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
      fprintf(stderr, "bench-daemon: %s exited at startup\n", o->spawn);
      d->pid = 0;
      return -1;
    }
    if (unix_socket && stat(d->sock, &st) == 0)
      return 0;
    if (!unix_socket) {
      FILE *f = fopen(d->port_file, "r");
      int port = 0;
      if (f != NULL) {
        int ok = fscanf(f, "%d", &port) == 1;
        fclose(f);
        if (ok && port > 0) {
          snprintf(d->addr, sizeof d->addr, "127.0.0.1:%d", port);
          return 0;
        }
      }
    }
    struct timespec t = {0, 25 * 1000000L};
    nanosleep(&t, NULL);
  }
  fprintf(stderr, "bench-daemon: %s did not come up within 10 s\n", o->spawn);
  return -1;
}

static void stop_daemon(daemon_proc *d)
{
  if (d->pid <= 0)
    return;
  kill(d->pid, SIGTERM);
  int status;
  for (int i = 0; i < 200; i++) {
    if (waitpid(d->pid, &status, WNOHANG) == d->pid)
      goto done;
    struct timespec t = {0, 25 * 1000000L};
    nanosleep(&t, NULL);
  }
  kill(d->pid, SIGKILL);
  waitpid(d->pid, &status, 0);
done:
  d->pid = 0;
  if (d->sock[0])
    unlink(d->sock);
  unlink(d->port_file);
}

/* ------------------------------------------------------------------------------------ */
/* Requests                                                                               */

/* Packed upper triangle of a diagonally dominant symmetric matrix (diag n, off-diagonal in
 * [-0.5, 0.5)): positive definite by Gershgorin, cheap to make at n = 4096. */
static float *dominant_packed(size_t n, uint64_t seed)
{
  float *p = malloc(pc_packed_len(n) * sizeof(float));
  if (p == NULL)
    return NULL;
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
                   const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
  grpc_status_code code;
  char *details = NULL;
  int rc = rpc_call(ch, method, req, desc, CALL_MS, 1, resp, &code, &details);
  if (rc != RPC_OK)
    fprintf(stderr, "bench-daemon: %s: %s: %s\n", method, rpc_status_name(code),
            details ? details : rpc_strerror(rc));
  free(details);
  return rc == RPC_OK ? 0 : -1;
}

/* Registers job with ntensors n x n tensors, block size n: block i is tensor i. */
static int register_job(grpc_channel *ch, const char *job, size_t n, int ntensors)
{
  Precond__V1__RegisterRequest req = PRECOND__V1__REGISTER_REQUEST__INIT;
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  Precond__V1__TensorSpec ts[MAX_LIST + 256];
  Precond__V1__TensorSpec *tp[MAX_LIST + 256];
  uint64_t shape[2] = {n, n};
  char names[MAX_LIST + 256][16];
  if (ntensors > MAX_LIST + 256)
    return -1;
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
  req.shampoo = &so;
  req.worker = "bench-daemon";
  ProtobufCMessage *resp = NULL;
  int rc = call_ok(ch, RPC_METHOD_REGISTER, &req.base, &precond__v1__register_response__descriptor,
                   &resp);
  if (resp != NULL) {
    const Precond__V1__RegisterResponse *r = (const Precond__V1__RegisterResponse *)resp;
    if (r->n_blocks != (size_t)ntensors) {
      fprintf(stderr, "bench-daemon: %s: %zu blocks, expected %d\n", job, r->n_blocks,
              ntensors);
      rc = -1;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  return rc;
}

/* A one-block push request whose two factors both point at packed (n(n+1)/2 floats). */
typedef struct {
  Precond__V1__PushRequest req;
  Precond__V1__BlockStatistics bs;
  Precond__V1__BlockStatistics *bsp;
  Precond__V1__PackedMatrix l, r;
} push_msg;

static void push_init(push_msg *m, const char *job, uint32_t block, size_t n, float *packed)
{
  precond__v1__push_request__init(&m->req);
  precond__v1__block_statistics__init(&m->bs);
  precond__v1__packed_matrix__init(&m->l);
  precond__v1__packed_matrix__init(&m->r);
  m->l.n = m->r.n = (uint32_t)n;
  m->l.data.data = m->r.data.data = (uint8_t *)packed;
  m->l.data.len = m->r.data.len = pc_packed_len(n) * sizeof(float);
  m->bs.block_id = block;
  m->bs.left = &m->l;
  m->bs.right = &m->r;
  m->bsp = &m->bs;
  m->req.job = (char *)job;
  m->req.step = 1;
  m->req.n_blocks = 1;
  m->req.blocks = &m->bsp;
}

/* ------------------------------------------------------------------------------------ */
/* Client threads                                                                         */

typedef struct {
  const char *addr;
  const char *job;
  uint32_t block;
  size_t n;
  float *packed;     /* shared, read-only */
  int fetch;         /* 0: push, 1: fetch */
  double until;      /* stop time */
  pthread_barrier_t *start;
  double *lat;       /* latencies in ms */
  size_t nlat, caplat;
  uint64_t bytes;
  int failed;
} worker;

static void *worker_main(void *arg)
{
  worker *w = arg;
  grpc_channel *ch = bench_channel(w->addr);
  push_msg pm;
  push_init(&pm, w->job, w->block, w->n, w->packed);
  Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
  fr.job = (char *)w->job;
  /* Warm the connection before the clock starts. */
  Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
  sr.job = (char *)w->job;
  ProtobufCMessage *resp = NULL;
  if (ch == NULL || call_ok(ch, RPC_METHOD_GET_STATS, &sr.base,
                            &precond__v1__stats_response__descriptor, &resp) != 0)
    w->failed = 1;
  if (resp != NULL)
    protobuf_c_message_free_unpacked(resp, NULL);
  pthread_barrier_wait(w->start);
  uint64_t step = 1;
  while (!w->failed && (w->nlat == 0 || now_s() < w->until)) {
    double t0 = now_s();
    resp = NULL;
    if (w->fetch) {
      if (call_ok(ch, RPC_METHOD_FETCH_PRECONDITIONERS, &fr.base,
                  &precond__v1__fetch_response__descriptor, &resp) != 0) {
        w->failed = 1;
        break;
      }
      const Precond__V1__FetchResponse *r = (const Precond__V1__FetchResponse *)resp;
      for (size_t i = 0; i < r->n_preconditioners; i++) {
        const Precond__V1__BlockRoots *b = r->preconditioners[i];
        w->bytes += (b->left ? b->left->data.len : 0) + (b->right ? b->right->data.len : 0);
      }
    } else {
      pm.req.step = step++;
      if (call_ok(ch, RPC_METHOD_PUSH_STATISTICS, &pm.req.base,
                  &precond__v1__push_response__descriptor, &resp) != 0) {
        w->failed = 1;
        break;
      }
      w->bytes += 2 * pm.l.data.len;
    }
    if (resp != NULL)
      protobuf_c_message_free_unpacked(resp, NULL);
    if (w->nlat == w->caplat) {
      size_t cap = w->caplat ? 2 * w->caplat : 1024;
      double *nl = realloc(w->lat, cap * sizeof(double));
      if (nl == NULL) {
        w->failed = 1;
        break;
      }
      w->lat = nl;
      w->caplat = cap;
    }
    w->lat[w->nlat++] = 1e3 * (now_s() - t0);
  }
  rpc_channel_destroy(ch);
  return NULL;
}

static int cmp_double(const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double percentile(const double *sorted, size_t n, double q)
{
  if (n == 0)
    return 0.0;
  size_t i = (size_t)(q * (double)(n - 1) + 0.5);
  return sorted[i < n ? i : n - 1];
}

/* Single-threaded memcpy MB/s of bytes (repeated for about 0.2 s). */
static double memcpy_mb_s(size_t bytes)
{
  unsigned char *a = malloc(bytes), *b = malloc(bytes);
  if (a == NULL || b == NULL) {
    free(a);
    free(b);
    return 0.0;
  }
  memset(a, 1, bytes);
  memset(b, 0, bytes);
  size_t reps = 0;
  double t0 = now_s(), t;
  do {
    memcpy(b, a, bytes);
    a[reps % bytes] = b[(reps * 7) % bytes];  /* keep the copies observable */
    reps++;
    t = now_s();
  } while (t - t0 < 0.2 || reps < 3);
  double mbs = (double)bytes * (double)reps / (t - t0) / 1e6;
  free(a);
  free(b);
  return mbs;
}

static void print_row(const char *bench, const char *transport, size_t n, int clients,
                      uint64_t ops, double secs, double mbs, double ops_s, const double *p,
                      const char *baseline, double base_value)
{
  printf("%s,%s,%zu,%d,%llu,%.3f,%.1f,%.1f,%.3f,%.3f,%.3f,%s,%.1f,%.4f\n", bench, transport, n,
         clients, (unsigned long long)ops, secs, mbs, ops_s, p[0], p[1], p[2], baseline,
         base_value, base_value > 0 ? (strcmp(bench, "pool") == 0 ? ops_s : mbs) / base_value
                                    : 0.0);
  fflush(stdout);
}

/* One push or fetch cell: k clients for o->seconds. */
static int run_cell(const bench_opts *o, const char *addr, const char *transport, int fetch,
                    const char *job, size_t n, int k, float *packed, double memcpy_rate)
{
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
    w[i] = (worker){.addr = addr, .job = job, .block = fetch ? 0 : (uint32_t)i, .n = n,
                    .packed = packed, .fetch = fetch, .start = &start};
    if (pthread_create(&th[i], NULL, worker_main, &w[i]) != 0)
      break;
    started++;
  }
  if (started < k) {
    /* Can't release a barrier sized for k + 1 with fewer parties: give up loudly. */
    fprintf(stderr, "bench-daemon: could not start %d threads\n", k);
    exit(1);
  }
  double t0 = now_s();
  for (int i = 0; i < k; i++)
    w[i].until = t0 + o->seconds;
  pthread_barrier_wait(&start);
  t0 = now_s();
  for (int i = 0; i < k; i++)
    pthread_join(th[i], NULL);
  double secs = now_s() - t0;
  pthread_barrier_destroy(&start);

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
    qsort(all, total, sizeof(double), cmp_double);
    double p[3] = {percentile(all, total, 0.5), percentile(all, total, 0.9),
                   percentile(all, total, 0.99)};
    print_row(fetch ? "fetch" : "push", transport, n, k, total, secs,
              (double)bytes / secs / 1e6, (double)total / secs, p, "memcpy", memcpy_rate);
    rc = 0;
  }
  free(all);
  for (int i = 0; i < k; i++)
    free(w[i].lat);
  free(w);
  free(th);
  return rc;
}

/* Waits until the daemon has a root of every block of job computed from step or later. */
static int wait_roots(grpc_channel *ch, const char *job, size_t nblocks, uint64_t step,
                      double timeout_s)
{
  Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
  Precond__V1__BlockVersion bv[256], *bvp[256];
  uint64_t ver[256] = {0}, src[256] = {0};
  if (nblocks > 256)
    return -1;
  fr.job = (char *)job;
  fr.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;  /* only versions matter here */
  double until = now_s() + timeout_s;
  while (now_s() < until) {
    fr.n_have = 0;
    for (size_t i = 0; i < nblocks; i++) {
      precond__v1__block_version__init(&bv[i]);
      bv[i].block_id = (uint32_t)i;
      bv[i].version = ver[i];
      bvp[fr.n_have++] = &bv[i];
    }
    fr.have = bvp;
    ProtobufCMessage *resp = NULL;
    if (call_ok(ch, RPC_METHOD_FETCH_PRECONDITIONERS, &fr.base,
                &precond__v1__fetch_response__descriptor, &resp) != 0)
      return -1;
    const Precond__V1__FetchResponse *r = (const Precond__V1__FetchResponse *)resp;
    for (size_t i = 0; i < r->n_preconditioners; i++) {
      const Precond__V1__BlockRoots *b = r->preconditioners[i];
      if (b->block_id < nblocks) {
        ver[b->block_id] = b->version;
        src[b->block_id] = b->source_step;
      }
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    size_t done = 0;
    for (size_t i = 0; i < nblocks; i++)
      done += src[i] >= step && ver[i] > 0;
    if (done == nblocks)
      return 0;
    struct timespec t = {0, 5 * 1000000L};
    nanosleep(&t, NULL);
  }
  fprintf(stderr, "bench-daemon: %s: roots not ready within %.0f s\n", job, timeout_s);
  return -1;
}

/* Pool rows: the daemon's roots/s on B blocks of 256 against one thread here. */
static int run_pool(const bench_opts *o, const char *addr, const char *transport)
{
  const size_t n = 256;
  int B = o->pool_blocks;
  size_t len = pc_packed_len(n);
  float *g = malloc(n * n * sizeof(float));
  float *lp = malloc((size_t)B * len * sizeof(float)), *rp = malloc((size_t)B * len * sizeof(float));
  float *dense = malloc(n * n * sizeof(float)), *x = malloc(n * n * sizeof(float));
  grpc_channel *ch = NULL;
  int rc = -1;
  if (g == NULL || lp == NULL || rp == NULL || dense == NULL || x == NULL)
    goto cleanup;
  /* Gram matrices of Gaussian-ish gradients (sum of 4 uniforms): realistic conditioning. */
  uint64_t s = 12345;
  for (int b = 0; b < B; b++) {
    for (size_t i = 0; i < n * n; i++) {
      double acc = 0;
      for (int k = 0; k < 4; k++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        acc += (double)(s >> 40) / (double)(1ULL << 24) - 0.5;
      }
      g[i] = (float)acc;
    }
    pc_gram_f32(n, n, g, n, lp + (size_t)b * len, rp + (size_t)b * len);
  }

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
  if (ch == NULL || register_job(ch, job, n, B) != 0)
    goto cleanup;
  int pool_threads = 0;  /* as the daemon reports it */
  {
    Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
    ProtobufCMessage *st = NULL;
    if (call_ok(ch, RPC_METHOD_GET_STATS, &sr.base, &precond__v1__stats_response__descriptor,
                &st) != 0)
      goto cleanup;
    pool_threads = (int)((const Precond__V1__StatsResponse *)st)->threads;
    protobuf_c_message_free_unpacked(st, NULL);
  }
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  Precond__V1__BlockStatistics *bs = calloc((size_t)B, sizeof(*bs));
  Precond__V1__BlockStatistics **bsp = calloc((size_t)B, sizeof(*bsp));
  Precond__V1__PackedMatrix *pm = calloc(2 * (size_t)B, sizeof(*pm));
  if (bs == NULL || bsp == NULL || pm == NULL) {
    free(bs);
    free(bsp);
    free(pm);
    goto cleanup;
  }
  for (int b = 0; b < B; b++) {
    precond__v1__block_statistics__init(&bs[b]);
    precond__v1__packed_matrix__init(&pm[2 * b]);
    precond__v1__packed_matrix__init(&pm[2 * b + 1]);
    pm[2 * b].n = pm[2 * b + 1].n = (uint32_t)n;
    pm[2 * b].data.data = (uint8_t *)(lp + (size_t)b * len);
    pm[2 * b + 1].data.data = (uint8_t *)(rp + (size_t)b * len);
    pm[2 * b].data.len = pm[2 * b + 1].data.len = len * sizeof(float);
    bs[b].block_id = (uint32_t)b;
    bs[b].left = &pm[2 * b];
    bs[b].right = &pm[2 * b + 1];
    bsp[b] = &bs[b];
  }
  req.job = job;
  req.step = 1;
  req.n_blocks = (size_t)B;
  req.blocks = bsp;
  ProtobufCMessage *resp = NULL;
  t0 = now_s();
  int pushed = call_ok(ch, RPC_METHOD_PUSH_STATISTICS, &req.base,
                       &precond__v1__push_response__descriptor, &resp);
  if (resp != NULL)
    protobuf_c_message_free_unpacked(resp, NULL);
  free(bs);
  free(bsp);
  free(pm);
  if (pushed != 0 || wait_roots(ch, job, (size_t)B, 1, 600.0) != 0)
    goto cleanup;
  double daemon_s = now_s() - t0;
  double zero[3] = {0, 0, 0};
  print_row("pool", transport, n, pool_threads, (uint64_t)B, daemon_s, 0.0,
            (double)B / daemon_s, zero, "single_thread", local_rate);
  rc = 0;

cleanup:
  if (ch != NULL)
    rpc_channel_destroy(ch);
  free(g);
  free(lp);
  free(rp);
  free(dense);
  free(x);
  return rc;
}

/* Every push and fetch cell of one daemon. */
static int run_transport(const bench_opts *o, const char *addr, const char *transport)
{
  int rc = 0;
  for (int si = 0; si < o->nsizes; si++) {
    size_t n = o->sizes[si];
    size_t req_bytes = 2 * pc_packed_len(n) * sizeof(float);
    /* The push job has one block per client of the largest cell that runs at this size
     * (the daemon allocates statistics for every registered block). */
    int maxc = 1;
    for (int i = 0; i < o->nclients; i++)
      if (o->clients[i] > maxc && (double)o->clients[i] * (double)req_bytes / 1e6 <= o->max_inflight_mb)
        maxc = o->clients[i];
    float *packed = dominant_packed(n, n);
    if (packed == NULL)
      return -1;
    double mc = o->memcpy_mb_s[si];
    grpc_channel *ch = rpc_channel_create(addr, 0);
    char pjob[96], fjob[96];
    snprintf(pjob, sizeof pjob, "bench-push-%d-%s-%zu", (int)getpid(), transport, n);
    snprintf(fjob, sizeof fjob, "bench-fetch-%d-%s-%zu", (int)getpid(), transport, n);
    int have_fetch = 0;
    if (ch == NULL || register_job(ch, pjob, n, maxc) != 0) {
      rc = -1;
    } else if (n <= o->fetch_max && register_job(ch, fjob, n, 1) == 0) {
      push_msg pm;
      push_init(&pm, fjob, 0, n, packed);
      ProtobufCMessage *resp = NULL;
      if (call_ok(ch, RPC_METHOD_PUSH_STATISTICS, &pm.req.base,
                  &precond__v1__push_response__descriptor, &resp) == 0 &&
          wait_roots(ch, fjob, 1, 1, 600.0) == 0)
        have_fetch = 1;
      if (resp != NULL)
        protobuf_c_message_free_unpacked(resp, NULL);
    } else if (n > o->fetch_max) {
      fprintf(stderr, "bench-daemon: no fetch rows for n = %zu (above --fetch-max %zu)\n", n,
              o->fetch_max);
    }
    for (int ci = 0; ci < o->nclients && ch != NULL; ci++) {
      int k = o->clients[ci];
      if ((double)k * (double)req_bytes / 1e6 > o->max_inflight_mb) {
        fprintf(stderr, "bench-daemon: skip n = %zu with %d clients (%.0f MB in flight > "
                        "--max-inflight-mb %.0f)\n", n, k, (double)k * (double)req_bytes / 1e6,
                o->max_inflight_mb);
        continue;
      }
      if (have_fetch && run_cell(o, addr, transport, 1, fjob, n, k, packed, mc) != 0)
        rc = -1;
      if (run_cell(o, addr, transport, 0, pjob, n, k, packed, mc) != 0)
        rc = -1;
    }
    if (ch != NULL)
      rpc_channel_destroy(ch);
    free(packed);
  }
  return rc;
}

int main(int argc, char **argv)
{
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  bench_opts o = {.seconds = 1.0, .fetch_max = 1024, .pool_blocks = 16,
                  .threads = cores > 0 ? (int)cores : 1,
                  .max_inflight_mb = 256, .transports = 3};
  parse_list("256,1024,4096", o.sizes, NULL, &o.nsizes);
  parse_list("1,4,16", NULL, o.clients, &o.nclients);
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
      bad = parse_list(v, o.sizes, NULL, &o.nsizes);
    else if (strcmp(a, "--clients") == 0)
      bad = parse_list(v, NULL, o.clients, &o.nclients);
    else if (strcmp(a, "--seconds") == 0)
      bad = (o.seconds = atof(v)) <= 0 || o.seconds > 3600;
    else if (strcmp(a, "--fetch-max") == 0)
      bad = (o.fetch_max = (size_t)atol(v)) == 0;
    else if (strcmp(a, "--pool-blocks") == 0)
      bad = (o.pool_blocks = atoi(v)) < 0 || o.pool_blocks > 256;
    else if (strcmp(a, "--threads") == 0)
      bad = (o.threads = atoi(v)) < 1 || o.threads > 1024;
    else if (strcmp(a, "--window-mb") == 0)
      bad = (o.window_mb = atoi(v)) < 0 || o.window_mb > 1024;
    else if (strcmp(a, "--max-inflight-mb") == 0)
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
  for (int i = 0; i < o.nclients; i++)
    if (o.clients[i] > MAX_LIST * 16) {
      fprintf(stderr, "bench-daemon: at most %d clients\n", MAX_LIST * 16);
      return 2;
    }
  if ((o.addr == NULL) == (o.spawn == NULL)) {
    fprintf(stderr, "bench-daemon: give exactly one of --addr and --spawn (see --help)\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  g_window_mb = o.window_mb;
  /* The memcpy limit is taken first, before any daemon computes roots on this machine. */
  for (int si = 0; si < o.nsizes; si++)
    o.memcpy_mb_s[si] = memcpy_mb_s(2 * pc_packed_len(o.sizes[si]) * sizeof(float));
  printf("bench,transport,block,clients,ops,seconds,mb_per_s,ops_per_s,p50_ms,p90_ms,p99_ms,"
         "baseline,baseline_value,ratio\n");
  int rc = 0;
  if (o.addr != NULL) {
    const char *transport = strncmp(o.addr, "unix:", 5) == 0 ? "unix" : "tcp";
    if (o.pool_blocks > 0 && run_pool(&o, o.addr, transport) != 0)
      rc = -1;
    if (run_transport(&o, o.addr, transport) != 0)
      rc = -1;
  } else {
    /* The pool rows get a daemon of their own with all its threads; the push and fetch
     * daemons get one pool thread, so the roots their pushes trigger leave a core to the
     * transport being measured. */
    daemon_proc d;
    if (o.pool_blocks > 0) {
      if (spawn_daemon(&o, 0, o.threads, &d) != 0 || run_pool(&o, d.addr, "tcp") != 0)
        rc = -1;
      stop_daemon(&d);
    }
    for (int t = 0; t < 2; t++) {
      if (!(o.transports & (1 << t)))
        continue;
      if (spawn_daemon(&o, t == 1, 1, &d) != 0) {
        rc = -1;
        continue;
      }
      fprintf(stderr, "bench-daemon: %s daemon at %s (pid %d)\n", t ? "unix" : "tcp", d.addr,
              (int)d.pid);
      if (run_transport(&o, d.addr, t ? "unix" : "tcp") != 0)
        rc = -1;
      stop_daemon(&d);
    }
  }
  return rc == 0 ? 0 : 1;
}
