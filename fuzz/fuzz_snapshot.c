/*
 * fuzz_snapshot.c -- libFuzzer harness: precondd's snapshot reader. The input is one byte
 * choosing the format (1 + byte % 5: every format the reader takes), then a payload; the
 * harness writes it behind a header whose magic, format, length and both CRC-32s are
 * right, so every input reaches the parser instead of stopping at the checksum. Each read
 * goes into a fresh store under the daemon's own limits; anything loaded is freed again.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "precondd.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char g_dir[64];

static void le(unsigned char *out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) out[i] = (unsigned char)(v >> (8 * i));
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  pd_log_set_level(PD_LOG_ERROR);
  snprintf(g_dir, sizeof g_dir, "/tmp/pd-fuzz-snap-XXXXXX");
  if (!mkdtemp(g_dir)) abort();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  unsigned format = 1u + data[0] % 5u;
  data++;
  size--;
  unsigned char h[32];
  memcpy(h, "PCDSNAP1", 8);
  le(h + 8, format, 4);
  le(h + 12, 0, 4);
  le(h + 16, size, 8);
  le(h + 24, crc32(crc32(0L, Z_NULL, 0), data, (uInt)size), 4);
  le(h + 28, crc32(crc32(0L, Z_NULL, 0), h, 28), 4);
  char path[128];
  snprintf(path, sizeof path, "%s/%s", g_dir, PD_SNAPSHOT_FILE);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(h, 1, sizeof h, f) != sizeof h || fwrite(data, 1, size, f) != size) abort();
  fclose(f);
  pd_stats stats;
  pd_store st;
  char err[512];
  if (pd_stats_init(&stats) != PD_OK ||
      pd_store_init(&st, &stats, (size_t)256 << 20, 4096) != PD_OK)
    abort();
  pd_config cfg;
  pd_config_default(&cfg);
  st.ended_max = cfg.ended_jobs; /* the ended names are kept as by the daemon */
  int rc = pd_snapshot_read(&st, g_dir, err, sizeof err);
  /* A refusal loads nothing. */
  if (rc != PD_OK && st.njobs != 0 && rc != PD_ENOMEM) abort();
  pd_store_destroy(&st);
  if (atomic_load(&stats.memory_bytes) != 0) abort();
  pd_stats_destroy(&stats);
  return 0;
}
