/* test_service.c -- unit tests of host/service.c, in process (no sockets): every RPC's
 * answers and status codes, validation before storage, and mutated requests, so that the
 * request handling runs under the sanitizers with the unit suite. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

#include "health.pb-c.h"
#include "precondd.h"
#include "precond.pb-c.h"
#include "preconditioner.h"
#include "rpc.h"

static pd_daemon *daemon_new(size_t memory_mb) {
  pd_daemon *d = calloc(1, sizeof *d);
  pd_config_default(&d->cfg);
  d->cfg.threads = 1;
  d->cfg.memory_limit_bytes = memory_mb << 20;
  d->cfg.max_message_bytes = (size_t)4 << 20;
  assert_int_equal(pd_stats_init(&d->stats), PD_OK);
  assert_int_equal(
      pd_store_init(&d->store, &d->stats, d->cfg.memory_limit_bytes, d->cfg.max_blocks_per_job),
      PD_OK);
  d->store.ended_max = d->cfg.ended_jobs; /* as main.c does */
  pd_sched_rules rules = {d->cfg.failure_threshold, d->cfg.drift_threshold, &d->store,
                          d->cfg.warm_roots, d->cfg.pool_nice};
  assert_int_equal(pd_sched_start(&d->sched, 1, &d->stats, &rules), PD_OK);
  return d;
}

/* Polls cond every millisecond until it holds or WAIT_S seconds pass; the caller then
 * asserts it. The deadline only bounds a hang (the pool is slow under the sanitizers on a
 * loaded machine): no test here depends on how fast the pool is. */
#define WAIT_S 120.0
#define WAIT_FOR(cond)                                                         \
  for (double wait_end_ = pd_now() + WAIT_S; !(cond) && pd_now() < wait_end_;) \
  nanosleep(&(struct timespec){0, 1000000}, NULL)

static void daemon_free(pd_daemon *d) {
  pd_sched_stop(&d->sched);
  pd_store_destroy(&d->store);
  assert_int_equal(atomic_load(&d->stats.memory_bytes), 0);
  pd_stats_destroy(&d->stats);
  free(d);
}

/* Runs one call with msg (or raw bytes when msg is NULL); returns the code and, on OK and
 * when out is given, the parsed response. */
/* The job of that name, borrowed: the store keeps it alive while the test does not end it. */
static pd_job *job_of(pd_daemon *d, const char *name) {
  pd_job *j = pd_store_get(&d->store, name, 0);
  pd_job_unref(j, &d->stats);
  return j;
}

static grpc_status_code handle(pd_daemon *d, pd_method m, const ProtobufCMessage *msg,
                               const void *raw, size_t rawlen,
                               const ProtobufCMessageDescriptor *desc, ProtobufCMessage **out,
                               char *why) {
  grpc_byte_buffer *bb = NULL;
  if (msg) {
    assert_int_equal(rpc_pack(msg, 0, &bb), RPC_OK);
  } else {
    grpc_slice s = grpc_slice_from_copied_buffer(raw, rawlen);
    bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
  }
  pd_reply rep;
  pd_service_handle(d, m, bb, &rep);
  grpc_byte_buffer_destroy(bb);
  if (why) snprintf(why, 512, "%s", rep.message);
  if (rep.code == GRPC_STATUS_OK) {
    assert_non_null(rep.payload);
    if (out) assert_int_equal(rpc_unpack(rep.payload, desc, 0, out), RPC_OK);
    grpc_byte_buffer_destroy(rep.payload);
  } else {
    assert_null(rep.payload);
    assert_true(strlen(rep.message) > 0);
  }
  return rep.code;
}

/* Register of job (one r x c tensor "w" in bs blocks), taking over an ended job's name when
 * reuse_ended. */
static grpc_status_code reg_as(pd_daemon *d, const char *job, uint64_t r, uint64_t c, uint32_t bs,
                               int reuse_ended, Precond__V1__RegisterResponse **out, char *why) {
  uint64_t shape[2] = {r, c};
  Precond__V1__TensorSpec t = PRECOND__V1__TENSOR_SPEC__INIT;
  t.name = (char *)"w";
  t.n_shape = 2;
  t.shape = shape;
  Precond__V1__TensorSpec *tp = &t;
  Precond__V1__ShampooOptions so = PRECOND__V1__SHAMPOO_OPTIONS__INIT;
  so.block_size = bs;
  Precond__V1__RegisterRequest req = PRECOND__V1__REGISTER_REQUEST__INIT;
  req.job = (char *)job;
  req.n_tensors = 1;
  req.tensors = &tp;
  req.shampoo = &so;
  req.reuse_ended_job = reuse_ended != 0;
  return handle(d, PD_M_REGISTER, &req.base, NULL, 0, &precond__v1__register_response__descriptor,
                (ProtobufCMessage **)out, why);
}

static grpc_status_code reg(pd_daemon *d, const char *job, uint64_t r, uint64_t c, uint32_t bs,
                            Precond__V1__RegisterResponse **out, char *why) {
  return reg_as(d, job, r, c, bs, 0, out, why);
}

/* Identity-plus statistics of order n, packed. */
static float *stat(size_t n, float scale) {
  float *p = calloc(pc_packed_len(n), sizeof *p);
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++) p[k++] = (i == j ? 2.0f : 0.1f) * scale;
  return p;
}

