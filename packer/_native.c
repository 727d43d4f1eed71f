/* packer's compiled helpers for the read path, the module packer._native: crop-on-decode for JPEG
 * records (libjpeg's jpeg_crop_scanline + jpeg_skip_scanlines, below), the crop resize
 * (resize_crop: packer/_resize.c), Pillow's RGBX result packed into a batch slot (pack_rgb) and
 * float32 normalization with streaming stores (normalize).
 *
 * A training crop covers ~45% of a record on average, but a plain decode does the inverse DCT,
 * upsampling and colour conversion of every pixel. libjpeg (libjpeg-turbo >= 1.5, Debian's 2.1
 * included) can decode only a band of iMCU columns and skip rows; the TurboJPEG API offers that
 * only from libjpeg-turbo 3.0, and PyTurboJPEG 1.x not at all, hence this small binding.
 *
 * decode_crop(data, top, left, height, width, scale_num, scale_denom, channels, out)
 *   decodes rows [top, top + height) and at least columns [left, left + width) of the image as
 *   scaled by scale_num/scale_denom, as RGB (channels 3) or RGBX (4), into the writable buffer
 *   `out`, rows packed at (returned width) x channels bytes. Returns
 *   (x_offset, out_width, image_width, image_height): the decoded band starts at column x_offset
 *   (iMCU-aligned, <= left) and is out_width columns wide. Corrupt data, including what libjpeg
 *   only warns about, raises ValueError; the GIL is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#include "_resize.h"

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: damaged data, treated as an error as the rest of packer does */
        on_error(cinfo);
    }
}

typedef struct {
    const unsigned char *data;
    unsigned long size;
    unsigned int top, left, height, width, num, denom, channels;
    unsigned char *out;
    size_t out_size;
    /* results */
    unsigned int x_offset, out_width, image_width, image_height;
    char message[JMSG_LENGTH_MAX];
} job;

