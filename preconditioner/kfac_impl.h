/*
 * kfac_impl.h -- the K-FAC kernels, written once and included by kfac.c once per precision.
 * Not a header to include anywhere else. The includer defines:
 *   REAL                 float or double
 *   SFX(name)            name##_f32 or name##_f64
 *   GEMM, SYRK           cblas_sgemm/cblas_ssyrk or the d versions
 *   SYEVD, POTRF, POTRI  the LAPACKE s or d routines
 *   NEWTON_TOL           the coupled Newton tolerance for this precision
 * and this file undefines them at its end, ready for the next instance.
 *
 * A symmetric row-major buffer is also its own column-major one, so LAPACK's 'L' triangle
 * in column-major order is the upper triangle of the row-major matrix.
 */

void SFX(pc_kfac_fold)(size_t count, REAL *f, const REAL *batch, double decay, int first) {
  if (!f || !batch) return;
  if (first) {
    if (f != batch) memcpy(f, batch, count * sizeof *f);
    return;
  }
  SFX(pc_stat_update)(count, f, batch, (REAL)decay);
}

double SFX(pc_kfac_trace)(size_t n, const REAL *packed) {
  double tr = 0.0;
  if (!packed) return 0.0;
  for (size_t i = 0; i < n; i++) { /* row i of the packed triangle starts with a[i][i] */
    tr += packed[0];
    packed += n - i;
  }
  return tr;
}

/* Copies the upper triangle of the dense n x n a onto its lower triangle, 16 x 16 tiles at a
 * time so that the strided reads stay within a few pages. */
static void SFX(kfac_mirror)(size_t n, REAL *a) {
  const size_t b = 16;
  for (size_t r0 = 0; r0 < n; r0 += b)
    for (size_t c0 = 0; c0 <= r0; c0 += b)
      for (size_t r = r0; r < r0 + b && r < n; r++)
        for (size_t c = c0; c < c0 + b && c < r; c++) a[r * n + c] = a[c * n + r];
}

/* Dense F + damping I from the packed F. */
static void SFX(kfac_dense_damped)(size_t n, const REAL *f, double damping, REAL *a) {
  SFX(pc_unpack)(n, f, a);
  for (size_t i = 0; i < n; i++) a[i * n + i] += (REAL)damping;
}

/* max|X (F + damping I) - I| over KFAC_RESIDUAL_COLS evenly spaced columns, in fp64. */
static int SFX(kfac_residual)(size_t n, const REAL *f, double damping, const REAL *x, double *res) {
  size_t k = n < KFAC_RESIDUAL_COLS ? n : KFAC_RESIDUAL_COLS;
  double *xd = malloc((n * n + 2 * n * k) * sizeof *xd);
  if (!xd) return PC_ENOMEM;
  double *e = xd + n * n, *r = e + n * k;
  for (size_t i = 0; i < n * n; i++) xd[i] = x[i];
  for (size_t c = 0; c < k; c++) {
    size_t col = k > 1 ? c * (n - 1) / (k - 1) : 0;
    for (size_t i = 0; i < n; i++) { /* (F + d I)[i][col] from the packed upper triangle */
      size_t lo = i < col ? i : col, hi = i < col ? col : i;
      e[i * k + c] = (double)f[lo * n - lo * (lo - 1) / 2 + (hi - lo)] + (i == col ? damping : 0);
    }
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)k, (int)n, 1.0, xd, (int)n, e,
              (int)k, 0.0, r, (int)k);
  double m = 0.0;
  for (size_t c = 0; c < k; c++) {
    size_t col = k > 1 ? c * (n - 1) / (k - 1) : 0;
    for (size_t i = 0; i < n; i++) {
      double d = fabs(r[i * k + c] - (i == col ? 1.0 : 0.0));
      m = d > m || isnan(d) ? d : m;
    }
  }
  free(xd);
  *res = m;
  return PC_OK;
}

/* Eigendecomposition of the dense symmetric a in place: row j of a becomes eigenvector j,
 * w the eigenvalues ascending. */
static int SFX(kfac_syevd)(size_t n, REAL *a, REAL *w) {
  lapack_int rc = SYEVD(LAPACK_COL_MAJOR, 'V', 'L', (lapack_int)n, a, (lapack_int)n, w);
  if (rc == 0) return PC_OK;
  return rc == LAPACK_WORK_MEMORY_ERROR ? PC_ENOMEM : PC_ELAPACK;
}

/* x = (a + damping I)^-1 by Cholesky: potrf factors, potri inverts from the factor. */
static int SFX(kfac_cholesky)(size_t n, const REAL *f, double damping, REAL *x) {
  SFX(kfac_dense_damped)(n, f, damping, x);
  lapack_int rc = POTRF(LAPACK_COL_MAJOR, 'L', (lapack_int)n, x, (lapack_int)n);
  if (rc == 0) rc = POTRI(LAPACK_COL_MAJOR, 'L', (lapack_int)n, x, (lapack_int)n);
  if (rc != 0) return rc == LAPACK_WORK_MEMORY_ERROR ? PC_ENOMEM : PC_ELAPACK;
  SFX(kfac_mirror)(n, x);
  return PC_OK;
}

/* x = Q diag(1 / (max(v, 0) + damping)) Q^T: eigenvalues below zero are rounding noise of a
 * PSD factor. As W^T W with W = diag((max(v, 0) + damping)^-1/2) Q^T: one syrk. */
