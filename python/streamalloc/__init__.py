"""streamalloc: a CUDA caching allocator with stream-aware lifetimes, for PyTorch.

    import streamalloc.torch
    streamalloc.torch.install()   # before the first CUDA tensor

Pure Python over ctypes: the compiled part is ``libstreamalloc.so``, installed inside this
package by ``pip install`` (or found through ``STREAMALLOC_LIB``, or a cargo build of a
source checkout; see ``streamalloc._lib``).

Also: ``streamalloc.p2p`` (many tensors between ranks through a bounded staging pool) and
``streamalloc.bounded_send.BoundedSender`` (pipeline ``isend``s within a memory budget).
"""

from ._lib import LibraryNotFound, load, library_path


def _version() -> str:
    # One source: Cargo's workspace version. The wheel build writes it to _version.py;
    # a source checkout reads Cargo.toml two folders up.
    try:
        from ._version import version

        return version
    except ImportError:
        pass
    import re
    from pathlib import Path

    try:
        text = (Path(__file__).resolve().parents[2] / "Cargo.toml").read_text()
    except OSError:
        return "unknown"
    m = re.search(r'^\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    return m.group(1) if m else "unknown"


__version__ = _version()

__all__ = ["LibraryNotFound", "load", "library_path", "__version__"]
