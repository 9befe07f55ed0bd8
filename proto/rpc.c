/*
 * rpc.c -- gRPC core <-> protobuf-c glue: byte buffers, channels, a blocking unary call.
 */
#include "rpc.h"

#include <errno.h>
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

const char *rpc_strerror(int code) {
  switch (code) {
    case RPC_OK:
      return "success";
    case RPC_EINVAL:
      return "invalid argument";
    case RPC_ENOMEM:
      return "out of memory";
    case RPC_ETOOBIG:
      return "message above the size limit";
    case RPC_EPARSE:
      return "message does not parse";
    case RPC_ESTATUS:
      return "RPC failed with a non-OK status";
    case RPC_ECALL:
      return "gRPC refused to start the call";
    default:
      return "unknown rpc error code";
  }
}

const char *rpc_status_name(grpc_status_code code) {
  switch (code) {
    case GRPC_STATUS_OK:
      return "OK";
    case GRPC_STATUS_CANCELLED:
      return "CANCELLED";
    case GRPC_STATUS_UNKNOWN:
      return "UNKNOWN";
    case GRPC_STATUS_INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case GRPC_STATUS_DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case GRPC_STATUS_NOT_FOUND:
      return "NOT_FOUND";
    case GRPC_STATUS_ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case GRPC_STATUS_PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case GRPC_STATUS_FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case GRPC_STATUS_ABORTED:
      return "ABORTED";
    case GRPC_STATUS_OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case GRPC_STATUS_UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case GRPC_STATUS_INTERNAL:
      return "INTERNAL";
    case GRPC_STATUS_UNAVAILABLE:
      return "UNAVAILABLE";
    case GRPC_STATUS_DATA_LOSS:
      return "DATA_LOSS";
    case GRPC_STATUS_UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN_STATUS_CODE";
  }
}

static size_t rpc__limit(size_t max_bytes) {
  if (max_bytes == 0) return RPC_DEFAULT_MAX_MESSAGE_BYTES;
  return max_bytes > RPC_MAX_MESSAGE_BYTES_CAP ? RPC_MAX_MESSAGE_BYTES_CAP : max_bytes;
}

void rpc_size_args(grpc_channel_args *args, grpc_arg arg[2], size_t max_bytes) {
  int limit = (int)rpc__limit(max_bytes);
  arg[0].type = GRPC_ARG_INTEGER;
  arg[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  arg[0].value.integer = limit;
  arg[1].type = GRPC_ARG_INTEGER;
  arg[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  arg[1].value.integer = limit;
  args->num_args = 2;
  args->args = arg;
}

/* The transport defaults: {key, value} pairs, the winners of the measurements in
 * docs/precondd.md ("Wire"). None so far: each candidate (frame size, lookahead, BDP probe,
 * write buffer, read chunks, retries) and a set of them were measured against gRPC's own
 * values and none won beyond the run-to-run noise, so gRPC's stay. A winner goes here and
 * reaches libprecond, precondctl, the benches and precondd's server at once. */
static const struct {
  const char *key;
  int value;
} rpc__transport_defaults[] = {
    {NULL, 0},
};

void rpc_args_init(rpc_args *a, size_t max_bytes) {
  memset(a, 0, sizeof *a);
  int limit = (int)rpc__limit(max_bytes);
  rpc_args_set_int(a, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, limit);
  rpc_args_set_int(a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, limit);
  for (size_t i = 0; rpc__transport_defaults[i].key != NULL; i++)
    rpc_args_set_int(a, rpc__transport_defaults[i].key, rpc__transport_defaults[i].value);
}

int rpc_args_set_int(rpc_args *a, const char *key, int value) {
  if (!a || !key || !*key || strlen(key) >= RPC_ARG_KEY_BYTES) return RPC_EINVAL;
  size_t i = 0;
  while (i < a->n && strcmp(a->key[i], key) != 0) i++;
  if (i == RPC_ARGS_MAX) return RPC_ENOMEM;
  if (i == a->n) {
    snprintf(a->key[i], sizeof a->key[i], "%s", key);
    a->n++;
  }
  a->arg[i].type = GRPC_ARG_INTEGER;
  a->arg[i].key = a->key[i];
  a->arg[i].value.integer = value;
  return RPC_OK;
}

int rpc_args_parse(rpc_args *a, const char *key_eq_value) {
  if (!a || !key_eq_value) return RPC_EINVAL;
  const char *eq = strchr(key_eq_value, '=');
  if (!eq || eq == key_eq_value || (size_t)(eq - key_eq_value) >= RPC_ARG_KEY_BYTES)
    return RPC_EINVAL;
  char key[RPC_ARG_KEY_BYTES];
  memcpy(key, key_eq_value, (size_t)(eq - key_eq_value));
  key[eq - key_eq_value] = '\0';
  char *end = NULL;
  errno = 0;
  long v = strtol(eq + 1, &end, 10);
  if (end == eq + 1 || *end != '\0' || errno != 0 || v < INT_MIN || v > INT_MAX) return RPC_EINVAL;
  return rpc_args_set_int(a, key, (int)v);
}

const grpc_channel_args *rpc_args_get(rpc_args *a) {
  for (size_t i = 0; i < a->n; i++) a->arg[i].key = a->key[i]; /* in case a was copied */
  a->args.num_args = a->n;
  a->args.args = a->arg;
  return &a->args;
}

grpc_channel *rpc_channel_create_args(const char *target, rpc_args *a) {
  if (!target || !*target || !a) return NULL;
  grpc_init();
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  grpc_channel *channel = grpc_channel_create(target, creds, rpc_args_get(a));
  grpc_channel_credentials_release(creds);
  if (!channel) grpc_shutdown();
  return channel;
}

int rpc_pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out) {
  if (out) *out = NULL;
  if (!msg || !out) return RPC_EINVAL;
  size_t n = protobuf_c_message_get_packed_size(msg);
  if (n > rpc__limit(max_bytes)) return RPC_ETOOBIG;
  grpc_slice slice = grpc_slice_malloc(n);
  size_t written = protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(slice));
  if (written != n) {
    grpc_slice_unref(slice);
    return RPC_EINVAL;
  }
  *out = grpc_raw_byte_buffer_create(&slice, 1);
  grpc_slice_unref(slice); /* the buffer took its own reference */
  return *out ? RPC_OK : RPC_ENOMEM;
}

