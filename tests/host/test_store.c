/* test_store.c -- unit tests of host/store.c: options, job layout and ids, registration
 * rules, memory accounting, statistics updates (the bytes path and pushes read in place,
 * kept and refused) and root publication. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "precondd.h"
#include "preconditioner.h"

/* A store of limit bytes (100 blocks a job) over fresh stats, both to be destroyed. */
static void store_open(pd_stats *stats, pd_store *st, size_t limit) {
  assert_int_equal(pd_stats_init(stats), PD_OK);
  assert_int_equal(pd_store_init(st, stats, limit, 100), PD_OK);
}

static void test_options(void **state) {
  (void)state;
  char err[256];
  pd_shampoo_opts o = {0};
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_OK);
  assert_int_equal(o.block_size, 128);
  assert_int_equal(o.skip_limit, 4096);
  assert_true(o.beta2 == 1.0f);
  assert_int_equal(o.root_exponent, 4);
  assert_true(o.epsilon == 1e-6);
  pd_shampoo_opts in = {0};
  in.beta2 = 1.5f;
  o = in;
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_EINVAL);
  assert_non_null(strstr(err, "beta2"));
  in.beta2 = NAN;
  o = in;
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_EINVAL);
  in.beta2 = 0.9f;
  in.block_size = 100000;
  o = in;
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_EINVAL);
  assert_non_null(strstr(err, "block_size"));
  in.block_size = 0;
  in.method = 7;
  o = in;
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_EINVAL);
  in.method = PC_METHOD_EIGH;
  in.epsilon = -1;
  o = in;
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_EINVAL);
  assert_non_null(strstr(err, "epsilon"));
}

static pd_job *build(const char *name, uint64_t (*dims)[2], const int *ranks, size_t n,
                     uint32_t block_size, uint32_t max_blocks, int *rc, char *err) {
  pd_shampoo_opts o = {0};
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, 256), PD_OK);
  o.block_size = block_size;
  pd_tensor t[8];
  static char names[8][24];
  for (size_t i = 0; i < n; i++) {
    snprintf(names[i], sizeof names[i], "t%zu", i);
    t[i].name = names[i];
    t[i].rank = ranks[i];
    t[i].dims = dims[i];
  }
  pd_job *job = NULL;
  *rc = pd_job_build(name, &pd_mode_shampoo, &o, n, t, max_blocks, &job, err, 256);
  return job;
}

static void test_layout_ids(void **state) {
  (void)state;
  char err[256];
  int rc;
  /* [4,4] -> 1 block; [3] -> diagonal; [8,4] -> 2 blocks (rows 4+4). */
  uint64_t dims[3][2] = {{4, 4}, {3, 0}, {8, 4}};
  int ranks[3] = {2, 1, 2};
  pd_job *job = build("j", dims, ranks, 3, 4, 100, &rc, err);
  assert_int_equal(rc, PD_OK);
  assert_int_equal(job->nblocks, 3);
  assert_int_equal(job->ndiag, 1);
  assert_int_equal(job->diag[0], 1);
  for (uint32_t i = 0; i < 3; i++) assert_int_equal(job->blocks[i].id, i);
  assert_int_equal(job->blocks[0].tensor, 0);
  assert_int_equal(job->blocks[1].tensor, 2);
  assert_int_equal(job->blocks[2].tensor, 2);
  assert_int_equal(job->blocks[2].row0, 4);
  /* Statistics and a root pair per block, plus the job's own records. */
  assert_true(pd_job_bytes(job) > 3 * 2 * 2 * pc_packed_len(4) * sizeof(float));

  /* Same tensors: same; another block size: not. */
  pd_job *same = build("j", dims, ranks, 3, 4, 100, &rc, err);
  pd_job *other = build("j", dims, ranks, 3, 2, 100, &rc, err);
  assert_true(pd_job_same(job, same));
  assert_false(pd_job_same(job, other));
  pd_job_free(same, NULL);
  pd_job_free(other, NULL);

  /* Limits and bad shapes. */
  assert_null(build("j", dims, ranks, 3, 4, 2, &rc, err));
  assert_int_equal(rc, PD_ELIMIT);
  uint64_t zero[1][2] = {{4, 0}};
  int r2[1] = {2};
  assert_null(build("j", zero, r2, 1, 4, 100, &rc, err));
  assert_int_equal(rc, PD_EINVAL);
  assert_non_null(strstr(err, "tensors[0].shape"));
  assert_null(build("", dims, ranks, 3, 4, 100, &rc, err));
  assert_int_equal(rc, PD_EINVAL);
  pd_job_free(job, NULL);

  /* An absurd block count is refused before any layout is allocated. */
  pd_shampoo_opts o = {0};
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_OK);
  o.block_size = 1;
  o.skip_limit = UINT32_MAX;
  uint64_t huge[2] = {(uint64_t)1 << 24, (uint64_t)1 << 24};
  pd_tensor t = {(char *)"w", 2, huge};
  pd_job *out = NULL;
  assert_int_equal(pd_job_build("j", &pd_mode_shampoo, &o, 1, &t, 65536, &out, err, sizeof err),
                   PD_ELIMIT);
  assert_null(out);
  assert_non_null(strstr(err, "blocks"));
}

