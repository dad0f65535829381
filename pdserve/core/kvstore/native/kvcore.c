/* The compiled part of the KV bookkeeping: `Map`, a hash map from uint64 keys (block hashes) to int64 values
 * >= 0 (block ids, slots), and `Order`, slots in least-recently-pushed order (the free queue, tier LRUs).
 *
 * Map:
 * Open addressing with linear probing and tombstones; the table doubles at 70% load (tombstones count,
 * so a churning map rebuilds itself clean). Keys go through a 64-bit finalizer first: block hashes are
 * already uniform, small integer keys (tests, slots) are not. A CPython extension type (`Map`): single keys
 * cost what a dict's do, and bulk calls take buffers (numpy arrays) so a request's hundreds of blocks cost
 * one call, not one Python operation each. pdserve/core/kvstore/u64map.py wraps it and holds its contract.
 * Order: a doubly linked list over slot numbers, O(1) push / move / remove; pdserve/core/kvstore/lru_queue.py.
 * hash_chain: a prompt's chained block hashes in one call (hash_chain.h); pdserve/core/kvstore/block_hash.py.
 * copy_rows / fill_rows: metadata rows copied or set across columns in one call (columns.h); kv_columns.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "u64map.h"
#include "order.h"
#include "hash_chain.h"
#include "columns.h"

static PyMethodDef module_methods[] = {
    {"set_xxh3", (PyCFunction)set_xxh3, METH_O, "set_xxh3(address of XXH3_64bits_withSeed)"},
    {"hash_chain", (PyCFunction)hash_chain, METH_VARARGS, "hash_chain(data, stride, seed, out u64) -> blocks"},
    {"copy_rows", (PyCFunction)copy_rows, METH_VARARGS, "copy_rows(dst columns, src columns, dst slots, src slots)"},
    {"fill_rows", (PyCFunction)fill_rows, METH_VARARGS, "fill_rows(columns, values, slots)"},
    {NULL}
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvcore", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__kvcore(void) {
    if (PyType_Ready(&MapType) < 0 || PyType_Ready(&OrderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &MapType) < 0 || PyModule_AddType(m, &OrderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
