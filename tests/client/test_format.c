/*
 * test_format.c -- unit tests of precondctl's output: the stats and block tables carry the
 * figures, and the JSON documents carry exact numbers and escaped strings.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "format.h"

typedef struct {
  char *buf;
  size_t len;
  FILE *f;
} sink;

static void sink_open(sink *s) {
  s->buf = NULL;
  s->len = 0;
  s->f = open_memstream(&s->buf, &s->len);
  assert_non_null(s->f);
}

static char *sink_close(sink *s) {
  assert_int_equal(fclose(s->f), 0);
  return s->buf;
}

static precond_job_stats jobs[2];
static precond_block_stats blocks[2];

static precond_stats sample(void) {
  precond_stats s;
  memset(&s, 0, sizeof s);
  s.version = "0.1.0";
  s.uptime_s = 12.5;
  s.jobs = 2;
  s.threads = 3;
  s.replicas = 1;
  s.queue_depth = 7;
  s.roots_computed = 12345678901ULL;
  s.roots_failed = 2;
  s.compute_ms_p50 = 1.25;
  s.roots_skipped = 7;
  s.drift_threshold = 0.01;
  s.staleness =
      (precond_staleness){.samples = 40, .p50 = 1, .p90 = 3, .p99 = 9, .max = 12, .mean = 1.5};
  s.bytes_in = 3u << 20;
  s.memory_bytes = 1024;
  jobs[0] = (precond_job_stats){
      .job = "resnet", .mode = PRECOND_MODE_SHAMPOO, .blocks = 4, .workers = 2, .last_step = 99};
  jobs[1] = (precond_job_stats){.job = "we\"ird\\job\n", .mode = PRECOND_MODE_KFAC};
  s.njobs = 2;
  s.job_stats = jobs;
  blocks[0] = (precond_block_stats){.job = "resnet",
                                    .block_id = 3,
                                    .tensor = "conv1.w",
                                    .rows = 64,
                                    .cols = 576,
                                    .version = 5,
                                    .stat_step = 99,
                                    .root_step = 97,
                                    .staleness = 2,
                                    .roots_computed = 5,
                                    .last_error = 3.5e-7,
                                    .last_compute_ms = 0.75,
                                    .roots_skipped = 4,
                                    .roots_warm = 6,
                                    .roots_warm_skipped = 1,
                                    .roots_seeded = 2,
                                    .roots_cold = 1,
                                    .staleness_dist = {.samples = 9, .p50 = 2, .p90 = 4, .max = 6}};
  blocks[1] = (precond_block_stats){
      .job = "resnet", .block_id = 4, .tensor = "fc.w", .rows = 10, .cols = 128};
  s.nblocks = 2;
  s.block_stats = blocks;
  return s;
}

static void test_stats_table(void **state) {
  (void)state;
  precond_stats s = sample();
  sink k;
  sink_open(&k);
  assert_int_equal(precond__format_stats(k.f, &s, 0), 0);
  char *out = sink_close(&k);
  assert_non_null(strstr(out, "precondd 0.1.0"));
  assert_non_null(strstr(out, "12345678901 computed, 2 failed, 7 skipped (drift < 0.01)"));
  assert_non_null(strstr(out, "p50 1  p90 3  p99 9  max 12  mean 1.50  (40 samples)"));
  assert_non_null(strstr(out, "in 3.0 MiB"));
  assert_non_null(strstr(out, "memory               1.0 KiB"));
  assert_non_null(strstr(out, "resnet"));
  assert_non_null(strstr(out, "shampoo"));
  assert_non_null(strstr(out, "kfac"));
  free(out);

  s.njobs = 0;
  sink_open(&k);
  assert_int_equal(precond__format_stats(k.f, &s, 0), 0);
  out = sink_close(&k);
  assert_non_null(strstr(out, "(no jobs)"));
  free(out);
}

static void test_stats_json(void **state) {
  (void)state;
  precond_stats s = sample();
  sink k;
  sink_open(&k);
  assert_int_equal(precond__format_stats(k.f, &s, 1), 0);
  char *out = sink_close(&k);
  assert_int_equal(out[0], '{');
  assert_non_null(strstr(out, "\"version\":\"0.1.0\""));
  assert_non_null(strstr(out, "\"roots_computed\":12345678901,"));
  assert_non_null(strstr(out, "\"uptime_s\":12.5,"));
  assert_non_null(strstr(out, "\"compute_ms_p50\":1.25,"));
  assert_non_null(strstr(out, "\"roots_skipped\":7,\"drift_threshold\":0.01,"));
  assert_non_null(strstr(out,
                         "\"staleness\":{\"samples\":40,\"p50\":1,\"p90\":3,"
                         "\"p99\":9,\"max\":12,\"mean\":1.5}"));
  assert_non_null(strstr(out, "\"job\":\"resnet\",\"mode\":\"shampoo\",\"blocks\":4"));
  /* quote, backslash and newline escaped */
  assert_non_null(strstr(out, "\"job\":\"we\\\"ird\\\\job\\n\""));
  assert_string_equal(out + strlen(out) - 3, "]}\n");
  free(out);
}

