/*
 * bench-accel.c -- speed of accel's layers and models on one backend.
 *
 * Prints, in one run (so that ratios compare numbers measured side by side):
 *   - the sgemm peak: the best GFLOP/s of square sgemms (512, 1024, 1536);
 *   - the Transformer block (batch 32, context 64, 4 heads, MLP 4 d) at d_model 128..512:
 *     forward and backward time of each layer, and the block's matrix-product GFLOP/s;
 *   - a ResNet basic block (batch 128; 16 -> 16 at 28x28, and 16 -> 32 stride 2): per layer
 *     and the block's convolution GFLOP/s;
 *   - the full training step (forward + backward) of the default Transformer LM and of the
 *     default ResNet-20 at batch 128.
 * Times are the median and the best of --reps repetitions after one warm-up, with ac_sync
 * before each clock reading; GFLOP/s (and the peak) use the median. --csv prints CSV
 * (section,config,item,pass,ms,min_ms,gflop,gflops,peak_gflops,ratio_to_peak); otherwise
 * a table.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "accel.h"

#define MAX_REPS 50

static int csv;
static int reps = 5;
/* --quick: one small case of each section, one repetition, so that a test can run the
 * benchmark in a second and it cannot rot. Figures from it mean nothing. */
static int quick;
static double peak_gflops;
static ac_backend *be;

/* CLOCK_MONOTONIC (wall) by default; --clock cpu: the process's CPU time, which on a
 * shared machine leaves out the time other processes held the cores (meaningful for the CPU
 * backend; with N threads it counts all of them). Every repetition reads both clocks, so
 * that the model lines can give the other clock's median of the SAME steps (a wall and a
 * CPU figure from two separate runs can come from two different distributions). */
static clockid_t clock_id = CLOCK_MONOTONIC;

