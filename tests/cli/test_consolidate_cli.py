"""``lightning-zero consolidate``: an existing OUTPUT is never replaced without ``--overwrite``, and a single-file
Lightning checkpoint as input is converted with a note saying what the copy holds."""

import pytest
import torch

from lightning_zero.cli import main as cli_main


def _ddp_checkpoint(path):
    """What Lightning's DDP strategy saves: the weights, optimizer states and the loops' other entries."""
    weight = torch.arange(6.0).reshape(2, 3)
    torch.save(
        {
            "state_dict": {"net.weight": weight},
            "optimizer_states": [{"state": {}, "param_groups": []}],
            "epoch": 1,
            "global_step": 4,
        },
        path,
    )
    return weight


def test_an_existing_output_is_refused_without_overwrite(tmp_path, capsys):
    source = tmp_path / "last.ckpt"
    _ddp_checkpoint(source)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    assert cli_main(["consolidate", str(source), str(notes)]) == 1
    assert "notes.txt exists; pass --overwrite" in capsys.readouterr().err
    assert notes.read_text() == "hello\n"
    assert cli_main(["consolidate", str(source), str(notes), "--overwrite"]) == 0
    assert torch.load(notes, weights_only=True)["global_step"] == 4


def test_a_single_file_checkpoint_is_converted_with_a_note(tmp_path, capsys):
    source = tmp_path / "last.ckpt"
    weight = _ddp_checkpoint(source)
    output = tmp_path / "weights.ckpt"
    assert cli_main(["consolidate", str(source), str(output), "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "single-file checkpoint" in out and "not its optimizer states; --with-optimizer keeps them" in out
    written = torch.load(output, weights_only=True)
    assert torch.equal(written["state_dict"]["net.weight"], weight.bfloat16())
    assert "optimizer_states" not in written and written["epoch"] == 1


def test_zero_to_fp32_flags_that_do_not_apply_are_refused(tmp_path, capsys):
    source = tmp_path / "last.ckpt"
    _ddp_checkpoint(source)
    for argv, message in (
        ([str(tmp_path / "w.ckpt"), "--safe_serialization"], "--safe_serialization writes safetensors"),
        ([str(tmp_path / "w.ckpt"), "--max_shard_size", "1GB"], "--max-shard-size applies to --hf"),
    ):
        with pytest.raises(SystemExit) as exit:
            cli_main(["consolidate", str(source), *argv])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err
    assert cli_main(["consolidate", str(source), str(tmp_path / "w.ckpt"), "-t", "step3"]) == 1
    assert "not a DeepSpeed checkpoint directory" in capsys.readouterr().err
