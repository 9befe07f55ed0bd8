/* test_trainer.c -- the trainer library (trainer/) against a real precondd.
 *
 * Argument: the path of precondd; the test starts it on a free loopback port. A toy model
 * (a 2-D weight cut into several blocks, a small matrix, a diagonal vector) with gradients
 * set directly: the layout taken from the daemon, statistics pushed and received there,
 * roots received and applied, sync_roots reproducible, fallback counted; bad cases: daemon
 * absent, bad options. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "precondd_proc.h"
#include "precond.h"
#include "trainer.h"

static const char *precondd_path;
static pc_method root_method = PC_METHOD_NEWTON; /* opts_for's, changed by one test */
static int root_exponent = 4;                    /* the same */
static pdproc precondd;

enum { NPARAMS = 3 };

typedef struct {
  ac_backend *be;
  ac_param p[NPARAMS];
  ac_param *list[NPARAMS];
} toy;

/* w (12, 10): with block size 8, four blocks (two ragged); u (3, 5): one block; d (5000):
 * a vector, so diagonal (no block). */
static void toy_init(toy *m) {
  static const size_t w_shape[2] = {12, 10}, u_shape[2] = {3, 5}, d_shape[1] = {5000};
  assert_int_equal(ac_backend_create(&m->be, NULL), AC_OK);
  assert_int_equal(ac_param_init(&m->p[0], m->be, "w", 2, w_shape), AC_OK);
  assert_int_equal(ac_param_init(&m->p[1], m->be, "u", 2, u_shape), AC_OK);
  assert_int_equal(ac_param_init(&m->p[2], m->be, "d", 1, d_shape), AC_OK);
  for (int i = 0; i < NPARAMS; i++) m->list[i] = &m->p[i];
}

/* Gradients that depend on the step and the parameter values (so that a root applied
 * differently would show in later steps). */
static void toy_grads(toy *m, long step) {
  for (int i = 0; i < NPARAMS; i++) {
    size_t n = m->p[i].value.numel;
    float *v = malloc(n * sizeof *v), *g = malloc(n * sizeof *g);
    assert_non_null(v);
    assert_non_null(g);
    assert_int_equal(ac_tensor_download(&m->p[i].value, v), AC_OK);
    for (size_t k = 0; k < n; k++)
      g[k] = (float)(sin(0.37 * (double)k + 0.11 * (double)step + i) + 0.5 * v[k]);
    assert_int_equal(ac_tensor_upload(&m->p[i].grad, g), AC_OK);
    free(v);
    free(g);
  }
}

static void toy_destroy(toy *m) {
  for (int i = 0; i < NPARAMS; i++) ac_param_destroy(&m->p[i]);
  ac_backend_destroy(m->be);
}

static const char *daemon_addr; /* opts_for's daemon; NULL: precondd's (one test changes it) */

static void opts_for(pt_options *o, const char *job) {
  pt_options_default(o, PT_MODE_SHAMPOO);
  o->daemon = daemon_addr != NULL ? daemon_addr : precondd.addr;
  o->job = job;
  o->shampoo.layout.block_size = 8;
  o->shampoo.momentum = 0;
  o->shampoo.root_method = root_method;
  o->shampoo.root_exponent = root_exponent;
}

/* One daemon for the group, in a directory of its own that pdproc_destroy removes. */
static int setup(void **state) {
  (void)state;
  return pdproc_start_in(&precondd, precondd_path, NULL);
}

static int teardown(void **state) {
  (void)state;
  pdproc_destroy(&precondd);
  return 0;
}

/* The worker's blocks are the daemon's: same count, and the daemon's job holds exactly
 * those blocks of those tensors. */
static void test_layout_from_daemon(void **state) {
  (void)state;
  toy m;
  toy_init(&m);
  pt_options o;
  opts_for(&o, "layout");
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_OK);
  pt_counters c;
  pt_get_counters(t, &c);
  assert_int_equal(c.units, 5); /* w: 2 x 2, u: 1, d: none */
  assert_int_equal(c.units, ac_shampoo_nblocks(pt_shampoo(t)));
  assert_int_equal(c.resumed_step, 0);

  precond_client *cl = NULL;
  precond_options po;
  precond_options_default(&po);
  po.addr = precondd.addr;
  po.background = 0;
  assert_int_equal(precond_connect(&po, &cl), PRECOND_OK);
  precond_stats st;
  assert_int_equal(precond_get_stats(cl, "layout", 1, &st), PRECOND_OK);
  assert_int_equal(st.nblocks, c.units);
  size_t on_w = 0;
  for (size_t k = 0; k < st.nblocks; k++) on_w += strcmp(st.block_stats[k].tensor, "w") == 0;
  assert_int_equal(on_w, 4);
  precond_stats_destroy(&st);
  precond_close(cl);
  pt_destroy(t);
  toy_destroy(&m);
}

