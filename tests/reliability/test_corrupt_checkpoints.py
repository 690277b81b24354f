"""Every way a sharded checkpoint can be damaged ends in one CheckpointError naming the file: for load, consolidate
and ``lightning-zero verify`` (exit code 1, one line per error, no traceback). Never a torch internal error, never a
silent success, never a consolidated file holding uninitialised memory."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from typing import Callable, NamedTuple

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from lightning_zero.checkpoint.io import _translate
from lightning_zero.checkpoint.safe_load import DCPMetadataUnpickler
from lightning_zero.cli import main as cli_main
from tests.ranks import run_distributed
from tests.reliability.tamper import reseal


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))


def _save_worker(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(make_model(), mesh=init_device_mesh("cpu", (world_size,)))
    save_sharded_checkpoint(path, {"state_dict": model.state_dict()}, {"epoch": 1})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A checkpoint of 2 ranks: every tensor is stored as 2 chunks, one per shard file."""
    path = str(tmp_path_factory.mktemp("pristine") / "model.ckpt")
    run_distributed(_save_worker, 2, path)
    return path


# ---------------------------------------------------------------- ways to damage a checkpoint
def truncate(name: str) -> Callable:
    def damage(path):
        full = os.path.join(path, name)
        os.truncate(full, os.path.getsize(full) // 2)

    return damage


def flip_byte(name: str) -> Callable:
    def damage(path):
        full = os.path.join(path, name)
        with open(full, "r+b") as file:
            file.seek(os.path.getsize(full) - 40)  # inside the last tensor's bytes
            byte = file.read(1)
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte[0] ^ 0x10]))

    return damage


def delete(name: str) -> Callable:
    return lambda path: os.remove(os.path.join(path, name))


def replace_with(name: str, content: bytes, resealed: bool = False) -> Callable:
    def damage(path):
        with open(os.path.join(path, name), "wb") as file:
            file.write(content)
        if resealed:
            reseal(path)

    return damage


def edit_metadata(edit: Callable, resealed: bool = True) -> Callable:
    """Edit the unpickled DCP metadata; ``resealed``: recompute zero.json's records, as a careful forger would."""

    def damage(path):
        with open(os.path.join(path, ".metadata"), "rb") as file:
            metadata = DCPMetadataUnpickler(file).load()
        edit(metadata)
        with open(os.path.join(path, ".metadata"), "wb") as file:
            pickle.dump(metadata, file)
        if resealed:
            reseal(path)

    return damage


def grow_tensor(metadata) -> None:
    item = metadata.state_dict_metadata["state_dict.0.weight"]
    item.size = torch.Size([item.size[0] + 1, item.size[1]])  # a row no chunk stores


def drop_chunk(metadata) -> None:
    metadata.state_dict_metadata["state_dict.2.weight"].chunks.pop()


def shift_chunk(metadata) -> None:
    chunk = metadata.state_dict_metadata["state_dict.0.weight"].chunks[-1]
    chunk.offsets = torch.Size([chunk.offsets[0] + 7, 0])  # past the end of the tensor


def edit_info(path) -> None:
    with open(os.path.join(path, "zero.json")) as file:
        info = json.load(file)
    info["world_size"] = 8
    with open(os.path.join(path, "zero.json"), "w") as file:
        json.dump(info, file)


def remove_all_but(keep: str) -> Callable:
    def damage(path):
        for name in os.listdir(path):
            if name != keep:
                os.remove(os.path.join(path, name))

    return damage


class Case(NamedTuple):
    damage: Callable
    file: str  # the file the error must name
    says: str  # and what it must say about it


