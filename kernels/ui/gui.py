"""``ti.GUI``: Taichi's immediate-mode 2-D GUI, headless.

Programs draw circles, lines, triangles, text and images into a canvas and call
``gui.show(path)`` to write the frame; :mod:`difftape.ui.canvas` rasterises exactly as Taichi
1.7.4 does, so the frames are Taichi's (text aside). There are no windows: ``show_gui=True``
(Taichi's default) is refused with the advice Taichi gives on a machine without a display,
``ti.GUI(..., show_gui=False)`` or ``TI_GUI_SHOW=0`` in the environment (which Taichi also
reads). Without a window there are no events: ``get_event`` is False, ``get_events`` empty,
``running`` stays True until the program sets it to False.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterator

import numpy as np

from ..errors import ImageError, MediaError
from ..frontend.field import Field, MatrixField, ScalarField
from ..frontend.ndarray import Ndarray
from .canvas import F32, Canvas, hex_channels, to_bytes
from .image import cook_image, write_rgb

__all__ = ["GUI", "hex_to_rgb", "rgb_to_hex"]


def _env_flag(key: str, default: bool) -> bool:
    """Taichi's ``TI_GUI_SHOW``-style switches: an integer in the environment overrides."""
    if key not in os.environ:
        return default
    return bool(int(os.environ[key]))


def _points(a, name: str) -> np.ndarray:
    """An (n, 2) or (n, 2, 1) array of positions (NumPy, a field or an ndarray) as float32."""
    if isinstance(a, (Field, Ndarray)):
        a = a.to_numpy()
    a = np.asarray(a)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim != 2 or a.shape[1] != 2:
        raise ImageError(f"ti.GUI: {name} must be an array of 2-D positions of shape (n, 2), "
                         f"not {a.shape}")
    return np.ascontiguousarray(a.astype(F32))


def _colors(color, n: int, name: str = "color") -> np.ndarray:
    """One 0xRRGGBB colour or an array of n of them -> (n, 4) float32 RGBA rows."""
    if isinstance(color, np.ndarray):
        if color.shape != (n,):
            raise ImageError(f"ti.GUI: {name} must be one colour or an array of shape ({n},), "
                             f"not {color.shape}")
        return hex_channels(color.astype(np.uint32))
    if isinstance(color, numbers.Integral) and not isinstance(color, bool):
        return np.repeat(hex_channels(int(color)), n, axis=0)
    raise ImageError(f"ti.GUI: {name} must be an int (e.g. 0x956333) or an array of them, "
                     f"not {type(color).__name__}")


def _radii(radius, n: int) -> np.ndarray:
    if isinstance(radius, np.ndarray):
        if radius.shape != (n,):
            raise ImageError(f"ti.GUI: radius must be a number or an array of shape ({n},), "
                             f"not {radius.shape}")
        return radius.astype(F32)
    if isinstance(radius, numbers.Number):
        return np.full(n, radius, F32)
    raise ImageError(f"ti.GUI: radius must be a number or an array of them, "
                     f"not {type(radius).__name__}")


