/* KeyTable: the block-key table of the Index Service's memory store.
 *
 * A lookup probes every key of a prompt (64 and more) in a table of millions of blocks; held in
 * a Python dict, each probe is a chain of dependent cache misses (index, entry, key object,
 * value), about 0.8 us under load. This table keeps the 32 octets of each key inline in an
 * open-addressing array, so a batch of keys is probed in passes that let the memory accesses of
 * all keys overlap: hash every key and prefetch its slot, then compare and prefetch the values.
 *
 * Keys are 64 lowercase hex digits (str), or for lookups packed 32 octets a key (pack_keys makes
 * them straight from a request body's JSON). The hash mixes the key's four words with a secret
 * derived from CPython's hash secret, so published keys cannot be chosen to collide. Linear
 * probing at a load of at most 1/2, with backward-shift deletion (no tombstones). Each slot
 * holds a value (any object) and a payload (bytes or None): the block's records packed
 * (packed.py: each a skeleton's number, the block key's and the digests' octets), from which a
 * lookup renders the block's JSON array without touching the value.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>
#include <sys/mman.h>

#include "_hex.h"

/* A slot holds no key of its own: a packed payload starts with its first record's skeleton
 * number and block key (packed.py), so the key is read there, and the slot keeps the key's hash
 * to compare first. A key without a payload is held as a bytes object of its 32 octets, tagged
 * in the pointer's low bit (objects are aligned). 24 octets a slot, against 48 with the key
 * inline: at most half the slots are used, so a record's share is 48 to 96 octets
 * (decision 0026). */
typedef struct {
    size_t hash;     /* hash_key of the key, where value is set */
    PyObject *value; /* NULL marks an empty slot */
    PyObject *held;  /* owned: the payload, or the key alone tagged KEY_ONLY */
} Slot;

#define KEY_ONLY ((uintptr_t)1)
#define PACKED_HEAD 36 /* a packed record's skeleton number and block key */

/* A stored replica of the memory store: its deadline, space, holder, cost summary and record,
 * in one object of no more than its fields. Held as Python objects (a class with slots, its
 * packed octets as bytes, its deadline as an int) a plain record took 224 octets; this takes
 * 128 (decision 0026). The record is packed (packed.py: a skeleton's number, the block key's
 * and the digests' octets, inline) with origin the Skeletons that packed it, or, in a store
 * that renders nothing (size 0), origin is the record itself. Not tracked by the cyclic
 * collector: nothing it references leads back to it (decision 0025). */
typedef struct {
    PyObject_HEAD
    long long expires_at;
    PyObject *space;   /* owned */
    PyObject *holder;  /* owned */
    PyObject *summary; /* owned, NULL until known */
    PyObject *origin;  /* owned */
    uint32_t size;     /* octets of data; 0 when the record is not packed */
    unsigned char data[];
} Replica;

static PyTypeObject ReplicaType;

/* A new replica with room for `size` octets of packed data (copied by the caller); NULL with
 * MemoryError set. summary may be NULL (not known yet). */
static Replica *
alloc_replica(long long expires_at, PyObject *space, PyObject *holder, PyObject *summary,
              PyObject *origin, Py_ssize_t size)
{
    Replica *self = PyObject_Malloc(offsetof(Replica, data) + (size_t)size);
    if (self == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    PyObject_Init((PyObject *)self, &ReplicaType);
    self->expires_at = expires_at;
    self->space = Py_NewRef(space);
    self->holder = Py_NewRef(holder);
    self->summary = Py_XNewRef(summary);
    self->origin = Py_NewRef(origin);
    self->size = (uint32_t)size;
    return self;
}

/* A payload's packed octets: a bytes object's, or a packed replica's own (a block of one
 * replica is held as that replica, its payload the replica itself). */
static inline const unsigned char *
payload_octets(PyObject *payload, Py_ssize_t *size)
{
    if (Py_IS_TYPE(payload, &ReplicaType)) {
        *size = ((Replica *)payload)->size;
        return ((Replica *)payload)->data;
    }
    *size = PyBytes_GET_SIZE(payload);
    return (const unsigned char *)PyBytes_AS_STRING(payload);
}

static inline int
is_payload(PyObject *payload)
{
    return PyBytes_CheckExact(payload)
           || (Py_IS_TYPE(payload, &ReplicaType) && ((Replica *)payload)->size > 0);
}

static inline int
key_only(const Slot *slot)
{
    return ((uintptr_t)slot->held & KEY_ONLY) != 0;
}

/* A held pointer without its KEY_ONLY tag: the object it owns. */
static inline PyObject *
untagged(PyObject *held)
{
    return (PyObject *)((uintptr_t)held & ~KEY_ONLY);
}

/* The object a slot holds: its payload, or the bytes of its key alone. */
static inline PyObject *
held_object(const Slot *slot)
{
    return untagged(slot->held);
}

/* A slot's payload (borrowed), Py_None when it holds its key alone. */
static inline PyObject *
slot_payload(const Slot *slot)
{
    return key_only(slot) ? Py_None : slot->held;
}

/* The 32 octets of a used slot's key. */
static inline const unsigned char *
slot_key(const Slot *slot)
{
    PyObject *held = held_object(slot);
    if (key_only(slot)) {
        return (const unsigned char *)PyBytes_AS_STRING(held);
    }
    Py_ssize_t size;
    return payload_octets(held, &size) + 4;
}

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask;
    Py_ssize_t used;
    PyObject *identity;  /* bytes: what follows each record's block key */
    PyObject *skeletons; /* list of bytes (or None where freed), shared with the store */
} KeyTable;

/* The 32 octets of a key, or -1 with ValueError/TypeError set. */
static int
parse_key(PyObject *text, uint64_t out[4])
{
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "block key must be str, not %.80s", Py_TYPE(text)->tp_name);
        return -1;
    }
    if (PyUnicode_KIND(text) != PyUnicode_1BYTE_KIND || PyUnicode_GET_LENGTH(text) != 64
        || hex64(PyUnicode_1BYTE_DATA(text), (unsigned char *)out) < 0) {
        PyErr_SetString(PyExc_ValueError, "block key must be 64 lowercase hex digits");
        return -1;
    }
    return 0;
}

/* Secret per process, from CPython's keyed hash of bytes (public API; PYTHONHASHSEED governs it
 * as it does dicts): keys published by a client cannot be chosen to collide without knowing
 * it. */
static uint64_t secret[4];

