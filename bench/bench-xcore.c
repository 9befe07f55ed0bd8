/*
 * bench-xcore.c -- how a same-host push's bytes cross cores fastest on this machine (issue 13
 * P2; docs/precondd.md, "Session 11"). CSV on stdout.
 *
 * A producer thread pinned to one core writes a push's bytes (default 4,198,400: the two
 * packed fp32 factors of a 1024 block) from its own buffer into a region, as a worker writes
 * its slot; a consumer thread pinned to another core then reads them, as precondd's fold
 * does (reads the slot and its statistic, writes the spare, swaps them), or sums them; turn
 * by turn through a condition variable, as the doorbell hands a push over. Variants:
 *   producer  memcpy (plain stores: glibc's copy of a few MB does not stream here),
 *             nt512 / nt256 (non-temporal _mm512_stream_ps / _mm256_stream_ps, then sfence:
 *             the lines go to memory, the consumer reads them from there instead of
 *             snooping the producer's caches), clwb / clflushopt (a plain copy in 64 KiB
 *             pieces, each piece's lines written back / flushed after it), mix (the
 *             first 512 KiB plain, the rest non-temporal);
 *   consumer  fold (the daemon's pass until session 12: into the spare), fold-pf (with software
 *             prefetch 2 KiB ahead), sum, keep (the daemon's pass since session 13: in place,
 *             the old values streamed to the spare);
 *   region    shm (a file in /dev/shm, mapped shared: what precondd's regions are), anon
 *             (private anonymous memory with 4 KiB pages), thp (the same with
 *             MADV_HUGEPAGE, 2 MiB pages where the kernel gives them);
 *   cores     "0,1" across two cores, or "0,0" both on one core (the reference).
 * Each round runs every variant once, in order (so the machine's load moves them alike), and
 * a one-core memcpy of the same bytes (the denominator of issue 13's target). Per variant:
 * the median over rounds of the CPU time of each side's pass per hand-off (the thread's own
 * clock around its write or read: the neighbours' load does not count), MB per CPU second of
 * the two passes, its ratio to the round's memcpy, the wall clock of the whole exchange, and
 * the median over rounds of the ratio to the first variant of the same round (the plain
 * memcpy + fold across cores: today's push). The first pass into a fresh region (page faults
 * included) is a row of its own: shm against shm with MAP_POPULATE.
 *
 * Consumers added in session 14 (the fold without the spare's stream, each with the daemon's
 * test per value): copy (the slot tested and copied into the spare by plain stores, then
 * folded from there in place: an overwrite of the slot after the copy cannot reach the
 * statistic, so nothing needs undoing), check (a test pass over the slot, then keep), inplace
 * (the fold in place with no old values kept: the bound, not undoable), keep-pf (keep with
 * software prefetch of the slot --prefetch bytes ahead, 1024 by default), fold-nt (the fold
 * into the spare by streaming stores, then swapped: three streams, nothing to undo),
 * keep-plain (keep with the old values stored plainly, so they stay cached).
 *
 * --overlap (session 17) measures the posted push instead: push k folded while push k + 1
 * is written, libprecond's write (rpc_shm_write_vouched) against the daemon's vouched fold
 * called through its mode table, each variant also turn by turn in the same round (below,
 * "--overlap: ...").
 *
 *   bench-xcore [--bytes B] [--reps N (hand-offs per cell, 40)] [--rounds R (9)]
 *               [--cores P,C (0,1)] [--consumers C1,C2,... (only the first variant and the
 *               nt512 rows of these consumers)] [--prefetch B]
 *   bench-xcore --overlap [--order N (1024)] [--places P (2)] [--each] [--one-source]
 *               [--reps N] [--rounds R]
 *               [--cores P,C] [--consumers V1,V2,... (these variants only, e.g.
 *               streamed+daemon,plain+daemon: the first is the base of vs_first)]
 *               [--prefetch B (the pf folds' distance, 1024)]
 */
#define _GNU_SOURCE /* pthread_setaffinity_np, CPU_SET, MAP_POPULATE */
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "precondd.h"       /* the daemon's fold (--overlap: pd_mode.fold_vouched) */
#include "preconditioner.h" /* pc_packed_len */
#include "rpc.h"            /* libprecond's write into a slot (rpc_shm_write_vouched) */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define XC_X86 1
#else
#define XC_X86 0
#endif

enum { P_MEMCPY, P_NT512, P_NT256, P_CLWB, P_CLFLUSHOPT, P_MIX };
enum {
  C_FOLD,
  C_FOLD_PF,
  C_SUM,
  C_KEEP,
  C_COPY,
  C_CHECK,
  C_INPLACE,
  C_KEEP_PF,
  C_FOLD_NT,
  C_KEEP_PLAIN
};
enum { R_SHM, R_ANON, R_THP };

static const char *const prod_name[] = {"memcpy", "nt512", "nt256", "clwb", "clflushopt", "mix"};
static const char *const cons_name[] = {"fold",  "fold-pf", "sum",     "keep",    "copy",
                                        "check", "inplace", "keep-pf", "fold-nt", "keep-plain"};
static const char *const region_name[] = {"shm", "anon", "thp"};

typedef struct {
  int prod, cons, region, same_core;
} variant;

/* The first is today's push (the ratios' base). */
static const variant variants[] = {
    {P_MEMCPY, C_FOLD, R_SHM, 0},     {P_NT512, C_FOLD, R_SHM, 0},
    {P_NT256, C_FOLD, R_SHM, 0},      {P_CLWB, C_FOLD, R_SHM, 0},
    {P_CLFLUSHOPT, C_FOLD, R_SHM, 0}, {P_MEMCPY, C_FOLD_PF, R_SHM, 0},
    {P_NT512, C_FOLD_PF, R_SHM, 0},   {P_MEMCPY, C_SUM, R_SHM, 0},
    {P_NT512, C_SUM, R_SHM, 0},       {P_MEMCPY, C_FOLD, R_ANON, 0},
    {P_MEMCPY, C_FOLD, R_THP, 0},     {P_NT512, C_FOLD, R_THP, 0},
    {P_MEMCPY, C_FOLD, R_SHM, 1},     {P_NT512, C_FOLD, R_SHM, 1},
    {P_MIX, C_FOLD, R_SHM, 0},        {P_MIX, C_FOLD, R_SHM, 1},
    {P_NT512, C_KEEP, R_SHM, 0},      {P_NT512, C_KEEP, R_SHM, 1},
    {P_NT512, C_COPY, R_SHM, 0},      {P_NT512, C_COPY, R_SHM, 1},
    {P_NT512, C_CHECK, R_SHM, 0},     {P_NT512, C_INPLACE, R_SHM, 0},
    {P_NT512, C_KEEP_PF, R_SHM, 0},   {P_NT512, C_FOLD_NT, R_SHM, 0},
    {P_NT512, C_FOLD_NT, R_SHM, 1},   {P_NT512, C_KEEP_PLAIN, R_SHM, 0},
};
enum { NV = sizeof variants / sizeof variants[0] };

