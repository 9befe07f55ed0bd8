/* graft.c: not written yet. */
#include "preconditioner.h"
