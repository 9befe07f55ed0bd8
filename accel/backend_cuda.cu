/*
 * backend_cuda.cu -- the CUDA backend: device memory from cudaMalloc, one stream per backend,
 * cuBLAS for gemm and syrk, and one kernel per remaining primitive. Arguments were checked
 * by backend.c. Scalar formulas (unary ops, random numbers, packed indices) come from
 * ac_internal.h, the same code the CPU backend runs, so the backends agree by construction
 * where they can (bit-exact uniforms and dropout masks) and to rounding elsewhere.
 *
 * Row-major on a column-major library: a row-major m x n matrix with row stride ld is the
 * column-major n x m matrix with leading dimension ld, its transpose. So row-major
 * C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the gemm call swaps A and B.
 */
#include <cstdio>
#include <cstring>
#include <new>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "ac_internal.h"

namespace {

struct cuda_state {
  int device;
  cudaStream_t stream;
  cublasHandle_t blas;
  float *scratch; /* dense syrk output and reduction partials */
  size_t scratch_bytes;
  double *partials_host; /* pinned, for ac_sum_to_host */
};

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 65535;
constexpr int kSumBlocks = 1024;

cuda_state *st(ac_backend *be) {
  return static_cast<cuda_state *>(be->impl);
}

/* Blocks for a grid-stride loop over n elements. */
unsigned blocks_for(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < kMaxBlocks ? (b > 0 ? b : 1) : kMaxBlocks);
}

int launched() {
  return cudaGetLastError() == cudaSuccess ? AC_OK : AC_EDEVICE;
}

int cuda_rc(cudaError_t e) {
  if (e == cudaSuccess) return AC_OK;
  return e == cudaErrorMemoryAllocation ? AC_ENOMEM : AC_EDEVICE;
}

int blas_rc(cublasStatus_t s) {
  if (s == CUBLAS_STATUS_SUCCESS) return AC_OK;
  return s == CUBLAS_STATUS_ALLOC_FAILED ? AC_ENOMEM : AC_EDEVICE;
}

/* Makes the backend's device current (a no-op when it already is). */
int use(ac_backend *be) {
  return cuda_rc(cudaSetDevice(st(be)->device));
}

#define GRID_STRIDE(i, n)                                                 \
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)gridDim.x * blockDim.x)

