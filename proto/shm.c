/*
 * shm.c -- the same-host data path's shared rules (libprecond and precondd): the CRC-32C
 * of a region's bytes, the copy that checksums what it copied, and the ring each half of
 * a region is written as; and the client's side of a region (opening the daemon's region,
 * writing push statistics into it, reading fetched roots out of it), here rather than in
 * libprecond so bench-daemon's shm rows use it through the rpc_ layer too. The daemon's
 * side is host/shm.c. See docs/precondd.md, "Shared memory".
 */
#define _GNU_SOURCE /* sched_getcpu (glibc) */
#include "rpc.h"

#include "precond.pb-c.h"
#include "preconditioner.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__linux__)
#include <linux/futex.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): iSCSI's and ext4's, and the one
 * x86's SSE 4.2 computes in hardware. */
#define RPC__CRC32C_POLY 0x82F63B78u

static uint32_t rpc__crc_table[8][256];
static void rpc__x2k_init(void);
static pthread_once_t rpc__crc_once = PTHREAD_ONCE_INIT;

static void rpc__crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (RPC__CRC32C_POLY & (0u - (c & 1u)));
    rpc__crc_table[0][i] = c;
  }
  rpc__x2k_init();
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      rpc__crc_table[t][i] =
          (rpc__crc_table[t - 1][i] >> 8) ^ rpc__crc_table[0][rpc__crc_table[t - 1][i] & 0xff];
}

/* Slicing-by-8 over the raw (pre/post-inverted by the caller) register. */
static uint32_t rpc__crc_soft(uint32_t c, const unsigned char *p, size_t len) {
  for (; len >= 8; p += 8, len -= 8) {
    uint32_t lo =
        c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
    c = rpc__crc_table[7][lo & 0xff] ^ rpc__crc_table[6][(lo >> 8) & 0xff] ^
        rpc__crc_table[5][(lo >> 16) & 0xff] ^ rpc__crc_table[4][lo >> 24] ^
        rpc__crc_table[3][p[4]] ^ rpc__crc_table[2][p[5]] ^ rpc__crc_table[1][p[6]] ^
        rpc__crc_table[0][p[7]];
  }
  while (len--) c = (c >> 8) ^ rpc__crc_table[0][(c ^ *p++) & 0xff];
  return c;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("sse4.2"))) static uint32_t rpc__crc_hw(uint32_t c, const unsigned char *p,
                                                              size_t len) {
  uint64_t c64 = c;
  for (; len >= 8; p += 8, len -= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c64 = __builtin_ia32_crc32di(c64, v);
  }
  c = (uint32_t)c64;
  while (len--) c = __builtin_ia32_crc32qi(c, *p++);
  return c;
}
/* Three chains over three pieces of k bytes (a multiple of 8), raw registers in c[]. */
__attribute__((target("sse4.2"))) static void rpc__crc3(uint64_t c[3], const unsigned char *p0,
                                                        const unsigned char *p1,
                                                        const unsigned char *p2, size_t k) {
  uint64_t a = c[0], b = c[1], e = c[2];
  for (size_t i = 0; i < k; i += 8) {
    uint64_t v0, v1, v2;
    memcpy(&v0, p0 + i, 8);
    memcpy(&v1, p1 + i, 8);
    memcpy(&v2, p2 + i, 8);
    a = __builtin_ia32_crc32di(a, v0);
    b = __builtin_ia32_crc32di(b, v1);
    e = __builtin_ia32_crc32di(e, v2);
  }
  c[0] = a;
  c[1] = b;
  c[2] = e;
}
#define RPC__HAVE_HW() __builtin_cpu_supports("sse4.2")
#else
__attribute__((unused)) static void rpc__crc3(uint64_t c[3], const unsigned char *p0,
                                              const unsigned char *p1, const unsigned char *p2,
                                              size_t k) {
  c[0] = rpc__crc_soft((uint32_t)c[0], p0, k);
  c[1] = rpc__crc_soft((uint32_t)c[1], p1, k);
  c[2] = rpc__crc_soft((uint32_t)c[2], p2, k);
}
#define rpc__crc_hw    rpc__crc_soft
#define RPC__HAVE_HW() 0
#endif

uint32_t rpc_crc32c(uint32_t crc, const void *data, size_t len) {
  pthread_once(&rpc__crc_once, rpc__crc_init);
  uint32_t c = ~crc;
  c = RPC__HAVE_HW() ? rpc__crc_hw(c, data, len) : rpc__crc_soft(c, data, len);
  return ~c;
}

/* CRC-32C of A || B from crc(A), crc(B) and |B|: crc(A) times x^(8 |B|) modulo the
 * polynomial, plus crc(B). x^(8 |B|) is a product of the powers x^(2^k) of |B|'s bits (a
 * table of 32 made once), each product 32 shift-and-add steps: well under a microsecond,
 * where squaring 32 x 32 bit matrices per bit of |B| took tens of microseconds a copy. */
static uint32_t rpc__x2k[64]; /* x^(2^k) mod P, reflected (x^0 is the top bit) */

static uint32_t rpc__mulmod(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) p ^= b;
    b = (b >> 1) ^ (RPC__CRC32C_POLY & (0u - (b & 1u))); /* b times x */
  }
  return p;
}

static void rpc__x2k_init(void) {
  rpc__x2k[0] = 1u << 30; /* x^1 */
  for (int k = 1; k < 64; k++) rpc__x2k[k] = rpc__mulmod(rpc__x2k[k - 1], rpc__x2k[k - 1]);
}

static uint32_t rpc__crc_combine(uint32_t crc1, uint32_t crc2, size_t len2) {
  uint32_t shift = 1u << 31; /* x^0 */
  uint64_t bits = (uint64_t)len2 << 3;
  for (int k = 0; bits != 0; k++, bits >>= 1)
    if (bits & 1) shift = rpc__mulmod(shift, rpc__x2k[k]);
  return rpc__mulmod(shift, crc1) ^ crc2;
}

int rpc_f32_scan(size_t count, const float *x) {
  enum { BLOCK = 1024 };
  uint32_t big = 0;
  for (size_t i0 = 0; i0 < count; i0 += BLOCK) {
    size_t m = count - i0 < BLOCK ? count - i0 : BLOCK;
    /* Branch-free per block (it vectorizes), an early exit between blocks. */
    uint32_t bad = 0;
    for (size_t i = 0; i < m; i++) {
      bad |= rpc_f32_nonfinite(x[i0 + i]);
      big |= rpc_f32_big(x[i0 + i]);
    }
    if (bad & 0x80000000u) return RPC_F32_BAD;
  }
  return big & 0x80000000u ? RPC_F32_FINITE : RPC_F32_BOUNDED;
}

/* The worse of scan and the RPC_F32_* of the k bytes at p (whole aligned floats). */
static int rpc__look(int scan, const unsigned char *p, size_t k) {
  if (scan == RPC_F32_BAD) return scan;
  int here = rpc_f32_scan(k / sizeof(float), (const float *)(const void *)p);
  return here < scan ? here : scan;
}

/* A copy and its CRC-32C. Large buffers are split in three thirds whose checksums run as
 * three independent chains (the hardware instruction has a latency of three and a
 * throughput of one: one chain uses a third of it) and are combined at the end; the copy
 * goes in pieces that stay in cache until their checksum is taken, so memory is crossed
 * once, and the checksum is of the bytes that landed in dst whatever src does meanwhile.
 * dst NULL: the checksum of src alone. finite (NULL: not wanted) gets 1 when the bytes
 * copied are fp32 values all finite, each piece looked at while it is in cache: the
 * daemon's NaN/Inf check of a push without a pass of its own; 0 when some value is not,
 * or the bytes are not whole aligned floats (their reader checks them itself then). */