static double clock_s(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

static void check(int rc, const char *what) {
  if (rc != AC_OK) {
    fprintf(stderr, "bench-accel: %s: %s\n", what, ac_strerror(rc));
    exit(1);
  }
}

/* Milliseconds of expr over reps runs after one warm-up: the median into out, the best
 * into last_min_ms; the median and best by the other clock (CPU time when --clock is wall,
 * and the reverse) of the same runs into last_other_ms / last_other_min_ms. GFLOP/s
 * figures, the peak's included, use the median: on a shared machine one lucky short run
 * would otherwise set the peak. */
static double last_min_ms, last_other_ms, last_other_min_ms;
#define TIME_MS(out, expr)                                                                       \
  do {                                                                                           \
    double ts_[MAX_REPS], to_[MAX_REPS];                                                         \
    clockid_t other_ = clock_id == CLOCK_MONOTONIC ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC; \
    for (int r_ = -1; r_ < reps; r_++) {                                                         \
      double t0_ = clock_s(clock_id), o0_ = clock_s(other_);                                     \
      check((expr), #expr);                                                                      \
      check(ac_sync(be), "sync");                                                                \
      double t1_ = clock_s(clock_id), o1_ = clock_s(other_);                                     \
      if (r_ >= 0) ts_[r_] = 1e3 * (t1_ - t0_), to_[r_] = 1e3 * (o1_ - o0_);                     \
    }                                                                                            \
    (out) = median(ts_, reps);                                                                   \
    last_min_ms = ts_[0];                                                                        \
    last_other_ms = median(to_, reps);                                                           \
    last_other_min_ms = to_[0];                                                                  \
  } while (0)

/* One figure: median ms and best ms of the last TIME_MS (ms is its median, or a sum of
 * medians with min_ms the sum of bests), GFLOP/s from the median. */
static void emit2(const char *section, const char *config, const char *item, const char *pass,
                  double ms, double min_ms, double flop) {
  double gf = flop > 0 ? flop / (ms * 1e-3) * 1e-9 : 0.0;
  if (csv) {
    printf("%s,%s,%s,%s,%.4f,%.4f,%.4f,%.2f,%.2f,%.3f\n", section, config, item, pass, ms, min_ms,
           flop * 1e-9, gf, peak_gflops, peak_gflops > 0 && gf > 0 ? gf / peak_gflops : 0.0);
  } else if (gf > 0) {
    printf("  %-8s %-20s %-15s %-7s %9.3f ms %9.3f ms %8.2f GFLOP/s (%5.1f%% of peak)\n", section,
           config, item, pass, ms, min_ms, gf, 100.0 * gf / peak_gflops);
  } else {
    printf("  %-8s %-20s %-15s %-7s %9.3f ms %9.3f ms\n", section, config, item, pass, ms, min_ms);
  }
  fflush(stdout);
}

static void emit(const char *section, const char *config, const char *item, const char *pass,
                 double ms, double flop) {
  emit2(section, config, item, pass, ms, last_min_ms, flop);
}

static float *dev_random(size_t n, uint64_t seed) {
  void *p = NULL;
  check(ac_malloc(be, n * sizeof(float), &p), "malloc");
  check(ac_rand_uniform(be, seed, 0, n, -1.0f, 1.0f, p), "rand");
  return p;
}

static int32_t *dev_tokens(size_t n, size_t vocab, uint64_t seed) {
  int32_t *h = malloc(n * sizeof *h);
  void *d = NULL;
  if (h == NULL) exit(1);
  for (size_t i = 0; i < n; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    h[i] = (int32_t)((seed >> 33) % vocab);
  }
  check(ac_malloc(be, n * sizeof *h, &d), "malloc");
  check(ac_memcpy_h2d(be, d, h, n * sizeof *h), "h2d");
  free(h);
  return d;
}

/* ------------------------------------------------------------------------------------ */

static void bench_sgemm_peak(void) {
  static const size_t sizes[] = {512, 1024, 1536};
  for (size_t i = 0; i < (quick ? 1 : sizeof sizes / sizeof sizes[0]); i++) {
    size_t n = sizes[i];
    float *a = dev_random(n * n, 1), *b = dev_random(n * n, 2), *c = dev_random(n * n, 3);
    double ms;
    TIME_MS(ms, ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n));
    double flop = 2.0 * (double)n * (double)n * (double)n;
    double gf = flop / (ms * 1e-3) * 1e-9;
    if (gf > peak_gflops) peak_gflops = gf;
    char cfg[32];
    snprintf(cfg, sizeof cfg, "n=%zu", n);
    emit("sgemm", cfg, "sgemm", "fwd", ms, flop);
    ac_free(be, a);
    ac_free(be, b);
    ac_free(be, c);
  }
  if (!csv) printf("  sgemm peak: %.2f GFLOP/s\n", peak_gflops);
}

/* The attention core's matrix products as ac_attention issues them (one strided-batched
 * gemm per head over the sequences): forward Q K^T and P V, or the four of backward. */
static int attn_gemms(ac_attention *a, int backward) {
  size_t b = a->batch, t = a->t, d = a->dim, h = a->heads, dh = d / h, tt = t * t;
  size_t ld = 3 * d, seq = t * 3 * d;
  const float *qkv = a->qkv.y;
  int rc = AC_OK;
  for (size_t i = 0; i < h && rc == AC_OK; i++) {
    const float *q = qkv + i * dh, *k = qkv + d + i * dh, *v = qkv + 2 * d + i * dh;
    float *p = a->probs + i * tt, *dp = a->dprobs + i * tt, *c = a->ctx + i * dh;
    float *dq = a->dqkv + i * dh;
    if (!backward) {
      rc = ac_sgemm_batched(be, AC_NO_TRANS, AC_TRANS, t, t, dh, 1.0f, q, ld, seq, k, ld, seq, 0.0f,
                            dp, t, h * tt, b);
      if (rc == AC_OK)
        rc = ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, p, t, h * tt, v, ld,
                              seq, 0.0f, c, d, t * d, b);
    } else {
      /* the same four shapes as the backward pass (outputs into scratch) */
      rc = ac_sgemm_batched(be, AC_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, p, t, h * tt, c, d, t * d,
                            0.0f, dq, ld, seq, b);
      if (rc == AC_OK)
        rc = ac_sgemm_batched(be, AC_NO_TRANS, AC_TRANS, t, t, dh, 1.0f, c, d, t * d, v, ld, seq,
                              0.0f, dp, t, h * tt, b);
      if (rc == AC_OK)
        rc = ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, p, t, h * tt, k, ld,
                              seq, 0.0f, dq, ld, seq, b);
      if (rc == AC_OK)
        rc = ac_sgemm_batched(be, AC_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, p, t, h * tt, q, ld, seq,
                              0.0f, a->dqkv + d + i * dh, ld, seq, b);
    }
  }
  return rc;
}

