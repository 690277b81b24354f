"""Test helpers that damage a sharded checkpoint the way disks, copies and people do."""

from __future__ import annotations

import json
import os

from lightning_zero.checkpoint.verify import file_records, seal


def reseal(path) -> None:
    """Re-record every file's size and checksum and re-seal ``zero.json``: what someone who edits a checkpoint and
    recomputes its records does, so that the checks behind the records can be tested."""
    info_path = os.path.join(path, "zero.json")
    with open(info_path) as file:
        info = json.load(file)
    info.pop("seal", None)
    info["files"] = file_records(os.fspath(path))
    with open(info_path, "w") as file:
        json.dump(seal(info), file)
