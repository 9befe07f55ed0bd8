/*
 * precondd_util.h -- starting and stopping a real precondd for the bench tests (header-only,
 * so tests/bench/meson.build stays as it is). The daemon listens on a free loopback port
 * (--listen 127.0.0.1:0, --port-file), keeps its state and log under the caller's temporary
 * directory, and is stopped with SIGTERM.
 */
#ifndef PRECOND_TESTS_BENCH_PRECONDD_UTIL_H
#define PRECOND_TESTS_BENCH_PRECONDD_UTIL_H

#include <signal.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* Starts precondd (binary at path) with its port file, state and log in dir; writes its
 * "127.0.0.1:PORT" address into addr (size addr_len) and its pid into *pid. Returns 0, or -1
 * (message on stderr) if it did not listen within 10 s. */
static int precondd_start(const char *path, const char *dir, pid_t *pid, char *addr,
                          size_t addr_len) {
  char port_file[256], log_file[256], state_dir[256];
  snprintf(port_file, sizeof port_file, "%s/port", dir);
  snprintf(log_file, sizeof log_file, "%s/precondd.log", dir);
  snprintf(state_dir, sizeof state_dir, "%s/state", dir);
  *pid = fork();
  if (*pid < 0) return -1;
  if (*pid == 0) {
    if (freopen(log_file, "w", stderr) == NULL) _exit(126);
    execl(path, path, "--listen", "127.0.0.1:0", "--port-file", port_file, "--state-dir",
          state_dir, "--threads", "1", "--log-level", "warn", (char *)NULL);
    _exit(127);
  }
  for (int i = 0; i < 200; i++) {
    FILE *f = fopen(port_file, "r");
    int port = 0;
    if (f != NULL) {
      int got = fscanf(f, "%d", &port);
      fclose(f);
      if (got == 1 && port > 0) {
        snprintf(addr, addr_len, "127.0.0.1:%d", port);
        return 0;
      }
    }
    usleep(50000);
  }
  fprintf(stderr, "precondd did not write %s within 10 s (log: %s)\n", port_file, log_file);
  return -1;
}

/* Stops a daemon started by precondd_start (SIGTERM, then waits); *pid becomes 0. A pid of 0
 * is a no-op. */
static void precondd_stop(pid_t *pid) {
  if (*pid <= 0) return;
  kill(*pid, SIGTERM);
  int st = 0;
  waitpid(*pid, &st, 0);
  *pid = 0;
}

#endif /* PRECOND_TESTS_BENCH_PRECONDD_UTIL_H */
