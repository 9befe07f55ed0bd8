/*
 * mode_shampoo.c -- Shampoo, the first entry of the mode table.
 *
 * Units are the blocks of pc_layout_init per tensor (the layout the worker uses too), with
 * two parts: L (rows x rows) and R (cols x cols). A push folds increments G G^T and G^T G into
 * them (S <- beta2 S + (1 - beta2) inc, or S += inc at beta2 = 1); a computation gives the
 * pair L^(-1/p), R^(-1/p), published if both are finite with an error within the failure
 * threshold. With --warm-roots on a block keeps the eigenbasis of each factor's last root
 * and starts the next one from it (warm, or skipped when the statistic is still diagonal in
 * it; seeded by one eigendecomposition when none is held; cold by the job's method when the
 * accuracy guard falls back), counted per factor root in the block's tallies.
 */
#include "precondd.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"
#include "rpc.h"

_Static_assert(sizeof(pd_shampoo_opts) <= PD_MODE_OPTS_MAX, "pd_shampoo_opts too large");

/* A block of n x n takes n(n+1)/2 floats per factor; 8192 keeps one factor at 128 MiB. */
#define PD_SHAMPOO_MAX_BLOCK 8192u
/* Roots at least once per this many statistics steps (a bound that no schedule needs to
 * pass: Distributed Shampoo's precondition_frequency is tens to hundreds). */
#define PD_SHAMPOO_MAX_ROOT_EVERY 100000u

/* Zero fields take the defaults. Block size, skip limit and epsilon are the numerics'
 * own (pc_layout_opts_default, pc_root_opts_default), the ones the worker's layout and roots
 * use, so the two ends cannot drift apart. p = 4 is Shampoo's two-sided rule for a 2-D
 * block. beta2 0 means sums (beta2 = 1): the wire's zero cannot mean "the worker's EMA",
 * which the daemon does not know, and libprecond's callers send their beta2 explicitly. */
static int shampoo_resolve(void *opts, char *err, size_t errlen) {
  pd_shampoo_opts *o = opts;
  pc_layout_opts lo;
  pc_layout_opts_default(&lo);
  pc_root_opts ro;
  pc_root_opts_default(&ro, 4);
  if (!o->block_size) o->block_size = (uint32_t)lo.block_size;
  if (!o->skip_limit) o->skip_limit = (uint32_t)lo.skip_limit;
  if (o->beta2 == 0.0f) o->beta2 = 1.0f;
  if (!o->root_exponent) o->root_exponent = (uint32_t)ro.p;
  if (o->epsilon == 0.0) o->epsilon = ro.epsilon;
  if (!o->root_every) o->root_every = 1;
  if (o->block_size > PD_SHAMPOO_MAX_BLOCK) {
    snprintf(err, errlen, "shampoo.block_size: %u is above the limit %u", o->block_size,
             PD_SHAMPOO_MAX_BLOCK);
    return PD_EINVAL;
  }
  if (!(o->beta2 > 0.0f && o->beta2 <= 1.0f)) {
    snprintf(err, errlen, "shampoo.beta2: %g is not in (0, 1]", (double)o->beta2);
    return PD_EINVAL;
  }
  if (o->root_exponent > 64) {
    snprintf(err, errlen, "shampoo.root_exponent: %u is not in [1, 64]", o->root_exponent);
    return PD_EINVAL;
  }
  if (!(o->epsilon > 0.0 && o->epsilon < 1.0)) {
    snprintf(err, errlen, "shampoo.epsilon: %g is not in (0, 1)", o->epsilon);
    return PD_EINVAL;
  }
  if (o->method < PC_METHOD_NEWTON || o->method > PC_METHOD_EIGH) {
    snprintf(err, errlen, "shampoo.method: %d is not a known method", o->method);
    return PD_EINVAL;
  }
  if (o->root_every > PD_SHAMPOO_MAX_ROOT_EVERY) {
    snprintf(err, errlen, "shampoo.root_every: %u is not in [1, %u]", o->root_every,
             PD_SHAMPOO_MAX_ROOT_EVERY);
    return PD_EINVAL;
  }
  return PD_OK;
}

/* The layout options and dims of tensor t as the numerics take them: the count and the
 * layout below go through pc_layout_count / pc_layout_init, the rule's one source. */
