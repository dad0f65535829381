"""The package's version: `pdserve.__version__`, and what `GET /version` answers."""

__version__ = "0.1.0"
