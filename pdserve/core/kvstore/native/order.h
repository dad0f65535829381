/* `Order`: slots 0..n-1 in least-recently-pushed order, as a Python type. Included once, by kvcore.c after
 * u64map.h (it uses its buffer helpers). */
/* ---- Order: slots in least-recently-pushed order (a doubly linked list over slot numbers) ------------ */

typedef struct {
    PyObject_HEAD
    int64_t n;     /* slots 0..n-1; index n is the sentinel: nxt[n] = head, prv[n] = tail */
    int64_t *prv, *nxt;
    uint8_t *in;
    int64_t size;
} OrderObject;

/* Arrays for n slots (and the sentinel); the old ones are freed only once the new ones are had. */
static int order_alloc(OrderObject *o, int64_t n) {
    int64_t *prv = malloc((n + 1) * sizeof(int64_t)), *nxt = malloc((n + 1) * sizeof(int64_t));
    uint8_t *in = calloc(n + 1, 1);
    if (!prv || !nxt || !in) { free(prv); free(nxt); free(in); PyErr_NoMemory(); return -1; }
    free(o->prv); free(o->nxt); free(o->in);
    o->prv = prv; o->nxt = nxt; o->in = in;
    o->n = n; o->size = 0;
    prv[n] = nxt[n] = n;
    return 0;
}

static PyObject *Order_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    OrderObject *self = (OrderObject *)type->tp_alloc(type, 0);
    if (self && order_alloc(self, 0)) { Py_DECREF(self); return NULL; }
    return (PyObject *)self;
}