/* ---- a request whose large bytes fields gRPC sends from where they are ---------------- */

/* A large bytes field: at least this many bytes. Sent, it is borrowed (a slice over the
 * caller's memory) while the rest of the message is packed into copies, so a 4 MB push
 * costs the client no copy of its own; received, it is gathered out of gRPC's slices into
 * its own buffer in one copy (rpc__lift_unpack). Below it the bookkeeping costs more than
 * the copy (docs/precondd.md, "Wire"). */
#define RPC__LARGE_BYTES ((size_t)64 << 10)

/* The borrowed slices of one call: gRPC releases each (rpc__borrow_done) once it is done with
 * the bytes, which the caller must keep until then (rpc__borrow_wait). */
typedef struct {
  pthread_mutex_t lock;
  pthread_cond_t done;
  size_t out; /* slices gRPC still holds */
} rpc__borrow;

static void rpc__borrow_done(void *user) {
  rpc__borrow *b = user;
  pthread_mutex_lock(&b->lock);
  if (--b->out == 0) pthread_cond_broadcast(&b->done);
  pthread_mutex_unlock(&b->lock);
}

/* Blocks until gRPC released every borrowed slice (after the call, when its stream is gone:
 * at once, in practice), then frees b's lock. */
static void rpc__borrow_wait(rpc__borrow *b) {
  pthread_mutex_lock(&b->lock);
  while (b->out > 0) pthread_cond_wait(&b->done, &b->lock);
  pthread_mutex_unlock(&b->lock);
  pthread_cond_destroy(&b->done);
  pthread_mutex_destroy(&b->lock);
}

/* protobuf-c's packing target: runs of small appends go into a copied piece, large ones
 * (a bytes field's data, appended as it lies in the message) become borrowed slices. */
typedef struct {
  ProtobufCBuffer base;
  grpc_slice *slices;
  size_t n, cap;
  unsigned char *piece; /* the copied piece being filled */
  size_t piece_len, piece_cap;
  rpc__borrow *borrow;
  int failed;
} rpc__slicer;

