/*
 * roots_impl.h -- the inverse-root kernels, written once and included by roots.c once per
 * precision. Not a header to include anywhere else. The includer defines:
 *   REAL            float or double
 *   REAL_MIN        smallest normal value of REAL
 *   SFX(name)       name##_f32 or name##_f64
 *   GEMM, SYRK      cblas_sgemm/cblas_ssyrk or the d versions
 *   SYEVD           LAPACKE_ssyevd or LAPACKE_dsyevd
 *
 * Matrices are n x n, row-major, with both triangles valid unless a comment says otherwise.
 * Every product here is of two commuting symmetric matrices (all are polynomials in A), so
 * the product is symmetric too; the "symmetric" variant computes one triangle and mirrors it.
 */

/* Copies the upper triangle onto the lower one, tile by tile so both sides stay in cache. */
static void SFX(mirror_upper)(size_t n, REAL *a) {
  const size_t b = 64;
  for (size_t i0 = 0; i0 < n; i0 += b) {
    size_t i1 = i0 + b < n ? i0 + b : n;
    for (size_t j0 = i0; j0 < n; j0 += b) {
      size_t j1 = j0 + b < n ? j0 + b : n;
      for (size_t i = i0; i < i1; i++)
        for (size_t j = j0 > i + 1 ? j0 : i + 1; j < j1; j++) a[j * n + i] = a[i * n + j];
    }
  }
}

/* c = alpha a a (a symmetric): syrk writes the upper triangle at half a gemm's flops. */
static void SFX(square)(size_t n, double alpha, const REAL *a, REAL *c, int sym) {
  int ni = (int)n;
  if (!sym) {
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, (REAL)alpha, a, ni, a, ni, 0,
         c, ni);
    return;
  }
  SYRK(CblasRowMajor, CblasUpper, CblasNoTrans, ni, ni, (REAL)alpha, a, ni, 0, c, ni);
  SFX(mirror_upper)(n, c);
}

/* c = alpha a b for commuting symmetric a, b. The symmetric version computes the upper
 * triangle as panels of PC_PANEL rows, c[i0:i0+h, i0:n] = a[i0:i0+h, :] b[:, i0:n], each one
 * gemm call, about (1 + PC_PANEL/n)/2 of the full product's flops. */
static void SFX(mul_sym)(size_t n, double alpha, const REAL *a, const REAL *b, REAL *c,
                         int sym) {
  int ni = (int)n;
  if (!sym || n < PC_PANEL_MIN_N) {
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, (REAL)alpha, a, ni, b, ni, 0,
         c, ni);
    /* Keep the iterates exactly symmetric: syrk squares T as T T^T, which would cancel an
     * antisymmetric rounding part of M in T^p and so let it survive in T^p M. */
    if (sym) SFX(mirror_upper)(n, c);
    return;
  }
  for (size_t i0 = 0; i0 < n; i0 += PC_PANEL) {
    size_t h = n - i0 < PC_PANEL ? n - i0 : PC_PANEL;
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)h, (int)(n - i0), ni, (REAL)alpha,
         a + i0 * n, ni, b + i0, ni, 0, c + i0 * n + i0, ni);
  }
  SFX(mirror_upper)(n, c);
}

/* out = t^p by repeated squaring; tmp is scratch. Writes alternate between out and tmp so
 * that the last one lands in out. */
static void SFX(matpow)(size_t n, int p, const REAL *t, REAL *out, REAL *tmp, int sym) {
  int top = 0, ops = 0;
  while ((p >> (top + 1)) != 0) top++;
  for (int bit = top - 1; bit >= 0; bit--) ops += 1 + ((p >> bit) & 1);
  if (ops == 0) {
    memcpy(out, t, n * n * sizeof *out);
    return;
  }
  const REAL *src = t;
  for (int bit = top - 1; bit >= 0; bit--) {
    REAL *dst = (ops-- % 2 == 1) ? out : tmp;
    SFX(square)(n, 1.0, src, dst, sym);
    src = dst;
    if ((p >> bit) & 1) {
      dst = (ops-- % 2 == 1) ? out : tmp;
      SFX(mul_sym)(n, 1.0, src, t, dst, sym);
      src = dst;
    }
  }
}

