/*
 * limits.c -- what one request may cost, decided on its bytes before they are parsed.
 *
 * Parsing a protobuf allocates per element: an empty TensorSpec is 2 bytes on the wire and
 * some 100 bytes once unpacked, and every handler then does work per element. So each
 * method has its own size limit (below the global --max-message-mb) and a limit on its one
 * repeated top-level field, both checked here by a scan of the wire format that allocates
 * nothing and skips the contents of length-delimited fields in one step. A request that
 * passes is parsed by protobuf-c, which remains the judge of well-formedness: the scan only
 * counts, and stops (admitting) at anything it does not understand.
 *
 * What this cannot do: gRPC's receive limit is one value for the whole server, so a message
 * is received in full (up to --max-message-mb) before it reaches this check. The server
 * checks the bearer token before it asks gRPC for the message (server.c), which bounds what
 * an unauthenticated client can make precondd hold to HTTP/2's flow-control window.
 */
#include "precondd.h"

#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>

/* The small requests: a job name and a flag or two. */
#define PD__SMALL_REQUEST_BYTES ((size_t)64 << 10)
/* Register: PD_MAX_TENSORS tensors with names of up to 256 bytes and rank-8 shapes. */
#define PD__REGISTER_BYTES ((size_t)32 << 20)
/* Fetch: one BlockVersion (at most 2 + 6 + 11 bytes) per block, and a job name. */
#define PD__FETCH_BYTES_PER_BLOCK 24u

typedef struct {
  size_t max_bytes;
  uint32_t field; /* the repeated top-level field counted; 0: none */
  size_t max_count;
  const char *name;  /* of that field, for the message */
  const char *limit; /* the option or constant behind max_count */
} pd__rule;

static pd__rule pd__rule_of(const pd_config *cfg, pd_method m) {
  pd__rule r = {PD__SMALL_REQUEST_BYTES, 0, 0, "", ""};
  size_t cap = cfg->max_message_bytes;
  switch (m) {
    case PD_M_REGISTER:
      r = (pd__rule){PD__REGISTER_BYTES, 3, PD_MAX_TENSORS, "tensors", "PD_MAX_TENSORS"};
      break;
    case PD_M_PUSH:
      r = (pd__rule){cap, 3, cfg->max_blocks_per_job, "blocks", "--max-blocks-per-job"};
      break;
    case PD_M_FETCH:
      r = (pd__rule){
          PD__SMALL_REQUEST_BYTES + (size_t)cfg->max_blocks_per_job * PD__FETCH_BYTES_PER_BLOCK, 2,
          cfg->max_blocks_per_job, "have", "--max-blocks-per-job"};
      break;
    default:
      break;
  }
  if (r.max_bytes > cap) r.max_bytes = cap;
  return r;
}

size_t pd_request_max_bytes(const pd_config *cfg, pd_method m) {
  return pd__rule_of(cfg, m).max_bytes;
}

/* The scan's state between slices. */
typedef struct {
  enum { PD__TAG, PD__VARINT, PD__LENGTH, PD__SKIP, PD__DONE } state;
  uint64_t acc; /* varint being read */
  int shift;
  uint64_t skip; /* bytes left to skip */
  size_t count;  /* occurrences of the counted field */
} pd__scan;

/* Feeds n bytes to the scan; stops (PD__DONE) on anything malformed, which protobuf-c will
 * report properly. */
static void pd__scan_feed(pd__scan *s, const pd__rule *r, const uint8_t *p, size_t n) {
  size_t i = 0;
  while (i < n && s->state != PD__DONE) {
    if (s->state == PD__SKIP) {
      size_t k = s->skip < n - i ? (size_t)s->skip : n - i;
      i += k;
      s->skip -= k;
      if (s->skip == 0) s->state = PD__TAG;
      continue;
    }
    uint8_t b = p[i++];
    if (s->shift >= 64) {
      s->state = PD__DONE; /* a varint longer than 10 bytes */
      break;
    }
    s->acc |= (uint64_t)(b & 0x7f) << s->shift;
    s->shift += 7;
    if (b & 0x80) continue;
    uint64_t v = s->acc;
    s->acc = 0;
    s->shift = 0;
    if (s->state == PD__VARINT) {
      s->state = PD__TAG;
    } else if (s->state == PD__LENGTH) {
      s->skip = v;
      s->state = v ? PD__SKIP : PD__TAG;
    } else {
      uint64_t field = v >> 3;
      unsigned wire = (unsigned)(v & 7);
      if (r->field && field == r->field && wire == 2) s->count++;
      switch (wire) {
        case 0:
          s->state = PD__VARINT;
          break;
        case 1:
          s->skip = 8;
          s->state = PD__SKIP;
          break;
        case 2:
          s->state = PD__LENGTH;
          break;
        case 5:
          s->skip = 4;
          s->state = PD__SKIP;
          break;
        default:
          s->state = PD__DONE;
          break; /* groups or garbage */
      }
    }
  }
}

int pd_request_admit(const pd_config *cfg, pd_method m, grpc_byte_buffer *payload, char *err,
                     size_t errlen) {
  if (!payload) return PD_OK;
  pd__rule r = pd__rule_of(cfg, m);
  /* For a compressed message this is the compressed size; the scan below bounds the
   * decompressed bytes too. */
  if (grpc_byte_buffer_length(payload) > r.max_bytes) goto too_big;
  grpc_byte_buffer_reader rd;
  if (!grpc_byte_buffer_reader_init(&rd, payload)) return PD_OK; /* parsing will fail */
  pd__scan s;
  memset(&s, 0, sizeof s);
  s.state = PD__TAG;
  size_t total = 0;
  grpc_slice sl;
  int over_bytes = 0;
  while (grpc_byte_buffer_reader_next(&rd, &sl)) {
    size_t n = GRPC_SLICE_LENGTH(sl);
    total += n;
    if (total > r.max_bytes)
      over_bytes = 1;
    else if (r.field)
      pd__scan_feed(&s, &r, GRPC_SLICE_START_PTR(sl), n);
    grpc_slice_unref(sl);
    if (over_bytes || s.count > r.max_count) break;
  }
  grpc_byte_buffer_reader_destroy(&rd);
  if (over_bytes) goto too_big;
  if (r.field && s.count > r.max_count) {
    snprintf(err, errlen, "%s: more than %zu entries in one request (%s)", r.name, r.max_count,
             r.limit);
    return PD_ELIMIT;
  }
  return PD_OK;
too_big:
  snprintf(err, errlen, "request above this method's size limit of %zu bytes", r.max_bytes);
  return PD_ELIMIT;
}
