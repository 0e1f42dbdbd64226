/* The fast path's downscale: antialiased bilinear (PIL's BILINEAR filter, torch's antialias=True), uint8,
 * interleaved channels. Written here so that a download process never imports torch for it: torch's
 * import costs ~2 CPU-seconds a process (~3% of a 10,000-row shard's), for one op of its kernel library.
 *
 * Separable, in fixed point as torch's uint8 kernel: per pass, each output pixel's weights are PIL's
 * (a triangle as wide as the scale factor, normalised), rounded to int16 with as many fraction bits as
 * the largest weight allows; sums in int32, rounded, clipped to uint8 between the passes. Torch runs the
 * horizontal pass first; here the vertical one goes first (it shrinks the rows the second pass reads),
 * so a pixel can differ from torch's by one grey level. Both passes are the same vertical pass: the
 * horizontal one runs on the transposed image, where it reads whole rows (SIMD) instead of gathers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int *first;    /* first input index of each output pixel */
    int *count;    /* how many inputs it reads */
    int16_t *w;    /* ``taps`` weights per output pixel */
    int taps, bits;
} Coeffs;

static void coeffs_free(Coeffs *k) { free(k->first); free(k->count); free(k->w); }

/* PIL's precompute_coeffs (Resample.c) for the triangle filter; int16 as torch's
 * _compute_index_ranges_int16_weights. Returns 0, or -1 when out of memory. */
static int coeffs(int in, int out, Coeffs *k) {
    double scale = (double)in / out, support = scale < 1.0 ? 1.0 : scale, inv = 1.0 / support, wmax = 0.0;
    int taps = (int)ceil(support) * 2 + 1;
    double *wd = calloc((size_t)taps * out, sizeof(double));
    k->first = malloc(sizeof(int) * out);
    k->count = malloc(sizeof(int) * out);
    k->w = calloc((size_t)taps * out, sizeof(int16_t));
    k->taps = taps;
    if (!wd || !k->first || !k->count || !k->w) { free(wd); return -1; }
    for (int o = 0; o < out; o++) {
        double center = (o + 0.5) * scale, sum = 0.0, *row = wd + (size_t)o * taps;
        int lo = (int)(center - support + 0.5), hi = (int)(center + support + 0.5);
        lo = lo < 0 ? 0 : lo;
        hi = hi > in ? in : hi;
        for (int i = 0; i < hi - lo; i++) {
            double t = fabs((i + lo - center + 0.5) * inv);
            row[i] = t < 1.0 ? 1.0 - t : 0.0;
            sum += row[i];
        }
        for (int i = 0; i < hi - lo; i++) {
            row[i] = sum != 0.0 ? row[i] / sum : row[i];
            wmax = row[i] > wmax ? row[i] : wmax;
        }
        k->first[o] = lo;
        k->count[o] = hi - lo;
    }
    int bits = 0;  /* the most fraction bits that keep the largest weight in an int16 */
    while (bits < 15 && (int)(0.5 + wmax * (1 << (bits + 1))) < (1 << 15)) bits++;
    for (size_t i = 0; i < (size_t)taps * out; i++)
        k->w[i] = (int16_t)(wd[i] < 0 ? -0.5 + wd[i] * (1 << bits) : 0.5 + wd[i] * (1 << bits));
    k->bits = bits;
    free(wd);
    return 0;
}

/* One output row, out[i] = sum_j w[j] * rows[j][i] (rows ``len`` bytes apart), from byte ``from`` on. */
static void row_scalar(const uint8_t *rows, int len, int n, const int16_t *w, int bits, uint8_t *out, int from) {
    for (int i = from; i < len; i++) {
        int32_t a = 1 << (bits - 1);
        for (int j = 0; j < n; j++) a += rows[(size_t)j * len + i] * w[j];
        a >>= bits;
        out[i] = a < 0 ? 0 : a > 255 ? 255 : (uint8_t)a;
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
/* 32 bytes at a time, two input rows per multiply-add (bytes interleaved, weights paired): the layout of
 * torch's and Pillow-SIMD's kernels. */
__attribute__((target("avx2")))
static void row_avx2(const uint8_t *rows, int len, int n, const int16_t *w, int bits, uint8_t *out) {
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32(1 << (bits - 1));
    if (len < 32) {
        row_scalar(rows, len, n, w, bits, out, 0);
        return;
    }
    for (int i = 0;; i += 32) {
        if (i > len - 32) i = len - 32;  /* the last block overlaps the one before it: the same values */
        __m256i a0 = half, a1 = half, a2 = half, a3 = half;
        const uint8_t *p = rows + i;
        int j = 0;
        for (; j + 1 < n; j += 2, p += 2 * (size_t)len) {
            __m256i r0 = _mm256_loadu_si256((const __m256i *)p), r1 = _mm256_loadu_si256((const __m256i *)(p + len));
            __m256i k = _mm256_set1_epi32((int32_t)(uint16_t)w[j] | (int32_t)((uint32_t)(uint16_t)w[j + 1] << 16));
            __m256i lo = _mm256_unpacklo_epi8(r0, r1), hi = _mm256_unpackhi_epi8(r0, r1);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), k));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), k));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), k));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), k));
        }
        if (j < n) {  /* an odd tap: paired with zeros */
            __m256i r0 = _mm256_loadu_si256((const __m256i *)p), k = _mm256_set1_epi32((uint16_t)w[j]);
            __m256i lo = _mm256_unpacklo_epi8(r0, zero), hi = _mm256_unpackhi_epi8(r0, zero);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi16(lo, zero), k));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi16(lo, zero), k));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi16(hi, zero), k));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi16(hi, zero), k));
        }
        __m256i b0 = _mm256_packs_epi32(_mm256_srai_epi32(a0, bits), _mm256_srai_epi32(a1, bits));
        __m256i b1 = _mm256_packs_epi32(_mm256_srai_epi32(a2, bits), _mm256_srai_epi32(a3, bits));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_packus_epi16(b0, b1));  /* lanes back in order */
        if (i == len - 32) break;
    }
}
#endif

