/*
 * tiny_trainer.c -- a complete minimal C trainer: a linear classifier on synthetic data,
 * trained with Shampoo through precondd by the trainer library (docs/trainer.md).
 * Usage: tiny_trainer [ADDRESS] (default $PRECOND_ADDR, else libprecond's default).
 * Exits 0 when the loss fell by half, 1 otherwise (the integration suite runs it).
 */
#include <stdio.h>
#include <stdlib.h>

#include "trainer.h"

enum { IN = 32, CLASSES = 4, BATCH = 64, STEPS = 40 };

/* The label is the group of IN / CLASSES features with the largest sum: learnable by a
 * linear model, different on every call (a fixed-seed LCG keeps runs reproducible). */
static void make_batch(unsigned *seed, float *x, int *y) {
  for (int r = 0; r < BATCH; r++) {
    float best = -1e30f, sum[CLASSES] = {0};
    for (int i = 0; i < IN; i++) {
      *seed = *seed * 1664525u + 1013904223u;
      x[r * IN + i] = (float)(*seed >> 8) / (float)(1u << 24) - 0.5f;
      sum[i / (IN / CLASSES)] += x[r * IN + i];
    }
    for (int c = 0; c < CLASSES; c++)
      if (sum[c] > best) best = sum[c], y[r] = c;
  }
}

int main(int argc, char **argv) {
  ac_backend *be = NULL;
  ac_linear fc = {0};
  ac_celoss ce = {0};
  ac_param_list params;
  pt_trainer *tr = NULL;
  pt_error err = {""};
  float *dx = NULL, hx[BATCH * IN];
  int *dy = NULL, hy[BATCH], rc = 1;
  unsigned seed = 1;
  double first = 0, loss = 0;
  ac_param_list_init(&params);
  if (ac_backend_create(&be, NULL) != AC_OK ||
      ac_linear_init(&fc, be, "fc", IN, CLASSES, 1, BATCH, 1) != AC_OK ||
      ac_celoss_init(&ce, be, CLASSES, BATCH) != AC_OK || ac_linear_params(&fc, &params) != AC_OK ||
      ac_malloc(be, sizeof hx, (void **)&dx) != AC_OK ||
      ac_malloc(be, sizeof hy, (void **)&dy) != AC_OK) {
    fprintf(stderr, "tiny_trainer: accel setup failed\n");
    goto done;
  }
  pt_options opts;
  pt_options_default(&opts, PT_MODE_SHAMPOO);
  opts.daemon = argc > 1 ? argv[1] : getenv("PRECOND_ADDR");
  opts.job = "tiny-trainer";
  opts.sync_roots = 1; /* every step uses the roots of its own statistics: reproducible */
  opts.shampoo.momentum = 0;
  if (pt_create(&tr, &opts, params.items, params.n, &err) != PT_OK) {
    fprintf(stderr, "tiny_trainer: %s\n", err.msg);
    goto done;
  }
  for (long step = 1; step <= STEPS; step++) {
    const float *logits, *dlogits;
    make_batch(&seed, hx, hy);
    if (ac_memcpy_h2d(be, dx, hx, sizeof hx) != AC_OK ||
        ac_memcpy_h2d(be, dy, hy, sizeof hy) != AC_OK ||
        ac_param_list_zero_grad(&params) != AC_OK ||
        ac_linear_forward(&fc, dx, BATCH, &logits) != AC_OK ||
        ac_celoss_forward(&ce, logits, (const int32_t *)dy, BATCH, &loss) != AC_OK ||
        ac_celoss_backward(&ce, &dlogits) != AC_OK ||
        ac_linear_backward(&fc, dlogits, NULL) != AC_OK) {
      fprintf(stderr, "tiny_trainer: forward/backward failed at step %ld\n", step);
      goto done;
    }
    pt_step_info info;
    if (pt_step(tr, step, 0.5 /* lr */, &info, &err) != PT_OK) {
      fprintf(stderr, "tiny_trainer: step %ld: %s\n", step, err.msg);
      goto done;
    }
    if (step == 1) first = loss;
    printf("step %2ld  loss %.4f  preconditioned blocks %zu  fallback %zu\n", step, loss,
           info.preconditioned, info.fallback);
  }
  rc = loss < 0.5 * first ? 0 : 1;
  printf("loss %.4f -> %.4f: %s\n", first, loss, rc == 0 ? "trained" : "did not train");
done:
  pt_destroy(tr);
  ac_free(be, dx);
  ac_free(be, dy);
  ac_param_list_destroy(&params);
  ac_celoss_destroy(&ce);
  ac_linear_destroy(&fc);
  ac_backend_destroy(be);
  return rc;
}