static int rpc__slicer_push(rpc__slicer *z, grpc_slice s) {
  if (z->n == z->cap) {
    size_t cap = z->cap ? 2 * z->cap : 16;
    grpc_slice *g = realloc(z->slices, cap * sizeof *g);
    if (!g) {
      grpc_slice_unref(s);
      return -1;
    }
    z->slices = g;
    z->cap = cap;
  }
  z->slices[z->n++] = s;
  return 0;
}

/* Ends the copied piece being filled (a slice that owns a copy of its bytes). */
static void rpc__slicer_flush(rpc__slicer *z) {
  if (z->piece_len == 0) return;
  if (rpc__slicer_push(z, grpc_slice_from_copied_buffer((const char *)z->piece, z->piece_len)))
    z->failed = 1;
  z->piece_len = 0;
}

static void rpc__slicer_append(ProtobufCBuffer *buf, size_t len, const uint8_t *data) {
  rpc__slicer *z = (rpc__slicer *)buf;
  if (z->failed || len == 0) return;
  if (len >= RPC__LARGE_BYTES) {
    rpc__slicer_flush(z);
    pthread_mutex_lock(&z->borrow->lock);
    z->borrow->out++;
    pthread_mutex_unlock(&z->borrow->lock);
    if (rpc__slicer_push(z, grpc_slice_new_with_user_data((void *)(uintptr_t)data, len,
                                                          rpc__borrow_done, z->borrow)))
      z->failed = 1;
    return;
  }
  if (z->piece_cap - z->piece_len < len) {
    size_t cap = z->piece_cap ? 2 * z->piece_cap : 4096;
    while (cap - z->piece_len < len) cap *= 2;
    unsigned char *p = realloc(z->piece, cap);
    if (!p) {
      z->failed = 1;
      return;
    }
    z->piece = p;
    z->piece_cap = cap;
  }
  memcpy(z->piece + z->piece_len, data, len);
  z->piece_len += len;
}

/* rpc_pack whose large bytes fields are borrowed from msg (which must stay unchanged until
 * rpc__borrow_wait(b) returns, after the call and grpc_byte_buffer_destroy(*out)); b is
 * initialised here whatever the result. */
static int rpc__pack_borrowed(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out,
                              rpc__borrow *b) {
  *out = NULL;
  pthread_mutex_init(&b->lock, NULL);
  pthread_cond_init(&b->done, NULL);
  b->out = 0;
  if (protobuf_c_message_get_packed_size(msg) > rpc__limit(max_bytes)) return RPC_ETOOBIG;
  rpc__slicer z = {.base = {rpc__slicer_append}, .borrow = b};
  protobuf_c_message_pack_to_buffer(msg, &z.base);
  rpc__slicer_flush(&z);
  if (!z.failed) *out = grpc_raw_byte_buffer_create(z.slices, z.n);
  for (size_t i = 0; i < z.n; i++) grpc_slice_unref(z.slices[i]); /* the buffer's refs stay */
  free(z.slices);
  free(z.piece);
  return *out ? RPC_OK : RPC_ENOMEM;
}

/* ---- a received message whose large bytes fields are gathered in one copy ------------- */

/* A received message of many slices (a large one) used to be flattened into one copy and
 * then parsed by protobuf-c, which copies every bytes field once more: two copies of a 4 MB
 * push in the daemon. Instead the wire format is walked over the slices: every large,
 * singular bytes field is gathered into a malloc'd buffer of its own (the one copy) and
 * left empty in a compact copy of the rest of the message (nested lengths rewritten), which
 * protobuf-c parses; the gathered buffers are then attached where the empty fields are,
 * found again by their path of fields and repeated indices. protobuf-c's default allocator
 * is malloc/free, so protobuf_c_message_free_unpacked frees them as its own. Anything this
 * walk is not sure about (a group, a oneof, a singular field seen twice in one message,
 * which protobuf would merge, bytes that do not parse) gives up, and the message takes the
 * flatten-and-parse path, which reports errors as before. */

#define RPC__LIFT_DEPTH 8 /* nested messages a gathered field may lie in */

typedef struct { /* a reader over a message's slices */
  const grpc_slice *s;
  size_t ns, i, off, pos; /* slice i, offset in it; pos: bytes read in all */
} rpc__rd;

