"""Start-up hook of ``streamalloc run``: makes streamalloc PyTorch's allocator in every
Python process of an unmodified program.

``streamalloc run`` puts this folder first on ``PYTHONPATH``; Python's ``site`` module
then imports this file at start-up, before the program's first line. It does not import
``torch`` itself (a process that never uses PyTorch pays nothing, and a program may still
set ``CUDA_VISIBLE_DEVICES`` and the like before its own ``import torch``). Instead it
watches for ``torch``: the moment ``import torch`` has finished, before any CUDA work can
have happened, it calls ``streamalloc.torch.install()`` and registers an exit hook that
prints the counters (``STREAMALLOC_STATS_AT_EXIT``) and writes the snapshots
(``STREAMALLOC_SNAPSHOT``) through the library's ``streamalloc_at_exit``. With
``STREAMALLOC_SLEEP_SIGNALS`` it also makes SIGUSR1 and SIGUSR2 sleep and wake the
process's tagged memory (``streamalloc._sleep.install_signal_handlers``).

If streamalloc cannot be installed (the library is missing, PyTorch is too old, or CUDA
was already initialised, e.g. by a ``.pth`` file that imports torch), the process says so
in one line on stderr and exits with status 2 rather than silently running on PyTorch's
own allocator.

Any ``sitecustomize`` that was already on the path (a distribution's, a virtualenv's, the
user's) is run afterwards, so it keeps working.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_done = False
_starting = True  # still inside site's start-up (SystemExit there is a fatal init error)


def _fail(message):
    argv0 = (getattr(sys, "argv", None) or ["python"])[0] or "python"
    sys.stderr.write("streamalloc: NOT installed in process %d (%s): %s\n" % (os.getpid(), argv0, message))
    sys.stderr.flush()
    if _starting:
        os._exit(2)
    raise SystemExit(2)


def _at_exit(lib):
    import ctypes

    fn = lib.streamalloc_at_exit
    fn.argtypes, fn.restype = [], ctypes.c_int
    fn()


def _install():
    """Installs streamalloc into the (fully imported) torch module, once."""
    global _done
    if _done:
        return
    _done = True
    torch = sys.modules["torch"]
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        _fail(
            "PyTorch had already initialised CUDA with its own allocator before streamalloc "
            "could be installed (something imported torch and used CUDA during start-up)"
        )
    try:
        import streamalloc._lib as lib
        import streamalloc.torch as st

        st.install()
    except Exception as err:  # one clear line, whatever went wrong
        _fail("%s: %s" % (type(err).__name__, err))
    import atexit

    atexit.register(_at_exit, lib.load())
    backup = os.environ.get("STREAMALLOC_SLEEP_SIGNALS")
    if backup:
        _sleep_signals(backup)


def _sleep_signals(backup):
    """``streamalloc run --sleep-signals``: SIGUSR1 sleeps the process's tags, SIGUSR2
    wakes them (handlers run in the main thread only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        sys.stderr.write(
            "streamalloc: process %d: --sleep-signals ignored (torch was first imported outside "
            "the main thread, where signal handlers cannot be set)\n" % os.getpid()
        )
        return
    try:
        import streamalloc._sleep as sleep

        sleep.install_signal_handlers(backup)
    except Exception as err:
        _fail("--sleep-signals: %s: %s" % (type(err).__name__, err))


class _TorchWatcher(importlib.abc.MetaPathFinder):
    """Finds ``torch`` with the other finders, then runs :func:`_install` right after the
    module has executed."""

    _busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or _done or self._busy:
            return None
        self._busy = True  # let the real finders answer, without recursing into this one
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _install()

        spec.loader.exec_module = exec_module
        return spec


def _chain():
    """Runs the next ``sitecustomize`` on the path, which this file shadows."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _boot():
    if "torch" in sys.modules:  # imported during start-up (a .pth file)
        _install()
    else:
        sys.meta_path.insert(0, _TorchWatcher())


_boot()
_starting = False
_chain()
