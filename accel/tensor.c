/*
 * tensor.c -- ac_tensor (device memory with a shape) and ac_param (a named value + gradient
 * pair), on top of the ac_malloc / ac_memcpy primitives, so they work on every backend.
 */
#include <stdlib.h>
#include <string.h>

#include "backend.h"

#define NAME_MAX_BYTES 256

static size_t dtype_size(ac_dtype dtype) {
  return dtype == AC_I32 ? sizeof(int32_t) : sizeof(float);
}

/* Shape checks shared by init and view: numel into *numel, no overflow. */
static int shape_check(ac_dtype dtype, int ndim, const size_t *shape, size_t *numel) {
  size_t count = 1;
  if ((dtype != AC_F32 && dtype != AC_I32) || ndim < 0 || ndim > AC_MAX_DIMS ||
      (ndim > 0 && shape == NULL))
    return AC_EINVAL;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] != 0 && count > SIZE_MAX / dtype_size(dtype) / shape[d]) return AC_EINVAL;
    count *= shape[d];
  }
  *numel = count;
  return AC_OK;
}

static void set_shape(ac_tensor *t, ac_backend *be, ac_dtype dtype, int ndim, const size_t *shape,
                      size_t numel) {
  t->be = be;
  t->dtype = dtype;
  t->ndim = ndim;
  for (int d = 0; d < AC_MAX_DIMS; d++) t->shape[d] = d < ndim ? shape[d] : 1;
  t->numel = numel;
}

int ac_tensor_init(ac_tensor *t, ac_backend *be, ac_dtype dtype, int ndim, const size_t *shape) {
  size_t numel = 0;
  int rc;

  if (t == NULL) return AC_EINVAL;
  memset(t, 0, sizeof *t);
  if (be == NULL) return AC_EINVAL;
  rc = shape_check(dtype, ndim, shape, &numel);
  if (rc != AC_OK) return rc;
  rc = ac_malloc(be, numel * dtype_size(dtype), &t->data);
  if (rc != AC_OK) goto fail;
  set_shape(t, be, dtype, ndim, shape, numel);
  t->owns = 1;
  /* Zero as bits: 0.0f and int 0 are both all-zero. */
  rc = dtype == AC_F32 ? ac_fill_f32(be, numel, t->data, 0.0f) : ac_fill_i32(be, numel, t->data, 0);
  if (rc != AC_OK) goto fail;
  return AC_OK;

fail:
  ac_tensor_destroy(t);
  return rc;
}

int ac_tensor_view(ac_tensor *t, ac_backend *be, ac_dtype dtype, int ndim, const size_t *shape,
                   void *data) {
  size_t numel = 0;
  if (t == NULL) return AC_EINVAL;
  memset(t, 0, sizeof *t);
  if (be == NULL || shape_check(dtype, ndim, shape, &numel) != AC_OK || (numel > 0 && data == NULL))
    return AC_EINVAL;
  set_shape(t, be, dtype, ndim, shape, numel);
  t->data = numel > 0 ? data : NULL;
  t->owns = 0;
  return AC_OK;
}

void ac_tensor_destroy(ac_tensor *t) {
  if (t == NULL) return;
  if (t->owns && t->data != NULL) ac_free(t->be, t->data);
  memset(t, 0, sizeof *t);
}

float *ac_tensor_f32(const ac_tensor *t) {
  return t != NULL && t->dtype == AC_F32 ? (float *)t->data : NULL;
}

int32_t *ac_tensor_i32(const ac_tensor *t) {
  return t != NULL && t->dtype == AC_I32 ? (int32_t *)t->data : NULL;
}

size_t ac_tensor_bytes(const ac_tensor *t) {
  return t != NULL ? t->numel * dtype_size(t->dtype) : 0;
}

int ac_tensor_upload(ac_tensor *t, const void *host) {
  if (t == NULL || t->be == NULL) return AC_EINVAL;
  return ac_memcpy_h2d(t->be, t->data, host, ac_tensor_bytes(t));
}

int ac_tensor_download(const ac_tensor *t, void *host) {
  if (t == NULL || t->be == NULL) return AC_EINVAL;
  return ac_memcpy_d2h(t->be, host, t->data, ac_tensor_bytes(t));
}

int ac_param_init(ac_param *p, ac_backend *be, const char *name, int ndim, const size_t *shape) {
  int rc;
  size_t len;

  if (p == NULL) return AC_EINVAL;
  memset(p, 0, sizeof *p);
  if (name == NULL) return AC_EINVAL;
  len = strnlen(name, NAME_MAX_BYTES);
  if (len == 0 || len >= NAME_MAX_BYTES) return AC_EINVAL;
  p->name = malloc(len + 1);
  if (p->name == NULL) return AC_ENOMEM;
  memcpy(p->name, name, len + 1);
  rc = ac_tensor_init(&p->value, be, AC_F32, ndim, shape);
  if (rc != AC_OK) goto fail;
  rc = ac_tensor_init(&p->grad, be, AC_F32, ndim, shape);
  if (rc != AC_OK) goto fail;
  return AC_OK;

fail:
  ac_param_destroy(p);
  return rc;
}

void ac_param_destroy(ac_param *p) {
  if (p == NULL) return;
  ac_tensor_destroy(&p->value);
  ac_tensor_destroy(&p->grad);
  free(p->name);
  memset(p, 0, sizeof *p);
}
