"""The package version, on the ground floor so that every layer can name it."""

__version__ = "0.1.0"
