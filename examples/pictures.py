"""What the picture-making examples share: the command line, ``ti.init``, the GIF and the
loss curve.

Each example draws its frames with ``ti.GUI(show_gui=False)`` (headless, as in DiffTaichi)
and hands ``gui.get_image()`` to :class:`Frames`, which writes them through
``ti.tools.VideoManager`` as one GIF. The loss curve is drawn with Pillow, which difftape
already depends on for its images: a plot of one line with axes and ticks needs no plotting
library (matplotlib would be a large dependency for that alone).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import difftape as ti

#: Where the gallery of the README lives; the examples write there unless told otherwise.
IMAGES = Path(__file__).resolve().parent / "images"


def parser(doc: str, iters: int) -> argparse.ArgumentParser:
    """The options every example takes: ``--iters``, ``--out`` and ``--remote``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--iters", type=int, default=iters, help="optimisation iterations")
    ap.add_argument("--out", default=str(IMAGES),
                    help="directory for the GIF and the loss curve (default: examples/images)")
    ap.add_argument("--remote", action="store_true",
                    help="run on a difftape server (DIFFTAPE_SERVER, DIFFTAPE_TOKEN)")
    return ap


def init(remote: bool, **kwargs) -> None:
    """``ti.init`` on the CPU, or on the server named by DIFFTAPE_SERVER/DIFFTAPE_TOKEN."""
    ti.init(arch=ti.remote if remote else ti.cpu, **kwargs)


class Frames:
    """Frames of a ``ti.GUI`` collected into ``<out>/<name>.gif`` (through
    ``ti.tools.VideoManager``; its PNG frames are removed once the GIF is made)."""

    def __init__(self, out: str | os.PathLike, name: str, fps: int = 20) -> None:
        self.out = Path(out)
        self.name = name
        self.video = ti.tools.VideoManager(str(self.out / f".{name}-frames"),
                                           video_filename=name, framerate=fps,
                                           automatic_build=False)

    def add(self, gui: ti.GUI) -> None:
        """Take the GUI's current picture as the next frame and clear it for the next one."""
        self.video.write_frame(gui.get_image())
        gui.clear()

    def save(self) -> Path:
        """Write the GIF; returns its path."""
        self.video.make_video(mp4=False, gif=True)
        made = Path(self.video.get_output_filename(".gif"))
        path = self.out / f"{self.name}.gif"
        made.replace(path)
        shutil.rmtree(self.video.directory)
        return path


def window(res: tuple[int, int], left: float, bottom: float, width: float):
    """A map from world positions ((n, 2) arrays) to a ``ti.GUI``'s [0, 1]^2 that shows the
    world from ``(left, bottom)``, ``width`` wide, at the same scale along both axes."""
    scale = np.array([1 / width, res[0] / (res[1] * width)])
    origin = np.array([left, bottom])

    def view(p) -> np.ndarray:
        return (np.asarray(p, np.float64) - origin) * scale

    return view


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    span = hi - lo
    raw = span / n
    step = 10.0 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [k * step for k in range(first, int(math.floor(hi / step + 1e-9)) + 1)]


def _label(v: float) -> str:
    return f"{v:.3g}" if v != 0 else "0"


def plot_losses(losses: Sequence[float], path: str | os.PathLike, title: str,
                xlabel: str = "iteration", ylabel: str = "loss", log: bool = False,
                size: tuple[int, int] = (640, 400)) -> Path:
    """Draw ``losses`` against their index as a line with axes, ticks and a title into a
    PNG (Pillow; drawn at twice the size and scaled down, for smooth lines). ``log``: a
    logarithmic loss axis (for positive losses spanning orders of magnitude)."""
    from PIL import Image, ImageDraw, ImageFont

    y = np.asarray(losses, np.float64)
    if y.size == 0 or not np.all(np.isfinite(y)):
        raise ValueError(f"plot_losses: need finite losses, got {y!r}")
    if log:
        if np.any(y <= 0):
            raise ValueError("plot_losses: a logarithmic axis needs positive losses")
        y = np.log10(y)
    s = 2  # supersampling
    w, h = size[0] * s, size[1] * s
    left, right, top, bottom = 90 * s, 24 * s, 40 * s, 56 * s
    img = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13 * s)
    big = ImageFont.load_default(size=16 * s)

    lo, hi = float(y.min()), float(y.max())
    pad = 0.05 * (hi - lo) if hi > lo else max(abs(hi), 1.0) * 0.1
    lo, hi = lo - pad, hi + pad
    xmax = max(len(y) - 1, 1)

    def px(i: float, v: float) -> tuple[float, float]:
        return (left + (w - left - right) * i / xmax,
                h - bottom - (h - top - bottom) * (v - lo) / (hi - lo))

    grid, ink = (225, 225, 225), (40, 40, 40)
    ticks = _ticks(lo, hi)
    if log:  # powers of ten only
        decades = range(math.ceil(lo), math.floor(hi) + 1)
        every = max(1, math.ceil(len(decades) / 6))
        ticks = [float(e) for e in decades if e % every == 0] or ticks
    for v in ticks:
        _, yy = px(0, v)
        draw.line([(left, yy), (w - right, yy)], fill=grid, width=s)
        text = f"1e{v:.0f}" if log and v == int(v) else (f"{10 ** v:.2g}" if log else _label(v))
        draw.text((left - 8 * s, yy), text, fill=ink, font=font, anchor="rm")
    for i in _ticks(0, xmax):
        if i != int(i):
            continue
        xx, _ = px(i, lo)
        draw.line([(xx, top), (xx, h - bottom)], fill=grid, width=s)
        draw.text((xx, h - bottom + 8 * s), str(int(i)), fill=ink, font=font, anchor="mt")
    draw.rectangle([left, top, w - right, h - bottom], outline=ink, width=s)
    pts = [px(i, v) for i, v in enumerate(y)]
    if len(pts) == 1:
        pts = pts * 2
    draw.line(pts, fill=(31, 119, 180), width=3 * s, joint="curve")
    draw.text(((left + w - right) / 2, top / 2), title, fill=ink, font=big, anchor="mm")
    draw.text(((left + w - right) / 2, h - 14 * s), xlabel, fill=ink, font=font, anchor="mm")
    draw.text((12 * s, top / 2), ylabel, fill=ink, font=font, anchor="lm")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.resize(size, Image.LANCZOS).save(path, optimize=True)
    return path
