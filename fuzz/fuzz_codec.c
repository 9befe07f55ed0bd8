/*
 * fuzz_codec.c -- libFuzzer harness: the packed and bf16 codecs of preconditioner/ that every
 * push and fetch goes through, checked by their properties rather than for crashes alone:
 *   bf16 -> fp32 -> bf16 is the identity for every non-NaN value;
 *   fp32 -> bf16 rounds to nearest: within half a bf16 ulp (2^-8 relative, 2^-134 among
 *     subnormals), or to an
 *     infinity only from beyond the largest finite bf16;
 *   packed -> dense -> packed is the identity (bit for bit), and dense is symmetric.
 * Input: one byte choosing the order n (0..63) of the packed matrix, then values.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_bf16(const uint8_t *data, size_t size) {
  size_t count = size / 2;
  uint16_t *h = malloc((count ? count : 1) * sizeof *h), *h2 = malloc((count ? count : 1) * 2);
  float *f = malloc((count ? count : 1) * sizeof *f);
  if (!h || !h2 || !f) abort();
  memcpy(h, data, count * 2);
  pc_bf16_to_f32(count, h, f);
  pc_f32_to_bf16(count, f, h2);
  for (size_t i = 0; i < count; i++)
    if (!isnan(f[i]) && h[i] != h2[i]) abort();
  free(h);
  free(h2);
  free(f);
}

static void check_round(const uint8_t *data, size_t size) {
  size_t count = size / 4;
  float *f = malloc((count ? count : 1) * sizeof *f), *back = malloc((count ? count : 1) * 4);
  uint16_t *h = malloc((count ? count : 1) * sizeof *h);
  if (!f || !back || !h) abort();
  memcpy(f, data, count * 4);
  pc_f32_to_bf16(count, f, h);
  pc_bf16_to_f32(count, h, back);
  for (size_t i = 0; i < count; i++) {
    if (!isfinite(f[i])) {
      if (isnan(f[i]) != isnan(back[i])) abort();
      continue;
    }
    if (isinf(back[i])) {
      if (fabsf(f[i]) < 3.3895e38f) abort(); /* the largest finite bf16 is 3.3895314e38 */
      continue;
    }
    /* Half an ulp: 2^-8 relative for normal values, 2^-134 absolute among subnormals. */
    double d = fabs((double)f[i] - (double)back[i]);
    if (d > fabs((double)f[i]) * (1.0 / 256.0) + ldexp(1.0, -134)) abort();
  }
  free(f);
  free(back);
  free(h);
}

static void check_packed(size_t n, const uint8_t *data, size_t size) {
  size_t len = pc_packed_len(n);
  float *p = calloc(len ? len : 1, sizeof *p), *p2 = calloc(len ? len : 1, sizeof *p2);
  float *a = malloc((n * n ? n * n : 1) * sizeof *a);
  if (!p || !p2 || !a) abort();
  memcpy(p, data, size < len * 4 ? size : len * 4);
  pc_unpack_f32(n, p, a);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++)
      if (memcmp(&a[i * n + j], &a[j * n + i], sizeof(float)) != 0) abort();
  pc_pack_f32(n, a, p2);
  if (memcmp(p, p2, len * sizeof *p) != 0) abort();
  free(p);
  free(p2);
  free(a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  check_bf16(data + 1, size - 1);
  check_round(data + 1, size - 1);
  check_packed(data[0] % 64, data + 1, size - 1);
  return 0;
}
