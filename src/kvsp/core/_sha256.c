/* SHA-256 of several ranges of one buffer, two at a time (kvsp.core._sha256).
 *
 * Every octet of a block a client receives is hashed twice (KVSP 6.7: Repr-Digest over the
 * container, the layer digests over each layer). With the x86 SHA extensions one SHA-256
 * stream is bound by the latency of SHA256RNDS2 (each pair of rounds waits for the previous),
 * so a core runs at about half of what its SHA unit can do. Two independent streams whose
 * rounds are interleaved fill that gap: here the ranges are shared out over two lanes, each
 * lane taking the next range when it finishes one, and every step compresses one block of
 * each lane. The container and its layers then cost about as much as the container alone.
 *
 * digests(buffer, ranges) -> list[bytes]: the SHA-256 of buffer[start:stop] for each
 * (start, stop) in ranges, in order, computed without the GIL. ACCELERATED says whether this
 * CPU has the instructions; without them digests() raises and callers use hashlib.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVSP_SHA_NI 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define KVSP_SHA_NI 0
#endif

typedef struct {
    Py_ssize_t start;
    Py_ssize_t stop;
} Range;

#if KVSP_SHA_NI

#define SHA_TARGET __attribute__((target("sha,sse4.1,ssse3")))

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static const uint32_t H256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

/* The working state of one stream in the register layout SHA256RNDS2 uses: (A,B,E,F) and
 * (C,D,G,H), with the message schedule's last four groups of four words. */
typedef struct {
    __m128i abef, cdgh;
    __m128i saved_abef, saved_cdgh;
    __m128i w[4];
} Lane;

/* One range in progress on a lane: full blocks are read where they lie; the last one or two
 * (the tail and the padding) from ``pad``. */
typedef struct {
    const uint8_t *next;
    Py_ssize_t full_left; /* full blocks still to read from the buffer */
    int pad_left;         /* padding blocks still to read from pad */
    int pad_at;
    Py_ssize_t job;       /* index of the range, -1 when the lane is idle */
    uint8_t pad[128];
    Lane lane;
} Stream;

static SHA_TARGET inline void lane_load(Lane *l, const uint32_t h[8]) {
    __m128i dcba = _mm_loadu_si128((const __m128i *)&h[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&h[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    l->abef = _mm_alignr_epi8(cdab, efgh, 8);
    l->cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
}

static SHA_TARGET inline void lane_store(const Lane *l, uint8_t out[32]) {
    __m128i feba = _mm_shuffle_epi32(l->abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(l->cdgh, 0xB1);
    __m128i dcba = _mm_blend_epi16(feba, dchg, 0xF0);
    __m128i hgfe = _mm_alignr_epi8(dchg, feba, 8);
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    _mm_storeu_si128((__m128i *)&out[0], _mm_shuffle_epi8(dcba, swap));
    _mm_storeu_si128((__m128i *)&out[16], _mm_shuffle_epi8(hgfe, swap));
}

/* Rounds 4g..4g+3 of a block on one lane; groups 0-3 take the block's words. */
static SHA_TARGET inline __attribute__((always_inline)) void
lane_rounds(Lane *l, int g, const uint8_t *block) {
    __m128i w;
    if (g < 4) {
        const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
        w = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(block + 16 * g)), swap);
        if (g == 0) {
            l->saved_abef = l->abef;
            l->saved_cdgh = l->cdgh;
        }
    } else {
        __m128i w16 = l->w[g & 3], w12 = l->w[(g + 1) & 3];
        __m128i w8 = l->w[(g + 2) & 3], w4 = l->w[(g + 3) & 3];
        w = _mm_add_epi32(_mm_sha256msg1_epu32(w16, w12), _mm_alignr_epi8(w4, w8, 4));
        w = _mm_sha256msg2_epu32(w, w4);
    }
    l->w[g & 3] = w;
    __m128i t = _mm_add_epi32(w, _mm_loadu_si128((const __m128i *)&K256[4 * g]));
    l->cdgh = _mm_sha256rnds2_epu32(l->cdgh, l->abef, t);
    l->abef = _mm_sha256rnds2_epu32(l->abef, l->cdgh, _mm_shuffle_epi32(t, 0x0E));
    if (g == 15) {
        l->abef = _mm_add_epi32(l->abef, l->saved_abef);
        l->cdgh = _mm_add_epi32(l->cdgh, l->saved_cdgh);
    }
}

static SHA_TARGET void compress_one(Lane *a, const uint8_t *block_a) {
#pragma GCC unroll 16
    for (int g = 0; g < 16; g++) {
        lane_rounds(a, g, block_a);
    }
}

/* The two lanes' rounds side by side: neither waits on the other's dependency chain. */
static SHA_TARGET void compress_two(Lane *a, const uint8_t *block_a, Lane *b,
                                    const uint8_t *block_b) {
#pragma GCC unroll 16
    for (int g = 0; g < 16; g++) {
        lane_rounds(a, g, block_a);
        lane_rounds(b, g, block_b);
    }
}

static SHA_TARGET void stream_begin(Stream *s, const uint8_t *base, const Range *r,
                                    Py_ssize_t job) {
    Py_ssize_t length = r->stop - r->start;
    Py_ssize_t tail = length % 64;
    uint64_t bits = (uint64_t)length * 8;
    s->job = job;
    s->next = base + r->start;
    s->full_left = length / 64;
    memset(s->pad, 0, sizeof s->pad);
    memcpy(s->pad, s->next + s->full_left * 64, (size_t)tail);
    s->pad[tail] = 0x80;
    s->pad_left = tail < 56 ? 1 : 2;
    for (int i = 0; i < 8; i++) {
        s->pad[64 * s->pad_left - 1 - i] = (uint8_t)(bits >> (8 * i));
    }
    s->pad_at = 0;
    lane_load(&s->lane, H256);
}

/* The block this stream compresses next. */
static inline const uint8_t *stream_block(const Stream *s) {
    return s->full_left > 0 ? s->next : s->pad + 64 * s->pad_at;
}

/* After a block: move on, and when the range is done write its digest and report it. */
static SHA_TARGET int stream_advance(Stream *s, uint8_t (*out)[32]) {
    if (s->full_left > 0) {
        s->next += 64;
        s->full_left--;
        return 0;
    }
    if (++s->pad_at < s->pad_left) {
        return 0;
    }
    lane_store(&s->lane, out[s->job]);
    s->job = -1;
    return 1;
}

static SHA_TARGET void digest_ranges(const uint8_t *base, const Range *ranges, Py_ssize_t count,
                                     uint8_t (*out)[32]) {
    Stream streams[2];
    Py_ssize_t next_job = 0;
    for (int i = 0; i < 2; i++) {
        streams[i].job = -1;
        if (next_job < count) {
            stream_begin(&streams[i], base, &ranges[next_job], next_job);
            next_job++;
        }
    }
    for (;;) {
        Stream *a = &streams[0], *b = &streams[1];
        if (a->job >= 0 && b->job >= 0) {
            compress_two(&a->lane, stream_block(a), &b->lane, stream_block(b));
        } else if (a->job >= 0 || b->job >= 0) {
            Stream *only = a->job >= 0 ? a : b;
            compress_one(&only->lane, stream_block(only));
        } else {
            return;
        }
        for (int i = 0; i < 2; i++) {
            Stream *s = &streams[i];
            if (s->job >= 0 && stream_advance(s, out) && next_job < count) {
                stream_begin(s, base, &ranges[next_job], next_job);
                next_job++;
            }
        }
    }
}

static int cpu_has_sha(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSSE3) || !(c & bit_SSE4_1)) {
        return 0;
    }
    if (__get_cpuid_max(0, NULL) < 7) {
        return 0;
    }
    __cpuid_count(7, 0, a, b, c, d);
    return (b & bit_SHA) != 0;
}

