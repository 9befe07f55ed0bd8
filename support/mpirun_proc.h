/*
 * mpirun_proc.h -- the one way tests and benchmarks start a program under a real `mpirun`
 * (prefix mprun_): daemon replicas (`mpirun -np R precondd ...`) and data-parallel workers
 * (`mpirun -np W transformer ...`). Lives in support/ with precondd_proc.h: shared by tests/
 * and bench/, never linked into a product; libc only (no cmocka, no MPI).
 *
 * The command line is always `mpirun [--allow-run-as-root] --oversubscribe -np N PROGRAM...`:
 * everything runs on this one machine (--oversubscribe: more ranks than cores), and Open MPI
 * refuses root without --allow-run-as-root, which is given only when running as root. np 0
 * runs PROGRAM alone, without mpirun (the single-machine path), through the same calls.
 *
 * The ranks are mpirun's children: signals go to them, not to mpirun (a SIGTERM to Open MPI's
 * mpirun is forwarded to the ranks, but mpirun then exits 1 whatever they did), and a rank's
 * pid is found by OMPI_COMM_WORLD_RANK in its environment (/proc). Programs still running
 * when the calling program exits (a failed assertion jumped past the stop) are killed at
 * exit. Not thread-safe: start and stop from one thread.
 */
#ifndef PRECOND_SUPPORT_MPIRUN_PROC_H
#define PRECOND_SUPPORT_MPIRUN_PROC_H

#include <sys/types.h>

typedef struct {
  pid_t pid;  /* mpirun (or the program when np is 0); 0 once it was seen to exit */
  int np;     /* ranks; 0: the program alone */
  int status; /* its exit status once it exited (128 + signal if a signal ended it), else -1 */
} mprun;

/* Starts argv (NULL-terminated: the program and its arguments; only read during the call)
 * under `mpirun -np np` (mpirun at path mpirun), or alone when np is 0 (mpirun unused, may
 * be NULL). stdout and stderr are appended to log; log NULL: both inherited. Does not wait
 * for anything (see mprun_wait_files). Returns 0, or -1 (message on stderr) if it could not
 * be started. */
int mprun_start(mprun *m, const char *mpirun, int np, const char *const *argv, const char *log);

/* Waits ms at most (ms < 0: without a limit) for m to exit. Returns its exit status (also in
 * m->status), or -1 if it still runs. Once exited, returns the same status again. */
int mprun_wait(mprun *m, long ms);

/* Waits ms at most until every rank (0 .. max(np, 1) - 1) has written its file: pattern with
 * "%r" replaced by the rank (the precondd convention, e.g. "dir/p-%r" for --port-file).
 * Returns 0 when all exist; 1 if m exited first (its status in m->status); -1 on timeout. */
int mprun_wait_files(mprun *m, const char *pattern, long ms);

/* The pid of rank r among mpirun's children (np 0: the program itself for r 0), or -1. */
pid_t mprun_rank_pid(const mprun *m, int r);

/* Sends sig to every rank (np 0: to the program). Returns how many processes took it. */
int mprun_signal_ranks(const mprun *m, int sig);

/* Sends sig to every rank (mpirun itself if no rank is left), then waits ms at most
 * (ms < 0: without a limit). Returns the exit status, or -1 if it did not exit in time (then
 * it is killed with SIGKILL and reaped). */
int mprun_stop(mprun *m, int sig, long ms);

#endif /* PRECOND_SUPPORT_MPIRUN_PROC_H */
