"""What every target's launcher does after a launch: decode the launch context's error word.

The generated code reports a failed bounds check or assertion by writing its message's number
(1-based, ``llvm_lowering.assert_messages``) into ``CtxLayout.err_code`` and the offending
value into ``err_value`` (host memory on the CPU, device memory on a GPU, read back after the
launch). :func:`raise_error_word` turns that pair into the exception the CPU path raises, so a
GPU launch (and the simulated grid, ``runtime/simgrid.py``) names the index, field and line
the same way.
"""

from __future__ import annotations

from typing import NoReturn

from ..autodiff.validation import RULE_MARKER
from ..errors import GradientRuleError, IndexOutOfRangeError, KernelAssertionError
from ..ir.passes.bounds import OUT_OF_RANGE


def raise_error_word(messages: list[str], code: int, value: int, kernel: str) -> NoReturn:
    """Raise the error that code ``code`` (nonzero) with value ``value`` stands for."""
    msg = messages[code - 1] if 0 < code <= len(messages) else "assertion failed"
    if msg.startswith(RULE_MARKER):
        raise GradientRuleError(msg[len(RULE_MARKER):], kernel=kernel)
    cls = IndexOutOfRangeError if msg.startswith(OUT_OF_RANGE) else KernelAssertionError
    raise cls(msg.replace("{}", str(value), 1))
