"""Pictures: ``ti.GUI`` drawing headless into frames (``gui.py`` over ``canvas.py``, which
rasterises as Taichi's GUI does) and the image and video files of ``ti.tools`` (``image.py``,
``video.py``), read and written with Pillow. ``ti.ui`` also has Taichi's GGUI names
(``ti.ui.Window``, ``Scene``, ...), which refuse saying that difftape has no GGUI
(``ggui.py``)."""

from .ggui import (  # noqa: F401
    GGUI_AVAILABLE,
    Camera,
    Canvas,
    Gui,
    ProjectionMode,
    Scene,
    Window,
    make_camera,
)
