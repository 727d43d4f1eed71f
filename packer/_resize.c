/* Antialiased bilinear resize of a crop of packed RGB pixels, written mirrored or not into a batch slot.
 *
 * The same filter and coefficients as Pillow's BILINEAR resize of the cropped image (its
 * precompute_coeffs: a triangle filter widened by the downscale factor), and so torch's antialiased
 * bilinear interpolate, which ports it; taps stop at the crop's edges, as in torchvision's
 * crop-then-resize. 14-bit fixed point, each pass rounded to uint8 as Pillow rounds.
 *
 * Why not a library's kernel: each needs the crop copied into its own layout first (Pillow's 4-byte
 * RGBX: ~40 us per crop here) and the result copied out again (~30 us), and only Pillow-SIMD's has
 * SIMD (plain Pillow takes ~560 us per crop, torch ~390). Here the crop is read in place (a raw
 * record or a decoded band) and finished rows are copied into the slot: ~90 us in all, against
 * ~180 for Pillow-SIMD with its copies (scripts/bench_resize.py).
 *
 * The horizontal pass costs the most per row, so it runs on the fewer rows: after the vertical pass
 * when the crop is taller than the output, before it otherwise. It does four rows at a time with
 * shared coefficients (byte shuffles and 16-bit multiply-adds, AVX2); the vertical pass works on
 * whole rows of contiguous bytes, 32 at a time. CPUs without AVX2 (checked at run time) take the
 * scalar code, the same integer arithmetic: both give identical bytes (tested).
 */
#define _USE_MATH_DEFINES /* M_PI */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_resize.h"

#define PRECISION 14 /* coefficient bits: 255 * 2^14 * (taps summing to ~1) fits easily in int32 */
#define ROUND (1 << (PRECISION - 1))
#define PAD 16 /* bytes readable past a row of the horizontal pass (vector loads of its last pixels) */

typedef struct {
    int *first; /* first source pixel of each output pixel */
    int *count; /* taps of each output pixel */
    int16_t *coeff; /* `stride` coefficients per output pixel, zero past `count` */
    int stride;
    int16_t *pairs; /* per output pixel and 4 taps, (c, c', c, c', c, c', 0, 0) twice: the horizontal
                       vector pass's operands, laid out once per call instead of once per row */
} taps;

static double triangle(double x) {
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

static double sinc(double x) {
    if (x == 0.0) return 1.0;
    x *= M_PI;
    return sin(x) / x;
}

static double lanczos3(double x) {
    return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3.0) : 0.0;
}

/* Pillow's precompute_coeffs for a dimension of `size` pixels -> `out` pixels, for its BILINEAR
 * filter or (`lanczos`) its LANCZOS one; 0, or -1 when out of memory. `stride` is rounded up to
 * whole groups of 4 taps. */
static int make_taps(taps *t, int size, int out, int lanczos) {
    double (*filter)(double) = lanczos ? lanczos3 : triangle;
    double scale = (double)size / out, filterscale = scale < 1.0 ? 1.0 : scale;
    double support = (lanczos ? 3.0 : 1.0) * filterscale;
    int ksize = (int)ceil(support) * 2 + 1, stride = (ksize + 3) & ~3;
    double *k = malloc(sizeof(double) * ksize);
    t->first = malloc(sizeof(int) * out);
    t->count = malloc(sizeof(int) * out);
    t->coeff = calloc((size_t)out * stride, sizeof(int16_t));
    t->stride = stride;
    if (!k || !t->first || !t->count || !t->coeff) {
        free(k);
        return -1;
    }
    for (int x = 0; x < out; x++) {
        double center = (x + 0.5) * scale, total = 0.0;
        int first = (int)(center - support + 0.5), last = (int)(center + support + 0.5);
        if (first < 0) first = 0;
        if (last > size) last = size;
        int n = last - first;
        for (int i = 0; i < n; i++) {
            k[i] = filter((i + first - center + 0.5) / filterscale);
            total += k[i];
        }
        for (int i = 0; i < n; i++) {
            double w = total != 0.0 ? k[i] / total : 0.0;
            t->coeff[(size_t)x * stride + i] = (int16_t)(w < 0 ? w * (1 << PRECISION) - 0.5 : w * (1 << PRECISION) + 0.5);
        }
        t->first[x] = first;
        t->count[x] = n;
    }
    free(k);
    return 0;
}

static void free_taps(taps *t) {
    free(t->first);
    free(t->count);
    free(t->coeff);
    free(t->pairs);
}

