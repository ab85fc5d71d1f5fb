"""Filesystems a test mounts (root only; a test that cannot mount one is skipped, saying why)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` ("64k") at `where`: a real filesystem that fills up."""
    where.mkdir(parents=True, exist_ok=True)
    if not _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@contextmanager
def read_only(src: Path, where: Path) -> Iterator[Path]:
    """`src` again at `where`, read-only (a bind mount remounted read-only), as a cache shipped
    pre-warmed is mounted on every replica."""
    where.mkdir(parents=True, exist_ok=True)
    if not _mount("--bind", str(src), str(where)):
        pytest.skip("a bind mount needs root (CAP_SYS_ADMIN)")
    try:
        if not _mount("-o", "remount,bind,ro", str(where)):
            pytest.skip("this machine cannot remount a bind mount read-only")
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def fill(where: Path) -> Path:
    """Writes one file until `where`'s filesystem is full; returns it."""
    path = where / "filler"
    block = bytes(4096)
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass
    return path
