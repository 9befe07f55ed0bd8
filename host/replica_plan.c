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

void pd_replica_resume_plan(const pd_replica_view *v, int nranks, pd_resume_plan *out) {
  *out = (pd_resume_plan){0, nranks, 0, v[0].propose};
  int ref = -1;
  for (int r = 0; r < nranks && ref < 0; r++)
    if (v[r].state == PD_VIEW_JOBS) ref = r;
  if (ref < 0) return; /* nothing to resume */
  /* Rank 0 always exists and writes a snapshot at every start that ends well, so its
   * snapshot (with jobs or without) names the run last written; a rank that holds an older
   * one is then recognised as such. */
  if (v[0].state == PD_VIEW_EMPTY && v[0].nranks >= 1) ref = 0;
  int R = v[ref].nranks;
  uint64_t run = v[ref].run;
  if (R < 1) return; /* written by an older daemon that did not say: as it did */
  int same = R == nranks;
  for (int r = 0; r < nranks && same; r++)
    if (v[r].state == PD_VIEW_JOBS && v[r].nranks >= 1 &&
        (v[r].rank != r || v[r].nranks != nranks || (run && v[r].run && v[r].run != run)))
      same = 0;
  if (same) {
    if (run) out->run = run;
    out->old_run = run;
    return;
  }
  out->reshard = 1;
  out->old_nranks = R;
  out->old_run = run;
  /* A new run: the old snapshots, still on disk until each rank writes its first, are told
   * apart from the new ones by it. */
  out->run = run ? run + 1 : v[0].propose;
}
