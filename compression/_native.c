/* Compiled inner loops of the float16 and uint8-blockwise codecs.
 *
 * Optional: the package builds without it (no compiler) and then runs the numpy kernels
 * in halfconv.py and blockwise.py. Every function here is bit-identical to its numpy
 * counterpart (tests/compression/test_native.py checks both on the same inputs): only
 * exactly rounded single IEEE operations and table lookups, and the build passes
 * -ffp-contract=off so that no multiply and add fuse into one differently rounded FMA.
 *
 * Why: numpy makes one pass over memory per operation. A blockwise encode is four of
 * them after the block scales (scale, shift, gather, store); here it is one, and the all-reduce's codec
 * time is the largest part of a 2-peer round on two cores.
 *
 * Interface: contiguous buffers (the buffer protocol, no numpy headers at build time),
 * lengths checked against each other, the GIL released around every loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Element types that may sit at any address: a payload starts wherever its message
 * header ends, so its float16 words are often at an odd offset. With these types gcc and
 * clang use unaligned vector loads and never assume more alignment than 1 byte. Other
 * compilers get the plain types, and get() refuses unaligned buffers for them. */
#if defined(__GNUC__)
typedef uint16_t u16 __attribute__((aligned(1)));
typedef uint32_t u32 __attribute__((aligned(1)));
typedef float f32 __attribute__((aligned(1)));
#define ANY_ALIGNMENT 1
#else
typedef uint16_t u16;
typedef uint32_t u32;
typedef float f32;
#define ANY_ALIGNMENT 0
#endif

/* The hot loops are also compiled for AVX2 and picked at load time where the CPU has it
 * (same IEEE operations, so the same bits); SSE2 lacks the narrowing stores they need. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* ---------------------------------------------------------------------------------
 * Buffer helpers. */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

/* Get a contiguous buffer of `itemsize`-byte items from `obj`; NULL-safe for None when
 * `optional`. Returns the item count, or -1 with an exception set. */
static Py_ssize_t get(PyObject *obj, Buf *b, int writable, Py_ssize_t itemsize,
                      int optional, const char *name) {
    b->held = 0;
    if (obj == Py_None && optional) return 0;
    if (PyObject_GetBuffer(obj, &b->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    b->held = 1;
    if (b->view.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items",
                     name, b->view.len, itemsize);
        release(b);
        return -1;
    }
    if (!ANY_ALIGNMENT && (uintptr_t)b->view.buf % (uintptr_t)itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: buffer is not aligned to its %zd-byte items",
                     name, itemsize);
        release(b);
        return -1;
    }
    return b->view.len / itemsize;
}

/* ---------------------------------------------------------------------------------
 * float32 <-> binary16. */

#define F16_OVERFLOW 0x477FF000u /* 65520: rounds to Inf in binary16 */
#define F32_INF 0x7F800000u
#define F16_MIN_NORMAL (113u << 23) /* 2**-14 */
#define F16_MAX_BITS 0x477FE000u /* 65504 */

/* The magnitude `a` (float32 bits, finite) rounded to binary16 precision, nearest even,
 * saturating at 65504; still float32 bits. Adding M = 2**(max(e, -14) + 13) to a value
 * of exponent e leaves exactly binary16's precision, so (a + M) - M is a rounded by the
 * FPU, subnormals included (the numpy kernel in halfconv.py does the same operations). */
static inline uint32_t half_round(uint32_t a) {
    uint32_t e = a & F32_INF;
    float m = u2f((e > F16_MIN_NORMAL ? e : F16_MIN_NORMAL) + (13u << 23));
    uint32_t r = f2u((u2f(a) + m) - m);
    return a >= F16_OVERFLOW ? F16_MAX_BITS : r;
}

/* The binary16 word of a rounded magnitude (see half_round) with float32 sign bits:
 * times 2**-112 (exact) puts binary16's exponent and mantissa in bits 13..27. */
static inline uint16_t half_word(uint32_t rounded, uint32_t sign) {
    return (uint16_t)((f2u(u2f(rounded) * 0x1p-112f) >> 13) | (sign >> 16));
}

/* A binary16 word (finite) to float32: the word, sign-extended and shifted, is the value
 * times 2**-112 once bits 28..30 are cleared; one exact multiply rebiases it. */
static inline float half_value(uint16_t h) {
    int32_t s = (int32_t)(int16_t)h * 8192; /* << 13, sign-extended */
    return u2f((uint32_t)s & 0x8FFFFFFFu) * 0x1p112f;
}

/* float32 bits to binary16 words and/or their float32 values; nonzero if an input is
 * NaN/Inf (the outputs are then garbage and the caller raises). One loop per combination
 * of outputs: a test inside the loop stops vectorisation. */
CLONES static uint32_t half_loop(const u32 *x, u16 *w, f32 *v, Py_ssize_t n) {
    uint32_t special = 0;
#define HALF_LOOP(STORE)                                                 \
    for (Py_ssize_t i = 0; i < n; i++) {                                 \
        uint32_t sign = x[i] & 0x80000000u, a = x[i] ^ sign;             \
        special |= a >= F32_INF;                                         \
        uint32_t r = half_round(a);                                      \
        STORE;                                                           \
    }
    if (w && v) {
        HALF_LOOP(w[i] = half_word(r, sign); v[i] = u2f(r | sign))
    } else if (w) {
        HALF_LOOP(w[i] = half_word(r, sign))
    } else if (v) {
        HALF_LOOP(v[i] = u2f(r | sign))
    } else {
        HALF_LOOP((void)r)
    }
#undef HALF_LOOP
    return special;
}

static PyObject *f32_to_f16(PyObject *self, PyObject *args) {
    PyObject *src_o, *words_o, *values_o;
    if (!PyArg_ParseTuple(args, "OOO:f32_to_f16", &src_o, &words_o, &values_o)) return NULL;
    Buf src, words, values;
    Py_ssize_t n = get(src_o, &src, 0, 4, 0, "src");
    if (n < 0) return NULL;
    Py_ssize_t nw = get(words_o, &words, 1, 2, 1, "words");
    if (nw < 0) { release(&src); return NULL; }
    Py_ssize_t nv = get(values_o, &values, 1, 4, 1, "values");
    if (nv < 0) { release(&src); release(&words); return NULL; }
    if ((words.held && nw != n) || (values.held && nv != n)) {
        PyErr_SetString(PyExc_ValueError, "f32_to_f16: words and values need src's length");
        release(&src); release(&words); release(&values);
        return NULL;
    }
    const u32 *x = src.view.buf;
    u16 *w = words.held ? words.view.buf : NULL;
    f32 *v = values.held ? values.view.buf : NULL;
    uint32_t special = 0;
    Py_BEGIN_ALLOW_THREADS
    special = half_loop(x, w, v, n);
    Py_END_ALLOW_THREADS
    release(&src); release(&words); release(&values);
    return PyBool_FromLong(!special);
}

/* Binary16 words to float32; nonzero if a word is Inf/NaN. */
CLONES static uint16_t half_values_loop(const u16 *h, f32 *o, Py_ssize_t n) {
    uint16_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        special |= (uint16_t)((h[i] & 0x7C00u) == 0x7C00u);
        o[i] = half_value(h[i]);
    }
    return special;
}

/* Nonzero if a binary16 word is Inf/NaN. */
CLONES static uint16_t half_special_loop(const u16 *h, Py_ssize_t n) {
    uint16_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++) special |= (uint16_t)((h[i] & 0x7C00u) == 0x7C00u);
    return special;
}

static PyObject *f16_to_f32(PyObject *self, PyObject *args) {
    PyObject *words_o, *out_o;
    int check_first = 0;
    if (!PyArg_ParseTuple(args, "OO|p:f16_to_f32", &words_o, &out_o, &check_first)) return NULL;
    Buf words, out;
    Py_ssize_t n = get(words_o, &words, 0, 2, 0, "words");
    if (n < 0) return NULL;
    Py_ssize_t no = get(out_o, &out, 1, 4, 0, "out");
    if (no < 0) { release(&words); return NULL; }
    if (no != n) {
        PyErr_SetString(PyExc_ValueError, "f16_to_f32: out needs the words' length");
        release(&words); release(&out);
        return NULL;
    }
    const u16 *h = words.view.buf;
    f32 *o = out.view.buf;
    uint16_t special;
    Py_BEGIN_ALLOW_THREADS
    if (check_first) { /* out untouched unless every word is finite (a second, cached read) */
        special = half_special_loop(h, n);
        if (!special) half_values_loop(h, o, n);
    } else {
        special = half_values_loop(h, o, n);
    }
    Py_END_ALLOW_THREADS
    release(&words); release(&out);
    return PyBool_FromLong(!special);
}

/* ---------------------------------------------------------------------------------
 * Blockwise 8-bit quantisation. */

#define LUT_SHIFT 13
#define LUT_SIZE (1u << (32 - LUT_SHIFT))

/* Per block, the signed element of largest magnitude (the positive one on a tie, +0.0
 * for a block of zeros); nonzero if x holds NaN/Inf. Magnitudes compare as integers
 * (IEEE order for finite values), which vectorises where float max would not. */
