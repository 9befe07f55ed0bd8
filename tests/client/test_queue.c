/*
 * test_queue.c -- unit tests of libprecond's push queue: FIFO order, coalescing a newer push
 * of a queued block, drop-oldest when full, batch taking by bytes, requeue after a failed send,
 * items taken alone, wrapped items giving their bytes back once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "queue.h"

/* An item whose payload is `bytes` copies of the step's low byte, so tests can tell which
 * push survived. */
static precond__item *make(uint32_t block, uint64_t step, size_t bytes) {
  precond__item *it = precond__item_new(block, step, 0, 1, bytes, 0, 0);
  assert_non_null(it);
  memset(it->data, (int)(step & 0xff), bytes);
  return it;
}

static void take_all(precond__queue *q, uint32_t *blocks, uint64_t *steps, size_t *n) {
  precond__item *out[64];
  *n = precond__queue_take(q, out, 64, SIZE_MAX);
  for (size_t i = 0; i < *n; i++) {
    blocks[i] = out[i]->block_id;
    steps[i] = out[i]->step;
    precond__item_free(out[i]);
  }
}

static void test_fifo_order(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 8, 8), 0);
  for (uint32_t b = 0; b < 5; b++)
    assert_int_equal(precond__queue_put(&q, make(b, 10 + b, 16)), PRECOND__QUEUED);
  assert_int_equal(q.length, 5);
  assert_int_equal(q.bytes, 5 * 16);
  uint32_t blocks[64];
  uint64_t steps[64];
  size_t n;
  take_all(&q, blocks, steps, &n);
  assert_int_equal(n, 5);
  for (uint32_t b = 0; b < 5; b++) {
    assert_int_equal(blocks[b], b);
    assert_int_equal(steps[b], 10 + b);
  }
  assert_int_equal(q.length, 0);
  assert_int_equal(q.bytes, 0);
  assert_null(q.head);
  precond__queue_destroy(&q);
}

static void test_coalesce_keeps_position_and_newest(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 8, 8), 0);
  precond__queue_put(&q, make(0, 1, 8));
  precond__queue_put(&q, make(1, 1, 8));
  precond__queue_put(&q, make(2, 1, 8));
  /* block 1 again at step 2 with a bigger payload: replaces the step-1 push in place */
  assert_int_equal(precond__queue_put(&q, make(1, 2, 32)), PRECOND__COALESCED);
  assert_int_equal(q.length, 3);
  assert_int_equal(q.bytes, 8 + 32 + 8);
  /* head and tail replacements relink both ends */
  assert_int_equal(precond__queue_put(&q, make(0, 3, 8)), PRECOND__COALESCED);
  assert_int_equal(precond__queue_put(&q, make(2, 3, 8)), PRECOND__COALESCED);
  precond__item *out[8];
  size_t n = precond__queue_take(&q, out, 8, SIZE_MAX);
  assert_int_equal(n, 3);
  assert_int_equal(out[0]->block_id, 0);
  assert_int_equal(out[0]->step, 3);
  assert_int_equal(out[1]->block_id, 1);
  assert_int_equal(out[1]->step, 2);
  assert_int_equal(out[1]->data[31], 2);
  assert_int_equal(out[2]->block_id, 2);
  assert_int_equal(out[2]->step, 3);
  for (size_t i = 0; i < n; i++) precond__item_free(out[i]);
  precond__queue_destroy(&q);
}