static int SFX(kfac_eigh_inverse)(size_t n, const REAL *f, double damping, REAL *x) {
  REAL *vt = malloc((n * n + n) * sizeof *vt);
  if (!vt) return PC_ENOMEM;
  REAL *w = vt + n * n;
  SFX(pc_unpack)(n, f, vt);
  int st = SFX(kfac_syevd)(n, vt, w);
  if (st == PC_OK) {
    for (size_t j = 0; j < n; j++) {
      REAL s = (REAL)(1.0 / sqrt((w[j] > 0 ? (double)w[j] : 0.0) + damping));
      for (size_t i = 0; i < n; i++) vt[j * n + i] *= s;
    }
    SYRK(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)n, 1, vt, (int)n, 0, x, (int)n);
    SFX(kfac_mirror)(n, x);
  }
  free(vt);
  return st;
}

/* x = (a + damping I)^-1 by precond's coupled Newton iteration with p = 1. The root adds its
 * own ridge epsilon * lambda_max (power iteration) and starts its scaled steps from the
 * interval [ridge / 2, lambda_max + ridge]: with the damping added here instead and a zero
 * epsilon, that interval starts at 0 and the scaled steps stall (measured: max|M - I| stuck
 * at 0.4 after 100 steps at n = 40). So the same deterministic power iteration is run here
 * first and epsilon chosen so that the root's ridge is exactly the damping. */
static int SFX(kfac_newton)(size_t n, const REAL *f, double damping, REAL *x,
                            pc_kfac_inv_info *info) {
  REAL *a = malloc(n * n * sizeof *a);
  if (!a) return PC_ENOMEM;
  SFX(pc_unpack)(n, f, a);
  double lmax = 0.0;
  int st = SFX(pc__power)(n, a, NULL, &lmax, NULL);
  if (st >= 0) {
    pc_root_opts ro;
    pc_root_opts_default(&ro, 1);
    ro.epsilon = damping / (lmax > 1e-16 ? lmax : 1e-16); /* roots.c's ridge rule, inverted */
    ro.tol = NEWTON_TOL;
    pc_root_info ri;
    st = SFX(pc_inverse_root)(n, a, x, &ro, &ri);
    info->iters = ri.iters;
    info->error = ri.error;
  }
  free(a);
  return st;
}

int SFX(pc_kfac_inverse)(size_t n, const REAL *f, double damping, pc_kfac_inv method, REAL *x,
                         pc_kfac_inv_info *info) {
  pc_kfac_inv_info scratch;
  if (inverse_check(n, f, damping, method, x) != PC_OK) return PC_EINVAL;
  if (!SFX(pc_all_finite)(pc_packed_len(n), f)) return PC_ENONFINITE_INPUT;
  if (!info) info = &scratch;
  info->method = method;
  info->iters = 0;
  info->error = INFINITY;
  int st;
  if (method == PC_KFAC_INV_NEWTON) {
    st = SFX(kfac_newton)(n, f, damping, x, info);
  } else {
    st = method == PC_KFAC_INV_CHOLESKY ? SFX(kfac_cholesky)(n, f, damping, x)
                                        : SFX(kfac_eigh_inverse)(n, f, damping, x);
    if (st == PC_OK) st = SFX(kfac_residual)(n, f, damping, x, &info->error);
  }
  if (st >= 0 && !SFX(pc_all_finite)(n * n, x)) st = PC_ENONFINITE_RESULT;
  return st;
}

int SFX(pc_kfac_eigen)(size_t n, const REAL *f, REAL *q, REAL *v) {
  if (eigen_check(n, f, q, v) != PC_OK) return PC_EINVAL;
  if (!SFX(pc_all_finite)(pc_packed_len(n), f)) return PC_ENONFINITE_INPUT;
  REAL *vt = malloc(n * n * sizeof *vt);
  if (!vt) return PC_ENOMEM;
  SFX(pc_unpack)(n, f, vt);
  int st = SFX(kfac_syevd)(n, vt, v);
  if (st == PC_OK) {
    for (size_t i = 0; i < n; i++) /* q = vt^T: eigenvector j in column j */
      for (size_t j = 0; j < n; j++) q[i * n + j] = vt[j * n + i];
    for (size_t j = 0; j < n; j++) v[j] = v[j] > 0 ? v[j] : 0;
  }
  free(vt);
  return st;
}

int SFX(pc_kfac_update)(size_t out, size_t in, const REAL *g_inv, const REAL *grad, size_t ld,
                        const REAL *a_inv, REAL *p) {
  return SFX(pc_direction)(out, in, g_inv, grad, ld, a_inv, p);
}

int SFX(pc_kfac_eigen_update)(size_t out, size_t in, const REAL *qg, const REAL *vg,
                              const REAL *grad, size_t ld, const REAL *qa, const REAL *va,
                              double lambda, REAL *p) {
  if (eigen_update_check(out, in, qg, vg, grad, ld, qa, va, lambda, p) != PC_OK) return PC_EINVAL;
  REAL *t = malloc(2 * out * in * sizeof *t);
  if (!t) return PC_ENOMEM;
  REAL *u = t + out * in;
  const int m = (int)out, n = (int)in, ldg = (int)ld;
  /* t = Q_G^T grad; u = t Q_A: the gradient in the factors' eigenbases. */
  GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, m, 1, qg, m, grad, ldg, 0, t, n);
  GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1, t, n, qa, n, 0, u, n);
  for (size_t i = 0; i < out; i++)
    for (size_t j = 0; j < in; j++)
      u[i * in + j] = (REAL)(u[i * in + j] / ((double)vg[i] * va[j] + lambda));
  /* Back: t = Q_G u; p = t Q_A^T. */
  GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1, qg, m, u, n, 0, t, n);
  GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, n, 1, t, n, qa, n, 0, p, ldg);
  free(t);
  return PC_OK;
}

#undef REAL
#undef SFX
#undef GEMM
#undef SYRK
#undef SYEVD
#undef POTRF
#undef POTRI
#undef NEWTON_TOL
