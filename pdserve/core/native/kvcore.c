/* The compiled part of the KV bookkeeping: `Map`, a hash map from uint64 keys (block hashes) to int64 values
 * >= 0 (block ids, slots), and `Order`, slots in least-recently-pushed order (the free queue, tier LRUs).
 *
 * Map:
 * Open addressing with linear probing and tombstones; the table doubles at 70% load (tombstones count,
 * so a churning map rebuilds itself clean). Keys go through a 64-bit finalizer first: block hashes are
 * already uniform, small integer keys (tests, slots) are not. A CPython extension type (`Map`): single keys
 * cost what a dict's do, and bulk calls take buffers (numpy arrays) so a request's hundreds of blocks cost
 * one call, not one Python operation each. pdserve/core/u64map.py wraps it and holds its contract.
 * Order: a doubly linked list over slot numbers, O(1) push / move / remove; pdserve/core/lru_queue.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* An entry's value is >= 0, or EMPTY / GONE: key and state in one 16-byte entry, one cache line per probe. */
enum { EMPTY = -1, GONE = -2 };

typedef struct {
    uint64_t key;
    int64_t val;
} pdm_entry;

typedef struct {
    pdm_entry *e;
    int64_t cap;  /* a power of two */
    int64_t size; /* live entries */
    int64_t used; /* live + GONE */
} pdm_map;

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static int alloc_table(pdm_map *m, int64_t cap) {
    pdm_entry *e = malloc(cap * sizeof(pdm_entry));
    if (!e) return -1;
    for (int64_t i = 0; i < cap; i++) e[i].val = EMPTY;
    m->e = e; m->cap = cap; m->size = 0; m->used = 0;
    return 0;
}

/* The index holding `key`, or -1. */
static inline int64_t find(const pdm_map *m, uint64_t key) {
    int64_t mask = m->cap - 1, i = (int64_t)(mix(key) & (uint64_t)mask);
    for (;;) {
        const pdm_entry *e = &m->e[i];
        if (e->val == EMPTY) return -1;
        if (e->key == key && e->val >= 0) return i;
        i = (i + 1) & mask;
    }
}

static void place(pdm_map *m, uint64_t key, int64_t val) { /* key known absent, room known */
    int64_t mask = m->cap - 1, i = (int64_t)(mix(key) & (uint64_t)mask);
    while (m->e[i].val >= 0) i = (i + 1) & mask;
    if (m->e[i].val == EMPTY) m->used++;
    m->e[i].key = key; m->e[i].val = val; m->size++;
}

static inline void drop(pdm_map *m, int64_t i) {
    m->e[i].val = GONE; m->size--;
}

/* Room for `extra` more keys at <= 70% load (GONE entries count): rebuilt to ~50% when short. */
static int grow(pdm_map *m, int64_t extra) {
    if ((m->used + extra) * 10 < m->cap * 7) return 0;
    pdm_map old = *m;
    int64_t cap = 16;
    while (cap < (m->size + extra) * 2) cap <<= 1;
    if (alloc_table(m, cap)) { *m = old; return -1; }
    for (int64_t i = 0; i < old.cap; i++)
        if (old.e[i].val >= 0) place(m, old.e[i].key, old.e[i].val);
    free(old.e);
    return 0;
}

/* ---- the Python type ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    pdm_map t;
} MapObject;

static int Map_init(MapObject *self, PyObject *args, PyObject *kw) {
    Py_ssize_t hint = 0;
    static char *names[] = {"hint", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|n", names, &hint)) return -1;
    free(self->t.e);
    int64_t cap = 16;
    while (cap * 7 / 10 < hint) cap <<= 1;
    if (alloc_table(&self->t, cap)) { PyErr_NoMemory(); return -1; }
    return 0;
}

static void Map_dealloc(MapObject *self) {
    free(self->t.e);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int key_of(PyObject *o, uint64_t *key) {
    if (!PyLong_Check(o)) {  /* numpy integers and the like: through __index__ */
        PyObject *i = PyNumber_Index(o);
        if (!i) return -1;
        *key = PyLong_AsUnsignedLongLong(i);
        Py_DECREF(i);
    } else {
        *key = PyLong_AsUnsignedLongLong(o);
    }
    if (*key == (uint64_t)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
        PyErr_SetString(PyExc_OverflowError, "U64Map keys are ints in [0, 2**64)");
        return -1;
    }
    return 0;
}

static Py_ssize_t Map_len(MapObject *self) { return (Py_ssize_t)self->t.size; }