CASES = {
    "truncated-shard": Case(truncate("__0_0.distcp"), "__0_0.distcp", "size is"),
    "flipped-byte-in-shard": Case(flip_byte("__1_0.distcp"), "__1_0.distcp", "CRC-32"),
    "missing-shard": Case(delete("__1_0.distcp"), "__1_0.distcp", "missing"),
    "empty-shard": Case(replace_with("__0_0.distcp", b""), "__0_0.distcp", "size is"),
    "text-shard-resealed": Case(
        replace_with("__0_0.distcp", b"hello\n", resealed=True), "__0_0.distcp", "truncated file or edited metadata"
    ),
    "truncated-metadata": Case(truncate(".metadata"), ".metadata", "size is"),
    "garbage-metadata": Case(replace_with(".metadata", b"\x80\x04garbage"), ".metadata", "size is"),
    "garbage-metadata-resealed": Case(
        replace_with(".metadata", b"\x80\x04garbage", True), ".metadata", "not a readable DCP metadata"
    ),
    "json-as-metadata-resealed": Case(
        replace_with(".metadata", b'{"a": 1}', True), ".metadata", "not a readable DCP metadata"
    ),
    "missing-metadata": Case(delete(".metadata"), ".metadata", "missing"),
    "edited-metadata": Case(edit_metadata(grow_tensor, resealed=False), ".metadata", "CRC-32"),
    "grown-tensor-resealed": Case(edit_metadata(grow_tensor), ".metadata", "48 of its 54 elements"),
    "dropped-chunk-resealed": Case(edit_metadata(drop_chunk), ".metadata", "not covered exactly"),
    "chunk-outside-resealed": Case(edit_metadata(shift_chunk), ".metadata", "lies outside"),
    "edited-zero-json": Case(edit_info, "zero.json", "was edited"),
    "truncated-zero-json": Case(truncate("zero.json"), "zero.json", "not readable JSON"),
    "other-format-zero-json": Case(replace_with("zero.json", b'{"format": "x"}'), "zero.json", "format 'x'"),
    "missing-zero-json": Case(delete("zero.json"), "zero.json", "missing"),
    "truncated-meta-pt": Case(truncate("meta.pt"), "meta.pt", "size is"),
    "text-meta-pt-resealed": Case(
        replace_with("meta.pt", b"not a torch file", True), "meta.pt", "not a readable torch file"
    ),
    "only-a-shard-left": Case(remove_all_but("__0_0.distcp"), "zero.json", "missing"),
}


@pytest.fixture(params=sorted(CASES))
def damaged(request, pristine, tmp_path):
    case = CASES[request.param]
    path = str(tmp_path / "model.ckpt")
    shutil.copytree(pristine, path)
    case.damage(path)
    return path, case


def _assert_names(error: CheckpointError, case: Case) -> None:
    text = str(error)
    assert case.file in text and case.says in text, text
    assert "CheckpointException" not in text and "PytorchStreamReader" not in text, text


def test_load_raises_one_checkpoint_error_naming_the_file(damaged):
    path, case = damaged
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as raised:
        load_sharded_checkpoint(path, {"state_dict": model.state_dict()})
    _assert_names(raised.value, case)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a damaged load changed weights"


def test_consolidate_raises_one_checkpoint_error_and_writes_nothing(damaged, tmp_path):
    path, case = damaged
    output = tmp_path / "out" / "model.safetensors"
    with pytest.raises(CheckpointError) as raised:
        consolidate_checkpoint(path, output)
    _assert_names(raised.value, case)
    assert not output.parent.exists() or not os.listdir(output.parent), "consolidate left a file behind"


