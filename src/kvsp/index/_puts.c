/* split_puts: a publish batch's records split into what each has alone and what it shares.
 *
 * The records a holder publishes in one batch differ in their block key and digest and, mostly,
 * in nothing else: validating each with pydantic cost about 12 us a record, most of an ingest
 * over HTTP. This scans a `POST replicas` body once and answers, for every record of its `put`,
 * its identity (Compatibility ID, scope, block key and replica digest, checked and decoded
 * here) and the text of all its other members (its "shape", as written), so the caller
 * validates each distinct shape once, with the full parser, and takes the identities as they
 * are. Consecutive records of one shape and one space come as a run: the caller's work is
 * per run, not per record.
 *
 * Only a plain form is split: an object of `put` (an array of objects) and at most an empty
 * `delete`, member names without escapes, each identity member once, as a string of exactly
 * its lowercase hex digits, and no `layer_digests` (the replica digest must then be the hash of
 * them, which ties the identity to the shape). Anything else answers None and the caller parses
 * the body the slow way, which refuses what is wrong with a precise error. Member values in a
 * shape are only delimited here (strings, matched brackets, scalars); the caller's parse of
 * the shape's text checks them, and a shape is copied as written, so whatever is malformed in
 * it is still malformed there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_hex.h"

/* an identity: Compatibility ID (32 octets), scope (16), block key (32), replica digest (32) */
#define IDENTITY_OCTETS 112
#define MAX_DEPTH 64

enum { COMPAT, SCOPE, KEY, DIGEST, MEMBERS };

typedef struct {
    const unsigned char *p, *end;
} Cursor;

static inline void
skip_space(Cursor *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) {
        c->p++;
    }
}

static inline int
take(Cursor *c, unsigned char expected)
{
    skip_space(c);
    if (c->p == c->end || *c->p != expected) {
        return -1;
    }
    c->p++;
    skip_space(c);
    return 0;
}

/* After an object's member or an array's element: 1 at a comma (another follows), 0 at the
 * `closer` (past it), -1 at anything else. */
static int
next_item(Cursor *c, unsigned char closer)
{
    skip_space(c);
    if (c->p < c->end && *c->p == ',') {
        c->p++;
        skip_space(c);
        return 1;
    }
    if (c->p < c->end && *c->p == closer) {
        c->p++;
        return 0;
    }
    return -1;
}

/* A string at c->p; after it on success. *escaped says whether it holds a backslash. */
static int
skip_string(Cursor *c, int *escaped)
{
    *escaped = 0;
    if (c->p == c->end || *c->p != '"') {
        return -1;
    }
    for (c->p++; c->p < c->end;) {
        unsigned char ch = *c->p;
        if (ch == '"') {
            c->p++;
            return 0;
        }
        if (ch < 0x20) {
            return -1;
        }
        if (ch == '\\') {
            *escaped = 1;
            c->p++;
            if (c->p == c->end) {
                return -1;
            }
        }
        c->p++;
    }
    return -1;
}

static inline int
is_delimiter(unsigned char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == ',' || ch == ':'
           || ch == '[' || ch == ']' || ch == '{' || ch == '}' || ch == '"';
}

/* Any value at c->p, delimited only: brackets matched, strings and scalars skipped whole. */
static int
skip_value(Cursor *c)
{
    unsigned char closers[MAX_DEPTH];
    int depth = 0, escaped;
    do {
        skip_space(c);
        if (c->p == c->end) {
            return -1;
        }
        unsigned char ch = *c->p;
        if (ch == '"') {
            if (skip_string(c, &escaped) < 0) {
                return -1;
            }
        }
        else if (ch == '{' || ch == '[') {
            if (depth == MAX_DEPTH) {
                return -1;
            }
            closers[depth++] = ch == '{' ? '}' : ']';
            c->p++;
        }
        else if (ch == '}' || ch == ']') {
            if (depth == 0 || closers[depth - 1] != ch) {
                return -1;
            }
            depth--;
            c->p++;
        }
        else if (ch == ',' || ch == ':') {
            if (depth == 0) {
                return -1;
            }
            c->p++;
        }
        else {
            while (c->p < c->end && !is_delimiter(*c->p)) {
                c->p++;
            }
        }
    } while (depth > 0);
    return 0;
}