static int Map_contains(MapObject *self, PyObject *o) {
    uint64_t key;
    if (key_of(o, &key)) { PyErr_Clear(); return 0; }  /* not a key this map can hold: absent */
    return find(&self->t, key) >= 0;
}

static PyObject *Map_getitem(MapObject *self, PyObject *o) {
    uint64_t key;
    if (key_of(o, &key)) return NULL;
    int64_t i = find(&self->t, key);
    if (i < 0) { PyErr_SetObject(PyExc_KeyError, o); return NULL; }
    return PyLong_FromLongLong(self->t.e[i].val);
}

static int Map_setitem(MapObject *self, PyObject *o, PyObject *v) {
    uint64_t key;
    if (key_of(o, &key)) return -1;
    if (v == NULL) {  /* del m[key] */
        int64_t i = find(&self->t, key);
        if (i < 0) { PyErr_SetObject(PyExc_KeyError, o); return -1; }
        drop(&self->t, i);
        return 0;
    }
    long long val = PyLong_AsLongLong(v);
    if (val == -1 && PyErr_Occurred()) return -1;
    if (val < 0) { PyErr_SetString(PyExc_ValueError, "U64Map values are >= 0"); return -1; }
    int64_t i = find(&self->t, key);
    if (i >= 0) { self->t.e[i].val = val; return 0; }
    if (grow(&self->t, 1)) { PyErr_NoMemory(); return -1; }
    place(&self->t, key, val);
    return 0;
}

static PyObject *Map_get(MapObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) { PyErr_SetString(PyExc_TypeError, "get(key, default=None)"); return NULL; }
    uint64_t key;
    if (key_of(args[0], &key)) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear();
    } else {
        int64_t i = find(&self->t, key);
        if (i >= 0) return PyLong_FromLongLong(self->t.e[i].val);
    }
    PyObject *d = n == 2 ? args[1] : Py_None;
    Py_INCREF(d);
    return d;
}

static PyObject *Map_pop(MapObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) { PyErr_SetString(PyExc_TypeError, "pop(key[, default])"); return NULL; }
    uint64_t key;
    if (key_of(args[0], &key)) return NULL;
    int64_t i = find(&self->t, key);
    if (i >= 0) {
        int64_t val = self->t.e[i].val;
        drop(&self->t, i);
        return PyLong_FromLongLong(val);
    }
    if (n == 2) { Py_INCREF(args[1]); return args[1]; }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

/* A C-contiguous buffer of n 8-byte items (numpy uint64 / int64 arrays), writable when asked. */
static int buffer_of(PyObject *o, Py_buffer *b, int writable, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)))
        return -1;
    if (b->itemsize != 8 || b->ndim != 1) {
        PyErr_Format(PyExc_TypeError, "%s: a 1-d array of 8-byte items is needed", what);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static Py_ssize_t nitems(Py_buffer *b) { return b->len / 8; }

/* _get_many(keys u64, out i64, missing) -> found */
static PyObject *Map_get_many(MapObject *self, PyObject *args) {
    PyObject *ko, *oo; long long missing;
    if (!PyArg_ParseTuple(args, "OOL", &ko, &oo, &missing)) return NULL;
    Py_buffer kb, ob;
    if (buffer_of(ko, &kb, 0, "keys")) return NULL;
    if (buffer_of(oo, &ob, 1, "out")) { PyBuffer_Release(&kb); return NULL; }
    Py_ssize_t n = nitems(&kb), found = 0;
    const uint64_t *keys = kb.buf; int64_t *out = ob.buf;
    if (nitems(&ob) < n) n = nitems(&ob);
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t i = find(&self->t, keys[j]);
        out[j] = i < 0 ? missing : self->t.e[i].val;
        found += i >= 0;
    }
    PyBuffer_Release(&kb); PyBuffer_Release(&ob);
    return PyLong_FromSsize_t(found);
}

static PyObject *Map_prefix_len(MapObject *self, PyObject *ko) {
    Py_buffer kb;
    if (buffer_of(ko, &kb, 0, "keys")) return NULL;
    Py_ssize_t n = nitems(&kb), j = 0;
    const uint64_t *keys = kb.buf;
    while (j < n && find(&self->t, keys[j]) >= 0) j++;
    PyBuffer_Release(&kb);
    return PyLong_FromSsize_t(j);
}

/* _put(keys u64, vals i64, inserted u8 or None, only_new) -> how many keys were new. only_new: keys
 * present keep their value (the first of repeats wins); else every key is set (later repeats win). */