CLONES static uint32_t scales_loop(const u32 *x, Py_ssize_t n, Py_ssize_t block, f32 *out) {
    uint32_t special = 0;
    Py_ssize_t nblocks = (n + block - 1) / block;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        Py_ssize_t start = b * block, stop = start + block < n ? start + block : n;
        int32_t pos = 0, neg = 0;
        for (Py_ssize_t i = start; i < stop; i++) {
            int32_t a = (int32_t)(x[i] & 0x7FFFFFFFu);
            int32_t negative = (int32_t)x[i] >> 31; /* all ones or zero */
            int32_t pa = a & ~negative, na = a & negative;
            special |= a >= (int32_t)F32_INF;
            pos = pa > pos ? pa : pos;
            neg = na > neg ? na : neg;
        }
        out[b] = u2f(pos >= neg ? (uint32_t)pos : (uint32_t)neg | 0x80000000u);
    }
    return special;
}

/* The 256 levels of a block times its scale: the float32 products every decoder makes,
 * made once per block so that the per-element work is a lookup. */
static inline void scaled_levels(const f32 *table, float s, float *scaled) {
    for (int c = 0; c < 256; c++) scaled[c] = table[c] * s;
}

/* One block: codes and/or values (see quantize8). */
CLONES static void quantize_block(const f32 *x, float k, float s, const uint8_t *lut,
                                  const f32 *table, uint8_t *codes, f32 *values,
                                  Py_ssize_t n) {
    float scaled[256];
    if (values) scaled_levels(table, s, scaled);
    if (codes && values) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t c = lut[f2u(x[i] * k) >> LUT_SHIFT];
            codes[i] = c;
            values[i] = scaled[c];
        }
    } else if (codes) {
        for (Py_ssize_t i = 0; i < n; i++) codes[i] = lut[f2u(x[i] * k) >> LUT_SHIFT];
    } else if (values) {
        for (Py_ssize_t i = 0; i < n; i++) values[i] = scaled[lut[f2u(x[i] * k) >> LUT_SHIFT]];
    }
}

/* Blockwise quantisation in one pass over x: per block, its scale (scales_loop), then
 * its codes and/or values while the block is still in the L1 cache. Computing every
 * scale first read x from memory twice (a 2 MiB chunk of codes is 8 MiB of float32,
 * more than the L2 cache). The inverse is numpy's float32 `1 / s` where |s| is at least
 * float32's smallest normal, else 0 (blocks of zeros, or too tiny to invert). Returns
 * nonzero if x holds NaN/Inf, at the first block that does (the outputs are then
 * incomplete and the caller raises). */
static uint32_t quantize_blocks(const f32 *x, Py_ssize_t n, Py_ssize_t block,
                                const uint8_t *lut, const f32 *table, uint8_t *codes,
                                f32 *values, f32 *scales) {
    Py_ssize_t nblocks = (n + block - 1) / block;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        Py_ssize_t start = b * block, len = start + block < n ? block : n - start;
        float s;
        if (scales_loop((const u32 *)(x + start), len, len, &s)) return 1;
        float k = (f2u(s) & 0x7FFFFFFFu) >= 0x00800000u ? 1.0f / s : 0.0f;
        scales[b] = s;
        quantize_block(x + start, k, s, lut, table, codes ? codes + start : NULL,
                       values ? values + start : NULL, len);
    }
    return 0;
}

static PyObject *quantize8(PyObject *self, PyObject *args) {
    PyObject *x_o, *lut_o, *table_o, *codes_o, *values_o, *scales_o;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "OnOOOOO:quantize8", &x_o, &block, &lut_o, &table_o, &codes_o,
                          &values_o, &scales_o))
        return NULL;
    if (block < 1) { PyErr_SetString(PyExc_ValueError, "block must be >= 1"); return NULL; }
    Buf xb = {0}, sb = {0}, lb = {0}, tb = {0}, cb = {0}, vb = {0};
    PyObject *result = NULL;
    Py_ssize_t n = get(x_o, &xb, 0, 4, 0, "x");
    if (n < 0) goto done;
    Py_ssize_t nblocks = (n + block - 1) / block;
    if (get(scales_o, &sb, 1, 4, 0, "scales") != nblocks ||
        get(lut_o, &lb, 0, 1, 0, "lut") != (Py_ssize_t)LUT_SIZE ||
        get(table_o, &tb, 0, 4, 0, "table") != 256) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError,
                            "quantize8: scales need one item per block, lut 2**19 bytes and "
                            "table 256 float32");
        goto done;
    }
    Py_ssize_t nc = get(codes_o, &cb, 1, 1, 1, "codes");
    Py_ssize_t nv = nc < 0 ? -1 : get(values_o, &vb, 1, 4, 1, "values");
    if (nc < 0 || nv < 0) goto done;
    if ((cb.held && nc != n) || (vb.held && nv != n)) {
        PyErr_SetString(PyExc_ValueError, "quantize8: codes and values need x's length");
        goto done;
    }
    uint32_t special;
    Py_BEGIN_ALLOW_THREADS
    special = quantize_blocks(xb.view.buf, n, block, lb.view.buf, tb.view.buf,
                              cb.held ? cb.view.buf : NULL, vb.held ? vb.view.buf : NULL,
                              sb.view.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(!special);
done:
    release(&xb); release(&sb); release(&lb); release(&tb); release(&cb); release(&vb);
    return result;
}

/* One block: out[i] = table[codes[i]] * s. */
CLONES static void dequantize_block(const uint8_t *codes, const f32 *table, float s,
                                    f32 *out, Py_ssize_t n) {
    float scaled[256];
    scaled_levels(table, s, scaled);
    for (Py_ssize_t i = 0; i < n; i++) out[i] = scaled[codes[i]];
}

static PyObject *dequantize8(PyObject *self, PyObject *args) {
    PyObject *codes_o, *table_o, *scales_o, *out_o;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "OOOnO:dequantize8", &codes_o, &table_o, &scales_o, &block,
                          &out_o))
        return NULL;
    if (block < 1) { PyErr_SetString(PyExc_ValueError, "block must be >= 1"); return NULL; }
    Buf cb = {0}, tb = {0}, sb = {0}, ob = {0};
    PyObject *result = NULL;
    Py_ssize_t n = get(codes_o, &cb, 0, 1, 0, "codes");
    if (n < 0) goto done;
    Py_ssize_t nblocks = (n + block - 1) / block;
    if (get(table_o, &tb, 0, 4, 0, "table") != 256 ||
        get(scales_o, &sb, 0, 4, 0, "scales") != nblocks ||
        get(out_o, &ob, 1, 4, 0, "out") != n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError,
                            "dequantize8: table needs 256 float32, scales one per block "
                            "and out the codes' length");
        goto done;
    }
    const uint8_t *codes = cb.view.buf;
    const f32 *table = tb.view.buf, *scales = sb.view.buf;
    f32 *out = ob.view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        Py_ssize_t start = b * block, stop = start + block < n ? start + block : n;
        dequantize_block(codes + start, table, scales[b], out + start, stop - start);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&cb); release(&tb); release(&sb); release(&ob);
    return result;
}

/* ---------------------------------------------------------------------------------
 * scaled-float16: per row, binary16 words of (x - mean) * k, k = inverse * 2**-112.
 *
 * The same operations as floating.py's _encode_scaled_fast, element by element: one
 * float32 subtract and one float32 multiply (each rounded on its own), then binary16
 * rounding as integer arithmetic on the product's bits (nearest even: add the lowest
 * kept bit and 0xFFF, keep bits 13..27 and the sign). The caller guarantees that no
 * product reaches binary16's overflow threshold. One pass over memory where numpy
 * makes eight calls per tile. */

CLONES static void scaled16_loop(const f32 *x, const f32 *means, const f32 *k, Py_ssize_t rows,
                                 Py_ssize_t row, u16 *words) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float mean = means[r], scale = k[r];
        const f32 *xr = x + r * row;
        u16 *wr = words + r * row;
        for (Py_ssize_t i = 0; i < row; i++) {
            float y = xr[i] - mean;
            y = y * scale;
            uint32_t u = f2u(y);
            u += (u >> 13) & 1u;
            u += 0xFFFu;
            wr[i] = (uint16_t)(((u >> 13) & 0x7FFFu) | ((u >> 16) & 0x8000u));
        }
    }
}

