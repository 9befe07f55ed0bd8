/* test_replica.c -- integration tests of daemon replicas: precondd started by a real
 * `mpirun --oversubscribe -np R` (argv[1]: mpirun, argv[2]: precondd), each rank on its own
 * unix socket, clients through proto/rpc.c. Every wait is bounded: a hang fails the test. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "precond.pb-c.h"
#include "preconditioner.h"
#include "mpirun_proc.h"
#include "precondd_proc.h"
#include "rpc.h"

#define MAX_RANKS 4

static const char *g_mpirun, *g_precondd, *g_transformer, *g_precondctl, *g_resnet;

typedef struct {
  mprun run;  /* mpirun, or precondd alone */
  int nranks; /* 0: precondd without mpirun */
  char dir[64];
  char addr[MAX_RANKS][128];
  grpc_channel *ch[MAX_RANKS];
  const char *const *extra; /* more precondd options (NULL-terminated), or NULL */
} cluster;

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Starts `mpirun ... precondd` (nranks > 0) or precondd alone (nranks 0) with the usual
 * options plus extra (NULL-terminated), output into dir/log, in c->run. */
static void spawn(cluster *c, int nranks, const char *const *extra) {
  char sock[128], state[128], port[128], log[128];
  snprintf(sock, sizeof sock, "unix:%s/s-%%r.sock", c->dir);
  snprintf(state, sizeof state, "%s/d-%%r", c->dir);
  snprintf(port, sizeof port, "%s/p-%%r", c->dir);
  snprintf(log, sizeof log, "%s/log", c->dir);
  const char *argv[48];
  int n = 0;
  const char *const common[] = {g_precondd, "--listen",       sock, "--state-dir",
                                state,      "--port-file",    port, "--threads",
                                "1",        "--grace-period", "2",  "--drift-threshold",
                                "0"};
  for (size_t i = 0; i < sizeof common / sizeof common[0]; i++) argv[n++] = common[i];
  for (int i = 0; extra && extra[i]; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  assert_int_equal(mprun_start(&c->run, g_mpirun, nranks, argv, log), 0);
}

/* Occurrences of needle in the file's first 64 KiB. */
static int file_count(const char *path, const char *needle) {
  char buf[1 << 16];
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  int k = 0;
  for (const char *p = buf; (p = strstr(p, needle)) != NULL; p++) k++;
  return k;
}

static int file_has(const char *path, const char *needle) {
  return file_count(path, needle) > 0;
}

static int log_has(const cluster *c, const char *needle) {
  char path[128];
  snprintf(path, sizeof path, "%s/log", c->dir);
  return file_has(path, needle);
}

static void dump_log(const cluster *c) {
  char cmd[160];
  snprintf(cmd, sizeof cmd, "tail -n 40 %s/log >&2", c->dir);
  if (system(cmd) != 0) fprintf(stderr, "(no log)\n");
}

/* 1 if every thread of pid but its main one blocks SIGTERM and SIGINT (SigBlk in
 * /proc/PID/task/TID/status), else 0 (a line on stderr). precondd takes them in its main
 * thread alone (sigtimedwait, which unblocks them there while it waits); one that reached a
 * thread not blocking them, as Open MPI's started by MPI_Init once did, ended the rank by the
 * default action: no final snapshot, mpirun exiting 1 (test_killed_rank's flake). */
static int signals_blocked_off_main(pid_t pid) {
  char path[96], line[256];
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL) return 0;
  const unsigned long long want = 1ULL << (SIGTERM - 1) | 1ULL << (SIGINT - 1);
  int ok = 1;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    long tid = strtol(e->d_name, NULL, 10);
    if (tid <= 0 || tid == pid) continue;
    snprintf(path, sizeof path, "/proc/%d/task/%ld/status", (int)pid, tid);
    FILE *f = fopen(path, "r");
    if (f == NULL) continue; /* the thread ended meanwhile */
    unsigned long long blk = 0;
    int seen = 0;
    while (!seen && fgets(line, sizeof line, f)) seen = sscanf(line, "SigBlk: %llx", &blk) == 1;
    fclose(f);
    if (seen && (blk & want) != want) {
      fprintf(stderr, "precondd %d: thread %ld does not block SIGTERM and SIGINT (SigBlk %llx)\n",
              (int)pid, tid, blk);
      ok = 0;
    }
  }
  closedir(d);
  return ok;
}

/* Starts c->nranks ranks (0: one daemon without mpirun) in c->dir and waits (60 s at most)
 * until every rank wrote its port file; then opens a channel to each, and checks that each
 * rank takes SIGTERM in its main thread alone (signals_blocked_off_main). */
static void cluster_run(cluster *c) {
  int n = c->nranks > 0 ? c->nranks : 1;
  char pf[128];
  for (int r = 0; r < n; r++) {
    snprintf(pf, sizeof pf, "%s/p-%d", c->dir, r);
    unlink(pf);
  }
  spawn(c, c->nranks, c->extra);
  snprintf(pf, sizeof pf, "%s/p-%%r", c->dir);
  int up = mprun_wait_files(&c->run, pf, 60000);
  if (up != 0) {
    dump_log(c);
    fail_msg("%s",
             up > 0 ? "the daemons exited before listening" : "a rank did not listen within 60 s");
  }
  for (int r = 0; r < n; r++) {
    snprintf(c->addr[r], sizeof c->addr[r], "unix:%s/s-%d.sock", c->dir, r);
    c->ch[r] = rpc_channel_create(c->addr[r], 0);
    assert_non_null(c->ch[r]);
    pid_t pid = mprun_rank_pid(&c->run, r);
    assert_true(pid > 0);
    assert_int_equal(signals_blocked_off_main(pid), 1);
  }
}

/* Starts nranks ranks in a new temporary directory, with the options extra (NULL: none). */
static void cluster_start_with(cluster *c, int nranks, const char *const *extra) {
  memset(c, 0, sizeof *c);
  snprintf(c->dir, sizeof c->dir, "/tmp/pdrep-XXXXXX");
  assert_non_null(mkdtemp(c->dir));
  c->nranks = nranks;
  c->extra = extra;
  cluster_run(c);
}

static void cluster_start(cluster *c, int nranks) {
  cluster_start_with(c, nranks, NULL);
}

/* SIGTERM to every rank; all must exit 0 within 30 s (mpirun's status says so). The
 * directory stays (cluster_run starts them again on their snapshots). */
static void cluster_halt(cluster *c) {
  for (int r = 0; r < MAX_RANKS; r++) {
    if (c->ch[r]) rpc_channel_destroy(c->ch[r]);
    c->ch[r] = NULL;
  }
  /* To the ranks, not mpirun (which would exit 1 whatever they did). */
  assert_int_equal(mprun_signal_ranks(&c->run, SIGTERM), c->nranks > 0 ? c->nranks : 1);
  int st = mprun_wait(&c->run, 30000);
  if (st != 0) dump_log(c);
  assert_int_equal(st, 0);
}

