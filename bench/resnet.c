/*
 * resnet.c -- the ResNet benchmark client: a ResNet-20-style network for 28x28x1 images
 * (accel's ac_resnet: three stages of three basic blocks, widths 16/32/64, batch norm, ReLU,
 * global average pooling, linear 10) trained on Fashion-MNIST (bench/datasets.h) with SGD,
 * AdamW or Shampoo whose roots come from a running precondd. The loop, options and outputs
 * are the harness's (bench/train.h); this file is the model and the data.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "accel.h"
#include "datasets.h"
#include "train.h"

typedef struct {
  long batch, width, blocks, chunk;
  int conv_init; /* index into rn_inits */
  char data[512];
} rn_args;

/* --conv-init, in the order of rn_init_kind. */
static const char *const rn_inits[] = {"fan-in", "fan-out", NULL};
static const ac_init rn_init_kind[] = {AC_INIT_LAYER, AC_INIT_HE_FAN_OUT};

typedef struct {
  ac_backend *be;
  ac_resnet net;
  ac_param_list params;
  const ds_images *eval;
  ds_image_sampler train;
  size_t batch;
  size_t lo, local;      /* this worker's share of a batch: images lo .. lo + local - 1 */
  float *x;              /* host, batch images */
  uint8_t *y8;           /* host labels */
  int32_t *y32, *pred;   /* host */
  float *d_x;            /* device */
  int32_t *d_y, *d_pred; /* device */
  int32_t *d_ys;         /* device: K-FAC's model Fisher's drawn labels */
  pt_trainer *kfac;      /* borrowed; set for the model Fisher (rn_set_trainer) */
  const ds_images *trainset;
  long factor; /* ABS: batches per update (rn_set_batch_factor); 1 */
} rn_ctx;

static int rn_upload(rn_ctx *c, size_t n) {
  for (size_t i = 0; i < n; i++) c->y32[i] = c->y8[i];
  int rc = ac_memcpy_h2d(c->be, c->d_x, c->x, n * DS_FMNIST_PIXELS * sizeof(float));
  if (rc == AC_OK) rc = ac_memcpy_h2d(c->be, c->d_y, c->y32, n * sizeof(int32_t));
  return rc;
}

static int rn_backward(void *ctx) {
  return ac_resnet_backward(&((rn_ctx *)ctx)->net);
}

static int rn_train_step(void *ctx, double *loss) {
  rn_ctx *c = ctx;
  int rc = ac_param_list_zero_grad(&c->params);
  double sum = 0;
  /* ABS's larger batches are factor batches whose gradients add up (batch norm normalises
   * each batch on its own, as a data-parallel worker's share without sync BN would). */
  for (long k = 0; k < c->factor && rc == AC_OK; k++) {
    double l = 0;
    if (ds_image_sampler_next(&c->train, c->batch, c->x, c->y8) != DS_OK) return -1;
    rc = rn_upload(c, c->batch);
    /* Every worker draws the same global batch (same seed) and trains on its images. */
    if (rc == AC_OK)
      rc = ac_resnet_forward(&c->net, c->d_x + c->lo * DS_FMNIST_PIXELS, c->d_y + c->lo, c->local,
                             AC_MODE_TRAIN, &l);
    if (rc == AC_OK)
      rc = tr_kfac_model_fisher(c->kfac, &c->net.xent, c->d_ys, &c->params, rn_backward, c);
    if (rc == AC_OK) rc = ac_resnet_backward(&c->net);
    sum += l;
  }
  for (size_t i = 0; i < c->params.n && rc == AC_OK && c->factor > 1; i++) {
    ac_tensor *g = &c->params.items[i]->grad;
    rc = ac_axpby(c->be, g->numel, 1.0f / (float)c->factor, ac_tensor_f32(g), 0.0f, NULL,
                  ac_tensor_f32(g));
  }
  *loss = sum / (double)c->factor;
  return rc;
}

static int rn_set_batch_factor(void *ctx, long k) {
  if (k < 1) return -1;
  ((rn_ctx *)ctx)->factor = k;
  return 0;
}

/* ABS's Hessian-vector products: the loss gradient on the first batch of the training set in
 * file order, batch norm on its running statistics (evaluation mode), so that the two
 * gradients of a central difference see one function. */
static int rn_hv_grad(void *ctx) {
  rn_ctx *c = ctx;
  double l = 0;
  if (ds_images_batch(c->trainset, 0, c->batch, c->x, c->y8) != DS_OK) return -1;
  int rc = rn_upload(c, c->batch);
  if (rc == AC_OK) rc = ac_resnet_forward(&c->net, c->d_x, c->d_y, c->batch, AC_MODE_EVAL, &l);
  if (rc == AC_OK) rc = ac_resnet_backward(&c->net);
  return rc;
}

