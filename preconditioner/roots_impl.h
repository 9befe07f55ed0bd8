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

/* Copies the upper triangle onto the lower one in 8 x 8 tiles: each lower row segment is
 * written contiguously from a column of the upper tile. Row strides of a page or more make
 * wider tiles thrash the TLB (64 x 64 tiles took 16 ms at n = 1024, 8 x 8 take 0.6 ms).
 * Off-diagonal subnormals are flushed to zero on the way: OpenBLAS worker threads do not
 * inherit the caller's flush-to-zero mode, so every product's inputs must be free of them. */
static void SFX(mirror_upper)(size_t n, REAL *a) {
  const size_t b = 8;
  for (size_t j0 = 0; j0 < n; j0 += b) {
    size_t j1 = j0 + b < n ? j0 + b : n;
    for (size_t i0 = 0; i0 <= j0; i0 += b) {
      size_t i1 = i0 + b < n ? i0 + b : n;
      for (size_t j = j0; j < j1; j++) {
        size_t end = i1 < j ? i1 : j;
        REAL *dst = a + j * n;
        REAL *src = a + j;
        for (size_t i = i0; i < end; i++) {
          REAL v = src[i * n];
          if (fabs((double)v) < REAL_MIN) src[i * n] = v = 0;
          dst[i] = v;
        }
      }
    }
  }
}

/* c = alpha a a (a symmetric): syrk writes the upper triangle at half a gemm's flops. */
static void SFX(square)(size_t n, double alpha, const REAL *a, REAL *c, int sym) {
  int ni = (int)n;
  if (!sym) {
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, (REAL)alpha, a, ni, a, ni, 0, c,
         ni);
    return;
  }
  SYRK(CblasRowMajor, CblasUpper, CblasNoTrans, ni, ni, (REAL)alpha, a, ni, 0, c, ni);
  SFX(mirror_upper)(n, c);
}

/* c = alpha a b for commuting symmetric a, b. The symmetric version computes the upper
 * triangle as panels of PC_PANEL rows, c[i0:i0+h, i0:n] = a[i0:i0+h, :] b[:, i0:n], each one
 * gemm call, about (1 + PC_PANEL/n)/2 of the full product's flops. */
