/*
 * backend_cpu.c -- the CPU backend: "device" memory is host memory, BLAS is OpenBLAS (its
 * thread count set from ac_backend_opts.threads), and every other primitive is a plain loop.
 * Arguments were checked by backend.c; these kernels only compute. They are also the
 * reference the CUDA backend is tested against: reductions keep double accumulators, and
 * the loops are written so that the compiler vectorises them (the op's switch outside the
 * loop, contiguous rows) rather than with intrinsics. The exceptions to "same formula as
 * ac_internal.h" are GELU and softmax, which use a polynomial exp (accuracy stated there).
 */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "ac_internal.h"
#include "conv_lanes.h"
#include "gemm_small.h"

/* cblas takes int sizes; the generic checks allow size_t. */
static int blas_int_ok(size_t a, size_t b, size_t c, size_t d) {
  return a <= INT_MAX && b <= INT_MAX && c <= INT_MAX && d <= INT_MAX;
}

/* ------------------------------------------------------------------------------------ */
/* Worker threads for every loop of the backend (the direct convs, batch norm's passes, the
 * gemms' blocks, the elementwise ops). A loop over n items is cut into chunks of
 * consecutive items, a few per thread, and each thread (the caller too) takes the next
 * chunk not yet taken until none is left: a thread that is slower (these virtual cores
 * differ by up to a quarter in speed) or late (asleep, off its core) takes fewer, where one
 * contiguous half per thread made the other wait for it at the end of every loop. Every
 * kernel computes each item the same way whichever thread runs it and whatever the chunks
 * (reductions are split by channel, never across one; partial sums are per item), so
 * results do not depend on the thread count or on who took what, and runs repeat bit for
 * bit. A slice function gets the index of the thread running it (0: the caller), for
 * per-thread scratch. */

typedef void (*par_fn)(void *ctx, size_t lo, size_t hi, int thread);

/* A loop is handed out by publishing (fn, ctx, n, chunks) and then one word, work: the
 * loop's sequence number and the range of chunks not yet taken. A thread takes a chunk by
 * narrowing that range (compare-and-swap): the sequence number in the same word
 * makes a late worker's claim on a finished loop fail, and a successful claim holds the loop
 * open (the caller waits for every chunk to be done), so fn, ctx and n are still that
 * loop's when the worker reads them. The caller waits only for chunks taken, never for a
 * worker that took none. Both sides first spin and only then sleep on a condition
 * variable: the futex calls, and the wake-up of a sleeping thread, cost 10-50 us each on
 * this project's virtual machines and a ResNet-20 step hands out about 550 loops. A thread
 * that sleeps says so (sleepers, caller_sleeps, under mu), so the other side makes the
 * wake-up call only then. The spin is adaptive (pool_adapt): on a loaded machine, where
 * the other thread is often off its core for milliseconds, a fixed spin doubled the step's
 * CPU time and its wall time with it. */
/* PRECOND_POOL_STATS=1 in the environment: where the pool's threads work and idle, per
 * kind of loop (its slice function's name), printed to stderr when the backend is destroyed
 * (pool_stats_print). Off, it costs one branch per loop. For each kind: the loops handed
 * out and those run on the caller alone (under the split threshold), the wall time from
 * hand-out to the last slice's end, and per thread the wall and CPU time (the thread's own
 * clock) of its slices: a thread's wall in the loop minus its slices' wall is its idle
 * time there, and the sum of the threads' CPU over (wall x threads) the loop's share of
 * busy cores, a figure the machine's load distorts less than wall times do. Between loops
 * the caller's wall and CPU time are counted too (the workers idle then). */
#define POOL_STAT_KINDS 32

typedef struct pool_stat {
  const char *name;
  unsigned long loops, small; /* handed out; run on the caller alone */
  long wall_ns, small_ns;     /* hand-out to last slice; the small loops' wall */
  long wait_ns;               /* the caller, from its last chunk to the others' last */
  long *busy_ns, *cpu_ns;     /* per thread: its slices' wall and CPU time */
} pool_stat;

typedef struct pool_stats {
  pool_stat kind[POOL_STAT_KINDS];
  int nkinds;
  long gap_wall_ns, gap_cpu_ns; /* the caller between loops handed out */
  long last_end_ns, last_end_cpu_ns;
  long *slots; /* 2 x nthreads x POOL_STAT_KINDS longs behind busy_ns and cpu_ns */
} pool_stats;

typedef struct cpu_pool {
  int nthreads;       /* including the caller; 1: no workers were started */
  pthread_t *workers; /* nthreads - 1 */
  pthread_mutex_t mu;
  pthread_cond_t go, done_cv;
  _Atomic unsigned long long work; /* seq << 32 | front << 16 | back (pool_take) */
  _Atomic unsigned long done;      /* chunks of the current loop finished */
  _Atomic int stop;
  int sleepers, caller_sleeps; /* under mu */
  long caller_spin;            /* the caller's spin budget (ns; pool_adapt) */
  par_fn fn;
  void *ctx;
  size_t n, chunks;      /* items and chunks of the current loop */
  pool_stats *stats;     /* NULL unless PRECOND_POOL_STATS is set */
  int kind;              /* the loop's index in stats */
  int chunks_per_thread; /* POOL_CHUNKS_PER_THREAD, or PRECOND_POOL_CHUNKS (pool_start) */
} cpu_pool;

typedef struct pool_worker_arg {
  cpu_pool *pool;
  int index;
} pool_worker_arg;

static void slice_of(size_t n, int parts, int i, size_t *lo, size_t *hi) {
  *lo = n * (size_t)i / (size_t)parts;
  *hi = n * (size_t)(i + 1) / (size_t)parts;
}

/* Spin budgets: each waiting thread keeps its own, between 0 and POOL_SPIN_MAX_NS. */
#define POOL_SPIN_MAX_NS  100000L
#define POOL_SPIN_STEP_NS 2000L

static long pool_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void pool_pause(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __builtin_ia32_pause();
#endif
}

/* Spins while *word == value and stop is clear, for up to budget ns (the clock read every
 * 64 pauses); 1 if the wait ended. */
static int pool_spin(cpu_pool *p, _Atomic unsigned long long *word, unsigned long long value,
                     long t0, long budget) {
  for (unsigned i = 0;; i++) {
    if (atomic_load(word) != value || atomic_load(&p->stop)) return 1;
    pool_pause();
    if (i % 64 == 63 && pool_now_ns() - t0 > budget) return 0;
  }
}

/* Spins until the current loop's chunks are all done, for up to budget ns; 1 if they are. */
static int pool_spin_done(cpu_pool *p, size_t chunks, long t0, long budget) {
  for (unsigned i = 0;; i++) {
    if (atomic_load(&p->done) == chunks) return 1;
    pool_pause();
    if (i % 64 == 63 && pool_now_ns() - t0 > budget) return 0;
  }
}

/* After a wait of waited ns (additive increase, multiplicative decrease): a wait the spin
 * covered keeps the budget; one that slept but ended within the longest spin adds a step
 * (a longer spin would have caught it); a longer one halves it (the other thread was off
 * its core: spinning only burnt CPU). On quiet cores most waits are short and the budget
 * settles high; under load the long waits keep it near 0, where the pool behaves as a
 * plain condition-variable pool. */
static void pool_adapt(long *budget, long waited) {
  if (waited <= *budget) return;
  if (waited < POOL_SPIN_MAX_NS) {
    long b = *budget + POOL_SPIN_STEP_NS;
    *budget = b < POOL_SPIN_MAX_NS ? b : POOL_SPIN_MAX_NS;
  } else {
    *budget /= 2;
  }
}

static long pool_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* The stats' index of the loop kind name (compared by address: a string literal of
 * par_for), added on first sight; the last slot takes every kind beyond. */
static int pool_stat_kind(pool_stats *st, const char *name) {
  for (int i = 0; i < st->nkinds; i++)
    if (st->kind[i].name == name) return i;
  if (st->nkinds == POOL_STAT_KINDS) return POOL_STAT_KINDS - 1;
  st->kind[st->nkinds].name = name;
  return st->nkinds++;
}

/* Runs thread's slice [lo, hi) of the current loop, timed when the stats are on. */
static void pool_slice(cpu_pool *p, int thread, size_t lo, size_t hi) {
  if (p->stats == NULL) {
    p->fn(p->ctx, lo, hi, thread);
    return;
  }
  long t0 = pool_now_ns(), c0 = pool_cpu_ns();
  p->fn(p->ctx, lo, hi, thread);
  pool_stat *k = &p->stats->kind[p->kind];
  k->busy_ns[thread] += pool_now_ns() - t0;
  k->cpu_ns[thread] += pool_cpu_ns() - c0;
}

/* Phases within a loop's slices (the direct convs: packing, products, copy-out), counted
 * as kinds of their own with the wall time of each thread in them (busy_ms; no loops).
 * pool_phase registers one on the caller before the loop is handed out (-1: stats off);
 * pool_phase_end adds the time since *t to thread's count and restarts *t. Off, they cost
 * a branch per call. */
static int pool_phase(cpu_pool *p, const char *name) {
  return p->stats != NULL ? pool_stat_kind(p->stats, name) : -1;
}

static long pool_phase_start(const cpu_pool *p) {
  return p->stats != NULL ? pool_now_ns() : 0;
}

static void pool_phase_end(cpu_pool *p, int kind, int thread, long *t) {
  if (kind < 0) return;
  long now = pool_now_ns();
  p->stats->kind[kind].busy_ns[thread] += now - *t;
  *t = now;
}

/* Allocates the stats when PRECOND_POOL_STATS is set to something other than 0 (none on
 * out of memory: they are a diagnostic). */
static pool_stats *pool_stats_new(int nthreads) {
  const char *env = getenv("PRECOND_POOL_STATS");
  if (env == NULL || env[0] == '\0' || strcmp(env, "0") == 0) return NULL;
  pool_stats *st = calloc(1, sizeof *st);
  long *slots = calloc(2 * (size_t)nthreads * POOL_STAT_KINDS, sizeof *slots);
  if (st == NULL || slots == NULL) {
    free(st);
    free(slots);
    return NULL;
  }
  st->slots = slots;
  for (int i = 0; i < POOL_STAT_KINDS; i++) {
    st->kind[i].busy_ns = slots + 2 * (size_t)i * (size_t)nthreads;
    st->kind[i].cpu_ns = st->kind[i].busy_ns + nthreads;
  }
  st->last_end_ns = -1;
  return st;
}

/* One line per loop kind, then the caller's time between loops and a total, to stderr:
 * "pool-stats KIND loops small wall_ms small_ms caller_wait_ms busy_ms(per thread) cpu_ms(per thread)
 * idle_ms(of the threads but the caller) cores_busy". Frees the stats. */
static void pool_stats_print(pool_stats *st, int nthreads) {
  if (st == NULL) return;
  double wall = 0, cpu = 0;
  fprintf(stderr,
          "pool-stats kind loops small wall_ms small_ms caller_wait_ms busy_ms[t] cpu_ms[t] "
          "worker_idle_ms cores_busy\n");
  for (int i = 0; i < st->nkinds; i++) {
    const pool_stat *k = &st->kind[i];
    double c = 0, idle = 0;
    fprintf(stderr, "pool-stats %-18s %6lu %6lu %9.2f %8.2f %8.2f", k->name, k->loops, k->small,
            1e-6 * (double)k->wall_ns, 1e-6 * (double)k->small_ns, 1e-6 * (double)k->wait_ns);
    for (int t = 0; t < nthreads; t++) fprintf(stderr, " %8.2f", 1e-6 * (double)k->busy_ns[t]);
    for (int t = 0; t < nthreads; t++) {
      fprintf(stderr, " %8.2f", 1e-6 * (double)k->cpu_ns[t]);
      c += 1e-6 * (double)k->cpu_ns[t];
      if (t > 0) idle += 1e-6 * (double)(k->wall_ns - k->busy_ns[t]);
    }
    fprintf(stderr, " %8.2f %5.2f\n", idle, k->wall_ns > 0 ? c / (1e-6 * (double)k->wall_ns) : 0.0);
    wall += 1e-6 * (double)k->wall_ns;
    cpu += c;
  }
  fprintf(stderr, "pool-stats between-loops wall_ms %.2f caller_cpu_ms %.2f\n",
          1e-6 * (double)st->gap_wall_ns, 1e-6 * (double)st->gap_cpu_ns);
  fprintf(stderr, "pool-stats in-loops wall_ms %.2f cpu_ms %.2f cores_busy %.2f\n", wall, cpu,
          wall > 0 ? cpu / wall : 0.0);
  free(st->slots);
  free(st);
}

#define POOL_SEQ(w)   ((w) >> 32)
#define POOL_FRONT(w) ((size_t)((w) >> 16) & 0xffff)
#define POOL_BACK(w)  ((size_t)(w)&0xffff)

/* Runs chunks of the current loop on thread until none is left; returns the last value of
 * work it saw (a loop with every chunk taken: the value to wait on for the next). The
 * chunks not yet taken are [front, back): the caller takes them from the front, the
 * workers from the back, so that when the threads keep pace each runs the same part of
 * the items loop after loop (one contiguous slice each, as the pool had before the chunks:
 * the images a conv wrote are still in that core's cache for the batch norm after it), and
 * only where they meet does the faster one take more. */
static unsigned long long pool_take(cpu_pool *p, int thread) {
  unsigned long long w = atomic_load(&p->work);
  for (;;) {
    size_t front = POOL_FRONT(w), back = POOL_BACK(w);
    if (front >= back) return w;
    unsigned long long next = thread == 0 ? w + (1ULL << 16) : w - 1;
    if (!atomic_compare_exchange_weak(&p->work, &w, next)) continue; /* w reloaded */
    size_t lo, hi, chunks = p->chunks;
    slice_of(p->n, (int)chunks, (int)(thread == 0 ? front : back - 1), &lo, &hi);
    pool_slice(p, thread, lo, hi);
    if (atomic_fetch_add(&p->done, 1) + 1 == chunks && thread != 0) {
      pthread_mutex_lock(&p->mu);
      if (p->caller_sleeps) pthread_cond_signal(&p->done_cv);
      pthread_mutex_unlock(&p->mu);
    }
    w = atomic_load(&p->work);
  }
}

static void *pool_worker(void *arg) {
  pool_worker_arg a = *(pool_worker_arg *)arg;
  free(arg);
  cpu_pool *p = a.pool;
  unsigned long long seen = 0;
  long budget = POOL_SPIN_MAX_NS;
  for (;;) {
    long t0 = pool_now_ns();
    if (!pool_spin(p, &p->work, seen, t0, budget)) {
      pthread_mutex_lock(&p->mu);
      p->sleepers++;
      while (!atomic_load(&p->stop) && atomic_load(&p->work) == seen)
        pthread_cond_wait(&p->go, &p->mu);
      p->sleepers--;
      pthread_mutex_unlock(&p->mu);
    }
    pool_adapt(&budget, pool_now_ns() - t0);
    if (atomic_load(&p->stop)) break;
    seen = pool_take(p, a.index);
  }
  return NULL;
}

/* Loops touching fewer floats than this run on the caller alone: handing out a loop costs
 * more than it saves. */
#define PAR_MIN_FLOATS 32768.0
/* Chunks per thread, and the least work (floats) of a chunk: enough chunks that a thread
 * 25% slower, or one that starts late, leaves the other little to wait for at the end;
 * few enough that taking one (an atomic operation on a shared line) stays small. */
#define POOL_CHUNKS_PER_THREAD 16
#define POOL_MIN_CHUNK_FLOATS  8192.0

/* fn over [0, n) in chunks taken by the pool's threads; work: floats read and written, to
 * skip threading for small loops and to size the chunks. The caller takes chunks too, then
 * waits for the ones the others took (spinning first). */
#define par_for(p, n, work, fn, ctx) pool_run(p, n, work, fn, ctx, #fn)

static void pool_run(cpu_pool *p, size_t n, double work, par_fn fn, void *ctx, const char *name) {
  long t_start = 0;
  if (p->stats != NULL) {
    p->kind = pool_stat_kind(p->stats, name);
    t_start = pool_now_ns();
  }
  if (p->nthreads <= 1 || n < 2 || work < PAR_MIN_FLOATS) {
    long c_start = p->stats != NULL ? pool_cpu_ns() : 0;
    if (n > 0) fn(ctx, 0, n, 0);
    if (p->stats != NULL) {
      p->stats->kind[p->kind].small++;
      p->stats->kind[p->kind].small_ns += pool_now_ns() - t_start;
      if (p->nthreads == 1) p->stats->kind[p->kind].cpu_ns[0] += pool_cpu_ns() - c_start;
    }
    return;
  }
  if (p->stats != NULL && p->stats->last_end_ns >= 0) {
    p->stats->gap_wall_ns += t_start - p->stats->last_end_ns;
    p->stats->gap_cpu_ns += pool_cpu_ns() - p->stats->last_end_cpu_ns;
  }
  double most = work / POOL_MIN_CHUNK_FLOATS;
  size_t chunks = (size_t)p->nthreads * (size_t)p->chunks_per_thread;
  if (most < (double)chunks)
    chunks = most > (double)p->nthreads ? (size_t)most : (size_t)p->nthreads;
  if (chunks > n) chunks = n;
  if (chunks > 0xffff) chunks = 0xffff;
  p->fn = fn;
  p->ctx = ctx;
  p->n = n;
  p->chunks = chunks;
  atomic_store(&p->done, 0);
  unsigned long long seq = POOL_SEQ(atomic_load(&p->work)) + 1;
  /* publishes fn, ctx, n (sequentially consistent) */
  atomic_store(&p->work, (seq & 0xffffffffULL) << 32 | (unsigned long long)chunks);
  pthread_mutex_lock(&p->mu);
  if (p->sleepers > 0) pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  pool_take(p, 0);
  long t0 = pool_now_ns();
  if (!pool_spin_done(p, chunks, t0, p->caller_spin)) {
    pthread_mutex_lock(&p->mu);
    p->caller_sleeps = 1;
    while (atomic_load(&p->done) != chunks) pthread_cond_wait(&p->done_cv, &p->mu);
    p->caller_sleeps = 0;
    pthread_mutex_unlock(&p->mu);
  }
  pool_adapt(&p->caller_spin, pool_now_ns() - t0);
  if (p->stats != NULL) {
    p->stats->kind[p->kind].wait_ns += pool_now_ns() - t0;
    p->stats->last_end_ns = pool_now_ns();
    p->stats->last_end_cpu_ns = pool_cpu_ns();
    p->stats->kind[p->kind].loops++;
    p->stats->kind[p->kind].wall_ns += p->stats->last_end_ns - t_start;
  }
}

