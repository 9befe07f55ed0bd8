/*
 * train.c -- the training harness of the benchmark clients: options, loop, progress line,
 * CSV/JSON output, SGD/AdamW, and Shampoo's worker half wired to precondd via libprecond.
 *
 * The Shampoo step follows Anil et al. (2020) as the architecture splits it: the worker
 * computes each block's Gram matrices G G^T and G^T G on the device and queues them
 * (libprecond sends them in the background); precondd accumulates them and computes the
 * inverse roots; the worker applies the newest roots it holds, P = L^(-1/p) G R^(-1/p),
 * rescaled block by block to the norm of the grafted Adam step. A block whose roots have not
 * arrived yet (or are staler than the bound) takes the Adam step itself: the fallback.
 */
#include "train.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "precond.h"

const char *tr_strerror(int status) {
  switch (status) {
    case TR_OK: return "success";
    case TR_EINVAL: return "invalid argument";
    case TR_EIO: return "file could not be written";
    case TR_ENOMEM: return "out of memory";
    case TR_EACCEL: return "accelerator call failed";
    case TR_EDAEMON: return "precondd unreachable or refused the call";
    case TR_EMODEL: return "model step failed";
    case TR_ENONFINITE: return "training loss is not finite";
    case TR_EHELP: return "help requested";
  }
  return "unknown status";
}

/* Writes a formatted message into err (if any) and returns status. */
static int tr__fail(tr_error *err, int status, const char *fmt, ...) {
  if (err == NULL) return status;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  return status;
}

static double tr__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *tr_optimizer_name(tr_optimizer_kind kind) {
  switch (kind) {
    case TR_SGD: return "sgd";
    case TR_ADAMW: return "adamw";
    case TR_SHAMPOO: return "shampoo";
  }
  return "?";
}

/* ==================================================================================== */
/* Options                                                                                */

void tr_options_default(tr_options *o) {
  memset(o, 0, sizeof *o);
  o->optimizer = TR_ADAMW;
  o->steps = 200;
  o->epochs = 0;
  o->lr = -1;
  o->momentum = 0.9;
  o->beta1 = 0.9;
  o->beta2 = 0.999;
  o->eps = 1e-8;
  o->weight_decay = 0;
  o->clip = 0;
  o->warmup = 0;
  o->block_size = 128;
  o->stat_beta2 = 0.95;
  o->root_exponent = 4;
  o->shampoo_eps = 1e-6;
  o->stat_every = 1;
  o->max_staleness = 0;
  o->sync_roots = 0;
  const char *addr = getenv("PRECOND_ADDR");
  snprintf(o->daemon, sizeof o->daemon, "%s",
           addr != NULL && addr[0] != '\0' ? addr : "127.0.0.1:50551");
  o->seed = 1;
  o->backend = AC_BACKEND_CPU;
  o->threads = 1;
  o->eval_every = 0;
  o->eval_batches = 0;
  o->quiet = 0;
}

double tr_effective_lr(const tr_options *o) {
  if (o->lr >= 0) return o->lr;
  switch (o->optimizer) {
    case TR_SGD: return 0.1;
    case TR_ADAMW: return 1e-3;
    case TR_SHAMPOO: return 1e-3;
  }
  return 1e-3;
}

/* Internal option kinds: the public tr_arg types plus the harness's own. */
enum { K_LONG = TR_ARG_LONG, K_DOUBLE = TR_ARG_DOUBLE, K_STRING = TR_ARG_STRING,
       K_FLAG = 100, K_OPTIMIZER, K_BACKEND, K_U64, K_INT };

typedef struct {
  const char *name;
  int kind;
  void *dest;
  double min, max;   /* range; for K_STRING max is the buffer size */
  const char *help;
} tr__spec;

#define TR__NCOMMON 29

/* The harness's options, pointing into o. */
static size_t tr__common_specs(tr_options *o, tr__spec *s) {
  size_t n = 0;
#define SPEC(nm, k, d, lo, hi, h) s[n++] = (tr__spec){nm, k, d, lo, hi, h}
  SPEC("optimizer", K_OPTIMIZER, &o->optimizer, 0, 0, "sgd, adamw or shampoo");
  SPEC("steps", K_LONG, &o->steps, 1, 1e9, "training steps");
  SPEC("epochs", K_DOUBLE, &o->epochs, 1e-6, 1e4, "train for this many epochs instead of --steps");
  SPEC("lr", K_DOUBLE, &o->lr, 0, 1e3, "learning rate (default: sgd 0.1, adamw and shampoo 1e-3)");
  SPEC("momentum", K_DOUBLE, &o->momentum, 0, 0.999999, "SGD momentum");
  SPEC("beta1", K_DOUBLE, &o->beta1, 0, 0.999999, "AdamW (and Shampoo's grafted Adam) beta1");
  SPEC("beta2", K_DOUBLE, &o->beta2, 0, 0.999999, "AdamW (and Shampoo's grafted Adam) beta2");
  SPEC("eps", K_DOUBLE, &o->eps, 1e-30, 1, "AdamW epsilon");
  SPEC("weight-decay", K_DOUBLE, &o->weight_decay, 0, 10,
       "decoupled weight decay (AdamW, Shampoo); L2 for SGD");
  SPEC("clip", K_DOUBLE, &o->clip, 0, 1e9, "clip the global gradient norm to this (0: off)");
  SPEC("warmup", K_DOUBLE, &o->warmup, 0, 1e9, "linear learning-rate warm-up steps");
  SPEC("block-size", K_LONG, &o->block_size, 1, 8192, "Shampoo block size");
  SPEC("stat-beta2", K_DOUBLE, &o->stat_beta2, 1e-6, 1, "Shampoo statistics EMA (1: sum)");
  SPEC("root-exponent", K_LONG, &o->root_exponent, 1, 64, "Shampoo root order p in L^(-1/p)");
  SPEC("shampoo-eps", K_DOUBLE, &o->shampoo_eps, 0, 1, "Shampoo relative ridge");
  SPEC("stat-every", K_LONG, &o->stat_every, 1, 1e9, "push Shampoo statistics every N steps");
  SPEC("max-staleness", K_LONG, &o->max_staleness, 0, 1e9,
       "roots staler than N steps are not used (0: no bound)");
  SPEC("sync-roots", K_FLAG, &o->sync_roots, 0, 0,
       "wait for each step's roots (slow, reproducible)");
  SPEC("daemon", K_STRING, o->daemon, 0, sizeof o->daemon,
       "precondd address, host:port or unix:/path (or $PRECOND_ADDR)");
  SPEC("job", K_STRING, o->job, 0, sizeof o->job, "job name on the daemon (default: unique)");
  SPEC("seed", K_U64, &o->seed, 0, 0, "random seed (weights and batches)");
  SPEC("backend", K_BACKEND, &o->backend, 0, 0, "cpu or cuda");
  SPEC("threads", K_INT, &o->threads, 1, 256, "OpenBLAS threads of the cpu backend");
  SPEC("out", K_STRING, o->out, 0, sizeof o->out, "write train.csv and summary.json here");
  SPEC("eval-every", K_LONG, &o->eval_every, 0, 1e9, "evaluate every N steps (0: at the end)");
  SPEC("eval-batches", K_LONG, &o->eval_batches, 0, 1e9,
       "batches per evaluation (0: model default)");
  SPEC("quiet", K_FLAG, &o->quiet, 0, 0, "no progress line");
  SPEC("help", K_FLAG, NULL, 0, 0, "this text");
#undef SPEC
  return n;
}