/* Runs steps steps of a sync_roots (or async) job; returns the final w and the counters. */
static void run(const char *job, int sync, long start_step, long steps, float *w_out,
                pt_counters *c, long *fallback_steps, double *staleness_max) {
  toy m;
  toy_init(&m);
  pt_options o;
  opts_for(&o, job);
  o.sync_roots = sync;
  o.shampoo.start_step = start_step;
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_OK);
  *fallback_steps = 0;
  *staleness_max = -1;
  for (long s = 1; s <= steps; s++) {
    toy_grads(&m, s);
    pt_step_info info;
    int rc = pt_step(t, s, 0.01, &info, &err);
    if (rc != PT_OK) fail_msg("pt_step %ld: %s", s, err.msg);
    assert_true(info.pushed);
    assert_int_equal(info.preconditioned + info.fallback, 5);
    *fallback_steps += info.fallback > 0;
    if (info.staleness_max > *staleness_max) *staleness_max = (double)info.staleness_max;
    if (sync && s >= start_step) {
      assert_int_equal(info.preconditioned, 5); /* the roots of this very step */
      assert_int_equal(info.staleness_max, 0);
    }
  }
  pt_get_counters(t, c);
  if (w_out != NULL) assert_int_equal(ac_tensor_download(&m.p[0].value, w_out), AC_OK);
  pt_destroy(t);
  toy_destroy(&m);
}

/* Pushes arrive (the daemon's job reaches the last step), roots arrive and are applied. */
static void test_push_and_roots(void **state) {
  (void)state;
  pt_counters c;
  long fb;
  double smax;
  run("push", 1, 1, 4, NULL, &c, &fb, &smax);
  assert_int_equal(c.pushed, 4 * 5);
  assert_int_equal(c.dropped, 0);
  assert_int_equal(c.push_errors, 0);
  assert_true(c.results_applied >= 4 * 5);
  assert_int_equal(c.results_rejected, 0);
  assert_int_equal(fb, 0);
}

/* Two sync_roots runs of the same model give the same weights; the weights moved. */
static void test_sync_reproducible(void **state) {
  (void)state;
  float w1[120], w2[120];
  pt_counters c;
  long fb;
  double smax;
  run("repro-a", 1, 1, 5, w1, &c, &fb, &smax);
  run("repro-b", 1, 1, 5, w2, &c, &fb, &smax);
  assert_memory_equal(w1, w2, sizeof w1);
}

/* Same-host, the trainer's Shampoo slots lie in the shared region and are vouched for by
 * their diagonal (precond_push_vouch_gram: G G^T and G^T G are Gram matrices): a daemon on
 * a unix socket folds them without the spare (its vouched_pushes counts them), and the
 * weights after sync_roots steps are bit for bit those of the same run over TCP (the bytes
 * path: no region, no vouch). */
static void test_vouched_over_region(void **state) {
  (void)state;
  float w_tcp[120], w_shm[120];
  pt_counters c;
  long fb;
  double smax;
  run("vouch-tcp", 1, 1, 8, w_tcp, &c, &fb, &smax);
  char sock[128], listen[160];
  snprintf(sock, sizeof sock, "/tmp/precond-trainer-%d.sock", (int)getpid());
  unlink(sock);
  snprintf(listen, sizeof listen, "unix:%s", sock);
  pdproc ux;
  memset(&ux, 0, sizeof ux);
  pdproc_opts po;
  pdproc_opts_default(&po);
  po.path = precondd_path;
  po.listen = listen;
  po.state_dir = "";
  po.log_level = "warn";
  assert_int_equal(pdproc_start(&ux, &po), 0);
  daemon_addr = ux.addr;
  run("vouch-shm", 1, 1, 8, w_shm, &c, &fb, &smax);
  precond_client *cl = NULL;
  precond_options o;
  precond_options_default(&o);
  o.addr = ux.addr;
  o.background = 0;
  assert_int_equal(precond_connect(&o, &cl), PRECOND_OK);
  precond_stats st;
  assert_int_equal(precond_get_stats(cl, NULL, 0, &st), PRECOND_OK);
  assert_true(st.vouched_pushes > 0);
  assert_int_equal(st.torn_pushes, 0);
  assert_int_equal(st.rejected_pushes, 0);
  precond_stats_destroy(&st);
  precond_close(cl);
  daemon_addr = NULL;
  pdproc_destroy(&ux);
  unlink(sock);
  assert_memory_equal(w_tcp, w_shm, sizeof w_tcp);
}

