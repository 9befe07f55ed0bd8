/*
 * test_client.c -- integration tests of libprecond and precondctl against a real precondd,
 * started here over TCP loopback (a free port) and over a unix socket.
 *
 * The daemon and precondctl paths come from meson (PRECONDD, PRECONDCTL in the environment).
 * Statistics are multiples of the identity, so the expected roots are known in closed form:
 * (s I + ridge I)^(-1/4) with ridge = epsilon * s.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <lapacke.h>

#include "precond.h"
#include "precondd_proc.h"

#define ROOT_WAIT_MS 30000
#define EPSILON      1e-6

/* The daemon of the running test, started in a directory of its own; the teardown stops it
 * and removes that directory even when the test failed. */
static pdproc g_d;
static char g_sock[96];

/* Starts g_d on listen (NULL: a free loopback port) with one root thread, a 1 s grace period
 * and its output in the test log; requires the token in token_file when not NULL; keeps its
 * state in its directory when with_state, else has none (a restart then loses every job). */
static void daemon_start(const char *listen, const char *token_file, int with_state) {
  pdproc_opts o;
  pdproc_opts_default(&o);
  o.listen = listen;
  o.grace_period = 1;
  o.inherit_stderr = 1;
  o.state_dir = with_state ? NULL : "";
  const char *extra[] = {"--token-file", token_file, NULL};
  if (token_file != NULL) o.extra = extra;
  assert_int_equal(pdproc_start(&g_d, &o), 0);
}

static void daemon_stop(void) {
  pdproc_stop(&g_d, SIGTERM);
}

static int stop_daemon(void **state) {
  (void)state;
  pdproc_destroy(&g_d);
  if (g_sock[0] != '\0') unlink(g_sock);
  memset(&g_d, 0, sizeof g_d);
  g_sock[0] = '\0';
  return 0;
}

static void tcp_daemon(void) {
  daemon_start(NULL, NULL, 0);
}

static void unix_daemon_with(const char *const *extra);

static void unix_daemon(void) {
  unix_daemon_with(NULL);
}

/* "127.0.0.1:PORT" with a port nobody listens on right now, for a daemon started later. */
static void later_addr(char *addr, size_t len) {
  int port = pdproc_free_port();
  assert_true(port > 0);
  snprintf(addr, len, "127.0.0.1:%d", port);
}

static precond_client *connect_to(const char *addr, precond_encoding fetch_enc) {
  precond_options o;
  precond_options_default(&o);
  o.addr = addr;
  o.connect_timeout_ms = 20000; /* the daemon is starting */
  o.poll_interval_ms = 10;
  o.fetch_encoding = fetch_enc;
  o.keep_freed_memory = 1; /* the option's path runs; its effect is bench-daemon's to measure */
  precond_client *c = NULL;
  int st = precond_connect(&o, &c);
  assert_int_equal(st, PRECOND_OK);
  return c;
}

/* Packed s * I of size n. */
static float *scaled_identity(uint32_t n, float s) {
  size_t len = (size_t)n * (n + 1) / 2;
  float *p = calloc(len, sizeof(float));
  assert_non_null(p);
  size_t k = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i; j < n; j++) p[k++] = i == j ? s : 0.0f;
  return p;
}

/* Checks that packed x (n x n) is c I within rel (relative to c). */
static void assert_scaled_identity(const float *x, uint32_t n, double c, double rel) {
  assert_non_null(x);
  size_t k = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i; j < n; j++, k++) {
      double want = i == j ? c : 0.0;
      if (fabs(x[k] - want) > rel * c) {
        fprintf(stderr, "x[%u][%u] = %.8g, want %.8g\n", i, j, x[k], want);
        fail();
      }
    }
}

static double expected_root(double s) {
  return pow(s * (1.0 + EPSILON), -0.25);
}

/* Registers a 256 x 96 weight (two 128 x 96 blocks) and a bias (diagonal only). */
static void register_job(precond_client *c, const char *job, precond_layout *layout) {
  const uint64_t wshape[2] = {256, 96}, bshape[1] = {96};
  precond_tensor t[2] = {{"dense.w", 2, wshape}, {"dense.b", 1, bshape}};
  precond_shampoo_opts so = {.block_size = 128,
                             .root_exponent = 4,
                             .epsilon = EPSILON,
                             .beta2 = 1.0f,
                             .method = PRECOND_METHOD_EIGH};
  int st = precond_register(c, job, PRECOND_MODE_SHAMPOO, "test", 2, t, &so, layout);
  if (st != PRECOND_OK) {
    char e[256];
    precond_last_error(c, e, sizeof e);
    fprintf(stderr, "register: %s (%s)\n", precond_strerror(st), e);
  }
  assert_int_equal(st, PRECOND_OK);
  assert_int_equal(layout->nblocks, 2);
  assert_int_equal(layout->ndiagonal, 1);
  assert_int_equal(layout->diagonal_tensors[0], 1);
  for (size_t i = 0; i < 2; i++) {
    assert_int_equal(layout->blocks[i].block_id, i);
    assert_int_equal(layout->blocks[i].rows, 128);
    assert_int_equal(layout->blocks[i].cols, 96);
    assert_int_equal(layout->blocks[i].row0, 128 * i);
  }
}

/* Waits for a version of block id newer than *version computed from step (an earlier one
 * may arrive first) and returns it (the caller releases it); *version becomes its version. */
static const precond_roots *wait_step(precond_client *c, uint32_t id, uint64_t step,
                                      uint64_t *version) {
  const precond_roots *r = NULL;
  for (int tries = 0; tries < 1000; tries++) {
    int st = precond_wait_roots(c, id, *version, ROOT_WAIT_MS);
    if (st != PRECOND_OK) {
      char e[256];
      precond_last_error(c, e, sizeof e);
      fprintf(stderr, "no roots for block %u: %s (%s)\n", id, precond_strerror(st), e);
    }
    assert_int_equal(st, PRECOND_OK);
    assert_int_equal(precond_fetch(c, id, *version, &r), PRECOND_OK);
    assert_non_null(r);
    *version = r->version;
    if (r->source_step >= step) break;
    precond_roots_release(r);
    r = NULL;
  }
  assert_non_null(r);
  assert_int_equal(r->block_id, id);
  assert_int_equal(r->source_step, step);
  return r;
}

/* Pushes s I for both factors of every block at step, flushes, and checks that the
 * roots of the new version arrive and match (s_total I)^(-1/4). */
static void push_and_check(precond_client *c, const precond_layout *layout, uint64_t step, float s,
                           double s_total, precond_encoding enc, uint64_t *versions, double rel) {
  for (size_t b = 0; b < layout->nblocks; b++) {
    uint32_t nl = (uint32_t)layout->blocks[b].rows, nr = (uint32_t)layout->blocks[b].cols;
    float *l = scaled_identity(nl, s), *r = scaled_identity(nr, 2.0f * s);
    assert_int_equal(precond_push(c, step, (uint32_t)b, nl, l, nr, r, enc), PRECOND_OK);
    free(l);
    free(r);
  }
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  for (size_t b = 0; b < layout->nblocks; b++) {
    uint32_t id = (uint32_t)b;
    const precond_roots *r = wait_step(c, id, step, &versions[b]);
    assert_int_equal(r->n_left, layout->blocks[b].rows);
    assert_int_equal(r->n_right, layout->blocks[b].cols);
    assert_scaled_identity(r->left, r->n_left, expected_root(s_total), rel);
    assert_scaled_identity(r->right, r->n_right, expected_root(2.0 * s_total), rel);
    /* Only newer versions come back: asking with the version held gives nothing. */
    const precond_roots *again = (const precond_roots *)1;
    assert_int_equal(precond_fetch(c, id, r->version, &again), PRECOND_OK);
    assert_null(again);
    precond_roots_release(r);
  }
}

static void run_flow(const char *addr, precond_encoding enc, double rel) {
  precond_client *c = connect_to(addr, enc);
  precond_layout layout;
  register_job(c, "itest", &layout);
  uint64_t versions[2] = {0, 0};
  push_and_check(c, &layout, 1, 4.0f, 4.0, enc, versions, rel);
  /* beta2 = 1: the daemon sums the increments, so the statistic is now 4 + 12 = 16 */
  push_and_check(c, &layout, 2, 12.0f, 16.0, enc, versions, rel);

  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.pushed, 4);
  assert_int_equal(k.sent + k.coalesced + k.dropped, 4);
  assert_int_equal(k.push_errors, 0);
  assert_true(k.roots_received >= 4);
  assert_int_equal(k.queued, 0);

  precond_stats s;
  assert_int_equal(precond_get_stats(c, "itest", 1, &s), PRECOND_OK);
  assert_true(s.njobs >= 1);
  assert_string_equal(s.job_stats[0].job, "itest");
  assert_int_equal(s.nblocks, 2);
  /* 4 -> 16 is a pure scale: the daemon's drift test may answer it with the kept roots
   * rescaled (checked above against expected_root) instead of computing them again. */
  assert_true(s.roots_computed + s.roots_skipped >= 4);
  precond_stats_destroy(&s);

  int serving = 0;
  const char *name = NULL;
  assert_int_equal(precond_health(c, "", &serving, &name), PRECOND_OK);
  assert_int_equal(serving, 1);
  assert_string_equal(name, "SERVING");
  precond_layout_destroy(&layout);
  precond_close(c);
}

static void test_tcp_register_push_fetch(void **state) {
  (void)state;
  tcp_daemon();
  run_flow(g_d.addr, PRECOND_FP32, 1e-4);
  daemon_stop();
}

static void test_unix_socket_bf16(void **state) {
  (void)state;
  unix_daemon();
  /* bf16 both ways: 8 bits of mantissa, so about 0.4% per value */
  run_flow(g_d.addr, PRECOND_BF16, 1e-2);
}

/* A daemon on a unix socket, as daemon_start without a token or state, with more options
 * (NULL-terminated; NULL: none). */
static void unix_daemon_with(const char *const *extra) {
  char listen[128];
  snprintf(g_sock, sizeof g_sock, "/tmp/precond-test-%d.sock", (int)getpid());
  unlink(g_sock);
  snprintf(listen, sizeof listen, "unix:%s", g_sock);
  pdproc_opts o;
  pdproc_opts_default(&o);
  o.listen = listen;
  o.grace_period = 1;
  o.inherit_stderr = 1;
  o.state_dir = "";
  o.extra = extra;
  assert_int_equal(pdproc_start(&g_d, &o), 0);
}

/* The tests' options for a client of g_d's daemon over transport t with regions of
 * shm_bytes. */
static void options_for(precond_options *o, precond_transport t, uint64_t shm_bytes) {
  precond_options_default(o);
  o->addr = g_d.addr;
  o->connect_timeout_ms = 20000;
  o->poll_interval_ms = 10;
  o->transport = t;
  o->shm_bytes = shm_bytes;
}

/* A client of g_d's daemon over transport t (roots by reference, each push's answer
 * awaited as asked). */
static precond_client *connect_with(precond_transport t, int by_reference, int answer_wait) {
  precond_options o;
  options_for(&o, t, 4 << 20);
  o.roots_by_reference = by_reference;
  o.push_answer_wait = answer_wait;
  precond_client *c = NULL;
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  return c;
}

static precond_client *connect_transport_ref(precond_transport t, int by_reference) {
  return connect_with(t, by_reference, 0);
}

static precond_client *connect_transport(precond_transport t) {
  return connect_transport_ref(t, 0);
}

/* Packed G G^T of a pseudo-random n x n G (seeded): a statistic whose roots are not
 * trivial, so bit-identical roots mean the same bytes reached the daemon. */
static float *gram(uint32_t n, unsigned seed) {
  float *g = malloc((size_t)n * n * sizeof(float)), *p = malloc((size_t)n * (n + 1) / 2 * 4);
  assert_non_null(g);
  assert_non_null(p);
  uint64_t s = seed;
  for (size_t i = 0; i < (size_t)n * n; i++) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    g[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5);
  }
  size_t k = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i; j < n; j++, k++) {
      double acc = 0;
      for (uint32_t t = 0; t < n; t++) acc += (double)g[i * n + t] * g[j * n + t];
      p[k] = (float)acc + (i == j ? 0.1f : 0.0f);
    }
  free(g);
  return p;
}

/* The same-host data path through libprecond: over a unix socket (AUTO) pushes and roots go
 * through shared memory and give the very roots the same pushes give as gRPC bytes (a
 * second client forced to GRPC, its own job, the same daemon); a daemon without shared
 * memory (--shm-dir off) gets bytes from an AUTO client, and the flow still works. */
