"""The kernels through which Python scope reads and writes quantized fields
(frontend/quant.py's ``QuantStorage``): loads and stores in a kernel decode and encode, so
Python scope goes through the one implementation of the encodings (codegen/quant.py).

Imported on first use only (it defines kernels, which needs the frontend complete); no
``from __future__ import annotations`` here, so the kernels' annotations are objects, not
strings.
"""

from .annotations import NdarrayType, template
from .decorators import kernel
from .transformer import Grouped, static


@kernel
def quant_read(f: template(), out: NdarrayType()):
    """Every element of ``f`` into ``out`` (of ``f``'s shape; one element for a 0-d field)."""
    if static(len(f.shape) == 0):
        out[0] = f[None]
    else:
        for i in Grouped(f):
            out[i] = f[i]


@kernel
def quant_write(f: template(), values: NdarrayType(), mask: NdarrayType()):
    """``f[i] = values[i]`` where ``mask[i]`` is nonzero."""
    if static(len(f.shape) == 0):
        if mask[0]:
            f[None] = values[0]
    else:
        for i in Grouped(f):
            if mask[i]:
                f[i] = values[i]
