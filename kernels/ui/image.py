"""Images as Taichi's ``ti.GUI`` and ``ti.tools`` see them, read and written with Pillow.

Taichi's layout: ``img[x, y, c]``, ``x`` from the left and ``y`` from the *bottom*; a file stores
rows from the top, so reading and writing transpose and flip. Values: ``uint8`` as they are,
wider unsigned integers scaled by their maximum, floats in [0, 1] (clipped, then
``(uint8)(v * 255)``, truncated, as Taichi does). Channels: 1 (grey), 3 (RGB) or 4 (RGBA) when
writing; when reading, the file's own channels or, with ``channels=``, converted as
stb_image (which Taichi reads with) converts them, grey as ``(77 r + 150 g + 29 b) >> 8``.
"""

from __future__ import annotations

import builtins

import numpy as np

from ..errors import ImageError, MediaError
from ..frontend.field import Field
from ..frontend.ndarray import Ndarray

__all__ = ["imread", "imresize", "imshow", "imwrite"]

#: What Taichi writes, by the file name's last four characters.
_FORMATS = {".png": "PNG", ".bmp": "BMP", ".jpg": "JPEG"}
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def _pil():
    # Function-level: Pillow is loaded by the first picture read or written, not by
    # `import difftape`.
    from PIL import Image

    return Image


def _as_numpy(img, what: str) -> np.ndarray:
    if isinstance(img, Field | Ndarray):
        img = img.to_numpy()
    if not isinstance(img, np.ndarray) or img.dtype.kind == "O":
        raise ImageError(f"{what} takes a field, an ndarray or a NumPy array, "
                         f"not {type(img).__name__}")
    return img


def cook_image(img: np.ndarray, res: tuple[int, int]) -> np.ndarray:
    """A (w, h[, 1..4]) image as the RGBA float32 picture of ``ti.GUI.set_image``: unsigned
    integers times ``1 / max`` (in float32), floats as float32; grey fills all four channels,
    RG and RGB get zeros for the rest."""
    if img.dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        img = img.astype(np.float32) * (1 / np.iinfo(img.dtype).max)
    elif img.dtype in (np.float16, np.float32, np.float64):
        img = img.astype(np.float32)
    else:
        raise ImageError(f"ti.GUI.set_image: data type {img.dtype} is not an image type "
                         "(uint8/16/32/64 or float16/32/64)")
    if img.ndim == 2:
        img = img[..., None]
    if img.ndim != 3 or img.shape[2] not in (1, 2, 3, 4):
        raise ImageError(f"ti.GUI.set_image: an image of shape {img.shape} is not grey, RG, "
                         "RGB or RGBA")
    if img.shape[2] == 1:
        img = img + np.zeros((1, 1, 4), np.float32)
    elif img.shape[2] < 4:
        pad = np.zeros(img.shape[:2] + (4 - img.shape[2],), np.float32)
        img = np.concatenate([img, pad], axis=2)
    if tuple(img.shape[:2]) != tuple(res):
        raise ImageError(f"ti.GUI.set_image: image resolution {img.shape[:2]} does not match "
                         f"the GUI resolution {tuple(res)}")
    return np.ascontiguousarray(img)