/* precond__format_stats of s into a string (caller frees). */
static char *stats_out(const precond_stats *s, int json) {
  sink k;
  sink_open(&k);
  assert_int_equal(precond__format_stats(k.f, s, json), 0);
  return sink_close(&k);
}

/* A rank of daemon replicas: what crossed ranks and each job's load per rank, in the table
 * (shares of the job's cost) and in JSON (the costs); a daemon alone shows neither. */
static void test_stats_replicas(void **state) {
  (void)state;
  precond_stats s = sample();
  char *out = stats_out(&s, 0);
  assert_null(strstr(out, "LOAD PER RANK"));
  free(out);
  out = stats_out(&s, 1);
  assert_null(strstr(out, "\"replica\""));
  assert_null(strstr(out, "rank_load"));
  free(out);

  double load[2] = {3000, 1000};
  s.replicas = 2;
  s.rank = 1;
  s.replica = (precond_replica_stats){5, 6, 7, 8, 0, 0};
  jobs[0].nrank_load = 2;
  jobs[0].rank_load = load;
  out = stats_out(&s, 0);
  assert_non_null(strstr(out, "rank 1 of 2 replicas"));
  assert_non_null(strstr(out,
                         "rank 1 of 2: roots 5 sent, 6 received; statistics 7 forwarded, "
                         "8 received; 0 MPI errors\n"));
  assert_non_null(strstr(out, "resnet                   0: 75.0% 1: 25.0%\n"));
  free(out);
  out = stats_out(&s, 1);
  assert_non_null(strstr(out,
                         "\"replica\":{\"roots_sent\":5,\"roots_received\":6,"
                         "\"stats_forwarded\":7,\"stats_received\":8,\"mpi_errors\":0,"
                         "\"alone\":false}"));
  assert_non_null(strstr(out, "\"last_step\":99,\"rank_load\":[3000,1000]}"));
  free(out);
  jobs[0].nrank_load = 0;
  jobs[0].rank_load = NULL;
}

static void test_blocks_table_and_json(void **state) {
  (void)state;
  precond_stats s = sample();
  sink k;
  sink_open(&k);
  assert_int_equal(precond__format_blocks(k.f, &s, 0), 0);
  char *out = sink_close(&k);
  assert_non_null(strstr(out, "STALE"));
  assert_non_null(strstr(out, "conv1.w"));
  assert_non_null(strstr(out, "64x576"));
  assert_non_null(strstr(out, "3.50e-07"));
  assert_non_null(strstr(out, "     4          2/4/6"));
  assert_non_null(strstr(out, "WARM/SKIP/SEED/COLD"));
  assert_non_null(strstr(out, " 6/1/2/1\n"));
  free(out);

  sink_open(&k);
  assert_int_equal(precond__format_blocks(k.f, &s, 1), 0);
  out = sink_close(&k);
  assert_non_null(strstr(out, "{\"blocks\":[{\"job\":\"resnet\",\"block_id\":3,"));
  assert_non_null(strstr(out, "\"staleness\":2,"));
  assert_non_null(strstr(out, "\"roots_skipped\":4,"));
  assert_non_null(strstr(out,
                         "\"roots_warm\":6,\"roots_warm_skipped\":1,\"roots_seeded\":2,"
                         "\"roots_cold\":1"));
  assert_non_null(strstr(out, "\"staleness_dist\":{\"samples\":9,\"p50\":2,\"p90\":4,"));
  assert_non_null(strstr(out, "\"last_error\":3.4999999999999998e-07,"));
  assert_non_null(strstr(out, "},{\"job\":\"resnet\",\"block_id\":4,"));
  free(out);

  s.nblocks = 0;
  sink_open(&k);
  assert_int_equal(precond__format_blocks(k.f, &s, 1), 0);
  out = sink_close(&k);
  assert_string_equal(out, "{\"blocks\":[]}\n");
  free(out);
}

static void test_health(void **state) {
  (void)state;
  sink k;
  sink_open(&k);
  assert_int_equal(precond__format_health(k.f, "unix:/tmp/x", "SERVING", 0), 0);
  char *out = sink_close(&k);
  assert_string_equal(out, "unix:/tmp/x: SERVING\n");
  free(out);
  sink_open(&k);
  assert_int_equal(precond__format_health(k.f, "127.0.0.1:1", "NOT_SERVING", 1), 0);
  out = sink_close(&k);
  assert_string_equal(out, "{\"addr\":\"127.0.0.1:1\",\"status\":\"NOT_SERVING\"}\n");
  free(out);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stats_table),    cmocka_unit_test(test_stats_json),
      cmocka_unit_test(test_stats_replicas), cmocka_unit_test(test_blocks_table_and_json),
      cmocka_unit_test(test_health),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