static uint32_t rpc__copy_crc(void *dst, const void *src, size_t len, int *finite) {
  enum { PIECE = 16 << 10, SPLIT = 3 * PIECE };
  unsigned char *d = dst;
  const unsigned char *s = src;
  int check = finite && d && (uintptr_t)d % _Alignof(float) == 0 && len % sizeof(float) == 0;
  int ok = RPC_F32_BOUNDED;
  pthread_once(&rpc__crc_once, rpc__crc_init);
  if (len < SPLIT || !RPC__HAVE_HW()) {
    uint32_t crc = 0;
    for (size_t done = 0; done < len;) {
      size_t k = len - done < PIECE ? len - done : PIECE;
      if (d) memcpy(d + done, s + done, k);
      crc = rpc_crc32c(crc, (d ? d : s) + done, k);
      if (check) ok = rpc__look(ok, d + done, k);
      done += k;
    }
    if (finite) *finite = check ? ok : RPC_F32_BAD;
    return crc;
  }
  size_t third = len / 3 / 8 * 8, last = len - 2 * third;
  uint64_t c[3] = {~0u, ~0u, ~0u};
  const unsigned char *base = d ? d : s;
  for (size_t done = 0; done < third;) {
    size_t k = third - done < PIECE ? third - done : PIECE;
    if (d)
      for (int t = 0; t < 3; t++) memcpy(d + t * third + done, s + t * third + done, k);
    const unsigned char *p0 = base + done, *p1 = p0 + third, *p2 = p1 + third;
    rpc__crc3(c, p0, p1, p2, k);
    for (int t = 0; check && t < 3; t++) ok = rpc__look(ok, d + t * third + done, k);
    done += k;
  }
  /* The last third also holds the bytes past 3 * third. */
  size_t tail = last - third;
  if (d && tail) memcpy(d + 3 * third, s + 3 * third, tail);
  if (check && tail) ok = rpc__look(ok, d + 3 * third, tail);
  if (finite) *finite = check ? ok : RPC_F32_BAD;
  uint32_t c2 = (uint32_t)c[2];
  if (tail) c2 = rpc__crc_hw(c2, base + 3 * third, tail);
  uint32_t r0 = ~(uint32_t)c[0], r1 = ~(uint32_t)c[1], r2 = ~c2;
  return rpc__crc_combine(rpc__crc_combine(r0, r1, third), r2, last);
}

uint32_t rpc_shm_copy_crc(void *dst, const void *src, size_t len) {
  return rpc__copy_crc(dst, src, len, NULL);
}

uint32_t rpc_shm_copy_crc_finite(void *dst, const void *src, size_t len, int *finite) {
  return rpc__copy_crc(dst, src, len, finite);
}

uint32_t rpc_shm_crc(const void *data, size_t len) {
  return rpc__copy_crc(NULL, data, len, NULL);
}

/* The copy of rpc__copy_crc without the checksum: pieces small enough to be looked at for
 * NaN and Inf while they are in cache, so memory is crossed once. */
void rpc_shm_copy_finite(void *dst, const void *src, size_t len, int *finite) {
  enum { PIECE = 16 << 10 };
  unsigned char *d = dst;
  const unsigned char *s = src;
  int ok = (uintptr_t)d % _Alignof(float) == 0 && len % sizeof(float) == 0 ? RPC_F32_BOUNDED
                                                                           : RPC_F32_BAD;
  for (size_t done = 0; done < len;) {
    size_t k = len - done < PIECE ? len - done : PIECE;
    memcpy(d + done, s + done, k);
    ok = rpc__look(ok, d + done, k);
    done += k;
  }
  *finite = ok;
}

int rpc_shm_entry_holds(const unsigned char *area, size_t bytes, const Precond__V1__ShmRef *ref) {
  if (area == NULL || ref->seq == 0 ||
      rpc_shm_ref_check(bytes, RPC_SHM_ROOTS_DATA, bytes, ref->offset, ref->length,
                        (size_t)ref->length) != RPC_OK)
    return 0;
  const rpc_shm_entry *e =
      (const rpc_shm_entry *)(const void *)area + ref->seq % RPC_SHM_ROOTS_ENTRIES;
  /* Acquire: the entry's other fields and the bytes it guards are read after this. */
  if (__atomic_load_n(&e->seq, __ATOMIC_ACQUIRE) != ref->seq) return 0;
  return e->offset == ref->offset && e->length == ref->length && e->crc32c == ref->crc32c;
}

