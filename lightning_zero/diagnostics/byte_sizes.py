"""Sizes written as text (``"16M"``, ``"500MB"``, ``"1GiB"``) read as byte counts, the one reading every argument
that takes a size shares: the collective probe's message sizes and the Hugging Face export's ``max_shard_size``.

A bare number is bytes. A one-letter suffix (``K``, ``M``, ``G``) is a binary multiple, as nccl-tests read their
``-b``/``-e`` sizes; ``KiB``/``MiB``/``GiB`` are binary and ``KB``/``MB``/``GB`` decimal, as Hugging Face reads
``max_shard_size`` (``transformers/utils/hub.py``, ``convert_file_size_to_int``).
"""

from __future__ import annotations

from typing import Union

__all__ = ["parse_size"]

# Longest suffixes first, so "MB" is read before "B".
_MULTIPLES = {
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "B": 1,
}


def parse_size(size: Union[int, str], name: str = "size") -> int:
    """``size`` (a positive byte count, or text such as ``"64K"``, ``"500MB"``, ``"2GiB"``) as bytes; a
    ``ValueError`` naming the argument ``name`` otherwise."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip().upper()
        number, factor = text, 1
        for suffix, multiple in _MULTIPLES.items():
            if text.endswith(suffix):
                number, factor = text[: -len(suffix)].strip(), multiple
                break
        if number.replace(".", "", 1).isdigit():
            value = int(float(number) * factor)
            if value > 0:
                return value
    raise ValueError(f"{name} must be a positive byte count or a size such as 64K, 16M, 500MB or 2GiB, got {size!r}")
