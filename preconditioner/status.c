/* status.c -- messages for precond's numeric status codes. */
#include "preconditioner.h"

/* Returns a static message for any status code; unknown codes get a generic message. */
const char *pc_strerror(int status) {
  switch (status) {
    case PC_OK:
      return "ok";
    case PC_NOT_CONVERGED:
      return "not converged: result written, error above tolerance";
    case PC_EINVAL:
      return "invalid argument";
    case PC_ENONFINITE_INPUT:
      return "input contains NaN or Inf";
    case PC_ENONFINITE_RESULT:
      return "computation produced NaN or Inf";
    case PC_ENOMEM:
      return "out of memory";
    case PC_ELAPACK:
      return "LAPACK reported a failure";
    default:
      return "unknown status code";
  }
}
