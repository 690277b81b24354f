"""One rank of ``bench_nvme.py --sections capped3``: stage 3 at 2 ranks, bigger than each rank's memory cap.

Launched by :func:`run` as ``world_size`` processes (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in their
environment, gloo). Each rank caps its own ``RLIMIT_DATA`` right after ``import torch`` (see the note in
``bench_nvme.py`` for why that limit), builds the model under a deferred build (no rank ever holds it whole:
``apply_zero`` replays it one FSDP2 unit at a time right before sharding), shards it at stage 3 with the framework-free
core (``apply_zero`` + ``shard_optimizer``, as ``ZeroStrategy`` does without Lightning's own imports in the count),
and trains ``--capped-steps`` AdamW steps. Under ``offload_params="nvme", offload_optimizer="nvme"`` the fp32 shards
and Adam's moments live on disk; what stays in memory is the fp32 sharded gradients (4 bytes per parameter / world
size), the units being gathered, and the swap buffers. Under ``offload="cpu"`` the same model needs the shards, the
gradients and the moments (16 bytes per parameter / world size) in memory, which the cap refuses.

[Note: the model]
Residual blocks ``x + tanh(fc(x))`` of ``Linear(width, width)`` without bias: the activations keep their scale over
hundreds of blocks (a plain stack of Linear layers shrinks them to denormals, whose arithmetic is orders of magnitude
slower on CPU and would time the model, not the offload). ``unit_bytes=0``: one FSDP2 unit per block.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time

import torch

GB, GIB = 1e9, 1 << 30


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _zero_config(args, world: int):
    """Stage 3 with everything offloaded to NVMe (``--mode nvme``) or to CPU memory; one unit per block."""
    from lightning_zero.distributed.config import ZeroConfig
    from lightning_zero.offload.nvme_config import NvmeConfig

    width = args.width
    if args.mode != "nvme":
        return ZeroConfig(stage=3, offload="cpu", unit_bytes=0)
    nvme = NvmeConfig(
        args.nvme_path,
        sub_group_size=int(args.sub_group_size),
        buffer_count=3,
        buffer_size=width * width // world,
        max_in_cpu=4 * width * width,
        aio=dict(thread_count=args.threads, queue_depth=args.queue_depth, block_size=args.block_size),
    )
    return ZeroConfig(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme=nvme, unit_bytes=0)


def _report_swap_and_detach(model, optimizer, say) -> None:
    """Say what the NVMe swappers moved, then stop swapping without reading the states back (restore=False):
    their files and folders are removed."""
    from lightning_zero.offload.optimizer_swapper import detach_swapper, get_swapper
    from lightning_zero.offload.param_swapper import detach_param_step, detach_param_swapper, get_param_swapper

    params, states = get_param_swapper(model), get_swapper(optimizer)
    say(
        f"swap: parameters read {params.bytes_read / GIB:.1f} GiB, written {params.bytes_written / GIB:.1f} "
        f"GiB, peak resident {params.peak_resident_elements * 4 / 2**20:.0f} MiB of shards; optimizer states "
        f"read {states.io.stats['read'][0] / GIB:.1f} GiB at {states.io.throughput('read') / GB:.2f} GB/s, "
        f"written {states.io.stats['write'][0] / GIB:.1f} GiB at {states.io.throughput('write') / GB:.2f} "
        f"GB/s"
    )
    detach_swapper(optimizer, restore=False)
    detach_param_step(optimizer)
    detach_param_swapper(model, restore=False)


def rank_main(args) -> None:
    """One rank process (see the module docstring); prints ``  ``-prefixed lines the parent collects."""
    threading.stack_size(1 << 20)  # I/O threads: 1 MiB stacks, not 8 (a stack is a private writable mapping)
    torch.set_num_threads(1)  # two ranks on two cores
    cap = int(args.cap_gib * GIB)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    rank = int(os.environ["RANK"])

    def say(text):
        print(f"  [rank {rank}] {text}", flush=True)

    steps_done, begin, outcome = 0, time.perf_counter(), "ok"
    try:
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_zero.distributed.apply_zero import apply_zero
        from lightning_zero.distributed.exact_init import InitConfig, exact_init
        from lightning_zero.distributed.optimizer import shard_optimizer

        class Block(nn.Module):
            def __init__(self, width: int) -> None:
                super().__init__()
                self.fc = nn.Linear(width, width, bias=False)

            def forward(self, x):
                return x + torch.tanh(self.fc(x))

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        width = args.width
        blocks = max(1, int(args.capped_params) // (width * width))
        numel = blocks * width * width
        config = _zero_config(args, world)
        if rank == 0:
            say(
                f"model: {blocks} residual blocks of Linear({width}, {width}) fp32 = {numel / 1e6:.0f}M parameters; "
                f"fp32 model states (4+4+8 bytes/param) {16 * numel / GIB:.2f} GiB, "
                f"per rank {16 * numel / world / GIB:.2f}"
                f" GiB = {16 * numel / world / cap:.1f}x the cap of {args.cap_gib:.2f} GiB"
            )
        torch.manual_seed(0)
        with exact_init(InitConfig(host_memory_budget=0, deferred=True)):
            model = nn.Sequential(*[Block(width) for _ in range(blocks)])
        model = apply_zero(model, mesh, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        shard_optimizer(optimizer, config)
        say(
            f"set up in {time.perf_counter() - begin:.0f} s, VmHWM {_vm_kib('VmHWM') / 2**20:.2f} GiB, "
            f"VmData {_vm_kib('VmData') / 2**20:.2f} GiB"
        )
        generator = torch.Generator().manual_seed(rank)
        for _ in range(args.capped_steps):
            start = time.perf_counter()
            loss = model(torch.randn(4, width, generator=generator)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps_done += 1
            say(
                f"step {steps_done}: loss {loss.item():.4f} in {time.perf_counter() - start:.0f} s, "
                f"VmHWM {_vm_kib('VmHWM') / 2**20:.2f} GiB"
            )
        if args.mode == "nvme":
            _report_swap_and_detach(model, optimizer, say)
    except (MemoryError, RuntimeError) as error:  # the allocator's refusal under the cap
        outcome = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:140]}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    say(
        f"RESULT mode={args.mode} cap={args.cap_gib:.2f}GiB peak_rss={peak:.2f}GiB steps={steps_done} "
        f"{time.perf_counter() - begin:.0f}s {outcome}"
    )
    sys.stdout.flush()
    os._exit(0)  # a rank whose peer died must not wait in the process group's teardown


def capped_child_command(script: str, child_flag: str, mode: str, args) -> list[str]:
    """The command line of one capped child process of ``script`` (``child_flag``: which child it is) with the
    memory cap, model and NVMe settings of ``args``; ``bench_nvme.py``'s one-rank and two-rank children share it."""
    command = [sys.executable, script, child_flag, mode, "--nvme-path", args.nvme_path]
    for flag, value in (
        ("--capped-params", args.capped_params),
        ("--cap-gib", args.cap_gib),
        ("--width", args.width),
        ("--capped-steps", args.capped_steps),
        ("--sub-group-size", args.sub_group_size),
        ("--threads", args.threads),
        ("--queue-depth", args.queue_depth),
        ("--block-size", args.block_size),
    ):
        command += [flag, str(value)]
    return command


