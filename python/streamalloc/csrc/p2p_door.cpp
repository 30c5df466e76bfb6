// The drop-in's per-call reading of a P2POp list, in native code (streamalloc._p2p_native).
//
// `scan(ops, world, isend, irecv, group_rank, codes, groups)` reads every op's `op`, `peer` (or
// `group_peer`), `tensor` and, unless `groups` is None, `group` (which must be one of
// `groups`), checks them as streamalloc._p2p_checks.translate_ops does, with the same
// messages, and returns the list sorted into lanes (direction * world + peer, list order
// within a lane): (counts, tensors, nbytes, dtype codes, addresses, device), the last three
// columns as bytes of int64. A bad op raises ValueError with the message. `bent(tensors)`:
// the indices of the tensors of a list that are not 1-D. `lists(lanes, codes)`: the same
// columns for an `Exchange`'s tensors, given per lane (sends to each peer, then receives from
// each), or None at the first tensor the Python checks would refuse (they then say why).
//
// Why native: this runs over every op of every call (58,000 in the reproduction's pattern at
// scale); Python's attribute reads and tensor method calls cost 1-3 µs per op, these reads
// a fraction of that. Plain CPython API with PyTorch's tensor unpacking: no pybind11.
//
// Why a pipeline: read cold, as a shuffled list of that size is, the memory of each op
// arrives only when asked for, one link of a chain at a time (the op, its attribute
// values, the tensor object, its TensorImpl, its storage), and that waiting was most of the
// cost. So op i is checked while the links of the ops after it are fetched, one link per
// stage, `kAhead` ops apart (p2p_ops.h finds the op's links).
#include <Python.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include "p2p_ops.h"

namespace {

using p2p_ops::Layout;
using p2p_ops::prefetch;
using p2p_ops::prefetch_span;

constexpr Py_ssize_t kAhead = 4;   // ops between two stages of the pipeline
constexpr Py_ssize_t kStages = 6;  // fetch: op, values, their targets; read; impl; storage
constexpr Py_ssize_t kRing = 32;   // records between reading and checking (> 3 * kAhead)

PyObject* name_attribute() {
  static PyObject* name = PyUnicode_InternFromString("__name__");
  return name;
}

std::string text_of(PyObject* obj, bool repr) {
  PyObject* s = repr ? PyObject_Repr(obj) : PyObject_Str(obj);
  if (s == nullptr) {
    PyErr_Clear();
    return "?";
  }
  const char* c = PyUnicode_AsUTF8(s);
  std::string out = c ? c : "?";
  Py_DECREF(s);
  return out;
}

PyObject* refuse(const std::string& message) {
  PyErr_SetString(PyExc_ValueError, message.c_str());
  return nullptr;
}

// 0 send, 1 receive, -1 neither (the function's __name__ decides where it is not
// torch.distributed's own, as P2POp checks).
int direction_of(PyObject* fn, PyObject* isend, PyObject* irecv) {
  if (fn == isend) return 0;
  if (fn == irecv) return 1;
  PyObject* name = PyObject_GetAttr(fn, name_attribute());
  if (name == nullptr) {
    PyErr_Clear();
    return -1;
  }
  int out = -1;
  if (PyUnicode_Check(name)) {
    if (PyUnicode_CompareWithASCIIString(name, "isend") == 0) out = 0;
    if (PyUnicode_CompareWithASCIIString(name, "irecv") == 0) out = 1;
  }
  Py_DECREF(name);
  return out;
}

// An exact int (not a bool) in [0, world), else -1.
long rank_in(PyObject* value, long world) {
  if (value == nullptr || !PyLong_Check(value) || PyBool_Check(value)) return -1;
  long v = PyLong_AsLong(value);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  return (v >= 0 && v < world) ? v : -1;
}

// `codes[c10::ScalarType index]` from the Python list the callers pass, -1 where unknown.
std::vector<int64_t> codes_table(PyObject* codes) {
  std::vector<int64_t> table;
  if (PyList_Check(codes)) {
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(codes); ++k) {
      const int64_t code = PyLong_AsLongLong(PyList_GET_ITEM(codes, k));
      table.push_back(code == -1 && PyErr_Occurred() ? -1 : code);
    }
    PyErr_Clear();
  }
  return table;
}

// A tensor's dtype code in `table`, or -1.
int64_t code_of(const std::vector<int64_t>& table, const at::Tensor& t) {
  const auto type = static_cast<size_t>(t.scalar_type());
  return type < table.size() ? table[type] : -1;
}

// A tensor's device address (0 on the meta device, which has none).
int64_t address_of(const at::Tensor& t) {
  return t.is_meta() ? 0 : static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
}