typedef struct {
  const ProtobufCFieldDescriptor *fd[RPC__LIFT_DEPTH + 1];
  size_t index[RPC__LIFT_DEPTH + 1]; /* repeated fields: which element */
  int depth;                         /* fd[depth] is the bytes field */
  uint8_t *data;
  size_t len;
} rpc__hole;

typedef struct {
  unsigned char *out; /* the compact message */
  size_t len, cap;
  rpc__hole *holes;
  size_t nholes, capholes;
} rpc__lift;

static int rpc__rd_copy(rpc__rd *r, void *dst, size_t n) {
  unsigned char *d = dst;
  while (n > 0) {
    if (r->i >= r->ns) return -1;
    size_t have = GRPC_SLICE_LENGTH(r->s[r->i]) - r->off, k = have < n ? have : n;
    if (d) memcpy(d, GRPC_SLICE_START_PTR(r->s[r->i]) + r->off, k);
    if (d) d += k;
    n -= k;
    r->off += k;
    r->pos += k;
    if (r->off == GRPC_SLICE_LENGTH(r->s[r->i])) r->i++, r->off = 0;
  }
  return 0;
}

static int rpc__rd_varint(rpc__rd *r, uint64_t *v) {
  *v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    unsigned char b;
    if (rpc__rd_copy(r, &b, 1)) return -1;
    *v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) return 0;
  }
  return -1;
}

static unsigned char *rpc__lift_room(rpc__lift *L, size_t n) {
  if (L->cap - L->len < n) {
    size_t cap = L->cap ? 2 * L->cap : 4096;
    while (cap - L->len < n) cap *= 2;
    unsigned char *o = realloc(L->out, cap);
    if (!o) return NULL;
    L->out = o;
    L->cap = cap;
  }
  unsigned char *at = L->out + L->len;
  L->len += n;
  return at;
}

/* Appends v as a varint of exactly width bytes (0: as few as it needs); protobuf reads a
 * length padded with 0x80 continuation bytes as the same length. */
static int rpc__lift_varint(rpc__lift *L, uint64_t v, int width) {
  unsigned char b[10];
  int n = 0;
  do {
    b[n] = (unsigned char)(v & 0x7f);
    v >>= 7;
    if (v || n + 1 < width) b[n] |= 0x80;
    n++;
  } while (v || n < width);
  unsigned char *at = rpc__lift_room(L, (size_t)n);
  if (!at) return -1;
  memcpy(at, b, (size_t)n);
  return 0;
}

/* The fields of one message (of type d, up to r->pos == end) into L; path[0..depth-1] leads
 * to it. Returns 0, or -1: give up (the caller falls back). */
