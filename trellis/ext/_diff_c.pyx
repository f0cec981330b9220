# cython: language_level=3
"""Compiled twin of ``ext._diff_py``: the keys two versions of a map differ in.

One pass over `before` with a lookup in `after` per key (str keys cache their hashes), an
equality test only for entries that are not the very same object, and a pass over `after` only
when it holds keys `before` lacks. Must agree exactly with the reference.
"""

from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.object cimport Py_NE, PyObject, PyObject_RichCompareBool


def changed_keys(dict before not None, dict after not None):
    """The keys added, dropped, or whose entry in `after` is another object and not equal."""
    cdef set changed = set()
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t kept = 0
    cdef PyObject *key
    cdef PyObject *entry
    cdef PyObject *other
    if before is after:
        return changed
    while PyDict_Next(before, &pos, &key, &entry):
        other = PyDict_GetItem(after, <object>key)
        if other is NULL:
            changed.add(<object>key)
            continue
        kept += 1
        if other is not entry and PyObject_RichCompareBool(<object>entry, <object>other, Py_NE):
            changed.add(<object>key)
    if kept != len(after):
        pos = 0
        while PyDict_Next(after, &pos, &key, &entry):
            if PyDict_GetItem(before, <object>key) is NULL:
                changed.add(<object>key)
    return changed