/* t->pairs from t->coeff (`out` output pixels); 0, or -1 when out of memory. */
static int make_pairs(taps *t, int out) {
    int16_t *p = t->pairs = malloc(sizeof(int16_t) * 4 * (size_t)out * t->stride);
    if (p == NULL) return -1;
    for (int x = 0; x < out; x++) {
        for (int k = 0; k < t->stride; k += 2, p += 8) {
            const int16_t *c = t->coeff + (size_t)x * t->stride + k;
            int16_t lanes[8] = {c[0], c[1], c[0], c[1], c[0], c[1], 0, 0};
            memcpy(p, lanes, sizeof lanes);
        }
    }
    return 0;
}

static inline unsigned char clip8(int32_t v) {
    v >>= PRECISION;
    return v < 0 ? 0 : v > 255 ? 255 : (unsigned char)v;
}

/* --- scalar passes ------------------------------------------------------------------------------ */

static void vertical_scalar(const unsigned char *src, size_t src_stride, const taps *v, int y, unsigned char *dst,
                            int bytes) {
    const int16_t *c = v->coeff + (size_t)y * v->stride;
    const unsigned char *rows = src + (size_t)v->first[y] * src_stride;
    for (int i = 0; i < bytes; i++) {
        int32_t acc = ROUND;
        for (int k = 0; k < v->count[y]; k++) acc += c[k] * rows[(size_t)k * src_stride + i];
        dst[i] = clip8(acc);
    }
}

static void horizontal_scalar(const unsigned char *row, const taps *h, unsigned char *dst, int width, int flip) {
    for (int j = 0; j < width; j++) {
        int x = flip ? width - 1 - j : j;
        const int16_t *c = h->coeff + (size_t)x * h->stride;
        const unsigned char *p = row + (size_t)h->first[x] * 3;
        int32_t r = ROUND, g = ROUND, b = ROUND;
        for (int k = 0; k < h->count[x]; k++, p += 3) {
            r += c[k] * p[0];
            g += c[k] * p[1];
            b += c[k] * p[2];
        }
        dst[3 * j] = clip8(r);
        dst[3 * j + 1] = clip8(g);
        dst[3 * j + 2] = clip8(b);
    }
}

/* --- vector passes (x86) ------------------------------------------------------------------------- */

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_VECTOR_PASSES 1
#define AVX2 __attribute__((target("avx2")))

/* Two source rows' 32 bytes times their coefficients, added to four int32 accumulators. Unpacking
 * and packing both work within 128-bit lanes, so the bytes come back in order. */
AVX2 static inline void madd_rows(__m256i a, __m256i b, __m256i pair, __m256i acc[4]) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i alo = _mm256_unpacklo_epi8(a, zero), ahi = _mm256_unpackhi_epi8(a, zero);
    __m256i blo = _mm256_unpacklo_epi8(b, zero), bhi = _mm256_unpackhi_epi8(b, zero);
    acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(_mm256_unpacklo_epi16(alo, blo), pair));
    acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(_mm256_unpackhi_epi16(alo, blo), pair));
    acc[2] = _mm256_add_epi32(acc[2], _mm256_madd_epi16(_mm256_unpacklo_epi16(ahi, bhi), pair));
    acc[3] = _mm256_add_epi32(acc[3], _mm256_madd_epi16(_mm256_unpackhi_epi16(ahi, bhi), pair));
}

AVX2 static void vertical_vector(const unsigned char *src, size_t src_stride, const taps *v, int y, unsigned char *dst,
                                 int bytes) {
    const int16_t *c = v->coeff + (size_t)y * v->stride;
    const unsigned char *rows = src + (size_t)v->first[y] * src_stride;
    int n = v->count[y], i = 0;
    for (; i + 32 <= bytes; i += 32) {
        __m256i acc[4] = {_mm256_set1_epi32(ROUND), _mm256_set1_epi32(ROUND), _mm256_set1_epi32(ROUND),
                          _mm256_set1_epi32(ROUND)};
        int k = 0;
        for (; k + 2 <= n; k += 2) {
            __m256i pair = _mm256_set1_epi32((int32_t)(((uint32_t)(uint16_t)c[k + 1] << 16) | (uint16_t)c[k]));
            madd_rows(_mm256_loadu_si256((const __m256i *)(rows + (size_t)k * src_stride + i)),
                      _mm256_loadu_si256((const __m256i *)(rows + (size_t)(k + 1) * src_stride + i)), pair, acc);
        }
        if (k < n) {
            __m256i pair = _mm256_set1_epi32((uint16_t)c[k]);
            madd_rows(_mm256_loadu_si256((const __m256i *)(rows + (size_t)k * src_stride + i)), _mm256_setzero_si256(),
                      pair, acc);
        }
        __m256i lo = _mm256_packs_epi32(_mm256_srai_epi32(acc[0], PRECISION), _mm256_srai_epi32(acc[1], PRECISION));
        __m256i hi = _mm256_packs_epi32(_mm256_srai_epi32(acc[2], PRECISION), _mm256_srai_epi32(acc[3], PRECISION));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_packus_epi16(lo, hi));
    }
    if (i < bytes) { /* the row's last < 32 bytes */
        taps one = *v;
        one.first = v->first + y;
        one.count = v->count + y;
        one.coeff = (int16_t *)c;
        vertical_scalar(src + i, src_stride, &one, 0, dst + i, bytes - i);
    }
}