struct Entry {
  int lane;
  PyObject* tensor;  // owned: the reference the attribute read returned goes to the result
  int64_t nbytes, code, address;
};

// One op's attributes, as read (new references, or null where the op lacks them).
struct Record {
  PyObject *fn = nullptr, *peer = nullptr, *tensor = nullptr, *group_peer = nullptr,
           *group = nullptr;
  bool readable = false;  // op, peer and tensor were all there

  void read(PyObject* op, Layout& layout, bool want_group) {
    using namespace p2p_ops;
    const char* values = layout.values_of(op);
    fn = layout.get(op, kOp, values);
    peer = fn ? layout.get(op, kPeer, values) : nullptr;
    tensor = peer ? layout.get(op, kTensor, values) : nullptr;
    readable = tensor != nullptr;
    if (!readable) return;
    group_peer = layout.get(op, kGroupPeer, values);
    if (want_group) group = layout.get(op, kGroup, values);
  }
  void release() {
    Py_CLEAR(fn);
    Py_CLEAR(peer);
    Py_CLEAR(tensor);
    Py_CLEAR(group_peer);
    Py_CLEAR(group);
    readable = false;
  }
};

// A torch.Tensor's TensorImpl (unpacking reads the tensor object, fetched a stage earlier).
[[gnu::always_inline]] inline const c10::TensorImpl* impl_of(PyObject* tensor) {
  if (tensor == nullptr || !THPVariable_CheckExact(tensor)) return nullptr;
  return THPVariable_Unpack(tensor).unsafeGetTensorImpl();
}

// What the checks read of a TensorImpl: its storage pointer near the start; its offset,
// size, dtype, device, flags and key set at the end. (always_inline: GCC drops calls to a
// function that only prefetches, as if it did nothing.)
[[gnu::always_inline]] inline void fetch_impl(PyObject* tensor) {
  if (const c10::TensorImpl* impl = impl_of(tensor)) {
    const char* p = reinterpret_cast<const char*>(impl);
    prefetch(p + 16);
    prefetch_span(p + sizeof(c10::TensorImpl) - 32, 32);
  }
}

// The storage's data pointer (a tensor's address) and the flags checked before reading it.
[[gnu::always_inline]] inline void fetch_storage(PyObject* tensor) {
  if (const c10::TensorImpl* impl = impl_of(tensor)) {
    if (const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl()) {
      prefetch_span(reinterpret_cast<const char*>(storage) + 16, 48);
    }
  }
}

// Whether `group` is one of `groups`: identity first (what the process groups compare by
// anyway; the general comparison costs a rich compare per element).
int in_groups(PyObject* group, PyObject* groups) {
  if (PyTuple_CheckExact(groups)) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(groups); ++k) {
      if (PyTuple_GET_ITEM(groups, k) == group) return 1;
    }
  }
  const int found = PySequence_Contains(groups, group);
  if (found < 0) PyErr_Clear();
  return found;
}

struct Scan {
  long world;
  PyObject *isend, *irecv, *group_rank, *groups;
  std::vector<int64_t> codes;  // codes[c10::ScalarType index], -1 where unknown
  std::vector<Entry> entries;
  std::unordered_map<long, long> mapped;  // peer (global) -> group rank, through group_rank
  bool have_device = false;
  c10::Device device{c10::DeviceType::CPU};
  std::string failure;
  Layout layout;       // of the last op type met (a list has one, as a rule)
  Record ring[kRing];  // the ops between reading and checking

  Layout& layout_of(PyObject* op) {
    if (!layout.fits(Py_TYPE(op))) layout = Layout(Py_TYPE(op), op);
    return layout;
  }

  // The group rank an op names, or -1.
  long peer_of(const Record& r) {
    if (r.group_peer != nullptr && r.group_peer != Py_None) return rank_in(r.group_peer, world);
    if (group_rank == Py_None) return rank_in(r.peer, world);
    if (!PyLong_Check(r.peer) || PyBool_Check(r.peer)) return -1;
    const long g = PyLong_AsLong(r.peer);
    if (g == -1 && PyErr_Occurred()) PyErr_Clear();  // out of range: refused below
    auto found = mapped.find(g);
    if (found != mapped.end()) return found->second;
    PyObject* mapped_rank = g >= 0 ? PyObject_CallOneArg(group_rank, r.peer) : nullptr;
    if (mapped_rank == nullptr) PyErr_Clear();
    const long p = rank_in(mapped_rank, world);
    Py_XDECREF(mapped_rank);
    mapped.emplace(g, p);
    return p;
  }

