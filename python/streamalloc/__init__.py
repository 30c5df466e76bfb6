"""streamalloc: a CUDA caching allocator with stream-aware lifetimes, for PyTorch.

    import streamalloc.torch
    streamalloc.torch.install()   # before the first CUDA tensor

Pure Python over ctypes: the compiled part is ``libstreamalloc.so``, found next to this
package or through ``STREAMALLOC_LIB`` (see ``streamalloc._lib``).

Also: ``streamalloc.p2p`` (many tensors between ranks through a bounded staging pool) and
``streamalloc.bounded_send.BoundedSender`` (pipeline ``isend``s within a memory budget).
"""

from ._lib import LibraryNotFound, load, library_path

__all__ = ["LibraryNotFound", "load", "library_path"]