static void test_store_add_and_memory(void **state) {
  (void)state;
  pd_stats stats;
  pd_store st;
  char err[256];
  int rc;
  assert_int_equal(pd_stats_init(&stats), PD_OK);
  uint64_t dims[1][2] = {{8, 8}};
  int ranks[1] = {2};
  pd_job *job = build("a", dims, ranks, 1, 8, 100, &rc, err);
  /* Its reservation, and room to compute its largest block (the pool's scratch). */
  size_t need = pd_job_bytes(job) + job->scratch_max;
  assert_int_equal(job->scratch_max, pd_unit_scratch_bytes(&job->blocks[0], 0));
  assert_true(job->scratch_max >= 80 * 8 * 8);
  /* A limit one byte short refuses the job and leaves it to the caller. */
  assert_int_equal(pd_store_init(&st, &stats, need - 1, 100), PD_OK);
  pd_job *existing = NULL;
  assert_int_equal(pd_store_add(&st, job, &existing), PD_ELIMIT);
  assert_int_equal(st.njobs, 0);
  pd_store_destroy(&st);

  assert_int_equal(pd_store_init(&st, &stats, need, 100), PD_OK);
  assert_int_equal(pd_store_add(&st, job, &existing), PD_OK);
  assert_null(existing);
  pd_job *got = pd_store_get(&st, "a", 0);
  assert_ptr_equal(got, job);
  pd_job_unref(got, &stats);
  assert_null(pd_store_get(&st, "b", 0));
  /* Held now: the records and the statistics; the root pair reserved is not allocated. */
  assert_int_equal(atomic_load(&stats.memory_bytes),
                   pd_job_bytes(job) - 2 * pc_packed_len(8) * sizeof(float));
  assert_int_equal(atomic_load(&st.reserved), pd_job_bytes(job));
  assert_int_equal(atomic_load(&st.scratch_max), job->scratch_max);
  pd_job *again = build("a", dims, ranks, 1, 8, 100, &rc, err);
  assert_int_equal(pd_store_add(&st, again, &existing), PD_OK);
  assert_ptr_equal(existing, job);
  pd_job_unref(existing, &stats);
  pd_job_free(again, &stats);

  /* Workers are counted once per name. */
  pd_job_note_worker(job, "w1");
  pd_job_note_worker(job, "w1");
  pd_job_note_worker(job, "w2");
  pd_job_note_worker(job, "");
  assert_int_equal(job->nworkers, 2);

  /* Roots: publication numbers versions, and a reader's reference outlives the swap. */
  pd_block *b = &job->blocks[0];
  pd_root *r1 = pd_root_new(2, (const uint64_t[]){8, 8}, &stats);
  r1->source_step = 3;
  pd_block_publish(b, r1, &stats);
  pd_root *held = pd_block_root(b);
  assert_ptr_equal(held, r1);
  assert_int_equal(held->version, 1);
  pd_root *r2 = pd_root_new(2, (const uint64_t[]){8, 8}, &stats);
  r2->source_step = 4;
  pd_block_publish(b, r2, &stats);
  assert_int_equal(r2->version, 2);
  assert_int_equal(atomic_load(&b->root_step), 4);
  assert_int_equal(held->version, 1); /* still readable */
  pd_root_unref(held, &stats);

  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
}