  // Checks op i and adds its entry (taking the record's tensor), or sets `failure`.
  void take(Py_ssize_t i, PyObject* op, Record& r) {
    const auto at = [i] { return "op " + std::to_string(i); };
    if (!r.readable) {
      failure = at() + " is a " + Py_TYPE(op)->tp_name + ", not a torch.distributed.P2POp";
      return;
    }
    const int direction = direction_of(r.fn, isend, irecv);
    const long p = peer_of(r);
    if (groups != Py_None && in_groups(r.group ? r.group : Py_None, groups) != 1) {
      failure = "the P2POp list mixes process groups; pass one group's ops";
      return;
    }
    if (direction < 0) {
      failure = at() + ": P2POp.op must be torch.distributed.isend or irecv, not " +
                text_of(r.fn, true);
      return;
    }
    if (p < 0) {
      failure = at() + ": peer " + text_of(r.peer, true) + " is not a rank of the group (0.." +
                std::to_string(world - 1) + ")";
      return;
    }
    const auto about = [&] { return at() + " (peer " + text_of(r.peer, false) + ")"; };
    if (!THPVariable_Check(r.tensor)) {
      failure = about() + ": the tensor is " + Py_TYPE(r.tensor)->tp_name +
                ", not a torch.Tensor";
      return;
    }
    const at::Tensor& t = THPVariable_Unpack(r.tensor);
    if (!t.is_contiguous()) {
      failure = about() +
                ": the tensor is not contiguous; pass t.contiguous() and copy the result "
                "back after wait()";
      return;
    }
    if (have_device && t.device() != device) {
      failure = about() + ": the tensor is on " + t.device().str() + ", the first op's is on " +
                device.str() + "; use one device";
      return;
    }
    if (!have_device) {
      device = t.device();
      have_device = true;
    }
    const int64_t code = code_of(codes, t);
    if (code < 0) {
      failure = at() + ": a tensor of dtype " + std::string(c10::toString(t.scalar_type())) +
                " that streamalloc does not know";
      return;
    }
    entries.push_back(Entry{static_cast<int>(direction * world + p), r.tensor,
                            static_cast<int64_t>(t.nbytes()), code, address_of(t)});
    r.tensor = nullptr;  // the entry holds it now
  }

  // Every op through the pipeline, in list order; false at the first bad op. The attributes
  // of the few ops after it may have been read (plain lookups for a P2POp), none checked.
  bool read_all(PyObject* const* items, Py_ssize_t n) {
    const bool want_group = groups != Py_None;
    for (Py_ssize_t i = 0; i < n + kStages * kAhead && failure.empty(); ++i) {
      // Stage s works on op i - s * kAhead.
      const auto op = [&](Py_ssize_t s) -> Py_ssize_t {
        const Py_ssize_t j = i - s * kAhead;
        return j >= 0 && j < n ? j : -1;
      };
      if (i < n) p2p_ops::fetch_op(items[i]);
      if (const Py_ssize_t j = op(1); j >= 0) layout_of(items[j]).fetch_values(items[j]);
      if (const Py_ssize_t j = op(2); j >= 0) layout_of(items[j]).fetch_targets(items[j]);
      if (const Py_ssize_t j = op(3); j >= 0) {
        ring[j % kRing].read(items[j], layout_of(items[j]), want_group);
      }
      if (const Py_ssize_t j = op(4); j >= 0) fetch_impl(ring[j % kRing].tensor);
      if (const Py_ssize_t j = op(5); j >= 0) fetch_storage(ring[j % kRing].tensor);
      if (const Py_ssize_t j = op(6); j >= 0) {
        Record& r = ring[j % kRing];
        take(j, items[j], r);
        r.release();
      }
    }
    return failure.empty();
  }

  ~Scan() {
    for (Record& r : ring) r.release();  // the ops read ahead of a bad one
    for (Entry& e : entries) Py_XDECREF(e.tensor);
  }
};

