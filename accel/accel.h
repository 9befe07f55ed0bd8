/*
 * accel.h -- the worker runtime: the one public header of accel/ (prefix ac_).
 *
 * It includes the three layers of the API, each usable alone:
 *   backend.h  status codes, backends, device memory, primitives, tensors and parameters
 *              (the conventions every primitive follows are at its top);
 *   layers.h   layers and model blocks;
 *   optim.h    optimizers, schedules, Shampoo's worker half, K-FAC's worker kernels
 *              (it includes preconditioner/preconditioner.h for the block layout and grafting).
 * backend.h needs nothing outside accel/, so the CUDA backend compiles with it alone.
 */
#ifndef PRECOND_ACCEL_H
#define PRECOND_ACCEL_H

#include "backend.h"
#include "layers.h"
#include "optim.h"

#endif /* PRECOND_ACCEL_H */
