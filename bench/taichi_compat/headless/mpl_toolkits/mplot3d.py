"""Headless stand-in for mpl_toolkits.mplot3d: ``Axes3D`` does nothing."""

from _noop import Nothing

Axes3D = Nothing