/* Deviation of the symmetric m from the identity, read from the upper triangle. */
static void SFX(deviation)(size_t n, const REAL *m, root_dev *d) {
  double dmin = INFINITY, dmax = -INFINITY, off = 0.0, frob = 0.0;
  for (size_t i = 0; i < n; i++) {
    const REAL *row = m + i * n;
    double di = row[i];
    dmin = di < dmin ? di : dmin;
    dmax = di > dmax ? di : dmax;
    frob += (di - 1.0) * (di - 1.0);
    double rowsq = 0.0;
    for (size_t j = i + 1; j < n; j++) {
      double v = fabs((double)row[j]);
      off = v > off ? v : off;
      rowsq += v * v;
    }
    frob += 2.0 * rowsq;
  }
  d->dmin = dmin;
  d->dmax = dmax;
  d->offmax = off;
  d->frob = sqrt(frob);
  d->maxdev = dev_scaled(d, 1.0);
}

/* t = ((p + 1) I - s m) / p, with subnormals flushed so that no BLAS thread sees one. */
static void SFX(newton_t)(size_t n, int p, double s, const REAL *m, REAL *t) {
  const REAL c = (REAL)(-s / p), diag = (REAL)((p + 1.0) / p);
  for (size_t i = 0; i < n * n; i++) {
    REAL v = c * m[i];
    t[i] = fabs((double)v) < REAL_MIN ? 0 : v;
  }
  for (size_t i = 0; i < n; i++) t[i * n + i] += diag;
}

static void SFX(flush_subnormals)(size_t count, REAL *a) {
  for (size_t i = 0; i < count; i++)
    if (a[i] != 0 && fabs((double)a[i]) < REAL_MIN) a[i] = 0;
}

/* The coupled Newton iteration for the inverse p-th root of ad = A + ridge I (Anil et al.
 * 2020, section 1 of the algorithms note):
 *   T = ((p+1) I - M) / p,  M <- T^p M,  X <- X T,
 * which keeps M = X^p ad and drives M to I, so that X -> ad^(-1/p).
 * Textbook start (v->scaled == 0): M = z ad, X = z^(1/p) I with z = (p+1) / (2 |ad|_F).
 * Scaled (v->scaled == 1): before each step M and X are rescaled by s and s^(1/p), with s
 * chosen from an interval [lo, hi] known to hold M's spectrum so that both ends map to the
 * same value under m -> m ((p+1-m)/p)^p (the scalar model of one step); the interval is
 * carried through the steps by the same map and tightened by |M - I|_F.
 * Writes x (the accepted iterate), *iters (steps computed, a rejected one included) and
 * *err (max|M - I| of the accepted iterate). Returns PC_OK, PC_NOT_CONVERGED or PC_ENOMEM. */