static double thread_cpu_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- the passes ---- */

#if XC_X86
/* Streaming copy of n bytes (dst 64-byte aligned, n a multiple of 64; the caller copies any
 * rest plainly), then sfence so the stores are visible before the hand-off. */
__attribute__((target("avx512f"))) static void copy_nt512(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n / sizeof(float); i += 16)
    _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
  _mm_sfence();
}

__attribute__((target("avx"))) static void copy_nt256(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n / sizeof(float); i += 8)
    _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
  _mm_sfence();
}

/* A plain copy in 64 KiB pieces, each piece's lines then written back (wb: clwb, the lines
 * stay cached) or flushed (clflushopt), and sfence. */
__attribute__((target("clwb,clflushopt"))) static void copy_flush(unsigned char *dst,
                                                                  const unsigned char *src,
                                                                  size_t n, int wb) {
  enum { PIECE = 64 << 10 };
  for (size_t done = 0; done < n; done += PIECE) {
    size_t k = n - done < PIECE ? n - done : PIECE;
    memcpy(dst + done, src + done, k);
    for (size_t l = 0; l < k; l += 64) {
      if (wb)
        _mm_clwb(dst + done + l);
      else
        _mm_clflushopt(dst + done + l);
    }
  }
  _mm_sfence();
}

/* The daemon's fold as its AVX2 clone runs it (o = b s + w x, no FMA), with prefetch of the
 * slot pf bytes ahead when pf > 0. */
__attribute__((target("avx2"))) static void fold(size_t n, const float *s, const float *x, float *o,
                                                 size_t pf) {
  const __m256 b = _mm256_set1_ps(0.999f), w = _mm256_set1_ps(0.001f);
  for (size_t i = 0; i < n; i += 8) {
    if (pf && i % 16 == 0) _mm_prefetch((const char *)(x + i) + pf, _MM_HINT_T0);
    __m256 y = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(s + i)),
                             _mm256_mul_ps(w, _mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(o + i, y);
  }
}

/* The daemon's test per value, ORed over a pass (rpc_f32_big: the exponent's bits plus a
 * carry into bit 31 from 2^126 up, NaN and Inf included); the result is the OR's bit 31. */
#define XC_BIG(acc, v)       \
  acc = _mm512_or_si512(acc, \
                        _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(v), expo), carry))
#define XC_TEST_SETUP                                                                        \
  const __m512i expo = _mm512_set1_epi32(0x7f800000), carry = _mm512_set1_epi32(0x01800000); \
  __m512i big = _mm512_setzero_si512()
#define XC_TEST_RESULT ((uint32_t)_mm512_reduce_or_epi32(big) >> 31)

/* The daemon's fold since session 13 (host/mode_shampoo.c, shampoo_fold_keep): in place into
 * the statistic s, its old values streamed to the spare o (both 64-byte aligned), so that a
 * refused push can swap them back; no read for ownership of o's lines. With the daemon's test
 * per value (the exponent's bits plus a carry, ORed: rpc_f32_big) and, when pf > 0, software
 * prefetch of the slot pf bytes ahead; plain (keep-plain) stores the old values plainly
 * instead (o's lines read for ownership, but kept in this core's caches for the next push).
 * Returns the OR's bit 31. */
__attribute__((target("avx512f"))) static uint32_t keep(size_t n, float *s, const float *x,
                                                        float *o, size_t pf, int plain) {
  const __m512 b = _mm512_set1_ps(0.999f), w = _mm512_set1_ps(0.001f);
  XC_TEST_SETUP;
  for (size_t i = 0; i < n; i += 16) {
    if (pf) _mm_prefetch((const char *)(x + i) + pf, _MM_HINT_T0);
    __m512 sv = _mm512_load_ps(s + i);
    if (plain)
      _mm512_store_ps(o + i, sv);
    else
      _mm512_stream_ps(o + i, sv);
    __m512 y = _mm512_add_ps(_mm512_mul_ps(b, sv), _mm512_mul_ps(w, _mm512_loadu_ps(x + i)));
    XC_BIG(big, y);
    _mm512_store_ps(s + i, y);
  }
  _mm_sfence();
  return XC_TEST_RESULT;
}

/* The fold into o: by streaming stores when nt (fold-nt: no read for ownership of o's lines;
 * the caller swaps statistic and spare, as a kept push does, and a refused one just does not
 * swap: nothing to undo; three streams where keep has four), else plainly (o == s: inplace,
 * no old values kept: the bound of any form without a spare, not undoable, so not a form the
 * daemon may use alone). Returns the test's bit 31. */
__attribute__((target("avx512f"))) static uint32_t fold_to(size_t n, const float *s, const float *x,
                                                           float *o, int nt) {
  const __m512 b = _mm512_set1_ps(0.999f), w = _mm512_set1_ps(0.001f);
  XC_TEST_SETUP;
  for (size_t i = 0; i < n; i += 16) {
    __m512 y = _mm512_add_ps(_mm512_mul_ps(b, _mm512_load_ps(s + i)),
                             _mm512_mul_ps(w, _mm512_loadu_ps(x + i)));
    XC_BIG(big, y);
    if (nt)
      _mm512_stream_ps(o + i, y);
    else
      _mm512_store_ps(o + i, y);
  }
  if (nt) _mm_sfence();
  return XC_TEST_RESULT;
}

/* The slot's values tested (rpc_f32_big) and, when o is not NULL, copied to o by plain
 * stores (o stays in this core's caches). Returns the test's bit 31. */
__attribute__((target("avx512f"))) static uint32_t check(size_t n, const float *x, float *o) {
  XC_TEST_SETUP;
  for (size_t i = 0; i < n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    XC_BIG(big, v);
    if (o) _mm512_store_ps(o + i, v);
  }
  return XC_TEST_RESULT;
}

__attribute__((target("avx2"))) static float sum(size_t n, const float *x) {
  __m256 a = _mm256_setzero_ps(), c = _mm256_setzero_ps();
  for (size_t i = 0; i < n; i += 16) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(x + i));
    c = _mm256_add_ps(c, _mm256_loadu_ps(x + i + 8));
  }
  float v[8];
  _mm256_storeu_ps(v, _mm256_add_ps(a, c));
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}
#else
static void fold(size_t n, const float *s, const float *x, float *o, size_t pf) {
  (void)pf;
  for (size_t i = 0; i < n; i++) o[i] = 0.999f * s[i] + 0.001f * x[i];
}