static void pool_stop(cpu_pool *p) {
  pool_stats_print(p->stats, p->nthreads);
  p->stats = NULL;
  if (p->nthreads > 1) {
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads - 1; i++) pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done_cv);
  }
  free(p->workers);
  p->workers = NULL;
  p->nthreads = 1;
}

/* Starts nthreads - 1 workers; on any failure the pool runs everything on the caller
 * (nthreads 1): slower, never wrong. */
static void pool_start(cpu_pool *p, int nthreads) {
  memset(p, 0, sizeof *p);
  atomic_init(&p->work, 0);
  atomic_init(&p->done, 0);
  atomic_init(&p->stop, 0);
  p->caller_spin = POOL_SPIN_MAX_NS;
  p->nthreads = 1;
  if (nthreads <= 1) {
    p->stats = pool_stats_new(1); /* the passes' shares on one core */
    return;
  }
  p->workers = calloc((size_t)nthreads - 1, sizeof *p->workers);
  if (p->workers == NULL) return;
  if (pthread_mutex_init(&p->mu, NULL) != 0) goto fail_mu;
  if (pthread_cond_init(&p->go, NULL) != 0) goto fail_go;
  if (pthread_cond_init(&p->done_cv, NULL) != 0) goto fail_done;
  p->nthreads = nthreads;
  p->stats = pool_stats_new(nthreads);
  /* PRECOND_POOL_CHUNKS=k: k chunks per thread (1: one contiguous slice each, as the pool
   * of session 10), to measure what the chunks change on a given machine. */
  const char *env = getenv("PRECOND_POOL_CHUNKS");
  p->chunks_per_thread = env != NULL && atoi(env) > 0 ? atoi(env) : POOL_CHUNKS_PER_THREAD;
  for (int i = 0; i < nthreads - 1; i++) {
    pool_worker_arg *a = malloc(sizeof *a);
    if (a != NULL) {
      a->pool = p;
      a->index = i + 1;
    }
    if (a == NULL || pthread_create(&p->workers[i], NULL, pool_worker, a) != 0) {
      free(a);
      /* Only the first i workers exist: stop them and fall back to the caller alone. */
      p->nthreads = i + 1;
      pool_stop(p);
      return;
    }
  }
  return;
fail_done:
  pthread_cond_destroy(&p->go);
fail_go:
  pthread_mutex_destroy(&p->mu);
fail_mu:
  free(p->workers);
  p->workers = NULL;
}

/* The backend's state: the thread count of its options (0: OpenBLAS's default) and the
 * pool of as many threads for the loops. */
typedef struct cpu_impl {
  int threads;
  cpu_pool pool;
  float *scratch; /* the direct convs' (cpu_scratch) */
  int isa;        /* the direct convs' variant (ac_cpu_isa; PORTABLE: none), set at creation */
  size_t scratch_floats;
} cpu_impl;

static cpu_pool *pool_of(ac_backend *be) {
  return &((cpu_impl *)be->impl)->pool;
}

static void cpu_destroy(ac_backend *be) {
  cpu_impl *impl = be->impl;
  if (impl != NULL) {
    pool_stop(&impl->pool);
    free(impl->scratch);
  }
  free(impl);
  be->impl = NULL;
}

static int cpu_sync(ac_backend *be) {
  (void)be;
  return AC_OK;
}

static int cpu_malloc(ac_backend *be, size_t bytes, void **out) {
  (void)be;
  size_t rounded = (bytes + 255u) / 256u * 256u;
  if (rounded < bytes) return AC_ENOMEM;
  *out = aligned_alloc(256, rounded);
  return *out != NULL ? AC_OK : AC_ENOMEM;
}

static void cpu_free(ac_backend *be, void *p) {
  (void)be;
  free(p);
}

static int cpu_memcpy(ac_backend *be, void *dst, const void *src, size_t bytes) {
  (void)be;
  memcpy(dst, src, bytes);
  return AC_OK;
}

/* The elementwise loops split [0, n) into blocks of EW_BLOCK floats across the pool (a
 * block is computed the same way by whichever thread: any thread count gives the same
 * bits). Batch norm's passes were parallel, but the residual sums, fills and activations
 * between them ran on the caller alone: at 2 threads, 8-10 ms of a 230 ms ResNet step with
 * the second core idle. */
#define EW_BLOCK 4096

static size_t ew_blocks(size_t n) {
  return (n + EW_BLOCK - 1) / EW_BLOCK;
}

/* The floats [lo, hi) of block range [blo, bhi) of n. */
static void ew_range(size_t n, size_t blo, size_t bhi, size_t *lo, size_t *len) {
  size_t hi = bhi * EW_BLOCK < n ? bhi * EW_BLOCK : n;
  *lo = blo * EW_BLOCK;
  *len = hi - *lo;
}

typedef struct fill_args {
  size_t n;
  float value;
  float *x;
} fill_args;

static void fill_slice(void *ctx, size_t blo, size_t bhi, int thread) {
  const fill_args *a = ctx;
  size_t lo, len;
  ew_range(a->n, blo, bhi, &lo, &len);
  for (size_t i = 0; i < len; i++) a->x[lo + i] = a->value;
}

static int cpu_fill_f32(ac_backend *be, size_t n, float *x, float value) {
  fill_args a = {n, value, x};
  par_for(pool_of(be), ew_blocks(n), (double)n, fill_slice, &a);
  return AC_OK;
}

static int cpu_fill_i32(ac_backend *be, size_t n, int32_t *x, int32_t value) {
  (void)be;
  for (size_t i = 0; i < n; i++) x[i] = value;
  return AC_OK;
}

static int cpu_copy2d(ac_backend *be, size_t rows, size_t cols, const float *src, size_t lds,
                      float *dst, size_t ldd) {
  (void)be;
  for (size_t i = 0; i < rows; i++) memcpy(dst + i * ldd, src + i * lds, cols * sizeof(float));
  return AC_OK;
}

/* y[idx] = x[idx'], idx'[perm[k]] = idx[k]: walk y in order, step x by its strides. When
 * the last axis stays last (a conv's (oc, n, ohw) -> (n, oc, ohw)), whole rows of it are
 * copied at once. The rows of y are split across the pool (each row is copied the same way
 * by whichever thread). */
typedef struct perm_args {
  int outer; /* the axes walked one index at a time */
  size_t run;
  size_t yshape[AC_MAX_DIMS], ystride[AC_MAX_DIMS];
  const float *x;
  float *y;
} perm_args;

static void permute_rows(void *ctx, size_t lo, size_t hi, int thread) {
  const perm_args *a = ctx;
  size_t idx[AC_MAX_DIMS], r = lo;
  for (int d = a->outer - 1; d >= 0; d--) {
    idx[d] = r % a->yshape[d];
    r /= a->yshape[d];
  }
  for (size_t row = lo; row < hi; row++) {
    size_t src = 0;
    for (int d = 0; d < a->outer; d++) src += idx[d] * a->ystride[d];
    if (a->run > 1)
      memcpy(a->y + row * a->run, a->x + src, a->run * sizeof *a->y);
    else
      a->y[row] = a->x[src];
    for (int d = a->outer - 1; d >= 0; d--) {
      if (++idx[d] < a->yshape[d]) break;
      idx[d] = 0;
    }
  }
}

static int cpu_permute(ac_backend *be, int ndim, const size_t *shape, const int *perm,
                       const float *x, float *y) {
  size_t xstride[AC_MAX_DIMS], numel = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    xstride[d] = numel;
    numel *= shape[d];
  }
  perm_args a = {.run = perm[ndim - 1] == ndim - 1 ? shape[ndim - 1] : 1, .x = x, .y = y};
  a.outer = a.run > 1 ? ndim - 1 : ndim;
  for (int d = 0; d < ndim; d++) {
    a.yshape[d] = shape[perm[d]];
    a.ystride[d] = xstride[perm[d]];
  }
  par_for(pool_of(be), numel / a.run, 2.0 * (double)numel, permute_rows, &a);
  return AC_OK;
}

/* Products of a backend with more than one thread run on the backend's own pool, each
 * thread calling single-threaded OpenBLAS on its share, never on OpenBLAS's threads:
 * OpenBLAS synchronises its threads on every call and they spin-wait after it, so on a
 * shared machine the small products of a conv (16 x 6272 x 144 per chunk, hundreds per
 * step) lost more to the waiting than they gained (ResNet-20 step, --threads 2: 2152 ms CPU
 * time against 642 on OpenBLAS's threads for the big products only). The pool's threads
 * block on a condition variable instead. A product is cut into items = (batch index, block
 * of rows or columns of C): the longer of m and n is cut (the other operand, packed again
 * by every call, is then the smaller one), into at most GEMM_BLOCKS blocks of at least
 * GEMM_MIN_CUT, a function of the shape alone; every item is its own OpenBLAS call
 * whichever thread makes it. OpenBLAS's result for an element depends on the shape of the
 * call it is in (its kernels and blocking differ at the edges), so only the same calls for
 * any thread count give the same bits (test_cpu_pool_bitwise). Products under
 * PAR_GEMM_MACS stay on the caller (cut the same way). */
#define GEMM_BLOCKS   4
#define GEMM_MIN_CUT  64
#define PAR_GEMM_MACS 262144.0

/* One single-threaded product: the backend's own AVX-512F kernel for the small blocks it
 * takes (gemm_small.c: Shampoo's 128-blocks, where OpenBLAS runs its AVX2 kernels), else
 * OpenBLAS. The choice is a function of the call's shape and the backend's ISA alone, so the
 * same calls give the same bits for any thread count. */
static void cpu_gemm1(int isa, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, size_t m, size_t n, size_t k,
                      float alpha, const float *a, size_t lda, const float *b, size_t ldb,
                      float beta, float *c, size_t ldc) {
  /* A 1 x 1 result is a dot product (K-FAC's KL clip: <p, grad> per tensor, up to 66k
   * terms): OpenBLAS's gemm packs both vectors first and took 10x sdot's time there. */
  if (m == 1 && n == 1) {
    float d =
        cblas_sdot((int)k, a, ta == CblasTrans ? (int)lda : 1, b, tb == CblasTrans ? 1 : (int)ldb);
    *c = beta == 0.0f ? alpha * d : alpha * d + beta * *c;
    return;
  }
  if (isa >= AC_CPU_ISA_AVX512 && ac__gemm_small(ta == CblasTrans, tb == CblasTrans, m, n, k, alpha,
                                                 a, lda, b, ldb, beta, c, ldc) == 0)
    return;
  cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta,
              c, (int)ldc);
}

typedef struct gemm_args {
  int isa; /* the backend's (cpu_gemm1) */
  CBLAS_TRANSPOSE ta, tb;
  size_t m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, block, nblocks;
  int cut_rows; /* blocks of rows of C (of A) rather than columns (of B) */
  float alpha, beta;
  const float *a, *b;
  float *c;
} gemm_args;

/* The items [lo, hi): C_i[r0:r1, :) from A's rows r0.. (its columns when A is transposed),
 * or C_i[:, j0:j1) from B's columns j0.. (its rows when B is transposed). */
static void gemm_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const gemm_args *g = ctx;
  for (size_t it = lo; it < hi; it++) {
    size_t i = it / g->nblocks, s0 = it % g->nblocks * g->block;
    size_t len = g->cut_rows ? g->m : g->n;
    size_t s1 = s0 + g->block < len ? s0 + g->block : len;
    const float *a = g->a + i * g->stride_a, *b = g->b + i * g->stride_b;
    float *c = g->c + i * g->stride_c;
    size_t m = g->m, n = g->n;
    if (g->cut_rows) {
      a += g->ta == CblasTrans ? s0 : s0 * g->lda;
      c += s0 * g->ldc;
      m = s1 - s0;
    } else {
      b += g->tb == CblasTrans ? s0 * g->ldb : s0;
      c += s0;
      n = s1 - s0;
    }
    cpu_gemm1(g->isa, g->ta, g->tb, m, n, g->k, g->alpha, a, g->lda, b, g->ldb, g->beta, c, g->ldc);
  }
}

static int cpu_sgemm_batched(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k,
                             float alpha, const float *a, size_t lda, size_t stride_a,
                             const float *b, size_t ldb, size_t stride_b, float beta, float *c,
                             size_t ldc, size_t stride_c, size_t batch) {
  const cpu_impl *impl = be->impl;
  if (!blas_int_ok(m, n, k, 1) || !blas_int_ok(lda, ldb, ldc, 1)) return AC_EINVAL;
  if (k == 0) {
    /* BLAS would demand lda >= 1 here; the result is just beta C. */
    for (size_t i = 0; i < batch; i++)
      for (size_t r = 0; r < m; r++)
        for (size_t j = 0; j < n; j++) {
          float *cij = c + i * stride_c + r * ldc + j;
          *cij = beta == 0.0f ? 0.0f : beta * *cij;
        }
    return AC_OK;
  }
  gemm_args g = {impl->isa,
                 ta == AC_TRANS ? CblasTrans : CblasNoTrans,
                 tb == AC_TRANS ? CblasTrans : CblasNoTrans,
                 m,
                 n,
                 k,
                 lda,
                 ldb,
                 ldc,
                 stride_a,
                 stride_b,
                 stride_c,
                 0,
                 0,
                 m > n,
                 alpha,
                 beta,
                 a,
                 b,
                 c};
  size_t len = g.cut_rows ? m : n, block = ((len + GEMM_BLOCKS - 1) / GEMM_BLOCKS + 15) / 16 * 16;
  g.block = block > GEMM_MIN_CUT ? block : GEMM_MIN_CUT;
  g.nblocks = (len + g.block - 1) / g.block;
  double macs = (double)m * (double)n * (double)k * (double)batch;
  if (impl->pool.nthreads <= 1 || macs < PAR_GEMM_MACS)
    gemm_slice(&g, 0, batch * g.nblocks, 0);
  else
    par_for(pool_of(be), batch * g.nblocks, macs, gemm_slice, &g);
  return AC_OK;
}

/* The Gram matrix's upper triangle by blocks of rows, each single-threaded OpenBLAS calls on
 * the pool (as the products above; one whole ssyrk would need OpenBLAS's own threads): block
 * i is C[r0:r1, r0:n) = alpha A_r0:r1 A_r0:n^T (rows of A; its columns when transposed), its
 * diagonal square by ssyrk (upper triangle only: the lower one was half of that square's
 * work, never read) and the rest by one gemm. At order 128 (two blocks of 64) that is 2/3
 * of the multiply-adds of gemms over whole diagonal squares. The blocks, a function of the
 * shape, shrink along the triangle, so items alternate from both ends (0, last, 1, ...)
 * and the pool's contiguous halves get about the same work. */
typedef struct syrk_args {
  int isa; /* the backend's (cpu_gemm1) */
  CBLAS_TRANSPOSE ta, tb;
  size_t n, k, lda, block, nblocks;
  float alpha;
  const float *a;
  float *c;
} syrk_args;

static void syrk_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const syrk_args *s = ctx;
  for (size_t it = lo; it < hi; it++) {
    size_t blk = it % 2 == 0 ? it / 2 : s->nblocks - 1 - it / 2;
    size_t r0 = blk * s->block, r1 = r0 + s->block < s->n ? r0 + s->block : s->n;
    const float *ar = s->a + (s->ta == CblasTrans ? r0 : r0 * s->lda);
    const float *ab = s->a + (s->ta == CblasTrans ? r1 : r1 * s->lda);
    float *c = s->c + r0 * s->n + r0;
    cblas_ssyrk(CblasRowMajor, CblasUpper, s->ta, (int)(r1 - r0), (int)s->k, s->alpha, ar,
                (int)s->lda, 0.0f, c, (int)s->n);
    if (r1 < s->n)
      cpu_gemm1(s->isa, s->ta, s->tb, r1 - r0, s->n - r1, s->k, s->alpha, ar, s->lda, ab, s->lda,
                0.0f, c + (r1 - r0), s->n);
  }
}

/* Dense n x n Gram matrix (upper triangle) into scratch, then packed with beta. */
static int cpu_syrk_packed(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                           const float *a, size_t lda, float beta, float *c_packed) {
  float *dense = NULL;

  if (!blas_int_ok(n, k, lda, 1)) return AC_EINVAL;
  /* Shampoo's blocks: the small-block kernel writes the packed triangle itself */
  if (((const cpu_impl *)be->impl)->isa >= AC_CPU_ISA_AVX512 &&
      ac__syrk_small_packed(trans == AC_TRANS, n, k, alpha, a, lda, beta, c_packed) == 0)
    return AC_OK;
  if (k > 0) {
    dense = malloc(n * n * sizeof *dense);
    if (dense == NULL) return AC_ENOMEM;
    syrk_args s = {((const cpu_impl *)be->impl)->isa,
                   trans == AC_TRANS ? CblasTrans : CblasNoTrans,
                   trans == AC_TRANS ? CblasNoTrans : CblasTrans,
                   n,
                   k,
                   lda,
                   0,
                   0,
                   alpha,
                   a,
                   dense};
    size_t block = ((n + 7) / 8 + 15) / 16 * 16;
    s.block = block > GEMM_MIN_CUT ? block : GEMM_MIN_CUT;
    s.nblocks = (n + s.block - 1) / s.block;
    double macs = (double)n * (double)n * (double)k / 2;
    if (macs < PAR_GEMM_MACS)
      syrk_slice(&s, 0, s.nblocks, 0);
    else
      par_for(pool_of(be), s.nblocks, macs, syrk_slice, &s);
  }
  size_t p = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++, p++) {
      float g = dense != NULL ? dense[i * n + j] : 0.0f;
      c_packed[p] = beta == 0.0f ? g : g + beta * c_packed[p];
    }
  free(dense);
  return AC_OK;
}