static grpc_status_code push2(pd_daemon *d, const char *job, uint64_t step, const float *l,
                              size_t nl, const float *r, size_t nr, uint32_t id1, char *why) {
  Precond__V1__PackedMatrix ml = PRECOND__V1__PACKED_MATRIX__INIT;
  Precond__V1__PackedMatrix mr = PRECOND__V1__PACKED_MATRIX__INIT;
  ml.n = (uint32_t)nl;
  ml.data.data = (uint8_t *)l;
  ml.data.len = pc_packed_len(nl) * 4;
  mr.n = (uint32_t)nr;
  mr.data.data = (uint8_t *)r;
  mr.data.len = pc_packed_len(nr) * 4;
  Precond__V1__BlockStatistics b[2] = {PRECOND__V1__BLOCK_STATISTICS__INIT,
                                       PRECOND__V1__BLOCK_STATISTICS__INIT};
  b[0].left = b[1].left = &ml;
  b[0].right = b[1].right = &mr;
  b[1].block_id = id1;
  Precond__V1__BlockStatistics *bp[2] = {&b[0], &b[1]};
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = (char *)job;
  req.step = step;
  req.n_blocks = 2;
  req.blocks = bp;
  return handle(d, PD_M_PUSH, &req.base, NULL, 0, NULL, NULL, why);
}

static void test_register(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  char why[512];
  Precond__V1__RegisterResponse *r = NULL;
  assert_int_equal(reg(d, "j", 8, 12, 4, &r, why), GRPC_STATUS_OK);
  assert_int_equal(r->n_blocks, 6);
  assert_int_equal(r->blocks[5]->row0, 4);
  assert_int_equal(r->blocks[5]->col0, 8);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  assert_int_equal(reg(d, "j", 8, 12, 4, NULL, why), GRPC_STATUS_OK);
  assert_int_equal(reg(d, "j", 8, 12, 8, NULL, why), GRPC_STATUS_FAILED_PRECONDITION);
  assert_int_equal(reg(d, "j2", 8, 0, 4, NULL, why), GRPC_STATUS_INVALID_ARGUMENT);
  assert_int_equal(reg(d, "", 8, 8, 4, NULL, why), GRPC_STATUS_INVALID_ARGUMENT);
  assert_int_equal(reg(d, "big", 4096, 4096, 4096, NULL, why), GRPC_STATUS_RESOURCE_EXHAUSTED);
  Precond__V1__RegisterRequest abs = PRECOND__V1__REGISTER_REQUEST__INIT;
  abs.job = (char *)"k";
  abs.mode = PRECOND__V1__MODE__MODE_ABS;
  assert_int_equal(handle(d, PD_M_REGISTER, &abs.base, NULL, 0, NULL, NULL, why),
                   GRPC_STATUS_UNIMPLEMENTED);
  assert_int_equal(handle(d, PD_M_REGISTER, NULL, "\xff\xff", 2, NULL, NULL, why),
                   GRPC_STATUS_INVALID_ARGUMENT);
  pd_reply rep;
  pd_service_handle(d, PD_M_REGISTER, NULL, &rep); /* no message at all */
  assert_int_equal(rep.code, GRPC_STATUS_INVALID_ARGUMENT);
  daemon_free(d);
}