static inline uint64_t
mix(uint64_t a, uint64_t b)
{
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline size_t
hash_key(const uint64_t key[4])
{
    return (size_t)(mix(key[0] ^ secret[0], key[1] ^ secret[1])
                    ^ mix(key[2] ^ secret[2], key[3] ^ secret[3]));
}

static inline int
holds_key(const Slot *slot, const uint64_t key[4], size_t hash)
{
    return slot->hash == hash && memcmp(slot_key(slot), key, 32) == 0;
}

/* The slot holding key, or the empty slot where it would go, probing from slot i. */
static Slot *
find_slot_from(Slot *slots, size_t mask, const uint64_t key[4], size_t hash, size_t i)
{
    for (;;) {
        Slot *slot = &slots[i];
        if (slot->value == NULL || holds_key(slot, key, hash)) {
            return slot;
        }
        i = (i + 1) & mask;
    }
}

static inline Slot *
find_slot(Slot *slots, size_t mask, const uint64_t key[4], size_t hash)
{
    return find_slot_from(slots, mask, key, hash, hash & mask);
}

/* Slot arrays come from mmap (zeroed), with transparent huge pages asked for: a probe then
 * rarely misses the TLB as well as the caches. */
static Slot *
alloc_slots(size_t capacity)
{
    void *p = mmap(NULL, capacity * sizeof(Slot), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    madvise(p, capacity * sizeof(Slot), MADV_HUGEPAGE);
#endif
    return p;
}

static void
free_slots(Slot *slots, size_t capacity)
{
    munmap(slots, capacity * sizeof(Slot));
}

static int
resize(KeyTable *self, size_t capacity)
{
    Slot *fresh = alloc_slots(capacity);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (self->slots != NULL) {
        for (size_t i = 0; i <= self->mask; i++) {
            Slot *old = &self->slots[i];
            if (old->value != NULL) { /* keys are distinct: the first empty slot is its place */
                size_t j = old->hash & (capacity - 1);
                while (fresh[j].value != NULL) {
                    j = (j + 1) & (capacity - 1);
                }
                fresh[j] = *old;
            }
        }
        free_slots(self->slots, self->mask + 1);
    }
    self->slots = fresh;
    self->mask = capacity - 1;
    return 0;
}

static PyObject *
KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"", "", NULL};
    PyObject *identity, *skeletons;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!:KeyTable", kwlist, &PyBytes_Type,
                                     &identity, &PyList_Type, &skeletons)) {
        return NULL;
    }
    KeyTable *self = (KeyTable *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->identity = Py_NewRef(identity);
    self->skeletons = Py_NewRef(skeletons);
    if (resize(self, 8) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
KeyTable_traverse(KeyTable *self, visitproc visit, void *arg)
{
    if (self->slots != NULL) {
        for (size_t i = 0; i <= self->mask; i++) {
            Py_VISIT(self->slots[i].value);
            Py_VISIT(self->slots[i].value != NULL ? held_object(&self->slots[i]) : NULL);
        }
    }
    Py_VISIT(self->skeletons);
    return 0;
}

static int
KeyTable_clear(KeyTable *self)
{
    Py_CLEAR(self->identity);
    Py_CLEAR(self->skeletons);
    if (self->slots != NULL) {
        Slot *slots = self->slots;
        size_t mask = self->mask;
        self->slots = NULL;
        self->used = 0;
        for (size_t i = 0; i <= mask; i++) {
            if (slots[i].value != NULL) {
                Py_DECREF(slots[i].value);
                Py_DECREF(held_object(&slots[i]));
            }
        }
        free_slots(slots, mask + 1);
    }
    return 0;
}

static void
KeyTable_dealloc(KeyTable *self)
{
    PyObject_GC_UnTrack(self);
    KeyTable_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
KeyTable_len(KeyTable *self)
{
    return self->used;
}

/* The slot holding the key named by text, or NULL when it is absent; -1 on a malformed key. */
static int
locate(KeyTable *self, PyObject *text, Slot **out)
{
    uint64_t key[4];
    if (parse_key(text, key) < 0) {
        return -1;
    }
    Slot *slot = NULL;
    if (self->slots != NULL) { /* NULL only after the garbage collector cleared the table */
        slot = find_slot(self->slots, self->mask, key, hash_key(key));
    }
    *out = slot != NULL && slot->value != NULL ? slot : NULL;
    return 0;
}

static PyObject *
KeyTable_get(KeyTable *self, PyObject *text)
{
    Slot *slot;
    if (locate(self, text, &slot) < 0) {
        return NULL;
    }
    return Py_NewRef(slot != NULL ? slot->value : Py_None);
}

static PyObject *
KeyTable_put(KeyTable *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put(key, value, payload) takes 3 arguments");
        return NULL;
    }
    PyObject *value = args[1], *payload = args[2];
    if (value == Py_None) {
        PyErr_SetString(PyExc_ValueError, "a KeyTable value cannot be None");
        return NULL;
    }
    if (payload != Py_None && !is_payload(payload)) {
        PyErr_SetString(PyExc_TypeError, "payload must be bytes, a packed StoredReplica or None");
        return NULL;
    }
    uint64_t key[4];
    if (parse_key(args[0], key) < 0) {
        return NULL;
    }
    PyObject *held;
    if (payload == Py_None) {
        held = PyBytes_FromStringAndSize((const char *)key, 32);
        if (held == NULL) {
            return NULL;
        }
        held = (PyObject *)((uintptr_t)held | KEY_ONLY);
    }
    else {
        Py_ssize_t size;
        const unsigned char *octets = payload_octets(payload, &size);
        if (size < PACKED_HEAD || memcmp(octets + 4, key, 32) != 0) {
            PyErr_SetString(PyExc_ValueError, "a payload's first record must be of its key");
            return NULL;
        }
        held = Py_NewRef(payload);
    }
    if (self->slots == NULL && resize(self, 8) < 0) {
        Py_DECREF(untagged(held));
        return NULL;
    }
    size_t hash = hash_key(key);
    Slot *slot = find_slot(self->slots, self->mask, key, hash);
    if (slot->value == NULL) {
        if ((size_t)(self->used + 1) * 2 > self->mask + 1) {
            if (resize(self, (self->mask + 1) * 2) < 0) {
                Py_DECREF(untagged(held));
                return NULL;
            }
            slot = find_slot(self->slots, self->mask, key, hash);
        }
        slot->hash = hash;
        slot->value = Py_NewRef(value);
        slot->held = held;
        self->used++;
    }
    else {
        /* the old references go only once the slot is whole again: freeing them may run code
         * that uses this table */
        PyObject *old_value = slot->value, *old_held = held_object(slot);
        slot->value = Py_NewRef(value);
        slot->held = held;
        Py_DECREF(old_value);
        Py_DECREF(old_held);
    }
    Py_RETURN_NONE;
}

static PyObject *
KeyTable_pop(KeyTable *self, PyObject *text)
{
    Slot *hole;
    if (locate(self, text, &hole) < 0) {
        return NULL;
    }
    if (hole == NULL) {
        Py_RETURN_NONE;
    }
    size_t mask = self->mask;
    Slot *slots = self->slots;
    PyObject *value = hole->value;
    PyObject *held = held_object(hole);
    /* backward shift: move later entries of the run into the hole when their home allows */
    size_t i = (size_t)(hole - slots), j = i;
    for (;;) {
        j = (j + 1) & mask;
        Slot *next = &slots[j];
        if (next->value == NULL) {
            break;
        }
        size_t home = next->hash & mask;
        /* next may move to i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            slots[i] = *next;
            i = j;
        }
    }
    slots[i].value = NULL;
    slots[i].held = NULL;
    self->used--;
    Py_DECREF(held); /* once the table is whole again */
    return value;    /* the table's reference passes to the caller */
}

#define BATCH 64
#define PAYLOAD_LINES 8

/* Probe n keys (at most BATCH), given as str items or as packed octets, overlapping their
 * memory accesses; stores the matched slots of the leading present keys in found and returns
 * how many, or -1. */
static Py_ssize_t
probe_batch(KeyTable *self, PyObject **items, const unsigned char *packed, Py_ssize_t n,
            Slot **found)
{
    uint64_t parsed[BATCH][4];
    size_t hash[BATCH];
    Slot *candidate[BATCH];
    Slot *slots = self->slots;
    size_t mask = self->mask;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (packed != NULL) {
            memcpy(parsed[k], packed + 32 * k, 32);
        }
        else if (parse_key(items[k], parsed[k]) < 0) {
            return -1;
        }
        hash[k] = hash_key(parsed[k]);
        __builtin_prefetch(&slots[hash[k] & mask]);
        __builtin_prefetch((char *)&slots[hash[k] & mask] + sizeof(Slot) - 1);
    }
    /* first the slot of each key's hash, and its held object's first lines fetched (the key is
     * read there, and a block's array is usually one record of a few hundred octets;
     * prefetching past an object cannot fault), then the keys compared */
    for (Py_ssize_t k = 0; k < n; k++) {
        size_t i = hash[k] & mask;
        while (slots[i].value != NULL && slots[i].hash != hash[k]) {
            i = (i + 1) & mask;
        }
        candidate[k] = &slots[i];
        if (slots[i].value != NULL) {
            const char *held = (const char *)held_object(&slots[i]);
            for (int line = 0; line < PAYLOAD_LINES; line++) {
                __builtin_prefetch(held + 64 * line);
            }
        }
    }
    Py_ssize_t matched = 0;
    for (; matched < n; matched++) {
        Slot *slot = candidate[matched];
        if (slot->value != NULL && !holds_key(slot, parsed[matched], hash[matched])) {
            /* another key of the same hash: probe on past it */
            slot = find_slot_from(slots, mask, parsed[matched], hash[matched],
                                  ((size_t)(slot - slots) + 1) & mask);
        }
        if (slot->value == NULL) {
            break;
        }
        found[matched] = slot;
    }
    return matched;
}

/* Keys as given to prefix and join_prefix: a sequence of str, or bytes of packed keys (32
 * octets each, as pack_keys makes them). */
typedef struct {
    PyObject *seq;                 /* owned; the sequence, or the bytes */
    PyObject **items;              /* NULL for packed keys */
    const unsigned char *packed;   /* NULL for str keys */
    Py_ssize_t n;
} Keys;

static int
keys_of(PyObject *arg, Keys *keys)
{
    if (PyBytes_Check(arg)) {
        if (PyBytes_GET_SIZE(arg) % 32 != 0) {
            PyErr_SetString(PyExc_ValueError, "packed keys are 32 octets each");
            return -1;
        }
        keys->seq = Py_NewRef(arg);
        keys->items = NULL;
        keys->packed = (const unsigned char *)PyBytes_AS_STRING(arg);
        keys->n = PyBytes_GET_SIZE(arg) / 32;
        return 0;
    }
    keys->seq = PySequence_Fast(arg, "block keys must be a sequence or packed bytes");
    if (keys->seq == NULL) {
        return -1;
    }
    keys->items = PySequence_Fast_ITEMS(keys->seq);
    keys->packed = NULL;
    keys->n = PySequence_Fast_GET_SIZE(keys->seq);
    return 0;
}

/* The leading keys' slots, in batches; returns a PyMem array (caller frees) and its length. */
static Slot **
probe_prefix(KeyTable *self, PyObject *keys_arg, Py_ssize_t *matched_out, PyObject **seq_out)
{
    Keys keys;
    if (keys_of(keys_arg, &keys) < 0) {
        return NULL;
    }
    /* no slots only after the garbage collector cleared the table: nothing is held */
    Py_ssize_t n = self->slots == NULL ? 0 : keys.n;
    Slot **found = PyMem_Malloc(sizeof(Slot *) * (size_t)(n > 0 ? n : 1));
    if (found == NULL) {
        Py_DECREF(keys.seq);
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t matched = 0;
    for (Py_ssize_t start = 0; start < n; start += BATCH) {
        Py_ssize_t size = n - start < BATCH ? n - start : BATCH;
        Py_ssize_t got = probe_batch(self, keys.items ? keys.items + start : NULL,
                                     keys.packed ? keys.packed + 32 * start : NULL, size,
                                     found + start);
        if (got < 0) {
            PyMem_Free(found);
            Py_DECREF(keys.seq);
            return NULL;
        }
        matched += got;
        if (got < size) {
            break;
        }
    }
    *matched_out = matched;
    *seq_out = keys.seq;
    return found;
}

static PyObject *
KeyTable_prefix(KeyTable *self, PyObject *keys_arg)
{
    Py_ssize_t matched;
    PyObject *seq;
    Slot **found = probe_prefix(self, keys_arg, &matched, &seq);
    if (found == NULL) {
        return NULL;
    }
    PyObject *out = PyList_New(matched);
    if (out != NULL) {
        for (Py_ssize_t k = 0; k < matched; k++) {
            PyList_SET_ITEM(out, k, Py_NewRef(found[k]->value));
        }
    }
    PyMem_Free(found);
    Py_DECREF(seq);
    return out;
}

#define RECORD_OPEN "{\"block_key\":\""
#define RECORD_OPEN_LEN ((Py_ssize_t)sizeof(RECORD_OPEN) - 1)

#if defined(__SSE2__)
/* 32 octets -> 64 lowercase hex digits, 16 octets a step: each octet's nibbles interleaved,
 * high first, then offset to '0'-'9' and, above 9, to 'a'-'f'. */
static inline char *
hex32(const unsigned char *octets, char *out)
{
    const __m128i nibble = _mm_set1_epi8(0x0f);
    for (int half = 0; half < 2; half++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(octets + 16 * half));
        __m128i high = _mm_and_si128(_mm_srli_epi16(x, 4), nibble);
        __m128i low = _mm_and_si128(x, nibble);
        __m128i n[2] = {_mm_unpacklo_epi8(high, low), _mm_unpackhi_epi8(high, low)};
        for (int k = 0; k < 2; k++) {
            __m128i letter = _mm_and_si128(_mm_cmpgt_epi8(n[k], _mm_set1_epi8(9)),
                                           _mm_set1_epi8('a' - '0' - 10));
            __m128i digits = _mm_add_epi8(_mm_add_epi8(n[k], _mm_set1_epi8('0')), letter);
            _mm_storeu_si128((__m128i *)(out + 32 * half + 16 * k), digits);
        }
    }
    return out + 64;
}
#else
/* 32 octets -> 64 lowercase hex digits, four octets at a time (SWAR): each octet's nibbles are
 * spread to bytes of their own, then 0-9 and a-f are offset to their characters. */
static char *
hex32(const unsigned char *octets, char *out)
{
    const uint64_t nibbles = 0x000f000f000f000fULL, ones = 0x0101010101010101ULL;
    for (int i = 0; i < 32; i += 4) {
        uint32_t word;
        memcpy(&word, octets + i, 4);
        uint64_t x = word;
        x = (x | (x << 16)) & 0x0000ffff0000ffffULL;
        x = (x | (x << 8)) & 0x00ff00ff00ff00ffULL; /* octet k in bits 16k.. */
        uint64_t n = ((x >> 4) & nibbles) | ((x & nibbles) << 8); /* high nibble first */
        uint64_t letter = ((n + 6 * ones) >> 4) & ones;           /* 1 where n >= 10 */
        uint64_t digits = n + 0x30 * ones + letter * ('a' - '0' - 10);
        memcpy(out + 2 * i, &digits, 8);
    }
    return out + 64;
}
#endif

/* The skeleton a packed record at p names (left octets from p on) and the count of its digests,
 * or NULL with ValueError set when the payload does not parse. */
static PyObject *
skeleton_at(PyObject *skeletons, const unsigned char *p, Py_ssize_t left, Py_ssize_t *holes)
{
    if (left < PACKED_HEAD) {
        PyErr_SetString(PyExc_ValueError, "a packed record is cut short");
        return NULL;
    }
    uint32_t number = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16
                      | (uint32_t)p[3] << 24;
    PyObject *skeleton = (Py_ssize_t)number < PyList_GET_SIZE(skeletons)
                             ? PyList_GET_ITEM(skeletons, number)
                             : NULL;
    if (skeleton == NULL || !PyBytes_CheckExact(skeleton)) {
        PyErr_SetString(PyExc_ValueError, "a packed record names no skeleton");
        return NULL;
    }
    const char *at = PyBytes_AS_STRING(skeleton), *end = at + PyBytes_GET_SIZE(skeleton);
    Py_ssize_t count = 0;
    while ((at = memchr(at, 0, (size_t)(end - at))) != NULL) {
        count++;
        at++;
    }
    if (left < PACKED_HEAD + 32 * count) {
        PyErr_SetString(PyExc_ValueError, "a packed record is cut short");
        return NULL;
    }
    *holes = count;
    return skeleton;
}

/* The length of the JSON array rendered from a payload, or -1 with ValueError set. */
static Py_ssize_t
array_size(PyObject *identity, PyObject *skeletons, const unsigned char *p, Py_ssize_t left)
{
    Py_ssize_t size = 1, records = 0;
    Py_ssize_t opened = RECORD_OPEN_LEN + 64 + PyBytes_GET_SIZE(identity);
    while (left > 0) {
        Py_ssize_t holes;
        PyObject *skeleton = skeleton_at(skeletons, p, left, &holes);
        if (skeleton == NULL) {
            return -1;
        }
        size += 1 + opened + PyBytes_GET_SIZE(skeleton) + 63 * holes; /* the ',' or the ']' */
        p += PACKED_HEAD + 32 * holes;
        left -= PACKED_HEAD + 32 * holes;
        records++;
    }
    if (records == 0) {
        PyErr_SetString(PyExc_ValueError, "a block's payload holds no record");
        return -1;
    }
    return size;
}

/* Render a payload array_size accepted: '[' + each record's JSON joined by ',' + ']'. */
static char *
render_array(PyObject *identity, PyObject *skeletons, const unsigned char *p, Py_ssize_t left,
             char *out)
{
    const unsigned char *end_of_payload = p + left;
    Py_ssize_t identity_len = PyBytes_GET_SIZE(identity);
    *out++ = '[';
    while (p < end_of_payload) {
        uint32_t number = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16
                          | (uint32_t)p[3] << 24;
        PyObject *skeleton = PyList_GET_ITEM(skeletons, number);
        memcpy(out, RECORD_OPEN, RECORD_OPEN_LEN);
        out = hex32(p + 4, out + RECORD_OPEN_LEN);
        memcpy(out, PyBytes_AS_STRING(identity), (size_t)identity_len);
        out += identity_len;
        const char *at = PyBytes_AS_STRING(skeleton);
        const char *end = at + PyBytes_GET_SIZE(skeleton);
        p += PACKED_HEAD;
        for (;;) {
            const char *hole = memchr(at, 0, (size_t)(end - at));
            const char *stop = hole != NULL ? hole : end;
            memcpy(out, at, (size_t)(stop - at));
            out += stop - at;
            if (hole == NULL) {
                break;
            }
            out = hex32(p, out);
            p += 32;
            at = hole + 1;
        }
        *out++ = p < end_of_payload ? ',' : ']';
    }
    return out;
}

/* join_prefix(keys, head, middle, sep, tail)
 *   -> (matched, head + decimal(matched) + middle + sep.join(arrays) + tail)
 * where each matched block's JSON array is rendered from its payload. The whole answer in one
 * allocation, its size counted first. Raises LookupError when a matched key has no payload,
 * ValueError when a payload does not parse. */
static PyObject *
KeyTable_join_prefix(KeyTable *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "join_prefix(keys, head, middle, sep, tail) takes 5 arguments");
        return NULL;
    }
    for (int a = 1; a < 5; a++) {
        if (!PyBytes_CheckExact(args[a])) {
            PyErr_SetString(PyExc_TypeError, "head, middle, sep and tail must be bytes");
            return NULL;
        }
    }
    Py_ssize_t matched;
    PyObject *seq;
    Slot **found = probe_prefix(self, args[0], &matched, &seq);
    if (found == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    PyObject *sep = args[3];
    char count[32];
    Py_ssize_t count_len = (Py_ssize_t)snprintf(count, sizeof(count), "%zd", matched);
    Py_ssize_t sep_len = PyBytes_GET_SIZE(sep);
    Py_ssize_t total = count_len;
    for (int a = 1; a < 5; a++) {
        total += a == 3 ? 0 : PyBytes_GET_SIZE(args[a]);
    }
    for (Py_ssize_t k = 0; k < matched; k++) {
        PyObject *payload = slot_payload(found[k]);
        if (payload == Py_None) {
            PyErr_SetString(PyExc_LookupError, "a matched key has no payload");
            goto done;
        }
        Py_ssize_t octets;
        const unsigned char *packed = payload_octets(payload, &octets);
        Py_ssize_t size = array_size(self->identity, self->skeletons, packed, octets);
        if (size < 0) {
            goto done;
        }
        total += size + (k ? sep_len : 0);
    }
    PyObject *joined = PyBytes_FromStringAndSize(NULL, total);
    if (joined == NULL) {
        goto done;
    }
    char *p = PyBytes_AS_STRING(joined);
#define APPEND(src, len)                        \
    do {                                        \
        memcpy(p, (src), (size_t)(len));        \
        p += (len);                             \
    } while (0)
    APPEND(PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]));
    APPEND(count, count_len);
    APPEND(PyBytes_AS_STRING(args[2]), PyBytes_GET_SIZE(args[2]));
    for (Py_ssize_t k = 0; k < matched; k++) {
        if (k) {
            APPEND(PyBytes_AS_STRING(sep), sep_len);
        }
        Py_ssize_t octets;
        const unsigned char *packed = payload_octets(slot_payload(found[k]), &octets);
        p = render_array(self->identity, self->skeletons, packed, octets, p);
    }
    APPEND(PyBytes_AS_STRING(args[4]), PyBytes_GET_SIZE(args[4]));