static PyObject *scaled16(PyObject *self, PyObject *args) {
    PyObject *x_o, *means_o, *k_o, *words_o;
    Py_ssize_t row;
    if (!PyArg_ParseTuple(args, "OOOnO:scaled16", &x_o, &means_o, &k_o, &row, &words_o))
        return NULL;
    Buf xb, mb, kb, wb;
    xb.held = mb.held = kb.held = wb.held = 0;
    PyObject *result = NULL;
    Py_ssize_t n = get(x_o, &xb, 0, 4, 0, "x");
    if (n < 0) goto done;
    Py_ssize_t rows = get(means_o, &mb, 0, 4, 0, "means");
    if (rows < 0) goto done;
    Py_ssize_t nk = get(k_o, &kb, 0, 4, 0, "k");
    if (nk < 0) goto done;
    Py_ssize_t nw = get(words_o, &wb, 1, 2, 0, "words");
    if (nw < 0) goto done;
    if (row < 1 || nk != rows || rows * row != n || nw != n) {
        PyErr_SetString(PyExc_ValueError,
                        "scaled16: need len(x) == len(words) == rows * row, len(k) == rows");
        goto done;
    }
    const f32 *xp = xb.view.buf, *mp = mb.view.buf, *kp = kb.view.buf;
    u16 *wp = wb.view.buf;
    Py_BEGIN_ALLOW_THREADS
    scaled16_loop(xp, mp, kp, rows, row, wp);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&xb); release(&mb); release(&kb); release(&wb);
    return result;
}

/* ---------------------------------------------------------------------------------
 * Copy and check: the daemon's and the client's one pass over a call's inputs
 * (peer/client/handoff.py). A value is NaN or Inf exactly when its exponent bits are all ones;
 * the copy moves bits, so it is exact for every value. */

CLONES static uint32_t copy_bits32_loop(const u32 *x, u32 *o, Py_ssize_t n) {
    uint32_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = x[i];
        o[i] = v;
        special |= (uint32_t)((v & F32_INF) == F32_INF);
    }
    return special;
}

#if defined(__GNUC__)
typedef uint64_t u64 __attribute__((aligned(1)));
#else
typedef uint64_t u64;
#endif
#define F64_INF 0x7FF0000000000000ull

CLONES static uint64_t copy_bits64_loop(const u64 *x, u64 *o, Py_ssize_t n) {
    uint64_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = x[i];
        o[i] = v;
        special |= (uint64_t)((v & F64_INF) == F64_INF);
    }
    return special;
}

/* Large copies stream their stores past the caches (x86-64's non-temporal stores). The
 * destination of a large checked copy is a shared-memory segment that the daemon reads
 * next, from memory, in another process: a cached store would first read each destination
 * line into this core's cache (read for ownership), half again the memory traffic of the
 * copy, for lines nobody reads from there. 64 MB of float32 into a segment: 4.9-5.1 ms
 * instead of 7.4-10.5 with cached stores on the development machine (the bits are moved
 * unchanged either way). Below STREAM_MIN_BYTES the destination may still be read from
 * the cache, and the plain loop is used. */
#define STREAM_MIN_BYTES ((Py_ssize_t)256 << 10)

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define STREAMING 1

/* `nbytes` (a multiple of 32) from x to o (32-byte aligned), streamed; whether a 32-bit
 * lane matched: lane & mask == want, with (mask, want) per even and odd lane (a float32's
 * exponent bits in every lane; a float64's in its high, odd lane, the even lane's want
 * unreachable). */
__attribute__((target("avx2"))) static int stream_avx2(const char *x, char *o, Py_ssize_t nbytes,
                                                        uint32_t mask_even, uint32_t mask_odd,
                                                        uint32_t want_even, uint32_t want_odd) {
    const __m256i mask = _mm256_set_epi32((int)mask_odd, (int)mask_even, (int)mask_odd,
                                          (int)mask_even, (int)mask_odd, (int)mask_even,
                                          (int)mask_odd, (int)mask_even);
    const __m256i want = _mm256_set_epi32((int)want_odd, (int)want_even, (int)want_odd,
                                          (int)want_even, (int)want_odd, (int)want_even,
                                          (int)want_odd, (int)want_even);
    __m256i hit = _mm256_setzero_si256();
    for (Py_ssize_t i = 0; i < nbytes; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(x + i));
        hit = _mm256_or_si256(hit, _mm256_cmpeq_epi32(_mm256_and_si256(v, mask), want));
        _mm256_stream_si256((__m256i *)(o + i), v);
    }
    _mm_sfence(); /* the streamed lines are visible before whatever this thread does next */
    return !_mm256_testz_si256(hit, hit);
}

/* The same with SSE2 (every x86-64 CPU), 16 bytes at a time; o 32-byte aligned. */
static int stream_sse2(const char *x, char *o, Py_ssize_t nbytes, uint32_t mask_even,
                       uint32_t mask_odd, uint32_t want_even, uint32_t want_odd) {
    const __m128i mask = _mm_set_epi32((int)mask_odd, (int)mask_even, (int)mask_odd,
                                       (int)mask_even);
    const __m128i want = _mm_set_epi32((int)want_odd, (int)want_even, (int)want_odd,
                                       (int)want_even);
    __m128i hit = _mm_setzero_si128();
    for (Py_ssize_t i = 0; i < nbytes; i += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(x + i));
        hit = _mm_or_si128(hit, _mm_cmpeq_epi32(_mm_and_si128(v, mask), want));
        _mm_stream_si128((__m128i *)(o + i), v);
    }
    _mm_sfence();
    return _mm_movemask_epi8(hit) != 0;
}

/* copy_finite's loop for large copies: the elements up to o's first 32-byte boundary and
 * after its last one through the plain loops, the rest streamed. Returns -1 (nothing
 * copied) when o is not aligned to its items, so that no boundary falls on whole items. */
static int copy_streamed(const char *x, char *o, Py_ssize_t n, int itemsize) {
    if ((uintptr_t)o % (uintptr_t)itemsize) return -1;
    Py_ssize_t head = (Py_ssize_t)((32 - (uintptr_t)o % 32) % 32) / itemsize;
    if (head > n) head = n;
    Py_ssize_t body = (n - head) * itemsize / 32 * 32;
    Py_ssize_t tail_at = head + body / itemsize;
    int special;
    if (itemsize == 4) {
        special = copy_bits32_loop((const u32 *)x, (u32 *)o, head) != 0;
        special |= copy_bits32_loop((const u32 *)(x + tail_at * 4), (u32 *)(o + tail_at * 4),
                                    n - tail_at) != 0;
    } else {
        special = copy_bits64_loop((const u64 *)x, (u64 *)o, head) != 0;
        special |= copy_bits64_loop((const u64 *)(x + tail_at * 8), (u64 *)(o + tail_at * 8),
                                    n - tail_at) != 0;
    }
    uint32_t mask_even = itemsize == 4 ? F32_INF : 0;
    uint32_t mask_odd = itemsize == 4 ? F32_INF : (uint32_t)(F64_INF >> 32);
    uint32_t want_even = itemsize == 4 ? F32_INF : 1; /* (lane & 0) is never 1 */
    const char *bx = x + head * itemsize;
    char *bo = o + head * itemsize;
    if (__builtin_cpu_supports("avx2"))
        special |= stream_avx2(bx, bo, body, mask_even, mask_odd, want_even, mask_odd);
    else
        special |= stream_sse2(bx, bo, body, mask_even, mask_odd, want_even, mask_odd);
    return special;
}
#endif

static PyObject *copy_finite(PyObject *self, PyObject *args) {
    PyObject *src_o, *out_o;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OOi:copy_finite", &src_o, &out_o, &itemsize)) return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "copy_finite: itemsize must be 4 or 8");
        return NULL;
    }
    Buf src, out;
    Py_ssize_t n = get(src_o, &src, 0, itemsize, 0, "src");
    if (n < 0) return NULL;
    Py_ssize_t no = get(out_o, &out, 1, itemsize, 0, "out");
    if (no < 0) { release(&src); return NULL; }
    if (no != n) {
        PyErr_SetString(PyExc_ValueError, "copy_finite: out needs src's length");
        release(&src); release(&out);
        return NULL;
    }
    int special = -1;
    Py_BEGIN_ALLOW_THREADS
#ifdef STREAMING
    if (n * itemsize >= STREAM_MIN_BYTES)
        special = copy_streamed(src.view.buf, out.view.buf, n, itemsize);
#endif
    if (special < 0) {
        if (itemsize == 4)
            special = copy_bits32_loop(src.view.buf, out.view.buf, n) != 0;
        else
            special = copy_bits64_loop(src.view.buf, out.view.buf, n) != 0;
    }
    Py_END_ALLOW_THREADS
    release(&src); release(&out);
    return PyBool_FromLong(!special);
}

/* The finiteness scan alone (compression/kernels.py all_finite): one read pass, where
 * numpy's float sum reads as fast only on cached data and isfinite() writes a mask. */

CLONES static uint32_t special_bits32_loop(const u32 *x, Py_ssize_t n) {
    uint32_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        special |= (uint32_t)((x[i] & F32_INF) == F32_INF);
    return special;
}

CLONES static uint64_t special_bits64_loop(const u64 *x, Py_ssize_t n) {
    uint64_t special = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        special |= (uint64_t)((x[i] & F64_INF) == F64_INF);
    return special;
}

static PyObject *all_finite(PyObject *self, PyObject *args) {
    PyObject *x_o;
    int itemsize;
    if (!PyArg_ParseTuple(args, "Oi:all_finite", &x_o, &itemsize)) return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "all_finite: itemsize must be 4 or 8");
        return NULL;
    }
    Buf x;
    Py_ssize_t n = get(x_o, &x, 0, itemsize, 0, "x");
    if (n < 0) return NULL;
    int special;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        special = special_bits32_loop(x.view.buf, n) != 0;
    else
        special = special_bits64_loop(x.view.buf, n) != 0;
    Py_END_ALLOW_THREADS
    release(&x);
    return PyBool_FromLong(!special);
}

