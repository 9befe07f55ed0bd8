/*
 * config.c -- the defaults of every precondd option (main.c parses the command line over
 * them; tests start from them too).
 */
#include "precondd.h"

#include <string.h>
#include <unistd.h>

void pd_config_default(pd_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  snprintf(cfg->listen, sizeof cfg->listen, "127.0.0.1:50551");
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  cfg->threads = cores > 0 ? (int)cores : 1;
  cfg->io_threads = 4;
  cfg->max_message_bytes = (size_t)256 << 20;
  cfg->memory_limit_bytes = (size_t)4096 << 20;
  /* Off: a per-host daemon usually serves one job, which may use the whole budget; a daemon
   * shared by several jobs sets one so that none can take it all. */
  cfg->job_memory_limit_bytes = 0;
  cfg->max_blocks_per_job = 65536;
  cfg->snapshot_interval_s = 60;
  cfg->failure_threshold = 0.1;
  /* Statistics that moved by less than 1% (trace and random quadratic forms) keep their
   * root: it would move by about 0.25% (p = 4), well under the 1-3% fp32 floor of any root
   * (docs/precondd.md, "Root pool"). */
  cfg->drift_threshold = 0.01;
  /* Warm-started roots (--warm-roots on) are off by default: measured against the cold
   * coupled-Newton roots they replace, they differ by up to 2% on the near-singular Gram
   * sums of the load test (tests/load), above its 1e-3 check (docs/roots.md, "Steady state in precondd"). */
  cfg->warm_roots = 0;
  cfg->grace_s = 5;
  cfg->job_idle_expiry_s = 0; /* off: a paused job (a checkpointed run) keeps its statistics */
  /* Names of 1024 ended jobs (at most 256 KiB) are remembered: enough for every job a
   * per-host daemon serves (PD_MAX_JOBS) to end once before the oldest is forgotten. */
  cfg->ended_jobs = 1024;
  cfg->log_level = PD_LOG_INFO;
  /* Same-host clients' regions: tmpfs where there is one (memory, not disk, behind them). */
  if (access("/dev/shm", W_OK) == 0) snprintf(cfg->shm_dir, sizeof cfg->shm_dir, "/dev/shm");
}
