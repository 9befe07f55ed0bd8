/*
 * precondctl.c -- the operator's CLI for precondd: daemon stats, per-block figures, a
 * health probe and ending a job, as tables (default) or JSON (--json), built on libprecond.
 *
 * Exit status: 0 success (health: SERVING); 1 usage error; 2 daemon unreachable or an RPC
 * failed (one line on stderr says why); 3 health answered but not SERVING.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format.h"
#include "precond.h"
#include "rpc.h"

enum { EXIT_USAGE = 1, EXIT_RPC = 2, EXIT_NOT_SERVING = 3 };

#define DEFAULT_ADDR "127.0.0.1:50551"

static void usage(FILE *f) {
  fprintf(f,
          "usage: precondctl [--addr A] [--token-file F] [--timeout MS] [--job J] [--json]\n"
          "                  stats|health|blocks|end-job JOB\n"
          "\n"
          "  stats    daemon-wide figures and the job table (GetStats)\n"
          "  blocks   per-block figures: versions, staleness, roots, errors (GetStats);\n"
          "           K-FAC layers in their own table: factor orders A and G, pi, the\n"
          "           dampings and age of the published inverses, compute time\n"
          "  health   grpc.health.v1 check; exit 0 if SERVING, 3 otherwise\n"
          "  end-job JOB  EndJob: the daemon frees the job's statistics and roots and\n"
          "           leaves it out of its snapshots; it remembers the name, so workers\n"
          "           still running are refused instead of registering the job again\n"
          "           (a new run of that name sets reuse_ended_job)\n"
          "\n"
          "  --addr A        daemon address, host:port or unix:/path (default %s,\n"
          "                  or $PRECOND_ADDR)\n"
          "  --token-file F  file holding the shared token (sent as a bearer token)\n"
          "  --timeout MS    deadline of the call (default 2000)\n"
          "  --job J         only this job (stats, blocks)\n"
          "  --json          one JSON document on stdout instead of a table\n"
          "  --help          this text\n"
          "\n"
          "exit status: 0 ok, 1 usage, 2 daemon unreachable or call failed, 3 not serving\n",
          DEFAULT_ADDR);
}

/* Reads the first line of path into a malloc'd string without surrounding whitespace.
 * Returns NULL (with a message on stderr) if the file cannot be read or holds no token. */
static char *read_token(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL) {
    fprintf(stderr, "precondctl: cannot read token file %s\n", path);
    return NULL;
  }
  char line[4096];
  char *tok = NULL;
  if (fgets(line, sizeof line, f) != NULL) {
    char *s = line;
    while (*s == ' ' || *s == '\t') s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t'))
      s[--n] = '\0';
    if (n > 0 && (tok = malloc(n + 1)) != NULL) memcpy(tok, s, n + 1);
  }
  fclose(f);
  if (tok == NULL) fprintf(stderr, "precondctl: token file %s holds no token\n", path);
  return tok;
}

