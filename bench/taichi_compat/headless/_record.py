"""Recording stand-ins for ``ti.GUI`` and ``ti.ui`` (GGUI), used by ``bench/taichi_examples.py``
on both backends (Taichi's GGUI needs Vulkan, which is not here): every array a program hands
to them is kept, per frame, so that two runs can be compared by *what they draw*.

A frame ends at ``gui.show()`` / ``window.show()``; ``ti.tools.imshow(img)`` is a frame of its
own. Each drawing call is recorded as ``(name, {argument: value})``: positional arguments under
their position ("0", "1" ...), keyword arguments under their names; fields, ndarrays and Taichi
vectors as ``to_numpy()`` taken at the call, sequences of numbers as arrays, other values as
they are (strings, numbers) or as their type's name. ``running`` turns False once ``frames``
frames are shown; a ``show()`` after that raises :class:`FramesDone`, which ends the program
(for loops that never look at ``running``). Events: none; keys: never pressed; the cursor: the
window's centre; GGUI widgets return the value they are given (the program's defaults).
:meth:`Recorder.save` pickles the shown frames (after :class:`FramesDone`, a frame begun but
not shown is dropped). While a recorder is installed, the headless ``matplotlib.pyplot``
stand-in records its drawing calls (``plt.plot``, ``plt.imshow`` ...) here too.
"""

import contextlib
import pickle
import sys
import types

import numpy as np
from _noop import HeadlessUnavailable, Nothing, rgb_to_hex


class FramesDone(BaseException):
    """The program showed the frames it was allowed (a BaseException: ``except Exception`` in
    a program does not swallow it)."""


#: Key and event names, for ``ti.GUI.X`` and ``ti.ui.X`` (distinct values are all that matters).
KEYS = ("ESCAPE", "SHIFT", "ALT", "CTRL", "BACKSPACE", "RETURN", "SPACE", "UP", "DOWN", "LEFT",
        "RIGHT", "CAPSLOCK", "TAB", "LMB", "MMB", "RMB", "EXIT", "WHEEL", "MOVE", "MOTION",
        "PRESS", "RELEASE")


