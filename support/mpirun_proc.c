/* mpirun_proc.c -- starting programs under a real mpirun for tests and benchmarks
 * (mpirun_proc.h). */
#include "mpirun_proc.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Processes started and not yet seen to exit: killed at exit (a failed cmocka assertion
 * longjmps past the caller's stop). */
enum { MPRUN__MAX_LIVE = 16, MPRUN__MAX_ARGS = 64 };
static pid_t mprun__live[MPRUN__MAX_LIVE];
static int mprun__atexit_set;

static void mprun__kill_live(void) {
  for (int i = 0; i < MPRUN__MAX_LIVE; i++)
    if (mprun__live[i] > 0) {
      kill(mprun__live[i], SIGKILL);
      waitpid(mprun__live[i], NULL, 0);
      mprun__live[i] = 0;
    }
}

static void mprun__track(pid_t pid, int add) {
  for (int i = 0; i < MPRUN__MAX_LIVE; i++)
    if (add ? mprun__live[i] == 0 : mprun__live[i] == pid) {
      mprun__live[i] = add ? pid : 0;
      return;
    }
}

static void mprun__sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

int mprun_start(mprun *m, const char *mpirun, int np, const char *const *argv, const char *log) {
  memset(m, 0, sizeof *m);
  m->status = -1;
  const char *args[MPRUN__MAX_ARGS];
  char nps[16];
  int n = 0;
  if (np < 0 || (np > 0 && mpirun == NULL) || argv == NULL || argv[0] == NULL) {
    fprintf(stderr, "mprun_start: %s\n", np > 0 && mpirun == NULL ? "no mpirun" : "bad arguments");
    return -1;
  }
  if (np > 0) {
    snprintf(nps, sizeof nps, "%d", np);
    args[n++] = mpirun;
    if (geteuid() == 0) args[n++] = "--allow-run-as-root"; /* Open MPI refuses root without */
    args[n++] = "--oversubscribe";
    args[n++] = "-np";
    args[n++] = nps;
  }
  for (int i = 0; argv[i] != NULL; i++) {
    if (n == MPRUN__MAX_ARGS - 1) {
      fprintf(stderr, "mprun_start: too many arguments\n");
      return -1;
    }
    args[n++] = argv[i];
  }
  args[n] = NULL;
  if (!mprun__atexit_set) {
    atexit(mprun__kill_live);
    mprun__atexit_set = 1;
  }
  fflush(NULL); /* buffered output must not be written twice by the child */
  pid_t pid = fork();
  if (pid < 0) {
    perror("mprun_start: fork");
    return -1;
  }
  if (pid == 0) {
    if (log != NULL) {
      int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
      if (fd < 0) _exit(126);
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    }
    execv(args[0], (char *const *)args);
    fprintf(stderr, "mprun_start: cannot run %s\n", args[0]);
    _exit(127);
  }
  m->pid = pid;
  m->np = np;
  mprun__track(pid, 1);
  return 0;
}

int mprun_wait(mprun *m, long ms) {
  if (m->pid <= 0) return m->status;
  for (long t = 0; ms < 0 || t <= ms; t += 10) {
    int st;
    if (waitpid(m->pid, &st, WNOHANG) == m->pid) {
      mprun__track(m->pid, 0);
      m->pid = 0;
      m->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return m->status;
    }
    mprun__sleep_ms(10);
  }
  return -1;
}

/* pattern with the first "%r" replaced by r, into out. */
static void mprun__subst(char *out, size_t cap, const char *pattern, int r) {
  const char *at = strstr(pattern, "%r");
  if (at == NULL)
    snprintf(out, cap, "%s", pattern);
  else
    snprintf(out, cap, "%.*s%d%s", (int)(at - pattern), pattern, r, at + 2);
}

int mprun_wait_files(mprun *m, const char *pattern, long ms) {
  int n = m->np > 0 ? m->np : 1;
  long t = 0;
  for (int r = 0; r < n; r++) {
    char path[512];
    mprun__subst(path, sizeof path, pattern, r);
    for (; access(path, R_OK) != 0; t += 10) {
      if (mprun_wait(m, 0) >= 0) return 1;
      if (t > ms) return -1;
      mprun__sleep_ms(10);
    }
  }
  return 0;
}

/* The parent pid of pid from /proc/PID/stat ("pid (name) S ppid ..."), or -1. */
static pid_t mprun__ppid(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
  int ppid;
  char state;
  return p != NULL && sscanf(p + 1, " %c %d", &state, &ppid) == 2 ? (pid_t)ppid : -1;
}

/* 1 if pid's environment holds the entry want (whole, up to its NUL). */
static int mprun__env_has(pid_t pid, const char *want) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/environ", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return 0;
  enum { CAP = 1 << 16 };
  char *env = malloc(CAP);
  int found = 0;
  size_t n = env != NULL ? fread(env, 1, CAP, f) : 0;
  fclose(f);
  for (size_t at = 0; at < n && !found; at += strnlen(env + at, n - at) + 1)
    found = strncmp(env + at, want, n - at) == 0;
  free(env);
  return found;
}

/* The children of parent into kids (at most cap); their count. */
static int mprun__children(pid_t parent, pid_t *kids, int cap) {
  DIR *d = opendir("/proc");
  if (d == NULL) return 0;
  int n = 0;
  struct dirent *e;
  while (n < cap && (e = readdir(d)) != NULL) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (end != e->d_name && *end == '\0' && mprun__ppid((pid_t)pid) == parent)
      kids[n++] = (pid_t)pid;
  }
  closedir(d);
  return n;
}

pid_t mprun_rank_pid(const mprun *m, int r) {
  if (m->pid <= 0) return -1;
  if (m->np == 0) return r == 0 ? m->pid : -1;
  char want[48];
  snprintf(want, sizeof want, "OMPI_COMM_WORLD_RANK=%d", r);
  pid_t kids[256];
  int n = mprun__children(m->pid, kids, 256);
  for (int i = 0; i < n; i++)
    if (mprun__env_has(kids[i], want)) return kids[i];
  return -1;
}

int mprun_signal_ranks(const mprun *m, int sig) {
  if (m->pid <= 0) return 0;
  if (m->np == 0) return kill(m->pid, sig) == 0;
  pid_t kids[256];
  int n = mprun__children(m->pid, kids, 256), took = 0;
  for (int i = 0; i < n; i++) took += kill(kids[i], sig) == 0;
  return took;
}

int mprun_stop(mprun *m, int sig, long ms) {
  if (m->pid <= 0) return m->status;
  if (mprun_signal_ranks(m, sig) == 0) kill(m->pid, sig);
  int st = mprun_wait(m, ms);
  if (st < 0) {
    fprintf(stderr, "mprun_stop: %d did not exit within %ld ms of signal %d\n", (int)m->pid, ms,
            sig);
    kill(m->pid, SIGKILL);
    mprun_wait(m, -1);
    return -1;
  }
  return st;
}