static void shampoo_layout_args(const pd_shampoo_opts *o, const pd_tensor *t, pc_layout_opts *lo,
                                size_t dims[PD_MAX_RANK]) {
  pc_layout_opts_default(lo);
  lo->block_size = o->block_size;
  lo->skip_limit = o->skip_limit;
  for (int k = 0; k < t->rank; k++) dims[k] = (size_t)t->dims[k];
}

/* Counts the blocks before any layout is allocated (pc_layout_count is O(rank) and does not
 * allocate), so an absurd shape costs nothing. */
static int shampoo_count(const pd_shampoo_opts *o, size_t ntensors, const pd_tensor *t,
                         uint32_t max_blocks, size_t *count, char *err, size_t errlen) {
  size_t total = 0;
  for (size_t i = 0; i < ntensors; i++) {
    pc_layout_opts lo;
    size_t dims[PD_MAX_RANK], n;
    shampoo_layout_args(o, &t[i], &lo, dims);
    int prc = pc_layout_count(t[i].rank, dims, &lo, &n);
    if (prc != PC_OK) {
      snprintf(err, errlen, "tensors[%zu].shape: layout failed: %s", i, pc_strerror(prc));
      return PD_EINVAL;
    }
    if (n > max_blocks - total) {
      snprintf(err, errlen, "tensors[%zu]: the job would have more than %u blocks", i, max_blocks);
      return PD_ELIMIT;
    }
    total += n;
  }
  *count = total;
  return PD_OK;
}

static int shampoo_layout(const void *opts, size_t ntensors, const pd_tensor *tensors,
                          uint32_t max_units, pd_unit_shape *units, size_t *nunits, uint32_t *diag,
                          size_t *ndiag, char *err, size_t errlen) {
  const pd_shampoo_opts *o = opts;
  if (!units) return shampoo_count(o, ntensors, tensors, max_units, nunits, err, errlen);
  /* Block ids are numbered in tensor order, tiles row-major within a tensor (the layout's
   * own order), so every worker and replica derives the same ids. */
  *nunits = *ndiag = 0;
  for (size_t i = 0; i < ntensors; i++) {
    pc_layout_opts lo;
    size_t dims[PD_MAX_RANK];
    shampoo_layout_args(o, &tensors[i], &lo, dims);
    pc_layout lay;
    int prc = pc_layout_init(&lay, tensors[i].rank, dims, &lo);
    if (prc != PC_OK) {
      snprintf(err, errlen, "tensors[%zu].shape: layout failed: %s", i, pc_strerror(prc));
      return prc == PC_ENOMEM ? PD_ENOMEM : PD_EINVAL;
    }
    if (lay.diagonal || lay.nblocks == 0) {
      diag[(*ndiag)++] = (uint32_t)i;
    } else if (*nunits + lay.nblocks > max_units) {
      snprintf(err, errlen, "tensors[%zu]: the job would have more than %u blocks", i, max_units);
      pc_layout_destroy(&lay);
      return PD_ELIMIT;
    } else {
      for (size_t k = 0; k < lay.nblocks; k++) {
        pd_unit_shape *u = &units[(*nunits)++];
        u->tensor = (uint32_t)i;
        u->row0 = lay.blocks[k].row0;
        u->rows = lay.blocks[k].rows;
        u->col0 = lay.blocks[k].col0;
        u->cols = lay.blocks[k].cols;
        u->nparts = 2;
        u->order[0] = u->rows;
        u->order[1] = u->cols;
      }
    }
    pc_layout_destroy(&lay);
  }
  return PD_OK;
}

static void shampoo_fold(const void *opts, const pd_block *u, float *const *state,
                         const float *const *inc) {
  float beta2 = ((const pd_shampoo_opts *)opts)->beta2;
  for (uint32_t k = 0; k < u->nparts; k++)
    pc_stat_update_f32(pc_packed_len(u->order[k]), state[k], inc[k], beta2);
}

/* The fold loops are memory-bound but for their test per value: on x86-64 GCC also
 * compiles them for AVX2 and picks the clone at load time (ifunc). The same operations (no
 * FMA contraction in ISO C mode), so both clones compute the same values. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SHAMPOO_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SHAMPOO_CLONES
#endif

/* One part's fold into o (o may be s itself, not otherwise overlapping s or x): the same
 * expressions as pc_stat_update_f32, bit for bit (tests/host/test_mode_shampoo.c), each x[i]
 * loaded once. Returns the OR of rpc_f32_big over the results: bit 31 clear when every one
 * is below 2^126. A NaN or Inf in x makes its result NaN or Inf (w > 0), so clear also means
 * x was all finite and nothing overflowed: one test per value decides nearly every push. */