/* Four rows at once (`rows`, `stride` bytes apart; each readable PAD bytes past its end), sharing
 * each output pixel's coefficients: rows 0 and 1 in the lanes of one register, 2 and 3 of another.
 * Per row and output pixel: 16 bytes from its first tap (5 RGB pixels: taps 4g .. 4g+3 and one
 * spare), taps 4g, 4g+1 and 4g+2, 4g+3 gathered as 16-bit (r, r', g, g', b, b', 0, 0) for a
 * multiply-add with (c, c', c, c', c, c', 0, 0) -> int32 (r, g, b, 0). The 4-byte store of a pixel
 * spills one byte into the next, which is stored after it; a row's last pixel is stored in 3 bytes. */
AVX2 static void horizontal_vector(const unsigned char *rows, size_t stride, const taps *h, unsigned char *const dst[4],
                                   int width, int flip) {
    const __m256i taps01 = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                                            0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i taps23 = _mm256_setr_epi8(6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1,
                                            6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1);
    for (int j = 0; j < width; j++) {
        int x = flip ? width - 1 - j : j;
        const __m128i *c = (const __m128i *)(h->pairs + (size_t)x * h->stride * 4);
        const unsigned char *p = rows + (size_t)h->first[x] * 3;
        __m256i acc01 = _mm256_set1_epi32(ROUND), acc23 = acc01;
        for (int g = 0; g < h->count[x]; g += 4, p += 12, c += 2) {
            __m256i c01 = _mm256_broadcastsi128_si256(_mm_loadu_si128(c));
            __m256i c23 = _mm256_broadcastsi128_si256(_mm_loadu_si128(c + 1));
            __m256i p01 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                  _mm_loadu_si128((const __m128i *)(p + stride)), 1);
            __m256i p23 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + 2 * stride))),
                                                  _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 1);
            acc01 = _mm256_add_epi32(acc01, _mm256_madd_epi16(_mm256_shuffle_epi8(p01, taps01), c01));
            acc01 = _mm256_add_epi32(acc01, _mm256_madd_epi16(_mm256_shuffle_epi8(p01, taps23), c23));
            acc23 = _mm256_add_epi32(acc23, _mm256_madd_epi16(_mm256_shuffle_epi8(p23, taps01), c01));
            acc23 = _mm256_add_epi32(acc23, _mm256_madd_epi16(_mm256_shuffle_epi8(p23, taps23), c23));
        }
        /* lanes: (row 0, row 2) and (row 1, row 3), 4 bytes a pixel */
        __m256i words = _mm256_packs_epi32(_mm256_srai_epi32(acc01, PRECISION), _mm256_srai_epi32(acc23, PRECISION));
        __m256i bytes = _mm256_packus_epi16(words, words);
        __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
        uint32_t pixel[4] = {(uint32_t)_mm_cvtsi128_si32(lo), (uint32_t)_mm_cvtsi128_si32(hi),
                             (uint32_t)_mm_extract_epi32(lo, 1), (uint32_t)_mm_extract_epi32(hi, 1)};
        if (j + 1 < width) {
            for (int r = 0; r < 4; r++) memcpy(dst[r] + 3 * j, &pixel[r], 4);
        } else { /* little-endian: r, g, b are the low bytes */
            for (int r = 0; r < 4; r++) memcpy(dst[r] + 3 * j, &pixel[r], 3);
        }
    }
}

static int have_avx2 = -1;
#endif

/* Ask for source rows [from, to) (`bytes` each) ahead of use: the crop's rows lie across 4 KiB pages
 * of the page cache, where the hardware prefetcher stops (measured: a record not in the cache cost
 * ~35 us more per crop; this takes back about half). */
static void prefetch_rows(const unsigned char *src, size_t src_stride, int from, int to, size_t bytes) {
    for (int y = from; y < to; y++) {
        const unsigned char *row = src + (size_t)y * src_stride;
        for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 3);
        __builtin_prefetch(row + bytes - 1, 0, 3);
    }
}

int resize_vector_available(void) {
#ifdef HAVE_VECTOR_PASSES
    if (have_avx2 < 0) {
        __builtin_cpu_init();
        have_avx2 = __builtin_cpu_supports("avx2") != 0;
    }
    return have_avx2;
#else
    return 0;
#endif
}

