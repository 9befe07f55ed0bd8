/* test_rpc.c -- unit tests of proto/ (rpc.h): byte-buffer packing, size limits, channels, and
 * the blocking call's failure paths (no server: nothing listens on the port used); the packed
 * codec (codec.c), the shared-memory rules and client side (shm.c) and the JSON string
 * escaper (json.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

#include "precond.pb-c.h"
#include "rpc.h"

static void test_pack_unpack_roundtrip(void **state) {
  (void)state;
  float data[6] = {1, 2, 3, 4, 5, 6};
  Precond__V1__PackedMatrix left = PRECOND__V1__PACKED_MATRIX__INIT;
  left.n = 3;
  left.data.len = sizeof data;
  left.data.data = (uint8_t *)data;
  Precond__V1__BlockStatistics blk = PRECOND__V1__BLOCK_STATISTICS__INIT;
  blk.block_id = 7;
  blk.left = &left;
  Precond__V1__BlockStatistics *blks[1] = {&blk};
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = (char *)"job-a";
  req.step = 42;
  req.n_blocks = 1;
  req.blocks = blks;

  grpc_byte_buffer *bb = NULL;
  assert_int_equal(rpc_pack(&req.base, 0, &bb), RPC_OK);
  assert_non_null(bb);
  ProtobufCMessage *out = NULL;
  assert_int_equal(rpc_unpack(bb, &precond__v1__push_request__descriptor, 0, &out), RPC_OK);
  Precond__V1__PushRequest *got = (Precond__V1__PushRequest *)out;
  assert_string_equal(got->job, "job-a");
  assert_int_equal(got->step, 42);
  assert_int_equal(got->n_blocks, 1);
  assert_int_equal(got->blocks[0]->block_id, 7);
  assert_int_equal(got->blocks[0]->left->n, 3);
  assert_int_equal(got->blocks[0]->left->data.len, sizeof data);
  assert_memory_equal(got->blocks[0]->left->data.data, data, sizeof data);
  assert_null(got->blocks[0]->right);
  protobuf_c_message_free_unpacked(out, NULL);

  /* The limit applies to the serialised size on both sides. */
  size_t n = grpc_byte_buffer_length(bb);
  assert_int_equal(rpc_unpack(bb, &precond__v1__push_request__descriptor, n - 1, &out),
                   RPC_ETOOBIG);
  assert_null(out);
  grpc_byte_buffer_destroy(bb);
  assert_int_equal(rpc_pack(&req.base, n - 1, &bb), RPC_ETOOBIG);
  assert_null(bb);
  assert_int_equal(rpc_pack(&req.base, n, &bb), RPC_OK);
  grpc_byte_buffer_destroy(bb);
}

static void test_unpack_garbage(void **state) {
  (void)state;
  /* Field 1 declared as a length-delimited string of 100 bytes, but only 3 follow. */
  const char garbage[] =
      "\x0a\x64"
      "abc";
  grpc_slice s = grpc_slice_from_copied_buffer(garbage, sizeof garbage - 1);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  ProtobufCMessage *out = (ProtobufCMessage *)1;
  assert_int_equal(rpc_unpack(bb, &precond__v1__push_request__descriptor, 0, &out), RPC_EPARSE);
  assert_null(out);
  grpc_byte_buffer_destroy(bb);

  /* An empty message is valid protobuf: all fields default. */
  grpc_slice e = grpc_empty_slice();
  bb = grpc_raw_byte_buffer_create(&e, 1);
  assert_int_equal(rpc_unpack(bb, &precond__v1__push_request__descriptor, 0, &out), RPC_OK);
  assert_int_equal(((Precond__V1__PushRequest *)out)->n_blocks, 0);
  protobuf_c_message_free_unpacked(out, NULL);
  grpc_byte_buffer_destroy(bb);

  assert_int_equal(rpc_unpack(NULL, &precond__v1__push_request__descriptor, 0, &out), RPC_EPARSE);
  assert_int_equal(rpc_unpack(bb, NULL, 0, &out), RPC_EINVAL);
  assert_int_equal(rpc_pack(NULL, 0, &bb), RPC_EINVAL);
}

/* A large message arriving in many slices: its large bytes fields gathered out of them
 * (rpc__lift_unpack), the result the same message protobuf-c parses from the flat bytes,
 * whatever the cuts (inside tags, lengths and fields). */
static size_t cut_slices(const uint8_t *flat, size_t n, grpc_slice *s, size_t max) {
  static const size_t cuts[] = {1, 2, 3, 4093, 17, 65536, 5, 100000};
  size_t k = 0;
  for (size_t at = 0; at < n && k < max; k++) {
    size_t c = cuts[k % (sizeof cuts / sizeof cuts[0])];
    if (c > n - at || k + 1 == max) c = n - at;
    s[k] = grpc_slice_from_copied_buffer((const char *)flat + at, c);
    at += c;
  }
  return k;
}

/* Packs m into a malloc'd buffer (*n bytes). */
static uint8_t *pack_flat(const ProtobufCMessage *m, size_t *n) {
  *n = protobuf_c_message_get_packed_size(m);
  uint8_t *b = malloc(*n ? *n : 1);
  assert_non_null(b);
  assert_int_equal(protobuf_c_message_pack(m, b), *n);
  return b;
}

/* flat in slices through rpc__lift_unpack (expect: its result) and rpc_unpack, both
 * compared with protobuf-c's parse of flat, packed again. */
static void check_lifted(const uint8_t *flat, size_t n, int expect) {
  enum { MAXS = 4096 };
  grpc_slice *s = malloc(MAXS * sizeof *s);
  assert_non_null(s);
  size_t ns = cut_slices(flat, n, s, MAXS);
  ProtobufCMessage *want =
      protobuf_c_message_unpack(&precond__v1__push_request__descriptor, NULL, n, flat);
  ProtobufCMessage *got = NULL;
  assert_int_equal(rpc__lift_unpack(s, ns, &precond__v1__push_request__descriptor, &got), expect);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(s, ns);
  ProtobufCMessage *via = NULL;
  assert_int_equal(rpc_unpack(bb, &precond__v1__push_request__descriptor, 0, &via),
                   want ? RPC_OK : RPC_EPARSE);
  grpc_byte_buffer_destroy(bb);
  size_t nw = 0, ng = 0, nv = 0;
  uint8_t *w = want ? pack_flat(want, &nw) : NULL;
  if (expect == RPC_OK) {
    uint8_t *g = pack_flat(got, &ng);
    assert_int_equal(ng, nw);
    assert_memory_equal(g, w, nw);
    free(g);
  } else {
    assert_null(got);
  }
  if (want) {
    uint8_t *v = pack_flat(via, &nv);
    assert_int_equal(nv, nw);
    assert_memory_equal(v, w, nw);
    free(v);
  }
  free(w);
  for (size_t i = 0; i < ns; i++) grpc_slice_unref(s[i]);
  free(s);
  if (got) protobuf_c_message_free_unpacked(got, NULL);
  if (via) protobuf_c_message_free_unpacked(via, NULL);
  if (want) protobuf_c_message_free_unpacked(want, NULL);
}

/* check_lifted of flat's n bytes twice back to back (protobuf merges them into one). */
static void check_doubled(const uint8_t *flat, size_t n, int expect) {
  uint8_t *two = malloc(2 * n);
  assert_non_null(two);
  memcpy(two, flat, n);
  memcpy(two + n, flat, n);
  check_lifted(two, 2 * n, expect);
  free(two);
}