/* The host's memory is the backend's: the packing pass writes straight into the caller's. */
static int cpu_syrk_packed_to_host(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                                   const float *a, size_t lda, float *host_packed) {
  return cpu_syrk_packed(be, trans, n, k, alpha, a, lda, 0.0f, host_packed);
}

static int cpu_unpack_sym(ac_backend *be, size_t n, const float *packed, float *dense, size_t ld) {
  (void)be;
  size_t p = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++, p++) {
      dense[i * ld + j] = packed[p];
      dense[j * ld + i] = packed[p];
    }
  return AC_OK;
}

static int cpu_pack_sym(ac_backend *be, size_t n, const float *dense, size_t ld, float *packed) {
  (void)be;
  size_t p = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++, p++) packed[p] = dense[i * ld + j];
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Elementwise kernels. The op's switch sits outside the element loop, so that each loop is
 * one statement over contiguous arrays that the compiler vectorises. Outputs may equal an
 * input exactly (in place, as accel.h allows): these loops read element i before writing
 * it, and GCC's runtime overlap check keeps exact aliasing on the vector path. */

/* out[i] = a[i] op b[i] */
static void binary_vv(ac_binary_op op, size_t n, const float *a, const float *b, float *out) {
  switch (op) {
    case AC_BIN_ADD:
      for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
      break;
    case AC_BIN_SUB:
      for (size_t i = 0; i < n; i++) out[i] = a[i] - b[i];
      break;
    case AC_BIN_MUL:
      for (size_t i = 0; i < n; i++) out[i] = a[i] * b[i];
      break;
    default:
      for (size_t i = 0; i < n; i++) out[i] = a[i] / b[i];
      break;
  }
}

/* out[i] = a[i] op s */
static void binary_vs(ac_binary_op op, size_t n, const float *a, float s, float *out) {
  switch (op) {
    case AC_BIN_ADD:
      for (size_t i = 0; i < n; i++) out[i] = a[i] + s;
      break;
    case AC_BIN_SUB:
      for (size_t i = 0; i < n; i++) out[i] = a[i] - s;
      break;
    case AC_BIN_MUL:
      for (size_t i = 0; i < n; i++) out[i] = a[i] * s;
      break;
    default:
      for (size_t i = 0; i < n; i++) out[i] = a[i] / s;
      break;
  }
}

typedef enum { EW_BINARY, EW_AXPBY, EW_AFFINE, EW_UNARY, EW_UNARY_BACKWARD } ew_kind;

typedef struct ew_args {
  ew_kind kind;
  int op; /* ac_binary_op or ac_unary_op */
  size_t n;
  float alpha, beta;
  const float *a, *b; /* b: NULL where the op has one input */
  float *out;
} ew_args;

static void ew_slice(void *ctx, size_t blo, size_t bhi, int thread);

/* work: floats read and written per element (more for the exp-bound GELU). */
static void ew_run(ac_backend *be, const ew_args *e, double work) {
  par_for(pool_of(be), ew_blocks(e->n), work * (double)e->n, ew_slice, (void *)e);
}

static int cpu_binary(ac_backend *be, ac_binary_op op, size_t n, const float *a, const float *b,
                      float *out) {
  ew_args e = {.kind = EW_BINARY, .op = (int)op, .n = n, .a = a, .b = b, .out = out};
  ew_run(be, &e, 3.0);
  return AC_OK;
}

/* y is not read when beta is 0 (it may be NULL then). */
static void axpby_range(size_t n, float alpha, const float *x, float beta, const float *y,
                        float *out) {
  if (beta == 0.0f)
    for (size_t i = 0; i < n; i++) out[i] = alpha * x[i];
  else
    for (size_t i = 0; i < n; i++) out[i] = alpha * x[i] + beta * y[i];
}

static int cpu_axpby(ac_backend *be, size_t n, float alpha, const float *x, float beta,
                     const float *y, float *out) {
  ew_args e = {.kind = EW_AXPBY, .n = n, .alpha = alpha, .beta = beta, .a = x, .b = y, .out = out};
  ew_run(be, &e, 3.0);
  return AC_OK;
}

static int cpu_affine(ac_backend *be, size_t n, float alpha, const float *x, float beta,
                      float *out) {
  ew_args e = {.kind = EW_AFFINE, .n = n, .alpha = alpha, .beta = beta, .a = x, .out = out};
  ew_run(be, &e, 2.0);
  return AC_OK;
}

/* GCC keeps a clamp followed by arithmetic as a branch (so the loop stays scalar) while
 * floating-point traps are honoured; nothing here reads the exception flags. */
#if defined(__GNUC__) && !defined(__clang__)
#define AC__CPU_VEC __attribute__((optimize("no-trapping-math")))
#else
#define AC__CPU_VEC
#endif

/* The exp-bound loops (GELU, softmax) are compute-bound: on x86-64, GCC also compiles them
 * for AVX2 and picks the clone at load time (ifunc). Same operations, no FMA contraction
 * (ISO C mode) and no reductions, so both clones compute the same values. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define AC__CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define AC__CPU_CLONES
#endif

/* e^x for x in [-87, 89] (callers clamp), written to vectorise: x = n ln2 + r with
 * |r| <= ln2/2 (n rounded by the 1.5 * 2^23 trick, ln2 split in two so that n ln2 is exact
 * enough), e^r by the degree-7 minimax polynomial of the classic single-precision expf, and
 * 2^n built in the exponent bits. Relative error about 2 ulp; x >= 88.4 gives +Inf
 * (n = 128 lands in the exponent of Inf), the overflow GELU relies on. */
AC__CPU_VEC static inline float exp_poly(float x) {
  float t = x * 1.44269504088896341f + 12582912.0f;
  float n = t - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  uint32_t tb; /* t's low mantissa bits hold n + 2^22: no float-to-int conversion */
  memcpy(&tb, &t, sizeof tb);
  /* Unsigned, so a NaN input (garbage bits, NaN result anyway) is not signed overflow. */
  uint32_t bits = (tb - 0x4B400000u + 127u) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* GELU, tanh form, as x s(2u) with s the logistic function and u = sqrt(2/pi) (x + c x^3):
 * 0.5 (1 + tanh u) = s(2u) = 1 / (1 + e), e = e^(-2u). This form keeps a small relative
 * error also where GELU is tiny (x very negative), unlike 1 + tanh(u), which cancels there.
 * The clamps let NaN through; e overflows to Inf (s = 0) below x = -5.9 or so. Accuracy
 * against the same formula in double (test_backend's gelu_accuracy): relative error under
 * 3e-7 (1 + |2u|) (the |2u| part is the rounding of u itself, amplified by e^(-2u)). */
AC__CPU_VEC static inline float gelu_exp(float x) {
  float m2u = -2.0f * AC__GELU_S * (x + AC__GELU_C * x * x * x);
  m2u = m2u < -87.0f ? -87.0f : m2u;
  m2u = m2u > 89.0f ? 89.0f : m2u;
  return exp_poly(m2u);
}

AC__CPU_CLONES AC__CPU_VEC static void gelu_forward(size_t n, const float *x, float *out) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i];
    out[i] = v / (1.0f + gelu_exp(v));
  }
}

/* d/dx [x s(2u)] = s + 2 x s (1 - s) u', with 1 - s = e s (no cancellation as s -> 1). The
 * second term is below 1e-33 for |x| > 40, so x is clamped there to keep x u' finite, and
 * it is 0 where s is (e = Inf would make it Inf * 0). */
AC__CPU_CLONES AC__CPU_VEC static void gelu_backward(size_t n, const float *x, const float *dy,
                                                     float *dx) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i], e = gelu_exp(v), s = 1.0f / (1.0f + e);
    float xc = v < -40.0f ? -40.0f : v;
    xc = xc > 40.0f ? 40.0f : xc;
    float du = AC__GELU_S * (1.0f + 3.0f * AC__GELU_C * xc * xc);
    float term = 2.0f * xc * (e * s * s) * du;
    dx[i] = dy[i] * (s + (s == 0.0f ? 0.0f : term));
  }
}

static void unary_range(ac_unary_op op, size_t n, const float *x, float *out) {
  switch (op) {
    case AC_UNARY_RELU:
      for (size_t i = 0; i < n; i++) out[i] = x[i] > 0.0f ? x[i] : 0.0f;
      break;
    case AC_UNARY_GELU:
      gelu_forward(n, x, out);
      break;
    case AC_UNARY_SQUARE:
      for (size_t i = 0; i < n; i++) out[i] = x[i] * x[i];
      break;
    case AC_UNARY_NEG:
      for (size_t i = 0; i < n; i++) out[i] = -x[i];
      break;
    default: /* libm ops: not on a hot path */
      for (size_t i = 0; i < n; i++) out[i] = ac__unary_value(op, x[i]);
      break;
  }
}

static void unary_backward_range(ac_unary_op op, size_t n, const float *x, const float *dy,
                                 float *dx) {
  switch (op) {
    case AC_UNARY_RELU:
      for (size_t i = 0; i < n; i++) {
        float d = dy[i]; /* loaded unconditionally, so that the select vectorises */
        dx[i] = x[i] > 0.0f ? d : 0.0f;
      }
      break;
    case AC_UNARY_GELU:
      gelu_backward(n, x, dy, dx);
      break;
    default:
      for (size_t i = 0; i < n; i++) dx[i] = dy[i] * ac__unary_deriv(op, x[i]);
      break;
  }
}

static void ew_slice(void *ctx, size_t blo, size_t bhi, int thread) {
  const ew_args *e = ctx;
  size_t lo, len;
  ew_range(e->n, blo, bhi, &lo, &len);
  const float *a = e->a + lo, *b = e->b != NULL ? e->b + lo : NULL;
  float *out = e->out + lo;
  switch (e->kind) {
    case EW_BINARY:
      binary_vv((ac_binary_op)e->op, len, a, b, out);
      break;
    case EW_AXPBY:
      axpby_range(len, e->alpha, a, e->beta, b, out);
      break;
    case EW_AFFINE:
      for (size_t i = 0; i < len; i++) out[i] = e->alpha * a[i] + e->beta;
      break;
    case EW_UNARY:
      unary_range((ac_unary_op)e->op, len, a, out);
      break;
    default:
      unary_backward_range((ac_unary_op)e->op, len, a, b, out);
      break;
  }
}

static int cpu_unary(ac_backend *be, ac_unary_op op, size_t n, const float *x, float *out) {
  ew_args e = {.kind = EW_UNARY, .op = (int)op, .n = n, .a = x, .out = out};
  ew_run(be, &e, op == AC_UNARY_RELU || op == AC_UNARY_SQUARE || op == AC_UNARY_NEG ? 2.0 : 16.0);
  return AC_OK;
}

static int cpu_unary_backward(ac_backend *be, ac_unary_op op, size_t n, const float *x,
                              const float *dy, float *dx) {
  ew_args e = {.kind = EW_UNARY_BACKWARD, .op = (int)op, .n = n, .a = x, .b = dy, .out = dx};
  ew_run(be, &e, op == AC_UNARY_RELU ? 3.0 : 16.0);
  return AC_OK;
}

/* Rows of inner values against one scalar each, split by rows across the pool; inner == 1
 * (a bias over rows of mid values) runs along mid instead, so that both shapes have a long
 * contiguous loop. */
typedef struct bcast_args {
  ac_binary_op op;
  size_t mid, inner;
  const float *x, *v;
  float *out;
} bcast_args;

static void bcast_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const bcast_args *a = ctx;
  for (size_t r = lo; r < hi; r++) {
    if (a->inner == 1) {
      binary_vv(a->op, a->mid, a->x + r * a->mid, a->v, a->out + r * a->mid);
    } else {
      size_t base = r * a->inner;
      binary_vs(a->op, a->inner, a->x + base, a->v[r % a->mid], a->out + base);
    }
  }
}

static int cpu_bcast(ac_backend *be, ac_binary_op op, size_t outer, size_t mid, size_t inner,
                     const float *x, const float *v, float *out) {
  bcast_args a = {op, mid, inner, x, v, out};
  size_t rows = inner == 1 ? outer : outer * mid;
  par_for(pool_of(be), rows, 2.0 * (double)(outer * mid * inner), bcast_slice, &a);
  return AC_OK;
}

/* Sum (or sum of squares) of one contiguous row in double, in 8 interleaved partial sums so
 * that the loop vectorises (the order differs from a left-to-right sum; all in double). */
static double row_sum(size_t n, const float *x, int squares) {
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  if (squares) {
    for (; i + 8 <= n; i += 8)
      for (size_t j = 0; j < 8; j++) part[j] += (double)x[i + j] * (double)x[i + j];
  } else {
    for (; i + 8 <= n; i += 8)
      for (size_t j = 0; j < 8; j++) part[j] += (double)x[i + j];
  }
  double acc =
      ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; i < n; i++) acc += squares ? (double)x[i] * (double)x[i] : (double)x[i];
  return acc;
}

/* acc[m] = the sums of rows (o, m) over o, one m at a time (split across the pool: each sum
 * is made by one thread in a fixed order). */
typedef struct reduce_args {
  size_t outer, mid, inner;
  int squares;
  const float *x;
  double *acc;
} reduce_args;

static void reduce_rows_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const reduce_args *a = ctx;
  for (size_t m = lo; m < hi; m++)
    for (size_t o = 0; o < a->outer; o++)
      a->acc[m] += row_sum(a->inner, a->x + (o * a->mid + m) * a->inner, a->squares);
}

/* Into per-mid double accumulators. Rows of inner values are summed along the row;
 * inner == 1 (bias gradients reduce down columns) adds whole rows of mid values at once,
 * so both stream through x once with a contiguous inner loop. */
static int cpu_reduce(ac_backend *be, ac_reduce_op op, size_t outer, size_t mid, size_t inner,
                      float alpha, const float *x, float beta, float *out) {
  double *acc = malloc(mid * sizeof *acc);
  if (acc == NULL) return AC_ENOMEM;
  for (size_t m = 0; m < mid; m++) acc[m] = op == AC_REDUCE_MAX ? -INFINITY : 0.0;
  if (op == AC_REDUCE_MAX) {
    for (size_t o = 0; o < outer; o++)
      for (size_t m = 0; m < mid; m++) {
        const float *row = x + (o * mid + m) * inner;
        double a = acc[m];
        for (size_t i = 0; i < inner; i++) {
          double e = row[i];
          a = e > a || isnan(e) ? e : a;
        }
        acc[m] = a;
      }
  } else if (inner == 1) {
    int sq = op != AC_REDUCE_SUM;
    for (size_t o = 0; o < outer; o++) {
      const float *row = x + o * mid;
      if (sq)
        for (size_t m = 0; m < mid; m++) acc[m] += (double)row[m] * (double)row[m];
      else
        for (size_t m = 0; m < mid; m++) acc[m] += (double)row[m];
    }
  } else {
    reduce_args a = {outer, mid, inner, op != AC_REDUCE_SUM, x, acc};
    par_for(pool_of(be), mid, (double)(outer * mid * inner), reduce_rows_slice, &a);
  }
  for (size_t m = 0; m < mid; m++) {
    double a = op == AC_REDUCE_NORM2 ? sqrt(acc[m]) : acc[m];
    float r = alpha * (float)a;
    out[m] = beta == 0.0f ? r : r + beta * out[m];
  }
  free(acc);
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Batch norm's per-channel passes. The reductions split the channels across the pool (one
 * thread sums a whole channel, in a fixed order); the maps split the (outer, mid) rows. */

typedef struct chan_args {
  size_t outer, mid, inner;
  const float *x, *y, *mask, *p0, *p1, *p2, *res;
  float *out, *out0, *out1;
  int relu;
  int isa; /* the backend's variant (ac_cpu_isa), for the row sums */
} chan_args;

/* Batch norm's row sums, one row of a channel at a time, in double: 16 partials of each
 * sum, element i going to partial i mod 16, totalled pairwise at the end. The passes were
 * compute-bound (a double add per float in SSE2's 2-double vectors: the masked
 * gradient-sum pass cost 7x the dx pass, which reads as much), so the whole 16-float blocks
 * run on AVX2 or AVX-512F where the backend's variant has it (ac_cpu_isa, as the direct
 * convs). Every variant makes the same sums in the same order (a float times a float is
 * exact in double, so a fused multiply-add rounds as the separate add does): the same bits
 * for any variant and thread count. */
#define ROW_LANES 16

