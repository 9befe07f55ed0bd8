/*
 * load_client.c -- precondd under load, and precondd killed with -9 under a training client.
 * The load test of the hardening issue: a client of precondd's wire and of libprecond, not a
 * trainer or a benchmark; its short runs are the integration tests `load` and `kill9`
 * (tests/load/meson.build), its long ones tests/load/long_run.sh.
 *
 * Load (default): --clients N (64) threads, each on its own channel with its own job, register
 * a [2b, b] tensor (two b x b blocks), then loop for --seconds: push one step's statistics
 * (a random Gram matrix per block, the same for both factors), fetch the roots newer than the
 * ones held, and every 8th step GetStats. Every root returned is checked against the root
 * computed here (pc_inverse_root_f32 with the daemon's defaults) from the statistic of its
 * source step, which the client folds itself with the daemon's rule (pc_stat_update_f32, so
 * the bits agree). The daemon's RSS is sampled every --rss-ms. One summary line of key=value
 * pairs on stdout; --rss-csv FILE writes the samples.
 *
 * Kill -9 (--kill9 K): one libprecond client trains (push both blocks, flush, read the
 * newest roots) against a daemon started here with a state directory and --snapshot-interval
 * --snapshot-s; every --seconds the daemon is killed with SIGKILL and started again on the
 * same port, K times. Per kill one line: the client's step at the kill, the step the daemon
 * resumed from (libprecond's counter, from the daemon's answers), steps lost, the time from
 * the restart to the first new root at the client, the newest root version before and
 * after, and whether the client was told (its daemon_restarts counter). Versions of the
 * roots the client receives must never go backwards.
 *
 * Exit status: 0 when no call failed, every checked root matched, (kill9) versions never
 * went backwards and every restart was told; 1 otherwise; 2 for bad options.
 *
 *   build/tests/load/load-client --spawn build/host/precondd --clients 64 --seconds 600 --rss-csv rss.csv
 *   build/tests/load/load-client --spawn build/host/precondd --kill9 3 --seconds 5
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "precond.h"
#include "precondd_proc.h"
#include "precond.pb-c.h"
#include "preconditioner.h"
#include "rpc.h"

#define RING     64   /* statistics kept per block: roots of older steps are not checked */
#define ROOT_TOL 1e-3 /* relative max difference of a root to the local one */

typedef struct {
  const char *spawn, *addr, *rss_csv;
  int clients, seconds, block, threads, rss_ms, kill9;
  double snapshot_s;
  pid_t pid; /* daemon to sample (spawned, or --pid) */
} opts_t;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* ---- the daemon ----------------------------------------------------------------------- */

/* Starts precondd with the one starter of the tests and benchmarks (support/precondd_proc.h)
 * on 127.0.0.1:port (0: a free one), its files in d->dir (made on the first start and kept
 * across restarts, so a restart finds the state directory). With --kill9 the daemon keeps a
 * state directory and snapshots every --snapshot-s; without, it keeps none. Returns 0 once
 * it listens (d->port, d->addr, d->pid set). */
static int daemon_start(const opts_t *o, pdproc *d, int port) {
  char listen[64], snap[32];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(snap, sizeof snap, "%g", o->snapshot_s);
  const char *extra[] = {"--drift-threshold", "0", "--snapshot-interval", snap, NULL};
  if (!o->kill9) extra[2] = NULL;
  pdproc_opts po;
  pdproc_opts_default(&po);
  po.path = o->spawn;
  po.listen = listen;
  po.state_dir = o->kill9 ? NULL : "";
  po.threads = o->threads;
  po.log_level = "warn";
  po.extra = extra;
  return pdproc_start(d, &po);
}

/* Stops the daemon and removes its directory, or on failure keeps the directory and names
 * its log. */
static void daemon_finish(pdproc *d, int failed) {
  if (failed) {
    pdproc_stop(d, SIGTERM);
    fprintf(stderr, "load-client: the daemon's log is %s\n", d->log);
    return;
  }
  pdproc_destroy(d);
}

/* Resident set of pid in KiB (VmRSS), or -1. */
static long rss_kib(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  long kib = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
  fclose(f);
  return kib;
}