/* Returns 0 on success, else -1 with job->message set. No Python calls: runs without the GIL. */
static int run(job *j) {
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    JDIMENSION x_offset, width;

    memset(&cinfo, 0, sizeof cinfo); /* so that jpeg_destroy_decompress is safe at any point */
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        snprintf(j->message, sizeof j->message, "%s", err.message);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, j->data, j->size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = j->channels == 4 ? JCS_EXT_RGBX : JCS_RGB;
    cinfo.scale_num = j->num;
    cinfo.scale_denom = j->denom;
    jpeg_start_decompress(&cinfo);
    j->image_width = cinfo.output_width;
    j->image_height = cinfo.output_height;
    if (j->width == 0 || j->height == 0 || j->left + j->width > cinfo.output_width ||
        j->top + j->height > cinfo.output_height) {
        snprintf(j->message, sizeof j->message, "crop %ux%u at (%u, %u) outside the %ux%u image",
                 j->width, j->height, j->left, j->top, cinfo.output_width, cinfo.output_height);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    x_offset = j->left;
    width = j->width;
    jpeg_crop_scanline(&cinfo, &x_offset, &width);
    if ((size_t)j->height * width * j->channels > j->out_size) {
        snprintf(j->message, sizeof j->message, "output buffer too small");
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    while (cinfo.output_scanline < j->top) {
        if (jpeg_skip_scanlines(&cinfo, j->top - cinfo.output_scanline) == 0) {
            snprintf(j->message, sizeof j->message, "cannot skip to row %u", j->top);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
    }
    while (cinfo.output_scanline < j->top + j->height) {
        JSAMPROW rows[16]; /* libjpeg returns up to one iMCU row per call: pass that many */
        JDIMENSION k, first = cinfo.output_scanline - j->top, count = j->top + j->height - cinfo.output_scanline;
        if (count > 16) count = 16;
        for (k = 0; k < count; k++) rows[k] = j->out + (size_t)(first + k) * width * j->channels;
        jpeg_read_scanlines(&cinfo, rows, count);
    }
    j->x_offset = x_offset;
    j->out_width = width;
    jpeg_destroy_decompress(&cinfo); /* the rows below the crop are never decoded */
    return 0;
}

static PyObject *decode_crop(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    job j;
    int status;

    memset(&j, 0, sizeof j);
    if (!PyArg_ParseTuple(args, "y*IIIIIIIw*", &data, &j.top, &j.left, &j.height, &j.width, &j.num, &j.denom,
                          &j.channels, &out)) {
        return NULL;
    }
    if (j.channels != 3 && j.channels != 4) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "channels must be 3 or 4");
        return NULL;
    }
    j.data = data.buf;
    j.size = (unsigned long)data.len;
    j.out = out.buf;
    j.out_size = (size_t)out.len;
    Py_BEGIN_ALLOW_THREADS
    status = run(&j);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (status != 0) {
        PyErr_SetString(PyExc_ValueError, j.message);
        return NULL;
    }
    return Py_BuildValue("(IIII)", j.x_offset, j.out_width, j.image_width, j.image_height);
}

/* The Arrow C data interface (a stable ABI): Pillow exports an image's pixels through it without a copy. */
struct ArrowSchema {
    const char *format, *name, *metadata;
    int64_t flags, n_children;
    struct ArrowSchema **children, *dictionary;
    void (*release)(struct ArrowSchema *);
    void *private_data;
};
struct ArrowArray {
    int64_t length, null_count, offset, n_buffers, n_children;
    const void **buffers;
    struct ArrowArray **children, *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};

/* The RGBX pixels of an image exported by Pillow's __arrow_c_array__() (a fixed-size list of 4 uint8
 * per pixel, width x height of them), or NULL with an exception set. */
static const unsigned char *arrow_pixels(PyObject *exported, unsigned int width, unsigned int height) {
    PyObject *schema_capsule, *array_capsule;
    const struct ArrowSchema *schema;
    const struct ArrowArray *array, *child;

    if (!PyArg_ParseTuple(exported, "OO", &schema_capsule, &array_capsule)) return NULL;
    schema = PyCapsule_GetPointer(schema_capsule, "arrow_schema");
    array = schema ? PyCapsule_GetPointer(array_capsule, "arrow_array") : NULL;
    if (!array) return NULL;
    if (strcmp(schema->format, "+w:4") != 0 || schema->n_children != 1 || strcmp(schema->children[0]->format, "C") != 0 ||
        array->n_children != 1 || array->length != (int64_t)width * height) {
        PyErr_SetString(PyExc_ValueError, "not RGBX pixels of the expected size");
        return NULL;
    }
    child = array->children[0];
    if (child->n_buffers != 2 || child->buffers[1] == NULL || child->length < (array->offset + array->length) * 4) {
        PyErr_SetString(PyExc_ValueError, "unexpected Arrow layout");
        return NULL;
    }
    return (const unsigned char *)child->buffers[1] + (child->offset + array->offset * 4);
}

/* One row of RGBX pixels to RGB, mirrored if `flip`. */
static void pack_row(const unsigned char *src, unsigned char *dst, unsigned int width, int flip) {
    if (flip) {
        const unsigned char *p = src + (size_t)(width - 1) * 4;
        for (unsigned int x = 0; x < width; x++, p -= 4, dst += 3) {
            dst[0] = p[0];
            dst[1] = p[1];
            dst[2] = p[2];
        }
    } else {
        const unsigned char *p = src;
        for (unsigned int x = 0; x < width; x++, p += 4, dst += 3) {
            dst[0] = p[0];
            dst[1] = p[1];
            dst[2] = p[2];
        }
    }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <tmmintrin.h>
#define HAVE_SSSE3_PATH 1
static int have_ssse3 = 0; /* set at import from the CPU's flags */

/* pack_row with one byte shuffle per four pixels (3.5x faster here). Each 16-byte store writes 4
 * bytes past its 12: the next pixel and the first byte of the one after, which later steps
 * overwrite. The loop stops while two pixels are left for the scalar tail, so no store passes the
 * row's end (the fuzzer under AddressSanitizer found the last row of a slot written one byte past). */
__attribute__((target("ssse3"))) static void pack_row_ssse3(const unsigned char *src, unsigned char *dst,
                                                           unsigned int width, int flip) {
    const __m128i forward = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m128i mirrored = _mm_setr_epi8(12, 13, 14, 8, 9, 10, 4, 5, 6, 0, 1, 2, -1, -1, -1, -1);
    unsigned int x = 0;
    for (; x + 6 <= width; x += 4, dst += 12) {
        size_t first = flip ? width - 4 - x : x;
        __m128i pixels = _mm_loadu_si128((const __m128i *)(src + first * 4));
        _mm_storeu_si128((__m128i *)dst, _mm_shuffle_epi8(pixels, flip ? mirrored : forward));
    }
    if (x < width) {
        pack_row(flip ? src : src + (size_t)x * 4, dst, width - x, flip);
    }
}
#endif

/* pack_rgb(src, width, height, flip, out): RGBX pixels (Pillow's layout, 4 bytes a pixel) to packed
 * RGB in the writable buffer `out` (a batch slot), mirrored left-right when `flip`, in one pass.
 * `src` is the pair Image.__arrow_c_array__() returns (read in place) or a bytes-like object. */
static PyObject *pack_rgb(PyObject *self, PyObject *args) {
    PyObject *src;
    Py_buffer src_view, out;
    unsigned int width, height;
    int flip, have_view = 0;
    const unsigned char *s;

    if (!PyArg_ParseTuple(args, "OIIpw*", &src, &width, &height, &flip, &out)) {
        return NULL;
    }
    if (PyTuple_Check(src)) {
        s = arrow_pixels(src, width, height);
    } else if (PyObject_GetBuffer(src, &src_view, PyBUF_SIMPLE) == 0) {
        have_view = 1;
        s = src_view.buf;
        if ((size_t)src_view.len < (size_t)width * height * 4) {
            PyErr_SetString(PyExc_ValueError, "source too small for the image");
            s = NULL;
        }
    } else {
        s = NULL;
    }
    if (s != NULL && (size_t)out.len < (size_t)width * height * 3) {
        PyErr_SetString(PyExc_ValueError, "output too small for the image");
        s = NULL;
    }
    if (s != NULL) {
        unsigned char *d = out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (unsigned int y = 0; y < height; y++) {
#ifdef HAVE_SSSE3_PATH
            if (have_ssse3) {
                pack_row_ssse3(s + (size_t)y * width * 4, d + (size_t)y * width * 3, width, flip);
                continue;
            }
#endif
            pack_row(s + (size_t)y * width * 4, d + (size_t)y * width * 3, width, flip);
        }
        Py_END_ALLOW_THREADS
    }
    if (have_view) PyBuffer_Release(&src_view);
    PyBuffer_Release(&out);
    if (s == NULL) return NULL;
    Py_RETURN_NONE;
}

/* normalize(src, out, mean255, inv_std255): out = (src - mean255) * inv_std255 per channel, for
 * packed uint8 pixels of 3 channels into float32 `out` (same element count), in one pass.
 *
 * A float32 batch is 4x the bytes of its uint8 crops and far larger than the caches, so writing it
 * is bound by memory bandwidth. Ordinary stores first read each destination line into the cache
 * (and torch's copy + sub + mul passes the crop three times); non-temporal stores write each line
 * once, bypassing the cache. The arithmetic is the same float32 subtract then multiply as the torch
 * path's, so results are identical. */
static void normalize_scalar(const unsigned char *s, float *d, size_t n, const float *mean, const float *inv,
                             size_t phase) {
    for (size_t i = 0; i < n; i++, phase = phase == 2 ? 0 : phase + 1) {
        d[i] = ((float)s[i] - mean[phase]) * inv[phase];
    }
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* 48 bytes (16 pixels) per step: twelve 4-float vectors whose channel phase cycles 0, 1, 2. */
static size_t normalize_sse2(const unsigned char *s, float *d, size_t n, const float *mean, const float *inv) {
    __m128 m[3], k[3];
    for (int p = 0; p < 3; p++) {
        m[p] = _mm_setr_ps(mean[p % 3], mean[(p + 1) % 3], mean[(p + 2) % 3], mean[p % 3]);
        k[p] = _mm_setr_ps(inv[p % 3], inv[(p + 1) % 3], inv[(p + 2) % 3], inv[p % 3]);
    }
    /* vector j of a step starts at element 4j, channel (4j) % 3 = j % 3 ... as 4 = 1 (mod 3) */
    const __m128i zero = _mm_setzero_si128();
    int stream = ((uintptr_t)d & 15) == 0;
    size_t i = 0;
    for (; i + 48 <= n; i += 48) {
        for (int b = 0; b < 3; b++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(s + i + 16 * b));
            __m128i lo = _mm_unpacklo_epi8(bytes, zero), hi = _mm_unpackhi_epi8(bytes, zero);
            __m128i words[4] = {_mm_unpacklo_epi16(lo, zero), _mm_unpackhi_epi16(lo, zero),
                                _mm_unpacklo_epi16(hi, zero), _mm_unpackhi_epi16(hi, zero)};
            for (int q = 0; q < 4; q++) {
                int j = 4 * b + q, p = j % 3;
                __m128 v = _mm_mul_ps(_mm_sub_ps(_mm_cvtepi32_ps(words[q]), m[p]), k[p]);
                if (stream) {
                    _mm_stream_ps(d + i + 4 * j, v);
                } else {
                    _mm_storeu_ps(d + i + 4 * j, v);
                }
            }
        }
    }
    if (stream) _mm_sfence();
    return i;
}
#endif

static PyObject *normalize(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    float mean[3], inv[3];

    if (!PyArg_ParseTuple(args, "y*w*(fff)(fff)", &src, &out, &mean[0], &mean[1], &mean[2], &inv[0], &inv[1],
                          &inv[2])) {
        return NULL;
    }
    size_t n = (size_t)src.len;
    int ok = n % 3 == 0 && (size_t)out.len == n * sizeof(float);
    if (ok) {
        const unsigned char *s = src.buf;
        float *d = out.buf;
        Py_BEGIN_ALLOW_THREADS
        size_t done = 0;
#if defined(__SSE2__)
        done = normalize_sse2(s, d, n, mean, inv);
#endif
        normalize_scalar(s + done, d + done, n - done, mean, inv, done % 3);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_SetString(PyExc_ValueError, "normalize needs 3-channel uint8 pixels and a float32 output of as many elements");
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* resize_crop(src, src_height, src_width, top, left, height, width, out, out_height, out_width, flip,
 * vector=True, lanczos=False): packer/_resize.c's resize of a box of packed RGB pixels into `out`,
 * antialiased bilinear or Lanczos, GIL released. */
static PyObject *resize_crop(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    int src_height, src_width, top, left, height, width, out_height, out_width, flip, vector = 1, lanczos = 0;
    int status = 0;
    const char *problem = NULL;

    if (!PyArg_ParseTuple(args, "y*iiiiiiw*iip|pp", &src, &src_height, &src_width, &top, &left, &height, &width, &out,
                          &out_height, &out_width, &flip, &vector, &lanczos)) {
        return NULL;
    }
    if (src_height <= 0 || src_width <= 0 || (size_t)src.len < (size_t)src_height * src_width * 3) {
        problem = "source smaller than its stated size";
    } else if (top < 0 || left < 0 || height <= 0 || width <= 0 || top + height > src_height || left + width > src_width) {
        problem = "crop box outside the source image";
    } else if (out_height <= 0 || out_width <= 0 || (size_t)out.len < (size_t)out_height * out_width * 3) {
        problem = "output too small for the resized crop";
    } else {
        Py_BEGIN_ALLOW_THREADS
        status = resize_crop_rgb(src.buf, src_width, top, left, height, width, out.buf, out_height,
                                 out_width, flip, lanczos, vector);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, top, left, height, width, scale_num, scale_denom, channels, out) -> "
     "(x_offset, out_width, image_width, image_height)"},
    {"pack_rgb", pack_rgb, METH_VARARGS,
     "pack_rgb(src, width, height, flip, out): RGBX pixels (Image.__arrow_c_array__() or bytes) to RGB in out"},
    {"normalize", normalize, METH_VARARGS,
     "normalize(src, out, mean255, inv_std255): 3-channel uint8 pixels to (x - mean255) * inv_std255 as float32 in out"},
    {"resize_crop", resize_crop, METH_VARARGS,
     "resize_crop(src, src_height, src_width, top, left, height, width, out, out_height, out_width, flip, "
     "vector=True, lanczos=False): antialiased bilinear (or Lanczos) resize of a box of packed RGB pixels into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef HAVE_SSSE3_PATH
    __builtin_cpu_init();
    have_ssse3 = __builtin_cpu_supports("ssse3");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "RESIZE_VECTOR", resize_vector_available()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
