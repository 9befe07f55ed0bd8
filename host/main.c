/*
 * main.c -- precondd's options, startup (restore, pool, server), the periodic snapshot loop
 * and the graceful shutdown on SIGTERM/SIGINT.
 */
#include "precondd.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "preconditioner.h"
#include "rpc.h"

static void pd__config_free(pd_config *cfg) {
  free(cfg->tls_cert);
  free(cfg->tls_key);
  free(cfg->tls_client_ca);
  cfg->tls_cert = cfg->tls_key = cfg->tls_client_ca = NULL;
}

static void pd__usage(FILE *f) {
  fprintf(
      f,
      "Usage: precondd [OPTION]...\n"
      "Per-host daemon computing Shampoo's inverse matrix roots and K-FAC's damped inverses\n"
      "for training workers over gRPC (service precond.v1.Preconditioner; health:\n"
      "grpc.health.v1.Health).\n"
      "\n"
      "  --listen ADDRESS         where to listen: HOST:PORT or unix:/PATH (default\n"
      "                           127.0.0.1:50551; port 0 picks a free port; %%r: the MPI\n"
      "                           rank). A non-loopback\n"
      "                           address is refused unless --tls-cert/--tls-key is given\n"
      "                           (or --token-file with --insecure-token). Loopback means a\n"
      "                           unix socket or a host whose every address is loopback.\n"
      "  --token-file FILE        require metadata 'authorization: Bearer TOKEN' on every call\n"
      "                           (health check excepted); TOKEN is the file's first line.\n"
      "  --insecure-token         allow --token-file on a non-loopback address without TLS:\n"
      "                           the token then crosses the network in cleartext\n"

      "  --tls-cert FILE          serve TLS with this PEM certificate chain (with --tls-key);\n"
      "                           a non-loopback address is then allowed without a token\n"
      "  --tls-key FILE           the PEM private key of --tls-cert\n"
      "  --tls-client-ca FILE     with TLS: require client certificates signed by this CA\n"
      "  --port-file FILE         write the bound TCP port to FILE once listening\n"
      "  --state-dir DIR          snapshot directory (created if missing); without it nothing\n"
      "                           survives a restart\n"
      "  --snapshot-interval S    seconds between snapshots (default 60; 0: only at shutdown).\n"
      "                           A crash (kill -9, power loss) loses what was pushed since the\n"
      "                           last snapshot: at most one interval; clients are told (the\n"
      "                           daemon epoch and the step it resumed from, in every answer)\n"
      "  --threads N              root worker threads (default: online cores); OpenBLAS gets\n"
      "                           cores/N threads for a block of order 512 and up, 1 below,\n"
      "                           so the two never oversubscribe; 0: no\n"
      "                           pool (statistics are stored, no root is computed: for\n"
      "                           transport benchmarks, bench-daemon --wire)\n"
      "  --io-threads N           gRPC completion-queue pollers (default 4)\n"
      "  --shm-dir DIR|off        where same-host clients' shared-memory regions are made\n"
      "                           (default /dev/shm; off: clients send bytes over gRPC)\n"
      "  --grpc-arg KEY=INTEGER   a gRPC server channel argument over the tuned defaults\n"
      "                           (docs/precondd.md, Wire); repeat, up to 8\n"
      "  --max-message-mb N       largest request or response in MiB (default 256, at most 2047)\n"
      "  --memory-limit-mb N      budget for statistics and roots in MiB (default 4096); a\n"
      "                           Register that would pass it gets RESOURCE_EXHAUSTED\n"
      "  --job-memory-limit-mb N  what one job may reserve (records, statistics, a root\n"
      "                           per block) in MiB; a Register above it gets\n"
      "                           RESOURCE_EXHAUSTED naming the job (default 0: no limit\n"
      "                           beyond --memory-limit-mb)\n"
      "  --max-blocks-per-job N   (default 65536)\n"
      "  --failure-threshold X    roots with a larger residual error are not published\n"
      "                           (default 0.1); the previous root stays\n"
      "  --drift-threshold X      a block whose statistics moved less than X (relative, trace\n"
      "                           and random probes) since its root keeps it (default 0.01;\n"
      "                           0: always compute)\n");
  /* Two strings: one would pass the 4095 characters C99 compilers must accept. */
  fprintf(
      f,
      "  --warm-roots on|off      on: a block keeps the eigenbasis of its last roots and starts\n"
      "                           the next ones from it (docs/roots.md, \"Steady state\");\n"
      "                           off (default): every root is computed cold\n"
      "  --pool-nice N            the root workers' nice value, 0-19 (default 0: the daemon's):\n"
      "                           where a core is shared with a worker, the worker runs first\n"
      "  --grace-period S         at shutdown, calls in flight get S seconds (default 5)\n"
      "  --job-idle-expiry S      end a job with no Register, push or fetch for S seconds, as\n"
      "                           EndJob would (default 0: never). Restored jobs start idle at 0\n"
      "  --ended-jobs N           remember the names of the last N ended jobs (EndJob, idle\n"
      "                           expiry; default 1024, snapshotted): a Register of one is\n"
      "                           FAILED_PRECONDITION unless it sets reuse_ended_job, so a\n"
      "                           worker still running cannot bring an ended job back; 0: none\n"
      "  --log-level LEVEL        error, warn, info (default) or debug; logs go to stderr\n"
      "  --help                   this text\n"
      "  --version                print the version\n"
      "\n"
      "Replicas: under mpirun (mpirun -np R precondd --listen unix:/tmp/pd-%%r.sock\n"
      "--state-dir state-%%r ...) each rank is a daemon; %%r in --listen, --state-dir and\n"
      "--port-file becomes the rank (0 without mpirun; --state-dir needs it with R > 1). Every\n"
      "rank computes the roots of the blocks it owns (a greedy balance of n^3 per side, the\n"
      "same on every rank) and sends them to the others; a worker uses its local rank only.\n"
      "See docs/replicas.md.\n"
      "\n"
      "SIGTERM or SIGINT: stop accepting calls, finish those in flight, write a final snapshot,\n"
      "exit 0. See docs/precondd.md.\n");
}

