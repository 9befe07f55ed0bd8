/*
 * queue.h -- libprecond internal: the bounded push queue and its coalescing policy.
 * Not part of the public API (prefix precond__); included by client.c and the unit tests.
 *
 * A FIFO of blocks waiting to be sent, at most one entry per block id (a newer push of a
 * queued block replaces it in place, keeping its position), at most `capacity` entries (a
 * push into a full queue drops the oldest entry). Not thread-safe: the client's mutex guards
 * it. Block ids are dense (0 .. nblocks-1, as the daemon's layout numbers them), so the
 * per-block lookup is an array.
 */
#ifndef PRECOND_CLIENT_QUEUE_H
#define PRECOND_CLIENT_QUEUE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* One queued block: header, then n_left then n_right packed values of elem_size bytes,
 * in the item's own payload or elsewhere (data). */
typedef struct precond__item {
  struct precond__item *prev, *next; /* queue links; owned by the queue while queued */
  uint32_t block_id;
  uint64_t step;
  int encoding; /* precond_encoding */
  uint32_t n_left, n_right;
  size_t left_bytes, right_bytes; /* payload sizes */
  unsigned char *data;            /* left bytes, then right bytes: payload, or the place
                                   * precond__item_wrap was given */
  int alone;                      /* 1: taken from the queue in a batch of its own */
  /* A wrapped item's owner (client.c: a slot in a shared region): release runs once, at
   * precond__item_free, before the header goes, with owner and slot as set. */
  void (*release)(struct precond__item *item);
  void *owner;
  uint64_t slot;
  /* The mode of its large writes into the region (rpc.h, rpc_shm_mode_pick's: RPC_SHM_PLAIN
   * or RPC_SHM_STREAMED, maybe with RPC_SHM_UNSETTLED; a worker slot's is chosen at
   * precond_push_begin) and the bytes written in each (precond_push_copy's, rpc_shm_put's;
   * writes below 1 MiB not counted). */
  int wmode;
  uint64_t wrote[2];
  /* Bit k: part k (0 left/a, 1 right/g) was last written whole by precond_push_copy with
   * every value below 2^125 (its ShmRef is vouched). Atomic: workers may copy parts of one
   * slot at once. */
  atomic_uint vouched;
  unsigned char payload[];
} precond__item;

/* Allocates an item with room for left_bytes + right_bytes of payload (not filled). The
 * caller owns it until it hands it to precond__queue_put; free with precond__item_free.
 * Returns NULL on out of memory. */
precond__item *precond__item_new(uint32_t block_id, uint64_t step, int encoding, uint32_t n_left,
                                 size_t left_bytes, uint32_t n_right, size_t right_bytes);
/* precond__item_new whose bytes are at data (not owned by the item: the caller sets
 * release/owner/slot to give them back at precond__item_free). NULL on out of memory. */
precond__item *precond__item_wrap(uint32_t block_id, uint64_t step, int encoding, uint32_t n_left,
                                  size_t left_bytes, uint32_t n_right, size_t right_bytes,
                                  unsigned char *data);
void precond__item_free(precond__item *item);
size_t precond__item_bytes(const precond__item *item);

typedef struct {
  precond__item *head, *tail; /* oldest at head */
  precond__item **by_block;   /* nblocks entries: the queued item of each block or NULL */
  uint32_t nblocks;
  size_t length, capacity;
  size_t bytes; /* payload bytes queued */
} precond__queue;

/* Result of a put. */
enum { PRECOND__QUEUED = 0, PRECOND__COALESCED = 1, PRECOND__DROPPED_OLDEST = 2 };

/* Initialises an empty queue for block ids below nblocks holding at most capacity (>= 1)
 * items. Returns 0, or -1 on out of memory / bad arguments (queue left zeroed). */
int precond__queue_init(precond__queue *q, size_t capacity, uint32_t nblocks);

/* Frees every queued item and the index. A zeroed queue is a no-op. */
void precond__queue_destroy(precond__queue *q);

/* Takes ownership of item (its block_id must be < nblocks) and queues it per the policy:
 * replaces a queued item of the same block (PRECOND__COALESCED; the old one is freed), else
 * appends, first dropping and freeing the oldest if full (PRECOND__DROPPED_OLDEST), else
 * PRECOND__QUEUED. Never fails. */
int precond__queue_put(precond__queue *q, precond__item *item);

/* Removes items from the head into out[] (at most max_items), stopping before the payload
 * would exceed max_bytes, but always taking at least one item if the queue is not empty;
 * an item marked alone is taken only as the first, and then alone. The caller owns the
 * removed items. Returns how many were taken. */
size_t precond__queue_take(precond__queue *q, precond__item **out, size_t max_items,
                           size_t max_bytes);

/* Puts n items taken earlier back at the head, in their order (after a failed send). An
 * item whose block has been queued again meanwhile is freed instead (the newer push wins,
 * counted in *coalesced); an item that finds the queue full is freed (it is older than
 * everything queued; counted in *dropped). Takes ownership of all n items. */
void precond__queue_requeue(precond__queue *q, precond__item **items, size_t n, uint64_t *coalesced,
                            uint64_t *dropped);

#endif /* PRECOND_CLIENT_QUEUE_H */
