/* Antialiased bilinear resize of a crop of packed RGB pixels, written mirrored or not into a batch slot.
 *
 * The same filter and coefficients as Pillow's BILINEAR resize of the cropped image (its
 * precompute_coeffs: a triangle filter widened by the downscale factor), and so torch's antialiased
 * bilinear interpolate, which ports it; taps stop at the crop's edges, as in torchvision's
 * crop-then-resize. 14-bit fixed point, each pass rounded to uint8 as Pillow rounds. Why not Pillow: it reads RGB
 * only after unpacking it to its 4-byte RGBX layout (~40 us per raw crop here), its result must be
 * packed back to RGB for the batch (~30 us), and plain Pillow's kernel has no SIMD (480 us per 224
 * crop, against ~96 for Pillow-SIMD). Here the crop is read in place (a raw record or a decoded
 * band) and the second pass writes straight into the slot.
 *
 * Per output row, the vertical pass makes one intermediate row (over whole rows of contiguous
 * bytes, 32 at a time with AVX2), which stays in the L1 cache for the horizontal pass (two output
 * pixels per step, up to 4 taps each, with byte shuffles and 16-bit multiply-adds). CPUs without
 * AVX2 (checked at run time) take the scalar code, the same integer arithmetic: both give identical
 * bytes (tested).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_resize.h"

#define PRECISION 14 /* coefficient bits: 255 * 2^14 * (taps summing to ~1) fits easily in int32 */
#define ROUND (1 << (PRECISION - 1))
#define PAD 32 /* bytes readable past the intermediate row (vector loads of its last pixels) */

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

/* Pillow's precompute_coeffs for the box [lo, hi) of a dimension of `size` pixels -> `out` pixels;
 * 0, or -1 when out of memory. `stride` is rounded up to whole groups of 4 taps. */
static int make_taps(taps *t, int size, double lo, double hi, int out) {
    double scale = (hi - lo) / out, filterscale = scale < 1.0 ? 1.0 : scale, support = filterscale;
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
        double center = lo + (x + 0.5) * scale, total = 0.0;
        int first = (int)(center - support + 0.5), last = (int)(center + support + 0.5);
        if (first < 0) first = 0;
        if (last > size) last = size;
        int n = last - first;
        for (int i = 0; i < n; i++) {
            k[i] = triangle((i + first - center + 0.5) / filterscale);
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

static void horizontal_scalar(const unsigned char *row, const taps *h, int xlo, unsigned char *dst, int width, int flip) {
    for (int j = 0; j < width; j++) {
        int x = flip ? width - 1 - j : j;
        const int16_t *c = h->coeff + (size_t)x * h->stride;
        const unsigned char *p = row + (size_t)(h->first[x] - xlo) * 3;
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

/* Two output pixels per step, one per 128-bit lane. Per pixel: 16 bytes from its first tap (5 RGB
 * pixels: taps 4g .. 4g+3 and one spare), taps 4g, 4g+1 and 4g+2, 4g+3 gathered as 16-bit
 * (r, r', g, g', b, b', 0, 0) for a multiply-add with (c, c', c, c', c, c', 0, 0) -> int32
 * (r, g, b, 0). The 4-byte store of a pixel spills one byte into the next, which is stored after it;
 * the row's last pixel is stored in 3 bytes. */
AVX2 static void horizontal_vector(const unsigned char *row, const taps *h, int xlo, unsigned char *dst, int width,
                                   int flip) {
    const __m256i taps01 = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                                            0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i taps23 = _mm256_setr_epi8(6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1,
                                            6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1);
    int j = 0;
    for (; j + 2 <= width; j += 2) {
        int xa = flip ? width - 1 - j : j, xb = flip ? width - 2 - j : j + 1;
        const __m128i *ca = (const __m128i *)(h->pairs + (size_t)xa * h->stride * 4);
        const __m128i *cb = (const __m128i *)(h->pairs + (size_t)xb * h->stride * 4);
        const unsigned char *pa = row + (size_t)(h->first[xa] - xlo) * 3, *pb = row + (size_t)(h->first[xb] - xlo) * 3;
        int n = h->count[xa] > h->count[xb] ? h->count[xa] : h->count[xb];
        __m256i acc = _mm256_set1_epi32(ROUND);
        for (int g = 0; g < n; g += 4, pa += 12, pb += 12, ca += 2, cb += 2) {
            __m256i pixels = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)pa)),
                                                     _mm_loadu_si128((const __m128i *)pb), 1);
            __m256i c01 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(ca)), _mm_loadu_si128(cb), 1);
            __m256i c23 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(ca + 1)),
                                                  _mm_loadu_si128(cb + 1), 1);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(pixels, taps01), c01));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(pixels, taps23), c23));
        }
        __m256i words = _mm256_packs_epi32(_mm256_srai_epi32(acc, PRECISION), acc);
        __m256i bytes = _mm256_packus_epi16(words, words);
        uint32_t a = (uint32_t)_mm256_cvtsi256_si32(bytes);
        uint32_t b = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1));
        memcpy(dst + 3 * j, &a, 4);
        memcpy(dst + 3 * j + 3, &b, j + 2 < width ? 4 : 3); /* little-endian: r, g, b are the low bytes */
    }
    if (j < width) { /* an odd width's last pixel */
        int x = flip ? 0 : j;
        taps one = *h;
        one.first = h->first + x;
        one.count = h->count + x;
        one.coeff = h->coeff + (size_t)x * h->stride;
        horizontal_scalar(row, &one, xlo, dst + 3 * j, 1, 0);
    }
}

static int have_avx2 = -1;
#endif

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

int resize_crop_rgb(const unsigned char *src, int src_width, int top, int left, int height,
                    int width, unsigned char *out, int out_height, int out_width, int flip, int vector) {
    taps v, h;
    int status = -1;
    memset(&v, 0, sizeof v);
    memset(&h, 0, sizeof h);
    /* the crop is the image: taps stop at its edges, as when torchvision crops, then resizes */
    size_t src_stride = (size_t)src_width * 3;
    src += (size_t)top * src_stride + (size_t)left * 3;
    if (make_taps(&v, height, 0, height, out_height) == 0 && make_taps(&h, width, 0, width, out_width) == 0) {
        /* the columns the horizontal taps reach: the vertical pass makes only those */
        int xlo = h.first[0], xhi = h.first[out_width - 1] + h.count[out_width - 1];
        int bytes = (xhi - xlo) * 3;
        unsigned char *mid = malloc((size_t)bytes + PAD);
        unsigned char *rgb_row = mid;
        vector = vector && resize_vector_available();
        if (mid != NULL && (!vector || make_pairs(&h, out_width) == 0)) {
            memset(mid + bytes, 0, PAD);
            for (int y = 0; y < out_height; y++) {
#ifdef HAVE_VECTOR_PASSES
                if (vector) {
                    vertical_vector(src + (size_t)xlo * 3, src_stride, &v, y, rgb_row, bytes);
                    horizontal_vector(rgb_row, &h, xlo, out + (size_t)y * out_width * 3, out_width, flip);
                    continue;
                }
#endif
                vertical_scalar(src + (size_t)xlo * 3, src_stride, &v, y, rgb_row, bytes);
                horizontal_scalar(rgb_row, &h, xlo, out + (size_t)y * out_width * 3, out_width, flip);
            }
            status = 0;
        }
        free(mid);
    }
    free_taps(&v);
    free_taps(&h);
    return status;
}