int rpc_shm_ring_take(uint64_t *pos, uint64_t area, uint64_t len, uint64_t *off) {
  if (!pos || !off || len > area) return RPC_ETOOBIG;
  if (*pos > area || area - *pos < len) *pos = 0; /* wrap: the oldest bytes go first */
  *off = *pos;
  uint64_t next = *pos + (len + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  *pos = next > area ? area : next;
  return RPC_OK;
}

int rpc_shm_ref_check(uint64_t region, uint64_t lo, uint64_t hi, uint64_t offset, uint64_t length,
                      size_t expect) {
  if (hi > region || lo > hi) return RPC_EINVAL;
  if (length != expect) return RPC_EINVAL;
  if (offset < lo || offset > hi || hi - offset < length) return RPC_EINVAL;
  return RPC_OK;
}

/* ---- the client's side of a region: open, write push statistics, read fetched roots ---- */

/* Where the ring's next byte is, in bytes of the ring ever taken (the stamps' count). */
static uint64_t rpc__shm_count(const rpc_shm *s) {
  return s->in_laps * (s->bytes / 2 - RPC_SHM_PUSH_RING) + s->in_pos;
}

/* The bytes of the ring this side takes from (rpc_shm.lim), at most the ring. */
static uint64_t rpc__shm_room(const rpc_shm *s) {
  uint64_t ring = s->bytes / 2 - RPC_SHM_PUSH_RING;
  return s->lim != 0 && s->lim < ring ? s->lim : ring;
}

void rpc_shm_close(rpc_shm *s) {
  if (s->roots != NULL) munmap((void *)(uintptr_t)s->roots, s->roots_bytes);
  if (s->map != NULL) munmap(s->map, s->bytes);
  if (s->map != NULL && s->fd >= 0) close(s->fd); /* drops the flock */
  memset(s, 0, sizeof *s);
  s->fd = -1;
}

int rpc_shm_open(grpc_channel *ch, const char *token, long deadline_ms, uint64_t want, rpc_shm *s,
                 grpc_status_code *code, char *err, size_t errlen) {
  return rpc_shm_open_holding(ch, token, deadline_ms, want, 0, s, code, err, errlen);
}

int rpc_shm_open_holding(grpc_channel *ch, const char *token, long deadline_ms, uint64_t want,
                         int holds_vouched, rpc_shm *s, grpc_status_code *code, char *err,
                         size_t errlen) {
  memset(s, 0, sizeof *s);
  s->fd = -1;
  Precond__V1__ShmOpenRequest req = PRECOND__V1__SHM_OPEN_REQUEST__INIT;
  req.bytes = want;
  req.holds_vouched = holds_vouched != 0;
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
  s->bell = r->doorbell && s->bytes / 2 > RPC_SHM_PUSH_RING;
  s->queue = s->bell && r->doorbell_queue;
  s->rung = __atomic_load_n(&((rpc_shm_head *)map)->bell, __ATOMIC_ACQUIRE);
  /* This client flags its sleeps on answered: the daemon wakes it only then (rpc.h). */
  __atomic_store_n(&((rpc_shm_head *)map)->answer_wait, RPC_SHM_WAIT_FLAGGED, __ATOMIC_SEQ_CST);
  s->pace.nap_max_us = rpc_shm_nap_max_us();
  s->wmode.force = rpc_shm_write_force();
  /* The roots area, read-only, if there is one and it can be mapped: without it fetches
   * get their roots in this region's half, as from an older daemon. */
  int rfd = r->roots_path && r->roots_path[0] && r->roots_bytes > RPC_SHM_ROOTS_DATA
                ? open(r->roots_path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
                : -1;
  if (rfd >= 0 && fstat(rfd, &st) == 0 && (uint64_t)st.st_size == r->roots_bytes) {
    void *roots = mmap(NULL, (size_t)r->roots_bytes, PROT_READ, MAP_SHARED, rfd, 0);
    if (roots != MAP_FAILED) {
      s->roots = roots;
      s->roots_bytes = (size_t)r->roots_bytes;
    }
  }
  if (rfd >= 0) close(rfd); /* the mapping stays */
  protobuf_c_message_free_unpacked(msg, NULL);
  return RPC_OK;

fail:
  *code = GRPC_STATUS_FAILED_PRECONDITION;
  if (fd >= 0) close(fd);
  protobuf_c_message_free_unpacked(msg, NULL);
  return rc;
}

void rpc_shm_session(const rpc_shm *s, Precond__V1__ShmSession *w) {
  precond__v1__shm_session__init(w);
  w->id = s->id;
  w->secret.data = (uint8_t *)(uintptr_t)s->secret;
  w->secret.len = RPC_SHM_SECRET_BYTES;
}

unsigned char *rpc_shm_slot(rpc_shm *s, Precond__V1__PackedMatrix *m, size_t len,
                            Precond__V1__ShmRef *ref) {
  uint64_t off = 0, before = s->in_pos, half = s->bytes / 2;
  if (s->map == NULL || len == 0 || half <= RPC_SHM_PUSH_RING ||
      rpc_shm_ring_take(&s->in_pos, rpc__shm_room(s), len, &off) != RPC_OK)
    return NULL;
  if (off < before) s->in_laps++; /* wrapped */
  uint64_t ring = half - RPC_SHM_PUSH_RING, start = s->in_laps * ring + off;
  /* The head first, then (the caller) the bytes: the full fence orders the caller's stores,
   * non-temporal ones of a large memcpy included, after it. */
  __atomic_store_n((uint64_t *)(void *)s->map, start + (s->in_pos - off), __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  precond__v1__shm_ref__init(ref);
  ref->offset = RPC_SHM_PUSH_RING + off;
  ref->length = len;
  ref->seq = start + 1;
  ref->unchecked = 1; /* the daemon validates what it reads, as it does a message's bytes */
  m->shm = ref;
  m->data.data = NULL;
  m->data.len = 0;
  return s->map + RPC_SHM_PUSH_RING + off;
}

int rpc_shm_push_intact(const unsigned char *map, size_t bytes, uint64_t offset, uint64_t seq) {
  uint64_t half = bytes / 2;
  if (seq == 0) return 1;
  if (map == NULL || half <= RPC_SHM_PUSH_RING) return 0;
  uint64_t ring = half - RPC_SHM_PUSH_RING, start = seq - 1;
  if (offset != RPC_SHM_PUSH_RING + start % ring) return 0;
  /* The reads of the bytes before the head's load (the client's writes come after its
   * head): a head past the slot's lap means some byte read may be a later push's. */
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  uint64_t head = __atomic_load_n((const uint64_t *)(const void *)map, __ATOMIC_ACQUIRE);
  return head >= start && head - start <= ring;
}

/* The streaming stores of rpc_shm_write (64 bytes at a time, dst 64-byte aligned, n a
 * multiple of 64), then sfence: streaming stores are weakly ordered, and the push's head
 * and doorbell, written after them, must not become visible before them. Returns the OR of
 * rpc_f32_unvouched over the bytes read as floats (rpc_shm_write_vouched's test, free in
 * this memory-bound pass; meaningful where the bytes are floats at float offsets). */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static uint32_t rpc__stream512(unsigned char *d,
                                                                  const unsigned char *s,
                                                                  size_t n) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), carry = _mm512_set1_epi32(0x02000000);
  __m512i out = _mm512_setzero_si512();
  for (size_t i = 0; i < n; i += 64) {
    __m512i v = _mm512_loadu_si512((const void *)(s + i));
    out = _mm512_or_si512(out, _mm512_add_epi32(_mm512_and_si512(v, expo), carry));
    _mm512_stream_si512((void *)(d + i), v);
  }
  _mm_sfence();
  return (uint32_t)_mm512_reduce_or_epi32(out);
}

__attribute__((target("avx"))) static void rpc__stream256(unsigned char *d, const unsigned char *s,
                                                          size_t n) {
  for (size_t i = 0; i < n; i += 32) {
    _mm256_stream_si256((__m256i *)(void *)(d + i),
                        _mm256_loadu_si256((const __m256i *)(const void *)(s + i)));
    _mm256_stream_si256((__m256i *)(void *)(d + i + 32),
                        _mm256_loadu_si256((const __m256i *)(const void *)(s + i + 32)));
  }
  _mm_sfence();
}

/* 2: AVX-512, 1: AVX, 0: neither (plain copies only). */
static int rpc__stream_kind(void) {
  return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx") ? 1 : 0;
}
#else
static int rpc__stream_kind(void) {
  return 0;
}
#endif

void rpc_shm_write(void *dst, const void *src, size_t len) {
  unsigned char *d = dst;
  const unsigned char *s = src;
  int kind = len >= RPC_SHM_STREAM_MIN ? rpc__stream_kind() : 0;
  if (kind == 0) {
    memcpy(d, s, len);
    return;
  }
  size_t head = (64 - (uintptr_t)d % 64) % 64, body = (len - head) / 64 * 64;
  memcpy(d, s, head);
#if defined(__x86_64__) && defined(__GNUC__)
  if (kind == 2)
    (void)rpc__stream512(d + head, s + head, body);
  else
    rpc__stream256(d + head, s + head, body);
#endif
  memcpy(d + head + body, s + head + body, len - head - body);
}

int rpc_shm_cpu(void) {
#if defined(__linux__) && defined(__GLIBC__)
  /* glibc's answer from the kernel's vDSO or rseq area: a few nanoseconds where the
   * system call took about a microsecond on this VM, asked three times a push
   * (docs/precondd.md, "Session 12"). */
  return sched_getcpu();
#elif defined(__linux__) && defined(SYS_getcpu)
  unsigned cpu = 0;
  return syscall(SYS_getcpu, &cpu, NULL, NULL) == 0 ? (int)cpu : -1;
#else
  return -1;
#endif
}

int rpc_shm_streams_at(const void *map, size_t len) {
  if (len < RPC_SHM_STREAM_MIN || rpc__stream_kind() == 0) return 0;
  if (map == NULL) return 1;
  uint32_t d = __atomic_load_n(&((const rpc_shm_head *)map)->daemon_cpu, __ATOMIC_RELAXED);
  return d == 0 || (int)(d - 1) != rpc_shm_cpu();
}

/* The plain copy of rpc_shm_write_vouched, with the vouch's test in its pass (it vectorizes):
 * the OR of rpc_f32_unvouched. */
static uint32_t rpc__copy_vouch(float *d, const float *s, size_t count) {
  uint32_t out = 0;
  for (size_t i = 0; i < count; i++) {
    out |= rpc_f32_unvouched(s[i]);
    d[i] = s[i];
  }
  return out;
}

int rpc_shm_write_vouched(float *dst, const float *src, size_t count, int stream) {
  uint32_t out;
  if (!stream || count * sizeof(float) < RPC_SHM_STREAM_MIN) {
    out = rpc__copy_vouch(dst, src, count);
  } else if (rpc__stream_kind() != 2) { /* AVX alone: rpc_shm_write, then a look at src */
    rpc_shm_write(dst, src, count * sizeof(float));
    out = 0;
    for (size_t i = 0; i < count; i++) out |= rpc_f32_unvouched(src[i]);
  } else {
#if defined(__x86_64__) && defined(__GNUC__)
    size_t head = (64 - (uintptr_t)dst % 64) % 64 / sizeof(float);
    head = head < count ? head : count;
    size_t body = (count - head) / 16 * 16;
    out = rpc__copy_vouch(dst, src, head) |
          rpc__stream512((unsigned char *)(dst + head), (const unsigned char *)(src + head),
                         body * sizeof(float)) |
          rpc__copy_vouch(dst + head + body, src + head + body, count - head - body);
#else
    out = rpc__copy_vouch(dst, src, count);
#endif
  }
  return !(out & 0x80000000u);
}

int rpc_shm_streams(const rpc_shm *s, size_t len) {
  return rpc_shm_streams_at(s->map, len);
}

/* ---- the write's mode, measured (session 16; rpc.h: rpc_shm_mode) ---- */

static int rpc__shm_force_env;

static void rpc__shm_force_read(void) {
  const char *v = getenv("PRECOND_SHM_WRITE");
  rpc__shm_force_env = v == NULL                    ? 0
                       : strcmp(v, "streamed") == 0 ? RPC_SHM_FORCE_STREAMED
                       : strcmp(v, "plain") == 0    ? RPC_SHM_FORCE_PLAIN
                                                    : 0;
}

int rpc_shm_write_force(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, rpc__shm_force_read);
  return rpc__shm_force_env;
}

