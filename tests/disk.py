"""A real full disk for the tests: a small tmpfs (the tests run as root), filled to its last block.

Example::

    with small_disk(tmp_path / "disk", "16m") as disk:
        disk.fill()      # every free block taken: the next write gets ENOSPC
        disk.free()      # given back
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class SmallDisk:
    """A mounted tmpfs: ``fill()`` takes every free block, ``free()`` gives them back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 4096, 1):  # (large writes first, then down to the last byte)
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
        finally:
            os.close(fd)
        probe = self.path / "probe"
        with pytest.raises(OSError) as err, open(probe, "wb", buffering=0) as f:  # full: not one block
            f.write(b"x" * 8192)
        probe.unlink(missing_ok=True)
        assert err.value.errno == errno.ENOSPC, err.value

    def free(self) -> None:
        self.filler.unlink()


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[SmallDisk]:
    """A tmpfs of ``size`` (mount's ``size=``, e.g. "256k") at ``path``, unmounted at the end."""
    assert os.geteuid() == 0, "the full-disk tests mount a tmpfs: run them as root (.ci/run does)"
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True,
                   timeout=30)
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)
