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
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "precond.h"
#include "precondd_proc.h"

#define ROOT_WAIT_MS 30000
#define EPSILON 1e-6

/* The daemon of the running test, started in a directory of its own; the teardown stops it
 * and removes that directory even when the test failed. */
static pdproc g_d;
static char g_sock[96];

/* Starts g_d on listen (NULL: a free loopback port) with one root thread, a 1 s grace period
 * and its output in the test log; requires the token in token_file when not NULL; keeps its
 * state in its directory when with_state, else has none (a restart then loses every job). */
static void daemon_start(const char *listen, const char *token_file, int with_state)
{
  pdproc_opts o;
  pdproc_opts_default(&o);
  o.listen = listen;
  o.grace_period = 1;
  o.inherit_stderr = 1;
  o.state_dir = with_state ? NULL : "";
  const char *extra[] = {"--token-file", token_file, NULL};
  if (token_file != NULL)
    o.extra = extra;
  assert_int_equal(pdproc_start(&g_d, &o), 0);
}

static void daemon_stop(void)
{
  pdproc_stop(&g_d, SIGTERM);
}

static int stop_daemon(void **state)
{
  (void)state;
  pdproc_destroy(&g_d);
  if (g_sock[0] != '\0')
    unlink(g_sock);
  memset(&g_d, 0, sizeof g_d);
  g_sock[0] = '\0';
  return 0;
}

static void tcp_daemon(void)
{
  daemon_start(NULL, NULL, 0);
}

static void unix_daemon(void)
{
  char listen[128];
  snprintf(g_sock, sizeof g_sock, "/tmp/precond-test-%d.sock", (int)getpid());
  unlink(g_sock);
  snprintf(listen, sizeof listen, "unix:%s", g_sock);
  daemon_start(listen, NULL, 0);
}

/* "127.0.0.1:PORT" with a port nobody listens on right now, for a daemon started later. */
static void later_addr(char *addr, size_t len)
{
  int port = pdproc_free_port();
  assert_true(port > 0);
  snprintf(addr, len, "127.0.0.1:%d", port);
}

static precond_client *connect_to(const char *addr, precond_encoding fetch_enc)
{
  precond_options o;
  precond_options_default(&o);
  o.addr = addr;
  o.connect_timeout_ms = 20000;  /* the daemon is starting */
  o.poll_interval_ms = 10;
  o.fetch_encoding = fetch_enc;
  precond_client *c = NULL;
  int st = precond_connect(&o, &c);
  assert_int_equal(st, PRECOND_OK);
  return c;
}

/* Packed s * I of size n. */
static float *scaled_identity(uint32_t n, float s)
{
  size_t len = (size_t)n * (n + 1) / 2;
  float *p = calloc(len, sizeof(float));
  assert_non_null(p);
  size_t k = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i; j < n; j++)
      p[k++] = i == j ? s : 0.0f;
  return p;
}