/* The partials' total, pairwise (p is overwritten). */
static double lanes_total(double *p) {
  for (size_t w = ROW_LANES / 2; w >= 1; w /= 2)
    for (size_t j = 0; j < w; j++) p[j] += p[j + w];
  return p[0];
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define ROW_HAVE_SIMD 1

/* The pairwise total of 16 double lanes held as lo (lanes 0-7) and hi (8-15): lane j + 8
 * into j, then j + 4, j + 2, j + 1: lanes_total's adds in its order, the same bits. */
__attribute__((target("avx512f"))) static double lanes_total_avx512(__m512d lo, __m512d hi) {
  __m512d s8 = _mm512_add_pd(lo, hi);
  __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
  __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

/* One row's sums (row_grad_sums) on AVX-512F, its 16 partials in registers: g = dy, zeroed
 * where mask <= 0 (mask not NULL), to gout when not NULL; sg += the total of g, sgx += the
 * total of g (x - c). */
__attribute__((target("avx512f"))) static void row_grad_sums_avx512(size_t n, const float *dy,
                                                                    const float *mask,
                                                                    const float *x, float c,
                                                                    float *gout, double *sg,
                                                                    double *sgx) {
  __m512d p0 = _mm512_setzero_pd(), p1 = p0, q0 = p0, q1 = p0;
  __m512 vc = _mm512_set1_ps(c), zero = _mm512_setzero_ps();
  size_t i = 0;
  for (; i + ROW_LANES <= n; i += ROW_LANES) {
    __m512 g = _mm512_loadu_ps(dy + i);
    if (mask != NULL)
      g = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_loadu_ps(mask + i), zero, _CMP_GT_OQ), g);
    if (gout != NULL) _mm512_storeu_ps(gout + i, g);
    __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), vc);
    __m512d glo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    __m512d ghi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    __m512d dlo = _mm512_cvtps_pd(_mm512_castps512_ps256(d));
    __m512d dhi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
    p0 = _mm512_add_pd(p0, glo);
    p1 = _mm512_add_pd(p1, ghi);
    q0 = _mm512_fmadd_pd(glo, dlo, q0);
    q1 = _mm512_fmadd_pd(ghi, dhi, q1);
  }
  if (i < n) { /* the row's last n - i < 16 floats, into lanes 0..n-i-1 alone, as in C */
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
    __mmask8 klo = (__mmask8)(k & 0xff), khi = (__mmask8)(k >> 8);
    __m512 g = _mm512_maskz_loadu_ps(k, dy + i);
    if (mask != NULL)
      g = _mm512_maskz_mov_ps(
          _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(k, mask + i), zero, _CMP_GT_OQ), g);
    if (gout != NULL) _mm512_mask_storeu_ps(gout + i, k, g);
    __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vc);
    __m512d glo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    __m512d ghi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    __m512d dlo = _mm512_cvtps_pd(_mm512_castps512_ps256(d));
    __m512d dhi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
    p0 = _mm512_mask_add_pd(p0, klo, p0, glo);
    p1 = _mm512_mask_add_pd(p1, khi, p1, ghi);
    q0 = _mm512_mask3_fmadd_pd(glo, dlo, q0, klo);
    q1 = _mm512_mask3_fmadd_pd(ghi, dhi, q1, khi);
  }
  *sg += lanes_total_avx512(p0, p1);
  *sgx += lanes_total_avx512(q0, q1);
}

/* Added into partials p and q of 16 lanes each: the row's whole 16-float blocks, g = dy
 * (masked, to gout) as above, p += g, q += g (x - c); returns how many floats they
 * covered. */
__attribute__((target("avx2,fma"))) static size_t row_grad_sums_avx2(size_t n, const float *dy,
                                                                     const float *mask,
                                                                     const float *x, float c,
                                                                     float *gout, double *p,
                                                                     double *q) {
  __m256d pa[4], qa[4];
  for (int k = 0; k < 4; k++) {
    pa[k] = _mm256_loadu_pd(p + 4 * k);
    qa[k] = _mm256_loadu_pd(q + 4 * k);
  }
  __m256 vc = _mm256_set1_ps(c), zero = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + ROW_LANES <= n; i += ROW_LANES)
    for (int h = 0; h < 2; h++) {
      size_t o = i + 8 * (size_t)h;
      __m256 g = _mm256_loadu_ps(dy + o);
      if (mask != NULL)
        g = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(mask + o), zero, _CMP_GT_OQ), g);
      if (gout != NULL) _mm256_storeu_ps(gout + o, g);
      __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + o), vc);
      __m256d glo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
      __m256d ghi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
      __m256d dlo = _mm256_cvtps_pd(_mm256_castps256_ps128(d));
      __m256d dhi = _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1));
      pa[2 * h] = _mm256_add_pd(pa[2 * h], glo);
      pa[2 * h + 1] = _mm256_add_pd(pa[2 * h + 1], ghi);
      qa[2 * h] = _mm256_fmadd_pd(glo, dlo, qa[2 * h]);
      qa[2 * h + 1] = _mm256_fmadd_pd(ghi, dhi, qa[2 * h + 1]);
    }
  for (int k = 0; k < 4; k++) {
    _mm256_storeu_pd(p + 4 * k, pa[k]);
    _mm256_storeu_pd(q + 4 * k, qa[k]);
  }
  return i;
}
#else
#define ROW_HAVE_SIMD 0
#endif

/* One row of batch norm's backward sums: g = dy, or 0 where mask <= 0 (mask not NULL),
 * written to gout when it is not NULL (gout may be dy); element i's g to partial i mod 16,
 * its g (x - c) to another 16, each totalled pairwise (lanes_total) and added to sg and
 * sgx. Every variant makes these adds in this order. */
static void row_grad_sums(int isa, size_t n, const float *dy, const float *mask, const float *x,
                          float c, float *gout, double *sg, double *sgx) {
#if ROW_HAVE_SIMD
  if (isa == AC_CPU_ISA_AVX512) {
    row_grad_sums_avx512(n, dy, mask, x, c, gout, sg, sgx);
    return;
  }
#endif
  double p[ROW_LANES] = {0}, q[ROW_LANES] = {0};
  size_t i = 0;
#if ROW_HAVE_SIMD
  if (isa == AC_CPU_ISA_AVX2) i = row_grad_sums_avx2(n, dy, mask, x, c, gout, p, q);
#else
  (void)isa;
#endif
  for (size_t j = 0; i < n; i++, j = (j + 1) % ROW_LANES) {
    float g = mask == NULL || mask[i] > 0.0f ? dy[i] : 0.0f;
    if (gout != NULL) gout[i] = g;
    p[j] += (double)g;
    q[j] += (double)g * (double)(x[i] - c);
  }
  *sg += lanes_total(p);
  *sgx += lanes_total(q);
}

/* s += the sum of x[0, n), q += the sum of its squares: the gradient sums of g = x about 0
 * (x - 0 is x, exactly). */
static void row_moments(int isa, size_t n, const float *x, double *s, double *q) {
  row_grad_sums(isa, n, x, NULL, x, 0.0f, NULL, s, q);
}

/* A channel's mean and biased variance from the double sums of its count values and of
 * their squares (clamped at 0). */
static void moments_finish(double s, double q, double count, float *mean, float *var) {
  double mu = count > 0 ? s / count : 0.0, v = count > 0 ? q / count - mu * mu : 0.0;
  *mean = (float)mu;
  *var = (float)(v > 0.0 ? v : 0.0);
}

static void moments_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const chan_args *a = ctx;
  for (size_t m = lo; m < hi; m++) {
    double s = 0.0, q = 0.0;
    for (size_t o = 0; o < a->outer; o++)
      row_moments(a->isa, a->inner, a->x + (o * a->mid + m) * a->inner, &s, &q);
    moments_finish(s, q, (double)(a->outer * a->inner), a->out0 + m, a->out1 + m);
  }
}

static int cpu_channel_moments(ac_backend *be, size_t outer, size_t mid, size_t inner,
                               const float *x, float *mean, float *var) {
  chan_args a = {.outer = outer,
                 .mid = mid,
                 .inner = inner,
                 .x = x,
                 .out0 = mean,
                 .out1 = var,
                 .isa = ((cpu_impl *)be->impl)->isa};
  par_for(pool_of(be), mid, (double)(outer * mid * inner), moments_slice, &a);
  return AC_OK;
}

AC__CPU_VEC static void affine_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const chan_args *a = ctx;
  for (size_t r = lo; r < hi; r++) {
    size_t m = r % a->mid, base = r * a->inner;
    float sc = a->p0[m], sh = a->p1[m];
    const float *x = a->x + base, *res = a->res != NULL ? a->res + base : NULL;
    float *y = a->out + base;
    if (res != NULL && a->relu)
      for (size_t i = 0; i < a->inner; i++) {
        float v = x[i] * sc + sh + res[i];
        y[i] = v > 0.0f ? v : 0.0f;
      }
    else if (res != NULL)
      for (size_t i = 0; i < a->inner; i++) y[i] = x[i] * sc + sh + res[i];
    else if (a->relu)
      for (size_t i = 0; i < a->inner; i++) {
        float v = x[i] * sc + sh;
        y[i] = v > 0.0f ? v : 0.0f;
      }
    else
      for (size_t i = 0; i < a->inner; i++) y[i] = x[i] * sc + sh;
  }
}

static int cpu_channel_affine(ac_backend *be, size_t outer, size_t mid, size_t inner,
                              const float *x, const float *scale, const float *shift,
                              const float *res, int relu, float *y) {
  chan_args a = {.outer = outer,
                 .mid = mid,
                 .inner = inner,
                 .x = x,
                 .p0 = scale,
                 .p1 = shift,
                 .res = res,
                 .relu = relu,
                 .out = y};
  par_for(pool_of(be), outer * mid, (double)(outer * mid * inner) * (res ? 3 : 2), affine_slice,
          &a);
  return AC_OK;
}

/* A channel's sums row by row, each row totalled (row_grad_sums) and added in row order:
 * the order ac_conv3x3_bn_grad's per-image sums are added in, so the same bits. */
static void grad_sums_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const chan_args *a = ctx;
  for (size_t m = lo; m < hi; m++) {
    double sg = 0.0, sgx = 0.0;
    for (size_t o = 0; o < a->outer; o++) {
      size_t base = (o * a->mid + m) * a->inner;
      row_grad_sums(a->isa, a->inner, a->y + base, a->mask != NULL ? a->mask + base : NULL,
                    a->x + base, a->p0[m], a->out != NULL ? a->out + base : NULL, &sg, &sgx);
    }
    a->out0[m] = (float)sg;
    a->out1[m] = (float)sgx;
  }
}

static int cpu_channel_grad_sums(ac_backend *be, size_t outer, size_t mid, size_t inner,
                                 const float *dy, const float *mask, const float *x,
                                 const float *center, float *gout, float *sum_g, float *sum_gx) {
  chan_args a = {.outer = outer,
                 .mid = mid,
                 .inner = inner,
                 .y = dy,
                 .mask = mask,
                 .x = x,
                 .p0 = center,
                 .out = gout,
                 .out0 = sum_g,
                 .out1 = sum_gx,
                 .isa = ((cpu_impl *)be->impl)->isa};
  par_for(pool_of(be), mid, (double)(outer * mid * inner) * 3, grad_sums_slice, &a);
  return AC_OK;
}

AC__CPU_VEC static void combine_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const chan_args *a = ctx;
  for (size_t r = lo; r < hi; r++) {
    size_t m = r % a->mid, base = r * a->inner;
    float ca = a->p0[m], cb = a->p1 != NULL ? a->p1[m] : 0.0f;
    float cc = a->p2 != NULL ? a->p2[m] : 0.0f;
    const float *dy = a->y + base, *x = a->x + base;
    float *dx = a->out + base;
    if (a->mask != NULL) {
      const float *mask = a->mask + base;
      for (size_t i = 0; i < a->inner; i++) {
        float g = dy[i];
        g = mask[i] > 0.0f ? g : 0.0f;
        dx[i] = ca * g + cb * x[i] + cc;
      }
    } else {
      for (size_t i = 0; i < a->inner; i++) dx[i] = ca * dy[i] + cb * x[i] + cc;
    }
  }
}

static int cpu_channel_combine(ac_backend *be, size_t outer, size_t mid, size_t inner,
                               const float *dy, const float *mask, const float *x, const float *a_,
                               const float *b, const float *c, float *dx) {
  chan_args a = {.outer = outer,
                 .mid = mid,
                 .inner = inner,
                 .y = dy,
                 .mask = mask,
                 .x = x,
                 .p0 = a_,
                 .p1 = b,
                 .p2 = c,
                 .out = dx};
  par_for(pool_of(be), outer * mid, (double)(outer * mid * inner) * (mask ? 4 : 3), combine_slice,
          &a);
  return AC_OK;
}

static int cpu_sum_to_host(ac_backend *be, size_t n, const float *x, int squares, double *out) {
  (void)be;
  double acc = 0.0;
  for (size_t i = 0; i < n; i++) acc += squares ? (double)x[i] * x[i] : (double)x[i];
  *out = acc;
  return AC_OK;
}

static int cpu_argmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, int32_t *idx) {
  (void)be;
  for (size_t r = 0; r < rows; r++) {
    const float *row = x + r * cols;
    size_t best = 0;
    for (size_t j = 1; j < cols; j++)
      if (row[j] > row[best]) best = j;
    idx[r] = (int32_t)best;
  }
  return AC_OK;
}

static int cpu_sample_rows(ac_backend *be, size_t rows, size_t cols, const float *probs,
                           const float *u, int32_t *labels) {
  (void)be;
  for (size_t r = 0; r < rows; r++) {
    const float *row = probs + r * cols;
    if (labels[r] < 0 || (size_t)labels[r] >= cols) continue; /* an ignored row */
    float sum = 0.0f;
    for (size_t j = 0; j < cols; j++) sum += row[j];
    if (!(sum > 0.0f) || !isfinite(sum)) continue;
    float target = u[r] * sum, acc = 0.0f;
    int32_t pick = -1;
    for (size_t j = 0; j < cols; j++) {
      acc += row[j];
      if (row[j] > 0.0f) pick = (int32_t)j; /* the last positive so far: rounding's answer */
      if (target < acc && row[j] > 0.0f) break;
    }
    labels[r] = pick;
  }
  return AC_OK;
}

/* e^x for every x <= 0 (softmax's shifted logits): exp_poly, with exact zeros below the
 * smallest normal result (masked entries are -Inf). NaN stays NaN. */
AC__CPU_CLONES AC__CPU_VEC static void exp_nonpos(size_t n, const float *x, float *y) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i], c = v < -87.0f ? -87.0f : v;
    float e = exp_poly(c);
    y[i] = v < -87.0f ? 0.0f : e;
  }
}

/* Softmax of one row; returns the log of the normaliser plus the max (the log-sum-exp).
 * The exponentials are exp_poly's (about 2 ulp); the sum is in double. */
static float softmax_row(size_t cols, const float *x, float *y) {
  float mx = -INFINITY;
  for (size_t j = 0; j < cols; j++) mx = x[j] > mx ? x[j] : mx;
  binary_vs(AC_BIN_SUB, cols, x, mx, y);
  exp_nonpos(cols, y, y);
  double sum = row_sum(cols, y, 0);
  float inv = (float)(1.0 / sum);
  for (size_t j = 0; j < cols; j++) y[j] *= inv;
  return mx + (float)log(sum);
}

static int cpu_softmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, float *y) {
  (void)be;
  for (size_t r = 0; r < rows; r++) softmax_row(cols, x + r * cols, y + r * cols);
  return AC_OK;
}

static int cpu_softmax_rows_backward(ac_backend *be, size_t rows, size_t cols, const float *y,
                                     const float *dy, float *dx) {
  (void)be;
  for (size_t r = 0; r < rows; r++) {
    const float *yr = y + r * cols, *dyr = dy + r * cols;
    float *dxr = dx + r * cols;
    double dot = 0.0;
    for (size_t j = 0; j < cols; j++) dot += (double)dyr[j] * yr[j];
    for (size_t j = 0; j < cols; j++) dxr[j] = yr[j] * (dyr[j] - (float)dot);
  }
  return AC_OK;
}

static int cpu_mask_causal(ac_backend *be, size_t batch, size_t t, float *x, float value) {
  (void)be;
  for (size_t b = 0; b < batch; b++)
    for (size_t i = 0; i < t; i++)
      for (size_t j = i + 1; j < t; j++) x[(b * t + i) * t + j] = value;
  return AC_OK;
}

static int cpu_xent_forward(ac_backend *be, size_t rows, size_t cols, const float *logits,
                            const int32_t *labels, float *probs, float *loss) {
  (void)be;
  for (size_t r = 0; r < rows; r++) {
    const float *x = logits + r * cols;
    int32_t label = labels[r];
    /* Read the label's logit before probs (which may alias logits) is written. */
    float target = label >= 0 && (size_t)label < cols ? x[label] : 0.0f;
    float lse = softmax_row(cols, x, probs + r * cols);
    loss[r] = label >= 0 && (size_t)label < cols ? lse - target : 0.0f;
  }
  return AC_OK;
}

static int cpu_xent_backward(ac_backend *be, size_t rows, size_t cols, const float *probs,
                             const int32_t *labels, float scale, float *dlogits) {
  (void)be;
  for (size_t r = 0; r < rows; r++) {
    int32_t label = labels[r];
    int counted = label >= 0 && (size_t)label < cols;
    for (size_t j = 0; j < cols; j++) {
      float onehot = counted && (size_t)label == j ? 1.0f : 0.0f;
      dlogits[r * cols + j] = counted ? scale * (probs[r * cols + j] - onehot) : 0.0f;
    }
  }
  return AC_OK;
}

static int cpu_layernorm_forward(ac_backend *be, size_t rows, size_t cols, float eps,
                                 const float *x, const float *gamma, const float *beta, float *y,
                                 float *mean, float *rstd) {
  (void)be;
  for (size_t r = 0; r < rows; r++) {
    const float *xr = x + r * cols;
    float *yr = y + r * cols;
    double s = 0.0, q = 0.0;
    for (size_t j = 0; j < cols; j++) s += xr[j];
    double mu = s / (double)cols;
    for (size_t j = 0; j < cols; j++) q += (xr[j] - mu) * (xr[j] - mu);
    float m = (float)mu, rs = (float)(1.0 / sqrt(q / (double)cols + eps));
    mean[r] = m;
    rstd[r] = rs;
    for (size_t j = 0; j < cols; j++)
      yr[j] = (xr[j] - m) * rs * gamma[j] + (beta != NULL ? beta[j] : 0.0f);
  }
  return AC_OK;
}

