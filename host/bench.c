/*
 * bench.c -- precondd-bench: end-to-end figures of a real precondd over a real socket.
 *
 *   precondd-bench --daemon build/host/precondd [--threads N] [--seconds S] [--sizes 128,512]
 *   precondd-bench --connect 127.0.0.1:50551 ...
 *
 * With --daemon it starts that binary on a free loopback port with a temporary state dir
 * (removed afterwards). For each block size n it registers a job with one n x n block and
 * measures, on one client thread:
 *   push_per_s, push_mb_per_s  PushStatistics of both factors (fp32, then bf16) back to back,
 *                              after 10 untimed warm-up pushes
 *   root_ms                    from a push to the first fetch that returns a newer root
 *                              (median of the repetitions)
 *   fetch_ms                   FetchPreconditioners of one fresh root pair (median)
 * With --snapshot-mb M (and --daemon) it measures instead the snapshot of about M MiB of
 * statistics: written at SIGTERM and restored at the next start, as the daemon logs them.
 * Output: CSV on stdout, one row per (n, encoding). OpenBLAS threads of the daemon follow its
 * --threads; this process does no BLAS work.
 */
#include "precondd.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "preconditioner.h"
#include "precond.pb-c.h"
#include "rpc.h"

static void bench__sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int bench__cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double bench__median(double *v, size_t n) {
  if (n == 0) return 0;
  qsort(v, n, sizeof *v, bench__cmp);
  return v[n / 2];
}