/* The Transformer block at width d: each layer forward and backward, then the block. */
static void bench_tblock(size_t d) {
  const size_t batch = quick ? 2 : 32, t = 64, heads = 4, mlp = 4 * d, rows = batch * t;
  char cfg[64];
  snprintf(cfg, sizeof cfg, "d=%zu,B=%zu,T=%zu", d, batch, t);
  ac_tblock blk;
  check(ac_tblock_init(&blk, be, "blk", d, heads, mlp, t, batch, 0.0f, 1), "tblock init");
  float *x = dev_random(rows * d, 5), *dyd = dev_random(rows * d, 6);
  float *dym = dev_random(rows * mlp, 7), *dyq = dev_random(rows * 3 * d, 8);
  const float *y, *g;
  check(ac_tblock_forward(&blk, x, batch, t, AC_MODE_TRAIN, &y), "forward");
  check(ac_tblock_backward(&blk, dyd, &g), "backward");

  double dr = (double)rows, dd = (double)d, dm = (double)mlp;
  double f_qkv = 2 * dr * dd * 3 * dd, f_proj = 2 * dr * dd * dd, f_fc = 2 * dr * dd * dm;
  double f_att = 2.0 * 2.0 * (double)(batch * heads) * (double)(t * t) * (dd / (double)heads);
  double ms, lin_ms = 0.0, lin_min = 0.0;
  /* Each layer on the inputs the block's forward gave it. */
  TIME_MS(ms, ac_layernorm_forward(&blk.ln1, x, rows, &y));
  emit("tblock", cfg, "layernorm", "fwd", ms, 0);
  TIME_MS(ms, ac_layernorm_backward(&blk.ln1, dyd, &g));
  emit("tblock", cfg, "layernorm", "bwd", ms, 0);
  TIME_MS(ms, ac_linear_forward(&blk.attn.qkv, blk.ln1.y, rows, &y));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "attn.qkv", "fwd", ms, f_qkv);
  TIME_MS(ms, ac_linear_backward(&blk.attn.qkv, dyq, &g));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "attn.qkv", "bwd", ms, 2 * f_qkv);
  TIME_MS(ms, ac_attention_forward(&blk.attn, blk.ln1.y, batch, t, &y));
  emit("tblock", cfg, "attention(all)", "fwd", ms, f_qkv + f_proj + f_att);
  TIME_MS(ms, ac_attention_backward(&blk.attn, dyd, &g));
  emit("tblock", cfg, "attention(all)", "bwd", ms, 2 * (f_qkv + f_proj + f_att));
  TIME_MS(ms, ac_linear_forward(&blk.attn.proj, blk.attn.ctx, rows, &y));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "attn.proj", "fwd", ms, f_proj);
  TIME_MS(ms, ac_linear_backward(&blk.attn.proj, dyd, &g));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "attn.proj", "bwd", ms, 2 * f_proj);
  TIME_MS(ms, ac_linear_forward(&blk.fc1, blk.ln2.y, rows, &y));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "mlp.fc1", "fwd", ms, f_fc);
  TIME_MS(ms, ac_linear_backward(&blk.fc1, dym, &g));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "mlp.fc1", "bwd", ms, 2 * f_fc);
  TIME_MS(ms, ac_activation_forward(&blk.gelu, blk.fc1.y, rows * mlp, &y));
  emit("tblock", cfg, "gelu", "fwd", ms, 0);
  TIME_MS(ms, ac_activation_backward(&blk.gelu, dym, &g));
  emit("tblock", cfg, "gelu", "bwd", ms, 0);
  TIME_MS(ms, ac_linear_forward(&blk.fc2, blk.gelu.y, rows, &y));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "mlp.fc2", "fwd", ms, f_fc);
  TIME_MS(ms, ac_linear_backward(&blk.fc2, dyd, &g));
  lin_ms += ms;
  lin_min += last_min_ms;
  emit("tblock", cfg, "mlp.fc2", "bwd", ms, 2 * f_fc);
  TIME_MS(ms, ac_residual_forward(&blk.add1, x, blk.ln1.y, rows * d, &y));
  emit("tblock", cfg, "residual", "fwd", ms, 0);

  TIME_MS(ms, attn_gemms(&blk.attn, 0));
  emit("tblock", cfg, "attn.matmuls", "fwd", ms, f_att);
  double att_ms = ms, att_min = last_min_ms;
  TIME_MS(ms, attn_gemms(&blk.attn, 1));
  emit("tblock", cfg, "attn.matmuls", "bwd", ms, 2 * f_att);
  att_ms += ms;
  att_min += last_min_ms;
  double f_lin = 3 * (f_qkv + f_proj + 2 * f_fc), f_all = f_lin + 3 * f_att;
  emit2("tblock", cfg, "linear layers", "fwd+bwd", lin_ms, lin_min, f_lin);
  emit2("tblock", cfg, "all matmuls", "fwd+bwd", lin_ms + att_ms, lin_min + att_min, f_all);
  double fwd, step;
  TIME_MS(fwd, ac_tblock_forward(&blk, x, batch, t, AC_MODE_TRAIN, &y));
  emit("tblock", cfg, "block", "fwd", fwd, f_all / 3);
  TIME_MS(step, ac_tblock_forward(&blk, x, batch, t, AC_MODE_TRAIN, &y) ||
                    ac_tblock_backward(&blk, dyd, &g));
  emit("tblock", cfg, "block", "fwd+bwd", step, f_all);
  ac_free(be, x);
  ac_free(be, dyd);
  ac_free(be, dym);
  ac_free(be, dyq);
  ac_tblock_destroy(&blk);
}

