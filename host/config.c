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
  cfg->max_blocks_per_job = 65536;
  cfg->snapshot_interval_s = 60;
  cfg->failure_threshold = 0.1;
  cfg->grace_s = 5;
  cfg->log_level = PD_LOG_INFO;
}
