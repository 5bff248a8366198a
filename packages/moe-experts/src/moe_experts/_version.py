"""The single source of this package's version."""

__version__ = "0.4.1"