static void test_full_drops_oldest(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 3, 16), 0);
  for (uint32_t b = 0; b < 3; b++)
    assert_int_equal(precond__queue_put(&q, make(b, 1, 4)), PRECOND__QUEUED);
  assert_int_equal(precond__queue_put(&q, make(3, 1, 4)), PRECOND__DROPPED_OLDEST);
  assert_int_equal(precond__queue_put(&q, make(4, 1, 4)), PRECOND__DROPPED_OLDEST);
  /* a coalescing push into a full queue drops nothing */
  assert_int_equal(precond__queue_put(&q, make(3, 2, 4)), PRECOND__COALESCED);
  assert_int_equal(q.length, 3);
  /* the dropped block can be queued again (its index slot was cleared) */
  uint32_t blocks[64];
  uint64_t steps[64];
  size_t n;
  take_all(&q, blocks, steps, &n);
  assert_int_equal(n, 3);
  assert_int_equal(blocks[0], 2);
  assert_int_equal(blocks[1], 3);
  assert_int_equal(steps[1], 2);
  assert_int_equal(blocks[2], 4);
  assert_int_equal(precond__queue_put(&q, make(0, 5, 4)), PRECOND__QUEUED);
  precond__queue_destroy(&q);
}

static void test_take_respects_byte_budget(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 16, 16), 0);
  precond__queue_put(&q, make(0, 1, 100));
  precond__queue_put(&q, make(1, 1, 100));
  precond__queue_put(&q, make(2, 1, 100));
  precond__item *out[8];
  /* 250 bytes: two items fit, the third would not */
  size_t n = precond__queue_take(&q, out, 8, 250);
  assert_int_equal(n, 2);
  precond__item_free(out[0]);
  precond__item_free(out[1]);
  /* a single item larger than the budget still goes (alone) */
  n = precond__queue_take(&q, out, 8, 10);
  assert_int_equal(n, 1);
  assert_int_equal(out[0]->block_id, 2);
  precond__item_free(out[0]);
  /* empty queue: nothing */
  assert_int_equal(precond__queue_take(&q, out, 8, 10), 0);
  /* max_items bound */
  for (uint32_t b = 0; b < 5; b++) precond__queue_put(&q, make(b, 1, 1));
  n = precond__queue_take(&q, out, 2, SIZE_MAX);
  assert_int_equal(n, 2);
  precond__item_free(out[0]);
  precond__item_free(out[1]);
  assert_int_equal(q.length, 3);
  precond__queue_destroy(&q);
}

static void test_requeue_after_failed_send(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 4, 16), 0);
  for (uint32_t b = 0; b < 3; b++) precond__queue_put(&q, make(b, 1, 4));
  precond__item *out[8];
  size_t n = precond__queue_take(&q, out, 8, SIZE_MAX);
  assert_int_equal(n, 3);
  /* while the send was failing: block 1 pushed again (newer), block 7 and 8 new */
  precond__queue_put(&q, make(1, 2, 4));
  precond__queue_put(&q, make(7, 2, 4));
  precond__queue_put(&q, make(8, 2, 4));
  uint64_t coalesced = 0, dropped = 0;
  precond__queue_requeue(&q, out, n, &coalesced, &dropped);
  /* block 1's old push loses to the newer one; blocks 0 and 2 go back in front, but only
   * one of them fits (capacity 4): the older, block 0, is dropped */
  assert_int_equal(coalesced, 1);
  assert_int_equal(dropped, 1);
  uint32_t blocks[64];
  uint64_t steps[64];
  take_all(&q, blocks, steps, &n);
  assert_int_equal(n, 4);
  assert_int_equal(blocks[0], 2);
  assert_int_equal(steps[0], 1);
  assert_int_equal(blocks[1], 1);
  assert_int_equal(steps[1], 2);
  assert_int_equal(blocks[2], 7);
  assert_int_equal(blocks[3], 8);
  precond__queue_destroy(&q);
}

static void test_requeue_preserves_order(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 8, 8), 0);
  for (uint32_t b = 0; b < 4; b++) precond__queue_put(&q, make(b, 1, 4));
  precond__item *out[8];
  size_t n = precond__queue_take(&q, out, 3, SIZE_MAX);
  assert_int_equal(n, 3);
  precond__queue_requeue(&q, out, n, NULL, NULL);
  uint32_t blocks[64];
  uint64_t steps[64];
  take_all(&q, blocks, steps, &n);
  assert_int_equal(n, 4);
  for (uint32_t b = 0; b < 4; b++) assert_int_equal(blocks[b], b);
  precond__queue_destroy(&q);
}