/* cluster_halt, and the directory removed. */
static void cluster_stop(cluster *c) {
  cluster_halt(c);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", c->dir);
  assert_int_equal(system(cmd), 0);
}

/* ---- calls ---------------------------------------------------------------------------- */

static grpc_status_code call(grpc_channel *ch, const char *method, ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *desc, void *resp, char *msg) {
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  char *details = NULL;
  ProtobufCMessage *r = NULL;
  rpc_call(ch, method, req, desc, 20000, 0, &r, &code, &details);
  if (msg) snprintf(msg, 512, "%s", details ? details : "");
  free(details);
  *(ProtobufCMessage **)resp = r;
  return code;
}

/* The job of these tests: tensors whose blocks (block size 32) have unequal costs. */
static const uint64_t g_shapes[][2] = {{64, 32}, {32, 20}, {48, 16}, {8, 12}, {40, 40}};
#define NT (sizeof g_shapes / sizeof g_shapes[0])

static grpc_status_code do_register(grpc_channel *ch, const char *job, size_t nt,
                                    Precond__V1__RegisterResponse **resp, char *msg) {
  Precond__V1__TensorSpec specs[NT], *ptrs[NT];
  char names[NT][24];
  for (size_t i = 0; i < nt; i++) {
    precond__v1__tensor_spec__init(&specs[i]);
    snprintf(names[i], sizeof names[i], "t%zu", i);
    specs[i].name = names[i];
    specs[i].n_shape = 2;
    specs[i].shape = (uint64_t *)g_shapes[i];
    ptrs[i] = &specs[i];
  }
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  so.block_size = 32;
  Precond__V1__RegisterRequest req = PRECOND__V1__REGISTER_REQUEST__INIT;
  req.shampoo = &so;
  req.job = (char *)job;
  req.n_tensors = nt;
  req.tensors = ptrs;
  req.worker = (char *)"test";
  return call(ch, RPC_METHOD_REGISTER, &req.base, &precond__v1__register_response__descriptor, resp,
              msg);
}

