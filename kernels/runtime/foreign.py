"""Arrays of other libraries (PyTorch, JAX, anything with ``__dlpack__`` or
``__array_interface__``) as ``ti.types.ndarray()`` arguments, and DLPack for fields and
ndarrays.

A foreign array is turned into a NumPy array over the same memory (``np.from_dlpack``, or
``np.asarray`` for the array interface), so a kernel reads and writes the caller's tensor in
place: no copy. Two cases copy, once per launch, and say so here and in the README:

* a strided (non-contiguous) tensor: the kernel runs on a C-ordered copy, written back into
  the tensor after the launch (the generated code indexes arrays with their extents only);
* nothing else. Arrays on another device (CUDA, ...) are refused: difftape runs on the CPU, and
  moving them is the caller's decision (``t.cpu()``).

Read-only sources (JAX arrays are immutable) are passed read-only: a kernel that writes one is
refused at launch. Nothing here imports torch or jax.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import ArgumentError, DifftapeError
from .storage import shared_array

_DLPACK_CPU = 1
_DEVICE_NAMES = {2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 10: "ROCm",
                 13: "CUDA managed", 14: "oneAPI"}


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
                                "difftape kernels run on the CPU: move it there first "
                                "(e.g. tensor.cpu(), a copy)")
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
        if isinstance(a, np.ndarray | ArrayExchange):
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
    inactive cells read 0). ``to_torch``/``to_jax`` return copies and ``from_torch``/
    ``from_jax`` copy in, as Taichi's ``to_torch``/``from_torch`` do (like ``to_numpy``).
    """

    def _dlpack_array(self) -> np.ndarray:
        # Host storage is shared; device storage has no host memory to share.
        return shared_array(self.storage, "__dlpack__")

    def __dlpack__(self, *args, **kwargs):
        return self._dlpack_array().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DLPACK_CPU, 0)

    def to_torch(self, device=None, **kwargs):
        """A new PyTorch tensor holding a copy (on ``device``, the CPU by default)."""
        import torch

        out = torch.from_numpy(self.to_numpy(**kwargs))
        return out.to(device) if device is not None else out

    def from_torch(self, tensor) -> None:
        """Copy a PyTorch tensor in (any device; shapes must match as for from_numpy)."""
        if getattr(tensor, "device", None) is not None and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        self.from_numpy(as_numpy(tensor, "the tensor"))

    def to_jax(self, **kwargs):
        """A new JAX array holding a copy."""
        import jax.numpy as jnp

        return jnp.asarray(self.to_numpy(**kwargs))

    def from_jax(self, array) -> None:
        """Copy a JAX array in."""
        self.from_numpy(as_numpy(array, "the JAX array"))