static int cpu_layernorm_backward(ac_backend *be, size_t rows, size_t cols, const float *x,
                                  const float *gamma, const float *mean, const float *rstd,
                                  const float *dy, float *dx, float *dgamma, float *dbeta) {
  (void)be;
  for (size_t r = 0; r < rows; r++) {
    const float *xr = x + r * cols, *dyr = dy + r * cols;
    float *dxr = dx + r * cols;
    double sg = 0.0, sgx = 0.0;
    for (size_t j = 0; j < cols; j++) {
      float xhat = (xr[j] - mean[r]) * rstd[r];
      float g = dyr[j] * gamma[j];
      sg += g;
      sgx += (double)g * xhat;
      dgamma[j] += dyr[j] * xhat;
      if (dbeta != NULL) dbeta[j] += dyr[j];
    }
    float mg = (float)(sg / (double)cols), mgx = (float)(sgx / (double)cols);
    for (size_t j = 0; j < cols; j++) {
      float xhat = (xr[j] - mean[r]) * rstd[r];
      dxr[j] = rstd[r] * (dyr[j] * gamma[j] - mg - xhat * mgx);
    }
  }
  return AC_OK;
}

static int cpu_gather_rows(ac_backend *be, size_t n, size_t cols, const float *table,
                           size_t table_rows, const int32_t *idx, float *out) {
  (void)be;
  for (size_t r = 0; r < n; r++) {
    if (idx[r] >= 0 && (size_t)idx[r] < table_rows)
      memcpy(out + r * cols, table + (size_t)idx[r] * cols, cols * sizeof(float));
    else
      memset(out + r * cols, 0, cols * sizeof(float));
  }
  return AC_OK;
}

static int cpu_scatter_add_rows(ac_backend *be, size_t n, size_t cols, const float *src,
                                const int32_t *idx, float *table, size_t table_rows) {
  (void)be;
  for (size_t r = 0; r < n; r++) {
    if (idx[r] < 0 || (size_t)idx[r] >= table_rows) continue;
    float *dst = table + (size_t)idx[r] * cols;
    for (size_t j = 0; j < cols; j++) dst[j] += src[r * cols + j];
  }
  return AC_OK;
}

/* Input coordinate of output coordinate o and kernel tap p: o*stride + p - pad, which is
 * negative (as a wrapped size_t: >= size) in the padding. */
static size_t in_coord(size_t o, size_t stride, size_t p, size_t pad) {
  return o * stride + p - pad;
}

/* The output columns xo whose input column xo*stride + q - pad lies inside [0, w):
 * [*lo, *hi), so that a row of the column matrix is zeros, a (strided) copy, zeros. */
static void valid_cols(size_t w, size_t ow, size_t stride, size_t q, size_t pad, size_t *lo,
                       size_t *hi) {
  size_t l = q >= pad ? 0 : (pad - q + stride - 1) / stride;
  size_t h = w + pad <= q ? 0 : (w + pad - q + stride - 1) / stride;
  *lo = l < ow ? l : ow;
  *hi = h < ow ? h : ow;
  if (*hi < *lo) *hi = *lo;
}

/* Where row r = (ch, p, q) of image b starts in the column matrix: ac_im2col's layout
 * (n, ckk, ohw) or ac_im2col_batch's (ckk, n ohw), where image b's outputs sit at column
 * b ohw of rows n ohw long. */
static size_t col_row(const ac_conv2d_geom *g, size_t ohw, int merged, size_t b, size_t r) {
  size_t ckk = g->c * g->kh * g->kw;
  return merged ? r * g->n * ohw + b * ohw : (b * ckk + r) * ohw;
}

/* Tap (p, q) of a stride-1 conv whose output rows are as long as the input's (ow == w, a
 * "same" conv): its oh x w plane of the column matrix is the input plane shifted by p - pad_h
 * rows and q - pad_w columns, so the valid rows are ONE contiguous copy (a long memcpy
 * instead of oh short row loops, which cost im2col ~3x here); the columns that wrapped into
 * the neighbouring row and the rows in the padding are zeroed after. lo, hi: the valid
 * output columns (valid_cols). */
static void im2col_plane_same(const ac_conv2d_geom *g, size_t oh, size_t p, size_t q, size_t lo,
                              size_t hi, const float *plane, float *dst) {
  size_t w = g->w, ylo = p >= g->pad_h ? 0 : g->pad_h - p;
  size_t yhi = g->h + g->pad_h > p ? g->h + g->pad_h - p : 0;
  yhi = yhi < oh ? yhi : oh;
  if (ylo >= yhi || lo >= hi) {
    memset(dst, 0, oh * w * sizeof *dst);
    return;
  }
  size_t first = ylo * w + lo, last = (yhi - 1) * w + hi; /* dst range [first, last) */
  memset(dst, 0, first * sizeof *dst);
  memcpy(dst + first, plane + (ylo + p - g->pad_h) * w + (lo + q - g->pad_w),
         (last - first) * sizeof *dst);
  memset(dst + last, 0, (oh * w - last) * sizeof *dst);
  for (size_t y = ylo; y < yhi; y++) {
    for (size_t i = 0; i < lo; i++) dst[y * w + i] = 0.0f;
    for (size_t i = hi; i < w; i++) dst[y * w + i] = 0.0f;
  }
}

/* One row of the column matrix per (channel, tap) and image. Each output row y is one input
 * row (or zeros in the padding), copied over its valid columns. Images [b_lo, b_hi) only,
 * so that workers can split a batch: every image's columns are written by exactly one
 * call. */
static void im2col_images(const ac_conv2d_geom *g, size_t oh, size_t ow, int merged, const float *x,
                          float *col, size_t b_lo, size_t b_hi) {
  size_t ohw = oh * ow, sw = g->stride_w;
  int same = sw == 1 && g->stride_h == 1 && ow == g->w;
  for (size_t b = b_lo; b < b_hi; b++)
    for (size_t ch = 0; ch < g->c; ch++) {
      const float *plane = x + (b * g->c + ch) * g->h * g->w;
      for (size_t p = 0; p < g->kh; p++)
        for (size_t q = 0; q < g->kw; q++) {
          float *row = col + col_row(g, ohw, merged, b, (ch * g->kh + p) * g->kw + q);
          size_t lo, hi;
          valid_cols(g->w, ow, sw, q, g->pad_w, &lo, &hi);
          if (same) {
            im2col_plane_same(g, oh, p, q, lo, hi, plane, row);
            continue;
          }
          for (size_t y = 0; y < oh; y++) {
            float *dst = row + y * ow;
            size_t iy = in_coord(y, g->stride_h, p, g->pad_h);
            if (iy >= g->h || hi == lo) {
              memset(dst, 0, ow * sizeof *dst);
              continue;
            }
            /* Short rows (a few dozen values): plain loops beat library calls here. */
            const float *src = plane + iy * g->w + (lo * sw + q - g->pad_w);
            for (size_t i = 0; i < lo; i++) dst[i] = 0.0f;
            if (sw == 1)
              for (size_t i = 0; i < hi - lo; i++) dst[lo + i] = src[i];
            else
              for (size_t i = 0; i < hi - lo; i++) dst[lo + i] = src[i * sw];
            for (size_t i = hi; i < ow; i++) dst[i] = 0.0f;
          }
        }
    }
}

/* The transpose of im2col for images [b_lo, b_hi): every row segment of the column matrix
 * added back over its valid columns into the image, which is zeroed first. */
static void col2im_images(const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
                          const float *col, float *x, size_t b_lo, size_t b_hi) {
  size_t ohw = oh * ow, sw = g->stride_w, chw = g->c * g->h * g->w;
  memset(x + b_lo * chw, 0, (b_hi - b_lo) * chw * sizeof(float));
  for (size_t b = b_lo; b < b_hi; b++)
    for (size_t ch = 0; ch < g->c; ch++) {
      float *plane = x + (b * g->c + ch) * g->h * g->w;
      for (size_t p = 0; p < g->kh; p++)
        for (size_t q = 0; q < g->kw; q++) {
          const float *row = col + col_row(g, ohw, merged, b, (ch * g->kh + p) * g->kw + q);
          size_t lo, hi;
          valid_cols(g->w, ow, sw, q, g->pad_w, &lo, &hi);
          for (size_t y = 0; y < oh; y++) {
            size_t iy = in_coord(y, g->stride_h, p, g->pad_h);
            if (iy >= g->h || hi == lo) continue;
            const float *src = row + y * ow + lo;
            float *dst = plane + iy * g->w + (lo * sw + q - g->pad_w);
            if (sw == 1)
              for (size_t i = 0; i < hi - lo; i++) dst[i] += src[i];
            else
              for (size_t i = 0; i < hi - lo; i++) dst[i * sw] += src[i];
          }
        }
    }
}

typedef struct lower_args {
  const ac_conv2d_geom *g;
  size_t oh, ow;
  int merged;
  const float *src;
  float *dst;
} lower_args;

static void im2col_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const lower_args *a = ctx;
  im2col_images(a->g, a->oh, a->ow, a->merged, a->src, a->dst, lo, hi);
}

static void col2im_slice(void *ctx, size_t lo, size_t hi, int thread) {
  const lower_args *a = ctx;
  col2im_images(a->g, a->oh, a->ow, a->merged, a->src, a->dst, lo, hi);
}

/* Both split the batch by images across the pool. */
static void lower(ac_backend *be, const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
                  const float *src, float *dst, par_fn slice) {
  lower_args a = {g, oh, ow, merged, src, dst};
  par_for(pool_of(be), g->n, (double)(g->n * g->c * g->kh * g->kw * oh * ow), slice, &a);
}

static int cpu_im2col(ac_backend *be, const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
                      const float *x, float *col) {
  lower(be, g, oh, ow, merged, x, col, im2col_slice);
  return AC_OK;
}

static int cpu_col2im(ac_backend *be, const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
                      const float *col, float *x) {
  lower(be, g, oh, ow, merged, col, x, col2im_slice);
  return AC_OK;
}

static int cpu_pool2d_forward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, size_t oh,
                              size_t ow, const float *x, float *y, int32_t *argmax) {
  (void)be;
  float inv = 1.0f / (float)(g->kh * g->kw);
  for (size_t pl = 0; pl < g->n * g->c; pl++) {
    const float *plane = x + pl * g->h * g->w;
    for (size_t yo = 0; yo < oh; yo++)
      for (size_t xo = 0; xo < ow; xo++) {
        float best = -INFINITY, sum = 0.0f;
        size_t besti = SIZE_MAX;
        for (size_t p = 0; p < g->kh; p++)
          for (size_t q = 0; q < g->kw; q++) {
            size_t iy = in_coord(yo, g->stride_h, p, g->pad_h);
            size_t ix = in_coord(xo, g->stride_w, q, g->pad_w);
            if (iy >= g->h || ix >= g->w) continue;
            float v = plane[iy * g->w + ix];
            sum += v;
            if (besti == SIZE_MAX || v > best) {
              best = v;
              besti = iy * g->w + ix;
            }
          }
        size_t o = (pl * oh + yo) * ow + xo;
        y[o] = op == AC_POOL_MAX ? best : sum * inv;
        if (argmax != NULL) argmax[o] = (int32_t)besti;
      }
  }
  return AC_OK;
}

static int cpu_pool2d_backward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, size_t oh,
                               size_t ow, const float *dy, const int32_t *argmax, float *dx) {
  (void)be;
  size_t hw = g->h * g->w;
  float inv = 1.0f / (float)(g->kh * g->kw);
  memset(dx, 0, g->n * g->c * hw * sizeof(float));
  for (size_t pl = 0; pl < g->n * g->c; pl++) {
    float *plane = dx + pl * hw;
    for (size_t yo = 0; yo < oh; yo++)
      for (size_t xo = 0; xo < ow; xo++) {
        size_t o = (pl * oh + yo) * ow + xo;
        if (op == AC_POOL_MAX) {
          /* argmax comes from device memory: an index outside the plane is ignored. */
          if (argmax[o] >= 0 && (size_t)argmax[o] < hw) plane[argmax[o]] += dy[o];
          continue;
        }
        for (size_t p = 0; p < g->kh; p++)
          for (size_t q = 0; q < g->kw; q++) {
            size_t iy = in_coord(yo, g->stride_h, p, g->pad_h);
            size_t ix = in_coord(xo, g->stride_w, q, g->pad_w);
            if (iy < g->h && ix < g->w) plane[iy * g->w + ix] += dy[o] * inv;
          }
      }
  }
  return AC_OK;
}

static int cpu_rand(ac_backend *be, int dist, uint64_t seed, uint64_t offset, size_t n, float a,
                    float b, float *out) {
  (void)be;
  for (size_t i = 0; i < n; i++) out[i] = ac__rand_value(dist, seed, offset + i, a, b);
  return AC_OK;
}

static int cpu_adamw_update(ac_backend *be, size_t n, float *p, const float *g, float *m, float *v,
                            float lr, float beta1, float beta2, float eps, float wd, float bc1,
                            float bc2) {
  (void)be;
  for (size_t i = 0; i < n; i++) {
    m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
    v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
    float mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
  }
  return AC_OK;
}

/* The expressions of cpu_axpby, cpu_binary, cpu_affine and the square root, in the order
 * Shampoo's unfused chain applies them: bit for bit the same results. accel builds with
 * -fno-math-errno (accel/meson.build), so GCC vectorises the loop, square root included
 * (sqrtps; with errno it stayed scalar sqrtss). */
static int cpu_moment_graft(ac_backend *be, size_t n, const float *g, float *f, float *v, float *x,
                            float *d, const ac_moment_graft_args *a) {
  (void)be;
  const ac_moment_graft_args k = *a; /* a copy: the stores below cannot alias it */
  for (size_t i = 0; i < n; i++) {
    const float gi = g[i], fi = k.f_new * gi + k.f_keep * f[i];
    const float xi = k.x_g == 0.0f ? k.x_f * fi : k.x_g * gi + k.x_f * fi;
    const float vi = k.v_new * (gi * gi) + k.v_keep * v[i];
    f[i] = fi;
    v[i] = vi;
    x[i] = xi;
    d[i] = xi / (sqrtf(k.v_scale * vi) + k.eps);
  }
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Direct 3x3 convolutions (stride 1, padding 1), AVX2 + FMA or AVX-512F, no column matrix. The 3x3
 * convs of a small ResNet have 16-64 channels: as im2col + gemm their products are skinny
 * (M = 16-64) and the column matrix (9x the activations) is written and read on every
 * pass; here the input is copied once into a padded layout and every tap is a shifted
 * read of it.
 *
 * The "tall" layout of nb images of one channel: rows of wq = w + 1 floats, image b in rows
 * [b (h + 1), (b + 1)(h + 1)), its pixel (y, x) at b is + (y + 1) wq + x + 1 with is =
 * (h + 1) wq; everything else is zero: column 0 of each row (the left padding, and the
 * right padding of the row before) and row 0 of each image (the top padding, and the
 * bottom padding of the image before), then one more zero row and the slack of the last
 * vector. The output (y, x) of image b is position j = b is + y wq + x, and tap (p, q)
 * reads position j + p wq + q: a conv over the whole chunk is one run of vectors over j.
 * Positions with x == w or y == h are computed and thrown away (1/wq + 1/(h+1) of the
 * work: 7% at 28x28, 27% at 7x7). The positions are covered by vectors of vw floats: 8
 * (AVX2) or 16 (AVX-512F), the variant chosen once per backend (cpu_impl.isa). */

typedef struct c3_geom {
  size_t h, w, wq, is; /* image height, width; row stride w + 1; image stride (h + 1) wq */
} c3_geom;

static c3_geom c3_geom_of(size_t h, size_t w) {
  c3_geom g = {h, w, w + 1, (h + 1) * (w + 1)};
  return g;
}

/* Positions of nb images in whole vectors of vw floats. */
static size_t c3_nvec(const c3_geom *g, size_t nb, size_t vw) {
  return (nb * g->is + vw - 1) / vw;
}

/* Floats of one channel of nb images in the tall layout: every read of the last vector's
 * taps (up to vw nvec - 1 + 2 wq + 2) stays inside; a multiple of 16 (64-byte rows). */
static size_t c3_chan_len(const c3_geom *g, size_t nb, size_t vw) {
  return (c3_nvec(g, nb, vw) * vw + 2 * g->wq + 2 + 15) / 16 * 16;
}

/* wp[ob][ch][t][i] = W[4 ob + i][ch][t] for kk taps per channel pair (9, or 1 for a 1x1
 * conv): the 4 output channels of a block side by side, so that a tap's 4 weights are
 * consecutive broadcasts. */
static void c3_pack_weights(size_t c, size_t oc, size_t kk, const float *w, float *wp) {
  for (size_t o = 0; o < oc; o++)
    for (size_t ch = 0; ch < c; ch++)
      for (size_t t = 0; t < kk; t++)
        wp[((o / 4 * c + ch) * kk + t) * 4 + o % 4] = w[(o * c + ch) * kk + t];
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define C3_HAVE_KERNELS 1
#define C3_TARGET       __attribute__((target("avx2,fma")))

/* dst[0, n) = src[0, n): rows of 7-64 floats, where a memcpy call per row cost more than
 * the copy (it was most of the packing's time); the tail through a mask. */
C3_TARGET static void c3_copy(float *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
  if (i < n) {
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)), idx);
    _mm256_maskstore_ps(dst + i, mask, _mm256_maskload_ps(src + i, mask));
  }
}

/* dst[0, n) = src[0, n) + res[0, n) (res may be dst). */
C3_TARGET static void c3_copy_add(float *dst, const float *src, const float *res, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(src + i), _mm256_loadu_ps(res + i)));
  for (; i < n; i++) dst[i] = src[i] + res[i];
}

/* NAME(g, nb, src, sstride, off, dst, len): one channel of nb images (image b's plane at
 * src + b sstride) into the tall layout with pixel (y, x) at b is + y wq + x + off (off =
 * wq + 1: as an input; 0: as an output, dy), zeros elsewhere in [0, len) (len 0: dst
 * already holds them, as when the forward packs the next image of its part at the same
 * places: the zeroing cost as much as the copy). Rows copied by COPY, inlined. */