#undef APPEND
    result = Py_BuildValue("(nN)", matched, joined);
done:
    PyMem_Free(found);
    Py_DECREF(seq);
    return result;
}

/* One holder of the first matched block and the leading blocks it holds. */
typedef struct {
    PyObject *holder; /* owned */
    Py_ssize_t blocks;
} Run;

static int
run_order(const void *a, const void *b)
{
    const Run *x = a, *y = b;
    if (x->blocks != y->blocks) {
        return x->blocks > y->blocks ? -1 : 1;
    }
    return PyUnicode_Compare(x->holder, y->holder); /* two str: cannot fail */
}

/* A block's replicas, *count of them: a StoredReplica is a block of itself (its list entry at
 * value_at, no tuple made), anything else holds a tuple of them as "replicas" (*owner, a new
 * reference, is that tuple). NULL with an error set when neither. */
static PyObject *const *
replicas_of(PyObject *const *value_at, Py_ssize_t *count, PyObject **owner)
{
    *owner = NULL;
    if (Py_IS_TYPE(*value_at, &ReplicaType)) {
        *count = 1;
        return value_at;
    }
    PyObject *replicas = PyObject_GetAttrString(*value_at, "replicas");
    if (replicas == NULL) {
        return NULL;
    }
    if (!PyTuple_CheckExact(replicas)) {
        Py_DECREF(replicas);
        PyErr_SetString(PyExc_TypeError, "a block's replicas must be a tuple");
        return NULL;
    }
    *owner = replicas;
    *count = PyTuple_GET_SIZE(replicas);
    return &PyTuple_GET_ITEM(replicas, 0);
}