PyObject* scan(PyObject*, PyObject* args) {
  PyObject *ops, *isend, *irecv, *group_rank, *codes, *groups;
  long world;
  if (!PyArg_ParseTuple(args, "OlOOOOO", &ops, &world, &isend, &irecv, &group_rank, &codes,
                        &groups)) {
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(ops, "ops must be a sequence");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  Scan sc{world, isend, irecv, group_rank, groups};
  sc.codes = codes_table(codes);
  sc.entries.reserve(n);
  const bool ok = sc.read_all(PySequence_Fast_ITEMS(seq), n);
  Py_DECREF(seq);
  if (!ok) return refuse(sc.failure);
  // Counting sort into lanes, stable: list order within each lane.
  const size_t lanes = static_cast<size_t>(2 * world);
  std::vector<Py_ssize_t> counts(lanes, 0), next(lanes, 0);
  for (const Entry& e : sc.entries) counts[e.lane]++;
  for (size_t l = 1; l < lanes; ++l) next[l] = next[l - 1] + counts[l - 1];
  const Py_ssize_t m = static_cast<Py_ssize_t>(sc.entries.size());
  PyObject* tensors = PyList_New(m);
  PyObject* nbytes = PyBytes_FromStringAndSize(nullptr, m * 8);
  PyObject* dtypes = PyBytes_FromStringAndSize(nullptr, m * 8);
  PyObject* addresses = PyBytes_FromStringAndSize(nullptr, m * 8);
  PyObject* count_list = PyList_New(static_cast<Py_ssize_t>(lanes));
  if (!tensors || !nbytes || !dtypes || !addresses || !count_list) {
    Py_XDECREF(tensors);
    Py_XDECREF(nbytes);
    Py_XDECREF(dtypes);
    Py_XDECREF(addresses);
    Py_XDECREF(count_list);
    return nullptr;
  }
  auto* nb = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(nbytes));
  auto* cd = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(dtypes));
  auto* ad = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(addresses));
  for (Entry& e : sc.entries) {
    const Py_ssize_t k = next[e.lane]++;
    PyList_SET_ITEM(tensors, k, e.tensor);  // the entry's reference
    e.tensor = nullptr;
    nb[k] = e.nbytes;
    cd[k] = e.code;
    ad[k] = e.address;
  }
  for (size_t l = 0; l < lanes; ++l) {
    PyList_SET_ITEM(count_list, static_cast<Py_ssize_t>(l), PyLong_FromSsize_t(counts[l]));
  }
  PyObject* where = Py_None;
  if (sc.have_device) {
    where = PyUnicode_FromString(sc.device.str().c_str());
  } else {
    Py_INCREF(Py_None);
  }
  return Py_BuildValue("(NNNNNN)", count_list, tensors, nbytes, dtypes, addresses, where);
}

// The indices (bytes of int64) of the tensors of a list that are not 1-D: the few that
// packing with PyTorch views must flatten. Apart from `scan`, which does not read the
// dimensions (one more cache line per tensor, wanted by that packing alone); pipelined
// likewise: the tensor object, then the lines of its TensorImpl that dim() reads.
PyObject* bent(PyObject*, PyObject* tensors) {
  if (!PyList_Check(tensors)) {
    PyErr_SetString(PyExc_TypeError, "expected a list of tensors");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  PyObject* const* items = PySequence_Fast_ITEMS(tensors);
  std::vector<int64_t> out;
  for (Py_ssize_t i = 0; i < n + 2 * kAhead; ++i) {
    if (i < n) prefetch_span(items[i], 24);
    if (const Py_ssize_t j = i - kAhead; j >= 0 && j < n) {
      if (const c10::TensorImpl* impl = impl_of(items[j])) {
        const char* p = reinterpret_cast<const char*>(impl);
        prefetch(p + 64);  // the number of sizes
        prefetch_span(p + sizeof(c10::TensorImpl) - 32, 32);  // the sizes policy
      }
    }
    if (const Py_ssize_t j = i - 2 * kAhead; j >= 0 && j < n) {
      if (THPVariable_Check(items[j]) && THPVariable_Unpack(items[j]).dim() != 1) {
        out.push_back(j);
      }
    }
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(int64_t)));
}

