// Reading the attributes of many Python objects quickly: the op half of the P2POp reader
// (p2p_door.cpp), plain CPython API, no PyTorch (so that it builds and is checked against
// every CPython whose layout it knows: benches/gpu/p2p/ops_layout_check.py).
//
// Why: the reader visits every op of a list of tens of thousands, in whatever order the
// caller shuffled them into, so each op, its attribute values, its tensor object, ... is a
// cache miss, and each waits for the one before it (0.6-0.8 µs per op measured, where the
// same reads from cache take 0.05-0.15 µs). The ops are independent of each other, so the
// reader fetches the memory of the ops ahead of the one it reads, one link of the chain
// per stage; this header knows where the links are. Then, with the memory at hand, the
// generic attribute lookup is most of what is left, so it is skipped where the value is
// known to be where that lookup itself would read it.
//
// Values come from CPython's generic attribute lookup, or from where it reads them: a
// __slots__ member at its offset (the member descriptor says where), or a managed __dict__'s
// value slot (CPython's internal layout, pycore_object.h and pycore_dict.h of 3.11 to 3.13,
// and nothing on any other version; a slot is read only where it must be the attribute's,
// see Layout::slots). Prefetch addresses are hints: a stale or wrong one costs a wasted
// fetch, never a fault; the reads made to find them stay inside the object.
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
  // Bit j: slot j of a managed __dict__'s values may be the attribute's (the type's
  // shared keys fix its index for every instance). Found from a probe instance: the slots
  // holding what getattr returned, the attribute's among them; narrowed likewise whenever
  // an instance's candidates disagree. Read there where the instance's values array is in
  // use and every candidate slot holds the same object (then it is the attribute, whichever
  // slot is its own: a peer and its group rank, say); anything else goes through getattr.
  uint32_t slots[kNames] = {};

  Layout() = default;
  Layout(PyTypeObject* t, PyObject* probe) : Layout(t) { find_indices(probe); }
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
      in_type[k] = descr != nullptr;
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
  // whether the attribute is there). `values`: values_of(obj).
  [[gnu::always_inline]] PyObject* get(PyObject* obj, int k, const char* values) {
    if (offset[k] > 0) {
      PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset[k]);
      if (v == nullptr && !required[k]) v = Py_None;
      Py_XINCREF(v);
      return v;
    }
    const uint32_t m = slots[k];
    if (values != nullptr && m != 0 && (m & (m - 1)) == 0) {  // one candidate: its slot
      const int j = __builtin_ctz(m);
      PyObject* v = j < capacity(values) ? reinterpret_cast<PyObject* const*>(values)[j]
                                         : nullptr;
      if (v != nullptr) {
        Py_INCREF(v);
        return v;
      }
    }
    return get_other(obj, k, values);
  }

  // get() where the attribute is not in a slot, nor in the one candidate value slot.
  PyObject* get_other(PyObject* obj, int k, const char* values) {
    if (slots[k] != 0 && values != nullptr) {
      // Every index a type's shared keys give is within every instance's values array
      // (CPython's own lookup reads values[index] unchecked); 3.13 also counts them.
      PyObject* const* slot = reinterpret_cast<PyObject* const*>(values);
      PyObject* v = nullptr;
      bool same = true;
      for (uint32_t m = slots[k]; m != 0 && same; m &= m - 1) {
        const int j = __builtin_ctz(m);
        PyObject* s = j < capacity(values) ? slot[j] : nullptr;
        same = s != nullptr && (v == nullptr || s == v);
        v = s;
      }
      if (same) {
        Py_INCREF(v);
        return v;
      }
      v = PyObject_GetAttr(obj, name_object(k));
      if (v == nullptr) {
        PyErr_Clear();
      } else {  // it came from the values (nothing in the type): its slot holds it
        slots[k] &= holding(obj, v);
      }
      return v;
    }
    PyObject* v = PyObject_GetAttr(obj, name_object(k));
    if (v == nullptr) PyErr_Clear();
    return v;
  }
  PyObject* get(PyObject* obj, int k) { return get(obj, k, values_of(obj)); }

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
    int found = 0;
    for_each_set(obj, [&](int, PyObject* v) {
      if (found < most) out[found++] = v;
    });
    return found;
  }

  // The first value slot of the managed __dict__ values array that CPython's lookup reads
  // for this instance, or null (none, the instance's dict is an object of its own, or the
  // layout is not known here).
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
    // 3.13: inline, right after the object header: capacity, size, embedded and valid
    // bytes, 4 more, then the slots; lookups read them while they are valid.
    if (!PyType_HasFeature(Py_TYPE(obj), Py_TPFLAGS_INLINE_VALUES)) return nullptr;
    const char* values = reinterpret_cast<const char*>(obj) + sizeof(PyObject) + 8;
    return values[-8 + 3] ? values : nullptr;
#else
    (void)obj;
    return nullptr;
#endif
  }

 private:
  bool in_type[kNames] = {};  // the type (its MRO) has something under the name

  // The candidate slots of the attributes the probe's values hold.
  void find_indices(PyObject* probe) {
    if (version == 0 || type->tp_getattro != PyObject_GenericGetAttr) return;
    for (int k = 0; k < kNames; ++k) {
      if (offset[k] > 0 || in_type[k]) continue;  // a class attribute may take precedence
      PyObject* v = PyObject_GetAttr(probe, name_object(k));
      if (v == nullptr) {
        PyErr_Clear();
        continue;
      }
      slots[k] = holding(probe, v);
      Py_DECREF(v);
    }
  }

  // The set slots of the instance's values holding `v` (none if one is past bit 31).
  uint32_t holding(PyObject* obj, PyObject* v) const {
    uint32_t out = 0;
    bool all = true;
    for_each_set(obj, [&](int j, PyObject* slot) {
      if (slot != v) return;
      if (j < 32) {
        out |= uint32_t{1} << j;
      } else {
        all = false;
      }
    });
    return all ? out : 0;
  }

  // f(index, value) for every set slot of the values CPython's lookup reads; false where
  // there are none (the instance's dict is an object of its own, or the layout is not
  // known here).
  template <typename F>
  [[gnu::always_inline]] bool for_each_set(PyObject* obj, F&& f) const {
    const char* values = values_of(obj);
    if (values == nullptr) return false;
    PyObject* const* slot = reinterpret_cast<PyObject* const*>(values);
#if PY_VERSION_HEX < 0x030D0000
    // 3.11, 3.12: byte -2 counts the entries set, bytes -3, -4, ... hold their indices in
    // insertion order (_PyDictValues_AddToInsertionOrder).
    const uint8_t* size = reinterpret_cast<const uint8_t*>(values) - 2;
    for (int q = 1; q <= *size; ++q) {
      if (PyObject* v = slot[size[-q]]) f(size[-q], v);
    }
#else
    for (int q = 0; q < capacity(values); ++q) {
      if (PyObject* v = slot[q]) f(q, v);
    }
#endif
    return true;
  }

  // How many slots the values array has where this CPython says (3.13), else 32 (past
  // every index a candidate mask holds).
  static int capacity(const char* values) {
#if PY_VERSION_HEX >= 0x030D0000
    return *reinterpret_cast<const uint8_t*>(values - 8);
#else
    (void)values;
    return 32;
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
