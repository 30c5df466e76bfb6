// Reading the attributes of many Python objects quickly: the op half of the P2POp reader
// (p2p_door.cpp), plain CPython API, no PyTorch (so that it builds and is checked against
// every CPython whose layout it knows).
//
// Why: the reader visits every op of a list of tens of thousands, in whatever order the
// caller shuffled them into, so each op, its attribute values, its tensor object, ... is a
// cache miss, and each waits for the one before it (0.6-0.8 µs per op measured, where the
// same reads from cache take 0.05-0.15 µs). The ops are independent of each other, so the reader
// fetches the memory of the ops ahead of the one it reads, one link of the chain per stage;
// this header knows where the links are.
//
// Every value the reader uses comes from ordinary reads: CPython's generic attribute
// lookup, or a __slots__ member read at its offset exactly as that lookup would read it.
// What the stages below compute are prefetch addresses, which are hints: a stale or wrong
// one costs a wasted fetch, never a fault. The reads they make to find them stay inside the
// object, within the layout this CPython documents in its internal headers (pycore_object.h,
// pycore_dict.h; 3.11 to 3.13), and are skipped on any other version.
#pragma once

#include <Python.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>

namespace p2p_ops {

[[gnu::always_inline]] inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// The cache lines of [p, p + n), n at most 64.
[[gnu::always_inline]] inline void prefetch_span(const void* p, size_t n) {
  prefetch(p);
  if ((reinterpret_cast<uintptr_t>(p) & 63) + n > 64) {
    prefetch(static_cast<const char*>(p) + n - 1);
  }
}

// The attributes read, by index.
enum Name { kOp, kPeer, kTensor, kGroupPeer, kGroup, kNames };

inline PyObject* name_object(int k) {
  static PyObject* names[kNames] = {
      PyUnicode_InternFromString("op"), PyUnicode_InternFromString("peer"),
      PyUnicode_InternFromString("tensor"), PyUnicode_InternFromString("group_peer"),
      PyUnicode_InternFromString("group")};
  return names[k];
}

#if !defined(Py_GIL_DISABLED) && PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
#define P2P_OPS_KNOWN_LAYOUT 1
#endif

// How one type's attributes are found: found again whenever the type changes (its version
// tag, which CPython clears when a class attribute is set or deleted).
struct Layout {
  PyTypeObject* type = nullptr;
  unsigned int version = 0;
  // > 0: the attribute is a __slots__ member (an object member, no audit hook) at this
  // offset. A member is a data descriptor, so CPython's generic lookup reads it there
  // whatever the instance's __dict__ holds.
  Py_ssize_t offset[kNames] = {};
  bool required[kNames] = {};  // an empty slot is an AttributeError (else None)
  bool managed = false;        // the other attributes live in a managed __dict__'s values

  Layout() = default;
  explicit Layout(PyTypeObject* t) : type(t) {
#ifdef P2P_OPS_KNOWN_LAYOUT
    version = t->tp_version_tag;
    managed = PyType_HasFeature(t, Py_TPFLAGS_MANAGED_DICT);
    if (t->tp_getattro != PyObject_GenericGetAttr) return;
    PyObject* descrs[kNames];
    for (int k = 0; k < kNames; ++k) {
      descrs[k] = _PyType_Lookup(t, name_object(k));  // borrowed; sets no error
    }
    // The lookups gave the type a version tag (0: none), unless it cannot have one: then
    // every attribute goes through PyObject_GetAttr.
    version = t->tp_version_tag;
    if (version == 0) return;
    for (int k = 0; k < kNames; ++k) {
      PyObject* descr = descrs[k];
      if (descr == nullptr || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) continue;
      const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
      if ((member->type != T_OBJECT_EX && member->type != T_OBJECT) ||
          (member->flags & ~READONLY) != 0 || member->offset <= 0) {
        continue;
      }
      offset[k] = member->offset;
      required[k] = member->type == T_OBJECT_EX;
    }
#else
    (void)t;  // every attribute through PyObject_GetAttr, no values fetched
#endif
  }

  bool fits(const PyTypeObject* t) const { return t == type && t->tp_version_tag == version; }