uint64_t rpc_shm_thread_ns(void) {
  struct timespec t;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) != 0) return 0;
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* The lock's holders do a few loads and stores: a spin, no system call. */
static void rpc__mode_lock(rpc_shm_mode *m) {
  while (__atomic_test_and_set(&m->busy, __ATOMIC_ACQUIRE))
    while (__atomic_load_n(&m->busy, __ATOMIC_RELAXED)) {
    }
}

static void rpc__mode_unlock(rpc_shm_mode *m) {
  __atomic_clear(&m->busy, __ATOMIC_RELEASE);
}

/* A moving average: the first figure as it is, then a quarter of each new one, so that a
 * probe block (RPC_SHM_MODE_BLOCK figures) replaces most of what an old one left. What
 * goes in is the median of the figure and the two before it (last[]), at most 1.5x the
 * average: on a loaded machine a push now and then costs several times the others (the
 * core taken by another process's cache traffic), and one such would otherwise tip the
 * choice for a whole period; a real rise still gets through in a block (1.125x a figure,
 * 2.6x over eight). */
static void rpc__mode_avg(double *avg, uint32_t *n, double last[2], double x) {
  double y = x;
  if (*n >= 2) { /* the median of three */
    double lo = last[0] < last[1] ? last[0] : last[1], hi = last[0] + last[1] - lo;
    y = x < lo ? lo : x > hi ? hi : x;
  }
  last[1] = last[0];
  last[0] = x;
  if (*n > 0 && y > 1.5 * *avg) y = 1.5 * *avg;
  *avg = *n == 0 ? y : *avg + 0.25 * (y - *avg);
  if (*n < UINT32_MAX) (*n)++;
}

/* Sets m->chosen (1 + mode) to the mode with the lower write + read per byte, unless a
 * kind of figure is missing (two of each wanted: -1 returned, nothing set). The mode
 * chosen last stays unless the other is RPC_SHM_MODE_MARGIN cheaper: two modes that cost
 * about the same are not swapped at every probe. */
static int rpc__mode_best(rpc_shm_mode *m) {
  for (int k = 0; k < 2; k++)
    if (m->nwrite[k] < 2 || m->nread[k] < 2) return -1;
  double cost[2];
  for (int k = 0; k < 2; k++) cost[k] = m->write[k] + m->read[k];
  int was = m->chosen - 1, best = cost[RPC_SHM_STREAMED] < cost[RPC_SHM_PLAIN];
  if (was >= 0 && best != was && cost[best] > (1.0 - RPC_SHM_MODE_MARGIN) * cost[was]) best = was;
  if (best != was) m->switches++;
  m->chosen = best + 1;
  return best;
}

int rpc_shm_mode_chosen(rpc_shm_mode *m) {
  rpc__mode_lock(m);
  int chosen = m->chosen - 1;
  rpc__mode_unlock(m);
  return chosen;
}

int rpc_shm_mode_pick(rpc_shm_mode *m, const void *map, size_t len) {
  if (len < RPC_SHM_STREAM_MIN || rpc__stream_kind() == 0) return RPC_SHM_PLAIN;
  rpc__mode_lock(m);
  int mode;
  if (m->force != 0) {
    mode = m->force == RPC_SHM_FORCE_STREAMED ? RPC_SHM_STREAMED : RPC_SHM_PLAIN;
  } else if (m->heard == 0) {
    mode = rpc_shm_streams_at(map, len); /* an older daemon, or none answered yet */
  } else {
    uint64_t tick = m->ticks++, block = tick / RPC_SHM_MODE_BLOCK;
    if (tick == 2 * RPC_SHM_MODE_BLOCK) {
      /* The first block of each mode first touched the slots' pages (faults on both sides,
       * on the threads' clocks): what they cost says nothing of the modes. */
      m->nwrite[0] = m->nwrite[1] = m->nread[0] = m->nread[1] = 0;
    }
    /* Probe blocks in the mode not in use come RPC_SHM_MODE_BLOCK * 8 writes after the
     * probes, then at gaps doubling up to one block in RPC_SHM_MODE_EVERY (m->probe_at: the
     * next one's block), so that a choice the first figures got wrong is soon undone. The
     * choice is made again only as the block after one starts, when both modes' figures
     * are fresh: between, the mode in use, whose figures follow the load, is not weighed
     * against the other's older ones (on a loaded machine that swapped the modes back and
     * forth whenever the load rose). */
    if (block >= RPC_SHM_MODE_PROBE && m->probe_at == 0) {
      m->gap = 8;
      m->probe_at = RPC_SHM_MODE_PROBE + m->gap - 1;
    }
    if (block >= RPC_SHM_MODE_PROBE && tick % RPC_SHM_MODE_BLOCK == 0 &&
        (m->chosen == 0 || block == m->probe_at + 1)) {
      int was = m->chosen;
      rpc__mode_best(m);
      if (block == m->probe_at + 1) {
        /* A new choice is checked 8 blocks on again: one probe block caught at a bad
         * moment would otherwise hold the dearer mode for a whole period. */
        uint64_t gap = 2 * m->gap < RPC_SHM_MODE_EVERY ? 2 * m->gap : RPC_SHM_MODE_EVERY;
        m->gap = m->chosen != was ? 8 : gap;
        m->probe_at += m->gap;
      }
    }
    int best = m->chosen - 1;
    if (block < RPC_SHM_MODE_PROBE)
      mode = (int)(block % 2); /* plain first */
    else if (best >= 0)
      mode = block == m->probe_at ? !best : best;
    else
      mode = rpc_shm_streams_at(map, len); /* no clean figures: the rule before */
    /* The first writes after a change of mode find the slots as the other mode left them
     * (a plain write after streamed ones takes every line from memory; a place is written
     * again a push or two later): they would charge the change to the mode. */
    if (mode + 1 != m->last) m->run = 0;
    m->last = mode + 1;
    if (m->run < RPC_SHM_MODE_SETTLE) {
      m->run++;
      mode |= RPC_SHM_UNSETTLED;
    }
  }
  rpc__mode_unlock(m);
  return mode;
}

