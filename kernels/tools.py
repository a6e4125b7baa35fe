"""``ti.tools``: Taichi's image, video and mesh helpers (``imread``, ``imwrite``, ``imresize``,
``imshow``, ``VideoManager``, ``PLYWriter``), implemented in :mod:`difftape.ui`."""

from __future__ import annotations

from .ui.image import imread, imresize, imshow, imwrite
from .ui.ply import PLYWriter
from .ui.video import VideoManager

__all__ = ["PLYWriter", "VideoManager", "imread", "imresize", "imshow", "imwrite"]
