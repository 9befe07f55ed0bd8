/*
 * shm.h -- libprecond internal: the client's side of the same-host data path (a region the
 * daemon made for this client, docs/precondd.md "Shared memory"). Not public (prefix
 * precond__shm); used by client.c, bench-daemon's shm rows and the tests. One thread uses a
 * region at a time (libprecond: its background thread).
 */
#ifndef PRECOND_CLIENT_SHM_H
#define PRECOND_CLIENT_SHM_H

#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>

#include "precond.pb-c.h"
#include "rpc.h"

typedef struct {
  uint64_t id;
  uint8_t secret[RPC_SHM_SECRET_BYTES];
  unsigned char *map; /* NULL: no region */
  size_t bytes;
  int fd;
  uint64_t in_pos; /* next free byte of the client's ring (the first half) */
} precond__shm;

/* Asks the daemon on ch for a region of want bytes (0: its default), opens the file it
 * names, takes a shared flock on it (held until precond__shm_close: the daemon frees the
 * region when no lock is left, e.g. when this process dies) and maps it. On RPC_OK *s is
 * ready; otherwise *s is closed, *code has the gRPC status (UNIMPLEMENTED: a daemon without
 * shared memory) and err a message. token as rpc_call_token's. */
int precond__shm_open(grpc_channel *ch, const char *token, long deadline_ms, uint64_t want,
                      precond__shm *s, grpc_status_code *code, char *err, size_t errlen);

/* Unmaps and closes (dropping the lock). A closed or zeroed *s is a no-op. */
void precond__shm_close(precond__shm *s);

/* The session fields a request carries. */
void precond__shm_session(const precond__shm *s, Precond__V1__ShmSession *w);

/* Moves the bytes of push matrix m into the region (its ring), if they fit the first half:
 * sets m->shm to *ref (caller-provided, lives until the call is sent) and empties m->data.
 * Returns the bytes moved (0: m keeps its bytes). */
size_t precond__shm_put(precond__shm *s, Precond__V1__PackedMatrix *m, Precond__V1__ShmRef *ref);

/* For every matrix of a fetch answer that names the region: checks that the reference lies
 * in the daemon's half and that the bytes there have its CRC-32C, and points data at them
 * (no copy: the caller decodes them into its own roots, the one copy the bytes path makes
 * too). Returns the bytes checked, or -1 with a message naming the field in err (a
 * reference out of place or a checksum that differs: the answer must not be used). Either
 * way precond__shm_fetch_done(r) must run before r is freed. */
long long precond__shm_fetch_in(const precond__shm *s, Precond__V1__FetchResponse *r, char *err,
                                size_t errlen);

/* Detaches the data pointers precond__shm_fetch_in set (they are the region's, not the
 * answer's), so protobuf_c_message_free_unpacked(r) frees only what is r's. */
void precond__shm_fetch_done(Precond__V1__FetchResponse *r);

#endif /* PRECOND_CLIENT_SHM_H */