/* ---- load ----------------------------------------------------------------------------- */

typedef struct {
  const opts_t *o;
  int id;
  grpc_channel *ch;
  /* results */
  uint64_t steps, pushes, fetches, stats, errors, roots, checked, unchecked, bad;
  double worst;
  char first_error[256];
} client_t;

static _Atomic int g_stop;

static float rnd(uint64_t *s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void note_error(client_t *c, const char *what, grpc_status_code code, const char *msg) {
  if (c->errors++ == 0)
    snprintf(c->first_error, sizeof c->first_error, "client %d %s: %s: %s", c->id, what,
             rpc_status_name(code), msg ? msg : "");
}

/* The call; on a non-OK status the error is counted. */
static int call(client_t *c, const char *what, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp) {
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  char *details = NULL;
  int rc = rpc_call(c->ch, method, req, desc, 60000, 1, resp, &code, &details);
  if (rc != RPC_OK) note_error(c, what, code, details);
  free(details);
  return rc == RPC_OK;
}

/* max |a - b| / max |b| over packed order-n values. */
static double rel_diff(size_t n, const float *a, const float *b) {
  double md = 0, mb = 0;
  for (size_t i = 0; i < pc_packed_len(n); i++) {
    md = fmax(md, fabs((double)a[i] - (double)b[i]));
    mb = fmax(mb, fabs((double)b[i]));
  }
  return mb > 0 ? md / mb : md;
}

/* Checks one returned factor against the root of the packed statistic stat, computed here;
 * full and packed are n x n scratch. Returns the relative difference (INFINITY on a
 * malformed answer). */
static double check_root(size_t n, const float *stat, const Precond__V1__PackedMatrix *m,
                         float *full, float *x, float *packed) {
  if (!m || m->n != n || m->data.len != pc_packed_len(n) * sizeof(float)) return INFINITY;
  pc_root_opts ro;
  pc_root_opts_default(&ro, 4); /* the daemon's defaults: p = 4, its epsilon and method */
  pc_unpack_f32(n, stat, full);
  if (pc_inverse_root_f32(n, full, x, &ro, NULL) < 0) return INFINITY;
  pc_pack_f32(n, x, packed);
  float *got = malloc(m->data.len);
  if (!got) return INFINITY;
  memcpy(got, m->data.data, m->data.len); /* the bytes may be unaligned */
  double d = rel_diff(n, got, packed);
  free(got);
  return d;
}

static void *client_main(void *arg) {
  client_t *c = arg;
  const size_t b = (size_t)c->o->block, plen = pc_packed_len(b), k = b + 3;
  char job[64];
  snprintf(job, sizeof job, "load-%d", c->id);
  float *ring = calloc(2 * RING * plen, sizeof *ring); /* [block][step % RING] */
  uint64_t ring_step[2][RING] = {{0}};
  float *sum = calloc(2 * plen, sizeof *sum);
  float *g = malloc(b * k * sizeof *g);
  float *full = malloc(b * b * sizeof *full), *x = malloc(b * b * sizeof *x);
  float *packed = malloc(plen * sizeof *packed);
  uint64_t have[2] = {0, 0}, seed = 0x9e3779b97f4a7c15ULL * (uint64_t)(c->id + 1);
  if (!ring || !sum || !g || !full || !x || !packed) {
    note_error(c, "setup", GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    goto done;
  }

  uint64_t shape[2] = {2 * b, b};
  Precond__V1__TensorSpec ts = PRECOND__V1__TENSOR_SPEC__INIT, *tsp = &ts;
  ts.name = (char *)"w";
  ts.n_shape = 2;
  ts.shape = shape;
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  so.block_size = (uint32_t)b;
  Precond__V1__RegisterRequest rr = PRECOND__V1__REGISTER_REQUEST__INIT;
  rr.job = job;
  rr.n_tensors = 1;
  rr.tensors = &tsp;
  rr.shampoo = &so;
  rr.worker = (char *)"load-client";
  Precond__V1__RegisterResponse *reg = NULL;
  if (!call(c, "Register", RPC_METHOD_REGISTER, &rr.base,
            &precond__v1__register_response__descriptor, (ProtobufCMessage **)&reg))
    goto done;
  size_t nb = reg->n_blocks;
  protobuf_c_message_free_unpacked(&reg->base, NULL);
  if (nb != 2) {
    note_error(c, "Register", GRPC_STATUS_OK, "not two blocks");
    goto done;
  }

  for (uint64_t step = 1; !atomic_load(&g_stop); step++) {
    /* Push: one Gram matrix per block, both factors. */
    Precond__V1__PackedMatrix pm[2];
    Precond__V1__BlockStatistics bs[2], *bsp[2];
    float *incs = malloc(2 * plen * sizeof *incs);
    if (!incs) break;
    for (int blk = 0; blk < 2; blk++) {
      for (size_t i = 0; i < b * k; i++) g[i] = rnd(&seed);
      pc_gram_f32(b, k, g, k, incs + blk * plen, NULL);
      precond__v1__packed_matrix__init(&pm[blk]);
      pm[blk].n = (uint32_t)b;
      pm[blk].data.data = (uint8_t *)(incs + blk * plen);
      pm[blk].data.len = plen * sizeof(float);
      precond__v1__block_statistics__init(&bs[blk]);
      bs[blk].block_id = (uint32_t)blk;
      bs[blk].left = bs[blk].right = &pm[blk];
      bsp[blk] = &bs[blk];
    }
    Precond__V1__PushRequest pr = PRECOND__V1__PUSH_REQUEST__INIT;
    pr.job = job;
    pr.step = step;
    pr.n_blocks = 2;
    pr.blocks = bsp;
    ProtobufCMessage *ack = NULL;
    int pushed = call(c, "Push", RPC_METHOD_PUSH_STATISTICS, &pr.base,
                      &precond__v1__push_response__descriptor, &ack);
    if (ack) protobuf_c_message_free_unpacked(ack, NULL);
    c->pushes++;
    if (pushed) /* the daemon's fold, here: the bits of the statistic agree */
      for (int blk = 0; blk < 2; blk++) {
        pc_stat_update_f32(plen, sum + blk * plen, incs + blk * plen, 1.0f);
        memcpy(ring + ((size_t)blk * RING + step % RING) * plen, sum + blk * plen,
               plen * sizeof(float));
        ring_step[blk][step % RING] = step;
      }
    free(incs);
    c->steps = step;

    /* Fetch the roots newer than the ones held; check each. */
    Precond__V1__BlockVersion bv[2], *bvp[2];
    for (int blk = 0; blk < 2; blk++) {
      precond__v1__block_version__init(&bv[blk]);
      bv[blk].block_id = (uint32_t)blk;
      bv[blk].version = have[blk];
      bvp[blk] = &bv[blk];
    }
    Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
    fr.job = job;
    fr.n_have = 2;
    fr.have = bvp;
    fr.step = step;
    Precond__V1__FetchResponse *f = NULL;
    c->fetches++;
    if (call(c, "Fetch", RPC_METHOD_FETCH_PRECONDITIONERS, &fr.base,
             &precond__v1__fetch_response__descriptor, (ProtobufCMessage **)&f)) {
      for (size_t i = 0; i < f->n_preconditioners; i++) {
        const Precond__V1__BlockRoots *r = f->preconditioners[i];
        c->roots++;
        if (r->block_id >= 2 || r->version <= have[r->block_id]) {
          c->bad++;
          continue;
        }
        have[r->block_id] = r->version;
        size_t slot = r->source_step % RING;
        if (ring_step[r->block_id][slot] != r->source_step) {
          c->unchecked++; /* older than the ring */
          continue;
        }
        const float *stat = ring + ((size_t)r->block_id * RING + slot) * plen;
        double dl = check_root(b, stat, r->left, full, x, packed);
        double dr = check_root(b, stat, r->right, full, x, packed);
        double d = fmax(dl, dr);
        c->checked++;
        if (!(d <= c->worst)) c->worst = d;
        if (!(d <= ROOT_TOL)) c->bad++;
      }
      protobuf_c_message_free_unpacked(&f->base, NULL);
    }

    if (step % 8 == 0) {
      Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
      sr.job = job;
      sr.blocks = 1;
      Precond__V1__StatsResponse *st = NULL;
      c->stats++;
      if (call(c, "GetStats", RPC_METHOD_GET_STATS, &sr.base,
               &precond__v1__stats_response__descriptor, (ProtobufCMessage **)&st))
        protobuf_c_message_free_unpacked(&st->base, NULL);
    }
  }
done:
  free(ring);
  free(sum);
  free(g);
  free(full);
  free(x);
  free(packed);
  return NULL;
}

static int run_load(const opts_t *o, const char *addr) {
  client_t *cs = calloc((size_t)o->clients, sizeof *cs);
  pthread_t *th = calloc((size_t)o->clients, sizeof *th);
  FILE *csv = o->rss_csv ? fopen(o->rss_csv, "w") : NULL;
  if (!cs || !th || (o->rss_csv && !csv)) {
    fprintf(stderr, "load-client: out of memory or cannot write %s\n",
            o->rss_csv ? o->rss_csv : "");
    return 1;
  }
  if (csv) fprintf(csv, "t_s,rss_kib\n");
  long rss0 = o->pid > 0 ? rss_kib(o->pid) : -1, rss_max = rss0, rss_end = rss0;
  double t0 = now_s();
  int started = 0;
  for (int i = 0; i < o->clients; i++) {
    cs[i].o = o;
    cs[i].id = i;
    cs[i].ch = rpc_channel_create(addr, 0);
    if (!cs[i].ch || pthread_create(&th[i], NULL, client_main, &cs[i]) != 0) break;
    started++;
  }
  while (now_s() - t0 < o->seconds) {
    sleep_ms(o->rss_ms);
    long r = o->pid > 0 ? rss_kib(o->pid) : -1;
    if (r > rss_max) rss_max = r;
    if (r >= 0) rss_end = r;
    if (csv && r >= 0) fprintf(csv, "%.1f,%ld\n", now_s() - t0, r);
  }
  atomic_store(&g_stop, 1);
  client_t tot = {0};
  tot.worst = 0;
  const char *first = NULL;
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    rpc_channel_destroy(cs[i].ch);
    tot.steps += cs[i].steps;
    tot.pushes += cs[i].pushes;
    tot.fetches += cs[i].fetches;
    tot.stats += cs[i].stats;
    tot.errors += cs[i].errors;
    tot.roots += cs[i].roots;
    tot.checked += cs[i].checked;
    tot.unchecked += cs[i].unchecked;
    tot.bad += cs[i].bad;
    if (cs[i].worst > tot.worst) tot.worst = cs[i].worst;
    if (!first && cs[i].errors) first = cs[i].first_error;
  }
  double secs = now_s() - t0;
  if (csv) fclose(csv);
  uint64_t requests = tot.pushes + tot.fetches + tot.stats + (uint64_t)started;
  printf(
      "clients=%d seconds=%.1f block=%d requests=%llu pushes=%llu fetches=%llu stats=%llu "
      "requests_per_s=%.1f errors=%llu roots=%llu checked=%llu unchecked=%llu bad=%llu "
      "worst_rel_diff=%.3g rss_start_kib=%ld rss_max_kib=%ld rss_end_kib=%ld\n",
      started, secs, o->block, (unsigned long long)requests, (unsigned long long)tot.pushes,
      (unsigned long long)tot.fetches, (unsigned long long)tot.stats, requests / secs,
      (unsigned long long)tot.errors, (unsigned long long)tot.roots,
      (unsigned long long)tot.checked, (unsigned long long)tot.unchecked,
      (unsigned long long)tot.bad, tot.worst, rss0, rss_max, rss_end);
  if (first) fprintf(stderr, "load-client: first error: %s\n", first);
  int ok = started == o->clients && tot.errors == 0 && tot.bad == 0 && tot.checked > 0;
  free(cs);
  free(th);
  return ok ? 0 : 1;
}

/* ---- kill -9 ---------------------------------------------------------------------------- */

/* One training step of the kill -9 client: push both blocks at step, flush, and take the
 * newest roots; versions[] holds the daemon versions received, which must not go back. */
static int train_step(precond_client *c, uint64_t step, size_t b, uint64_t *seed,
                      uint64_t versions[2], int *backwards) {
  size_t plen = pc_packed_len(b), k = b + 3;
  float *g = malloc(b * k * sizeof *g), *p = malloc(plen * sizeof *p);
  int st = g && p ? PRECOND_OK : PRECOND_ENOMEM;
  for (uint32_t blk = 0; blk < 2 && st == PRECOND_OK; blk++) {
    for (size_t i = 0; i < b * k; i++) g[i] = rnd(seed);
    pc_gram_f32(b, k, g, k, p, NULL);
    st = precond_push(c, step, blk, (uint32_t)b, p, (uint32_t)b, p, PRECOND_FP32);
  }
  free(g);
  free(p);
  if (st == PRECOND_OK) st = precond_flush(c, 30000);
  for (uint32_t blk = 0; blk < 2; blk++) {
    const precond_roots *r = NULL;
    if (precond_fetch(c, blk, 0, &r) == PRECOND_OK && r) {
      if (r->daemon_version < versions[blk]) *backwards = 1;
      if (r->daemon_version > versions[blk]) versions[blk] = r->daemon_version;
      precond_roots_release(r);
    }
  }
  return st;
}

static int run_kill9(const opts_t *o) {
  pdproc d = {0};
  int failed = 0, backwards = 0;
  if (daemon_start(o, &d, 0) != 0) {
    fprintf(stderr, "load-client: cannot start %s\n", o->spawn);
    daemon_finish(&d, 1);
    return 1;
  }
  const char *addr = d.addr;
  precond_options po;
  precond_options_default(&po);
  po.addr = addr;
  po.poll_interval_ms = 5;
  po.backoff_max_ms = 200;
  precond_client *c = NULL;
  size_t b = (size_t)o->block;
  const uint64_t shape[2] = {2 * b, b};
  precond_tensor t = {"w", 2, shape};
  precond_shampoo_opts so = {.block_size = (uint32_t)b};
  precond_layout layout = {0};
  if (precond_connect(&po, &c) != PRECOND_OK ||
      precond_register(c, "kill9", PRECOND_MODE_SHAMPOO, "load-client", 1, &t, &so, &layout) !=
          PRECOND_OK) {
    fprintf(stderr, "load-client: cannot register with the daemon at %s\n", addr);
    daemon_finish(&d, 1);
    precond_close(c);
    return 1;
  }
  uint64_t seed = 12345, step = 0, versions[2] = {0, 0};
  for (int kill_no = 1; kill_no <= o->kill9 && !failed; kill_no++) {
    double until = now_s() + o->seconds;
    while (now_s() < until)
      if (train_step(c, ++step, b, &seed, versions, &backwards) != PRECOND_OK) failed = 1;
    uint64_t at_kill = step, v_before = versions[0] > versions[1] ? versions[0] : versions[1];
    pdproc_stop(&d, SIGKILL);
    double t_restart = now_s();
    if (daemon_start(o, &d, d.port) != 0) {
      fprintf(stderr, "load-client: the daemon did not come back on %s\n", addr);
      failed = 1;
      break;
    }
    /* Train until a root newer than any before the kill arrives (the daemon recomputes
     * from the restored statistics, numbered above every earlier run's). */
    double recovered = -1;
    while (now_s() - t_restart < 60 && recovered < 0) {
      if (train_step(c, ++step, b, &seed, versions, &backwards) != PRECOND_OK) failed = 1;
      if (versions[0] > v_before && versions[1] > v_before) recovered = now_s() - t_restart;
    }
    precond_counters k;
    precond_get_counters(c, &k);
    int told = k.daemon_restarts == (uint64_t)kill_no;
    uint64_t v_after = versions[0] > versions[1] ? versions[0] : versions[1];
    printf(
        "kill=%d step_at_kill=%llu resumed_step=%llu steps_lost=%llu recover_s=%.3f "
        "version_before=%llu version_after=%llu told=%d backwards=%d\n",
        kill_no, (unsigned long long)at_kill, (unsigned long long)k.resumed_step,
        (unsigned long long)(at_kill - k.resumed_step), recovered, (unsigned long long)v_before,
        (unsigned long long)v_after, told, backwards);
    fflush(stdout);
    if (!told || backwards || recovered < 0) failed = 1;
  }
  precond_layout_destroy(&layout);
  precond_close(c);
  daemon_finish(&d, failed);
  return failed ? 1 : 0;
}

/* ---- main ----------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
          "usage: load-client (--spawn PRECONDD | --addr HOST:PORT [--pid PID]) [options]\n"
          "  --clients N      concurrent clients, each with its own job (default 64)\n"
          "  --seconds S      load: run time; --kill9: training time before each kill (10)\n"
          "  --block N        block order b: each job is one [2b, b] tensor, 2 blocks (32)\n"
          "  --threads N      the spawned daemon's root workers (default 2)\n"
          "  --rss-ms MS      RSS sampling period of the daemon (default 1000)\n"
          "  --rss-csv FILE   write the RSS samples (t_s,rss_kib)\n"
          "  --kill9 K        kill -9 harness: K kills and restarts of the spawned daemon\n"
          "  --snapshot-s S   the spawned daemon's --snapshot-interval with --kill9 (1)\n");
}

int main(int argc, char **argv) {
  opts_t o = {
      .clients = 64, .seconds = 10, .block = 32, .threads = 2, .rss_ms = 1000, .snapshot_s = 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--help") == 0) {
      usage(stdout);
      return 0;
    }
    if (!v) {
      fprintf(stderr, "load-client: %s needs a value\n", a);
      return 2;
    }
    i++;
    if (strcmp(a, "--spawn") == 0)
      o.spawn = v;
    else if (strcmp(a, "--addr") == 0)
      o.addr = v;
    else if (strcmp(a, "--rss-csv") == 0)
      o.rss_csv = v;
    else if (strcmp(a, "--pid") == 0)
      o.pid = (pid_t)atoi(v);
    else if (strcmp(a, "--clients") == 0)
      o.clients = atoi(v);
    else if (strcmp(a, "--seconds") == 0)
      o.seconds = atoi(v);
    else if (strcmp(a, "--block") == 0)
      o.block = atoi(v);
    else if (strcmp(a, "--threads") == 0)
      o.threads = atoi(v);
    else if (strcmp(a, "--rss-ms") == 0)
      o.rss_ms = atoi(v);
    else if (strcmp(a, "--kill9") == 0)
      o.kill9 = atoi(v);
    else if (strcmp(a, "--snapshot-s") == 0)
      o.snapshot_s = atof(v);
    else {
      fprintf(stderr, "load-client: unknown option %s\n", a);
      usage(stderr);
      return 2;
    }
  }
  if (!o.spawn == !o.addr || o.clients < 1 || o.clients > 4096 || o.seconds < 1 || o.block < 2 ||
      o.block > 1024 || o.threads < 1 || o.rss_ms < 10 || o.kill9 < 0 || (o.kill9 && !o.spawn) ||
      !(o.snapshot_s >= 0)) {
    usage(stderr);
    return 2;
  }
  openblas_set_num_threads(1); /* the reference roots: one thread per client */
  signal(SIGPIPE, SIG_IGN);
  if (o.kill9) return run_kill9(&o);
  if (!o.spawn) return run_load(&o, o.addr);
  pdproc d = {0};
  if (daemon_start(&o, &d, 0) != 0) {
    fprintf(stderr, "load-client: cannot start %s\n", o.spawn);
    daemon_finish(&d, 1);
    return 1;
  }
  o.pid = d.pid;
  int rc = run_load(&o, d.addr);
  int st = pdproc_stop(&d, SIGTERM);
  if (st != 0) {
    fprintf(stderr, "load-client: the daemon exited with status %d\n", st);
    rc = 1;
  }
  daemon_finish(&d, rc != 0);
  return rc;
}
