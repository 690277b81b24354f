"""``python -m lightning_zero.fabric run --strategy zero_stage_3 script.py``: ``fabric run`` that knows the ZeRO names.

[Note: why not plain ``fabric run``]
``fabric run`` validates ``--strategy`` with a ``click.Choice`` whose list is read from Fabric's strategy registry
when ``lightning.fabric.cli`` is imported, which is before any user code runs; nothing in the ``fabric`` command
imports third-party strategies, so ``fabric run --strategy zero_stage_3`` is rejected by click. This entry point
imports :mod:`lightning_zero.fabric` first (registering the names) and then hands the command line to Fabric's own CLI,
unchanged: every ``fabric run`` option works the same. The launched script must ``import lightning_zero`` before
creating ``Fabric()`` (the names are registered per process); Fabric's CLI excludes names containing ``offload``
from its choices, so the offload variants are chosen in the script (``Fabric(strategy="zero_stage_3_offload")``)
or with plain ``fabric run`` and no ``--strategy``.
"""

import lightning_zero.fabric  # noqa: F401  (registers the strategy names before Fabric's CLI builds its choices)


def main() -> None:
    try:
        from lightning.fabric.cli import _main
    except ImportError as err:  # lightning.fabric.cli defines its click command only where click is installed
        raise SystemExit(f"`fabric run` needs click (pip install click): {err}") from None

    # The choices click holds, not the registry: they were frozen when lightning.fabric.cli was first imported.
    choices = next(param.type.choices for param in _main.commands["run"].params if param.name == "strategy")
    if "zero_stage_3" not in choices:
        raise RuntimeError(
            "lightning.fabric.cli was imported before lightning_zero, so its --strategy choices lack "
            "the ZeRO names; run `python -m lightning_zero.fabric run ...` in a fresh interpreter"
        )
    _main(prog_name="python -m lightning_zero.fabric")


if __name__ == "__main__":
    main()