/* Count block k's replicas into the runs (opened at the first block); how many runs went on,
 * or -1. */
static Py_ssize_t
extend_runs(PyObject *const *replicas, Py_ssize_t count, Py_ssize_t k, PyObject *position,
            Run *runs, Py_ssize_t *holders)
{
    Py_ssize_t going_on = 0;
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *replica = replicas[r];
        if (!Py_IS_TYPE(replica, &ReplicaType)
            || !PyUnicode_CheckExact(((Replica *)replica)->holder)) {
            PyErr_SetString(PyExc_TypeError, "a block's replicas must be StoredReplicas");
            return -1;
        }
        PyObject *holder = ((Replica *)replica)->holder;
        PyObject *at = PyDict_GetItemWithError(position, holder); /* borrowed */
        if (at == NULL && PyErr_Occurred()) {
            return -1;
        }
        if (at == NULL && k == 0) {
            PyObject *number = PyLong_FromSsize_t(*holders);
            int failed = number == NULL || PyDict_SetItem(position, holder, number) < 0;
            Py_XDECREF(number);
            if (failed) {
                return -1;
            }
            runs[(*holders)++] = (Run){Py_NewRef(holder), 1};
            going_on++;
        }
        else if (at != NULL) {
            Run *run = &runs[PyLong_AsSsize_t(at)];
            if (run->blocks == k) {
                run->blocks = k + 1;
                going_on++;
            }
        }
    }
    return going_on;
}

