/*
 * conv_lanes.h -- the CPU backend's "lanes" layout for the direct 3x3 convs (conv_lanes.c);
 * internal to accel: outside code must not include it.
 *
 * A group of up to 16 images, one channel, h x w pixels: [y + 1][x + 1][16 images] in a
 * frame of (h + 2) x (w + 2) positions of 16 floats, the frame's border zero. One 16-float
 * vector is one (y, x) of the group's 16 images, so a 3x3 conv (stride 1, padding 1) over the
 * group computes only outputs that are kept: output (y, x) of 16 images is a sum of reads at
 * (y + p, x + q), p, q < 3. Missing images of a partial group are zero lanes.
 */
#ifndef PRECOND_AC_CONV_LANES_H
#define PRECOND_AC_CONV_LANES_H

#include <stddef.h>

/* Images per group: the lanes of one AVX-512F vector. */
enum { AC__LANES = 16 };

/* Floats of one channel of a group in the lanes layout: (h + 2)(w + 2) positions of 16. */
size_t ac__lanes_chan_len(size_t h, size_t w);

/* One channel of nb <= 16 images (image b's h x w plane at src + b sstride) into the lanes
 * layout at dst: the inside of the frame, lanes nb..15 zero; the border is left as it is
 * (the caller zeroes it once). Needs AVX-512F (the caller checked). */
void ac__lanes_pack(size_t h, size_t w, size_t nb, const float *src, size_t sstride, float *dst);

/* The other way, for outputs: src holds n positions of 16 lanes (lane b: image b), and image
 * b < nb gets its n floats at dst + b dstride, plus res + b dstride when res is not NULL (res
 * may be dst). Needs AVX-512F. */
void ac__lanes_unpack(size_t n, size_t nb, const float *src, float *dst, size_t dstride,
                      const float *res);

/* The moments of the same n positions, per lane b: s[b] += the sum of its n values, q[b] +=
 * the sum of their squares, in double, in the CPU backend's order for a row of n floats
 * (row_moments in backend_cpu.c: partial sums by position mod 16 in position order, then
 * totalled pairwise 8, 4, 2, 1): the bits a copied-out plane's row_moments gives, made
 * for 16 images at once from the lanes. Needs AVX-512F. */
void ac__lanes_moments(size_t n, const float *src, double *s, double *q);

#endif