static inline int
named(const unsigned char *name, Py_ssize_t length, const char *expected)
{
    return (size_t)length == strlen(expected) && memcmp(name, expected, (size_t)length) == 0;
}

/* The identity member `name` names (COMPAT..DIGEST), MEMBERS for another, -1 for one that
 * keeps a record from being split. */
static int
identity_member(const unsigned char *name, Py_ssize_t length)
{
    if (named(name, length, "compat_id")) {
        return COMPAT;
    }
    if (named(name, length, "scope_id")) {
        return SCOPE;
    }
    if (named(name, length, "block_key")) {
        return KEY;
    }
    if (named(name, length, "digest")) {
        return DIGEST;
    }
    return named(name, length, "layer_digests") ? -1 : MEMBERS;
}

/* An identity member's string value at c->p, decoded into its place in `identity`. */
static int
take_identity(Cursor *c, int member, unsigned char *identity)
{
    static const Py_ssize_t offsets[] = {0, 32, 48, 80};
    const unsigned char *p = c->p;
    Py_ssize_t left = c->end - p;
    unsigned char *out = identity + offsets[member];
    int bad;
    if (member == SCOPE) {
        bad = left < 34 || p[0] != '"' || p[33] != '"' || hex32_octets(p + 1, out) < 0;
        c->p += 34;
    }
    else if (member == DIGEST) {
        bad = left < 74 || p[0] != '"' || memcmp(p + 1, "sha-256:", 8) != 0 || p[73] != '"'
              || hex64(p + 9, out) < 0;
        c->p += 74;
    }
    else {
        bad = left < 66 || p[0] != '"' || p[65] != '"' || hex64(p + 1, out) < 0;
        c->p += 66;
    }
    return bad ? -1 : 0;
}

/* One record at c->p: its identity into `identity`, the text of its other members as an
 * object into `shape` (its length into *shape_length). */
static int
split_record(Cursor *c, unsigned char *identity, unsigned char *shape, Py_ssize_t *shape_length)
{
    Py_ssize_t at = 0;
    unsigned seen = 0;
    int escaped;
    if (take(c, '{') < 0) {
        return -1;
    }
    shape[at++] = '{';
    for (;;) {
        const unsigned char *name = c->p;
        if (skip_string(c, &escaped) < 0 || escaped) {
            return -1;
        }
        int member = identity_member(name + 1, c->p - name - 2);
        if (member < 0 || take(c, ':') < 0) {
            return -1;
        }
        if (member < MEMBERS) {
            if (seen & (1u << member) || take_identity(c, member, identity) < 0) {
                return -1;
            }
            seen |= 1u << member;
        }
        else {
            if (skip_value(c) < 0) {
                return -1;
            }
            if (at > 1) {
                shape[at++] = ',';
            }
            memcpy(shape + at, name, (size_t)(c->p - name));
            at += c->p - name;
        }
        int more = next_item(c, '}');
        if (more < 0) {
            return -1;
        }
        if (!more) {
            break;
        }
    }
    if (seen != (1u << MEMBERS) - 1) {
        return -1;
    }
    shape[at++] = '}';
    *shape_length = at;
    return 0;
}

/* A run of records is done: (text, count) appended to runs. */
static int
end_run(PyObject *runs, PyObject *text, Py_ssize_t count)
{
    PyObject *run = Py_BuildValue("(On)", text, count);
    if (run == NULL || PyList_Append(runs, run) < 0) {
        Py_XDECREF(run);
        return -1;
    }
    Py_DECREF(run);
    return 0;
}

/* The records of the `put` array at c->p (after its '['): their identities appended to
 * `identities`, and runs of consecutive records of one shape and one space (Compatibility ID
 * and scope) to `runs`, each (shape text, records); runs of equal text share the object. */