static void tr__print_value(FILE *f, const tr__spec *s) {
  switch (s->kind) {
    case K_LONG: fprintf(f, "%ld", *(const long *)s->dest); break;
    case K_INT: fprintf(f, "%d", *(const int *)s->dest); break;
    case K_DOUBLE: fprintf(f, "%g", *(const double *)s->dest); break;
    case K_U64: fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)s->dest); break;
    case K_STRING: fprintf(f, "%s", (const char *)s->dest); break;
    case K_OPTIMIZER:
      fprintf(f, "%s", tr_optimizer_name(*(const tr_optimizer_kind *)s->dest));
      break;
    case K_BACKEND:
      fprintf(f, "%s", *(const ac_backend_kind *)s->dest == AC_BACKEND_CUDA ? "cuda" : "cpu");
      break;
    default: break;
  }
}

static void tr__usage_line(FILE *f, const tr__spec *s) {
  char left[64];
  const char *meta = s->kind == K_FLAG ? "" : s->kind == K_STRING ? " S"
                     : s->kind == K_DOUBLE ? " X" : s->kind == K_OPTIMIZER ? " NAME"
                     : s->kind == K_BACKEND ? " NAME" : " N";
  snprintf(left, sizeof left, "  --%s%s", s->name, meta);
  fprintf(f, "%-26s %s", left, s->help);
  int show = s->dest != NULL && s->kind != K_FLAG &&
             !(s->kind == K_STRING && ((const char *)s->dest)[0] == '\0');
  if (show) {
    fprintf(f, " [");
    tr__print_value(f, s);
    fprintf(f, "]");
  }
  fprintf(f, "\n");
}

void tr_usage(FILE *f, const tr_options *defaults, const tr_arg *extra, size_t nextra,
              const char *prog, const char *summary) {
  tr_options d = *defaults;
  tr__spec specs[TR__NCOMMON];
  size_t n = tr__common_specs(&d, specs);
  fprintf(f, "Usage: %s [OPTION]...\n%s\n\n", prog, summary != NULL ? summary : "");
  if (nextra > 0) fprintf(f, "Model and data:\n");
  for (size_t i = 0; i < nextra; i++) {
    tr__spec s = {extra[i].name, (int)extra[i].type, extra[i].dest, extra[i].min, extra[i].max,
                  extra[i].help};
    tr__usage_line(f, &s);
  }
  fprintf(f, "Training:\n");
  for (size_t i = 0; i < n; i++) tr__usage_line(f, &specs[i]);
  fprintf(f,
          "\nOutputs: a progress line on stderr; with --out, OUT/train.csv (one row per step:\n"
          "%s)\nand OUT/summary.json. Shampoo needs a running precondd (--daemon).\n",
          TR_CSV_HEADER);
}

/* Parses one value into s->dest. Returns 0 or -1 with err set. */
static int tr__set(const tr__spec *s, const char *v, tr_error *err) {
  char *end = NULL;
  errno = 0;
  switch (s->kind) {
    case K_LONG:
    case K_INT: {
      long x = strtol(v, &end, 10);
      if (errno || end == v || *end != '\0' || (double)x < s->min || (double)x > s->max) {
        tr__fail(err, TR_EINVAL, "--%s: '%s' is not an integer in [%.0f, %.0f]", s->name, v,
                 s->min, s->max);
        return -1;
      }
      if (s->kind == K_LONG) *(long *)s->dest = x;
      else *(int *)s->dest = (int)x;
      return 0;
    }
    case K_U64: {
      if (v[0] == '-') break;
      unsigned long long x = strtoull(v, &end, 10);
      if (errno || end == v || *end != '\0') break;
      *(uint64_t *)s->dest = (uint64_t)x;
      return 0;
    }
    case K_DOUBLE: {
      double x = strtod(v, &end);
      if (errno || end == v || *end != '\0' || !isfinite(x) || x < s->min || x > s->max) {
        tr__fail(err, TR_EINVAL, "--%s: '%s' is not a number in [%g, %g]", s->name, v, s->min,
                 s->max);
        return -1;
      }
      *(double *)s->dest = x;
      return 0;
    }
    case K_STRING: {
      size_t len = strlen(v);
      if (len + 1 > (size_t)s->max) {
        tr__fail(err, TR_EINVAL, "--%s: value longer than %.0f bytes", s->name, s->max - 1);
        return -1;
      }
      memcpy(s->dest, v, len + 1);
      return 0;
    }
    case K_OPTIMIZER: {
      for (int k = TR_SGD; k <= TR_SHAMPOO; k++) {
        if (strcmp(v, tr_optimizer_name((tr_optimizer_kind)k)) == 0) {
          *(tr_optimizer_kind *)s->dest = (tr_optimizer_kind)k;
          return 0;
        }
      }
      tr__fail(err, TR_EINVAL, "--optimizer: '%s' is not one of sgd, adamw, shampoo", v);
      return -1;
    }
    case K_BACKEND: {
      if (strcmp(v, "cpu") == 0) *(ac_backend_kind *)s->dest = AC_BACKEND_CPU;
      else if (strcmp(v, "cuda") == 0) *(ac_backend_kind *)s->dest = AC_BACKEND_CUDA;
      else {
        tr__fail(err, TR_EINVAL, "--backend: '%s' is not one of cpu, cuda", v);
        return -1;
      }
      return 0;
    }
    default: break;
  }
  tr__fail(err, TR_EINVAL, "--%s: '%s' is not a valid value", s->name, v);
  return -1;
}

