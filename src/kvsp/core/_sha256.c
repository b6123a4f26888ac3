/* SHA-256 of several ranges of one buffer, two at a time, as the buffer fills
 * (kvsp.core._sha256).
 *
 * Every octet of a block a client receives is hashed twice (KVSP 6.7: Repr-Digest over the
 * container, the layer digests over each layer). With the x86 SHA extensions one SHA-256
 * stream is bound by the latency of SHA256RNDS2 (each pair of rounds waits for the previous),
 * so a core runs at about half of what its SHA unit can do. Two independent streams whose
 * rounds are interleaved fill that gap: here the ranges are shared out over two lanes, each
 * lane taking the next range when it finishes one, and every step compresses one block of
 * each lane. The container and its layers then cost about as much as the container alone.
 *
 * A block's octets arrive over time, and hashing them as they come hides most of the hashing
 * behind the transfer. A Hasher keeps its lanes between calls: advance(buffer, filled) hashes
 * what the first ``filled`` octets of the buffer allow (a range ends once all of it is in)
 * and returns the indices of the ranges it completed; digest(i) is a completed range's
 * SHA-256. Hashing runs without the GIL. ACCELERATED says whether this CPU has the
 * instructions; without them a Hasher cannot be made, and callers use hashlib.
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

/* One range in progress on a lane: full blocks are read where they lie (at ``pos``); the last
 * one or two (the tail and the padding) from ``pad``, built once the range's end is in. */
typedef struct {
    Py_ssize_t pos;      /* offset of the next full block */
    Py_ssize_t full_end; /* where the range's full blocks end */
    Py_ssize_t stop;     /* where the range ends */
    uint64_t bits;       /* the range's length in bits, for the padding */
    int pad_left;        /* padding blocks, 0 until the range's end is in */
    int pad_at;
    Py_ssize_t job;      /* index of the range, -1 when the lane is idle */
    uint8_t pad[128];
    Lane lane;
} Stream;

/* The ranges of one buffer, their digests as they complete, and the two lanes between calls. */
typedef struct {
    Py_ssize_t count;
    Range *ranges;
    uint8_t (*out)[32];
    Py_ssize_t next_job;
    Stream streams[2];
} Progress;

static SHA_TARGET void stream_begin(Stream *s, const Range *r, Py_ssize_t job) {
    s->job = job;
    s->pos = r->start;
    s->stop = r->stop;
    s->full_end = r->start + (r->stop - r->start) / 64 * 64;
    s->bits = (uint64_t)(r->stop - r->start) * 8;
    s->pad_left = 0;
    s->pad_at = 0;
    lane_load(&s->lane, H256);
}

/* How many blocks the stream can compress now that the first ``filled`` octets are in: its
 * full blocks that are in, else (once its end is in) its padding blocks. */
static Py_ssize_t stream_ready(Stream *s, const uint8_t *base, Py_ssize_t filled) {
    if (s->job < 0) {
        return 0;
    }
    if (s->pos < s->full_end) {
        Py_ssize_t in = filled < s->full_end ? filled : s->full_end;
        return in > s->pos ? (in - s->pos) / 64 : 0;
    }
    if (s->pad_left == 0) {
        if (filled < s->stop) {
            return 0;
        }
        Py_ssize_t tail = s->stop - s->full_end;
        memset(s->pad, 0, sizeof s->pad);
        memcpy(s->pad, base + s->full_end, (size_t)tail);
        s->pad[tail] = 0x80;
        s->pad_left = tail < 56 ? 1 : 2;
        for (int i = 0; i < 8; i++) {
            s->pad[64 * s->pad_left - 1 - i] = (uint8_t)(s->bits >> (8 * i));
        }
    }
    return s->pad_left - s->pad_at;
}

/* The block this stream compresses next. */
static inline const uint8_t *stream_block(const Stream *s, const uint8_t *base) {
    return s->pos < s->full_end ? base + s->pos : s->pad + 64 * s->pad_at;
}