/* Starts the daemon; returns its pid and writes the address. */
static pid_t bench__start(const char *bin, const char *dir, const char *threads,
                          const char *memory_mb, char *addr, size_t len) {
  char portfile[300], state[300], logfile[300];
  snprintf(portfile, sizeof portfile, "%s/port", dir);
  snprintf(state, sizeof state, "%s/state", dir);
  snprintf(logfile, sizeof logfile, "%s/log", dir);
  unlink(portfile); /* a restart must not read the previous run's port */
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    int fd = open(logfile, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) dup2(fd, 2);
    const char *argv[16] = {bin, "--listen", "127.0.0.1:0", "--port-file", portfile,
                            "--state-dir", state, "--threads", threads,
                            "--snapshot-interval", "0", NULL};
    if (memory_mb) {
      argv[11] = "--memory-limit-mb";
      argv[12] = memory_mb;
    }
    execv(bin, (char *const *)argv);
    _exit(127);
  }
  for (int i = 0; i < 1000; i++) {
    FILE *f = fopen(portfile, "r");
    int port = 0;
    if (f) {
      int ok = fscanf(f, "%d", &port) == 1;
      fclose(f);
      if (ok && port > 0) {
        snprintf(addr, len, "127.0.0.1:%d", port);
        return pid;
      }
    }
    if (waitpid(pid, NULL, WNOHANG) == pid) return -1;
    bench__sleep_ms(10);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

typedef struct {
  grpc_channel *ch;
  const char *job;
  size_t n;
  float *stat;
  uint16_t *stat16;
} bench_ctx;

static int bench__push(bench_ctx *c, uint64_t step, int bf16) {
  Precond__V1__PackedMatrix m = PRECOND__V1__PACKED_MATRIX__INIT;
  m.n = (uint32_t)c->n;
  size_t count = pc_packed_len(c->n);
  if (bf16) {
    m.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
    m.data.data = (uint8_t *)c->stat16;
    m.data.len = count * 2;
  } else {
    m.data.data = (uint8_t *)c->stat;
    m.data.len = count * 4;
  }
  Precond__V1__BlockStatistics b = PRECOND__V1__BLOCK_STATISTICS__INIT;
  b.left = &m;
  b.right = &m;
  Precond__V1__BlockStatistics *bp = &b;
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = (char *)c->job;
  req.step = step;
  req.n_blocks = 1;
  req.blocks = &bp;
  ProtobufCMessage *resp = NULL;
  grpc_status_code code;
  char *details = NULL;
  int rc = rpc_call(c->ch, RPC_METHOD_PUSH_STATISTICS, &req.base,
                    &precond__v1__push_response__descriptor, 60000, 0, &resp, &code, &details);
  if (rc != RPC_OK) fprintf(stderr, "push: %s: %s\n", rpc_status_name(code), details);
  free(details);
  if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  return rc;
}

/* Fetches with have = version; returns the newest version seen (or version) and its
 * source step in *source (untouched when nothing newer came). */
static uint64_t bench__fetch(bench_ctx *c, uint64_t version, uint64_t *source) {
  Precond__V1__BlockVersion v = PRECOND__V1__BLOCK_VERSION__INIT;
  v.version = version;
  Precond__V1__BlockVersion *vp = &v;
  Precond__V1__FetchRequest req = PRECOND__V1__FETCH_REQUEST__INIT;
  req.job = (char *)c->job;
  req.n_have = 1;
  req.have = &vp;
  ProtobufCMessage *resp = NULL;
  grpc_status_code code;
  char *details = NULL;
  uint64_t out = version;
  if (rpc_call(c->ch, RPC_METHOD_FETCH_PRECONDITIONERS, &req.base,
               &precond__v1__fetch_response__descriptor, 60000, 0, &resp, &code,
               &details) == RPC_OK) {
    Precond__V1__FetchResponse *f = (Precond__V1__FetchResponse *)resp;
    if (f->n_preconditioners) {
      out = f->preconditioners[0]->version;
      if (source) *source = f->preconditioners[0]->source_step;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
  } else {
    fprintf(stderr, "fetch: %s: %s\n", rpc_status_name(code), details);
  }
  free(details);
  return out;
}

/* Blocks waiting for or in a root computation, from GetStats. */
static uint64_t bench__queue_depth(bench_ctx *c) {
  Precond__V1__StatsRequest req = PRECOND__V1__STATS_REQUEST__INIT;
  ProtobufCMessage *resp = NULL;
  grpc_status_code code;
  char *details = NULL;
  uint64_t depth = 0;
  if (rpc_call(c->ch, RPC_METHOD_GET_STATS, &req.base, &precond__v1__stats_response__descriptor,
               60000, 0, &resp, &code, &details) == RPC_OK) {
    depth = ((Precond__V1__StatsResponse *)resp)->queue_depth;
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  free(details);
  return depth;
}

static int bench__register(bench_ctx *c) {
  uint64_t shape[2] = {c->n, c->n};
  Precond__V1__TensorSpec t = PRECOND__V1__TENSOR_SPEC__INIT;
  t.name = (char *)"w";
  t.n_shape = 2;
  t.shape = shape;
  Precond__V1__TensorSpec *tp = &t;
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  so.block_size = (uint32_t)c->n;
  Precond__V1__RegisterRequest req = PRECOND__V1__REGISTER_REQUEST__INIT;
  req.job = (char *)c->job;
  req.n_tensors = 1;
  req.tensors = &tp;
  req.shampoo = &so;
  ProtobufCMessage *resp = NULL;
  grpc_status_code code;
  char *details = NULL;
  int rc = rpc_call(c->ch, RPC_METHOD_REGISTER, &req.base,
                    &precond__v1__register_response__descriptor, 60000, 1, &resp, &code,
                    &details);
  if (rc != RPC_OK) fprintf(stderr, "register: %s: %s\n", rpc_status_name(code), details);
  free(details);
  if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  return rc;
}

/* A well-conditioned SPD statistic: I + small symmetric noise, packed. */
static void bench__stat(size_t n, float *p) {
  uint64_t s = 7;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++) {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      float noise = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5) * 0.5f / (float)n;
      p[k++] = (i == j ? 1.0f : 0.0f) + noise;
    }
}

/* The seconds of the last log line of dir/log that contains key and ends "in X s". */
static double bench__log_seconds(const char *dir, const char *key) {
  char path[300], line[2048];
  snprintf(path, sizeof path, "%s/log", dir);
  FILE *f = fopen(path, "r");
  double out = -1;
  while (f && fgets(line, sizeof line, f)) {
    const char *in = strstr(line, key) ? strstr(line, " in ") : NULL;
    if (in) out = atof(in + 4);
  }
  if (f) fclose(f);
  return out;
}

static int bench__stop(pid_t pid) {
  kill(pid, SIGTERM);
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* Snapshot write and restore of about mb MiB of statistics (blocks of 256 x 256, one
 * statistic pushed per block; some roots get computed meanwhile and are saved too). */
static int bench__snapshot(const char *bin, const char *threads, size_t mb) {
  char dir[64], addr[300], path[300];
  snprintf(dir, sizeof dir, "/tmp/precondd-bench-XXXXXX");
  if (!mkdtemp(dir)) return 1;
  char mem[32];
  snprintf(mem, sizeof mem, "%zu", 2 * mb + 64); /* statistics and a root pair per block */
  pid_t pid = bench__start(bin, dir, threads, mem, addr, sizeof addr);
  if (pid <= 0) return 1;
  size_t per_block = 2 * pc_packed_len(256) * 4;
  size_t nblocks = (mb << 20) / per_block + 1;
  grpc_channel *ch = rpc_channel_create(addr, 0);
  bench_ctx c = {ch, "snap", 256, malloc(pc_packed_len(256) * 4), NULL};
  int status = 0;
  /* One tensor of 256 rows and 256 * nblocks columns: nblocks blocks of 256 x 256. */
  uint64_t shape[2] = {256, 256 * (uint64_t)nblocks};
  Precond__V1__TensorSpec t = PRECOND__V1__TENSOR_SPEC__INIT;
  t.name = (char *)"w";
  t.n_shape = 2;
  t.shape = shape;
  Precond__V1__TensorSpec *tp = &t;
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  so.block_size = 256;
  so.skip_limit = (uint32_t)(256 * nblocks);
  Precond__V1__RegisterRequest rr = PRECOND__V1__REGISTER_REQUEST__INIT;
  rr.job = (char *)"snap";
  rr.n_tensors = 1;
  rr.tensors = &tp;
  rr.shampoo = &so;
  ProtobufCMessage *resp = NULL;
  grpc_status_code code;
  char *details = NULL;
  if (rpc_call(ch, RPC_METHOD_REGISTER, &rr.base, &precond__v1__register_response__descriptor,
               60000, 1, &resp, &code, &details) != RPC_OK) {
    fprintf(stderr, "register: %s: %s\n", rpc_status_name(code), details);
    status = 1;
  }
  free(details);
  if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  bench__stat(256, c.stat);
  Precond__V1__PackedMatrix m = PRECOND__V1__PACKED_MATRIX__INIT;
  m.n = 256;
  m.data.data = (uint8_t *)c.stat;
  m.data.len = pc_packed_len(256) * 4;
  enum { B = 8 };
  Precond__V1__BlockStatistics b[B], *bp[B];
  for (size_t i = 0; !status && i < nblocks; i += B) {
    size_t k = 0;
    for (; k < B && i + k < nblocks; k++) {
      precond__v1__block_statistics__init(&b[k]);
      b[k].block_id = (uint32_t)(i + k);
      b[k].left = b[k].right = &m;
      bp[k] = &b[k];
    }
    Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
    req.job = (char *)"snap";
    req.step = 1;
    req.n_blocks = k;
    req.blocks = bp;
    if (rpc_call(ch, RPC_METHOD_PUSH_STATISTICS, &req.base,
                 &precond__v1__push_response__descriptor, 60000, 0, &resp, &code,
                 &details) != RPC_OK) {
      fprintf(stderr, "push: %s: %s\n", rpc_status_name(code), details);
      status = 1;
    }
    free(details);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  }
  rpc_channel_destroy(ch);
  free(c.stat);
  if (bench__stop(pid) != 0) status = 1;
  double write_s = bench__log_seconds(dir, "snapshot written");
  snprintf(path, sizeof path, "%s/state/%s", dir, PD_SNAPSHOT_FILE);
  FILE *f = fopen(path, "rb");
  double file_mb = 0;
  if (f) {
    fseek(f, 0, SEEK_END);
    file_mb = (double)ftell(f) / 1048576.0;
    fclose(f);
  }
  pid = bench__start(bin, dir, threads, mem, addr, sizeof addr);
  double restore_s = pid > 0 ? bench__log_seconds(dir, "restored") : -1;
  if (pid <= 0 || bench__stop(pid) != 0) status = 1;
  printf("snapshot_blocks,file_mb,write_s,restore_s\n%zu,%.1f,%.3f,%.3f\n", nblocks, file_mb,
         write_s, restore_s);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) status = 1;
  return status;
}

int main(int argc, char **argv) {
  const char *daemon_bin = NULL, *connect = NULL, *threads = "2", *sizes = "128,512,1024";
  double seconds = 1.0;
  int reps = 5;
  size_t snapshot_mb = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--daemon") && v) daemon_bin = argv[++i];
    else if (!strcmp(a, "--connect") && v) connect = argv[++i];
    else if (!strcmp(a, "--threads") && v) threads = argv[++i];
    else if (!strcmp(a, "--sizes") && v) sizes = argv[++i];
    else if (!strcmp(a, "--seconds") && v) seconds = atof(argv[++i]);
    else if (!strcmp(a, "--reps") && v) reps = atoi(argv[++i]);
    else if (!strcmp(a, "--snapshot-mb") && v) snapshot_mb = strtoul(argv[++i], NULL, 10);
    else {
      fprintf(stderr, "usage: precondd-bench (--daemon PATH [--threads N] | --connect ADDR) "
              "[--sizes 128,512,1024] [--seconds S] [--reps R] [--snapshot-mb M]\n");
      return 2;
    }
  }
  if (!daemon_bin == !connect || reps < 1 || reps > 1000 || !(seconds > 0)) {
    fprintf(stderr, "precondd-bench: give exactly one of --daemon or --connect\n");
    return 2;
  }
  pd_log_set_level(PD_LOG_WARN);
  if (snapshot_mb > 0) {
    if (!daemon_bin || snapshot_mb > 4096) {
      fprintf(stderr, "precondd-bench: --snapshot-mb (1 to 4096) needs --daemon\n");
      return 2;
    }
    return bench__snapshot(daemon_bin, threads, snapshot_mb);
  }
  char dir[64] = "", addr[300];
  pid_t pid = 0;
  if (daemon_bin) {
    snprintf(dir, sizeof dir, "/tmp/precondd-bench-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    pid = bench__start(daemon_bin, dir, threads, NULL, addr, sizeof addr);
    if (pid <= 0) {
      fprintf(stderr, "precondd-bench: cannot start %s (log in %s/log)\n", daemon_bin, dir);
      return 1;
    }
  } else {
    snprintf(addr, sizeof addr, "%s", connect);
  }
  grpc_channel *ch = rpc_channel_create(addr, 0);
  printf("n,encoding,push_per_s,push_mb_per_s,root_ms,fetch_ms,daemon_threads\n");
  int status = 0;
  for (const char *p = sizes; *p;) {
    size_t n = strtoul(p, NULL, 10);
    const char *comma = strchr(p, ',');
    p = comma ? comma + 1 : p + strlen(p);
    if (n < 1 || n > 8192) continue;
    char job[64];
    snprintf(job, sizeof job, "bench-%zu-%d", n, (int)getpid());
    size_t count = pc_packed_len(n);
    bench_ctx c = {ch, job, n, malloc(count * 4), malloc(count * 2)};
    if (!c.stat || !c.stat16 || bench__register(&c) != RPC_OK) {
      status = 1;
      free(c.stat);
      free(c.stat16);
      break;
    }
    bench__stat(n, c.stat);
    pc_f32_to_bf16(count, c.stat, c.stat16);
    uint64_t step = 0, version = 0;
    for (int bf16 = 0; bf16 <= 1; bf16++) {
      /* Throughput: pushes back to back for the given time, after a few untimed ones (a
       * fresh HTTP/2 connection's flow-control windows grow over its first messages). */
      for (int w = 0; w < 10; w++) bench__push(&c, ++step, bf16);
      int pushes = 0;
      double t0 = pd_now();
      while (pd_now() - t0 < seconds && bench__push(&c, ++step, bf16) == RPC_OK) pushes++;
      double dt = pd_now() - t0;
      double bytes = (double)pushes * 2.0 * (double)count * (bf16 ? 2 : 4);
      /* Latency: wait for the queue to settle, then push once and poll for a newer root. */
      double root_ms[1000], fetch_ms[1000];
      int nroot = 0, nfetch = 0;
      for (int r = 0; r < reps; r++) {
        /* Settle: nothing queued or computing, and we hold the newest root. */
        for (int w = 0; w < 100000 && bench__queue_depth(&c) > 0; w++) bench__sleep_ms(2);
        uint64_t v;
        while ((v = bench__fetch(&c, version, NULL)) > version) version = v;
        uint64_t before = version, source = 0, pushed = ++step;
        double t1 = pd_now();
        if (bench__push(&c, pushed, bf16) != RPC_OK) break;
        /* The first fetch that returns a root computed from this push. */
        while (pd_now() - t1 < 120) {
          version = bench__fetch(&c, before, &source);
          if (version > before && source >= pushed) break;
        }
        root_ms[nroot++] = 1e3 * (pd_now() - t1);
        double t2 = pd_now();
        bench__fetch(&c, 0, NULL); /* one full root pair */
        fetch_ms[nfetch++] = 1e3 * (pd_now() - t2);
      }
      printf("%zu,%s,%.1f,%.1f,%.2f,%.3f,%s\n", n, bf16 ? "bf16" : "fp32",
             (double)pushes / dt, bytes / dt / 1048576.0, bench__median(root_ms, nroot),
             bench__median(fetch_ms, nfetch), daemon_bin ? threads : "?");
      fflush(stdout);
    }
    free(c.stat);
    free(c.stat16);
  }
  rpc_channel_destroy(ch);
  if (pid > 0) {
    kill(pid, SIGTERM);
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) status = 1;
    char cmd[200];
    snprintf(cmd, sizeof cmd, "grep -h 'snapshot written' '%s/log' >&2; rm -rf '%s'", dir, dir);
    if (system(cmd) != 0) status = 1;
  }
  return status;
}