/* The names of ended jobs: remembered under the removal's lock, bounded (the oldest are
 * forgotten), refused by a Register unless it reuses the name, and listed for snapshots. */
static void test_ended_names(void **state) {
  (void)state;
  pd_stats stats;
  pd_store st;
  char err[256];
  int rc;
  uint64_t dims[1][2] = {{4, 4}};
  int ranks[1] = {2};
  store_open(&stats, &st, (size_t)64 << 20);
  st.ended_max = 2;
  const char *names[3] = {"a", "b", "c"};
  pd_job *existing = NULL;
  for (int i = 0; i < 3; i++) {
    pd_job *j = build(names[i], dims, ranks, 1, 4, 100, &rc, err);
    assert_int_equal(pd_store_add(&st, j, &existing), PD_OK);
  }
  pd_job_unref(pd_store_remove(&st, "a", 0, 0), &stats);
  pd_job_unref(pd_store_remove(&st, "b", 0, 0), &stats);
  /* c idle for 10 s at a time 100 s after its last activity: an expiry. */
  pd_job *cj = pd_store_get(&st, "c", 0);
  atomic_store(&cj->last_active, 0.0);
  pd_job_unref(cj, &stats);
  pd_job_unref(pd_store_remove(&st, NULL, 10, 100), &stats);
  assert_int_equal(st.njobs, 0);
  /* Two remembered: a, the oldest, is forgotten. */
  pd_ended_job e = {0};
  assert_int_equal(pd_store_ended(&st, "a", &e), 0);
  assert_int_equal(pd_store_ended(&st, "b", &e), 1);
  assert_int_equal(e.how, PD_ENDED_BY_CALL);
  assert_true(e.ended_at > 1700000000); /* unix time, not a monotonic clock */
  assert_int_equal(pd_store_ended(&st, "c", &e), 1);
  assert_int_equal(e.how, PD_ENDED_IDLE);
  size_t n = 0;
  pd_ended_job *list = pd_store_list_ended(&st, &n, NULL, NULL);
  assert_int_equal(n, 2);
  assert_string_equal(list[0].name, "b"); /* oldest first */
  assert_string_equal(list[1].name, "c");
  pd_ended_free(list, n);

  pd_job *b = build("b", dims, ranks, 1, 4, 100, &rc, err);
  assert_int_equal(pd_store_register(&st, b, 0, &existing, &e), PD_EENDED);
  assert_int_equal(e.how, PD_ENDED_BY_CALL);
  assert_int_equal(st.njobs, 0);
  assert_int_equal(pd_store_register(&st, b, 1, &existing, NULL), PD_OK); /* reused */
  assert_null(existing);
  assert_int_equal(pd_store_ended(&st, "b", NULL), 0);
  pd_job *a = build("a", dims, ranks, 1, 4, 100, &rc, err);
  assert_int_equal(pd_store_register(&st, a, 0, &existing, NULL), PD_OK); /* forgotten */
  /* A restore or a replica's copy (pd_store_add) always takes the name. */
  pd_job *c = build("c", dims, ranks, 1, 4, 100, &rc, err);
  assert_int_equal(pd_store_add(&st, c, &existing), PD_OK);
  assert_int_equal(pd_store_ended(&st, "c", NULL), 0);
  assert_int_equal(st.nended, 0);
  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
}