static int conv_lowering(ac_conv2d *c, const float *x, int col2im) {
  size_t chw = c->g.c * c->g.h * c->g.w;
  int rc = AC_OK;
  for (size_t b0 = 0; b0 < c->batch && rc == AC_OK; b0 += c->chunk) {
    ac_conv2d_geom g = c->g;
    g.n = c->batch - b0 < c->chunk ? c->batch - b0 : c->chunk;
    rc = col2im ? ac_col2im_batch(be, &g, c->ws, c->dx + b0 * chw)
                : ac_im2col_batch(be, &g, x + b0 * chw, c->ws);
  }
  return rc;
}

/* A ResNet basic block at batch 128. */
static void bench_basicblock(size_t in_c, size_t out_c, size_t hw, size_t stride, size_t chunk) {
  const size_t batch = quick ? 4 : 128;
  char cfg[64];
  snprintf(cfg, sizeof cfg, "%zu->%zu,%zux%zu,s%zu,N%zu", in_c, out_c, hw, hw, stride, batch);
  size_t wsn = ac_basicblock_workspace_floats(in_c, out_c, hw, hw, stride, chunk);
  float *ws = dev_random(wsn, 9);
  ac_basicblock blk;
  check(ac_basicblock_init(&blk, be, "blk", in_c, out_c, hw, hw, stride, batch, chunk, ws, 1),
        "basicblock init");
  size_t ohw = blk.oh * blk.ow, nout = batch * out_c * ohw;
  float *x = dev_random(batch * in_c * hw * hw, 10), *dy = dev_random(nout, 11);
  const float *y, *g;
  check(ac_basicblock_forward(&blk, x, batch, AC_MODE_TRAIN, &y), "forward");
  check(ac_basicblock_backward(&blk, dy, &g), "backward");
  double f1 = 2.0 * (double)(batch * out_c * ohw) * (double)(in_c * 9);
  double f2 = 2.0 * (double)(batch * out_c * ohw) * (double)(out_c * 9);
  double fs = blk.has_short ? 2.0 * (double)(batch * out_c * ohw) * (double)in_c : 0.0;
  double ms;
  TIME_MS(ms, ac_conv2d_forward(&blk.conv1, x, batch, &y));
  emit("resblock", cfg, "conv1", "fwd", ms, f1);
  TIME_MS(ms, ac_conv2d_backward(&blk.conv1, dy, &g));
  emit("resblock", cfg, "conv1", "bwd", ms, 2 * f1);
  TIME_MS(ms, ac_batchnorm_forward(&blk.bn1, blk.conv1.y, batch, AC_MODE_TRAIN, &y));
  emit("resblock", cfg, "batchnorm+relu", "fwd", ms, 0);
  TIME_MS(ms, ac_batchnorm_backward(&blk.bn1, dy, &g));
  emit("resblock", cfg, "batchnorm+relu", "bwd", ms, 0);
  TIME_MS(ms, ac_conv2d_forward(&blk.conv2, blk.bn1.y, batch, &y));
  emit("resblock", cfg, "conv2", "fwd", ms, f2);
  TIME_MS(ms, ac_conv2d_backward(&blk.conv2, dy, &g));
  emit("resblock", cfg, "conv2", "bwd", ms, 2 * f2);
  /* conv1's lowering on its own: im2col (forward and backward) and col2im (backward) of
   * the whole batch, chunk by chunk through the workspace, as ac_conv2d issues them. */
  TIME_MS(ms, conv_lowering(&blk.conv1, x, 0));
  emit("resblock", cfg, "conv1.im2col", "fwd", ms, 0);
  TIME_MS(ms, conv_lowering(&blk.conv1, x, 1));
  emit("resblock", cfg, "conv1.col2im", "bwd", ms, 0);
  double step;
  TIME_MS(step, ac_basicblock_forward(&blk, x, batch, AC_MODE_TRAIN, &y) ||
                    ac_basicblock_backward(&blk, dy, &g));
  emit("resblock", cfg, "block", "fwd+bwd", step, 3 * (f1 + f2 + fs));
  ac_free(be, x);
  ac_free(be, dy);
  ac_basicblock_destroy(&blk);
  ac_free(be, ws);
}