/* The horizontal pass over `n` (1-4) rows of `width` pixels, `stride` bytes apart, into out_rows. */
static void horizontal_rows(const unsigned char *rows, size_t stride, int n, const taps *h, unsigned char *const out_rows[4],
                            unsigned char *spare, int out_width, int flip, int vector) {
#ifdef HAVE_VECTOR_PASSES
    if (vector) {
        unsigned char *dst[4] = {out_rows[0], spare, spare, spare};
        for (int r = 1; r < n; r++) dst[r] = out_rows[r];
        horizontal_vector(rows, stride, h, dst, out_width, flip);
        return;
    }
#else
    (void)spare, (void)vector;
#endif
    for (int r = 0; r < n; r++) horizontal_scalar(rows + r * stride, h, out_rows[r], out_width, flip);
}

int resize_crop_rgb(const unsigned char *src, int src_width, int top, int left, int height, int width,
                    unsigned char *out, int out_height, int out_width, int flip, int lanczos, int vector) {
    taps v, h;
    int status = -1;
    size_t src_stride = (size_t)src_width * 3, out_stride = (size_t)out_width * 3;
    /* the crop is the image: taps stop at its edges, as when torchvision crops, then resizes */
    src += (size_t)top * src_stride + (size_t)left * 3;
    memset(&v, 0, sizeof v);
    memset(&h, 0, sizeof h);
    vector = vector && resize_vector_available();
    if (make_taps(&v, height, out_height, lanczos) == 0 && make_taps(&h, width, out_width, lanczos) == 0 &&
        (!vector || make_pairs(&h, out_width) == 0)) {
        /* The horizontal pass costs the most per row, so it runs on the fewer rows: the output's
         * (vertical pass first) when the crop is taller, else the crop's. Lanczos always goes
         * horizontal first, as Pillow does: its negative lobes push the intermediate row past 0-255,
         * and clipping it in the other order gave up to 38 levels of difference on noise. The
         * horizontal pass's input rows are padded copies, four at a time, as its vector loads read
         * past a row's last pixel. */
        int vertical_first = !lanczos && height >= out_height, rows = vertical_first ? out_height : height;
        size_t stride = (size_t)width * 3 + PAD;
        /* Output rows are made in `staged` (in the L1 cache), then copied to `out` whole: writing a
         * batch slot not in the cache a few bytes at a time cost up to as much as the resize. */
        unsigned char *scratch = calloc(4 * stride + 5 * out_stride, 1), *staged = scratch + 4 * stride;
        unsigned char *spare = staged + 4 * out_stride;
        unsigned char *mid = vertical_first ? NULL : malloc((size_t)height * out_stride);
        if (scratch != NULL && (vertical_first || mid != NULL)) {
            int fetched = 0; /* source rows asked for so far */
            for (int y = 0; y < rows; y += 4) {
                int n = rows - y < 4 ? rows - y : 4, last = y + 7 < rows ? y + 7 : rows - 1;
                int until = vertical_first ? v.first[last] + v.count[last] : last + 1; /* the next group's rows */
                if (until > fetched) {
                    prefetch_rows(src, src_stride, fetched, until, (size_t)width * 3);
                    fetched = until;
                }
                unsigned char *dst[4];
                for (int r = 0; r < n; r++) {
                    unsigned char *row = scratch + r * stride;
                    dst[r] = vertical_first ? staged + r * out_stride : mid + (size_t)(y + r) * out_stride;
                    if (!vertical_first) {
                        memcpy(row, src + (size_t)(y + r) * src_stride, (size_t)width * 3);
                    }
#ifdef HAVE_VECTOR_PASSES
                    else if (vector) {
                        vertical_vector(src, src_stride, &v, y + r, row, width * 3);
                    }
#endif
                    else {
                        vertical_scalar(src, src_stride, &v, y + r, row, width * 3);
                    }
                }
                horizontal_rows(scratch, stride, n, &h, dst, spare, out_width, flip, vector);
                for (int r = 0; vertical_first && r < n; r++) {
                    memcpy(out + (size_t)(y + r) * out_stride, dst[r], out_stride);
                }
            }
            for (int y = 0; !vertical_first && y < out_height; y++) { /* then the vertical pass */
#ifdef HAVE_VECTOR_PASSES
                if (vector) {
                    vertical_vector(mid, out_stride, &v, y, staged, (int)out_stride);
                } else
#endif
                {
                    vertical_scalar(mid, out_stride, &v, y, staged, (int)out_stride);
                }
                memcpy(out + (size_t)y * out_stride, staged, out_stride);
            }
            status = 0;
        }
        free(scratch);
        free(mid);
    }
    free_taps(&v);
    free_taps(&h);
    return status;
}