int tr_parse_args(tr_options *opts, const tr_arg *extra, size_t nextra, int argc, char **argv,
                  const char *prog, const char *summary, tr_error *err) {
  if (opts == NULL || (extra == NULL && nextra > 0) || argc < 0 || (argv == NULL && argc > 0))
    return tr__fail(err, TR_EINVAL, "tr_parse_args: bad arguments");
  tr_options defaults = *opts;
  tr__spec specs[TR__NCOMMON];
  size_t n = tr__common_specs(opts, specs);
  int saw_steps = 0, saw_epochs = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strncmp(a, "--", 2) != 0 || a[2] == '\0')
      return tr__fail(err, TR_EINVAL, "unexpected argument '%s' (options start with --)", a);
    const char *name = a + 2;
    const char *eq = strchr(name, '=');
    size_t nlen = eq != NULL ? (size_t)(eq - name) : strlen(name);
    tr__spec found = {0};
    int have = 0;
    for (size_t k = 0; k < nextra && !have; k++) {
      if (strlen(extra[k].name) == nlen && strncmp(extra[k].name, name, nlen) == 0) {
        found = (tr__spec){extra[k].name, (int)extra[k].type, extra[k].dest, extra[k].min,
                           extra[k].max, extra[k].help};
        have = 1;
      }
    }
    for (size_t k = 0; k < n && !have; k++) {
      if (strlen(specs[k].name) == nlen && strncmp(specs[k].name, name, nlen) == 0) {
        found = specs[k];
        have = 1;
      }
    }
    if (!have) return tr__fail(err, TR_EINVAL, "unknown option '--%.*s' (see --help)",
                               (int)nlen, name);
    if (found.kind == K_FLAG) {
      if (eq != NULL) return tr__fail(err, TR_EINVAL, "--%s takes no value", found.name);
      if (found.dest == NULL) {
        tr_usage(stdout, &defaults, extra, nextra, prog, summary);
        return TR_EHELP;
      }
      *(int *)found.dest = 1;
      continue;
    }
    const char *v;
    if (eq != NULL) {
      v = eq + 1;
    } else {
      if (i + 1 >= argc) return tr__fail(err, TR_EINVAL, "--%s needs a value", found.name);
      v = argv[++i];
    }
    if (tr__set(&found, v, err) != 0) return TR_EINVAL;
    if (found.dest == &opts->steps) saw_steps = 1;
    if (found.dest == &opts->epochs) saw_epochs = 1;
  }
  if (saw_steps && saw_epochs)
    return tr__fail(err, TR_EINVAL, "give --steps or --epochs, not both");
  if (saw_epochs) opts->steps = 0;
  if (opts->steps == 0 && !(opts->epochs > 0))
    return tr__fail(err, TR_EINVAL, "no training length: give --steps or --epochs");
  if (opts->optimizer == TR_SHAMPOO && opts->daemon[0] == '\0')
    return tr__fail(err, TR_EINVAL, "--optimizer shampoo needs --daemon ADDRESS");
  return TR_OK;
}

/* ==================================================================================== */
/* Progress, ETA, statistics                                                              */

double tr_eta(double elapsed_s, long done, long total) {
  if (done >= total) return 0;
  if (done <= 0 || !(elapsed_s >= 0)) return -1;
  return elapsed_s / (double)done * (double)(total - done);
}

void tr_format_duration(char *buf, size_t len, double s) {
  if (len == 0) return;
  if (!(s >= 0) || !isfinite(s)) {
    snprintf(buf, len, "?");
    return;
  }
  long t = (long)(s + 0.5);
  if (t < 60) snprintf(buf, len, "%lds", t);
  else if (t < 3600) snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
  else snprintf(buf, len, "%ldh%02ldm", t / 3600, (t % 3600) / 60);
}

void tr_format_progress(char *buf, size_t len, long step, long total, double loss,
                        double items_per_s, const char *unit, double elapsed_s, double eta_s) {
  char el[32], eta[32], rate[32];
  tr_format_duration(el, sizeof el, elapsed_s);
  tr_format_duration(eta, sizeof eta, eta_s);
  if (!(items_per_s >= 0) || !isfinite(items_per_s)) snprintf(rate, sizeof rate, "?");
  else if (items_per_s >= 1e6) snprintf(rate, sizeof rate, "%.1fM", items_per_s / 1e6);
  else if (items_per_s >= 1e4) snprintf(rate, sizeof rate, "%.1fk", items_per_s / 1e3);
  else snprintf(rate, sizeof rate, "%.1f", items_per_s);
  snprintf(buf, len, "step %ld/%ld  loss %.4f  %s %s/s  elapsed %s  eta %s", step, total, loss,
           rate, unit != NULL ? unit : "items", el, eta);
}

static int tr__cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int tr_median(const double *vals, size_t n, double *out) {
  *out = NAN;
  if (n == 0) return TR_OK;
  double *c = malloc(n * sizeof *c);
  if (c == NULL) return TR_ENOMEM;
  memcpy(c, vals, n * sizeof *c);
  qsort(c, n, sizeof *c, tr__cmp_double);
  *out = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
  free(c);
  return TR_OK;
}

/* ==================================================================================== */
/* CSV and JSON                                                                           */

int tr_csv_header(FILE *f) {
  return fprintf(f, "%s\n", TR_CSV_HEADER) < 0 ? TR_EIO : TR_OK;
}

/* A CSV field: empty for NaN, else %.*g. */
static void tr__csv_num(FILE *f, double v, int digits) {
  if (isfinite(v)) fprintf(f, "%.*g", digits, v);
  else if (!isnan(v)) fprintf(f, "%s", v > 0 ? "inf" : "-inf");
}

int tr_csv_row(FILE *f, const tr_row *r) {
  fprintf(f, "%ld,", r->step);
  tr__csv_num(f, r->wall_s, 6);
  fputc(',', f);
  tr__csv_num(f, r->step_ms, 5);
  fputc(',', f);
  tr__csv_num(f, r->train_loss, 7);
  fputc(',', f);
  tr__csv_num(f, r->eval_loss, 7);
  fputc(',', f);
  tr__csv_num(f, r->eval_accuracy, 6);
  fputc(',', f);
  tr__csv_num(f, r->lr, 6);
  fputc(',', f);
  tr__csv_num(f, r->staleness, 4);
  return fprintf(f, ",%d\n", r->fallback ? 1 : 0) < 0 ? TR_EIO : TR_OK;
}

void tr_json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)(s != NULL ? s : ""); *p; p++) {
    switch (*p) {
      case '"': fputs("\\\"", f); break;
      case '\\': fputs("\\\\", f); break;
      case '\n': fputs("\\n", f); break;
      case '\r': fputs("\\r", f); break;
      case '\t': fputs("\\t", f); break;
      default:
        if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
  }
  fputc('"', f);
}

static void tr__json_num(FILE *f, const char *key, double v, int last) {
  fprintf(f, "  \"%s\": ", key);
  if (isfinite(v)) fprintf(f, "%.9g", v);
  else fputs("null", f);
  fputs(last ? "\n" : ",\n", f);
}

static void tr__json_int(FILE *f, const char *key, long long v) {
  fprintf(f, "  \"%s\": %lld,\n", key, v);
}

static void tr__json_str(FILE *f, const char *key, const char *v) {
  fprintf(f, "  \"%s\": ", key);
  tr_json_string(f, v);
  fputs(",\n", f);
}

