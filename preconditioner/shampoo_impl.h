/*
 * shampoo_impl.h -- the Shampoo statistics and direction kernels, written once and included
 * by shampoo.c once per precision. Not a header to include anywhere else. The includer
 * defines:
 *   REAL            float or double
 *   SFX(name)       name##_f32 or name##_f64
 *   GEMM, SYRK      cblas_sgemm/cblas_ssyrk or the d versions
 * and this file undefines them at its end, ready for the next instance.
 */

int SFX(pc_gram)(size_t rows, size_t cols, const REAL *g, size_t ld, REAL *left_packed,
                 REAL *right_packed) {
  int rc = gram_check(rows, cols, g, ld);
  if (rc != PC_OK) return rc;
  size_t n = rows > cols ? rows : cols;
  REAL *c = malloc(n * n * sizeof *c);
  if (c == NULL) return PC_ENOMEM;

  /* syrk fills the upper triangle only: exactly what the packed form keeps. */
  if (left_packed != NULL) {
    SYRK(CblasRowMajor, CblasUpper, CblasNoTrans, (int)rows, (int)cols, 1, g, (int)ld, 0, c,
         (int)rows);
    SFX(pc_pack)(rows, c, left_packed);
  }
  if (right_packed != NULL) {
    SYRK(CblasRowMajor, CblasUpper, CblasTrans, (int)cols, (int)rows, 1, g, (int)ld, 0, c,
         (int)cols);
    SFX(pc_pack)(cols, c, right_packed);
  }
  free(c);
  return PC_OK;
}

void SFX(pc_stat_update)(size_t count, REAL *s, const REAL *inc, REAL beta2) {
  if (s == NULL || inc == NULL) return;
  if (beta2 == 1) {
    for (size_t i = 0; i < count; i++) s[i] += inc[i];
    return;
  }
  const REAL w = 1 - beta2;
  for (size_t i = 0; i < count; i++) s[i] = beta2 * s[i] + w * inc[i];
}

int SFX(pc_direction)(size_t rows, size_t cols, const REAL *lroot, const REAL *g, size_t ld,
                      const REAL *rroot, REAL *p) {
  int rc = direction_check(rows, cols, lroot, g, ld, rroot, p, sizeof *p);
  if (rc != PC_OK) return rc;
  const int m = (int)rows, n = (int)cols, ldg = (int)ld;
  if (lroot == NULL && rroot == NULL) {
    copy_rows(rows, cols, g, ld, p, sizeof *p);
    return PC_OK;
  }
  /* gemm must not write what it reads: go through t unless exactly one product is taken
   * and p is apart from g (p is either g or apart from it, see direction_check). */
  int direct = (lroot == NULL || rroot == NULL) && p != g;
  REAL *t = NULL;
  if (!direct) {
    t = malloc(rows * cols * sizeof *t);
    if (t == NULL) return PC_ENOMEM;
  }

  if (lroot != NULL && rroot != NULL) {
    /* t = L g; p = t R */
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1, lroot, m, g, ldg, 0, t, n);
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1, t, n, rroot, n, 0, p, ldg);
  } else {
    REAL *out = direct ? p : t;
    const int ldo = direct ? ldg : n;
    if (lroot != NULL)
      GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1, lroot, m, g, ldg, 0, out, ldo);
    else
      GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1, g, ldg, rroot, n, 0, out, ldo);
    if (!direct)
      for (size_t i = 0; i < rows; i++) memcpy(p + i * ld, t + i * cols, cols * sizeof *p);
  }
  free(t);
  return PC_OK;
}

#undef REAL
#undef SFX
#undef GEMM
#undef SYRK
