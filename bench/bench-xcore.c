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
 *   bench-xcore [--bytes B] [--reps N (hand-offs per cell, 40)] [--rounds R (9)]
 *               [--cores P,C (0,1)] [--consumers C1,C2,... (only the first variant and the
 *               nt512 rows of these consumers)] [--prefetch B]
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
  pthread_mutex_init(&c.mu, NULL);
  pthread_cond_init(&c.cv, NULL);
  pthread_t t[2];
  double t0 = now_s();
  int rc = -1;
  if (pthread_create(&t[1], NULL, consumer_main, &c) == 0) {
    if (pthread_create(&t[0], NULL, producer_main, &c) == 0) {
      pthread_join(t[0], NULL);
      rc = 0;
    } else {
      /* let the consumer run its turns out with nothing to read */
      c.reps = 0;
    }
    pthread_join(t[1], NULL);
  }
  *wall = (now_s() - t0) / (double)(reps + 1);
  cpu[0] = c.work[0] / (double)reps;
  cpu[1] = c.work[1] / (double)reps;
  pthread_cond_destroy(&c.cv);
  pthread_mutex_destroy(&c.mu);
  return rc;
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

int main(int argc, char **argv) {
  size_t bytes = 2 * 524800 * sizeof(float), reps = 40, rounds = 9;
  int core[2] = {0, 1};
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
    else {
      fprintf(stderr,
              "usage: bench-xcore [--bytes B] [--reps N (40)] [--rounds R (9)] [--cores P,C "
              "(0,1)] [--consumers C1,C2,...] [--prefetch B]\n");
      return 2;
    }
  }
  bytes = bytes / 64 * 64;
  if (bytes < 4096 || reps < 1 || rounds < 1 || rounds > 99) {
    fprintf(stderr, "bench-xcore: --bytes at least 4096, --reps at least 1, --rounds 1..99\n");
    return 2;
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

  double mb = (double)bytes / 1e6, mc_sorted[99];
  memcpy(mc_sorted, mc, rounds * sizeof *mc);
  double mc_med = median(mc_sorted, rounds);
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