static uint32_t keep(size_t n, float *s, const float *x, float *o, size_t pf, int plain) {
  (void)pf;
  (void)plain;
  for (size_t i = 0; i < n; i++) {
    o[i] = s[i];
    s[i] = 0.999f * s[i] + 0.001f * x[i];
  }
  return 0;
}

static uint32_t fold_to(size_t n, const float *s, const float *x, float *o, int nt) {
  (void)nt;
  for (size_t i = 0; i < n; i++) o[i] = 0.999f * s[i] + 0.001f * x[i];
  return 0;
}

static uint32_t check(size_t n, const float *x, float *o) {
  if (o) memcpy(o, x, n * sizeof *x);
  return 0;
}

static float sum(size_t n, const float *x) {
  float a = 0;
  for (size_t i = 0; i < n; i++) a += x[i];
  return a;
}
#endif

static int have(int prod) {
#if XC_X86
  switch (prod) {
    case P_NT512:
    case P_MIX:
      return __builtin_cpu_supports("avx512f");
    case P_NT256:
      return __builtin_cpu_supports("avx");
    default:
      return 1; /* clwb/clflushopt: /proc/cpuinfo is checked in main */
  }
#else
  return prod == P_MEMCPY;
#endif
}

static void produce(int prod, unsigned char *dst, const unsigned char *src, size_t n) {
#if XC_X86
  size_t body = n / 64 * 64;
  switch (prod) {
    case P_NT512:
      copy_nt512((float *)(void *)dst, (const float *)(const void *)src, body);
      break;
    case P_NT256:
      copy_nt256((float *)(void *)dst, (const float *)(const void *)src, body);
      break;
    case P_MIX: /* the first 512 KiB plain (they may stay in a core's L2), the rest streamed */
      if (body > (512u << 10)) {
        memcpy(dst, src, 512u << 10);
        copy_nt512((float *)(void *)(dst + (512u << 10)),
                   (const float *)(const void *)(src + (512u << 10)), body - (512u << 10));
      } else {
        memcpy(dst, src, body);
      }
      break;
    case P_CLWB:
      copy_flush(dst, src, n, 1);
      return;
    case P_CLFLUSHOPT:
      copy_flush(dst, src, n, 0);
      return;
    default:
      memcpy(dst, src, n);
      return;
  }
  memcpy(dst + body, src + body, n - body);
#else
  (void)prod;
  memcpy(dst, src, n);
#endif
}

/* ---- one cell: reps hand-offs between two pinned threads ---- */

/* keep-pf's prefetch distance in bytes (--prefetch). */
static size_t keep_pf_bytes = 1024;

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int turn; /* 0: the producer's, 1: the consumer's */
  const variant *v;
  unsigned char *src, *slot; /* the producer's bytes; the region's slot */
  float *stat, *spare;       /* the consumer's statistic and spare */
  size_t bytes, reps;
  int core[2];
  double work[2]; /* CPU seconds of each side's passes */
  volatile float sink;
} cell;

