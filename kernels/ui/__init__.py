"""Pictures: ``ti.GUI`` drawing headless into frames (``gui.py`` over ``canvas.py``, which
rasterises as Taichi's GUI does) and the image and video files of ``ti.tools`` (``image.py``,
``video.py``), read and written with Pillow."""