def to_file_bytes(img) -> np.ndarray:
    """A field, ndarray or array in Taichi's layout as the uint8 rows (h, w, c) a file stores."""
    img = _as_numpy(img, "ti.tools.imwrite")
    if img.dtype in (np.uint16, np.uint32, np.uint64):
        img = (img // (np.iinfo(img.dtype).max // 256)).astype(np.uint8)
    elif img.dtype in (np.float32, np.float64):
        img = (np.clip(img, 0, 1) * 255.0).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise ImageError(f"ti.tools.imwrite: data type {img.dtype} is not supported "
                         "(uint8/16/32/64, float32/64)")
    if img.ndim == 2:
        img = img[..., None]
    if img.ndim != 3 or img.shape[2] not in (1, 3, 4):
        raise ImageError(f"ti.tools.imwrite: an image of shape {img.shape} is not grey, RGB "
                         "or RGBA")
    return np.ascontiguousarray(img.swapaxes(0, 1)[::-1])


def write_rgb(filename: str, rows: np.ndarray) -> None:
    """Write uint8 rows (h, w, 1/3/4), top row first, as .png, .bmp or .jpg (JPEG quality 95,
    alpha dropped, as Taichi writes them)."""
    filename = str(filename)
    fmt = _FORMATS.get(filename[-4:].lower()) if len(filename) >= 5 else None
    if fmt is None:
        raise ImageError(f"cannot write image file {filename!r}: unknown suffix (Taichi's "
                         "formats are .png, .bmp and .jpg)")
    Image = _pil()
    picture = Image.fromarray(rows[:, :, 0] if rows.shape[2] == 1 else rows,
                              _MODES[rows.shape[2]])
    options = {}
    if fmt == "JPEG":
        options["quality"] = 95
        if picture.mode == "RGBA":
            picture = picture.convert("RGB")
    try:
        picture.save(filename, fmt, **options)
    except OSError as e:
        raise MediaError(f"cannot write image file {filename!r}: {e}") from e


def imwrite(img, filename: str) -> None:
    """``ti.tools.imwrite(img, filename)``: ``img[x, y]`` (grey, RGB or RGBA; a field, ndarray
    or NumPy array) to a .png, .bmp or .jpg file."""
    write_rgb(filename, to_file_bytes(img))


def _grey(rgb: np.ndarray) -> np.ndarray:
    """stb_image's luma: ``(77 r + 150 g + 29 b) >> 8``."""
    r, g, b = (rgb[..., k].astype(np.uint32) for k in range(3))
    return ((77 * r + 150 * g + 29 * b) >> 8).astype(np.uint8)


def _convert(img: np.ndarray, channels: int) -> np.ndarray:
    """(h, w, c) uint8 -> (h, w, channels) as stb_image converts between 1 to 4 channels."""
    have = img.shape[2]
    if have == channels:
        return img
    full = np.full(img.shape[:2], 255, np.uint8)
    if have <= 2:
        g = img[..., 0]
        a = img[..., 1] if have == 2 else full
        parts = {1: [g], 2: [g, a], 3: [g, g, g], 4: [g, g, g, a]}[channels]
    else:
        y = _grey(img)
        a = img[..., 3] if have == 4 else full
        rgb = [img[..., 0], img[..., 1], img[..., 2]]
        parts = {1: [y], 2: [y, a], 3: rgb, 4: [*rgb, a]}[channels]
    return np.stack(parts, axis=2)


def imread(filename: str, channels: int = 0) -> np.ndarray:
    """``ti.tools.imread(filename, channels=0)``: a uint8 image ``[x, y, c]`` (``y`` from the
    bottom) with the file's channels (1 grey, 2 grey+alpha, 3 RGB, 4 RGBA) or ``channels``."""
    if channels not in (0, 1, 2, 3, 4):
        raise ImageError(f"ti.tools.imread: channels must be 0 (as in the file) to 4, "
                         f"not {channels}")
    Image = _pil()
    try:
        with Image.open(filename) as picture:
            picture.load()
            mode = picture.mode
            if mode in ("L", "LA", "RGB", "RGBA"):
                arr = np.asarray(picture, np.uint8)
            elif mode == "1":
                arr = np.asarray(picture.convert("L"), np.uint8)
            elif mode.startswith("I"):  # 16 and 32 bits grey: stb keeps the high byte
                wide = np.asarray(picture).astype(np.int64)
                arr = np.clip(wide >> 8, 0, 255).astype(np.uint8)
            elif mode in ("P", "PA"):
                transparent = "transparency" in picture.info or mode == "PA"
                arr = np.asarray(picture.convert("RGBA" if transparent else "RGB"), np.uint8)
            elif mode == "F":
                arr = np.asarray(picture.convert("L"), np.uint8)
            else:
                arr = np.asarray(picture.convert("RGB"), np.uint8)
    except OSError as e:
        raise MediaError(f"cannot read image file {filename!r}: {e}") from e
    if arr.ndim == 2:
        arr = arr[..., None]
    if channels:
        arr = _convert(arr, channels)
    return arr.swapaxes(0, 1)[:, ::-1, :]


def imresize(img, w: int, h: int | None = None) -> np.ndarray:
    """``ti.tools.imresize(img, w, h=w)``: ``img[x, y, ...]`` resized to (w, h) by taking the
    nearest pixel below each sample (Taichi's rule: source index ``floor(k * size / new)``)."""
    img = _as_numpy(img, "ti.tools.imresize")
    if h is None:
        h = w
    if (w, h) == img.shape[:2]:
        return img
    if not (isinstance(w, int) and isinstance(h, int) and w > 1 and h > 1):
        raise ImageError(f"ti.tools.imresize: the new size must be integers above 1, not {w}x{h}")
    xs = np.clip(np.arange(w) * (img.shape[0] / w), 0, img.shape[0] - 1).astype(np.int32)
    ys = np.clip(np.arange(h) * (img.shape[1] / h), 0, img.shape[1] - 1).astype(np.int32)
    return img[xs[:, None], ys[None, :]]


def imshow(img, title: str = "imshow") -> None:
    """``ti.tools.imshow(img)``: in a notebook (IPython), display the image; elsewhere there
    is no window to show it in, and it is refused (write it with ``ti.tools.imwrite``)."""
    if getattr(builtins, "get_ipython", None) is None:
        raise MediaError(f"ti.tools.imshow({title!r}): difftape has no windows; outside a "
                         "notebook write the image with ti.tools.imwrite(img, 'image.png')")
    # Function-level: IPython is there when get_ipython is (a notebook or IPython shell).
    import IPython.display

    rows = to_file_bytes(img)
    IPython.display.display(_pil().fromarray(rows[:, :, 0] if rows.shape[2] == 1 else rows))