static void test_block_update(void **state) {
  (void)state;
  pd_stats stats;
  pd_store st;
  char err[256];
  int rc;
  store_open(&stats, &st, (size_t)1 << 30);
  uint64_t dims[1][2] = {{3, 2}};
  int ranks[1] = {2};
  pd_job *job = build("a", dims, ranks, 1, 8, 100, &rc, err);
  ((pd_shampoo_opts *)(void *)job->opts)->beta2 = 0.5f;
  pd_job *existing;
  assert_int_equal(pd_store_add(&st, job, &existing), PD_OK);
  pd_block *b = &job->blocks[0];
  float l[6] = {1, 2, 3, 4, 5, 6}, r[3] = {2, 4, 8};
  pd_block_update(b, (const float *[]){l, r}, 7, &stats);
  pd_block_update(b, (const float *[]){l, r}, 5,
                  &stats); /* an older step does not move stat_step back */
  /* EMA from zero, twice: 0.5 * (0.5 * x) + 0.5 * x = 0.75 x */
  for (int i = 0; i < 6; i++) assert_true(b->stat[0][i] == 0.75f * l[i]);
  for (int i = 0; i < 3; i++) assert_true(b->stat[1][i] == 0.75f * r[i]);
  assert_int_equal(atomic_load(&b->stat_step), 7);
  assert_int_equal(b->pushes, 2);
  assert_int_equal(b->stale.count, 0); /* no root yet: nothing to be stale */

  /* With a root of step 7: a push of step 9 is one sample of 2, a repeated step 9 none. */
  pd_root *root = pd_root_new(b->nparts, b->order, &stats);
  root->source_step = 7;
  pd_block_publish(b, root, &stats);
  pd_block_update(b, (const float *[]){l, r}, 9, &stats);
  pd_block_update(b, (const float *[]){l, r}, 9, &stats);
  pd_block_update(b, (const float *[]){l, r}, 12, &stats);
  assert_int_equal(b->stale.count, 2);
  pd_stale_summary sum;
  pd_stale_hist_summary(&b->stale, &sum);
  assert_true(sum.p50 == 2 && sum.p99 == 5 && sum.mean == 3.5);
  assert_int_equal(sum.max, 5);
  pd_stats_staleness(&stats, &sum);
  assert_int_equal(sum.count, 2);
  assert_int_equal(sum.max, 5);
  pd_store_destroy(&st);
  pd_stats_destroy(&stats);
}

/* intact for pd_job_push_into: what ctx says. */
static int intact_as(void *ctx) {
  return *(const int *)ctx;
}

/* A job of one 40 x 23 block (orders 40 and 23: 820 and 276 floats, tails of 4) at beta2,
 * added to st. */
static pd_job *add_40x23(pd_store *st, const char *name, float beta2) {
  char err[256];
  int rc;
  uint64_t dims[1][2] = {{40, 23}};
  int ranks[1] = {2};
  pd_job *job = build(name, dims, ranks, 1, 64, 100, &rc, err), *existing;
  assert_non_null(job);
  ((pd_shampoo_opts *)(void *)job->opts)->beta2 = beta2;
  assert_int_equal(pd_store_add(st, job, &existing), PD_OK);
  return job;
}

/* pd_job_push_into against pd_block_update on a twin job (the bytes path): kept pushes give
 * the same statistics bit for bit, whether folded into the spares or in place (aligned
 * buffers on a CPU with AVX-512F: the block's statistic then stays where it is); a push
 * refused for a NaN or for its memory changing leaves every statistic as it was, bit for
 * bit, and the next push goes on from there. */