static void test_shm_same_roots_as_bytes(void **state) {
  (void)state;
  const char *extra[] = {"--drift-threshold", "0", NULL};
  unix_daemon_with(extra);
  precond_client *cs = connect_transport(PRECOND_TRANSPORT_AUTO);
  precond_client *cb = connect_transport(PRECOND_TRANSPORT_GRPC);
  precond_client *cr = connect_transport_ref(PRECOND_TRANSPORT_AUTO, 1);
  precond_layout ls, lb, lr;
  register_job(cs, "via-shm", &ls);
  register_job(cb, "via-bytes", &lb);
  register_job(cr, "via-ref", &lr);
  uint64_t vs[2] = {0, 0}, vb[2] = {0, 0}, vr[2] = {0, 0};
  /* roots by reference kept past their client's close: the mapping stays until released */
  const precond_roots *kept = NULL, *kept_want = NULL;
  for (uint64_t step = 1; step <= 2; step++) {
    for (uint32_t b = 0; b < 2; b++) {
      float *l = gram(128, (unsigned)(10 * step + b)), *r = gram(96, (unsigned)(20 * step + b));
      if (b == 1) { /* written into the client's slot, no copy of the caller's */
        float *p0 = NULL, *p1 = NULL;
        precond_push_slot *slot = NULL;
        assert_int_equal(precond_push_begin(cs, step, b, 128, 96, &p0, &p1, &slot), PRECOND_OK);
        memcpy(p0, l, (size_t)128 * 129 / 2 * sizeof(float));
        memcpy(p1, r, (size_t)96 * 97 / 2 * sizeof(float));
        assert_int_equal(precond_push_commit(cs, slot), PRECOND_OK);
      } else {
        assert_int_equal(precond_push(cs, step, b, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
      }
      assert_int_equal(precond_push(cb, step, b, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
      assert_int_equal(precond_push(cr, step, b, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
      free(l);
      free(r);
    }
    assert_int_equal(precond_flush(cs, ROOT_WAIT_MS), PRECOND_OK);
    assert_int_equal(precond_flush(cb, ROOT_WAIT_MS), PRECOND_OK);
    assert_int_equal(precond_flush(cr, ROOT_WAIT_MS), PRECOND_OK);
    for (uint32_t b = 0; b < 2; b++) {
      const precond_roots *rs = wait_step(cs, b, step, &vs[b]);
      const precond_roots *rb = wait_step(cb, b, step, &vb[b]);
      const precond_roots *rr = wait_step(cr, b, step, &vr[b]);
      assert_memory_equal(rs->left, rb->left, (size_t)128 * 129 / 2 * sizeof(float));
      assert_memory_equal(rs->right, rb->right, (size_t)96 * 97 / 2 * sizeof(float));
      /* By reference: the same values, read where the daemon published them. */
      assert_memory_equal(rr->left, rb->left, (size_t)128 * 129 / 2 * sizeof(float));
      assert_memory_equal(rr->right, rb->right, (size_t)96 * 97 / 2 * sizeof(float));
      assert_int_equal(precond_roots_intact(rr), 1);
      assert_int_equal(precond_roots_intact(rs), 1); /* a copy: always */
      precond_roots_release(rs);
      if (step == 2 && b == 1) {
        kept = rr;
        kept_want = rb;
      } else {
        precond_roots_release(rb);
        precond_roots_release(rr);
      }
    }
  }
  precond_counters ks, kb;
  precond_get_counters(cs, &ks);
  precond_get_counters(cb, &kb);
  /* Every push went through the region (four blocks of two factors) and roots came back
   * through it; the forced client never used one. */
  assert_int_equal(ks.shm_bytes >= ks.bytes_sent, 1);
  assert_true(ks.bytes_sent > 0 && ks.bytes_received > 0);
  assert_true(ks.shm_bytes >= ks.bytes_sent + (uint64_t)2 * (128 * 129 / 2 + 96 * 97 / 2) * 4);
  assert_int_equal(kb.shm_bytes, 0);
  /* Polls through a region are rung at its doorbell, never gRPC calls (session 10). */
  assert_true(ks.fetch_calls > 0 && ks.fetch_rung == ks.fetch_calls);
  assert_int_equal(kb.fetch_rung, 0);
  precond_counters kr;
  precond_get_counters(cr, &kr);
  assert_true(kr.fetch_calls > 0 && kr.fetch_rung == kr.fetch_calls);
  assert_int_equal(ks.roots_by_reference, 0);
  assert_true(kr.roots_by_reference >= 4 && kr.roots_by_reference == kr.roots_received);
  precond_layout_destroy(&ls);
  precond_layout_destroy(&lb);
  precond_layout_destroy(&lr);
  precond_close(cs);
  precond_close(cb);
  precond_close(cr);
  assert_memory_equal(kept->left, kept_want->left, (size_t)128 * 129 / 2 * sizeof(float));
  assert_memory_equal(kept->right, kept_want->right, (size_t)96 * 97 / 2 * sizeof(float));
  precond_roots_release(kept);
  precond_roots_release(kept_want);
  daemon_stop();
  stop_daemon(NULL);

  /* Fallback: no shared memory on the daemon, an AUTO client sends bytes. */
  const char *off[] = {"--shm-dir", "off", NULL};
  unix_daemon_with(off);
  precond_client *c = connect_transport(PRECOND_TRANSPORT_AUTO);
  precond_layout layout;
  register_job(c, "fallback", &layout);
  uint64_t versions[2] = {0, 0};
  push_and_check(c, &layout, 1, 4.0f, 4.0, PRECOND_FP32, versions, 1e-4);
  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.shm_bytes, 0);
  assert_true(k.bytes_received > 0);
  precond_layout_destroy(&layout);
  precond_close(c);
  daemon_stop();
}

/* Registers job with one (128 nblocks) x 96 weight: nblocks 128 x 96 blocks. */
static void register_rows(precond_client *c, const char *job, uint32_t nblocks) {
  const uint64_t shape[2] = {128 * (uint64_t)nblocks, 96};
  precond_tensor t = {"w", 2, shape};
  precond_shampoo_opts so = {.block_size = 128,
                             .skip_limit = 8192,
                             .root_exponent = 4,
                             .epsilon = EPSILON,
                             .beta2 = 1.0f,
                             .method = PRECOND_METHOD_EIGH};
  precond_layout l;
  assert_int_equal(precond_register(c, job, PRECOND_MODE_SHAMPOO, "test", 1, &t, &so, &l),
                   PRECOND_OK);
  assert_int_equal(l.nblocks, nblocks);
  precond_layout_destroy(&l);
}

/* Registers job with one 384 x 96 weight: three 128 x 96 blocks. */
static void register_three(precond_client *c, const char *job) {
  register_rows(c, job, 3);
}

/* A slot of a 128 x 96 block at step (precond_push_begin), filled with the Gram statistics
 * of seed, or (huge 1) 3e38 everywhere, finite but overflowing once added to itself, or
 * (huge 2) the Gram statistics with a NaN (copied: the copy sees it, the slot is not
 * vouched for), or (huge 3) the same NaN written after the copy (a false vouch). */
static precond_push_slot *slot_filled(precond_client *c, uint64_t step, uint32_t b, unsigned seed,
                                      int huge) {
  float *p0 = NULL, *p1 = NULL;
  precond_push_slot *slot = NULL;
  const size_t c0 = (size_t)128 * 129 / 2, c1 = (size_t)96 * 97 / 2;
  assert_int_equal(precond_push_begin(c, step, b, 128, 96, &p0, &p1, &slot), PRECOND_OK);
  if (huge == 1) {
    for (size_t i = 0; i < c0 + c1; i++) p0[i] = 3e38f;
  } else {
    float *l = gram(128, seed), *r = gram(96, seed + 1000);
    if (huge == 2) l[7] = NAN;
    precond_push_copy(slot, p0, l, c0);
    precond_push_copy(slot, p1, r, c1);
    free(l);
    free(r);
    if (huge == 3) p0[7] = NAN;
  }
  return slot;
}

/* One push of a 128 x 96 block at step, written into the client's slot (slot_filled), then
 * the wait until the background thread took it, so that each push is a call of its own
 * (posted at the region's doorbell when there is one). */
static void push_one(precond_client *c, uint64_t step, uint32_t b, unsigned seed, int huge) {
  assert_int_equal(precond_push_commit(c, slot_filled(c, step, b, seed, huge)), PRECOND_OK);
  assert_int_equal(precond_wait_queued(c, 0, ROOT_WAIT_MS), PRECOND_OK);
}

static void wait_stopped(pid_t pid);

/* Waits until c's background thread rang more than n polls at a region's doorbell. */
static void wait_rung_past(precond_client *c, uint64_t n) {
  precond_counters k;
  precond_get_counters(c, &k);
  for (int tries = 0; tries < 20000 && k.fetch_rung <= n; tries++) {
    struct timespec t = {0, 1000000L};
    nanosleep(&t, NULL);
    precond_get_counters(c, &k);
  }
  assert_true(k.fetch_rung > n);
}

/* Waits until c's background thread opened its region (a poll rung at its doorbell). */
static void wait_region(precond_client *c) {
  wait_rung_past(c, 0);
}

/* Both clients' roots of blocks [0, nblocks) at their newest step (steps[b]) are the same
 * bits. */
static void assert_same_roots(precond_client *a, precond_client *b, uint32_t nblocks,
                              const uint64_t *steps) {
  for (uint32_t i = 0; i < nblocks; i++) {
    if (steps[i] == 0) continue;
    uint64_t va = 0, vb = 0;
    const precond_roots *ra = wait_step(a, i, steps[i], &va), *rb = wait_step(b, i, steps[i], &vb);
    assert_memory_equal(ra->left, rb->left, (size_t)128 * 129 / 2 * sizeof(float));
    assert_memory_equal(ra->right, rb->right, (size_t)96 * 97 / 2 * sizeof(float));
    precond_roots_release(ra);
    precond_roots_release(rb);
  }
}

/* A unix-socket daemon (no drift skip: every push's roots computed) and two clients of it:
 * *cs through a region (AUTO; answer_wait: each push's answer awaited), *cb forced to gRPC
 * bytes (a twin job's client). */
static void twins_with(precond_client **cs, precond_client **cb, int answer_wait) {
  const char *extra[] = {"--drift-threshold", "0", NULL};
  unix_daemon_with(extra);
  *cs = connect_with(PRECOND_TRANSPORT_AUTO, 0, answer_wait);
  *cb = connect_transport(PRECOND_TRANSPORT_GRPC);
}

static void twins(precond_client **cs, precond_client **cb) {
  twins_with(cs, cb, 0);
}

static void twins_end(precond_client *cs, precond_client *cb) {
  precond_close(cs);
  precond_close(cb);
  daemon_stop();
}

/* precond_push_begin's slots in the region itself (session 15): written by the caller where
 * the daemon reads them, posted from there with no copy and no NaN/Inf scan of the
 * client's (answer_wait: sent from there, each answer awaited). The same pushes as gRPC
 * bytes on a twin job fold the same bits; a NaN written into a region slot is committed
 * (PRECOND_OK; the twin's scan refuses it at once) and the daemon refuses that push alone,
 * counted in push_errors with its message, the pushes after it kept; a NaN slot committed
 * with others (commit_all: one batch) costs only its own block (the refused batch goes
 * again one block a push); a cancelled slot and a slot coalesced by a newer one of its
 * block leave nothing behind. */
static void region_slots_twins(int answer_wait) {
  precond_client *cs = NULL, *cb = NULL;
  twins_with(&cs, &cb, answer_wait);
  precond_client *both[2] = {cs, cb};
  register_three(cs, "slot-shm");
  register_three(cb, "slot-bytes");
  wait_region(cs);
  {
    /* precond_push_copy of a 1024 block's part (2 MiB) into a region slot (streamed), at a
     * 64-byte boundary and off it: the same bits */
    precond_options o;
    precond_options_default(&o);
    o.addr = g_d.addr;
    o.connect_timeout_ms = 20000;
    o.shm_bytes = 16 << 20; /* worker slots of 6 MiB */
    o.push_answer_wait = answer_wait;
    precond_client *cg = NULL;
    assert_int_equal(precond_connect(&o, &cg), PRECOND_OK);
    const uint64_t shape[2] = {1024, 2};
    precond_tensor t = {"w", 2, shape};
    precond_shampoo_opts so = {.block_size = 1024};
    precond_layout l;
    assert_int_equal(
        precond_register(cg, "slot-copy", PRECOND_MODE_SHAMPOO, "test", 1, &t, &so, &l),
        PRECOND_OK);
    precond_layout_destroy(&l);
    wait_region(cg);
    const size_t c0 = (size_t)1024 * 1025 / 2;
    float *src = malloc(c0 * sizeof(float));
    assert_non_null(src);
    for (size_t i = 0; i < c0; i++) src[i] = (float)i * 0.5f - 7.0f;
    for (size_t k = 0; k < 2; k++) {
      float *p0 = NULL, *p1 = NULL;
      precond_push_slot *slot = NULL;
      assert_int_equal(precond_push_begin(cg, 1, 0, 1024, 2, &p0, &p1, &slot), PRECOND_OK);
      memset(p0, 0, c0 * sizeof(float));
      precond_push_copy(slot, p0 + k, src, c0 - k);
      assert_memory_equal(p0 + k, src, (c0 - k) * sizeof(float));
      if (k == 0) {
        p1[0] = p1[2] = 1.0f;
        p1[1] = 0.0f;
        assert_int_equal(precond_push_commit(cg, slot), PRECOND_OK);
        assert_int_equal(precond_flush(cg, ROOT_WAIT_MS), PRECOND_OK);
      } else {
        precond_push_cancel(slot);
      }
    }
    precond_counters kg;
    precond_get_counters(cg, &kg);
    assert_int_equal(kg.region_slots, 1); /* the slot written was in the region */
    assert_int_equal(kg.sent, 1);
    /* its 2 MiB part written in one mode or the other (session 16) */
    assert_int_equal(kg.region_streamed + kg.region_plain, 1);
    assert_int_equal(kg.pushes_posted, answer_wait ? 0 : 1);
    free(src);
    precond_close(cg);
  }
  for (uint64_t step = 1; step <= 6; step++) {
    for (int k = 0; k < 2; k++) {
      precond_client *c = both[k];
      if (step == 5) {
        /* one commit: block 0 twice (the newer wins), block 1 with a NaN, block 2 */
        precond_push_slot *s[4] = {slot_filled(c, step, 0, 7777, 0),
                                   slot_filled(c, step, 1, 501, 2), slot_filled(c, step, 2, 502, 0),
                                   slot_filled(c, step, 0, 500, 0)};
        assert_int_equal(precond_push_commit_all(c, s, 4), k == 0 ? PRECOND_OK : PRECOND_EINVAL);
        /* answered before step 6: a block of a batch split after its refusal goes back to
         * the queue's head, where a newer push of it queued meanwhile would replace it */
        assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
        continue;
      }
      for (uint32_t b = 0; b < 3; b++) {
        if (step == 3 && b == 1) {
          float *p0 = NULL, *p1 = NULL;
          precond_push_slot *slot = NULL;
          assert_int_equal(precond_push_begin(c, step, b, 128, 96, &p0, &p1, &slot), PRECOND_OK);
          float *l = gram(128, 4242);
          memcpy(p0, l, (size_t)128 * 129 / 2 * sizeof(float));
          memset(p1, 0, (size_t)96 * 97 / 2 * sizeof(float));
          free(l);
          p0[7] = NAN;
          assert_int_equal(precond_push_commit(c, slot), k == 0 ? PRECOND_OK : PRECOND_EINVAL);
          assert_int_equal(precond_wait_queued(c, 0, ROOT_WAIT_MS), PRECOND_OK);
        }
        if (step == 4 && b == 0) precond_push_cancel(slot_filled(c, step, b, 9999, 0));
        push_one(c, step, b, (unsigned)(100 * step + b), 0);
      }
    }
  }
  for (int k = 0; k < 2; k++) assert_int_equal(precond_flush(both[k], ROOT_WAIT_MS), PRECOND_OK);
  const char *jobs[2] = {"slot-shm", "slot-bytes"};
  for (int k = 0; k < 2; k++) {
    precond_stats st;
    assert_int_equal(precond_get_stats(both[k], jobs[k], 1, &st), PRECOND_OK);
    for (size_t i = 0; i < st.nblocks; i++) assert_int_equal(st.block_stats[i].stat_step, 6);
    precond_stats_destroy(&st);
    precond_counters n;
    precond_get_counters(both[k], &n);
    assert_int_equal(n.pushed, k == 0 ? 20 : 18);
    assert_int_equal(n.coalesced, 1);
    assert_int_equal(n.sent, 17);
    assert_int_equal(n.push_errors, k == 0 ? 2 : 0);
    assert_int_equal(n.dropped + n.queued, 0);
    /* every slot of the region client's was in the region; none of the twin's */
    assert_int_equal(n.region_slots, k == 0 ? n.pushed : 0);
    if (k == 0) assert_true(answer_wait ? n.pushes_posted == 0 : n.pushes_posted > 0);
    if (k == 0) {
      char e[512];
      precond_last_error(cs, e, sizeof e);
      assert_non_null(strstr(e, "NaN or Inf")); /* the daemon's own message */
    }
  }
  const uint64_t steps[3] = {6, 6, 6};
  assert_same_roots(cs, cb, 3, steps);
  twins_end(cs, cb);
}

static void test_shm_region_slots(void **state) {
  (void)state;
  region_slots_twins(0);
}

/* The same with push_answer_wait (session 15, later): the slots are in the region too, each
 * batch sent from them and its answer awaited (none posted). */
static void test_shm_region_slots_awaited(void **state) {
  (void)state;
  region_slots_twins(1);
}

/* A commit on a thread of its own (precond_push_commit of slot_filled's slot), for the
 * awaited push rung by the committing thread: rc its return, done set once it returned. */
typedef struct {
  precond_client *c;
  uint64_t step;
  uint32_t block;
  unsigned seed;
  int pushes; /* blocks [block, block + 1) pushed at steps step .. step + pushes - 1 */
  int rc;
  atomic_int done;
} committer;

static void *committer_main(void *arg) {
  committer *m = arg;
  int rc = PRECOND_OK;
  for (int i = 0; i < m->pushes && rc == PRECOND_OK; i++) {
    uint64_t step = m->step + (uint64_t)i;
    rc = precond_push_commit(m->c, slot_filled(m->c, step, m->block, m->seed + (unsigned)step, 0));
    /* each push answered before the next: none coalesced, whoever sends it */
    if (rc == PRECOND_OK && m->pushes > 1) rc = precond_wait_queued(m->c, 0, ROOT_WAIT_MS);
  }
  m->rc = rc;
  atomic_store(&m->done, 1);
  return NULL;
}

/* A unix-socket daemon (no drift skip) and two clients of it, each with three blocks
 * registered: the returned one through a region (*o its options: answer_wait as given, a
 * thread that idles after its first poll, which opens the region and has ended on return),
 * *cb forced to gRPC bytes (the twin job's). */
static precond_client *direct_twins(precond_options *o, int answer_wait, const char *job,
                                    precond_client **cb, const char *twin_job) {
  const char *extra[] = {"--drift-threshold", "0", NULL};
  unix_daemon_with(extra);
  *cb = connect_transport(PRECOND_TRANSPORT_GRPC);
  options_for(o, PRECOND_TRANSPORT_AUTO, 4 << 20);
  o->poll_interval_ms = 600000;
  o->backoff_max_ms = 200;
  o->push_answer_wait = answer_wait;
  precond_client *c = NULL;
  assert_int_equal(precond_connect(o, &c), PRECOND_OK);
  register_three(c, job);
  register_three(*cb, twin_job);
  wait_region(c);
  return c;
}

/* The end of a direct-ring test's first part: c's roots are twin's at steps (twin flushed
 * first), both closed. Then a new client with options o, job registered, its region open:
 * returned. */
static precond_client *twins_checked_new(const precond_options *o, precond_client *c,
                                         precond_client *twin, const uint64_t steps[3],
                                         const char *job) {
  assert_int_equal(precond_flush(twin, ROOT_WAIT_MS), PRECOND_OK);
  assert_int_equal(precond_set_poll_interval(c, 10), PRECOND_OK);
  assert_same_roots(c, twin, 3, steps);
  precond_close(twin);
  precond_close(c);
  precond_client *n = NULL;
  assert_int_equal(precond_connect(o, &n), PRECOND_OK);
  register_three(n, job);
  wait_region(n);
  return n;
}

/* Commits slot on c (the background thread idle) and checks that the committing thread
 * rang it itself (pushes_direct): awaited (push_answer_wait), answered on return; posted,
 * posted; nothing left queued either way. */
static void direct_commit(precond_client *c, precond_push_slot *slot) {
  precond_counters k0, k;
  precond_get_counters(c, &k0);
  assert_int_equal(precond_push_commit(c, slot), PRECOND_OK);
  precond_get_counters(c, &k);
  assert_int_equal(k.pushes_direct, k0.pushes_direct + 1); /* rung by this thread */
  if (k.pushes_posted == k0.pushes_posted)
    assert_int_equal(k.sent + k.push_errors, k0.sent + k0.push_errors + 1); /* answered */
  else
    assert_int_equal(k.pushes_posted, k0.pushes_posted + 1); /* posted, not awaited */
  assert_int_equal(k.queued, 0);
}

/* A daemon restarted after the one holding c's push of job's block 1 at step 13 unanswered
 * was killed: c's flush sends it again (the job registered again), nothing lost. */
static void restarted_holds(precond_client *c, const char *job) {
  unix_daemon_with(NULL);
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.sent, 1);
  assert_int_equal(k.push_errors + k.coalesced + k.dropped, 0);
  assert_true(k.reregistered >= 1);
  precond_stats st;
  assert_int_equal(precond_get_stats(c, job, 1, &st), PRECOND_OK);
  assert_int_equal(st.block_stats[1].stat_step, 13); /* the new daemon holds it */
  precond_stats_destroy(&st);
}

/* Waits until c's daemon folded job's block b at step (its statistic step): the head of
 * that push was taken long before, and its answer is written or about to be. */
static void wait_folded(precond_client *c, const char *job, uint32_t b, uint64_t step) {
  for (int tries = 0; tries < 20000; tries++) {
    precond_stats st;
    assert_int_equal(precond_get_stats(c, job, 1, &st), PRECOND_OK);
    uint64_t got = st.block_stats[b].stat_step;
    precond_stats_destroy(&st);
    if (got >= step) return;
    struct timespec t = {0, 1000000L};
    nanosleep(&t, NULL);
  }
  fail_msg("block %u of %s not folded at step %llu", b, job, (unsigned long long)step);
}

/* Steps 1 and 2 of c's three blocks, each rung by the committing thread (direct_commit),
 * and the same pushes on twin as bytes. posted_job (posted pushes): after each push, the
 * wait until the daemon folded it, so that the next commit finds its head taken (and its
 * answer, collected there without a wait, once written). */
static void direct_steps(precond_client *c, precond_client *twin, const char *posted_job) {
  for (uint64_t step = 1; step <= 2; step++)
    for (uint32_t b = 0; b < 3; b++) {
      direct_commit(c, slot_filled(c, step, b, 100 * (unsigned)step + b, 0));
      push_one(twin, step, b, 100 * (unsigned)step + b, 0);
      if (posted_job != NULL) wait_folded(c, posted_job, b, step);
    }
}

/* Two threads committing c's blocks 0 and 2 at once, steps 3 .. 10 each (committer_main:
 * each push taken or answered before the next), then the same pushes on twin as bytes. */
static void two_committers(precond_client *c, precond_client *twin) {
  committer m[2] = {{.c = c, .step = 3, .block = 0, .seed = 1000, .pushes = 8},
                    {.c = c, .step = 3, .block = 2, .seed = 2000, .pushes = 8}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++)
    assert_int_equal(pthread_create(&th[i], NULL, committer_main, &m[i]), 0);
  for (int i = 0; i < 2; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(m[i].rc, PRECOND_OK);
  }
  for (uint64_t step = 3; step <= 10; step++) {
    push_one(twin, step, 0, 1000 + (unsigned)step, 0);
    push_one(twin, step, 2, 2000 + (unsigned)step, 0);
  }
}

/* After direct_steps and a NaN slot (step 3, block 1): the refusal counted with the
 * daemon's message, the six others sent; then two_committers, all sent, nothing lost. */
static void nan_counted_then_two(precond_client *c, precond_client *twin) {
  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.push_errors, 1);
  assert_int_equal(k.sent, 6);
  char e[512];
  precond_last_error(c, e, sizeof e);
  assert_non_null(strstr(e, "NaN or Inf"));
  two_committers(c, twin);
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(c, &k);
  assert_int_equal(k.sent, 6 + 16);
  assert_int_equal(k.push_errors, 1);
  assert_int_equal(k.coalesced + k.dropped + k.queued, 0);
}

/* Waits until c's counters.pushes_direct reaches n. */
static void wait_direct(precond_client *c, uint64_t n) {
  precond_counters k;
  precond_get_counters(c, &k);
  for (int tries = 0; tries < 20000 && k.pushes_direct < n; tries++) {
    struct timespec t = {0, 1000000L};
    nanosleep(&t, NULL);
    precond_get_counters(c, &k);
  }
  assert_true(k.pushes_direct >= n);
}

/* push_answer_wait's pacing (session 16): precond_wait_queued counts the blocks taken and
 * not yet answered, so a worker pacing itself with it writes its next statistic only once
 * the daemon folded the last one. The daemon stopped: the awaited push leaves the queue
 * (taken, its ring call rung by the committing thread, which waits for the answer) and the
 * wait still times out, as its answer cannot come;
 * posted, the same wait ends once the push is taken (unchanged). Let go, the wait ends with
 * the push answered; the slots were in the region and fold the same bits as a gRPC twin's
 * pushes. */
static void test_shm_awaited_paced(void **state) {
  (void)state;
  const char *extra[] = {"--drift-threshold", "0", NULL};
  unix_daemon_with(extra);
  precond_client *cs[2] = {NULL, NULL}, *cb = connect_transport(PRECOND_TRANSPORT_GRPC);
  for (int k = 0; k < 2; k++) {
    /* no poll after the first (it opens the region) while the daemon is stopped: the
     * background threads make no call but the pushes' */
    precond_options o;
    options_for(&o, PRECOND_TRANSPORT_AUTO, 4 << 20);
    o.poll_interval_ms = 600000;
    o.push_answer_wait = k == 0;
    assert_int_equal(precond_connect(&o, &cs[k]), PRECOND_OK);
  }
  precond_client *cw = cs[0], *cp = cs[1];
  register_three(cw, "paced-wait");
  register_three(cp, "paced-post");
  register_three(cb, "paced-bytes");
  wait_region(cw);
  wait_region(cp);
  assert_int_equal(kill(g_d.pid, SIGSTOP), 0);
  wait_stopped(g_d.pid);
  /* cw's push is rung by its committing thread (session 16), which waits for the answer */
  committer m = {.c = cw, .step = 1, .block = 0, .seed = 99, .pushes = 1};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, committer_main, &m), 0);
  assert_int_equal(precond_push_commit(cp, slot_filled(cp, 1, 0, 100, 0)), PRECOND_OK);
  assert_int_equal(precond_wait_queued(cp, 0, ROOT_WAIT_MS), PRECOND_OK); /* taken, posted */
  wait_direct(cw, 1);
  precond_counters k;
  precond_get_counters(cw, &k);
  for (int tries = 0; tries < 10000 && k.queued > 0; tries++) {
    struct timespec t = {0, 1000000L};
    nanosleep(&t, NULL);
    precond_get_counters(cw, &k);
  }
  assert_int_equal(k.queued, 0); /* taken: what is left to wait for is its answer */
  assert_int_equal(precond_wait_queued(cw, 0, 300), PRECOND_ETIMEDOUT);
  assert_int_equal(atomic_load(&m.done), 0);
  assert_int_equal(kill(g_d.pid, SIGCONT), 0);
  assert_int_equal(precond_wait_queued(cw, 0, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(cw, &k);
  assert_int_equal(k.sent, 1); /* answered by the time the wait ended */
  pthread_join(th, NULL);
  assert_int_equal(m.rc, PRECOND_OK);
  assert_int_equal(k.pushes_direct, 1);
  push_one(cw, 2, 0, 200, 0);
  precond_get_counters(cw, &k);
  assert_int_equal(k.sent, 2);
  assert_int_equal(k.region_slots, 2);
  assert_int_equal(k.pushes_posted, 0);
  assert_int_equal(k.push_errors + k.coalesced + k.dropped, 0);
  precond_stats st;
  assert_int_equal(precond_get_stats(cw, "paced-wait", 1, &st), PRECOND_OK);
  assert_int_equal(st.block_stats[0].stat_step, 2); /* folded before the wait returned */
  precond_stats_destroy(&st);
  assert_int_equal(precond_flush(cp, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(cp, &k);
  assert_int_equal(k.sent, 1);
  assert_int_equal(k.pushes_posted, 1);
  for (uint64_t step = 1; step <= 2; step++) push_one(cb, step, 0, 100 * (unsigned)step, 0);
  assert_int_equal(precond_flush(cb, ROOT_WAIT_MS), PRECOND_OK);
  assert_int_equal(precond_set_poll_interval(cw, 10), PRECOND_OK);
  const uint64_t steps[3] = {2, 0, 0};
  assert_same_roots(cw, cb, 3, steps);
  precond_close(cp);
  twins_end(cw, cb);
}

/* The awaited push rung by the committing thread (session 16): with push_answer_wait, a
 * slot's push committed while nothing else is queued or in flight and the background
 * thread is idle is sent by precond_push_commit itself, answered when it returns
 * (pushes_direct, sent counted at once); a NaN slot's refusal is counted at once; two
 * threads committing at once lose nothing and keep each block's push order; the daemon
 * stopped under a commit holds it until it answers; the daemon killed under one puts the
 * push back in the queue, sent again to the restarted daemon. The region's pushes fold the
 * same bits as a gRPC twin's. */
static void test_shm_awaited_direct(void **state) {
  (void)state;
  precond_options o;
  precond_client *cb = NULL, *cw = direct_twins(&o, 1, "direct-wait", &cb, "direct-bytes");
  precond_counters k, k0;
  direct_steps(cw, cb, NULL);
  /* a NaN slot: committed, refused by the daemon's fold, counted when commit returns */
  direct_commit(cw, slot_filled(cw, 3, 1, 77, 2));
  nan_counted_then_two(cw, cb);
  precond_get_counters(cw, &k);
  assert_int_equal(k.pushes_posted, 0);
  /* the daemon stopped under a commit: it waits for the answer, nothing lost */
  assert_int_equal(kill(g_d.pid, SIGSTOP), 0);
  wait_stopped(g_d.pid);
  precond_get_counters(cw, &k0);
  pthread_t th;
  committer s = {.c = cw, .step = 11, .block = 0, .seed = 1000, .pushes = 1};
  assert_int_equal(pthread_create(&th, NULL, committer_main, &s), 0);
  wait_direct(cw, k0.pushes_direct + 1);
  assert_int_equal(precond_wait_queued(cw, 0, 300), PRECOND_ETIMEDOUT); /* in flight */
  assert_int_equal(atomic_load(&s.done), 0); /* the stopped daemon cannot answer */
  assert_int_equal(kill(g_d.pid, SIGCONT), 0);
  pthread_join(th, NULL);
  assert_int_equal(s.rc, PRECOND_OK);
  precond_get_counters(cw, &k);
  assert_int_equal(k.sent, k0.sent + 1);
  push_one(cb, 11, 0, 1011, 0);
  const uint64_t steps[3] = {11, 2, 10};
  /* the daemon killed under a commit: the push goes back to the queue, and to the new
   * daemon (the job registered again); a new client, whose thread idles after its first
   * poll (its counters seen after the poll ended: the thread was idle by then) */
  cw = twins_checked_new(&o, cw, cb, steps, "direct-kill");
  assert_int_equal(kill(g_d.pid, SIGSTOP), 0);
  wait_stopped(g_d.pid);
  precond_get_counters(cw, &k0);
  committer x = {.c = cw, .step = 13, .block = 1, .seed = 3000, .pushes = 1};
  assert_int_equal(pthread_create(&th, NULL, committer_main, &x), 0);
  wait_direct(cw, k0.pushes_direct + 1);
  pdproc_stop(&g_d, SIGKILL);
  pthread_join(th, NULL);
  assert_int_equal(x.rc, PRECOND_OK);
  precond_get_counters(cw, &k);
  assert_int_equal(k.sent, 0); /* not answered: back in the queue */
  assert_int_equal(k.pushes_direct, 1);
  restarted_holds(cw, "direct-kill");
  precond_close(cw);
  daemon_stop();
}

/* The posted push rung by the committing thread (session 17): without push_answer_wait, a
 * slot's push committed alone while the background thread is idle is posted by
 * precond_push_commit itself (pushes_direct and pushes_posted both count it, nothing left
 * queued when commit returns), the answers of earlier posts collected there when they are
 * in; the pushes fold the same bits as a gRPC twin's. A NaN slot so posted is refused by the
 * daemon and counted in push_errors one push later (here: after the flush). Two threads
 * committing at once lose nothing and keep each block's order. The daemon stopped with a
 * push posted: commits return (a push that would wait on it goes to the background thread,
 * as before) and nothing is lost once it runs again; killed with a push posted and
 * restarted: the push goes again to the new daemon (the job registered again), and the
 * commits after it are rung directly again. */
static void test_shm_posted_direct(void **state) {
  (void)state;
  precond_options o;
  precond_client *cb = NULL, *cp = direct_twins(&o, 0, "pdirect-post", &cb, "pdirect-bytes");
  precond_counters k, k0;
  direct_steps(cp, cb, "pdirect-post");
  precond_get_counters(cp, &k);
  assert_true(k.sent >= 4); /* the earlier posts' answers, collected by later commits */
  /* a NaN slot: committed, posted, refused by the daemon's fold, counted once collected */
  direct_commit(cp, slot_filled(cp, 3, 1, 77, 2));
  assert_int_equal(precond_flush(cp, ROOT_WAIT_MS), PRECOND_OK);
  nan_counted_then_two(cp, cb);
  /* the daemon stopped with pushes posted: the commits return, nothing is lost */
  wait_folded(cp, "pdirect-post", 2, 10);
  assert_int_equal(kill(g_d.pid, SIGSTOP), 0);
  wait_stopped(g_d.pid);
  precond_get_counters(cp, &k0);
  for (uint32_t b = 0; b < 3; b++)
    assert_int_equal(precond_push_commit(cp, slot_filled(cp, 11, b, 3000 + b, 0)), PRECOND_OK);
  precond_get_counters(cp, &k);
  for (int tries = 0; tries < 10000 && k.pushes_posted == k0.pushes_posted; tries++) {
    struct timespec t = {0, 1000000L};
    nanosleep(&t, NULL);
    precond_get_counters(cp, &k);
  }
  assert_true(k.pushes_posted > k0.pushes_posted); /* rung; the stopped daemon cannot answer */
  assert_int_equal(k.sent, k0.sent);
  assert_int_equal(kill(g_d.pid, SIGCONT), 0);
  assert_int_equal(precond_flush(cp, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(cp, &k);
  assert_int_equal(k.sent, k0.sent + 3);
  assert_int_equal(k.push_errors + k.coalesced + k.dropped + k.queued, 1);
  for (uint32_t b = 0; b < 3; b++) push_one(cb, 11, b, 3000 + b, 0);
  const uint64_t steps[3] = {11, 11, 11};
  /* the daemon killed with a push posted: it goes again to the new daemon; a new client,
   * whose thread idles after its first poll (seen ended: wait_region) */
  cp = twins_checked_new(&o, cp, cb, steps, "pdirect-kill");
  assert_int_equal(kill(g_d.pid, SIGSTOP), 0);
  wait_stopped(g_d.pid);
  assert_int_equal(precond_push_commit(cp, slot_filled(cp, 13, 1, 4000, 0)), PRECOND_OK);
  precond_get_counters(cp, &k);
  assert_int_equal(k.pushes_direct, 1); /* posted by the commit, not answered */
  assert_int_equal(k.pushes_posted, 1);
  assert_int_equal(k.queued, 0);
  pdproc_stop(&g_d, SIGKILL);
  restarted_holds(cp, "pdirect-kill");
  /* recovered: the pushes after it are sent, and, once a new region is open (a poll rung
   * there; a failed open is tried again 10 s later) and the thread idles again (one poll
   * more, at the period's change), rung directly again: of 20, at least one */
  precond_get_counters(cp, &k0);
  assert_int_equal(precond_set_poll_interval(cp, 10), PRECOND_OK);
  wait_rung_past(cp, k0.fetch_rung);
  assert_int_equal(precond_set_poll_interval(cp, 600000), PRECOND_OK);
  precond_get_counters(cp, &k0);
  for (uint64_t step = 14; step < 34; step++) push_one(cp, step, 0, 4000 + (unsigned)step, 0);
  assert_int_equal(precond_flush(cp, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(cp, &k);
  assert_int_equal(k.sent, 21);
  assert_int_equal(k.push_errors + k.coalesced + k.dropped, 0);
  assert_true(k.pushes_direct > k0.pushes_direct);
  wait_folded(cp, "pdirect-kill", 0, 33);
  precond_close(cp);
  daemon_stop();
}

/* A client of g_d's daemon over transport t (regions of shm_bytes) with job registered:
 * one rows x cols Shampoo tensor in blocks of block, at beta2 (0: the default). */
static precond_client *tensor_client(precond_transport t, uint64_t shm_bytes, const char *job,
                                     uint64_t rows, uint64_t cols, uint32_t block, float beta2) {
  precond_options o;
  options_for(&o, t, shm_bytes);
  precond_client *c = NULL;
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  const uint64_t shape[2] = {rows, cols};
  precond_tensor w = {"w", 2, shape};
  precond_shampoo_opts so = {.block_size = block, .beta2 = beta2};
  precond_layout l;
  assert_int_equal(precond_register(c, job, PRECOND_MODE_SHAMPOO, "test", 1, &w, &so, &l),
                   PRECOND_OK);
  precond_layout_destroy(&l);
  return c;
}

/* Vouched slots (session 16), two 768 x 4 blocks (a left factor of 1.2 MB: the streamed
 * copy): the client registers job at beta2 over transport t (regions of 16 MiB). */
static precond_client *vouch_client(precond_transport t, const char *job, float beta2) {
  return tensor_client(t, 16 << 20, job, 1536, 4, 768, beta2);
}

/* A slot of step for c's 768 x 4 block b, both parts written by precond_push_copy (vouched
 * where the slot is in the region): small values of seed and a dominant diagonal; lie: a
 * NaN and 1e38 (>= 2^125) written into the left part after its copy. */
static precond_push_slot *vouch_slot(precond_client *c, uint64_t step, uint32_t b, unsigned seed,
                                     int lie) {
  const size_t c0 = (size_t)768 * 769 / 2, c1 = (size_t)4 * 5 / 2;
  float *src = malloc((c0 + c1) * sizeof(float)), *p0 = NULL, *p1 = NULL;
  assert_non_null(src);
  for (size_t i = 0; i < c0 + c1; i++) src[i] = (float)((i * 7919 + seed * 104729) % 1000) * 1e-6f;
  for (uint32_t i = 0, k = 0; i < 768; k += 768 - i, i++) src[k] += 1.0f; /* the diagonal */
  for (uint32_t i = 0, k = 0; i < 4; k += 4 - i, i++) src[c0 + k] += 1.0f;
  precond_push_slot *slot = NULL;
  assert_int_equal(precond_push_begin(c, step, b, 768, 4, &p0, &p1, &slot), PRECOND_OK);
  precond_push_copy(slot, p0, src, c0);
  precond_push_copy(slot, p1, src + c0, c1);
  if (lie) {
    p0[3] = NAN;
    p0[c0 - 1] = 1e38f;
  }
  free(src);
  return slot;
}

/* Both blocks of c at step in one commit (one batch); lie: block 1's slot lies. */
static void vouch_step(precond_client *c, uint64_t step, int lie) {
  precond_push_slot *s[2] = {vouch_slot(c, step, 0, (unsigned)step, 0),
                             vouch_slot(c, step, 1, (unsigned)step + 100, lie)};
  assert_int_equal(precond_push_commit_all(c, s, 2), PRECOND_OK);
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
}

/* Slots written by precond_push_copy are vouched for and the client promises at ShmOpen to
 * hold them until answered (session 16): the daemon folds them in place with no spare. The
 * EMA's and the sums' roots are the gRPC twins' bit for bit after four pushes. A false
 * vouch (a NaN and 1e38 written after the copy into block 1's slot, committed with block
 * 0's) is refused torn: counted in the daemon's torn_pushes and the client's push_errors
 * (both blocks), its message naming the field, and not sent again (block 0, folded once in
 * the torn push, is still the honest sums' bits); block 1's statistic stays finite (the
 * next push's roots are published) and the other jobs, in the same daemon, are untouched
 * (still their twins' bits). */
static void test_shm_region_vouched(void **state) {
  (void)state;
  const char *extra[] = {"--drift-threshold", "0", NULL};
  unix_daemon_with(extra);
  precond_client *c[5] = {vouch_client(PRECOND_TRANSPORT_AUTO, "v-ema", 0.99f),
                          vouch_client(PRECOND_TRANSPORT_AUTO, "v-sum", 1.0f),
                          vouch_client(PRECOND_TRANSPORT_GRPC, "v-ema-bytes", 0.99f),
                          vouch_client(PRECOND_TRANSPORT_GRPC, "v-sum-bytes", 1.0f),
                          vouch_client(PRECOND_TRANSPORT_AUTO, "v-liar", 1.0f)};
  for (int j = 0; j < 5; j++)
    if (j != 2 && j != 3) wait_region(c[j]);
  for (uint64_t step = 1; step <= 4; step++)
    for (int j = 0; j < 5; j++) vouch_step(c[j], step, j == 4 && step == 3);
  const size_t c0 = (size_t)768 * 769 / 2, c1 = (size_t)4 * 5 / 2;
  /* (the EMA, its twin), (the sums, theirs), (the liar's block 0, the sums' block 0) */
  const int pair[3][2] = {{0, 2}, {1, 3}, {4, 1}};
  for (int j = 0; j < 3; j++)
    for (uint32_t b = 0; b < (j < 2 ? 2u : 1u); b++) {
      uint64_t va = 0, vb = 0;
      const precond_roots *ra = wait_step(c[pair[j][0]], b, 4, &va),
                          *rb = wait_step(c[pair[j][1]], b, 4, &vb);
      assert_memory_equal(ra->left, rb->left, c0 * sizeof(float));
      assert_memory_equal(ra->right, rb->right, c1 * sizeof(float));
      precond_roots_release(ra);
      precond_roots_release(rb);
    }
  for (int j = 0; j < 2; j++) {
    precond_counters k;
    precond_get_counters(c[j], &k);
    assert_int_equal(k.region_slots, 8);
    assert_int_equal(k.sent, 8);
    assert_int_equal(k.push_errors, 0);
  }
  precond_counters k;
  precond_get_counters(c[4], &k);
  assert_int_equal(k.region_slots, 8);
  assert_int_equal(k.sent, 6);
  assert_int_equal(k.push_errors, 2);
  char e[512];
  precond_last_error(c[4], e, sizeof e);
  assert_non_null(strstr(e, "DATA_LOSS"));
  assert_non_null(strstr(e, "blocks[1].left.shm.vouched"));
  assert_non_null(strstr(e, "torn"));
  uint64_t v = 0;
  const precond_roots *r = wait_step(c[4], 1, 4, &v); /* published: finite */
  for (size_t i = 0; i < c0; i++) assert_true(isfinite(r->left[i]));
  precond_roots_release(r);
  precond_stats st;
  assert_int_equal(precond_get_stats(c[0], NULL, 0, &st), PRECOND_OK);
  assert_int_equal(st.torn_pushes, 1);
  assert_int_equal(st.rejected_pushes, 1);
  precond_stats_destroy(&st);
  for (int j = 0; j < 5; j++) precond_close(c[j]);
  daemon_stop();
}

/* A slot of step for c's 768 x 4 block b written in place as a kernel would: left G G^T,
 * right G^T G of a 768 x 4 G of seed (small values), then precond_push_vouch_gram, whose
 * count must be want. bad: after the write, 1 a NaN on the left diagonal (a NaN in G would
 * show there), 2 an off-diagonal 1e38 (>= 2^125) with the diagonal small (no Gram matrix). */
static precond_push_slot *gram_slot(precond_client *c, uint64_t step, uint32_t b, unsigned seed,
                                    int bad, int want) {
  enum { ROWS = 768, COLS = 4 };
  float *g = malloc((size_t)ROWS * COLS * sizeof(float)), *p0 = NULL, *p1 = NULL;
  assert_non_null(g);
  for (size_t i = 0; i < (size_t)ROWS * COLS; i++)
    g[i] = (float)((int)((i * 31 + seed * 7) % 23) - 11) * 0.01f;
  precond_push_slot *slot = NULL;
  assert_int_equal(precond_push_begin(c, step, b, ROWS, COLS, &p0, &p1, &slot), PRECOND_OK);
  for (size_t i = 0, k = 0; i < ROWS; i++)
    for (size_t j = i; j < ROWS; j++, k++) {
      float sum = 0.0f;
      for (size_t l = 0; l < COLS; l++) sum += g[i * COLS + l] * g[j * COLS + l];
      p0[k] = sum;
    }
  for (size_t i = 0, k = 0; i < COLS; i++)
    for (size_t j = i; j < COLS; j++, k++) {
      float sum = 0.0f;
      for (size_t r = 0; r < ROWS; r++) sum += g[r * COLS + i] * g[r * COLS + j];
      p1[k] = sum;
    }
  if (bad == 1) p0[ROWS] = NAN; /* row 1's diagonal */
  if (bad == 2) p0[1] = 1e38f;
  free(g);
  assert_int_equal(precond_push_vouch_gram(slot), want);
  return slot;
}

/* The daemon's count of pushes folded without the spare (GetStats vouched_pushes), and
 * of those refused torn and refused at all. */
static void fold_counts(precond_client *c, uint64_t *vouched, uint64_t *torn, uint64_t *rejected) {
  precond_stats st;
  assert_int_equal(precond_get_stats(c, NULL, 0, &st), PRECOND_OK);
  *vouched = st.vouched_pushes;
  *torn = st.torn_pushes;
  *rejected = st.rejected_pushes;
  precond_stats_destroy(&st);
}

/* Slots a kernel wrote itself, vouched for by precond_push_vouch_gram (session 16): Gram
 * statistics (both parts vouched in the region, none over gRPC) are folded without the
 * spare (the daemon's vouched_pushes moves by one a push once the statistic is bounded,
 * after the first) and their roots are the gRPC twin's bit for bit after four pushes. A NaN
 * on a diagonal is not vouched for: that push keeps the spare's fold and is refused whole
 * (not torn, not counted vouched), the job's roots later still published. A false claim
 * (an off-diagonal 1e38 over a small diagonal) is refused torn and counted, its statistic
 * finite: the next push is folded spare-free again, which the daemon does only for a
 * statistic known below 2^126 (its torn statistic, no longer PSD, may get no root). */
static void test_shm_region_vouch_gram(void **state) {
  (void)state;
  const char *extra[] = {"--drift-threshold", "0", NULL};
  unix_daemon_with(extra);
  precond_client *c[4] = {vouch_client(PRECOND_TRANSPORT_AUTO, "g-sum", 1.0f),
                          vouch_client(PRECOND_TRANSPORT_GRPC, "g-sum-bytes", 1.0f),
                          vouch_client(PRECOND_TRANSPORT_AUTO, "g-nan", 1.0f),
                          vouch_client(PRECOND_TRANSPORT_AUTO, "g-liar", 1.0f)};
  wait_region(c[0]);
  wait_region(c[2]);
  wait_region(c[3]);
  assert_int_equal(precond_push_vouch_gram(NULL), PRECOND_EINVAL);
  uint64_t v0, t0, r0, v1, t1, r1;
  fold_counts(c[0], &v0, &t0, &r0);
  for (uint64_t step = 1; step <= 4; step++)
    for (int j = 0; j < 2; j++) {
      precond_push_slot *s[2] = {gram_slot(c[j], step, 0, (unsigned)step, 0, j == 0 ? 2 : 0),
                                 gram_slot(c[j], step, 1, (unsigned)step + 50, 0, j == 0 ? 2 : 0)};
      assert_int_equal(precond_push_commit_all(c[j], s, 2), PRECOND_OK);
      assert_int_equal(precond_flush(c[j], ROOT_WAIT_MS), PRECOND_OK);
    }
  fold_counts(c[0], &v1, &t1, &r1);
  assert_int_equal(v1 - v0, 3); /* the first push found no bounded statistic */
  assert_int_equal(t1, t0);
  assert_int_equal(r1, r0);
  for (uint32_t b = 0; b < 2; b++) {
    uint64_t va = 0, vb = 0;
    const precond_roots *ra = wait_step(c[0], b, 4, &va), *rb = wait_step(c[1], b, 4, &vb);
    assert_memory_equal(ra->left, rb->left, (size_t)768 * 769 / 2 * sizeof(float));
    assert_memory_equal(ra->right, rb->right, (size_t)4 * 5 / 2 * sizeof(float));
    precond_roots_release(ra);
    precond_roots_release(rb);
  }
  /* j = 2 with a NaN on the diagonal at step 2, j = 3 a false claim at step 2. */
  for (int j = 2; j < 4; j++) {
    for (uint64_t step = 1; step <= 3; step++) {
      int bad = step == 2 ? j - 1 : 0;
      precond_push_slot *s = gram_slot(c[j], step, 0, (unsigned)step, bad, bad == 1 ? 1 : 2);
      int st = precond_push_commit(c[j], s);
      assert_int_equal(st, PRECOND_OK);
      assert_int_equal(precond_flush(c[j], ROOT_WAIT_MS), PRECOND_OK);
      fold_counts(c[0], &v0, &t0, &r0);
      assert_int_equal(v0 - v1, step > 1 && bad != 1 ? 1 : 0);
      assert_int_equal(t0 - t1, bad == 2 ? 1 : 0);
      assert_true(r0 > r1 || !bad);
      v1 = v0;
      t1 = t0;
      r1 = r0;
    }
    precond_counters k;
    precond_get_counters(c[j], &k);
    assert_true(k.push_errors >= 1);
    char e[512];
    precond_last_error(c[j], e, sizeof e);
    assert_non_null(strstr(e, j == 2 ? "INVALID_ARGUMENT" : "DATA_LOSS"));
    if (j == 3) continue; /* torn: step 3 folded spare-free above, so known below 2^126 */
    uint64_t v = 0;
    const precond_roots *r = wait_step(c[j], 0, 3, &v); /* published: finite */
    for (size_t i = 0; i < (size_t)768 * 769 / 2; i++) assert_true(isfinite(r->left[i]));
    precond_roots_release(r);
  }
  for (int j = 0; j < 4; j++) precond_close(c[j]);
  daemon_stop();
}

/* The region's worker slots while none is answered (the daemon stopped): taken in order,
 * they fill the part, and a push that finds no room is a queue entry (copied later, never
 * blocking); the oldest slot given back (cancelled) frees its place, and the next slot wraps
 * around to it, and no further: the next slot's place is still held, unanswered. No slot
 * was written over another before its answer: the daemon, let go, folds the same bits as a
 * gRPC twin. */
static void test_shm_region_full(void **state) {
  (void)state;
  precond_client *cs = NULL, *cb = NULL;
  twins(&cs, &cb);
  register_rows(cs, "full-shm", 40);
  register_rows(cb, "full-bytes", 40);
  wait_region(cs);
  for (uint32_t b = 0; b < 3; b++) push_one(cs, 1, b, b, 0); /* answered: places free again */
  assert_int_equal(precond_flush(cs, ROOT_WAIT_MS), PRECOND_OK);
  precond_counters k0, k1, k2;
  precond_get_counters(cs, &k0);
  assert_int_equal(k0.region_slots, 3);
  assert_int_equal(kill(g_d.pid, SIGSTOP), 0);
  wait_stopped(g_d.pid);
  /* A 4 MiB region: a ring of 2 MiB - 64, its first quarter the background thread's, the
   * rest (1572864 bytes) worker slots of 51648 bytes (a 128 x 96 block's two parts): 30,
   * one of them held (the part's first place). */
  precond_push_slot *held = slot_filled(cs, 2, 39, 1, 0);
  for (uint32_t b = 0; b < 36; b++)
    assert_int_equal(precond_push_commit(cs, slot_filled(cs, 2, b, 100 + b, 0)), PRECOND_OK);
  precond_get_counters(cs, &k1);
  assert_int_equal(k1.region_slots - k0.region_slots, 29);
  precond_push_cancel(held); /* the oldest: its place, and only it, is free */
  for (uint32_t b = 36; b < 39; b++)
    assert_int_equal(precond_push_commit(cs, slot_filled(cs, 2, b, 100 + b, 0)), PRECOND_OK);
  precond_get_counters(cs, &k2);
  assert_int_equal(k2.region_slots - k1.region_slots, 1);
  assert_int_equal(kill(g_d.pid, SIGCONT), 0);
  assert_int_equal(precond_flush(cs, ROOT_WAIT_MS), PRECOND_OK);
  /* The twin: the same pushes, as bytes. */
  for (uint32_t b = 0; b < 3; b++) push_one(cb, 1, b, b, 0);
  for (uint32_t b = 0; b < 39; b++)
    assert_int_equal(precond_push_commit(cb, slot_filled(cb, 2, b, 100 + b, 0)), PRECOND_OK);
  assert_int_equal(precond_flush(cb, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(cs, &k2);
  assert_int_equal(k2.sent, 42);
  assert_int_equal(k2.push_errors + k2.coalesced + k2.dropped, 0);
  uint64_t steps[40] = {0};
  for (uint32_t b = 0; b < 39; b++) steps[b] = 2;
  assert_same_roots(cs, cb, 40, steps);
  twins_end(cs, cb);
}

/* The window's lap (session 17): slots of a 1024 x 2 block (2 MiB each) in a 32 MiB region's
 * part (five places) are taken in order until the lap holds 8 MiB (four); the next goes
 * back to the part's start when that place is free (the oldest slot cancelled), and on
 * along the part while it is not. Slots held uncommitted: the daemon plays no part. */
static void test_shm_window_lap(void **state) {
  (void)state;
  unix_daemon();
  precond_client *c = tensor_client(PRECOND_TRANSPORT_AUTO, 32 << 20, "lap", 1024, 2, 1024, 0);
  wait_region(c);
  for (int start_free = 1; start_free >= 0; start_free--) {
    float *p0[5], *p1 = NULL;
    precond_push_slot *s[5];
    for (int i = 0; i < 4; i++)
      assert_int_equal(precond_push_begin(c, 1, 0, 1024, 2, &p0[i], &p1, &s[i]), PRECOND_OK);
    const ptrdiff_t step = p0[1] - p0[0];
    assert_true(step > 0);
    for (int i = 2; i < 4; i++) assert_true(p0[i] - p0[i - 1] == step); /* in order */
    if (start_free) precond_push_cancel(s[0]);
    assert_int_equal(precond_push_begin(c, 1, 0, 1024, 2, &p0[4], &p1, &s[4]), PRECOND_OK);
    if (start_free)
      assert_ptr_equal(p0[4], p0[0]); /* the lap ended: back at the start */
    else
      assert_true(p0[4] - p0[3] == step); /* the start held: the lap goes on */
    for (int i = start_free; i < 5; i++) precond_push_cancel(s[i]); /* all given back */
  }
  precond_close(c);
  daemon_stop();
}

/* Pushes posted at the region's doorbell and collected later (session 14) fold the same
 * bits, in the same order, as the same pushes sent as gRPC bytes on a twin job; a push the
 * daemon refuses (an overflow: NaN is refused here before it leaves) is reported one push
 * later through the same counters and message, the others kept; a NaN push in between is
 * refused at once and changes nothing; precond_flush returns only once every push was
 * answered (the daemon's statistic step is the last one right after it). */
static void test_shm_pipelined_same_as_bytes(void **state) {
  (void)state;
  const char *extra[] = {"--drift-threshold", "0", NULL};
  unix_daemon_with(extra);
  precond_client *cs = connect_transport(PRECOND_TRANSPORT_AUTO);
  precond_client *cb = connect_transport(PRECOND_TRANSPORT_GRPC);
  precond_options ow;
  precond_options_default(&ow);
  ow.addr = g_d.addr;
  ow.connect_timeout_ms = 20000;
  ow.poll_interval_ms = 10;
  ow.shm_bytes = 4 << 20;
  ow.push_answer_wait = 1; /* through the region, each answer awaited (before session 14) */
  precond_client *cw = NULL;
  assert_int_equal(precond_connect(&ow, &cw), PRECOND_OK);
  precond_client *both[3] = {cs, cb, cw};
  register_three(cs, "pipe-shm");
  register_three(cb, "pipe-bytes");
  register_three(cw, "pipe-wait");
  float *nan_l = scaled_identity(128, 1.0f), *nan_r = scaled_identity(96, 1.0f);
  nan_l[5] = NAN;
  for (uint64_t step = 1; step <= 6; step++)
    for (uint32_t b = 0; b < 3; b++)
      for (int k = 0; k < 3; k++) {
        if (step == 5 && b == 0)
          assert_int_equal(precond_push(both[k], step, b, 128, nan_l, 96, nan_r, PRECOND_FP32),
                           PRECOND_EINVAL);
        /* block 2: 3e38 at step 3 is taken, step 4's would overflow it and is refused */
        push_one(both[k], step, b, (unsigned)(100 * step + b), b == 2 && (step == 3 || step == 4));
      }
  free(nan_l);
  free(nan_r);
  for (int k = 0; k < 3; k++) assert_int_equal(precond_flush(both[k], ROOT_WAIT_MS), PRECOND_OK);
  const char *jobs[3] = {"pipe-shm", "pipe-bytes", "pipe-wait"};
  for (int k = 0; k < 3; k++) {
    /* Flushed: the daemon already folded (or refused) every push, the last one included. */
    precond_stats s;
    assert_int_equal(precond_get_stats(both[k], jobs[k], 1, &s), PRECOND_OK);
    assert_int_equal(s.nblocks, 3);
    for (size_t i = 0; i < s.nblocks; i++) assert_int_equal(s.block_stats[i].stat_step, 6);
    precond_stats_destroy(&s);
    precond_counters n;
    precond_get_counters(both[k], &n);
    assert_int_equal(n.pushed, 18);
    assert_int_equal(n.sent, 17);
    assert_int_equal(n.push_errors, 1);
    assert_int_equal(n.coalesced + n.dropped + n.queued, 0);
    char e[512];
    precond_last_error(both[k], e, sizeof e);
    assert_non_null(strstr(e, "overflow"));
    if (k == 0)
      assert_true(n.pushes_posted >= 10 && n.shm_bytes >= n.bytes_sent);
    else
      assert_int_equal(n.pushes_posted, 0);
    if (k == 2) assert_true(n.shm_bytes >= n.bytes_sent);
  }
  for (uint32_t b = 0; b < 2; b++) {
    uint64_t vs = 0, vb = 0, vw = 0;
    const precond_roots *rs = wait_step(cs, b, 6, &vs), *rb = wait_step(cb, b, 6, &vb);
    const precond_roots *rw = wait_step(cw, b, 6, &vw);
    assert_memory_equal(rs->left, rb->left, (size_t)128 * 129 / 2 * sizeof(float));
    assert_memory_equal(rs->right, rb->right, (size_t)96 * 97 / 2 * sizeof(float));
    assert_memory_equal(rw->left, rb->left, (size_t)128 * 129 / 2 * sizeof(float));
    assert_memory_equal(rw->right, rb->right, (size_t)96 * 97 / 2 * sizeof(float));
    precond_roots_release(rs);
    precond_roots_release(rb);
    precond_roots_release(rw);
  }
  precond_close(cs);
  precond_close(cb);
  precond_close(cw);
  daemon_stop();
}

/* Waits until every thread of process pid is stopped (SIGSTOP acts on each thread as it
 * next leaves the kernel or is interrupted, not when kill returns). */
static void wait_stopped(pid_t pid) {
  char path[64];
  for (int tries = 0; tries < 10000; tries++) {
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    char cmd[160];
    snprintf(cmd, sizeof cmd, "grep -L '^State:.*(stopped)' %s/*/status | grep -q .", path);
    if (system(cmd) != 0) return; /* no thread left that is not stopped */
    struct timespec t = {0, 1000000L};
    nanosleep(&t, NULL);
  }
  fail_msg("precondd %d did not stop", (int)pid);
}

/* A daemon killed with a push posted at its region's doorbell and not yet answered (the
 * daemon stopped first, so it cannot answer): the client finds the region gone, keeps the
 * push and sends it again to the restarted daemon (which lost the job and gets it
 * registered again); nothing is lost and nothing is counted as an error. */
static void test_shm_pipelined_restart(void **state) {
  (void)state;
  unix_daemon_with(NULL);
  precond_options o;
  precond_options_default(&o);
  o.addr = g_d.addr;
  o.connect_timeout_ms = 20000;
  o.poll_interval_ms = 60000; /* no poll collects the posted push: only flush does */
  o.backoff_max_ms = 200;
  o.shm_bytes = 4 << 20;
  precond_client *c = NULL;
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  precond_layout layout;
  register_job(c, "pipe-restart", &layout);
  float *l = scaled_identity(128, 1.0f), *r = scaled_identity(96, 2.0f);
  for (uint64_t step = 1; step <= 2; step++) { /* posted once a poll or push opened the region */
    assert_int_equal(precond_push(c, step, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
    assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  }
  precond_counters k;
  precond_get_counters(c, &k);
  uint64_t posted = k.pushes_posted;
  assert_true(posted >= 1);
  assert_int_equal(kill(g_d.pid, SIGSTOP), 0);
  wait_stopped(g_d.pid);
  free(l);
  free(r);
  l = scaled_identity(128, 4.0f);
  r = scaled_identity(96, 8.0f);
  /* Step 3 written into a worker slot of the region (session 15): lost with its region, it
   * goes again from the old mapping, which the slot keeps. */
  float *p0 = NULL, *p1 = NULL;
  precond_push_slot *slot = NULL;
  assert_int_equal(precond_push_begin(c, 3, 0, 128, 96, &p0, &p1, &slot), PRECOND_OK);
  memcpy(p0, l, (size_t)128 * 129 / 2 * sizeof(float));
  memcpy(p1, r, (size_t)96 * 97 / 2 * sizeof(float));
  assert_int_equal(precond_push_commit(c, slot), PRECOND_OK);
  for (int tries = 0; tries < 10000 && k.pushes_posted == posted; tries++) {
    struct timespec t = {0, 1000000L};
    nanosleep(&t, NULL);
    precond_get_counters(c, &k);
  }
  assert_int_equal(k.pushes_posted, posted + 1); /* rung; the stopped daemon cannot answer */
  assert_int_equal(k.sent, 2);
  pdproc_stop(&g_d, SIGKILL);
  unix_daemon_with(NULL);
  int st = precond_flush(c, ROOT_WAIT_MS);
  precond_get_counters(c, &k);
  if (st != PRECOND_OK) {
    char e[256];
    precond_last_error(c, e, sizeof e);
    fprintf(stderr, "flush after restart: %s; sent %llu, retries %llu, last error: %s\n",
            precond_strerror(st), (unsigned long long)k.sent, (unsigned long long)k.retries, e);
  }
  assert_int_equal(st, PRECOND_OK);
  assert_int_equal(k.sent, 3);
  assert_int_equal(k.push_errors, 0);
  assert_int_equal(k.region_slots, 1);
  assert_true(k.retries >= 1 && k.reregistered >= 1);
  /* The new daemon holds step 3's push alone (4 I): the one in flight, sent again. */
  assert_int_equal(precond_set_poll_interval(c, 10), PRECOND_OK);
  uint64_t v = 0;
  const precond_roots *got = wait_step(c, 0, 3, &v);
  assert_scaled_identity(got->left, got->n_left, expected_root(4.0), 1e-4);
  precond_roots_release(got);
  free(l);
  free(r);
  precond_layout_destroy(&layout);
  precond_close(c);
  daemon_stop();
}

static void test_bad_input_is_refused_locally(void **state) {
  (void)state;
  tcp_daemon();
  precond_client *c = connect_to(g_d.addr, PRECOND_FP32);
  float *l = scaled_identity(128, 1.0f), *r = scaled_identity(96, 1.0f);
  /* before register */
  assert_int_equal(precond_push(c, 1, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  const precond_roots *got = NULL;
  assert_int_equal(precond_fetch(c, 0, 0, &got), PRECOND_EINVAL);
  precond_layout layout;
  register_job(c, "bad", &layout);
  /* block outside the layout, wrong factor sizes, nothing to push, NaN */
  assert_int_equal(precond_push(c, 1, 2, 128, l, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push(c, 1, 0, 96, l, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push(c, 1, 0, 0, NULL, 0, NULL, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push(c, 1, 0, 128, NULL, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  /* The slot form: the same sizes refused at begin, a NaN written into the slot at commit
   * (the slot is gone then), a slot dropped by cancel; nothing of these is queued. */
  float *p0 = NULL, *p1 = NULL;
  precond_push_slot *slot = NULL;
  assert_int_equal(precond_push_begin(c, 1, 0, 96, 96, &p0, &p1, &slot), PRECOND_EINVAL);
  assert_null(slot);
  assert_int_equal(precond_push_begin(c, 1, 2, 128, 96, &p0, &p1, &slot), PRECOND_EINVAL);
  assert_int_equal(precond_push_begin(c, 1, 0, 128, 96, &p0, &p1, &slot), PRECOND_OK);
  assert_ptr_equal(p1, p0 + (size_t)128 * 129 / 2); /* one span, as precond.h promises */
  memcpy(p0, l, (size_t)128 * 129 / 2 * sizeof(float));
  memcpy(p1, r, (size_t)96 * 97 / 2 * sizeof(float));
  p1[96 * 97 / 2 - 1] = NAN;
  assert_int_equal(precond_push_commit(c, slot), PRECOND_EINVAL);
  assert_int_equal(precond_push_begin(c, 1, 0, 128, 96, &p0, &p1, &slot), PRECOND_OK);
  precond_push_cancel(slot);
  precond_counters kc;
  precond_get_counters(c, &kc);
  assert_int_equal(kc.pushed, 0);
  l[5] = NAN;
  assert_int_equal(precond_push(c, 1, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  l[5] = INFINITY;
  assert_int_equal(precond_push(c, 1, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push(c, 1, 0, 128, l, 96, r, (precond_encoding)7), PRECOND_EINVAL);
  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.pushed, 0);
  /* both factors are required */
  assert_int_equal(precond_push(c, 1, 1, 0, NULL, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  /* a good push after all that goes through */
  l[5] = 0.0f;
  assert_int_equal(precond_push(c, 1, 1, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(c, &k);
  assert_int_equal(k.sent, 1);
  assert_int_equal(k.push_errors, 0);
  /* Slots committed together: the one with a NaN is dropped (PRECOND_EINVAL), the good one
   * is queued and sent all the same, NULL entries are skipped; a NULL client frees them. */
  precond_push_slot *many[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; i += 2) {
    assert_int_equal(precond_push_begin(c, 2, (uint32_t)i / 2, 128, 96, &p0, &p1, &many[i]),
                     PRECOND_OK);
    memcpy(p0, l, (size_t)128 * 129 / 2 * sizeof(float));
    memcpy(p1, r, (size_t)96 * 97 / 2 * sizeof(float));
    if (i == 0) p0[7] = NAN;
  }
  assert_int_equal(precond_push_commit_all(c, many, 3), PRECOND_EINVAL);
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(c, &k);
  assert_int_equal(k.pushed, 2);
  assert_int_equal(k.sent, 2);
  assert_int_equal(k.push_errors, 0);
  assert_int_equal(precond_push_begin(c, 3, 0, 128, 96, &p0, &p1, &many[0]), PRECOND_OK);
  assert_int_equal(precond_push_commit_all(NULL, many, 1), PRECOND_EINVAL); /* freed: ASan */
  assert_int_equal(precond_push_commit_all(c, NULL, 0), PRECOND_OK);
  /* bad registrations */
  const uint64_t zero[2] = {0, 4};
  precond_tensor t = {"z", 2, zero};
  precond_layout l2;
  assert_int_equal(precond_register(c, "bad", PRECOND_MODE_SHAMPOO, NULL, 1, &t, NULL, &l2),
                   PRECOND_EINVAL);
  assert_int_equal(precond_register(c, "", PRECOND_MODE_SHAMPOO, NULL, 1, &t, NULL, &l2),
                   PRECOND_EINVAL);
  free(l);
  free(r);
  precond_layout_destroy(&layout);
  precond_close(c);
  daemon_stop();
}

static void test_dead_address(void **state) {
  (void)state;
  char addr[64];
  later_addr(addr, sizeof addr);
  precond_options o;
  precond_options_default(&o);
  o.addr = addr;
  o.connect_timeout_ms = 300;
  precond_client *c = (precond_client *)1;
  assert_int_equal(precond_connect(&o, &c), PRECOND_EUNAVAILABLE);
  /* without waiting at connect, a call with a short deadline fails cleanly */
  o.connect_timeout_ms = 0;
  o.call_timeout_ms = 300;
  o.wait_for_ready = 0;
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  precond_stats s;
  int st = precond_get_stats(c, NULL, 0, &s);
  assert_true(st == PRECOND_EUNAVAILABLE || st == PRECOND_ETIMEDOUT);
  char e[256];
  precond_last_error(c, e, sizeof e);
  assert_true(strlen(e) > 0);
  precond_close(c);
  o.addr = "";
  assert_int_equal(precond_connect(&o, &c), PRECOND_EINVAL);
}

/* The worker starts first, the daemon later; then the daemon restarts (losing the job) and
 * the client registers again by itself and keeps getting roots. */
static void test_reconnect_and_reregister(void **state) {
  (void)state;
  char addr[64];
  later_addr(addr, sizeof addr);
  precond_options o;
  precond_options_default(&o);
  o.addr = addr;
  o.connect_timeout_ms = 0;
  o.poll_interval_ms = 10;
  o.backoff_max_ms = 200;
  precond_client *c = NULL;
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  daemon_start(addr, NULL, 0);
  precond_layout layout;
  register_job(c, "again", &layout); /* waits for the daemon to come up */
  uint64_t versions[2] = {0, 0};
  push_and_check(c, &layout, 1, 1.0f, 1.0, PRECOND_FP32, versions, 1e-4);

  daemon_stop();
  float *l = scaled_identity(128, 2.0f), *r = scaled_identity(96, 4.0f);
  /* pushed while the daemon is down: queued, retried with backoff */
  assert_int_equal(precond_push(c, 2, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
  assert_int_equal(precond_flush(c, 300), PRECOND_ETIMEDOUT);
  daemon_start(addr, NULL, 0);
  int st = precond_flush(c, ROOT_WAIT_MS);
  precond_counters k;
  precond_get_counters(c, &k);
  if (st != PRECOND_OK) {
    char e[256];
    precond_last_error(c, e, sizeof e);
    fprintf(stderr,
            "flush after restart: %s; queued %zu, sent %llu, retries %llu, "
            "reregistered %llu; last error: %s\n",
            precond_strerror(st), k.queued, (unsigned long long)k.sent,
            (unsigned long long)k.retries, (unsigned long long)k.reregistered, e);
  }
  assert_int_equal(st, PRECOND_OK);
  assert_true(k.retries >= 1);
  assert_true(k.reregistered >= 1);
  assert_int_equal(k.push_errors, 0);
  /* the new daemon computes a root of the new statistic (2 I alone: it lost the old one) */
  const precond_roots *got = NULL;
  for (int tries = 0; tries < 3000; tries++) {
    assert_int_equal(precond_fetch(c, 0, 0, &got), PRECOND_OK);
    if (got != NULL && got->source_step == 2) break;
    precond_roots_release(got);
    got = NULL;
    struct timespec t = {0, 10 * 1000000L};
    nanosleep(&t, NULL);
  }
  assert_non_null(got);
  assert_scaled_identity(got->left, got->n_left, expected_root(2.0), 1e-4);
  precond_roots_release(got);
  free(l);
  free(r);
  precond_layout_destroy(&layout);
  precond_close(c);
  daemon_stop();
}

/* The client is told when the daemon restarts: a clean restart and a kill -9 each count
 * once, with the step the daemon resumed the job from (the snapshot's; what was pushed
 * after it was lost), while pushing and fetching go on. */
static void test_daemon_restart_is_told(void **state) {
  (void)state;
  char addr[64];
  later_addr(addr, sizeof addr); /* the restarts listen where the client dials */
  daemon_start(addr, NULL, 1);
  precond_client *c = connect_to(addr, PRECOND_FP32);
  precond_layout layout;
  register_job(c, "told", &layout);
  uint64_t versions[2] = {0, 0};
  push_and_check(c, &layout, 1, 1.0f, 1.0, PRECOND_FP32, versions, 1e-4);
  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.daemon_restarts, 0);

  daemon_stop(); /* SIGTERM: the snapshot holds step 1 */
  daemon_start(addr, NULL, 1);
  float *l = scaled_identity(128, 2.0f), *r = scaled_identity(96, 4.0f);
  assert_int_equal(precond_push(c, 2, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(c, &k);
  assert_int_equal(k.daemon_restarts, 1);
  assert_int_equal(k.resumed_step, 1);

  pdproc_stop(&g_d, SIGKILL); /* step 2 was never snapshotted */
  daemon_start(addr, NULL, 1);
  assert_int_equal(precond_push(c, 3, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  precond_get_counters(c, &k);
  assert_int_equal(k.daemon_restarts, 2);
  assert_int_equal(k.resumed_step, 1);
  free(l);
  free(r);
  precond_layout_destroy(&layout);
  precond_close(c);
  daemon_stop();
}

/* precondctl against a live daemon (table and JSON) and a dead address. */
static int run_ctl(const char *args, char *out, size_t len) {
  const char *ctl = getenv("PRECONDCTL");
  assert_non_null(ctl);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", ctl, args);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_precondctl(void **state) {
  (void)state;
  tcp_daemon();
  precond_client *c = connect_to(g_d.addr, PRECOND_FP32);
  precond_layout layout;
  register_job(c, "ctljob", &layout);
  uint64_t versions[2] = {0, 0};
  push_and_check(c, &layout, 1, 1.0f, 1.0, PRECOND_FP32, versions, 1e-4);

  static char out[65536];
  char args[256];
  snprintf(args, sizeof args, "--addr %s stats", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "ctljob"));
  assert_non_null(strstr(out, "queue depth"));
  snprintf(args, sizeof args, "--addr %s stats --json", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_int_equal(out[0], '{');
  assert_non_null(strstr(out, "\"job\":\"ctljob\""));
  snprintf(args, sizeof args, "--addr %s blocks", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "128x96"));
  snprintf(args, sizeof args, "--json --addr %s blocks --job ctljob", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "\"block_id\":1,"));
  snprintf(args, sizeof args, "--addr %s health", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "SERVING"));
  precond_layout_destroy(&layout);
  precond_close(c);
  daemon_stop();

  /* dead address: exit 2, one line naming the address */
  snprintf(args, sizeof args, "--addr %s --timeout 500 stats", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 2);
  assert_non_null(strstr(out, "cannot reach precondd"));
  assert_non_null(strstr(out, g_d.addr));
  assert_int_equal(strchr(out, '\n'), out + strlen(out) - 1);
  /* usage errors: exit 1 */
  assert_int_equal(run_ctl("frobnicate", out, sizeof out), 1);
  assert_int_equal(run_ctl("--timeout x stats", out, sizeof out), 1);
  assert_int_equal(run_ctl("--token-file /nonexistent stats", out, sizeof out), 1);
  assert_int_equal(run_ctl("--help", out, sizeof out), 0);
  assert_non_null(strstr(out, "usage: precondctl"));
}

/* EndJob: a client ending its own job forgets it, so its background thread does not
 * register it again; the daemon no longer knows it. precondctl end-job ends another. */
static void test_end_job(void **state) {
  (void)state;
  tcp_daemon();
  precond_client *c = connect_to(g_d.addr, PRECOND_FP32);
  precond_client *other = connect_to(g_d.addr, PRECOND_FP32);
  precond_layout layout, layout2;
  register_job(c, "mine", &layout);
  register_job(other, "other", &layout2);
  uint64_t versions[2] = {0, 0};
  push_and_check(c, &layout, 7, 1.0f, 1.0, PRECOND_FP32, versions, 1e-4);

  precond_ended e = {0};
  assert_int_equal(precond_end_job(c, NULL, &e), PRECOND_OK);
  assert_int_equal(e.blocks, 2);
  assert_int_equal(e.last_step, 7);
  assert_true(e.bytes > 2 * 2 * (128 * 129 / 2 + 96 * 97 / 2) * sizeof(float));
  /* Many poll intervals later the job is still gone: nothing registered it again. */
  struct timespec t = {0, 300 * 1000000L};
  nanosleep(&t, NULL);
  precond_stats s;
  assert_int_equal(precond_get_stats(c, "mine", 0, &s), PRECOND_ENOTFOUND);
  assert_int_equal(precond_get_stats(c, NULL, 0, &s), PRECOND_OK);
  assert_int_equal(s.njobs, 1);
  precond_stats_destroy(&s);
  float *l = scaled_identity(128, 1.0f), *r = scaled_identity(96, 1.0f);
  assert_int_equal(precond_push(c, 8, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_EINVAL);
  free(l);
  free(r);
  assert_int_equal(precond_end_job(c, "mine", NULL), PRECOND_ENOTFOUND);
  assert_int_equal(precond_end_job(c, NULL, NULL), PRECOND_EINVAL); /* no job of its own */

  /* precondctl: the other job, once its worker is done. */
  precond_close(other);
  static char out[4096];
  char args[256];
  snprintf(args, sizeof args, "--addr %s end-job other", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "ended job other: 2 blocks"));
  snprintf(args, sizeof args, "--addr %s --json end-job other", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 2);
  assert_non_null(strstr(out, "unknown job"));
  assert_int_equal(run_ctl("end-job", out, sizeof out), 1);
  precond_layout_destroy(&layout);
  precond_layout_destroy(&layout2);
  precond_close(c);
}

/* A worker still running when an operator ends its job (precondctl end-job) must not bring
 * it back: libprecond registers again by itself after a NOT_FOUND, and precondd used to
 * accept that, so the job came back empty and kept training. Now the daemon remembers the
 * ended name: the worker's next flush says PRECOND_EENDED with the daemon's reason, its
 * thread stops (no retry loop), the job stays gone, also across a restart; a new run takes
 * the name with reuse_ended_job. */
static void test_ended_job_stays_ended(void **state) {
  (void)state;
  char addr[64];
  later_addr(addr, sizeof addr); /* the restart below listens where the clients dial */
  daemon_start(addr, NULL, 1);
  precond_client *w = connect_to(addr, PRECOND_FP32);
  precond_layout layout;
  register_job(w, "run1", &layout);
  uint64_t versions[2] = {0, 0};
  push_and_check(w, &layout, 1, 1.0f, 1.0, PRECOND_FP32, versions, 1e-4);

  static char out[4096];
  char args[256];
  snprintf(args, sizeof args, "--addr %s end-job run1", addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "ended job run1"));

  /* The worker's next step: its push (or its thread's poll, whichever comes first) is
   * refused, and so is the Register that follows. */
  float *l = scaled_identity(128, 1.0f), *r = scaled_identity(96, 1.0f);
  int pst = precond_push(w, 2, 0, 128, l, 96, r, PRECOND_FP32);
  assert_true(pst == PRECOND_OK || pst == PRECOND_EENDED);
  int st = precond_flush(w, ROOT_WAIT_MS);
  char e[512];
  precond_last_error(w, e, sizeof e);
  if (st != PRECOND_EENDED) fprintf(stderr, "flush: %s (%s)\n", precond_strerror(st), e);
  assert_int_equal(st, PRECOND_EENDED);
  assert_non_null(strstr(e, "\"run1\" was ended by EndJob at"));
  assert_non_null(strstr(e, "reuse_ended_job"));
  assert_int_equal(precond_push(w, 3, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_EENDED);
  assert_int_equal(precond_wait_roots(w, 0, versions[0], 100), PRECOND_EENDED);
  precond_counters k1, k2;
  precond_get_counters(w, &k1);
  assert_int_equal(k1.reregistered, 0);
  assert_int_equal(k1.push_errors, pst == PRECOND_OK); /* step 2's block, if queued: dropped */
  assert_int_equal(k1.queued, 0);
  /* No loop: many poll intervals and backoffs later nothing more was tried. */
  nanosleep(&(struct timespec){0, 500 * 1000000L}, NULL);
  precond_get_counters(w, &k2);
  assert_int_equal(k2.retries, k1.retries);
  assert_int_equal(k2.fetch_calls, k1.fetch_calls);
  precond_stats s;
  assert_int_equal(precond_get_stats(w, "run1", 0, &s), PRECOND_ENOTFOUND);

  /* Remembered across a restart (the snapshot holds the name). */
  daemon_stop();
  daemon_start(addr, NULL, 1);
  precond_client *n = connect_to(addr, PRECOND_FP32);
  const uint64_t wshape[2] = {256, 96}, bshape[1] = {96};
  precond_tensor t[2] = {{"dense.w", 2, wshape}, {"dense.b", 1, bshape}};
  precond_shampoo_opts so = {.block_size = 128, .epsilon = EPSILON, .method = PRECOND_METHOD_EIGH};
  precond_layout l2;
  /* A call right after the restart can meet the old connection's end (UNAVAILABLE). */
  int rst = PRECOND_EUNAVAILABLE;
  for (int tries = 0; tries < 50 && rst == PRECOND_EUNAVAILABLE; tries++) {
    if (tries > 0) nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
    rst = precond_register(n, "run1", PRECOND_MODE_SHAMPOO, "test", 2, t, &so, &l2);
  }
  assert_int_equal(rst, PRECOND_ESTATE);
  precond_last_error(n, e, sizeof e);
  assert_non_null(strstr(e, "was ended by EndJob"));
  precond_close(n);
  /* A new run of the same name says so. */
  precond_options o;
  precond_options_default(&o);
  o.addr = addr;
  o.connect_timeout_ms = 20000;
  o.reuse_ended_job = 1;
  assert_int_equal(precond_connect(&o, &n), PRECOND_OK);
  register_job(n, "run1", &l2);
  uint64_t v2[2] = {0, 0};
  push_and_check(n, &l2, 1, 2.0f, 2.0, PRECOND_FP32, v2, 1e-4); /* from zero: 2 I alone */
  /* The old worker registers again explicitly (a new run of its own): allowed while the
   * job is there, and its pushes go through. The layout it gets back replaces the first. */
  precond_layout_destroy(&layout);
  register_job(w, "run1", &layout);
  assert_int_equal(precond_push(w, 2, 0, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
  assert_int_equal(precond_flush(w, ROOT_WAIT_MS), PRECOND_OK);
  free(l);
  free(r);
  precond_layout_destroy(&layout);
  precond_layout_destroy(&l2);
  precond_close(w);
  precond_close(n);
  daemon_stop();
}

/* Several threads push and fetch on one client with a queue of 2 blocks: every push is
 * accounted for (sent, coalesced or dropped), nothing is refused, and the last step's roots
 * arrive. */
typedef struct {
  precond_client *c;
  uint32_t block;
  int steps;
  const float *l, *r;
  int failures;
} pusher;

static void *pusher_main(void *arg) {
  pusher *p = arg;
  uint64_t held = 0;
  for (int s = 1; s <= p->steps; s++) {
    if (precond_push(p->c, (uint64_t)s, p->block, 128, p->l, 96, p->r, PRECOND_FP32) != PRECOND_OK)
      p->failures++;
    const precond_roots *r = NULL;
    if (precond_fetch(p->c, p->block, held, &r) != PRECOND_OK) p->failures++;
    if (r != NULL) {
      if (r->version <= held || r->left == NULL || !(r->left[0] > 0.0f)) p->failures++;
      held = r->version;
      precond_roots_release(r);
    }
  }
  return NULL;
}

static void test_concurrent_pushes_small_queue(void **state) {
  (void)state;
  tcp_daemon();
  precond_options o;
  precond_options_default(&o);
  o.addr = g_d.addr;
  o.connect_timeout_ms = 20000;
  o.poll_interval_ms = 5;
  o.queue_blocks = 2;
  precond_client *c = NULL;
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  const uint64_t shape[2] = {512, 96}; /* four 128 x 96 blocks */
  precond_tensor t = {"w", 2, shape};
  precond_shampoo_opts so = {.block_size = 128, .epsilon = EPSILON, .method = PRECOND_METHOD_EIGH};
  precond_layout layout;
  assert_int_equal(precond_register(c, "conc", PRECOND_MODE_SHAMPOO, NULL, 1, &t, &so, &layout),
                   PRECOND_OK);
  assert_int_equal(layout.nblocks, 4);
  float *l = scaled_identity(128, 1.0f), *r = scaled_identity(96, 1.0f);
  pusher p[4];
  pthread_t th[4];
  for (uint32_t i = 0; i < 4; i++) {
    p[i] = (pusher){.c = c, .block = i, .steps = 200, .l = l, .r = r};
    assert_int_equal(pthread_create(&th[i], NULL, pusher_main, &p[i]), 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(p[i].failures, 0);
  }
  assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.pushed, 800);
  assert_int_equal(k.sent + k.coalesced + k.dropped, 800);
  assert_int_equal(k.push_errors, 0);
  assert_int_equal(k.queued, 0);
  /* With room for 2 of 4 blocks, drop-oldest may have lost any block's last pushes; one
   * more step per block, flushed one at a time, always gets through. */
  for (uint32_t i = 0; i < 4; i++) {
    assert_int_equal(precond_push(c, 201, i, 128, l, 96, r, PRECOND_FP32), PRECOND_OK);
    assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
  }
  precond_stats st;
  assert_int_equal(precond_get_stats(c, "conc", 1, &st), PRECOND_OK);
  assert_int_equal(st.nblocks, 4);
  for (size_t i = 0; i < st.nblocks; i++) assert_int_equal(st.block_stats[i].stat_step, 201);
  precond_stats_destroy(&st);
  free(l);
  free(r);
  precond_layout_destroy(&layout);
  precond_close(c);
}

/* A daemon that requires a token: calls without it (or with a wrong one) fail with
 * PRECOND_EAUTH, with it they work; precondctl's --token-file likewise. */
static void test_token(void **state) {
  (void)state;
  char good[64], bad[64];
  snprintf(good, sizeof good, "/tmp/precond-test-token-%d", (int)getpid());
  snprintf(bad, sizeof bad, "/tmp/precond-test-badtoken-%d", (int)getpid());
  FILE *f = fopen(good, "w");
  assert_non_null(f);
  fputs("s3cret-token\n", f);
  fclose(f);
  f = fopen(bad, "w");
  assert_non_null(f);
  fputs("wrong\n", f);
  fclose(f);
  daemon_start(NULL, good, 0);

  precond_options o;
  precond_options_default(&o);
  o.addr = g_d.addr;
  o.connect_timeout_ms = 20000;
  precond_client *c = NULL;
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  precond_stats s;
  assert_int_equal(precond_get_stats(c, NULL, 0, &s), PRECOND_EAUTH);
  precond_close(c);
  o.token = "s3cret-token";
  assert_int_equal(precond_connect(&o, &c), PRECOND_OK);
  precond_layout layout;
  register_job(c, "tok", &layout);
  uint64_t versions[2] = {0, 0};
  push_and_check(c, &layout, 1, 1.0f, 1.0, PRECOND_FP32, versions, 1e-4);
  precond_layout_destroy(&layout);
  precond_close(c);

  static char out[65536];
  char args[512];
  snprintf(args, sizeof args, "--addr %s stats", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 2);
  assert_non_null(strstr(out, "authentication"));
  snprintf(args, sizeof args, "--addr %s --token-file %s stats", g_d.addr, bad);
  assert_int_equal(run_ctl(args, out, sizeof out), 2);
  snprintf(args, sizeof args, "--addr %s --token-file %s stats", g_d.addr, good);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "tok"));
  unlink(good);
  unlink(bad);
}

/* ---- K-FAC ------------------------------------------------------------------------- */

/* Packed upper n x n of (1/8) X^T X for an m x n X of small integers from seed: every entry
 * is a multiple of 1/8 below 256, exactly representable in bf16, so fp32 and bf16 pushes
 * carry the same factor and the expected inverses need no rounding model. */
static float *int_factor(uint32_t n, uint32_t m, unsigned seed) {
  int *x = malloc((size_t)m * n * sizeof *x);
  float *p = malloc((size_t)n * (n + 1) / 2 * sizeof *p);
  assert_non_null(x);
  assert_non_null(p);
  for (size_t i = 0; i < (size_t)m * n; i++) {
    seed = seed * 1103515245u + 12345u;
    x[i] = (int)((seed >> 16) % 5) - 2;
  }
  size_t k = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i; j < n; j++) {
      int acc = 0;
      for (uint32_t r = 0; r < m; r++) acc += x[r * n + i] * x[r * n + j];
      p[k++] = (float)acc / 8.0f;
    }
  free(x);
  return p;
}

static double packed_trace(uint32_t n, const double *p) {
  double t = 0.0;
  size_t k = 0;
  for (uint32_t i = 0; i < n; k += n - i, i++) t += p[k];
  return t;
}

/* Checks packed inv (fp32, from the daemon) against (F + d I)^-1 in double by LAPACK
 * (potrf + potri) of the packed double factor f, within rel of the largest entry. */
static void assert_damped_inverse(uint32_t n, const double *f, double d, const float *inv,
                                  double rel) {
  double *x = calloc((size_t)n * n, sizeof *x);
  assert_non_null(x);
  size_t k = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i; j < n; j++, k++) x[i * n + j] = f[k] + (i == j ? d : 0.0);
  assert_int_equal(LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'U', (lapack_int)n, x, (lapack_int)n), 0);
  assert_int_equal(LAPACKE_dpotri(LAPACK_ROW_MAJOR, 'U', (lapack_int)n, x, (lapack_int)n), 0);
  double big = 0.0;
  for (size_t i = 0; i < (size_t)n * n; i++) big = fmax(big, fabs(x[i]));
  k = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i; j < n; j++, k++)
      if (fabs(inv[k] - x[i * n + j]) > rel * big) {
        fprintf(stderr, "inverse[%u][%u] = %.8g, LAPACK %.8g\n", i, j, inv[k], x[i * n + j]);
        fail();
      }
  free(x);
}

/* One K-FAC layer as the test keeps it: the running averages in double, as the daemon's
 * pc_kfac_fold does them (the first push taken as is, then F <- 0.95 F + 0.05 F_batch). */
typedef struct {
  uint32_t na, ng;
  double *a, *g;
  int folds;
} kfac_layer;

static void kfac_fold(kfac_layer *l, const float *a, const float *g) {
  size_t la = (size_t)l->na * (l->na + 1) / 2, lg = (size_t)l->ng * (l->ng + 1) / 2;
  double keep = l->folds == 0 ? 0.0 : 0.95;
  for (size_t i = 0; i < la; i++) l->a[i] = keep * l->a[i] + (1.0 - keep) * a[i];
  for (size_t i = 0; i < lg; i++) l->g[i] = keep * l->g[i] + (1.0 - keep) * g[i];
  l->folds++;
}

/* Waits for the inverses of layer id computed from step (newer than *version) and checks
 * them against LAPACK with the pi-damping computed here (lambda = damping). */
static void kfac_check(precond_client *c, uint32_t id, const kfac_layer *l, uint64_t step,
                       double damping, uint64_t *version) {
  const precond_roots *r = wait_step(c, id, step, version);
  assert_int_equal(r->n_a, l->na);
  assert_int_equal(r->n_g, l->ng);
  assert_int_equal(r->n_left, 0);
  assert_null(r->left);
  assert_null(r->right);
  assert_int_equal(r->inverse, PRECOND_KFAC_INVERSE_CHOLESKY); /* AUTO: by size */
  /* pi = sqrt((tr A / dim A) / (tr G / dim G)) (Martens & Grosse 2015, 6.3). */
  double pi = sqrt((packed_trace(l->na, l->a) / l->na) / (packed_trace(l->ng, l->g) / l->ng));
  assert_float_equal(r->pi, pi, 1e-5 * pi);
  assert_damped_inverse(l->na, l->a, pi * sqrt(damping), r->a_inv, 1e-4);
  assert_damped_inverse(l->ng, l->g, sqrt(damping) / pi, r->g_inv, 1e-4);
  precond_roots_release(r);
}

/* Register a K-FAC job (a dense layer with bias, a convolution, a batch norm), push A and G
 * in fp32 then bf16, fetch the damped inverses and check them against LAPACK in double;
 * precondctl's K-FAC table; every bad input refused, named where the daemon answers. */
static void test_kfac_register_push_fetch(void **state) {
  (void)state;
  tcp_daemon();
  precond_client *c = connect_to(g_d.addr, PRECOND_FP32);
  /* fc: out 4, in 5 + bias (A of order 6); conv: out 3, in 2 x 3 x 3 (A of order 18). */
  const uint64_t fc[2] = {4, 6}, conv[4] = {3, 2, 3, 3}, bn[1] = {3};
  precond_tensor t[3] = {{"fc", 2, fc}, {"conv", 4, conv}, {"bn", 1, bn}};
  precond_kfac_opts ko = {.damping = 2e-3, .inv_every = 2};
  precond_layout layout;
  char e[512];

  /* Bad options: refused by the daemon, the field named; nothing registered. */
  precond_kfac_opts bad = ko;
  bad.damping = -1.0;
  assert_int_equal(precond_register_kfac(c, "kf", "w0", 3, t, &bad, &layout), PRECOND_EREJECTED);
  precond_last_error(c, e, sizeof e);
  assert_non_null(strstr(e, "kfac.damping"));
  bad = ko;
  bad.factor_decay = 1.5;
  assert_int_equal(precond_register_kfac(c, "kf", "w0", 3, t, &bad, &layout), PRECOND_EREJECTED);
  precond_last_error(c, e, sizeof e);
  assert_non_null(strstr(e, "kfac.factor_decay"));
  /* Shampoo options on a K-FAC job: refused here. */
  precond_shampoo_opts so = {.block_size = 128};
  assert_int_equal(precond_register(c, "kf", PRECOND_MODE_KFAC, NULL, 3, t, &so, &layout),
                   PRECOND_EINVAL);

  assert_int_equal(precond_register_kfac(c, "kf", "w0", 3, t, &ko, &layout), PRECOND_OK);
  assert_int_equal(layout.nblocks, 2);
  assert_int_equal(layout.blocks[0].rows, 4);
  assert_int_equal(layout.blocks[0].cols, 6);
  assert_int_equal(layout.blocks[1].tensor, 1);
  assert_int_equal(layout.blocks[1].rows, 3);
  assert_int_equal(layout.blocks[1].cols, 18);
  assert_int_equal(layout.ndiagonal, 1);
  assert_int_equal(layout.diagonal_tensors[0], 2);

  kfac_layer l[2] = {{6, 4, NULL, NULL, 0}, {18, 3, NULL, NULL, 0}};
  for (int u = 0; u < 2; u++) {
    l[u].a = calloc((size_t)l[u].na * (l[u].na + 1) / 2, sizeof(double));
    l[u].g = calloc((size_t)l[u].ng * (l[u].ng + 1) / 2, sizeof(double));
    assert_non_null(l[u].a);
    assert_non_null(l[u].g);
  }
  uint64_t version[2] = {0, 0};
  /* Step 1 (fp32): inverses at once (none yet). Step 2 (bf16): the running average, due
   * (inv_every 2). Step 3: folded, not due. Step 4: due again. */
  for (uint64_t step = 1; step <= 4; step++) {
    precond_encoding enc = step % 2 ? PRECOND_FP32 : PRECOND_BF16;
    for (uint32_t u = 0; u < 2; u++) {
      float *a = int_factor(l[u].na, 2 * l[u].na, (unsigned)(10 * step + u));
      float *g = int_factor(l[u].ng, 16, (unsigned)(100 * step + u));
      assert_int_equal(precond_push_kfac(c, step, u, l[u].na, a, l[u].ng, g, enc), PRECOND_OK);
      kfac_fold(&l[u], a, g);
      free(a);
      free(g);
    }
    assert_int_equal(precond_flush(c, ROOT_WAIT_MS), PRECOND_OK);
    if (step != 3)
      for (uint32_t u = 0; u < 2; u++) kfac_check(c, u, &l[u], step, ko.damping, &version[u]);
  }
  precond_counters k;
  precond_get_counters(c, &k);
  assert_int_equal(k.push_errors, 0);
  assert_int_equal(k.sent + k.coalesced, 8);

  /* Bad pushes, refused here before anything is queued. */
  float *a = int_factor(6, 12, 1), *g = int_factor(4, 16, 2);
  assert_int_equal(precond_push_kfac(c, 5, 0, 5, a, 4, g, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push_kfac(c, 5, 0, 4, g, 6, a, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push_kfac(c, 5, 7, 6, a, 4, g, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push(c, 5, 0, 4, g, 6, a, PRECOND_FP32), PRECOND_EINVAL);
  a[3] = NAN;
  assert_int_equal(precond_push_kfac(c, 5, 0, 6, a, 4, g, PRECOND_FP32), PRECOND_EINVAL);
  precond_get_counters(c, &k);
  assert_int_equal(k.pushed, 8);

  /* GetStats and precondctl: factor orders, pi, dampings (product lambda), inverse age. */
  precond_stats s;
  assert_int_equal(precond_get_stats(c, "kf", 1, &s), PRECOND_OK);
  assert_int_equal(s.job_stats[0].mode, PRECOND_MODE_KFAC);
  assert_int_equal(s.nblocks, 2);
  assert_int_equal(s.block_stats[1].a_order, 18);
  assert_int_equal(s.block_stats[1].g_order, 3);
  assert_true(s.block_stats[1].pi > 0);
  assert_float_equal(s.block_stats[1].damping_a * s.block_stats[1].damping_g, ko.damping, 1e-12);
  assert_int_equal(s.block_stats[1].roots_computed, 3);
  precond_stats_destroy(&s);
  static char out[65536];
  char args[256];
  snprintf(args, sizeof args, "--addr %s blocks --job kf", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "LAYER"));
  assert_non_null(strstr(out, "DAMP A"));
  assert_null(strstr(out, "SHAPE")); /* no Shampoo table for a K-FAC job */
  snprintf(args, sizeof args, "--json --addr %s blocks --job kf", g_d.addr);
  assert_int_equal(run_ctl(args, out, sizeof out), 0);
  assert_non_null(strstr(out, "\"a_order\":18,\"g_order\":3,\"pi\":"));

  /* A K-FAC push on a Shampoo job is refused here too. */
  precond_layout shl;
  register_job(c, "sh", &shl);
  free(a);
  free(g);
  a = scaled_identity(96, 1.0f);
  g = scaled_identity(128, 1.0f);
  assert_int_equal(precond_push_kfac(c, 1, 0, 96, a, 128, g, PRECOND_FP32), PRECOND_EINVAL);
  assert_int_equal(precond_push(c, 1, 0, 128, g, 96, a, PRECOND_FP32), PRECOND_OK);
  precond_layout_destroy(&shl);
  free(a);
  free(g);
  for (int u = 0; u < 2; u++) {
    free(l[u].a);
    free(l[u].g);
  }

  /* precond_set_poll_interval: at 5 s the job is polled at most once (at the change) in
   * 0.5 s; back at 10 ms, 5 polls come well inside one 5 s period (the wait for the 5 s
   * period's next poll ends at the change). Waited for, not timed: a loaded machine only
   * delays the polls, and 4 s stays below the period that the change must have ended. */
  assert_int_equal(precond_set_poll_interval(c, 0), PRECOND_EINVAL);
  assert_int_equal(precond_set_poll_interval(c, 5000), PRECOND_OK);
  precond_counters k0, k1, k2;
  nanosleep(&(struct timespec){0, 100 * 1000000L}, NULL);
  precond_get_counters(c, &k0);
  nanosleep(&(struct timespec){0, 500 * 1000000L}, NULL);
  precond_get_counters(c, &k1);
  assert_true(k1.fetch_calls - k0.fetch_calls <= 1);
  struct timespec t0, tn;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  assert_int_equal(precond_set_poll_interval(c, 10), PRECOND_OK);
  double waited = 0;
  do {
    nanosleep(&(struct timespec){0, 10 * 1000000L}, NULL);
    precond_get_counters(c, &k2);
    clock_gettime(CLOCK_MONOTONIC, &tn);
    waited = (double)(tn.tv_sec - t0.tv_sec) + 1e-9 * (double)(tn.tv_nsec - t0.tv_nsec);
  } while (k2.fetch_calls - k1.fetch_calls < 5 && waited < 4.0);
  assert_true(k2.fetch_calls - k1.fetch_calls >= 5);
  precond_layout_destroy(&layout);
  precond_close(c);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  if (getenv("CLIENT_TEST")) cmocka_set_test_filter(getenv("CLIENT_TEST")); /* one, by name */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_tcp_register_push_fetch, stop_daemon),
      cmocka_unit_test_teardown(test_unix_socket_bf16, stop_daemon),
      cmocka_unit_test_teardown(test_shm_same_roots_as_bytes, stop_daemon),
      cmocka_unit_test_teardown(test_shm_pipelined_same_as_bytes, stop_daemon),
      cmocka_unit_test_teardown(test_shm_pipelined_restart, stop_daemon),
      cmocka_unit_test_teardown(test_shm_region_slots, stop_daemon),
      cmocka_unit_test_teardown(test_shm_region_slots_awaited, stop_daemon),
      cmocka_unit_test_teardown(test_shm_awaited_paced, stop_daemon),
      cmocka_unit_test_teardown(test_shm_awaited_direct, stop_daemon),
      cmocka_unit_test_teardown(test_shm_posted_direct, stop_daemon),
      cmocka_unit_test_teardown(test_shm_region_vouched, stop_daemon),
      cmocka_unit_test_teardown(test_shm_region_vouch_gram, stop_daemon),
      cmocka_unit_test_teardown(test_shm_region_full, stop_daemon),
      cmocka_unit_test_teardown(test_shm_window_lap, stop_daemon),
      cmocka_unit_test_teardown(test_bad_input_is_refused_locally, stop_daemon),
      cmocka_unit_test_teardown(test_dead_address, stop_daemon),
      cmocka_unit_test_teardown(test_reconnect_and_reregister, stop_daemon),
      cmocka_unit_test_teardown(test_daemon_restart_is_told, stop_daemon),
      cmocka_unit_test_teardown(test_precondctl, stop_daemon),
      cmocka_unit_test_teardown(test_end_job, stop_daemon),
      cmocka_unit_test_teardown(test_ended_job_stays_ended, stop_daemon),
      cmocka_unit_test_teardown(test_token, stop_daemon),
      cmocka_unit_test_teardown(test_concurrent_pushes_small_queue, stop_daemon),
      cmocka_unit_test_teardown(test_kfac_register_push_fetch, stop_daemon),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
