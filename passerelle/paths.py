"""Where passerelle keeps files: builds and models it caches, and state (keys, usage, runtime logs).

``$PASSERELLE_CACHE`` and ``$PASSERELLE_STATE`` override the defaults; both are read at each call so
tests (and a second gateway on the same machine) can point them elsewhere.

Example::

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {"PASSERELLE_STATE": "/tmp/p"}):
    ...     str(state_dir())
    '/tmp/p'
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Builds and models passerelle fetched or made (``$PASSERELLE_CACHE``)."""
    root = os.environ.get("PASSERELLE_CACHE") or Path.home() / ".cache" / "passerelle"
    return Path(root)


def state_dir() -> Path:
    """Where passerelle keeps state: keys and usage, runtime logs (``$PASSERELLE_STATE``)."""
    root = os.environ.get("PASSERELLE_STATE") or Path.home() / ".local" / "state" / "passerelle"
    return Path(root)