static void test_unpack_lifted(void **state) {
  (void)state;
  enum { BIG = 200000, MID = 70000, SMALL = 1000 };
  uint8_t *bytes = malloc(BIG);
  assert_non_null(bytes);
  for (size_t i = 0; i < BIG; i++) bytes[i] = (uint8_t)(i * 2654435761u >> 13);
  Precond__V1__PackedMatrix pm[4];
  const size_t len[4] = {100000, SMALL, MID, BIG};
  for (int k = 0; k < 4; k++) {
    precond__v1__packed_matrix__init(&pm[k]);
    pm[k].n = (uint32_t)(k + 3);
    pm[k].data.data = bytes + k;
    pm[k].data.len = len[k] - (size_t)k;
  }
  Precond__V1__BlockStatistics blk[3], *bp[3] = {&blk[0], &blk[1], &blk[2]};
  for (int b = 0; b < 3; b++) {
    precond__v1__block_statistics__init(&blk[b]);
    blk[b].block_id = (uint32_t)(10 + b);
  }
  blk[0].left = &pm[0];  /* gathered */
  blk[0].right = &pm[1]; /* small: stays in the compact message */
  blk[2].a = &pm[2];
  blk[2].g = &pm[3];
  Precond__V1__ShmSession sess = PRECOND__V1__SHM_SESSION__INIT;
  sess.id = 5;
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = (char *)"lifted";
  req.step = 300; /* a two-byte varint */
  req.n_blocks = 3;
  req.blocks = bp;
  size_t n = 0;
  uint8_t *flat = pack_flat(&req.base, &n);
  check_lifted(flat, n, RPC_OK);
  check_lifted(flat, n - 1, RPC_EPARSE); /* truncated: refused both ways */

  /* Two messages back to back are one (protobuf merges them): the blocks of both, in order;
   * with a singular message field twice (shm), merged by protobuf-c, the walk gives up and
   * rpc_unpack parses the flattened bytes. */
  check_doubled(flat, n, RPC_OK);
  free(flat);
  req.shm = &sess;
  flat = pack_flat(&req.base, &n);
  check_lifted(flat, n, RPC_OK);
  check_doubled(flat, n, RPC_EPARSE);
  free(flat);
  free(bytes);
}

static void test_size_args(void **state) {
  (void)state;
  grpc_arg arg[2];
  grpc_channel_args args;
  rpc_size_args(&args, arg, 0);
  assert_int_equal(args.num_args, 2);
  assert_int_equal(arg[0].value.integer, (int)RPC_DEFAULT_MAX_MESSAGE_BYTES);
  assert_string_equal(arg[0].key, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH);
  assert_string_equal(arg[1].key, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH);
  rpc_size_args(&args, arg, (size_t)1 << 40);
  assert_int_equal(arg[1].value.integer, 0x7fffffff);
  /* 4096 x 4096 packed fp32, both factors, fits the default. */
  assert_true((size_t)4096 * 4097 / 2 * 4 * 2 < RPC_DEFAULT_MAX_MESSAGE_BYTES);
}

static void test_args(void **state) {
  (void)state;
  rpc_args a;
  rpc_args_init(&a, 1000);
  const grpc_channel_args *ca = rpc_args_get(&a);
  assert_true(ca->num_args >= 2);
  assert_string_equal(ca->args[0].key, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH);
  assert_int_equal(ca->args[0].value.integer, 1000);
  size_t n = ca->num_args;
  /* A default replaced keeps the count; a new key adds one. */
  assert_int_equal(rpc_args_parse(&a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH "=77"), RPC_OK);
  assert_int_equal(rpc_args_set_int(&a, "grpc.test_only_key", -5), RPC_OK);
  ca = rpc_args_get(&a);
  assert_int_equal(ca->num_args, n + 1);
  assert_int_equal(ca->args[1].value.integer, 77);
  assert_string_equal(ca->args[n].key, "grpc.test_only_key");
  assert_int_equal(ca->args[n].value.integer, -5);
  assert_int_equal(ca->args[n].type, GRPC_ARG_INTEGER);
  const char *bad[] = {"",
                       "=1",
                       "key",
                       "key=",
                       "key=1x",
                       "key=3000000000",
                       "a_key_longer_than_sixty_three_bytes_is_refused_as_it_would_be_cut=1"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    assert_int_equal(rpc_args_parse(&a, bad[i]), RPC_EINVAL);
  assert_int_equal(rpc_args_set_int(&a, "", 1), RPC_EINVAL);
  assert_int_equal(rpc_args_get(&a)->num_args, n + 1);
  char key[32];
  int rc = RPC_OK;
  for (int i = 0; rc == RPC_OK && i < RPC_ARGS_MAX + 1; i++) {
    snprintf(key, sizeof key, "grpc.k%d", i);
    rc = rpc_args_set_int(&a, key, i);
  }
  assert_int_equal(rc, RPC_ENOMEM);
  assert_int_equal(rpc_args_get(&a)->num_args, RPC_ARGS_MAX);
}

/* proto/shm.c: the checksum (CRC-32C's check value, every split of the three-chain copy
 * against the plain one), the ring and the reference check. */
static void test_shm_rules(void **state) {
  (void)state;
  assert_int_equal(rpc_crc32c(0, "123456789", 9), 0xE3069283u); /* the published check */
  assert_int_equal(rpc_crc32c(0, "", 0), 0);
  enum { N = 200003 };
  unsigned char *a = malloc(N), *b = malloc(N);
  assert_non_null(a);
  assert_non_null(b);
  uint64_t s = 7;
  for (size_t i = 0; i < N; i++) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    a[i] = (unsigned char)(s >> 56);
  }
  const size_t lens[] = {0, 1, 7, 8, 9, 49151, 49152, 49153, 49160, 65536, 100001, N};
  for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
    memset(b, 0, N);
    uint32_t want = rpc_crc32c(0, a, lens[i]);
    /* In two calls: continuing a checksum is the checksum of the whole. */
    assert_int_equal(
        rpc_crc32c(rpc_crc32c(0, a, lens[i] / 3), a + lens[i] / 3, lens[i] - lens[i] / 3), want);
    assert_int_equal(rpc_shm_copy_crc(b, a, lens[i]), want);
    assert_memory_equal(a, b, lens[i]);
    assert_int_equal(rpc_shm_crc(a, lens[i]), want);
  }
  b[12345] ^= 1; /* one bit: another checksum */
  assert_int_not_equal(rpc_shm_crc(b, N), rpc_shm_crc(a, N));
  free(a);
  free(b);

  /* The copy of unchecked push references: the bytes, and whether they are finite floats,
   * a NaN or Inf anywhere (the pieces' edges included) found. */
  enum { F = 3 * 4096 + 5 };
  float *x = malloc(F * sizeof *x), *y = malloc(F * sizeof *y);
  assert_non_null(x);
  assert_non_null(y);
  for (size_t i = 0; i < F; i++) x[i] = (float)i - 7.5f;
  int finite = -1;
  rpc_shm_copy_finite(y, x, F * sizeof *x, &finite);
  assert_int_equal(finite, RPC_F32_BOUNDED);
  assert_memory_equal(x, y, F * sizeof *x);
  /* The bound of rpc_f32_scan: 2^126 and up (a finite value) makes the bytes FINITE only. */
  x[4097] = 0x1p126f;
  rpc_shm_copy_finite(y, x, F * sizeof *x, &finite);
  assert_int_equal(finite, RPC_F32_FINITE);
  assert_int_equal(rpc_f32_scan(F, x), RPC_F32_FINITE);
  x[4097] = -0x1.fffffep125f; /* the largest magnitude below it */
  assert_int_equal(rpc_f32_scan(F, x), RPC_F32_BOUNDED);
  x[4097] = (float)4097 - 7.5f;
  const size_t bad[] = {0, 4095, 4096, F - 1};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    float keep = x[bad[i]];
    x[bad[i]] = i % 2 ? INFINITY : NAN;
    rpc_shm_copy_finite(y, x, F * sizeof *x, &finite);
    assert_int_equal(finite, RPC_F32_BAD);
    assert_int_equal(rpc_f32_scan(F, x), RPC_F32_BAD);
    x[bad[i]] = keep;
  }
  rpc_shm_copy_finite(y, x, F * sizeof *x - 1, &finite); /* not whole floats */
  assert_int_equal(finite, 0);
  free(x);
  free(y);

  /* The ring: aligned takes, a wrap when the next one does not fit, too big refused. */
  uint64_t pos = 0, off = 99;
  assert_int_equal(rpc_shm_ring_take(&pos, 1024, 100, &off), RPC_OK);
  assert_int_equal(off, 0);
  assert_int_equal(pos, 128);
  assert_int_equal(rpc_shm_ring_take(&pos, 1024, 896, &off), RPC_OK);
  assert_int_equal(off, 128);
  assert_int_equal(pos, 1024);
  assert_int_equal(rpc_shm_ring_take(&pos, 1024, 1, &off), RPC_OK);
  assert_int_equal(off, 0); /* wrapped */
  assert_int_equal(rpc_shm_ring_take(&pos, 1024, 1025, &off), RPC_ETOOBIG);

  /* References: inside [lo, hi) of the region and of the expected length, whatever the
   * numbers (no overflow). */
  assert_int_equal(rpc_shm_ref_check(1024, 0, 512, 0, 512, 512), RPC_OK);
  assert_int_equal(rpc_shm_ref_check(1024, 0, 512, 8, 512, 512), RPC_EINVAL);
  assert_int_equal(rpc_shm_ref_check(1024, 512, 1024, 500, 16, 16), RPC_EINVAL);
  assert_int_equal(rpc_shm_ref_check(1024, 512, 1024, 512, 16, 8), RPC_EINVAL);
  assert_int_equal(rpc_shm_ref_check(1024, 0, 2048, 0, 16, 16), RPC_EINVAL);
  assert_int_equal(rpc_shm_ref_check(1024, 0, 512, UINT64_MAX - 4, 16, 16), RPC_EINVAL);
  assert_int_equal(rpc_shm_ref_check(1024, 0, 512, 8, UINT64_MAX, (size_t)-1), RPC_EINVAL);
}