static PyObject *Map_put(MapObject *self, PyObject *args) {
    PyObject *ko, *vo, *io; int only_new;
    if (!PyArg_ParseTuple(args, "OOOp", &ko, &vo, &io, &only_new)) return NULL;
    Py_buffer kb, vb, ib = {0};
    if (buffer_of(ko, &kb, 0, "keys")) return NULL;
    if (buffer_of(vo, &vb, 0, "values")) { PyBuffer_Release(&kb); return NULL; }
    int have_mask = io != Py_None;
    if (have_mask && PyObject_GetBuffer(io, &ib, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) {
        PyBuffer_Release(&kb); PyBuffer_Release(&vb); return NULL;
    }
    Py_ssize_t n = nitems(&kb), added = 0;
    PyObject *result = NULL;
    if (nitems(&vb) != n || (have_mask && ib.len < n)) {
        PyErr_SetString(PyExc_ValueError, "keys, values and mask differ in length");
        goto done;
    }
    if (grow(&self->t, n)) { PyErr_NoMemory(); goto done; }
    const uint64_t *keys = kb.buf; const int64_t *vals = vb.buf; uint8_t *mask = ib.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t i = find(&self->t, keys[j]);
        if (i < 0) { place(&self->t, keys[j], vals[j]); added++; }
        else if (!only_new) self->t.e[i].val = vals[j];
        if (have_mask) mask[j] = i < 0;
    }
    result = PyLong_FromSsize_t(added);
done:
    PyBuffer_Release(&kb); PyBuffer_Release(&vb);
    if (have_mask) PyBuffer_Release(&ib);
    return result;
}

/* _del_many(keys u64, only_if i64 or None, out i64, missing) -> removed */
static PyObject *Map_del_many(MapObject *self, PyObject *args) {
    PyObject *ko, *co, *oo; long long missing;
    if (!PyArg_ParseTuple(args, "OOOL", &ko, &co, &oo, &missing)) return NULL;
    Py_buffer kb, cb = {0}, ob;
    if (buffer_of(ko, &kb, 0, "keys")) return NULL;
    if (buffer_of(oo, &ob, 1, "out")) { PyBuffer_Release(&kb); return NULL; }
    int have_cond = co != Py_None;
    if (have_cond && buffer_of(co, &cb, 0, "only_if")) {
        PyBuffer_Release(&kb); PyBuffer_Release(&ob); return NULL;
    }
    Py_ssize_t n = nitems(&kb), removed = 0;
    if (nitems(&ob) < n || (have_cond && nitems(&cb) < n)) {
        PyErr_SetString(PyExc_ValueError, "keys, only_if and out differ in length");
        n = -1;
    }
    const uint64_t *keys = kb.buf; const int64_t *cond = cb.buf; int64_t *out = ob.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t i = find(&self->t, keys[j]);
        int hit = i >= 0 && (!have_cond || self->t.e[i].val == cond[j]);
        out[j] = hit ? self->t.e[i].val : missing;
        if (hit) { drop(&self->t, i); removed++; }
    }
    PyBuffer_Release(&kb); PyBuffer_Release(&ob);
    if (have_cond) PyBuffer_Release(&cb);
    return n < 0 ? NULL : PyLong_FromSsize_t(removed);
}

/* _items(keys u64 out, vals i64 out) -> count; both hold at least len(self) items */
static PyObject *Map_items(MapObject *self, PyObject *args) {
    PyObject *ko, *vo;
    if (!PyArg_ParseTuple(args, "OO", &ko, &vo)) return NULL;
    Py_buffer kb, vb;
    if (buffer_of(ko, &kb, 1, "keys")) return NULL;
    if (buffer_of(vo, &vb, 1, "values")) { PyBuffer_Release(&kb); return NULL; }
    Py_ssize_t k = 0;
    if (nitems(&kb) < self->t.size || nitems(&vb) < self->t.size) {
        PyErr_SetString(PyExc_ValueError, "output arrays too short");
        k = -1;
    }
    uint64_t *keys = kb.buf; int64_t *vals = vb.buf;
    for (int64_t i = 0; k >= 0 && i < self->t.cap; i++)
        if (self->t.e[i].val >= 0) { keys[k] = self->t.e[i].key; vals[k] = self->t.e[i].val; k++; }
    PyBuffer_Release(&kb); PyBuffer_Release(&vb);
    return k < 0 ? NULL : PyLong_FromSsize_t(k);
}