static void SFX(mul_sym)(size_t n, double alpha, const REAL *a, const REAL *b, REAL *c, int sym) {
  int ni = (int)n;
  if (!sym || n < PC_PANEL_MIN_N) {
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, (REAL)alpha, a, ni, b, ni, 0, c,
         ni);
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
  if (isnan(d->frob)) d->maxdev = NAN; /* the max comparisons above skip NaNs; the sum keeps them */
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
 * The iterates live in a workspace of five n x n buffers and a newton_state, so that a run
 * can change precision half-way (see roots.c). A step writes T^p into pw (tmp as scratch),
 * the new M into tmp and the new X into pw (T^p is dead by then); accepting the step swaps
 * m with tmp and x with pw, rejecting it leaves m and x as they were. */
typedef struct {
  REAL *m, *x, *t, *pw, *tmp;
} SFX(newton_ws);

/* Points the workspace at five consecutive n x n blocks of buf. */
static void SFX(newton_ws_carve)(SFX(newton_ws) * w, REAL *buf, size_t n) {
  const size_t nn = n * n;
  w->m = buf;
  w->x = buf + nn;
  w->t = buf + 2 * nn;
  w->pw = buf + 3 * nn;
  w->tmp = buf + 4 * nn;
}

/* Starts the iteration on ad = A + ridge I, which the caller has written into w->m. */
static void SFX(newton_start)(size_t n, int p, double lo, double hi, const pc__newton_variant *v,
                              SFX(newton_ws) * w, newton_state *st) {
  const size_t nn = n * n;
  st->lo = lo;
  st->hi = hi;
  st->iters = 0;
  st->stopped = 0;
  /* While X is a multiple of the identity (xscale > 0) it is not stored: the first X T is
   * then a scaled copy of T, not a product (symmetric variant; the textbook multiplies). */
  st->xscale = 1.0;
  if (!v->scaled) {
    double f = 0.0;
    for (size_t i = 0; i < nn; i++) f += (double)w->m[i] * w->m[i];
    double z = (p + 1.0) / (2.0 * sqrt(f));
    for (size_t i = 0; i < nn; i++) w->m[i] = (REAL)(z * w->m[i]);
    st->xscale = pow(z, 1.0 / p);
  }
  if (!v->symmetric) {
    memset(w->x, 0, nn * sizeof *w->x);
    for (size_t i = 0; i < n; i++) w->x[i * n + i] = (REAL)st->xscale;
    st->xscale = 0.0;
  }
  SFX(deviation)(n, w->m, &st->dev);
  st->err = st->dev.maxdev;
}

/* Takes steps until max|M - I| <= tol, max_iters steps in all, the divergence guard or the
 * rounding floor stops it, or (stop_lo > 0) the interval's lo / hi reaches stop_lo. */
static void SFX(newton_steps)(size_t n, int p, double tol, int max_iters, double stop_lo,
                              const pc__newton_variant *v, SFX(newton_ws) * w, newton_state *st) {
  const size_t nn = n * n;
  const int sym = v->symmetric;
  while (st->err > tol && st->iters < max_iters && !st->stopped &&
         !(stop_lo > 0.0 && st->lo >= stop_lo * st->hi)) {
    double s = 1.0;
    int local = 1;
    if (v->scaled) {
      interval_tighten(&st->lo, &st->hi, st->dev.frob);
      s = equalizing_scale(st->lo, st->hi, p, v->floor);
      local = st->lo >= 0.5 && st->hi <= 1.5; /* M near I: Newton's local regime */
    }
    double err_ref = dev_scaled(&st->dev, s);
    SFX(newton_t)(n, p, s, w->m, w->t);
    SFX(matpow)(n, p, w->t, w->pw, w->tmp, sym);
    SFX(mul_sym)(n, s, w->pw, w->m, w->tmp, sym); /* the new M */
    SFX(flush_subnormals)(nn, w->tmp);
    double xs = pow(s, 1.0 / p);
    if (st->xscale > 0.0) { /* the new X */
      for (size_t i = 0; i < nn; i++) w->pw[i] = (REAL)(st->xscale * xs * w->t[i]);
    } else {
      SFX(mul_sym)(n, xs, w->x, w->t, w->pw, sym);
    }
    st->iters++;
    root_dev dn;
    SFX(deviation)(n, w->tmp, &dn);
    /* Divergence guard: in floating point the error eventually grows; keep the previous
     * iterate then. NaN fails the comparison and stops here too. */
    if (!(dn.maxdev <= 1.2 * err_ref) && (local || !isfinite(dn.maxdev))) {
      st->stopped = 1;
      break;
    }
    REAL *sw = w->m;
    w->m = w->tmp;
    w->tmp = sw;
    sw = w->x;
    w->x = w->pw;
    w->pw = sw;
    st->xscale = 0.0;
    st->dev = dn;
    st->err = dn.maxdev;
    if (v->scaled) {
      interval_advance(&st->lo, &st->hi, s, p);
      /* At the rounding floor a step no longer halves the error: stop rather than spin.
       * Only near I (err_ref < 1e-3, where a step squares the error): earlier, with M's
       * spectrum still spread over [0.5, 1.5], max|M - I| can fall slowly (measured: p = 1,
       * 0.029 -> 0.022 at the first local step). */
      if (local && err_ref < 1e-3 && st->err > tol && st->err > 0.5 * err_ref) st->stopped = 1;
    }
  }
}

/* X of the accepted iterate into out. */
static void SFX(newton_result)(size_t n, const SFX(newton_ws) * w, const newton_state *st,
                               REAL *out) {
  if (st->xscale > 0.0) { /* no step accepted: X is still the starting multiple of I */
    memset(out, 0, n * n * sizeof *out);
    for (size_t i = 0; i < n; i++) out[i * n + i] = (REAL)st->xscale;
  } else {
    memcpy(out, w->x, n * n * sizeof *out);
  }
}

/* Power iteration for lambda_max, the ridge, and an interval [lo, hi] that holds the
 * spectrum of a + ridge I. Returns PC_OK, PC_ENONFINITE_RESULT when a + ridge I == 0 (the
 * root is infinite), or an error. */
static int SFX(newton_bounds)(size_t n, const REAL *a, double epsilon, pc_root_info *info,
                              double *lo, double *hi) {
  double lmax = 0.0;
  int st = SFX(pc__power)(n, a, NULL, &lmax, NULL);
  if (st < 0) return st;
  double ridge = pc__ridge(epsilon, lmax);
  info->lambda_max = lmax;
  info->ridge = ridge;
  /* Power iteration approaches lambda_max from below: allow a margin, and fall back on
   * |a + ridge I|_F (a true upper bound) when it did not converge. */
  if (st == PC_OK && lmax > 0.0) {
    *hi = (lmax + ridge) * 1.01;
  } else {
    double f = 0.0, tr = 0.0;
    for (size_t i = 0; i < n * n; i++) f += (double)a[i] * a[i];
    for (size_t i = 0; i < n; i++) tr += a[i * n + i];
    f += 2.0 * ridge * tr + (double)n * ridge * ridge;
    *hi = sqrt(f > 0.0 ? f : 0.0);
  }
  *lo = 0.5 * ridge;
  return *hi > 0.0 ? PC_OK : PC_ENONFINITE_RESULT;
}

/* The whole iteration in one precision. */
static int SFX(newton_route)(size_t n, const REAL *a, REAL *x, const pc_root_opts *opts,
                             const pc__newton_variant *v, pc_root_info *info) {
  double lo = 0, hi = 0;
  info->iters = 0;
  info->error = INFINITY;
  int st = SFX(newton_bounds)(n, a, opts->epsilon, info, &lo, &hi);
  if (st != PC_OK) return st;
  REAL *buf = pc__scratch_alloc(5 * n * n * sizeof *buf);
  if (!buf) return PC_ENOMEM;
  SFX(newton_ws) w;
  SFX(newton_ws_carve)(&w, buf, n);
  memcpy(w.m, a, n * n * sizeof *a);
  for (size_t i = 0; i < n; i++) w.m[i * n + i] += (REAL)info->ridge;
  newton_state ns;
  SFX(newton_start)(n, opts->p, lo, hi, v, &w, &ns);
  SFX(newton_steps)(n, opts->p, opts->tol, opts->max_iters, 0.0, v, &w, &ns);
  SFX(newton_result)(n, &w, &ns, x);
  free(buf);
  info->iters = ns.iters;
  info->error = ns.err;
  return ns.err <= opts->tol ? PC_OK : PC_NOT_CONVERGED;
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
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)k, (int)n, 1.0, xd, (int)n,
                e, (int)k, 0.0, f, (int)k);
    double *sw = e;
    e = f;
    f = sw;
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