static int rpc__lift_msg(rpc__rd *r, size_t end, const ProtobufCMessageDescriptor *d, rpc__lift *L,
                         rpc__hole *path, int depth) {
  size_t *seen = calloc(d->n_fields ? d->n_fields : 1, sizeof *seen); /* occurrences */
  int rc = seen ? 0 : -1;
  while (rc == 0 && r->pos < end) {
    uint64_t tag, len;
    if (rpc__rd_varint(r, &tag) || (tag >> 3) == 0 || (tag >> 3) > 0x1fffffff) {
      rc = -1;
      break;
    }
    const ProtobufCFieldDescriptor *fd =
        protobuf_c_message_descriptor_get_field(d, (unsigned)(tag >> 3));
    size_t fi = fd ? (size_t)(fd - d->fields) : 0;
    int repeated = fd && fd->label == PROTOBUF_C_LABEL_REPEATED;
    if (fd && !repeated &&
        (fd->type == PROTOBUF_C_TYPE_MESSAGE || fd->type == PROTOBUF_C_TYPE_BYTES) &&
        (seen[fi] > 0 || (fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF))) {
      rc = -1; /* merged or chosen by protobuf: not followed here */
      break;
    }
    size_t index = fd ? seen[fi]++ : 0;
    if (rpc__lift_varint(L, tag, 0)) {
      rc = -1;
      break;
    }
    switch (tag & 7) {
      case 0: {
        uint64_t v;
        rc = rpc__rd_varint(r, &v) || rpc__lift_varint(L, v, 0) ? -1 : 0;
        break;
      }
      case 1:
      case 5: {
        size_t n = (tag & 7) == 1 ? 8 : 4;
        unsigned char *at = rpc__lift_room(L, n);
        rc = at && rpc__rd_copy(r, at, n) == 0 ? 0 : -1;
        break;
      }
      case 2:
        if (rpc__rd_varint(r, &len) || len > end - r->pos) {
          rc = -1;
          break;
        }
        if (fd && len >= RPC__LARGE_BYTES && depth < RPC__LIFT_DEPTH &&
            (fd->type == PROTOBUF_C_TYPE_BYTES && !repeated)) {
          /* Gathered; the compact message gets the field empty. */
          if (L->nholes == L->capholes) {
            size_t cap = L->capholes ? 2 * L->capholes : 8;
            rpc__hole *h = realloc(L->holes, cap * sizeof *h);
            if (!h) {
              rc = -1;
              break;
            }
            L->holes = h;
            L->capholes = cap;
          }
          rpc__hole *h = &L->holes[L->nholes];
          *h = *path;
          h->fd[depth] = fd;
          h->index[depth] = 0;
          h->depth = depth;
          h->len = (size_t)len;
          h->data = malloc((size_t)len);
          if (!h->data) {
            rc = -1;
            break;
          }
          L->nholes++;
          rc = rpc__rd_copy(r, h->data, (size_t)len) || rpc__lift_varint(L, 0, 0) ? -1 : 0;
        } else if (fd && len >= RPC__LARGE_BYTES && depth < RPC__LIFT_DEPTH &&
                   fd->type == PROTOBUF_C_TYPE_MESSAGE) {
          /* Followed: its length is known once its own large fields are out. */
          size_t at = L->len;
          if (rpc__lift_varint(L, 0, 5)) {
            rc = -1;
            break;
          }
          rpc__hole inner = *path;
          inner.fd[depth] = fd;
          inner.index[depth] = index;
          size_t start = L->len;
          rc = rpc__lift_msg(r, r->pos + (size_t)len, fd->descriptor, L, &inner, depth + 1);
          uint64_t n = L->len - start;
          if (rc == 0 && n < ((uint64_t)1 << 35)) {
            for (int k = 0; k < 5; k++, n >>= 7)
              L->out[at + (size_t)k] = (unsigned char)((n & 0x7f) | (k < 4 ? 0x80 : 0));
          } else {
            rc = -1;
          }
        } else {
          unsigned char *to;
          rc = rpc__lift_varint(L, len, 0) || !(to = rpc__lift_room(L, (size_t)len)) ||
                       rpc__rd_copy(r, to, (size_t)len)
                   ? -1
                   : 0;
        }
        break;
      default:
        rc = -1; /* groups (3, 4) and invalid wire types */
    }
  }
  if (rc == 0 && r->pos != end) rc = -1;
  free(seen);
  return rc;
}

/* Puts hole h's gathered bytes where its path leads in msg. -1: not there (give up). */
static int rpc__lift_attach(ProtobufCMessage *msg, rpc__hole *h) {
  ProtobufCMessage *m = msg;
  for (int k = 0; k < h->depth && m; k++) {
    const ProtobufCFieldDescriptor *fd = h->fd[k];
    char *base = (char *)m;
    if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(size_t *)(void *)(base + fd->quantifier_offset);
      ProtobufCMessage **arr = *(ProtobufCMessage ***)(void *)(base + fd->offset);
      m = h->index[k] < n ? arr[h->index[k]] : NULL;
    } else {
      m = *(ProtobufCMessage **)(void *)(base + fd->offset);
    }
  }
  if (!m) return -1;
  ProtobufCBinaryData *bd = (ProtobufCBinaryData *)(void *)((char *)m + h->fd[h->depth]->offset);
  if (bd->len != 0) return -1;
  free(bd->data); /* NULL, or protobuf-c's empty allocation */
  bd->data = h->data;
  bd->len = h->len;
  h->data = NULL; /* the message's now */
  return 0;
}