/* Grows the scratch buffer to at least bytes. */
int scratch(ac_backend *be, size_t bytes, float **out) {
  cuda_state *s = st(be);
  if (s->scratch_bytes < bytes) {
    if (s->scratch != nullptr) {
      cudaStreamSynchronize(s->stream);
      cudaFree(s->scratch);
      s->scratch = nullptr;
      s->scratch_bytes = 0;
    }
    int rc = cuda_rc(cudaMalloc(reinterpret_cast<void **>(&s->scratch), bytes));
    if (rc != AC_OK) return rc;
    s->scratch_bytes = bytes;
  }
  *out = s->scratch;
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Block reductions (blockDim.x == kThreads)                                               */

template <typename T, typename Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T buf[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads(); /* buf may still be read by a previous call */
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  if (warp == 0) {
    /* Lanes past the warp count hold a copy of buf[0]; the shuffles below only fold
     * lanes 0 .. kThreads/32 - 1 into lane 0, so the copies never count twice. */
    v = lane < kThreads / 32 ? buf[lane] : buf[0];
    for (int o = kThreads / 64; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
    if (lane == 0) buf[0] = v;
  }
  __syncthreads();
  return buf[0];
}

struct add_op {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
/* NaN wins, as in the CPU loop. */
struct max_op {
  __device__ float operator()(float a, float b) const {
    return (b > a || isnan(b)) ? b : a;
  }
};

/* ------------------------------------------------------------------------------------ */
/* Kernels                                                                                 */

template <typename T>
__global__ void k_fill(size_t n, T *x, T v) {
  GRID_STRIDE(i, n) x[i] = v;
}

struct perm_args {
  int ndim;
  size_t yshape[AC_MAX_DIMS];
  size_t xstride[AC_MAX_DIMS]; /* x stride of y's axis d */
};

__global__ void k_permute(size_t n, perm_args a, const float *x, float *y) {
  GRID_STRIDE(o, n) {
    size_t rest = o, src = 0;
    for (int d = a.ndim - 1; d >= 0; d--) {
      src += (rest % a.yshape[d]) * a.xstride[d];
      rest /= a.yshape[d];
    }
    y[o] = x[src];
  }
}

__global__ void k_scale(size_t rows, size_t cols, float beta, float *c, size_t ldc) {
  GRID_STRIDE(e, rows * cols) {
    size_t i = e / cols, j = e % cols;
    c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
  }
}

/* dense: n x n, its row-major upper triangle valid (column-major lower). */
__global__ void k_pack_beta(size_t n, const float *dense, size_t ld, float beta, float *packed) {
  GRID_STRIDE(e, n * n) {
    size_t i = e / n, j = e % n;
    if (j >= i) {
      size_t p = ac__packed_index(n, i, j);
      float g = dense[i * ld + j];
      packed[p] = beta == 0.0f ? g : g + beta * packed[p];
    }
  }
}

__global__ void k_unpack(size_t n, const float *packed, float *dense, size_t ld) {
  GRID_STRIDE(e, n * n) {
    size_t i = e / n, j = e % n;
    dense[i * ld + j] =
        j >= i ? packed[ac__packed_index(n, i, j)] : packed[ac__packed_index(n, j, i)];
  }
}

__global__ void k_binary(int op, size_t n, const float *a, const float *b, float *out) {
  GRID_STRIDE(i, n) out[i] = ac__binary_value(op, a[i], b[i]);
}

__global__ void k_axpby(size_t n, float alpha, const float *x, float beta, const float *y,
                        float *out) {
  GRID_STRIDE(i, n) out[i] = beta == 0.0f ? alpha * x[i] : alpha * x[i] + beta * y[i];
}

__global__ void k_affine(size_t n, float alpha, const float *x, float beta, float *out) {
  GRID_STRIDE(i, n) out[i] = alpha * x[i] + beta;
}

__global__ void k_unary(int op, size_t n, const float *x, float *out) {
  GRID_STRIDE(i, n) out[i] = ac__unary_value(op, x[i]);
}

__global__ void k_unary_backward(int op, size_t n, const float *x, const float *dy, float *dx) {
  GRID_STRIDE(i, n) dx[i] = dy[i] * ac__unary_deriv(op, x[i]);
}

__global__ void k_bcast(int op, size_t outer, size_t mid, size_t inner, const float *x,
                        const float *v, float *out) {
  GRID_STRIDE(e, outer * mid * inner) out[e] = ac__binary_value(op, x[e], v[(e / inner) % mid]);
}

/* One block per mid index (grid-stride over mid). */
__global__ void k_reduce(int op, size_t outer, size_t mid, size_t inner, float alpha,
                         const float *x, float beta, float *out) {
  for (size_t m = blockIdx.x; m < mid; m += gridDim.x) {
    size_t count = outer * inner;
    float acc = op == AC_REDUCE_MAX ? -INFINITY : 0.0f;
    for (size_t t = threadIdx.x; t < count; t += blockDim.x) {
      size_t o = t / inner, i = t % inner;
      float e = x[(o * mid + m) * inner + i];
      if (op == AC_REDUCE_SUM)
        acc += e;
      else if (op == AC_REDUCE_MAX)
        acc = max_op()(acc, e);
      else
        acc += e * e;
    }
    acc = op == AC_REDUCE_MAX ? block_reduce(acc, max_op()) : block_reduce(acc, add_op());
    if (threadIdx.x == 0) {
      if (op == AC_REDUCE_NORM2) acc = sqrtf(acc);
      float r = alpha * acc;
      out[m] = beta == 0.0f ? r : r + beta * out[m];
    }
  }
}

/* inner == 1 with many columns (bias gradients): one thread per column walks down the rows,
 * so a warp reads consecutive addresses. */
__global__ void k_reduce_columns(int op, size_t outer, size_t mid, float alpha, const float *x,
                                 float beta, float *out) {
  GRID_STRIDE(m, mid) {
    float acc = op == AC_REDUCE_MAX ? -INFINITY : 0.0f;
    for (size_t o = 0; o < outer; o++) {
      float e = x[o * mid + m];
      if (op == AC_REDUCE_SUM)
        acc += e;
      else if (op == AC_REDUCE_MAX)
        acc = max_op()(acc, e);
      else
        acc += e * e;
    }
    if (op == AC_REDUCE_NORM2) acc = sqrtf(acc);
    float r = alpha * acc;
    out[m] = beta == 0.0f ? r : r + beta * out[m];
  }
}

/* Batch norm's per-channel passes: the reductions run one block per channel (grid-stride
 * over channels), the maps one thread per element. */
__global__ void k_channel_moments(size_t outer, size_t mid, size_t inner, const float *x,
                                  float *mean, float *var) {
  for (size_t m = blockIdx.x; m < mid; m += gridDim.x) {
    size_t count = outer * inner;
    double s = 0.0, q = 0.0;
    for (size_t t = threadIdx.x; t < count; t += blockDim.x) {
      double e = x[((t / inner) * mid + m) * inner + t % inner];
      s += e;
      q += e * e;
    }
    s = block_reduce(s, add_op());
    q = block_reduce(q, add_op());
    if (threadIdx.x == 0) {
      double mu = count > 0 ? s / (double)count : 0.0;
      double v = count > 0 ? q / (double)count - mu * mu : 0.0;
      mean[m] = (float)mu;
      var[m] = (float)(v > 0.0 ? v : 0.0);
    }
  }
}

__global__ void k_channel_affine(size_t outer, size_t mid, size_t inner, const float *x,
                                 const float *scale, const float *shift, const float *res, int relu,
                                 float *y) {
  GRID_STRIDE(e, outer * mid * inner) {
    size_t m = (e / inner) % mid;
    float v = AC__FADD(AC__FMUL(x[e], scale[m]), shift[m]);
    if (res != nullptr) v = AC__FADD(v, res[e]);
    y[e] = relu && !(v > 0.0f) ? 0.0f : v;
  }
}

__global__ void k_channel_grad_sums(size_t outer, size_t mid, size_t inner, const float *dy,
                                    const float *mask, const float *x, const float *center,
                                    float *gout, float *sum_g, float *sum_gx) {
  for (size_t m = blockIdx.x; m < mid; m += gridDim.x) {
    size_t count = outer * inner;
    float c = center[m];
    double sg = 0.0, sgx = 0.0;
    for (size_t t = threadIdx.x; t < count; t += blockDim.x) {
      size_t e = ((t / inner) * mid + m) * inner + t % inner;
      float g = mask != nullptr && !(mask[e] > 0.0f) ? 0.0f : dy[e];
      if (gout != nullptr) gout[e] = g;
      sg += g;
      sgx += (double)g * (double)(x[e] - c);
    }
    sg = block_reduce(sg, add_op());
    sgx = block_reduce(sgx, add_op());
    if (threadIdx.x == 0) {
      sum_g[m] = (float)sg;
      sum_gx[m] = (float)sgx;
    }
  }
}

__global__ void k_channel_combine(size_t outer, size_t mid, size_t inner, const float *dy,
                                  const float *mask, const float *x, const float *a, const float *b,
                                  const float *c, float *dx) {
  GRID_STRIDE(e, outer * mid * inner) {
    size_t m = (e / inner) % mid;
    float g = mask != nullptr && !(mask[e] > 0.0f) ? 0.0f : dy[e];
    float v = AC__FMUL(a[m], g);
    if (b != nullptr) v = AC__FADD(v, AC__FMUL(b[m], x[e]));
    if (c != nullptr) v = AC__FADD(v, c[m]);
    dx[e] = v;
  }
}

__global__ void k_sum_partials(size_t n, const float *x, int squares, double *partials) {
  double acc = 0.0;
  GRID_STRIDE(i, n) acc += squares ? (double)x[i] * x[i] : (double)x[i];
  acc = block_reduce(acc, add_op());
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

struct argbest {
  float v;
  int32_t i;
};

/* One thread per row: the scan in column order, as the CPU's (cpu_sample_rows). */
__global__ void k_sample_rows(size_t rows, size_t cols, const float *probs, const float *u,
                              int32_t *labels) {
  for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows;
       r += (size_t)gridDim.x * blockDim.x) {
    const float *row = probs + r * cols;
    if (labels[r] < 0 || (size_t)labels[r] >= cols) continue;
    float sum = 0.0f;
    for (size_t j = 0; j < cols; j++) sum = __fadd_rn(sum, row[j]);
    if (!(sum > 0.0f) || !isfinite(sum)) continue;
    float target = __fmul_rn(u[r], sum), acc = 0.0f;
    int32_t pick = -1;
    for (size_t j = 0; j < cols; j++) {
      acc = __fadd_rn(acc, row[j]);
      if (row[j] > 0.0f) pick = (int32_t)j;
      if (target < acc && row[j] > 0.0f) break;
    }
    labels[r] = pick;
  }
}

__global__ void k_argmax_rows(size_t rows, size_t cols, const float *x, int32_t *idx) {
  __shared__ float sv[kThreads];
  __shared__ int32_t si[kThreads];
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *row = x + r * cols;
    float best = row[0];
    int32_t bi = 0;
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
      if (row[j] > best || (row[j] == best && (int32_t)j < bi)) {
        best = row[j];
        bi = (int32_t)j;
      }
    __syncthreads();
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if ((int)threadIdx.x < s) {
        float ov = sv[threadIdx.x + s];
        int32_t oi = si[threadIdx.x + s];
        if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
          sv[threadIdx.x] = ov;
          si[threadIdx.x] = oi;
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) idx[r] = si[0];
  }
}

/* Softmax of one row by one block; returns the log-sum-exp. y may alias x. */
__device__ float block_softmax_row(size_t cols, const float *x, float *y) {
  float mx = -INFINITY;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) mx = fmaxf(mx, x[j]);
  mx = block_reduce(mx, max_op());
  float s = 0.0f;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) s += expf(x[j] - mx);
  s = block_reduce(s, add_op());
  float inv = 1.0f / s;
  for (size_t j = threadIdx.x; j < cols; j += blockDim.x) y[j] = expf(x[j] - mx) * inv;
  return mx + logf(s);
}

