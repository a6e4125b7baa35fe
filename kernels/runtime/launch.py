"""What every target's launcher does after a launch: decode the launch context's error report.

The generated code reports a failed bounds check or assertion by writing its message's number
(1-based, ``ir.assertfmt.assert_messages``) into ``CtxLayout.err_code`` and the values its
message shows (the offending index, an ``assert``'s ``%d``/f-string values) into the slots from
``err_value`` on (host memory on the CPU, device memory on a GPU, read back after the
launch). :func:`raise_error_word` turns that report into the exception the CPU path raises, so
a GPU launch (and the simulated grid, ``runtime/simgrid.py``) names the index, field and line
the same way. On the CPU the report may also be ``STACK_REFUSED``: a thread's reverse-mode
stack was refused memory by the program's stack budget, whose refusal is raised
(``runtime/stackbudget.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from ..autodiff.validation import RULE_MARKER
from ..codegen.layout import STACK_REFUSED
from ..errors import GradientRuleError, IndexOutOfRangeError, KernelAssertionError
from ..ir.assertfmt import Message
from ..ir.passes.bounds import OUT_OF_RANGE
from .stackbudget import StackBudget


def raise_error_word(messages: list[Message], code: int, words: Sequence[int],
                     kernel: str, stacks: StackBudget | None = None,
                     ctx_address: int = 0) -> NoReturn:
    """Raise the error that code ``code`` (nonzero) with the value words ``words`` (the
    report's slots, as many as the message shows or more) stands for; ``STACK_REFUSED``:
    the refusal ``stacks`` (the program's stack budget) kept for the launch context at
    ``ctx_address``."""
    if code == STACK_REFUSED and stacks is not None:
        raise stacks.take_refusal(ctx_address, kernel)
    if not 0 < code <= len(messages):
        raise KernelAssertionError("assertion failed")
    message = messages[code - 1]
    msg = message.text(words)
    if msg.startswith(RULE_MARKER):
        raise GradientRuleError(msg[len(RULE_MARKER):], kernel=kernel)
    cls = IndexOutOfRangeError if message.template[0] == OUT_OF_RANGE else KernelAssertionError
    err = cls(msg)
    err.kernel = kernel  # which launch failed, also where the message is not read (a server's
    raise err            # problem response names it: on a grid, raised at a later sync)
