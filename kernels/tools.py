"""``ti.tools``: Taichi's image and video helpers (``imread``, ``imwrite``, ``imresize``,
``imshow``, ``VideoManager``), implemented in :mod:`difftape.ui`."""

from __future__ import annotations

from .ui.image import imread, imresize, imshow, imwrite
from .ui.video import VideoManager

__all__ = ["VideoManager", "imread", "imresize", "imshow", "imwrite"]