#define C3_PACK(NAME, TARGET, COPY)                                                      \
  TARGET static void NAME(const c3_geom *g, size_t nb, const float *src, size_t sstride, \
                          size_t off, float *dst, size_t len) {                          \
    memset(dst, 0, len * sizeof *dst);                                                   \
    for (size_t b = 0; b < nb; b++)                                                      \
      for (size_t y = 0; y < g->h; y++)                                                  \
        COPY(dst + b * g->is + y * g->wq + off, src + b * sstride + y * g->w, g->w);     \
  }
C3_PACK(c3_pack_avx2, C3_TARGET, c3_copy)

/* out[i][0, 8 nv) = sum over ch, t < nt of wp[ch][t][i] xq[ch cl + j + off[t]], i < 4:
 * output channels 4 at a time against 3 vectors of positions (12 accumulators), then 1. */
C3_TARGET static void c3_fwd_block(size_t c, size_t cl, size_t nt, const size_t *off, size_t nv,
                                   const float *xq, const float *wp, float *out, size_t ldo) {
  size_t v = 0;
  for (; v + 3 <= nv; v += 3) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    for (size_t ch = 0; ch < c; ch++) {
      const float *xc = xq + ch * cl + v * 8, *wc = wp + ch * 4 * nt;
      for (size_t t = 0; t < nt; t++) {
        const float *xt = xc + off[t];
        __m256 x0 = _mm256_loadu_ps(xt), x1 = _mm256_loadu_ps(xt + 8);
        __m256 x2 = _mm256_loadu_ps(xt + 16);
        __m256 w = _mm256_broadcast_ss(wc + 4 * t);
        a00 = _mm256_fmadd_ps(w, x0, a00);
        a01 = _mm256_fmadd_ps(w, x1, a01);
        a02 = _mm256_fmadd_ps(w, x2, a02);
        w = _mm256_broadcast_ss(wc + 4 * t + 1);
        a10 = _mm256_fmadd_ps(w, x0, a10);
        a11 = _mm256_fmadd_ps(w, x1, a11);
        a12 = _mm256_fmadd_ps(w, x2, a12);
        w = _mm256_broadcast_ss(wc + 4 * t + 2);
        a20 = _mm256_fmadd_ps(w, x0, a20);
        a21 = _mm256_fmadd_ps(w, x1, a21);
        a22 = _mm256_fmadd_ps(w, x2, a22);
        w = _mm256_broadcast_ss(wc + 4 * t + 3);
        a30 = _mm256_fmadd_ps(w, x0, a30);
        a31 = _mm256_fmadd_ps(w, x1, a31);
        a32 = _mm256_fmadd_ps(w, x2, a32);
      }
    }
    float *o0 = out + v * 8;
    _mm256_storeu_ps(o0, a00);
    _mm256_storeu_ps(o0 + 8, a01);
    _mm256_storeu_ps(o0 + 16, a02);
    _mm256_storeu_ps(o0 + ldo, a10);
    _mm256_storeu_ps(o0 + ldo + 8, a11);
    _mm256_storeu_ps(o0 + ldo + 16, a12);
    _mm256_storeu_ps(o0 + 2 * ldo, a20);
    _mm256_storeu_ps(o0 + 2 * ldo + 8, a21);
    _mm256_storeu_ps(o0 + 2 * ldo + 16, a22);
    _mm256_storeu_ps(o0 + 3 * ldo, a30);
    _mm256_storeu_ps(o0 + 3 * ldo + 8, a31);
    _mm256_storeu_ps(o0 + 3 * ldo + 16, a32);
  }
  for (; v < nv; v++) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t ch = 0; ch < c; ch++) {
      const float *xc = xq + ch * cl + v * 8, *wc = wp + ch * 4 * nt;
      for (size_t t = 0; t < nt; t++) {
        __m256 x0 = _mm256_loadu_ps(xc + off[t]);
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(wc + 4 * t), x0, a0);
        a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(wc + 4 * t + 1), x0, a1);
        a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(wc + 4 * t + 2), x0, a2);
        a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(wc + 4 * t + 3), x0, a3);
      }
    }
    _mm256_storeu_ps(out + v * 8, a0);
    _mm256_storeu_ps(out + ldo + v * 8, a1);
    _mm256_storeu_ps(out + 2 * ldo + v * 8, a2);
    _mm256_storeu_ps(out + 3 * ldo + v * 8, a3);
  }
}

/* The 8 lanes of a in a fixed order. */
C3_TARGET static float c3_hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* NAME(nv, off, dq, ldd, xc, dw, ldw): dw[i][ch][t] += sum over j < VW nv of dq[i][j]
 * xc[j + off[t]] for the 4 output channels i of a block (rows of dq ldd apart, of dw ldw
 * apart), one input channel xc and NP NQ taps t (3 x 3, or the 1 of a 1x1 conv): per row p
 * of taps, 4 x NQ accumulators of VW lanes over all positions, then one sum each (HSUM, a
 * fixed order). One body for both ISAs and both tap counts. */
#define C3_WGRAD_BLOCK(NAME, TARGET, VEC, VW, ZERO, LOAD, FMA, HSUM, NP, NQ)         \
  TARGET static void NAME(size_t nv, const size_t *off, const float *dq, size_t ldd, \
                          const float *xc, float *dw, size_t ldw) {                  \
    for (size_t p = 0; p < NP; p++) {                                                \
      VEC a[4][NQ];                                                                  \
      for (size_t i = 0; i < 4; i++)                                                 \
        for (size_t q = 0; q < NQ; q++) a[i][q] = ZERO();                            \
      for (size_t v = 0; v < nv; v++) {                                              \
        VEC xv[NQ];                                                                  \
        for (size_t q = 0; q < NQ; q++) xv[q] = LOAD(xc + off[p * NQ + q] + v * VW); \
        for (size_t i = 0; i < 4; i++) {                                             \
          VEC d = LOAD(dq + i * ldd + v * VW);                                       \
          for (size_t q = 0; q < NQ; q++) a[i][q] = FMA(d, xv[q], a[i][q]);          \
        }                                                                            \
      }                                                                              \
      for (size_t i = 0; i < 4; i++)                                                 \
        for (size_t q = 0; q < NQ; q++) dw[i * ldw + p * NQ + q] += HSUM(a[i][q]);   \
    }                                                                                \
  }
C3_WGRAD_BLOCK(c3_wgrad_block, C3_TARGET, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps,
               _mm256_fmadd_ps, c3_hsum, 3, 3)
C3_WGRAD_BLOCK(c3_wgrad_block1, C3_TARGET, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps,
               _mm256_fmadd_ps, c3_hsum, 1, 1)

/* The AVX-512F variants: the same sums over vectors of 16 positions. */
#define C5_TARGET __attribute__((target("avx512f,avx2,fma")))

/* c3_copy and c3_copy_add with AVX-512F's masks: a row of 7 or 14 floats is one masked
 * load and store (AVX2's masked store, vmaskmovps, is slow on AMD's cores). */
C5_TARGET static void c5_copy(float *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
  if (i < n) {
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(dst + i, k, _mm512_maskz_loadu_ps(k, src + i));
  }
}

C5_TARGET static void c5_copy_add(float *dst, const float *src, const float *res, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(src + i), _mm512_loadu_ps(res + i)));
  if (i < n) {
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(
        dst + i, k,
        _mm512_add_ps(_mm512_maskz_loadu_ps(k, src + i), _mm512_maskz_loadu_ps(k, res + i)));
  }
}
C3_PACK(c5_pack, C5_TARGET, c5_copy)

/* out[i][16 v, 16 (v + NV)) for the 4 output channels i of a block, NV (1..6) vectors:
 * 4 NV accumulators (24 of the 32 registers at NV 6), NV loads and 4 broadcasts per tap. */
#define C5_FWD_VECS(NV)                                                                    \
  C5_TARGET static void c5_fwd_vecs##NV(size_t c, size_t cl, size_t nt, const size_t *off, \
                                        const float *xq, const float *wp, float *out,      \
                                        size_t ldo) {                                      \
    __m512 a[4][NV];                                                                       \
    for (size_t i = 0; i < 4; i++)                                                         \
      for (size_t k = 0; k < NV; k++) a[i][k] = _mm512_setzero_ps();                       \
    for (size_t ch = 0; ch < c; ch++) {                                                    \
      const float *xc = xq + ch * cl, *wc = wp + ch * 4 * nt;                              \
      for (size_t t = 0; t < nt; t++) {                                                    \
        __m512 xv[NV];                                                                     \
        for (size_t k = 0; k < NV; k++) xv[k] = _mm512_loadu_ps(xc + off[t] + 16 * k);     \
        for (size_t i = 0; i < 4; i++) {                                                   \
          __m512 wv = _mm512_set1_ps(wc[4 * t + i]);                                       \
          for (size_t k = 0; k < NV; k++) a[i][k] = _mm512_fmadd_ps(wv, xv[k], a[i][k]);   \
        }                                                                                  \
      }                                                                                    \
    }                                                                                      \
    for (size_t i = 0; i < 4; i++)                                                         \
      for (size_t k = 0; k < NV; k++) _mm512_storeu_ps(out + i * ldo + 16 * k, a[i][k]);   \
  }
C5_FWD_VECS(6)
C5_FWD_VECS(5)
C5_FWD_VECS(4)
C5_FWD_VECS(3)
C5_FWD_VECS(2)
C5_FWD_VECS(1)

/* c3_fwd_block over vectors of 16: 6 vectors at a time, and the rest in one call of 1-5,
 * or two of 4 + 3 or 4 + 4 for a rest of 7 or 8. Fewer than 3 vectors leave fewer than 12
 * independent sums, under what keeps the multiply-add units busy: with 6, then 3, then 1
 * (as before), a 7x7 image's 4 vectors ran a quarter of its work at half speed (a 28x28
 * image's 53, 2 of them). Every output lane is the same sum in the same order whatever the
 * split: the same bits. */
typedef void (*c5_fwd_vecs_fn)(size_t c, size_t cl, size_t nt, const size_t *off, const float *xq,
                               const float *wp, float *out, size_t ldo);
static const c5_fwd_vecs_fn c5_fwd_vecs[7] = {
    NULL, c5_fwd_vecs1, c5_fwd_vecs2, c5_fwd_vecs3, c5_fwd_vecs4, c5_fwd_vecs5, c5_fwd_vecs6};

static void c5_fwd_block(size_t c, size_t cl, size_t nt, const size_t *off, size_t nv,
                         const float *xq, const float *wp, float *out, size_t ldo) {
  size_t v = 0;
  while (nv - v > 0) {
    size_t rest = nv - v, k = rest >= 9 || rest == 6 ? 6 : rest >= 7 ? 4 : rest;
    c5_fwd_vecs[k](c, cl, nt, off, xq + 16 * v, wp, out + 16 * v, ldo);
    v += k;
  }
}