/* a = V diag(w) V^T by LAPACK syevd: vt (n x n) gets V^T, row j = eigenvector j, and w the
 * eigenvalues in ascending order. Returns PC_OK, PC_ENOMEM or PC_ELAPACK. */
static int SFX(eig_decompose)(size_t n, const REAL *a, REAL *vt, REAL *w) {
  memcpy(vt, a, n * n * sizeof *vt);
  /* a is symmetric, so its row-major buffer is also its column-major one. The eigenvectors
   * come back as columns of a column-major V: row j of the row-major vt is eigenvector j. */
  lapack_int rc = SYEVD(LAPACK_COL_MAJOR, 'V', 'L', (lapack_int)n, vt, (lapack_int)n, w);
  if (rc != 0) return rc == LAPACK_WORK_MEMORY_ERROR ? PC_ENOMEM : PC_ELAPACK;
  return PC_OK;
}

/* x = V diag((max(w, 0) + ridge)^(-1/p)) V^T from the eigenvector rows vt, which are scaled
 * in place: x = W^T W with W = diag(lam^(-1/2p)) V^T (one syrk). Negative eigenvalues are
 * floored at 0, so the root's eigenvalues are those of a + ridge I floored at the ridge. */
static void SFX(eig_assemble)(size_t n, REAL *vt, const REAL *w, int p, double ridge, REAL *x) {
  for (size_t j = 0; j < n; j++) {
    double lam = (w[j] > 0 ? (double)w[j] : 0.0) + ridge;
    REAL d = (REAL)pow(lam, -0.5 / p);
    for (size_t i = 0; i < n; i++) vt[j * n + i] *= d;
  }
  SYRK(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)n, 1, vt, (int)n, 0, x, (int)n);
  SFX(mirror_upper)(n, x);
}

/* The eigendecomposition route: decompose, then assemble the root. The ridge comes from the
 * exact largest eigenvalue, so no power iteration. */
static int SFX(eigh)(size_t n, const REAL *a, REAL *x, int p, double epsilon, pc_root_info *info) {
  int status = PC_ENOMEM;
  REAL *vt = pc__scratch_alloc((n * n + n) * sizeof *vt);
  if (!vt) goto done;
  REAL *w = vt + n * n;
  status = SFX(eig_decompose)(n, a, vt, w);
  if (status != PC_OK) goto done;
  double lmax = w[n - 1];
  double ridge = pc__ridge(epsilon, lmax);
  SFX(eig_assemble)(n, vt, w, p, ridge, x);
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
