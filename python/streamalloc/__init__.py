"""streamalloc: a CUDA caching allocator with stream-aware lifetimes, for PyTorch.

    import streamalloc.torch
    streamalloc.torch.install()   # before the first CUDA tensor

Pure Python over ctypes: the compiled part is ``libstreamalloc.so``, found next to this
package or through ``STREAMALLOC_LIB`` (see ``streamalloc._lib``).
"""

from ._lib import LibraryNotFound, load, library_path

__all__ = ["LibraryNotFound", "load", "library_path"]