static void test_init_rejects_zero_capacity_and_destroy_frees(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 0, 4), -1);
  precond__queue_destroy(&q);
  /* items left in the queue are freed by destroy (ASan/LSan checks the leak) */
  assert_int_equal(precond__queue_init(&q, 4, 4), 0);
  precond__queue_put(&q, make(0, 1, 64));
  precond__queue_put(&q, make(1, 1, 64));
  precond__queue_destroy(&q);
  assert_int_equal(q.length, 0);
}

/* An item marked alone leaves in a batch of its own: a batch stops before it, and one that
 * starts with it holds it alone. */
static void test_alone_items_leave_alone(void **state) {
  (void)state;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 8, 8), 0);
  for (uint32_t b = 0; b < 5; b++) {
    precond__item *it = make(b, 10 + b, 16);
    it->alone = b == 2 || b == 3;
    assert_int_equal(precond__queue_put(&q, it), PRECOND__QUEUED);
  }
  precond__item *out[8];
  size_t want[4] = {2, 1, 1, 1}; /* 0 1 | 2 | 3 | 4 */
  uint32_t next = 0;
  for (int k = 0; k < 4; k++) {
    size_t n = precond__queue_take(&q, out, 8, SIZE_MAX);
    assert_int_equal(n, want[k]);
    for (size_t i = 0; i < n; i++) {
      assert_int_equal(out[i]->block_id, next++);
      precond__item_free(out[i]);
    }
  }
  assert_int_equal(q.length, 0);
  precond__queue_destroy(&q);
}

static int g_released;
static void count_release(precond__item *it) {
  assert_ptr_equal(it->owner, &g_released);
  g_released++;
}

/* A wrapped item's bytes are the caller's: release runs exactly once whichever way the item
 * goes (coalesced by a newer push, dropped as the oldest, taken and freed, destroyed with
 * the queue). */
static void test_wrapped_items_release_once(void **state) {
  (void)state;
  unsigned char bytes[4][32];
  precond__item *w[4];
  for (int i = 0; i < 4; i++) {
    w[i] = precond__item_wrap((uint32_t)i % 3, 1, 0, 1, 32, 0, 0, bytes[i]);
    assert_non_null(w[i]);
    assert_ptr_equal(w[i]->data, bytes[i]);
    w[i]->owner = &g_released;
    w[i]->release = count_release;
  }
  assert_null(precond__item_wrap(0, 1, 0, 1, 32, 0, 0, NULL));
  g_released = 0;
  precond__queue q;
  assert_int_equal(precond__queue_init(&q, 2, 3), 0);
  assert_int_equal(precond__queue_put(&q, w[0]), PRECOND__QUEUED);    /* block 0 */
  assert_int_equal(precond__queue_put(&q, w[3]), PRECOND__COALESCED); /* block 0 again */
  assert_int_equal(g_released, 1);
  assert_int_equal(precond__queue_put(&q, w[1]), PRECOND__QUEUED);         /* block 1 */
  assert_int_equal(precond__queue_put(&q, w[2]), PRECOND__DROPPED_OLDEST); /* w[3] goes */
  assert_int_equal(g_released, 2);
  precond__item *out[2];
  assert_int_equal(precond__queue_take(&q, out, 1, SIZE_MAX), 1);
  precond__item_free(out[0]);
  assert_int_equal(g_released, 3);
  precond__queue_destroy(&q);
  assert_int_equal(g_released, 4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fifo_order),
      cmocka_unit_test(test_coalesce_keeps_position_and_newest),
      cmocka_unit_test(test_full_drops_oldest),
      cmocka_unit_test(test_take_respects_byte_budget),
      cmocka_unit_test(test_requeue_after_failed_send),
      cmocka_unit_test(test_requeue_preserves_order),
      cmocka_unit_test(test_init_rejects_zero_capacity_and_destroy_frees),
      cmocka_unit_test(test_alone_items_leave_alone),
      cmocka_unit_test(test_wrapped_items_release_once),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