/* root_method and root_exponent reach the daemon: eigh's roots are the same roots as Newton's to float
 * accuracy, but not to the bit, so the weights after a few sync steps differ slightly. */
static void test_root_method(void **state) {
  (void)state;
  float wn[120], we[120];
  pt_counters c;
  long fb;
  double smax;
  run("method-newton", 1, 1, 5, wn, &c, &fb, &smax);
  root_method = PC_METHOD_EIGH;
  run("method-eigh", 1, 1, 5, we, &c, &fb, &smax);
  root_method = PC_METHOD_NEWTON;
  double diff = 0.0, norm = 0.0;
  for (int k = 0; k < 120; k++) {
    diff = fmax(diff, fabs((double)we[k] - (double)wn[k]));
    norm = fmax(norm, fabs((double)wn[k]));
  }
  assert_true(diff > 0.0);
  assert_true(diff < 1e-3 * norm);

  /* root_exponent reaches the daemon: square roots on both sides are other roots, so the
   * weights move apart by more than float noise. */
  root_exponent = 2;
  run("exponent-2", 1, 1, 5, we, &c, &fb, &smax);
  root_exponent = 4;
  diff = 0.0;
  for (int k = 0; k < 120; k++) diff = fmax(diff, fabs((double)we[k] - (double)wn[k]));
  assert_true(diff > 1e-3 * norm);
}

/* Before start_step every block takes the grafted fallback, and it is counted. */
static void test_fallback_counted(void **state) {
  (void)state;
  pt_counters c;
  long fb;
  double smax;
  run("fallback", 1, 3, 4, NULL, &c, &fb, &smax);
  assert_int_equal(fb, 2);
}

/* root_delay K (sync_roots): at step s every block applies the roots of the statistics of
 * step s - K exactly (their source step, staleness K), none before step K + 1 or before
 * start_step; after sync_first N steps that used their own step's roots, those of step
 * max(N, s - K). Two such runs give the same weights, and not those of K = 0. sync 0:
 * asynchronous after the first N steps (only those are checked). */
static void delay_run(const char *job, int sync, long delay, long sync_first, long start_step,
                      long steps, float *w_out) {
  toy m;
  toy_init(&m);
  pt_options o;
  opts_for(&o, job);
  o.sync_roots = sync;
  o.root_delay = delay;
  o.sync_first = sync_first;
  o.shampoo.start_step = start_step;
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_OK);
  const ac_shampoo *opt = pt_shampoo(t);
  for (long s = 1; s <= steps; s++) {
    toy_grads(&m, s);
    pt_step_info info;
    if (pt_step(t, s, 0.01, &info, &err) != PT_OK) fail_msg("pt_step %ld: %s", s, err.msg);
    if (!sync && s > sync_first) continue;
    long src = s <= sync_first ? s : s - delay > sync_first ? s - delay : sync_first;
    int used = src >= 1 && s >= start_step;
    assert_int_equal(info.preconditioned, used ? 5 : 0);
    assert_int_equal(info.fallback, used ? 0 : 5);
    if (used) {
      assert_int_equal(info.staleness_max, s - src);
      assert_true(info.staleness_mean == (double)(s - src));
    }
    for (size_t b = 0; b < 5; b++) {
      ac_shampoo_block bi;
      assert_int_equal(ac_shampoo_block_info(opt, b, &bi), AC_OK);
      if (used) /* the roots of step src: the statistics through that step */
        assert_int_equal(bi.source_step, (uint64_t)src);
      else if (src < 1) /* none handed over yet */
        assert_int_equal(bi.version, 0);
    }
  }
  pt_counters c;
  pt_get_counters(t, &c);
  assert_int_equal(c.results_rejected, 0);
  if (w_out != NULL) assert_int_equal(ac_tensor_download(&m.p[0].value, w_out), AC_OK);
  pt_destroy(t);
  toy_destroy(&m);
}

