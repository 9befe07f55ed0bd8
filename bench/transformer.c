/*
 * transformer.c -- the Transformer benchmark client: a decoder-only byte-level language model
 * (accel's ac_lm: pre-layer-norm blocks, GELU MLP, learned positional embeddings) trained on
 * the King James Bible (bench/datasets.h: first 90% train, last 10% eval) with SGD, AdamW or
 * Shampoo whose roots come from a running precondd. The loop, options and outputs are the
 * harness's (bench/train.h); this file is the model and the data.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "accel.h"
#include "datasets.h"
#include "train.h"

typedef struct {
  long context, d_model, heads, layers, mlp, batch;
  double dropout;
  int tie_head, init; /* init: index into lm_inits */
  char data[512];
} lm_args;

/* --init: the linears' initialisation, in the order of lm_init_kind. */
static const char *const lm_inits[] = {"uniform", "normal002", NULL};
static const ac_init lm_init_kind[] = {AC_INIT_LAYER, AC_INIT_NORMAL002};

typedef struct {
  ac_backend *be;
  ac_lm lm;
  ac_param_list params;
  const ds_text *text;
  ds_text_sampler train;
  uint64_t eval_seed;
  size_t batch, t;
  size_t lo, local;     /* data parallelism: this worker's rows of each batch */
  uint8_t *in8, *tg8;   /* host, batch x t */
  int32_t *in32, *tg32; /* host */
  int32_t *d_in, *d_tg; /* device */
  int32_t *d_ts;        /* device: K-FAC's model Fisher's drawn targets */
  pt_trainer *kfac;     /* borrowed; set for the model Fisher (lm_set_trainer) */
} lm_ctx;

/* Uploads one batch of windows as int32 token and target ids. */
static int lm_upload(lm_ctx *c) {
  size_t n = c->batch * c->t;
  for (size_t i = 0; i < n; i++) {
    c->in32[i] = c->in8[i];
    c->tg32[i] = c->tg8[i];
  }
  int rc = ac_memcpy_h2d(c->be, c->d_in, c->in32, n * sizeof(int32_t));
  if (rc == AC_OK) rc = ac_memcpy_h2d(c->be, c->d_tg, c->tg32, n * sizeof(int32_t));
  return rc;
}

static int lm_backward(void *ctx) {
  return ac_lm_backward(&((lm_ctx *)ctx)->lm);
}

static int lm_train_step(void *ctx, double *loss) {
  lm_ctx *c = ctx;
  if (ds_text_sampler_next(&c->train, c->batch, c->in8, c->tg8) != DS_OK) return -1;
  int rc = lm_upload(c);
  if (rc == AC_OK) rc = ac_param_list_zero_grad(&c->params);
  /* Every worker draws the same global batch (same seed) and trains on its rows. */
  if (rc == AC_OK)
    rc = ac_lm_forward(&c->lm, c->d_in + c->lo * c->t, c->d_tg + c->lo * c->t, c->local, c->t,
                       AC_MODE_TRAIN, loss);
  if (rc == AC_OK)
    rc = tr_kfac_model_fisher(c->kfac, &c->lm.xent, c->d_ts, &c->params, lm_backward, c);
  if (rc == AC_OK) rc = ac_lm_backward(&c->lm);
  return rc;
}

/* Data parallelism: rank's equal share of the batch's sequences, so that the mean over
 * the workers of their mean losses is the batch's mean. */
static int lm_shard(void *ctx, int rank, int size, const ac_bn_sync *sync) {
  (void)sync; /* no batch norm */
  lm_ctx *c = ctx;
  if (size < 1 || c->batch % (size_t)size != 0) {
    fprintf(stderr,
            "transformer: --batch %zu does not divide among %d data-parallel "
            "workers\n",
            c->batch, size);
    return -1;
  }
  c->local = c->batch / (size_t)size;
  c->lo = (size_t)rank * c->local;
  return 0;
}

/* The same eval windows every time (a sampler re-seeded per evaluation), so evaluations
 * along a run and across optimizers compare like with like. */