static void pin(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *side(cell *c, int me) {
  pin(c->core[me]);
  double work = 0;
  size_t nf = c->bytes / sizeof(float);
  for (size_t r = 0; r < c->reps; r++) {
    pthread_mutex_lock(&c->mu);
    while (c->turn != me) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    double t0 = thread_cpu_s();
    const float *x = (const float *)(const void *)c->slot;
    const size_t m = nf / 16 * 16; /* the 16-wide passes' length */
    if (me == 0) {
      produce(c->v->prod, c->slot, c->src, c->bytes);
      c->src[(r * 4096) % c->bytes]++; /* a different statistic each push */
    } else if (c->v->cons == C_SUM) {
      c->sink = sum(nf / 16 * 16, (const float *)(const void *)c->slot);
    } else if (c->v->cons == C_KEEP || c->v->cons == C_KEEP_PF || c->v->cons == C_KEEP_PLAIN) {
      c->sink = (float)keep(m, c->stat, x, c->spare, c->v->cons == C_KEEP_PF ? keep_pf_bytes : 0,
                            c->v->cons == C_KEEP_PLAIN);
    } else if (c->v->cons == C_CHECK) {
      /* a test pass over the slot (it brings the slot into this core's caches), then keep */
      c->sink = (float)(check(m, x, NULL) | keep(m, c->stat, x, c->spare, 0, 0));
    } else if (c->v->cons == C_COPY) {
      /* the slot tested and copied into the spare (the daemon's own memory: an overwrite
       * after this cannot reach the fold), then folded from there in place, no old values
       * kept */
      c->sink = (float)(check(m, x, c->spare) | fold_to(m, c->stat, c->spare, c->stat, 0));
    } else if (c->v->cons == C_INPLACE) {
      c->sink = (float)fold_to(m, c->stat, x, c->stat, 0);
    } else if (c->v->cons == C_FOLD_NT) {
      c->sink = (float)fold_to(m, c->stat, x, c->spare, 1);
      float *t = c->stat;
      c->stat = c->spare;
      c->spare = t;
    } else {
      fold(nf / 8 * 8, c->stat, (const float *)(const void *)c->slot, c->spare,
           c->v->cons == C_FOLD_PF ? 2048 : 0);
      float *t = c->stat;
      c->stat = c->spare;
      c->spare = t;
    }
    if (r > 0) work += thread_cpu_s() - t0; /* the first hand-off warms the pages up */
    pthread_mutex_lock(&c->mu);
    c->turn = !me;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
  }
  c->work[me] = work;
  return NULL;
}

static void *consumer_main(void *arg) {
  return side(arg, 1);
}

static void *producer_main(void *arg) {
  return side(arg, 0);
}

/* A region of bytes (rounded up to 2 MiB) of the given kind; NULL on failure. */
static unsigned char *region_map(int kind, size_t bytes, int populate) {
  size_t len = (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  void *p = MAP_FAILED;
  if (kind == R_SHM) {
    char path[] = "/dev/shm/bench-xcore-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return NULL;
    unlink(path);
    if (ftruncate(fd, (off_t)len) == 0)
      p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd,
               0);
    close(fd);
  } else {
    /* 2 MiB aligned, so that the huge-page variant can have whole huge pages. */
    unsigned char *q =
        mmap(NULL, len + (2u << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (q == MAP_FAILED) return NULL;
    unsigned char *a =
        (unsigned char *)(((uintptr_t)q + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1));
    madvise(a, len, kind == R_THP ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    p = a;
  }
  return p == MAP_FAILED ? NULL : p;
}

/* Starts the consumer, then the producer, on arg (whose lock and condition mu and cv are
 * made and destroyed here) and joins them; then cpu[2] from work[2] (each side's CPU
 * seconds over reps counted hand-offs) and *wall (seconds per hand-off, the uncounted first
 * included). Returns 0, or -1 when a thread could not be had (give_up(arg) lets a consumer
 * already started run out). */
static int run_pair(void *(*consumer)(void *), void *(*producer)(void *), void *arg,
                    void (*give_up)(void *), pthread_mutex_t *mu, pthread_cond_t *cv,
                    const double work[2], size_t reps, double cpu[2], double *wall) {
  pthread_mutex_init(mu, NULL);
  pthread_cond_init(cv, NULL);
  double t0 = now_s();
  pthread_t t[2];
  int rc = -1;
  if (pthread_create(&t[1], NULL, consumer, arg) == 0) {
    if (pthread_create(&t[0], NULL, producer, arg) == 0) {
      pthread_join(t[0], NULL);
      rc = 0;
    } else {
      give_up(arg);
    }
    pthread_join(t[1], NULL);
  }
  *wall = (now_s() - t0) / (double)(reps + 1);
  cpu[0] = work[0] / (double)reps;
  cpu[1] = work[1] / (double)reps;
  pthread_cond_destroy(cv);
  pthread_mutex_destroy(mu);
  return rc;
}

/* Lets the consumer run its turns out with nothing to read. */
static void cell_give_up(void *arg) {
  ((cell *)arg)->reps = 0;
}

/* One cell; returns 0 and fills cpu[2] (seconds per hand-off of each side's pass) and
 * *wall (seconds per hand-off), -1 if threads cannot be had. */
static int run_cell(const variant *v, unsigned char *slot, unsigned char *src, float *stat,
                    float *spare, size_t bytes, size_t reps, const int core[2], double cpu[2],
                    double *wall) {
  cell c = {.v = v,
            .src = src,
            .slot = slot,
            .stat = stat,
            .spare = spare,
            .bytes = bytes,
            .reps = reps + 1};
  c.core[0] = core[0];
  c.core[1] = v->same_core ? core[0] : core[1];
  return run_pair(consumer_main, producer_main, &c, cell_give_up, &c.mu, &c.cv, c.work, reps, cpu,
                  wall);
}

/* One-core memcpy of bytes, CPU seconds per copy, the median of 9 timed copies. */
static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *a, size_t n) {
  qsort(a, n, sizeof *a, cmp_double);
  return n % 2 ? a[n / 2] : 0.5 * (a[n / 2 - 1] + a[n / 2]);
}

/* The median of n (at most 99) values, a left as it is. */
static double median_of(const double *a, size_t n) {
  double t[99];
  memcpy(t, a, n * sizeof *a);
  return median(t, n);
}

static double memcpy_cpu_s(unsigned char *d, unsigned char *s, size_t bytes) {
  double t[9];
  memcpy(d, s, bytes);
  for (int i = 0; i < 9; i++) {
    double t0 = thread_cpu_s();
    memcpy(d, s, bytes);
    t[i] = thread_cpu_s() - t0;
    s[i * 64] ^= d[bytes - 1 - (size_t)i];
  }
  return median(t, 9);
}

/* The first pass into a fresh region (page faults included), CPU seconds. */
static double first_pass_s(int populate, const unsigned char *src, size_t bytes) {
  unsigned char *r = region_map(R_SHM, bytes, populate);
  if (r == NULL) return 0.0;
  double t0 = thread_cpu_s();
  memcpy(r, src, bytes);
  double t = thread_cpu_s() - t0;
  munmap(r, (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20));
  return t;
}

static int cpu_has(const char *flag) {
  FILE *f = fopen("/proc/cpuinfo", "r");
  char line[8192];
  int found = 0;
  if (f == NULL) return 0;
  while (!found && fgets(line, sizeof line, f))
    if (strncmp(line, "flags", 5) == 0) {
      char pat[64];
      snprintf(pat, sizeof pat, " %s", flag);
      char *p = strstr(line, pat);
      found = p && (p[strlen(pat)] == ' ' || p[strlen(pat)] == '\n');
    }
  fclose(f);
  return found;
}

/* 1 when name is one of the comma-separated names in list. */
static int listed(const char *list, const char *name) {
  size_t n = strlen(name);
  for (const char *p = list; *p;) {
    const char *e = strchr(p, ',');
    size_t k = e ? (size_t)(e - p) : strlen(p);
    if (k == n && strncmp(p, name, n) == 0) return 1;
    if (!e) break;
    p = e + 1;
  }
  return 0;
}

/* ---- --overlap: push k folded while push k + 1 is written (session 17) ----
 *
 * The posted doorbell's pattern: the producer writes push k + 1 into the other place of a
 * ring of --places places (2) while the consumer folds push k from its place, at most two
 * pushes in flight; next to it, in the same round, the same variant turn by turn (one place,
 * each push folded before the next is written: the awaited push). The producer writes as
 * libprecond's precond_push_copy does (rpc_shm_write_vouched per part: plain, or streamed),
 * or as a variant to try (plain-rev: plain stores from the end back, so that the fold's
 * first lines are the freshest; movsb: the vouch's test per 16 KiB piece, then rep movsb);
 * the consumer folds as precondd's doorbell thread does a vouched push into a bounded
 * statistic (daemon: the Shampoo mode's pd_mode.fold_vouched, called through the mode
 * table: the daemon's own code), or a variant of that loop kept here to try: its direction
 * (rev: both parts backwards, the last part first; alt: forwards and backwards in turn, so
 * that a pass starts on the statistic's lines the last one wrote, still in this core's L2),
 * software prefetch of the slot --prefetch bytes ahead (pf: into every level; nta: with the
 * non-temporal hint, so that the slot's lines do not push the statistic's out of L2). A
 * staggered cell's producer starts push k + 1 only once the consumer finished push k's
 * first part. The block is n x n (--order, 1024): two packed parts of n(n+1)/2 floats each,
 * the producer's source the same size. What was found: docs/precondd.md, "Session 17: the
 * overlapped fold". */

enum { OW_PLAIN, OW_STREAM, OW_PLAIN_REV, OW_MOVSB };
enum { OF_DAEMON, OF_REV, OF_ALT, OF_PF, OF_ALT_PF, OF_NTA, OF_ALT_NTA };
static const char *const ow_name[] = {"plain", "streamed", "plain-rev", "movsb"};
static const char *const of_name[] = {"daemon", "rev", "alt", "pf", "alt-pf", "nta", "alt-nta"};

typedef struct {
  int write, fold, stagger;
} ovariant;

/* The first is today's posted push as the write-mode chooser leaves it most of the time. */
static const ovariant ovariants[] = {
    {OW_STREAM, OF_DAEMON, 0}, {OW_PLAIN, OF_DAEMON, 0}, {OW_STREAM, OF_REV, 0},
    {OW_PLAIN, OF_REV, 0},     {OW_STREAM, OF_ALT, 0},   {OW_PLAIN, OF_ALT, 0},
    {OW_STREAM, OF_PF, 0},     {OW_PLAIN, OF_PF, 0},     {OW_STREAM, OF_ALT_PF, 0},
    {OW_STREAM, OF_DAEMON, 1}, {OW_PLAIN, OF_DAEMON, 1}, {OW_PLAIN_REV, OF_DAEMON, 0},
    {OW_PLAIN_REV, OF_REV, 0}, {OW_STREAM, OF_NTA, 0},   {OW_STREAM, OF_ALT_NTA, 0},
    {OW_PLAIN, OF_ALT_NTA, 0}, {OW_MOVSB, OF_DAEMON, 0}, {OW_MOVSB, OF_REV, 0},
};
enum { NOV = sizeof ovariants / sizeof ovariants[0] };

/* A variant's name, e.g. "streamed+daemon" or "plain+daemon+stagger". */
static void ov_name(const ovariant *v, char *buf, size_t len) {
  snprintf(buf, len, "%s+%s%s", ow_name[v->write], of_name[v->fold], v->stagger ? "+stagger" : "");
}

/* --one-source: both parts written from the first part's source, as bench-daemon's push-lib
 * row writes its slot (one 2.1 MB buffer twice for a 1024 block: it stays in the writer's
 * L2, where two distinct parts' 4.2 MB do not). */
static int ov_one_source;

/* The slot's prefetch distance of the pf folds, bytes (--prefetch). */
static size_t ov_pf_bytes = 1024;

/* shampoo_vouched_part's loop (host/mode_shampoo.c: the same operations, so the same values),
 * backwards when rev. Returns the OR of rpc_f32_big over the values left in s; *outside gets
 * bit 31 when some x was outside the vouch. */
static uint32_t ov_vouched_c(size_t len, float *s, const float *x, float beta2, int rev,
                             uint32_t *outside) {
  uint32_t big = 0, out = 0;
  const float w = 1 - beta2;
  for (size_t n = 0; n < len; n++) {
    size_t i = rev ? len - 1 - n : n;
    uint32_t o = rpc_f32_unvouched(x[i]);
    float y = beta2 * s[i] + w * x[i];
    float v = o & 0x80000000u ? s[i] : y;
    out |= o;
    big |= rpc_f32_big(v);
    s[i] = v;
  }
  *outside |= out;
  return big;
}

#if XC_X86
/* shampoo_vouched_512's loop, backwards when rev, with prefetch of the slot pf bytes ahead
 * in its direction when pf > 0; len a multiple of 16 (main checks). */
__attribute__((target("avx512f"))) static uint32_t ov_vouched_512(size_t len, float *s,
                                                                  const float *x, float beta2,
                                                                  int rev, size_t pf, int nta,
                                                                  uint32_t *outside) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), carry = _mm512_set1_epi32(0x01800000);
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), lim = _mm512_set1_epi32(0x7e000000);
  const __m512 b = _mm512_set1_ps(beta2), w = _mm512_set1_ps(1 - beta2);
  __m512i big = _mm512_setzero_si512();
  __mmask16 out = 0;
  const ptrdiff_t step = rev ? -16 : 16, ahead = rev ? -(ptrdiff_t)pf : (ptrdiff_t)pf;
  for (size_t n = 0, i = rev ? len - 16 : 0; n < len; n += 16, i += (size_t)step) {
    if (pf && nta)
      _mm_prefetch((const char *)(x + i) + ahead, _MM_HINT_NTA);
    else if (pf)
      _mm_prefetch((const char *)(x + i) + ahead, _MM_HINT_T0);
    __m512 sv = _mm512_loadu_ps(s + i), xv = _mm512_loadu_ps(x + i);
    __mmask16 ok = _mm512_cmplt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(xv), absm), lim);
    __m512 y = _mm512_add_ps(_mm512_mul_ps(b, sv), _mm512_mul_ps(w, xv));
    y = _mm512_mask_blend_ps(ok, sv, y);
    out |= (__mmask16)~ok;
    big = _mm512_or_si512(big,
                          _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(y), expo), carry));
    _mm512_mask_storeu_ps(s + i, ok, y);
  }
  if (out) *outside |= 0x80000000u;
  return (uint32_t)_mm512_reduce_or_epi32(big);
}

