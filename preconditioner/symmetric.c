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

/* In blocks without a branch inside, so the loop vectorizes (and, add and or: SSE2 has
 * them): the exponent's bits plus one carry into the sign bit exactly when they are all
 * ones, an Inf or a NaN. The early-exit form ran at a third of a copy's speed, a whole
 * pass over every push (daemon and client, docs/precondd.md "Wire"). */
int pc_all_finite_f32(size_t count, const float *x) {
  enum { BLOCK = 1024 };
  for (size_t i0 = 0; i0 < count; i0 += BLOCK) {
    size_t m = count - i0 < BLOCK ? count - i0 : BLOCK;
    uint32_t bad = 0;
    for (size_t i = 0; i < m; i++) {
      uint32_t u;
      memcpy(&u, &x[i0 + i], sizeof u);
      bad |= (u & 0x7f800000u) + 0x00800000u;
    }
    if (bad & 0x80000000u) return 0;
  }
  return 1;
}

int pc_all_finite_f64(size_t count, const double *x) {
  for (size_t i = 0; i < count; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}