int rpc__lift_unpack(const grpc_slice *s, size_t n, const ProtobufCMessageDescriptor *desc,
                     ProtobufCMessage **out) {
  *out = NULL;
  size_t total = 0;
  for (size_t i = 0; i < n; i++) total += GRPC_SLICE_LENGTH(s[i]);
  rpc__rd r = {.s = s, .ns = n};
  rpc__lift L = {0};
  rpc__hole path = {.depth = 0};
  int rc = rpc__lift_msg(&r, total, desc, &L, &path, 0) == 0 ? RPC_OK : RPC_EPARSE;
  if (rc == RPC_OK) {
    *out = protobuf_c_message_unpack(desc, NULL, L.len, L.out);
    if (!*out) rc = RPC_EPARSE;
  }
  for (size_t i = 0; rc == RPC_OK && i < L.nholes; i++)
    if (rpc__lift_attach(*out, &L.holes[i])) rc = RPC_EPARSE;
  if (rc != RPC_OK && *out) {
    protobuf_c_message_free_unpacked(*out, NULL);
    *out = NULL;
  }
  for (size_t i = 0; i < L.nholes; i++) free(L.holes[i].data);
  free(L.holes);
  free(L.out);
  return rc;
}

int rpc_unpack(grpc_byte_buffer *buf, const ProtobufCMessageDescriptor *desc, size_t max_bytes,
               ProtobufCMessage **out) {
  if (out) *out = NULL;
  if (!desc || !out) return RPC_EINVAL;
  if (!buf) return RPC_EPARSE;
  size_t limit = rpc__limit(max_bytes);
  /* For a compressed buffer this is the compressed size: checked again after readall. */
  if (grpc_byte_buffer_length(buf) > limit) return RPC_ETOOBIG;

  /* One uncompressed slice (most small messages): parsed where it is, not flattened into
   * a copy first. */
  if (buf->type == GRPC_BB_RAW && buf->data.raw.compression == GRPC_COMPRESS_NONE &&
      buf->data.raw.slice_buffer.count == 1) {
    grpc_slice one = buf->data.raw.slice_buffer.slices[0];
    *out = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(one), GRPC_SLICE_START_PTR(one));
    return *out ? RPC_OK : RPC_EPARSE;
  }
  /* Many slices (a large message): its large bytes fields gathered in one copy each. */
  if (buf->type == GRPC_BB_RAW && buf->data.raw.compression == GRPC_COMPRESS_NONE &&
      grpc_byte_buffer_length(buf) >= RPC__LARGE_BYTES &&
      rpc__lift_unpack(buf->data.raw.slice_buffer.slices, buf->data.raw.slice_buffer.count, desc,
                       out) == RPC_OK)
    return RPC_OK;
  grpc_byte_buffer_reader reader;
  if (!grpc_byte_buffer_reader_init(&reader, buf)) return RPC_EPARSE;
  grpc_slice all = grpc_byte_buffer_reader_readall(&reader);
  grpc_byte_buffer_reader_destroy(&reader);

  int rc = RPC_OK;
  size_t n = GRPC_SLICE_LENGTH(all);
  if (n > limit) {
    rc = RPC_ETOOBIG;
    goto done;
  }
  /* protobuf-c copies strings and bytes fields, so the slice can go once this returns. */
  *out = protobuf_c_message_unpack(desc, NULL, n, GRPC_SLICE_START_PTR(all));
  if (!*out) rc = RPC_EPARSE;
done:
  grpc_slice_unref(all);
  return rc;
}

grpc_channel *rpc_channel_create(const char *target, size_t max_message_bytes) {
  rpc_args a;
  rpc_args_init(&a, max_message_bytes);
  return rpc_channel_create_args(target, &a);
}

grpc_channel *rpc_channel_create_tls(const char *target, size_t max_message_bytes,
                                     const char *root_pem, const char *cert_pem,
                                     const char *key_pem) {
  if (!target || !*target || (!cert_pem != !key_pem)) return NULL;
  grpc_init();
  rpc_args a;
  rpc_args_init(&a, max_message_bytes);
  grpc_ssl_pem_key_cert_pair pair = {key_pem, cert_pem};
  grpc_channel_credentials *creds =
      grpc_ssl_credentials_create(root_pem, cert_pem ? &pair : NULL, NULL, NULL);
  grpc_channel *channel = creds ? grpc_channel_create(target, creds, rpc_args_get(&a)) : NULL;
  if (creds) grpc_channel_credentials_release(creds);
  if (!channel) grpc_shutdown();
  return channel;
}

void rpc_channel_destroy(grpc_channel *channel) {
  if (!channel) return;
  grpc_channel_destroy(channel);
  grpc_shutdown();
}

