/* Row copies between metadata columns (`MetaColumns`: numpy arrays indexed by slot). Included once, by
 * kvcore.c after u64map.h (it uses its buffer helpers).
 *
 * copy_rows(dst_columns, src_columns, dst_slots, src_slots): for each pair of columns (equal item sizes),
 * dst[dst_slots[j]] = src[src_slots[j]]: a run of blocks copied to the tier below in one call instead of a
 * numpy gather and scatter (and a temporary) per column.
 * fill_rows(columns, values, slots): column[slots[j]] = its value, for each column. */

typedef struct {
    Py_buffer b;
    char kind;  /* 'b' bool/int8, 'i' signed, 'u' unsigned, 'f' float */
} column;

static void release_columns(column *c, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&c[i].b);
    PyMem_Free(c);
}

/* Writable or not, C-contiguous 1-d numeric buffers of the objects of a tuple. */
static column *columns_of(PyObject *tuple, int writable, Py_ssize_t *n) {
    if (!PyTuple_Check(tuple)) { PyErr_SetString(PyExc_TypeError, "columns must be a tuple of arrays"); return NULL; }
    *n = PyTuple_GET_SIZE(tuple);
    column *c = PyMem_Calloc(*n ? *n : 1, sizeof(column));
    if (!c) { PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < *n; i++) {
        Py_buffer *b = &c[i].b;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(tuple, i), b,
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0))) {
            release_columns(c, i);
            return NULL;
        }
        const char *f = b->format ? b->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        char k = strchr("?", *f) ? 'b' : strchr("bhilq", *f) ? 'i' : strchr("BHILQ", *f) ? 'u'
                 : strchr("fd", *f) ? 'f' : 0;
        Py_ssize_t size = b->itemsize;
        if (b->ndim != 1 || !k || f[1] || (size != 1 && size != 2 && size != 4 && size != 8)) {
            PyErr_SetString(PyExc_TypeError, "columns must be 1-d numeric arrays");
            release_columns(c, i + 1);
            return NULL;
        }
        c[i].kind = k;
    }
    return c;
}

/* Every slot in range of every column. */
static int slots_in(const int64_t *slots, Py_ssize_t k, const column *c, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = c[i].b.len / c[i].b.itemsize;
        for (Py_ssize_t j = 0; j < k; j++)
            if (slots[j] < 0 || slots[j] >= len) {
                PyErr_Format(PyExc_IndexError, "slot %lld out of range", (long long)slots[j]);
                return -1;
            }
    }
    return 0;
}

static PyObject *copy_rows(PyObject *m, PyObject *args) {
    PyObject *dto, *sto, *dso, *sso;
    if (!PyArg_ParseTuple(args, "OOOO", &dto, &sto, &dso, &sso)) return NULL;
    Py_ssize_t nd, ns;
    column *dst = columns_of(dto, 1, &nd);
    if (!dst) return NULL;
    column *src = columns_of(sto, 0, &ns);
    if (!src) { release_columns(dst, nd); return NULL; }
    Py_buffer db, sb;
    PyObject *result = NULL;
    if (buffer_of(dso, &db, 0, "dst_slots")) goto out;
    if (buffer_of(sso, &sb, 0, "src_slots")) { PyBuffer_Release(&db); goto out; }
    Py_ssize_t k = nitems(&db);
    const int64_t *ds = db.buf, *ss = sb.buf;
    if (nd != ns || nitems(&sb) != k) {
        PyErr_SetString(PyExc_ValueError, "columns and slots differ in number");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nd; i++)
        if (dst[i].b.itemsize != src[i].b.itemsize || dst[i].kind != src[i].kind) {
            PyErr_SetString(PyExc_TypeError, "copy_rows: a column pair differs in type");
            goto done;
        }
    if (slots_in(ds, k, dst, nd) || slots_in(ss, k, src, ns)) goto done;
    for (Py_ssize_t i = 0; i < nd; i++) {
        char *d = dst[i].b.buf; const char *s = src[i].b.buf;
        switch (dst[i].b.itemsize) {
        case 1: for (Py_ssize_t j = 0; j < k; j++) ((uint8_t *)d)[ds[j]] = ((const uint8_t *)s)[ss[j]]; break;
        case 2: for (Py_ssize_t j = 0; j < k; j++) ((uint16_t *)d)[ds[j]] = ((const uint16_t *)s)[ss[j]]; break;
        case 4: for (Py_ssize_t j = 0; j < k; j++) ((uint32_t *)d)[ds[j]] = ((const uint32_t *)s)[ss[j]]; break;
        default: for (Py_ssize_t j = 0; j < k; j++) ((uint64_t *)d)[ds[j]] = ((const uint64_t *)s)[ss[j]]; break;
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&db); PyBuffer_Release(&sb);
out:
    release_columns(dst, nd); release_columns(src, ns);
    return result;
}

/* The bytes of `value` as an item of column `c` (a bool, an int or a float, as numpy would cast it). */
static int item_of(PyObject *value, const column *c, uint64_t *bits) {
    Py_ssize_t size = c->b.itemsize;
    if (c->kind == 'f') {
        double v = PyFloat_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred()) return -1;
        if (size == 8) memcpy(bits, &v, 8);
        else { float f = (float)v; *bits = 0; memcpy(bits, &f, 4); }
        return 0;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (c->kind == 'b') v = v != 0;
    *bits = (uint64_t)v;  /* little-endian: the low `size` bytes are the item */
    return 0;
}

static PyObject *fill_rows(PyObject *m, PyObject *args) {
    PyObject *co, *vo, *so;
    if (!PyArg_ParseTuple(args, "OOO", &co, &vo, &so)) return NULL;
    if (!PyTuple_Check(vo)) { PyErr_SetString(PyExc_TypeError, "values must be a tuple"); return NULL; }
    Py_ssize_t n;
    column *c = columns_of(co, 1, &n);
    if (!c) return NULL;
    Py_buffer sb;
    PyObject *result = NULL;
    if (buffer_of(so, &sb, 0, "slots")) goto out;
    Py_ssize_t k = nitems(&sb);
    const int64_t *slots = sb.buf;
    if (PyTuple_GET_SIZE(vo) != n) { PyErr_SetString(PyExc_ValueError, "one value per column"); goto done; }
    if (slots_in(slots, k, c, n)) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t bits;
        if (item_of(PyTuple_GET_ITEM(vo, i), &c[i], &bits)) goto done;
        char *d = c[i].b.buf;
        switch (c[i].b.itemsize) {
        case 1: for (Py_ssize_t j = 0; j < k; j++) ((uint8_t *)d)[slots[j]] = (uint8_t)bits; break;
        case 2: for (Py_ssize_t j = 0; j < k; j++) ((uint16_t *)d)[slots[j]] = (uint16_t)bits; break;
        case 4: for (Py_ssize_t j = 0; j < k; j++) ((uint32_t *)d)[slots[j]] = (uint32_t)bits; break;
        default: for (Py_ssize_t j = 0; j < k; j++) ((uint64_t *)d)[slots[j]] = bits; break;
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sb);
out:
    release_columns(c, n);
    return result;
}