static PyObject *Map_clear(MapObject *self, PyObject *unused) {
    for (int64_t i = 0; i < self->t.cap; i++) self->t.e[i].val = EMPTY;
    self->t.size = 0; self->t.used = 0;
    Py_RETURN_NONE;
}

static PyMethodDef Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Map_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))Map_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)Map_clear, METH_NOARGS, "remove every entry"},
    {"_get_many", (PyCFunction)Map_get_many, METH_VARARGS, NULL},
    {"_prefix_len", (PyCFunction)Map_prefix_len, METH_O, NULL},
    {"_put", (PyCFunction)Map_put, METH_VARARGS, NULL},
    {"_del_many", (PyCFunction)Map_del_many, METH_VARARGS, NULL},
    {"_items", (PyCFunction)Map_items, METH_VARARGS, NULL},
    {NULL}
};

static PySequenceMethods Map_as_sequence = {.sq_contains = (objobjproc)Map_contains};
static PyMappingMethods Map_as_mapping = {
    .mp_length = (lenfunc)Map_len, .mp_subscript = (binaryfunc)Map_getitem,
    .mp_ass_subscript = (objobjargproc)Map_setitem,
};

static PyTypeObject MapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_kvcore.Map",
    .tp_basicsize = sizeof(MapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "uint64 -> int64 >= 0 hash map (open addressing)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Map_init,
    .tp_dealloc = (destructor)Map_dealloc,
    .tp_methods = Map_methods,
    .tp_as_sequence = &Map_as_sequence,
    .tp_as_mapping = &Map_as_mapping,
};


/* ---- Order: slots in least-recently-pushed order (a doubly linked list over slot numbers) ------------ */

typedef struct {
    PyObject_HEAD
    int64_t n;     /* slots 0..n-1; index n is the sentinel: nxt[n] = head, prv[n] = tail */
    int64_t *prv, *nxt;
    uint8_t *in;
    int64_t size;
} OrderObject;