static int lm_evaluate(void *ctx, long batches, double *loss, double *accuracy) {
  lm_ctx *c = ctx;
  ds_text_sampler ev;
  if (ds_text_sampler_init(&ev, c->text, DS_SPLIT_EVAL, c->t, c->eval_seed) != DS_OK) return -1;
  long nb = batches > 0 ? batches : 20;
  double sum = 0;
  for (long b = 0; b < nb; b++) {
    double l = 0;
    if (ds_text_sampler_next(&ev, c->batch, c->in8, c->tg8) != DS_OK) return -1;
    int rc = lm_upload(c);
    if (rc == AC_OK) rc = ac_lm_forward(&c->lm, c->d_in, c->d_tg, c->batch, c->t, AC_MODE_EVAL, &l);
    if (rc != AC_OK) return rc;
    sum += l;
  }
  *loss = sum / (double)nb;
  *accuracy = NAN;
  return 0;
}

static void lm_set_hook(void *ctx, const ac_hook *hook) {
  ac_lm_set_hook(&((lm_ctx *)ctx)->lm, hook);
}

static void lm_set_trainer(void *ctx, pt_trainer *t) {
  ((lm_ctx *)ctx)->kfac = t;
}

int main(int argc, char **argv) {
  tr_options opts;
  tr_options_default(&opts);
  opts.model = "transformer";
  opts.steps = 500;
  opts.eval_every = 100;
  ac_lm_config cfg;
  ac_lm_config_default(&cfg);
  lm_args a = {64, 128, 4, 2, 0, 32, 0.0, cfg.tie_head, 0, ""};
  while (lm_init_kind[a.init] != cfg.init) a.init++;
  tr_arg extra[] = {
      {"context", TR_ARG_LONG, &a.context, 2, 4096, "context length in bytes", NULL},
      {"d-model", TR_ARG_LONG, &a.d_model, 4, 8192, "model width", NULL},
      {"heads", TR_ARG_LONG, &a.heads, 1, 256, "attention heads (divide --d-model)", NULL},
      {"layers", TR_ARG_LONG, &a.layers, 1, 256, "Transformer blocks", NULL},
      {"mlp", TR_ARG_LONG, &a.mlp, 0, 65536, "MLP width (0: 4 x d-model)", NULL},
      {"batch", TR_ARG_LONG, &a.batch, 1, 65536, "sequences per step", NULL},
      {"dropout", TR_ARG_DOUBLE, &a.dropout, 0, 0.95, "dropout probability", NULL},
      {"tie-head", TR_ARG_FLAG, &a.tie_head, 0, 0,
       "output head = the embedding matrix (as GPT-2); --no-tie-head: its own", NULL},
      {"init", TR_ARG_CHOICE, &a.init, 0, 0,
       "linear weights: uniform (U(+-1/sqrt(fan-in))) or normal002 (N(0, 0.02^2), as GPT-2)",
       lm_inits},
      {"data", TR_ARG_STRING, a.data, 0, sizeof a.data,
       "KJV text cache (default $PRECOND_DATA_DIR/kjv.txt or data/kjv.txt; made with `bible`)",
       NULL},
  };
  size_t nextra = sizeof extra / sizeof extra[0];
  tr_error err = {{0}};
  int rc =
      tr_parse_args(&opts, extra, nextra, argc, argv, "transformer",
                    "Trains a byte-level decoder-only Transformer on the King James Bible.", &err);
  if (rc == TR_EHELP) return 0;
  if (rc != TR_OK) {
    fprintf(stderr, "transformer: %s\n", err.msg);
    return 2;
  }
  if (a.d_model % a.heads != 0) {
    fprintf(stderr, "transformer: --d-model %ld is not a multiple of --heads %ld\n", a.d_model,
            a.heads);
    return 2;
  }

  int status = 1;
  ds_text text = {0};
  lm_ctx c;
  memset(&c, 0, sizeof c);
  ac_param_list_init(&c.params);
  ac_backend *be = NULL;
  ds_error derr = {{0}};
  int drc = ds_text_load(&text, a.data[0] ? a.data : NULL, 1, &derr);
  if (drc != DS_OK) {
    fprintf(stderr, "transformer: %s (%s)\n", derr.msg, ds_strerror(drc));
    goto done;
  }
  if (tr_backend_create(&opts, &be, &err) != TR_OK) {
    fprintf(stderr, "transformer: %s\n", err.msg);
    goto done;
  }

  cfg.vocab = DS_TEXT_VOCAB;
  cfg.ctx = (size_t)a.context;
  cfg.dim = (size_t)a.d_model;
  cfg.heads = (size_t)a.heads;
  cfg.layers = (size_t)a.layers;
  cfg.mlp = a.mlp > 0 ? (size_t)a.mlp : 4 * (size_t)a.d_model;
  cfg.batch = (size_t)a.batch;
  cfg.dropout = (float)a.dropout;
  cfg.seed = opts.seed;
  cfg.tie_head = a.tie_head;
  cfg.init = lm_init_kind[a.init];
  c.be = be;
  c.text = &text;
  c.batch = (size_t)a.batch;
  c.local = c.batch;
  c.t = (size_t)a.context;
  c.eval_seed = opts.seed ^ 0x5eed5eedULL;
  int arc = ac_lm_init(&c.lm, be, &cfg);
  if (arc == AC_OK) arc = ac_lm_params(&c.lm, &c.params);
  if (arc != AC_OK) {
    fprintf(stderr, "transformer: model: %s\n", ac_strerror(arc));
    goto done;
  }
  if (ds_text_sampler_init(&c.train, &text, DS_SPLIT_TRAIN, c.t, opts.seed) != DS_OK) {
    fprintf(stderr, "transformer: --context %ld is too long for the corpus\n", a.context);
    goto done;
  }
  size_t n = c.batch * c.t;
  c.in8 = malloc(n);
  c.tg8 = malloc(n);
  c.in32 = malloc(n * sizeof(int32_t));
  c.tg32 = malloc(n * sizeof(int32_t));
  if (c.in8 == NULL || c.tg8 == NULL || c.in32 == NULL || c.tg32 == NULL ||
      ac_malloc(be, n * sizeof(int32_t), (void **)&c.d_in) != AC_OK ||
      ac_malloc(be, n * sizeof(int32_t), (void **)&c.d_tg) != AC_OK ||
      ac_malloc(be, n * sizeof(int32_t), (void **)&c.d_ts) != AC_OK) {
    fprintf(stderr, "transformer: out of memory for batch buffers\n");
    goto done;
  }

  size_t train_len = 0;
  ds_text_split(&text, DS_SPLIT_TRAIN, &train_len);
  tr_model model = {"transformer",
                    &c,
                    c.params.n,
                    c.params.items,
                    lm_train_step,
                    lm_evaluate,
                    (double)n,
                    "tok",
                    (long)(train_len / n),
                    lm_shard,
                    lm_set_hook,
                    lm_set_trainer,
                    NULL,
                    NULL};
  tr_print_start(&opts, be, &model);
  tr_summary sm;
  rc = tr_train(&opts, be, &model, &sm, &err);
  if (rc != TR_OK) {
    fprintf(stderr, "transformer: %s\n", err.msg);
    goto done;
  }
  printf(
      "transformer %s: final eval loss %.4f (%.3f bits/byte), %ld steps, median step "
      "%.1f ms",
      sm.optimizer, sm.final_eval_loss, sm.final_eval_loss / log(2.0), sm.steps, sm.median_step_ms);
  tr_print_result_end(&opts, &sm);
  status = 0;
done:
  ac_free(be, c.d_in);
  ac_free(be, c.d_tg);
  ac_free(be, c.d_ts);
  free(c.in8);
  free(c.tg8);
  free(c.in32);
  free(c.tg32);
  ac_param_list_destroy(&c.params);
  if (c.be != NULL) ac_lm_destroy(&c.lm);
  ac_backend_destroy(be);
  ds_text_destroy(&text);
  return status;
}
