/*
 * format.c -- precondctl's tables and JSON documents (see format.h).
 *
 * JSON is written by hand: the documents are flat and small, and the project must not pull
 * in a JSON library for a CLI. Numbers use %.17g/%llu so scripts read back exact values;
 * non-finite doubles (never expected from the daemon) become null to stay valid JSON.
 */
#include "format.h"

#include <inttypes.h>
#include <math.h>

#include "rpc.h" /* rpc_json_string: the one escaper (proto/json.c says why there) */

const char *precond__mode_name(int mode) {
  switch (mode) {
    case PRECOND_MODE_SHAMPOO:
      return "shampoo";
    case PRECOND_MODE_KFAC:
      return "kfac";
    case PRECOND_MODE_ABS:
      return "abs";
    default:
      return "unknown";
  }
}

const char *precond__method_name(int method) {
  switch (method) {
    case PRECOND_METHOD_NEWTON:
      return "newton";
    case PRECOND_METHOD_NEWTON_TEXTBOOK:
      return "newton-textbook";
    case PRECOND_METHOD_EIGH:
      return "eigh";
    default:
      return "unknown";
  }
}

static void json_double(FILE *f, double x) {
  if (isfinite(x))
    fprintf(f, "%.17g", x);
  else
    fputs("null", f);
}

static void json_key(FILE *f, const char *key, int *first) {
  if (!*first) fputc(',', f);
  *first = 0;
  fprintf(f, "\"%s\":", key);
}

static void kv_u64(FILE *f, const char *key, uint64_t v, int *first) {
  json_key(f, key, first);
  fprintf(f, "%" PRIu64, v);
}

static void kv_i64(FILE *f, const char *key, int64_t v, int *first) {
  json_key(f, key, first);
  fprintf(f, "%" PRId64, v);
}

static void kv_dbl(FILE *f, const char *key, double v, int *first) {
  json_key(f, key, first);
  json_double(f, v);
}

static void kv_str(FILE *f, const char *key, const char *v, int *first) {
  json_key(f, key, first);
  rpc_json_string(f, v);
}