static int Order_init(OrderObject *self, PyObject *args, PyObject *kw) {
    Py_ssize_t n;
    static char *names[] = {"num_slots", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n", names, &n)) return -1;
    if (n < 0) { PyErr_SetString(PyExc_ValueError, "num_slots must be >= 0"); return -1; }
    free(self->prv); free(self->nxt); free(self->in);
    self->prv = malloc((n + 1) * sizeof(int64_t));
    self->nxt = malloc((n + 1) * sizeof(int64_t));
    self->in = calloc(n + 1, 1);
    if (!self->prv || !self->nxt || !self->in) { PyErr_NoMemory(); return -1; }
    self->n = n; self->size = 0;
    self->prv[n] = self->nxt[n] = n;
    return 0;
}

static void Order_dealloc(OrderObject *self) {
    free(self->prv); free(self->nxt); free(self->in);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline void unlink_slot(OrderObject *o, int64_t s) {
    o->nxt[o->prv[s]] = o->nxt[s];
    o->prv[o->nxt[s]] = o->prv[s];
    o->in[s] = 0; o->size--;
}

static inline void append_slot(OrderObject *o, int64_t s) {
    if (o->in[s]) unlink_slot(o, s);
    int64_t tail = o->prv[o->n];
    o->prv[s] = tail; o->nxt[s] = o->n;
    o->nxt[tail] = s; o->prv[o->n] = s;
    o->in[s] = 1; o->size++;
}

static int slot_of(OrderObject *o, PyObject *obj, int64_t *s) {
    *s = PyLong_AsLongLong(obj);
    if (*s == -1 && PyErr_Occurred()) return -1;
    if (*s < 0 || *s >= o->n) { PyErr_Format(PyExc_IndexError, "slot %lld out of range", (long long)*s); return -1; }
    return 0;
}

static int slots_of(OrderObject *o, PyObject *obj, Py_buffer *b) {
    if (buffer_of(obj, b, 0, "slots")) return -1;
    const int64_t *v = b->buf;
    for (Py_ssize_t j = 0; j < nitems(b); j++)
        if (v[j] < 0 || v[j] >= o->n) {
            PyErr_Format(PyExc_IndexError, "slot %lld out of range", (long long)v[j]);
            PyBuffer_Release(b);
            return -1;
        }
    return 0;
}

static Py_ssize_t Order_len(OrderObject *self) { return (Py_ssize_t)self->size; }

static int Order_contains(OrderObject *self, PyObject *obj) {
    int64_t s = PyLong_AsLongLong(obj);
    if (s == -1 && PyErr_Occurred()) return -1;
    return s >= 0 && s < self->n && self->in[s];
}

static PyObject *Order_push(OrderObject *self, PyObject *obj) {
    int64_t s;
    if (slot_of(self, obj, &s)) return NULL;
    append_slot(self, s);
    Py_RETURN_NONE;
}

static PyObject *Order_remove(OrderObject *self, PyObject *obj) {
    int64_t s;
    if (slot_of(self, obj, &s)) return NULL;
    if (self->in[s]) unlink_slot(self, s);
    Py_RETURN_NONE;
}

static PyObject *Order_push_many(OrderObject *self, PyObject *obj) {
    Py_buffer b;
    if (slots_of(self, obj, &b)) return NULL;
    const int64_t *v = b.buf;
    for (Py_ssize_t j = 0; j < nitems(&b); j++) append_slot(self, v[j]);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *Order_remove_many(OrderObject *self, PyObject *obj) {
    Py_buffer b;
    if (slots_of(self, obj, &b)) return NULL;
    const int64_t *v = b.buf;
    Py_ssize_t removed = 0;
    for (Py_ssize_t j = 0; j < nitems(&b); j++)
        if (self->in[v[j]]) { unlink_slot(self, v[j]); removed++; }
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(removed);
}

/* _peek(after, out) -> k: the k (<= len(out)) slots that follow `after` (-1: from the head), in order. */
static PyObject *Order_peek(OrderObject *self, PyObject *args) {
    long long after; PyObject *oo;
    if (!PyArg_ParseTuple(args, "LO", &after, &oo)) return NULL;
    if (after < -1 || after >= self->n || (after >= 0 && !self->in[after])) {
        PyErr_Format(PyExc_ValueError, "slot %lld is not in the order", after);
        return NULL;
    }
    Py_buffer ob;
    if (buffer_of(oo, &ob, 1, "out")) return NULL;
    int64_t *out = ob.buf, s = self->nxt[after < 0 ? self->n : after];
    Py_ssize_t k = 0, cap = nitems(&ob);
    while (k < cap && s != self->n) { out[k++] = s; s = self->nxt[s]; }
    PyBuffer_Release(&ob);
    return PyLong_FromSsize_t(k);
}

/* _pop_first(out) -> k: remove the first k (<= len(out)) slots into out. */
static PyObject *Order_pop_first(OrderObject *self, PyObject *oo) {
    Py_buffer ob;
    if (buffer_of(oo, &ob, 1, "out")) return NULL;
    int64_t *out = ob.buf;
    Py_ssize_t k = 0, cap = nitems(&ob);
    while (k < cap && self->size) {
        int64_t s = self->nxt[self->n];
        unlink_slot(self, s);
        out[k++] = s;
    }
    PyBuffer_Release(&ob);
    return PyLong_FromSsize_t(k);
}

static PyObject *Order_clear(OrderObject *self, PyObject *unused) {
    memset(self->in, 0, self->n + 1);
    self->prv[self->n] = self->nxt[self->n] = self->n;
    self->size = 0;
    Py_RETURN_NONE;
}

static PyMethodDef Order_methods[] = {
    {"push", (PyCFunction)Order_push, METH_O, "push(slot): it becomes the most recent"},
    {"remove", (PyCFunction)Order_remove, METH_O, "remove(slot) (absent: nothing)"},
    {"clear", (PyCFunction)Order_clear, METH_NOARGS, "remove every slot"},
    {"_push_many", (PyCFunction)Order_push_many, METH_O, NULL},
    {"_remove_many", (PyCFunction)Order_remove_many, METH_O, NULL},
    {"_peek", (PyCFunction)Order_peek, METH_VARARGS, NULL},
    {"_pop_first", (PyCFunction)Order_pop_first, METH_O, NULL},
    {NULL}
};

static PySequenceMethods Order_as_sequence = {.sq_length = (lenfunc)Order_len,
                                              .sq_contains = (objobjproc)Order_contains};

static PyTypeObject OrderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_kvcore.Order",
    .tp_basicsize = sizeof(OrderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "slots 0..n-1 in least-recently-pushed order",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Order_init,
    .tp_dealloc = (destructor)Order_dealloc,
    .tp_methods = Order_methods,
    .tp_as_sequence = &Order_as_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvcore", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__kvcore(void) {
    if (PyType_Ready(&MapType) < 0 || PyType_Ready(&OrderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&MapType);
    Py_INCREF(&OrderType);
    if (PyModule_AddObject(m, "Map", (PyObject *)&MapType) < 0
        || PyModule_AddObject(m, "Order", (PyObject *)&OrderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