/* The 16 lanes of a in a fixed order. */
C5_TARGET static float c5_hsum(__m512 a) {
  __m256 s = _mm256_add_ps(_mm512_castps512_ps256(a),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  return c3_hsum(s);
}

C3_WGRAD_BLOCK(c5_wgrad_block, C5_TARGET, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
               _mm512_fmadd_ps, c5_hsum, 3, 3)
C3_WGRAD_BLOCK(c5_wgrad_block1, C5_TARGET, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
               _mm512_fmadd_ps, c5_hsum, 1, 1)
#else
#define C3_HAVE_KERNELS 0
#endif

/* The direct kernels need AVX2 and FMA (the processor checked once per process) and output
 * channels in blocks of 4; otherwise the layers use im2col + gemm. The ISA a backend uses,
 * an ac_cpu_isa: the processor's best (AVX-512F over AVX2 + FMA), capped by
 * ac_backend_opts.cpu_isa. */
static int c3_best = AC_CPU_ISA_PORTABLE; /* set once (c3_once), read after */
static pthread_once_t c3_once = PTHREAD_ONCE_INIT;

static void c3_detect(void) {
#if C3_HAVE_KERNELS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    c3_best = __builtin_cpu_supports("avx512f") ? AC_CPU_ISA_AVX512 : AC_CPU_ISA_AVX2;
#endif
}

static int c3_isa(int cap) {
  pthread_once(&c3_once, c3_detect);
  return cap == AC_CPU_ISA_BEST || cap > c3_best ? c3_best : cap;
}

static const char *c3_isa_name(int isa) {
  return isa == AC_CPU_ISA_AVX512 ? "AVX-512F" : isa == AC_CPU_ISA_AVX2 ? "AVX2" : "none";
}

static int cpu_conv3x3_ok(ac_backend *be, size_t c, size_t oc) {
  (void)c;
  return ((cpu_impl *)be->impl)->isa >= AC_CPU_ISA_AVX2 && oc % 4 == 0;
}

/* The backend's scratch for the direct convs, grown on demand (one call at a time on a
 * backend, as for every primitive). */
static float *cpu_scratch(ac_backend *be, size_t floats) {
  cpu_impl *impl = be->impl;
  if (impl->scratch_floats < floats) {
    free(impl->scratch);
    impl->scratch_floats = 0;
    impl->scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (impl->scratch == NULL) return NULL;
    impl->scratch_floats = floats;
  }
  return impl->scratch;
}

/* The stride-2 convs (a ResNet's downsampling 3x3 convs, padding 1, and its 1x1 projection
 * shortcuts, no padding) on the same kernels, for an input of even size 2h x 2w and g the
 * h x w output's geometry: each input channel is split into nph phase planes, each in the
 * tall layout of g with pl floats: nph 4 for a 3x3 conv (plane 2 rp + cp holds the input
 * pixels (2 y + rp, 2 x + cp) at (y, x)), nph 1 for a 1x1 conv (the even rows' even
 * columns, all it reads). Tap (p, q) reads input row 2 y + p - 1: row y - 1 of the odd
 * plane (p 0), row y of the even (p 1) or the odd one (p 2), and the same for columns: so
 * every tap is again one shifted read of a plane, and output position j of the tall layout
 * is a sum of reads at j + off[t]. The input gradient is the 4 phases of dx, each a sum over
 * its own taps (1, 2, 2 and 4 of the 9) of dy read at j + 0, 1, wq or wq + 1. */
typedef struct c3_args {
  c3_geom g;                          /* the output's (= the input's at stride 1) */
  int isa;                            /* AC_CPU_ISA_AVX2 or _AVX512 */
  size_t vw;                          /* floats per vector: 8 or 16 */
  size_t stride, kk, nph, pl, ih, iw; /* stride 1 or 2, taps 9 or 1, phase planes, input size */
  size_t nt, off[9];                  /* the taps' offsets within a channel of cl floats */
  size_t n, c, oc, nv, cl, dl, per_thread, parts;
  size_t nch, groups; /* the weight gradient's chunks of images and groups of chunks */
  const float *x, *w, *dy;
  float *y, *dw, *scratch;   /* y: the output, or dx; dw: the weight gradient's partial sums */
  unsigned char *ready;      /* per thread: its scratch's zeros written (c3_thread_scratch) */
  size_t *packed_nb;         /* the weight gradient, per thread: the images of the chunk its scratch
                        holds (0: none yet), whose zeros the next chunk of as many keeps */
  double *sums;              /* NULL, or per image and output channel the moments' s and q, or bn's
                       two gradient sums */
  const float *res;          /* NULL, or added to the forward's output as it is copied out */
  const ac_bn_grad_args *bn; /* NULL, or the batch norm the output is the gradient for */
  /* The input gradient (stride 2): per phase of dx, its taps (indices into the kk weights),
   * their offsets into dy's tall layout, and where its packed weights start. */
  size_t dnt[4], dtap[4][4], doff[4][4], dwo[4];
  cpu_pool *pool; /* for the phases' counts (PRECOND_POOL_STATS): */
  int phase[3];   /* packing, products, copy-out (pool_phase; -1: off) */
} c3_args;

#if C3_HAVE_KERNELS
/* Floats of scratch behind the per-thread flags of threads threads. */
#define C3_READY_FLOATS(threads) (((threads) + sizeof(float) - 1) / sizeof(float))

/* The backend's variant: its ISA and vector width. */
static void c3_args_isa(ac_backend *be, c3_args *a) {
  a->isa = ((cpu_impl *)be->impl)->isa;
  a->vw = a->isa == AC_CPU_ISA_AVX512 ? 16 : 8;
}

/* The conv's shape: output geometry, phase planes (of pl floats, set by c3_set_taps). */
static void c3_set_shape(c3_args *a, size_t ih, size_t iw, size_t k, size_t stride) {
  a->stride = stride;
  a->kk = k * k;
  a->nph = stride == 2 && k == 3 ? 4 : 1;
  a->ih = ih;
  a->iw = iw;
  a->g = c3_geom_of(ih / stride, iw / stride);
}

/* The forward taps' offsets for phase planes of pl floats. */
static void c3_set_taps(c3_args *a, size_t pl) {
  size_t wq = a->g.wq;
  a->pl = pl;
  a->cl = a->nph * pl;
  a->nt = a->kk;
  for (size_t t = 0; t < a->kk; t++) {
    size_t p = t / 3, q = t % 3;
    if (a->stride == 1)
      a->off[t] = p * wq + q;
    else if (a->kk == 1)
      a->off[t] = wq + 1;
    else
      a->off[t] = (2 * (p != 1) + (q != 1)) * pl + (p != 0) * wq + (q != 0);
  }
}

/* The input gradient's taps per phase of dx (stride 2): an even row (rp 0) is read by tap
 * row 1 of the output row y; an odd one by tap row 0 of output row y + 1 and tap row 2 of
 * row y; columns alike. The phases' packed weights follow each other. */
static void c3_set_dgrad_taps(c3_args *a) {
  static const size_t tap[2][2] = {{1, 0}, {0, 2}}, shift[2][2] = {{0, 0}, {1, 0}};
  size_t start = 0;
  for (size_t ph = 0; ph < a->nph; ph++) {
    size_t rp = ph >> 1, cp = ph & 1, k = 0;
    if (a->kk == 1) {
      a->dtap[ph][0] = 0;
      a->doff[ph][0] = 0;
      k = 1;
    }
    for (size_t i = 0; i < 1 + rp && a->kk == 9; i++)
      for (size_t j = 0; j < 1 + cp; j++, k++) {
        a->dtap[ph][k] = 3 * tap[rp][i] + tap[cp][j];
        a->doff[ph][k] = shift[rp][i] * a->g.wq + shift[cp][j];
      }
    a->dnt[ph] = k;
    a->dwo[ph] = start;
    start += k * a->c * a->oc;
  }
}

/* c3_pack, c3_copy and c3_copy_add on the variant isa. */
static void c3_pack(int isa, const c3_geom *g, size_t nb, const float *src, size_t sstride,
                    size_t off, float *dst, size_t len) {
  if (isa == AC_CPU_ISA_AVX512)
    c5_pack(g, nb, src, sstride, off, dst, len);
  else
    c3_pack_avx2(g, nb, src, sstride, off, dst, len);
}

static void c3_copy_isa(int isa, float *dst, const float *src, const float *res, size_t n) {
  if (isa == AC_CPU_ISA_AVX512 && res != NULL)
    c5_copy_add(dst, src, res, n);
  else if (isa == AC_CPU_ISA_AVX512)
    c5_copy(dst, src, n);
  else if (res != NULL)
    c3_copy_add(dst, src, res, n);
  else
    c3_copy(dst, src, n);
}

/* Input channel planes of nb images (image b's at src + b sstride) into the layout the taps
 * read (c3_args), zeros elsewhere in [0, len) (len 0: dst already holds them). */
static void c3_pack_in(const c3_args *a, size_t nb, const float *src, size_t sstride, float *dst,
                       size_t len) {
  const c3_geom *g = &a->g;
  if (a->stride == 1) {
    c3_pack(a->isa, g, nb, src, sstride, g->wq + 1, dst, len);
    return;
  }
  memset(dst, 0, len * sizeof *dst);
  for (size_t rp = 0; rp < (a->nph == 4 ? 2 : 1); rp++)
    for (size_t b = 0; b < nb; b++)
      for (size_t y = 0; y < g->h; y++) {
        const float *s = src + b * sstride + (2 * y + rp) * a->iw;
        float *d0 = dst + 2 * rp * a->pl + b * g->is + (y + 1) * g->wq + 1, *d1 = d0 + a->pl;
        if (a->nph == 4)
          for (size_t x = 0; x < g->w; x++) {
            d0[x] = s[2 * x];
            d1[x] = s[2 * x + 1];
          }
        else
          for (size_t x = 0; x < g->w; x++) d0[x] = s[2 * x];
      }
}

/* 4 output channels over a->nv vectors of positions, on the backend's variant. */
static void c3_fwd_kernel(const c3_args *a, size_t c, size_t cl, size_t nt, const size_t *off,
                          const float *xq, const float *wp, float *out, size_t ldo) {
  if (a->isa == AC_CPU_ISA_AVX512)
    c5_fwd_block(c, cl, nt, off, a->nv, xq, wp, out, ldo);
  else
    c3_fwd_block(c, cl, nt, off, a->nv, xq, wp, out, ldo);
}

/* The scratch of thread (per_thread floats each), and whether its zeros (the padding the
 * packing routines leave alone) still have to be written: once per thread and call, on its
 * first chunk. */
static float *c3_thread_scratch(const c3_args *a, int thread, int *fresh) {
  *fresh = !a->ready[thread];
  a->ready[thread] = 1;
  return a->scratch + (size_t)thread * a->per_thread;
}

/* Forward, images [lo, hi) on thread: each image is packed into the thread's scratch,
 * convolved 4 output channels at a time into the rest of it, and its valid positions
 * copied out. */
static void c3_fwd_part(void *ctx, size_t lo, size_t hi, int thread) {
  const c3_args *a = ctx;
  const c3_geom *g = &a->g;
  int fresh;
  float *xq = c3_thread_scratch(a, thread, &fresh), *out = xq + a->c * a->cl;
  size_t ldo = a->nv * a->vw, ihw = a->ih * a->iw, ohw = g->h * g->w;
  long t = pool_phase_start(a->pool);
  for (size_t b = lo; b < hi; b++) {
    for (size_t ch = 0; ch < a->c; ch++)
      c3_pack_in(a, 1, a->x + (b * a->c + ch) * ihw, 0, xq + ch * a->cl,
                 b == lo && fresh ? a->cl : 0);
    pool_phase_end(a->pool, a->phase[0], thread, &t);
    for (size_t ob = 0; ob < a->oc / 4; ob++) {
      c3_fwd_kernel(a, a->c, a->cl, a->nt, a->off, xq, a->w + ob * a->c * 4 * a->nt, out, ldo);
      pool_phase_end(a->pool, a->phase[1], thread, &t);
      for (size_t i = 0; i < 4; i++) {
        float *plane = a->y + (b * a->oc + ob * 4 + i) * ohw;
        const float *rp = a->res != NULL ? a->res + (plane - a->y) : NULL;
        for (size_t y = 0; y < g->h; y++)
          c3_copy_isa(a->isa, plane + y * g->w, out + i * ldo + y * g->wq,
                      rp != NULL ? rp + y * g->w : NULL, g->w);
        double *sq = a->sums != NULL ? a->sums + 2 * (b * a->oc + ob * 4 + i) : NULL;
        if (sq != NULL) /* the plane just written, from the cache */
          sq[0] = sq[1] = 0.0;
        if (sq != NULL && a->bn != NULL) { /* masked in place, batch norm's sums */
          size_t at = (size_t)(plane - a->y);
          row_grad_sums(a->isa, ohw, plane, a->bn->mask != NULL ? a->bn->mask + at : NULL,
                        a->bn->x + at, a->bn->center[ob * 4 + i], plane, sq, sq + 1);
        } else if (sq != NULL) {
          row_moments(a->isa, ohw, plane, sq, sq + 1);
        }
      }
      pool_phase_end(a->pool, a->phase[2], thread, &t);
    }
  }
}

/* The forward in the lanes layout (conv_lanes.h), groups [lo, hi) of 16 images on thread:
 * each group's channels are packed into the thread's scratch (its frame's zeros once per
 * thread and call), then for every block of 4 output channels each output row is one run of
 * the forward kernel over its w positions (the taps at offsets (p (w + 2) + q) 16), into the
 * rest of the scratch, copied out to the 16 images' planes (plus the residual, res), and
 * their moments made from the lanes (16 images per vector, in row_moments' order); or, for
 * an input gradient with a batch norm's sums (bn), those made on each plane just written,
 * as c3_fwd_part does. Every output is the tall kernel's sum, term for term, and every
 * moment row_moments' sum: the same bits. */
static void c3_lanes_part(void *ctx, size_t lo, size_t hi, int thread) {
  const c3_args *a = ctx;
  const c3_geom *g = &a->g;
  int fresh;
  float *xq = c3_thread_scratch(a, thread, &fresh), *out = xq + a->c * a->cl;
  size_t ohw = g->h * g->w, ldo = ohw * AC__LANES, row = (g->w + 2) * AC__LANES;
  long t = pool_phase_start(a->pool);
  if (fresh) memset(xq, 0, a->c * a->cl * sizeof *xq);
  for (size_t grp = lo; grp < hi; grp++) {
    size_t b0 = grp * AC__LANES, nb = a->n - b0 < AC__LANES ? a->n - b0 : AC__LANES;
    for (size_t ch = 0; ch < a->c; ch++)
      ac__lanes_pack(g->h, g->w, nb, a->x + (b0 * a->c + ch) * ohw, a->c * ohw, xq + ch * a->cl);
    pool_phase_end(a->pool, a->phase[0], thread, &t);
    for (size_t ob = 0; ob < a->oc / 4; ob++) {
      const float *wp = a->w + ob * a->c * 4 * a->nt;
      for (size_t y = 0; y < g->h; y++)
        c5_fwd_block(a->c, a->cl, a->nt, a->off, g->w, xq + y * row, wp, out + y * g->w * AC__LANES,
                     ldo);
      pool_phase_end(a->pool, a->phase[1], thread, &t);
      for (size_t i = 0; i < 4; i++) {
        size_t o = ob * 4 + i, at = (b0 * a->oc + o) * ohw, ps = a->oc * ohw;
        double s[AC__LANES] = {0}, q[AC__LANES] = {0};
        ac__lanes_unpack(ohw, nb, out + i * ldo, a->y + at, ps,
                         a->res != NULL ? a->res + at : NULL);
        if (a->bn == NULL) ac__lanes_moments(ohw, out + i * ldo, s, q);
        for (size_t b = 0; b < nb; b++) {
          a->sums[2 * ((b0 + b) * a->oc + o)] = s[b];
          a->sums[2 * ((b0 + b) * a->oc + o) + 1] = q[b];
        }
      }
      pool_phase_end(a->pool, a->phase[2], thread, &t);
    }
    /* An input gradient's batch norm sums, as c3_fwd_part's (masked in place), image by
     * image once all its planes are written: each image's planes, mask and x are then one
     * contiguous run (per block of 4 channels, 16 images' 49-196-float planes far apart
     * missed the cache on every plane: the sums cost 3x the tall layout's). */
    for (size_t b = 0; b < nb && a->bn != NULL; b++)
      for (size_t o = 0; o < a->oc; o++) {
        size_t at = ((b0 + b) * a->oc + o) * ohw;
        double *sq = a->sums + 2 * ((b0 + b) * a->oc + o);
        row_grad_sums(a->isa, ohw, a->y + at, a->bn->mask != NULL ? a->bn->mask + at : NULL,
                      a->bn->x + at, a->bn->center[o], a->y + at, sq, sq + 1);
      }
    pool_phase_end(a->pool, a->phase[2], thread, &t);
  }
}

/* Input gradient of a stride-2 conv, images [lo, hi) on thread: each image's dy is packed
 * (as an output, pixel (y, x) at y wq + x, zeros after each row and image), then for every
 * block of 4 input channels and every phase of dx, a forward pass over the phase's taps,
 * scattered to every other pixel of dx. */
static void c3_dgrad_part(void *ctx, size_t lo, size_t hi, int thread) {
  const c3_args *a = ctx;
  const c3_geom *g = &a->g;
  int fresh;
  float *dq = c3_thread_scratch(a, thread, &fresh), *out = dq + a->oc * a->dl;
  size_t ldo = a->nv * a->vw, ihw = a->ih * a->iw, ohw = g->h * g->w;
  long t = pool_phase_start(a->pool);
  for (size_t b = lo; b < hi; b++) {
    for (size_t o = 0; o < a->oc; o++)
      c3_pack(a->isa, g, 1, a->dy + (b * a->oc + o) * ohw, 0, 0, dq + o * a->dl,
              b == lo && fresh ? a->dl : 0);
    float *dxb = a->y + b * a->c * ihw;
    if (a->nph == 1) memset(dxb, 0, a->c * ihw * sizeof *dxb); /* 1x1: odd pixels get none */
    pool_phase_end(a->pool, a->phase[0], thread, &t);
    for (size_t cb = 0; cb < a->c / 4; cb++) {
      for (size_t ph = 0; ph < a->nph; ph++) {
        size_t nt = a->dnt[ph], rp = ph >> 1, cp = ph & 1;
        c3_fwd_kernel(a, a->oc, a->dl, nt, a->doff[ph], dq, a->w + a->dwo[ph] + cb * a->oc * 4 * nt,
                      out, ldo);
        pool_phase_end(a->pool, a->phase[1], thread, &t);
        for (size_t i = 0; i < 4; i++)
          for (size_t y = 0; y < g->h; y++) {
            float *d = dxb + (4 * cb + i) * ihw + (2 * y + rp) * a->iw + cp;
            const float *s = out + i * ldo + y * g->wq;
            for (size_t x = 0; x < g->w; x++) d[2 * x] = s[x];
          }
        pool_phase_end(a->pool, a->phase[2], thread, &t);
      }
      for (size_t i = 0; i < 4 && a->bn != NULL; i++) { /* its 4 planes complete: */
        size_t ch = 4 * cb + i, at = (b * a->c + ch) * ihw;
        float *plane = a->y + at;
        double *sq = a->sums + 2 * (b * a->c + ch);
        if (a->res != NULL) c3_copy_isa(a->isa, plane, plane, a->res + at, ihw);
        sq[0] = sq[1] = 0.0;
        row_grad_sums(a->isa, ihw, plane, a->bn->mask != NULL ? a->bn->mask + at : NULL,
                      a->bn->x + at, a->bn->center[ch], plane, sq, sq + 1);
        pool_phase_end(a->pool, a->phase[2], thread, &t);
      }
    }
  }
}

/* Weight gradient, groups [lo, hi) on thread: group k sums chunks [k nch / groups, (k + 1)
 * nch / groups) of images into its own partial weights pw_k, chunk by chunk (x's and dy's
 * channels packed into the thread's scratch, then the 4 x kk weights of every (output
 * block, input channel)). Which thread runs a group does not change its sums. */
static void c3_wgrad_part(void *ctx, size_t lo, size_t hi, int thread) {
  const c3_args *a = ctx;
  const c3_geom *g = &a->g;
  size_t ihw = a->ih * a->iw, ohw = g->h * g->w, wn = a->oc * a->c * a->kk;
  float *xq = a->scratch + (size_t)thread * a->per_thread, *dq = xq + a->c * a->cl;
  long t = pool_phase_start(a->pool);
  for (size_t k = lo; k < hi; k++) {
    float *pw = a->dw + k * wn;
    memset(pw, 0, wn * sizeof *pw);
    size_t q0, q1;
    slice_of(a->nch, (int)a->groups, (int)k, &q0, &q1);
    for (size_t q = q0; q < q1; q++) {
      size_t b0, b1;
      slice_of(a->n, (int)a->nch, (int)q, &b0, &b1);
      size_t nb = b1 - b0, nv = c3_nvec(g, nb, a->vw);
      /* A chunk of as many images as the last one on this thread writes its values at the
       * same places: the zeros around them are still there (writing them again cost a
       * quarter of the packing). */
      int same = a->packed_nb[thread] == nb;
      a->packed_nb[thread] = nb;
      for (size_t ch = 0; ch < a->c; ch++)
        c3_pack_in(a, nb, a->x + (b0 * a->c + ch) * ihw, a->c * ihw, xq + ch * a->cl,
                   same ? 0 : a->cl);
      for (size_t o = 0; o < a->oc; o++)
        c3_pack(a->isa, g, nb, a->dy + (b0 * a->oc + o) * ohw, a->oc * ohw, 0, dq + o * a->dl,
                same ? 0 : a->dl);
      pool_phase_end(a->pool, a->phase[0], thread, &t);
      for (size_t ob = 0; ob < a->oc / 4; ob++)
        for (size_t ch = 0; ch < a->c; ch++) {
          const float *dqb = dq + ob * 4 * a->dl, *xc = xq + ch * a->cl;
          float *dw = pw + (ob * 4 * a->c + ch) * a->kk;
          size_t ldw = a->c * a->kk;
          if (a->isa == AC_CPU_ISA_AVX512 && a->kk == 9)
            c5_wgrad_block(nv, a->off, dqb, a->dl, xc, dw, ldw);
          else if (a->isa == AC_CPU_ISA_AVX512)
            c5_wgrad_block1(nv, a->off, dqb, a->dl, xc, dw, ldw);
          else if (a->kk == 9)
            c3_wgrad_block(nv, a->off, dqb, a->dl, xc, dw, ldw);
          else
            c3_wgrad_block1(nv, a->off, dqb, a->dl, xc, dw, ldw);
        }
      pool_phase_end(a->pool, a->phase[1], thread, &t);
    }
  }
}

/* The phases of a direct conv's slices in the pool's stats, by the loop kind's name: the
 * forward with moments (a ResNet's forward convs), without, with a batch norm's gradient
 * sums (its stride-1 input gradients), the stride-2 input gradient, the weight gradient
 * (no copy-out) and the forward in the lanes layout. */
static const char *const c3_phase_names[7][4] = {
    {"c3_fwd_part", "c3_fwd_part:pack", "c3_fwd_part:kernel", "c3_fwd_part:copyout"},
    {"c3_fwd_part.nomoments", "c3_fwd_part.nomoments:pack", "c3_fwd_part.nomoments:kernel",
     "c3_fwd_part.nomoments:copyout"},
    {"c3_fwd_part.bngrad", "c3_fwd_part.bngrad:pack", "c3_fwd_part.bngrad:kernel",
     "c3_fwd_part.bngrad:copyout"},
    {"c3_dgrad_part", "c3_dgrad_part:pack", "c3_dgrad_part:kernel", "c3_dgrad_part:scatter"},
    {"c3_wgrad_part", "c3_wgrad_part:pack", "c3_wgrad_part:kernel", NULL},
    {"c3_lanes_part", "c3_lanes_part:pack", "c3_lanes_part:kernel", "c3_lanes_part:copyout"},
    {"c3_lanes_part.bngrad", "c3_lanes_part.bngrad:pack", "c3_lanes_part.bngrad:kernel",
     "c3_lanes_part.bngrad:copyout"}};

/* Registers the phases of set (a row of c3_phase_names) for a's loop; returns the loop's
 * kind name. */
static const char *c3_phases(c3_args *a, cpu_pool *pool, int set) {
  a->pool = pool;
  for (int i = 0; i < 3; i++)
    a->phase[i] =
        c3_phase_names[set][i + 1] != NULL ? pool_phase(pool, c3_phase_names[set][i + 1]) : -1;
  return c3_phase_names[set][0];
}

/* Where the forward takes the lanes layout (c3_lanes_part) instead of the tall one: the one
 * rule. It needs AVX-512F (16 lanes) and a 3x3 stride-1 conv; it pays where the tall
 * layout's thrown-away positions do (h w small: 14x14, 7x7; at 28x28 it measured level).
 * The convs of a ResNet's step: the forward with moments and no residual (the moments come
 * from the lanes) and the stride-1 input gradient with batch norm's sums (ac_conv3x3_bn_grad,
 * its copy-out as c3_fwd_part's). The plain and residual-only calls keep the tall layout. */
#define C3_LANES_MAX_HW 196
static int c3_lanes_fits(const c3_args *a, const float *moments) {
  return a->isa == AC_CPU_ISA_AVX512 && a->stride == 1 && a->kk == 9 &&
         ((moments != NULL && a->res == NULL) || a->bn != NULL) &&
         a->g.h * a->g.w <= C3_LANES_MAX_HW;
}

/* The forward of a direct conv: stride 1 (3x3) or 2 (3x3 or 1x1), ih x iw input; with
 * moments or (stride 1) a batch norm's gradient sums, bn, made in the copy-out. */
static int c3_forward(ac_backend *be, size_t n, size_t c, size_t oc, size_t ih, size_t iw, size_t k,
                      size_t stride, const float *x, const float *wt, const float *res, float *y,
                      float *moments, const ac_bn_grad_args *bn) {
  cpu_pool *pool = pool_of(be);
  size_t parts = (size_t)pool->nthreads;
  c3_args a = {.n = n, .c = c, .oc = oc, .parts = parts, .x = x, .y = y, .res = res, .bn = bn};
  c3_set_shape(&a, ih, iw, k, stride);
  c3_args_isa(be, &a);
  int lanes = c3_lanes_fits(&a, moments);
  if (lanes) {
    a.cl = ac__lanes_chan_len(a.g.h, a.g.w);
    a.nt = 9;
    for (size_t t = 0; t < 9; t++) a.off[t] = (t / 3 * (a.g.w + 2) + t % 3) * AC__LANES;
    a.per_thread = c * a.cl + 4 * a.g.h * a.g.w * AC__LANES;
  } else {
    a.nv = c3_nvec(&a.g, 1, a.vw);
    c3_set_taps(&a, c3_chan_len(&a.g, 1, a.vw));
    a.per_thread = c * a.cl + 4 * a.nv * a.vw;
  }
  size_t wfloats = (oc * c * a.kk + 15) / 16 * 16;
  size_t sfloats = moments != NULL || bn != NULL ? 4 * n * oc : 0;
  float *s = cpu_scratch(be, wfloats + parts * a.per_thread + sfloats + C3_READY_FLOATS(parts));
  if (s == NULL) return AC_ENOMEM;
  c3_pack_weights(c, oc, a.kk, wt, s);
  a.w = s;
  a.scratch = s + wfloats;
  if (sfloats > 0) a.sums = (double *)(void *)(a.scratch + parts * a.per_thread);
  a.ready = (unsigned char *)(a.scratch + parts * a.per_thread + sfloats);
  memset(a.ready, 0, parts);
  int set = lanes ? (bn != NULL ? 6 : 5) : moments != NULL ? 0 : bn != NULL ? 2 : 1;
  const char *kind = c3_phases(&a, pool, set);
  if (lanes)
    pool_run(pool, (n + AC__LANES - 1) / AC__LANES, (double)(n * c * oc * a.g.h * a.g.w),
             c3_lanes_part, &a, kind);
  else
    pool_run(pool, n, (double)(n * c * oc * a.g.h * a.g.w), c3_fwd_part, &a, kind);
  /* Each channel's sums over the images in image order: ac_channel_moments' and
   * ac_channel_grad_sums' order, so the same bits. */
  for (size_t o = 0; o < oc && a.sums != NULL; o++) {
    double sum = 0.0, sq = 0.0;
    for (size_t b = 0; b < n; b++) {
      sum += a.sums[2 * (b * oc + o)];
      sq += a.sums[2 * (b * oc + o) + 1];
    }
    if (moments != NULL) {
      moments_finish(sum, sq, (double)(n * a.g.h * a.g.w), moments + o, moments + oc + o);
    } else {
      bn->sums[o] = (float)sum;
      bn->sums[oc + o] = (float)sq;
    }
  }
  return AC_OK;
}

/* Chunks of images small enough that a block's 4 rows of dy and a channel of x stay in the
 * cache while its 36 weights are summed, in C3_WGRAD_GROUPS groups (fewer for a small
 * batch) with a partial sum each, added into dW in group order at the end. The chunks, the
 * groups and so the order of every sum are a function of the shape alone: the same bits for
 * any thread count. One hand-off to the pool per conv (it was two per chunk, 640 per
 * ResNet-20 step); the chunk count is rounded up to a multiple of the groups, so that the
 * threads' shares are equal. */
#define C3_WGRAD_CHUNK_FLOATS 131072
#define C3_WGRAD_GROUPS       8

/* dW += the groups' partial weights, added in group order (for every element the same
 * sums whichever thread makes them), blocks [blo, bhi) of EW_BLOCK elements. At stage 3
 * (64 x 64 x 9 weights, 8 groups) that is 300 K floats read per conv, on the caller alone
 * before. */
typedef struct c3_group_sums {
  size_t wn, groups;
  const float *pw; /* groups x wn */
  float *dw;
} c3_group_sums;

static void c3_group_sum_slice(void *ctx, size_t blo, size_t bhi, int thread) {
  const c3_group_sums *a = ctx;
  float acc[256];
  size_t lo, len;
  ew_range(a->wn, blo, bhi, &lo, &len);
  for (size_t i0 = lo; i0 < lo + len; i0 += 256) {
    size_t m = lo + len - i0 < 256 ? lo + len - i0 : 256;
    memcpy(acc, a->pw + i0, m * sizeof *acc);
    for (size_t g = 1; g < a->groups; g++)
      for (size_t i = 0; i < m; i++) acc[i] += a->pw[g * a->wn + i0 + i];
    for (size_t i = 0; i < m; i++) a->dw[i0 + i] += acc[i];
  }
}

static int c3_wgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t ih, size_t iw, size_t k,
                    size_t stride, const float *x, const float *dy, float *dw) {
  cpu_pool *pool = pool_of(be);
  c3_args a = {.n = n, .c = c, .oc = oc, .x = x, .dy = dy};
  c3_set_shape(&a, ih, iw, k, stride);
  c3_args_isa(be, &a);
  a.parts = (size_t)pool->nthreads;
  size_t per_image = (c * a.nph + oc) * a.g.is, nbmax = C3_WGRAD_CHUNK_FLOATS / per_image;
  nbmax = nbmax < 1 ? 1 : nbmax;
  size_t nch = (n + nbmax - 1) / nbmax;
  nch = (nch + C3_WGRAD_GROUPS - 1) / C3_WGRAD_GROUPS * C3_WGRAD_GROUPS;
  a.nch = nch < n ? nch : n;
  a.groups = a.nch < C3_WGRAD_GROUPS ? a.nch : C3_WGRAD_GROUPS;
  size_t nb = (n + a.nch - 1) / a.nch; /* the largest chunk */
  c3_set_taps(&a, c3_chan_len(&a.g, nb, a.vw));
  a.dl = (c3_nvec(&a.g, nb, a.vw) * a.vw + 15) / 16 * 16;
  a.per_thread = c * a.cl + oc * a.dl;
  size_t wn = oc * c * a.kk, nbf = a.parts * sizeof(size_t) / sizeof(float);
  float *s = cpu_scratch(be, a.groups * wn + 16 + a.parts * a.per_thread + nbf);
  if (s == NULL) return AC_ENOMEM;
  a.dw = s;
  a.scratch = s + (a.groups * wn + 15) / 16 * 16;
  a.packed_nb = (size_t *)(void *)(a.scratch + a.parts * a.per_thread);
  memset(a.packed_nb, 0, a.parts * sizeof(size_t));
  const char *kind = c3_phases(&a, pool, 4);
  pool_run(pool, a.groups, (double)(n * c * oc * a.g.h * a.g.w), c3_wgrad_part, &a, kind);
  c3_group_sums gs = {wn, a.groups, a.dw, dw};
  par_for(pool, ew_blocks(wn), (double)(wn * (a.groups + 2)), c3_group_sum_slice, &gs);
  return AC_OK;
}
#endif