SHAMPOO_CLONES static uint32_t shampoo_fold_part(size_t len, const float *s, const float *x,
                                                 float *o, float beta2) {
  uint32_t big = 0;
  if (beta2 == 1) {
    for (size_t i = 0; i < len; i++) {
      float y = s[i] + x[i];
      big |= rpc_f32_big(y);
      o[i] = y;
    }
  } else {
    const float w = 1 - beta2;
    for (size_t i = 0; i < len; i++) {
      float y = beta2 * s[i] + w * x[i];
      big |= rpc_f32_big(y);
      o[i] = y;
    }
  }
  return big;
}

/* shampoo_fold in the update's own pass, noting whether the result stays below 2^126 (b + w
 * is at most 2, so a statistic and an increment below 2^126 fold below 2^127: finite;
 * pd_mode.fold_bounded). */
static void shampoo_fold_bounded(const void *opts, const pd_block *u, float *const *state,
                                 const float *const *inc, uint8_t *bounded) {
  const float beta2 = ((const pd_shampoo_opts *)opts)->beta2;
  for (uint32_t k = 0; k < u->nparts; k++)
    bounded[k] =
        !(shampoo_fold_part(pc_packed_len(u->order[k]), state[k], inc[k], state[k], beta2) &
          0x80000000u);
}

/* Part k's fold of a vouched increment in place (pd_mode.fold_vouched): s[i] gets
 * shampoo_fold_part's value bit for bit where x[i] is below 2^125 (rpc_f32_unvouched), else
 * keeps its own. Returns the OR of rpc_f32_big over the values left in s; *outside gets bit
 * 31 set when some x[i] was outside the vouch. */
SHAMPOO_CLONES static uint32_t shampoo_vouched_part(size_t len, float *s, const float *x,
                                                    float beta2, uint32_t *outside) {
  uint32_t big = 0, out = 0;
  const float w = beta2 == 1 ? 1 : 1 - beta2;
  for (size_t i = 0; i < len; i++) {
    uint32_t o = rpc_f32_unvouched(x[i]);
    float y = beta2 == 1 ? s[i] + x[i] : beta2 * s[i] + w * x[i];
    float v = o & 0x80000000u ? s[i] : y;
    out |= o;
    big |= rpc_f32_big(v);
    s[i] = v;
  }
  *outside |= out;
  return big;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define SHAMPOO_KEEP 1
/* shampoo_vouched_part by AVX-512 (no alignment needed), bit for bit: the same separate
 * multiply and add; a masked store leaves s where x is outside the vouch. Why: it is
 * shampoo_fold_keep without the spare's stream, 60-150 us of a 1024 push (session 14). */
__attribute__((target("avx512f"))) static uint32_t shampoo_vouched_512(size_t len, float *s,
                                                                       const float *x, float beta2,
                                                                       uint32_t *outside) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), carry = _mm512_set1_epi32(0x01800000);
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), lim = _mm512_set1_epi32(0x7e000000);
  const __m512 b = _mm512_set1_ps(beta2), w = _mm512_set1_ps(1 - beta2);
  __m512i big = _mm512_setzero_si512();
  __mmask16 out = 0;
  size_t i = 0;
  for (; i + 16 <= len; i += 16) {
    __m512 sv = _mm512_loadu_ps(s + i), xv = _mm512_loadu_ps(x + i);
    __mmask16 ok = _mm512_cmplt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(xv), absm), lim);
    __m512 y = beta2 == 1 ? _mm512_add_ps(sv, xv)
                          : _mm512_add_ps(_mm512_mul_ps(b, sv), _mm512_mul_ps(w, xv));
    y = _mm512_mask_blend_ps(ok, sv, y);
    out |= (__mmask16)~ok;
    big = _mm512_or_si512(big,
                          _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(y), expo), carry));
    _mm512_mask_storeu_ps(s + i, ok, y);
  }
  if (out) *outside |= 0x80000000u;
  return (uint32_t)_mm512_reduce_or_epi32(big) |
         shampoo_vouched_part(len - i, s + i, x + i, beta2, outside);
}
/* Part k's fold in place with its old values streamed to old (both 64-byte aligned, not
 * overlapping each other or x): the same expressions as shampoo_fold_part, bit for bit
 * (separate multiply and add, no FMA), each x[i] loaded once; returns its OR of
 * rpc_f32_big. Why: folding into a spare reads the spare's lines before writing them (a
 * read for ownership of 2 MB per factor); folding in place writes lines it has just read,
 * and the copy that keeps the fold undoable goes to memory by streaming stores, read only
 * when a push is refused. The sfence orders the streamed copy before the lock's release. */