/* The first batches * batch test images in file order (all 10,000 when batches is 0), with
 * batch norm on its running statistics: mean loss and accuracy. */
static int rn_evaluate(void *ctx, long batches, double *loss, double *accuracy) {
  rn_ctx *c = ctx;
  size_t total = c->eval->count;
  if (batches > 0 && (size_t)batches * c->batch < total) total = (size_t)batches * c->batch;
  double sum = 0;
  size_t correct = 0;
  for (size_t first = 0; first < total; first += c->batch) {
    size_t n = total - first < c->batch ? total - first : c->batch;
    double l = 0;
    if (ds_images_batch(c->eval, first, n, c->x, c->y8) != DS_OK) return -1;
    int rc = rn_upload(c, n);
    if (rc == AC_OK) rc = ac_resnet_forward(&c->net, c->d_x, c->d_y, n, AC_MODE_EVAL, &l);
    if (rc == AC_OK) rc = ac_argmax_rows(c->be, n, DS_FMNIST_CLASSES, c->net.logits, c->d_pred);
    if (rc == AC_OK) rc = ac_memcpy_d2h(c->be, c->pred, c->d_pred, n * sizeof(int32_t));
    if (rc != AC_OK) return rc;
    sum += l * (double)n;
    for (size_t i = 0; i < n; i++) correct += c->pred[i] == c->y32[i];
  }
  *loss = sum / (double)total;
  *accuracy = (double)correct / (double)total;
  return 0;
}

/* Data parallelism: rank's equal share of the batch's images, so that the mean over the
 * workers of their mean losses is the batch's mean, and batch norm across the workers
 * (sync), so that it normalises over the global batch as one worker does. */
static int rn_shard(void *ctx, int rank, int size, const ac_bn_sync *sync) {
  rn_ctx *c = ctx;
  if (size < 1 || c->batch % (size_t)size != 0) {
    fprintf(stderr, "resnet: --batch %zu does not divide among %d data-parallel workers\n",
            c->batch, size);
    return -1;
  }
  c->local = c->batch / (size_t)size;
  c->lo = (size_t)rank * c->local;
  ac_resnet_set_sync(&c->net, sync);
  return 0;
}

static void rn_set_hook(void *ctx, const ac_hook *hook) {
  ac_resnet_set_hook(&((rn_ctx *)ctx)->net, hook);
}

static void rn_set_trainer(void *ctx, pt_trainer *t) {
  ((rn_ctx *)ctx)->kfac = t;
}