def test_verify_cli_prints_one_line_per_error_and_exits_1(damaged, capsys):
    path, case = damaged
    assert cli_main(["verify", path]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines and all(line.startswith("lightning-zero verify: error: ") for line in lines), captured.err
    assert any(case.file in line and case.says in line for line in lines), captured.err
    assert captured.out == ""


def test_intact_checkpoint_verifies_and_consolidates_exactly(pristine, tmp_path, capsys):
    assert cli_main(["verify", pristine]) == 0
    assert "OK (5 files" in capsys.readouterr().out
    info = json.load(open(os.path.join(pristine, "zero.json")))
    # every file is recorded, the (empty) marker of a directory a lightning-zero save wrote included
    assert set(info["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt", ".lightning-zero-partial"}
    assert "seal" in info
    full = consolidate_checkpoint(pristine)
    for key, value in make_model().state_dict().items():
        assert torch.equal(full[key], value), key


def test_text_file_given_as_checkpoint(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(CheckpointError, match="notes.txt: a file, not a lightning-zero sharded checkpoint"):
        load_sharded_checkpoint(text, {"state_dict": make_model().state_dict()})
    # consolidate also accepts a single-file Lightning checkpoint, so a text file is refused as an unreadable one
    with pytest.raises(CheckpointError, match="notes.txt: not a readable torch file"):
        consolidate_checkpoint(text, tmp_path / "out.ckpt")
    assert cli_main(["consolidate", str(text), str(tmp_path / "out.ckpt")]) == 1
    assert cli_main(["verify", str(text)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "notes.txt" in err[0] and "notes.txt" in err[1], err
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_consolidate_refuses_a_directory_output_before_reading(pristine, tmp_path, capsys, monkeypatch):
    from lightning_zero.checkpoint import consolidate as consolidate_module

    def must_not_open(path):
        raise AssertionError("the source was opened before the output was checked")

    monkeypatch.setattr(consolidate_module, "open_source", must_not_open)
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "mine.txt").write_text("the user's")
    with pytest.raises(ValueError, match="existing directory"):
        consolidate_checkpoint(pristine, tmp_path / "existing")
    assert cli_main(["consolidate", pristine, str(tmp_path / "existing")]) == 1
    assert "existing directory" in capsys.readouterr().err
    assert os.listdir(tmp_path / "existing") == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["existing"]


def test_cli_debug_shows_the_exception(pristine, tmp_path):
    path = str(tmp_path / "model.ckpt")
    shutil.copytree(pristine, path)
    truncate("__1_0.distcp")(path)
    with pytest.raises(CheckpointError, match="__1_0.distcp"):
        cli_main(["consolidate", path, str(tmp_path / "o.ckpt"), "--debug"])


@pytest.mark.slow  # a fresh interpreter importing Lightning: ~15 s on the shared 2-core machine
def test_cli_process_prints_no_traceback(pristine, tmp_path):
    path = str(tmp_path / "model.ckpt")
    shutil.copytree(pristine, path)
    truncate("__1_0.distcp")(path)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    quiet = subprocess.run(
        [sys.executable, "-m", "lightning_zero", "consolidate", path, str(tmp_path / "o.ckpt")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr, quiet.stderr
    assert quiet.stderr.count("\n") == 1 and "__1_0.distcp" in quiet.stderr, quiet.stderr


@pytest.mark.parametrize("output", ["model.ckpt", "model.safetensors"])
def test_a_consolidation_failing_midway_leaves_no_file(pristine, tmp_path, monkeypatch, output):
    from lightning_zero.checkpoint.tensor_sources import DCPTensorSource

    def failing(self, entry):
        raise OSError("disk went away")

    monkeypatch.setattr(DCPTensorSource, "load", failing)
    with pytest.raises(OSError, match="disk went away"):
        consolidate_checkpoint(pristine, tmp_path / output)
    assert os.listdir(tmp_path) == []


def test_a_failure_inside_dcp_is_a_checkpoint_error(pristine, tmp_path):
    path = str(tmp_path / "model.ckpt")
    shutil.copytree(pristine, path)
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as file:
        file.write(b"XX")  # the zip header of the first record: torch.load fails inside DCP's read
    # checksums=False skips the CRC that would have caught it first: DCP's CheckpointException (a BaseException)
    # must still come out as a CheckpointError
    with pytest.raises(CheckpointError, match="loading failed on 1 rank") as raised:
        load_sharded_checkpoint(path, {"state_dict": make_model().state_dict()}, checksums=False)
    assert isinstance(raised.value.__cause__, Exception)  # the rank's own error, not DCP's BaseException wrapper


def _load_damaged_worker(rank: int, world_size: int, path: str, name: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(make_model(), mesh=init_device_mesh("cpu", (world_size,)))
    # each rank checksums every other file; the rank that finds the damage must not leave the other one waiting
    with pytest.raises(CheckpointError, match=f"{name}: contents changed"):
        load_sharded_checkpoint(path, {"state_dict": model.state_dict()})


def test_every_rank_raises_when_one_rank_finds_the_damage(pristine, tmp_path):
    for name in ("__0_0.distcp", "__1_0.distcp"):
        path = str(tmp_path / name / "model.ckpt")
        shutil.copytree(pristine, path)
        flip_byte(name)(path)
        run_distributed(_load_damaged_worker, 2, path, name)


def test_dcp_checkpoint_exception_becomes_a_checkpoint_error():
    wrapped = CheckpointException("load", {0: (ValueError("bad\nsecond line"), None), 1: (KeyError("k"), None)})
    error = _translate(wrapped, "/x/model.ckpt")
    assert isinstance(error, CheckpointError) and isinstance(error, RuntimeError)
    assert str(error) == "/x/model.ckpt: loading failed on 2 rank(s): rank 0: ValueError: bad; rank 1: KeyError: 'k'"
    inner = CheckpointError("/x/model.ckpt/__0_0.distcp: not a readable torch file")
    assert _translate(CheckpointException("load", {1: (inner, None)}), "/x") is inner