int main(int argc, char **argv) {
  const char *addr = getenv("PRECOND_ADDR");
  const char *token_file = NULL, *job = NULL, *cmd = NULL, *arg = NULL;
  int json = 0, timeout_ms = 2000;
  if (addr == NULL || addr[0] == '\0') addr = DEFAULT_ADDR;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "--addr") == 0 || strcmp(a, "--token-file") == 0 ||
               strcmp(a, "--timeout") == 0 || strcmp(a, "--job") == 0) {
      if (i + 1 >= argc) {
        fprintf(stderr, "precondctl: %s needs a value (see --help)\n", a);
        return EXIT_USAGE;
      }
      const char *v = argv[++i];
      if (strcmp(a, "--addr") == 0) {
        addr = v;
      } else if (strcmp(a, "--token-file") == 0) {
        token_file = v;
      } else if (strcmp(a, "--job") == 0) {
        job = v;
      } else {
        char *end = NULL;
        long ms = strtol(v, &end, 10);
        if (end == v || *end != '\0' || ms <= 0 || ms > 3600000) {
          fprintf(stderr, "precondctl: --timeout wants milliseconds in 1..3600000, got '%s'\n", v);
          return EXIT_USAGE;
        }
        timeout_ms = (int)ms;
      }
    } else if (a[0] == '-') {
      fprintf(stderr, "precondctl: unknown option '%s' (see --help)\n", a);
      return EXIT_USAGE;
    } else if (cmd == NULL) {
      cmd = a;
    } else if (arg == NULL && strcmp(cmd, "end-job") == 0) {
      arg = a;
    } else {
      fprintf(stderr, "precondctl: one command only, got '%s' and '%s'\n", cmd, a);
      return EXIT_USAGE;
    }
  }
  if (cmd == NULL) {
    usage(stderr);
    return EXIT_USAGE;
  }
  int is_stats = strcmp(cmd, "stats") == 0, is_blocks = strcmp(cmd, "blocks") == 0;
  int is_health = strcmp(cmd, "health") == 0, is_end = strcmp(cmd, "end-job") == 0;
  if (!is_stats && !is_blocks && !is_health && !is_end) {
    fprintf(stderr, "precondctl: unknown command '%s' (stats, health, blocks or end-job)\n", cmd);
    return EXIT_USAGE;
  }
  if (is_end && (arg == NULL || arg[0] == '\0')) {
    fprintf(stderr, "precondctl: end-job needs the job's name (see --help)\n");
    return EXIT_USAGE;
  }

  int rc = EXIT_RPC;
  char *token = NULL;
  precond_client *client = NULL;
  precond_stats stats = {0};
  if (token_file != NULL && (token = read_token(token_file)) == NULL) return EXIT_USAGE;

  precond_options opts;
  precond_options_default(&opts);
  opts.addr = addr;
  opts.token = token;
  opts.background = 0;
  opts.connect_timeout_ms = 0; /* the call itself finds out, within its deadline */
  /* Fail fast: a refused connection is UNAVAILABLE at once rather than at the deadline
   * (a daemon that is up but slow still has the whole deadline to answer). */
  opts.wait_for_ready = 0;
  opts.call_timeout_ms = timeout_ms;
  int st = precond_connect(&opts, &client);
  if (st != PRECOND_OK) {
    fprintf(stderr, "precondctl: %s: %s\n", addr, precond_strerror(st));
    goto cleanup;
  }

  if (is_end) {
    precond_ended e;
    st = precond_end_job(client, arg, &e);
    if (st == PRECOND_OK) {
      if (json) {
        printf("{\"job\": ");
        rpc_json_string(stdout, arg);
        printf(", \"ended\": true, \"blocks\": %u, \"last_step\": %llu, \"bytes\": %llu}\n",
               e.blocks, (unsigned long long)e.last_step, (unsigned long long)e.bytes);
      } else
        printf("ended job %s: %u blocks, last step %llu, %llu bytes freed\n", arg, e.blocks,
               (unsigned long long)e.last_step, (unsigned long long)e.bytes);
      rc = 0;
      goto cleanup;
    }
  } else if (is_health) {
    int serving = 0;
    const char *name = NULL;
    st = precond_health(client, "", &serving, &name);
    if (st == PRECOND_OK) {
      precond__format_health(stdout, addr, name, json);
      rc = serving ? 0 : EXIT_NOT_SERVING;
      goto cleanup;
    }
  } else {
    st = precond_get_stats(client, job, is_blocks, &stats);
    if (st == PRECOND_OK) {
      int w = is_blocks ? precond__format_blocks(stdout, &stats, json)
                        : precond__format_stats(stdout, &stats, json);
      rc = w == 0 ? 0 : EXIT_RPC;
      goto cleanup;
    }
  }
  char detail[256];
  precond_last_error(client, detail, sizeof detail);
  if (st == PRECOND_ETIMEDOUT || st == PRECOND_EUNAVAILABLE)
    fprintf(stderr, "precondctl: cannot reach precondd at %s (%s)\n", addr, detail);
  else
    fprintf(stderr, "precondctl: %s: %s (%s)\n", addr, precond_strerror(st), detail);

cleanup:
  precond_stats_destroy(&stats);
  precond_close(client);
  free(token);
  return rc;
}