__global__ void k_softmax_rows(size_t rows, size_t cols, const float *x, float *y) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x)
    block_softmax_row(cols, x + r * cols, y + r * cols);
}

__global__ void k_softmax_rows_backward(size_t rows, size_t cols, const float *y, const float *dy,
                                        float *dx) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *yr = y + r * cols, *dyr = dy + r * cols;
    float dot = 0.0f;
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x) dot += dyr[j] * yr[j];
    dot = block_reduce(dot, add_op());
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
      dx[r * cols + j] = yr[j] * (dyr[j] - dot);
  }
}

__global__ void k_mask_causal(size_t batch, size_t t, float *x, float value) {
  GRID_STRIDE(e, batch * t * t) {
    size_t i = (e / t) % t, j = e % t;
    if (j > i) x[e] = value;
  }
}

__global__ void k_xent_forward(size_t rows, size_t cols, const float *logits, const int32_t *labels,
                               float *probs, float *loss) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int32_t label = labels[r];
    bool counted = label >= 0 && (size_t)label < cols;
    /* Read before block_softmax_row writes probs (which may alias logits): its first
     * block_reduce synchronises the block before any write. */
    float target = counted ? logits[r * cols + label] : 0.0f;
    float lse = block_softmax_row(cols, logits + r * cols, probs + r * cols);
    if (threadIdx.x == 0) loss[r] = counted ? lse - target : 0.0f;
    __syncthreads();
  }
}

__global__ void k_xent_backward(size_t rows, size_t cols, const float *probs, const int32_t *labels,
                                float scale, float *dlogits) {
  GRID_STRIDE(e, rows * cols) {
    size_t r = e / cols, j = e % cols;
    int32_t label = labels[r];
    bool counted = label >= 0 && (size_t)label < cols;
    float onehot = counted && (size_t)label == j ? 1.0f : 0.0f;
    dlogits[e] = counted ? scale * (probs[e] - onehot) : 0.0f;
  }
}

__global__ void k_layernorm_forward(size_t rows, size_t cols, float eps, const float *x,
                                    const float *gamma, const float *beta, float *y, float *mean,
                                    float *rstd) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *xr = x + r * cols;
    float s = 0.0f;
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j];
    float mu = block_reduce(s, add_op()) / (float)cols;
    float q = 0.0f;
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x) q += (xr[j] - mu) * (xr[j] - mu);
    float rs = 1.0f / sqrtf(block_reduce(q, add_op()) / (float)cols + eps);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
      y[r * cols + j] = (xr[j] - mu) * rs * gamma[j] + (beta != nullptr ? beta[j] : 0.0f);
  }
}

/* dx of one row per block; runs after k_layernorm_params, as dx may alias dy. */
__global__ void k_layernorm_dx(size_t rows, size_t cols, const float *x, const float *gamma,
                               const float *mean, const float *rstd, const float *dy, float *dx) {
  for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *xr = x + r * cols, *dyr = dy + r * cols;
    float m = mean[r], rs = rstd[r], sg = 0.0f, sgx = 0.0f;
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
      float g = dyr[j] * gamma[j];
      sg += g;
      sgx += g * (xr[j] - m) * rs;
    }
    float mg = block_reduce(sg, add_op()) / (float)cols;
    float mgx = block_reduce(sgx, add_op()) / (float)cols;
    for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
      float xhat = (xr[j] - m) * rs;
      dx[r * cols + j] = rs * (dyr[j] * gamma[j] - mg - xhat * mgx);
    }
  }
}