int tr_json_summary(FILE *f, const tr_summary *s) {
  fputs("{\n", f);
  tr__json_str(f, "model", s->model);
  tr__json_str(f, "optimizer", s->optimizer);
  tr__json_str(f, "backend", s->backend);
  tr__json_str(f, "status", s->status != NULL ? s->status : "ok");
  tr__json_int(f, "seed", (long long)s->seed);
  tr__json_num(f, "lr", s->lr, 0);
  tr__json_int(f, "steps", s->steps);
  tr__json_int(f, "params", s->params);
  tr__json_num(f, "final_train_loss", s->final_train_loss, 0);
  tr__json_num(f, "final_eval_loss", s->final_eval_loss, 0);
  tr__json_num(f, "final_eval_accuracy", s->final_eval_accuracy, 0);
  tr__json_num(f, "best_eval_loss", s->best_eval_loss, 0);
  tr__json_num(f, "wall_s", s->wall_s, 0);
  tr__json_num(f, "total_s", s->total_s, 0);
  tr__json_num(f, "median_step_ms", s->median_step_ms, 0);
  tr__json_num(f, "mean_step_ms", s->mean_step_ms, 0);
  tr__json_num(f, "items_per_s", s->items_per_s, 0);
  tr__json_str(f, "item_unit", s->item_unit);
  tr__json_num(f, "staleness_mean", s->staleness_mean, 0);
  tr__json_num(f, "staleness_median", s->staleness_median, 0);
  tr__json_int(f, "staleness_max", s->staleness_max);
  tr__json_int(f, "fallback_steps", s->fallback_steps);
  tr__json_int(f, "blocks", s->blocks);
  tr__json_int(f, "stats_pushed", (long long)s->stats_pushed);
  tr__json_int(f, "stats_dropped", (long long)s->stats_dropped);
  tr__json_int(f, "stats_coalesced", (long long)s->stats_coalesced);
  fprintf(f, "  \"roots_received\": %llu\n}\n", (unsigned long long)s->roots_received);
  return ferror(f) ? TR_EIO : TR_OK;
}

int tr_mkdirs(const char *path) {
  char buf[1024];
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof buf) return TR_EIO;
  memcpy(buf, path, len + 1);
  for (size_t i = 1; i <= len; i++) {
    if (buf[i] == '/' || buf[i] == '\0') {
      char c = buf[i];
      buf[i] = '\0';
      if (mkdir(buf, 0777) != 0 && errno != EEXIST) return TR_EIO;
      buf[i] = c;
    }
  }
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode) ? TR_OK : TR_EIO;
}

/* ==================================================================================== */
/* Shampoo's worker half and its link to precondd                                         */

typedef struct {
  uint32_t id;           /* daemon block id */
  size_t param;          /* index into the optimizer's params */
  size_t row0, rows, col0, cols;
  size_t ld;             /* columns of the parameter's 2-D view */
  uint64_t version;      /* of the roots held; 0: none */
  uint64_t source_step;
  uint32_t n_left, n_right; /* sides of the roots held (0: that side is the identity) */
  float *lroot, *rroot;  /* device, dense rows x rows and cols x cols */
} tr__block;

struct tr_shampoo {
  precond_client *client;
  precond_layout layout;
  size_t nblocks;
  tr__block *blocks;
  float *stat_l, *stat_r;   /* device, packed statistics of one block */
  float *host_l, *host_r;   /* host copies for precond_push */
  float *root_packed;       /* device, one packed root on its way to dense */
  float *dir, *pre;         /* device, the grafted step and the preconditioned step */
  float *tmp1, *tmp2;       /* device, one block each */
  uint64_t roots_received;
};

static int tr__accel(tr_error *err, int rc, const char *what) {
  if (rc == AC_OK) return TR_OK;
  return tr__fail(err, TR_EACCEL, "%s: %s", what, ac_strerror(rc));
}

static void tr__shampoo_free(ac_backend *be, tr_shampoo *s) {
  if (s == NULL) return;
  if (s->blocks != NULL) {
    for (size_t b = 0; b < s->nblocks; b++) {
      ac_free(be, s->blocks[b].lroot);
      ac_free(be, s->blocks[b].rroot);
    }
  }
  free(s->blocks);
  ac_free(be, s->stat_l);
  ac_free(be, s->stat_r);
  ac_free(be, s->root_packed);
  ac_free(be, s->dir);
  ac_free(be, s->pre);
  ac_free(be, s->tmp1);
  ac_free(be, s->tmp2);
  free(s->host_l);
  free(s->host_r);
  precond_layout_destroy(&s->layout);
  precond_close(s->client);
  free(s);
}

/* The 2-D view's column count of a parameter, as pc_layout sees it (rank 1: 1). */
static size_t tr__view_cols(const ac_param *p) {
  size_t c = 1;
  for (int d = 1; d < p->value.ndim; d++) c *= p->value.shape[d];
  return c;
}

