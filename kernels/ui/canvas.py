"""The canvas behind ``ti.GUI``: an RGBA float32 picture and the shapes drawn into it.

The picture is ``img[x, y, c]`` (``x`` to the right, ``y`` up, as ``ti.GUI`` indexes pixels),
values in [0, 1]. Shapes are rasterised the way Taichi 1.7.4's GUI canvas does it, step for
step in float32, so that a frame written here has the same bytes as Taichi's:

* a circle of radius ``r`` centred at ``c`` (in pixels) covers pixel ``(i, j)`` (measured at its
  corner point ``(i, j)``) with ``alpha = clamp(r - |c - (i, j)|, 0, 1)``;
* a line of radius ``r`` from ``a`` to ``b`` covers the pixel centre ``p = (i + .5, j + .5)``
  with ``alpha = clamp(r - d, 0, 1)``, ``d`` the distance from ``p`` to the segment (round caps);
* a pixel ``dest`` under a shape of colour ``col`` becomes ``(1 - alpha) * dest + alpha * col``,
  shape after shape in the order drawn;
* a triangle overwrites the pixels whose centre is inside it (edges included), no blending.

Text is the exception: Taichi renders it with stb_truetype and the Go font it ships, we with
Pillow's FreeType and Pillow's own default font, so text pixels differ (see :meth:`Canvas.text`).

Drawing is vectorised over all the shapes of one call: every (shape, pixel) pair inside the
shape's bounding box is an entry; the entries are blended in rounds, round ``k`` holding the
``k``-th shape to touch each pixel, so that every pixel sees its shapes in draw order.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
#: Taichi's ``1 / 255.0f``: colours are ``byte * (1 / 255)`` in float32, not ``byte / 255``.
INV255 = F32(1) / F32(255)
_ZERO = F32(0)
_ONE = F32(1)
_HALF = F32(0.5)


def hex_channels(color) -> np.ndarray:
    """A 0xRRGGBB colour (an int or an array of them) as float32 RGBA rows, opaque."""
    c = np.atleast_1d(np.asarray(color)).astype(np.int64)
    out = np.empty((c.shape[0], 4), F32)
    out[:, 0] = (c // 65536).astype(F32) * INV255
    out[:, 1] = (c // 256 % 256).astype(F32) * INV255
    out[:, 2] = (c % 256).astype(F32) * INV255
    out[:, 3] = F32(255) * INV255
    return out


def to_bytes(img: np.ndarray) -> np.ndarray:
    """The RGB bytes of an RGBA float picture ``img[x, y]`` as an image file stores them: rows
    top to bottom. Each channel is ``(uint8)(255 * clamp(v, 0, 1))`` in float32, truncated
    (NaN, which a degenerate line leaves, reads 0 as in Taichi's C++ on x86)."""
    v = F32(255) * np.clip(img[:, :, :3], _ZERO, _ONE)
    v = np.where(np.isnan(v), _ZERO, v)
    return np.ascontiguousarray(v.astype(np.uint8).swapaxes(0, 1)[::-1])


def _boxes(lo_x, hi_x, lo_y, hi_y):
    """Every pixel of the boxes ``[lo_x, hi_x] x [lo_y, hi_y]`` (inclusive, int64 arrays, one
    box per shape; empty where hi < lo): (shape index, i, j) of each, grouped by shape."""
    nx = np.maximum(hi_x - lo_x + 1, 0)
    ny = np.maximum(hi_y - lo_y + 1, 0)
    counts = nx * ny
    shape = np.repeat(np.arange(counts.shape[0]), counts)
    first = np.cumsum(counts) - counts
    local = np.arange(int(counts.sum()), dtype=np.int64) - first[shape]
    ny_s = ny[shape]
    return shape, lo_x[shape] + local // ny_s, lo_y[shape] + local % ny_s


def _finite(*arrays) -> np.ndarray:
    ok = np.ones(arrays[0].shape[0], bool)
    for a in arrays:
        ok &= np.isfinite(a).reshape(a.shape[0], -1).all(axis=1)
    return ok


class Canvas:
    """An RGBA float32 picture of ``res`` pixels and Taichi's GUI shapes drawn into it."""

    def __init__(self, res: tuple[int, int]) -> None:
        self.res = res
        self.img = np.zeros((res[0], res[1], 4), F32)

    # -- coordinates ---------------------------------------------------------------------
    def transform(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[0, 1]^2 -> pixels, as Taichi's canvas matrix ``diag(w, h, 1)`` applied to
        ``(x, y, 1)`` (the zero terms kept: an infinite coordinate spoils both axes)."""
        w, h = F32(self.res[0]), F32(self.res[1])
        x = np.asarray(x, F32)
        y = np.asarray(y, F32)
        return (w * x + _ZERO * y) + _ZERO, (_ZERO * x + h * y) + _ZERO

    # -- blending ------------------------------------------------------------------------
    def clear(self, color: int) -> None:
        self.img[...] = hex_channels(color)[0]

    def _blend(self, i, j, alpha, colors) -> None:
        """``dest = (1 - a) * dest + a * colour`` for each entry (pixel ``(i, j)``, alpha,
        colour row), entries of the same pixel in the order given."""
        keep = alpha != 0  # blending with alpha 0 leaves the pixel as it is, bit for bit
        if not keep.all():
            i, j, alpha, colors = i[keep], j[keep], alpha[keep], colors[keep]
        n = alpha.shape[0]
        if n == 0:
            return
        flat = self.img.reshape(-1, 4)
        pix = i * self.res[1] + j
        order = np.argsort(pix, kind="stable")
        sorted_pix = pix[order]
        starts = np.ones(n, bool)
        starts[1:] = sorted_pix[1:] != sorted_pix[:-1]
        first = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n) - first
        by_rank = np.argsort(rank, kind="stable")
        bounds = np.searchsorted(rank[by_rank], np.arange(rank.max() + 2))
        for k in range(len(bounds) - 1):
            sel = by_rank[bounds[k]:bounds[k + 1]]
            p = pix[sel]
            a = alpha[sel][:, None]
            flat[p] = (_ONE - a) * flat[p] + a * colors[sel]

    # -- shapes --------------------------------------------------------------------------
    def circles(self, x, y, radius, colors) -> None:
        """Circles at ``(x, y)`` in [0, 1]^2 (float32 arrays), radii in pixels, RGBA rows."""
        cx, cy = self.transform(x, y)
        r = np.broadcast_to(np.asarray(radius, F32), cx.shape)
        ok = _finite(cx, cy, r)
        w, h = self.res
        lo_x = np.where(ok, np.maximum(0, np.ceil(np.where(ok, cx - r, 0))), 1).astype(np.int64)
        lo_y = np.where(ok, np.maximum(0, np.ceil(np.where(ok, cy - r, 0))), 1).astype(np.int64)
        hi_x = np.where(ok, np.minimum(np.floor(np.where(ok, cx + r, 0)), w - 1), 0)
        hi_y = np.where(ok, np.minimum(np.floor(np.where(ok, cy + r, 0)), h - 1), 0)
        s, i, j = _boxes(lo_x, hi_x.astype(np.int64), lo_y, hi_y.astype(np.int64))
        dx = cx[s] - i.astype(F32)
        dy = cy[s] - j.astype(F32)
        dist = np.sqrt((_ZERO + dx * dx) + dy * dy)
        alpha = colors[s, 3] * np.clip(r[s] - dist, _ZERO, _ONE)
        self._blend(i, j, alpha, colors[s])

    def segments(self, ax, ay, bx, by, radius, colors) -> None:
        """Lines from ``(ax, ay)`` to ``(bx, by)`` in [0, 1]^2, radii in pixels, RGBA rows."""
        ax, ay = self.transform(ax, ay)
        bx, by = self.transform(bx, by)
        r = np.broadcast_to(np.asarray(radius, F32), ax.shape)
        ok = _finite(ax, ay, bx, by, r)
        w, h = self.res
        safe = lambda v: np.where(ok, v, _ZERO)  # noqa: E731
        ai_x = (safe(ax) + _HALF).astype(np.int64)  # C's truncating int cast
        ai_y = (safe(ay) + _HALF).astype(np.int64)
        bi_x = (safe(bx) + _HALF).astype(np.int64)
        bi_y = (safe(by) + _HALF).astype(np.int64)
        ri = np.ceil(safe(r) + _HALF).astype(np.int64)
        lo_x = np.where(ok, np.maximum(0, np.minimum(ai_x, bi_x) - ri), 1)
        lo_y = np.where(ok, np.maximum(0, np.minimum(ai_y, bi_y) - ri), 1)
        hi_x = np.where(ok, np.minimum(w - 1, np.maximum(ai_x, bi_x) + ri), 0)
        hi_y = np.where(ok, np.minimum(h - 1, np.maximum(ai_y, bi_y) + ri), 0)
        dx, dy = bx - ax, by - ay
        length = np.sqrt((_ZERO + dx * dx) + dy * dy)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = _ONE / length  # a zero-length line: NaN coverage, as in Taichi
        ux, uy = inv * dx, inv * dy
        s, i, j = _boxes(lo_x, hi_x, lo_y, hi_y)
        px = (i.astype(F32) + _HALF) - ax[s]
        py = (j.astype(F32) + _HALF) - ay[s]
        with np.errstate(invalid="ignore"):
            u = (_ZERO + (-uy[s]) * px) + ux[s] * py
            v = (_ZERO + ux[s] * px) + uy[s] * py
            v = np.where(v > 0, np.maximum(_ZERO, v - length[s]), v)
            dist = np.sqrt((_ZERO + u * u) + v * v)
            alpha = colors[s, 3] * _clamp01(r[s] - dist)
        self._blend(i, j, alpha, colors[s])

    def triangles(self, a, b, c, colors) -> None:
        """Filled triangles (corner arrays of shape (n, 2) in [0, 1]^2), RGBA rows."""
        ax, ay = self.transform(a[:, 0], a[:, 1])
        bx, by = self.transform(b[:, 0], b[:, 1])
        cx, cy = self.transform(c[:, 0], c[:, 1])
        ok = _finite(ax, ay, bx, by, cx, cy)
        w, h = self.res
        safe = lambda v: np.where(ok, v, _ZERO)  # noqa: E731
        lo_x = np.floor(safe(np.minimum(ax, np.minimum(bx, cx)))).astype(np.int64)
        lo_y = np.floor(safe(np.minimum(ay, np.minimum(by, cy)))).astype(np.int64)
        hi_x = np.ceil(safe(np.maximum(ax, np.maximum(bx, cx)))).astype(np.int64) - 1
        hi_y = np.ceil(safe(np.maximum(ay, np.maximum(by, cy)))).astype(np.int64) - 1
        lo_x = np.where(ok, np.maximum(lo_x, 0), 1)
        lo_y = np.where(ok, np.maximum(lo_y, 0), 1)
        hi_x = np.where(ok, np.minimum(hi_x, w - 1), 0)
        hi_y = np.where(ok, np.minimum(hi_y, h - 1), 0)
        s, i, j = _boxes(lo_x, hi_x, lo_y, hi_y)
        px = i.astype(F32) + _HALF
        py = j.astype(F32) + _HALF

        def outside(p0x, p0y, p1x, p1y):  # cross(p - p0, p1 - p0) <= 0
            return ((px - p0x[s]) * (p1y[s] - p0y[s]) - (py - p0y[s]) * (p1x[s] - p0x[s])) <= 0

        in_a = outside(ax, ay, bx, by)
        in_b = outside(bx, by, cx, cy)
        in_c = outside(cx, cy, ax, ay)
        inside = (in_a == in_b) & (in_a == in_c)
        s, i, j = s[inside], i[inside], j[inside]
        # the last triangle drawn over a pixel wins
        pix = i * h + j
        last = np.unique(pix[::-1], return_index=True)[1]
        keep = pix.shape[0] - 1 - last
        self.img[i[keep], j[keep]] = colors[s[keep]]

    def text(self, content: str, x: float, y: float, size: float, rgb) -> None:
        """``content`` with its top left corner at ``(x, y)`` in [0, 1]^2, ``size`` pixels
        from the font's ascender to its descender, colour ``rgb`` (floats in [0, 1]).

        Laid out as Taichi lays it (two pixels of left padding, the baseline ``ascent`` below
        the top) but drawn with Pillow's default scalable font, so the glyphs' pixels differ
        from Taichi's (stb_truetype and its Go font)."""
        from PIL import Image, ImageDraw, ImageFont  # Function-level: Pillow, for text only

        px, py = self.transform(np.asarray([x]), np.asarray([y]))
        dx, dy = int(px[0]), int(py[0])
        w, h = self.res
        probe = ImageFont.load_default(size=100)
        ascent, descent = probe.getmetrics()
        font = ImageFont.load_default(size=max(1.0, float(size) * 100 / (ascent + descent)))
        baseline = int(font.getmetrics()[0])
        mask = Image.new("L", (w, h), 0)
        ImageDraw.Draw(mask).text((2, baseline), content, fill=255, font=font, anchor="ls")
        cover = np.asarray(mask, np.uint8)  # rows from the top
        rows, cols = np.nonzero(cover)
        i = dx + cols
        j = dy - 1 - rows
        inside = (i >= 0) & (i < w) & (j >= 0) & (j < h)
        alpha = cover[rows, cols][inside].astype(F32) / F32(255)
        color = np.array([*rgb, 1.0], F32)
        self._blend(i[inside].astype(np.int64), j[inside].astype(np.int64), alpha,
                    np.broadcast_to(color, (alpha.shape[0], 4)))


def _clamp01(v: np.ndarray) -> np.ndarray:
    """C's ``clamp(v, 0, 1)`` (comparisons, so NaN stays NaN, as np.clip does too)."""
    return np.clip(v, _ZERO, _ONE)
