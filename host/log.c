/*
 * log.c -- leveled, timestamped log lines on stderr (one fprintf a line, so lines from
 * several threads never interleave), and the thread names that profilers and
 * /proc/PID/task show.
 */
#include "precondd.h"

#include <stdarg.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

static _Atomic int pd__log_threshold = PD_LOG_INFO;
static _Atomic int pd__log_rank = -1; /* under mpirun: lines say which rank wrote them */

static const char *const pd__level_names[] = {"ERROR", "WARN", "INFO", "DEBUG"};

void pd_thread_name(const char *name) {
#ifdef __linux__
  prctl(PR_SET_NAME, name, 0, 0, 0); /* what pthread_setname_np does, without _GNU_SOURCE */
#else
  (void)name;
#endif
}

void pd_log_set_level(pd_log_level level) {
  atomic_store(&pd__log_threshold, (int)level);
}

void pd_log_set_rank(int rank) {
  atomic_store(&pd__log_rank, rank);
}

int pd_log_parse_level(const char *s, pd_log_level *out) {
  static const char *const names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++) {
    if (s && strcmp(s, names[i]) == 0) {
      *out = (pd_log_level)i;
      return 0;
    }
  }
  return -1;
}

void pd_log(pd_log_level level, const char *fmt, ...) {
  if ((int)level > atomic_load(&pd__log_threshold)) return;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char who[32] = "";
  int rank = atomic_load(&pd__log_rank);
  if (rank >= 0) snprintf(who, sizeof who, "[%d]", rank);
  fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s precondd%s: %s\n", tm.tm_year + 1900,
          tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
          pd__level_names[level], who, msg);
}