/* Human-readable byte count: "12.3 MiB". */
static void human_bytes(char *buf, size_t len, uint64_t bytes) {
  static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = (double)bytes;
  int u = 0;
  while (x >= 1024.0 && u < 4) {
    x /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", bytes);
  else
    snprintf(buf, len, "%.1f %s", x, unit[u]);
}

/* "key":{"samples":..,"p50":..,"p90":..,"p99":..,"max":..,"mean":..} */
static void json_staleness(FILE *f, const char *key, const precond_staleness *s, int *first) {
  int inner = 1;
  json_key(f, key, first);
  fputc('{', f);
  kv_u64(f, "samples", s->samples, &inner);
  kv_dbl(f, "p50", s->p50, &inner);
  kv_dbl(f, "p90", s->p90, &inner);
  kv_dbl(f, "p99", s->p99, &inner);
  kv_u64(f, "max", s->max, &inner);
  kv_dbl(f, "mean", s->mean, &inner);
  fputc('}', f);
}

static void json_job(FILE *f, const precond_job_stats *j) {
  int first = 1;
  fputc('{', f);
  kv_str(f, "job", j->job, &first);
  kv_str(f, "mode", precond__mode_name(j->mode), &first);
  kv_u64(f, "blocks", j->blocks, &first);
  kv_u64(f, "workers", j->workers, &first);
  kv_u64(f, "last_step", j->last_step, &first);
  if (j->nrank_load > 0) {
    json_key(f, "rank_load", &first);
    fputc('[', f);
    for (size_t r = 0; r < j->nrank_load; r++) {
      if (r > 0) fputc(',', f);
      json_double(f, j->rank_load[r]);
    }
    fputc(']', f);
  }
  fputc('}', f);
}

/* Daemon replicas, in the table: what crossed ranks, and each job's load per rank (its
 * units' estimated cost, sum of order^3, owned by each rank: the ownership's balance). */
static void table_replicas(FILE *f, const precond_stats *s) {
  const precond_replica_stats *x = &s->replica;
  fprintf(f,
          "%-20s rank %d of %u: roots %" PRIu64 " sent, %" PRIu64 " received; statistics %" PRIu64
          " forwarded, %" PRIu64 " received; %" PRIu64 " MPI errors%s\n",
          "replicas", (int)s->rank, s->replicas, x->roots_sent, x->roots_received,
          x->stats_forwarded, x->stats_received, x->mpi_errors,
          x->alone ? " (alone: computes every unit)" : "");
  int header = 0;
  for (size_t i = 0; i < s->njobs; i++) {
    const precond_job_stats *j = &s->job_stats[i];
    double total = 0;
    for (size_t r = 0; r < j->nrank_load; r++) total += j->rank_load[r];
    if (j->nrank_load == 0 || !(total > 0)) continue;
    if (!header) fprintf(f, "\n%-24s %s\n", "JOB", "LOAD PER RANK (share of the units' n^3)");
    header = 1;
    fprintf(f, "%-24s", j->job ? j->job : "");
    for (size_t r = 0; r < j->nrank_load; r++)
      fprintf(f, " %zu: %.1f%%", r, 100.0 * j->rank_load[r] / total);
    fputc('\n', f);
  }
}

int precond__format_stats(FILE *f, const precond_stats *s, int json) {
  if (json) {
    int first = 1;
    fputc('{', f);
    kv_str(f, "version", s->version, &first);
    kv_dbl(f, "uptime_s", s->uptime_s, &first);
    kv_u64(f, "jobs", s->jobs, &first);
    kv_u64(f, "threads", s->threads, &first);
    kv_u64(f, "replicas", s->replicas, &first);
    kv_i64(f, "rank", s->rank, &first);
    if (s->replicas > 1) {
      const precond_replica_stats *x = &s->replica;
      int rf = 1;
      json_key(f, "replica", &first);
      fputc('{', f);
      kv_u64(f, "roots_sent", x->roots_sent, &rf);
      kv_u64(f, "roots_received", x->roots_received, &rf);
      kv_u64(f, "stats_forwarded", x->stats_forwarded, &rf);
      kv_u64(f, "stats_received", x->stats_received, &rf);
      kv_u64(f, "mpi_errors", x->mpi_errors, &rf);
      json_key(f, "alone", &rf);
      fputs(x->alone ? "true" : "false", f);
      fputc('}', f);
    }
    kv_u64(f, "queue_depth", s->queue_depth, &first);
    kv_u64(f, "roots_computed", s->roots_computed, &first);
    kv_u64(f, "roots_failed", s->roots_failed, &first);
    kv_u64(f, "roots_skipped", s->roots_skipped, &first);
    kv_dbl(f, "drift_threshold", s->drift_threshold, &first);
    json_staleness(f, "staleness", &s->staleness, &first);
    kv_dbl(f, "compute_ms_p50", s->compute_ms_p50, &first);
    kv_dbl(f, "compute_ms_p90", s->compute_ms_p90, &first);
    kv_dbl(f, "compute_ms_p99", s->compute_ms_p99, &first);
    kv_u64(f, "bytes_in", s->bytes_in, &first);
    kv_u64(f, "bytes_out", s->bytes_out, &first);
    kv_u64(f, "memory_bytes", s->memory_bytes, &first);
    kv_u64(f, "rejected_pushes", s->rejected_pushes, &first);
    kv_u64(f, "torn_pushes", s->torn_pushes, &first);
    kv_u64(f, "vouched_pushes", s->vouched_pushes, &first);
    kv_u64(f, "snapshots_written", s->snapshots_written, &first);
    kv_dbl(f, "last_snapshot_age_s", s->last_snapshot_age_s, &first);
    json_key(f, "job_stats", &first);
    fputc('[', f);
    for (size_t i = 0; i < s->njobs; i++) {
      if (i > 0) fputc(',', f);
      json_job(f, &s->job_stats[i]);
    }
    fputs("]}\n", f);
    return ferror(f) ? -1 : 0;
  }

  char in[32], out[32], mem[32];
  human_bytes(in, sizeof in, s->bytes_in);
  human_bytes(out, sizeof out, s->bytes_out);
  human_bytes(mem, sizeof mem, s->memory_bytes);
  fprintf(f, "precondd %s  up %.1f s  rank %d of %u replicas  %u threads\n",
          s->version ? s->version : "?", s->uptime_s, (int)s->rank, s->replicas, s->threads);
  fprintf(f, "%-20s %" PRIu64 "\n", "queue depth", s->queue_depth);
  fprintf(f, "%-20s %" PRIu64 " computed, %" PRIu64 " failed, %" PRIu64 " skipped (drift < %g)\n",
          "roots", s->roots_computed, s->roots_failed, s->roots_skipped, s->drift_threshold);
  fprintf(f,
          "%-20s p50 %.0f  p90 %.0f  p99 %.0f  max %" PRIu64 "  mean %.2f  (%" PRIu64 " samples)\n",
          "staleness, steps", s->staleness.p50, s->staleness.p90, s->staleness.p99,
          s->staleness.max, s->staleness.mean, s->staleness.samples);
  fprintf(f, "%-20s p50 %.3f  p90 %.3f  p99 %.3f\n", "compute ms", s->compute_ms_p50,
          s->compute_ms_p90, s->compute_ms_p99);
  fprintf(f, "%-20s in %s, out %s\n", "bytes", in, out);
  fprintf(f, "%-20s %s\n", "memory", mem);
  fprintf(f, "%-20s %" PRIu64 " (torn: %" PRIu64 ")\n", "rejected pushes", s->rejected_pushes,
          s->torn_pushes);
  fprintf(f, "%-20s %" PRIu64 " (folded without the spare)\n", "vouched pushes", s->vouched_pushes);
  fprintf(f, "%-20s %" PRIu64 " written, last %.1f s ago\n", "snapshots", s->snapshots_written,
          s->last_snapshot_age_s);
  fprintf(f, "\n%-24s %-8s %8s %8s %12s\n", "JOB", "MODE", "BLOCKS", "WORKERS", "LAST STEP");
  for (size_t i = 0; i < s->njobs; i++) {
    const precond_job_stats *j = &s->job_stats[i];
    fprintf(f, "%-24s %-8s %8u %8u %12" PRIu64 "\n", j->job ? j->job : "",
            precond__mode_name(j->mode), j->blocks, j->workers, j->last_step);
  }
  if (s->njobs == 0) fputs("(no jobs)\n", f);
  if (s->replicas > 1) table_replicas(f, s);
  return ferror(f) ? -1 : 0;
}

int precond__format_blocks(FILE *f, const precond_stats *s, int json) {
  if (json) {
    fputs("{\"blocks\":[", f);
    for (size_t i = 0; i < s->nblocks; i++) {
      const precond_block_stats *b = &s->block_stats[i];
      int first = 1;
      if (i > 0) fputc(',', f);
      fputc('{', f);
      kv_str(f, "job", b->job, &first);
      kv_u64(f, "block_id", b->block_id, &first);
      kv_str(f, "tensor", b->tensor, &first);
      kv_u64(f, "rows", b->rows, &first);
      kv_u64(f, "cols", b->cols, &first);
      kv_u64(f, "version", b->version, &first);
      kv_u64(f, "stat_step", b->stat_step, &first);
      kv_u64(f, "root_step", b->root_step, &first);
      kv_u64(f, "staleness", b->staleness, &first);
      kv_u64(f, "roots_computed", b->roots_computed, &first);
      kv_u64(f, "roots_failed", b->roots_failed, &first);
      kv_u64(f, "roots_skipped", b->roots_skipped, &first);
      kv_dbl(f, "last_drift", b->last_drift, &first);
      json_staleness(f, "staleness_dist", &b->staleness_dist, &first);
      kv_dbl(f, "last_error", b->last_error, &first);
      kv_dbl(f, "last_compute_ms", b->last_compute_ms, &first);
      kv_i64(f, "owner", b->owner, &first);
      if (b->a_order == 0) { /* a Shampoo block */
        kv_u64(f, "roots_warm", b->roots_warm, &first);
        kv_u64(f, "roots_warm_skipped", b->roots_warm_skipped, &first);
        kv_u64(f, "roots_seeded", b->roots_seeded, &first);
        kv_u64(f, "roots_cold", b->roots_cold, &first);
      }
      if (b->a_order > 0) { /* a K-FAC layer */
        kv_u64(f, "a_order", b->a_order, &first);
        kv_u64(f, "g_order", b->g_order, &first);
        kv_dbl(f, "pi", b->pi, &first);
        kv_dbl(f, "damping_a", b->damping_a, &first);
        kv_dbl(f, "damping_g", b->damping_g, &first);
      }
      fputc('}', f);
    }
    fputs("]}\n", f);
    return ferror(f) ? -1 : 0;
  }

  size_t nkfac = 0;
  for (size_t i = 0; i < s->nblocks; i++) nkfac += s->block_stats[i].a_order > 0;
  if (nkfac < s->nblocks || s->nblocks == 0)
    fprintf(f, "%-16s %5s %-20s %11s %7s %8s %8s %6s %7s %6s %6s %14s %10s %9s %5s %s\n", "JOB",
            "BLOCK", "TENSOR", "SHAPE", "VERSION", "STAT", "ROOT", "STALE", "ROOTS", "FAILED",
            "SKIP", "AGE p50/90/MAX", "ERROR", "MS", "OWNER", "WARM/SKIP/SEED/COLD");
  for (size_t i = 0; i < s->nblocks; i++) {
    const precond_block_stats *b = &s->block_stats[i];
    if (b->a_order > 0) continue; /* K-FAC layers have their own table below */
    char shape[32], age[48], paths[96];
    snprintf(shape, sizeof shape, "%" PRIu64 "x%" PRIu64, b->rows, b->cols);
    snprintf(paths, sizeof paths, "%" PRIu64 "/%" PRIu64 "/%" PRIu64 "/%" PRIu64, b->roots_warm,
             b->roots_warm_skipped, b->roots_seeded, b->roots_cold);
    snprintf(age, sizeof age, "%.0f/%.0f/%" PRIu64, b->staleness_dist.p50, b->staleness_dist.p90,
             b->staleness_dist.max);
    fprintf(f,
            "%-16s %5u %-20s %11s %7" PRIu64 " %8" PRIu64 " %8" PRIu64 " %6" PRIu64 " %7" PRIu64
            " %6" PRIu64 " %6" PRIu64 " %14s %10.2e %9.3f %5d %s\n",
            b->job ? b->job : "", b->block_id, b->tensor ? b->tensor : "", shape, b->version,
            b->stat_step, b->root_step, b->staleness, b->roots_computed, b->roots_failed,
            b->roots_skipped, age, b->last_error, b->last_compute_ms, (int)b->owner, paths);
  }
  if (s->nblocks == 0) fputs("(no blocks)\n", f);
  if (nkfac == 0) return ferror(f) ? -1 : 0;
  /* K-FAC layers: the factor orders, the damping split of the published inverses, and
   * their age (staleness: steps between the newest factors and the inverses' source). */
  fprintf(f, "%s%-16s %5s %-20s %6s %6s %7s %10s %10s %10s %6s %14s %8s %6s %10s %9s\n",
          nkfac < s->nblocks ? "\n" : "", "JOB", "LAYER", "TENSOR", "A", "G", "VERSION", "PI",
          "DAMP A", "DAMP G", "AGE", "AGE p50/90/MAX", "INVERSES", "FAILED", "ERROR", "MS");
  for (size_t i = 0; i < s->nblocks; i++) {
    const precond_block_stats *b = &s->block_stats[i];
    if (b->a_order == 0) continue;
    char age[48];
    snprintf(age, sizeof age, "%.0f/%.0f/%" PRIu64, b->staleness_dist.p50, b->staleness_dist.p90,
             b->staleness_dist.max);
    fprintf(f,
            "%-16s %5u %-20s %6" PRIu64 " %6" PRIu64 " %7" PRIu64 " %10.4g %10.3e %10.3e %6" PRIu64
            " %14s %8" PRIu64 " %6" PRIu64 " %10.2e %9.3f\n",
            b->job ? b->job : "", b->block_id, b->tensor ? b->tensor : "", b->a_order, b->g_order,
            b->version, b->pi, b->damping_a, b->damping_g, b->staleness, age, b->roots_computed,
            b->roots_failed, b->last_error, b->last_compute_ms);
  }
  return ferror(f) ? -1 : 0;
}

int precond__format_health(FILE *f, const char *addr, const char *status_name, int json) {
  if (json) {
    int first = 1;
    fputc('{', f);
    kv_str(f, "addr", addr, &first);
    kv_str(f, "status", status_name, &first);
    fputs("}\n", f);
  } else {
    fprintf(f, "%s: %s\n", addr ? addr : "", status_name ? status_name : "");
  }
  return ferror(f) ? -1 : 0;
}