  // The attribute as CPython's getattr returns it: a new reference, or null without an
  // error set where the object has none (any error met is cleared: the reader only asks
  // whether the attribute is there).
  PyObject* get(PyObject* obj, int k) const {
    if (offset[k] > 0) {
      PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset[k]);
      if (v == nullptr && !required[k]) v = Py_None;
      Py_XINCREF(v);
      return v;
    }
    PyObject* v = PyObject_GetAttr(obj, name_object(k));
    if (v == nullptr) PyErr_Clear();
    return v;
  }

  // Stage 1 (the op's own lines are in): the lines that hold its attribute values. A slot
  // holds the tensor itself: that object is fetched at once.
  [[gnu::always_inline]] void fetch_values(PyObject* obj) const {
    if (offset[kTensor] > 0) {
      const PyObject* t =
          *reinterpret_cast<PyObject* const*>(reinterpret_cast<const char*>(obj) + offset[kTensor]);
      if (t != nullptr) prefetch_span(t, 24);
    }
    if (const char* values = values_of(obj)) {
      prefetch_span(values - 8, 56);  // 3.11 and 3.12 count their entries just before them
    }
  }

  // Stage 2 (the values are in): the objects they point to (the op's tensor among them; the
  // rest, its function, ranks and group, are shared by every op and already cached).
  [[gnu::always_inline]] void fetch_targets(PyObject* obj) const {
    PyObject* targets[8];
    const int n = value_targets(obj, targets, 8);
    for (int k = 0; k < n; ++k) prefetch_span(targets[k], 24);
  }

  // Up to `most` of the values set in the instance's managed __dict__ (none where there
  // is no such values array, or on a CPython whose layout is not known here).
  [[gnu::always_inline]] int value_targets(PyObject* obj, PyObject** out, int most) const {
    const char* values = values_of(obj);
    if (values == nullptr) return 0;
    PyObject* const* slots = reinterpret_cast<PyObject* const*>(values);
    int found = 0;
#if PY_VERSION_HEX < 0x030D0000
    // 3.11, 3.12: byte -2 counts the entries set, bytes -3, -4, ... hold their indices in
    // insertion order (_PyDictValues_AddToInsertionOrder).
    const uint8_t* size = reinterpret_cast<const uint8_t*>(values) - 2;
    for (int q = 1; q <= *size && found < most; ++q) {
      if (PyObject* v = slots[size[-q]]) out[found++] = v;
    }
#else
    // 3.13: a header of capacity, size, embedded, valid bytes, then `capacity` slots.
    const uint8_t capacity = *reinterpret_cast<const uint8_t*>(values - 8);
    for (int q = 0; q < capacity && found < most; ++q) {
      if (PyObject* v = slots[q]) out[found++] = v;
    }
#endif
    return found;
  }

 private:
  // The first value slot of a managed __dict__'s values array, or null.
  [[gnu::always_inline]] const char* values_of(PyObject* obj) const {
    if (!managed) return nullptr;
#if defined(P2P_OPS_KNOWN_LAYOUT) && PY_VERSION_HEX < 0x030C0000
    // 3.11: the values pointer is the fourth word before the object (null once the
    // instance's dict exists as an object).
    return static_cast<const char*>(reinterpret_cast<void* const*>(obj)[-4]);
#elif defined(P2P_OPS_KNOWN_LAYOUT) && PY_VERSION_HEX < 0x030D0000
    // 3.12: the third word before the object, the values' address minus one (odd), or
    // a dict.
    const uintptr_t tagged = reinterpret_cast<const uintptr_t*>(obj)[-3];
    return (tagged & 1) ? reinterpret_cast<const char*>(tagged + 1) : nullptr;
#elif defined(P2P_OPS_KNOWN_LAYOUT)
    // 3.13: inline, right after the object header (8 bytes of counts, then the slots).
    if (!PyType_HasFeature(Py_TYPE(obj), Py_TPFLAGS_INLINE_VALUES)) return nullptr;
    return reinterpret_cast<const char*>(obj) + sizeof(PyObject) + 8;
#else
    (void)obj;
    return nullptr;
#endif
  }
};

// Stage 0, before the op's type is known: the words before its GC header that lead to a
// managed __dict__'s values (3.11, 3.12), its header, and what follows it (slots, or 3.13's
// inline values).
[[gnu::always_inline]] inline void fetch_op(const PyObject* op) {
  const char* p = reinterpret_cast<const char*>(op);
  prefetch(p - 32);
  prefetch(p + 8);
  prefetch(p + 63);
}

}  // namespace p2p_ops
