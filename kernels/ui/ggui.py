"""``ti.ui``'s GGUI names (``Window``, ``Scene``, ``Canvas``, ``Camera``, ``Gui``,
``make_camera``): Taichi's Vulkan window and 3-D scene renderer, which difftape does not have.

They exist so that a Taichi program using them fails where it starts to, with a
:class:`~difftape.errors.MediaError` saying that difftape has no GGUI and what to draw with
instead, as Taichi's own do where GGUI is not available (its ``check_ggui_availability``); a
class that constructed but drew nothing would be a program that runs and shows nothing.
"""

from __future__ import annotations

from ..errors import MediaError

__all__ = ["GGUI_AVAILABLE", "Camera", "Canvas", "Gui", "ProjectionMode", "Scene", "Window",
           "make_camera"]

#: Whether ``ti.ui.Window`` and the rest work here (Taichi's ``_ti_core.GGUI_AVAILABLE``).
GGUI_AVAILABLE = False
#: Taichi's camera projection modes: None where there is no GGUI, as in Taichi.
ProjectionMode = None


def _refuse(what: str) -> MediaError:
    return MediaError(
        f"ti.ui.{what}: difftape has no GGUI (Taichi's Vulkan window and 3-D scene renderer: "
        "ti.ui.Window, Scene, Canvas, Camera). Draw 2-D frames with ti.GUI instead "
        "(headless: ti.GUI(name, res, show_gui=False), then gui.show('frame.png') writes "
        "each frame), or write the geometry out (ti.tools.PLYWriter) and render it elsewhere.")


class _Unavailable:
    """A GGUI class: constructing one raises :func:`_refuse`'s error."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise _refuse(type(self).__name__ + "()")


class Window(_Unavailable):
    """``ti.ui.Window(name, res)``: not available (no GGUI)."""


class Scene(_Unavailable):
    """``ti.ui.Scene()`` (deprecated in Taichi for ``window.get_scene()``): not available."""


class Canvas(_Unavailable):
    """``window.get_canvas()``'s class: not available."""


class Camera(_Unavailable):
    """``ti.ui.Camera()``: not available."""


class Gui(_Unavailable):
    """``window.get_gui()``'s class (GGUI's widgets): not available."""


def make_camera() -> Camera:
    """``ti.ui.make_camera()``: not available (no GGUI)."""
    raise _refuse("make_camera()")
