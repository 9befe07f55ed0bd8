/* precondd_proc.c -- starting and stopping a real precondd for tests and benchmarks
 * (precondd_proc.h). */
#include "precondd_proc.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Daemons started and not yet seen to exit: killed at exit (a failed cmocka assertion
 * longjmps past the test's stop). */
enum { PDPROC__MAX_LIVE = 32 };
static pid_t pdproc__live[PDPROC__MAX_LIVE];
static int pdproc__atexit_set;

static void pdproc__kill_live(void) {
  for (int i = 0; i < PDPROC__MAX_LIVE; i++)
    if (pdproc__live[i] > 0) {
      kill(pdproc__live[i], SIGKILL);
      waitpid(pdproc__live[i], NULL, 0);
      pdproc__live[i] = 0;
    }
}

static void pdproc__track(pid_t pid, int add) {
  for (int i = 0; i < PDPROC__MAX_LIVE; i++)
    if (add ? pdproc__live[i] == 0 : pdproc__live[i] == pid) {
      pdproc__live[i] = add ? pid : 0;
      return;
    }
}

static void pdproc__sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

static int pdproc__status(int st) {
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

void pdproc_opts_default(pdproc_opts *o) {
  memset(o, 0, sizeof *o);
  o->threads = 1;
  o->wait_ms = 20000;
}

/* The child: stdout to /dev/null, stderr to the log unless inherited, then exec. */
static void pdproc__exec(const pdproc *d, const char *const *argv) {
  int nul = open("/dev/null", O_RDWR);
  if (nul >= 0) dup2(nul, STDOUT_FILENO);
  if (d->log[0] != '\0') {
    int fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd < 0) _exit(126);
    dup2(fd, STDERR_FILENO);
  }
  execv(argv[0], (char *const *)argv);
  perror("exec precondd");
  _exit(127);
}

int pdproc_start(pdproc *d, const pdproc_opts *opts) {
  pdproc_opts def;
  if (opts == NULL) {
    pdproc_opts_default(&def);
    opts = &def;
  }
  const char *path = opts->path != NULL ? opts->path : getenv("PRECONDD");
  if (path == NULL || d->pid > 0) {
    fprintf(stderr, "pdproc_start: %s\n",
            path == NULL ? "no precondd path ($PRECONDD)" : "the daemon is already running");
    return -1;
  }
  if (d->dir[0] == '\0') {
    snprintf(d->dir, sizeof d->dir, "/tmp/precondd-test-XXXXXX");
    if (mkdtemp(d->dir) == NULL) {
      perror("pdproc_start: mkdtemp");
      d->dir[0] = '\0';
      return -1;
    }
    d->own_dir = 1;
  }
  const char *listen = opts->listen != NULL ? opts->listen : "127.0.0.1:0";
  char port_file[200], state[200], threads[16], io[16], grace[16];
  snprintf(port_file, sizeof port_file, "%s/port", d->dir);
  snprintf(state, sizeof state, "%s/state", d->dir);
  snprintf(threads, sizeof threads, "%d", opts->threads);
  snprintf(io, sizeof io, "%d", opts->io_threads);
  snprintf(grace, sizeof grace, "%d", opts->grace_period);
  if (opts->inherit_stderr)
    d->log[0] = '\0';
  else
    snprintf(d->log, sizeof d->log, "%s/precondd.log", d->dir);
  unlink(port_file);

  const char *argv[64];
  int argc = 0;
  argv[argc++] = path;
  argv[argc++] = "--listen";
  argv[argc++] = listen;
  argv[argc++] = "--port-file";
  argv[argc++] = port_file;
  argv[argc++] = "--threads";
  argv[argc++] = threads;
  const char *state_dir = opts->state_dir != NULL ? opts->state_dir : state;
  if (state_dir[0] != '\0') {
    argv[argc++] = "--state-dir";
    argv[argc++] = state_dir;
  }
  if (opts->io_threads > 0) {
    argv[argc++] = "--io-threads";
    argv[argc++] = io;
  }
  if (opts->grace_period > 0) {
    argv[argc++] = "--grace-period";
    argv[argc++] = grace;
  }
  if (opts->log_level != NULL) {
    argv[argc++] = "--log-level";
    argv[argc++] = opts->log_level;
  }
  for (int i = 0; opts->extra != NULL && opts->extra[i] != NULL; i++) {
    if (argc == 63) {
      fprintf(stderr, "pdproc_start: too many options\n");
      return -1;
    }
    argv[argc++] = opts->extra[i];
  }
  argv[argc] = NULL;

  if (!pdproc__atexit_set) {
    atexit(pdproc__kill_live);
    pdproc__atexit_set = 1;
  }
  fflush(NULL); /* buffered output must not be written twice by the child */
  pid_t pid = fork();
  if (pid < 0) {
    perror("pdproc_start: fork");
    return -1;
  }
  if (pid == 0) pdproc__exec(d, argv);
  d->pid = pid;
  d->port = 0;
  pdproc__track(pid, 1);

  /* The port file is written (atomically) once the daemon listens, for unix sockets too. */
  for (int waited = 0; waited <= opts->wait_ms; waited += 10) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      pdproc__track(pid, 0);
      d->pid = 0;
      return 1000 + pdproc__status(st);
    }
    FILE *f = fopen(port_file, "r");
    if (f != NULL) {
      int port = -1;
      int got = fscanf(f, "%d", &port);
      fclose(f);
      if (got == 1 && port >= 0) {
        d->port = port;
        if (strncmp(listen, "unix:", 5) == 0)
          snprintf(d->addr, sizeof d->addr, "%s", listen);
        else
          snprintf(d->addr, sizeof d->addr, "127.0.0.1:%d", port);
        return 0;
      }
    }
    pdproc__sleep_ms(10);
  }
  fprintf(stderr, "pdproc_start: precondd did not write %s within %d ms (log: %s)\n", port_file,
          opts->wait_ms, d->log[0] ? d->log : "stderr");
  pdproc_stop(d, SIGKILL);
  return -1;
}

