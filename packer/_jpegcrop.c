/* Crop-on-decode for JPEG records: libjpeg's jpeg_crop_scanline + jpeg_skip_scanlines.
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
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

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

static PyMethodDef methods[] = {
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, top, left, height, width, scale_num, scale_denom, channels, out) -> "
     "(x_offset, out_width, image_width, image_height)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegcrop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegcrop(void) { return PyModule_Create(&module); }