/* strdup into malloc (not gpr_malloc) memory so that callers free() it. */
static char *rpc__strdup(const char *s) {
  size_t n = strlen(s);
  char *d = malloc(n + 1);
  if (d) memcpy(d, s, n + 1);
  return d;
}

static char *rpc__slice_strdup(grpc_slice s) {
  size_t n = GRPC_SLICE_LENGTH(s);
  char *d = malloc(n + 1);
  if (!d) return NULL;
  if (n) memcpy(d, GRPC_SLICE_START_PTR(s), n);
  d[n] = '\0';
  return d;
}

/* Local failures are reported like remote ones so that callers handle one kind. */
static int rpc__fail(int rc, grpc_status_code code, const char *msg, grpc_status_code *status,
                     char **details) {
  if (status) *status = code;
  if (details) *details = rpc__strdup(msg);
  return rc;
}

/* The call itself: sends send_buf (not consumed), waits, fills *recv_buf with the
 * response bytes (owned by the caller) on an OK status. */
static int rpc__call_buffer(grpc_channel *channel, const char *method, grpc_byte_buffer *send_buf,
                            long deadline_ms, int wait_for_ready, const char *token,
                            grpc_byte_buffer **recv_out, grpc_status_code *status, char **details) {
  *recv_out = NULL;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  gpr_timespec deadline = deadline_ms > 0
                              ? gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                             gpr_time_from_millis(deadline_ms, GPR_TIMESPAN))
                              : gpr_inf_future(GPR_CLOCK_MONOTONIC);
  grpc_slice method_slice = grpc_slice_from_copied_string(method);
  grpc_call *call = grpc_channel_create_call(channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             method_slice, NULL, deadline, NULL);
  grpc_slice_unref(method_slice);

  grpc_metadata_array recv_initial, recv_trailing;
  grpc_metadata_array_init(&recv_initial);
  grpc_metadata_array_init(&recv_trailing);
  grpc_byte_buffer *recv_buf = NULL;
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  grpc_slice status_details = grpc_empty_slice();
  const char *error_string = NULL;
  grpc_metadata auth;
  char *auth_value = NULL;
  int have_auth = token && *token;
  int rc = RPC_OK;

  if (!call) {
    rc = rpc__fail(RPC_ECALL, GRPC_STATUS_INTERNAL, "grpc_channel_create_call failed", status,
                   details);
    goto cleanup;
  }
  if (have_auth) {
    size_t n = strlen(token);
    auth_value = malloc(n + 8);
    if (!auth_value) {
      rc = rpc__fail(RPC_ENOMEM, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", status, details);
      goto cleanup;
    }
    memcpy(auth_value, "Bearer ", 7);
    memcpy(auth_value + 7, token, n + 1);
    memset(&auth, 0, sizeof auth);
    auth.key = grpc_slice_from_static_string("authorization");
    auth.value = grpc_slice_from_static_string(auth_value);
  }

  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = have_auth ? 1 : 0;
  ops[0].data.send_initial_metadata.metadata = have_auth ? &auth : NULL;
  if (wait_for_ready)
    ops[0].flags =
        GRPC_INITIAL_METADATA_WAIT_FOR_READY | GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = send_buf;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &recv_initial;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &recv_buf;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &recv_trailing;
  ops[5].data.recv_status_on_client.status = &code;
  ops[5].data.recv_status_on_client.status_details = &status_details;
  ops[5].data.recv_status_on_client.error_string = &error_string;

  int tag_storage = 0;
  void *tag = &tag_storage;
  if (grpc_call_start_batch(call, ops, 6, tag, NULL) != GRPC_CALL_OK) {
    rc =
        rpc__fail(RPC_ECALL, GRPC_STATUS_INTERNAL, "grpc_call_start_batch failed", status, details);
    goto cleanup;
  }
  /* The call's deadline bounds this wait; the batch always completes (success = 1 even
   * when the RPC failed: the status code says how it went). */
  grpc_event ev;
  do {
    ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  } while (ev.type != GRPC_OP_COMPLETE || ev.tag != tag);

  if (status) *status = code;
  if (code != GRPC_STATUS_OK) {
    if (details) *details = rpc__slice_strdup(status_details);
    rc = RPC_ESTATUS;
    goto cleanup;
  }
  if (!recv_buf) {
    rc = rpc__fail(RPC_EPARSE, GRPC_STATUS_INTERNAL, "no response message", status, details);
    goto cleanup;
  }
  *recv_out = recv_buf;
  recv_buf = NULL;

cleanup:
  if (call) grpc_call_unref(call);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  if (recv_buf) grpc_byte_buffer_destroy(recv_buf);
  grpc_metadata_array_destroy(&recv_initial);
  grpc_metadata_array_destroy(&recv_trailing);
  grpc_slice_unref(status_details);
  if (error_string) gpr_free((void *)error_string);
  free(auth_value);
  return rc;
}

