/* PNG's row filters undone (PNG spec, section 9): the step of a PNG decode after the inflate, for the fast
 * PNG path (png.py). 8-bit samples only, so a filter's "previous pixel" is ``bpp`` bytes back. Up (the most
 * common filter) is written so that gcc vectorises it; Sub, Average and Paeth depend on the byte just
 * decoded, so they go a byte at a time, as libpng's own C does. The GIL is released for the whole image.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint8_t paeth(int a, int b, int c) {
    int p = b - c, q = a - c;            /* pa = |b - c|, pb = |a - c|, pc = |a + b - 2c| */
    int pa = abs(p), pb = abs(q), pc = abs(p + q);
    return (uint8_t)(pa <= pb && pa <= pc ? a : pb <= pc ? b : c);
}

/* One row: ``in`` its filtered bytes (after the filter-type byte), ``prev`` the row above, already
 * unfiltered (a row of zeros for the first), ``out`` where it goes. Returns 0, or -1 for an unknown type. */
static int unfilter_row(int type, const uint8_t *in, const uint8_t *prev, uint8_t *out, int len, int bpp) {
    int i;
    switch (type) {
    case 0:
        memcpy(out, in, len);
        return 0;
    case 1:
        memcpy(out, in, bpp < len ? bpp : len);
        for (i = bpp; i < len; i++) out[i] = (uint8_t)(in[i] + out[i - bpp]);
        return 0;
    case 2:
        for (i = 0; i < len; i++) out[i] = (uint8_t)(in[i] + prev[i]);
        return 0;
    case 3:
        for (i = 0; i < bpp && i < len; i++) out[i] = (uint8_t)(in[i] + (prev[i] >> 1));
        for (; i < len; i++) out[i] = (uint8_t)(in[i] + ((out[i - bpp] + prev[i]) >> 1));
        return 0;
    case 4:
        for (i = 0; i < bpp && i < len; i++) out[i] = (uint8_t)(in[i] + prev[i]);  /* paeth(0, b, 0) = b */
        for (; i < len; i++) out[i] = (uint8_t)(in[i] + paeth(out[i - bpp], prev[i], prev[i - bpp]));
        return 0;
    default:
        return -1;
    }
}

static PyObject *unfilter(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int h, len, bpp;
    if (!PyArg_ParseTuple(args, "y*iiiw*", &src, &h, &len, &bpp, &dst)) return NULL;
    PyObject *result = NULL;
    uint8_t *zeros = NULL;
    if (h < 1 || len < 1 || bpp < 1 || bpp > 8 || src.len != (Py_ssize_t)h * (len + 1)
        || dst.len != (Py_ssize_t)h * len) {
        PyErr_Format(PyExc_ValueError, "unfilter: %d rows of %d bytes (%d a pixel) do not fit buffers of %zd "
                     "and %zd bytes", h, len, bpp, src.len, dst.len);
        goto done;
    }
    zeros = calloc(len, 1);
    if (!zeros) {
        PyErr_NoMemory();
        goto done;
    }
    int bad_row = -1, bad_type = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *in = src.buf, *prev = zeros;
    uint8_t *out = dst.buf;
    for (int y = 0; y < h; y++, in += len + 1, prev = out, out += len) {
        if (unfilter_row(in[0], in + 1, prev, out, len, bpp) < 0) {
            bad_row = y;
            bad_type = in[0];
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad_row >= 0) {
        PyErr_Format(PyExc_ValueError, "unfilter: row %d has filter type %d (0-4 exist)", bad_row, bad_type);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(zeros);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"unfilter", unfilter, METH_VARARGS,
     "unfilter(src, rows, row_bytes, bpp, dst): PNG's filters undone, 8-bit samples: ``src`` the inflated\n"
     "image data (each row a filter-type byte and ``row_bytes`` bytes), ``dst`` rows x row_bytes for the\n"
     "pixels; ValueError naming the row when a filter type is not 0-4."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_unfilter", NULL, -1, methods};

PyMODINIT_FUNC PyInit__unfilter(void) { return PyModule_Create(&module); }
