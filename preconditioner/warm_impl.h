/*
 * warm_impl.h -- the steady-state root kernels, written once and included by warm.c once per
 * precision. Not a header to include anywhere else. The includer defines:
 *   REAL            float or double (the storage of a, x and the basis)
 *   SFX(name)       name##_f32 or name##_f64
 *   GEMM, SYRK, TRSM, POTRF   the BLAS/LAPACKE routines of REAL
 *   WIDE            1 if B may be formed in fp64 wider than REAL (fp32), else 0
 *   EIGH_UNIT       the epsilon of the eigh route's rule (eigh_pays), 0.0 to keep it off
 * and it undefines them at its end, ready for the next instance.
 *
 * Notation: V is the held basis, stored as vt (n x n row-major, row j = eigenvector j);
 * B = V A V^T is the statistic in that basis, kept in fp64, upper triangle only.
 */

/* b = V A V^T (upper triangle; the lower one is not written). wide: a and V are widened into
 * s64 (3 n^2 doubles) and both products run in fp64, so that B's small diagonal entries keep
 * their relative accuracy (an fp32 product errs by ~1e-7 |A| on every entry, which is a
 * tenth of a ridge-level eigenvalue at epsilon 1e-6). Else the products run in REAL, in s
 * (2 n^2 REAL), and B is widened afterwards. D = V A first; then B's upper triangle in row
 * panels, B[i0:i0+h, i0:n] = D[i0:i0+h, :] V[i0:n, :]^T (B is symmetric: ~0.56 of a product). */
static void SFX(warm_rayleigh)(size_t n, const REAL *a, const REAL *vt, int wide, double *b,
                               double *s64, REAL *s) {
  const size_t nn = n * n;
  const int ni = (int)n;
  if (wide) {
    double *a64 = s64, *v64 = s64 + nn, *d = s64 + 2 * nn;
    for (size_t i = 0; i < nn; i++) {
      a64[i] = a[i];
      v64[i] = vt[i];
    }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1, v64, ni, a64, ni, 0, d,
                ni);
    for (size_t i0 = 0; i0 < n; i0 += PC_WARM_PANEL) {
      size_t h = n - i0 < PC_WARM_PANEL ? n - i0 : PC_WARM_PANEL;
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)h, (int)(n - i0), ni, 1, d + i0 * n,
                  ni, v64 + i0 * n, ni, 0, b + i0 * n + i0, ni);
    }
    return;
  }
  REAL *d = s, *bn = s + nn;
  GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1, vt, ni, a, ni, 0, d, ni);
  for (size_t i0 = 0; i0 < n; i0 += PC_WARM_PANEL) {
    size_t h = n - i0 < PC_WARM_PANEL ? n - i0 : PC_WARM_PANEL;
    GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)h, (int)(n - i0), ni, 1, d + i0 * n, ni,
         vt + i0 * n, ni, 0, bn + i0 * n + i0, ni);
  }
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++) b[i * n + j] = bn[i * n + j];
}

/* One Jacobi step on every pair of the nearly diagonal B at once. For the pair i < j, the
 * rotation that diagonalises the 2 x 2 problem [b_ii b_ij; b_ij b_jj] has tan(theta) = t
 * (Golub and Van Loan, sym.schur2: tau = (b_jj - b_ii) / (2 b_ij), t = sign(tau) / (|tau| +
 * sqrt(1 + tau^2)), so |t| <= 1 even for equal diagonal entries). Taken to first order and
 * over all pairs together, the new eigenvectors are the rows of N V with N = I - K, K
 * antisymmetric, K_ij = t: row i = v_i - t v_j, row j = v_j + t v_i; for small b_ij,
 * t ~ b_ij / (b_jj - b_ii), the first-order perturbation of an eigenvector. The 2 x 2 problem
 * moves b_ii by -t b_ij and b_jj by +t b_ij; summed over pairs this is the second-order
 * perturbation of the eigenvalues, written into lam, from the pairs in that regime only,
 * |t| <= PC_WARM_TMAX. The others are near-degenerate (|b_ij| comparable to |b_jj - b_ii|):
 * over a large such block, e.g. the ridge-level one of a Shampoo statistic whose entries are
 * rounding noise, their summed corrections grow to the size of the ridge (measured in
 * docs/roots.md). Their rotation is kept: it mixes nearly equal eigenvalues and lets further
 * sweeps converge. dg: n doubles of scratch. */
static void SFX(warm_jacobi)(size_t n, const double *b, REAL *nmat, double *lam, double *dg) {
  for (size_t i = 0; i < n; i++) dg[i] = lam[i] = b[i * n + i];
  memset(nmat, 0, n * n * sizeof *nmat);
  for (size_t i = 0; i < n; i++) {
    nmat[i * n + i] = 1;
    const double *bi = b + i * n;
    for (size_t j = i + 1; j < n; j++) {
      double bij = bi[j];
      if (bij == 0.0) continue;
      double tau = (dg[j] - dg[i]) / (2.0 * bij);
      double t = (tau >= 0.0 ? 1.0 : -1.0) / (fabs(tau) + sqrt(1.0 + tau * tau));
      if (fabs(tau) > 1e150) t = 0.5 / tau; /* tau^2 overflowed */
      nmat[i * n + j] = (REAL)-t;
      nmat[j * n + i] = (REAL)t;
      if (fabs(t) > PC_WARM_TMAX) continue; /* beyond second order: no correction */
      lam[i] -= t * bij;
      lam[j] += t * bij;
    }
  }
}