static void test_push_into(void **state) {
  (void)state;
  pd_stats stats;
  pd_store st;
  int rc;
  store_open(&stats, &st, (size_t)1 << 30);
  pd_job *job = add_40x23(&st, "p", 0.9f), *twin = add_40x23(&st, "q", 0.9f);
  pd_block *b = &job->blocks[0], *t = &twin->blocks[0];
  size_t len[2] = {pc_packed_len(b->order[0]), pc_packed_len(b->order[1])};
  float *inc[2], *bad = malloc(len[1] * sizeof *bad);
  assert_non_null(bad);
  for (int k = 0; k < 2; k++) {
    inc[k] = malloc(len[k] * sizeof(float));
    assert_non_null(inc[k]);
  }
  int kept_in_place = 0;
  for (int push = 0; push < 6; push++) {
    for (int k = 0; k < 2; k++)
      for (size_t i = 0; i < len[k]; i++)
        inc[k][i] = (float)((i * 7919 + (size_t)push * 31 + (size_t)k) % 1000) * 1.3e-3f;
    float *out[PD_MAX_PARTS] = {NULL};
    for (int k = 0; k < 2; k++) {
      out[k] = aligned_alloc(64, (len[k] * sizeof(float) + 63) / 64 * 64);
      assert_non_null(out[k]);
    }
    float *where = b->stat[0];
    int intact = push != 3; /* push 3: the client's memory changed meanwhile */
    memcpy(bad, inc[1], len[1] * sizeof *bad);
    if (push == 4) bad[len[1] - 1] = NAN; /* push 4: a NaN in the last value */
    const float *in[PD_MAX_PARTS] = {inc[0], bad};
    pd_push_refusal no;
    rc = pd_job_push_into(job, 1, &b, in, out, (uint64_t)push + 1, &stats, intact_as, &intact, &no);
    if (push == 3 || push == 4) {
      assert_int_equal(rc, PD_EINVAL);
      assert_int_equal(no.why, push == 3 ? PD_FOLD_CHANGED : PD_FOLD_NONFINITE);
    } else {
      assert_int_equal(rc, PD_OK);
      kept_in_place += b->stat[0] == where;
      pd_block_update(t, (const float *const *)inc, (uint64_t)push + 1, &stats);
    }
    for (int k = 0; k < 2; k++) {
      assert_memory_equal(b->stat[k], t->stat[k], len[k] * sizeof(float));
      free(out[k]); /* the caller's either way: a spare or the statistic it replaced */
    }
    assert_int_equal(b->pushes, t->pushes);
  }
#if defined(__GNUC__) && defined(__x86_64__)
  /* From the second kept push on the statistic lies in an aligned buffer (at the latest). */
  if (__builtin_cpu_supports("avx512f")) assert_true(kept_in_place >= 2);
#endif
  for (int k = 0; k < 2; k++) free(inc[k]);
  free(bad);
  pd_store_destroy(&st);
  pd_stats_destroy(&stats);
}

/* pd_job_push_vouched, at beta2 (an EMA, or 1: sums), against pd_block_update on a twin
 * job: the first push (no statistic known bounded yet) takes the fold with the spare; from
 * then on the fold in place with no spare (out[] untouched) keeps the same bits. A false
 * vouch (a NaN, a value of 1e38 >= 2^125) is refused torn: the statistic keeps its old
 * values in those places only, every other value folded, all finite; a change of the
 * memory during such a fold is refused torn, folded as read. A third job is untouched. A
 * statistic not known bounded goes back to the fold with the spare: a NaN then leaves
 * nothing behind. */
