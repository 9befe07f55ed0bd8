/*
 * codec.c -- the packed wire codec (rpc.h): how PackedMatrix.data holds values. One rule,
 * little-endian on the wire, used by precondd's service and by libprecond.
 */
#include "rpc.h"

#include <stdint.h>
#include <string.h>

#include "preconditioner.h"

enum { RPC__FP32 = 0, RPC__BF16 = 1, RPC__CHUNK = 1024 };

static int rpc__little_endian(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

size_t rpc_packed_width(int encoding) {
  return encoding == RPC__FP32 ? 4 : encoding == RPC__BF16 ? 2 : 0;
}

int rpc_packed_native(int encoding) {
  return encoding == RPC__FP32 && rpc__little_endian();
}

int rpc_packed_decode(int encoding, const void *data, size_t len, size_t count, float *out) {
  size_t width = rpc_packed_width(encoding);
  if (width == 0 || (count && (!data || !out)) || len / width != count || len % width)
    return RPC_EINVAL;
  const unsigned char *p = data;
  if (rpc_packed_native(encoding)) {
    memcpy(out, p, len);
  } else if (encoding == RPC__FP32) {
    for (size_t k = 0; k < count; k++, p += 4) {
      uint32_t u =
          (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
      memcpy(&out[k], &u, 4);
    }
  } else {
    uint16_t h[RPC__CHUNK]; /* in pieces: no allocation, any alignment of data */
    for (size_t k0 = 0; k0 < count; k0 += RPC__CHUNK) {
      size_t n = count - k0 < RPC__CHUNK ? count - k0 : RPC__CHUNK;
      for (size_t k = 0; k < n; k++, p += 2) h[k] = (uint16_t)(p[0] | p[1] << 8);
      pc_bf16_to_f32(n, h, out + k0);
    }
  }
  return RPC_OK;
}

int rpc_packed_encode(int encoding, const float *in, size_t count, void *out) {
  if (rpc_packed_width(encoding) == 0 || (count && (!in || !out))) return RPC_EINVAL;
  unsigned char *p = out;
  if (rpc_packed_native(encoding)) {
    memcpy(p, in, count * 4);
  } else if (encoding == RPC__FP32) {
    for (size_t k = 0; k < count; k++) {
      uint32_t u;
      memcpy(&u, &in[k], 4);
      for (int b = 0; b < 4; b++) *p++ = (unsigned char)(u >> (8 * b));
    }
  } else {
    uint16_t h[RPC__CHUNK];
    for (size_t k0 = 0; k0 < count; k0 += RPC__CHUNK) {
      size_t n = count - k0 < RPC__CHUNK ? count - k0 : RPC__CHUNK;
      pc_f32_to_bf16(n, in + k0, h);
      for (size_t k = 0; k < n; k++) {
        *p++ = (unsigned char)(h[k] & 0xff);
        *p++ = (unsigned char)(h[k] >> 8);
      }
    }
  }
  return RPC_OK;
}