void rpc_shm_mode_wrote(rpc_shm_mode *m, int pick, size_t len, uint64_t ns) {
  if (len < RPC_SHM_STREAM_MIN || pick < 0 || pick > (RPC_SHM_STREAMED | RPC_SHM_UNSETTLED)) return;
  int mode = pick & RPC_SHM_STREAMED;
  rpc__mode_lock(m);
  m->count[mode]++;
  if (!(pick & RPC_SHM_UNSETTLED))
    rpc__mode_avg(&m->write[mode], &m->nwrite[mode], m->wlast[mode], (double)ns / (double)len);
  rpc__mode_unlock(m);
}

void rpc_shm_mode_read(rpc_shm_mode *m, const uint64_t bytes[2], uint64_t ns) {
  if (ns == 0) return;
  rpc__mode_lock(m);
  m->heard++;
  /* Only a push written in one mode tells that mode's cost. */
  int mode = bytes[RPC_SHM_PLAIN] == 0 ? RPC_SHM_STREAMED : RPC_SHM_PLAIN;
  if (bytes[mode] > 0 && bytes[!mode] == 0)
    rpc__mode_avg(&m->read[mode], &m->nread[mode], m->rlast[mode],
                  (double)ns / (double)bytes[mode]);
  rpc__mode_unlock(m);
}

static rpc_shm_mode *rpc__shm_mode(rpc_shm *s) {
  return s->mode != NULL ? s->mode : &s->wmode;
}

void rpc_shm_wrote(rpc_shm *s, int pick, uint64_t len) {
  if (len < RPC_SHM_STREAM_MIN || pick < 0 || pick > (RPC_SHM_STREAMED | RPC_SHM_UNSETTLED)) return;
  s->wrote[pick & RPC_SHM_STREAMED] += len;
  s->unsettled |= (pick & RPC_SHM_UNSETTLED) != 0;
}

size_t rpc_shm_put(rpc_shm *s, Precond__V1__PackedMatrix *m, Precond__V1__ShmRef *ref) {
  const uint8_t *src = m->data.data;
  size_t len = m->data.len;
  unsigned char *dst = rpc_shm_slot(s, m, len, ref);
  if (dst == NULL) return 0;
  rpc_shm_mode *md = rpc__shm_mode(s);
  int pick = rpc_shm_mode_pick(md, s->map, len);
  if (len < RPC_SHM_STREAM_MIN) {
    memcpy(dst, src, len);
    return len;
  }
  uint64_t t0 = rpc_shm_thread_ns();
  if (pick & RPC_SHM_STREAMED)
    rpc_shm_write(dst, src, len);
  else
    memcpy(dst, src, len);
  rpc_shm_mode_wrote(md, pick, len, rpc_shm_thread_ns() - t0);
  rpc_shm_wrote(s, pick, len);
  return len;
}

void rpc_shm_rewind(rpc_shm *s) {
  if (s->in_pos == 0) return;
  s->in_pos = 0;
  s->in_laps++; /* the next slot's stamp starts a lap: the rest of this one counts as taken */
  s->push_start = rpc__shm_count(s);
  s->push_end = 0;
}

/* ---- the doorbell (rpc.h: rpc_shm_head) ---- */

_Static_assert(sizeof(rpc_shm_head) == RPC_SHM_PUSH_RING, "the doorbell is the ring's head");

int rpc_shm_futex_wait(uint32_t *word, uint32_t val, long timeout_ms) {
#if defined(__linux__)
  struct timespec ts = {timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  /* Not FUTEX_PRIVATE_FLAG: the word is in a mapping another process shares. */
  return syscall(SYS_futex, word, FUTEX_WAIT, val, timeout_ms < 0 ? NULL : &ts, NULL, 0) != 0 &&
         errno == ETIMEDOUT;
#else
  (void)word;
  (void)val;
  struct timespec ts = {0, 100000L}; /* no futex: poll */
  (void)timeout_ms;
  nanosleep(&ts, NULL);
  return 0;
#endif
}

void rpc_shm_futex_wake(uint32_t *word) {
#if defined(__linux__)
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#else
  (void)word;
#endif
}

double rpc_shm_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return 1e6 * (double)ts.tv_sec + 1e-3 * (double)ts.tv_nsec;
}

static int rpc__shm_reached(const uint32_t *word, uint32_t want) {
  return (int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - want) >= 0;
}

static double rpc__shm_nap_env;

static void rpc__shm_nap_read(void) {
  const char *v = getenv("PRECOND_SHM_NAP_US");
  char *end = NULL;
  double us = v ? strtod(v, &end) : 0;
  rpc__shm_nap_env = v && end != v && *end == '\0' && us >= 0 && us <= 100000 ? us : 0;
}

double rpc_shm_nap_max_us(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, rpc__shm_nap_read);
  return rpc__shm_nap_env;
}

int rpc_shm_nap(const uint32_t *word, uint32_t want, rpc_shm_pace *pace, double until_us,
                int same_core) {
  double t0 = rpc_shm_now_us(), e = pace->expect_us;
  pace->t0_us = t0;
  if (rpc__shm_reached(word, want)) return 1;
  /* Not known, idle, or the other side on this core (where the futex's hand-off is cheap
   * and a spin would only keep the other side off the CPU): sleep. */
  int spin = e <= RPC_SHM_SPIN_US;
  if (!(e > 0) || same_core || (!spin && e > pace->nap_max_us)) return 0;
  double end = t0 + (spin ? RPC_SHM_SPIN_US : 2 * e);
  if (until_us > 0 && until_us < end) end = until_us;
  if (spin) {
    /* About as long as a nap costs: a short wait is cheaper spun than slept. */
    for (unsigned i = 1;; i++) {
      if (rpc__shm_reached(word, want)) {
        pace->expect_us = rpc_shm_now_us() - t0;
        return 1;
      }
#if defined(__x86_64__) && defined(__GNUC__)
      _mm_pause();
#endif
      if (i % 64 == 0 && rpc_shm_now_us() >= end) return 0;
    }
  }
  /* Naps on this core's own timer: the expected wait, then a quarter of it at a time. */
  double nap = e;
  for (int first = 1;; first = 0) {
    double left = end - rpc_shm_now_us();
    if (left <= 0) return 0;
    if (nap > left) nap = left;
    struct timespec ts = {0, (long)(nap * 1e3)};
    nanosleep(&ts, NULL);
    if (rpc__shm_reached(word, want)) {
      /* There at the first look: it took at most the nap (whose lateness is the timer's,
       * not the other side's), so expect a little less next time; else about this long. */
      pace->expect_us = first ? 0.9375 * e : rpc_shm_now_us() - t0;
      return 1;
    }
    nap = e / 4 > RPC_SHM_SPIN_US ? e / 4 : RPC_SHM_SPIN_US;
  }
}