static int pd__parse_num(const char *opt, const char *s, double lo, double hi, double *out) {
  char *end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || !end || end == s || *end || !(v >= lo && v <= hi)) {
    fprintf(stderr, "precondd: %s: '%s' is not a number in [%g, %g]\n", opt, s, lo, hi);
    return -1;
  }
  *out = v;
  return 0;
}

/* Reads a whole (PEM) file into a malloc'd string; NULL with a message on failure. */
static char *pd__read_file(const char *opt, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "precondd: %s %s: %s\n", opt, path, strerror(errno));
    return NULL;
  }
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  for (size_t k; buf && (k = fread(buf + n, 1, cap - n - 1, f)) > 0;) {
    n += k;
    if (n + 1 == cap) {
      char *nb = cap < ((size_t)1 << 24) ? realloc(buf, cap * 2) : NULL;
      if (!nb) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = nb;
      cap *= 2;
    }
  }
  fclose(f);
  if (!buf || n == 0) {
    fprintf(stderr, "precondd: %s %s: empty, unreadable or above 16 MiB\n", opt, path);
    free(buf);
    return NULL;
  }
  buf[n] = '\0';
  return buf;
}

static int pd__read_token(const char *path, char *out, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "precondd: --token-file %s: %s\n", path, strerror(errno));
    return -1;
  }
  char line[1024];
  if (!fgets(line, sizeof line, f)) line[0] = '\0';
  fclose(f);
  size_t n = strcspn(line, "\r\n");
  line[n] = '\0';
  if (n == 0 || n >= len) {
    fprintf(stderr,
            "precondd: --token-file %s: the first line must hold a token of 1 to %zu "
            "bytes\n",
            path, len - 1);
    return -1;
  }
  memcpy(out, line, n + 1);
  return 0;
}

/* 1 when every address of a resolved host is loopback (127.0.0.0/8, ::1, or 127.0.0.0/8
 * mapped into IPv6); 0 when it does not resolve. A name is resolved rather than matched by
 * prefix: "127.0.0.1.example.com" is a host name, not a loopback address. */
static int pd__host_is_loopback(const char *host) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host, NULL, &hints, &res) != 0 || !res) return 0;
  int all = 1;
  for (const struct addrinfo *a = res; a && all; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const struct sockaddr_in *v4 = (const struct sockaddr_in *)(const void *)a->ai_addr;
      all = (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const struct in6_addr *v6 =
          &((const struct sockaddr_in6 *)(const void *)a->ai_addr)->sin6_addr;
      all = IN6_IS_ADDR_LOOPBACK(v6) || (IN6_IS_ADDR_V4MAPPED(v6) && v6->s6_addr[12] == 127);
    } else {
      all = 0;
    }
  }
  freeaddrinfo(res);
  return all;
}

/* 1 for unix sockets and hosts that are loopback (see pd__host_is_loopback). The address is
 * HOST:PORT, [HOST]:PORT, or either after gRPC's "ipv4:" / "ipv6:" scheme. */
static int pd__is_local(const char *addr) {
  if (strncmp(addr, "unix:", 5) == 0 || strncmp(addr, "unix-abstract:", 14) == 0) return 1;
  if (strncmp(addr, "ipv4:", 5) == 0 || strncmp(addr, "ipv6:", 5) == 0) addr += 5;
  char host[512];
  const char *end;
  if (addr[0] == '[') {
    addr++;
    end = strchr(addr, ']');
  } else {
    end = strrchr(addr, ':');
  }
  if (!end || end == addr || (size_t)(end - addr) >= sizeof host) return 0;
  memcpy(host, addr, (size_t)(end - addr));
  host[end - addr] = '\0';
  return pd__host_is_loopback(host);
}