/* After a block: move on; when the range is done, write its digest and return 1. */
static SHA_TARGET int stream_advance(Stream *s, uint8_t (*out)[32]) {
    if (s->pos < s->full_end) {
        s->pos += 64;
        return 0;
    }
    if (++s->pad_at < s->pad_left) {
        return 0;
    }
    lane_store(&s->lane, out[s->job]);
    return 1;
}

static void progress_start(Progress *p) {
    p->next_job = 0;
    p->streams[0].job = p->streams[1].job = -1;
}

/* Hash what the first ``filled`` octets at ``base`` allow. The index of each range completed
 * goes to ``completed`` (room for every range); returns how many there were. */
static SHA_TARGET Py_ssize_t progress_advance(Progress *p, const uint8_t *base, Py_ssize_t filled,
                                              Py_ssize_t *completed) {
    Py_ssize_t done = 0;
    for (;;) {
        for (int i = 0; i < 2; i++) {
            Stream *s = &p->streams[i];
            if (s->job < 0 && p->next_job < p->count) {
                stream_begin(s, &p->ranges[p->next_job], p->next_job);
                p->next_job++;
            }
        }
        Stream *a = &p->streams[0], *b = &p->streams[1];
        Py_ssize_t ready_a = stream_ready(a, base, filled);
        Py_ssize_t ready_b = stream_ready(b, base, filled);
        if (ready_a == 0 && ready_b == 0) {
            return done;
        }
        /* both lanes side by side while both can go on, else the one that can; stop at the end
         * of either lane's run, where a range may have ended and a lane be free */
        Py_ssize_t run = ready_a == 0 ? ready_b : ready_b == 0 ? ready_a
                       : ready_a < ready_b ? ready_a : ready_b;
        for (Py_ssize_t k = 0; k < run; k++) {
            if (ready_a > 0 && ready_b > 0) {
                compress_two(&a->lane, stream_block(a, base), &b->lane, stream_block(b, base));
            } else {
                Stream *only = ready_a > 0 ? a : b;
                compress_one(&only->lane, stream_block(only, base));
            }
            for (int i = 0; i < 2; i++) {
                Stream *s = &p->streams[i];
                if ((i == 0 ? ready_a : ready_b) > 0 && stream_advance(s, p->out)) {
                    completed[done++] = s->job;
                    s->job = -1;
                }
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

/* The ranges of ``ranges_obj`` checked against a buffer of ``length`` octets, in a new array
 * (NULL with an exception set when one is not a (start, stop) pair within the buffer). */
static Range *parse_ranges(PyObject *ranges_obj, Py_ssize_t length, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(ranges_obj, "ranges must be a sequence of (start, stop)");
    if (seq == NULL) {
        return NULL;
    }
    *count = PySequence_Fast_GET_SIZE(seq);
    Range *ranges = PyMem_Malloc(sizeof(Range) * (size_t)(*count ? *count : 1));
    if (ranges == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *count; i++) {
        Py_ssize_t start, stop;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "nn", &start, &stop)) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_TypeError, "each range is a (start, stop) tuple of ints");
            }
            goto fail;
        }
        if (start < 0 || stop < start || stop > length) {
            PyErr_Format(PyExc_ValueError, "range (%zd, %zd) is not within %zd octets", start,
                         stop, length);
            goto fail;
        }
        ranges[i].start = start;
        ranges[i].stop = stop;
    }
    Py_DECREF(seq);
    return ranges;
fail:
    Py_DECREF(seq);
    PyMem_Free(ranges);
    return NULL;
}

/* -- Hasher ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
#if KVSP_SHA_NI
    Progress progress;
#endif
    Py_ssize_t length; /* the buffer's length, fixed by the ranges */
    Py_ssize_t *completed;
    char *done;
    int busy; /* an advance runs without the GIL */
} Hasher;