__attribute__((target("avx512f"))) static uint32_t shampoo_fold_keep(size_t len, float *s,
                                                                     const float *x, float *old,
                                                                     float beta2) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), carry = _mm512_set1_epi32(0x01800000);
  __m512i big = _mm512_setzero_si512();
  size_t i = 0;
  if (beta2 == 1) {
    for (; i + 16 <= len; i += 16) {
      __m512 sv = _mm512_load_ps(s + i);
      _mm512_stream_ps(old + i, sv);
      __m512 y = _mm512_add_ps(sv, _mm512_loadu_ps(x + i));
      big = _mm512_or_si512(
          big, _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(y), expo), carry));
      _mm512_store_ps(s + i, y);
    }
  } else {
    const __m512 b = _mm512_set1_ps(beta2), w = _mm512_set1_ps(1 - beta2);
    for (; i + 16 <= len; i += 16) {
      __m512 sv = _mm512_load_ps(s + i);
      _mm512_stream_ps(old + i, sv);
      __m512 y = _mm512_add_ps(_mm512_mul_ps(b, sv), _mm512_mul_ps(w, _mm512_loadu_ps(x + i)));
      big = _mm512_or_si512(
          big, _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(y), expo), carry));
      _mm512_store_ps(s + i, y);
    }
  }
  _mm_sfence();
  uint32_t r = (uint32_t)_mm512_reduce_or_epi32(big);
  for (; i < len; i++) {
    old[i] = s[i];
    r |= shampoo_fold_part(1, &s[i], &x[i], &s[i], beta2);
  }
  return r;
}

/* Whether part buffers s and o can take shampoo_fold_keep here. */
static int shampoo_keeps(const float *s, const float *o) {
  return (((uintptr_t)s | (uintptr_t)o) & 63) == 0 && __builtin_cpu_supports("avx512f");
}
#else
#define SHAMPOO_KEEP 0
#endif

/* The fold with both checks in its one pass (pd_mode.fold_into): in place, the old values
 * to out, where the buffers are aligned for streaming stores and the CPU has AVX-512F
 * (precondd's own spares are, pd_shm_spare_take; a statistic from elsewhere moves into one
 * at its first such push), else into out. Only when some result is at or above 2^126 (rare:
 * huge statistics, or a bad push) are the results looked at again, in the daemon's own
 * memory: all finite admits them (not bounded); else the increment is looked at again to say
 * which refusal it is, an increment's NaN or Inf or an overflow (a client changing its slot
 * meanwhile can only change that message). The overflow test is exact here (the float result
 * itself is Inf), where fold_fits, computing in double, keeps a margin of 2^-20. */
static int shampoo_fold_into(const void *opts, const pd_block *u, float *const *state,
                             const float *const *inc, float *const *out, uint8_t *bounded,
                             uint8_t *in_place, uint32_t *part) {
  const float beta2 = ((const pd_shampoo_opts *)opts)->beta2;
  uint32_t over_part = UINT32_MAX, bad_part = UINT32_MAX;
  for (uint32_t k = 0; k < u->nparts; k++) {
    size_t len = pc_packed_len(u->order[k]);
    uint32_t big;
#if SHAMPOO_KEEP
    in_place[k] = (uint8_t)shampoo_keeps(state[k], out[k]);
    if (in_place[k])
      big = shampoo_fold_keep(len, state[k], inc[k], out[k], beta2);
    else
#else
    in_place[k] = 0;
#endif
      big = shampoo_fold_part(len, state[k], inc[k], out[k], beta2);
    bounded[k] = !(big & 0x80000000u);
    if (bounded[k] || rpc_f32_scan(len, in_place[k] ? state[k] : out[k]) != RPC_F32_BAD) continue;
    if (rpc_f32_scan(len, inc[k]) == RPC_F32_BAD) {
      if (bad_part == UINT32_MAX) bad_part = k;
    } else if (over_part == UINT32_MAX) {
      over_part = k;
    }
  }
  if (bad_part != UINT32_MAX) {
    *part = bad_part;
    return PD_FOLD_NONFINITE;
  }
  if (over_part != UINT32_MAX) {
    *part = over_part;
    return PD_FOLD_OVERFLOW;
  }
  return PD_FOLD_OK;
}