/* dgamma and dbeta: one thread per column walks down the rows (coalesced). */
__global__ void k_layernorm_params(size_t rows, size_t cols, const float *x, const float *mean,
                                   const float *rstd, const float *dy, float *dgamma,
                                   float *dbeta) {
  GRID_STRIDE(j, cols) {
    float sg = 0.0f, sb = 0.0f;
    for (size_t r = 0; r < rows; r++) {
      float d = dy[r * cols + j];
      sg += d * (x[r * cols + j] - mean[r]) * rstd[r];
      sb += d;
    }
    dgamma[j] += sg;
    if (dbeta != nullptr) dbeta[j] += sb;
  }
}

__global__ void k_gather_rows(size_t n, size_t cols, const float *table, size_t table_rows,
                              const int32_t *idx, float *out) {
  GRID_STRIDE(e, n * cols) {
    int32_t r = idx[e / cols];
    out[e] = r >= 0 && (size_t)r < table_rows ? table[(size_t)r * cols + e % cols] : 0.0f;
  }
}

__global__ void k_scatter_add_rows(size_t n, size_t cols, const float *src, const int32_t *idx,
                                   float *table, size_t table_rows) {
  GRID_STRIDE(e, n * cols) {
    int32_t r = idx[e / cols];
    if (r >= 0 && (size_t)r < table_rows) atomicAdd(table + (size_t)r * cols + e % cols, src[e]);
  }
}

struct geom {
  size_t n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow;
};

geom make_geom(const ac_conv2d_geom *g, size_t oh, size_t ow) {
  return geom{g->n,        g->c,        g->h,     g->w,     g->kh, g->kw,
              g->stride_h, g->stride_w, g->pad_h, g->pad_w, oh,    ow};
}

/* Offset of row r = (ch, p, q) of image b in the column matrix: ac_im2col's (n, ckk, ohw)
 * or, merged, ac_im2col_batch's (ckk, n ohw). */
__device__ size_t col_row(const geom &g, int merged, size_t b, size_t r) {
  size_t ohw = g.oh * g.ow;
  return merged ? r * g.n * ohw + b * ohw : (b * g.c * g.kh * g.kw + r) * ohw;
}

/* One thread per col entry (b, ch, p, q, y, x). */
__global__ void k_im2col(geom g, int merged, const float *x, float *col) {
  size_t ohw = g.oh * g.ow, kk = g.kh * g.kw, total = g.n * g.c * kk * ohw;
  GRID_STRIDE(e, total) {
    size_t pix = e % ohw, rest = e / ohw; /* rest = (b * c + ch) * kk + p * kw + q */
    size_t q = rest % g.kw, p = (rest / g.kw) % g.kh, plane = rest / kk;
    size_t b = plane / g.c, ch = plane % g.c;
    size_t yo = pix / g.ow, xo = pix % g.ow;
    size_t iy = yo * g.sh + p - g.ph, ix = xo * g.sw + q - g.pw; /* wraps in the padding */
    col[col_row(g, merged, b, ch * kk + p * g.kw + q) + pix] =
        iy < g.h && ix < g.w ? x[(plane * g.h + iy) * g.w + ix] : 0.0f;
  }
}

/* One thread per input pixel: the sum over the col entries that read it (no atomics). */
__global__ void k_col2im(geom g, int merged, const float *col, float *x) {
  size_t total = g.n * g.c * g.h * g.w;
  GRID_STRIDE(e, total) {
    size_t ix = e % g.w, iy = (e / g.w) % g.h, plane = e / (g.h * g.w);
    size_t b = plane / g.c, ch = plane % g.c;
    float s = 0.0f;
    for (size_t p = 0; p < g.kh; p++) {
      size_t ty = iy + g.ph; /* = yo * sh + p */
      if (ty < p || (ty - p) % g.sh != 0 || (ty - p) / g.sh >= g.oh) continue;
      size_t yo = (ty - p) / g.sh;
      for (size_t q = 0; q < g.kw; q++) {
        size_t tx = ix + g.pw;
        if (tx < q || (tx - q) % g.sw != 0 || (tx - q) / g.sw >= g.ow) continue;
        size_t xo = (tx - q) / g.sw;
        s += col[col_row(g, merged, b, (ch * g.kh + p) * g.kw + q) + yo * g.ow + xo];
      }
    }
    x[e] = s;
  }
}

/* Max or average pooling: one thread per output. */
__global__ void k_pool_forward(int op, geom g, const float *x, float *y, int32_t *argmax) {
  size_t total = g.n * g.c * g.oh * g.ow;
  float inv = 1.0f / (float)(g.kh * g.kw);
  GRID_STRIDE(o, total) {
    size_t xo = o % g.ow, yo = (o / g.ow) % g.oh, plane = o / (g.oh * g.ow);
    const float *in = x + plane * g.h * g.w;
    float best = -INFINITY, sum = 0.0f;
    size_t besti = (size_t)-1;
    for (size_t p = 0; p < g.kh; p++)
      for (size_t q = 0; q < g.kw; q++) {
        size_t iy = yo * g.sh + p - g.ph, ix = xo * g.sw + q - g.pw;
        if (iy >= g.h || ix >= g.w) continue;
        float v = in[iy * g.w + ix];
        sum += v;
        if (besti == (size_t)-1 || v > best) {
          best = v;
          besti = iy * g.w + ix;
        }
      }
    y[o] = op == AC_POOL_MAX ? best : sum * inv;
    if (argmax != nullptr) argmax[o] = (int32_t)besti;
  }
}

__global__ void k_maxpool_backward(geom g, const float *dy, const int32_t *argmax, float *dx) {
  size_t total = g.n * g.c * g.oh * g.ow, hw = g.h * g.w;
  GRID_STRIDE(o, total) {
    int32_t a = argmax[o];
    if (a >= 0 && (size_t)a < hw) atomicAdd(dx + (o / (g.oh * g.ow)) * hw + (size_t)a, dy[o]);
  }
}