/* ---------------------------------------------------------------------------------
 * Robust aggregation (averaging/allreduce/robust.py): CenteredClip's two passes over
 * the senders' copies of a chunk, and the trimmed mean with equal weights.
 *
 * numpy makes one pass over all n copies per operation: the median's compare-exchanges
 * (17 for 8 copies), `diff = stack - median`, the Gram matrix, the result. Here the
 * copies are read in tiles of ROBUST_TILE coordinates that stay in L1: the tile is
 * sorted by the comparators robust.py passes in (the same pruned network, so the same
 * median bits); `x_i - median` is formed in the copies' dtype (as numpy does) and the
 * Gram matrix accumulated per lane (one coordinate of the tile) in that dtype over
 * ROBUST_FLUSH tiles, 16 products per partial sum, then in float64: float32 lanes keep
 * twice the products per vector of float64 ones, and partial sums of 16 stay within a
 * few units in the last place, more accurate than numpy's float32 BLAS blocks of 8192
 * (robust.py's _gram). A second pass forms `median + sum_i a_i (x_i - median)` in
 * float64, rounded once. Every lane does the same operations in the same order whatever
 * the vector width, and the lanes are summed in a fixed order: the results do not
 * depend on the CPU. An overflowing product leaves the Gram matrix not finite and
 * robust.py takes its numpy path, which rescales. */

#if defined(__GNUC__)
typedef double f64 __attribute__((aligned(1)));
#else
typedef double f64;
#endif

#define ROBUST_TILE 32
#define ROBUST_MAX 32 /* robust.py's _NETWORK_MAX: above it, numpy sorts */

/* Every loop below runs over one whole tile (a fixed trip count, vectorised); a last,
 * partial tile is padded with zeros that are never stored. */

/* The robust kernels' loops are elementwise over a tile's lanes, so wider vectors do
 * not change which operations each lane does: every clone gives the same bits. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define ROBUST_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ROBUST_CLONES
#endif

#define ROBUST_FLUSH 16 /* tiles per partial Gram sum in the product type P */

#define ROBUST_KERNELS(S, T, ST)                                                        \
    static inline void load_tile##S(const ST *x, Py_ssize_t n, Py_ssize_t m, Py_ssize_t j0, \
                                    Py_ssize_t w, T tile[][ROBUST_TILE]) {              \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            const ST *xi = x + i * m + j0;                                              \
            if (w == ROBUST_TILE)                                                       \
                for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) tile[i][l] = xi[l];        \
            else                                                                        \
                for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) tile[i][l] = l < w ? xi[l] : 0; \
        }                                                                               \
    }                                                                                   \
    static inline void exchange##S(T *restrict lo, T *restrict hi) {                    \
        for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) {                                  \
            T a = lo[l], b = hi[l];                                                     \
            lo[l] = b < a ? b : a;                                                      \
            hi[l] = b < a ? a : b;                                                      \
        }                                                                               \
    }                                                                                   \
    static inline void sort_tile##S(T v[][ROBUST_TILE], const int32_t *pairs,           \
                                    Py_ssize_t npairs) {                                \
        for (Py_ssize_t p = 0; p < npairs; p++) exchange##S(v[pairs[2 * p]], v[pairs[2 * p + 1]]); \
    }                                                                                   \
    static inline void add_products##S(T *restrict acc, const T *restrict a,            \
                                       const T *restrict b) {                           \
        for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) acc[l] += a[l] * b[l];             \
    }                                                                                   \
    /* Add the partial sums `part` (tri x TILE) to the float64 Gram sums and clear them. */ \
    static inline void flush##S(T *restrict part, double *restrict acc, Py_ssize_t tri) { \
        for (Py_ssize_t p = 0; p < tri * ROBUST_TILE; p++) {                            \
            acc[p] += (double)part[p];                                                  \
            part[p] = 0;                                                                \
        }                                                                               \
    }                                                                                   \
    ROBUST_CLONES static void median_gram##S(const ST *x, Py_ssize_t n, Py_ssize_t m,          \
                                      const int32_t *pairs, Py_ssize_t npairs,          \
                                      Py_ssize_t lower, Py_ssize_t upper, ST *median,   \
                                      T *part, double *acc, double *gram) {             \
        T xt[ROBUST_MAX][ROBUST_TILE], v[ROBUST_MAX][ROBUST_TILE];                      \
        const Py_ssize_t tri = n * (n + 1) / 2;                                         \
        memset(acc, 0, (size_t)tri * ROBUST_TILE * sizeof(double));                     \
        memset(part, 0, (size_t)tri * ROBUST_TILE * sizeof(T));                         \
        Py_ssize_t tiles = 0;                                                           \
        for (Py_ssize_t j0 = 0; j0 < m; j0 += ROBUST_TILE) {                            \
            const Py_ssize_t w = m - j0 < ROBUST_TILE ? m - j0 : ROBUST_TILE;           \
            load_tile##S(x, n, m, j0, w, xt);                                           \
            memcpy(v, xt, (size_t)n * sizeof(xt[0]));                                   \
            sort_tile##S(v, pairs, npairs);                                             \
            T med[ROBUST_TILE];                                                         \
            for (Py_ssize_t l = 0; l < ROBUST_TILE; l++)                                \
                med[l] = v[lower][l] + (v[upper][l] - v[lower][l]) * (T)0.5;            \
            for (Py_ssize_t l = 0; l < w; l++) median[j0 + l] = med[l];                 \
            for (Py_ssize_t i = 0; i < n; i++) /* the tile's x_i - median, in place */ \
                for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) xt[i][l] -= med[l];        \
            T *a = part;                                                                \
            for (Py_ssize_t i = 0; i < n; i++)                                          \
                for (Py_ssize_t k = i; k < n; k++, a += ROBUST_TILE)                    \
                    add_products##S(a, xt[i], xt[k]);                                   \
            if (++tiles == ROBUST_FLUSH) {                                              \
                flush##S(part, acc, tri);                                               \
                tiles = 0;                                                              \
            }                                                                           \
        }                                                                               \
        flush##S(part, acc, tri);                                                       \
        const double *a = acc;                                                          \
        for (Py_ssize_t i = 0; i < n; i++)                                              \
            for (Py_ssize_t k = i; k < n; k++, a += ROBUST_TILE) {                      \
                double s = 0.0;                                                         \
                for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) s += a[l];                 \
                gram[i * n + k] = gram[k * n + i] = s;                                  \
            }                                                                           \
    }                                                                                   \
    ROBUST_CLONES static void combine##S(const ST *x, Py_ssize_t n, Py_ssize_t m,              \
                                  const ST *median, const double *coeffs, ST *out) {    \
        T xt[ROBUST_MAX][ROBUST_TILE];                                                  \
        double med[ROBUST_TILE], sum[ROBUST_TILE];                                      \
        for (Py_ssize_t j0 = 0; j0 < m; j0 += ROBUST_TILE) {                            \
            const Py_ssize_t w = m - j0 < ROBUST_TILE ? m - j0 : ROBUST_TILE;           \
            load_tile##S(x, n, m, j0, w, xt);                                           \
            for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) {                              \
                med[l] = l < w ? (double)median[j0 + l] : 0.0;                          \
                sum[l] = 0.0;                                                           \
            }                                                                           \
            for (Py_ssize_t i = 0; i < n; i++) {                                        \
                const double c = coeffs[i];                                             \
                for (Py_ssize_t l = 0; l < ROBUST_TILE; l++)                            \
                    sum[l] += c * ((double)xt[i][l] - med[l]);                          \
            }                                                                           \
            for (Py_ssize_t l = 0; l < w; l++) out[j0 + l] = (T)(med[l] + sum[l]);      \
        }                                                                               \
    }                                                                                   \
    /* The trimmed mean of equal weights, as robust.py's: rows first..last-1 of the  \
     * sorted tile summed in row order in the copies' dtype, then divided by their     \
     * count (the same IEEE operations in the same order, so the same bits). */        \
    ROBUST_CLONES static void trimmed##S(const ST *x, Py_ssize_t n, Py_ssize_t m,              \
                                  const int32_t *pairs, Py_ssize_t npairs,              \
                                  Py_ssize_t first, Py_ssize_t last, ST *out) {         \
        T v[ROBUST_MAX][ROBUST_TILE], s[ROBUST_TILE];                                   \
        const T count = (T)(last - first);                                              \
        for (Py_ssize_t j0 = 0; j0 < m; j0 += ROBUST_TILE) {                            \
            const Py_ssize_t w = m - j0 < ROBUST_TILE ? m - j0 : ROBUST_TILE;           \
            load_tile##S(x, n, m, j0, w, v);                                            \
            sort_tile##S(v, pairs, npairs);                                             \
            for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) s[l] = v[first][l];            \
            for (Py_ssize_t r = first + 1; r < last; r++)                               \
                for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) s[l] += v[r][l];           \
            for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) s[l] = s[l] / count;           \
            for (Py_ssize_t l = 0; l < w; l++) out[j0 + l] = s[l];                      \
        }                                                                               \
    }

