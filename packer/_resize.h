/* packer/_resize.c: antialiased bilinear resize of an RGB crop (see there). */
#ifndef PACKER_RESIZE_H
#define PACKER_RESIZE_H

/* Whether this CPU runs the vector passes (AVX2 on x86; never elsewhere). */
int resize_vector_available(void);

/* Resize rows [top, top + height) x columns [left, left + width) of the packed RGB image `src`
 * (src_width pixels a row; the caller checks the box is inside it) to out_height x out_width packed
 * RGB in `out`, mirrored left-right when `flip`, with Pillow's LANCZOS filter instead of its BILINEAR
 * one when `lanczos`; `vector` selects the SIMD passes where available. 0, or -1 when out of memory. */
int resize_crop_rgb(const unsigned char *src, int src_width, int top, int left, int height,
                    int width, unsigned char *out, int out_height, int out_width, int flip, int lanczos, int vector);

#endif
