"""The SDK version; the only place it is written (pyproject.toml reads it from here)."""

__version__ = "0.2.0"