ROBUST_KERNELS(32, float, f32)
ROBUST_KERNELS(64, double, f64)

/* Checks shared by the robust kernels: `stack` holds n rows of m items of `itemsize`,
 * the comparators index rows below n. Returns m, or -1 with an exception set. */
static Py_ssize_t robust_shape(Py_ssize_t items, Py_ssize_t n, Buf *pairs, Py_ssize_t npairs2) {
    if (n < 1 || n > ROBUST_MAX) {
        PyErr_Format(PyExc_ValueError, "robust kernels take 1..%d rows, got %zd", ROBUST_MAX, n);
        return -1;
    }
    if (items % n) {
        PyErr_SetString(PyExc_ValueError, "stack: length is not a multiple of the rows");
        return -1;
    }
    if (pairs) {
        if (npairs2 % 2) {
            PyErr_SetString(PyExc_ValueError, "pairs: need an even number of indices");
            return -1;
        }
        const int32_t *p = pairs->view.buf;
        for (Py_ssize_t i = 0; i < npairs2; i++)
            if (p[i] < 0 || p[i] >= n) {
                PyErr_SetString(PyExc_ValueError, "pairs: row index out of range");
                return -1;
            }
    }
    return items / n;
}

static PyObject *median_gram(PyObject *self, PyObject *args) {
    PyObject *x_o, *pairs_o, *median_o, *gram_o;
    Py_ssize_t n, lower, upper;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OnOnniOO:median_gram", &x_o, &n, &pairs_o, &lower, &upper,
                          &itemsize, &median_o, &gram_o))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "median_gram: itemsize must be 4 or 8");
        return NULL;
    }
    Buf xb, pb, mb, gb;
    xb.held = pb.held = mb.held = gb.held = 0;
    PyObject *result = NULL;
    double *acc = NULL;
    void *part = NULL;
    Py_ssize_t nx = get(x_o, &xb, 0, itemsize, 0, "stack");
    if (nx < 0) goto done;
    Py_ssize_t np2 = get(pairs_o, &pb, 0, 4, 0, "pairs");
    if (np2 < 0) goto done;
    Py_ssize_t nm = get(median_o, &mb, 1, itemsize, 0, "median");
    if (nm < 0) goto done;
    Py_ssize_t ng = get(gram_o, &gb, 1, 8, 0, "gram");
    if (ng < 0) goto done;
    Py_ssize_t m = robust_shape(nx, n, &pb, np2);
    if (m < 0) goto done;
    if (nm != m || ng != n * n || lower < 0 || upper < 0 || lower >= n || upper >= n) {
        PyErr_SetString(PyExc_ValueError,
                        "median_gram: need len(median) == m, len(gram) == n * n, rows < n");
        goto done;
    }
    acc = PyMem_RawMalloc((size_t)(n * (n + 1) / 2) * ROBUST_TILE * sizeof(double));
    part = PyMem_RawMalloc((size_t)(n * (n + 1) / 2) * ROBUST_TILE * (size_t)itemsize);
    if (!acc || !part) { PyErr_NoMemory(); goto done; }
    const int32_t *pp = pb.view.buf;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        median_gram32(xb.view.buf, n, m, pp, np2 / 2, lower, upper, mb.view.buf, part, acc,
                      gb.view.buf);
    else
        median_gram64(xb.view.buf, n, m, pp, np2 / 2, lower, upper, mb.view.buf, part, acc,
                      gb.view.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_RawFree(acc);
    PyMem_RawFree(part);
    release(&xb); release(&pb); release(&mb); release(&gb);
    return result;
}

static PyObject *combine(PyObject *self, PyObject *args) {
    PyObject *x_o, *median_o, *coeffs_o, *out_o;
    Py_ssize_t n;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OnOOiO:combine", &x_o, &n, &median_o, &coeffs_o, &itemsize,
                          &out_o))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "combine: itemsize must be 4 or 8");
        return NULL;
    }
    Buf xb, mb, cb, ob;
    xb.held = mb.held = cb.held = ob.held = 0;
    PyObject *result = NULL;
    Py_ssize_t nx = get(x_o, &xb, 0, itemsize, 0, "stack");
    if (nx < 0) goto done;
    Py_ssize_t nm = get(median_o, &mb, 0, itemsize, 0, "median");
    if (nm < 0) goto done;
    Py_ssize_t nc = get(coeffs_o, &cb, 0, 8, 0, "coeffs");
    if (nc < 0) goto done;
    Py_ssize_t no = get(out_o, &ob, 1, itemsize, 0, "out");
    if (no < 0) goto done;
    Py_ssize_t m = robust_shape(nx, n, NULL, 0);
    if (m < 0) goto done;
    if (nm != m || no != m || nc != n) {
        PyErr_SetString(PyExc_ValueError,
                        "combine: need len(median) == len(out) == m, len(coeffs) == n");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        combine32(xb.view.buf, n, m, mb.view.buf, cb.view.buf, ob.view.buf);
    else
        combine64(xb.view.buf, n, m, mb.view.buf, cb.view.buf, ob.view.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&xb); release(&mb); release(&cb); release(&ob);
    return result;
}

static PyObject *trimmed(PyObject *self, PyObject *args) {
    PyObject *x_o, *pairs_o, *out_o;
    Py_ssize_t n, first, last;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OnOnniO:trimmed", &x_o, &n, &pairs_o, &first, &last,
                          &itemsize, &out_o))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "trimmed: itemsize must be 4 or 8");
        return NULL;
    }
    Buf xb, pb, ob;
    xb.held = pb.held = ob.held = 0;
    PyObject *result = NULL;
    Py_ssize_t nx = get(x_o, &xb, 0, itemsize, 0, "stack");
    if (nx < 0) goto done;
    Py_ssize_t np2 = get(pairs_o, &pb, 0, 4, 0, "pairs");
    if (np2 < 0) goto done;
    Py_ssize_t no = get(out_o, &ob, 1, itemsize, 0, "out");
    if (no < 0) goto done;
    Py_ssize_t m = robust_shape(nx, n, &pb, np2);
    if (m < 0) goto done;
    if (no != m || first < 0 || last > n || first >= last) {
        PyErr_SetString(PyExc_ValueError, "trimmed: need len(out) == m, 0 <= first < last <= n");
        goto done;
    }
    const int32_t *pp = pb.view.buf;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        trimmed32(xb.view.buf, n, m, pp, np2 / 2, first, last, ob.view.buf);
    else
        trimmed64(xb.view.buf, n, m, pp, np2 / 2, first, last, ob.view.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&xb); release(&pb); release(&ob);
    return result;
}

/* The trimmed mean of unequal weights, as robust.py's _kept_by_rank and _weighted_average:
 * each value's rank from the pairwise comparisons (ties ranked by row), then over the rows
 * in order the kept values' plain sum, weighted sum and weight total in the copies' dtype,
 * the same IEEE operations in the same order, so the same bits. */
#define WEIGHTED_TRIMMED(S, T, ST)                                                      \
    ROBUST_CLONES static void trimmed_weighted##S(const ST *x, Py_ssize_t n, Py_ssize_t m, \
                                                  Py_ssize_t k, const ST *weights, ST *out) { \
        T v[ROBUST_MAX][ROBUST_TILE];                                                   \
        int32_t rank[ROBUST_MAX][ROBUST_TILE];                                          \
        T weighted[ROBUST_TILE], total[ROBUST_TILE], plain[ROBUST_TILE];                \
        const T count = (T)(n - 2 * k);                                                 \
        for (Py_ssize_t j0 = 0; j0 < m; j0 += ROBUST_TILE) {                            \
            const Py_ssize_t w = m - j0 < ROBUST_TILE ? m - j0 : ROBUST_TILE;           \
            load_tile##S(x, n, m, j0, w, v);                                            \
            memset(rank, 0, (size_t)n * sizeof(rank[0]));                               \
            for (Py_ssize_t i = 0; i < n; i++)                                          \
                for (Py_ssize_t j = i + 1; j < n; j++)                                  \
                    for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) {                      \
                        const int32_t before = v[i][l] <= v[j][l];                      \
                        rank[j][l] += before;                                           \
                        rank[i][l] += 1 - before;                                       \
                    }                                                                   \
            for (Py_ssize_t l = 0; l < ROBUST_TILE; l++)                                \
                weighted[l] = total[l] = plain[l] = 0;                                  \
            for (Py_ssize_t i = 0; i < n; i++) {                                        \
                const T weight = weights[i];                                            \
                for (Py_ssize_t l = 0; l < ROBUST_TILE; l++) {                          \
                    T indicator = (T)(rank[i][l] >= k && rank[i][l] < n - k);           \
                    T product = v[i][l] * indicator;                                    \
                    plain[l] += product;                                                \
                    product *= weight;                                                  \
                    weighted[l] += product;                                             \
                    indicator *= weight;                                                \
                    total[l] += indicator;                                              \
                }                                                                       \
            }                                                                           \
            for (Py_ssize_t l = 0; l < w; l++)                                          \
                out[j0 + l] = total[l] > 0 ? weighted[l] / total[l] : plain[l] / count; \
        }                                                                               \
    }

