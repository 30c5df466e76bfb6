"""Whether streamalloc is PyTorch's allocator in this process, and the two helpers every
PyTorch-facing module shares: importing ``torch`` with a one-line error, and naming a CUDA
device. A module of its own so that ``streamalloc._sleep`` reads them without importing
``streamalloc.torch``, which hands ``_sleep``'s functions on as its own.

``streamalloc.torch.install()`` writes the state; everything else only reads it.
"""

from __future__ import annotations

import sys

# The pluggable wrapper (keeps its function pointers alive) or the door module, once installed.
allocator = None
# "native" or "pluggable" once installed.
door_in_use = None


class InstallError(RuntimeError):
    """streamalloc could not become PyTorch's allocator."""


class TorchNotFound(InstallError, ImportError):
    """PyTorch is not installed in this Python. Also an ``ImportError``, so code that
    guards ``import torch`` with ``except ImportError`` keeps working."""


# Users meet these as streamalloc.torch's (in tracebacks, reprs and pickles).
InstallError.__module__ = TorchNotFound.__module__ = "streamalloc.torch"


def installed() -> bool:
    """True once :func:`install` succeeded in this process."""
    return allocator is not None


def door() -> str | None:
    """``"native"`` or ``"pluggable"``: the door :func:`install` used (None before)."""
    return door_in_use


def import_torch():
    """``torch``, or :class:`TorchNotFound` saying in one line how to get it. A PyTorch
    that is installed but fails to import (a missing dependency of its own) keeps its own
    error."""
    try:
        import torch
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        raise TorchNotFound(
            f"streamalloc: PyTorch is not installed for {sys.executable}: pip install torch"
        ) from None
    return torch


def device(device=None) -> int:
    """The index of ``device`` (None: the current one; an int, ``"cuda:1"`` or a
    ``torch.device``)."""
    torch = import_torch()

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return device.index if device.index is not None else torch.cuda.current_device()
    raise TypeError(f"not a CUDA device: {device!r}")