static int tr__cmp_block(const void *a, const void *b) {
  const tr__block *x = a, *y = b;
  if (x->param != y->param) return x->param < y->param ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

static int tr__shampoo_init(tr_optimizer *o, const char *model_name, tr_error *err) {
  const tr_options *opts = &o->opts;
  ac_backend *be = o->be;
  int rc = TR_OK;
  precond_tensor *tensors = NULL;
  uint64_t *shapes = NULL;
  tr_shampoo *s = calloc(1, sizeof *s);
  if (s == NULL) return TR_ENOMEM;

  precond_options po;
  precond_options_default(&po);
  po.addr = opts->daemon;
  po.connect_timeout_ms = 5000;
  int prc = precond_connect(&po, &s->client);
  if (prc != PRECOND_OK) {
    rc = tr__fail(err, TR_EDAEMON, "cannot reach precondd at %s: %s (start one with "
                  "build/host/precondd --listen %s)", opts->daemon, precond_strerror(prc),
                  opts->daemon);
    goto fail;
  }

  tensors = calloc(o->nparams, sizeof *tensors);
  shapes = calloc(o->nparams * AC_MAX_DIMS, sizeof *shapes);
  if (tensors == NULL || shapes == NULL) {
    rc = TR_ENOMEM;
    goto fail;
  }
  for (size_t i = 0; i < o->nparams; i++) {
    const ac_tensor *v = &o->params[i]->value;
    int rank = v->ndim < 1 ? 1 : v->ndim;
    for (int d = 0; d < rank; d++) shapes[i * AC_MAX_DIMS + (size_t)d] = v->shape[d];
    tensors[i] = (precond_tensor){o->params[i]->name, rank, &shapes[i * AC_MAX_DIMS]};
  }
  char job[160];
  if (opts->job[0] != '\0') snprintf(job, sizeof job, "%s", opts->job);
  else snprintf(job, sizeof job, "%s-shampoo-%ld", model_name, (long)getpid());
  precond_shampoo_opts so = {0};
  so.block_size = (uint32_t)opts->block_size;
  so.beta2 = (float)opts->stat_beta2;
  so.root_exponent = (uint32_t)opts->root_exponent;
  so.epsilon = opts->shampoo_eps;
  so.method = PRECOND_METHOD_NEWTON;
  prc = precond_register(s->client, job, PRECOND_MODE_SHAMPOO, model_name, o->nparams, tensors,
                         &so, &s->layout);
  if (prc != PRECOND_OK) {
    char msg[256];
    precond_last_error(s->client, msg, sizeof msg);
    rc = tr__fail(err, TR_EDAEMON, "precondd at %s refused to register job %s: %s%s%s",
                  opts->daemon, job, precond_strerror(prc), msg[0] ? ": " : "", msg);
    goto fail;
  }

  s->nblocks = s->layout.nblocks;
  s->blocks = calloc(s->nblocks > 0 ? s->nblocks : 1, sizeof *s->blocks);
  if (s->blocks == NULL) {
    rc = TR_ENOMEM;
    goto fail;
  }
  size_t max_side = 1, max_block = 1, max_numel = 1;
  for (size_t i = 0; i < o->nparams; i++)
    if (o->params[i]->value.numel > max_numel) max_numel = o->params[i]->value.numel;
  for (size_t b = 0; b < s->nblocks; b++) {
    const precond_block *pb = &s->layout.blocks[b];
    tr__block *blk = &s->blocks[b];
    if (pb->tensor >= o->nparams) {
      rc = tr__fail(err, TR_EDAEMON, "precondd's layout names tensor %u of %zu", pb->tensor,
                    o->nparams);
      goto fail;
    }
    const ac_param *p = o->params[pb->tensor];
    size_t ld = tr__view_cols(p), vrows = p->value.numel / (ld ? ld : 1);
    if (pb->rows == 0 || pb->cols == 0 || pb->row0 + pb->rows > vrows ||
        pb->col0 + pb->cols > ld) {
      rc = tr__fail(err, TR_EDAEMON, "precondd's block %u does not fit tensor %s", pb->block_id,
                    p->name);
      goto fail;
    }
    *blk = (tr__block){.id = pb->block_id, .param = pb->tensor, .row0 = pb->row0,
                       .rows = pb->rows, .col0 = pb->col0, .cols = pb->cols, .ld = ld};
    if (blk->rows > max_side) max_side = blk->rows;
    if (blk->cols > max_side) max_side = blk->cols;
    if (blk->rows * blk->cols > max_block) max_block = blk->rows * blk->cols;
    rc = tr__accel(err, ac_malloc(be, blk->rows * blk->rows * sizeof(float),
                                  (void **)&blk->lroot), "ac_malloc");
    if (rc == TR_OK)
      rc = tr__accel(err, ac_malloc(be, blk->cols * blk->cols * sizeof(float),
                                    (void **)&blk->rroot), "ac_malloc");
    if (rc != TR_OK) goto fail;
  }
  /* The step walks the parameters in order and each one's blocks after it. */
  qsort(s->blocks, s->nblocks, sizeof *s->blocks, tr__cmp_block);
  size_t plen = ac_packed_len(max_side);
  s->host_l = malloc(plen * sizeof(float));
  s->host_r = malloc(plen * sizeof(float));
  if (s->host_l == NULL || s->host_r == NULL) {
    rc = TR_ENOMEM;
    goto fail;
  }
  void **bufs[] = {(void **)&s->stat_l, (void **)&s->stat_r, (void **)&s->root_packed,
                   (void **)&s->dir, (void **)&s->pre, (void **)&s->tmp1, (void **)&s->tmp2};
  size_t sizes[] = {plen, plen, plen, max_numel, max_numel, max_block, max_block};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    rc = tr__accel(err, ac_malloc(be, sizes[k] * sizeof(float), bufs[k]), "ac_malloc");
    if (rc != TR_OK) goto fail;
  }
  free(tensors);
  free(shapes);
  o->shampoo = s;
  return TR_OK;
fail:
  free(tensors);
  free(shapes);
  tr__shampoo_free(be, s);
  return rc;
}

/* Queues the Gram matrices of every block of this step's gradients. */
static int tr__shampoo_push(tr_optimizer *o, long step, tr_error *err) {
  tr_shampoo *s = o->shampoo;
  for (size_t b = 0; b < s->nblocks; b++) {
    const tr__block *k = &s->blocks[b];
    const float *g = ac_tensor_f32(&o->params[k->param]->grad) + k->row0 * k->ld + k->col0;
    int rc = ac_syrk_packed(o->be, AC_NO_TRANS, k->rows, k->cols, 1.0f, g, k->ld, 0.0f,
                            s->stat_l);
    if (rc == AC_OK)
      rc = ac_syrk_packed(o->be, AC_TRANS, k->cols, k->rows, 1.0f, g, k->ld, 0.0f, s->stat_r);
    if (rc == AC_OK)
      rc = ac_memcpy_d2h(o->be, s->host_l, s->stat_l, ac_packed_len(k->rows) * sizeof(float));
    if (rc == AC_OK)
      rc = ac_memcpy_d2h(o->be, s->host_r, s->stat_r, ac_packed_len(k->cols) * sizeof(float));
    if (rc != AC_OK) return tr__accel(err, rc, "Shampoo statistics");
    int prc = precond_push(s->client, (uint64_t)step, k->id, (uint32_t)k->rows, s->host_l,
                           (uint32_t)k->cols, s->host_r, PRECOND_FP32);
    if (prc != PRECOND_OK)
      return tr__fail(err, TR_EDAEMON, "precond_push block %u: %s", k->id,
                      precond_strerror(prc));
  }
  return TR_OK;
}

/* Takes a newer version of block k's roots if libprecond holds one (device upload). */
static int tr__shampoo_refresh(tr_optimizer *o, tr__block *k, tr_error *err) {
  tr_shampoo *s = o->shampoo;
  const precond_roots *r = NULL;
  int prc = precond_fetch(s->client, k->id, k->version, &r);
  if (prc != PRECOND_OK)
    return tr__fail(err, TR_EDAEMON, "precond_fetch block %u: %s", k->id, precond_strerror(prc));
  if (r == NULL) return TR_OK;
  int rc = AC_OK;
  /* A side whose size does not match the block is ignored (identity), never applied. */
  uint32_t nl = r->n_left == k->rows && r->left != NULL ? r->n_left : 0;
  uint32_t nr = r->n_right == k->cols && r->right != NULL ? r->n_right : 0;
  if (nl > 0) {
    rc = ac_memcpy_h2d(o->be, s->root_packed, r->left, ac_packed_len(nl) * sizeof(float));
    if (rc == AC_OK) rc = ac_unpack_sym(o->be, nl, s->root_packed, k->lroot, nl);
  }
  if (rc == AC_OK && nr > 0) {
    rc = ac_memcpy_h2d(o->be, s->root_packed, r->right, ac_packed_len(nr) * sizeof(float));
    if (rc == AC_OK) rc = ac_unpack_sym(o->be, nr, s->root_packed, k->rroot, nr);
  }
  if (rc == AC_OK) {
    k->version = r->version;
    k->source_step = r->source_step;
    k->n_left = nl;
    k->n_right = nr;
    s->roots_received++;
  }
  precond_roots_release(r);
  return tr__accel(err, rc, "Shampoo roots upload");
}

/* --sync-roots: waits until block k holds roots computed from the statistics of step. */
static int tr__shampoo_wait(tr_optimizer *o, tr__block *k, long step, tr_error *err) {
  double deadline = tr__now() + 60.0;
  for (;;) {
    int rc = tr__shampoo_refresh(o, k, err);
    if (rc != TR_OK) return rc;
    if (k->version > 0 && k->source_step >= (uint64_t)step) return TR_OK;
    int left_ms = (int)((deadline - tr__now()) * 1000.0);
    if (left_ms <= 0 || precond_wait_roots(o->shampoo->client, k->id, k->version, left_ms) ==
                            PRECOND_ETIMEDOUT)
      return tr__fail(err, TR_EDAEMON, "--sync-roots: no roots of step %ld for block %u "
                      "within 60 s", step, k->id);
  }
}