int pdproc_start_in(pdproc *d, const char *path, const char *dir) {
  pdproc_opts o;
  pdproc_opts_default(&o);
  o.path = path;
  o.log_level = "warn";
  if (dir != NULL) snprintf(d->dir, sizeof d->dir, "%s", dir);
  return pdproc_start(d, &o);
}

int pdproc_stop(pdproc *d, int sig) {
  if (d->pid <= 0) return -1;
  pid_t pid = d->pid;
  kill(pid, sig);
  int st = 0, status = -1;
  for (int i = 0; i < 3000; i++) {
    if (waitpid(pid, &st, WNOHANG) == pid) {
      status = pdproc__status(st);
      break;
    }
    pdproc__sleep_ms(10);
  }
  if (status < 0) {
    fprintf(stderr, "pdproc_stop: precondd %d did not exit within 30 s of signal %d\n", (int)pid,
            sig);
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  }
  pdproc__track(pid, 0);
  d->pid = 0;
  return status;
}

void pdproc_destroy(pdproc *d) {
  pdproc_stop(d, SIGTERM);
  if (d->own_dir) {
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", d->dir);
    if (system(cmd) != 0) fprintf(stderr, "pdproc_destroy: could not remove %s\n", d->dir);
    d->dir[0] = '\0';
    d->own_dir = 0;
  }
}

int pdproc_log_contains(const pdproc *d, const char *needle) {
  if (d->log[0] == '\0') return 0;
  FILE *f = fopen(d->log, "r");
  if (f == NULL) return 0;
  enum { CAP = 1 << 20 };
  char *buf = malloc(CAP + 1);
  int found = 0;
  if (buf != NULL) {
    size_t n = fread(buf, 1, CAP, f);
    buf[n] = '\0';
    found = strstr(buf, needle) != NULL;
    free(buf);
  }
  fclose(f);
  return found;
}

/* 1 if a loopback TCP socket can bind port now (released again at once). */
static int port_bindable(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons((uint16_t)port);
  int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
  close(fd);
  return ok;
}

/* The port is taken below the kernel's ephemeral range (ip_local_port_range), because
 * between this call and the daemon's bind the port is free: one the kernel hands out (a
 * port-0 bind, or any outgoing connection of a test running beside this one) could land on
 * it, and the daemon would then fail to start. Ports below the range are only ever taken
 * by name, so only another caller of this function could collide, once in thousands. */
int pdproc_free_port(void) {
  int lo = 32768; /* Linux's default low end when /proc cannot be read */
  FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  if (f != NULL) {
    if (fscanf(f, "%d", &lo) != 1) lo = 32768;
    fclose(f);
  }
  const int first = 10000; /* clear of the well-known and registered ports in common use */
  if (lo - first < 1000) return 0;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  unsigned seed = (unsigned)getpid() * 2654435761u ^ (unsigned)ts.tv_nsec;
  for (int tries = 0; tries < 64; tries++) {
    seed = seed * 1103515245u + 12345u;
    int port = first + (int)((seed >> 8) % (unsigned)(lo - first));
    if (port_bindable(port)) return port;
  }
  return 0;
}
