/* Chained block hashes in one call: hash_chain(data, stride, seed, out) sets out[k] to xxh3-64 of the k-th
 * `stride` bytes of `data`, seeded with out[k-1] (out[-1] = seed): `pdserve.core.block_hash.hash_blocks`
 * without a Python step per block. The xxh3 used is the xxhash package's own (`XXH3_64bits_withSeed`, which
 * its extension module exports), its address handed over once by `set_xxh3`: the very function
 * `xxhash.xxh3_64_intdigest` calls, so the hashes are equal by construction.
 * Included once, by kvcore.c. */
typedef uint64_t (*xxh3_seeded_fn)(const void *, size_t, uint64_t);
static xxh3_seeded_fn xxh3_seeded = NULL;

static PyObject *set_xxh3(PyObject *module, PyObject *addr) {
    void *p = PyLong_AsVoidPtr(addr);
    if (!p) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null function address");
        return NULL;
    }
    xxh3_seeded = (xxh3_seeded_fn)p;
    Py_RETURN_NONE;
}

static PyObject *hash_chain(PyObject *module, PyObject *args) {
    PyObject *data_o, *out_o; Py_ssize_t stride; unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnKO", &data_o, &stride, &seed, &out_o)) return NULL;
    if (!xxh3_seeded) { PyErr_SetString(PyExc_RuntimeError, "set_xxh3 was not called"); return NULL; }
    if (stride <= 0) { PyErr_SetString(PyExc_ValueError, "stride must be positive"); return NULL; }
    Py_buffer db, ob;
    if (PyObject_GetBuffer(data_o, &db, PyBUF_C_CONTIGUOUS)) return NULL;
    if (buffer_of(out_o, &ob, 1, "out")) { PyBuffer_Release(&db); return NULL; }
    Py_ssize_t n = db.len / stride;
    PyObject *result = NULL;
    if (nitems(&ob) < n) {
        PyErr_SetString(PyExc_ValueError, "out is shorter than the number of blocks");
    } else {
        const char *d = db.buf; uint64_t *out = ob.buf, h = seed;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n; k++) out[k] = h = xxh3_seeded(d + k * stride, (size_t)stride, h);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(n);
    }
    PyBuffer_Release(&db); PyBuffer_Release(&ob);
    return result;
}