/* pd_mode.fold_vouched: each part in place, its values outside the vouch left unfolded. */
static int shampoo_fold_vouched(const void *opts, const pd_block *u, float *const *state,
                                const float *const *inc, uint8_t *bounded, uint32_t *part) {
  const float beta2 = ((const pd_shampoo_opts *)opts)->beta2;
  int torn = 0;
  for (uint32_t k = 0; k < u->nparts; k++) {
    size_t len = pc_packed_len(u->order[k]);
    uint32_t outside = 0, big;
#if SHAMPOO_KEEP
    if (__builtin_cpu_supports("avx512f"))
      big = shampoo_vouched_512(len, state[k], inc[k], beta2, &outside);
    else
#endif
      big = shampoo_vouched_part(len, state[k], inc[k], beta2, &outside);
    bounded[k] = !(big & 0x80000000u);
    if ((outside & 0x80000000u) && !torn) {
      torn = 1;
      *part = k;
    }
  }
  return torn;
}

/* 1 when every value of s and x is below 2^126 in magnitude (so finite): the exponent's
 * bits plus three carry into the sign bit from 2^126 up. No branch inside: it vectorizes. */
static int shampoo_both_below_2_126(size_t len, const float *s, const float *x) {
  uint32_t big = 0;
  for (size_t i = 0; i < len; i++) {
    big |= rpc_f32_big(s[i]) | rpc_f32_big(x[i]);
  }
  return !(big & 0x80000000u);
}

/* 1 if the statistic updated with inc (pc_stat_update's rule) stays finite. Computed in
 * double with a margin of 2^-20 below FLT_MAX, more than the rounding of the float kernel,
 * so a statistic this admits can never become Inf when pc_stat_update_f32 applies inc. */
static int shampoo_fold_fits(const void *opts, const pd_block *u, const float *const *state,
                             const float *const *inc) {
  float beta2 = ((const pd_shampoo_opts *)opts)->beta2;
  const double limit = (double)FLT_MAX * (1.0 - 1.0 / 1048576.0);
  const double b = beta2, w = beta2 == 1.0f ? 1.0 : 1.0 - (double)beta2;
  /* Every value looked at, no early exit, the length taken once: the loop vectorizes (it
   * was a quarter of a large push's time in the daemon, docs/precondd.md "Wire"). A NaN
   * compares false, as the early-exit form's did. */
  int fits = 1;
  for (uint32_t k = 0; k < u->nparts; k++) {
    const float *s = state[k], *x = inc[k];
    size_t len = pc_packed_len(u->order[k]);
    /* b + w is at most 2 (a sum): of values below 2^126 the update is below 2^127, far
     * under the limit. That float pass at copy speed decides nearly every push; the
     * double one (6 GB/s, a third of a large push's time) runs only when it cannot. */
    if (shampoo_both_below_2_126(len, s, x)) continue;
    for (size_t i = 0; i < len; i++) fits &= fabs(b * (double)s[i] + w * (double)x[i]) <= limit;
  }
  return fits;
}

/* What a block keeps between computations with --warm-roots on: the eigenbasis of each
 * factor's last root, so that the next root of a statistic that moved a little starts from
 * it (pc_inverse_root_warm_f32; docs/roots.md, "Steady state"). */
typedef struct {
  uint32_t nparts;
  size_t bytes; /* what it holds, for the daemon's memory count */
  pc_eigbasis_f32 basis[PD_MAX_PARTS];
} shampoo_unit;

static size_t shampoo_unit_free(void *unit_state) {
  shampoo_unit *w = unit_state;
  if (!w) return 0;
  size_t bytes = w->bytes;
  for (uint32_t k = 0; k < w->nparts; k++) pc_eigbasis_destroy_f32(&w->basis[k]);
  free(w);
  return bytes;
}

/* The block's warm state, made at its first computation; NULL when the daemon keeps none
 * (unit_state NULL) or it cannot be allocated (then this computation is cold, the next one
 * tries again). */
