# The op reader's knowledge of CPython's object layouts (python/streamalloc/csrc/p2p_ops.h),
# checked against each interpreter given (default: this one), no torch: a small extension
# built from the header reads the fields of P2POp-like objects (__slots__, a managed
# __dict__ in any insertion order, deleted and class-level attributes, a materialised
# dict, properties, peers equal to their group rank or not) and every value must be the
# one getattr returns; on 3.11 to 3.13 the fast reads must be in use (prefetch targets, the
# value slots and the members), elsewhere getattr serves alone.
#   python3 benches/gpu/p2p/ops_layout_check.py [PYTHON ...]
# Needs a C++ compiler (c++) and each interpreter's headers (skipped without them); exits
# non-zero on any failure.
import os
import random
import shutil
import subprocess
import sys
import tempfile

HEADER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                          "python", "streamalloc", "csrc")

SOURCE = r"""
#include "p2p_ops.h"
using p2p_ops::Layout;

// (values set in the managed __dict__, managed) of obj.
static PyObject* targets(PyObject*, PyObject* obj) {
  Layout l(Py_TYPE(obj));
  PyObject* out[8];
  const int n = l.value_targets(obj, out, 8);
  PyObject* list = PyList_New(n);
  for (int i = 0; i < n; ++i) {
    Py_INCREF(out[i]);
    PyList_SET_ITEM(list, i, out[i]);
  }
  return Py_BuildValue("(Ni)", list, (int)l.managed);
}

// ([attribute k of each object, Ellipsis where missing], a member, value slots in use),
// one layout for all of them, found from `probe`.
static PyObject* get_all(PyObject*, PyObject* args) {
  PyObject *probe, *objs;
  int k;
  if (!PyArg_ParseTuple(args, "OO!i", &probe, &PyList_Type, &objs, &k)) return nullptr;
  Layout l(Py_TYPE(probe), probe);
  PyObject* out = PyList_New(0);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objs); ++i) {
    PyObject* v = l.get(PyList_GET_ITEM(objs, i), k);
    PyList_Append(out, v ? v : Py_Ellipsis);
    Py_XDECREF(v);
  }
  return Py_BuildValue("(Nii)", out, (int)(l.offset[k] > 0), (int)(l.slots[k] != 0));
}

static PyMethodDef methods[] = {{"targets", targets, METH_O, ""},
                                {"get_all", get_all, METH_VARARGS, ""},
                                {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "ops_layout", "", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};
PyMODINIT_FUNC PyInit_ops_layout(void) { return PyModule_Create(&def); }
"""

NAMES = ["op", "peer", "tensor", "group_peer", "group"]