static void push_vouched_at(float beta2) {
  pd_stats stats;
  pd_store st;
  int rc;
  store_open(&stats, &st, (size_t)1 << 30);
  pd_job *jobs[3] = {add_40x23(&st, "p", beta2), add_40x23(&st, "q", beta2),
                     add_40x23(&st, "other", beta2)};
  pd_block *b = &jobs[0]->blocks[0], *t = &jobs[1]->blocks[0], *o = &jobs[2]->blocks[0];
  size_t len[2] = {pc_packed_len(b->order[0]), pc_packed_len(b->order[1])};
  float *inc[2], *old[2], *other[2];
  for (int k = 0; k < 2; k++) {
    inc[k] = malloc(len[k] * sizeof(float));
    old[k] = malloc(len[k] * sizeof(float));
    other[k] = malloc(len[k] * sizeof(float));
    assert_true(inc[k] && old[k] && other[k]);
    for (size_t i = 0; i < len[k]; i++) inc[k][i] = (float)(i % 17) * 0.25f;
  }
  pd_block_update(o, (const float *const *)inc, 1, &stats);
  for (int k = 0; k < 2; k++) memcpy(other[k], o->stat[k], len[k] * sizeof(float));
  uint64_t kept = 0;
  for (int push = 0; push < 7; push++) {
    for (int k = 0; k < 2; k++)
      for (size_t i = 0; i < len[k]; i++)
        inc[k][i] = (float)((i * 7919 + (size_t)push * 31 + (size_t)k) % 1000) * 1.3e-3f;
    if (push == 3) { /* a false vouch */
      inc[0][5] = NAN;
      inc[1][len[1] - 1] = 1e38f;
    }
    if (push == 6) { /* not known bounded: the fold with the spare */
      b->stat_bounded[1] = 0;
      inc[1][len[1] - 1] = NAN;
    }
    float *out[PD_MAX_PARTS] = {NULL}, *spare[PD_MAX_PARTS] = {NULL};
    for (int k = 0; k < 2; k++) {
      out[k] = spare[k] = aligned_alloc(64, (len[k] * sizeof(float) + 63) / 64 * 64);
      assert_non_null(out[k]);
      memcpy(old[k], b->stat[k], len[k] * sizeof(float));
    }
    int intact = push != 4; /* push 4: the memory changed meanwhile */
    pd_push_refusal no;
    rc = pd_job_push_vouched(jobs[0], 1, &b, (const float *const *)inc, out, (uint64_t)push + 1,
                             &stats, intact_as, &intact, &no);
    if (push >= 1 && push <= 5) /* the fold in place, nothing kept */
      for (int k = 0; k < 2; k++) assert_ptr_equal(out[k], spare[k]);
    if (push == 3) {
      assert_int_equal(rc, PD_EINVAL);
      assert_true(no.torn && no.why == PD_FOLD_VOUCH && no.block == 0 && no.part == 0);
      /* what is expected: the fold where the value was within the vouch, else the old */
      const float w = beta2 == 1 ? 1 : 1 - beta2;
      for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < len[k]; i++) {
          float x = inc[k][i], y = beta2 == 1 ? old[k][i] + x : beta2 * old[k][i] + w * x;
          float want = (k == 0 && i == 5) || (k == 1 && i == len[k] - 1) ? old[k][i] : y;
          assert_memory_equal(&b->stat[k][i], &want, sizeof want);
          assert_true(isfinite(b->stat[k][i]));
        }
      for (int k = 0; k < 2; k++) memcpy(t->stat[k], b->stat[k], len[k] * sizeof(float));
    } else if (push == 4) {
      assert_int_equal(rc, PD_EINVAL);
      assert_true(no.torn && no.why == PD_FOLD_CHANGED);
      pd_block_update(t, (const float *const *)inc, (uint64_t)push + 1, &stats); /* as read */
    } else if (push == 6) {
      assert_int_equal(rc, PD_EINVAL);
      assert_true(!no.torn && no.why == PD_FOLD_NONFINITE);
      for (int k = 0; k < 2; k++) assert_memory_equal(b->stat[k], old[k], len[k] * sizeof(float));
    } else {
      assert_int_equal(rc, PD_OK);
      kept++;
      pd_block_update(t, (const float *const *)inc, (uint64_t)push + 1, &stats);
    }
    for (int k = 0; k < 2; k++) {
      assert_memory_equal(b->stat[k], t->stat[k], len[k] * sizeof(float));
      free(out[k]);
    }
    assert_int_equal(b->pushes, kept);
    if (push < 6) assert_true(b->stat_bounded[0] && b->stat_bounded[1]);
  }
  for (int k = 0; k < 2; k++) {
    assert_memory_equal(o->stat[k], other[k], len[k] * sizeof(float));
    free(inc[k]);
    free(old[k]);
    free(other[k]);
  }
  pd_store_destroy(&st);
  pd_stats_destroy(&stats);
}

static void test_push_vouched(void **state) {
  (void)state;
  push_vouched_at(0.9f);
  push_vouched_at(1.0f);
}

int main(void) {
  pd_log_set_level(PD_LOG_ERROR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_options),
      cmocka_unit_test(test_layout_ids),
      cmocka_unit_test(test_store_add_and_memory),
      cmocka_unit_test(test_block_update),
      cmocka_unit_test(test_push_into),
      cmocka_unit_test(test_push_vouched),
      cmocka_unit_test(test_ended_names),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