/* A plain copy with the vouch's test (rpc_shm_write_vouched's plain pass), 64 bytes at a
 * time from the end back (count a multiple of 16). Returns 1 when every value is vouched. */
__attribute__((target("avx512f"))) static int ov_write_rev_512(float *d, const float *s,
                                                               size_t count) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), carry = _mm512_set1_epi32(0x02000000);
  __m512i out = _mm512_setzero_si512();
  for (size_t i = count; i >= 16; i -= 16) {
    __m512i v = _mm512_loadu_si512((const void *)(s + i - 16));
    out = _mm512_or_si512(out, _mm512_add_epi32(_mm512_and_si512(v, expo), carry));
    _mm512_storeu_si512((void *)(d + i - 16), v);
  }
  return !((uint32_t)_mm512_reduce_or_epi32(out) & 0x80000000u);
}
#endif

#if XC_X86
/* The movsb write: per 16 KiB piece the vouch's test (the piece then in L1), then the
 * piece copied by rep movsb (whose large copies may write whole lines without reading
 * them first, yet leave them cached). Returns 1 when every value is vouched. */
__attribute__((target("avx512f"))) static int ov_write_movsb_512(float *d, const float *s,
                                                                 size_t count) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), carry = _mm512_set1_epi32(0x02000000);
  __m512i out = _mm512_setzero_si512();
  enum { PIECE = 4096 }; /* floats */
  for (size_t at = 0; at < count; at += PIECE) {
    size_t k = count - at < PIECE ? count - at : PIECE;
    for (size_t i = 0; i + 16 <= k; i += 16) {
      __m512i v = _mm512_loadu_si512((const void *)(s + at + i));
      out = _mm512_or_si512(out, _mm512_add_epi32(_mm512_and_si512(v, expo), carry));
    }
    void *dst = d + at;
    const void *src = s + at;
    size_t n = k * sizeof(float);
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
  }
  return !((uint32_t)_mm512_reduce_or_epi32(out) & 0x80000000u);
}
#endif