/* P_k = L^(-1/p) G_k R^(-1/p) into tmp2 (rows x cols, contiguous). */
static int tr__shampoo_direction(tr_optimizer *o, const tr__block *k, const float *g) {
  tr_shampoo *s = o->shampoo;
  int rc = AC_OK;
  const float *src = g;
  size_t lds = k->ld;
  if (k->n_right > 0) {
    rc = ac_sgemm(o->be, AC_NO_TRANS, AC_NO_TRANS, k->rows, k->cols, k->cols, 1.0f, src, lds,
                  k->rroot, k->cols, 0.0f, s->tmp1, k->cols);
    src = s->tmp1;
    lds = k->cols;
  }
  if (rc != AC_OK) return rc;
  if (k->n_left > 0)
    return ac_sgemm(o->be, AC_NO_TRANS, AC_NO_TRANS, k->rows, k->cols, k->rows, 1.0f, k->lroot,
                    k->rows, src, lds, 0.0f, s->tmp2, k->cols);
  return ac_copy2d(o->be, k->rows, k->cols, src, lds, s->tmp2, k->cols);
}

static int tr__shampoo_step(tr_optimizer *o, long step, double lr, tr_step_info *info,
                            tr_error *err) {
  tr_shampoo *s = o->shampoo;
  const tr_options *opts = &o->opts;
  int rc;
  int push = (step - 1) % opts->stat_every == 0;
  if (push && (rc = tr__shampoo_push(o, step, err)) != TR_OK) return rc;
  if (push && opts->sync_roots) {
    if (precond_flush(s->client, 60000) != PRECOND_OK)
      return tr__fail(err, TR_EDAEMON, "--sync-roots: statistics not sent within 60 s");
  }
  double stale_sum = 0;
  long stale_n = 0, stale_max = -1;
  int fallback = 0;
  size_t b = 0;
  for (size_t i = 0; i < o->nparams; i++) {
    ac_param *p = o->params[i];
    size_t n = p->value.numel;
    float *g = ac_tensor_f32(&p->grad), *w = ac_tensor_f32(&p->value);
    /* The grafted step D: Adam run on a zero buffer with rate -1 writes its direction. */
    ac_adamw_args aa = {.lr = -1.0f, .beta1 = (float)opts->beta1, .beta2 = (float)opts->beta2,
                        .eps = (float)opts->eps, .weight_decay = 0.0f, .step = step};
    rc = ac_fill_f32(o->be, n, s->dir, 0.0f);
    if (rc == AC_OK) rc = ac_adamw_update(o->be, n, s->dir, g, o->state1[i], o->state2[i], &aa);
    if (rc == AC_OK) rc = ac_memcpy_d2d(o->be, s->pre, s->dir, n * sizeof(float));
    if (rc != AC_OK) return tr__accel(err, rc, "Shampoo grafted step");
    for (; b < s->nblocks && s->blocks[b].param == i; b++) {
      tr__block *k = &s->blocks[b];
      rc = push && opts->sync_roots ? tr__shampoo_wait(o, k, step, err)
                                    : tr__shampoo_refresh(o, k, err);
      if (rc != TR_OK) return rc;
      long age = k->version > 0 ? step - (long)k->source_step : -1;
      int usable = k->version > 0 && (k->n_left > 0 || k->n_right > 0) &&
                   (opts->max_staleness == 0 || age <= opts->max_staleness);
      if (!usable) {
        fallback = 1;
        continue;
      }
      size_t off = k->row0 * k->ld + k->col0, cnt = k->rows * k->cols;
      double np2 = 0, nd2 = 0;
      rc = tr__shampoo_direction(o, k, g + off);
      if (rc == AC_OK) rc = ac_sumsq_to_host(o->be, cnt, s->tmp2, &np2);
      if (rc == AC_OK) rc = ac_copy2d(o->be, k->rows, k->cols, s->dir + off, k->ld, s->tmp1,
                                      k->cols);
      if (rc == AC_OK) rc = ac_sumsq_to_host(o->be, cnt, s->tmp1, &nd2);
      if (rc != AC_OK) return tr__accel(err, rc, "Shampoo preconditioned step");
      if (!(np2 > 0) || !isfinite(np2)) {
        fallback = 1;  /* no usable norm: the block keeps the grafted step */
        continue;
      }
      rc = ac_affine(o->be, cnt, (float)sqrt(nd2 / np2), s->tmp2, 0.0f, s->tmp2);
      if (rc == AC_OK)
        rc = ac_copy2d(o->be, k->rows, k->cols, s->tmp2, k->cols, s->pre + off, k->ld);
      if (rc != AC_OK) return tr__accel(err, rc, "Shampoo preconditioned step");
      stale_sum += (double)age;
      stale_n++;
      if (age > stale_max) stale_max = age;
    }
    /* w <- w - lr (P + wd w) */
    rc = ac_axpby(o->be, n, (float)-lr, s->pre, (float)(1.0 - lr * opts->weight_decay), w, w);
    if (rc != AC_OK) return tr__accel(err, rc, "Shampoo update");
  }
  if (info != NULL) {
    info->staleness = stale_n > 0 ? stale_sum / (double)stale_n : NAN;
    info->staleness_max = stale_max;
    info->fallback = fallback;
  }
  return TR_OK;
}

/* ==================================================================================== */
/* Optimizers                                                                             */

int tr_optimizer_init(tr_optimizer *o, const tr_options *opts, ac_backend *be,
                      ac_param **params, size_t nparams, const char *model_name, tr_error *err) {
  if (o == NULL) return TR_EINVAL;
  memset(o, 0, sizeof *o);
  if (opts == NULL || be == NULL || params == NULL || nparams == 0 || model_name == NULL)
    return tr__fail(err, TR_EINVAL, "tr_optimizer_init: bad arguments");
  for (size_t i = 0; i < nparams; i++)
    if (params[i] == NULL || params[i]->value.be != be || params[i]->value.numel == 0 ||
        ac_tensor_f32(&params[i]->value) == NULL || ac_tensor_f32(&params[i]->grad) == NULL)
      return tr__fail(err, TR_EINVAL, "parameter %zu is empty or on another backend", i);
  o->kind = opts->optimizer;
  o->be = be;
  o->params = params;
  o->nparams = nparams;
  o->opts = *opts;
  o->lr = tr_effective_lr(opts);
  int rc = TR_OK;
  o->state1 = calloc(nparams, sizeof *o->state1);
  o->state2 = calloc(nparams, sizeof *o->state2);
  if (o->state1 == NULL || o->state2 == NULL) {
    rc = TR_ENOMEM;
    goto fail;
  }
  for (size_t i = 0; i < nparams && rc == TR_OK; i++) {
    size_t n = params[i]->value.numel;
    rc = tr__accel(err, ac_malloc(be, n * sizeof(float), (void **)&o->state1[i]), "ac_malloc");
    if (rc == TR_OK) rc = tr__accel(err, ac_fill_f32(be, n, o->state1[i], 0.0f), "ac_fill");
    if (rc == TR_OK && o->kind != TR_SGD) {
      rc = tr__accel(err, ac_malloc(be, n * sizeof(float), (void **)&o->state2[i]), "ac_malloc");
      if (rc == TR_OK) rc = tr__accel(err, ac_fill_f32(be, n, o->state2[i], 0.0f), "ac_fill");
    }
  }
  if (rc != TR_OK) goto fail;
  if (o->kind == TR_SHAMPOO && (rc = tr__shampoo_init(o, model_name, err)) != TR_OK) goto fail;
  return TR_OK;
fail:
  tr_optimizer_destroy(o);
  return rc;
}

