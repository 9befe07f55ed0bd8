/* symmetric.c -- packed upper-triangle layout, bf16 transport, finiteness checks. */
#include <math.h>
#include <string.h>

#include "preconditioner.h"

size_t pc_packed_len(size_t n) {
  return n * (n + 1) / 2;
}

/* Row i of the packed upper triangle holds a[i][i..n-1]: n - i values. */
void pc_pack_f32(size_t n, const float *dense, float *packed) {
  for (size_t i = 0; i < n; i++) {
    memcpy(packed, dense + i * n + i, (n - i) * sizeof *packed);
    packed += n - i;
  }
}

void pc_pack_f64(size_t n, const double *dense, double *packed) {
  for (size_t i = 0; i < n; i++) {
    memcpy(packed, dense + i * n + i, (n - i) * sizeof *packed);
    packed += n - i;
  }
}

void pc_unpack_f32(size_t n, const float *packed, float *dense) {
  for (size_t i = 0; i < n; i++) {
    for (size_t j = i; j < n; j++) {
      dense[i * n + j] = *packed;
      dense[j * n + i] = *packed;
      packed++;
    }
  }
}

void pc_unpack_f64(size_t n, const double *packed, double *dense) {
  for (size_t i = 0; i < n; i++) {
    for (size_t j = i; j < n; j++) {
      dense[i * n + j] = *packed;
      dense[j * n + i] = *packed;
      packed++;
    }
  }
}

/* bf16 is the upper half of an IEEE binary32. Rounding to nearest even adds 0x7fff plus the
 * lowest kept bit before truncating; a NaN keeps its sign and gets the quiet bit so that
 * truncation cannot turn it into an infinity. */
void pc_f32_to_bf16(size_t count, const float *in, uint16_t *out) {
  for (size_t i = 0; i < count; i++) {
    uint32_t u;
    memcpy(&u, &in[i], sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      out[i] = (uint16_t)((u >> 16) | 0x0040u);
      continue;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    out[i] = (uint16_t)(u >> 16);
  }
}

void pc_bf16_to_f32(size_t count, const uint16_t *in, float *out) {
  for (size_t i = 0; i < count; i++) {
    uint32_t u = (uint32_t)in[i] << 16;
    memcpy(&out[i], &u, sizeof u);
  }
}

/* Bit 31 set when x is NaN or Inf: OR it over many values and test once (below). */
static inline uint32_t nonfinite_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x7f800000u) + 0x00800000u;
}

/* In blocks without a branch inside, so the loop vectorizes (and, add and or: SSE2 has
 * them): the exponent's bits plus one carry into the sign bit exactly when they are all
 * ones, an Inf or a NaN. The early-exit form ran at a third of a copy's speed, a whole
 * pass over every push (daemon and client, docs/precondd.md "Wire"). */
int pc_all_finite_f32(size_t count, const float *x) {
  enum { BLOCK = 1024 };
  for (size_t i0 = 0; i0 < count; i0 += BLOCK) {
    size_t m = count - i0 < BLOCK ? count - i0 : BLOCK;
    uint32_t bad = 0;
    for (size_t i = 0; i < m; i++) bad |= nonfinite_bits(x[i0 + i]);
    if (bad & 0x80000000u) return 0;
  }
  return 1;
}

/* Row i of packed is copied to dense row i with the finiteness test of pc_all_finite_f32
 * (one vectorised loop), then the lower triangle is mirrored tile by tile from rows that are
 * still in cache: column-wise stores (a 512-byte stride at n = 128) were the unpack's cost. */
int pc_unpack_finite_f32(size_t n, const float *packed, float *dense, size_t ld) {
  enum { TILE = 16 };
  uint32_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    float *row = dense + i * ld;
    for (size_t j = i; j < n; j++) {
      bad |= nonfinite_bits(packed[j - i]);
      row[j] = packed[j - i];
    }
    packed += n - i;
  }
  for (size_t i0 = 0; i0 < n; i0 += TILE)
    for (size_t j0 = i0; j0 < n; j0 += TILE) {
      const size_t i1 = i0 + TILE < n ? i0 + TILE : n, j1 = j0 + TILE < n ? j0 + TILE : n;
      for (size_t j = j0; j < j1; j++)
        for (size_t i = i0; i < i1 && i < j; i++) dense[j * ld + i] = dense[i * ld + j];
    }
  return (bad & 0x80000000u) == 0;
}

int pc_all_finite_f64(size_t count, const double *x) {
  for (size_t i = 0; i < count; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}