static void test_push_fetch_stats(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  char why[512];
  assert_int_equal(reg(d, "j", 4, 8, 4, NULL, why), GRPC_STATUS_OK); /* blocks 0, 1 */
  float *l = stat(4, 1), *bad = stat(4, 1);
  bad[2] = NAN;
  assert_int_equal(push2(d, "nope", 1, l, 4, l, 4, 1, why), GRPC_STATUS_FAILED_PRECONDITION);
  assert_int_equal(push2(d, "j", 1, l, 4, l, 4, 0, why), GRPC_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(why, "twice"));
  assert_int_equal(push2(d, "j", 1, l, 4, l, 4, 2, why), GRPC_STATUS_NOT_FOUND);
  assert_int_equal(push2(d, "j", 1, l, 4, l, 3, 1, why), GRPC_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(why, "right.n"));
  assert_int_equal(push2(d, "j", 1, l, 4, bad, 4, 1, why), GRPC_STATUS_INVALID_ARGUMENT);
  /* Nothing of the refused pushes was stored. */
  pd_job *job = job_of(d, "j");
  assert_int_equal(job->blocks[0].pushes, 0);
  assert_int_equal(atomic_load(&d->stats.rejected_pushes), 5);

  assert_int_equal(push2(d, "j", 3, l, 4, l, 4, 1, why), GRPC_STATUS_OK);
  assert_int_equal(job->blocks[0].pushes, 1);
  assert_int_equal(job->blocks[1].pushes, 1);
  WAIT_FOR(atomic_load(&d->stats.roots_computed) >= 2);
  assert_int_equal(atomic_load(&d->stats.roots_computed), 2);

  Precond__V1__BlockVersion v = PRECOND__V1__BLOCK_VERSION__INIT;
  v.block_id = 1;
  v.version = 1;
  Precond__V1__BlockVersion *vp = &v;
  Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
  fr.job = (char *)"j";
  fr.n_have = 1;
  fr.have = &vp;
  fr.encoding = PRECOND__V1__ENCODING__ENCODING_BF16;
  Precond__V1__FetchResponse *f = NULL;
  assert_int_equal(handle(d, PD_M_FETCH, &fr.base, NULL, 0,
                          &precond__v1__fetch_response__descriptor, (ProtobufCMessage **)&f, why),
                   GRPC_STATUS_OK);
  assert_int_equal(f->n_preconditioners, 1); /* block 1 is held at version 1 */
  assert_int_equal(f->preconditioners[0]->block_id, 0);
  assert_int_equal(f->preconditioners[0]->source_step, 3);
  assert_int_equal(f->preconditioners[0]->left->data.len, pc_packed_len(4) * 2);
  protobuf_c_message_free_unpacked(&f->base, NULL);
  fr.encoding = (Precond__V1__Encoding)5;
  assert_int_equal(handle(d, PD_M_FETCH, &fr.base, NULL, 0, NULL, NULL, why),
                   GRPC_STATUS_INVALID_ARGUMENT);
  fr.encoding = PRECOND__V1__ENCODING__ENCODING_FP32;
  v.block_id = 9;
  assert_int_equal(handle(d, PD_M_FETCH, &fr.base, NULL, 0, NULL, NULL, why),
                   GRPC_STATUS_NOT_FOUND);

  Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
  sr.blocks = 1;
  Precond__V1__StatsResponse *st = NULL;
  assert_int_equal(handle(d, PD_M_STATS, &sr.base, NULL, 0,
                          &precond__v1__stats_response__descriptor, (ProtobufCMessage **)&st, why),
                   GRPC_STATUS_OK);
  assert_int_equal(st->jobs, 1);
  assert_int_equal(st->n_block_stats, 2);
  assert_int_equal(st->block_stats[1]->stat_step, 3);
  assert_int_equal(st->block_stats[1]->staleness, 0);
  assert_int_equal(st->rejected_pushes, 5);
  assert_int_equal(st->roots_computed, 2);
  assert_true(st->memory_bytes > 0);
  protobuf_c_message_free_unpacked(&st->base, NULL);

  /* A push that leaves the statistics as they were (zeros into sums): the drift test keeps
   * both roots, republished as of step 5 and counted; the push of step 5 met roots of
   * step 3, a staleness sample of 2 per block. */
  float *zero = calloc(pc_packed_len(4), sizeof *zero);
  assert_int_equal(push2(d, "j", 5, zero, 4, zero, 4, 1, why), GRPC_STATUS_OK);
  WAIT_FOR(atomic_load(&d->stats.roots_skipped) >= 2);
  assert_int_equal(handle(d, PD_M_STATS, &sr.base, NULL, 0,
                          &precond__v1__stats_response__descriptor, (ProtobufCMessage **)&st, why),
                   GRPC_STATUS_OK);
  assert_int_equal(st->roots_skipped, 2);
  assert_int_equal(st->roots_computed, 2);
  assert_true(st->drift_threshold == d->cfg.drift_threshold);
  assert_int_equal(st->staleness->samples, 2);
  assert_true(st->staleness->p50 == 2 && st->staleness->p99 == 2);
  assert_int_equal(st->staleness->max, 2);
  for (int b = 0; b < 2; b++) {
    assert_int_equal(st->block_stats[b]->roots_skipped, 1);
    assert_int_equal(st->block_stats[b]->version, 2);
    assert_int_equal(st->block_stats[b]->root_step, 5);
    assert_true(st->block_stats[b]->last_drift == 0);
    assert_int_equal(st->block_stats[b]->staleness_dist->samples, 1);
    assert_true(st->block_stats[b]->staleness_dist->mean == 2);
  }
  protobuf_c_message_free_unpacked(&st->base, NULL);
  free(zero);

  Grpc__Health__V1__HealthCheckRequest hr = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  Grpc__Health__V1__HealthCheckResponse *h = NULL;
  assert_int_equal(
      handle(d, PD_M_HEALTH, &hr.base, NULL, 0,
             &grpc__health__v1__health_check_response__descriptor, (ProtobufCMessage **)&h, why),
      GRPC_STATUS_OK);
  assert_int_equal(h->status, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  protobuf_c_message_free_unpacked(&h->base, NULL);
  free(l);
  free(bad);
  daemon_free(d);
}

/* Mutations of a valid push (bytes changed or cut): every answer is a documented code. */
static void test_mutated_requests(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  char why[512];
  assert_int_equal(reg(d, "j", 4, 8, 4, NULL, why), GRPC_STATUS_OK);
  float *l = stat(4, 1);
  Precond__V1__PackedMatrix m = PRECOND__V1__PACKED_MATRIX__INIT;
  m.n = 4;
  m.data.data = (uint8_t *)l;
  m.data.len = pc_packed_len(4) * 4;
  Precond__V1__BlockStatistics b[2] = {PRECOND__V1__BLOCK_STATISTICS__INIT,
                                       PRECOND__V1__BLOCK_STATISTICS__INIT};
  b[0].left = b[0].right = b[1].left = b[1].right = &m;
  b[1].block_id = 1;
  Precond__V1__BlockStatistics *bp[2] = {&b[0], &b[1]};
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = (char *)"j";
  req.step = 2;
  req.n_blocks = 2;
  req.blocks = bp;
  size_t n = protobuf_c_message_get_packed_size(&req.base);
  uint8_t *valid = malloc(n), *mut = malloc(n);
  protobuf_c_message_pack(&req.base, valid);
  uint64_t s = 5;
  const pd_method methods[5] = {PD_M_PUSH, PD_M_REGISTER, PD_M_FETCH, PD_M_STATS, PD_M_HEALTH};
  for (int it = 0; it < 3000; it++) {
    memcpy(mut, valid, n);
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    size_t len = n;
    if (it % 5 == 0) {
      len = (size_t)(s >> 33) % n;
    } else {
      for (int k = 0; k <= it % 3; k++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        mut[(s >> 33) % n] = (uint8_t)(s >> 20);
      }
    }
    grpc_status_code c = handle(d, methods[it % 5], NULL, mut, len, NULL, NULL, why);
    assert_true(c == GRPC_STATUS_OK || c == GRPC_STATUS_INVALID_ARGUMENT ||
                c == GRPC_STATUS_NOT_FOUND || c == GRPC_STATUS_FAILED_PRECONDITION ||
                c == GRPC_STATUS_RESOURCE_EXHAUSTED || c == GRPC_STATUS_UNIMPLEMENTED);
  }
  free(valid);
  free(mut);
  free(l);
  daemon_free(d);
}

/* Raw request bytes: a job field "j", then count copies of the two bytes of an empty
 * entry of field (length-delimited, length 0). The caller frees the buffer. */
static uint8_t *empty_entries(uint32_t field, size_t count, size_t *len) {
  *len = 3 + 2 * count;
  uint8_t *p = malloc(*len);
  assert_non_null(p);
  memcpy(p, "\x0a\x01j", 3);
  for (size_t i = 0; i < count; i++) {
    p[3 + 2 * i] = (uint8_t)(field << 3 | 2);
    p[4 + 2 * i] = 0;
  }
  return p;
}

/* handle() with the bytes cut into slices of `piece` bytes, as gRPC hands over a message
 * that arrived in frames. */
static grpc_status_code handle_sliced(pd_daemon *d, pd_method m, const uint8_t *raw, size_t len,
                                      size_t piece, char *why) {
  size_t ns = (len + piece - 1) / piece;
  grpc_slice *sl = calloc(ns, sizeof *sl);
  for (size_t i = 0; i < ns; i++)
    sl[i] = grpc_slice_from_copied_buffer((const char *)raw + i * piece,
                                          i + 1 < ns ? piece : len - i * piece);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sl, ns);
  for (size_t i = 0; i < ns; i++) grpc_slice_unref(sl[i]);
  free(sl);
  pd_reply rep;
  pd_service_handle(d, m, bb, &rep);
  grpc_byte_buffer_destroy(bb);
  if (rep.payload) grpc_byte_buffer_destroy(rep.payload);
  snprintf(why, 512, "%s", rep.message);
  return rep.code;
}