static int Order_init(OrderObject *self, PyObject *args, PyObject *kw) {
    Py_ssize_t n;
    static char *names[] = {"num_slots", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n", names, &n)) return -1;
    if (n < 0) { PyErr_SetString(PyExc_ValueError, "num_slots must be >= 0"); return -1; }
    return order_alloc(self, n);
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

/* A C-contiguous 1-d buffer (writable when asked) of at least `n` items of `itemsize` bytes, format one of
 * `formats`. */
static int column_of(PyObject *o, Py_buffer *b, Py_ssize_t itemsize, const char *formats, int64_t n,
                     const char *what, int writable) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0))) return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != itemsize || b->ndim != 1 || !f[0] || f[1] || !strchr(formats, f[0]) || b->len / itemsize < n) {
        PyErr_Format(PyExc_TypeError, "%s: a 1-d array of %zd-byte items covering every slot is needed", what,
                     itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* _peek_evictable(after, out, ready, busy, pinned_until, reclaiming bool, now) -> k: the first k (<= len(out))
 * slots after `after` (-1: from the head) that are evictable (as below) and not reclaiming, in order; the
 * order is left as it is (a tier's watermark marking). */
static PyObject *Order_peek_evictable(OrderObject *self, PyObject *args) {
    long long after; PyObject *oo, *ro, *bo, *po, *co; double now;
    if (!PyArg_ParseTuple(args, "LOOOOOd", &after, &oo, &ro, &bo, &po, &co, &now)) return NULL;
    if (after < -1 || after >= self->n || (after >= 0 && !self->in[after])) {
        PyErr_Format(PyExc_ValueError, "slot %lld is not in the order", after);
        return NULL;
    }
    Py_buffer ob, rb, bb, pb, cb;
    if (buffer_of(oo, &ob, 1, "out")) return NULL;
    if (column_of(ro, &rb, 1, "?", self->n, "ready", 0)) { PyBuffer_Release(&ob); return NULL; }
    if (column_of(bo, &bb, 4, "il", self->n, "busy", 0)) { PyBuffer_Release(&ob); PyBuffer_Release(&rb); return NULL; }
    if (column_of(po, &pb, 8, "d", self->n, "pinned_until", 0)) {
        PyBuffer_Release(&ob); PyBuffer_Release(&rb); PyBuffer_Release(&bb); return NULL;
    }
    if (column_of(co, &cb, 1, "?", self->n, "reclaiming", 0)) {
        PyBuffer_Release(&ob); PyBuffer_Release(&rb); PyBuffer_Release(&bb); PyBuffer_Release(&pb); return NULL;
    }
    const uint8_t *ready = rb.buf, *marked = cb.buf; const int32_t *busy = bb.buf; const double *pinned = pb.buf;
    int64_t *out = ob.buf, s = self->nxt[after < 0 ? self->n : after];
    Py_ssize_t k = 0, cap = nitems(&ob);
    for (; k < cap && s != self->n; s = self->nxt[s])
        if (ready[s] && busy[s] == 0 && pinned[s] <= now && !marked[s]) out[k++] = s;
    PyBuffer_Release(&ob); PyBuffer_Release(&rb); PyBuffer_Release(&bb); PyBuffer_Release(&pb);
    PyBuffer_Release(&cb);
    return PyLong_FromSsize_t(k);
}

/* _pop_evictable(out, ready bool, busy int32, pinned_until float64, now) -> k: remove the first k
 * (<= len(out)) slots that are ready, not busy and not pinned past `now` into out; the others keep their
 * places (`MetaColumns.evictable` in one walk). */
static PyObject *Order_pop_evictable(OrderObject *self, PyObject *args) {
    PyObject *oo, *ro, *bo, *po; double now;
    if (!PyArg_ParseTuple(args, "OOOOd", &oo, &ro, &bo, &po, &now)) return NULL;
    Py_buffer ob, rb, bb, pb;
    if (buffer_of(oo, &ob, 1, "out")) return NULL;
    if (column_of(ro, &rb, 1, "?", self->n, "ready", 0)) { PyBuffer_Release(&ob); return NULL; }
    if (column_of(bo, &bb, 4, "il", self->n, "busy", 0)) { PyBuffer_Release(&ob); PyBuffer_Release(&rb); return NULL; }
    if (column_of(po, &pb, 8, "d", self->n, "pinned_until", 0)) {
        PyBuffer_Release(&ob); PyBuffer_Release(&rb); PyBuffer_Release(&bb); return NULL;
    }
    const uint8_t *ready = rb.buf; const int32_t *busy = bb.buf; const double *pinned = pb.buf;
    int64_t *out = ob.buf, s = self->nxt[self->n];
    Py_ssize_t k = 0, cap = nitems(&ob);
    while (k < cap && s != self->n) {
        int64_t next = self->nxt[s];
        if (ready[s] && busy[s] == 0 && pinned[s] <= now) {
            unlink_slot(self, s);
            out[k++] = s;
        }
        s = next;
    }
    PyBuffer_Release(&ob); PyBuffer_Release(&rb); PyBuffer_Release(&bb); PyBuffer_Release(&pb);
    return PyLong_FromSsize_t(k);
}

/* The (ref int32 covering every slot, writable; ids int64 in range) arguments of the two calls below. */
static int refs_and_ids(OrderObject *self, PyObject *args, Py_buffer *rb, Py_buffer *ib) {
    PyObject *ro, *io;
    if (!PyArg_ParseTuple(args, "OO", &ro, &io)) return -1;
    if (column_of(ro, rb, 4, "il", self->n, "ref", 1)) return -1;
    if (slots_of(self, io, ib)) { PyBuffer_Release(rb); return -1; }
    return 0;
}

/* _take_refs(ref int32, ids int64): one more reference to each block (distinct ids); a block that had none
 * leaves this order (the free queue). */
static PyObject *Order_take_refs(OrderObject *self, PyObject *args) {
    Py_buffer rb, ib;
    if (refs_and_ids(self, args, &rb, &ib)) return NULL;
    int32_t *ref = rb.buf; const int64_t *ids = ib.buf;
    for (Py_ssize_t j = 0; j < nitems(&ib); j++) {
        if (ref[ids[j]] == 0 && self->in[ids[j]]) unlink_slot(self, ids[j]);
        ref[ids[j]]++;
    }
    PyBuffer_Release(&rb); PyBuffer_Release(&ib);
    Py_RETURN_NONE;
}

/* _release_refs(ref int32, ids int64) -> freed: one reference less on each block (an id may repeat: a
 * holder that held a block twice); those left with none join this order, in the order of their first
 * appearance. A count that goes negative raises (the counts stay decremented; nothing joins the order). */
static PyObject *Order_release_refs(OrderObject *self, PyObject *args) {
    Py_buffer rb, ib;
    if (refs_and_ids(self, args, &rb, &ib)) return NULL;
    int32_t *ref = rb.buf; const int64_t *ids = ib.buf;
    Py_ssize_t n = nitems(&ib), freed = 0;
    int64_t negative = -1;
    for (Py_ssize_t j = 0; j < n; j++)
        if (--ref[ids[j]] < 0 && negative < 0) negative = ids[j];
    if (negative < 0)
        for (Py_ssize_t j = 0; j < n; j++)
            if (ref[ids[j]] == 0 && !self->in[ids[j]]) { append_slot(self, ids[j]); freed++; }
    PyBuffer_Release(&rb); PyBuffer_Release(&ib);
    if (negative >= 0) {
        PyErr_Format(PyExc_AssertionError, "block %lld ref count went negative", (long long)negative);
        return NULL;
    }
    return PyLong_FromSsize_t(freed);
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
    {"_pop_evictable", (PyCFunction)Order_pop_evictable, METH_VARARGS, NULL},
    {"_peek_evictable", (PyCFunction)Order_peek_evictable, METH_VARARGS, NULL},
    {"_take_refs", (PyCFunction)Order_take_refs, METH_VARARGS, NULL},
    {"_release_refs", (PyCFunction)Order_release_refs, METH_VARARGS, NULL},
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
    .tp_new = Order_new,
    .tp_init = (initproc)Order_init,
    .tp_dealloc = (destructor)Order_dealloc,
    .tp_methods = Order_methods,
    .tp_as_sequence = &Order_as_sequence,
};