/* Checks that packed x (n x n) is c I within rel (relative to c). */
static void assert_scaled_identity(const float *x, uint32_t n, double c, double rel)
{
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

static double expected_root(double s)
{
  return pow(s * (1.0 + EPSILON), -0.25);
}

/* Registers a 256 x 96 weight (two 128 x 96 blocks) and a bias (diagonal only). */
static void register_job(precond_client *c, const char *job, precond_layout *layout)
{
  const uint64_t wshape[2] = {256, 96}, bshape[1] = {96};
  precond_tensor t[2] = {{"dense.w", 2, wshape}, {"dense.b", 1, bshape}};
  precond_shampoo_opts so = {.block_size = 128, .root_exponent = 4, .epsilon = EPSILON,
                             .beta2 = 1.0f, .method = PRECOND_METHOD_EIGH};
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

/* Pushes s I for both factors of every block at step, flushes, and checks that the
 * roots of the new version arrive and match (s_total I)^(-1/4). */
static void push_and_check(precond_client *c, const precond_layout *layout, uint64_t step,
                           float s, double s_total, precond_encoding enc, uint64_t *versions,
                           double rel)
{
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
    /* Wait for a root computed from this step (an earlier version may arrive first). */
    const precond_roots *r = NULL;
    for (int tries = 0; tries < 1000; tries++) {
      int st = precond_wait_roots(c, id, versions[b], ROOT_WAIT_MS);
      if (st != PRECOND_OK) {
        char e[256];
        precond_last_error(c, e, sizeof e);
        fprintf(stderr, "no roots for block %u: %s (%s)\n", id, precond_strerror(st), e);
      }
      assert_int_equal(st, PRECOND_OK);
      assert_int_equal(precond_fetch(c, id, versions[b], &r), PRECOND_OK);
      assert_non_null(r);
      versions[b] = r->version;
      if (r->source_step >= step)
        break;
      precond_roots_release(r);
      r = NULL;
    }
    assert_non_null(r);
    assert_int_equal(r->block_id, id);
    assert_int_equal(r->source_step, step);
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

static void run_flow(const char *addr, precond_encoding enc, double rel)
{
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

static void test_tcp_register_push_fetch(void **state)
{
  (void)state;
  tcp_daemon();
  run_flow(g_d.addr, PRECOND_FP32, 1e-4);
  daemon_stop();
}

static void test_unix_socket_bf16(void **state)
{
  (void)state;
  unix_daemon();
  /* bf16 both ways: 8 bits of mantissa, so about 0.4% per value */
  run_flow(g_d.addr, PRECOND_BF16, 1e-2);
}

static void test_bad_input_is_refused_locally(void **state)
{
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

static void test_dead_address(void **state)
{
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
static void test_reconnect_and_reregister(void **state)
{
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
  register_job(c, "again", &layout);  /* waits for the daemon to come up */
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
    fprintf(stderr, "flush after restart: %s; queued %zu, sent %llu, retries %llu, "
            "reregistered %llu; last error: %s\n", precond_strerror(st), k.queued,
            (unsigned long long)k.sent, (unsigned long long)k.retries,
            (unsigned long long)k.reregistered, e);
  }
  assert_int_equal(st, PRECOND_OK);
  assert_true(k.retries >= 1);
  assert_true(k.reregistered >= 1);
  assert_int_equal(k.push_errors, 0);
  /* the new daemon computes a root of the new statistic (2 I alone: it lost the old one) */
  const precond_roots *got = NULL;
  for (int tries = 0; tries < 3000; tries++) {
    assert_int_equal(precond_fetch(c, 0, 0, &got), PRECOND_OK);
    if (got != NULL && got->source_step == 2)
      break;
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
static void test_daemon_restart_is_told(void **state)
{
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
static int run_ctl(const char *args, char *out, size_t len)
{
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

static void test_precondctl(void **state)
{
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

static void *pusher_main(void *arg)
{
  pusher *p = arg;
  uint64_t held = 0;
  for (int s = 1; s <= p->steps; s++) {
    if (precond_push(p->c, (uint64_t)s, p->block, 128, p->l, 96, p->r, PRECOND_FP32) !=
        PRECOND_OK)
      p->failures++;
    const precond_roots *r = NULL;
    if (precond_fetch(p->c, p->block, held, &r) != PRECOND_OK)
      p->failures++;
    if (r != NULL) {
      if (r->version <= held || r->left == NULL || !(r->left[0] > 0.0f))
        p->failures++;
      held = r->version;
      precond_roots_release(r);
    }
  }
  return NULL;
}

static void test_concurrent_pushes_small_queue(void **state)
{
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
  const uint64_t shape[2] = {512, 96};  /* four 128 x 96 blocks */
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
  for (size_t i = 0; i < st.nblocks; i++)
    assert_int_equal(st.block_stats[i].stat_step, 201);
  precond_stats_destroy(&st);
  free(l);
  free(r);
  precond_layout_destroy(&layout);
  precond_close(c);
}

/* A daemon that requires a token: calls without it (or with a wrong one) fail with
 * PRECOND_EAUTH, with it they work; precondctl's --token-file likewise. */
static void test_token(void **state)
{
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

int main(void)
{
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
    cmocka_unit_test_teardown(test_tcp_register_push_fetch, stop_daemon),
    cmocka_unit_test_teardown(test_unix_socket_bf16, stop_daemon),
    cmocka_unit_test_teardown(test_bad_input_is_refused_locally, stop_daemon),
    cmocka_unit_test_teardown(test_dead_address, stop_daemon),
    cmocka_unit_test_teardown(test_reconnect_and_reregister, stop_daemon),
    cmocka_unit_test_teardown(test_daemon_restart_is_told, stop_daemon),
    cmocka_unit_test_teardown(test_precondctl, stop_daemon),
    cmocka_unit_test_teardown(test_token, stop_daemon),
    cmocka_unit_test_teardown(test_concurrent_pushes_small_queue, stop_daemon),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
