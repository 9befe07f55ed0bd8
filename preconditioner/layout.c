/*
 * layout.c -- Shampoo's block layout: which parts of a tensor get Kronecker factors.
 *
 * The layout must be a pure function of (rank, dims, opts): workers and every daemon replica
 * compute it independently and must agree block for block, so nothing here depends on the
 * machine, the thread count or the order of calls.
 *
 * Cutting rule: each axis of the 2-D view is cut into pieces of block_size, the last piece
 * holding the remainder (Distributed Shampoo and Lingvo cut the same way). Balanced pieces
 * would give slightly cheaper roots for awkward sizes, but a plain cut keeps the offsets
 * obvious to anyone reading a block id on the wire.
 */
#include <stdint.h>
#include <stdlib.h>

#include "preconditioner.h"

/* Defaults of the header; 4096 matches Lingvo's skip limit. */
#define PC_LAYOUT_DEFAULT_BLOCK 128
#define PC_LAYOUT_DEFAULT_SKIP  4096

void pc_layout_opts_default(pc_layout_opts *opts) {
  if (opts == NULL) return;
  opts->block_size = PC_LAYOUT_DEFAULT_BLOCK;
  opts->skip_limit = PC_LAYOUT_DEFAULT_SKIP;
}

/* Checks the arguments and computes the 2-D view. A product of dims that overflows size_t
 * is an error (no tensor that large can exist), not a silent wrap-around. */
static int layout_check(int rank, const size_t *dims, const pc_layout_opts *opts, size_t *rows,
                        size_t *cols) {
  if (dims == NULL || rank < 1) return PC_EINVAL;
  if (opts->block_size == 0 || opts->skip_limit == 0) return PC_EINVAL;
  for (int i = 0; i < rank; i++)
    if (dims[i] == 0) return PC_EINVAL;
  size_t c = 1;
  for (int i = 1; i < rank; i++) {
    if (c > SIZE_MAX / dims[i]) return PC_EINVAL;
    c *= dims[i];
  }
  if (c > SIZE_MAX / dims[0]) return PC_EINVAL;
  *rows = dims[0];
  *cols = c;
  return PC_OK;
}

static size_t ceil_div(size_t a, size_t b) {
  return a / b + (a % b != 0);
}

/* The one statement of the cutting rule: the view, whether it is diagonal, and the tiles per
 * axis. pc_layout_init lays the tiles out; pc_layout_count only counts them, so a daemon can
 * refuse an absurd job before allocating anything and still agree with every worker. */
static int layout_tiles(int rank, const size_t *dims, const pc_layout_opts *opts, size_t *rows,
                        size_t *cols, size_t *tr, size_t *tc) {
  int rc = layout_check(rank, dims, opts, rows, cols);
  if (rc != PC_OK) return rc;
  *tr = *tc = 0; /* diagonal: no tiles */
  if (rank == 1 || *rows > opts->skip_limit || *cols > opts->skip_limit) return PC_OK;
  *tr = ceil_div(*rows, opts->block_size);
  *tc = ceil_div(*cols, opts->block_size);
  /* rows, cols <= skip_limit here, but skip_limit is the caller's: keep the count honest. */
  if (*tr > SIZE_MAX / *tc || *tr * *tc > SIZE_MAX / sizeof(pc_block)) return PC_EINVAL;
  return PC_OK;
}

int pc_layout_count(int rank, const size_t *dims, const pc_layout_opts *opts, size_t *nblocks) {
  pc_layout_opts defaults;
  size_t rows, cols, tr, tc;
  if (nblocks == NULL) return PC_EINVAL;
  *nblocks = 0;
  if (opts == NULL) {
    pc_layout_opts_default(&defaults);
    opts = &defaults;
  }
  int rc = layout_tiles(rank, dims, opts, &rows, &cols, &tr, &tc);
  if (rc == PC_OK) *nblocks = tr * tc;
  return rc;
}

int pc_layout_init(pc_layout *layout, int rank, const size_t *dims, const pc_layout_opts *opts) {
  pc_layout_opts defaults;
  size_t rows = 0, cols = 0, tr = 0, tc = 0;
  if (layout == NULL) return PC_EINVAL;
  if (opts == NULL) {
    pc_layout_opts_default(&defaults);
    opts = &defaults;
  }
  layout->rows = layout->cols = 0;
  layout->diagonal = 0;
  layout->nblocks = 0;
  layout->blocks = NULL;
  int rc = layout_tiles(rank, dims, opts, &rows, &cols, &tr, &tc);
  if (rc != PC_OK) return rc;

  layout->rows = rows;
  layout->cols = cols;
  if (tr == 0) {
    layout->diagonal = 1;
    return PC_OK;
  }
  pc_block *blocks = malloc(tr * tc * sizeof *blocks);
  if (blocks == NULL) return PC_ENOMEM;

  size_t k = 0;
  for (size_t i = 0; i < tr; i++) {
    size_t r0 = i * opts->block_size;
    size_t nr = rows - r0 < opts->block_size ? rows - r0 : opts->block_size;
    for (size_t j = 0; j < tc; j++) {
      size_t c0 = j * opts->block_size;
      size_t nc = cols - c0 < opts->block_size ? cols - c0 : opts->block_size;
      blocks[k].row0 = r0;
      blocks[k].rows = nr;
      blocks[k].col0 = c0;
      blocks[k].cols = nc;
      k++;
    }
  }
  layout->nblocks = k;
  layout->blocks = blocks;
  return PC_OK;
}

void pc_layout_destroy(pc_layout *layout) {
  if (layout == NULL) return;
  free(layout->blocks);
  layout->blocks = NULL;
  layout->nblocks = 0;
}

uint64_t pc_root_window(uint64_t step, uint64_t id, uint64_t every) {
  if (every == 0) every = 1;
  return (step + id % every) / every;
}

uint64_t pc_root_window_start(uint64_t step, uint64_t id, uint64_t every) {
  if (every == 0) every = 1;
  uint64_t into = (step + id % every) % every; /* steps into the window */
  return step > into ? step - into : 0;
}