static int
split_array(Cursor *c, unsigned char *shape, PyObject **identities, Py_ssize_t *count,
            PyObject *runs)
{
    if (c->p < c->end && *c->p == ']') {
        c->p++;
        return 0;
    }
    PyObject *text = NULL; /* owned: the current run's */
    Py_ssize_t first = 0, length;
    for (;;) {
        Py_ssize_t room = PyBytes_GET_SIZE(*identities);
        if ((*count + 1) * IDENTITY_OCTETS > room && _PyBytes_Resize(identities, 2 * room) < 0) {
            goto error;
        }
        unsigned char *ids = (unsigned char *)PyBytes_AS_STRING(*identities);
        unsigned char *identity = ids + *count * IDENTITY_OCTETS;
        if (split_record(c, identity, shape, &length) < 0) {
            Py_XDECREF(text);
            return -1;
        }
        int same_text = text != NULL && PyBytes_GET_SIZE(text) == length
                        && memcmp(PyBytes_AS_STRING(text), shape, (size_t)length) == 0;
        int same_space = text != NULL
                         && memcmp(identity, ids + first * IDENTITY_OCTETS, 48) == 0;
        if (!same_text || !same_space) {
            if (text != NULL && end_run(runs, text, *count - first) < 0) {
                goto error;
            }
            if (!same_text) {
                Py_XDECREF(text);
                text = PyBytes_FromStringAndSize((const char *)shape, length);
                if (text == NULL) {
                    return -2;
                }
            }
            first = *count;
        }
        ++*count;
        int more = next_item(c, ']');
        if (more == 0) {
            int ended = end_run(runs, text, *count - first);
            Py_DECREF(text);
            return ended < 0 ? -2 : 0;
        }
        if (more < 0) {
            Py_DECREF(text);
            return -1;
        }
    }
error:
    Py_XDECREF(text);
    return -2;
}

/* The top-level object: `put` once, `delete` at most once and empty, nothing else. */
static int
split_body(Cursor *c, unsigned char *shape, PyObject **identities, Py_ssize_t *count,
           PyObject *runs)
{
    int seen_put = 0, seen_delete = 0, escaped;
    if (take(c, '{') < 0) {
        return -1;
    }
    for (;;) {
        const unsigned char *name = c->p;
        if (skip_string(c, &escaped) < 0 || escaped) {
            return -1;
        }
        Py_ssize_t length = c->p - name - 2;
        if (take(c, ':') < 0) {
            return -1;
        }
        if (named(name + 1, length, "put") && !seen_put) {
            seen_put = 1;
            if (take(c, '[') < 0) {
                return -1;
            }
            int split = split_array(c, shape, identities, count, runs);
            if (split < 0) {
                return split;
            }
        }
        else if (named(name + 1, length, "delete") && !seen_delete) {
            seen_delete = 1;
            if (take(c, '[') < 0 || c->p == c->end || *c->p != ']') {
                return -1;
            }
            c->p++;
        }
        else {
            return -1;
        }
        int more = next_item(c, '}');
        if (more < 0) {
            return -1;
        }
        if (!more) {
            break;
        }
    }
    skip_space(c);
    return seen_put && c->p == c->end ? 0 : -1;
}

/* split_puts(body) -> (identities, runs) | None: for each record of the body's `put`, its
 * identity (IDENTITY_OCTETS a record, one after another), and the runs of records of one shape
 * and space, each its shape's JSON text and its count of records. */
static PyObject *
split_puts(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *runs = PyList_New(0);
    PyObject *identities = PyBytes_FromStringAndSize(NULL, 64 * IDENTITY_OCTETS);
    unsigned char *shape = PyMem_Malloc((size_t)view.len + 2);
    Py_ssize_t count = 0;
    if (runs == NULL || identities == NULL || shape == NULL) {
        if (shape == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    Cursor c = {view.buf, (const unsigned char *)view.buf + view.len};
    int split = split_body(&c, shape, &identities, &count, runs);
    if (split == -2) {
        goto done;
    }
    if (split < 0 || count == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (_PyBytes_Resize(&identities, count * IDENTITY_OCTETS) == 0) {
        result = PyTuple_Pack(2, identities, runs);
    }
done:
    PyMem_Free(shape);
    Py_XDECREF(identities);
    Py_XDECREF(runs);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef module_methods[] = {
    {"split_puts", (PyCFunction)split_puts, METH_O,
     "A plain publish batch's records: their identities' octets, runs of one shape and space."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvsp.index._puts",
    .m_doc = "A publish batch's records split into identities and shapes (see split_puts).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__puts(void)
{
    return PyModule_Create(&module);
}