int rpc_shm_sleep(uint32_t *word, uint32_t want, uint32_t *wait, long timeout_ms) {
  /* Asks for a wake, then looks again: the other side stores the word, then looks at this
   * flag (both sequentially consistent, rpc_shm_signal), so one of the two sees the other's
   * store; and the kernel sleeps only while the word is still what was seen. */
  __atomic_fetch_or(wait, RPC_SHM_WAIT_ASLEEP, __ATOMIC_SEQ_CST);
  uint32_t seen = __atomic_load_n(word, __ATOMIC_SEQ_CST);
  int late = (int32_t)(seen - want) < 0 && rpc_shm_futex_wait(word, seen, timeout_ms);
  __atomic_fetch_and(wait, ~RPC_SHM_WAIT_ASLEEP, __ATOMIC_RELAXED);
  return rpc__shm_reached(word, want) ? 1 : late ? -1 : 0;
}

void rpc_shm_paced(rpc_shm_pace *pace) {
  pace->expect_us = rpc_shm_now_us() - pace->t0_us;
}

void rpc_shm_signal(uint32_t *word, uint32_t v, const uint32_t *wait) {
  /* Sequentially consistent, as the sleeper's ASLEEP and its second look: one of the two
   * sees the other's store (rpc.h, rpc_shm_nap). */
  __atomic_store_n(word, v, __ATOMIC_SEQ_CST);
  uint32_t w = __atomic_load_n(wait, __ATOMIC_SEQ_CST);
  if ((w & (RPC_SHM_WAIT_FLAGGED | RPC_SHM_WAIT_ASLEEP)) != RPC_SHM_WAIT_FLAGGED)
    rpc_shm_futex_wake(word);
}

int rpc_shm_bell_read(const unsigned char *map, size_t bytes, rpc_shm_bell *b) {
  memset(b, 0, sizeof *b);
  uint64_t half = bytes / 2;
  if (map == NULL || half <= RPC_SHM_PUSH_RING) return RPC_EINVAL;
  /* Each field once: what is checked is what is used, whatever the client writes now. */
  const rpc_shm_head *h = (const void *)map;
  b->bell = __atomic_load_n(&h->bell, __ATOMIC_ACQUIRE);
  b->req_offset = __atomic_load_n(&h->req_offset, __ATOMIC_RELAXED);
  b->req_length = __atomic_load_n(&h->req_length, __ATOMIC_RELAXED);
  b->method = __atomic_load_n(&h->method, __ATOMIC_RELAXED);
  b->reply_offset = __atomic_load_n(&h->reply_offset, __ATOMIC_RELAXED);
  b->reply_cap = __atomic_load_n(&h->reply_cap, __ATOMIC_RELAXED);
  if (b->reply_cap < RPC_SHM_REPLY_HEAD || b->reply_offset % 8 != 0 ||
      rpc_shm_ref_check(bytes, RPC_SHM_PUSH_RING, half, b->reply_offset, b->reply_cap,
                        b->reply_cap) != RPC_OK) {
    b->reply_cap = 0; /* no room to answer in */
    return RPC_EINVAL;
  }
  if ((b->method != RPC_SHM_BELL_PUSH && b->method != RPC_SHM_BELL_FETCH) ||
      rpc_shm_ref_check(bytes, RPC_SHM_PUSH_RING, half, b->req_offset, b->req_length,
                        b->req_length) != RPC_OK)
    return RPC_EINVAL;
  return RPC_OK;
}

void rpc_shm_bell_answer(unsigned char *map, size_t bytes, const rpc_shm_bell *b, uint32_t code,
                         const void *msg, size_t len) {
  rpc_shm_head *h = (void *)map;
  if (b->reply_cap >= RPC_SHM_REPLY_HEAD && b->reply_offset <= bytes &&
      bytes - b->reply_offset >= b->reply_cap) {
    if (len > b->reply_cap - RPC_SHM_REPLY_HEAD) len = b->reply_cap - RPC_SHM_REPLY_HEAD;
    unsigned char *at = map + b->reply_offset;
    uint32_t n = (uint32_t)len;
    if (len) memcpy(at + RPC_SHM_REPLY_HEAD, msg, len);
    memcpy(at + 4, &n, 4);
    memcpy(at, &code, 4);
  }
  rpc_shm_signal(&h->answered, b->bell, &h->answer_wait); /* after the answer's bytes */
}

size_t rpc_shm_bell_cpu_append(unsigned char *out, size_t len, size_t cap, uint64_t ns) {
  Precond__V1__PushResponse r = PRECOND__V1__PUSH_RESPONSE__INIT;
  r.bell_cpu_ns = ns; /* the only field set: its packing is that one field */
  size_t more = ns != 0 ? precond__v1__push_response__get_packed_size(&r) : 0;
  if (more == 0 || len > cap || cap - len < more) return len;
  return len + precond__v1__push_response__pack(&r, out + len);
}

#if defined(__linux__)
#ifndef F_OFD_GETLK /* <fcntl.h> declares them for _GNU_SOURCE only; Linux's numbers */
#define F_OFD_GETLK 36
#define F_OFD_SETLK 37
#endif
#endif

int rpc_shm_alive_mark(int fd) {
#if defined(__linux__)
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
  return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? RPC_OK : RPC_EINVAL;
#else
  (void)fd;
  return RPC_EINVAL;
#endif
}

int rpc_shm_alive(int fd) {
#if defined(__linux__)
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
  if (fd < 0 || fcntl(fd, F_OFD_GETLK, &fl) != 0) return 1;
  return fl.l_type != F_UNLCK;
#else
  (void)fd;
  return 1;
#endif
}

static double rpc__now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

/* Waits until the head's futex word *word (taken or answered) reaches want (counts wrap):
 * RPC_OK, or RPC_ECALL with DEADLINE_EXCEEDED past deadline_ms (> 0) or UNAVAILABLE when the
 * daemon's mark of life is gone (looked at every 100 ms of waiting). */
static int rpc__shm_wait(const rpc_shm *s, uint32_t *word, uint32_t want, uint32_t *waiting,
                         rpc_shm_pace *pace, long deadline_ms, grpc_status_code *status,
                         char **details) {
  double until = deadline_ms > 0 ? rpc__now_ms() + (double)deadline_ms : 0;
  /* First without the kernel, as pace says, unless the daemon's thread last served on this
   * CPU (rpc.h, rpc_shm_nap). */
  int same = 0;
  if (pace) {
    uint32_t d = __atomic_load_n(&((const rpc_shm_head *)(const void *)s->map)->daemon_cpu,
                                 __ATOMIC_RELAXED);
    same = d != 0 && (int)(d - 1) == rpc_shm_cpu();
  }
  if (pace && rpc_shm_nap(word, want, pace, 1e3 * until, same)) return RPC_OK;
  int rc = RPC_OK;
  for (;;) {
    uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if ((int32_t)(seen - want) >= 0) break;
    long wait = 100; /* then a look at the daemon's mark of life */
    if (deadline_ms > 0) {
      double left = until - rpc__now_ms();
      if (left <= 0) {
        *status = GRPC_STATUS_DEADLINE_EXCEEDED;
        if (details) *details = strdup("the daemon did not answer the region's doorbell in time");
        rc = RPC_ECALL;
        break;
      }
      if (left < (double)wait) wait = (long)left + 1;
    }
    if (waiting)
      rpc_shm_sleep(word, want, waiting, wait);
    else
      rpc_shm_futex_wait(word, seen, wait);
    seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if ((int32_t)(seen - want) < 0 && !rpc_shm_alive(s->fd)) {
      *status = GRPC_STATUS_UNAVAILABLE;
      if (details) *details = strdup("the daemon is gone (its mark on the region was dropped)");
      rc = RPC_ECALL;
      break;
    }
  }
  if (pace && rc == RPC_OK) rpc_shm_paced(pace);
  return rc;
}