static int SFX(newton)(size_t n, const REAL *ad, REAL *x_out, int p, double tol,
                       int max_iters, double lo, double hi, const pc__newton_variant *v,
                       int *iters, double *err_out) {
  const size_t nn = n * n;
  int status = PC_ENOMEM, it = 0, sym = v->symmetric;
  REAL *buf = malloc(6 * nn * sizeof *buf);
  if (!buf) goto done;
  REAL *m = buf, *mn = buf + nn, *t = buf + 2 * nn, *pw = buf + 3 * nn, *tmp = buf + 4 * nn;
  REAL *x = x_out, *xn = buf + 5 * nn;
  /* While x is a multiple of the identity (xscale > 0) it is not stored: the first X T is
   * then a scaled copy of T, not a product (symmetric variant only; the textbook multiplies). */
  double xscale = 1.0;
  memcpy(m, ad, nn * sizeof *m);
  if (!v->scaled) {
    double f = 0.0;
    for (size_t i = 0; i < nn; i++) f += (double)ad[i] * ad[i];
    double z = (p + 1.0) / (2.0 * sqrt(f));
    for (size_t i = 0; i < nn; i++) m[i] = (REAL)(z * m[i]);
    xscale = pow(z, 1.0 / p);
  }
  if (!sym) {
    memset(x, 0, nn * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i * n + i] = (REAL)xscale;
    xscale = 0.0;
  }
  root_dev dev;
  SFX(deviation)(n, m, &dev);
  double err = dev.maxdev;
  while (err > tol && it < max_iters) {
    double s = 1.0;
    int local = 1;
    if (v->scaled) {
      interval_tighten(&lo, &hi, dev.frob);
      s = equalizing_scale(lo, hi, p, v->floor);
      local = lo >= 0.5;
    }
    double err_ref = dev_scaled(&dev, s);
    SFX(newton_t)(n, p, s, m, t);
    SFX(matpow)(n, p, t, pw, tmp, sym);
    SFX(mul_sym)(n, s, pw, m, mn, sym);
    SFX(flush_subnormals)(nn, mn);
    double xs = pow(s, 1.0 / p);
    if (xscale > 0.0) {
      for (size_t i = 0; i < nn; i++) xn[i] = (REAL)(xscale * xs * t[i]);
    } else {
      SFX(mul_sym)(n, xs, x, t, xn, sym);
    }
    it++;
    root_dev dn;
    SFX(deviation)(n, mn, &dn);
    /* Divergence guard: in floating point the error eventually grows; keep the previous
     * iterate then. NaN fails the comparison and stops here too. */
    if (!(dn.maxdev <= 1.2 * err_ref) && (local || !isfinite(dn.maxdev))) break;
    REAL *sw = m; m = mn; mn = sw;
    sw = x; x = xn; xn = sw;
    xscale = 0.0;
    dev = dn;
    err = dn.maxdev;
    if (v->scaled) {
      interval_advance(&lo, &hi, s, p);
      /* At the rounding floor a step no longer halves the error: stop rather than spin. */
      if (local && err > tol && err > 0.5 * err_ref) break;
    }
  }
  if (xscale > 0.0) { /* no step accepted: X is still the starting multiple of I */
    memset(x, 0, nn * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i * n + i] = (REAL)xscale;
  }
  if (x != x_out) memcpy(x_out, x, nn * sizeof *x);
  *err_out = err;
  status = err <= tol ? PC_OK : PC_NOT_CONVERGED;
done:
  *iters = it;
  free(buf);
  return status;
}

/* max|X^p ad - I| over PC_RESIDUAL_COLS evenly spaced columns (all when n is smaller),
 * evaluated in fp64 so that the check's own rounding does not hide the root's error. */
static int SFX(sampled_residual)(size_t n, const REAL *a, double ridge, const REAL *x, int p,
                                 double *res) {
  size_t k = n < PC_RESIDUAL_COLS ? n : PC_RESIDUAL_COLS;
  int status = PC_ENOMEM;
  double *xd = malloc((n * n + 2 * n * k) * sizeof *xd);
  size_t *col = malloc(k * sizeof *col);
  if (!xd || !col) goto done;
  double *e = xd + n * n, *f = e + n * k;
  for (size_t i = 0; i < n * n; i++) xd[i] = x[i];
  for (size_t c = 0; c < k; c++) col[c] = k > 1 ? c * (n - 1) / (k - 1) : 0;
  for (size_t i = 0; i < n; i++)
    for (size_t c = 0; c < k; c++)
      e[i * k + c] = (double)a[i * n + col[c]] + (i == col[c] ? ridge : 0.0);
  for (int j = 0; j < p; j++) {
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)k, (int)n, 1.0, xd,
                (int)n, e, (int)k, 0.0, f, (int)k);
    double *sw = e; e = f; f = sw;
  }
  double r = 0.0;
  for (size_t i = 0; i < n; i++)
    for (size_t c = 0; c < k; c++) {
      double d = fabs(e[i * k + c] - (i == col[c] ? 1.0 : 0.0));
      r = d > r || isnan(d) ? d : r;
    }
  *res = r;
  status = PC_OK;
