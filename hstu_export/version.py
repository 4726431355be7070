"""The version of hstu-export (one place; ``hstu_export.__version__`` re-exports it)."""

__version__ = "0.1.0"
