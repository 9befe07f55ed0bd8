# bench/median.awk -- the one median of the bench scripts' rounds (push-lib.sh, push-xcore.sh,
# fold-xcore.sh, wire.sh), prepended to their awk programs: med(a, k, m) is the median of
# a[k, 1..m] (numbers), and sets the globals lo and hi to that run's least and greatest.
function med(a, k, m,   i, j, t, x) {
  for (i = 1; i <= m; i++) x[i] = a[k, i]
  for (i = 2; i <= m; i++) for (j = i; j > 1 && x[j - 1] + 0 > x[j] + 0; j--) { t = x[j]; x[j] = x[j - 1]; x[j - 1] = t }
  lo = x[1]; hi = x[m]
  return m % 2 ? x[(m + 1) / 2] : (x[m / 2] + x[m / 2 + 1]) / 2
}