int main(int argc, char **argv) {
  tr_options opts;
  tr_options_default(&opts);
  opts.model = "resnet";
  opts.steps = 300;
  opts.eval_every = 100;
  opts.eval_batches = 10;
  ac_resnet_config cfg;
  ac_resnet_config_default(&cfg);
  rn_args a = {128, 16, 3, 8, 0, ""};
  while (rn_init_kind[a.conv_init] != cfg.conv_init) a.conv_init++;
  tr_arg extra[] = {
      {"batch", TR_ARG_LONG, &a.batch, 1, 60000, "images per step", NULL},
      {"width", TR_ARG_LONG, &a.width, 1, 1024, "channels of the first stage (x2, x4 after)", NULL},
      {"blocks", TR_ARG_LONG, &a.blocks, 1, 64, "basic blocks per stage", NULL},
      {"chunk", TR_ARG_LONG, &a.chunk, 1, 60000, "images per im2col chunk (memory vs speed)", NULL},
      {"conv-init", TR_ARG_CHOICE, &a.conv_init, 0, 0,
       "conv weights N(0, 2/fan) per He et al.: fan-in (in_c k k) or fan-out (out_c k k)",
       rn_inits},
      {"data", TR_ARG_STRING, a.data, 0, sizeof a.data,
       "Fashion-MNIST directory (default " DS_FMNIST_DIR ")", NULL},
  };
  size_t nextra = sizeof extra / sizeof extra[0];
  tr_error err = {{0}};
  int rc = tr_parse_args(&opts, extra, nextra, argc, argv, "resnet",
                         "Trains a ResNet-20-style network on Fashion-MNIST. --eval-batches 0 "
                         "evaluates on all 10,000 test images.",
                         &err);
  if (rc == TR_EHELP) return 0;
  if (rc != TR_OK) {
    fprintf(stderr, "resnet: %s\n", err.msg);
    return 2;
  }

  int status = 1;
  ds_images train = {0}, test = {0};
  rn_ctx c;
  memset(&c, 0, sizeof c);
  ac_param_list_init(&c.params);
  ac_backend *be = NULL;
  ds_error derr = {{0}};
  const char *dir = a.data[0] ? a.data : NULL;
  int drc = ds_fmnist_load(&train, dir, DS_SPLIT_TRAIN, &derr);
  if (drc == DS_OK) drc = ds_fmnist_load(&test, dir, DS_SPLIT_EVAL, &derr);
  if (drc != DS_OK) {
    fprintf(stderr, "resnet: %s (%s)\n", derr.msg, ds_strerror(drc));
    goto done;
  }
  if ((size_t)a.batch > train.count) {
    fprintf(stderr, "resnet: --batch %ld is larger than the training set\n", a.batch);
    goto done;
  }
  if (tr_backend_create(&opts, &be, &err) != TR_OK) {
    fprintf(stderr, "resnet: %s\n", err.msg);
    goto done;
  }

  cfg.in_c = 1;
  cfg.h = cfg.w = DS_FMNIST_SIDE;
  cfg.classes = DS_FMNIST_CLASSES;
  cfg.stages = 3;
  cfg.blocks = (size_t)a.blocks;
  cfg.width[0] = (size_t)a.width;
  cfg.width[1] = 2 * (size_t)a.width;
  cfg.width[2] = 4 * (size_t)a.width;
  cfg.batch = (size_t)a.batch;
  cfg.chunk = (size_t)a.chunk < (size_t)a.batch ? (size_t)a.chunk : (size_t)a.batch;
  cfg.seed = opts.seed;
  cfg.conv_init = rn_init_kind[a.conv_init];
  c.be = be;
  c.eval = &test;
  c.trainset = &train;
  c.factor = 1;
  c.batch = c.local = (size_t)a.batch;
  int arc = ac_resnet_init(&c.net, be, &cfg);
  if (arc == AC_OK) arc = ac_resnet_params(&c.net, &c.params);
  if (arc != AC_OK) {
    fprintf(stderr, "resnet: model: %s\n", ac_strerror(arc));
    goto done;
  }
  if (ds_image_sampler_init(&c.train, &train, opts.seed) != DS_OK) {
    fprintf(stderr, "resnet: out of memory for the sampler\n");
    goto done;
  }
  size_t b = c.batch;
  c.x = malloc(b * DS_FMNIST_PIXELS * sizeof(float));
  c.y8 = malloc(b);
  c.y32 = malloc(b * sizeof(int32_t));
  c.pred = malloc(b * sizeof(int32_t));
  if (c.x == NULL || c.y8 == NULL || c.y32 == NULL || c.pred == NULL ||
      ac_malloc(be, b * DS_FMNIST_PIXELS * sizeof(float), (void **)&c.d_x) != AC_OK ||
      ac_malloc(be, b * sizeof(int32_t), (void **)&c.d_y) != AC_OK ||
      ac_malloc(be, b * sizeof(int32_t), (void **)&c.d_ys) != AC_OK ||
      ac_malloc(be, b * sizeof(int32_t), (void **)&c.d_pred) != AC_OK) {
    fprintf(stderr, "resnet: out of memory for batch buffers\n");
    goto done;
  }

  tr_model model = {"resnet",
                    &c,
                    c.params.n,
                    c.params.items,
                    rn_train_step,
                    rn_evaluate,
                    (double)b,
                    "img",
                    (long)(train.count / b),
                    rn_shard,
                    rn_set_hook,
                    rn_set_trainer,
                    rn_set_batch_factor,
                    rn_hv_grad};
  tr_print_start(&opts, be, &model);
  tr_summary sm;
  rc = tr_train(&opts, be, &model, &sm, &err);
  if (rc != TR_OK) {
    fprintf(stderr, "resnet: %s\n", err.msg);
    goto done;
  }
  printf("resnet %s: final test accuracy %.4f, eval loss %.4f, %ld steps, median step %.1f ms",
         sm.optimizer, sm.final_eval_accuracy, sm.final_eval_loss, sm.steps, sm.median_step_ms);
  tr_print_result_end(&opts, &sm);
  status = 0;
done:
  ac_free(be, c.d_x);
  ac_free(be, c.d_y);
  ac_free(be, c.d_ys);
  ac_free(be, c.d_pred);
  free(c.x);
  free(c.y8);
  free(c.y32);
  free(c.pred);
  ac_param_list_destroy(&c.params);
  ds_image_sampler_destroy(&c.train);
  if (c.be != NULL) ac_resnet_destroy(&c.net);
  ac_backend_destroy(be);
  ds_images_destroy(&train);
  ds_images_destroy(&test);
  return status;
}
