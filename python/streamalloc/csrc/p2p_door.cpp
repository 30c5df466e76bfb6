// The drop-in's per-call reading of a P2POp list, in native code (streamalloc._p2p_native).
//
// `scan(ops, world, isend, irecv, group_rank, codes, groups)` reads every op's `op`, `peer` (or
// `group_peer`), `tensor` and, unless `groups` is None, `group` (which must be one of
// `groups`), checks them as streamalloc._p2p_checks.translate_ops does, with the same messages, and returns the list sorted into lanes (direction * world + peer, list
// order within a lane): (counts, tensors, nbytes, dtype codes, addresses, device), the last
// three columns as bytes of int64. A bad op raises ValueError with the message.
//
// Why native: this runs over every op of every call (58,000 in the reproduction's pattern at
// scale); Python's attribute reads and tensor method calls cost 1-3 µs per op, these reads
// a fraction of that. Plain CPython API with PyTorch's tensor unpacking: no pybind11.
#include <Python.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

struct Names {
  PyObject* op = PyUnicode_InternFromString("op");
  PyObject* tensor = PyUnicode_InternFromString("tensor");
  PyObject* peer = PyUnicode_InternFromString("peer");
  PyObject* group_peer = PyUnicode_InternFromString("group_peer");
  PyObject* group = PyUnicode_InternFromString("group");
  PyObject* name = PyUnicode_InternFromString("__name__");
};

const Names& names() {
  static Names* n = new Names();
  return *n;
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
  PyObject* name = PyObject_GetAttr(fn, names().name);
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

struct Entry {
  int lane;
  PyObject* tensor;  // borrowed: the op holds it for the call
  int64_t nbytes, code, address;
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
  PyObject** items = PySequence_Fast_ITEMS(seq);
  const Py_ssize_t known = PyList_Check(codes) ? PyList_GET_SIZE(codes) : 0;
  std::vector<Entry> entries;
  entries.reserve(n);
  std::unordered_map<long, long> mapped;  // peer (global) -> group rank, through group_rank
  bool have_device = false;
  c10::Device device(c10::DeviceType::CPU);
  std::string failure;
  for (Py_ssize_t i = 0; i < n && failure.empty(); ++i) {
    PyObject* op = items[i];
    const std::string at = "op " + std::to_string(i);
    PyObject* fn = PyObject_GetAttr(op, names().op);
    PyObject* peer = fn ? PyObject_GetAttr(op, names().peer) : nullptr;
    PyObject* tensor = peer ? PyObject_GetAttr(op, names().tensor) : nullptr;
    if (tensor == nullptr) {
      PyErr_Clear();
      Py_XDECREF(fn);
      Py_XDECREF(peer);
      failure = at + " is a " + Py_TYPE(op)->tp_name + ", not a torch.distributed.P2POp";
      break;
    }
    const int direction = direction_of(fn, isend, irecv);
    long p = -1;
    PyObject* group_peer = PyObject_GetAttr(op, names().group_peer);
    if (group_peer == nullptr) PyErr_Clear();
    if (group_peer != nullptr && group_peer != Py_None) {
      p = rank_in(group_peer, world);
    } else if (group_rank == Py_None) {
      p = rank_in(peer, world);
    } else if (PyLong_Check(peer) && !PyBool_Check(peer)) {
      long g = PyLong_AsLong(peer);
      auto found = mapped.find(g);
      if (found != mapped.end()) {
        p = found->second;
      } else {
        PyObject* r = g >= 0 ? PyObject_CallOneArg(group_rank, peer) : nullptr;
        if (r == nullptr) PyErr_Clear();
        p = rank_in(r, world);
        Py_XDECREF(r);
        mapped.emplace(g, p);
      }
    }
    Py_XDECREF(group_peer);
    // Every op of one group (`groups`: the groups that name the caller's, None for any).
    int in_groups = 1;
    if (groups != Py_None) {
      PyObject* group = PyObject_GetAttr(op, names().group);
      if (group == nullptr) {
        PyErr_Clear();
        group = Py_None;
        Py_INCREF(group);
      }
      in_groups = PySequence_Contains(groups, group);
      Py_DECREF(group);
      if (in_groups < 0) PyErr_Clear();
    }
    if (in_groups != 1) {
      failure = "the P2POp list mixes process groups; pass one group's ops";
    } else if (direction < 0) {
      failure = at + ": P2POp.op must be torch.distributed.isend or irecv, not " + text_of(fn, true);
    } else if (p < 0) {
      failure = at + ": peer " + text_of(peer, true) + " is not a rank of the group (0.." +
                std::to_string(world - 1) + ")";
    } else if (!THPVariable_Check(tensor)) {
      failure = at + " (peer " + text_of(peer, false) + "): the tensor is " +
                Py_TYPE(tensor)->tp_name + ", not a torch.Tensor";
    } else {
      const at::Tensor& t = THPVariable_Unpack(tensor);
      if (!t.is_contiguous()) {
        failure = at + " (peer " + text_of(peer, false) +
                  "): the tensor is not contiguous; pass t.contiguous() and copy the result "
                  "back after wait()";
      } else if (have_device && t.device() != device) {
        failure = at + " (peer " + text_of(peer, false) + "): the tensor is on " +
                  t.device().str() + ", the first op's is on " + device.str() + "; use one device";
      } else {
        if (!have_device) {
          device = t.device();
          have_device = true;
        }
        const auto type = static_cast<Py_ssize_t>(t.scalar_type());
        int64_t code = -1;
        if (type < known) code = PyLong_AsLongLong(PyList_GET_ITEM(codes, type));
        if (code < 0) {
          PyErr_Clear();
          failure = at + ": a tensor of dtype " + std::string(c10::toString(t.scalar_type())) +
                    " that streamalloc does not know";
        } else {
          const int64_t address =
              t.is_meta() ? 0 : static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
          entries.push_back(Entry{static_cast<int>(direction * world + p), tensor,
                                  static_cast<int64_t>(t.nbytes()), code, address});
        }
      }
    }
    Py_DECREF(fn);
    Py_DECREF(peer);
    Py_DECREF(tensor);
  }
  if (!failure.empty()) {
    Py_DECREF(seq);
    return refuse(failure);
  }
  // Counting sort into lanes, stable: list order within each lane.
  const size_t lanes = static_cast<size_t>(2 * world);
  std::vector<Py_ssize_t> counts(lanes, 0), next(lanes, 0);
  for (const Entry& e : entries) counts[e.lane]++;
  for (size_t l = 1; l < lanes; ++l) next[l] = next[l - 1] + counts[l - 1];
  const Py_ssize_t m = static_cast<Py_ssize_t>(entries.size());
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
    Py_DECREF(seq);
    return nullptr;
  }
  auto* nb = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(nbytes));
  auto* cd = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(dtypes));
  auto* ad = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(addresses));
  for (const Entry& e : entries) {
    const Py_ssize_t k = next[e.lane]++;
    Py_INCREF(e.tensor);
    PyList_SET_ITEM(tensors, k, e.tensor);
    nb[k] = e.nbytes;
    cd[k] = e.code;
    ad[k] = e.address;
  }
  for (size_t l = 0; l < lanes; ++l) {
    PyList_SET_ITEM(count_list, static_cast<Py_ssize_t>(l), PyLong_FromSsize_t(counts[l]));
  }
  Py_DECREF(seq);
  PyObject* where = Py_None;
  if (have_device) {
    where = PyUnicode_FromString(device.str().c_str());
  } else {
    Py_INCREF(Py_None);
  }
  return Py_BuildValue("(NNNNNN)", count_list, tensors, nbytes, dtypes, addresses, where);
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