class GUI:
    """Taichi's ``ti.GUI(name, res, background_color, show_gui, fullscreen, fast_gui)``:
    a ``res`` canvas (an int is a square) cleared to ``background_color``; positions are in
    [0, 1]^2 with the origin at the bottom left, radii and widths in pixels."""

    class Event:
        """A GUI event (there are none without a window; for programs that build them)."""

        def __init__(self) -> None:
            self.type = None
            self.modifier = None
            self.pos = None
            self.key = None
            self.delta = None

    class WidgetValue:
        """The value of a slider or label (no window: it changes only when set)."""

        def __init__(self, value: float) -> None:
            self.value = value

    # Taichi's key and event names, for programs that compare events against them.
    SHIFT, ALT, CTRL, ESCAPE, RETURN, TAB = "Shift", "Alt", "Control", "Escape", "Return", "Tab"
    BACKSPACE, SPACE, UP, DOWN, LEFT, RIGHT = "BackSpace", " ", "Up", "Down", "Left", "Right"
    CAPSLOCK, LMB, MMB, RMB = "Caps_Lock", "LMB", "MMB", "RMB"
    EXIT, WHEEL, MOVE = "WMClose", "Wheel", "Motion"
    MOTION, PRESS, RELEASE = "Move", "Press", "Release"

    def __init__(self, name: str = "Taichi", res=512, background_color: int = 0x0,
                 show_gui: bool = True, fullscreen: bool = False, fast_gui: bool = False) -> None:
        show_gui = _env_flag("TI_GUI_SHOW", show_gui)
        fullscreen = _env_flag("TI_GUI_FULLSCREEN", fullscreen)
        fast_gui = _env_flag("TI_GUI_FAST", fast_gui)
        if show_gui:
            where = ("this machine has no display (DISPLAY is not set)"
                     if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY")
                     else "difftape has no window support")
            raise MediaError(
                f"ti.GUI({name!r}) cannot open a window: {where}. difftape's GUI draws "
                "headless: pass show_gui=False (or set TI_GUI_SHOW=0) and write the frames "
                "with gui.show('frame.png').")
        if isinstance(res, numbers.Number):
            res = (res, res)
        res = tuple(int(v) for v in res)
        if len(res) != 2 or min(res) < 1:
            raise ImageError(f"ti.GUI: res must be a size or a (width, height) pair, not {res}")
        self.name = name
        self.res = res
        self.show_gui = show_gui
        self.fullscreen = fullscreen
        self.fast_gui = fast_gui
        self.canvas = Canvas(res)
        if fast_gui:
            self.img = np.zeros(res[0] * res[1], np.uint32)
        else:
            self.img = np.zeros(res + (4,), F32)
        self.background_color = background_color
        self.key_pressed: set[str] = set()
        self.event = None
        self.frame = 0
        self._fps_limit: float | None = 60.0
        self._running = True
        self._widgets = 0
        self.clear()

    def __enter__(self) -> GUI:
        return self

    def __exit__(self, e_type, val, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<ti.GUI {self.name!r} {self.res[0]}x{self.res[1]}, frame {self.frame}, "
                f"headless>")

    def close(self) -> None:
        """Close the GUI: ``running`` becomes False."""
        self._running = False

    # -- widgets: no window to draw them in, so they hold their values ------------------------
    def slider(self, text: str, minimum: float, maximum: float, step: float = 1) -> WidgetValue:
        """A slider's value (``minimum`` until the program sets ``.value``)."""
        return GUI.WidgetValue(float(minimum))

    def label(self, text: str) -> WidgetValue:
        """A label's value (0 until set)."""
        return GUI.WidgetValue(0.0)

    def button(self, text: str, event_name: str | None = None) -> str:
        """The event name a click would send (there are no clicks without a window)."""
        return event_name or f"WidgetButton_{text}"

    # -- drawing ---------------------------------------------------------------------------
    def clear(self, color: int | None = None) -> None:
        """Fill the canvas with ``color`` (default: the background colour)."""
        self.canvas.clear(self.background_color if color is None else color)

    def cook_image(self, img: np.ndarray) -> np.ndarray:
        """A (w, h[, 1..4]) NumPy image as the RGBA float32 picture ``set_image`` shows:
        unsigned integers scaled by their maximum, floats as they are."""
        return cook_image(img, self.res)

    def get_image(self) -> np.ndarray:
        """The canvas as an RGBA float32 array ``[x, y, c]`` (with ``fast_gui``: the packed
        0xRRGGBB pixels of the last ``set_image``)."""
        if not self.fast_gui:
            self.img = np.ascontiguousarray(self.img)
            self.img[...] = self.canvas.img
        return self.img

    def set_image(self, img) -> None:
        """Show ``img`` (a field, ndarray or NumPy array of the GUI's resolution: grey, RG, RGB
        or RGBA; unsigned integers scaled by their maximum, floats in [0, 1]) on the canvas.
        ``img[i, j]`` is the pixel ``i`` from the left and ``j`` from the bottom."""
        if self.fast_gui:
            self._set_fast_image(img)
            return
        if isinstance(img, ScalarField | MatrixField):
            arr = img.to_numpy()
            vector = isinstance(img, MatrixField)
            if vector and (img.m != 1 or img.n not in (2, 3, 4)):
                raise ImageError("ti.GUI.set_image: only grey, RG, RGB or RGBA images "
                                 f"(vector fields of 2 to 4 entries), not {img.n}x{img.m}")
            if arr.dtype.kind == "f" and (vector or arr.ndim == 2):
                # Taichi copies float fields into the picture channel by channel, leaving
                # the channels it does not write (alpha) as they were.
                if tuple(arr.shape[:2]) != self.res:
                    raise ImageError(f"ti.GUI.set_image: image resolution {arr.shape[:2]} does "
                                     f"not match the GUI resolution {self.res}")
                arr = arr.astype(F32)
                if vector:
                    self.img[:, :, :arr.shape[2]] = arr
                    if arr.shape[2] <= 2:
                        self.img[:, :, 2] = 0
                else:
                    self.img[:, :, :3] = arr[:, :, None]
            else:
                self.img = self.cook_image(arr)
        elif isinstance(img, Ndarray):
            self.img = self.cook_image(img.to_numpy())
        elif isinstance(img, np.ndarray):
            self.img = self.cook_image(img)
        else:
            raise ImageError("ti.GUI.set_image takes a field, an ndarray or a NumPy array, "
                             f"not {type(img).__name__}")
        self.canvas.img[...] = self.img

    def _set_fast_image(self, img) -> None:
        """``fast_gui``: the picture packed as 0xRRGGBB words, row by row from the top."""
        if not isinstance(img, MatrixField):
            raise ImageError("ti.GUI.set_image with fast_gui=True takes a ti.Vector.field")
        arr = img.to_numpy()
        if tuple(arr.shape[:2]) != self.res:
            raise ImageError(f"ti.GUI.set_image: image resolution {arr.shape[:2]} does not "
                             f"match the GUI resolution {self.res}")
        if img.m != 1 or img.n not in (3, 4):
            raise ImageError("ti.GUI.set_image with fast_gui=True takes RGB or RGBA vector "
                             "fields only")
        if arr.dtype == np.uint8:
            rgb = arr[:, :, :3].astype(np.int64)
        elif arr.dtype.kind == "f" and arr.dtype.itemsize >= 4:
            rgb = np.clip((arr[:, :, :3] * arr.dtype.type(255)).astype(np.int32), 0, 255)
        else:
            raise ImageError("ti.GUI.set_image with fast_gui=True takes f32, f64 or u8 fields, "
                             f"not {arr.dtype}")
        rgb = rgb[:, ::-1].astype(np.uint32)  # rows from the top
        packed = (rgb[:, :, 0] << 16) + (rgb[:, :, 1] << 8) + rgb[:, :, 2]
        self.img = np.ascontiguousarray(packed.T).reshape(-1)

    def circle(self, pos, color: int = 0xFFFFFF, radius: float = 1) -> None:
        """A circle at ``pos`` ([0, 1]^2) of ``radius`` pixels."""
        self._check_canvas()
        self.canvas.circles(np.asarray([pos[0]], F32), np.asarray([pos[1]], F32),
                            np.asarray([radius], F32), _colors(color, 1))

    def circles(self, pos, radius=1, color=0xFFFFFF, palette=None,
                palette_indices=None) -> None:
        """Circles at the rows of ``pos`` (n, 2); ``radius`` and ``color`` one for all or one
        per circle, or colours picked from ``palette`` by ``palette_indices``."""
        self._check_canvas()
        pos = _points(pos, "pos")
        n = pos.shape[0]
        colors = _colors(color, n)
        if palette is not None:
            if palette_indices is None:
                raise ImageError("ti.GUI.circles: palette must be used together with "
                                 "palette_indices")
            if isinstance(palette_indices, Field | Ndarray):
                palette_indices = palette_indices.to_numpy()
            ind = np.asarray(palette_indices)
            if not np.issubdtype(ind.dtype, np.integer) or ind.shape != (n,):
                raise ImageError(f"ti.GUI.circles: palette_indices must be {n} integers")
            if n and (ind.min() < 0 or ind.max() >= len(palette)):
                raise ImageError("ti.GUI.circles: palette_indices out of the palette's range")
            colors = hex_channels(np.asarray(palette, np.uint32)[ind])
        self.canvas.circles(pos[:, 0], pos[:, 1], _radii(radius, n), colors)

    def line(self, begin, end, radius: float = 1, color: int = 0xFFFFFF) -> None:
        """A line from ``begin`` to ``end`` ([0, 1]^2), ``radius`` pixels wide each side."""
        self._check_canvas()
        self.canvas.segments(np.asarray([begin[0]], F32), np.asarray([begin[1]], F32),
                             np.asarray([end[0]], F32), np.asarray([end[1]], F32),
                             np.asarray([radius], F32), _colors(color, 1))

    def lines(self, begin, end, radius=1, color=0xFFFFFF) -> None:
        """Lines from the rows of ``begin`` to those of ``end`` ((n, 2) each)."""
        self._check_canvas()
        begin, end = _points(begin, "begin"), _points(end, "end")
        if begin.shape != end.shape:
            raise ImageError(f"ti.GUI.lines: begin {begin.shape} and end {end.shape} differ")
        n = begin.shape[0]
        # Taichi nudges each end point right by 1e-6 * (i % 18 + 6) (in double, then float).
        bx = (end[:, 0].astype(np.float64) + 1e-6 * (np.arange(n) % 18 + 6)).astype(F32)
        self.canvas.segments(begin[:, 0], begin[:, 1], bx, end[:, 1], _radii(radius, n),
                             _colors(color, n))

    def triangle(self, a, b, c, color: int = 0xFFFFFF) -> None:
        """A filled triangle with corners ``a``, ``b``, ``c`` ([0, 1]^2)."""
        self._check_canvas()
        pts = [np.asarray([[p[0], p[1]]], F32) for p in (a, b, c)]
        self.canvas.triangles(*pts, _colors(color, 1))

    def triangles(self, a, b, c, color=0xFFFFFF) -> None:
        """Filled triangles with corners at the rows of ``a``, ``b``, ``c`` ((n, 2) each)."""
        self._check_canvas()
        a, b, c = _points(a, "a"), _points(b, "b"), _points(c, "c")
        if not a.shape == b.shape == c.shape:
            raise ImageError("ti.GUI.triangles: a, b and c must have the same shape")
        self.canvas.triangles(a, b, c, _colors(color, a.shape[0]))

    def rect(self, topleft, bottomright, radius: float = 1, color: int = 0xFFFFFF) -> None:
        """The outline of the rectangle between two corners, as four lines."""
        a = topleft[0], topleft[1]
        b = bottomright[0], topleft[1]
        c = bottomright[0], bottomright[1]
        d = topleft[0], bottomright[1]
        for p, q in ((a, b), (b, c), (c, d), (d, a)):
            self.line(p, q, radius, color)

    @staticmethod
    def _arrow_to_lines(orig, major, tip_scale=0.2, angle=45):
        angle = math.radians(180 - angle)
        c, s = math.cos(angle), math.sin(angle)
        minor1 = np.stack([major[:, 0] * c - major[:, 1] * s, major[:, 0] * s + major[:, 1] * c], 1)
        minor2 = np.stack([major[:, 0] * c + major[:, 1] * s, -major[:, 0] * s + major[:, 1] * c],
                          1)
        end = orig + major
        return [(orig, end), (end, end + minor1 * tip_scale), (end, end + minor2 * tip_scale)]

    def arrows(self, orig, direction, radius=1, color=0xFFFFFF, **kwargs) -> None:
        """Arrows from the rows of ``orig`` along those of ``direction``."""
        orig, direction = np.asarray(orig), np.asarray(direction)
        for begin, end in self._arrow_to_lines(orig, direction, **kwargs):
            self.lines(begin, end, radius, color)

    def arrow(self, orig, direction, radius: float = 1, color: int = 0xFFFFFF, **kwargs) -> None:
        """One arrow from ``orig`` along ``direction``."""
        for begin, end in self._arrow_to_lines(np.array([orig]), np.array([direction]),
                                               **kwargs):
            self.line(begin[0], end[0], radius, color)

    def text(self, content: str, pos, font_size: float = 15, color: int = 0xFFFFFF) -> None:
        """``content`` with its top left corner at ``pos``; ``font_size`` pixels high. The
        glyphs are Pillow's default font, not Taichi's (their pixels differ)."""
        self._check_canvas()
        r, g, b = hex_to_rgb(color)
        self.canvas.text(str(content), pos[0], pos[1], float(font_size), (r, g, b))

    def _check_canvas(self) -> None:
        if self.fast_gui:
            raise ImageError("ti.GUI(fast_gui=True) shows only the picture of set_image; "
                             "draw shapes on a GUI without fast_gui")

    # -- frames ----------------------------------------------------------------------------
    def show(self, file: str | None = None) -> None:
        """End the frame: write it to ``file`` (.png, .bmp or .jpg) if given, then clear the
        canvas to the background colour. With ``fast_gui`` the file holds the set_image
        picture (what Taichi's window would show)."""
        if file:
            if self.fast_gui:
                packed = self.img.reshape(self.res[1], self.res[0])  # rows from the top
                rgb = np.stack([(packed >> 16) & 255, (packed >> 8) & 255, packed & 255], 2)
                write_rgb(file, np.ascontiguousarray(rgb.astype(np.uint8)))
            else:
                write_rgb(file, to_bytes(self.canvas.img))
        self.frame += 1
        self.clear()

    # -- events: none without a window -------------------------------------------------------
    def has_key_event(self) -> bool:
        """Always False: no window, no events."""
        return False

    def get_event(self, *e_filter) -> bool:
        """Always False: no window, no events."""
        return False

    def get_events(self, *e_filter) -> Iterator[Event]:
        """No events (an empty iterator)."""
        return iter(())

    def is_pressed(self, *keys) -> bool:
        """Always False: no keys are pressed without a window."""
        return False

    def get_cursor_pos(self) -> tuple[float, float]:
        """(0, 0): there is no mouse without a window."""
        return 0.0, 0.0

    @property
    def running(self) -> bool:
        """True until the program sets it to False (or closes the GUI)."""
        return self._running

    @running.setter
    def running(self, value: bool) -> None:
        self._running = bool(value)

    @property
    def fps_limit(self) -> float | None:
        """The frame rate limit (frames are written as fast as the program makes them: a
        window would wait between frames, files do not)."""
        return self._fps_limit

    @fps_limit.setter
    def fps_limit(self, value: float | None) -> None:
        self._fps_limit = None if value is None or value == 0 else float(value)


def rgb_to_hex(c) -> int:
    """``ti.rgb_to_hex``: (r, g, b) floats in [0, 1] (scalars or arrays) -> 0xRRGGBB."""

    def byte(v):
        return np.clip(np.int32(np.asarray(v) * 255), 0, 255)

    return (byte(c[0]) << 16) + (byte(c[1]) << 8) + byte(c[2])


def hex_to_rgb(color: int) -> tuple[float, float, float]:
    """``ti.hex_to_rgb``: 0xRRGGBB -> (r, g, b) floats in [0, 1]."""
    color = int(color)
    return ((color >> 16) & 0xFF) / 255, ((color >> 8) & 0xFF) / 255, (color & 0xFF) / 255