/* holder_runs(keys) -> (matched, [(holder, blocks), ...]): the count of leading keys present
 * (as prefix finds them) and each holder of the first with the number of leading blocks it
 * holds, most first, then by holder: a router's answer (replicas.holder_runs over the
 * prefix's values) counted in one walk, which ends once no holder's run goes on. Values are
 * StoredReplicas, or objects whose "replicas" is a tuple of them. */
static PyObject *
KeyTable_holder_runs(KeyTable *self, PyObject *keys_arg)
{
    PyObject *values = KeyTable_prefix(self, keys_arg); /* held: no slot is read after this */
    if (values == NULL) {
        return NULL;
    }
    Py_ssize_t matched = PyList_GET_SIZE(values), holders = 0;
    PyObject *result = NULL, *position = PyDict_New();
    Run *runs = NULL;
    if (position == NULL) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < matched; k++) {
        Py_ssize_t count;
        PyObject *owner;
        PyObject *const *replicas = replicas_of(PySequence_Fast_ITEMS(values) + k, &count, &owner);
        if (replicas == NULL) {
            goto done;
        }
        if (k == 0) {
            runs = PyMem_Calloc((size_t)count + 1, sizeof(Run));
            if (runs == NULL) {
                Py_XDECREF(owner);
                PyErr_NoMemory();
                goto done;
            }
        }
        Py_ssize_t going_on = extend_runs(replicas, count, k, position, runs, &holders);
        Py_XDECREF(owner);
        if (going_on < 0) {
            goto done;
        }
        if (going_on == 0) {
            break;
        }
    }
    if (holders > 1) {
        qsort(runs, (size_t)holders, sizeof(Run), run_order);
    }
    PyObject *listed = PyList_New(holders);
    if (listed == NULL) {
        goto done;
    }
    for (Py_ssize_t h = 0; h < holders; h++) {
        PyObject *run = Py_BuildValue("(On)", runs[h].holder, runs[h].blocks);
        if (run == NULL) {
            Py_DECREF(listed);
            goto done;
        }
        PyList_SET_ITEM(listed, h, run);
    }
    result = Py_BuildValue("(nN)", matched, listed);