/* One thread per input pixel, like col2im: the windows covering it, each dy / (kh kw). */
__global__ void k_avgpool_backward(geom g, const float *dy, float *dx) {
  size_t total = g.n * g.c * g.h * g.w;
  float inv = 1.0f / (float)(g.kh * g.kw);
  GRID_STRIDE(e, total) {
    size_t ix = e % g.w, iy = (e / g.w) % g.h, plane = e / (g.h * g.w);
    float s = 0.0f;
    for (size_t p = 0; p < g.kh; p++) {
      size_t ty = iy + g.ph;
      if (ty < p || (ty - p) % g.sh != 0 || (ty - p) / g.sh >= g.oh) continue;
      for (size_t q = 0; q < g.kw; q++) {
        size_t tx = ix + g.pw;
        if (tx < q || (tx - q) % g.sw != 0 || (tx - q) / g.sw >= g.ow) continue;
        s += dy[(plane * g.oh + (ty - p) / g.sh) * g.ow + (tx - q) / g.sw] * inv;
      }
    }
    dx[e] = s;
  }
}

__global__ void k_rand(int dist, uint64_t seed, uint64_t offset, size_t n, float a, float b,
                       float *out) {
  GRID_STRIDE(i, n) out[i] = ac__rand_value(dist, seed, offset + i, a, b);
}

__global__ void k_adamw(size_t n, float *p, const float *g, float *m, float *v, float lr, float b1,
                        float b2, float eps, float wd, float bc1, float bc2) {
  GRID_STRIDE(i, n) {
    float mi = b1 * m[i] + (1.0f - b1) * g[i];
    float vi = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    p[i] -= lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * p[i]);
  }
}

__global__ void k_moment_graft(size_t n, const float *g, float *f, float *v, float *x, float *d,
                               ac_moment_graft_args a) {
  GRID_STRIDE(i, n) {
    float gi = g[i], fi = a.f_new * gi + a.f_keep * f[i];
    float xi = a.x_g == 0.0f ? a.x_f * fi : a.x_g * gi + a.x_f * fi;
    float vi = a.v_new * (gi * gi) + a.v_keep * v[i];
    f[i] = fi;
    v[i] = vi;
    x[i] = xi;
    d[i] = xi / (sqrtf(a.v_scale * vi) + a.eps);
  }
}

/* ------------------------------------------------------------------------------------ */
/* ac__ops entries                                                                         */

#define STREAM(be) (st(be)->stream)
#define USE(be)                           \
  do {                                    \
    int use_rc_ = use(be);                \
    if (use_rc_ != AC_OK) return use_rc_; \
  } while (0)
#define LAUNCH(be, kernel, grid, ...)                         \
  do {                                                        \
    USE(be);                                                  \
    kernel<<<(grid), kThreads, 0, STREAM(be)>>>(__VA_ARGS__); \
    return launched();                                        \
  } while (0)

void cu_destroy(ac_backend *be) {
  cuda_state *s = st(be);
  if (s == nullptr) return;
  cudaSetDevice(s->device);
  if (s->stream != nullptr) cudaStreamSynchronize(s->stream);
  cudaFree(s->scratch);
  cudaFreeHost(s->partials_host);
  if (s->blas != nullptr) cublasDestroy(s->blas);
  if (s->stream != nullptr) cudaStreamDestroy(s->stream);
  delete s;
  be->impl = nullptr;
}

int cu_sync(ac_backend *be) {
  USE(be);
  return cuda_rc(cudaStreamSynchronize(STREAM(be)));
}

int cu_malloc(ac_backend *be, size_t bytes, void **out) {
  USE(be);
  int rc = cuda_rc(cudaMalloc(out, bytes));
  if (rc != AC_OK) *out = nullptr;
  return rc;
}

void cu_free(ac_backend *be, void *p) {
  if (use(be) != AC_OK) return;
  cudaStreamSynchronize(STREAM(be));
  cudaFree(p);
}

int cu_copy(ac_backend *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
            bool wait) {
  USE(be);
  int rc = cuda_rc(cudaMemcpyAsync(dst, src, bytes, kind, STREAM(be)));
  if (rc == AC_OK && wait) rc = cuda_rc(cudaStreamSynchronize(STREAM(be)));
  return rc;
}

int cu_h2d(ac_backend *be, void *dst, const void *src, size_t bytes) {
  return cu_copy(be, dst, src, bytes, cudaMemcpyHostToDevice, true);
}

int cu_d2h(ac_backend *be, void *dst, const void *src, size_t bytes) {
  return cu_copy(be, dst, src, bytes, cudaMemcpyDeviceToHost, true);
}

int cu_d2d(ac_backend *be, void *dst, const void *src, size_t bytes) {
  return cu_copy(be, dst, src, bytes, cudaMemcpyDeviceToDevice, false);
}

int cu_fill_f32(ac_backend *be, size_t n, float *x, float v) {
  LAUNCH(be, k_fill<float>, blocks_for(n), n, x, v);
}

int cu_fill_i32(ac_backend *be, size_t n, int32_t *x, int32_t v) {
  LAUNCH(be, k_fill<int32_t>, blocks_for(n), n, x, v);
}

int cu_copy2d(ac_backend *be, size_t rows, size_t cols, const float *src, size_t lds, float *dst,
              size_t ldd) {
  USE(be);
  return cuda_rc(cudaMemcpy2DAsync(dst, ldd * sizeof(float), src, lds * sizeof(float),
                                   cols * sizeof(float), rows, cudaMemcpyDeviceToDevice,
                                   STREAM(be)));
}

int cu_permute(ac_backend *be, int ndim, const size_t *shape, const int *perm, const float *x,
               float *y) {
  perm_args a;
  size_t xstride[AC_MAX_DIMS], numel = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    xstride[d] = numel;
    numel *= shape[d];
  }
  a.ndim = ndim;
  for (int d = 0; d < ndim; d++) {
    a.yshape[d] = shape[perm[d]];
    a.xstride[d] = xstride[perm[d]];
  }
  LAUNCH(be, k_permute, blocks_for(numel), numel, a, x, y);
}