/* proto/shm.c, the client's side on an anonymous mapping (no daemon): pushes go into the
 * first half's ring with their checksum or stay as bytes; fetched references are taken from
 * the daemon's half only, and only with a matching checksum. */
/* The doorbell's head (rpc_shm_head): what the daemon reads is checked against the push
 * ring whatever the client wrote, without overflow; the answer lands in its room, cut to
 * it, and moves answered; rpc_shm_call rings nothing when the daemon serves no doorbell or
 * the request does not fit before the ring's end. */
static void test_shm_bell(void **state) {
  (void)state;
  const size_t bytes = 1 << 16, half = bytes / 2;
  unsigned char *map = aligned_alloc(64, bytes);
  assert_non_null(map);
  memset(map, 0, bytes);
  rpc_shm_head *h = (void *)map;
  rpc_shm_bell b;
  h->bell = 3;
  h->req_offset = RPC_SHM_PUSH_RING;
  h->req_length = 100;
  h->method = RPC_SHM_BELL_PUSH;
  h->reply_offset = RPC_SHM_PUSH_RING + 128;
  h->reply_cap = RPC_SHM_BELL_REPLY;
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_OK);
  assert_int_equal(b.bell, 3);
  assert_int_equal(b.req_length, 100);
  h->req_offset = half - 50; /* past the client's half */
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_EINVAL);
  assert_int_equal(b.reply_cap, RPC_SHM_BELL_REPLY); /* the answer's room is sound */
  h->req_offset = UINT64_MAX - 10;                   /* no overflow */
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_EINVAL);
  h->req_offset = 0; /* the head itself */
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_EINVAL);
  h->req_offset = RPC_SHM_PUSH_RING;
  h->method = RPC_SHM_BELL_FETCH;
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_OK);
  h->method = 3;
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_EINVAL);
  h->method = RPC_SHM_BELL_PUSH;
  h->reply_offset = RPC_SHM_PUSH_RING + 4; /* not 8-aligned */
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_EINVAL);
  assert_int_equal(b.reply_cap, 0); /* no room to answer in */
  h->reply_offset = UINT64_MAX - 7;
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_EINVAL);
  assert_int_equal(b.reply_cap, 0);
  h->reply_offset = RPC_SHM_PUSH_RING + 128;
  h->reply_cap = 4; /* below the answer's head */
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_EINVAL);
  /* An answer: code, length, bytes cut to the room; answered = bell. */
  h->reply_cap = 16;
  assert_int_equal(rpc_shm_bell_read(map, bytes, &b), RPC_OK);
  rpc_shm_bell_answer(map, bytes, &b, 3, "a message longer than the room", 30);
  uint32_t code, n;
  memcpy(&code, map + b.reply_offset, 4);
  memcpy(&n, map + b.reply_offset + 4, 4);
  assert_int_equal(code, 3);
  assert_int_equal(n, 16 - RPC_SHM_REPLY_HEAD);
  assert_memory_equal(map + b.reply_offset + RPC_SHM_REPLY_HEAD, "a messag", 8);
  assert_int_equal(h->answered, 3);
  /* No room: only answered moves. */
  b.reply_cap = 0;
  b.bell = 4;
  rpc_shm_bell_answer(map, bytes, &b, 5, "x", 1);
  assert_int_equal(h->answered, 4);
  memcpy(&code, map + RPC_SHM_PUSH_RING + 128, 4);
  assert_int_equal(code, 3);
  /* rpc_shm_call: nothing rung without a doorbell, or when the request does not fit. */
  rpc_shm s = {.map = map, .bytes = bytes, .fd = -1};
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = "j";
  ProtobufCMessage *resp = (ProtobufCMessage *)&req;
  grpc_status_code st;
  char *details = NULL;
  assert_int_equal(rpc_shm_call(&s, &req.base, &precond__v1__push_response__descriptor, 100, &resp,
                                &st, &details),
                   RPC_EINVAL);
  assert_null(resp);
  s.bell = 1;
  s.in_pos = half - RPC_SHM_PUSH_RING - RPC_SHM_BELL_REPLY; /* the request's bytes don't fit */
  assert_int_equal(rpc_shm_call(&s, &req.base, &precond__v1__push_response__descriptor, 100, &resp,
                                &st, &details),
                   RPC_ETOOBIG);
  assert_int_equal(h->bell, 3); /* not rung */
  /* Rung with nobody serving: DEADLINE_EXCEEDED after the deadline. */
  s.in_pos = 0;
  s.rung = h->bell;
  h->answered = h->bell; /* the last one answered */
  assert_int_equal(rpc_shm_call(&s, &req.base, &precond__v1__push_response__descriptor, 50, &resp,
                                &st, &details),
                   RPC_ECALL);
  assert_int_equal(st, GRPC_STATUS_DEADLINE_EXCEEDED);
  assert_int_equal(h->bell, 4);
  free(details);
  free(map);
}

/* The daemon's part of the pipelined doorbell, played by hand: answers the pending push
 * rung with bell with code and body (the packed response, or the message). */
static void queue_answer(unsigned char *map, const rpc_shm *s, uint32_t bell, uint32_t code,
                         const void *body, uint32_t n) {
  rpc_shm_head *h = (void *)map;
  for (uint32_t i = 0; i < s->npend; i++)
    if (s->pend[i].bell == bell) {
      memcpy(map + s->pend[i].reply, &code, 4);
      memcpy(map + s->pend[i].reply + 4, &n, 4);
      memcpy(map + s->pend[i].reply + RPC_SHM_REPLY_HEAD, body, n);
      __atomic_store_n(&h->answered, bell, __ATOMIC_RELEASE);
      return;
    }
  fail_msg("bell %u is not pending", bell);
}

/* The pipelined doorbell's client side (rpc_shm_begin, rpc_shm_post, rpc_shm_collect), the
 * daemon played by hand: a push goes to the ring's start when the pending ones leave it
 * clear, else right after the previous push, never over a pending one; the head is filled
 * for the next push only once the daemon took the previous one (else the deadline); answers
 * are collected oldest first, each with its own code and message; a post without the queue
 * or with RPC_SHM_QUEUE pending, and a push larger than the ring, ring nothing. */
