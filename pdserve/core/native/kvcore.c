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
 * hash_chain: a prompt's chained block hashes in one call (hash_chain.h); pdserve/core/block_hash.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "u64map.h"
#include "order.h"
#include "hash_chain.h"

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