// `Exchange`'s lists: `lanes`, a sequence of 2 * world sequences of tensors (the sends to
// each peer, then the receives from each, already checked to be lists or tuples), read into
// (counts, tensors, nbytes, dtype codes, addresses, device) as `scan` returns them, tensors
// that require grad detached (the exchange moves their data, as `p.data` would). None where a
// tensor is not a contiguous torch.Tensor of a known dtype on the first one's device: the
// Python checks (streamalloc._p2p_checks) then find it and raise their message.
PyObject* lists(PyObject*, PyObject* args) {
  PyObject *lanes, *codes;
  if (!PyArg_ParseTuple(args, "OO", &lanes, &codes)) return nullptr;
  PyObject* outer = PySequence_Fast(lanes, "lanes must be a sequence");
  if (outer == nullptr) return nullptr;
  const std::vector<int64_t> table = codes_table(codes);
  const Py_ssize_t n_lanes = PySequence_Fast_GET_SIZE(outer);
  std::vector<PyObject*> inner(static_cast<size_t>(n_lanes), nullptr);
  Py_ssize_t total = 0;
  bool ok = true;
  for (Py_ssize_t l = 0; l < n_lanes && ok; ++l) {
    inner[l] = PySequence_Fast(PySequence_Fast_GET_ITEM(outer, l), "a lane must be a sequence");
    ok = inner[l] != nullptr;
    if (ok) total += PySequence_Fast_GET_SIZE(inner[l]);
  }
  PyObject* result = nullptr;
  PyObject* tensors = ok ? PyList_New(total) : nullptr;
  PyObject* nbytes = ok ? PyBytes_FromStringAndSize(nullptr, total * 8) : nullptr;
  PyObject* dtypes = ok ? PyBytes_FromStringAndSize(nullptr, total * 8) : nullptr;
  PyObject* addresses = ok ? PyBytes_FromStringAndSize(nullptr, total * 8) : nullptr;
  PyObject* counts = ok ? PyList_New(n_lanes) : nullptr;
  bool refused = false, have_device = false;
  c10::Device device{c10::DeviceType::CPU};
  if (tensors && nbytes && dtypes && addresses && counts) {
    auto* nb = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(nbytes));
    auto* cd = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(dtypes));
    auto* ad = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(addresses));
    Py_ssize_t k = 0;
    for (Py_ssize_t l = 0; l < n_lanes && !refused && k >= 0; ++l) {
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(inner[l]);
      PyObject* const* items = PySequence_Fast_ITEMS(inner[l]);
      PyList_SET_ITEM(counts, l, PyLong_FromSsize_t(n));
      for (Py_ssize_t i = 0; i < n && !refused; ++i, ++k) {
        if (i + kAhead < n) fetch_impl(items[i + kAhead]);
        PyObject* obj = items[i];
        if (!THPVariable_Check(obj)) {
          refused = true;
          break;
        }
        const at::Tensor& t = THPVariable_Unpack(obj);
        const int64_t code = code_of(table, t);
        if (!t.is_contiguous() || code < 0 || (have_device && t.device() != device)) {
          refused = true;
          break;
        }
        if (!have_device) {
          device = t.device();
          have_device = true;
        }
        PyObject* held = nullptr;
        if (t.requires_grad()) {
          held = THPVariable_Wrap(t.detach());
          if (held == nullptr) {
            k = -1;  // an error is set
            break;
          }
        } else {
          Py_INCREF(obj);
          held = obj;
        }
        PyList_SET_ITEM(tensors, k, held);
        nb[k] = static_cast<int64_t>(t.nbytes());
        cd[k] = code;
        ad[k] = address_of(t);
      }
    }
    if (k >= 0) {
      if (refused) {
        Py_INCREF(Py_None);
        result = Py_None;
      } else {
        PyObject* where = have_device ? PyUnicode_FromString(device.str().c_str()) : Py_None;
        if (!have_device) Py_INCREF(Py_None);
        result = Py_BuildValue("(OOOOON)", counts, tensors, nbytes, dtypes, addresses, where);
      }
    }
  }
  // A list's unset items are NULL, which its deallocation skips.
  Py_XDECREF(tensors);
  Py_XDECREF(nbytes);
  Py_XDECREF(dtypes);
  Py_XDECREF(addresses);
  Py_XDECREF(counts);
  for (PyObject* seq : inner) Py_XDECREF(seq);
  Py_DECREF(outer);
  return result;
}

// The index of a torch.dtype in c10::ScalarType (the table `scan` reads dtype codes from).
PyObject* scalar_type(PyObject*, PyObject* dtype) {
  if (!THPDtype_Check(dtype)) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.dtype");
    return nullptr;
  }
  return PyLong_FromLong(static_cast<long>(reinterpret_cast<THPDtype*>(dtype)->scalar_type));
}

PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "Reads a P2POp list into lanes (see the file's comment)."},
    {"bent", bent, METH_O, "The indices of the tensors of a list that are not 1-D."},
    {"lists", lists, METH_VARARGS, "Reads an Exchange's tensors, lane by lane, into columns."},
    {"scalar_type", scalar_type, METH_O, "The c10::ScalarType index of a torch.dtype."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

#define SA_CONCAT_(a, b) a##b
#define SA_CONCAT(a, b) SA_CONCAT_(a, b)
#define SA_STRINGIFY_(a) #a
#define SA_STRINGIFY(a) SA_STRINGIFY_(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, SA_STRINGIFY(TORCH_EXTENSION_NAME),
                                 "streamalloc's native P2POp list reader", -1, methods};

PyMODINIT_FUNC SA_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&module_def);
}