static void test_shm_queue(void **state) {
  (void)state;
  const size_t bytes = 1 << 16, ring = bytes / 2 - RPC_SHM_PUSH_RING, slot = 8000;
  unsigned char *map = aligned_alloc(64, bytes);
  assert_non_null(map);
  memset(map, 0, bytes);
  rpc_shm_head *h = (void *)map;
  rpc_shm s = {.map = map, .bytes = bytes, .fd = -1, .bell = 1, .queue = 1};
  Precond__V1__PushRequest req = PRECOND__V1__PUSH_REQUEST__INIT;
  req.job = "j";
  Precond__V1__PackedMatrix m = PRECOND__V1__PACKED_MATRIX__INIT;
  Precond__V1__ShmRef ref;
  grpc_status_code st;
  char *details = NULL;
  const uint64_t need = slot + 2048; /* the slot, the request and its answer's room */
  /* Push 1 at the ring's start; push 2 after it (push 1 pending). Nothing pending: nothing
   * to wait for, nothing answered. */
  assert_int_equal(rpc_shm_taken(&s, s.npend - 1), 1);
  assert_int_equal(rpc_shm_answered(&s), 0);
  assert_int_equal(rpc_shm_begin(&s, need, 100, &st, NULL), RPC_OK);
  assert_int_equal(s.push_start, 0);
  assert_non_null(rpc_shm_slot(&s, &m, slot, &ref));
  assert_int_equal(rpc_shm_post(&s, &req.base, 100, &st, NULL), RPC_OK);
  assert_int_equal(h->bell, 1);
  assert_int_equal(s.npend, 1);
  assert_int_equal(rpc_shm_begin(&s, need, 100, &st, NULL), RPC_OK);
  uint64_t second = s.push_start;
  assert_true(second >= slot && second < ring);
  assert_non_null(rpc_shm_slot(&s, &m, slot, &ref));
  assert_int_equal(ref.seq, second + 1);
  /* The daemon has not taken push 1's head: push 2's post waits out its deadline
   * (rpc_shm_taken says so beforehand, without waiting). */
  assert_int_equal(rpc_shm_taken(&s, 0), 0);
  assert_int_equal(rpc_shm_post(&s, &req.base, 30, &st, &details), RPC_ECALL);
  assert_int_equal(st, GRPC_STATUS_DEADLINE_EXCEEDED);
  free(details);
  assert_int_equal(h->bell, 1);
  assert_int_equal(h->taken_wait, 0); /* it asked for a wake while it waited, no longer */
  h->taken = 1;
  assert_int_equal(rpc_shm_taken(&s, 0), 1);
  assert_int_equal(rpc_shm_post(&s, &req.base, 100, &st, NULL), RPC_OK);
  assert_int_equal(s.npend, 2);
  assert_int_equal(rpc_shm_taken(&s, 1), 0); /* push 2's head not taken yet, push 1's was */
  assert_int_equal(rpc_shm_taken(&s, 0), 1);
  assert_int_equal(rpc_shm_taken(&s, 2), 1); /* not pending */
  /* A full queue: post refuses, begin collects push 1 (answered OK) and places push 3 at the
   * ring's start a lap on (push 2's bytes stay clear). rpc_shm_answered looks at push 1's
   * answer only: not there, then there. */
  assert_int_equal(rpc_shm_post(&s, &req.base, 100, &st, NULL), RPC_EINVAL);
  assert_int_equal(rpc_shm_answered(&s), 0);
  const uint8_t accepted[2] = {0x08, 0x01}; /* PushResponse.accepted = 1 */
  queue_answer(map, &s, 1, GRPC_STATUS_OK, accepted, 2);
  assert_int_equal(rpc_shm_answered(&s), 1);
  assert_int_equal(rpc_shm_begin(&s, need, 100, &st, NULL), RPC_OK);
  assert_int_equal(s.npend, 1);
  assert_int_equal(s.pend[0].bell, 2);
  assert_int_equal(s.push_start, ring);
  assert_non_null(rpc_shm_slot(&s, &m, slot, &ref));
  assert_true(ref.seq - 1 + slot <= second + ring); /* clear of push 2 */
  h->taken = 2;
  assert_int_equal(rpc_shm_post(&s, &req.base, 100, &st, NULL), RPC_OK);
  /* Push 2 refused: its own code and message, then push 3's OK; then none pending;
   * rpc_shm_answered says 1 only once push 2, the oldest, is answered. */
  assert_int_equal(rpc_shm_answered(&s), 0);
  queue_answer(map, &s, 2, GRPC_STATUS_INVALID_ARGUMENT, "blocks[0].left.data: NaN", 24);
  assert_int_equal(rpc_shm_answered(&s), 1);
  ProtobufCMessage *resp = NULL;
  assert_int_equal(
      rpc_shm_collect(&s, &precond__v1__push_response__descriptor, 100, &resp, &st, &details),
      RPC_ESTATUS);
  assert_int_equal(st, GRPC_STATUS_INVALID_ARGUMENT);
  assert_string_equal(details, "blocks[0].left.data: NaN");
  assert_null(resp);
  free(details);
  queue_answer(map, &s, 3, GRPC_STATUS_OK, accepted, 2);
  assert_int_equal(
      rpc_shm_collect(&s, &precond__v1__push_response__descriptor, 100, &resp, &st, &details),
      RPC_OK);
  assert_int_equal(((Precond__V1__PushResponse *)resp)->accepted, 1);
  protobuf_c_message_free_unpacked(resp, NULL);
  free(details);
  assert_int_equal(
      rpc_shm_collect(&s, &precond__v1__push_response__descriptor, 100, &resp, &st, &details),
      RPC_EINVAL);
  assert_int_equal(rpc_shm_answered(&s), 0);
  assert_int_equal(rpc_shm_answered(NULL), 0);
  assert_int_equal(rpc_shm_taken(NULL, 0), 0);
  /* Without the queue (an older daemon) only one at a time; a push above the ring: nothing. */
  s.queue = 0;
  assert_int_equal(rpc_shm_begin(&s, need, 100, &st, NULL), RPC_OK);
  assert_non_null(rpc_shm_slot(&s, &m, slot, &ref));
  assert_int_equal(rpc_shm_post(&s, &req.base, 100, &st, NULL), RPC_OK);
  assert_int_equal(rpc_shm_post(&s, &req.base, 100, &st, NULL), RPC_EINVAL);
  assert_int_equal(h->bell, 4);
  assert_int_equal(rpc_shm_begin(&s, ring + 1, 100, &st, NULL), RPC_ETOOBIG);
  assert_int_equal(s.npend, 1);
  free(map);
}

/* rpc_shm_write: every byte of src lands in dst and nothing around it is touched, below
 * RPC_SHM_STREAM_MIN (a plain copy) and from it on (streamed, non-temporal stores), for any
 * alignment of dst and src and lengths that are not whole lines. */
static void test_shm_write(void **state) {
  (void)state;
  const size_t cap = RPC_SHM_STREAM_MIN + 4096;
  unsigned char *src = malloc(cap + 64), *dst = malloc(cap + 256);
  assert_non_null(src);
  assert_non_null(dst);
  for (size_t i = 0; i < cap + 64; i++) src[i] = (unsigned char)(i * 7 + i / 251);
  const size_t lens[] = {0,
                         1,
                         100,
                         RPC_SHM_STREAM_MIN - 1,
                         RPC_SHM_STREAM_MIN,
                         RPC_SHM_STREAM_MIN + 37,
                         RPC_SHM_STREAM_MIN + 4096 - 64};
  const size_t dst_at[] = {64, 72, 127}, src_at[] = {0, 3, 32};
  for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
    for (size_t a = 0; a < 3; a++) {
      size_t len = lens[li], da = dst_at[a] - (uintptr_t)dst % 64, sa = src_at[a];
      memset(dst, 0xA5, cap + 256);
      rpc_shm_write(dst + da, src + sa, len);
      assert_memory_equal(dst + da, src + sa, len);
      for (size_t i = 0; i < da; i++) assert_int_equal(dst[i], 0xA5);
      for (size_t i = da + len; i < cap + 256; i++) assert_int_equal(dst[i], 0xA5);
    }
  free(src);
  free(dst);
}

/* rpc_shm_streams: large slots only, and only when the daemon's thread did not last run on
 * the caller's CPU (the thread pinned to the CPU it is on, so the answer cannot move). */
