/*
 * fuzz_service.c -- libFuzzer harness: every request handler of precondd through
 * pd_service_handle, against a store that holds a job with statistics and published roots.
 * Input: one byte choosing the method (modulo PD_M_COUNT), then the request bytes as gRPC
 * would hand them over. The store is rebuilt whenever inputs have registered more jobs, so
 * a long run measures the handlers, not the growth of a store nobody cleans.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

#include "precondd.h"
#include "preconditioner.h"
#include "rpc.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static pd_daemon *g_d;

/* Registers job "j" (one 12 x 18 tensor in 6 x 6 blocks, one rank-1 tensor), pushes a
 * positive definite statistic to every block and computes its roots on this thread. */
static void fixture_fill(pd_daemon *d) {
  pd_shampoo_opts o = {0};
  char err[256];
  if (pd_mode_shampoo.resolve(&o, err, sizeof err) != PD_OK) abort();
  o.block_size = 6;
  uint64_t w[2] = {12, 18}, bias[1] = {18};
  pd_tensor t[2] = {{(char *)"w", 2, w}, {(char *)"b", 1, bias}};
  pd_job *job = NULL, *existing = NULL;
  if (pd_job_build("j", &pd_mode_shampoo, &o, 2, t, d->cfg.max_blocks_per_job, &job, err,
                   sizeof err) != PD_OK ||
      pd_store_add(&d->store, job, &existing) != PD_OK)
    abort();
  for (size_t i = 0; i < job->nblocks; i++) {
    pd_block *b = &job->blocks[i];
    size_t ll = pc_packed_len(b->rows), lr = pc_packed_len(b->cols);
    float *l = calloc(ll, sizeof *l), *r = calloc(lr, sizeof *r);
    for (size_t k = 0, p = 0; k < b->rows; p += b->rows - k, k++) l[p] = 1.0f + (float)k;
    for (size_t k = 0, p = 0; k < b->cols; p += b->cols - k, k++) r[p] = 2.0f + (float)k;
    pd_block_update(b, (const float *[]){l, r}, 5, &d->stats);
    pd_root_outcome out;
    pd_sched_compute(b, &d->stats, &d->sched.rules, &out);
    free(l);
    free(r);
  }
}

static pd_daemon *fixture_new(void) {
  pd_daemon *d = calloc(1, sizeof *d);
  pd_config_default(&d->cfg);
  d->cfg.threads = 1;
  d->cfg.memory_limit_bytes = (size_t)64 << 20;
  d->cfg.max_message_bytes = (size_t)4 << 20;
  d->cfg.max_blocks_per_job = 4096;
  pd_sched_rules rules = {d->cfg.failure_threshold, 0, &d->store, d->cfg.warm_roots, 0};
  if (pd_stats_init(&d->stats) != PD_OK ||
      pd_store_init(&d->store, &d->stats, d->cfg.memory_limit_bytes, d->cfg.max_blocks_per_job) !=
          PD_OK ||
      pd_sched_start(&d->sched, 1, &d->stats, &rules) != PD_OK)
    abort();
  d->store.ended_max = d->cfg.ended_jobs; /* as main.c: EndJob and Register meet the names */
  fixture_fill(d);
  return d;
}

static void fixture_free(pd_daemon *d) {
  pd_sched_stop(&d->sched);
  pd_store_destroy(&d->store);
  pd_stats_destroy(&d->stats);
  free(d);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  pd_log_set_level(PD_LOG_ERROR);
  g_d = fixture_new();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  pd_method m = (pd_method)(data[0] % PD_M_COUNT);
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)data + 1, size - 1);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  pd_reply rep;
  pd_service_handle(g_d, m, bb, &rep);
  grpc_byte_buffer_destroy(bb);
  /* The contract: a payload exactly on OK, and a message on every error. */
  if ((rep.code == GRPC_STATUS_OK) != (rep.payload != NULL)) abort();
  if (rep.code != GRPC_STATUS_OK && rep.message[0] == '\0') abort();
  if (rep.payload) grpc_byte_buffer_destroy(rep.payload);
  /* Fresh fixture when registers piled up jobs, or an EndJob took the fixture's job. */
  if (g_d->store.njobs > 8 || g_d->store.njobs == 0) {
    fixture_free(g_d);
    g_d = fixture_new();
  }
  return 0;
}