static void hasher_dealloc(Hasher *self) {
#if KVSP_SHA_NI
    PyMem_Free(self->progress.ranges);
    PyMem_Free(self->progress.out);
#endif
    PyMem_Free(self->completed);
    PyMem_Free(self->done);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int hasher_init(Hasher *self, PyObject *args, PyObject *kwds) {
    PyObject *ranges_obj;
    Py_ssize_t length, count;
    static char *keywords[] = {"length", "ranges", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nO:Hasher", keywords, &length, &ranges_obj)) {
        return -1;
    }
    if (!accelerated) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no SHA extensions; use hashlib");
        return -1;
    }
    if (length < 0) {
        PyErr_SetString(PyExc_ValueError, "length must be >= 0");
        return -1;
    }
    if (self->completed != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Hasher is set up once");
        return -1;
    }
    Range *ranges = parse_ranges(ranges_obj, length, &count);
    if (ranges == NULL) {
        return -1;
    }
    size_t room = (size_t)(count ? count : 1);
    self->completed = PyMem_Malloc(sizeof(Py_ssize_t) * room);
    self->done = PyMem_Calloc(room, 1);
#if KVSP_SHA_NI
    self->progress.ranges = ranges;
    self->progress.count = count;
    self->progress.out = PyMem_Malloc(32 * room);
    progress_start(&self->progress);
    if (self->progress.out == NULL || self->completed == NULL || self->done == NULL) {
        PyErr_NoMemory();
        return -1;
    }
#else
    PyMem_Free(ranges);
#endif
    self->length = length;
    return 0;
}

static PyObject *hasher_advance(Hasher *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t filled;
    if (!PyArg_ParseTuple(args, "y*n:advance", &view, &filled)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (self->completed == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the Hasher was not set up");
        goto done;
    }
    if (view.len != self->length) {
        PyErr_Format(PyExc_ValueError, "the buffer has %zd octets; the ranges are within %zd",
                     view.len, self->length);
        goto done;
    }
    if (filled < 0 || filled > view.len) {
        PyErr_Format(PyExc_ValueError, "%zd octets filled is not within %zd", filled, view.len);
        goto done;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "advance is already running on another thread");
        goto done;
    }
    Py_ssize_t count = 0;
#if KVSP_SHA_NI
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS count =
        progress_advance(&self->progress, (const uint8_t *)view.buf, filled, self->completed);
    Py_END_ALLOW_THREADS self->busy = 0;
#endif
    result = PyList_New(count);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        self->done[self->completed[i]] = 1;
        PyObject *index = PyLong_FromSsize_t(self->completed[i]);
        if (index == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, index);
    }
done:
    PyBuffer_Release(&view);
    return result;
}

static PyObject *hasher_digest(Hasher *self, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
#if KVSP_SHA_NI
    if (self->completed != NULL && i >= 0 && i < self->progress.count && self->done[i]) {
        return PyBytes_FromStringAndSize((const char *)self->progress.out[i], 32);
    }
#endif
    PyErr_Format(PyExc_ValueError, "range %zd is not complete", i);
    return NULL;
}

static PyMethodDef hasher_methods[] = {
    {"advance", (PyCFunction)hasher_advance, METH_VARARGS,
     "advance(buffer, filled) -> list[int]: hash what the first filled octets allow; the "
     "indices of the ranges completed."},
    {"digest", (PyCFunction)hasher_digest, METH_O, "digest(i) -> bytes: a completed range's."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HasherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvsp.core._sha256.Hasher",
    .tp_doc = "Hasher(length, ranges): SHA-256 of ranges of a buffer of length octets, hashed "
              "as it fills.",
    .tp_basicsize = sizeof(Hasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hasher_init,
    .tp_dealloc = (destructor)hasher_dealloc,
    .tp_methods = hasher_methods,
};

static PyMethodDef methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvsp.core._sha256",
    .m_doc = "SHA-256 of ranges of one buffer, two lanes at a time, as it fills.",
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
    if (PyType_Ready(&HasherType) < 0 ||
        PyModule_AddObject(m, "ACCELERATED", PyBool_FromLong(accelerated)) < 0 ||
        PyModule_AddObjectRef(m, "Hasher", (PyObject *)&HasherType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