int tr_optimizer_step(tr_optimizer *o, long step, double lr, tr_step_info *info,
                      tr_error *err) {
  if (o == NULL || o->params == NULL || step < 1 || !(lr >= 0))
    return tr__fail(err, TR_EINVAL, "tr_optimizer_step: bad arguments");
  if (info != NULL) *info = (tr_step_info){NAN, -1, 0};
  if (o->kind == TR_SHAMPOO) return tr__shampoo_step(o, step, lr, info, err);
  for (size_t i = 0; i < o->nparams; i++) {
    ac_param *p = o->params[i];
    size_t n = p->value.numel;
    float *w = ac_tensor_f32(&p->value), *g = ac_tensor_f32(&p->grad);
    int rc;
    if (o->kind == TR_SGD) {
      /* g += wd w; v = mu v + g; w -= lr v */
      rc = ac_axpby(o->be, n, (float)o->opts.weight_decay, w, 1.0f, g, g);
      if (rc == AC_OK)
        rc = ac_axpby(o->be, n, 1.0f, g, (float)o->opts.momentum, o->state1[i], o->state1[i]);
      if (rc == AC_OK) rc = ac_axpby(o->be, n, (float)-lr, o->state1[i], 1.0f, w, w);
    } else {
      ac_adamw_args a = {.lr = (float)lr, .beta1 = (float)o->opts.beta1,
                         .beta2 = (float)o->opts.beta2, .eps = (float)o->opts.eps,
                         .weight_decay = (float)o->opts.weight_decay, .step = step};
      rc = ac_adamw_update(o->be, n, w, g, o->state1[i], o->state2[i], &a);
    }
    if (rc != AC_OK) return tr__accel(err, rc, tr_optimizer_name(o->kind));
  }
  return TR_OK;
}

void tr_optimizer_counters(const tr_optimizer *o, long *blocks, uint64_t *pushed,
                           uint64_t *dropped, uint64_t *coalesced, uint64_t *roots_received) {
  precond_counters c = {0};
  long nb = 0;
  uint64_t rr = 0;
  if (o != NULL && o->shampoo != NULL) {
    precond_get_counters(o->shampoo->client, &c);
    nb = (long)o->shampoo->nblocks;
    rr = o->shampoo->roots_received;
  }
  if (blocks) *blocks = nb;
  if (pushed) *pushed = c.pushed;
  if (dropped) *dropped = c.dropped;
  if (coalesced) *coalesced = c.coalesced;
  if (roots_received) *roots_received = rr;
}

void tr_optimizer_destroy(tr_optimizer *o) {
  if (o == NULL) return;
  tr__shampoo_free(o->be, o->shampoo);
  for (size_t i = 0; i < o->nparams; i++) {
    if (o->state1 != NULL) ac_free(o->be, o->state1[i]);
    if (o->state2 != NULL) ac_free(o->be, o->state2[i]);
  }
  free(o->state1);
  free(o->state2);
  memset(o, 0, sizeof *o);
}

/* ==================================================================================== */
/* The loop                                                                               */

long tr_total_steps(const tr_options *opts, const tr_model *model) {
  if (opts->steps > 0) return opts->steps;
  double spe = model != NULL && model->steps_per_epoch > 0 ? (double)model->steps_per_epoch : 1;
  double t = ceil(opts->epochs * spe);
  return t < 1 ? 1 : t > 1e12 ? (long)1e12 : (long)t;
}

/* The progress line: redrawn in place on a terminal (at most 4 times a second), one line
 * per tenth of the run otherwise (logs stay short). */
typedef struct {
  int tty;
  double last;
  long every;
  int drawn;
} tr__progress;

static void tr__progress_show(tr__progress *p, const tr_model *m, long step, long total,
                              double loss, double train_s, int final) {
  double now = tr__now();
  int show = p->tty ? (final || now - p->last >= 0.25) : (final || step % p->every == 0);
  if (!show) return;
  p->last = now;
  char line[200];
  double rate = train_s > 0 ? m->items_per_step * (double)step / train_s : NAN;
  tr_format_progress(line, sizeof line, step, total, loss, rate, m->item_unit, train_s,
                     tr_eta(train_s, step, total));
  if (p->tty) {
    fprintf(stderr, "\r%-78s", line);
    p->drawn = 1;
    if (final) {
      fputc('\n', stderr);
      p->drawn = 0;
    }
  } else {
    fprintf(stderr, "%s\n", line);
  }
  fflush(stderr);
}

static void tr__progress_note(tr__progress *p, const char *fmt, ...) {
  if (p->drawn) fputc('\n', stderr);
  p->drawn = 0;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fflush(stderr);
}

/* Scales every gradient so that the global norm is at most clip. */
static int tr__clip(ac_backend *be, const tr_model *m, double clip, tr_error *err) {
  double total = 0;
  for (size_t i = 0; i < m->nparams; i++) {
    double s = 0;
    int rc = ac_sumsq_to_host(be, m->params[i]->grad.numel, ac_tensor_f32(&m->params[i]->grad),
                              &s);
    if (rc != AC_OK) return tr__accel(err, rc, "gradient norm");
    total += s;
  }
  double norm = sqrt(total);
  if (!(norm > clip) || !isfinite(norm)) return TR_OK;
  for (size_t i = 0; i < m->nparams; i++) {
    float *g = ac_tensor_f32(&m->params[i]->grad);
    int rc = ac_affine(be, m->params[i]->grad.numel, (float)(clip / norm), g, 0.0f, g);
    if (rc != AC_OK) return tr__accel(err, rc, "gradient clipping");
  }
  return TR_OK;
}