def value(v):
    """What is recorded of an argument: see the module's docstring."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Nothing):
        raise HeadlessUnavailable("the program draws a value made by a headless stand-in "
                                  "(a matplotlib colour map?), not by the program")
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.copy()
    if hasattr(v, "to_numpy"):
        return np.asarray(v.to_numpy())
    if isinstance(v, (list, tuple)):
        items = [value(x) for x in v]
        if all(isinstance(x, (bool, int, float, np.ndarray)) for x in items):
            try:
                return np.asarray(items, dtype=np.float64)
            except ValueError:  # ragged
                pass
        return tuple(items)
    return f"<{type(v).__name__}>"


class Recorder:
    def __init__(self, frames: int) -> None:
        self.limit = frames
        self.shown: list[list] = []
        self.current: list = []

    def add(self, name: str, args: tuple, kwargs: dict) -> None:
        values = {str(i): value(a) for i, a in enumerate(args)}
        values.update({k: value(v) for k, v in kwargs.items()})
        self.current.append((name, values))

    @property
    def running(self) -> bool:
        return len(self.shown) < self.limit

    def show(self) -> None:
        if not self.running:
            raise FramesDone
        self.shown.append(self.current)
        self.current = []

    def save(self, path: str, complete: bool) -> None:
        """Write the shown frames; with ``complete`` (the program ended by itself), also what
        it drew after its last ``show()`` (a plot shown by ``plt.show()``, or drawn and never
        shown) as a last frame."""
        frames = self.shown + ([self.current] if complete and self.current else [])
        with open(path, "wb") as f:
            pickle.dump(frames, f)


RECORDER = Recorder(0)


def plot_call(name: str):
    """A ``matplotlib.pyplot`` drawing function that records its arguments (the headless
    pyplot stand-in asks for these while a recorder is installed)."""
    def call(*args, **kwargs):
        RECORDER.add(f"plt.{name}", args, kwargs)
    return call


def _recording(prefix: str, name: str):
    def call(self, *args, **kwargs):
        RECORDER.add(f"{prefix}.{name}", args, kwargs)
    call.__name__ = name
    return call


class _Shows:
    """``running`` (settable: programs end their loop with ``gui.running = False``), ``show``."""

    _stopped = False

    @property
    def running(self) -> bool:
        return RECORDER.running and not self._stopped

    @running.setter
    def running(self, v: bool) -> None:
        self._stopped = not v

    def show(self, *args, **kwargs) -> None:
        RECORDER.show()

    @property
    def frame(self) -> int:
        return len(RECORDER.shown)

    def get_event(self, *args, **kwargs):
        return False

    def get_events(self, *args, **kwargs):
        return []

    def is_pressed(self, *args, **kwargs) -> bool:
        return False

    def get_cursor_pos(self) -> tuple[float, float]:
        return (0.5, 0.5)

    event = None


class _Widget:
    def __init__(self, value) -> None:
        self.value = value


class GUI(_Shows):
    """``ti.GUI``: drawing calls are recorded (any method not listed here too)."""

    def __init__(self, name="", res=512, background_color=0, show_gui=True, **kwargs):
        self.res = (res, res) if isinstance(res, int) else tuple(res)
        self.fps_limit = kwargs.get("fps_limit", 60)
        RECORDER.add("gui.GUI", (), {"res": self.res, "background_color": background_color})

    def slider(self, text, minimum, maximum, step=1):
        return _Widget(minimum)

    def label(self, text):
        return _Widget(0)

    def button(self, text, event_name=None):
        return event_name or text

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return types.MethodType(_recording("gui", name), self)


for _k in KEYS:
    setattr(GUI, _k, _k)


class _SubWindow:
    """``window.get_gui()`` and its ``sub_window``: widgets return the value they are given."""

    @contextlib.contextmanager
    def sub_window(self, *args, **kwargs):
        yield self

    def begin(self, *args, **kwargs) -> None:
        pass

    def end(self) -> None:
        pass

    def text(self, *args, **kwargs) -> None:
        pass

    def button(self, *args, **kwargs) -> bool:
        return False

    def slider_float(self, text, old_value, *args, **kwargs):
        return old_value

    slider_int = checkbox = color_edit_3 = slider_float


class Camera:
    """``ti.ui.Camera``: its settings are recorded when a scene takes it."""

    def __init__(self) -> None:
        self.settings: dict = {}
        # read back by programs that move the camera (Taichi's initial values)
        self.curr_position = np.array([0.0, 0.0, 0.0])
        self.curr_lookat = np.array([0.0, 0.0, -1.0])
        self.curr_up = np.array([0.0, 1.0, 0.0])

    SETTINGS = ("position", "lookat", "up", "fov", "z_near", "z_far", "projection_mode")

    def __getattr__(self, name):
        if name not in self.SETTINGS:
            raise AttributeError(name)

        def setter(*args):
            self.settings[name] = value(args[0] if len(args) == 1 else args)
            if name in ("position", "lookat", "up"):
                setattr(self, "curr_" + name, np.asarray(self.settings[name], np.float64))
        return setter

    def track_user_inputs(self, *args, **kwargs) -> None:
        pass


class Scene:
    def set_camera(self, camera: Camera) -> None:
        RECORDER.add("scene.set_camera", (), dict(camera.settings))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return types.MethodType(_recording("scene", name), self)


class Canvas:
    def scene(self, scene: Scene) -> None:
        pass

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return types.MethodType(_recording("canvas", name), self)


class Window(_Shows):
    def __init__(self, name="", res=(512, 512), *args, **kwargs):
        self.res = tuple(res)
        RECORDER.add("window.Window", (), {"res": self.res})

    def get_canvas(self) -> Canvas:
        return Canvas()

    def get_scene(self) -> Scene:
        return Scene()

    def get_gui(self) -> _SubWindow:
        return _SubWindow()

    def save_image(self, *args, **kwargs) -> None:
        pass

    def destroy(self) -> None:
        pass

    def __getattr__(self, name):
        raise HeadlessUnavailable(f"ti.ui.Window.{name} has no headless stand-in")


def _ui_module() -> types.ModuleType:
    ui = types.ModuleType("taichi.ui")
    ui.Window, ui.Scene, ui.Camera, ui.Canvas = Window, Scene, Camera, Canvas
    ui.make_camera = Camera
    ui.ProjectionMode = types.SimpleNamespace(Perspective="Perspective",
                                              Orthogonal="Orthogonal")
    for k in KEYS:
        setattr(ui, k, k)

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.isupper() and len(name) == 1 or name in ("a", "w", "s", "d"):
            return name
        raise HeadlessUnavailable(f"ti.ui.{name} has no headless stand-in")

    ui.__getattr__ = __getattr__
    return ui


def install(ti, frames: int) -> Recorder:
    """Put the stand-ins in ``ti`` (``ti.GUI``, ``ti.ui``, ``taichi.ui``); the recorder."""
    RECORDER.limit = frames
    ti.GUI = GUI
    if not hasattr(ti, "rgb_to_hex"):
        ti.rgb_to_hex = rgb_to_hex
    ti.ui = sys.modules["taichi.ui"] = _ui_module()
    if hasattr(ti, "tools"):
        ti.tools.imshow = _imshow
    return RECORDER


def _imshow(img, title="imshow") -> None:
    """``ti.tools.imshow``: the image is a frame of its own."""
    RECORDER.add("tools.imshow", (img,), {})
    RECORDER.show()
