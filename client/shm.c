/*
 * shm.c -- libprecond's side of the same-host data path: opening the daemon's region,
 * writing push statistics into it and reading fetched roots out of it (shm.h). The
 * checksum and ring rules are proto/shm.c's, the daemon's side host/shm.c.
 */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void precond__shm_close(precond__shm *s) {
  if (s->map != NULL) munmap(s->map, s->bytes);
  if (s->map != NULL && s->fd >= 0) close(s->fd); /* drops the flock */
  memset(s, 0, sizeof *s);
  s->fd = -1;
}

int precond__shm_open(grpc_channel *ch, const char *token, long deadline_ms, uint64_t want,
                      precond__shm *s, grpc_status_code *code, char *err, size_t errlen) {
  memset(s, 0, sizeof *s);
  s->fd = -1;
  Precond__V1__ShmOpenRequest req = PRECOND__V1__SHM_OPEN_REQUEST__INIT;
  req.bytes = want;
  ProtobufCMessage *msg = NULL;
  char *details = NULL;
  *code = GRPC_STATUS_OK;
  int rc = rpc_call_token(ch, RPC_METHOD_OPEN_SHM, &req.base,
                          &precond__v1__shm_open_response__descriptor, deadline_ms, 0, token, &msg,
                          code, &details);
  if (rc != RPC_OK) {
    snprintf(err, errlen, "OpenSharedMemory: %s: %s", rpc_status_name(*code),
             details ? details : rpc_strerror(rc));
    free(details);
    return rc;
  }
  free(details);
  const Precond__V1__ShmOpenResponse *r = (const Precond__V1__ShmOpenResponse *)msg;
  int fd = -1;
  struct stat st;
  rc = RPC_EINVAL;
  if (r->secret.len != RPC_SHM_SECRET_BYTES || r->bytes < 2 * RPC_SHM_ALIGN ||
      r->bytes % (2 * RPC_SHM_ALIGN) != 0 || r->path == NULL) {
    snprintf(err, errlen, "OpenSharedMemory: a malformed answer");
    goto fail;
  }
  errno = 0;
  fd = open(r->path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  /* The lock first, then the first call that names the region (the daemon sees it in use
   * from then on and unlinks the name). The file must be the size announced. */
  if (fd < 0 || flock(fd, LOCK_SH) != 0 || fstat(fd, &st) != 0 ||
      (uint64_t)st.st_size != r->bytes) {
    snprintf(err, errlen, "shared memory %s: %s", r->path,
             fd < 0 || errno ? strerror(errno) : "not the size announced");
    goto fail;
  }
  void *map = mmap(NULL, (size_t)r->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    snprintf(err, errlen, "shared memory %s: mmap: %s", r->path, strerror(errno));
    goto fail;
  }
  s->map = map;
  s->fd = fd;
  s->bytes = (size_t)r->bytes;
  s->id = r->id;
  memcpy(s->secret, r->secret.data, RPC_SHM_SECRET_BYTES);
  protobuf_c_message_free_unpacked(msg, NULL);
  return RPC_OK;

fail:
  *code = GRPC_STATUS_FAILED_PRECONDITION;
  if (fd >= 0) close(fd);
  protobuf_c_message_free_unpacked(msg, NULL);
  return rc;
}

void precond__shm_session(const precond__shm *s, Precond__V1__ShmSession *w) {
  precond__v1__shm_session__init(w);
  w->id = s->id;
  w->secret.data = (uint8_t *)(uintptr_t)s->secret;
  w->secret.len = RPC_SHM_SECRET_BYTES;
}

size_t precond__shm_put(precond__shm *s, Precond__V1__PackedMatrix *m, Precond__V1__ShmRef *ref) {
  uint64_t off = 0;
  if (s->map == NULL || m->data.len == 0 ||
      rpc_shm_ring_take(&s->in_pos, s->bytes / 2, m->data.len, &off) != RPC_OK)
    return 0;
  precond__v1__shm_ref__init(ref);
  ref->offset = off;
  ref->length = m->data.len;
  ref->crc32c = rpc_shm_copy_crc(s->map + off, m->data.data, m->data.len);
  m->shm = ref;
  m->data.data = NULL;
  m->data.len = 0;
  return (size_t)ref->length;
}

long long precond__shm_fetch_in(const precond__shm *s, Precond__V1__FetchResponse *r, char *err,
                                size_t errlen) {
  long long total = 0;
  for (size_t i = 0; i < r->n_preconditioners; i++) {
    Precond__V1__BlockRoots *b = r->preconditioners[i];
    Precond__V1__PackedMatrix *part[4] = {b->left, b->right, b->a_inv, b->g_inv};
    static const char *const name[4] = {"left", "right", "a_inv", "g_inv"};
    for (int k = 0; k < 4; k++) {
      Precond__V1__PackedMatrix *m = part[k];
      if (m == NULL || m->shm == NULL) continue;
      const Precond__V1__ShmRef *ref = m->shm;
      if (s->map == NULL || m->data.len != 0 ||
          rpc_shm_ref_check(s->bytes, s->bytes / 2, s->bytes, ref->offset, ref->length,
                            (size_t)ref->length) != RPC_OK) {
        snprintf(err, errlen, "preconditioners[%zu].%s.shm: outside the daemon's half", i,
                 name[k]);
        return -1;
      }
      if (rpc_shm_crc(s->map + ref->offset, (size_t)ref->length) != ref->crc32c) {
        snprintf(err, errlen, "preconditioners[%zu].%s.shm: checksum mismatch", i, name[k]);
        return -1;
      }
      free(m->data.data); /* empty: protobuf-c may have left a NULL or its own empty buffer */
      m->data.data = s->map + ref->offset;
      m->data.len = (size_t)ref->length;
      total += (long long)ref->length;
    }
  }
  return total;
}

void precond__shm_fetch_done(Precond__V1__FetchResponse *r) {
  for (size_t i = 0; r != NULL && i < r->n_preconditioners; i++) {
    Precond__V1__BlockRoots *b = r->preconditioners[i];
    Precond__V1__PackedMatrix *part[4] = {b->left, b->right, b->a_inv, b->g_inv};
    for (int k = 0; k < 4; k++)
      if (part[k] != NULL && part[k]->shm != NULL) {
        part[k]->data.data = NULL;
        part[k]->data.len = 0;
      }
  }
}