WEIGHTED_TRIMMED(32, float, f32)
WEIGHTED_TRIMMED(64, double, f64)

static PyObject *trimmed_weighted(PyObject *self, PyObject *args) {
    PyObject *x_o, *weights_o, *out_o;
    Py_ssize_t n, k;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OnnOiO:trimmed_weighted", &x_o, &n, &k, &weights_o, &itemsize,
                          &out_o))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "trimmed_weighted: itemsize must be 4 or 8");
        return NULL;
    }
    Buf xb, wb, ob;
    xb.held = wb.held = ob.held = 0;
    PyObject *result = NULL;
    Py_ssize_t nx = get(x_o, &xb, 0, itemsize, 0, "stack");
    if (nx < 0) goto done;
    Py_ssize_t nw = get(weights_o, &wb, 0, itemsize, 0, "weights");
    if (nw < 0) goto done;
    Py_ssize_t no = get(out_o, &ob, 1, itemsize, 0, "out");
    if (no < 0) goto done;
    Py_ssize_t m = robust_shape(nx, n, NULL, 0);
    if (m < 0) goto done;
    if (no != m || nw != n || k < 0 || 2 * k >= n) {
        PyErr_SetString(PyExc_ValueError,
                        "trimmed_weighted: need len(out) == m, len(weights) == n, 0 <= 2k < n");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        trimmed_weighted32(xb.view.buf, n, m, k, wb.view.buf, ob.view.buf);
    else
        trimmed_weighted64(xb.view.buf, n, m, k, wb.view.buf, ob.view.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&xb); release(&wb); release(&ob);
    return result;
}

/* ---------------------------------------------------------------------------------
 * The mean of a chunk (averaging/allreduce/reducer.py): out = (x0*w0 + x1*w1 + ...) / d
 * in one pass over the copies, where numpy makes one pass per operation (a first copy
 * scaled into an accumulator, each later one added, the division into a fresh array,
 * then the check of that average before it is encoded). Each product, each sum and the
 * quotient are rounded on their own in the values' dtype, in that order, as numpy's
 * `acc = x0 * w0; acc += x1 * w1; ...; acc / d` rounds them, so the bits are the same.
 * The partial sums of a block of WSUM_BLOCK elements stay in the L1 cache while every
 * copy is added to them, so each copy is read once and the result written once.
 * Returns nonzero if an output is NaN/Inf: with weights > 0 (products of a NaN or an Inf
 * stay NaN/Inf whatever the weight, and sums and quotients keep them), that is an input
 * holding one or an overflow, so a finite output also vouches for every input. d may be
 * absent (no division). */

#define WSUM_BLOCK 1024

#define WSUM_LOOP(NAME, P, T, U, INF)                                                      \
    CLONES static U NAME(const P *const *x, const T *w, Py_ssize_t k, T d, int has_d,      \
                         P *o, Py_ssize_t n) {                                             \
        U special = 0;                                                                     \
        T acc[WSUM_BLOCK];                                                                 \
        for (Py_ssize_t s = 0; s < n; s += WSUM_BLOCK) {                                   \
            Py_ssize_t m = n - s < WSUM_BLOCK ? n - s : WSUM_BLOCK;                        \
            const P *x0 = x[0] + s;                                                        \
            T w0 = w[0];                                                                   \
            for (Py_ssize_t i = 0; i < m; i++) acc[i] = x0[i] * w0;                        \
            for (Py_ssize_t j = 1; j < k; j++) {                                           \
                const P *xj = x[j] + s;                                                    \
                T wj = w[j];                                                               \
                for (Py_ssize_t i = 0; i < m; i++) acc[i] = acc[i] + xj[i] * wj;           \
            }                                                                              \
            P *os = o + s;                                                                 \
            if (has_d) {                                                                   \
                for (Py_ssize_t i = 0; i < m; i++) {                                       \
                    T r = acc[i] / d; U u; memcpy(&u, &r, sizeof u);                       \
                    os[i] = r; special |= (U)((u & INF) == INF);                           \
                }                                                                          \
            } else {                                                                       \
                for (Py_ssize_t i = 0; i < m; i++) {                                       \
                    T r = acc[i]; U u; memcpy(&u, &r, sizeof u);                           \
                    os[i] = r; special |= (U)((u & INF) == INF);                           \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        return special;                                                                    \
    }

/* P: the element type at any address (f32/f64 above); T: the value type. */
WSUM_LOOP(wsum32_loop, f32, float, uint32_t, F32_INF)
WSUM_LOOP(wsum64_loop, f64, double, uint64_t, F64_INF)

/* The float32 mean where some copies are binary16 words (codec float16's payloads, as
 * received): each word is widened exactly (half_value) where it is added, so the words
 * are read once, at half the bytes, and no decoded array is written and read back; the
 * bits are those of decoding first. An Inf/NaN word counts as a non-finite output (as its
 * decoded value would have made one: the caller then checks the copies one by one). */
CLONES static uint32_t wsum32h_loop(const void *const *x, const unsigned char *half,
                                    const float *w, Py_ssize_t k, float d, int has_d, f32 *o,
                                    Py_ssize_t n) {
    uint32_t special = 0;
    uint16_t bad = 0;
    float acc[WSUM_BLOCK];
    for (Py_ssize_t s = 0; s < n; s += WSUM_BLOCK) {
        Py_ssize_t m = n - s < WSUM_BLOCK ? n - s : WSUM_BLOCK;
        for (Py_ssize_t j = 0; j < k; j++) {
            float wj = w[j];
            if (half[j]) {
                const u16 *hj = (const u16 *)x[j] + s;
                if (j == 0) {
                    for (Py_ssize_t i = 0; i < m; i++) {
                        bad |= (uint16_t)((hj[i] & 0x7C00u) == 0x7C00u);
                        acc[i] = half_value(hj[i]) * wj;
                    }
                } else {
                    for (Py_ssize_t i = 0; i < m; i++) {
                        bad |= (uint16_t)((hj[i] & 0x7C00u) == 0x7C00u);
                        acc[i] = acc[i] + half_value(hj[i]) * wj;
                    }
                }
            } else {
                const f32 *xj = (const f32 *)x[j] + s;
                if (j == 0) {
                    for (Py_ssize_t i = 0; i < m; i++) acc[i] = xj[i] * wj;
                } else {
                    for (Py_ssize_t i = 0; i < m; i++) acc[i] = acc[i] + xj[i] * wj;
                }
            }
        }
        f32 *os = o + s;
        if (has_d)
            for (Py_ssize_t i = 0; i < m; i++) acc[i] = acc[i] / d;
        for (Py_ssize_t i = 0; i < m; i++) {
            os[i] = acc[i];
            special |= (uint32_t)((f2u(acc[i]) & F32_INF) == F32_INF);
        }
    }
    return special | bad;
}

#define WSUM_MAX_COPIES 4096

static PyObject *weighted_sum(PyObject *self, PyObject *args) {
    PyObject *copies_o, *weights_o, *out_o;
    double d;
    int itemsize;
    Py_buffer halves = {0};
    if (!PyArg_ParseTuple(args, "OOdiO|y*:weighted_sum", &copies_o, &weights_o, &d, &itemsize,
                          &out_o, &halves))
        return NULL;
    const unsigned char *half = halves.buf != NULL && halves.len > 0 ? halves.buf : NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "weighted_sum: itemsize must be 4 or 8");
        PyBuffer_Release(&halves);
        return NULL;
    }
    PyObject *copies = PySequence_Fast(copies_o, "weighted_sum: copies must be a sequence");
    if (!copies) {
        PyBuffer_Release(&halves);
        return NULL;
    }
    PyObject *weights = PySequence_Fast(weights_o, "weighted_sum: weights must be a sequence");
    if (!weights) {
        Py_DECREF(copies);
        PyBuffer_Release(&halves);
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(copies);
    PyObject *result = NULL;
    Buf ob;
    ob.held = 0;
    Buf *bufs = NULL;
    const void **ptrs = NULL;
    double *w = NULL;
    float *w32 = NULL;
    if (k < 1 || k > WSUM_MAX_COPIES || PySequence_Fast_GET_SIZE(weights) != k) {
        PyErr_SetString(PyExc_ValueError,
                        "weighted_sum: need 1 to 4096 copies and one weight per copy");
        goto done;
    }
    if (half != NULL && (halves.len != k || itemsize != 4)) {
        PyErr_SetString(PyExc_ValueError,
                        "weighted_sum: halves needs one byte per copy, and float32 (itemsize 4)");
        goto done;
    }
    bufs = PyMem_Calloc((size_t)k, sizeof *bufs);
    ptrs = PyMem_Calloc((size_t)k, sizeof *ptrs);
    w = PyMem_Calloc((size_t)k, sizeof *w);
    w32 = PyMem_Calloc((size_t)k, sizeof *w32);
    if (!bufs || !ptrs || !w || !w32) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t no = get(out_o, &ob, 1, itemsize, 0, "out");
    if (no < 0) goto done;
    for (Py_ssize_t j = 0; j < k; j++) {
        w[j] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(weights, j));
        if (w[j] == -1.0 && PyErr_Occurred()) goto done;
        w32[j] = (float)w[j];
        Py_ssize_t copy_itemsize = half != NULL && half[j] ? 2 : itemsize;
        Py_ssize_t nj = get(PySequence_Fast_GET_ITEM(copies, j), &bufs[j], 0, copy_itemsize, 0,
                            "copy");
        if (nj < 0) goto done;
        if (nj != no) {
            PyErr_SetString(PyExc_ValueError, "weighted_sum: every copy and out need one length");
            goto done;
        }
        ptrs[j] = bufs[j].view.buf;
    }
    int special;
    Py_BEGIN_ALLOW_THREADS
    int any_half = 0;
    for (Py_ssize_t j = 0; half != NULL && j < k; j++) any_half |= half[j] != 0;
    if (any_half)
        special = wsum32h_loop((const void *const *)ptrs, half, w32, k, (float)d, d != 0.0,
                               ob.view.buf, no) != 0;
    else if (itemsize == 4)
        special = wsum32_loop((const f32 *const *)ptrs, w32, k, (float)d, d != 0.0, ob.view.buf,
                              no) != 0;
    else
        special = wsum64_loop((const f64 *const *)ptrs, w, k, d, d != 0.0, ob.view.buf, no) != 0;
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(!special);
done:
    if (bufs)
        for (Py_ssize_t j = 0; j < k; j++) release(&bufs[j]);
    release(&ob);
    PyMem_Free(bufs);
    PyMem_Free(ptrs);
    PyMem_Free(w);
    PyMem_Free(w32);
    Py_DECREF(copies);
    Py_DECREF(weights);
    PyBuffer_Release(&halves);
    return result;
}

/* ---------------------------------------------------------------------------------
 * The member's part check (averaging/allreduce/part_check.py): as an averaged chunk is
 * copied where it goes, the sums that compare it with this member's own values of it, in
 * the same pass, so the check reads no memory twice. In place `own` is `out` itself: each
 * element is read before it is written. `backup`, when given, gets own's values (in
 * place: what the average overwrites, for a part refused later).
 *
 * Sums, with d = result - own rounded in the values' dtype: sum d^2, sum own^2, sum |d|,
 * sum |own| (float64), and the count of own's nonzero values. Element i adds to lane
 * i % CHECK_LANES, each lane in element order, first into a partial sum in the dtype over
 * the lane's CHECK_FLUSH elements of each group of CHECK_GROUP, which is then added to
 * the lane's float64 total; at the end the lanes are added in lane order. Every lane
 * does the same operations whatever the vector width (every path gives the same bits)
 * and kernels.check_sums reproduces them with numpy. Partial sums of 16 terms stay
 * within a few units in the last place of float32, and no term cancels another (the
 * differences are squared themselves, not formed from r.r - 2 r.o + o.o). */

#define CHECK_LANES 16
#define CHECK_FLUSH 16
#define CHECK_GROUP (CHECK_LANES * CHECK_FLUSH)
#define CHECK_SUMS 5

typedef struct {
    double t[4][CHECK_LANES]; /* sq, osq, ab, oab */
    int64_t nonzero[CHECK_LANES];
} CheckLanes;

/* Elements from..n-1 (from at a group's start). */
#define CHECK_GENERIC(NAME, T, V, BITS_T, TO_BITS, INF)                                       \
    static int NAME(const T *x, T *out, const T *own, T *backup, Py_ssize_t from,             \
                    Py_ssize_t n, CheckLanes *l) {                                            \
        BITS_T special = 0;                                                                   \
        for (Py_ssize_t g = from; g < n; g += CHECK_GROUP) {                                  \
            V p[4][CHECK_LANES] = {{0}};                                                      \
            Py_ssize_t end = n - g < CHECK_GROUP ? n : g + CHECK_GROUP;                       \
            for (Py_ssize_t i = g; i < end; i++) {                                            \
                int k = (int)((i - g) % CHECK_LANES);                                         \
                V r = x[i], o = own[i];                                                       \
                special |= (BITS_T)((TO_BITS(r) & INF) == INF);                               \
                V d = r - o;                                                                  \
                p[0][k] = p[0][k] + d * d;                                                    \
                p[1][k] = p[1][k] + o * o;                                                    \
                p[2][k] = p[2][k] + (d < 0 ? -d : d);                                         \
                p[3][k] = p[3][k] + (o < 0 ? -o : o);                                         \
                l->nonzero[k] += o != 0;                                                      \
                if (backup) backup[i] = o;                                                    \
                if (out) out[i] = r; /* after own[i] was read: out may be own */              \
            }                                                                                 \
            for (int j = 0; j < 4; j++)                                                       \
                for (int k = 0; k < CHECK_LANES; k++)                                         \
                    l->t[j][k] = l->t[j][k] + (double)p[j][k];                                \
        }                                                                                     \
        return special != 0;                                                                  \
    }

static inline uint64_t d2u(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }

CHECK_GENERIC(check32_generic, f32, float, uint32_t, f2u, F32_INF)
CHECK_GENERIC(check64_generic, f64, double, uint64_t, d2u, F64_INF)

#ifdef STREAMING
/* A lane's float32 partial sums (8 lanes) added to its float64 totals. */
__attribute__((target("avx2"))) static inline void flush8(double *t, __m256 p) {
    _mm256_storeu_pd(t, _mm256_add_pd(_mm256_loadu_pd(t), _mm256_cvtps_pd(_mm256_castps256_ps128(p))));
    _mm256_storeu_pd(t + 4,
                     _mm256_add_pd(_mm256_loadu_pd(t + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1))));
}