done:
    for (Py_ssize_t h = 0; h < holders; h++) {
        Py_DECREF(runs[h].holder);
    }
    PyMem_Free(runs);
    Py_XDECREF(position);
    Py_DECREF(values);
    return result;
}

static PyObject *
KeyTable_values(KeyTable *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(self->used);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (size_t i = 0; self->slots != NULL && i <= self->mask; i++) {
        if (self->slots[i].value != NULL) {
            PyList_SET_ITEM(out, k++, Py_NewRef(self->slots[i].value));
        }
    }
    return out;
}

/* heapq.heappush, which put_run pushes each new replica's deadline with */
static PyObject *heappush;

/* put_run(identities, start, stop, head, space, holder, expires_at, summary, skeletons,
 * deadlines) -> stopped: store records start..stop-1 of a split publish batch (index/puts.py:
 * IDENTITY_OCTETS of identity each, all of one shape and of this table's space) as long as
 * their blocks are new here: each a replica packed as `head` (its skeleton's number) and its
 * identity's block key and digest, held as its block, its deadline pushed on the heap
 * `deadlines`. Answers the first record not stored (stop when all were); the caller stores
 * that one, and counts those stored (their skeleton's uses, the table's records). */
static PyObject *
KeyTable_put_run(KeyTable *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10 || !PyBytes_CheckExact(args[0]) || !PyLong_Check(args[1])
        || !PyLong_Check(args[2]) || !PyBytes_CheckExact(args[3]) || PyBytes_GET_SIZE(args[3]) != 4
        || !PyUnicode_Check(args[5]) || !PyLong_Check(args[6]) || !PyList_CheckExact(args[9])) {
        PyErr_SetString(PyExc_TypeError,
                        "put_run(identities, start, stop, head, space, holder, expires_at, "
                        "summary, skeletons, deadlines) takes bytes, int, int, 4 octets, "
                        "tuple, str, int, object, object, list");
        return NULL;
    }
    PyObject *space = args[4], *holder = args[5];
    PyObject *summary = args[7], *skeletons = args[8], *deadlines = args[9];
    const unsigned char *head = (const unsigned char *)PyBytes_AS_STRING(args[3]);
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), stop = PyLong_AsSsize_t(args[2]);
    long long expires_at = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (start < 0 || start > stop || stop > PyBytes_GET_SIZE(args[0]) / 112) {
        PyErr_SetString(PyExc_ValueError, "put_run's records lie outside its identities");
        return NULL;
    }
    const unsigned char *ids = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    /* room for every record first, so the slots stay where they are while a batch of them is
     * hashed and its slots prefetched (their accesses overlap, as a lookup's probes do) */
    if (self->slots == NULL && resize(self, 8) < 0) {
        return NULL;
    }
    while ((size_t)(self->used + (stop - start)) * 2 > self->mask + 1) {
        if (resize(self, (self->mask + 1) * 2) < 0) {
            return NULL;
        }
    }
    size_t hashes[BATCH];
    Py_ssize_t i = start;
    for (; i < stop; i++) {
        const unsigned char *identity = ids + 112 * i;
        Py_ssize_t in_batch = (i - start) % BATCH;
        if (in_batch == 0) {
            for (Py_ssize_t k = 0; k < BATCH && i + k < stop; k++) {
                uint64_t ahead[4];
                memcpy(ahead, identity + 112 * k + 48, 32);
                hashes[k] = hash_key(ahead);
                __builtin_prefetch(&self->slots[hashes[k] & self->mask], 1);
            }
        }
        uint64_t key[4];
        memcpy(key, identity + 48, 32);
        size_t hash = hashes[in_batch];
        Slot *slot = find_slot(self->slots, self->mask, key, hash);
        if (slot->value != NULL) {
            break; /* a block held already: the caller adds the replica to it */
        }
        Replica *replica = alloc_replica(expires_at, space, holder, summary, skeletons, 68);
        if (replica == NULL) {
            return NULL;
        }
        memcpy(replica->data, head, 4);
        memcpy(replica->data + 4, identity + 48, 64); /* block key and digest */
        slot->hash = hash;
        slot->value = (PyObject *)replica;
        slot->held = Py_NewRef(replica);
        self->used++;
        PyObject *push[2] = {deadlines, (PyObject *)replica};
        PyObject *pushed = PyObject_Vectorcall(heappush, push, 2, NULL);
        if (pushed == NULL) {
            return NULL;
        }
        Py_DECREF(pushed);
    }
    return PyLong_FromSsize_t(i);
}