static void test_shm_streams(void **state) {
  (void)state;
  rpc_shm s = {.fd = -1, .bytes = 1 << 16};
  void *map = mmap(NULL, s.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(map != MAP_FAILED);
  s.map = map;
  rpc_shm_head *h = map;
  int can = __builtin_cpu_supports("avx") != 0;
  assert_int_equal(rpc_shm_streams(&s, RPC_SHM_STREAM_MIN - 1), 0);
  assert_int_equal(rpc_shm_streams(&s, RPC_SHM_STREAM_MIN), can); /* daemon_cpu not known */
  unsigned long old[16] = {0}, one[16] = {0};
  assert_true(syscall(SYS_sched_getaffinity, 0, sizeof old, old) > 0);
  int cpu = rpc_shm_cpu();
  assert_true(cpu >= 0 && cpu < 1024);
  one[cpu / 64] = 1ul << (cpu % 64);
  assert_int_equal(syscall(SYS_sched_setaffinity, 0, sizeof one, one), 0);
  cpu = rpc_shm_cpu();
  h->daemon_cpu = (uint32_t)cpu + 1; /* the daemon served on this CPU: plain stores */
  assert_int_equal(rpc_shm_streams(&s, RPC_SHM_STREAM_MIN), 0);
  h->daemon_cpu = (uint32_t)cpu + 2; /* on another: streamed */
  assert_int_equal(rpc_shm_streams(&s, 4 * RPC_SHM_STREAM_MIN), can);
  assert_int_equal(syscall(SYS_sched_setaffinity, 0, sizeof old, old), 0);
  munmap(map, s.bytes);
}

/* rpc_shm_mode's pushes fed synthetic costs (ns per byte by mode: the writer's w, the
 * daemon's r): n large writes, each a push of its own written in the mode picked, its
 * write and the daemon's figure reported as a writer and rpc_shm_collect do; a write just
 * after a change of mode (RPC_SHM_UNSETTLED) costs 20x (the slots as the other mode left
 * them). Returns in got how many went in each mode, in *unsettled (NULL: not wanted) how
 * many were flagged. */
static void mode_feed(rpc_shm_mode *m, const void *map, int n, const double w[2], const double r[2],
                      uint64_t got[2], int *unsettled) {
  const size_t len = RPC_SHM_STREAM_MIN;
  got[0] = got[1] = 0;
  for (int i = 0; i < n; i++) {
    int pick = rpc_shm_mode_pick(m, map, len), mode = pick & RPC_SHM_STREAMED;
    assert_true((pick & ~(RPC_SHM_STREAMED | RPC_SHM_UNSETTLED)) == 0);
    double x = pick & RPC_SHM_UNSETTLED ? 20.0 : 1.0;
    if (unsettled) *unsettled += (pick & RPC_SHM_UNSETTLED) != 0;
    rpc_shm_mode_wrote(m, pick, len, (uint64_t)(x * w[mode] * (double)len));
    uint64_t bytes[2] = {0, 0};
    if (!(pick & RPC_SHM_UNSETTLED)) bytes[mode] = len; /* rpc_shm_collect's rule */
    rpc_shm_mode_read(m, bytes, (uint64_t)(x * r[mode] * (double)len));
    got[mode]++;
  }
}

/* rpc_shm_mode (session 16): before the daemon's first figure (an older daemon) the rule
 * before (rpc_shm_streams_at); then probe blocks in turn; then the cheaper sum of write and
 * read, the other mode one block a period; a change of costs followed within a period; a
 * single outlier or a push of mixed modes tips nothing; near-equal costs are not swapped at
 * every probe; small writes plain; a forced mode kept. */
static void test_shm_mode(void **state) {
  (void)state;
  if (!__builtin_cpu_supports("avx")) { /* no streaming stores: every write plain */
    rpc_shm_mode m = {0};
    assert_int_equal(rpc_shm_mode_pick(&m, NULL, 4 * RPC_SHM_STREAM_MIN), RPC_SHM_PLAIN);
    return;
  }
  const int block = RPC_SHM_MODE_BLOCK, period = RPC_SHM_MODE_EVERY * RPC_SHM_MODE_BLOCK;
  unsigned char head[RPC_SHM_PUSH_RING] = {0};
  rpc_shm_head *h = (void *)head;
  rpc_shm_mode m = {0};
  uint64_t got[2];
  /* No figure yet: the rule before (daemon_cpu 0: not known, streamed), counted, no probe. */
  assert_int_equal(rpc_shm_mode_pick(&m, head, RPC_SHM_STREAM_MIN - 1), RPC_SHM_PLAIN);
  assert_int_equal(rpc_shm_mode_pick(&m, head, RPC_SHM_STREAM_MIN), RPC_SHM_STREAMED);
  h->daemon_cpu = (uint32_t)rpc_shm_cpu() + 1; /* on this CPU now (or a moment ago) */
  int here = rpc_shm_streams_at(head, RPC_SHM_STREAM_MIN);
  assert_int_equal(rpc_shm_mode_pick(&m, head, RPC_SHM_STREAM_MIN), here);
  uint64_t none[2] = {RPC_SHM_STREAM_MIN, 0};
  rpc_shm_mode_read(&m, none, 0); /* an answer without the figure */
  assert_int_equal(m.heard, 0);
  assert_int_equal(m.ticks, 0);
  assert_int_equal(rpc_shm_mode_chosen(&m), -1);
  h->daemon_cpu = 0;

  /* Plain cheaper (this session's host: 0.03 + 0.05 against 0.04 + 0.07 ns per byte). */
  const double w1[2] = {0.03, 0.04}, r1[2] = {0.05, 0.07};
  mode_feed(&m, head, 1, w1, r1, got, NULL); /* the first figure comes with this answer */
  assert_int_equal(m.heard, 1);
  assert_int_equal(m.ticks, 0); /* still the rule before */
  mode_feed(&m, head, RPC_SHM_MODE_PROBE * block, w1, r1, got, NULL);
  assert_int_equal(got[RPC_SHM_PLAIN], RPC_SHM_MODE_PROBE / 2 * block); /* in turn */
  assert_int_equal(got[RPC_SHM_STREAMED], RPC_SHM_MODE_PROBE / 2 * block);
  /* Then probe blocks at gaps of 8, 16, 32 blocks, then every RPC_SHM_MODE_EVERY: blocks
   * 15, 31, 63, 127, 191 up to block 191's end. */
  int flagged = 0;
  mode_feed(&m, head, 192 * block - RPC_SHM_MODE_PROBE * block, w1, r1, got, &flagged);
  assert_int_equal(rpc_shm_mode_chosen(&m), RPC_SHM_PLAIN);
  assert_int_equal(got[RPC_SHM_STREAMED], 5 * block);
  assert_int_equal(got[RPC_SHM_PLAIN], (192 - RPC_SHM_MODE_PROBE - 5) * block);
  assert_int_equal(m.switches, 1);
  /* The first writes after each change of mode flagged (back from the probes to plain, into
   * and out of each probe block, into the last), their 20x costs left out. */
  assert_int_equal(flagged, 10 * RPC_SHM_MODE_SETTLE);

  /* One push 10x dearer, and pushes of mixed modes very cheap: nothing tips. */
  double w10[2] = {0.3, 0.04}, r10[2] = {0.5, 0.07};
  double avg[2] = {m.write[RPC_SHM_PLAIN], m.read[RPC_SHM_PLAIN]};
  mode_feed(&m, head, 1, w10, r10, got, NULL);
  assert_int_equal(got[RPC_SHM_PLAIN], 1);
  mode_feed(&m, head, 1, w1, r1, got, NULL);
  /* the median of three left it out: the averages as they were */
  assert_true(fabs(m.write[RPC_SHM_PLAIN] - avg[0]) < 1e-9 * avg[0]);
  assert_true(fabs(m.read[RPC_SHM_PLAIN] - avg[1]) < 1e-9 * avg[1]);
  uint64_t mixed[2] = {RPC_SHM_STREAM_MIN, RPC_SHM_STREAM_MIN};
  uint32_t nread = m.nread[RPC_SHM_STREAMED];
  for (int i = 0; i < 50; i++) rpc_shm_mode_read(&m, mixed, 1);
  assert_int_equal(m.nread[RPC_SHM_STREAMED], nread);
  mode_feed(&m, head, period, w1, r1, got, NULL);
  assert_int_equal(got[RPC_SHM_STREAMED], block);
  assert_int_equal(m.switches, 1);

  /* The host changes (streamed cheaper now): followed once the next probe block is
   * measured, not before (plain's figures are weighed against fresh ones only). */
  const double w2[2] = {0.06, 0.04}, r2[2] = {0.09, 0.05};
  int to_probe = period - (int)(m.ticks % (uint64_t)period) - block; /* its first write */
  mode_feed(&m, head, to_probe, w2, r2, got, NULL);
  assert_int_equal(rpc_shm_mode_chosen(&m), RPC_SHM_PLAIN);
  assert_int_equal(got[RPC_SHM_PLAIN], to_probe);
  mode_feed(&m, head, block + 1, w2, r2, got, NULL); /* the probe block, the next write */
  assert_int_equal(rpc_shm_mode_chosen(&m), RPC_SHM_STREAMED);
  assert_int_equal(got[RPC_SHM_STREAMED], block + 1);
  mode_feed(&m, head, period - to_probe - block - 1, w2, r2, got, NULL);
  /* The new choice checked again at gaps of 8, 16, 32 blocks (probe blocks 327, 343, 375),
   * then one a period. */
  mode_feed(&m, head, period, w2, r2, got, NULL);
  assert_int_equal(got[RPC_SHM_PLAIN], 3 * block);
  assert_int_equal(got[RPC_SHM_STREAMED], period - 3 * block);
  assert_int_equal(m.switches, 2);

  /* About equal (1% apart, under RPC_SHM_MODE_MARGIN), jittering: no swap at every probe. */
  const double w3[2] = {0.05, 0.0505}, r3[2] = {0.05, 0.05}; /* plain 0.5% cheaper */
  mode_feed(&m, head, 4 * period, w3, r3, got, NULL);
  assert_int_equal(rpc_shm_mode_chosen(&m), RPC_SHM_STREAMED);
  assert_int_equal(m.switches, 2);

  /* A first choice the probes got wrong (streamed looked cheaper then) is undone at the
   * first probe after them, 8 blocks on, not a whole period later. */
  rpc_shm_mode e = {0};
  mode_feed(&e, head, 1 + RPC_SHM_MODE_PROBE * block, w2, r2, got, NULL);
  mode_feed(&e, head, 1, w1, r1, got, NULL);
  assert_int_equal(rpc_shm_mode_chosen(&e), RPC_SHM_STREAMED);
  mode_feed(&e, head, 8 * block, w1, r1, got, NULL); /* up to block 16's first write */
  assert_int_equal(rpc_shm_mode_chosen(&e), RPC_SHM_PLAIN);
  assert_int_equal(got[RPC_SHM_PLAIN], block + 1); /* the probe block, then plain */

  /* Forced: that mode, whatever the figures; the writes still counted. */
  uint64_t before = m.count[RPC_SHM_PLAIN];
  m.force = RPC_SHM_FORCE_PLAIN;
  mode_feed(&m, head, 3 * period, w1, r1, got, NULL);
  assert_int_equal(got[RPC_SHM_PLAIN], 3 * period);
  assert_int_equal(m.count[RPC_SHM_PLAIN], before + 3 * period);
  m.force = RPC_SHM_FORCE_STREAMED;
  mode_feed(&m, head, period, w1, r1, got, NULL);
  assert_int_equal(got[RPC_SHM_STREAMED], period);
}

/* PRECOND_SHM_WRITE, read once: "plain" forces plain stores (no other test reads it). */
static void test_shm_write_force(void **state) {
  (void)state;
  assert_int_equal(setenv("PRECOND_SHM_WRITE", "plain", 1), 0);
  assert_int_equal(rpc_shm_write_force(), RPC_SHM_FORCE_PLAIN);
  assert_int_equal(setenv("PRECOND_SHM_WRITE", "streamed", 1), 0);
  assert_int_equal(rpc_shm_write_force(), RPC_SHM_FORCE_PLAIN); /* read once */
  unsetenv("PRECOND_SHM_WRITE");
}

/* rpc_shm_bell_cpu_append: the daemon's figure appended to a packed PushResponse parses
 * with the message's own fields; not appended without room, or with no figure. */
static void test_shm_bell_cpu_append(void **state) {
  (void)state;
  Precond__V1__PushResponse r = PRECOND__V1__PUSH_RESPONSE__INIT;
  r.accepted = 3;
  r.daemon_epoch = 77;
  unsigned char out[64];
  size_t n = precond__v1__push_response__pack(&r, out);
  size_t m = rpc_shm_bell_cpu_append(out, n, sizeof out, 123456789);
  assert_true(m > n);
  Precond__V1__PushResponse *u = precond__v1__push_response__unpack(NULL, m, out);
  assert_non_null(u);
  assert_int_equal(u->accepted, 3);
  assert_int_equal(u->daemon_epoch, 77);
  assert_int_equal(u->bell_cpu_ns, 123456789);
  precond__v1__push_response__free_unpacked(u, NULL);
  assert_int_equal(rpc_shm_bell_cpu_append(out, n, n + 2, 123456789), n); /* no room */
  assert_int_equal(rpc_shm_bell_cpu_append(out, n, sizeof out, 0), n);
}

/* The doorbell's waits (rpc.h: rpc_shm_nap, rpc_shm_sleep, rpc_shm_signal; session 12), as
 * the client and the daemon's doorbell thread wait: two threads hand a count back and
 * forth, the expected wait forced in turn to each way of waiting (no nap, a spin, naps,
 * naps that run out before the other side comes, too long to nap), the other side late in
 * some rounds; run again with either side an older peer (its wait word 0, it sleeps on the
 * futex without a flag, so every store must wake it). No wake-up is lost: no sleep runs
 * into its timeout (10 s, far beyond any round), and every count arrives. */
typedef struct {
  uint32_t word[2], wait[2];
  int rounds, older, late[2];
} pace_pp;

static void pace_wait(pace_pp *p, int me, uint32_t want, rpc_shm_pace *pace, int round) {
  static const double expect[] = {0, 5, 300, 40, 1500, 5000};
  if (p->older == me + 1) { /* an older peer: the futex alone, no flag */
    for (;;) {
      uint32_t seen = __atomic_load_n(&p->word[me], __ATOMIC_ACQUIRE);
      if ((int32_t)(seen - want) >= 0) return;
      if (rpc_shm_futex_wait(&p->word[me], seen, 10000) &&
          (int32_t)(__atomic_load_n(&p->word[me], __ATOMIC_ACQUIRE) - want) < 0)
        p->late[me]++;
    }
  }
  pace->expect_us = expect[(round + 3 * me) % 6];
  pace->nap_max_us = round % 7 ? 2000 : 0; /* naps on in most rounds */
  if (rpc_shm_nap(&p->word[me], want, pace, 0, round % 11 == 0)) return;
  for (;;) {
    int r = rpc_shm_sleep(&p->word[me], want, &p->wait[me], 10000);
    if (r == 1) break;
    if (r < 0) p->late[me]++;
  }
  rpc_shm_paced(pace);
  assert_true(pace->expect_us >= 0);
}

static void pace_late(int round, int every) {
  if (round % every == 0) {
    struct timespec ts = {0, 100000L * (round % 5)};
    nanosleep(&ts, NULL);
  }
}

static void *pace_daemon(void *arg) {
  pace_pp *p = arg;
  rpc_shm_pace pace = {0};
  for (int r = 1; r <= p->rounds; r++) {
    pace_wait(p, 1, (uint32_t)r, &pace, r);
    pace_late(r, 3);
    rpc_shm_signal(&p->word[0], (uint32_t)r, &p->wait[0]);
  }
  return NULL;
}

static void test_shm_pace(void **state) {
  (void)state;
  /* What rpc_shm_nap does without the other side: at once when the word is there; no nap
   * when the wait is not known or too long to nap; a spin or naps that run out. */
  uint32_t word = 5;
  rpc_shm_pace pace = {.nap_max_us = 2000};
  assert_int_equal(rpc_shm_nap(&word, 5, &pace, 0, 0), 1);
  assert_int_equal(rpc_shm_nap(&word, 4, &pace, 0, 0), 1); /* past it: counts wrap */
  assert_int_equal(rpc_shm_nap(&word, 6, &pace, 0, 0), 0);
  pace.expect_us = 2 * pace.nap_max_us;
  assert_int_equal(rpc_shm_nap(&word, 6, &pace, 0, 0), 0);
  pace.expect_us = 5;
  assert_int_equal(rpc_shm_nap(&word, 6, &pace, 0, 0), 0);
  assert_int_equal(rpc_shm_nap(&word, 6, &pace, 0, 1), 0); /* same core: no spin */
  pace.expect_us = 50;
  assert_int_equal(rpc_shm_nap(&word, 6, &pace, 0, 0), 0);
  assert_true(pace.expect_us == 50); /* unchanged until the wait ends */
  pace.expect_us = 500;
  assert_int_equal(rpc_shm_nap(&word, 6, &pace, rpc_shm_now_us() - 1, 0), 0); /* past until */
  pace.nap_max_us = 0; /* naps off: at once */
  assert_int_equal(rpc_shm_nap(&word, 6, &pace, 0, 0), 0);
  assert_true(rpc_shm_nap_max_us() >= 0);
  /* rpc_shm_signal stores the word whatever the wait word holds. */
  uint32_t wait = RPC_SHM_WAIT_FLAGGED;
  rpc_shm_signal(&word, 9, &wait);
  assert_int_equal(word, 9);
  wait = 0;
  rpc_shm_signal(&word, 10, &wait);
  assert_int_equal(word, 10);
  /* rpc_shm_sleep: there already (1), or a timeout with nobody to store (-1); the flag is
   * left as found. */
  wait = RPC_SHM_WAIT_FLAGGED;
  assert_int_equal(rpc_shm_sleep(&word, 10, &wait, 1), 1);
  assert_int_equal(rpc_shm_sleep(&word, 11, &wait, 1), -1);
  assert_int_equal(wait, RPC_SHM_WAIT_FLAGGED);

  for (int older = 0; older <= 2; older++) {
    pace_pp p = {.rounds = 300, .older = older};
    p.wait[0] = older == 1 ? 0 : RPC_SHM_WAIT_FLAGGED;
    p.wait[1] = older == 2 ? 0 : RPC_SHM_WAIT_FLAGGED;
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, pace_daemon, &p), 0);
    rpc_shm_pace mine = {0};
    for (int r = 1; r <= p.rounds; r++) {
      pace_late(r, 4);
      rpc_shm_signal(&p.word[1], (uint32_t)r, &p.wait[1]);
      pace_wait(&p, 0, (uint32_t)r, &mine, r);
    }
    pthread_join(t, NULL);
    assert_int_equal(p.word[0], p.rounds);
    assert_int_equal(p.word[1], p.rounds);
    assert_int_equal(p.late[0], 0);
    assert_int_equal(p.late[1], 0);
  }
}