bool int_ok(size_t v) {
  return v <= 0x7fffffffu;
}

int cu_sgemm_batched(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k,
                     float alpha, const float *a, size_t lda, size_t stride_a, const float *b,
                     size_t ldb, size_t stride_b, float beta, float *c, size_t ldc, size_t stride_c,
                     size_t batch) {
  if (!int_ok(m) || !int_ok(n) || !int_ok(k) || !int_ok(lda) || !int_ok(ldb) || !int_ok(ldc) ||
      !int_ok(batch))
    return AC_EINVAL;
  USE(be);
  if (k == 0) {
    for (size_t i = 0; i < batch; i++) {
      k_scale<<<blocks_for(m * n), kThreads, 0, STREAM(be)>>>(m, n, beta, c + i * stride_c, ldc);
      if (launched() != AC_OK) return AC_EDEVICE;
    }
    return AC_OK;
  }
  /* Column-major C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m). */
  return blas_rc(cublasSgemmStridedBatched(st(be)->blas, tb == AC_TRANS ? CUBLAS_OP_T : CUBLAS_OP_N,
                                           ta == AC_TRANS ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n,
                                           (int)m, (int)k, &alpha, b, (int)ldb, (long long)stride_b,
                                           a, (int)lda, (long long)stride_a, &beta, c, (int)ldc,
                                           (long long)stride_c, (int)batch));
}

/* The Gram matrix's upper triangle (row-major) into dense n x n device memory. */
static int syrk_dense(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                      const float *a, size_t lda, float *dense) {
  const float zero = 0.0f;
  if (k == 0) return cuda_rc(cudaMemsetAsync(dense, 0, n * n * sizeof(float), STREAM(be)));
  /* Row-major A (n x k) is column-major A^T: C = A A^T is op = T on it; row-major A
   * (k x n) for A^T A is column-major n x k: op = N. Column-major lower = row-major upper. */
  return blas_rc(cublasSsyrk(st(be)->blas, CUBLAS_FILL_MODE_LOWER,
                             trans == AC_NO_TRANS ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)k,
                             &alpha, a, (int)lda, &zero, dense, (int)n));
}

int cu_syrk_packed(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha, const float *a,
                   size_t lda, float beta, float *c_packed) {
  float *dense = nullptr;
  if (!int_ok(n) || !int_ok(k) || !int_ok(lda)) return AC_EINVAL;
  USE(be);
  int rc = scratch(be, n * n * sizeof(float), &dense);
  if (rc == AC_OK) rc = syrk_dense(be, trans, n, k, alpha, a, lda, dense);
  if (rc != AC_OK) return rc;
  LAUNCH(be, k_pack_beta, blocks_for(n * n), n, dense, n, beta, c_packed);
}

/* Dense and packed in the scratch buffer, then one download into the caller's memory. */
int cu_syrk_packed_to_host(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                           const float *a, size_t lda, float *host_packed) {
  float *dense = nullptr;
  const size_t len = n * (n + 1) / 2;
  if (!int_ok(n) || !int_ok(k) || !int_ok(lda)) return AC_EINVAL;
  USE(be);
  int rc = scratch(be, (n * n + len) * sizeof(float), &dense);
  if (rc == AC_OK) rc = syrk_dense(be, trans, n, k, alpha, a, lda, dense);
  if (rc != AC_OK) return rc;
  k_pack_beta<<<blocks_for(n * n), kThreads, 0, STREAM(be)>>>(n, dense, n, 0.0f, dense + n * n);
  rc = launched();
  return rc == AC_OK ? cu_copy(be, host_packed, dense + n * n, len * sizeof(float),
                               cudaMemcpyDeviceToHost, true)
                     : rc;
}

int cu_unpack_sym(ac_backend *be, size_t n, const float *packed, float *dense, size_t ld) {
  LAUNCH(be, k_unpack, blocks_for(n * n), n, packed, dense, ld);
}

int cu_pack_sym(ac_backend *be, size_t n, const float *dense, size_t ld, float *packed) {
  LAUNCH(be, k_pack_beta, blocks_for(n * n), n, dense, ld, 0.0f, packed);
}

int cu_binary(ac_backend *be, ac_binary_op op, size_t n, const float *a, const float *b,
              float *out) {
  LAUNCH(be, k_binary, blocks_for(n), (int)op, n, a, b, out);
}

int cu_axpby(ac_backend *be, size_t n, float alpha, const float *x, float beta, const float *y,
             float *out) {
  LAUNCH(be, k_axpby, blocks_for(n), n, alpha, x, beta, y, out);
}

int cu_affine(ac_backend *be, size_t n, float alpha, const float *x, float beta, float *out) {
  LAUNCH(be, k_affine, blocks_for(n), n, alpha, x, beta, out);
}

int cu_unary(ac_backend *be, ac_unary_op op, size_t n, const float *x, float *out) {
  LAUNCH(be, k_unary, blocks_for(n), (int)op, n, x, out);
}

int cu_unary_backward(ac_backend *be, ac_unary_op op, size_t n, const float *x, const float *dy,
                      float *dx) {
  LAUNCH(be, k_unary_backward, blocks_for(n), (int)op, n, x, dy, dx);
}

int cu_bcast(ac_backend *be, ac_binary_op op, size_t outer, size_t mid, size_t inner,
             const float *x, const float *v, float *out) {
  LAUNCH(be, k_bcast, blocks_for(outer * mid * inner), (int)op, outer, mid, inner, x, v, out);
}

unsigned row_blocks(size_t rows) {
  return static_cast<unsigned>(rows < kMaxBlocks ? rows : kMaxBlocks);
}

int cu_reduce(ac_backend *be, ac_reduce_op op, size_t outer, size_t mid, size_t inner, float alpha,
              const float *x, float beta, float *out) {
  if (inner == 1 && mid >= 4 * (size_t)kThreads)
    LAUNCH(be, k_reduce_columns, blocks_for(mid), (int)op, outer, mid, alpha, x, beta, out);
  LAUNCH(be, k_reduce, row_blocks(mid), (int)op, outer, mid, inner, alpha, x, beta, out);
}