static int pd__parse(int argc, char **argv, pd_config *cfg) {
  enum {
    O_LISTEN = 256,
    O_STATE,
    O_THREADS,
    O_IO,
    O_MSG,
    O_MEM,
    O_BLOCKS,
    O_SNAP,
    O_FAIL,
    O_GRACE,
    O_TOKEN,
    O_PORTFILE,
    O_LOG,
    O_HELP,
    O_VERSION,
    O_CERT,
    O_KEY,
    O_CA,
    O_INSECURE,
    O_DRIFT,
    O_EXPIRY,
    O_ENDED,
    O_JOBMEM,
    O_WARM,
    O_GRPCARG,
    O_SHMDIR,
    O_POOLNICE
  };
  static const struct option opts[] = {{"listen", required_argument, NULL, O_LISTEN},
                                       {"state-dir", required_argument, NULL, O_STATE},
                                       {"threads", required_argument, NULL, O_THREADS},
                                       {"io-threads", required_argument, NULL, O_IO},
                                       {"max-message-mb", required_argument, NULL, O_MSG},
                                       {"memory-limit-mb", required_argument, NULL, O_MEM},
                                       {"job-memory-limit-mb", required_argument, NULL, O_JOBMEM},
                                       {"max-blocks-per-job", required_argument, NULL, O_BLOCKS},
                                       {"snapshot-interval", required_argument, NULL, O_SNAP},
                                       {"failure-threshold", required_argument, NULL, O_FAIL},
                                       {"drift-threshold", required_argument, NULL, O_DRIFT},
                                       {"warm-roots", required_argument, NULL, O_WARM},
                                       {"pool-nice", required_argument, NULL, O_POOLNICE},
                                       {"grpc-arg", required_argument, NULL, O_GRPCARG},
                                       {"shm-dir", required_argument, NULL, O_SHMDIR},
                                       {"grace-period", required_argument, NULL, O_GRACE},
                                       {"job-idle-expiry", required_argument, NULL, O_EXPIRY},
                                       {"ended-jobs", required_argument, NULL, O_ENDED},
                                       {"token-file", required_argument, NULL, O_TOKEN},
                                       {"insecure-token", no_argument, NULL, O_INSECURE},
                                       {"tls-cert", required_argument, NULL, O_CERT},
                                       {"tls-key", required_argument, NULL, O_KEY},
                                       {"tls-client-ca", required_argument, NULL, O_CA},
                                       {"port-file", required_argument, NULL, O_PORTFILE},
                                       {"log-level", required_argument, NULL, O_LOG},
                                       {"help", no_argument, NULL, O_HELP},
                                       {"version", no_argument, NULL, O_VERSION},
                                       {NULL, 0, NULL, 0}};
  int c, insecure_token = 0;
  double v;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
      case O_LISTEN:
        if (!*optarg || strlen(optarg) >= sizeof cfg->listen) goto bad_value;
        snprintf(cfg->listen, sizeof cfg->listen, "%s", optarg);
        break;
      case O_STATE:
        if (!*optarg || strlen(optarg) >= sizeof cfg->state_dir) goto bad_value;
        snprintf(cfg->state_dir, sizeof cfg->state_dir, "%s", optarg);
        break;
      case O_PORTFILE:
        if (!*optarg || strlen(optarg) >= sizeof cfg->port_file) goto bad_value;
        snprintf(cfg->port_file, sizeof cfg->port_file, "%s", optarg);
        break;
      case O_THREADS:
        if (pd__parse_num("--threads", optarg, 0, 1024, &v)) return 2;
        cfg->threads = (int)v;
        break;
      case O_GRPCARG: {
        /* Checked here so a typo stops the start; server.c applies them. */
        rpc_args check;
        rpc_args_init(&check, 0);
        if (cfg->ngrpc_args == 8 || strlen(optarg) >= sizeof cfg->grpc_args[0] ||
            rpc_args_parse(&check, optarg) != RPC_OK) {
          fprintf(stderr, "precondd: --grpc-arg wants KEY=INTEGER (at most 8): %s\n", optarg);
          return 2;
        }
        snprintf(cfg->grpc_args[cfg->ngrpc_args++], sizeof cfg->grpc_args[0], "%s", optarg);
        break;
      }
      case O_SHMDIR:
        if (!*optarg || strlen(optarg) >= sizeof cfg->shm_dir) goto bad_value;
        snprintf(cfg->shm_dir, sizeof cfg->shm_dir, "%s", strcmp(optarg, "off") ? optarg : "");
        break;
      case O_IO:
        if (pd__parse_num("--io-threads", optarg, 1, 256, &v)) return 2;
        cfg->io_threads = (int)v;
        break;
      case O_MSG:
        if (pd__parse_num("--max-message-mb", optarg, 1, 2047, &v)) return 2;
        cfg->max_message_bytes = (size_t)(v * 1048576.0);
        break;
      case O_MEM:
        if (pd__parse_num("--memory-limit-mb", optarg, 1, 1e9, &v)) return 2;
        cfg->memory_limit_bytes = (size_t)(v * 1048576.0);
        break;
      case O_JOBMEM:
        if (pd__parse_num("--job-memory-limit-mb", optarg, 0, 1e9, &v)) return 2;
        cfg->job_memory_limit_bytes = (size_t)(v * 1048576.0);
        break;
      case O_BLOCKS:
        if (pd__parse_num("--max-blocks-per-job", optarg, 1, 1e8, &v)) return 2;
        cfg->max_blocks_per_job = (uint32_t)v;
        break;
      case O_SNAP:
        if (pd__parse_num("--snapshot-interval", optarg, 0, 1e7, &v)) return 2;
        cfg->snapshot_interval_s = v;
        break;
      case O_FAIL:
        if (pd__parse_num("--failure-threshold", optarg, 0, 1e30, &v)) return 2;
        cfg->failure_threshold = v;
        break;
      case O_DRIFT:
        if (pd__parse_num("--drift-threshold", optarg, 0, 1, &v)) return 2;
        cfg->drift_threshold = v;
        break;
      case O_POOLNICE:
        if (pd__parse_num("--pool-nice", optarg, 0, 19, &v)) return 2;
        cfg->pool_nice = (int)v;
        break;
      case O_WARM:
        if (strcmp(optarg, "on") != 0 && strcmp(optarg, "off") != 0) {
          fprintf(stderr, "precondd: --warm-roots takes on or off, not %s\n", optarg);
          return 2;
        }
        cfg->warm_roots = strcmp(optarg, "on") == 0;
        break;
      case O_GRACE:
        if (pd__parse_num("--grace-period", optarg, 0, 3600, &v)) return 2;
        cfg->grace_s = v;
        break;
      case O_EXPIRY:
        if (pd__parse_num("--job-idle-expiry", optarg, 0, 1e9, &v)) return 2;
        cfg->job_idle_expiry_s = v;
        break;
      case O_ENDED:
        if (pd__parse_num("--ended-jobs", optarg, 0, PD_MAX_ENDED_JOBS, &v)) return 2;
        cfg->ended_jobs = (uint32_t)v;
        break;
      case O_TOKEN:
        if (pd__read_token(optarg, cfg->token, sizeof cfg->token)) return 2;
        break;
      case O_INSECURE:
        insecure_token = 1;
        break;
      case O_CERT:
        free(cfg->tls_cert);
        if (!(cfg->tls_cert = pd__read_file("--tls-cert", optarg))) return 2;
        break;
      case O_KEY:
        free(cfg->tls_key);
        if (!(cfg->tls_key = pd__read_file("--tls-key", optarg))) return 2;
        break;
      case O_CA:
        free(cfg->tls_client_ca);
        if (!(cfg->tls_client_ca = pd__read_file("--tls-client-ca", optarg))) return 2;
        break;
      case O_LOG:
        if (pd_log_parse_level(optarg, &cfg->log_level) != 0) {
          fprintf(stderr, "precondd: --log-level: '%s' is not error, warn, info or debug\n",
                  optarg);
          return 2;
        }
        break;
      case O_HELP:
        pd__usage(stdout);
        return 1;
      case O_VERSION:
        printf("precondd %s\n", PD_VERSION);
        return 1;
      default:
        fprintf(stderr, "precondd: unknown option or missing value: %s\n",
                optind > 0 && optind <= argc ? argv[optind - 1] : "?");
        pd__usage(stderr);
        return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "precondd: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (!cfg->tls_cert != !cfg->tls_key) {
    fprintf(stderr, "precondd: --tls-cert and --tls-key go together\n");
    return 2;
  }
  if (cfg->tls_client_ca && !cfg->tls_cert) {
    fprintf(stderr, "precondd: --tls-client-ca needs --tls-cert and --tls-key\n");
    return 2;
  }
  if (!cfg->tls_cert && !pd__is_local(cfg->listen)) {
    if (!*cfg->token) {
      fprintf(stderr,
              "precondd: refusing to listen on non-loopback address %s without "
              "--tls-cert/--tls-key or --token-file\n",
              cfg->listen);
      return 2;
    }
    if (!insecure_token) {
      fprintf(stderr,
              "precondd: refusing to send --token-file's token in cleartext on "
              "non-loopback address %s: add --tls-cert/--tls-key, or --insecure-token\n",
              cfg->listen);
      return 2;
    }
    fprintf(stderr, "precondd: warning: --insecure-token: the token crosses %s unencrypted\n",
            cfg->listen);
  }
  return 0;