/* Deterministic pseudo-random numbers in [-1, 1). */
static float rnd(uint64_t *s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Packed G G^T of a random n x (n + 3) matrix. */
static float *random_stat(size_t n, uint64_t seed) {
  size_t k = n + 3;
  float *g = malloc(n * k * sizeof *g), *p = malloc(pc_packed_len(n) * sizeof *p);
  assert_true(g && p);
  for (size_t i = 0; i < n * k; i++) g[i] = rnd(&seed);
  assert_int_equal(pc_gram_f32(n, k, g, k, p, NULL), PC_OK);
  free(g);
  return p;
}

/* Pushes step's statistics of every block of the layout (seeded by block and step) to ch. */
static void push_all(grpc_channel *ch, const char *job, const Precond__V1__RegisterResponse *lay,
                     uint64_t step) {
  size_t nb = lay->n_blocks;
  Precond__V1__PackedMatrix *m = calloc(2 * nb, sizeof *m);
  Precond__V1__BlockStatistics *b = calloc(nb, sizeof *b), **ptrs = calloc(nb, sizeof *ptrs);
  float **vals = calloc(2 * nb, sizeof *vals);
  assert_true(m && b && ptrs && vals);
  for (size_t i = 0; i < nb; i++) {
    const Precond__V1__BlockInfo *bi = lay->blocks[i];
    uint64_t n[2] = {bi->rows, bi->cols};
    precond__v1__block_statistics__init(&b[i]);
    b[i].block_id = bi->block_id;
    for (int k = 0; k < 2; k++) {
      vals[2 * i + k] = random_stat(n[k], 1000 * step + 10 * i + (uint64_t)k);
      precond__v1__packed_matrix__init(&m[2 * i + k]);
      m[2 * i + k].n = (uint32_t)n[k];
      m[2 * i + k].data.data = (uint8_t *)vals[2 * i + k];
      m[2 * i + k].data.len = pc_packed_len(n[k]) * 4;
    }
    b[i].left = &m[2 * i];
    b[i].right = &m[2 * i + 1];
    ptrs[i] = &b[i];
  }
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = (char *)job;
  req.step = step;
  req.n_blocks = nb;
  req.blocks = ptrs;
  Precond__V1__PushResponse *resp = NULL;
  char msg[512];
  assert_int_equal(call(ch, RPC_METHOD_PUSH_STATISTICS, &req.base,
                        &precond__v1__push_response__descriptor, &resp, msg),
                   GRPC_STATUS_OK);
  assert_int_equal(resp->accepted, nb);
  protobuf_c_message_free_unpacked(&resp->base, NULL);
  for (size_t i = 0; i < 2 * nb; i++) free(vals[i]);
  free(vals);
  free(m);
  free(b);
  free(ptrs);
}

/* Fetches (have = nothing) until every one of nb blocks has a root of source step >= step
 * (30 s at most); the answer, blocks in id order. */
static Precond__V1__FetchResponse *wait_roots(grpc_channel *ch, const char *job, size_t nb,
                                              uint64_t step) {
  for (int tries = 0; tries < 1500; tries++) {
    Precond__V1__FetchRequest req = PRECOND__V1__FETCH_REQUEST__INIT;
    req.job = (char *)job;
    Precond__V1__FetchResponse *f = NULL;
    assert_int_equal(call(ch, RPC_METHOD_FETCH_PRECONDITIONERS, &req.base,
                          &precond__v1__fetch_response__descriptor, &f, NULL),
                     GRPC_STATUS_OK);
    size_t ok = 0;
    for (size_t i = 0; i < f->n_preconditioners; i++)
      ok += f->preconditioners[i]->source_step >= step;
    if (ok == nb) return f;
    protobuf_c_message_free_unpacked(&f->base, NULL);
    sleep_ms(20);
  }
  fail_msg("job %s: roots of step %llu did not arrive within 30 s", job, (unsigned long long)step);
  return NULL;
}

static Precond__V1__StatsResponse *get_stats(grpc_channel *ch, const char *job) {
  Precond__V1__StatsRequest req = PRECOND__V1__STATS_REQUEST__INIT;
  req.job = (char *)job;
  req.blocks = 1;
  Precond__V1__StatsResponse *s = NULL;
  assert_int_equal(
      call(ch, RPC_METHOD_GET_STATS, &req.base, &precond__v1__stats_response__descriptor, &s, NULL),
      GRPC_STATUS_OK);
  return s;
}

/* Starts nranks ranks (the options extra; NULL: none) in a new directory and registers job
 * (the tests' tensors) on rank 0; its layout (the caller frees it). */
static Precond__V1__RegisterResponse *cluster_with_job(cluster *c, int nranks,
                                                       const char *const *extra, const char *job) {
  cluster_start_with(c, nranks, extra);
  Precond__V1__RegisterResponse *lay = NULL;
  char msg[512];
  assert_int_equal(do_register(c->ch[0], job, NT, &lay, msg), GRPC_STATUS_OK);
  return lay;
}

/* Waits until every rank of c serves roots of step (or later) for all nb blocks of job. */
static void wait_roots_everywhere(const cluster *c, const char *job, size_t nb, uint64_t step) {
  for (int r = 0; r < (c->nranks > 0 ? c->nranks : 1); r++) {
    Precond__V1__FetchResponse *f = wait_roots(c->ch[r], job, nb, step);
    protobuf_c_message_free_unpacked(&f->base, NULL);
  }
}

/* cluster_with_job on 2 ranks, statistics of step 1 pushed to rank 0, and every rank holding
 * every root of them; the layout. */
static Precond__V1__RegisterResponse *cluster_with_roots(cluster *c, const char *job) {
  Precond__V1__RegisterResponse *lay = cluster_with_job(c, 2, NULL, job);
  push_all(c->ch[0], job, lay, 1);
  wait_roots_everywhere(c, job, lay->n_blocks, 1);
  return lay;
}

/* max |a - b| / max |b| over n packed values. */
static double rel_diff(size_t n, const uint8_t *a, const uint8_t *b) {
  double md = 0, mb = 0;
  for (size_t i = 0; i < n; i++) {
    float x, y;
    memcpy(&x, a + 4 * i, 4);
    memcpy(&y, b + 4 * i, 4);
    md = fmax(md, fabs((double)x - y));
    mb = fmax(mb, fabs((double)y));
  }
  return mb > 0 ? md / mb : md;
}

/* ---- tests ---------------------------------------------------------------------------- */

/* R ranks: the ownership every rank answers is the same partition, balanced within the
 * greedy bound and reported per rank in GetStats; statistics pushed to rank 0 alone reach
 * each owner, and every rank then serves every root: the owner's, bit for bit, under the
 * owner's version, equal (fp32 tolerance) to what one daemon alone computes from the same
 * statistics. */
static void check_replicas(int nranks) {
  const char *job = "rep";
  cluster one, c;
  cluster_start(&one, 0);
  cluster_start(&c, nranks);

  Precond__V1__RegisterResponse *lay[MAX_RANKS] = {NULL}, *lay1 = NULL;
  char msg[512];
  for (int r = 0; r < nranks; r++)
    assert_int_equal(do_register(c.ch[r], job, NT, &lay[r], msg), GRPC_STATUS_OK);
  assert_int_equal(do_register(one.ch[0], job, NT, &lay1, msg), GRPC_STATUS_OK);
  size_t nb = lay[0]->n_blocks;
  assert_int_equal(lay1->n_blocks, nb);
  assert_true(nb >= (size_t)nranks);

  /* A partition: one owner per block, the same on every rank; every rank owns some. */
  double load[MAX_RANKS] = {0}, maxcost = 0;
  for (size_t i = 0; i < nb; i++) {
    const Precond__V1__BlockInfo *b = lay[0]->blocks[i];
    assert_true(b->owner >= 0 && b->owner < nranks);
    for (int r = 1; r < nranks; r++) assert_int_equal(lay[r]->blocks[i]->owner, b->owner);
    assert_int_equal(lay1->blocks[i]->owner, 0);
    double cost = pow((double)b->rows, 3) + pow((double)b->cols, 3);
    load[b->owner] += cost;
    maxcost = fmax(maxcost, cost);
  }
  double lo = INFINITY, hi = 0;
  for (int r = 0; r < nranks; r++) {
    assert_true(load[r] > 0);
    lo = fmin(lo, load[r]);
    hi = fmax(hi, load[r]);
  }
  assert_true(hi - lo <= maxcost); /* the greedy bound */

  push_all(c.ch[0], job, lay[0], 1);
  push_all(one.ch[0], job, lay1, 1);
  Precond__V1__FetchResponse *ref = wait_roots(one.ch[0], job, nb, 1);
  Precond__V1__FetchResponse *f[MAX_RANKS];
  for (int r = 0; r < nranks; r++) f[r] = wait_roots(c.ch[r], job, nb, 1);
  for (size_t i = 0; i < nb; i++) {
    const Precond__V1__BlockRoots *a = f[0]->preconditioners[i];
    assert_int_equal(a->block_id, i);
    for (int r = 1; r < nranks; r++) {
      const Precond__V1__BlockRoots *o = f[r]->preconditioners[i];
      assert_int_equal(o->version, a->version);
      assert_int_equal(o->left->data.len, a->left->data.len);
      assert_memory_equal(o->left->data.data, a->left->data.data, a->left->data.len);
      assert_memory_equal(o->right->data.data, a->right->data.data, a->right->data.len);
    }
    const Precond__V1__BlockRoots *s = ref->preconditioners[i];
    assert_true(rel_diff(a->left->data.len / 4, a->left->data.data, s->left->data.data) < 1e-4);
    assert_true(rel_diff(a->right->data.len / 4, a->right->data.data, s->right->data.data) < 1e-4);
  }

  /* Each rank reports itself, the ownership and the per-rank load; roots crossed ranks. */
  for (int r = 0; r < nranks; r++) {
    Precond__V1__StatsResponse *s = get_stats(c.ch[r], job);
    assert_int_equal(s->replicas, nranks);
    assert_int_equal(s->rank, r);
    assert_non_null(s->replica);
    assert_true(s->replica->roots_received > 0);
    assert_true(s->replica->roots_sent > 0);
    assert_int_equal(s->n_block_stats, nb);
    for (size_t i = 0; i < nb; i++)
      assert_int_equal(s->block_stats[i]->owner, lay[0]->blocks[i]->owner);
    assert_int_equal(s->job_stats[0]->n_rank_load, nranks);
    for (int k = 0; k < nranks; k++) assert_true(s->job_stats[0]->rank_load[k] == load[k]);
    protobuf_c_message_free_unpacked(&s->base, NULL);
  }
  Precond__V1__StatsResponse *s0 = get_stats(c.ch[0], job);
  assert_true(s0->replica->stats_forwarded > 0); /* rank 0 got every push */
  assert_int_equal(s0->replica->mpi_errors, 0);
  protobuf_c_message_free_unpacked(&s0->base, NULL);

  for (int r = 0; r < nranks; r++) {
    protobuf_c_message_free_unpacked(&f[r]->base, NULL);
    protobuf_c_message_free_unpacked(&lay[r]->base, NULL);
  }
  protobuf_c_message_free_unpacked(&ref->base, NULL);
  protobuf_c_message_free_unpacked(&lay1->base, NULL);
  cluster_stop(&c);
  cluster_stop(&one);
}

static void test_two_ranks(void **state) {
  (void)state;
  check_replicas(2);
}

/* Three ranks; and a job with fewer units than ranks is refused with a clear message. */
static void test_three_ranks(void **state) {
  (void)state;
  check_replicas(3);
  cluster c;
  cluster_start(&c, 3);
  Precond__V1__RegisterResponse *lay = NULL;
  char msg[512];
  /* t0 alone: 64 x 32 is two blocks of 32 x 32. */
  assert_int_equal(do_register(c.ch[1], "small", 1, &lay, msg), GRPC_STATUS_FAILED_PRECONDITION);
  assert_non_null(strstr(msg, "2 units for 3 daemon replicas"));
  cluster_stop(&c);
}

/* A job registered on rank 0 alone reaches rank 1 (it serves it without a Register); after
 * a restart of the whole job every rank serves the roots it held, under the same versions,
 * from its own snapshot, and new statistics give new roots everywhere. */
static void test_restart(void **state) {
  (void)state;
  const char *job = "again";
  cluster c;
  Precond__V1__RegisterResponse *lay = cluster_with_job(&c, 2, NULL, job);
  size_t nb = lay->n_blocks;
  Precond__V1__FetchResponse *f = NULL;
  for (int t = 0; t < 500; t++) { /* the job reaches rank 1 through MPI, not a Register */
    Precond__V1__FetchRequest req = PRECOND__V1__FETCH_REQUEST__INIT;
    req.job = (char *)job;
    if (call(c.ch[1], RPC_METHOD_FETCH_PRECONDITIONERS, &req.base,
             &precond__v1__fetch_response__descriptor, &f, NULL) == GRPC_STATUS_OK)
      break;
    sleep_ms(20);
  }
  assert_non_null(f);
  protobuf_c_message_free_unpacked(&f->base, NULL);
  push_all(c.ch[1], job, lay, 1);
  Precond__V1__FetchResponse *before[2];
  for (int r = 0; r < 2; r++) before[r] = wait_roots(c.ch[r], job, nb, 1);
  cluster_halt(&c);
  cluster_run(&c);
  for (int r = 0; r < 2; r++) {
    Precond__V1__FetchResponse *after = wait_roots(c.ch[r], job, nb, 1);
    for (size_t i = 0; i < nb; i++) {
      assert_int_equal(after->preconditioners[i]->version, before[r]->preconditioners[i]->version);
      assert_int_equal(after->preconditioners[i]->version, before[0]->preconditioners[i]->version);
    }
    protobuf_c_message_free_unpacked(&after->base, NULL);
  }
  for (int r = 0; r < 2; r++) protobuf_c_message_free_unpacked(&before[r]->base, NULL);
  push_all(c.ch[0], job, lay, 2);
  wait_roots_everywhere(&c, job, nb, 2);
  protobuf_c_message_free_unpacked(&lay->base, NULL);
  cluster_stop(&c);
}

/* Roots of step `step` on every rank of c equal (fp32 tolerance) the reference daemon's of
 * the same step, which saw every push of the run. */
static void check_against(const cluster *c, const char *job, size_t nb, uint64_t step,
                          const Precond__V1__FetchResponse *ref) {
  for (int r = 0; r < (c->nranks > 0 ? c->nranks : 1); r++) {
    Precond__V1__FetchResponse *f = wait_roots(c->ch[r], job, nb, step);
    for (size_t i = 0; i < nb; i++) {
      const Precond__V1__BlockRoots *a = f->preconditioners[i], *s = ref->preconditioners[i];
      assert_int_equal(a->source_step, step);
      assert_true(rel_diff(a->left->data.len / 4, a->left->data.data, s->left->data.data) < 1e-4);
      assert_true(rel_diff(a->right->data.len / 4, a->right->data.data, s->right->data.data) <
                  1e-4);
    }
    protobuf_c_message_free_unpacked(&f->base, NULL);
  }
}

/* Every rank of c (resumed) serves every root of step - 1 at once, from the snapshots, and
 * tells a client that registers the job was resumed: its last step and a daemon epoch above
 * every one before (*epoch, raised to the highest now). */
static void check_resumed(const cluster *c, const char *job, size_t nb, uint64_t step,
                          uint64_t *epoch) {
  uint64_t top = *epoch;
  for (int r = 0; r < (c->nranks > 0 ? c->nranks : 1); r++) {
    Precond__V1__RegisterResponse *lay = NULL;
    char msg[512];
    assert_int_equal(do_register(c->ch[r], job, NT, &lay, msg), GRPC_STATUS_OK);
    assert_int_equal(lay->resumed_step, step - 1);
    assert_true(lay->daemon_epoch > *epoch);
    if (lay->daemon_epoch > top) top = lay->daemon_epoch;
    for (size_t i = 0; i < nb; i++)
      assert_true(lay->blocks[i]->owner >= 0 &&
                  lay->blocks[i]->owner < (c->nranks > 0 ? c->nranks : 1));
    protobuf_c_message_free_unpacked(&lay->base, NULL);
    Precond__V1__FetchRequest req = PRECOND__V1__FETCH_REQUEST__INIT;
    req.job = (char *)job;
    Precond__V1__FetchResponse *f = NULL;
    assert_int_equal(call(c->ch[r], RPC_METHOD_FETCH_PRECONDITIONERS, &req.base,
                          &precond__v1__fetch_response__descriptor, &f, NULL),
                     GRPC_STATUS_OK);
    assert_int_equal(f->n_preconditioners, nb); /* none waits for a computation */
    for (size_t i = 0; i < nb; i++) assert_int_equal(f->preconditioners[i]->source_step, step - 1);
    protobuf_c_message_free_unpacked(&f->base, NULL);
  }
  *epoch = top;
}

/* The daemon job restarted with another rank count resumes from the old ranks' snapshots:
 * 2 ranks -> one daemon alone -> 2 ranks -> 3 ranks, one step of statistics pushed in each
 * (to one rank: the others' units are forwarded). After each resume every rank serves every
 * root at once and clients see the resume; the next step's roots equal those of one daemon
 * that got every push: no statistics were lost or doubled on the way. Then an old snapshot
 * missing: every rank stops, naming the file. */
static void test_rank_count_change(void **state) {
  (void)state;
  const char *job = "resize";
  cluster one, c;
  cluster_start(&one, 0);
  Precond__V1__RegisterResponse *lay1 = NULL, *lay = cluster_with_job(&c, 2, NULL, job);
  char msg[512];
  assert_int_equal(do_register(one.ch[0], job, NT, &lay1, msg), GRPC_STATUS_OK);
  size_t nb = lay->n_blocks;
  uint64_t epoch = lay->daemon_epoch;
  static const int counts[] = {2, 0, 2, 3}; /* 0: one daemon without mpirun */
  for (uint64_t step = 1; step <= 4; step++) {
    if (step > 1) {
      cluster_halt(&c); /* each rank writes its snapshot */
      c.nranks = counts[step - 1];
      cluster_run(&c);
      check_resumed(&c, job, nb, step, &epoch);
    }
    int n = c.nranks > 0 ? c.nranks : 1;
    push_all(c.ch[(step - 1) % (uint64_t)n], job, lay, step);
    push_all(one.ch[0], job, lay1, step);
    Precond__V1__FetchResponse *ref = wait_roots(one.ch[0], job, nb, step);
    check_against(&c, job, nb, step, ref);
    protobuf_c_message_free_unpacked(&ref->base, NULL);
  }
  assert_true(log_has(&c, "resumed 1 jobs of a daemon job of 2 rank(s) as rank 2 of 3"));
  /* Rank 2 of 3 had no old directory of its own: both old snapshots came over MPI, from
   * ranks 0 and 1 (the state directories need not be shared). */
  assert_true(log_has(&c, "(2 of the old snapshots received from other ranks)"));
  cluster_halt(&c);
  char gone[160];
  snprintf(gone, sizeof gone, "%s/d-2/precondd.snap", c.dir);
  assert_int_equal(unlink(gone), 0);
  spawn(&c, 2, c.extra);
  int st = mprun_wait(&c.run, 60000);
  if (st <= 0) dump_log(&c);
  assert_true(st > 0);
  assert_true(log_has(&c, "the snapshot of rank 2 of 3"));
  assert_true(log_has(&c, "d-2/precondd.snap, is missing"));
  protobuf_c_message_free_unpacked(&lay->base, NULL);
  protobuf_c_message_free_unpacked(&lay1->base, NULL);
  c.nranks = 3;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", c.dir);
  assert_int_equal(system(cmd), 0);
  cluster_stop(&one);
}

/* precondctl stats on a rank shows the replicas, what crossed ranks and each job's load per
 * rank (the shares of the GetStats rank_load), precondctl blocks each block's owner; an
 * EndJob on one rank ends the job on every rank. */
static void test_end_job_and_ctl(void **state) {
  (void)state;
  const char *job = "ending";
  cluster c;
  Precond__V1__RegisterResponse *lay = cluster_with_roots(&c, job);
  size_t nb = lay->n_blocks;
  char msg[512];

  double load[2] = {0, 0}, ones = 0;
  for (size_t i = 0; i < nb; i++) {
    const Precond__V1__BlockInfo *b = lay->blocks[i];
    load[b->owner] += pow((double)b->rows, 3) + pow((double)b->cols, 3);
    ones += b->owner == 1;
  }
  char out[160], cmd[512], want[160];
  snprintf(out, sizeof out, "%s/ctl.txt", c.dir);
  snprintf(cmd, sizeof cmd, "%s --addr %s stats > %s 2>&1", g_precondctl, c.addr[1], out);
  assert_int_equal(system(cmd), 0);
  assert_true(file_has(out, "rank 1 of 2 replicas"));
  assert_true(file_has(out, "rank 1 of 2: roots "));
  assert_true(file_has(out, "0 MPI errors"));
  snprintf(want, sizeof want, "%-24s 0: %.1f%% 1: %.1f%%\n", job,
           100 * load[0] / (load[0] + load[1]), 100 * load[1] / (load[0] + load[1]));
  assert_true(file_has(out, want));
  snprintf(cmd, sizeof cmd, "%s --addr %s --json blocks > %s 2>&1", g_precondctl, c.addr[1], out);
  assert_int_equal(system(cmd), 0);
  assert_int_equal(file_count(out, "\"owner\":1"), (int)ones);

  /* EndJob on rank 1: rank 0 ends the job too (within 10 s), and knows it no more. */
  Precond__V1__EndJobRequest end = PRECOND__V1__END_JOB_REQUEST__INIT;
  end.job = (char *)job;
  Precond__V1__EndJobResponse *er = NULL;
  assert_int_equal(call(c.ch[1], RPC_METHOD_END_JOB, &end.base,
                        &precond__v1__end_job_response__descriptor, &er, msg),
                   GRPC_STATUS_OK);
  assert_int_equal(er->blocks, nb);
  protobuf_c_message_free_unpacked(&er->base, NULL);
  grpc_status_code code = GRPC_STATUS_OK;
  for (int t = 0; t < 500 && code == GRPC_STATUS_OK; t++) {
    Precond__V1__FetchRequest req = PRECOND__V1__FETCH_REQUEST__INIT;
    req.job = (char *)job;
    Precond__V1__FetchResponse *f = NULL;
    code = call(c.ch[0], RPC_METHOD_FETCH_PRECONDITIONERS, &req.base,
                &precond__v1__fetch_response__descriptor, &f, NULL);
    if (f) protobuf_c_message_free_unpacked(&f->base, NULL);
    if (code == GRPC_STATUS_OK) sleep_ms(20);
  }
  assert_int_equal(code, GRPC_STATUS_NOT_FOUND);
  er = NULL;
  assert_int_equal(call(c.ch[0], RPC_METHOD_END_JOB, &end.base,
                        &precond__v1__end_job_response__descriptor, &er, msg),
                   GRPC_STATUS_NOT_FOUND);
  if (er) protobuf_c_message_free_unpacked(&er->base, NULL);
  assert_true(log_has(&c, "job ending ended by another rank"));
  protobuf_c_message_free_unpacked(&lay->base, NULL);
  cluster_stop(&c);
}

/* Misconfigurations end every rank with a message, never a hang: ranks sharing a state
 * directory are refused at once; a rank that cannot bind (two ranks, one socket) stops the
 * others through the startup agreement. */
static void test_bad_starts(void **state) {
  (void)state;
  cluster c;
  memset(&c, 0, sizeof c);
  snprintf(c.dir, sizeof c.dir, "/tmp/pdrep-XXXXXX");
  assert_non_null(mkdtemp(c.dir));
  char shared[128];
  snprintf(shared, sizeof shared, "%s/shared", c.dir);
  const char *const same_state[] = {"--state-dir", shared, NULL};
  spawn(&c, 2, same_state);
  int st = mprun_wait(&c.run, 30000);
  assert_true(st > 0);
  assert_true(log_has(&c, "put %r in it"));

  /* A free TCP port both ranks ask for (precondd turns SO_REUSEPORT off: one bind fails). */
  int port = pdproc_free_port();
  assert_true(port > 0);
  char sock[64];
  snprintf(sock, sizeof sock, "127.0.0.1:%d", port);
  const char *const same_socket[] = {"--listen", sock, NULL};
  spawn(&c, 2, same_socket);
  st = mprun_wait(&c.run, 60000);
  if (st <= 0) dump_log(&c);
  assert_true(st > 0);
  assert_true(log_has(&c, "another replica failed to start"));
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", c.dir);
  assert_int_equal(system(cmd), 0);
}

/* Column 4 (train_loss) of every data line of dir/train.csv into loss[]; their count. */
static int read_losses(const char *dir, double *loss, int max) {
  char path[160], line[512];
  snprintf(path, sizeof path, "%s/train.csv", dir);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  int n = 0;
  while (fgets(line, sizeof line, f) && n < max) {
    double step, wall, ms, l;
    if (sscanf(line, "%lf,%lf,%lf,%lf", &step, &wall, &ms, &l) == 4) loss[n++] = l;
  }
  fclose(f);
  return n;
}

/* Starts a benchmark client: model (NULL-terminated: the program and its model's options)
 * with --daemon daemon --out dir/out and the options extra (NULL-terminated; NULL: none),
 * alone (nworkers 0) or as nworkers data-parallel workers; its log in dir/<out>.log, the
 * process in w. */
static void start_client(mprun *w, const char *dir, const char *out, int nworkers,
                         const char *daemon, const char *const *model, const char *const *extra) {
  char outdir[128], log[160];
  snprintf(outdir, sizeof outdir, "%s/%s", dir, out);
  snprintf(log, sizeof log, "%s/%s.log", dir, out);
  const char *argv[64];
  int n = 0;
  for (int i = 0; model[i]; i++) argv[n++] = model[i];
  const char *const common[] = {"--quiet", "--daemon", daemon, "--out", outdir};
  for (size_t i = 0; i < sizeof common / sizeof common[0]; i++) argv[n++] = common[i];
  for (int i = 0; extra && extra[i]; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  assert_int_equal(mprun_start(w, g_mpirun, nworkers, argv, log), 0);
}

/* The Transformer (tiny: one layer, width 64, batch 8, Shampoo) for steps steps: as
 * start_client. */
static void start_transformer(mprun *w, const char *dir, const char *out, int nworkers,
                              const char *daemon, const char *steps, const char *const *extra) {
  const char *const model[] = {g_transformer, "--optimizer",    "shampoo", "--steps",
                               steps,         "--batch",        "8",       "--context",
                               "32",          "--d-model",      "64",      "--layers",
                               "1",           "--block-size",   "32",      "--eval-every",
                               "0",           "--eval-batches", "2",       NULL};
  start_client(w, dir, out, nworkers, daemon, model, extra);
}

/* Waits ms at most for the client w (output dir/out); its exit status, the log's
 * tail on stderr when not 0 (-1: still running). */
static int wait_client(mprun *w, const char *dir, const char *out, long ms) {
  int st = mprun_wait(w, ms);
  if (st != 0) {
    char cmd[200];
    snprintf(cmd, sizeof cmd, "tail -n 30 %s/%s.log >&2", dir, out);
    if (system(cmd) != 0) fprintf(stderr, "(no log)\n");
  }
  return st;
}

/* The Transformer for 20 steps (roots synchronous if sync); its exit status (-1: not
 * within 240 s). */
static int run_transformer(const char *dir, const char *out, int nworkers, const char *daemon,
                           int sync) {
  const char *const sync_roots[] = {"--sync-roots", NULL};
  mprun w;
  start_transformer(&w, dir, out, nworkers, daemon, "20", sync ? sync_roots : NULL);
  return wait_client(&w, dir, out, 240000);
}

/* Asserts that the log's two workers (the result lines, "<model> <optimizer>: final ...",
 * of a data-parallel run) end with the same model: the same evaluation, to the digit. */
static void assert_same_final_eval(const char *log) {
  char line[256], finals[2][256];
  FILE *f = fopen(log, "r");
  assert_non_null(f);
  int nf = 0;
  while (fgets(line, sizeof line, f)) {
    char *median = strstr(line, ", median step");
    if (strstr(line, ": final ") != NULL && median != NULL && nf < 2) {
      *median = '\0'; /* the evaluation and the steps, not the timings */
      snprintf(finals[nf++], sizeof finals[0], "%s", line);
    }
  }
  fclose(f);
  assert_int_equal(nf, 2);
  assert_string_equal(finals[0], finals[1]);
}

/* The largest relative difference between the per-step training losses of dir1/out1 and
 * dir2/out2, which must both have steps steps. */
static double loss_diff(const char *dir1, const char *out1, const char *dir2, const char *out2,
                        int steps) {
  double a[64], b[64];
  char d1[160], d2[160];
  snprintf(d1, sizeof d1, "%s/%s", dir1, out1);
  snprintf(d2, sizeof d2, "%s/%s", dir2, out2);
  assert_int_equal(read_losses(d1, a, 64), steps);
  assert_int_equal(read_losses(d2, b, 64), steps);
  double worst = 0;
  for (int i = 0; i < steps; i++) worst = fmax(worst, fabs(a[i] - b[i]) / fabs(a[i]));
  return worst;
}

/* One daemon alone (one) and 2 daemon ranks (two) for data-parallel comparisons; the
 * addresses the clients take (daemon2 with %r: each worker its rank's), 160 bytes each. */
static void dp_clusters(cluster *one, cluster *two, char *daemon1, char *daemon2) {
  cluster_start(one, 0);
  cluster_start(two, 2);
  snprintf(daemon1, 160, "unix:%s/s-0.sock", one->dir);
  snprintf(daemon2, 160, "unix:%s/s-%%r.sock", two->dir);
}

/* Two data-parallel workers, each on its own rank of two daemon replicas, with roots
 * synchronous, train the model one worker trains with one daemon: every step's loss equal
 * within 1e-4 relative (float reduction order: the batch's mean is the mean of two halves'
 * means, the gradients are averaged by MPI_Allreduce). Each worker computes the statistics
 * of half the blocks. A worker count that does not divide the batch is refused. */
static void test_data_parallel(void **state) {
  (void)state;
  cluster one, two;
  char daemon1[160], daemon2[160];
  dp_clusters(&one, &two, daemon1, daemon2);
  assert_int_equal(run_transformer(one.dir, "w1", 0, daemon1, 1), 0);
  assert_int_equal(run_transformer(two.dir, "w2", 2, daemon2, 1), 0);
  double worst = loss_diff(one.dir, "w1", two.dir, "w2", 20);
  fprintf(stderr, "data-parallel: largest relative loss difference %.3g over 20 steps\n", worst);
  assert_true(worst <= 1e-4);
  char d1[128], log2[160];
  double a[32];
  snprintf(d1, sizeof d1, "%s/w1", one.dir);
  int na = read_losses(d1, a, 32);
  assert_true(a[na - 1] < a[0]); /* it trained */
  snprintf(log2, sizeof log2, "%s/w2.log", two.dir);
  assert_true(file_has(log2, "data-parallel worker 0 of 2"));
  assert_true(file_has(log2, "data-parallel worker 1 of 2"));
  Precond__V1__StatsResponse *s = get_stats(two.ch[0], "");
  assert_int_equal(s->replica->stats_forwarded, 0); /* each pushed its own rank's blocks */
  assert_true(s->replica->roots_received > 0);
  protobuf_c_message_free_unpacked(&s->base, NULL);

  /* Roots asynchronous: the workers still apply the same daemon versions (agreed each
   * step), so both end with the same model: the same final evaluation, to the digit. */
  assert_int_equal(run_transformer(two.dir, "wa", 2, daemon2, 0), 0);
  char loga[160];
  snprintf(loga, sizeof loga, "%s/wa.log", two.dir);
  assert_same_final_eval(loga);

  char log3[160];
  snprintf(log3, sizeof log3, "%s/w3.log", two.dir);
  const char *const args[] = {g_transformer, "--optimizer", "shampoo", "--steps", "2", "--batch",
                              "8",           "--daemon",    daemon2,   "--quiet", NULL};
  mprun w3;
  assert_int_equal(mprun_start(&w3, g_mpirun, 3, args, log3), 0);
  int st = mprun_wait(&w3, 60000);
  assert_true(st > 0);
  assert_true(file_has(log3, "does not divide among 3 data-parallel workers"));
  cluster_stop(&two);
  cluster_stop(&one);
}

/* The data-parallel ResNet: 2 workers on 2 daemon ranks, roots synchronous, train the model
 * 1 worker trains with 1 daemon, every step's loss within 1e-4 relative (float reduction
 * order), with SGD, Shampoo and K-FAC (empirical and model Fisher). That takes every part:
 * the shares of the batch, batch norm across the workers (normalising by one half's
 * statistics alone would change the losses at the first step; accel's unit test checks sync
 * BN itself exactly), averaged gradients, statistics and K-FAC factors sharded among the
 * workers, the model Fisher's draws of each worker's rows. K-FAC with inverses
 * asynchronous keeps the workers' models equal too (the same final evaluation). */
static void test_data_parallel_resnet(void **state) {
  (void)state;
  cluster one, two;
  char daemon1[160], daemon2[160];
  dp_clusters(&one, &two, daemon1, daemon2);
  /* The optimizer, and the K-FAC Fisher (the model's: labels drawn, each worker its rows'). */
  static const char *const optimizers[][2] = {
      {"sgd", "empirical"}, {"shampoo", "empirical"}, {"kfac", "empirical"}, {"kfac", "model"}};
  for (int k = 0; k < 4; k++) {
    const char *const model[] = {g_resnet,
                                 "--optimizer",
                                 optimizers[k][0],
                                 "--kfac-fisher",
                                 optimizers[k][1],
                                 "--steps",
                                 "6",
                                 "--batch",
                                 "16",
                                 "--width",
                                 "4",
                                 "--blocks",
                                 "1",
                                 "--chunk",
                                 "8",
                                 "--eval-every",
                                 "0",
                                 "--eval-batches",
                                 "1",
                                 "--sync-roots",
                                 NULL};
    char o1[32], o2[32], log2[200];
    snprintf(o1, sizeof o1, "r1-%s-%s", optimizers[k][0], optimizers[k][1]);
    snprintf(o2, sizeof o2, "r2-%s-%s", optimizers[k][0], optimizers[k][1]);
    mprun w;
    start_client(&w, one.dir, o1, 0, daemon1, model, NULL);
    assert_int_equal(wait_client(&w, one.dir, o1, 240000), 0);
    start_client(&w, two.dir, o2, 2, daemon2, model, NULL);
    assert_int_equal(wait_client(&w, two.dir, o2, 240000), 0);
    double worst = loss_diff(one.dir, o1, two.dir, o2, 6);
    fprintf(stderr, "data-parallel resnet %s (%s Fisher): largest relative loss difference %.3g\n",
            optimizers[k][0], optimizers[k][1], worst);
    assert_true(worst <= 1e-4);
    snprintf(log2, sizeof log2, "%s/%s.log", two.dir, o2);
    assert_int_equal(file_count(log2, "reductions across workers (batch norm"), 2);
  }
  /* K-FAC with inverses asynchronous: the workers agree each step on the daemon versions
   * they apply, so both end with the same model. */
  const char *const kfac_async[] = {
      g_resnet, "--optimizer",  "kfac", "--steps",        "12", "--batch",
      "16",     "--width",      "4",    "--blocks",       "1",  "--chunk",
      "8",      "--eval-every", "0",    "--eval-batches", "1",  NULL};
  mprun w;
  start_client(&w, two.dir, "r2-async", 2, daemon2, kfac_async, NULL);
  assert_int_equal(wait_client(&w, two.dir, "r2-async", 240000), 0);
  char loga[200];
  snprintf(loga, sizeof loga, "%s/r2-async.log", two.dir);
  assert_same_final_eval(loga);
  cluster_stop(&two);
  cluster_stop(&one);
}

/* What a step of train.csv shows (rank 0 writes one line per step as it ends). */
enum { ALL_ROOTS, SOME_ROOTS, FALLBACK };

/* The rows of dir/train.csv so far: the step of the last, and in *found the first at step
 * >= from that shows what (0: none). ALL_ROOTS: no block fell back (column 9, fallback, is
 * 0); SOME_ROOTS: some block used roots (column 8, their mean staleness, is not empty);
 * FALLBACK: some block took the grafted step. */
static long csv_scan(const char *dir, long from, int what, long *found) {
  char path[160], line[512];
  snprintf(path, sizeof path, "%s/train.csv", dir);
  *found = 0;
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  long last = 0;
  while (fgets(line, sizeof line, f)) {
    if (strchr(line, '\n') == NULL) break; /* a line being written */
    const char *col[10] = {line};
    int n = 1;
    for (const char *p = line; n < 10 && (p = strchr(p, ',')) != NULL; p++) col[n++] = p + 1;
    char *end;
    long step = strtol(line, &end, 10);
    if (n < 10 || end == line || *end != ',') continue; /* the header */
    int fb = atoi(col[8]), roots = col[7][0] != ',';
    last = step;
    int hit = what == FALLBACK ? fb == 1 : what == ALL_ROOTS ? fb == 0 : roots;
    if (*found == 0 && step >= from && hit) *found = step;
  }
  fclose(f);
  return last;
}

/* Waits (ms at most, while the workers w run) for a step >= from that shows what; that
 * step, or 0. */
static long wait_step(const char *dir, long from, int what, mprun *w, long ms) {
  long found = 0;
  for (long t = 0; t <= ms; t += 20) {
    csv_scan(dir, from, what, &found);
    if (found > 0 || mprun_wait(w, 0) >= 0) break;
    sleep_ms(20);
  }
  if (found == 0) csv_scan(dir, from, what, &found);
  return found;
}

/* 1 once pid no longer runs (no such process, or a zombie: no longer our child). */
static int gone(pid_t pid) {
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return kill(pid, 0) != 0 && errno == ESRCH;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* "pid (name) S ..." */
  return p != NULL && p[1] == ' ' && p[2] == 'Z';
}

/* The last step of dir/train.csv. */
static long csv_last(const char *dir) {
  long found;
  return csv_scan(dir, 0, ALL_ROOTS, &found);
}

/* A daemon rank killed (SIGKILL) under two data-parallel workers (their own mpirun job,
 * roots asynchronous, a root more than STALE steps old not used): Open MPI's mpirun ends the
 * other daemon rank too; the workers keep training, every block taking the grafted step
 * (fallback, counted), with no crash and no hang; the daemon job restarted on its per-rank
 * snapshots resumes the job, and the workers reconnect and use new roots again (at a step
 * more than STALE steps after the restart: only roots the restarted daemons computed are
 * that new). Then a SIGTERM to one worker stops both after the same step: exit 0, the same
 * model on both, and each saw the restart.
 *
 * The run is long (its --steps) and stopped by the test: a step that falls back takes 2 ms
 * here, libprecond takes seconds to reconnect, and a loaded machine is 100 times slower, so
 * no fixed length would both cover the restart and end in time.
 *
 * STALE is large because roots reach a worker some steps after the statistics they come
 * from (libprecond polls every 20 ms, both workers must hold a version before either uses
 * it, and a step takes 2-5 ms): with 15 (until session 6) a new root could already be too
 * old when both workers held it, and the test waited for a step where it was not, which a
 * loaded machine can push past its 120 s (the likely cause of one failure). 100 steps
 * leave 200-500 ms for the trip. */
enum { STALE = 100 };
static void test_killed_rank(void **state) {
  (void)state;
  static const char *const snapshots[] = {"--snapshot-interval", "1", NULL};
  cluster c;
  cluster_start_with(&c, 2, snapshots);
  char daemon[160], out[160], log[160];
  snprintf(daemon, sizeof daemon, "unix:%s/s-%%r.sock", c.dir);
  snprintf(out, sizeof out, "%s/wk", c.dir);
  snprintf(log, sizeof log, "%s/wk.log", c.dir);
  char stale_steps[16];
  snprintf(stale_steps, sizeof stale_steps, "%d", STALE);
  const char *const stale[] = {"--max-staleness", stale_steps, NULL};
  mprun w;
  start_transformer(&w, c.dir, "wk", 2, daemon, "1000000", stale);
  long used = wait_step(out, 20, ALL_ROOTS, &w, 120000);
  assert_true(used > 0);

  /* A snapshot on each rank after that: the job and its roots are in it. */
  for (int r = 0; r < 2; r++) {
    Precond__V1__StatsResponse *s = get_stats(c.ch[r], "");
    uint64_t seen = s->snapshots_written, now = seen;
    protobuf_c_message_free_unpacked(&s->base, NULL);
    for (int t = 0; t < 1500 && now == seen; t++) {
      sleep_ms(20);
      s = get_stats(c.ch[r], "");
      now = s->snapshots_written;
      protobuf_c_message_free_unpacked(&s->base, NULL);
    }
    assert_true(now > seen);
  }

  pid_t r0 = mprun_rank_pid(&c.run, 0), r1 = mprun_rank_pid(&c.run, 1);
  assert_true(r0 > 0 && r1 > 0);
  for (int r = 0; r < 2; r++) {
    rpc_channel_destroy(c.ch[r]);
    c.ch[r] = NULL;
  }
  long at_kill = csv_last(out);
  assert_int_equal(kill(r1, SIGKILL), 0);
  int st = mprun_wait(&c.run, 60000);
  assert_true(st > 0); /* mpirun reports the lost rank */
  /* It sent SIGTERM to the other one and exited at once: rank 0 still shuts down (waiting
   * at most --grace-period + 5 s for the dead rank's goodbye) and writes its last snapshot,
   * which the restart must not overtake. */
  int t = 0;
  for (; t < 1500 && !gone(r0); t++) sleep_ms(20);
  fprintf(stderr, "killed rank: rank 0 gone %.1f s after mpirun exited\n", t * 0.02);
  assert_true(t < 1500);
  /* The workers went on: past STALE steps without a daemon every block falls back. */
  long fell = wait_step(out, at_kill + STALE + 1, FALLBACK, &w, 120000);
  assert_true(fell > 0);

  cluster_run(&c); /* the same state directories */
  long restarted = csv_last(out);
  for (int r = 0; r < 2; r++) {
    Precond__V1__StatsResponse *s = get_stats(c.ch[r], "");
    assert_int_equal(s->n_job_stats, 1);
    assert_true(s->job_stats[0]->last_step > 0);
    protobuf_c_message_free_unpacked(&s->base, NULL);
  }
  long back = wait_step(out, restarted + STALE + 1, SOME_ROOTS, &w, 120000);
  if (back == 0) dump_log(&c);
  assert_true(back > 0);
  assert_true(wait_step(out, back + 20, ALL_ROOTS, &w, 120000) > 0); /* trains on */

  pid_t w1 = mprun_rank_pid(&w, 1);
  assert_true(w1 > 0);
  assert_int_equal(kill(w1, SIGTERM), 0);
  assert_int_equal(wait_client(&w, c.dir, "wk", 120000), 0);
  fprintf(stderr,
          "killed rank: roots in use at step %ld, rank 1 killed at step %ld, every block "
          "falling back at step %ld, daemons back at step %ld, new roots in use at step %ld, "
          "stopped at step %ld\n",
          used, at_kill, fell, restarted, back, csv_last(out));
  /* Each worker saw the restart, and the job resumed from the snapshot (a step > 0). */
  assert_int_equal(file_count(log, "restarted (epoch 1 -> 2)"), 2);
  assert_int_equal(file_count(log, "resumed from step 0:"), 0);
  char summary[200];
  snprintf(summary, sizeof summary, "%s/summary.json", out);
  assert_true(file_has(summary, "\"status\": \"stopped\""));
  assert_same_final_eval(log);
  cluster_stop(&c);
}

int main(int argc, char **argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: test_replica MPIRUN PRECONDD TRANSFORMER PRECONDCTL RESNET\n");
    return 2;
  }
  g_mpirun = argv[1];
  g_precondd = argv[2];
  g_transformer = argv[3];
  g_precondctl = argv[4];
  g_resnet = argv[5];
  if (access(g_mpirun, X_OK) != 0) {
    fprintf(stderr, "test_replica: mpirun not found at %s (install openmpi-bin)\n", g_mpirun);
    return 77; /* meson: skipped */
  }
  if (getenv("REPLICA_TEST")) cmocka_set_test_filter(getenv("REPLICA_TEST")); /* one, by name */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_ranks),
      cmocka_unit_test(test_three_ranks),
      cmocka_unit_test(test_restart),
      cmocka_unit_test(test_rank_count_change),
      cmocka_unit_test(test_end_job_and_ctl),
      cmocka_unit_test(test_data_parallel),
      cmocka_unit_test(test_data_parallel_resnet),
      cmocka_unit_test(test_killed_rank),
      cmocka_unit_test(test_bad_starts),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