int cu_channel_moments(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                       float *mean, float *var) {
  LAUNCH(be, k_channel_moments, row_blocks(mid), outer, mid, inner, x, mean, var);
}

int cu_channel_affine(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                      const float *scale, const float *shift, const float *res, int relu,
                      float *y) {
  LAUNCH(be, k_channel_affine, blocks_for(outer * mid * inner), outer, mid, inner, x, scale, shift,
         res, relu, y);
}

int cu_channel_grad_sums(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                         const float *mask, const float *x, const float *center, float *gout,
                         float *sum_g, float *sum_gx) {
  LAUNCH(be, k_channel_grad_sums, row_blocks(mid), outer, mid, inner, dy, mask, x, center, gout,
         sum_g, sum_gx);
}

int cu_channel_combine(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                       const float *mask, const float *x, const float *a, const float *b,
                       const float *c, float *dx) {
  LAUNCH(be, k_channel_combine, blocks_for(outer * mid * inner), outer, mid, inner, dy, mask, x, a,
         b, c, dx);
}

int cu_sum_to_host(ac_backend *be, size_t n, const float *x, int squares, double *out) {
  float *buf = nullptr;
  cuda_state *s = st(be);
  USE(be);
  int rc = scratch(be, kSumBlocks * sizeof(double), &buf);
  if (rc != AC_OK) return rc;
  double *partials = reinterpret_cast<double *>(buf);
  unsigned blocks = blocks_for(n) < (unsigned)kSumBlocks ? blocks_for(n) : kSumBlocks;
  k_sum_partials<<<blocks, kThreads, 0, s->stream>>>(n, x, squares, partials);
  if (launched() != AC_OK) return AC_EDEVICE;
  rc = cu_copy(be, s->partials_host, partials, blocks * sizeof(double), cudaMemcpyDeviceToHost,
               true);
  if (rc != AC_OK) return rc;
  double acc = 0.0;
  for (unsigned i = 0; i < blocks; i++) acc += s->partials_host[i];
  *out = acc;
  return AC_OK;
}

int cu_argmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, int32_t *idx) {
  LAUNCH(be, k_argmax_rows, row_blocks(rows), rows, cols, x, idx);
}

int cu_sample_rows(ac_backend *be, size_t rows, size_t cols, const float *probs, const float *u,
                   int32_t *labels) {
  LAUNCH(be, k_sample_rows, blocks_for(rows), rows, cols, probs, u, labels);
}

int cu_softmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, float *y) {
  LAUNCH(be, k_softmax_rows, row_blocks(rows), rows, cols, x, y);
}

int cu_softmax_rows_backward(ac_backend *be, size_t rows, size_t cols, const float *y,
                             const float *dy, float *dx) {
  LAUNCH(be, k_softmax_rows_backward, row_blocks(rows), rows, cols, y, dy, dx);
}

int cu_mask_causal(ac_backend *be, size_t batch, size_t t, float *x, float value) {
  LAUNCH(be, k_mask_causal, blocks_for(batch * t * t), batch, t, x, value);
}

int cu_xent_forward(ac_backend *be, size_t rows, size_t cols, const float *logits,
                    const int32_t *labels, float *probs, float *loss) {
  LAUNCH(be, k_xent_forward, row_blocks(rows), rows, cols, logits, labels, probs, loss);
}

int cu_xent_backward(ac_backend *be, size_t rows, size_t cols, const float *probs,
                     const int32_t *labels, float scale, float *dlogits) {
  LAUNCH(be, k_xent_backward, blocks_for(rows * cols), rows, cols, probs, labels, scale, dlogits);
}

int cu_layernorm_forward(ac_backend *be, size_t rows, size_t cols, float eps, const float *x,
                         const float *gamma, const float *beta, float *y, float *mean,
                         float *rstd) {
  LAUNCH(be, k_layernorm_forward, row_blocks(rows), rows, cols, eps, x, gamma, beta, y, mean, rstd);
}

int cu_layernorm_backward(ac_backend *be, size_t rows, size_t cols, const float *x,
                          const float *gamma, const float *mean, const float *rstd, const float *dy,
                          float *dx, float *dgamma, float *dbeta) {
  USE(be);
  k_layernorm_params<<<blocks_for(cols), kThreads, 0, STREAM(be)>>>(rows, cols, x, mean, rstd, dy,
                                                                    dgamma, dbeta);
  if (launched() != AC_OK) return AC_EDEVICE;
  LAUNCH(be, k_layernorm_dx, row_blocks(rows), rows, cols, x, gamma, mean, rstd, dy, dx);
}

int cu_gather_rows(ac_backend *be, size_t n, size_t cols, const float *table, size_t table_rows,
                   const int32_t *idx, float *out) {
  LAUNCH(be, k_gather_rows, blocks_for(n * cols), n, cols, table, table_rows, idx, out);
}

int cu_scatter_add_rows(ac_backend *be, size_t n, size_t cols, const float *src, const int32_t *idx,
                        float *table, size_t table_rows) {
  LAUNCH(be, k_scatter_add_rows, blocks_for(n * cols), n, cols, src, idx, table, table_rows);
}

int cu_im2col(ac_backend *be, const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
              const float *x, float *col) {
  geom gg = make_geom(g, oh, ow);
  LAUNCH(be, k_im2col, blocks_for(g->n * g->c * g->kh * g->kw * oh * ow), gg, merged, x, col);
}

int cu_col2im(ac_backend *be, const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
              const float *col, float *x) {
  geom gg = make_geom(g, oh, ow);
  LAUNCH(be, k_col2im, blocks_for(g->n * g->c * g->h * g->w), gg, merged, col, x);
}

int cu_pool2d_forward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, size_t oh, size_t ow,
                      const float *x, float *y, int32_t *argmax) {
  geom gg = make_geom(g, oh, ow);
  LAUNCH(be, k_pool_forward, blocks_for(g->n * g->c * oh * ow), (int)op, gg, x, y, argmax);
}

