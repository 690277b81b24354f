"""DeepSpeed started on CPU by a test's ranks, without the C++ op its CPU accelerator would compile at the start.

[Note: a DeepSpeed start in the tests builds no op]
``deepspeed.comm.torch.TorchBackend.__init__`` calls ``build_shm_op()``, which asks the CPU accelerator for its
``ShareMemCommBuilder`` and JIT-compiles it (``OpBuilder.jit_load``, through ``torch.utils.cpp_extension.load``:
minutes on two cores) unless ``deepspeed.ops.__compatible_ops__`` says the op is not compatible. The op serves only
``TorchBackend.inference_all_reduce`` (the tensor-parallel layers of ``module_inject/layers.py`` in inference mode);
ZeRO's collectives (``TorchBackend.all_reduce``, ``reduce_scatter``, ``all_gather``) go to ``torch.distributed``
whether or not it exists, so leaving it out changes none of the numbers of a ZeRO run. A build killed half-way (by a
test's timeout) also leaves a lock in the extensions directory on which every later build waits forever. So every
test process that starts DeepSpeed calls :func:`deepspeed_on_cpu` first: the op is marked not compatible, and any JIT
build DeepSpeed would still start raises, naming the op. ``tests/conftest.py`` points ``TORCH_EXTENSIONS_DIR`` at an
empty directory of the session and fails the session if anything is built there.
"""

from __future__ import annotations

import os


def _refuse_jit_build(self, verbose=True):
    raise RuntimeError(
        f"a test would JIT-build DeepSpeed's {self.name} op (minutes on CPU); see tests/deepspeed_cpu.py for how a "
        "test starts DeepSpeed without it"
    )


def deepspeed_on_cpu():
    """Set DeepSpeed up in this process to start on its CPU accelerator without building an op, and return it."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    # DeepSpeed probes every op's compatibility (compiler runs) on the first read of this dict and keeps the result
    # in the module; filled beforehand, the probe never runs, and an op it does not list reads as not compatible.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})[ShareMemCommBuilder.NAME] = False
    OpBuilder.jit_load = _refuse_jit_build
    return deepspeed