static void test_root_delay(void **state) {
  (void)state;
  float w1[120], w2[120], w0[120];
  delay_run("delay1", 1, 1, 0, 1, 6, NULL);
  delay_run("delay2-a", 1, 2, 0, 1, 7, w1);
  delay_run("delay2-b", 1, 2, 0, 1, 7, w2);
  assert_memory_equal(w1, w2, sizeof w1);
  delay_run("delay0", 1, 0, 0, 1, 7, w0);
  assert_memory_not_equal(w0, w1, sizeof w0);
  delay_run("delay3-start5", 1, 3, 0, 5, 8, NULL);
  delay_run("delay2-first3", 1, 2, 3, 1, 8, NULL);
  delay_run("async-first3", 0, 0, 3, 1, 6, NULL);

  /* Refused: a delay without sync_roots, negative values. */
  toy m;
  toy_init(&m);
  pt_options o;
  opts_for(&o, "delay-bad");
  o.root_delay = 1;
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "root_delay"));
  o.sync_roots = 1;
  o.root_delay = -1;
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EINVAL);
  o.root_delay = 0;
  o.sync_first = -1;
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EINVAL);
  assert_null(t);
  toy_destroy(&m);
}

/* root_every 3 with sync_roots: precondd computes a block's roots at its first push, then
 * when its statistics step enters a new window of 3 steps, the windows offset by the
 * block's id (host/mode_shampoo.c); every step waits for those and applies them, so block b
 * at step s holds the roots of the last such step. Refused: below 1, and with root_delay. */
static void test_root_every(void **state) {
  (void)state;
  toy m;
  toy_init(&m);
  pt_options o;
  opts_for(&o, "every3");
  o.sync_roots = 1;
  o.root_every = 3;
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_OK);
  const ac_shampoo *opt = pt_shampoo(t);
  long due[5] = {0};
  for (long s = 1; s <= 8; s++) {
    toy_grads(&m, s);
    pt_step_info info;
    if (pt_step(t, s, 0.01, &info, &err) != PT_OK) fail_msg("pt_step %ld: %s", s, err.msg);
    assert_int_equal(info.preconditioned, 5);
    long worst = 0;
    for (size_t b = 0; b < 5; b++) {
      if (s == 1 || (s + (long)(b % 3)) % 3 == 0) due[b] = s;
      ac_shampoo_block bi;
      assert_int_equal(ac_shampoo_block_info(opt, b, &bi), AC_OK);
      assert_int_equal(bi.source_step, (uint64_t)due[b]);
      if (s - due[b] > worst) worst = s - due[b];
    }
    assert_true(worst <= 2);
    assert_int_equal(info.staleness_max, worst);
  }
  pt_destroy(t);
  t = NULL;
  o.root_every = 0;
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "root_every"));
  o.root_every = 2;
  o.root_delay = 1;
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "root_every"));
  assert_null(t);
  toy_destroy(&m);
}

/* No daemon at the address: a clear error naming it, nothing left allocated. */
static void test_daemon_absent(void **state) {
  (void)state;
  toy m;
  toy_init(&m);
  pt_options o;
  opts_for(&o, "absent");
  o.daemon = "127.0.0.1:1";
  o.connect_timeout_ms = 300;
  pt_trainer *t = (pt_trainer *)&o;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EDAEMON);
  assert_null(t);
  assert_non_null(strstr(err.msg, "127.0.0.1:1"));
  toy_destroy(&m);
}

static void test_bad_arguments(void **state) {
  (void)state;
  toy m;
  toy_init(&m);
  pt_options o;
  opts_for(&o, "");
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "job"));
  opts_for(&o, "bad");
  o.mode = (pt_mode)7;
  assert_int_equal(pt_create(&t, &o, m.list, NPARAMS, &err), PT_EINVAL);
  opts_for(&o, "bad");
  assert_int_equal(pt_create(&t, &o, m.list, 0, &err), PT_EINVAL);
  assert_int_equal(pt_step(NULL, 1, 0.1, NULL, &err), PT_EINVAL);
  assert_string_equal(pt_mode_name(PT_MODE_SHAMPOO), "shampoo");
  toy_destroy(&m);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s PRECONDD\n", argv[0]);
    return 2;
  }
  precondd_path = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout_from_daemon), cmocka_unit_test(test_push_and_roots),
      cmocka_unit_test(test_sync_reproducible),  cmocka_unit_test(test_root_method),
      cmocka_unit_test(test_fallback_counted),   cmocka_unit_test(test_daemon_absent),
      cmocka_unit_test(test_bad_arguments),      cmocka_unit_test(test_root_delay),
      cmocka_unit_test(test_root_every),         cmocka_unit_test(test_vouched_over_region),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