static PyMethodDef KeyTable_methods[] = {
    {"put_run", (PyCFunction)(void (*)(void))KeyTable_put_run, METH_FASTCALL,
     "Store a split batch's records of one shape into new blocks; the first not stored."},
    {"get", (PyCFunction)KeyTable_get, METH_O, "The value of a key, or None."},
    {"put", (PyCFunction)(void (*)(void))KeyTable_put, METH_FASTCALL,
     "Set a key's value and payload (bytes or None)."},
    {"pop", (PyCFunction)KeyTable_pop, METH_O, "Remove a key; its value, or None."},
    {"prefix", (PyCFunction)KeyTable_prefix, METH_O,
     "Values of the leading keys present, stopping at the first absent one."},
    {"join_prefix", (PyCFunction)(void (*)(void))KeyTable_join_prefix, METH_FASTCALL,
     "(matched, head + str(matched) + middle + sep.join(arrays) + tail) of the\n"
     "leading keys present, each array rendered from its packed records."},
    {"holder_runs", (PyCFunction)KeyTable_holder_runs, METH_O,
     "(matched, [(holder, blocks), ...]) of the leading keys present: each holder of\n"
     "the first block with the leading blocks it holds, most first, then by holder."},
    {"values", (PyCFunction)KeyTable_values, METH_NOARGS, "Every value, in no order."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_length = (lenfunc)KeyTable_len,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsp.index._keytable.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Block key (64 lowercase hex digits) -> value and payload, probed in batches.",
    .tp_new = KeyTable_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_traverse = (traverseproc)KeyTable_traverse,
    .tp_clear = (inquiry)KeyTable_clear,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_methods = KeyTable_methods,
};

/* StoredReplica(space, holder, expires_at, record, summary=None, packed_by=None): record is the
 * packed octets (and packed_by the Skeletons that packed them) or, unpacked, any object with a
 * block_key (and packed_by None). */
static PyObject *
Replica_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"space", "holder", "expires_at", "record", "summary", "packed_by",
                             NULL};
    PyObject *space, *holder, *record, *summary = Py_None, *packed_by = Py_None;
    long long expires_at;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OULO|OO:StoredReplica", kwlist, &space,
                                     &holder, &expires_at, &record, &summary, &packed_by)) {
        return NULL;
    }
    int packed = PyBytes_Check(record);
    if (packed == (packed_by == Py_None)) {
        PyErr_SetString(PyExc_TypeError,
                        "a packed record comes with its skeletons, and only a packed one");
        return NULL;
    }
    Py_ssize_t size = packed ? PyBytes_GET_SIZE(record) : 0;
    if (packed && (size < PACKED_HEAD || size > UINT32_MAX)) {
        PyErr_SetString(PyExc_ValueError, "a packed record holds a skeleton number and a key");
        return NULL;
    }
    Replica *self = alloc_replica(expires_at, space, holder, summary == Py_None ? NULL : summary,
                                  packed ? packed_by : record, size);
    if (self == NULL) {
        return NULL;
    }
    if (packed) {
        memcpy(self->data, PyBytes_AS_STRING(record), (size_t)size);
    }
    return (PyObject *)self;
}

static void
Replica_dealloc(Replica *self)
{
    Py_DECREF(self->space);
    Py_DECREF(self->holder);
    Py_XDECREF(self->summary);
    Py_DECREF(self->origin);
    PyObject_Free(self);
}

static PyObject *
Replica_richcompare(PyObject *a, PyObject *b, int op)
{
    if (op != Py_LT || !Py_IS_TYPE(a, &ReplicaType) || !Py_IS_TYPE(b, &ReplicaType)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    return PyBool_FromLong(((Replica *)a)->expires_at < ((Replica *)b)->expires_at);
}

static PyObject *
Replica_packed(Replica *self, void *Py_UNUSED(closure))
{
    if (self->size == 0) {
        PyErr_SetString(PyExc_LookupError, "this replica is not packed");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)self->data, self->size);
}

static PyObject *
Replica_packed_by(Replica *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->size ? self->origin : Py_None);
}

static PyObject *
Replica_record(Replica *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->size ? Py_None : self->origin);
}

static PyObject *
Replica_block_key(Replica *self, void *Py_UNUSED(closure))
{
    if (self->size == 0) {
        return PyObject_GetAttrString(self->origin, "block_key");
    }
    PyObject *key = PyUnicode_New(64, 127);
    if (key != NULL) {
        hex32(self->data + 4, (char *)PyUnicode_1BYTE_DATA(key));
    }
    return key;
}

static PyObject *
Replica_replicas(Replica *self, void *Py_UNUSED(closure))
{
    return PyTuple_Pack(1, (PyObject *)self);
}

static PyObject *
Replica_sizeof(Replica *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(offsetof(Replica, data) + self->size);
}

