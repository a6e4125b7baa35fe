"""Headless stand-in for imageio (see ``_noop``): ``imread`` reads PNGs, writes do nothing."""

from _noop import HeadlessUnavailable, read_png


def imread(path, *args, **kwargs):
    return read_png(path)


def imwrite(*args, **kwargs):
    return None


imsave = imwrite


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise HeadlessUnavailable(f"imageio.{name} has no headless stand-in")