/* Rings req as method with reply_cap bytes (8-aligned) of room for its answer, without
 * waiting for the answer (rpc_shm_post's rules; the answer is s->pend's last). */
static int rpc__shm_ring(rpc_shm *s, uint32_t method, uint32_t reply_cap,
                         const ProtobufCMessage *req, long deadline_ms, grpc_status_code *status,
                         char **details) {
  if (details) *details = NULL;
  *status = GRPC_STATUS_INVALID_ARGUMENT;
  if (!s || !req || !s->map || !s->bell || s->npend >= RPC_SHM_QUEUE || (s->npend > 0 && !s->queue))
    return RPC_EINVAL;
  rpc_shm_head *h = (void *)s->map;
  /* The large writes since the last ring are this request's (none for a fetch). */
  uint64_t wrote[2] = {s->wrote[0], s->wrote[1]};
  int unsettled = s->unsettled;
  s->wrote[0] = s->wrote[1] = 0;
  s->unsettled = 0;
  /* The head holds one request: the previous one's fields must have been read. With none
   * pending the daemon answered every bell, and it takes a head before it answers. */
  int rc = s->npend > 0 ? rpc__shm_wait(s, &h->taken, s->rung, &h->taken_wait, NULL, deadline_ms,
                                        status, details)
                        : RPC_OK;
  if (rc != RPC_OK) return rc;
  uint64_t half = s->bytes / 2, ring = half - RPC_SHM_PUSH_RING, cap = rpc__shm_room(s);
  size_t len = protobuf_c_message_get_packed_size(req);
  uint64_t room = (len + 7) / 8 * 8 + reply_cap, off;
  /* Only where it fits before the ring's end (a wrap would put it over the push's slots)
   * and clear of the pushes still pending (their slots and answers). */
  *status = GRPC_STATUS_RESOURCE_EXHAUSTED;
  if (len > UINT32_MAX || s->in_pos > cap || cap - s->in_pos < room ||
      (s->npend > 0 && rpc__shm_count(s) + room > s->pend[0].start + ring) ||
      (s->push_end != 0 && rpc__shm_count(s) + room > s->push_end) ||
      rpc_shm_ring_take(&s->in_pos, cap, room, &off) != RPC_OK)
    return RPC_ETOOBIG;
  unsigned char *at = s->map + RPC_SHM_PUSH_RING + off;
  protobuf_c_message_pack(req, at);
  uint32_t none = RPC_SHM_NO_ANSWER;
  uint64_t reply = RPC_SHM_PUSH_RING + off + (len + 7) / 8 * 8;
  memcpy(s->map + reply, &none, 4);
  __atomic_store_n(&h->req_offset, RPC_SHM_PUSH_RING + off, __ATOMIC_RELAXED);
  __atomic_store_n(&h->req_length, (uint32_t)len, __ATOMIC_RELAXED);
  __atomic_store_n(&h->method, method, __ATOMIC_RELAXED);
  __atomic_store_n(&h->reply_offset, reply, __ATOMIC_RELAXED);
  __atomic_store_n(&h->reply_cap, reply_cap, __ATOMIC_RELAXED);
  uint32_t mine = ++s->rung;
  /* Where this client rings from, for the daemon's way of waiting (rpc.h, rpc_shm_nap);
   * the wait bits as they are (this thread alone sets them, and does not wait now). */
  int cpu = rpc_shm_cpu();
  __atomic_store_n(&h->answer_wait,
                   RPC_SHM_WAIT_FLAGGED | (cpu < 0 ? 0u : (uint32_t)(cpu + 1) << RPC_SHM_WAIT_CPU),
                   __ATOMIC_RELAXED);
  rpc_shm_signal(&h->bell, mine, &h->bell_wait); /* after every byte above */
  s->pend[s->npend].bell = mine;
  s->pend[s->npend].reply = reply;
  s->pend[s->npend].cap = reply_cap;
  s->pend[s->npend].start = s->push_start;
  memcpy(s->pend[s->npend].wrote, wrote, sizeof wrote);
  s->pend[s->npend].unsettled = unsettled;
  s->npend++;
  if (s->push_end != 0) {
    /* The push takes what rpc_shm_begin reserved, whatever its request took of it: pushes
     * of one size then take the same places, turn by turn. */
    s->in_pos = s->push_end - s->in_laps * ring;
    s->push_end = 0;
  }
  *status = GRPC_STATUS_OK;
  return RPC_OK;
}

int rpc_shm_post(rpc_shm *s, const ProtobufCMessage *req, long deadline_ms,
                 grpc_status_code *status, char **details) {
  grpc_status_code code_ = GRPC_STATUS_UNKNOWN;
  return rpc__shm_ring(s, RPC_SHM_BELL_PUSH, RPC_SHM_BELL_REPLY, req, deadline_ms,
                       status ? status : &code_, details);
}

int rpc_shm_collect(rpc_shm *s, const ProtobufCMessageDescriptor *resp_desc, long deadline_ms,
                    ProtobufCMessage **resp, grpc_status_code *status, char **details) {
  grpc_status_code code_ = GRPC_STATUS_UNKNOWN;
  if (!status) status = &code_;
  if (resp) *resp = NULL;
  if (details) *details = NULL;
  *status = GRPC_STATUS_INVALID_ARGUMENT;
  if (!s || !resp_desc || !resp || !s->map || s->npend == 0) return RPC_EINVAL;
  rpc_shm_head *h = (void *)s->map;
  int rc = rpc__shm_wait(s, &h->answered, s->pend[0].bell, &h->answer_wait, &s->pace, deadline_ms,
                         status, details);
  if (rc != RPC_OK) return rc;
  uint64_t reply = s->pend[0].reply, cap = s->pend[0].cap, wrote[2] = {0, 0};
  if (!s->pend[0].unsettled) memcpy(wrote, s->pend[0].wrote, sizeof wrote); /* else: no credit */
  s->npend--;
  memmove(&s->pend[0], &s->pend[1], s->npend * sizeof s->pend[0]);
  uint32_t code, n;
  memcpy(&code, s->map + reply, 4);
  memcpy(&n, s->map + reply + 4, 4);
  if (code == RPC_SHM_NO_ANSWER || n > cap - RPC_SHM_REPLY_HEAD) {
    *status = GRPC_STATUS_INTERNAL;
    if (details) *details = strdup("the daemon's answer at the doorbell is malformed");
    return RPC_EPARSE;
  }
  const uint8_t *body = s->map + reply + RPC_SHM_REPLY_HEAD;
  *status = (grpc_status_code)code;
  if (code != GRPC_STATUS_OK) {
    if (details) *details = strndup((const char *)body, n);
    return RPC_ESTATUS;
  }
  *resp = protobuf_c_message_unpack(resp_desc, NULL, n, body);
  if (*resp == NULL) {
    *status = GRPC_STATUS_INTERNAL;
    if (details) *details = strdup("the daemon's answer at the doorbell does not parse");
    return RPC_EPARSE;
  }
  if (resp_desc == &precond__v1__push_response__descriptor)
    rpc_shm_mode_read(rpc__shm_mode(s), wrote,
                      ((const Precond__V1__PushResponse *)*resp)->bell_cpu_ns);
  if (details) *details = strdup("");
  return RPC_OK;
}