#endif /* KVSP_SHA_NI */

static int accelerated = 0;

static PyObject *digests(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer view;
    PyObject *ranges_obj;
    if (!PyArg_ParseTuple(args, "y*O:digests", &view, &ranges_obj)) {
        return NULL;
    }
    PyObject *result = NULL;
    Range *ranges = NULL;
    uint8_t(*out)[32] = NULL;
    PyObject *seq = PySequence_Fast(ranges_obj, "ranges must be a sequence of (start, stop)");
    if (seq == NULL) {
        goto done;
    }
    if (!accelerated) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no SHA extensions; use hashlib");
        goto done;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    ranges = PyMem_Malloc(sizeof(Range) * (size_t)(count ? count : 1));
    out = PyMem_Malloc(32 * (size_t)(count ? count : 1));
    if (ranges == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t start, stop;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "nn", &start, &stop)) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_TypeError, "each range is a (start, stop) tuple of ints");
            }
            goto done;
        }
        if (start < 0 || stop < start || stop > view.len) {
            PyErr_Format(PyExc_ValueError, "range (%zd, %zd) is not within %zd octets", start,
                         stop, view.len);
            goto done;
        }
        ranges[i].start = start;
        ranges[i].stop = stop;
    }
#if KVSP_SHA_NI
    Py_BEGIN_ALLOW_THREADS digest_ranges((const uint8_t *)view.buf, ranges, count, out);
    Py_END_ALLOW_THREADS
#endif
    result = PyList_New(count);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)out[i], 32);
        if (d == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, d);
    }
done:
    Py_XDECREF(seq);
    PyMem_Free(ranges);
    PyMem_Free(out);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"digests", digests, METH_VARARGS,
     "digests(buffer, ranges) -> list[bytes]: SHA-256 of buffer[start:stop] for each range."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvsp.core._sha256",
    .m_doc = "SHA-256 of ranges of one buffer, two lanes at a time.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__sha256(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
#if KVSP_SHA_NI
    accelerated = cpu_has_sha();
#endif
    if (PyModule_AddObject(m, "ACCELERATED", PyBool_FromLong(accelerated)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