def inner():
    """The checks, run by the interpreter under test with the extension on sys.path."""
    import ops_layout

    known = (3, 11) <= sys.version_info[:2] <= (3, 13)
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
            print("FAIL:", what, flush=True)

    def same(probe, objs, what, fast=None):
        for k, name in enumerate(NAMES):
            got, member, slot = ops_layout.get_all(probe, objs, k)
            want = [getattr(o, name, Ellipsis) for o in objs]
            check(all(g is w for g, w in zip(got, want)), f"{what}: {name}")
            if fast is not None and name in fast:
                check(bool(member or slot) == known, f"{what}: {name} read fast: {known}")

    class Op:  # as torch.distributed.P2POp sets its fields
        def __init__(self, peer, group_peer=None, tag=0):
            self.op, self.tensor, self.group = isinstance, [peer], object()
            self.peer, self.tag = peer, tag
            self.group_peer = peer if group_peer is None else group_peer

    class Slots:
        __slots__ = ("tensor", "op", "peer", "group_peer", "extra")

    class Loose:
        pass

    class Default:
        group = "class"

        def __init__(self):
            self.op, self.tensor, self.group = object(), object(), object()

    class Prop:
        def __init__(self):
            self.op, self.tensor = object(), object()

        @property
        def group(self):
            return "property"

    # Managed __dict__: targets, then values, over many instances (CPython sizes their
    # values arrays from the shared keys, smaller as instances accumulate). (Not vars(o):
    # before 3.13 it makes the dict an object of its own, off the fast path.)
    fields = ("op", "tensor", "group", "peer", "tag", "group_peer")
    ops = [Op(i % 4) for i in range(300)]
    for o in ops[::7]:
        del o.tag
    for o in ops:
        got, managed = ops_layout.targets(o)
        want = {id(getattr(o, n)) for n in fields if hasattr(o, n)} if known else set()
        check({id(x) for x in got} == want, "prefetch targets are the instance's values")
        check(managed == known, "a managed __dict__ is seen as one")
    same(ops[0], ops, "P2POp-like", fast=NAMES)
    gone = Op(1)
    del gone.tensor
    viewed, grown = Op(2), Op(3)
    vars(viewed)
    grown.__dict__.update({f"x{i}": i for i in range(40)})
    same(ops[0], [gone, viewed, grown, Op(1)], "deleted, materialised, grown dicts")
    # Peers equal to the tag or the group rank on the probe, not on the others: candidate
    # slots narrow as instances disagree.
    rng = random.Random(5)
    for trial in range(60):
        batch = [Op(rng.choice([0, 1, 2]), rng.choice([0, 1, 2, None]), rng.choice([0, 1]))
                 for _ in range(30)]
        for o in batch[::9]:
            del o.tag
        same(batch[0], batch, f"peers and ranks, trial {trial}")
    a, b = Loose(), Loose()
    a.tensor, a.op, a.peer = object(), object(), 3
    b.peer, b.op, b.tensor, b.group = 4, object(), object(), object()
    same(a, [a, b], "other insertion orders")
    same(b, [a, b], "other insertion orders, other probe")
    d1, d2 = Default(), Default()
    del d2.group
    same(d1, [d1, d2], "a class attribute under the name")
    same(Prop(), [Prop(), Prop()], "a property under the name")
    # __slots__: members read at their offsets, the same as getattr.
    s, t = Slots(), Slots()
    s.tensor, s.op = [1], print
    t.peer = 5
    same(s, [s, t], "slots", fast=["op", "peer", "tensor", "group_peer"])

    class Overridden(Slots):
        @property
        def peer(self):
            return 42

    o = Overridden()
    o.tensor = 5
    same(o, [o], "a property over a slot")
    print(f"{sys.version.split()[0]}: {'ok' if not failures else f'{len(failures)} failures'}")
    return 1 if failures else 0


def build_and_run(python, work):
    query = ("import sysconfig; print(sysconfig.get_paths()['include']); "
             "print(sysconfig.get_config_var('EXT_SUFFIX'))")
    include, suffix = subprocess.run([python, "-c", query], check=True, capture_output=True,
                                     text=True).stdout.split()
    if not os.path.exists(os.path.join(include, "Python.h")):
        print(f"SKIP: {python} has no headers (Python.h) to build against")
        return 0
    folder = os.path.join(work, os.path.basename(python) + suffix.replace(".", "_"))
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, "ops_layout.cpp")
    with open(source, "w") as f:
        f.write(SOURCE)
    built = subprocess.run(["c++", "-O2", "-std=c++17", "-shared", "-fPIC", "-I", include,
                            "-I", HEADER_DIR, source, "-o",
                            os.path.join(folder, "ops_layout" + suffix)],
                           capture_output=True, text=True)
    if built.returncode:
        print(f"{python}: FAIL: the extension does not build:\n{built.stderr}")
        return 1
    env = dict(os.environ, PYTHONPATH=folder)
    return subprocess.run([python, os.path.abspath(__file__), "--inner"], env=env).returncode


def main(argv):
    if argv[:1] == ["--inner"]:
        return inner()
    if shutil.which("c++") is None:
        print("SKIP: no C++ compiler (c++)")
        return 0
    work = tempfile.mkdtemp(prefix="ops_layout_")
    try:
        failed = [p for p in (argv or [sys.executable]) if build_and_run(p, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("ops layout checks:", "all passed" if not failed else f"failed for {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
