/* `Map`: a hash map from uint64 keys (block hashes) to int64 values >= 0 (block ids, slots), as a Python type.
 * Included once, by kvcore.c (one translation unit: everything here is static). */
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

/* Every Map has a table from its allocation on (a subclass that skips __init__ is still usable). */
static PyObject *Map_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    MapObject *self = (MapObject *)type->tp_alloc(type, 0);
    if (self && alloc_table(&self->t, 16)) { Py_DECREF(self); return PyErr_NoMemory(); }
    return (PyObject *)self;
}

static int Map_init(MapObject *self, PyObject *args, PyObject *kw) {
    Py_ssize_t hint = 0;
    static char *names[] = {"hint", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|n", names, &hint)) return -1;
    int64_t cap = 16;
    while (cap * 7 / 10 < hint) cap <<= 1;
    pdm_map fresh;
    if (alloc_table(&fresh, cap)) { PyErr_NoMemory(); return -1; }
    free(self->t.e);  /* (the new table first: a failed allocation leaves the old one) */
    self->t = fresh;
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

/* After key_of failed: 1 (error cleared) when the object is just not a key this map can hold (absent). */
static int not_a_key(void) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_OverflowError)) return 0;
    PyErr_Clear();
    return 1;
}

static int Map_contains(MapObject *self, PyObject *o) {
    uint64_t key;
    if (key_of(o, &key)) return not_a_key() ? 0 : -1;
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
        if (!not_a_key()) return NULL;
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
    if (key_of(args[0], &key)) {
        if (n < 2 || !not_a_key()) return NULL;
        Py_INCREF(args[1]);
        return args[1];
    }
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
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != 8 || b->ndim != 1 || !f[0] || f[1] || !strchr("qQlL", f[0])) {
        PyErr_Format(PyExc_TypeError, "%s: a 1-d array of 64-bit integers is needed", what);
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
    const uint64_t *keys = kb.buf; const int64_t *vals = vb.buf; uint8_t *mask = ib.buf;
    for (Py_ssize_t j = 0; j < n; j++)
        if (vals[j] < 0) { PyErr_SetString(PyExc_ValueError, "U64Map values are >= 0"); goto done; }
    if (grow(&self->t, n)) { PyErr_NoMemory(); goto done; }
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
    .tp_new = Map_new,
    .tp_init = (initproc)Map_init,
    .tp_dealloc = (destructor)Map_dealloc,
    .tp_methods = Map_methods,
    .tp_as_sequence = &Map_as_sequence,
    .tp_as_mapping = &Map_as_mapping,
};
