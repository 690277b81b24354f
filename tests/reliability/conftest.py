"""Fixtures shared by the reliability tests."""

import os
import subprocess

import pytest


@pytest.fixture
def small_disk(tmp_path, request):
    """A small tmpfs at ``tmp_path/small`` (size: the test module's ``SMALL_DISK_SIZE``, default 4 MiB), unmounted
    afterwards; skipped where mounting is not allowed."""
    size = getattr(request.module, "SMALL_DISK_SIZE", "4m")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