/* vt <- the rows of N vt made orthonormal in order: v1 = N vt, then Cholesky QR,
 * g = v1 v1^T = R^T R, vt = R^-T v1. N = I - K is within |K| of orthogonal, so g is well
 * conditioned and one Cholesky QR pass orthonormalises to working precision; it also removes
 * whatever drift from orthogonality the basis picked up in earlier calls. v1, g: n x n.
 * Returns PC_OK, or PC_ELAPACK when g is not numerically positive definite. */
static int SFX(warm_rotate)(size_t n, const REAL *nmat, REAL *vt, REAL *v1, REAL *g) {
  const int ni = (int)n;
  GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1, nmat, ni, vt, ni, 0, v1, ni);
  SYRK(CblasRowMajor, CblasUpper, CblasNoTrans, ni, ni, 1, v1, ni, 0, g, ni);
  /* g's row-major upper triangle is its column-major lower one: g = L L^T there, and the
   * row-major view of L is R = L^T, upper, with g = R^T R. */
  if (POTRF(LAPACK_COL_MAJOR, 'L', (lapack_int)n, g, (lapack_int)n) != 0) return PC_ELAPACK;
  TRSM(CblasRowMajor, CblasLeft, CblasUpper, CblasTrans, CblasNonUnit, ni, ni, 1, g, ni, v1, ni);
  memcpy(vt, v1, n * n * sizeof *vt);
  return PC_OK;
}

/* The steady-state route (the contract is pc_inverse_root_warm_*'s; arguments checked). */
static int SFX(warm_route)(size_t n, const REAL *a, REAL *x, const pc_root_opts *opts,
                           const pc_warm_opts *wo, SFX(pc_eigbasis) * basis, pc_warm_info *info) {
  const size_t nn = n * n;
  const int wide = WIDE && wo->wide;
  int status = PC_ENOMEM;
  double *b = pc__scratch_alloc((nn + 2 * n) * sizeof *b);
  REAL *s = pc__scratch_alloc((3 * nn + n) * sizeof *s);
  double *s64 = wide ? pc__scratch_alloc(3 * nn * sizeof *s64) : NULL;
  if (!b || !s || (wide && !s64)) goto done;
  double *lam = b + nn, *dg = lam + n;
  REAL *nmat = s, *v1 = s + nn, *g = s + 2 * nn, *lamr = s + 3 * nn;
  info->offdiag = info->change = NAN;
  info->residual = NAN;
  info->path = basis->valid ? PC_WARM_ROTATED : PC_WARM_SEEDED;
  /* Decided from the held eigenvalues, before any product: the eigh route pays no B. */
  if (basis->valid && eigh_pays(n, basis->w, opts->epsilon, EIGH_UNIT, wo->eigh_below))
    info->path = PC_WARM_EIGH;
  if (info->path != PC_WARM_ROTATED) {
    status = SFX(pc__eig_decompose)(n, a, basis->vt, lamr);
    if (status != PC_OK) goto done;
    for (size_t i = 0; i < n; i++) lam[i] = lamr[i]; /* the eigh route's, as pc__eigh's */
  }
  for (int sweep = 0; info->path != PC_WARM_EIGH && sweep < wo->sweeps; sweep++) {
    SFX(warm_rayleigh)(n, a, basis->vt, wide, b, s64, s);
    if (sweep == 0 && info->path == PC_WARM_ROTATED) {
      offdiag_measure(n, b, opts->p, opts->epsilon, dg, &info->offdiag, &info->change);
      if (!(info->change <= wo->max_change)) goto cold; /* NaN too */
      if (info->offdiag <= wo->skip_tol) {
        info->path = wo->reuse_root ? PC_WARM_REUSED : PC_WARM_SKIPPED;
        for (size_t i = 0; i < n; i++) lam[i] = b[i * n + i];
        break;
      }
    }
    SFX(warm_jacobi)(n, b, nmat, lam, dg);
    if (SFX(warm_rotate)(n, nmat, basis->vt, v1, g) != PC_OK) goto cold;
  }
  double lmax = lam[0];
  for (size_t i = 0; i < n; i++) {
    lmax = lam[i] > lmax ? lam[i] : lmax;
    lamr[i] = (REAL)lam[i];
  }
  double ridge = pc__ridge(opts->epsilon, lmax);
  if (info->path != PC_WARM_REUSED) {
    memcpy(nmat, basis->vt, nn * sizeof *nmat);
    SFX(pc__eig_assemble)(n, nmat, lamr, opts->p, ridge, x);
  }
  status = SFX(pc__sampled_residual)(n, a, ridge, x, opts->p, &info->residual);
  if (status != PC_OK) goto done;
  if (!(info->residual <= wo->guard_tol)) goto cold;
  memcpy(basis->w, lam, n * sizeof *lam);
  basis->valid = 1;
  info->root.iters = 0;
  info->root.error = info->residual;
  info->root.lambda_max = lmax;
  info->root.ridge = ridge;
  goto done;
cold:
  basis->valid = 0;
  info->path = PC_WARM_COLD;
  status = SFX(pc_inverse_root)(n, a, x, opts, &info->root);
done:
  free(b);
  free(s);
  free(s64);
  if (status < 0) basis->valid = 0;
  return status;
}

#undef REAL
#undef SFX
#undef GEMM
#undef SYRK
#undef TRSM
#undef POTRF
#undef WIDE
#undef EIGH_UNIT
