"""Headless stand-in for mpl_toolkits (see ``matplotlib``)."""