int rpc_shm_answered(const rpc_shm *s) {
  if (!s || !s->map || s->npend == 0) return 0;
  const rpc_shm_head *h = (const void *)s->map;
  return rpc__shm_reached(&h->answered, s->pend[0].bell);
}

int rpc_shm_taken(const rpc_shm *s, uint32_t i) {
  if (!s || !s->map) return 0;
  const rpc_shm_head *h = (const void *)s->map;
  return i >= s->npend || rpc__shm_reached(&h->taken, s->pend[i].bell);
}

int rpc_shm_call(rpc_shm *s, const ProtobufCMessage *req,
                 const ProtobufCMessageDescriptor *resp_desc, long deadline_ms,
                 ProtobufCMessage **resp, grpc_status_code *status, char **details) {
  return rpc_shm_call_method(s, RPC_SHM_BELL_PUSH, RPC_SHM_BELL_REPLY, req, resp_desc, deadline_ms,
                             resp, status, details);
}

int rpc_shm_call_method(rpc_shm *s, uint32_t method, uint32_t reply_cap,
                        const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                        long deadline_ms, ProtobufCMessage **resp, grpc_status_code *status,
                        char **details) {
  grpc_status_code code_ = GRPC_STATUS_UNKNOWN;
  if (!status) status = &code_;
  if (resp) *resp = NULL;
  if (details) *details = NULL;
  *status = GRPC_STATUS_INVALID_ARGUMENT;
  /* Its own answer is the oldest only with none pending before it. */
  if (!s || !resp_desc || !resp || s->npend > 0 ||
      (method != RPC_SHM_BELL_PUSH && method != RPC_SHM_BELL_FETCH) ||
      reply_cap < RPC_SHM_BELL_REPLY)
    return RPC_EINVAL;
  reply_cap = (reply_cap + 7) / 8 * 8;
  int rc = rpc__shm_ring(s, method, reply_cap, req, deadline_ms, status, details);
  if (rc != RPC_OK) return rc;
  return rpc_shm_collect(s, resp_desc, deadline_ms, resp, status, details);
}

/* Where rpc_shm_begin can place need bytes (RPC_SHM_ALIGN multiple, at most the ring)
 * without collecting: 2 at the ring's start (a lap on) where the pending pushes leave it
 * clear, 1 right after the previous push where that fits before the ring's end and stays
 * clear, 0 nowhere (a push must be collected first). */
static int rpc__shm_place(const rpc_shm *s, uint64_t need) {
  uint64_t ring = s->bytes / 2 - RPC_SHM_PUSH_RING;
  if (s->npend >= RPC_SHM_QUEUE) return 0;
  uint64_t tail = s->npend > 0 ? s->pend[0].start + ring : UINT64_MAX;
  uint64_t lap = (s->in_laps + (s->in_pos > 0)) * ring;
  if (lap + need <= tail) return 2;
  uint64_t cap = rpc__shm_room(s);
  return s->in_pos <= cap && cap - s->in_pos >= need && rpc__shm_count(s) + need <= tail;
}

int rpc_shm_fits(const rpc_shm *s, uint64_t need) {
  if (!s || !s->map || s->bytes / 2 <= RPC_SHM_PUSH_RING) return 0;
  if (need > rpc__shm_room(s)) return 0;
  return rpc__shm_place(s, (need + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN) != 0;
}

int rpc_shm_begin(rpc_shm *s, uint64_t need, long deadline_ms, grpc_status_code *status,
                  char **details) {
  grpc_status_code code_ = GRPC_STATUS_UNKNOWN;
  if (!status) status = &code_;
  if (details) *details = NULL;
  *status = GRPC_STATUS_INVALID_ARGUMENT;
  if (!s || !s->map || s->bytes / 2 <= RPC_SHM_PUSH_RING) return RPC_EINVAL;
  *status = GRPC_STATUS_RESOURCE_EXHAUSTED;
  if (need > rpc__shm_room(s)) return RPC_ETOOBIG;
  need = (need + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  for (;;) {
    int place = rpc__shm_place(s, need);
    if (place == 2) rpc_shm_rewind(s);
    if (place != 0) break;
    ProtobufCMessage *resp = NULL;
    char *msg = NULL;
    int rc = s->npend > 0 ? rpc_shm_collect(s, &precond__v1__push_response__descriptor, deadline_ms,
                                            &resp, status, &msg)
                          : RPC_ETOOBIG;
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    if (rc != RPC_OK) {
      if (details)
        *details = msg;
      else
        free(msg);
      return rc;
    }
    free(msg);
  }
  s->push_start = rpc__shm_count(s);
  s->push_end = s->push_start + (need + RPC_SHM_ALIGN - 1) / RPC_SHM_ALIGN * RPC_SHM_ALIGN;
  *status = GRPC_STATUS_OK;
  return RPC_OK;
}

void rpc_shm_fetch_request(const rpc_shm *s, Precond__V1__ShmSession *w,
                           Precond__V1__FetchRequest *req) {
  rpc_shm_session(s, w);
  req->shm = w;
  req->roots_area = s->roots != NULL;
}

long long rpc_shm_fetch_in(const rpc_shm *s, Precond__V1__FetchResponse *r, char *err,
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
      if (ref->seq != 0) {
        /* The roots area: published once, guarded by its entry (no checksum pass here). */
        if (m->data.len != 0 || !rpc_shm_entry_holds(s->roots, s->roots_bytes, ref)) {
          snprintf(err, errlen, "preconditioners[%zu].%s.shm: not in the roots area as named", i,
                   name[k]);
          return -1;
        }
        free(m->data.data);
        m->data.data = (uint8_t *)(uintptr_t)(s->roots + ref->offset);
        m->data.len = (size_t)ref->length;
        total += (long long)ref->length;
        continue;
      }
      if (s->map == NULL || m->data.len != 0 ||
          rpc_shm_ref_check(s->bytes, s->bytes / 2, s->bytes, ref->offset, ref->length,
                            (size_t)ref->length) != RPC_OK) {
        snprintf(err, errlen, "preconditioners[%zu].%s.shm: outside the daemon's half", i, name[k]);
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

int rpc_shm_fetch_intact(const rpc_shm *s, const Precond__V1__FetchResponse *r) {
  /* Acquire: the copies the caller made are ordered before these loads of the entries. */
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  for (size_t i = 0; r != NULL && i < r->n_preconditioners; i++) {
    const Precond__V1__BlockRoots *b = r->preconditioners[i];
    const Precond__V1__PackedMatrix *part[4] = {b->left, b->right, b->a_inv, b->g_inv};
    for (int k = 0; k < 4; k++)
      if (part[k] != NULL && part[k]->shm != NULL && part[k]->shm->seq != 0 &&
          !rpc_shm_entry_holds(s->roots, s->roots_bytes, part[k]->shm))
        return 0;
  }
  return 1;
}

void rpc_shm_fetch_done(Precond__V1__FetchResponse *r) {
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
