"""``ti.algorithms``: parallel sort and prefix sum over 1-D fields, as difftape kernels.

``parallel_sort(keys, values=None)`` sorts a field ascending in place (and permutes ``values``
alongside) with Batcher's odd-even merge sort: O(log² n) launches of one kernel, each a
parallel loop over disjoint compare-and-swap pairs, so no element is touched by two threads.
``PrefixSumExecutor(n).run(x)`` replaces the first ``n`` elements of ``x`` by their inclusive
prefix sums: each block of :data:`SCAN_BLOCK` elements is scanned serially (blocks in
parallel), the block totals are scanned, and each block adds the total of the blocks before it.
Everything runs in compiled kernels; Python only chooses the stages.
"""

from __future__ import annotations

from .errors import DifftapeError
from .frontend import ops
from .frontend.annotations import template
from .frontend.decorators import kernel
from .frontend.field import Field, ScalarFieldView, make_field
from .frontend.transformer import static
from .runtime import program

#: Elements per block of the prefix sum's first pass.
SCAN_BLOCK = 1024


def _check_1d(f, what: str, caller: str) -> None:
    if not isinstance(f, Field) or isinstance(f, ScalarFieldView) or f.element_shape:
        raise DifftapeError(f"{caller}: {what} must be a 1-D scalar field (ti.field(dtype, n)), "
                            f"got {type(f).__name__}")
    if len(f.shape) != 1:
        raise DifftapeError(f"{caller}: {what} must be a 1-D field, got shape {f.shape}")
    if f.sparse_terms:
        raise DifftapeError(f"{caller}: {what} is under a sparse SNode; use a dense field")
    if program.get().remote is not None:
        raise DifftapeError(f"{caller} is not supported under arch=ti.remote; run on ti.cpu")


@kernel
def _sort_stage(keys: template(), values: template(), with_values: template(), n: int,
                p: int, k: int, pairs: int, koff: int, voff: int):
    # Stage (p, k) of the odd-even merge sort: pair t compares elements a and a + k of the same
    # 2p-block. The pairs of one stage are disjoint, so the loop runs in parallel.
    for t in range(pairs):
        a = k % p + (t // k) * 2 * k + t % k
        b = a + k
        if b < n and a // (2 * p) == b // (2 * p):
            ka = keys[a + koff]
            kb = keys[b + koff]
            if kb < ka:
                keys[a + koff] = kb
                keys[b + koff] = ka
                if static(with_values):
                    va = values[a + voff]
                    values[a + voff] = values[b + voff]
                    values[b + voff] = va


def parallel_sort(keys, values=None) -> None:
    """``ti.algorithms.parallel_sort(keys, values=None)``: sort the 1-D field ``keys``
    ascending in place; ``values`` (a 1-D field of the same length), if given, is permuted
    the same way. The sort is not stable (equal keys may change order), as in Taichi."""
    _check_1d(keys, "keys", "parallel_sort")
    n = keys.shape[0]
    if values is not None:
        _check_1d(values, "values", "parallel_sort")
        if values.shape[0] != n:
            raise DifftapeError(f"parallel_sort: values has {values.shape[0]} elements, keys "
                                f"{n}: they are permuted together, so they need the same length")
    koff = keys.offset[0]
    voff = values.offset[0] if values is not None else 0
    p = 1
    while p < n:
        k = p
        while k >= 1:
            pairs = ((n - k - k % p) // (2 * k) + 1) * k
            if pairs > 0:
                _sort_stage(keys, keys if values is None else values, values is not None, n,
                            p, k, pairs, koff, voff)
            k //= 2
        p *= 2


@kernel
def _scan_blocks(x: template(), n: int, off: int, block: int, totals: template()):
    # Inclusive scan inside each block (blocks in parallel); each block's total to `totals`.
    for blk in range((n + block - 1) // block):
        acc = ops.cast(0, x.dtype)
        end = ops.min(n, (blk + 1) * block)
        for i in range(blk * block, end):
            acc += x[i + off]
            x[i + off] = acc
        totals[blk] = acc


@kernel
def _scan_totals(totals: template(), count: int):
    # Exclusive scan of the block totals, in order (there are n / SCAN_BLOCK of them).
    for _ in range(1):
        acc = ops.cast(0, totals.dtype)
        for b in range(count):
            t = totals[b]
            totals[b] = acc
            acc += t


@kernel
def _add_block_offsets(x: template(), n: int, off: int, block: int, totals: template()):
    for i in range(block, n):
        x[i + off] += totals[i // block]


class PrefixSumExecutor:
    """``ti.algorithms.PrefixSumExecutor(length)``: ``run(x)`` replaces the first ``length``
    elements of the 1-D field ``x`` by their inclusive prefix sums, in place. Integer sums wrap
    around as kernel arithmetic does. (Taichi offers it on CUDA and Vulkan for i32 only; here it
    runs on the CPU for any scalar type.)"""

    def __init__(self, length: int) -> None:
        if int(length) < 0:
            raise DifftapeError(f"PrefixSumExecutor: length must be >= 0, got {length}")
        self.sorting_length = int(length)
        self._totals: dict = {}  # per dtype: one total per block (a field of the program)

    def run(self, input_arr) -> None:
        _check_1d(input_arr, "the array", "PrefixSumExecutor.run")
        n = self.sorting_length
        if input_arr.shape[0] < n:
            raise DifftapeError(f"PrefixSumExecutor({n}).run: the field has only "
                                f"{input_arr.shape[0]} elements")
        if n == 0:
            return
        blocks = (n + SCAN_BLOCK - 1) // SCAN_BLOCK
        totals = self._totals.get(input_arr.dtype)
        if totals is None or totals._program is not program.get():  # (ti.init since)
            totals = self._totals[input_arr.dtype] = make_field(input_arr.dtype, shape=blocks)
        off = input_arr.offset[0]
        _scan_blocks(input_arr, n, off, SCAN_BLOCK, totals)
        if blocks > 1:
            _scan_totals(totals, blocks)
            _add_block_offsets(input_arr, n, off, SCAN_BLOCK, totals)


__all__ = ["parallel_sort", "PrefixSumExecutor"]