static shampoo_unit *shampoo_unit_get(const pd_block *u, void **unit_state, pd_compute_info *info) {
  if (!unit_state) return NULL;
  if (*unit_state) return *unit_state;
  shampoo_unit *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->nparts = u->nparts;
  w->bytes = sizeof *w;
  for (uint32_t k = 0; k < u->nparts; k++) {
    if (pc_eigbasis_init_f32(&w->basis[k], u->order[k]) != PC_OK) {
      shampoo_unit_free(w);
      return NULL;
    }
    w->bytes += pc_eigbasis_bytes_f32(u->order[k]);
  }
  info->state_bytes += (int64_t)w->bytes;
  *unit_state = w;
  return w;
}

static int shampoo_compute(const void *opts, const pd_block *u, const float *const *state,
                           void **unit_state, float *const *out, pd_compute_info *info) {
  const pd_shampoo_opts *o = opts;
  uint64_t nmax = u->order[0] > u->order[1] ? u->order[0] : u->order[1];
  float *a = malloc(nmax * nmax * sizeof *a), *x = malloc(nmax * nmax * sizeof *x);
  /* eigh runs in double: in float, eigenvalues near the ridge (1e-6 of the largest) carry
   * errors of the same size, and the residual then often exceeds the failure threshold, so
   * the block would publish nothing; syevd in double costs about the same at these orders. */
  const int eigh64 = o->method == PC_METHOD_EIGH && !unit_state; /* warm roots: their own */
  double *a64 = eigh64 ? malloc(nmax * nmax * sizeof *a64) : NULL;
  double *x64 = eigh64 ? malloc(nmax * nmax * sizeof *x64) : NULL;
  int rc = PC_ENOMEM;
  info->method = o->method;
  info->failed_part = -1;
  if (!a || !x || (eigh64 && (!a64 || !x64))) goto cleanup;
  pc_root_opts ro;
  pc_root_opts_default(&ro, (int)o->root_exponent);
  ro.epsilon = o->epsilon;
  ro.method = (pc_method)o->method; /* the cold method, and the warm path's fallback */
  shampoo_unit *w = shampoo_unit_get(u, unit_state, info);
  pc_warm_opts wo;
  pc_warm_opts_default(&wo);
  /* The guard at the daemon's default failure threshold (same measure: the sampled
   * max|x^p (A + ridge I) - I|), so that a warm root it lets through is publishable and
   * one it would not publish is recomputed cold instead of failing the block. */
  wo.guard_tol = 0.1;
  rc = PC_OK;
  /* Both factors, one after the other; the worst error and iteration count stand for both. */
  for (uint32_t k = 0; k < u->nparts && rc >= 0; k++) {
    size_t n = u->order[k];
    pc_root_info ri;
    memset(&ri, 0, sizeof ri);
    pc_unpack_f32(n, state[k], a);
    int rk;
    if (w) {
      pc_warm_info wi;
      rk = pc_inverse_root_warm_f32(n, a, x, &ro, &wo, &w->basis[k], &wi);
      ri = wi.root;
      if (rk >= 0)
        info->counts[wi.path == PC_WARM_ROTATED                             ? PD_SHAMPOO_WARM
                     : wi.path == PC_WARM_SEEDED || wi.path == PC_WARM_EIGH ? PD_SHAMPOO_SEEDED
                     : wi.path == PC_WARM_COLD
                         ? PD_SHAMPOO_COLD
                         : PD_SHAMPOO_SKIPPED]++; /* skipped, reused; eigh: a fresh syevd */
    } else if (eigh64) {
      for (size_t i = 0; i < n * n; i++) a64[i] = a[i];
      rk = pc_inverse_root_f64(n, a64, x64, &ro, &ri);
      for (size_t i = 0; rk >= 0 && i < n * n; i++) x[i] = (float)x64[i];
      if (rk >= 0) info->counts[PD_SHAMPOO_COLD]++;
    } else {
      rk = pc_inverse_root_f32(n, a, x, &ro, &ri);
      if (rk >= 0) info->counts[PD_SHAMPOO_COLD]++;
    }
    if (rk >= 0) pc_pack_f32(n, x, out[k]);
    if (rk != PC_OK) rc = rk;
    if (rk < 0) info->failed_part = (int)k;
    if (!(ri.error <= info->error)) info->error = ri.error; /* NaN wins */
    if ((uint32_t)ri.iters > info->iterations) info->iterations = (uint32_t)ri.iters;
  }
cleanup:
  free(a);
  free(x);
  free(a64);
  free(x64);
  return rc;
}