/* Counts and sizes are refused before the request is parsed: a Register of more tensors
 * than PD_MAX_TENSORS, a Push or a Fetch of more entries than --max-blocks-per-job, a
 * small request above its own size limit, a step above PD_MAX_STEP. */
static void test_request_limits(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  char why[512];
  assert_int_equal(reg(d, "j", 4, 8, 4, NULL, why), GRPC_STATUS_OK);
  size_t max = d->cfg.max_blocks_per_job, len;
  uint8_t *raw = empty_entries(3, PD_MAX_TENSORS + 1, &len);
  assert_int_equal(handle(d, PD_M_REGISTER, NULL, raw, len, NULL, NULL, why),
                   GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(why, "tensors: more than"));
  free(raw);
  raw = empty_entries(3, max + 1, &len);
  assert_int_equal(handle(d, PD_M_PUSH, NULL, raw, len, NULL, NULL, why),
                   GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(why, "blocks: more than"));
  assert_int_equal(atomic_load(&d->stats.rejected_pushes), 1);
  free(raw);
  /* Fetch: the limit itself passes, one more does not, however the bytes are sliced. */
  raw = empty_entries(2, max, &len);
  assert_int_equal(handle_sliced(d, PD_M_FETCH, raw, len, 3, why), GRPC_STATUS_OK);
  free(raw);
  raw = empty_entries(2, max + 1, &len);
  assert_int_equal(handle_sliced(d, PD_M_FETCH, raw, len, 3, why), GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(why, "have: more than"));
  assert_int_equal(handle_sliced(d, PD_M_FETCH, raw, len, len, why),
                   GRPC_STATUS_RESOURCE_EXHAUSTED);
  free(raw);
  /* GetStats has no use for 100 KiB. */
  size_t big = (size_t)100 << 10;
  char *name = malloc(big + 1);
  memset(name, 'x', big);
  name[big] = '\0';
  Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
  sr.job = name;
  assert_int_equal(handle(d, PD_M_STATS, &sr.base, NULL, 0, NULL, NULL, why),
                   GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_true(pd_request_max_bytes(&d->cfg, PD_M_STATS) < big);
  assert_int_equal(pd_request_max_bytes(&d->cfg, PD_M_PUSH), d->cfg.max_message_bytes);
  free(name);
  /* A step that a double cannot hold exactly is refused, nothing stored. */
  float *l = stat(4, 1);
  assert_int_equal(push2(d, "j", UINT64_MAX, l, 4, l, 4, 1, why), GRPC_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(why, "step"));
  assert_int_equal(push2(d, "j", PD_MAX_STEP + 1, l, 4, l, 4, 1, why),
                   GRPC_STATUS_INVALID_ARGUMENT);
  assert_int_equal(job_of(d, "j")->blocks[0].pushes, 0);
  assert_int_equal(push2(d, "j", PD_MAX_STEP, l, 4, l, 4, 1, why), GRPC_STATUS_OK);
  free(l);
  daemon_free(d);
}

/* Two pushes of 3e38 would make the stored sum Inf, and a block with an Inf statistic never
 * gets a root again: the second push is refused whole and the statistic stays finite. */
static void test_overflowing_push_refused(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  char why[512];
  assert_int_equal(reg(d, "j", 4, 8, 4, NULL, why), GRPC_STATUS_OK);
  float *ok = stat(4, 1), *huge = stat(4, 1.5e38f);
  assert_int_equal(push2(d, "j", 1, huge, 4, ok, 4, 1, why), GRPC_STATUS_OK);
  /* The third would take the right factors to 6e38: refused, nothing of it stored. */
  assert_int_equal(push2(d, "j", 2, ok, 4, huge, 4, 1, why), GRPC_STATUS_OK);
  assert_int_equal(push2(d, "j", 3, ok, 4, huge, 4, 1, why), GRPC_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(why, "overflow"));
  pd_job *job = job_of(d, "j");
  for (int b = 0; b < 2; b++) {
    assert_int_equal(job->blocks[b].pushes, 2);
    assert_int_equal(atomic_load(&job->blocks[b].stat_step), 2);
    assert_true(pc_all_finite_f32(pc_packed_len(4), job->blocks[b].stat[0]));
    assert_true(pc_all_finite_f32(pc_packed_len(4), job->blocks[b].stat[1]));
  }
  assert_int_equal(atomic_load(&d->stats.rejected_pushes), 1);
  free(ok);
  free(huge);
  daemon_free(d);
}

/* Jobs of rank-1 tensors have no statistics, but their records are memory too: counted in
 * memory_bytes and against --memory-limit-mb (they used to count 0 bytes, so such jobs
 * could grow the daemon without limit). */
static void test_rank1_jobs_counted(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(1);
  enum { NT = 1000 };
  Precond__V1__TensorSpec specs[NT], *ptrs[NT];
  char names[NT][32];
  uint64_t shape[1] = {1000};
  for (int i = 0; i < NT; i++) {
    precond__v1__tensor_spec__init(&specs[i]);
    snprintf(names[i], sizeof names[i], "bias-%04d-of-a-long-layer", i);
    specs[i].name = names[i];
    specs[i].n_shape = 1;
    specs[i].shape = shape;
    ptrs[i] = &specs[i];
  }
  Precond__V1__RegisterRequest req = PRECOND__V1__REGISTER_REQUEST__INIT;
  req.n_tensors = NT;
  req.tensors = ptrs;
  char job[32], why[512];
  int registered = 0;
  grpc_status_code code = GRPC_STATUS_OK;
  for (; registered < 200 && code == GRPC_STATUS_OK; registered++) {
    snprintf(job, sizeof job, "j%d", registered);
    req.job = job;
    code = handle(d, PD_M_REGISTER, &req.base, NULL, 0, NULL, NULL, why);
    if (registered == 0) assert_true(atomic_load(&d->stats.memory_bytes) > NT * 30);
  }
  assert_int_equal(code, GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_true(registered < 100);
  assert_true(atomic_load(&d->stats.memory_bytes) <= (int64_t)1 << 20);
  daemon_free(d); /* and every byte counted is given back */
}

static grpc_status_code end_job(pd_daemon *d, const char *job, Precond__V1__EndJobResponse **out,
                                char *why) {
  Precond__V1__EndJobRequest req = PRECOND__V1__END_JOB_REQUEST__INIT;
  req.job = (char *)job;
  return handle(d, PD_M_END_JOB, &req.base, NULL, 0, &precond__v1__end_job_response__descriptor,
                (ProtobufCMessage **)out, why);
}

static Precond__V1__StatsResponse *stats_of(pd_daemon *d) {
  Precond__V1__StatsRequest sr = PRECOND__V1__STATS_REQUEST__INIT;
  Precond__V1__StatsResponse *st = NULL;
  assert_int_equal(handle(d, PD_M_STATS, &sr.base, NULL, 0,
                          &precond__v1__stats_response__descriptor, (ProtobufCMessage **)&st, NULL),
                   GRPC_STATUS_OK);
  return st;
}

/* EndJob frees a job whose blocks are queued, while a call in flight (a reference taken as a
 * handler takes it) and a root handed out stay valid; the memory comes back to 0 once they
 * are released. The job is unknown afterwards and registers anew, empty. */
static void test_end_job(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  char why[512];
  assert_int_equal(end_job(d, "j", NULL, why), GRPC_STATUS_NOT_FOUND);
  assert_int_equal(end_job(d, "", NULL, why), GRPC_STATUS_INVALID_ARGUMENT);
  assert_int_equal(reg(d, "j", 8, 4, 4, NULL, why), GRPC_STATUS_OK);
  assert_int_equal(reg(d, "keep", 4, 4, 4, NULL, why), GRPC_STATUS_OK);
  float *l = stat(4, 1);
  for (uint64_t step = 1; step <= 20; step++) /* some queued, some computing */
    assert_int_equal(push2(d, "j", step, l, 4, l, 4, 1, why), GRPC_STATUS_OK);
  pd_job *inflight = pd_store_get(&d->store, "j", 0);
  pd_root *held = NULL;
  WAIT_FOR((held = pd_block_root(&inflight->blocks[0])) != NULL);
  assert_non_null(held);
  int64_t before = atomic_load(&d->stats.memory_bytes);

  Precond__V1__EndJobResponse *e = NULL;
  assert_int_equal(end_job(d, "j", &e, why), GRPC_STATUS_OK);
  assert_int_equal(e->blocks, 2);
  assert_int_equal(e->last_step, 20);
  assert_int_equal(e->bytes, pd_job_bytes(inflight));
  protobuf_c_message_free_unpacked(&e->base, NULL);
  assert_true(atomic_load(&inflight->ended));
  /* Unknown to every call now; the reference still reads the job. */
  assert_int_equal(end_job(d, "j", NULL, why), GRPC_STATUS_NOT_FOUND);
  assert_int_equal(push2(d, "j", 21, l, 4, l, 4, 1, why), GRPC_STATUS_FAILED_PRECONDITION);
  Precond__V1__FetchRequest fr = PRECOND__V1__FETCH_REQUEST__INIT;
  fr.job = (char *)"j";
  assert_int_equal(handle(d, PD_M_FETCH, &fr.base, NULL, 0, NULL, NULL, why),
                   GRPC_STATUS_NOT_FOUND);
  assert_int_equal(inflight->nblocks, 2);
  assert_true(held->version > 0);
  Precond__V1__StatsResponse *st = stats_of(d);
  assert_int_equal(st->jobs, 1);
  assert_string_equal(st->job_stats[0]->job, "keep");
  assert_int_equal(st->jobs_ended, 1);
  assert_int_equal(st->jobs_expired, 0);
  protobuf_c_message_free_unpacked(&st->base, NULL);

  /* The queue lets go of it (the pool finishes the block it computes, then drops it): its
   * entries leave the queue, and the pool drops their job references, the test's own the
   * last. Both are waited for: a worker leaves the depth count under the pool's lock and
   * drops its reference after unlocking, so depth 0 alone let the unref below miss the
   * free now and then under ASan and load (session 11's flake, reproduced with a sleep
   * before the worker's pd_job_unref). */
  WAIT_FOR(pd_sched_depth(&d->sched) == 0 && atomic_load(&inflight->refs) == 1);
  assert_int_equal(pd_sched_depth(&d->sched), 0);
  assert_int_equal(atomic_load(&inflight->refs), 1);
  /* The reference holds it: nothing of the job was freed. Not "equal": a computation that
   * was running at `before` may have published since (a root beside the held one, a block's
   * warm-start state), which only adds (a flake under ASan and load, session 8). */
  int64_t held_mem = atomic_load(&d->stats.memory_bytes);
  assert_true(held_mem >= before);
  pd_job_unref(inflight, &d->stats);
  assert_true(atomic_load(&d->stats.memory_bytes) < held_mem);
  pd_root_unref(held, &d->stats);

  /* Its name is remembered: a worker registering it again (what libprecond does after a
   * NOT_FOUND) is refused, saying when and how it ended and how to reuse the name; the
   * calls that name it say it ended. */
  assert_int_equal(reg(d, "j", 8, 4, 4, NULL, why), GRPC_STATUS_FAILED_PRECONDITION);
  assert_non_null(strstr(why, "\"j\" was ended by EndJob at 20"));
  assert_non_null(strstr(why, "reuse_ended_job"));
  assert_null(job_of(d, "j"));
  assert_int_equal(push2(d, "j", 22, l, 4, l, 4, 1, why), GRPC_STATUS_FAILED_PRECONDITION);
  assert_non_null(strstr(why, "was ended by EndJob"));
  assert_int_equal(handle(d, PD_M_FETCH, &fr.base, NULL, 0, NULL, NULL, why),
                   GRPC_STATUS_NOT_FOUND);
  assert_non_null(strstr(why, "was ended by EndJob"));
  /* Registered again with reuse_ended_job: a new, empty job, and the name is free again. */
  assert_int_equal(reg_as(d, "j", 8, 4, 4, 1, NULL, why), GRPC_STATUS_OK);
  assert_int_equal(job_of(d, "j")->blocks[0].pushes, 0);
  assert_int_equal(reg(d, "j", 8, 4, 4, NULL, why), GRPC_STATUS_OK);
  assert_int_equal(pd_store_ended(&d->store, "j", NULL), 0);
  /* With --ended-jobs 0 nothing is remembered: the old behaviour. */
  d->store.ended_max = 0;
  assert_int_equal(end_job(d, "keep", NULL, why), GRPC_STATUS_OK);
  assert_int_equal(reg(d, "keep", 4, 4, 4, NULL, why), GRPC_STATUS_OK);
  free(l);
  daemon_free(d);
}

/* The idle expiry ends jobs with no Register, push or fetch for longer than the option;
 * GetStats is not activity, a push is. */
static void test_idle_expiry(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  d->cfg.job_idle_expiry_s = 10;
  char why[512];
  assert_int_equal(reg(d, "idle", 4, 4, 4, NULL, why), GRPC_STATUS_OK);
  assert_int_equal(reg(d, "busy", 8, 4, 4, NULL, why), GRPC_STATUS_OK);
  double t0 = pd_now();
  assert_int_equal(pd_service_expire(d, t0 + 5), 0);
  /* Both were last active 100 s ago; then a push to one of them. */
  atomic_store(&job_of(d, "idle")->last_active, t0 - 100);
  atomic_store(&job_of(d, "busy")->last_active, t0 - 100);
  float *l = stat(4, 1);
  assert_int_equal(push2(d, "busy", 1, l, 4, l, 4, 1, why), GRPC_STATUS_OK);
  Precond__V1__StatsResponse *st = stats_of(d); /* a look: no activity */
  assert_int_equal(st->job_idle_expiry_s, 10);
  assert_true(st->job_stats[0]->idle_s >= 100);
  protobuf_c_message_free_unpacked(&st->base, NULL);
  assert_int_equal(pd_service_expire(d, pd_now()), 1);
  st = stats_of(d);
  assert_int_equal(st->jobs, 1);
  assert_string_equal(st->job_stats[0]->job, "busy");
  assert_int_equal(st->jobs_expired, 1);
  assert_int_equal(st->jobs_ended, 0);
  protobuf_c_message_free_unpacked(&st->base, NULL);
  /* An expired job's worker that comes back is refused like an ended one, told why. */
  assert_int_equal(reg(d, "idle", 4, 4, 4, NULL, why), GRPC_STATUS_FAILED_PRECONDITION);
  assert_non_null(strstr(why, "\"idle\" was ended by the idle expiry at"));
  assert_int_equal(reg_as(d, "idle", 4, 4, 4, 1, NULL, why), GRPC_STATUS_OK);
  /* Off: nothing expires. */
  d->cfg.job_idle_expiry_s = 0;
  assert_int_equal(pd_service_expire(d, pd_now() + 1e6), 0);
  free(l);
  daemon_free(d);
}

/* A per-job memory limit: one job cannot take the daemon's whole budget; a Register above
 * it is RESOURCE_EXHAUSTED naming the job and the option, and nothing is held for it. */
static void test_job_memory_limit(void **state) {
  (void)state;
  pd_daemon *d = daemon_new(64);
  char why[512];
  /* 64 x 64 in blocks of 64: statistics and a root pair, 4 x 2080 floats, 33 KB. */
  d->store.job_memory_limit = 40000;
  assert_int_equal(reg(d, "small", 64, 64, 64, NULL, why), GRPC_STATUS_OK);
  int64_t held = atomic_load(&d->stats.memory_bytes);
  assert_int_equal(reg(d, "large", 128, 64, 64, NULL, why), GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(why, "\"large\""));
  assert_non_null(strstr(why, "--job-memory-limit-mb"));
  assert_int_equal(atomic_load(&d->stats.memory_bytes), held);
  Precond__V1__StatsResponse *st = stats_of(d);
  assert_int_equal(st->jobs, 1);
  assert_int_equal(st->job_memory_limit_bytes, 40000);
  assert_true(st->job_stats[0]->memory_bytes > 4 * 2080 * sizeof(float));
  assert_true(st->job_stats[0]->memory_bytes <= 40000);
  protobuf_c_message_free_unpacked(&st->base, NULL);
  /* Off: the same job fits the daemon-wide budget. */
  d->store.job_memory_limit = 0;
  assert_int_equal(reg(d, "large", 128, 64, 64, NULL, why), GRPC_STATUS_OK);
  daemon_free(d);
}

/* Pushes 64 x 64 statistics l to every block of job (256 x 64 in 64 x 64 blocks: blocks 0
 * and k at step k, k = 1..3) and waits until the pool has computed a root of each. */
static void push_all_and_wait(pd_daemon *d, const char *job, const float *l, char *why) {
  for (uint32_t id1 = 1; id1 < 4; id1++)
    assert_int_equal(push2(d, job, id1, l, 64, l, 64, id1, why), GRPC_STATUS_OK);
  WAIT_FOR(pd_sched_depth(&d->sched) == 0 && atomic_load(&d->stats.roots_computed) >= 4);
  assert_true(atomic_load(&d->stats.roots_computed) >= 4);
}

/* A daemon with warm roots on or off, two pool threads (which could compute two blocks at
 * once) and job "j" registered: 256 x 64 in four 64 x 64 blocks. */
static pd_daemon *scratch_daemon(int warm, char *why) {
  pd_daemon *d = daemon_new(64);
  d->cfg.warm_roots = warm;
  d->store.warm_roots = d->cfg.warm_roots; /* as main.c does */
  pd_sched_stop(&d->sched);
  pd_sched_rules rules = {d->cfg.failure_threshold, 0, &d->store, d->cfg.warm_roots, 0};
  assert_int_equal(pd_sched_start(&d->sched, 2, &d->stats, &rules), PD_OK);
  assert_int_equal(reg(d, "j", 256, 64, 64, NULL, why), GRPC_STATUS_OK);
  return d;
}

/* The pool's scratch is in the budget: Register keeps room to compute the job's largest
 * block (a job whose records fit but whose computation would not is refused), and the pool
 * runs only as many computations at once as the free budget holds, queueing the rest. */
static void test_scratch_in_budget(void **state) {
  (void)state;
  char why[512];
  pd_daemon *d = scratch_daemon(0, why);
  pd_job *job = job_of(d, "j");
  size_t one = pd_unit_scratch_bytes(&job->blocks[0], 0);
  assert_int_equal(job->scratch_max, one);
  assert_true(one > 80 * 64 * 64);
  /* Room for the job and one computation and a half. */
  size_t reserved = atomic_load(&d->store.reserved);
  assert_int_equal(reserved, pd_job_bytes(job));
  d->store.memory_limit = reserved + one + one / 2;
  float *l = stat(64, 1);
  push_all_and_wait(d, "j", l, why);
  for (int b = 0; b < 4; b++) assert_true(atomic_load(&job->blocks[b].has_root));
  /* One computation at a time: never two blocks' scratch together. */
  assert_int_equal(atomic_load(&d->stats.scratch_peak), one);
  assert_int_equal(atomic_load(&d->stats.scratch_bytes), 0);
  Precond__V1__StatsResponse *st = stats_of(d);
  assert_int_equal(st->scratch_peak_bytes, one);
  assert_int_equal(st->scratch_bytes, 0);
  protobuf_c_message_free_unpacked(&st->base, NULL);

  /* A second job whose records fit in what is left but not with room to compute its block
   * (64 x 64 in one block: its own scratch is the same as the first's) is refused. */
  d->store.memory_limit = reserved + one + 1000;
  assert_int_equal(reg(d, "k", 64, 64, 64, NULL, why), GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(why, "scratch"));
  d->store.memory_limit = (size_t)64 << 20;
  assert_int_equal(reg(d, "k", 64, 64, 64, NULL, why), GRPC_STATUS_OK);
  free(l);
  daemon_free(d);
}

/* With --warm-roots on, a Shampoo computation's scratch is the warm bound: the warm route's
 * buffers (48 n^2) stay allocated while it falls back to a cold root, on top of the cold
 * bound. Register keeps room for it, the pool admits by it (two cold-bounded computations
 * would fit in the budget below, one warm one does), and GetStats counts it. */
static void test_warm_scratch_in_budget(void **state) {
  (void)state;
  char why[512];
  pd_daemon *d = scratch_daemon(1, why);
  pd_job *job = job_of(d, "j");
  size_t cold = pd_unit_scratch_bytes(&job->blocks[0], 0);
  size_t warm = pd_unit_scratch_bytes(&job->blocks[0], 1);
  assert_int_equal(warm - cold, 48 * 64 * 64);
  assert_int_equal(job->scratch_max, warm);
  assert_int_equal(atomic_load(&d->store.scratch_max), warm);
  size_t reserved = atomic_load(&d->store.reserved);
  assert_true(2 * cold < warm + warm / 2);
  d->store.memory_limit = reserved + warm + warm / 2;
  float *l = stat(64, 1);
  push_all_and_wait(d, "j", l, why);
  for (int b = 0; b < 4; b++) {
    assert_true(atomic_load(&job->blocks[b].has_root));
    assert_non_null(job->blocks[b].mode_state); /* computed warm (seeded) */
  }
  /* One computation at a time, counted at the warm bound. */
  assert_int_equal(atomic_load(&d->stats.scratch_peak), warm);
  Precond__V1__StatsResponse *st = stats_of(d);
  assert_int_equal(st->scratch_peak_bytes, warm);
  assert_int_equal(st->scratch_bytes, 0);
  protobuf_c_message_free_unpacked(&st->base, NULL);
  /* A second job (one 64 x 64 block: the same scratch) whose records fit with room for a
   * cold computation but not a warm one is refused; with room for a warm one it is not. */
  pd_shampoo_opts o = {0};
  assert_int_equal(pd_mode_shampoo.resolve(&o, why, 512), PD_OK);
  o.block_size = 64;
  uint64_t dims[2] = {64, 64};
  pd_tensor t = {(char *)"w", 2, dims};
  pd_job *k = NULL;
  assert_int_equal(pd_job_build("k", &pd_mode_shampoo, &o, 1, &t, 100, &k, why, 512), PD_OK);
  size_t kbytes = pd_job_bytes(k);
  pd_job_free(k, NULL);
  d->store.memory_limit = atomic_load(&d->store.reserved) + kbytes + cold + 1000;
  assert_int_equal(reg(d, "k", 64, 64, 64, NULL, why), GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(why, "scratch"));
  d->store.memory_limit = atomic_load(&d->store.reserved) + kbytes + warm;
  assert_int_equal(reg(d, "k", 64, 64, 64, NULL, why), GRPC_STATUS_OK);
  free(l);
  daemon_free(d);
}

int main(void) {
  pd_log_set_level(PD_LOG_ERROR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_register),
      cmocka_unit_test(test_push_fetch_stats),
      cmocka_unit_test(test_mutated_requests),
      cmocka_unit_test(test_request_limits),
      cmocka_unit_test(test_overflowing_push_refused),
      cmocka_unit_test(test_rank1_jobs_counted),
      cmocka_unit_test(test_end_job),
      cmocka_unit_test(test_idle_expiry),
      cmocka_unit_test(test_job_memory_limit),
      cmocka_unit_test(test_scratch_in_budget),
      cmocka_unit_test(test_warm_scratch_in_budget),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
