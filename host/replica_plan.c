/*
 * replica_plan.c -- which daemon replica (MPI rank) computes each unit, and the few rules of
 * the replica link that the store and the service apply. No MPI here: a daemon started
 * without mpirun, and the unit tests, use this file alone (replica.c is the MPI side).
 */
#include "precondd.h"

#include <stdlib.h>
#include <string.h>

int pd_replica_owns(const pd_replica_link *link, const pd_block *b) {
  return !link || link->nranks <= 1 || atomic_load(&link->alone) || (int)b->owner == link->rank;
}

double pd_replica_cost(const pd_block *b) {
  double c = 0;
  for (uint32_t k = 0; k < b->nparts; k++) {
    double n = (double)b->order[k];
    c += n * n * n;
  }
  return c;
}

typedef struct {
  double cost;
  uint32_t id;
} pd__unit_cost;

/* Decreasing cost, then increasing id: a total order, so every rank sorts alike. */
static int pd__cmp_cost(const void *a, const void *b) {
  const pd__unit_cost *x = a, *y = b;
  if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

int pd_replica_plan(pd_job *job, int nranks) {
  if (nranks < 1) return PD_EINVAL;
  double *load = calloc((size_t)nranks, sizeof *load);
  pd__unit_cost *units = malloc((job->nblocks ? job->nblocks : 1) * sizeof *units);
  if (!load || !units) {
    free(load);
    free(units);
    return PD_ENOMEM;
  }
  for (size_t i = 0; i < job->nblocks; i++)
    units[i] = (pd__unit_cost){pd_replica_cost(&job->blocks[i]), job->blocks[i].id};
  qsort(units, job->nblocks, sizeof *units, pd__cmp_cost);
  for (size_t i = 0; i < job->nblocks; i++) {
    int best = 0;
    for (int r = 1; r < nranks; r++)
      if (load[r] < load[best]) best = r;
    load[best] += units[i].cost;
    job->blocks[units[i].id].owner = (uint32_t)best;
  }
  free(units);
  free(job->rank_load);
  job->rank_load = load;
  return PD_OK;
}

int pd_replica_launched(int *size) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = getenv(vars[i]);
    if (v && *v) {
      *size = atoi(v);
      return 1;
    }
  }
  *size = 1;
  return 0;
}

int pd_replica_subst(char *s, size_t cap, int rank) {
  char out[2048], num[16];
  int nlen = snprintf(num, sizeof num, "%d", rank);
  size_t o = 0;
  for (const char *p = s; *p; p++) {
    if (p[0] == '%' && p[1] == 'r') {
      if (o + (size_t)nlen >= sizeof out) return -1;
      memcpy(out + o, num, (size_t)nlen);
      o += (size_t)nlen;
      p++;
    } else {
      if (o + 1 >= sizeof out) return -1;
      out[o++] = *p;
    }
  }
  out[o] = '\0';
  if (o + 1 > cap) return -1;
  memcpy(s, out, o + 1);
  return 0;
}

/* Reads "RANK NRANKS" from path; 0, or -1 when absent or not that. */
static int pd__read_ranks(const char *path, int *rank, int *nranks) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  int ok = fscanf(f, "%d %d", rank, nranks) == 2 && *nranks >= 1 && *rank >= 0 && *rank < *nranks;
  fclose(f);
  return ok ? 0 : -1;
}

int pd_replica_state_check(const char *dir, int rank, int nranks, size_t njobs, char *why,
                           size_t len) {
  char path[1100], tmp[1110];
  snprintf(path, sizeof path, "%s/%s", dir, PD_REPLICA_STATE_FILE);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int was_rank = 0, was_nranks = 0;
  if (njobs > 0 && pd__read_ranks(path, &was_rank, &was_nranks) == 0 &&
      (was_rank != rank || was_nranks != nranks)) {
    snprintf(why, len,
             "the snapshot in %s was written by rank %d of %d daemon replicas, and this is "
             "rank %d of %d: its %zu job(s) would be owned differently, and the statistics of "
             "the units other ranks owned are in their state directories, not here. Start "
             "the daemon job with %d rank(s) again (mpirun -np %d), or move the state "
             "directories away to start empty",
             dir, was_rank, was_nranks, rank, nranks, njobs, was_nranks, was_nranks);
    return PD_EINVAL;
  }
  FILE *f = fopen(tmp, "w");
  int ok = f && fprintf(f, "%d %d\n", rank, nranks) > 0;
  if (f && fclose(f) != 0) ok = 0;
  if (!ok || rename(tmp, path) != 0) {
    snprintf(why, len, "cannot write %s", path);
    return PD_EIO;
  }
  return PD_OK;
}