/* How 16 floats may be streamed to `o` (and every 64 bytes after it): 32 bytes at a time
 * where it is 32-byte aligned, 16 where it is 16-byte aligned (a large numpy array's
 * memory from malloc), else not (0: cached stores). */
static inline int stream_width(const char *o) {
    return (uintptr_t)o % 32 == 0 ? 32 : (uintptr_t)o % 16 == 0 ? 16 : 0;
}

/* 16 floats to o, streamed `width` bytes at a time (stream_width) or cached. */
__attribute__((target("avx2"))) static inline void store16(char *o, __m256 a, __m256 b,
                                                           int width) {
    if (width == 32) {
        _mm256_stream_ps((float *)o, a);
        _mm256_stream_ps((float *)(o + 32), b);
    } else if (width == 16) {
        _mm_stream_ps((float *)o, _mm256_castps256_ps128(a));
        _mm_stream_ps((float *)(o + 16), _mm256_extractf128_ps(a, 1));
        _mm_stream_ps((float *)(o + 32), _mm256_castps256_ps128(b));
        _mm_stream_ps((float *)(o + 48), _mm256_extractf128_ps(b, 1));
    } else {
        _mm256_storeu_ps((float *)o, a);
        _mm256_storeu_ps((float *)(o + 32), b);
    }
}

/* The float32 lanes with AVX2, whole groups only: lanes 0-7 and 8-15 in two registers per
 * sum. Stores to `out` where it is not `own`, and to `backup`, stream past the caches
 * where they are aligned (stream_width), as copy_finite's do: nobody reads them soon (the result
 * out of place is read next from memory, a backup only for a refused part), and a cached
 * store would first read each line. In place `out` is written cached: its lines were just
 * read as `own`. Returns the elements
 * done; the generic loop does the rest. */
