"""Headless stand-in for OpenCV (see ``_noop``): windows and writes do nothing; ``imread``
reads PNGs (BGR order, as OpenCV); ``resize`` is bilinear with OpenCV's pixel-centre rule."""

import numpy as np
from _noop import HeadlessUnavailable, read_png

INTER_LINEAR = 1
INTER_NEAREST = 0


def imread(path, flags=1):
    img = read_png(path)
    if img.ndim == 3:
        img = img[:, :, :3][:, :, ::-1] if flags != -1 else img
    return np.ascontiguousarray(img)


def resize(img, dsize=None, fx=None, fy=None, interpolation=INTER_LINEAR):
    h, w = img.shape[:2]
    if dsize:
        nw, nh = dsize
    else:
        nw, nh = int(round(w * fx)), int(round(h * fy))
    ys = np.clip((np.arange(nh) + 0.5) * h / nh - 0.5, 0, h - 1)
    xs = np.clip((np.arange(nw) + 0.5) * w / nw - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0), (xs - x0)
    a = img.astype(np.float64)
    if a.ndim == 3:
        wy, wx = wy[:, None, None], wx[None, :, None]
    else:
        wy, wx = wy[:, None], wx[None, :]
    top = a[y0][:, x0] * (1 - wx) + a[y0][:, x1] * wx
    bot = a[y1][:, x0] * (1 - wx) + a[y1][:, x1] * wx
    out = top * (1 - wy) + bot * wy
    return (np.round(out).astype(img.dtype) if img.dtype.kind in "iu"
            else out.astype(img.dtype))


def _nothing(*args, **kwargs):
    return None


imshow = imwrite = circle = line = rectangle = putText = namedWindow = _nothing
destroyAllWindows = _nothing


def waitKey(*args, **kwargs):
    return -1


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name.isupper():
        return 0
    raise HeadlessUnavailable(f"cv2.{name} has no headless stand-in")


