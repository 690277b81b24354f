"""``python -m tests.reliability.exit_script <trainer|fabric> <clean|raise> <report file> [devices]``: one process sets
up a ZeroStrategy process group and exits; an atexit handler registered *before* the strategy (so it runs after the
strategy's own handlers) writes whether the process group was still initialised at exit."""

import atexit
import sys

import torch
import torch.distributed as dist


def main(kind: str, how: str, report: str, devices: str = "1") -> None:
    atexit.register(lambda: open(report, "w").write("initialized" if dist.is_initialized() else "destroyed"))
    torch.set_num_threads(1)
    if kind == "trainer":
        from lightning.pytorch import Trainer
        from lightning.pytorch.demos.boring_classes import BoringModel

        from lightning_zero import ZeroStrategy

        trainer = Trainer(
            strategy=ZeroStrategy(stage=2),
            accelerator="cpu",
            devices=int(devices),
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(BoringModel())
    else:
        from lightning.fabric import Fabric

        from lightning_zero.fabric import ZeroStrategy

        fabric = Fabric(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=int(devices))
        fabric.launch()
        fabric.all_reduce(torch.ones(2))
    assert dist.is_initialized()
    if how == "raise":
        raise RuntimeError("the script fails after training")


if __name__ == "__main__":
    main(*sys.argv[1:])