static int ov_write_movsb(float *d, const float *s, size_t count) {
#if XC_X86
  if (__builtin_cpu_supports("avx512f")) return ov_write_movsb_512(d, s, count);
#endif
  return rpc_shm_write_vouched(d, s, count, 0);
}

/* The fold of a variant (the 512-bit loop where the CPU has it; prefetch only there). */
static uint32_t ov_vouched(size_t len, float *s, const float *x, float beta2, int rev, size_t pf,
                           int nta, uint32_t *outside) {
#if XC_X86
  if (__builtin_cpu_supports("avx512f"))
    return ov_vouched_512(len, s, x, beta2, rev, pf, nta, outside);
#endif
  (void)pf;
  (void)nta;
  return ov_vouched_c(len, s, x, beta2, rev, outside);
}

/* The plain-rev write (where the CPU has no AVX-512: the plain write forwards). */
static int ov_write_rev(float *d, const float *s, size_t count) {
#if XC_X86
  if (__builtin_cpu_supports("avx512f")) return ov_write_rev_512(d, s, count);
#endif
  return rpc_shm_write_vouched(d, s, count, 0);
}

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  const ovariant *v;
  int overlap; /* 0: turn by turn, one place; 1: --places places, two pushes in flight */
  size_t places, reps, part;
  const float *src; /* the worker's statistic: two parts of part floats */
  float *ring;      /* places x 2 parts */
  float *stat[2];   /* the daemon's statistic */
  const pd_mode *mode;
  pd_shampoo_opts opts;
  pd_block block;
  size_t written, folded, halves; /* pushes written, folded, half folded (the first part) */
  int core[2];
  double work[2];
  int bad; /* a write not vouched, or a fold torn: the cell's figures are not the push's */
} ocell;

static void ov_wait(ocell *c, const size_t *count, size_t want) {
  pthread_mutex_lock(&c->mu);
  while (*count < want) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
}