done:
  free(col);
  free(xd);
  return status;
}

/* The eigendecomposition route: a = V diag(w) V^T (LAPACK syevd), then
 * x = V diag((max(w, 0) + ridge)^(-1/p)) V^T, i.e. the eigenvalues of a + ridge I floored at
 * the ridge. The ridge comes from the exact largest eigenvalue, so no power iteration. */
static int SFX(eigh)(size_t n, const REAL *a, REAL *x, int p, double epsilon,
                     pc_root_info *info) {
  int status = PC_ENOMEM;
  REAL *vt = malloc((n * n + n) * sizeof *vt);
  if (!vt) goto done;
  REAL *w = vt + n * n;
  memcpy(vt, a, n * n * sizeof *vt);
  /* a is symmetric, so its row-major buffer is also its column-major one. The eigenvectors
   * come back as columns of a column-major V: row j of the row-major vt is eigenvector j. */
  lapack_int rc = SYEVD(LAPACK_COL_MAJOR, 'V', 'L', (lapack_int)n, vt, (lapack_int)n, w);
  if (rc != 0) {
    status = rc == LAPACK_WORK_MEMORY_ERROR ? PC_ENOMEM : PC_ELAPACK;
    goto done;
  }
  double lmax = w[n - 1];
  double ridge = epsilon * (lmax > 1e-16 ? lmax : 1e-16);
  for (size_t j = 0; j < n; j++) {
    double lam = (w[j] > 0 ? (double)w[j] : 0.0) + ridge;
    REAL d = (REAL)pow(lam, -0.5 / p);
    for (size_t i = 0; i < n; i++) vt[j * n + i] *= d;
  }
  /* x = W^T W with W = diag(lam^(-1/2p)) V^T. */
  SYRK(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)n, 1, vt, (int)n, 0, x, (int)n);
  SFX(mirror_upper)(n, x);
  double res = 0.0;
  status = SFX(sampled_residual)(n, a, ridge, x, p, &res);
  info->iters = 0;
  info->error = res;
  info->lambda_max = lmax;
  info->ridge = ridge;
done:
  free(vt);
  return status;
}

/* Power iteration for lambda_max, then the ridge and the coupled Newton iteration. */
static int SFX(newton_route)(size_t n, const REAL *a, REAL *x, const pc_root_opts *opts,
                             const pc__newton_variant *v, pc_root_info *info) {
  double lmax = 0.0;
  int st = SFX(pc__power)(n, a, NULL, &lmax, NULL);
  if (st < 0) return st;
  double hi_bound;
  REAL *ad = malloc(n * n * sizeof *ad);
  if (!ad) return PC_ENOMEM;
  double ridge = opts->epsilon * (lmax > 1e-16 ? lmax : 1e-16);
  memcpy(ad, a, n * n * sizeof *ad);
  for (size_t i = 0; i < n; i++) ad[i * n + i] += (REAL)ridge;
  /* Power iteration approaches lambda_max from below: allow a margin, and fall back on the
   * Frobenius norm (a true upper bound) when it did not converge. */
  if (st == PC_OK && lmax > 0.0) {
    hi_bound = (lmax + ridge) * 1.01;
  } else {
    double f = 0.0;
    for (size_t i = 0; i < n * n; i++) f += (double)ad[i] * ad[i];
    hi_bound = sqrt(f);
  }
  int iters = 0;
  double err = 0.0;
  if (!(hi_bound > 0.0)) { /* A + ridge I == 0: the root is infinite */
    free(ad);
    info->iters = 0;
    info->error = INFINITY;
    info->lambda_max = lmax;
    info->ridge = ridge;
    return PC_ENONFINITE_RESULT;
  }
  st = SFX(newton)(n, ad, x, opts->p, opts->tol, opts->max_iters, 0.5 * ridge, hi_bound, v,
                   &iters, &err);
  free(ad);
  info->iters = iters;
  info->error = err;
  info->lambda_max = lmax;
  info->ridge = ridge;
  return st;
}
