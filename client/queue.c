/*
 * queue.c -- the bounded push queue of libprecond (see queue.h for the policy).
 */
#include "queue.h"

#include <stdlib.h>

static precond__item *item_make(uint32_t block_id, uint64_t step, int encoding, uint32_t n_left,
                                size_t left_bytes, uint32_t n_right, size_t right_bytes,
                                unsigned char *data) {
  precond__item *item = malloc(sizeof(*item) + (data == NULL ? left_bytes + right_bytes : 0));
  if (item == NULL) return NULL;
  item->data = data != NULL ? data : item->payload;
  item->alone = 0;
  item->release = NULL;
  item->owner = NULL;
  item->slot = 0;
  item->wmode = 0;
  item->wrote[0] = item->wrote[1] = 0;
  atomic_init(&item->vouched, 0u);
  item->prev = item->next = NULL;
  item->block_id = block_id;
  item->step = step;
  item->encoding = encoding;
  item->n_left = n_left;
  item->n_right = n_right;
  item->left_bytes = left_bytes;
  item->right_bytes = right_bytes;
  return item;
}

precond__item *precond__item_new(uint32_t block_id, uint64_t step, int encoding, uint32_t n_left,
                                 size_t left_bytes, uint32_t n_right, size_t right_bytes) {
  return item_make(block_id, step, encoding, n_left, left_bytes, n_right, right_bytes, NULL);
}

precond__item *precond__item_wrap(uint32_t block_id, uint64_t step, int encoding, uint32_t n_left,
                                  size_t left_bytes, uint32_t n_right, size_t right_bytes,
                                  unsigned char *data) {
  if (data == NULL) return NULL;
  return item_make(block_id, step, encoding, n_left, left_bytes, n_right, right_bytes, data);
}

void precond__item_free(precond__item *item) {
  if (item != NULL && item->release != NULL) item->release(item);
  free(item);
}

size_t precond__item_bytes(const precond__item *item) {
  return item->left_bytes + item->right_bytes;
}

int precond__queue_init(precond__queue *q, size_t capacity, uint32_t nblocks) {
  q->head = q->tail = NULL;
  q->length = 0;
  q->bytes = 0;
  q->capacity = 0;
  q->nblocks = 0;
  q->by_block = NULL;
  if (capacity == 0) return -1;
  if (nblocks > 0) {
    q->by_block = calloc(nblocks, sizeof(*q->by_block));
    if (q->by_block == NULL) return -1;
  }
  q->nblocks = nblocks;
  q->capacity = capacity;
  return 0;
}

static void unlink_item(precond__queue *q, precond__item *item) {
  if (item->prev != NULL)
    item->prev->next = item->next;
  else
    q->head = item->next;
  if (item->next != NULL)
    item->next->prev = item->prev;
  else
    q->tail = item->prev;
  item->prev = item->next = NULL;
  q->by_block[item->block_id] = NULL;
  q->length--;
  q->bytes -= precond__item_bytes(item);
}

static void link_tail(precond__queue *q, precond__item *item) {
  item->next = NULL;
  item->prev = q->tail;
  if (q->tail != NULL)
    q->tail->next = item;
  else
    q->head = item;
  q->tail = item;
  q->by_block[item->block_id] = item;
  q->length++;
  q->bytes += precond__item_bytes(item);
}

static void link_head(precond__queue *q, precond__item *item) {
  item->prev = NULL;
  item->next = q->head;
  if (q->head != NULL)
    q->head->prev = item;
  else
    q->tail = item;
  q->head = item;
  q->by_block[item->block_id] = item;
  q->length++;
  q->bytes += precond__item_bytes(item);
}

void precond__queue_destroy(precond__queue *q) {
  precond__item *item = q->head;
  while (item != NULL) {
    precond__item *next = item->next;
    precond__item_free(item);
    item = next;
  }
  free(q->by_block);
  q->head = q->tail = NULL;
  q->by_block = NULL;
  q->length = q->bytes = 0;
  q->nblocks = 0;
}

int precond__queue_put(precond__queue *q, precond__item *item) {
  precond__item *old = q->by_block[item->block_id];
  if (old != NULL) {
    /* Replace in place: the block keeps its turn, so a hot block cannot starve others by
     * being pushed every step, and it does not jump ahead either. */
    item->prev = old->prev;
    item->next = old->next;
    if (old->prev != NULL)
      old->prev->next = item;
    else
      q->head = item;
    if (old->next != NULL)
      old->next->prev = item;
    else
      q->tail = item;
    q->by_block[item->block_id] = item;
    q->bytes = q->bytes - precond__item_bytes(old) + precond__item_bytes(item);
    precond__item_free(old);
    return PRECOND__COALESCED;
  }
  int result = PRECOND__QUEUED;
  if (q->length >= q->capacity) {
    precond__item *oldest = q->head;
    unlink_item(q, oldest);
    precond__item_free(oldest);
    result = PRECOND__DROPPED_OLDEST;
  }
  link_tail(q, item);
  return result;
}

size_t precond__queue_take(precond__queue *q, precond__item **out, size_t max_items,
                           size_t max_bytes) {
  size_t n = 0, bytes = 0;
  while (n < max_items && q->head != NULL) {
    size_t sz = precond__item_bytes(q->head);
    if (n > 0 && (bytes + sz > max_bytes || q->head->alone || out[0]->alone)) break;
    out[n] = q->head;
    unlink_item(q, q->head);
    bytes += sz;
    n++;
  }
  return n;
}

void precond__queue_requeue(precond__queue *q, precond__item **items, size_t n, uint64_t *coalesced,
                            uint64_t *dropped) {
  /* Walk backwards so that pushing each at the head restores the original order. */
  for (size_t i = n; i-- > 0;) {
    precond__item *item = items[i];
    if (item->block_id >= q->nblocks || q->by_block[item->block_id] != NULL) {
      precond__item_free(item);
      if (coalesced != NULL) (*coalesced)++;
    } else if (q->length >= q->capacity) {
      precond__item_free(item);
      if (dropped != NULL) (*dropped)++;
    } else {
      link_head(q, item);
    }
  }
}
