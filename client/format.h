/*
 * format.h -- libprecond internal: precondctl's output, as human-readable tables or JSON.
 * Not part of the public API (prefix precond__); used by precondctl.c and the unit tests.
 * Each function writes one complete document to f and returns 0, or -1 on a write error.
 */
#ifndef PRECOND_CLIENT_FORMAT_H
#define PRECOND_CLIENT_FORMAT_H

#include <stdio.h>

#include "precond.h"

/* Daemon-wide figures and the job table. */
int precond__format_stats(FILE *f, const precond_stats *stats, int json);

/* The per-block table (stats->block_stats). */
int precond__format_blocks(FILE *f, const precond_stats *stats, int json);

/* One health answer for addr. */
int precond__format_health(FILE *f, const char *addr, const char *status_name, int json);

/* Short name of a mode ("shampoo", "kfac", "abs") or method ("newton", ...). */
const char *precond__mode_name(int mode);
const char *precond__method_name(int method);

#endif /* PRECOND_CLIENT_FORMAT_H */