static int lm_step(ac_lm *m, ac_param_list *pl, const int32_t *tok, const int32_t *tgt) {
  double loss;
  int rc = ac_param_list_zero_grad(pl);
  if (rc == AC_OK) rc = ac_lm_forward(m, tok, tgt, m->cfg.batch, m->cfg.ctx, AC_MODE_TRAIN, &loss);
  return rc == AC_OK ? ac_lm_backward(m) : rc;
}

static int resnet_step(ac_resnet *m, ac_param_list *pl, const float *img, const int32_t *lab) {
  double loss;
  int rc = ac_param_list_zero_grad(pl);
  if (rc == AC_OK) rc = ac_resnet_forward(m, img, lab, m->cfg.batch, AC_MODE_TRAIN, &loss);
  return rc == AC_OK ? ac_resnet_backward(m) : rc;
}

/* The pass name of a model's second line: the same steps by the other clock. */
static const char *other_pass(void) {
  return clock_id == CLOCK_MONOTONIC ? "step.cpu" : "step.wall";
}

/* The two model steps; which: "models" (both), "lm" or "resnet" (one of them). */
static void bench_models(size_t chunk, const char *which) {
  ac_lm_config lc;
  ac_lm lm;
  ac_param_list pl;
  double ms;
  char cfg[96];
  if (strcmp(which, "resnet") == 0) goto resnet;
  ac_lm_config_default(&lc);
  if (quick) lc.batch = 2;
  check(ac_lm_init(&lm, be, &lc), "lm init");
  ac_param_list_init(&pl);
  check(ac_lm_params(&lm, &pl), "lm params");
  int32_t *tok = dev_tokens(lc.batch * lc.ctx, lc.vocab, 1);
  int32_t *tgt = dev_tokens(lc.batch * lc.ctx, lc.vocab, 2);
  snprintf(cfg, sizeof cfg, "d=%zu,L=%zu,T=%zu,B=%zu", lc.dim, lc.layers, lc.ctx, lc.batch);
  TIME_MS(ms, lm_step(&lm, &pl, tok, tgt));
  emit("model", cfg, "transformer-lm", "step", ms, 0);
  emit2("model", cfg, "transformer-lm", other_pass(), last_other_ms, last_other_min_ms, 0);
  ac_param_list_destroy(&pl);
  ac_free(be, tok);
  ac_free(be, tgt);
  ac_lm_destroy(&lm);
  if (strcmp(which, "lm") == 0) return;

resnet:;
  ac_resnet_config rc;
  ac_resnet net;
  ac_resnet_config_default(&rc);
  if (quick) rc.batch = 4;
  rc.chunk = chunk;
  check(ac_resnet_init(&net, be, &rc), "resnet init");
  ac_param_list_init(&pl);
  check(ac_resnet_params(&net, &pl), "resnet params");
  float *img = dev_random(rc.batch * rc.in_c * rc.h * rc.w, 3);
  int32_t *lab = dev_tokens(rc.batch, rc.classes, 4);
  snprintf(cfg, sizeof cfg, "resnet20,28x28x1,N=%zu,chunk=%zu", rc.batch, net.cfg.chunk);
  TIME_MS(ms, resnet_step(&net, &pl, img, lab));
  emit("model", cfg, "resnet", "step", ms, 0);
  emit2("model", cfg, "resnet", other_pass(), last_other_ms, last_other_min_ms, 0);
  ac_param_list_destroy(&pl);
  ac_free(be, img);
  ac_free(be, lab);
  ac_resnet_destroy(&net);
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: bench-accel [--csv] [--backend cpu|cuda] [--threads N] [--reps N]\n"
          "                   [--chunk N] [--only peak|tblock|resblock|models|lm|resnet]\n"
          "                   [--clock wall|cpu] [--isa best|portable|avx2|avx512]\n"
          "                   [--quick] [--help]\n"
          "  --csv       CSV output (section,config,item,pass,ms,min_ms,gflop,gflops,\n"
          "              peak_gflops,ratio_to_peak); a table otherwise\n"
          "  --backend   cpu (default) or cuda\n"
          "  --threads   OpenBLAS threads on the CPU backend (default 1)\n"
          "  --reps      timed repetitions per figure, median reported (default 5, max %d)\n"
          "  --chunk     images per im2col pass in the conv layers (default 8; 0: batch)\n"
          "  --only      run one section (the sgemm peak always runs); lm, resnet: one model\n"
          "  --clock     wall (default) or cpu: process CPU time, for a CPU backend on a\n"
          "              shared machine (counts every thread); the model steps are\n"
          "              also given by the other clock (pass step.cpu / step.wall)\n"
          "  --isa       cap on the CPU backend's direct conv kernels (default best; portable:\n"
          "              im2col + gemm), to compare the variants\n"
          "  --quick     tiny batches, one repetition: a smoke test, not a measurement\n",
          MAX_REPS);
}

