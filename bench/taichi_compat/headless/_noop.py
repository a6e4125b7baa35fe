"""Shared pieces of the headless stand-ins: a do-nothing object and a small PNG reader.

These modules replace display and image libraries (``matplotlib``, ``cv2``, ``imageio``) that
DiffTaichi's examples import but that neither the Taichi nor the difftape environment has.
Output calls (plots, windows, image writes) do nothing and record nothing; image *reads* are
real (PNG only) because their pixels feed the optimisation: both backends then get the same
input arrays. Anything else raises :class:`HeadlessUnavailable`, which the harness reports as
"cannot run headless" rather than as a difference between the backends.
"""

import struct
import zlib

import numpy as np


class HeadlessUnavailable(RuntimeError):
    """The example needs something the headless stand-ins do not provide."""


class Nothing:
    """Accepts any call, attribute, item or context use and does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return Nothing()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Nothing()

    def __getitem__(self, key):
        return Nothing()

    def __setitem__(self, key, value):
        pass

    def __iter__(self):
        return iter(())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def read_png(path: str | bytes) -> np.ndarray:
    """8-bit, non-interlaced PNG (grey, grey+alpha, RGB, RGBA) -> uint8 array (H, W[, C]);
    ``path`` a file's path or the file's bytes."""
    data = path if isinstance(path, bytes) else open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise HeadlessUnavailable(f"{path}: only PNG images can be read headless")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    width, height, depth, colour, _, _, interlace = header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(colour)
    if depth != 8 or channels is None or interlace:
        raise HeadlessUnavailable(f"{path}: PNG kind not supported headless")
    raw = zlib.decompress(idat)
    stride = width * channels
    out = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.int32)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if ftype == 0:
            cur = line
        elif ftype == 1:  # sub: a running sum along the row, per channel
            cur = np.cumsum(line.reshape(-1, channels), axis=0).reshape(-1) & 255
        elif ftype == 2:
            cur = (line + prev) & 255
        else:  # average, paeth depend on the left neighbour: byte by byte
            cur = np.zeros(stride, np.int32)
            for x in range(stride):
                a = cur[x - channels] if x >= channels else 0
                b = prev[x]
                c = prev[x - channels] if x >= channels else 0
                if ftype == 1:
                    pred = a
                elif ftype == 3:
                    pred = (a + b) >> 1
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (line[x] + pred) & 255
        out[y] = cur
        prev = cur
    img = out.reshape(height, width, channels)
    return img[:, :, 0] if channels == 1 else img


class NoGUI(Nothing):
    """``ti.GUI`` stand-in: draws, shows and records nothing; reports no events and a window
    that is never running (so a ``while gui.running`` loop ends at once)."""

    running = False

    def __init__(self, name="", res=512, *args, **kwargs):
        self.res = (res, res) if isinstance(res, int) else tuple(res)

    def get_event(self, *args, **kwargs):
        return False

    def get_events(self, *args, **kwargs):
        return ()

    def is_pressed(self, *args, **kwargs):
        return False


def rgb_to_hex(c) -> int:
    """``ti.rgb_to_hex``, the GUI's colour helper, for a backend without a GUI."""
    r, g, b = (min(255, max(0, int(float(v) * 255))) for v in c[:3])
    return (r << 16) | (g << 8) | b