bad_value:
  fprintf(stderr, "precondd: empty or too long value: %s\n", optarg);
  return 2;
}

/* Writes the port through a temporary file so a reader never sees a partial number. */
static int pd__write_port_file(const char *path, int port) {
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return -1;
  fprintf(f, "%d\n", port);
  if (fclose(f) != 0 || rename(tmp, path) != 0) return -1;
  return 0;
}

/* The start count in DIR/precondd.epoch; 0 when there is none. */
static uint64_t pd__epoch_read(const char *dir) {
  char path[1100];
  snprintf(path, sizeof path, "%s/precondd.epoch", dir);
  unsigned long long prev = 0;
  FILE *f = fopen(path, "r");
  if (f) {
    if (fscanf(f, "%llu", &prev) != 1) prev = 0;
    fclose(f);
  }
  return (uint64_t)prev;
}

/* Counts this start in DIR/precondd.epoch (written atomically and fsynced before anything
 * is served) and returns the new count in *epoch: one above the count there and above
 * floor. Root versions start above epoch << 40, so they never go backwards across a
 * restart, even after a crash that lost the roots that clients were holding. */
static int pd__epoch_next(const char *dir, uint64_t floor, uint64_t *epoch) {
  char path[1100], tmp[1110];
  snprintf(path, sizeof path, "%s/precondd.epoch", dir);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  uint64_t prev = pd__epoch_read(dir);
  *epoch = (prev > floor ? prev : floor) + 1;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  char text[32];
  int n = snprintf(text, sizeof text, "%llu\n", (unsigned long long)*epoch);
  int ok = write(fd, text, (size_t)n) == n && fsync(fd) == 0;
  if (close(fd) != 0) ok = 0;
  if (!ok || rename(tmp, path) != 0) return -1;
  int dfd = open(dir, O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return 0;
}

/* What this rank's state directory holds, for the other ranks (pd_replica_resume_plan). */
static pd_replica_view pd__view(const char *dir, int usable) {
  pd_replica_view v;
  memset(&v, 0, sizeof v);
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  v.propose = ((uint64_t)now.tv_sec << 32 ^ (uint64_t)now.tv_nsec << 8 ^ (uint64_t)getpid()) | 1;
  if (!usable) {
    v.state = PD_VIEW_FAILED;
    return v;
  }
  pd_snap_origin o;
  char err[512];
  int rc = pd_snapshot_peek(dir, &o, err, sizeof err);
  if (rc == PD_ENOENT) return v;
  if (rc != PD_OK) {
    v.state = PD_VIEW_BAD;
    return v;
  }
  v.state = o.njobs > 0 ? PD_VIEW_JOBS : PD_VIEW_EMPTY;
  v.rank = o.rank;
  v.nranks = o.nranks;
  v.run = o.run;
  return v;
}

/* Resumes under another rank count (docs/replicas.md): every rank takes the old ranks'
 * snapshots of their state directories (template with %r: the same --state-dir as theirs),
 * under MPI each read by one rank that can and broadcast (pd_replica_share_snapshots), alone
 * from the directories. 0, or -1 with the reason logged. */
static int pd__restore_resharded(pd_daemon *d, const char *template, const pd_resume_plan *p,
                                 pd_replica *rep) {
  const pd_replica_link *link = d->store.link;
  int rank = link ? link->rank : 0, nranks = link ? link->nranks : 1;
  char own[1100];
  snprintf(own, sizeof own, "%s", d->cfg.state_dir);
  if (p->old_nranks > 1 && !strstr(template, "%r")) {
    pd_log(PD_LOG_ERROR,
           "the snapshot in %s was written by a daemon job of %d ranks, and this one has %d: "
           "to resume from it this rank reads every old rank's state directory; start it "
           "with the --state-dir those ranks had, with %%r for the rank",
           own, p->old_nranks, nranks);
    return -1;
  }
  char(*dirs)[1100] = calloc((size_t)p->old_nranks, sizeof *dirs);
  const char **names = calloc((size_t)p->old_nranks, sizeof *names);
  pd_snap_bytes *bytes = NULL;
  int rc = -1, received = 0;
  uint64_t floor = 0;
  char err[1600] = "";
  int ok = dirs && names;
  if (!ok) pd_log(PD_LOG_ERROR, "out of memory at startup");
  for (int k = 0; ok && k < p->old_nranks; k++) {
    snprintf(dirs[k], sizeof dirs[k], "%s", template);
    if (pd_replica_subst(dirs[k], sizeof dirs[k], k) != 0) {
      pd_log(PD_LOG_ERROR, "--state-dir too long with %%r");
      ok = 0;
    }
    names[k] = dirs[k];
    uint64_t e = pd__epoch_read(dirs[k]); /* 0 where this rank cannot read it */
    if (e > floor) floor = e;
  }
#ifdef PD_HAVE_MPI
  /* Collective: every rank of the plan gets here, a rank that failed above too (with names
   * NULL), so that none waits for it. */
  if (rep && nranks > 1) {
    bytes = ok ? calloc((size_t)p->old_nranks, sizeof *bytes) : NULL;
    if (pd_replica_share_snapshots(rep, bytes ? names : NULL, p->old_nranks, bytes, &floor,
                                   &received) != PD_OK)
      ok = 0;
  }
#else
  (void)rep;
#endif
  if (!ok) {
    pd_log(PD_LOG_ERROR, "cannot resume the daemon job of %d rank(s) as rank %d of %d",
           p->old_nranks, rank, nranks);
    goto done;
  }
  /* A rank the old job did not have: what its directory holds is older than the job. */
  char aside[1300];
  if (rank >= p->old_nranks && pd_snapshot_set_aside_stale(own, aside, sizeof aside) == PD_OK)
    pd_log(PD_LOG_WARN,
           "%s/%s is from an earlier run (the daemon job last ran with %d ranks): set aside "
           "as %s",
           own, PD_SNAPSHOT_FILE, p->old_nranks, aside);
  /* Above every old rank's epoch: this rank now publishes units other ranks published. */
  if (pd__epoch_next(own, floor, &d->store.epoch) != 0) {
    pd_log(PD_LOG_ERROR, "--state-dir %s: cannot write precondd.epoch: %s", own, strerror(errno));
    goto done;
  }
  double t0 = pd_now();
  int r = pd_snapshot_read_resharded(&d->store, names, bytes, p->old_nranks, p->old_run, rank,
                                     nranks, err, sizeof err);
  if (r != PD_OK) {
    pd_log(PD_LOG_ERROR,
           "cannot resume the daemon job of %d rank(s) as rank %d of %d: %s (%s). Start it "
           "with %d rank(s) again, or move the state directories away to start empty",
           p->old_nranks, rank, nranks, err, pd_strerror(r), p->old_nranks);
    goto done;
  }
  size_t blocks = 0, mine = 0;
  for (size_t i = 0; i < d->store.njobs; i++)
    for (size_t k = 0; k < d->store.jobs[i]->nblocks; k++) {
      blocks++;
      mine += pd_replica_owns(link, &d->store.jobs[i]->blocks[k]);
    }
  pd_log(PD_LOG_INFO,
         "daemon epoch %llu; resumed %zu jobs of a daemon job of %d rank(s) as rank %d of %d: "
         "%zu of their %zu units are this rank's now, in %.3f s (%d of the old snapshots "
         "received from other ranks)",
         (unsigned long long)d->store.epoch, d->store.njobs, p->old_nranks, rank, nranks, mine,
         blocks, pd_now() - t0, received);
  rc = 0;
done:
  for (int k = 0; bytes && k < p->old_nranks; k++) free(bytes[k].data);
  free(bytes);
  free(dirs);
  free(names);
  return rc;
}

/* Restores the state directory: each rank its own snapshot, or, under another rank count
 * than the snapshots', the old ranks' (pd_replica_resume_plan; rep NULL: this daemon alone).
 * 0, 1 when resumed under another count (its snapshot is written once every rank started),
 * or -1. Every rank calls it (the view exchange is collective). */
static int pd__restore(pd_daemon *d, const char *template, pd_replica *rep) {
  int usable = 1;
  if (mkdir(d->cfg.state_dir, 0700) != 0 && errno != EEXIST) {
    pd_log(PD_LOG_ERROR, "--state-dir %s: %s", d->cfg.state_dir, strerror(errno));
    usable = 0;
  }
  const pd_replica_link *link = d->store.link;
  int nranks = link ? link->nranks : 1;
  pd_replica_view mine = pd__view(d->cfg.state_dir, usable), all[1], *views = all;
  all[0] = mine;
#ifdef PD_HAVE_MPI
  if (rep && nranks > 1) {
    views = calloc((size_t)nranks, sizeof *views);
    if (!views || pd_replica_exchange(rep, &mine, views) != PD_OK) {
      pd_log(PD_LOG_ERROR, "cannot learn what the other ranks' state directories hold");
      free(views);
      return -1;
    }
  }
#else
  (void)rep;
#endif
  int failed = 0;
  for (int r = 0; r < nranks; r++) failed |= views[r].state == PD_VIEW_FAILED;
  pd_resume_plan plan;
  pd_replica_resume_plan(views, nranks, &plan);
  if (views != all) free(views);
  if (failed) return -1; /* the rank that failed said why; the agreement stops them all */
  d->store.run = plan.run;
  if (plan.reshard) return pd__restore_resharded(d, template, &plan, rep) == 0 ? 1 : -1;

  if (pd__epoch_next(d->cfg.state_dir, 0, &d->store.epoch) != 0) {
    pd_log(PD_LOG_ERROR, "--state-dir %s: cannot write precondd.epoch: %s", d->cfg.state_dir,
           strerror(errno));
    return -1;
  }
  pd_log(PD_LOG_INFO, "daemon epoch %llu (start number with this state directory)",
         (unsigned long long)d->store.epoch);
  char err[512] = "";
  double t0 = pd_now();
  int rc = pd_snapshot_read(&d->store, d->cfg.state_dir, err, sizeof err);
  if (rc == PD_ENOENT) {
    pd_log(PD_LOG_INFO, "no snapshot in %s: starting empty", d->cfg.state_dir);
  } else if (rc == PD_ECORRUPT) {
    char aside[1300];
    if (pd_snapshot_set_aside(d->cfg.state_dir, aside, sizeof aside) == PD_OK)
      pd_log(PD_LOG_ERROR, "snapshot %s/%s is corrupt (%s): set aside as %s; starting empty",
             d->cfg.state_dir, PD_SNAPSHOT_FILE, err, aside);
    else
      pd_log(PD_LOG_ERROR, "snapshot %s/%s is corrupt (%s) and could not be renamed: %s",
             d->cfg.state_dir, PD_SNAPSHOT_FILE, err, strerror(errno));
  } else if (rc != PD_OK) {
    pd_log(PD_LOG_ERROR, "cannot restore the snapshot in %s: %s (%s)", d->cfg.state_dir, err,
           pd_strerror(rc));
    return -1;
  } else {
    size_t blocks = 0;
    for (size_t i = 0; i < d->store.njobs; i++) blocks += d->store.jobs[i]->nblocks;
    pd_log(PD_LOG_INFO, "restored %zu jobs, %zu blocks from %s/%s in %.3f s", d->store.njobs,
           blocks, d->cfg.state_dir, PD_SNAPSHOT_FILE, pd_now() - t0);
  }
  return 0;
}

/* Restored blocks whose statistics are newer than their root go back into the queue. */
static void pd__requeue(pd_daemon *d) {
  for (size_t i = 0; i < d->store.njobs; i++) {
    pd_job *j = d->store.jobs[i];
    for (size_t k = 0; k < j->nblocks; k++) {
      pd_block *b = &j->blocks[k];
      if (b->pushes > 0 && pd_replica_owns(j->link, b) &&
          (!atomic_load(&b->has_root) || atomic_load(&b->stat_step) > atomic_load(&b->root_step)))
        pd_sched_mark(&d->sched, b);
    }
  }
}

static void pd__snapshot(pd_daemon *d) {
  double t0 = pd_now();
  if (pd_snapshot_write(&d->store, d->cfg.state_dir) == PD_OK) {
    atomic_fetch_add(&d->stats.snapshots_written, 1);
    atomic_store(&d->stats.last_snapshot_time, pd_now());
    pd_log(PD_LOG_INFO, "snapshot written to %s/%s in %.3f s", d->cfg.state_dir, PD_SNAPSHOT_FILE,
           pd_now() - t0);
  }
}

/* Replicas: MPI starts only when an MPI launcher started this process (a daemon started
 * alone never initialises MPI: Open MPI's singleton init would start a helper process for
 * nothing), then %r in the paths becomes the rank. Returns 0, or an exit status. */
static int pd__replicas_init(int *argc, char ***argv, pd_config *cfg, void **rep,
                             pd_replica_link **link) {
  int size = 1, rank = 0;
  int launched = pd_replica_launched(&size);
  *rep = NULL;
  *link = NULL;
  if (launched && size > 1 && *cfg->state_dir && !strstr(cfg->state_dir, "%r")) {
    fprintf(stderr,
            "precondd: %d ranks would share --state-dir %s: put %%r in it (it becomes "
            "the rank)\n",
            size, cfg->state_dir);
    return 2;
  }
#ifdef PD_HAVE_MPI
  if (launched) {
    pd_replica *x = NULL;
    if (pd_replica_init(argc, argv, &x, &rank, &size) != PD_OK) return 1;
    *rep = x;
    *link = pd_replica_link_of(x);
    pd_log_set_rank(rank);
  }
#else
  (void)argc;
  (void)argv;
  if (launched && size > 1) {
    fprintf(stderr,
            "precondd: started by an MPI launcher with %d ranks, but built without "
            "MPI (meson -Dmpi=enabled, with libopenmpi-dev): each rank would be a separate "
            "daemon\n",
            size);
    return 2;
  }
#endif
  if (pd_replica_subst(cfg->listen, sizeof cfg->listen, rank) != 0 ||
      pd_replica_subst(cfg->state_dir, sizeof cfg->state_dir, rank) != 0 ||
      pd_replica_subst(cfg->port_file, sizeof cfg->port_file, rank) != 0) {
    fprintf(stderr, "precondd: --listen, --state-dir or --port-file too long with %%r\n");
    return 2;
  }
  if (*link) pd_log(PD_LOG_INFO, "replica rank %d of %d (listen %s)", rank, size, cfg->listen);
  return 0;
}

int main(int argc, char **argv) {
  static pd_daemon d;
  pd_config_default(&d.cfg);
  int prc = pd__parse(argc, argv, &d.cfg);
  if (prc) {
    pd__config_free(&d.cfg);
    return prc == 1 ? 0 : 2;
  }
  pd_log_set_level(d.cfg.log_level);
  /* Large messages reuse freed memory instead of fresh pages at every call (rpc.h). */
  if (rpc_keep_freed_memory() != RPC_OK) pd_log(PD_LOG_WARN, "malloc kept its own thresholds");
  /* Signals are taken synchronously by the main thread (sigtimedwait): block them before
   * any thread starts so that none of them receives one. MPI_Init (pd__replicas_init)
   * starts Open MPI's threads: blocked after it, a SIGTERM that came while the main thread
   * was out of its wait (writing a snapshot) went to one of those and ended the rank by the
   * default action, without its final snapshot, and mpirun exited 1 (test_killed_rank's
   * flake under load; test_replica checks every rank's thread masks). A signal that comes
   * during MPI_Init waits for the main loop. */
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  signal(SIGPIPE, SIG_IGN);
  void *rep = NULL; /* pd_replica under mpirun */
  pd_replica_link *link = NULL;
  char state_template[sizeof d.cfg.state_dir]; /* before %r becomes this rank */
  memcpy(state_template, d.cfg.state_dir, sizeof state_template);
  prc = pd__replicas_init(&argc, &argv, &d.cfg, &rep, &link);
  if (prc) {
    pd__config_free(&d.cfg);
    return prc;
  }

  int status = 1, ok = 1;
  pd_server *srv = NULL;
  int sched_started = 0;
  if (pd_stats_init(&d.stats) != PD_OK ||
      pd_store_init(&d.store, &d.stats, d.cfg.memory_limit_bytes, d.cfg.max_blocks_per_job) !=
          PD_OK) {
    pd_log(PD_LOG_ERROR, "out of memory at startup");
    pd__config_free(&d.cfg);
    return 1;
  }
  d.store.link = link; /* before any job: ownership is planned when a job is added */
  d.store.job_memory_limit = d.cfg.job_memory_limit_bytes;
  d.store.ended_max = d.cfg.ended_jobs;
  d.store.warm_roots = d.cfg.warm_roots; /* Register keeps room for the warm route's scratch */
  if (pd_shm_init(&d.shm, d.cfg.shm_dir, &d.store, &d.stats) != PD_OK) ok = 0;
  pd_shm_serve_bells(&d.shm, pd_service_bell, &d); /* pushes rung in a region */
  int resharded = 0;
  if (*d.cfg.state_dir) {
    int rrc = pd__restore(&d, state_template, rep);
    if (rrc < 0) ok = 0;
    resharded = rrc == 1;
  }
  if (ok && !*d.cfg.state_dir)
    pd_log(PD_LOG_WARN, "no --state-dir: statistics will not survive a restart");
  pd_sched_rules rules = {d.cfg.failure_threshold, d.cfg.drift_threshold, &d.store,
                          d.cfg.warm_roots, d.cfg.pool_nice};
  if (ok && pd_sched_start(&d.sched, d.cfg.threads, &d.stats, &rules) != PD_OK) {
    pd_log(PD_LOG_ERROR, "cannot start the worker pool");
    ok = 0;
  }
  sched_started = ok;
  if (ok) pd__requeue(&d);
  int port = 0;
  if (ok && pd_server_start(&d, &srv, &port) != PD_OK) ok = 0;
#ifdef PD_HAVE_MPI
  /* Every rank reaches this point, started or not: one that failed stops them all, with a
   * message, instead of leaving the others waiting for its roots. */
  if (rep && !pd_replica_agree(rep, ok)) {
    if (ok) pd_log(PD_LOG_ERROR, "another replica failed to start (see its log): stopping");
    ok = 0;
  }
  if (ok && rep && pd_replica_start(rep, &d) != PD_OK) {
    pd_log(PD_LOG_ERROR, "replicas: cannot start the communication thread: computing alone");
    atomic_store(&link->alone, 1);
  }
#endif
  /* Resumed under another rank count: every rank has read the old snapshots (the agreement),
   * so each now writes its own under the new count and run at once, and a crash from here
   * on resumes from these rather than from a mix of old and new. */
  if (ok && resharded) pd__snapshot(&d);
  if (!ok) goto done;
  char bound[32] = ""; /* the port that port 0 picked; nothing for a unix socket */
  if (port) snprintf(bound, sizeof bound, " (port %d)", port);
  pd_log(PD_LOG_INFO,
         "precondd %s listening on %s%s%s (max message %zu MiB, memory limit "
         "%zu MiB)",
         PD_VERSION, d.cfg.listen, bound,
         d.cfg.tls_cert ? (d.cfg.tls_client_ca ? " with TLS and client certificates" : " with TLS")
                        : "",
         d.cfg.max_message_bytes >> 20, d.cfg.memory_limit_bytes >> 20);
  if (*d.cfg.port_file && pd__write_port_file(d.cfg.port_file, port) != 0) {
    pd_log(PD_LOG_ERROR, "--port-file %s: %s", d.cfg.port_file, strerror(errno));
    goto done;
  }

  uint64_t seen_gen = atomic_load(&d.store.generation);
  uint64_t seen_roots = atomic_load(&d.stats.roots_computed);
  uint64_t seen_removed = atomic_load(&d.store.removed);
  double next = pd_now() + d.cfg.snapshot_interval_s;
  for (;;) {
    /* At least once a second: the idle expiry, and ended jobs written out. */
    double wait = 1.0;
    if (*d.cfg.state_dir && d.cfg.snapshot_interval_s > 0) {
      wait = next - pd_now();
      if (wait < 0.001) wait = 0.001;
      if (wait > 1.0) wait = 1.0;
    }
    struct timespec ts = {(time_t)wait, (long)((wait - (double)(time_t)wait) * 1e9)};
    int sig = sigtimedwait(&set, NULL, &ts);
    if (sig == SIGTERM || sig == SIGINT) {
      pd_log(PD_LOG_INFO, "%s received: shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
      break;
    }
    pd_service_expire(&d, pd_now());
    /* An ended job must not come back after a crash: the snapshot without it is written
     * now rather than an interval later. */
    uint64_t removed = atomic_load(&d.store.removed);
    if (removed != seen_removed) next = pd_now();
    if (*d.cfg.state_dir && d.cfg.snapshot_interval_s > 0 && pd_now() >= next) {
      seen_removed = removed;
      uint64_t gen = atomic_load(&d.store.generation);
      uint64_t roots = atomic_load(&d.stats.roots_computed);
      if (gen != seen_gen || roots != seen_roots) {
        pd__snapshot(&d);
        seen_gen = gen;
        seen_roots = roots;
      }
      next = pd_now() + d.cfg.snapshot_interval_s;
    }
  }
  status = 0;

done:
  if (srv) pd_server_stop(srv, d.cfg.grace_s);
  pd_shm_destroy(&d.shm); /* no call in flight any more */
#ifdef PD_HAVE_MPI
  pd_replica_quiesce(rep);
#endif
  if (sched_started) pd_sched_stop(&d.sched);
#ifdef PD_HAVE_MPI
  /* After the pool: the roots it published last still go out; before the snapshot: what
   * the other ranks still send is in it. */
  pd_replica_stop(rep, d.cfg.grace_s + 5);
#endif
  if (status == 0 && *d.cfg.state_dir) pd__snapshot(&d);
  pd_store_destroy(&d.store);
  pd_stats_destroy(&d.stats);
  pd__config_free(&d.cfg);
  if (status == 0) pd_log(PD_LOG_INFO, "stopped");
#ifdef PD_HAVE_MPI
  pd_replica_finalize(rep);
#endif
  return status;
}