static void test_shm_client(void **state) {
  (void)state;
  enum { R = 2048 };
  rpc_shm s = {.fd = -1, .id = 42};
  memset(s.secret, 0xAB, sizeof s.secret);
  void *map = mmap(NULL, R, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(map != MAP_FAILED);
  s.map = map;
  s.bytes = R;

  Precond__V1__ShmSession sess;
  rpc_shm_session(&s, &sess);
  assert_int_equal(sess.id, 42);
  assert_int_equal(sess.secret.len, RPC_SHM_SECRET_BYTES);
  assert_memory_equal(sess.secret.data, s.secret, RPC_SHM_SECRET_BYTES);

  uint8_t bytes[100], big[R];
  for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (uint8_t)(3 * i + 1);
  Precond__V1__PackedMatrix m = PRECOND__V1__PACKED_MATRIX__INIT;
  Precond__V1__ShmRef ref[2];
  for (int k = 0; k < 2; k++) {
    m.data.data = bytes;
    m.data.len = sizeof bytes;
    m.shm = NULL;
    assert_int_equal(rpc_shm_put(&s, &m, &ref[k]), sizeof bytes);
    assert_ptr_equal(m.shm, &ref[k]);
    assert_null(m.data.data);
    assert_int_equal(m.data.len, 0);
    /* The push ring starts after its head; 100 bytes take 128 */
    assert_int_equal(ref[k].offset, RPC_SHM_PUSH_RING + (uint64_t)k * 2 * RPC_SHM_ALIGN);
    assert_int_equal(ref[k].seq, 1 + (uint64_t)k * 2 * RPC_SHM_ALIGN); /* the stamp */
    assert_int_equal(ref[k].length, sizeof bytes);
    assert_true(ref[k].unchecked); /* no checksum pass: the daemon validates its copy */
    assert_memory_equal(s.map + ref[k].offset, bytes, sizeof bytes);
    assert_true(rpc_shm_push_intact(s.map, R, ref[k].offset, ref[k].seq));
  }
  /* A slot the caller writes itself: the next place of the ring, no copy. */
  m.shm = NULL;
  Precond__V1__ShmRef third;
  unsigned char *slot = rpc_shm_slot(&s, &m, 64, &third);
  assert_ptr_equal(slot, s.map + RPC_SHM_PUSH_RING + 4 * RPC_SHM_ALIGN);
  assert_ptr_equal(m.shm, &third);
  assert_int_equal(third.offset, RPC_SHM_PUSH_RING + 4 * RPC_SHM_ALIGN);
  assert_int_equal(third.length, 64);
  assert_true(third.unchecked);
  /* The stamp: a reference stays intact until the ring comes round onto it. The ring is
   * R / 2 - 64 = 960 bytes: slots of 128 from 0, 128 (ref[]), 64 from 256 (third); 448
   * bytes more end at 768, then a slot of 256 does not fit before 960 and wraps to 0: over
   * ref[0] and ref[1] (its 256 bytes), not over third. */
  assert_true(rpc_shm_push_intact(s.map, R, ref[0].offset, ref[0].seq));
  Precond__V1__ShmRef more;
  m.shm = NULL;
  assert_non_null(rpc_shm_slot(&s, &m, 448, &more));
  assert_true(rpc_shm_push_intact(s.map, R, ref[0].offset, ref[0].seq));
  m.shm = NULL;
  assert_non_null(rpc_shm_slot(&s, &m, 256, &more));
  assert_int_equal(more.offset, RPC_SHM_PUSH_RING);
  assert_int_equal(more.seq, 1 + 960);
  assert_false(rpc_shm_push_intact(s.map, R, ref[0].offset, ref[0].seq));
  assert_false(rpc_shm_push_intact(s.map, R, ref[1].offset, ref[1].seq));
  assert_true(rpc_shm_push_intact(s.map, R, third.offset, third.seq));
  assert_true(rpc_shm_push_intact(s.map, R, more.offset, more.seq));
  assert_true(rpc_shm_push_intact(s.map, R, 0, 0)); /* unstamped: an older client's */
  assert_false(rpc_shm_push_intact(s.map, R, third.offset + 64, third.seq)); /* misplaced */
  m.shm = NULL;
  assert_null(rpc_shm_slot(&s, &m, R / 2 - RPC_SHM_PUSH_RING + 1, &ref[0]));
  assert_null(rpc_shm_slot(&s, &m, 0, &ref[0]));
  assert_null(m.shm);
  memset(big, 7, sizeof big); /* more than the client's half: stays as bytes */
  m.data.data = big;
  m.data.len = R / 2 + 1;
  m.shm = NULL;
  assert_int_equal(rpc_shm_put(&s, &m, &ref[0]), 0);
  assert_ptr_equal(m.data.data, big);
  assert_null(m.shm);
  /* Rewound after an answered push: the next slot is the ring's start again, stamped a lap
   * on (1 + 2 x 960), and the slot of the lap before that it covers reads as overwritten. A
   * second rewind before any slot is taken is a no-op. */
  rpc_shm_rewind(&s);
  Precond__V1__ShmRef again;
  m.shm = NULL;
  assert_ptr_equal(rpc_shm_slot(&s, &m, 64, &again), s.map + RPC_SHM_PUSH_RING);
  assert_int_equal(again.seq, 1 + 2 * 960);
  assert_true(rpc_shm_push_intact(s.map, R, again.offset, again.seq));
  assert_false(rpc_shm_push_intact(s.map, R, more.offset, more.seq));
  rpc_shm_rewind(&s);
  rpc_shm_rewind(&s);
  m.shm = NULL;
  assert_ptr_equal(rpc_shm_slot(&s, &m, 64, &ref[1]), s.map + RPC_SHM_PUSH_RING);
  assert_int_equal(ref[1].seq, 1 + 3 * 960);
  assert_false(rpc_shm_push_intact(s.map, R, again.offset, again.seq));
  assert_true(rpc_shm_push_intact(s.map, R, ref[1].offset, ref[1].seq));

  /* A fetch answer naming the daemon's half. */
  memset(s.map + R / 2, 0x5A, 64);
  Precond__V1__ShmRef in = PRECOND__V1__SHM_REF__INIT;
  in.offset = R / 2;
  in.length = 64;
  in.crc32c = rpc_shm_crc(s.map + R / 2, 64);
  Precond__V1__PackedMatrix left = PRECOND__V1__PACKED_MATRIX__INIT;
  left.shm = &in;
  Precond__V1__BlockRoots b = PRECOND__V1__BLOCK_ROOTS__INIT;
  b.left = &left;
  Precond__V1__BlockRoots *bs[1] = {&b};
  Precond__V1__FetchResponse r = PRECOND__V1__FETCH_RESPONSE__INIT;
  r.n_preconditioners = 1;
  r.preconditioners = bs;
  char err[128] = "";
  assert_int_equal(rpc_shm_fetch_in(&s, &r, err, sizeof err), 64);
  assert_ptr_equal(left.data.data, s.map + R / 2);
  assert_int_equal(left.data.len, 64);
  rpc_shm_fetch_done(&r);
  assert_null(left.data.data);
  assert_int_equal(left.data.len, 0);

  s.map[R / 2 + 5] ^= 1; /* bytes a wrap overwrote: refused */
  assert_int_equal(rpc_shm_fetch_in(&s, &r, err, sizeof err), -1);
  assert_non_null(strstr(err, "preconditioners[0].left.shm: checksum mismatch"));
  rpc_shm_fetch_done(&r);
  in.offset = 0; /* the client's own half */
  in.crc32c = rpc_shm_crc(s.map, 64);
  assert_int_equal(rpc_shm_fetch_in(&s, &r, err, sizeof err), -1);
  assert_non_null(strstr(err, "outside the daemon's half"));
  rpc_shm_fetch_done(&r);

  /* The roots area (read-only for the client): a reference is taken while its entry holds
   * its seq; the copy counts while it still does afterwards. */
  Precond__V1__FetchRequest fq = PRECOND__V1__FETCH_REQUEST__INIT;
  rpc_shm_fetch_request(&s, &sess, &fq);
  assert_ptr_equal(fq.shm, &sess);
  assert_false(fq.roots_area); /* no area mapped */
  size_t A = (size_t)RPC_SHM_ROOTS_DATA + 4096;
  unsigned char *area = mmap(NULL, A, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(area != MAP_FAILED);
  rpc_shm_entry *e = (rpc_shm_entry *)(void *)area + 3; /* seq % RPC_SHM_ROOTS_ENTRIES */
  e->offset = RPC_SHM_ROOTS_DATA + 128;
  e->length = 64;
  memset(area + e->offset, 0x33, 64);
  e->crc32c = rpc_shm_crc(area + e->offset, 64);
  e->seq = RPC_SHM_ROOTS_ENTRIES + 3;
  s.roots = area;
  s.roots_bytes = A;
  rpc_shm_fetch_request(&s, &sess, &fq);
  assert_true(fq.roots_area);
  precond__v1__shm_ref__init(&in);
  in.offset = e->offset;
  in.length = 64;
  in.crc32c = e->crc32c;
  in.seq = e->seq;
  assert_int_equal(rpc_shm_fetch_in(&s, &r, err, sizeof err), 64);
  assert_ptr_equal(left.data.data, area + e->offset);
  assert_int_equal(rpc_shm_fetch_intact(&s, &r), 1);
  e->seq = 0; /* the daemon overwrites it: copies made meanwhile do not count */
  assert_int_equal(rpc_shm_fetch_intact(&s, &r), 0);
  rpc_shm_fetch_done(&r);
  assert_null(left.data.data);
  assert_int_equal(rpc_shm_fetch_in(&s, &r, err, sizeof err), -1);
  assert_non_null(strstr(err, "preconditioners[0].left.shm: not in the roots area"));
  rpc_shm_fetch_done(&r);
  e->seq = in.seq;
  in.offset = 64; /* inside the entry table: refused */
  assert_int_equal(rpc_shm_fetch_in(&s, &r, err, sizeof err), -1);
  rpc_shm_fetch_done(&r);
  in.offset = e->offset;
  in.seq += RPC_SHM_ROOTS_ENTRIES; /* the same entry, another publication */
  assert_int_equal(rpc_shm_fetch_in(&s, &r, err, sizeof err), -1);
  rpc_shm_fetch_done(&r);

  rpc_shm_close(&s); /* unmaps, the roots area too */
  assert_null(s.roots);
  assert_null(s.map);
  assert_int_equal(s.fd, -1);
  rpc_shm_close(&s); /* a closed region: a no-op */
}

static void test_call_without_server(void **state) {
  (void)state;
  assert_null(rpc_channel_create("", 0));
  assert_null(rpc_channel_create(NULL, 0));
  /* Port 1 on loopback: nothing listens there on a test machine. */
  grpc_channel *ch = rpc_channel_create("127.0.0.1:1", 0);
  assert_non_null(ch);
  Precond__V1__StatsRequest req = PRECOND__V1__STATS_REQUEST__INIT;
  ProtobufCMessage *resp = NULL;
  grpc_status_code code = GRPC_STATUS_OK;
  char *details = NULL;
  int rc = rpc_call(ch, RPC_METHOD_GET_STATS, &req.base, &precond__v1__stats_response__descriptor,
                    5000, 0, &resp, &code, &details);
  assert_int_equal(rc, RPC_ESTATUS);
  assert_int_equal(code, GRPC_STATUS_UNAVAILABLE);
  assert_null(resp);
  assert_non_null(details);
  free(details);

  /* Waiting for readiness: the deadline ends it. */
  rc = rpc_call_token(ch, RPC_METHOD_GET_STATS, &req.base, &precond__v1__stats_response__descriptor,
                      200, 1, "tok", &resp, &code, &details);
  assert_int_equal(rc, RPC_ESTATUS);
  assert_int_equal(code, GRPC_STATUS_DEADLINE_EXCEEDED);
  free(details);

  rc = rpc_call(ch, "", &req.base, &precond__v1__stats_response__descriptor, 100, 0, &resp, &code,
                &details);
  assert_int_equal(rc, RPC_EINVAL);
  assert_int_equal(code, GRPC_STATUS_INVALID_ARGUMENT);
  free(details);
  rpc_channel_destroy(ch);
  rpc_channel_destroy(NULL);
}

static void test_names(void **state) {
  (void)state;
  assert_string_equal(rpc_status_name(GRPC_STATUS_NOT_FOUND), "NOT_FOUND");
  assert_string_equal(rpc_status_name((grpc_status_code)99), "UNKNOWN_STATUS_CODE");
  assert_non_null(rpc_strerror(-99));
  assert_string_equal(rpc_strerror(RPC_EPARSE), "message does not parse");
}

/* The packed codec: little-endian bytes whatever the host, bf16 as an fp32's top half. */
static void test_packed_codec(void **state) {
  (void)state;
  assert_int_equal(rpc_packed_width(0), 4);
  assert_int_equal(rpc_packed_width(1), 2);
  assert_int_equal(rpc_packed_width(7), 0);
  const float v[3] = {1.0f, -2.5f, 3.0e-3f};
  unsigned char b[12 + 1];
  assert_int_equal(rpc_packed_encode(0, v, 3, b + 1), RPC_OK); /* unaligned on purpose */
  const unsigned char one[4] = {0x00, 0x00, 0x80, 0x3f}, minus[4] = {0x00, 0x00, 0x20, 0xc0};
  assert_memory_equal(b + 1, one, 4);
  assert_memory_equal(b + 5, minus, 4);
  float back[3];
  assert_int_equal(rpc_packed_decode(0, b + 1, 12, 3, back), RPC_OK);
  assert_memory_equal(back, v, sizeof v);
  assert_int_equal(rpc_packed_decode(0, b + 1, 11, 3, back), RPC_EINVAL);
  assert_int_equal(rpc_packed_decode(5, b + 1, 12, 3, back), RPC_EINVAL);
  assert_int_equal(rpc_packed_encode(5, v, 3, b), RPC_EINVAL);

  assert_int_equal(rpc_packed_encode(1, v, 3, b + 1), RPC_OK);
  assert_memory_equal(b + 1, one + 2, 2); /* 1.0: 0x3f80 */
  assert_memory_equal(b + 3, minus + 2, 2);
  assert_int_equal(rpc_packed_decode(1, b + 1, 6, 3, back), RPC_OK);
  assert_true(back[0] == 1.0f && back[1] == -2.5f);
  assert_true(fabsf(back[2] - v[2]) <= 0.004f * v[2]); /* 8 significant bits */
  /* More values than the codec's internal piece: every piece lands in its place. */
  enum { N = 3000 };
  float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
  unsigned char *h = malloc(2 * N);
  for (int i = 0; i < N; i++) x[i] = (float)i;
  assert_int_equal(rpc_packed_encode(1, x, N, h), RPC_OK);
  assert_int_equal(rpc_packed_decode(1, h, 2 * N, N, y), RPC_OK);
  for (int i = 0; i < 256; i++) assert_true(y[i] == x[i]); /* exact below 2^8 */
  assert_true(fabsf(y[N - 1] - x[N - 1]) <= 0.004f * x[N - 1]);
  free(x);
  free(y);
  free(h);
}

/* The JSON escaper of precondctl and the benchmark summaries (json.c): quotes, backslash,
 * the named control characters and \u00XX for the rest; UTF-8 passes; NULL is "". */
static void test_json_string(void **state) {
  (void)state;
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  assert_non_null(f);
  rpc_json_string(f, "a\"b\\c\nd\re\tf\x01g\x1f\xc3\xa9");
  rpc_json_string(f, NULL);
  assert_int_equal(fclose(f), 0);
  assert_string_equal(buf, "\"a\\\"b\\\\c\\nd\\re\\tf\\u0001g\\u001f\xc3\xa9\"\"\"");
  free(buf);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pack_unpack_roundtrip),
      cmocka_unit_test(test_unpack_garbage),
      cmocka_unit_test(test_unpack_lifted),
      cmocka_unit_test(test_size_args),
      cmocka_unit_test(test_args),
      cmocka_unit_test(test_shm_rules),
      cmocka_unit_test(test_shm_client),
      cmocka_unit_test(test_shm_write),
      cmocka_unit_test(test_shm_streams),
      cmocka_unit_test(test_shm_mode),
      cmocka_unit_test(test_shm_write_force),
      cmocka_unit_test(test_shm_bell_cpu_append),
      cmocka_unit_test(test_shm_bell),
      cmocka_unit_test(test_shm_pace),
      cmocka_unit_test(test_shm_queue),
      cmocka_unit_test(test_call_without_server),
      cmocka_unit_test(test_names),
      cmocka_unit_test(test_packed_codec),
      cmocka_unit_test(test_json_string),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