int tr_train(const tr_options *opts, ac_backend *be, const tr_model *model,
             tr_summary *summary, tr_error *err) {
  if (opts == NULL || be == NULL || model == NULL || model->train_step == NULL ||
      model->evaluate == NULL || model->params == NULL || model->nparams == 0)
    return tr__fail(err, TR_EINVAL, "tr_train: bad arguments");
  double t_start = tr__now();
  long total = tr_total_steps(opts, model);
  double base_lr = tr_effective_lr(opts);
  int rc = TR_OK;
  FILE *csv = NULL;
  double *step_ms = NULL, *losses = NULL, *stale = NULL;
  long nstale = 0;
  tr_optimizer opt;
  memset(&opt, 0, sizeof opt);
  tr_summary sm;
  memset(&sm, 0, sizeof sm);
  sm.model = model->name;
  sm.optimizer = tr_optimizer_name(opts->optimizer);
  sm.backend = ac_backend_name(be);
  sm.seed = opts->seed;
  sm.lr = base_lr;
  sm.item_unit = model->item_unit;
  sm.final_eval_loss = sm.final_eval_accuracy = sm.best_eval_loss = NAN;
  sm.staleness_mean = sm.staleness_median = NAN;
  sm.staleness_max = -1;
  sm.status = "ok";
  for (size_t i = 0; i < model->nparams; i++) sm.params += (long)model->params[i]->value.numel;

  step_ms = malloc((size_t)total * sizeof *step_ms);
  losses = malloc((size_t)total * sizeof *losses);
  stale = malloc((size_t)total * sizeof *stale);
  if (step_ms == NULL || losses == NULL || stale == NULL) {
    rc = tr__fail(err, TR_ENOMEM, "no memory for %ld steps of figures", total);
    goto done;
  }
  if (opts->out[0] != '\0') {
    char path[1100];
    if (tr_mkdirs(opts->out) != TR_OK) {
      rc = tr__fail(err, TR_EIO, "--out %s: cannot create the directory: %s", opts->out,
                    strerror(errno));
      goto done;
    }
    snprintf(path, sizeof path, "%s/train.csv", opts->out);
    csv = fopen(path, "w");
    if (csv == NULL || tr_csv_header(csv) != TR_OK) {
      rc = tr__fail(err, TR_EIO, "%s: %s", path, strerror(errno));
      goto done;
    }
  }
  rc = tr_optimizer_init(&opt, opts, be, model->params, model->nparams, model->name, err);
  if (rc != TR_OK) goto done;

  tr__progress prog = {isatty(STDERR_FILENO), 0, total >= 10 ? total / 10 : 1, 0};
  double train_s = 0;
  long step = 0;
  while (step < total) {
    step++;
    double t0 = tr__now();
    double loss = NAN;
    int mrc = model->train_step(model->ctx, &loss);
    if (mrc != 0) {
      rc = tr__fail(err, TR_EMODEL, "step %ld: the model's training step failed (%d)", step, mrc);
      sm.status = "model error";
      step--;
      break;
    }
    if (!isfinite(loss)) {
      rc = tr__fail(err, TR_ENONFINITE, "step %ld: training loss is %g; stopping", step, loss);
      sm.status = "diverged";
    }
    double lr = base_lr;
    if (opts->warmup > 0 && (double)step < opts->warmup) lr *= (double)step / opts->warmup;
    tr_step_info info = {NAN, -1, 0};
    if (rc == TR_OK && opts->clip > 0) rc = tr__clip(be, model, opts->clip, err);
    if (rc == TR_OK) rc = tr_optimizer_step(&opt, step, lr, &info, err);
    if (rc == TR_OK) rc = tr__accel(err, ac_sync(be), "ac_sync");
    double dt = tr__now() - t0;
    train_s += dt;
    step_ms[step - 1] = dt * 1e3;
    losses[step - 1] = loss;
    if (isfinite(info.staleness)) {
      stale[nstale++] = info.staleness;
      if (info.staleness_max > sm.staleness_max) sm.staleness_max = info.staleness_max;
    }
    if (info.fallback) sm.fallback_steps++;
    sm.steps = step;

    tr_row row = {step, train_s, dt * 1e3, loss, NAN, NAN, lr, info.staleness, info.fallback};
    int eval_now = rc == TR_OK &&
                   (step == total || (opts->eval_every > 0 && step % opts->eval_every == 0));
    if (!opts->quiet) tr__progress_show(&prog, model, step, total, loss, train_s, step == total);
    if (eval_now) {
      double el = NAN, ea = NAN;
      if (model->evaluate(model->ctx, opts->eval_batches, &el, &ea) != 0) {
        rc = tr__fail(err, TR_EMODEL, "step %ld: evaluation failed", step);
        sm.status = "model error";
      } else {
        row.eval_loss = el;
        row.eval_accuracy = ea;
        sm.final_eval_loss = el;
        sm.final_eval_accuracy = ea;
        if (isfinite(el) && !(el >= sm.best_eval_loss)) sm.best_eval_loss = el;
        if (!opts->quiet) {
          if (isfinite(ea))
            tr__progress_note(&prog, "eval at step %ld: loss %.4f  accuracy %.4f\n", step, el,
                              ea);
          else
            tr__progress_note(&prog, "eval at step %ld: loss %.4f\n", step, el);
        }
      }
    }
    if (csv != NULL && tr_csv_row(csv, &row) != TR_OK) {
      rc = tr__fail(err, TR_EIO, "%s/train.csv: write failed", opts->out);
      break;
    }
    if (rc != TR_OK) break;
  }
  if (prog.drawn) fputc('\n', stderr);

  sm.wall_s = train_s;
  long tail = sm.steps < 20 ? sm.steps : 20;
  double acc = 0;
  for (long i = sm.steps - tail; i < sm.steps; i++) acc += losses[i];
  sm.final_train_loss = tail > 0 ? acc / (double)tail : NAN;
  tr_median(step_ms, (size_t)sm.steps, &sm.median_step_ms);
  sm.mean_step_ms = sm.steps > 0 ? train_s * 1e3 / (double)sm.steps : NAN;
  sm.items_per_s = train_s > 0 ? model->items_per_step * (double)sm.steps / train_s : NAN;
  if (nstale > 0) {
    double ssum = 0;
    for (long i = 0; i < nstale; i++) ssum += stale[i];
    sm.staleness_mean = ssum / (double)nstale;
    tr_median(stale, (size_t)nstale, &sm.staleness_median);
  }
  tr_optimizer_counters(&opt, &sm.blocks, &sm.stats_pushed, &sm.stats_dropped,
                        &sm.stats_coalesced, &sm.roots_received);
  if (rc != TR_OK && strcmp(sm.status, "ok") == 0) sm.status = tr_strerror(rc);

done:
  tr_optimizer_destroy(&opt);
  sm.total_s = tr__now() - t_start;
  if (csv != NULL && fclose(csv) != 0 && rc == TR_OK)
    rc = tr__fail(err, TR_EIO, "%s/train.csv: write failed", opts->out);
  if (opts->out[0] != '\0' && step_ms != NULL && (rc == TR_OK || sm.steps > 0)) {
    char path[1100];
    snprintf(path, sizeof path, "%s/summary.json", opts->out);
    FILE *f = fopen(path, "w");
    int wrc = f != NULL ? tr_json_summary(f, &sm) : TR_EIO;
    if (f != NULL && fclose(f) != 0) wrc = TR_EIO;
    if (wrc != TR_OK && rc == TR_OK) rc = tr__fail(err, TR_EIO, "%s: write failed", path);
  }
  free(step_ms);
  free(losses);
  free(stale);
  if (summary != NULL) *summary = sm;
  return rc;
}
