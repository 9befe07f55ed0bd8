/*
 * precondd_proc.h -- the one way tests and benchmarks start and stop a real precondd (prefix
 * pdproc_). Lives in support/: shared by tests/ and bench/, never linked into a product.
 *
 * A daemon runs as a child process with its working files in one directory: the port file it
 * writes once listening (start waits for it, so a started daemon accepts calls), its log
 * (stderr; stdout goes to /dev/null so a daemon never holds the test runner's pipe) and, by
 * default, its state directory. Daemons still running when the test program exits (a failed
 * assertion jumped past the stop) are killed at exit, so none outlives the suite.
 *
 * No cmocka here: functions return a status, so a group setup can call them and a test
 * asserts on the result. Not thread-safe: start and stop daemons from one thread.
 */
#ifndef PRECOND_SUPPORT_PRECONDD_PROC_H
#define PRECOND_SUPPORT_PRECONDD_PROC_H

#include <sys/types.h>

typedef struct {
  const char *path;         /* the precondd binary; NULL: $PRECONDD */
  const char *listen;       /* --listen; NULL: "127.0.0.1:0" (a free port, read back) */
  const char *state_dir;    /* NULL: <dir>/state; "": no --state-dir (nothing survives a
                                restart) */
  int threads;              /* --threads; default 1 */
  int io_threads;           /* --io-threads; 0 (default): the daemon's */
  int grace_period;         /* --grace-period in seconds; 0 (default): the daemon's */
  const char *log_level;    /* --log-level; NULL (default): the daemon's */
  int inherit_stderr;       /* 1: the daemon writes to this process's stderr (the test log)
                                instead of <dir>/precondd.log. Default 0 */
  const char *const *extra; /* more options, NULL-terminated; NULL for none */
  int wait_ms;              /* how long start waits for the port file; default 20000 */
} pdproc_opts;

typedef struct {
  pid_t pid;      /* 0 when not running */
  int port;       /* the bound TCP port of the last start; 0 for a unix socket */
  char dir[160];  /* working directory: set it before the first start to use the caller's
                      (which the caller removes), or leave it empty and start makes one
                      under /tmp that pdproc_destroy removes */
  char addr[128]; /* what a client dials: "127.0.0.1:PORT", or the listen string for
                      "unix:PATH" */
  char log[192];  /* the log file (appended to across restarts); "" when inherited */
  int own_dir;    /* 1 if start made dir */
} pdproc;

/* Fills o with the defaults above. */
void pdproc_opts_default(pdproc_opts *o);

/* Starts precondd with opts (NULL: the defaults) and waits until it listens. d is the
 * caller's; zero it before the first start. A stopped d may be started again (same dir, so
 * the same state directory: a restart). Returns 0; 1000 + the daemon's exit status (128 +
 * signal if killed) if it exited before listening; -1 if it could not be started or did not
 * listen within wait_ms (then it is killed; a message is on stderr). */
int pdproc_start(pdproc *d, const pdproc_opts *opts);

/* The common case: precondd at path (NULL: $PRECONDD) with the default options and
 * --log-level warn, its files in dir (the caller's; NULL: one of its own). As pdproc_start. */
int pdproc_start_in(pdproc *d, const char *path, const char *dir);

/* Sends sig to a running daemon and waits for its exit (at most 30 s, then SIGKILL).
 * Returns its exit status (128 + signal if a signal ended it), or -1 if it was not running
 * or had to be killed. d->pid becomes 0. */
int pdproc_stop(pdproc *d, int sig);

/* Stops d if it runs (SIGTERM) and removes dir if start made it. d may be started again
 * (in a new directory). */
void pdproc_destroy(pdproc *d);

/* 1 if the daemon's log holds needle (in its first 1 MiB), else 0. */
int pdproc_log_contains(const pdproc *d, const char *needle);

/* A loopback TCP port that nothing holds right now (bound and released), for tests that
 * need an address before the daemon exists: chosen at random below the kernel's ephemeral
 * range, so no port-0 bind or outgoing connection can take it meanwhile; 0 on error. */
int pdproc_free_port(void);

#endif /* PRECOND_SUPPORT_PRECONDD_PROC_H */