int main(int argc, char **argv) {
  ac_backend_opts opts;
  const char *only = NULL;
  size_t chunk = 8;
  ac_backend_opts_default(&opts);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--quick") == 0) {
      quick = 1;
      reps = 1;
    } else if (strcmp(a, "--csv") == 0) {
      csv = 1;
    } else if (strcmp(a, "--backend") == 0 && v != NULL) {
      if (strcmp(v, "cpu") == 0)
        opts.kind = AC_BACKEND_CPU;
      else if (strcmp(v, "cuda") == 0)
        opts.kind = AC_BACKEND_CUDA;
      else {
        fprintf(stderr, "bench-accel: unknown backend '%s'\n", v);
        return 2;
      }
      i++;
    } else if (strcmp(a, "--threads") == 0 && v != NULL) {
      opts.threads = atoi(v);
      if (opts.threads < 1 || opts.threads > 256) {
        fprintf(stderr, "bench-accel: --threads must be 1..256\n");
        return 2;
      }
      i++;
    } else if (strcmp(a, "--reps") == 0 && v != NULL) {
      reps = atoi(v);
      if (reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "bench-accel: --reps must be 1..%d\n", MAX_REPS);
        return 2;
      }
      i++;
    } else if (strcmp(a, "--chunk") == 0 && v != NULL) {
      chunk = (size_t)strtoul(v, NULL, 10);
      i++;
    } else if (strcmp(a, "--clock") == 0 && v != NULL) {
      if (strcmp(v, "wall") == 0)
        clock_id = CLOCK_MONOTONIC;
      else if (strcmp(v, "cpu") == 0)
        clock_id = CLOCK_PROCESS_CPUTIME_ID;
      else {
        fprintf(stderr, "bench-accel: --clock must be wall or cpu\n");
        return 2;
      }
      i++;
    } else if (strcmp(a, "--isa") == 0 && v != NULL) {
      static const char *const names[] = {"best", "portable", "avx2", "avx512"};
      opts.cpu_isa = -1;
      for (int k = 0; k < 4; k++)
        if (strcmp(v, names[k]) == 0) opts.cpu_isa = k; /* the ac_cpu_isa values, in order */
      if (opts.cpu_isa < 0) {
        fprintf(stderr, "bench-accel: --isa must be best, portable, avx2 or avx512\n");
        return 2;
      }
      i++;
    } else if (strcmp(a, "--only") == 0 && v != NULL) {
      if (strcmp(v, "peak") != 0 && strcmp(v, "tblock") != 0 && strcmp(v, "resblock") != 0 &&
          strcmp(v, "models") != 0 && strcmp(v, "lm") != 0 && strcmp(v, "resnet") != 0) {
        fprintf(stderr,
                "bench-accel: --only must be peak, tblock, resblock, models, lm or resnet\n");
        return 2;
      }
      only = v;
      i++;
    } else {
      fprintf(stderr, "bench-accel: unknown or incomplete option '%s'\n", a);
      usage(stderr);
      return 2;
    }
  }
  int rc = ac_backend_create(&be, &opts);
  if (rc != AC_OK) {
    fprintf(stderr, "bench-accel: cannot create the backend: %s (%s)\n", ac_strerror(rc),
            ac_backend_describe(NULL));
    return 1;
  }
  if (csv)
    printf("section,config,item,pass,ms,min_ms,gflop,gflops,peak_gflops,ratio_to_peak\n");
  else
    printf(
        "bench-accel on %s, %d reps, %s clock: median ms, best ms, GFLOP/s of the "
        "median\n",
        ac_backend_describe(be), reps, clock_id == CLOCK_MONOTONIC ? "wall" : "process CPU");
  bench_sgemm_peak();
  if (only == NULL || strcmp(only, "tblock") == 0)
    for (size_t d = 128; d <= (quick ? 128 : 512); d += 128) bench_tblock(d);
  if (only == NULL || strcmp(only, "resblock") == 0) {
    bench_basicblock(16, 16, 28, 1, chunk);
    bench_basicblock(16, 32, 28, 2, chunk);
  }
  if (only == NULL || strcmp(only, "models") == 0 || strcmp(only, "lm") == 0 ||
      strcmp(only, "resnet") == 0)
    bench_models(chunk, only == NULL ? "models" : only);
  ac_backend_destroy(be);
  return 0;
}