int cu_pool2d_backward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, size_t oh, size_t ow,
                       const float *dy, const int32_t *argmax, float *dx) {
  geom gg = make_geom(g, oh, ow);
  size_t nx = g->n * g->c * g->h * g->w;
  if (op == AC_POOL_AVG) LAUNCH(be, k_avgpool_backward, blocks_for(nx), gg, dy, dx);
  USE(be);
  int rc = cuda_rc(cudaMemsetAsync(dx, 0, nx * sizeof(float), STREAM(be)));
  if (rc != AC_OK) return rc;
  LAUNCH(be, k_maxpool_backward, blocks_for(g->n * g->c * oh * ow), gg, dy, argmax, dx);
}

int cu_rand(ac_backend *be, int dist, uint64_t seed, uint64_t offset, size_t n, float a, float b,
            float *out) {
  LAUNCH(be, k_rand, blocks_for(n), dist, seed, offset, n, a, b, out);
}

int cu_adamw_update(ac_backend *be, size_t n, float *p, const float *g, float *m, float *v,
                    float lr, float beta1, float beta2, float eps, float wd, float bc1, float bc2) {
  LAUNCH(be, k_adamw, blocks_for(n), n, p, g, m, v, lr, beta1, beta2, eps, wd, bc1, bc2);
}

int cu_moment_graft(ac_backend *be, size_t n, const float *g, float *f, float *v, float *x,
                    float *d, const ac_moment_graft_args *a) {
  LAUNCH(be, k_moment_graft, blocks_for(n), n, g, f, v, x, d, *a);
}

ac__ops make_ops() {
  ac__ops o;
  std::memset(&o, 0, sizeof o);
  o.destroy = cu_destroy;
  o.sync = cu_sync;
  o.malloc_ = cu_malloc;
  o.free_ = cu_free;
  o.memcpy_h2d = cu_h2d;
  o.memcpy_d2h = cu_d2h;
  o.memcpy_d2d = cu_d2d;
  o.fill_f32 = cu_fill_f32;
  o.fill_i32 = cu_fill_i32;
  o.copy2d = cu_copy2d;
  o.permute = cu_permute;
  o.sgemm_batched = cu_sgemm_batched;
  o.syrk_packed = cu_syrk_packed;
  o.syrk_packed_to_host = cu_syrk_packed_to_host;
  o.unpack_sym = cu_unpack_sym;
  o.pack_sym = cu_pack_sym;
  o.binary = cu_binary;
  o.axpby = cu_axpby;
  o.affine = cu_affine;
  o.unary = cu_unary;
  o.unary_backward = cu_unary_backward;
  o.bcast = cu_bcast;
  o.reduce = cu_reduce;
  o.channel_moments = cu_channel_moments;
  o.channel_affine = cu_channel_affine;
  o.channel_grad_sums = cu_channel_grad_sums;
  o.channel_combine = cu_channel_combine;
  o.sum_to_host = cu_sum_to_host;
  o.argmax_rows = cu_argmax_rows;
  o.sample_rows = cu_sample_rows;
  o.softmax_rows = cu_softmax_rows;
  o.softmax_rows_backward = cu_softmax_rows_backward;
  o.mask_causal = cu_mask_causal;
  o.xent_forward = cu_xent_forward;
  o.xent_backward = cu_xent_backward;
  o.layernorm_forward = cu_layernorm_forward;
  o.layernorm_backward = cu_layernorm_backward;
  o.gather_rows = cu_gather_rows;
  o.scatter_add_rows = cu_scatter_add_rows;
  o.im2col = cu_im2col;
  o.col2im = cu_col2im;
  o.pool2d_forward = cu_pool2d_forward;
  o.pool2d_backward = cu_pool2d_backward;
  o.rand = cu_rand;
  o.adamw_update = cu_adamw_update;
  o.moment_graft = cu_moment_graft;
  return o;
}

const ac__ops cuda_ops = make_ops();

}  // namespace

extern "C" int ac__cuda_create(ac_backend *be, const ac_backend_opts *opts, char *err,
                               size_t errlen) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::snprintf(err, errlen, "no CUDA device: %s",
                  e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports 0 devices");
    cudaGetLastError(); /* clear the error so a later CPU-only run is not affected */
    return AC_ENODEV;
  }
  if (opts->device >= count) {
    std::snprintf(err, errlen, "CUDA device %d requested, %d present", opts->device, count);
    return AC_ENODEV;
  }
  cuda_state *s = new (std::nothrow) cuda_state();
  if (s == nullptr) {
    std::snprintf(err, errlen, "out of host memory");
    return AC_ENOMEM;
  }
  s->device = opts->device;
  be->impl = s;
  int rc = AC_OK;
  cudaDeviceProp prop;
  cublasStatus_t bs;

  if ((e = cudaSetDevice(s->device)) != cudaSuccess ||
      (e = cudaGetDeviceProperties(&prop, s->device)) != cudaSuccess ||
      (e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking)) != cudaSuccess ||
      (e = cudaMallocHost(reinterpret_cast<void **>(&s->partials_host),
                          kSumBlocks * sizeof(double))) != cudaSuccess) {
    std::snprintf(err, errlen, "CUDA device %d: %s", s->device, cudaGetErrorString(e));
    rc = cuda_rc(e);
    goto fail;
  }
  bs = cublasCreate(&s->blas);
  if (bs == CUBLAS_STATUS_SUCCESS) bs = cublasSetStream(s->blas, s->stream);
  if (bs != CUBLAS_STATUS_SUCCESS) {
    std::snprintf(err, errlen, "cuBLAS: %s", cublasGetStatusString(bs));
    rc = blas_rc(bs);
    goto fail;
  }
  be->ops = &cuda_ops;
  std::snprintf(be->desc, sizeof be->desc, "cuda:%d %.100s (sm_%d%d, %.0f GiB)", s->device,
                prop.name, prop.major, prop.minor,
                (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
  return AC_OK;

fail:
  cu_destroy(be);
  return rc;
}