static int cpu_conv3x3(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                       const float *x, const float *wt, const float *res, float *y,
                       float *moments) {
#if C3_HAVE_KERNELS
  return c3_forward(be, n, c, oc, h, w, 3, 1, x, wt, res, y, moments, NULL);
#else
  (void)be, (void)n, (void)c, (void)oc, (void)h, (void)w, (void)x, (void)wt, (void)res, (void)y,
      (void)moments;
  return AC_ENOTSUP;
#endif
}

static int cpu_conv3x3_bn_grad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                               const float *x, const float *wt, const float *res, float *y,
                               const ac_bn_grad_args *bn) {
#if C3_HAVE_KERNELS
  return c3_forward(be, n, c, oc, h, w, 3, 1, x, wt, res, y, NULL, bn);
#else
  (void)be, (void)n, (void)c, (void)oc, (void)h, (void)w, (void)x, (void)wt, (void)res, (void)y,
      (void)bn;
  return AC_ENOTSUP;
#endif
}

static int cpu_conv3x3_wgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                             const float *x, const float *dy, float *dw) {
#if C3_HAVE_KERNELS
  return c3_wgrad(be, n, c, oc, h, w, 3, 1, x, dy, dw);
#else
  (void)be, (void)n, (void)c, (void)oc, (void)h, (void)w, (void)x, (void)dy, (void)dw;
  return AC_ENOTSUP;
#endif
}

/* The stride-2 convs: the direct kernels, input channels in blocks of 4 too (the input
 * gradient's blocks), an even input. */
static int cpu_conv_s2_ok(ac_backend *be, size_t c, size_t oc, size_t h, size_t w, size_t k) {
  return cpu_conv3x3_ok(be, c, oc) && c % 4 == 0 && h % 2 == 0 && w % 2 == 0 && (k == 1 || k == 3);
}

static int cpu_conv_s2(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                       const float *x, const float *wt, float *y, float *moments) {
#if C3_HAVE_KERNELS
  return c3_forward(be, n, c, oc, h, w, k, 2, x, wt, NULL, y, moments, NULL);
#else
  (void)be, (void)n, (void)c, (void)oc, (void)h, (void)w, (void)k, (void)x, (void)wt, (void)y,
      (void)moments;
  return AC_ENOTSUP;
#endif
}

static int cpu_conv_s2_wgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                             size_t k, const float *x, const float *dy, float *dw) {
#if C3_HAVE_KERNELS
  return c3_wgrad(be, n, c, oc, h, w, k, 2, x, dy, dw);
#else
  (void)be, (void)n, (void)c, (void)oc, (void)h, (void)w, (void)k, (void)x, (void)dy, (void)dw;
  return AC_ENOTSUP;
#endif
}

static int cpu_conv_s2_dgrad_bn(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                                size_t k, const float *dy, const float *wt, const float *res,
                                float *dx, const ac_bn_grad_args *bn) {
#if C3_HAVE_KERNELS
  cpu_pool *pool = pool_of(be);
  size_t parts = (size_t)pool->nthreads;
  c3_args a = {.n = n, .c = c, .oc = oc, .parts = parts, .dy = dy, .y = dx, .res = res, .bn = bn};
  c3_set_shape(&a, h, w, k, 2);
  c3_args_isa(be, &a);
  a.nv = c3_nvec(&a.g, 1, a.vw);
  a.dl = c3_chan_len(&a.g, 1, a.vw);
  c3_set_dgrad_taps(&a);
  a.per_thread = oc * a.dl + 4 * a.nv * a.vw;
  size_t wfloats = (oc * c * a.kk + 15) / 16 * 16, sfloats = bn != NULL ? 4 * n * c : 0;
  float *s = cpu_scratch(be, wfloats + parts * a.per_thread + sfloats + C3_READY_FLOATS(parts));
  if (s == NULL) return AC_ENOMEM;
  /* s[dwo + ((cb oc + o) nt + t) 4 + i] = W[o][4 cb + i][tap t of the phase] */
  for (size_t ph = 0; ph < a.nph; ph++)
    for (size_t cb = 0; cb < c / 4; cb++)
      for (size_t o = 0; o < oc; o++)
        for (size_t t = 0; t < a.dnt[ph]; t++)
          for (size_t i = 0; i < 4; i++)
            s[a.dwo[ph] + ((cb * oc + o) * a.dnt[ph] + t) * 4 + i] =
                wt[(o * c + 4 * cb + i) * a.kk + a.dtap[ph][t]];
  a.w = s;
  a.scratch = s + wfloats;
  if (sfloats > 0) a.sums = (double *)(void *)(a.scratch + parts * a.per_thread);
  a.ready = (unsigned char *)(a.scratch + parts * a.per_thread + sfloats);
  memset(a.ready, 0, parts);
  const char *kind = c3_phases(&a, pool, 3);
  pool_run(pool, n, (double)(n * c * oc * a.g.h * a.g.w), c3_dgrad_part, &a, kind);
  for (size_t ch = 0; ch < c && bn != NULL; ch++) { /* in image order, as c3_forward's */
    double sum = 0.0, sq = 0.0;
    for (size_t b = 0; b < n; b++) {
      sum += a.sums[2 * (b * c + ch)];
      sq += a.sums[2 * (b * c + ch) + 1];
    }
    bn->sums[ch] = (float)sum;
    bn->sums[c + ch] = (float)sq;
  }
  return AC_OK;
#else
  (void)be, (void)n, (void)c, (void)oc, (void)h, (void)w, (void)k, (void)dy, (void)wt, (void)res,
      (void)dx, (void)bn;
  return AC_ENOTSUP;
#endif
}

static int cpu_conv_s2_dgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                             size_t k, const float *dy, const float *wt, float *dx) {
  return cpu_conv_s2_dgrad_bn(be, n, c, oc, h, w, k, dy, wt, NULL, dx, NULL);
}

static const ac__ops cpu_ops = {
    .destroy = cpu_destroy,
    .sync = cpu_sync,
    .malloc_ = cpu_malloc,
    .free_ = cpu_free,
    .memcpy_h2d = cpu_memcpy,
    .memcpy_d2h = cpu_memcpy,
    .memcpy_d2d = cpu_memcpy,
    .fill_f32 = cpu_fill_f32,
    .fill_i32 = cpu_fill_i32,
    .copy2d = cpu_copy2d,
    .permute = cpu_permute,
    .sgemm_batched = cpu_sgemm_batched,
    .syrk_packed = cpu_syrk_packed,
    .syrk_packed_to_host = cpu_syrk_packed_to_host,
    .unpack_sym = cpu_unpack_sym,
    .pack_sym = cpu_pack_sym,
    .binary = cpu_binary,
    .axpby = cpu_axpby,
    .affine = cpu_affine,
    .unary = cpu_unary,
    .unary_backward = cpu_unary_backward,
    .bcast = cpu_bcast,
    .reduce = cpu_reduce,
    .channel_moments = cpu_channel_moments,
    .channel_affine = cpu_channel_affine,
    .channel_grad_sums = cpu_channel_grad_sums,
    .channel_combine = cpu_channel_combine,
    .sum_to_host = cpu_sum_to_host,
    .argmax_rows = cpu_argmax_rows,
    .sample_rows = cpu_sample_rows,
    .softmax_rows = cpu_softmax_rows,
    .softmax_rows_backward = cpu_softmax_rows_backward,
    .mask_causal = cpu_mask_causal,
    .xent_forward = cpu_xent_forward,
    .xent_backward = cpu_xent_backward,
    .layernorm_forward = cpu_layernorm_forward,
    .layernorm_backward = cpu_layernorm_backward,
    .gather_rows = cpu_gather_rows,
    .scatter_add_rows = cpu_scatter_add_rows,
    .im2col = cpu_im2col,
    .col2im = cpu_col2im,
    .pool2d_forward = cpu_pool2d_forward,
    .pool2d_backward = cpu_pool2d_backward,
    .rand = cpu_rand,
    .adamw_update = cpu_adamw_update,
    .moment_graft = cpu_moment_graft,
    .conv3x3_ok = cpu_conv3x3_ok,
    .conv3x3 = cpu_conv3x3,
    .conv3x3_wgrad = cpu_conv3x3_wgrad,
    .conv3x3_bn_grad = cpu_conv3x3_bn_grad,
    .conv_s2_ok = cpu_conv_s2_ok,
    .conv_s2 = cpu_conv_s2,
    .conv_s2_wgrad = cpu_conv_s2_wgrad,
    .conv_s2_dgrad = cpu_conv_s2_dgrad,
    .conv_s2_dgrad_bn = cpu_conv_s2_dgrad_bn,
};

int ac__cpu_create(ac_backend *be, const ac_backend_opts *opts, char *err, size_t errlen) {
  cpu_impl *impl = malloc(sizeof *impl);
  if (impl == NULL) {
    snprintf(err, errlen, "cpu backend: out of memory");
    return AC_ENOMEM;
  }
  impl->threads = opts->threads > 0 ? opts->threads : openblas_get_num_threads();
  impl->scratch = NULL;
  impl->scratch_floats = 0;
  impl->isa = c3_isa(opts->cpu_isa);
  /* Every product runs on the backend's own pool, one single-threaded OpenBLAS call per
   * block: set once here rather than around every call (two calls per gemm on the hot path,
   * and a race between two backends in one process). */
  openblas_set_num_threads(1);
  pool_start(&impl->pool, impl->threads);
  be->ops = &cpu_ops;
  be->impl = impl;
  snprintf(be->desc, sizeof be->desc, "cpu (OpenBLAS, %d thread%s, direct convs %s)", impl->threads,
           impl->threads == 1 ? "" : "s", c3_isa_name(impl->isa));
  return AC_OK;
}