static void ov_bump(ocell *c, size_t *count) {
  pthread_mutex_lock(&c->mu);
  (*count)++;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void *ov_producer(void *arg) {
  ocell *c = arg;
  pin(c->core[0]);
  double work = 0;
  for (size_t k = 0; k < c->reps; k++) {
    /* The place is free once the push before it there is folded; turn by turn, once the
     * last push is; staggered, once the last push's first part is too. */
    size_t window = c->overlap ? 2 : 1;
    if (k >= window) ov_wait(c, &c->folded, k + 1 - window);
    if (c->overlap && c->v->stagger && k >= 1) ov_wait(c, &c->halves, k);
    float *dst = c->ring + (k % c->places) * 2 * c->part;
    double t0 = thread_cpu_s();
    int good = 1;
    for (int p = 0; p < 2; p++) {
      const float *from = c->src + (ov_one_source ? 0 : p * c->part);
      if (c->v->write == OW_PLAIN_REV)
        good &= ov_write_rev(dst + p * c->part, from, c->part);
      else if (c->v->write == OW_MOVSB)
        good &= ov_write_movsb(dst + p * c->part, from, c->part);
      else
        good &= rpc_shm_write_vouched(dst + p * c->part, from, c->part, c->v->write == OW_STREAM);
    }
    if (k > 0) work += thread_cpu_s() - t0; /* the first push warms the pages up */
    if (!good) c->bad = 1;
    ov_bump(c, &c->written);
  }
  c->work[0] = work;
  return NULL;
}

static void *ov_consumer(void *arg) {
  ocell *c = arg;
  pin(c->core[1]);
  double work = 0;
  for (size_t k = 0; k < c->reps; k++) {
    ov_wait(c, &c->written, k + 1);
    const float *x = c->ring + (k % c->places) * 2 * c->part;
    double t0 = thread_cpu_s();
    if (c->v->fold == OF_DAEMON) {
      /* The daemon's fold, each part, then the stagger's signal (the mode's function folds
       * both parts: called per part through a one-part block, as it loops over them). */
      for (int p = 0; p < 2; p++) {
        uint8_t bounded[PD_MAX_PARTS];
        uint32_t part = 0;
        float *st[1] = {c->stat[p]};
        const float *in[1] = {x + p * c->part};
        if (c->mode->fold_vouched(&c->opts, &c->block, st, in, bounded, &part) || !bounded[0])
          c->bad = 1;
        if (p == 0) ov_bump(c, &c->halves);
      }
    } else {
      int f = c->v->fold, nta = f == OF_NTA || f == OF_ALT_NTA;
      int rev = f == OF_REV || ((f == OF_ALT || f == OF_ALT_PF || f == OF_ALT_NTA) && k % 2);
      size_t pf = f == OF_PF || f == OF_ALT_PF || nta ? ov_pf_bytes : 0;
      uint32_t outside = 0;
      for (int q = 0; q < 2; q++) {
        int p = rev ? 1 - q : q;
        if (ov_vouched(c->part, c->stat[p], x + p * c->part, c->opts.beta2, rev, pf, nta,
                       &outside) &
            0x80000000u)
          c->bad = 1;
        if (q == 0) ov_bump(c, &c->halves);
      }
      if (outside) c->bad = 1;
    }
    if (k > 0) work += thread_cpu_s() - t0;
    ov_bump(c, &c->folded);
  }
  c->work[1] = work;
  return NULL;
}

/* Lets the consumer run out with nothing written. */
static void ov_give_up(void *arg) {
  ocell *c = arg;
  pthread_mutex_lock(&c->mu);
  c->written = c->reps;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/* One cell of reps pushes (and one more, uncounted, first); fills cpu[2] (seconds per push
 * of each side) and *wall. Returns -1 without threads, 1 when a write or fold went outside
 * the vouch (the data's fault: a bug here). */
static int ov_cell(const ovariant *v, int overlap, size_t places, size_t reps, size_t part,
                   const float *src, float *ring, float *const stat[2], const int core[2],
                   double cpu[2], double *wall) {
  ocell c = {.v = v,
             .overlap = overlap,
             .places = overlap ? places : 1,
             .reps = reps + 1,
             .part = part,
             .src = src,
             .ring = ring,
             .stat = {stat[0], stat[1]},
             .core = {core[0], core[1]},
             .mode = pd_mode_find(PD_MODE_SHAMPOO),
             .opts = {.beta2 = 0.999f}};
  c.block.nparts = 1;
  c.block.order[0] = 0;
  while (pc_packed_len(c.block.order[0] + 1) <= part) c.block.order[0]++;
  if (c.mode == NULL || c.mode->fold_vouched == NULL || pc_packed_len(c.block.order[0]) != part)
    return -1;
  int rc =
      run_pair(ov_consumer, ov_producer, &c, ov_give_up, &c.mu, &c.cv, c.work, reps, cpu, wall);
  return rc == 0 && c.bad ? 1 : rc;
}

/* --overlap's table: every variant turn by turn and overlapped, alternated in each round. */
static int ov_main(size_t order, size_t places, size_t reps, size_t rounds, const int core[2],
                   int each, const char *only) {
  size_t part = pc_packed_len(order), bytes = 2 * part * sizeof(float);
  size_t ring_bytes = places * bytes;
  float *src = aligned_alloc(64, bytes), *stat = aligned_alloc(64, bytes);
  unsigned char *dst = malloc(bytes), *ring = region_map(R_SHM, ring_bytes, 0);
  double *cpu[2] = {calloc(2 * NOV * rounds, sizeof(double)),
                    calloc(2 * NOV * rounds, sizeof(double))};
  double *wall = calloc(2 * NOV * rounds, sizeof(double)), *mc = calloc(rounds, sizeof(double));
  if (!src || !stat || !dst || !ring || !cpu[0] || !cpu[1] || !wall || !mc) {
    fprintf(stderr, "bench-xcore: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < 2 * part; i++) {
    src[i] = (float)(i % 1000) * 1e-3f;
    stat[i] = 1.0f;
  }
  float *const st[2] = {stat, stat + part};
  int ok[NOV], first = -1;
  for (int k = 0; k < NOV; k++) {
    char name[64];
    ov_name(&ovariants[k], name, sizeof name);
    ok[k] = only == NULL || listed(only, name);
    if (ok[k] && first < 0) first = k;
  }
  if (first < 0) {
    fprintf(stderr, "bench-xcore: --consumers names none of the --overlap variants\n");
    return 2;
  }
  for (size_t r = 0; r < rounds; r++) {
    pin(core[0]);
    mc[r] = memcpy_cpu_s(dst, (unsigned char *)src, bytes);
    for (int k = 0; k < NOV; k++)
      for (int o = 0; o < 2 && ok[k]; o++) {
        double c2[2], w;
        int rc = ov_cell(&ovariants[k], o, places, reps, part, src, (float *)(void *)ring, st, core,
                         c2, &w);
        if (rc != 0) {
          fprintf(stderr, "bench-xcore: %s\n", rc < 0 ? "no threads or no fold" : "a fold torn");
          return 1;
        }
        size_t at = (2 * (size_t)k + (size_t)o) * rounds + r;
        if (each) {
          char name[64];
          ov_name(&ovariants[k], name, sizeof name);
          fprintf(stderr, "round %zu,%s/%s,%.1f,%.1f\n", r, name, o ? "overlap" : "turn",
                  1e6 * c2[0], 1e6 * c2[1]);
        }
        cpu[0][at] = c2[0];
        cpu[1][at] = c2[1];
        wall[at] = w;
      }
  }
  double mb = (double)bytes / 1e6, mc_med = median_of(mc, rounds);
  printf(
      "variant,write,fold,stagger,pattern,places,rounds,bytes,producer_us,consumer_us,"
      "pair_us,pair_us_min,pair_us_max,mb_per_cpu_s,of_memcpy,wall_mb_s,vs_first\n");
  printf("memcpy,-,-,-,-,-,%zu,%zu,%.1f,0.0,%.1f,0,0,%.1f,1.0000,0.0,0.0000\n", rounds, bytes,
         1e6 * mc_med, 1e6 * mc_med, mb / mc_med);
  for (int o = 1; o >= 0; o--) /* the overlapped rows first: the posted push's */
    for (int k = 0; k < NOV; k++) {
      if (!ok[k]) continue;
      const ovariant *v = &ovariants[k];
      double p[99], q[99], pr[99], ratio[99], wl[99], vs[99];
      for (size_t r = 0; r < rounds; r++) {
        size_t at = (2 * (size_t)k + (size_t)o) * rounds + r,
               base = (2 * (size_t)first + (size_t)o) * rounds + r;
        p[r] = cpu[0][at];
        q[r] = cpu[1][at];
        pr[r] = p[r] + q[r];
        ratio[r] = pr[r] > 0 ? mc[r] / pr[r] : 0.0;
        wl[r] = wall[at];
        double f = cpu[0][base] + cpu[1][base];
        vs[r] = pr[r] > 0 ? f / pr[r] : 0.0;
      }
      double pair = median(pr, rounds);
      char name[96];
      ov_name(v, name, sizeof name - 8);
      strcat(name, o ? "/overlap" : "/turn");
      printf("%s,%s,%s,%d,%s,%zu,%zu,%zu,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.4f,%.1f,%.4f\n", name,
             ow_name[v->write], of_name[v->fold], v->stagger, o ? "overlap" : "turn",
             o ? places : 1, rounds, bytes, 1e6 * median(p, rounds), 1e6 * median(q, rounds),
             1e6 * pair, 1e6 * pr[0], 1e6 * pr[rounds - 1], mb / pair, median(ratio, rounds),
             mb / median(wl, rounds), median(vs, rounds));
    }
  return 0;
}

int main(int argc, char **argv) {
  size_t bytes = 2 * 524800 * sizeof(float), reps = 40, rounds = 9;
  int core[2] = {0, 1}, overlap = 0, each = 0;
  size_t order = 1024, places = 2;
  const char *only = NULL;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--bytes") == 0)
      bytes = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && strcmp(argv[i], "--reps") == 0)
      reps = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && strcmp(argv[i], "--rounds") == 0)
      rounds = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && strcmp(argv[i], "--cores") == 0 &&
             sscanf(argv[i + 1], "%d,%d", &core[0], &core[1]) == 2)
      i++;
    else if (i + 1 < argc && strcmp(argv[i], "--prefetch") == 0)
      keep_pf_bytes = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && strcmp(argv[i], "--consumers") == 0)
      only = argv[++i];
    else if (strcmp(argv[i], "--overlap") == 0)
      overlap = 1;
    else if (strcmp(argv[i], "--each") == 0)
      each = 1;
    else if (strcmp(argv[i], "--one-source") == 0)
      ov_one_source = 1;
    else if (i + 1 < argc && strcmp(argv[i], "--order") == 0)
      order = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && strcmp(argv[i], "--places") == 0)
      places = strtoull(argv[++i], NULL, 10);
    else {
      fprintf(stderr,
              "usage: bench-xcore [--bytes B] [--reps N (40)] [--rounds R (9)] [--cores P,C "
              "(0,1)] [--consumers C1,C2,...] [--prefetch B] [--overlap [--order N (1024)] "
              "[--places P (2)] [--each (every cell on stderr)] [--one-source]]\n");
      return 2;
    }
  }
  bytes = bytes / 64 * 64;
  if (bytes < 4096 || reps < 1 || rounds < 1 || rounds > 99) {
    fprintf(stderr, "bench-xcore: --bytes at least 4096, --reps at least 1, --rounds 1..99\n");
    return 2;
  }
  if (overlap) {
    if (order < 8 || order > 8192 || pc_packed_len(order) % 16 != 0 || places < 2 || places > 8) {
      fprintf(stderr,
              "bench-xcore: --order 8..8192 with n(n+1)/2 a multiple of 16 (e.g. 1024), "
              "--places 2..8\n");
      return 2;
    }
    ov_pf_bytes = keep_pf_bytes;
    return ov_main(order, places, reps, rounds, core, each, only);
  }
  int ok[NV];
  for (int k = 0; k < NV; k++)
    ok[k] = have(variants[k].prod) && (variants[k].prod != P_CLWB || cpu_has("clwb")) &&
            (variants[k].prod != P_CLFLUSHOPT || cpu_has("clflushopt")) &&
            (k == 0 || !only ||
             (variants[k].prod == P_NT512 && listed(only, cons_name[variants[k].cons])));

  unsigned char *src = malloc(bytes), *dst = malloc(bytes);
  /* Aligned as precondd's spares (bytes is a multiple of 64): keep's streaming stores. */
  float *stat = aligned_alloc(64, bytes), *spare = aligned_alloc(64, bytes);
  unsigned char *reg[3] = {region_map(R_SHM, bytes, 0), region_map(R_ANON, bytes, 0),
                           region_map(R_THP, bytes, 0)};
  double *cpu[2], *wall, *mc, *vs;
  cpu[0] = calloc(NV * rounds, sizeof(double));
  cpu[1] = calloc(NV * rounds, sizeof(double));
  wall = calloc(NV * rounds, sizeof(double));
  vs = calloc(NV * rounds, sizeof(double));
  mc = calloc(rounds, sizeof(double));
  if (!src || !dst || !stat || !spare || !reg[0] || !reg[1] || !reg[2] || !cpu[0] || !cpu[1] ||
      !wall || !vs || !mc) {
    fprintf(stderr, "bench-xcore: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < bytes / sizeof(float); i++) {
    ((float *)(void *)src)[i] = (float)(i % 1000) * 1e-3f;
    stat[i] = 1.0f;
    spare[i] = 0.0f;
  }
  memset(dst, 0, bytes);

  double first[2][99];
  for (size_t r = 0; r < rounds; r++) {
    pin(core[0]);
    mc[r] = memcpy_cpu_s(dst, src, bytes);
    for (int k = 0; k < NV; k++) {
      if (!ok[k]) continue;
      double c2[2], w;
      if (run_cell(&variants[k], reg[variants[k].region], src, stat, spare, bytes, reps, core, c2,
                   &w) != 0) {
        fprintf(stderr, "bench-xcore: no threads\n");
        return 1;
      }
      cpu[0][k * rounds + r] = c2[0];
      cpu[1][k * rounds + r] = c2[1];
      wall[k * rounds + r] = w;
    }
    for (int k = 0; k < NV; k++) {
      double base = cpu[0][r] + cpu[1][r], here = cpu[0][k * rounds + r] + cpu[1][k * rounds + r];
      vs[k * rounds + r] = here > 0 ? base / here : 0.0;
    }
    pin(core[0]);
    first[0][r] = first_pass_s(0, src, bytes);
    first[1][r] = first_pass_s(1, src, bytes);
  }

  double mb = (double)bytes / 1e6, mc_med = median_of(mc, rounds);
  printf(
      "variant,producer,consumer,region,cores,rounds,bytes,producer_us,consumer_us,"
      "mb_per_cpu_s,mb_per_cpu_s_min,mb_per_cpu_s_max,of_memcpy,wall_mb_s,vs_today\n");
  printf("memcpy,-,-,-,%d,%zu,%zu,%.1f,0.0,%.1f,%.1f,%.1f,1.0000,0.0,0.0000\n", core[0], rounds,
         bytes, 1e6 * mc_med, mb / mc_med, 0.0, 0.0);
  for (int k = 0; k < NV; k++) {
    if (!ok[k]) continue;
    const variant *v = &variants[k];
    double rate[99], ratio[99], p[99], q[99], wl[99], vv[99];
    for (size_t r = 0; r < rounds; r++) {
      double c = cpu[0][k * rounds + r] + cpu[1][k * rounds + r];
      rate[r] = c > 0 ? mb / c : 0.0;
      ratio[r] = c > 0 ? mc[r] / c : 0.0;
      p[r] = cpu[0][k * rounds + r];
      q[r] = cpu[1][k * rounds + r];
      wl[r] = wall[k * rounds + r];
      vv[r] = vs[k * rounds + r];
    }
    double m_rate = median(rate, rounds), lo = rate[0], hi = rate[rounds - 1];
    char cores[32], name[96];
    snprintf(cores, sizeof cores, "%d:%d", core[0], v->same_core ? core[0] : core[1]);
    snprintf(name, sizeof name, "%s+%s/%s%s", prod_name[v->prod], cons_name[v->cons],
             region_name[v->region], v->same_core ? "/one-core" : "");
    printf("%s,%s,%s,%s,%s,%zu,%zu,%.1f,%.1f,%.1f,%.1f,%.1f,%.4f,%.1f,%.4f\n", name,
           prod_name[v->prod], cons_name[v->cons], region_name[v->region], cores, rounds, bytes,
           1e6 * median(p, rounds), 1e6 * median(q, rounds), m_rate, lo, hi, median(ratio, rounds),
           mb / median(wl, rounds), median(vv, rounds));
  }
  printf("first-pass,memcpy,-,shm,%d,%zu,%zu,%.1f,0.0,%.1f,0.0,0.0,0.0000,0.0,0.0000\n", core[0],
         rounds, bytes, 1e6 * median(first[0], rounds), mb / median(first[0], rounds));
  printf("first-pass,memcpy,-,shm-populate,%d,%zu,%zu,%.1f,0.0,%.1f,0.0,0.0,0.0000,0.0,0.0000\n",
         core[0], rounds, bytes, 1e6 * median(first[1], rounds), mb / median(first[1], rounds));
  return 0;
}