int rpc_call_raw(grpc_channel *channel, const char *method, const void *bytes, size_t len,
                 long deadline_ms, int wait_for_ready, const char *token, grpc_byte_buffer **resp,
                 grpc_status_code *status, char **details) {
  if (details) *details = NULL;
  if (resp) *resp = NULL;
  if (!channel || !method || !*method || (!bytes && len) || !resp)
    return rpc__fail(RPC_EINVAL, GRPC_STATUS_INVALID_ARGUMENT, "rpc_call_raw: invalid argument",
                     status, details);
  grpc_slice slice = grpc_slice_from_copied_buffer(bytes, len);
  grpc_byte_buffer *send_buf = grpc_raw_byte_buffer_create(&slice, 1);
  grpc_slice_unref(slice);
  int rc = rpc__call_buffer(channel, method, send_buf, deadline_ms, wait_for_ready, token, resp,
                            status, details);
  grpc_byte_buffer_destroy(send_buf);
  if (rc == RPC_OK && details) *details = rpc__strdup("");
  return rc;
}

int rpc_call_token(grpc_channel *channel, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, long deadline_ms,
                   int wait_for_ready, const char *token, ProtobufCMessage **resp,
                   grpc_status_code *status, char **details) {
  if (details) *details = NULL;
  if (resp) *resp = NULL;
  if (!channel || !method || !*method || !req || !resp_desc || !resp)
    return rpc__fail(RPC_EINVAL, GRPC_STATUS_INVALID_ARGUMENT, "rpc_call: invalid argument", status,
                     details);

  grpc_byte_buffer *send_buf = NULL;
  rpc__borrow borrow;
  int rc = rpc__pack_borrowed(req, 0, &send_buf, &borrow);
  if (rc != RPC_OK) {
    rpc__borrow_wait(&borrow);
    return rpc__fail(
        rc, rc == RPC_EINVAL ? GRPC_STATUS_INVALID_ARGUMENT : GRPC_STATUS_RESOURCE_EXHAUSTED,
        rc == RPC_ETOOBIG ? "request above the message size limit" : rpc_strerror(rc), status,
        details);
  }
  grpc_byte_buffer *recv_buf = NULL;
  rc = rpc__call_buffer(channel, method, send_buf, deadline_ms, wait_for_ready, token, &recv_buf,
                        status, details);
  grpc_byte_buffer_destroy(send_buf);
  rpc__borrow_wait(&borrow); /* req's bytes are the caller's again */
  if (rc != RPC_OK) return rc;
  rc = rpc_unpack(recv_buf, resp_desc, RPC_MAX_MESSAGE_BYTES_CAP, resp);
  grpc_byte_buffer_destroy(recv_buf);
  if (rc != RPC_OK)
    return rpc__fail(rc, GRPC_STATUS_INTERNAL, "response does not parse", status, details);
  if (details) *details = rpc__strdup("");
  return RPC_OK;
}

int rpc_call(grpc_channel *channel, const char *method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, long deadline_ms, int wait_for_ready,
             ProtobufCMessage **resp, grpc_status_code *status, char **details) {
  return rpc_call_token(channel, method, req, resp_desc, deadline_ms, wait_for_ready, NULL, resp,
                        status, details);
}

int rpc_keep_freed_memory(void) {
#if defined(__GLIBC__)
  /* Blocks up to 32 MiB (glibc's largest threshold) from the heap rather than each its own
   * fresh mapping, and up to one default message of free memory kept at the heap's top
   * instead of handed back at every free. */
  int ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
           mallopt(M_TRIM_THRESHOLD, (int)RPC_DEFAULT_MAX_MESSAGE_BYTES) == 1;
  return ok ? RPC_OK : RPC_EINVAL;
#else
  return RPC_OK;
#endif
}
