"""Arrays of other libraries (PyTorch, JAX, anything with ``__dlpack__`` or
``__array_interface__``) as ``ti.types.ndarray()`` arguments, and DLPack for fields and
ndarrays.

A foreign array is turned into a NumPy array over the same memory (``np.from_dlpack``, or
``np.asarray`` for the array interface), so a kernel reads and writes the caller's tensor in
place: no copy. Two cases copy, once per launch, and say so here and in the README:

* a strided (non-contiguous) tensor: the kernel runs on a C-ordered copy, written back into
  the tensor after the launch (the generated code indexes arrays with their extents only);
* nothing else. Arrays on another device (CUDA, ...) are refused by a CPU program: moving them
  is the caller's decision (``t.cpu()``). A grid program (``arch=ti.cuda``) takes CUDA arrays
  in place and exports its storage as CUDA memory: ``runtime/devicearrays.py``.

Read-only sources (JAX arrays are immutable) are passed read-only: a kernel that writes one is
refused at launch. Nothing here imports torch or jax.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import ArgumentError, DifftapeError
from . import devicearrays, program
from .dlpack import CPU as _DLPACK_CPU
from .dlpack import DEVICE_NAMES as _DEVICE_NAMES
from .storage import Storage, shared_array


def as_numpy(a, what: str = "the array") -> np.ndarray:
    """A NumPy array over the memory of ``a`` (a tensor, a JAX array, anything exporting
    DLPack or the array interface), without copying. Raises DifftapeError when that is not
    possible (another device, a dtype NumPy lacks, no array protocol)."""
    if isinstance(a, np.ndarray):
        return a
    if getattr(a, "requires_grad", False) and hasattr(a, "detach"):
        a = a.detach()  # a PyTorch tensor that autograd tracks: same memory, no tracking
    if hasattr(a, "__dlpack__"):
        try:
            device = a.__dlpack_device__()
        except Exception:  # noqa: BLE001 - a producer without the device query: try the export
            device = (_DLPACK_CPU, 0)
        if device[0] != _DLPACK_CPU:
            name = _DEVICE_NAMES.get(device[0], f"DLPack device type {device[0]}")
            raise DifftapeError(f"{what} ({type(a).__name__}) lives on a {name} device; "
                                "this difftape program's storage is host memory: move it "
                                "there first (e.g. tensor.cpu(), a copy), or run on the "
                                "device (ti.init(arch=ti.cuda) takes CUDA arrays in place)")
        try:
            return np.from_dlpack(a)
        except (BufferError, TypeError, ValueError, RuntimeError) as e:
            raise DifftapeError(f"{what} ({type(a).__name__}) cannot be shared with NumPy "
                                f"through DLPack: {e}") from None
    if hasattr(a, "__array_interface__"):
        return np.asarray(a)
    raise DifftapeError(f"{what} must be an array (NumPy, ti.ndarray, or one exporting "
                        "__dlpack__ or __array_interface__: PyTorch, JAX), got "
                        f"{type(a).__name__}")


def array_in(a) -> np.ndarray:
    """``a`` as a NumPy array for copying in (``from_numpy``): a foreign array (PyTorch,
    JAX, DLPack or array-interface objects, also a tensor that autograd tracks) through
    :func:`as_numpy`, without an intermediate copy; anything else through ``np.asarray``
    (lists, scalars, NumPy arrays)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__dlpack__") or hasattr(a, "__array_interface__"):
        return as_numpy(a, "the array")
    return np.asarray(a)


def call_with_arrays(call: Callable, kernel: str, names: list[str], args: tuple,
                     indices: tuple[int, ...]):
    """``call(*args)`` with the foreign arrays among ``args[indices]`` replaced by NumPy views
    of their memory. A strided one is staged: a C-ordered copy for the call, copied back into
    the original afterwards (also when the call raises, so a partial write is visible as it is
    for contiguous arrays). Kept off the hot path: only called when such an array is passed."""
    args = list(args)
    staged: list[tuple[np.ndarray, np.ndarray]] = []
    for k in indices:
        a = args[k]
        if isinstance(a, np.ndarray | ArrayExchange | Storage):
            continue
        try:
            arr = as_numpy(a, f"argument '{names[k]}'")
        except DifftapeError as e:
            raise ArgumentError(f"kernel '{kernel}': Invalid type for argument {names[k]}, got "
                                f"{a!r:.60}: {e}", kernel=kernel) from None
        if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
            copy = np.ascontiguousarray(arr)
            if arr.flags.writeable:
                staged.append((arr, copy))
            else:
                copy.flags.writeable = False
            arr = copy
        args[k] = arr
    try:
        return call(*args)
    finally:
        for original, copy in staged:
            np.copyto(original, copy)