__attribute__((target("avx2"))) static Py_ssize_t check32_avx2(const char *x, char *out,
                                                                const char *own, char *backup,
                                                                Py_ssize_t n, CheckLanes *l,
                                                                int *special) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i inf = _mm256_set1_epi32((int)F32_INF);
    const __m256i one = _mm256_set1_epi32(1);
    __m256i count0 = _mm256_setzero_si256(), count1 = count0, hit = count0;
    Py_ssize_t groups = n / CHECK_GROUP;
    int stream = out != NULL && out != own ? stream_width(out) : 0;
    int stream_backup = backup != NULL ? stream_width(backup) : 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        __m256 p[8];
        for (int j = 0; j < 8; j++) p[j] = _mm256_setzero_ps();
        for (int b = 0; b < CHECK_FLUSH; b++) {
            Py_ssize_t at = (g * CHECK_GROUP + b * CHECK_LANES) * 4;
            __m256 r0 = _mm256_loadu_ps((const float *)(x + at));
            __m256 r1 = _mm256_loadu_ps((const float *)(x + at + 32));
            __m256 o0 = _mm256_loadu_ps((const float *)(own + at));
            __m256 o1 = _mm256_loadu_ps((const float *)(own + at + 32));
            if (backup) store16(backup + at, o0, o1, stream_backup);
            if (out) store16(out + at, r0, r1, stream);
            hit = _mm256_or_si256(
                hit, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(r0), inf), inf));
            hit = _mm256_or_si256(
                hit, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(r1), inf), inf));
            __m256 d0 = _mm256_sub_ps(r0, o0), d1 = _mm256_sub_ps(r1, o1);
            p[0] = _mm256_add_ps(p[0], _mm256_mul_ps(d0, d0));
            p[1] = _mm256_add_ps(p[1], _mm256_mul_ps(d1, d1));
            p[2] = _mm256_add_ps(p[2], _mm256_mul_ps(o0, o0));
            p[3] = _mm256_add_ps(p[3], _mm256_mul_ps(o1, o1));
            p[4] = _mm256_add_ps(p[4], _mm256_and_ps(d0, abs_mask));
            p[5] = _mm256_add_ps(p[5], _mm256_and_ps(d1, abs_mask));
            p[6] = _mm256_add_ps(p[6], _mm256_and_ps(o0, abs_mask));
            p[7] = _mm256_add_ps(p[7], _mm256_and_ps(o1, abs_mask));
            __m256 z0 = _mm256_cmp_ps(o0, _mm256_setzero_ps(), _CMP_NEQ_UQ);
            __m256 z1 = _mm256_cmp_ps(o1, _mm256_setzero_ps(), _CMP_NEQ_UQ);
            count0 = _mm256_add_epi32(count0, _mm256_and_si256(_mm256_castps_si256(z0), one));
            count1 = _mm256_add_epi32(count1, _mm256_and_si256(_mm256_castps_si256(z1), one));
        }
        for (int j = 0; j < 4; j++) {
            flush8(l->t[j], p[2 * j]);
            flush8(l->t[j] + 8, p[2 * j + 1]);
        }
    }
    if (stream || stream_backup) _mm_sfence(); /* streamed lines visible before what follows */
    int32_t counts[CHECK_LANES];
    _mm256_storeu_si256((__m256i *)counts, count0);
    _mm256_storeu_si256((__m256i *)(counts + 8), count1);
    for (int k = 0; k < CHECK_LANES; k++) l->nonzero[k] += counts[k];
    *special = !_mm256_testz_si256(hit, hit);
    return groups * CHECK_GROUP;
}
#endif

/* Elements per call of the AVX2 loop: its lane counts are 32-bit. */
#define CHECK_AVX2_MAX ((Py_ssize_t)1 << 34)

static PyObject *check_copy(PyObject *self, PyObject *args) {
    PyObject *src_o, *out_o, *own_o, *backup_o, *sums_o;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OOOOiO:check_copy", &src_o, &out_o, &own_o, &backup_o,
                          &itemsize, &sums_o))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "check_copy: itemsize must be 4 or 8");
        return NULL;
    }
    Buf src, out, own, backup, sums;
    src.held = out.held = own.held = backup.held = sums.held = 0;
    PyObject *result = NULL;
    Py_ssize_t n = get(src_o, &src, 0, itemsize, 0, "src");
    if (n < 0) goto done;
    Py_ssize_t no = get(out_o, &out, 1, itemsize, 1, "out");
    if (no < 0) goto done;
    Py_ssize_t nown = get(own_o, &own, 0, itemsize, 0, "own");
    if (nown < 0) goto done;
    Py_ssize_t nb = get(backup_o, &backup, 1, itemsize, 1, "backup");
    if (nb < 0) goto done;
    Py_ssize_t ns = get(sums_o, &sums, 1, 8, 0, "sums");
    if (ns < 0) goto done;
    if (nown != n || (out.held && no != n) || (backup.held && nb != n) || ns != CHECK_SUMS) {
        PyErr_SetString(PyExc_ValueError,
                        "check_copy: own, out and backup need src's length, sums 5 float64");
        goto done;
    }
    int special = 0;
    char *o = out.held ? out.view.buf : NULL, *b = backup.held ? backup.view.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    CheckLanes l;
    memset(&l, 0, sizeof l);
    Py_ssize_t done = 0;
#ifdef STREAMING
    if (itemsize == 4 && n < CHECK_AVX2_MAX && __builtin_cpu_supports("avx2"))
        done = check32_avx2(src.view.buf, o, own.view.buf, b, n, &l, &special);
#endif
    if (itemsize == 4)
        special |= check32_generic(src.view.buf, (f32 *)o, own.view.buf, (f32 *)b, done, n, &l);
    else
        special |= check64_generic(src.view.buf, (f64 *)o, own.view.buf, (f64 *)b, done, n, &l);
    double t[CHECK_SUMS] = {0};
    for (int k = 0; k < CHECK_LANES; k++) {
        for (int j = 0; j < 4; j++) t[j] = t[j] + l.t[j][k];
        t[4] = t[4] + (double)l.nonzero[k];
    }
    memcpy(sums.view.buf, t, sizeof t);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(!special);
done:
    release(&src); release(&out); release(&own); release(&backup); release(&sums);
    return result;
}

static PyMethodDef methods[] = {
    {"check_copy", check_copy, METH_VARARGS,
     "check_copy(src, out, own, backup, itemsize, sums) -> bool: copy float32 (itemsize 4) "
     "or float64 (8) src into out and own into backup (either None: no copy; own may be out "
     "itself) and write into sums (5 float64) sum d^2, sum own^2, sum |d|, sum |own| and "
     "own's nonzero count, d = src - own; False if src holds NaN/Inf."},
    {"all_finite", all_finite, METH_VARARGS,
     "all_finite(x, itemsize) -> bool: whether float32 (itemsize 4) or float64 (8) "
     "values hold no NaN/Inf."},
    {"copy_finite", copy_finite, METH_VARARGS,
     "copy_finite(src, out, itemsize) -> bool: copy float32 (itemsize 4) or float64 (8) "
     "values bit for bit; False if src holds NaN/Inf."},
    {"weighted_sum", weighted_sum, METH_VARARGS,
     "weighted_sum(copies, weights, d, itemsize, out, halves=b'') -> bool: out = "
     "(copies[0]*weights[0] + copies[1]*weights[1] + ...) / d in float32 (itemsize 4) or "
     "float64 (8), each operation rounded as numpy does, in that order; d 0: no division. "
     "halves (float32 only): one byte per copy, nonzero where the copy is binary16 words. "
     "False if out holds NaN/Inf or a word is Inf/NaN."},
    {"median_gram", median_gram, METH_VARARGS,
     "median_gram(stack, n, pairs, lower, upper, itemsize, median, gram): per column of the "
     "(n, m) stack, median = (row lower + row upper) / 2 after the comparators `pairs` "
     "(int32 i, j); gram (n * n float64) = the Gram matrix of stack - median."},
    {"combine", combine, METH_VARARGS,
     "combine(stack, n, median, coeffs, itemsize, out): out = median + sum_i coeffs[i] * "
     "(stack[i] - median), in float64, rounded once."},
    {"trimmed", trimmed, METH_VARARGS,
     "trimmed(stack, n, pairs, first, last, itemsize, out): per column, the mean of rows "
     "first..last-1 after the comparators `pairs` (summed in row order, in the dtype)."},
    {"trimmed_weighted", trimmed_weighted, METH_VARARGS,
     "trimmed_weighted(stack, n, k, weights, itemsize, out): per column, the weights-weighted "
     "mean of the values neither among the k smallest nor the k largest (ties by row); "
     "their plain mean where their weights are all zero."},
    {"f32_to_f16", f32_to_f16, METH_VARARGS,
     "f32_to_f16(src, words, values) -> bool: float32 to binary16 words (nearest even, "
     "saturating at +/-65504) and/or their float32 values; False if src holds NaN/Inf."},
    {"f16_to_f32", f16_to_f32, METH_VARARGS,
     "f16_to_f32(words, out, check_first=False) -> bool: binary16 words to float32; False "
     "if a word is Inf/NaN (check_first: then out is untouched)."},
    {"quantize8", quantize8, METH_VARARGS,
     "quantize8(x, block, lut, table, codes, values, scales) -> bool: per block of x, "
     "scales[b] = its signed element of largest magnitude (positive on a tie, +0.0 for "
     "zeros), then codes[i] = lut[bits(x[i] * inverse) >> 13] and/or values[i] = "
     "table[code] * scales[b] (inverse = 1/scales[b], 0 below float32's smallest normal); "
     "False if x holds NaN/Inf."},
    {"dequantize8", dequantize8, METH_VARARGS,
     "dequantize8(codes, table, scales, block, out): out[i] = table[codes[i]] * scales[b]."},
    {"scaled16", scaled16, METH_VARARGS,
     "scaled16(x, means, k, row, words): words[r*row+i] = binary16 bits of "
     "(x[r*row+i] - means[r]) * k[r] (k = inverse * 2**-112; no overflow check)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "Compiled codec kernels (optional).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    /* Whether the kernels take buffers at any address (see u16/u32/f32 above). */
    if (m && PyModule_AddIntConstant(m, "any_alignment", ANY_ALIGNMENT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* weighted_sum takes binary16 copies (its `halves` argument). */
    if (m && PyModule_AddIntConstant(m, "weighted_sum_halves", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