/* The vertical pass: ``src`` rows of ``len`` bytes to ``k``'s output rows in ``dst``. */
static void vertical(const uint8_t *src, int len, const Coeffs *k, int out_rows, uint8_t *dst, int simd) {
#if defined(__x86_64__)
    simd = simd && __builtin_cpu_supports("avx2");
#else
    simd = 0;
#endif
    for (int o = 0; o < out_rows; o++) {
        const uint8_t *rows = src + (size_t)k->first[o] * len;
        const int16_t *w = k->w + (size_t)o * k->taps;
#if defined(__x86_64__)
        if (simd) {
            row_avx2(rows, len, k->count[o], w, k->bits, dst + (size_t)o * len);
            continue;
        }
#endif
        row_scalar(rows, len, k->count[o], w, k->bits, dst + (size_t)o * len, 0);
    }
}

/* (rows, cols) pixels of c bytes to (cols, rows), in 32x32 blocks that keep both sides in cache.
 * Three-byte pixels move as four-byte words, each word's extra byte overwritten by the next pixel's
 * (``src`` has a byte to spare after its end; the last pixel of each output row moves as three bytes). */
static void transpose(const uint8_t *src, int rows, int cols, int c, uint8_t *dst) {
    enum { B = 32 };
    for (int r0 = 0; r0 < rows; r0 += B)
        for (int c0 = 0; c0 < cols; c0 += B) {
            int r1 = r0 + B < rows ? r0 + B : rows, c1 = c0 + B < cols ? c0 + B : cols;
            for (int q = c0; q < c1; q++) {
                const uint8_t *s = src + ((size_t)r0 * cols + q) * c;
                uint8_t *d = dst + ((size_t)q * rows + r0) * c;
                size_t step = (size_t)cols * c;
                if (c == 3) {
                    int words = r1 == rows ? r1 - 1 : r1;
                    for (int r = r0; r < words; r++, s += step, d += 3) {
                        uint32_t v;
                        memcpy(&v, s, 4);
                        memcpy(d, &v, 4);
                    }
                    if (words < r1) memcpy(d, s, 3);
                } else {
                    for (int r = r0; r < r1; r++, s += step, d += c) memcpy(d, s, c);
                }
            }
        }
}

static PyObject *downscale(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int h, w, c, nh, nw, simd = 1;
    if (!PyArg_ParseTuple(args, "y*iiiw*ii|p", &src, &h, &w, &c, &dst, &nh, &nw, &simd)) return NULL;
    PyObject *result = NULL;
    Coeffs kv = {0}, kh = {0};
    uint8_t *t1 = NULL, *t2 = NULL, *t3 = NULL;
    if (h < 1 || w < 1 || c < 1 || nh < 1 || nw < 1 || (size_t)w * c > INT_MAX || (size_t)nh * c > INT_MAX
        || src.len != (Py_ssize_t)h * w * c || dst.len != (Py_ssize_t)nh * nw * c) {
        PyErr_Format(PyExc_ValueError, "downscale: %dx%dx%d to %dx%d does not fit buffers of %zd and %zd bytes",
                     h, w, c, nh, nw, src.len, dst.len);
        goto done;
    }
    size_t mid = (size_t)nh * w * c;
    t1 = malloc(mid + 1);                   /* + 1: transpose's spare byte */
    t2 = malloc(mid);
    t3 = malloc((size_t)nw * nh * c + 1);
    if (coeffs(h, nh, &kv) < 0 || coeffs(w, nw, &kh) < 0 || !t1 || !t2 || !t3) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    vertical(src.buf, w * c, &kv, nh, t1, simd);   /* h x w   -> nh x w */
    transpose(t1, nh, w, c, t2);                   /*         -> w x nh */
    vertical(t2, nh * c, &kh, nw, t3, simd);       /*         -> nw x nh */
    transpose(t3, nw, nh, c, dst.buf);             /*         -> nh x nw */
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    coeffs_free(&kv);
    coeffs_free(&kh);
    free(t1);
    free(t2);
    free(t3);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"downscale", downscale, METH_VARARGS,
     "downscale(src, h, w, c, dst, new_h, new_w, simd=True): antialiased bilinear resize of the C-contiguous\n"
     "uint8 image ``src`` (h x w x c) into ``dst`` (new_h x new_w x c); ``simd=False`` takes the scalar path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_downscale", NULL, -1, methods};

PyMODINIT_FUNC PyInit__downscale(void) { return PyModule_Create(&module); }