class ArrayExchange:
    """DLPack export and PyTorch/JAX copies for fields and ndarrays (mixed into both).

    ``__dlpack__``/``__dlpack_device__`` share the storage (``torch.from_dlpack(x)`` sees and
    makes writes without copying; sparse fields share their dense backing store, where
    inactive cells read 0): host memory on the CPU, CUDA memory on a grid program
    (``runtime/devicearrays.py``, which honours the consumer's ``stream``). ``to_torch``/
    ``to_jax`` return copies and ``from_torch``/``from_jax`` copy in, as Taichi's
    ``to_torch``/``from_torch`` do (like ``to_numpy``); on a grid program, to and from CUDA
    arrays, the copy is made on the device.
    """

    def _device_storage(self) -> Storage | None:
        """The storage when it is a grid program's device memory (the device paths below
        apply), else None (host storage; the client's remote arrays override this: they
        have no local storage)."""
        storage = self.storage
        return storage if not storage.host and _on_device(storage) else None

    def _dlpack_array(self) -> np.ndarray:
        # Host storage is shared; device storage has no host memory to share.
        return shared_array(self.storage, "__dlpack__")

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        program.get().wait_for_passes()  # (the consumer reads the storage as it is now)
        if self._device_storage() is not None:
            return devicearrays.export(self.storage, stream, max_version, dl_device, copy)
        kwargs = {k: v for k, v in (("stream", stream), ("max_version", max_version),
                                    ("dl_device", dl_device), ("copy", copy)) if v is not None}
        return self._dlpack_array().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self._device_storage() is not None:
            return (devicearrays.dlpack.CUDA, self.storage._owner.memory.ordinal)
        return (_DLPACK_CPU, 0)

    def to_torch(self, device=None, **kwargs):
        """A new PyTorch tensor holding a copy (on ``device``, the CPU by default). On a
        grid program, to a CUDA device: copied on the device, handed over by DLPack."""
        import torch

        if device is not None and not kwargs and self._device_storage() is not None and \
                torch.device(device).type == "cuda":
            program.get().wait_for_passes()  # (to_numpy waits on the host path)
            copy = devicearrays.device_copy(self.storage)
            ordinal = copy._owner.memory.ordinal
            capsule = devicearrays.export(
                copy, devicearrays.stream_handle(torch.cuda.current_stream(ordinal)))
            out = torch.utils.dlpack.from_dlpack(capsule)
            return out if out.device == torch.device(device) else out.to(device)
        out = torch.from_numpy(self.to_numpy(**kwargs))
        return out.to(device) if device is not None else out

    def from_torch(self, tensor) -> None:
        """Copy a PyTorch tensor in (any device; shapes must match as for from_numpy). A
        CUDA tensor into a grid program's storage is copied on the device."""
        if devicearrays.is_device_array(tensor) and self._device_storage() is not None:
            self._copy_device_array(tensor, "the tensor")
            return
        if getattr(tensor, "device", None) is not None and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        self.from_numpy(as_numpy(tensor, "the tensor"))

    def to_jax(self, **kwargs):
        """A new JAX array holding a copy, on JAX's default device: from a grid program to a
        JAX on the GPU, copied on the device and handed over by DLPack; to a JAX without a
        GPU backend (its default device the CPU), through the host, as ``to_torch()``."""
        import jax

        if not kwargs and self._device_storage() is not None and \
                jax.default_backend() == "gpu":
            program.get().wait_for_passes()  # (to_numpy waits on the host path)
            return jax.dlpack.from_dlpack(
                devicearrays.DeviceExport(devicearrays.device_copy(self.storage)))
        import jax.numpy as jnp

        return jnp.asarray(self.to_numpy(**kwargs))

    def from_jax(self, array) -> None:
        """Copy a JAX array in (a GPU one on the device, into a grid program's storage)."""
        if devicearrays.is_device_array(array) and self._device_storage() is not None:
            self._copy_device_array(array, "the JAX array")
            return
        self.from_numpy(as_numpy(array, "the JAX array"))

    def _copy_device_array(self, a, what: str) -> None:
        program.get().wait_for_passes()  # (from_numpy waits on the host path)
        storage = self.storage
        with devicearrays.borrowed(a, storage._owner, what) as source:
            if source.shape != storage.shape:
                raise DifftapeError(f"{what} has shape {source.shape}; the storage has "
                                    f"{storage.shape}")
            storage.copy_from(source)


def _on_device(storage: Storage) -> bool:
    """Is ``storage`` device memory that can be shared (a grid program's)?"""
    return hasattr(getattr(getattr(storage, "_owner", None), "memory", None), "pin")