static PyMemberDef Replica_members[] = {
    {"expires_at", T_LONGLONG, offsetof(Replica, expires_at), READONLY,
     "The deadline, on the store's clock (ms)."},
    {"space", T_OBJECT, offsetof(Replica, space), READONLY, "(compat_id, scope_id)."},
    {"holder", T_OBJECT, offsetof(Replica, holder), READONLY, "The holder's canonical URL."},
    {"summary", T_OBJECT, offsetof(Replica, summary), 0,
     "The cost summary, or None until it is parsed."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Replica_getset[] = {
    {"packed", (getter)Replica_packed, NULL, "The packed record (LookupError if unpacked).", NULL},
    {"packed_by", (getter)Replica_packed_by, NULL, "The Skeletons that packed it, or None.", NULL},
    {"record", (getter)Replica_record, NULL, "The unpacked record, or None if packed.", NULL},
    {"block_key", (getter)Replica_block_key, NULL, "The block key (64 hex digits).", NULL},
    {"replicas", (getter)Replica_replicas, NULL, "(self,): a block of this one replica.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Replica_methods[] = {
    {"__sizeof__", (PyCFunction)Replica_sizeof, METH_NOARGS, "Octets of the object."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReplicaType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsp.index._keytable.StoredReplica",
    .tp_basicsize = offsetof(Replica, data),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One replica record as the memory store holds it; ordered by deadline.",
    .tp_new = Replica_new,
    .tp_dealloc = (destructor)Replica_dealloc,
    .tp_richcompare = Replica_richcompare,
    .tp_members = Replica_members,
    .tp_getset = Replica_getset,
    .tp_methods = Replica_methods,
};

/* check_keys(keys): ValueError naming the first key that is not 64 lowercase hex digits. */
static PyObject *
check_keys(PyObject *Py_UNUSED(module), PyObject *keys_arg)
{
    PyObject *seq = PySequence_Fast(keys_arg, "block keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t key[4];
    for (Py_ssize_t k = 0; k < n; k++) {
        if (parse_key(items[k], key) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "block key %zd is not 64 lowercase hex digits", k);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* is_hex(text) -> bool: whether text is lowercase hex digits only (a length a multiple of 8,
 * as every KVSP identifier's is; anything else is False). */
static PyObject *
is_hex(PyObject *Py_UNUSED(module), PyObject *text)
{
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "expected str, not %.80s", Py_TYPE(text)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    if (PyUnicode_KIND(text) != PyUnicode_1BYTE_KIND || n % 8 != 0) {
        Py_RETURN_FALSE;
    }
    const unsigned char *digits = PyUnicode_1BYTE_DATA(text);
    unsigned char octets[4];
    for (Py_ssize_t i = 0; i < n; i += 8) {
        if (hex8(digits + i, octets) < 0) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* Whether the n packed keys are all different (1), not (0), or -1 with MemoryError set: a set
 * of their indices probed by hash_key (keyed, so keys cannot be chosen to collide), at least
 * twice as many slots as keys. */
static int
all_distinct(const unsigned char *keys, Py_ssize_t n)
{
    uint32_t on_stack[256];
    size_t size = 16;
    while (size < 2 * (size_t)n) {
        size <<= 1;
    }
    uint32_t *slots = size <= 256 ? on_stack : PyMem_Malloc(size * sizeof(uint32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(slots, 0xff, size * sizeof(uint32_t)); /* UINT32_MAX: empty */
    int distinct = 1;
    for (Py_ssize_t k = 0; k < n && distinct; k++) {
        uint64_t words[4];
        memcpy(words, keys + 32 * k, 32);
        size_t i = hash_key(words) & (size - 1);
        for (; slots[i] != UINT32_MAX; i = (i + 1) & (size - 1)) {
            if (memcmp(keys + 32 * (size_t)slots[i], words, 32) == 0) {
                distinct = 0;
                break;
            }
        }
        slots[i] = (uint32_t)k;
    }
    if (slots != on_stack) {
        PyMem_Free(slots);
    }
    return distinct;
}

/* pack_keys(json) -> bytes | None: the packed keys (32 octets each) of a JSON array, given as
 * the octets of a buffer, whose elements are all different strings of 64 lowercase hex digits
 * written plainly; None for anything else (an escape, another kind of element, a wrong length,
 * a key twice), which the caller decodes the slow way and refuses with a precise error. */
static PyObject *
pack_keys(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = view.buf, *end = p + view.len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (view.len / 66 + 1) * 32);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t n = 0;
#define SKIP_SPACE                                                                  \
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {      \
        p++;                                                                        \
    }
    SKIP_SPACE;
    if (p == end || *p != '[') {
        goto slow;
    }
    p++;
    SKIP_SPACE;
    if (p < end && *p == ']') {
        p++;
    }
    else {
        for (;;) {
            if (end - p < 66 || p[0] != '"' || p[65] != '"' || hex64(p + 1, dst + 32 * n) < 0) {
                goto slow;
            }
            p += 66;
            n++;
            SKIP_SPACE;
            if (p < end && *p == ',') {
                p++;
                SKIP_SPACE;
                continue;
            }
            if (p < end && *p == ']') {
                p++;
                break;
            }
            goto slow;
        }
    }
    SKIP_SPACE;
#undef SKIP_SPACE
    if (p != end || n > (Py_ssize_t)UINT32_MAX) {
        goto slow;
    }
    int distinct = all_distinct(dst, n);
    if (distinct < 0) {
        PyBuffer_Release(&view);
        Py_DECREF(out);
        return NULL;
    }
    if (!distinct) {
        goto slow;
    }
    PyBuffer_Release(&view);
    if (_PyBytes_Resize(&out, 32 * n) < 0) {
        return NULL;
    }
    return out;
slow:
    PyBuffer_Release(&view);
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* untrack(*objects): take each object out of the cyclic garbage collector's lists. A store of
 * millions of long-lived records made of a few objects each costs every full collection a walk
 * of all of them (1.66 s at a million records: decision 0025), though none can be in a cycle. An
 * untracked object is still freed when its last reference goes; it must never be part of a
 * reference cycle, or the cycle is never collected. */
static PyObject *
untrack(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (PyObject_IS_GC(args[i]) && PyObject_GC_IsTracked(args[i])) {
            PyObject_GC_UnTrack(args[i]);
        }
    }
    Py_RETURN_NONE;
}

/* render_array(identity, payload, skeletons): one block's JSON array, as join_prefix renders
 * it (for answers assembled in Python: those with estimates). */
static PyObject *
render_array_of(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || !is_payload(args[1])
        || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "render_array(identity, payload, skeletons) takes "
                                         "bytes, bytes or a packed StoredReplica, list");
        return NULL;
    }
    Py_ssize_t octets;
    const unsigned char *packed = payload_octets(args[1], &octets);
    Py_ssize_t size = array_size(args[0], args[2], packed, octets);
    if (size < 0) {
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out != NULL) {
        render_array(args[0], args[2], packed, octets, PyBytes_AS_STRING(out));
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"render_array", (PyCFunction)(void (*)(void))render_array_of, METH_FASTCALL,
     "One block's JSON array from its packed records, as join_prefix renders it."},
    {"untrack", (PyCFunction)(void (*)(void))untrack, METH_FASTCALL,
     "Take objects that are never part of a reference cycle out of the garbage collector."},
    {"is_hex", (PyCFunction)is_hex, METH_O,
     "Whether a str is lowercase hex digits only, its length a multiple of 8."},
    {"pack_keys", (PyCFunction)pack_keys, METH_O,
     "The packed keys of a plain JSON array of 64-digit lowercase hex strings, or None."},
    {"check_keys", (PyCFunction)check_keys, METH_O,
     "Raise ValueError unless every key is 64 lowercase hex digits."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvsp.index._keytable",
    .m_doc = "The Index Service's block-key table (see KeyTable).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__keytable(void)
{
    for (int i = 0; i < 4; i++) {
        /* splitmix64 steps over the process's keyed hash of a label: four well-mixed words */
        PyObject *label = PyBytes_FromFormat("kvsp keytable secret %d", i);
        if (label == NULL) {
            return NULL;
        }
        Py_hash_t keyed = PyObject_Hash(label);
        Py_DECREF(label);
        if (keyed == -1 && PyErr_Occurred()) {
            return NULL;
        }
        uint64_t z = (uint64_t)keyed + 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        secret[i] = (z ^ (z >> 31)) | 1;
    }
    if (PyType_Ready(&KeyTableType) < 0 || PyType_Ready(&ReplicaType) < 0) {
        return NULL;
    }
    PyObject *heapq = PyImport_ImportModule("heapq");
    if (heapq == NULL) {
        return NULL;
    }
    heappush = PyObject_GetAttrString(heapq, "heappush");
    Py_DECREF(heapq);
    if (heappush == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "KeyTable", (PyObject *)&KeyTableType) < 0
        || PyModule_AddObjectRef(m, "StoredReplica", (PyObject *)&ReplicaType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