def run(args, script: str, world_size: int = 2) -> None:
    """Launch ``world_size`` capped ranks per offload (NVMe, then CPU) and print their lines."""
    from benchmarks.common import free_port

    for mode in ("nvme", "cpu"):
        print(
            f"stage 3, {world_size} rank processes, offload={mode!r}, RLIMIT_DATA {args.cap_gib:.2f} GiB each:",
            flush=True,
        )
        port = free_port()
        command = capped_child_command(script, "--stage3-child", mode, args)
        children = []
        for rank in range(world_size):
            env = {
                "MALLOC_MMAP_THRESHOLD_": "65536",
                **os.environ,
                "PYTHONWARNINGS": "ignore",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            children.append(
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            )
        for child in children:
            out, err = child.communicate()
            lines = [line for line in out.splitlines() if line.startswith("  ")]
            print("\n".join(lines) if lines else "  (no output)")
            if "FAILED" in out and "Connection reset by peer" in out:
                print("  (this rank failed because its peer died under the cap: the ranks are symmetric)")
            if child.returncode != 0:
                print(f"  exit code {child.returncode}: {err.strip().splitlines()[-3:]}")


def same_model_as_deepspeed(args) -> None:
    """One process: the model of ``bench_nvme.py``'s DeepSpeed ZeRO-3 child (``Linear(1024, 1024)`` layers without
    bias, batch 4, 1 rank, gloo) with this package's stage 3, parameters and optimizer states on NVMe, the same
    ``sub_group_size``, ``buffer_count`` 4 and aio knobs; prints the line the DeepSpeed child prints."""
    import shutil
    import tempfile

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.distributed.apply_zero import apply_zero
    from lightning_zero.distributed.config import ZeroConfig
    from lightning_zero.distributed.optimizer import shard_optimizer
    from lightning_zero.offload.nvme_config import NvmeConfig
    from lightning_zero.offload.optimizer_swapper import detach_swapper, get_swapper
    from lightning_zero.offload.param_swapper import detach_param_step, detach_param_swapper, get_param_swapper

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29572")
    dist.init_process_group("gloo")
    folder = tempfile.mkdtemp(prefix="lz-nvme-", dir=args.nvme_path)
    width = 1024
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, int(args.params) // width**2))])
    numel = sum(p.numel() for p in model.parameters())
    nvme = NvmeConfig(
        folder,
        sub_group_size=int(args.sub_group_size),
        buffer_count=4,
        max_in_cpu=int(args.max_in_cpu),
        aio=dict(thread_count=args.threads, queue_depth=args.queue_depth, block_size=args.block_size),
    )
    config = ZeroConfig(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme=nvme, unit_bytes=0)
    try:
        model = apply_zero(model, init_device_mesh("cpu", (1,)), config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.optimizer_fused)
        shard_optimizer(optimizer, config)
        times, cpu = [], []
        for _ in range(args.steps + 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            model(torch.randn(4, width)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        on_disk = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
        params, states = get_param_swapper(model), get_swapper(optimizer)
        step = sorted(times[1:])[len(times[1:]) // 2]
        print(
            f"  lightning-zero stage 3 NVMe (optimizer + parameters), {numel / 1e6:.0f}M fp32 parameters: train "
            f"step {step * 1e3:.0f} ms (median of {args.steps}; process CPU time "
            f"{sorted(cpu[1:])[len(cpu[1:]) // 2] * 1e3:.0f} ms), swap files {on_disk >> 20} MiB; at least "
            f"{2 * on_disk / step / GB:.2f} GB/s if every file is read and written once per step (its engine: "
            f"optimizer states read {states.io.throughput('read') / GB:.2f}, written "
            f"{states.io.throughput('write') / GB:.2f} GB/s; parameters read {params.bytes_read >> 20} MiB in "
            f"{args.steps + 1} steps: the model's shards read {params.bytes_read / params.disk_bytes():.1f} times)",
            flush=True,
        )
        detach_swapper(optimizer, restore=False)
        detach_param_step(optimizer)
        detach_param_swapper(model, restore=False)
    except Exception as error:
        print(f"  lightning-zero stage 3 NVMe failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
