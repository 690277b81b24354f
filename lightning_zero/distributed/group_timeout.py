"""The timeout of the process groups the package creates itself (the checkpoint saves' gloo control groups, a
pipeline's tied-weight groups), which must be the user's ``ZeroStrategy(timeout=...)``.

``dist.new_group`` does not inherit the default group's timeout: without one it takes torch's 30-minute default, so
with ``timeout=timedelta(seconds=30)`` a rank waiting for a hung peer in one of these groups waited 30 minutes, and
only the hang watchdog ended the job. torch has no public getter for the default group's timeout, so the adapter that
starts the default group records it here (:func:`set_package_group_timeout`) and the package's ``new_group`` calls
pass :func:`package_group_timeout`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

_TIMEOUT: Optional[timedelta] = None


def set_package_group_timeout(timeout: Optional[timedelta]) -> None:
    """Record the default process group's timeout (``None``: torch's default) for the groups created later."""
    global _TIMEOUT
    _TIMEOUT = timeout


def package_group_timeout() -> Optional[timedelta]:
    """The timeout to give ``dist.new_group`` (``None``: torch's default, when no ZeroStrategy started the group)."""
    return _TIMEOUT