/* Snapshot section: u32 block_size | u32 skip_limit | f32 beta2 | u32 p | f64 epsilon |
 * u32 method | (format 6 on) u32 root_every (32 bytes; 28 before, root_every read as 0:
 * the default). */
static void shampoo_snap_write(const void *opts, unsigned char *out) {
  const pd_shampoo_opts *o = opts;
  uint32_t beta2;
  uint64_t eps;
  memcpy(&beta2, &o->beta2, 4);
  memcpy(&eps, &o->epsilon, 8);
  pd_le_put(out, o->block_size, 4);
  pd_le_put(out + 4, o->skip_limit, 4);
  pd_le_put(out + 8, beta2, 4);
  pd_le_put(out + 12, o->root_exponent, 4);
  pd_le_put(out + 16, eps, 8);
  pd_le_put(out + 24, (uint32_t)o->method, 4);
  pd_le_put(out + 28, o->root_every, 4);
}

static void shampoo_snap_read(const unsigned char *in, void *opts) {
  pd_shampoo_opts *o = opts;
  uint32_t beta2 = (uint32_t)pd_le_get(in + 8, 4);
  uint64_t eps = pd_le_get(in + 16, 8);
  o->block_size = (uint32_t)pd_le_get(in, 4);
  o->skip_limit = (uint32_t)pd_le_get(in + 4, 4);
  memcpy(&o->beta2, &beta2, 4);
  o->root_exponent = (uint32_t)pd_le_get(in + 12, 4);
  memcpy(&o->epsilon, &eps, 8);
  o->method = (int)(int32_t)(uint32_t)pd_le_get(in + 24, 4);
  o->root_every = (uint32_t)pd_le_get(in + 28, 4);
}

static void shampoo_describe(const void *opts, char *buf, size_t len) {
  const pd_shampoo_opts *o = opts;
  snprintf(buf, len,
           "block size %u, skip limit %u, beta2 %g, p %u, epsilon %g, method %d, roots every %u "
           "steps",
           o->block_size, o->skip_limit, (double)o->beta2, o->root_exponent, o->epsilon, o->method,
           o->root_every);
}

/* Roots when the block's statistics step enters a new window of root_every steps, the
 * windows offset by the block's id so that a job's blocks (pushed together every step) take
 * their turns on different steps instead of all at once; and at every push while the block
 * has no root, or when no push queued one since the daemon started (due_step 0). A step
 * rule rather than a push count: a worker that restarted, skipped steps or pushes every
 * stat_every steps still knows that the roots it sees are at most root_every - 1 steps
 * older than the window's first push (trainer/shampoo.c waits on that with sync_roots). */
static int shampoo_compute_due(const void *opts, const pd_block *u, uint64_t pushes, uint64_t step,
                               uint64_t due_step, int has_root) {
  (void)pushes;
  uint64_t every = ((const pd_shampoo_opts *)opts)->root_every;
  if (every <= 1 || !has_root || due_step == 0) return 1;
  return pc_root_window(step, u->id, every) > pc_root_window(due_step, u->id, every);
}

/* The ridge is relative (epsilon times the largest eigenvalue), so the root of c S is
 * exactly c^(-1/p) times the root of S. */
static double shampoo_scale_exponent(const void *opts) {
  return -1.0 / (double)((const pd_shampoo_opts *)opts)->root_exponent;
}

const pd_mode pd_mode_shampoo = {
    .name = "shampoo",
    .id = PD_MODE_SHAMPOO,
    .part_names = {"left factor", "right factor"},
    .opts_size = sizeof(pd_shampoo_opts),
    .resolve = shampoo_resolve,
    .layout = shampoo_layout,
    .fold = shampoo_fold,
    .fold_fits = shampoo_fold_fits,
    .fold_bounded = shampoo_fold_bounded,
    .fold_into = shampoo_fold_into,
    .fold_vouched = shampoo_fold_vouched,
    .compute = shampoo_compute,
    .unit_free = shampoo_unit_free,
    .count_names = {"warm", "skipped", "seeded", "cold"},
    .publishable = pd_publishable_finite,
    .snap_bytes = 32,
    .snap_bytes_f5 = 28,
    .snap_write = shampoo_snap_write,
    .snap_read = shampoo_snap_read,
    .describe = shampoo_describe,
    .drift_test = 1,
    .scale_exponent = shampoo_scale_exponent,
    .compute_due = shampoo_compute_due,
};
