"""One measured configuration of ``bench_stages.py``: fresh spawned ranks train one model under one strategy.

A job is ``{"model", "precision", "kind"}`` (plus optional ``"options"``: extra ``ZeroStrategy`` keyword
arguments, for side-by-side comparisons of one option); ``kind`` is ``zero:<stage>[+cpu]`` (ZeroStrategy),
``deepspeed:<stage>[+cpu]``, ``ddp``, ``modelparallel:<2|3>`` (Lightning's FSDP2 strategy; 2 keeps the gathered
parameters after forward, 3 reshards them), ``fsdp:<sharding strategy>`` (Lightning's FSDP1 strategy, opt-in) or
``floor:<stage>`` (no strategy: the computation any data-parallel step at that stage must do, see ``run_floor``),
``sync:<stage>`` (the floor plus the one synchronisation per step that any data-parallel step needs: a lower bound)
``minimal:<0|1|2>`` (a framework-free loop with the stage's least communication, see ``run_minimal``) or
``engine:<0|1|2>`` (torch's own engine for the stage, DDP, ZeroRedundancyOptimizer or FSDP2, in a bare loop, see
``run_engine``).

Each rank reports the median wall time of a full training step (forward, backward, optimizer step) after warm-up,
and the growth of its peak memory (``VmHWM`` reset after imports on CPU; the CUDA allocator's peak on GPU).
``measure`` returns the maximum of both over ranks: the slowest rank sets the step time, the fullest the memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from benchmarks import _bench_models as models
from benchmarks._bench_counts import StepCounter
from benchmarks.common import deepspeed_init_distributed

# bf16t: ZeroStrategy's "bf16-true", whose stages 2-3 compute every op in bf16 over fp32 sharded masters: the numerics
# of DeepSpeed's bf16 engine (bf16.enabled), which both bf16 columns run on the DeepSpeed side.
PRECISIONS = {"fp32": ("32-true", None), "bf16": ("bf16-mixed", torch.bfloat16), "bf16t": ("bf16-true", torch.bfloat16)}


# Imported by every worker before its memory baseline. DeepSpeed's initialize imports torch._dynamo, torch._inductor
# (with sympy and triton) lazily, ~150 MB of modules and shared libraries: counted as growth they charged DeepSpeed a
# fixed import cost that has nothing to do with its model states (its tiny-model runs showed ~160 MB more than ours).
# Loading the same set on every side first keeps the figure about training memory.
_PRELOAD = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "lightning.pytorch",
    "lightning_zero",
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.bf16_optimizer",
)


def _preload() -> None:
    import importlib.util

    for name in _PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)


def _on_cuda() -> bool:
    return os.environ.get("BENCH_DEVICE") == "cuda" and torch.cuda.is_available()


def _reset_peak() -> int:
    if _on_cuda():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _proc_kib("VmRSS") * 1024


def _peak(baseline: int) -> int:
    if _on_cuda():
        return torch.cuda.max_memory_allocated() - baseline
    return _proc_kib("VmHWM") * 1024 - baseline


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def run_lightning(rank, world, args, job, out):
    import lightning.pytorch as pl

    import lightning_zero  # noqa: F401
    from lightning_zero import ZeroStrategy

    baseline = _reset_peak()
    times = []
    name, kind = job["model"], job["kind"]
    flag, low_dtype = PRECISIONS[job["precision"]]
    strategy_name, _, option = kind.partition(":")

    class Module(models.lightning_module(name, args)):
        def configure_model(self):
            if strategy_name != "modelparallel":
                return
            # Lightning's FSDP2 path: the user shards the model themselves, per repeated block then the root, with
            # the low-precision compute copies ZeroStrategy uses (fp32 masters, bf16 gathered, fp32 reduction).
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh, reshard = self.device_mesh["data_parallel"], option == "3"
            policy = MixedPrecisionPolicy(param_dtype=low_dtype, reduce_dtype=torch.float32 if low_dtype else None)
            for unit in models.units(name, self.net):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
            # The root as Lightning's FSDP2 docs shard it, with FSDP2's default (None): at stage 3 that keeps the
            # root gathered from forward to backward; passing True would re-gather it in backward.
            fully_shard(self.net, mesh=mesh, reshard_after_forward=None if reshard else False, mp_policy=policy)

    profiler, counter = _StepProfiler(args, rank, job), StepCounter(args, rank, job)

    class Timer(pl.Callback):
        # On CUDA the step's kernels run after the hooks return: without a synchronisation on both edges the figure
        # would be the host's launch time, with the GPU's work charged to whichever later step waits for it.
        # run_deepspeed synchronises the same way.
        def on_train_batch_start(self, *a):
            counter.step_begin(len(times))
            profiler.step_begin(len(times))
            if _on_cuda():
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            if _on_cuda():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    if strategy_name == "zero":
        stage, _, offload = option.partition("+")
        strategy = ZeroStrategy(stage=int(stage), offload=offload or None, **job.get("options", {}))
    elif strategy_name == "ddp":
        strategy = pl.strategies.DDPStrategy()
    elif strategy_name == "fsdp":
        strategy = pl.strategies.FSDPStrategy(sharding_strategy=option or "FULL_SHARD")
    elif strategy_name == "modelparallel":
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        raise ValueError(kind)
    data = models.batches(name, args, rank)
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=world,
        strategy=strategy,
        precision=flag,
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
    profiler.finish()
    counter.finish()
    _write(out, rank, times[args.warmup :], _peak(baseline))


def deepspeed_config(args, job) -> dict:
    """DeepSpeed's config for the same stage, offload, precision, batch and optimizer as our run."""
    stage, _, offload = job["kind"].partition(":")[2].partition("+")
    zero = {"stage": int(stage)}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": args.device == "cuda"}
        if int(stage) == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": args.device == "cuda"}
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if job["precision"] in ("bf16", "bf16t"):
        config["bf16"] = {"enabled": True}  # bf16 weights and compute, fp32 masters in the optimizer
    if job.get("ds_cpu_adam"):
        # DeepSpeed's own offload optimizer (gpu_suite.py --ds-cpu-adam): without torch_adam, an offloaded AdamW is
        # its DeepSpeedCPUAdam, a C++ extension built on first use (JIT, ninja); refused without offload.
        if not offload:
            raise ValueError(f"ds_cpu_adam needs an offloaded configuration, got {job['kind']}")
        del config["optimizer"]["params"]["torch_adam"]
        config["zero_force_ds_cpu_optimizer"] = True
    return config


def floor_owners(sizes: list[int], world: int) -> list[int]:
    """The rank that steps each parameter in the compute floor at stages 1-3: largest first onto the least loaded
    rank, so every rank steps about ``1/world`` of the elements (what ZeRO's partitioning gives each rank)."""
    loads, owners = [0] * world, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owners[index] = loads.index(min(loads))
        loads[owners[index]] += sizes[index]
    return owners


def run_floor(rank, world, args, job, out):
    """The compute floor of a cell: each rank runs forward and backward on its own micro-batch and AdamW on its
    share of the parameters (all of them at stage 0, about ``1/world`` of the elements at stages 1-3), in a plain
    torch loop with no collective and no framework. Any data-parallel step at that stage, in that precision, does at
    least this work on the same cores, so ``floor step / peer step`` is the lowest ratio to the peer that any
    implementation can reach: a step-time target below it cannot be met by anyone.

    Precision as ZeroStrategy computes (``adapters/precision_policy.py``): at stages 0-1 both bf16 flags run the fp32
    model under CPU autocast; at stages 2-3 the fp32 masters are cast once per step into a bf16 compute copy (FSDP2's
    ``param_dtype`` cast, done before its all-gather), which runs under autocast for ``bf16`` (``bf16-mixed``) and
    without it for ``bf16t`` (``bf16-true``), and the bf16 gradients are cast to fp32 for the master step.

    ``sync:<stage>`` adds one collective of a single element per step, after backward. Data parallelism exchanges
    something every step, so its ranks meet at least once per step and each step lasts as long as the slower rank's:
    with two ranks on two shared cores, that wait alone costs more than the collective's bytes. ``sync / peer`` is
    a lower bound on the step-time ratio that no data-parallel implementation computing this way can pass."""
    import copy

    synced = job["kind"].startswith("sync:")
    if synced:
        import torch.distributed as dist

        dist.init_process_group("nccl" if _on_cuda() else "gloo")
        token = torch.zeros(1, device="cuda" if _on_cuda() else "cpu")
    baseline = _reset_peak()
    name, stage = job["model"], job["kind"].partition(":")[2].partition("+")[0]
    model = models.build(name, args)
    low_dtype = PRECISIONS[job["precision"]][1]
    compute = model
    if low_dtype is not None and stage in ("2", "3"):
        compute = copy.deepcopy(model).to(low_dtype)
    pairs = list(zip(model.parameters(), compute.parameters()))
    if stage != "0":  # this rank's share of the optimizer step
        owners = floor_owners([master.numel() for master, _ in pairs], world)
        pairs = [pair for pair, owner in zip(pairs, owners) if owner == rank]
    optimizer = _adamw([master for master, _ in pairs])
    autocast = low_dtype is not None and (job["precision"] == "bf16" or compute is model)
    times = []
    for x, y in models.batches(name, args, rank):
        start = time.perf_counter()
        if compute is not model:
            with torch.no_grad():
                for master, low in zip(model.parameters(), compute.parameters()):
                    low.copy_(master)
        if compute is not model and not autocast and x.is_floating_point():
            x = x.to(low_dtype)  # bf16-true casts float inputs (the precision plugin's convert_input)
        with torch.autocast("cpu", dtype=low_dtype or torch.bfloat16, enabled=autocast):
            value = models.loss(name, compute, x, y)
        value.backward()
        if synced:
            dist.all_reduce(token)
        if compute is not model:
            for master, low in pairs:
                master.grad = low.grad.float()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        compute.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    _write(out, rank, times[args.warmup :], _peak(baseline))


def _adamw(params) -> torch.optim.AdamW:
    """The bare loops' AdamW (lr 1e-4), stepping with the kernel ZeroStrategy's would: torch's fused one for fp32 CPU
    tensors (``lightning_zero.ops.cpu_fused``), so that a yardstick never runs a slower kernel than ours does.
    Imported here, not with the module: a ``--peers before`` rank must import the other checkout's package first."""
    from lightning_zero.ops.cpu_fused import steps_fused_on_cpu

    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for index in steps_fused_on_cpu(optimizer):
        optimizer.param_groups[index]["fused"] = True
    return optimizer


def _bare_loop_start(rank, args, job):
    """What the bare loops (``minimal:<stage>``, ``engine:<stage>``) share before their first step: the stage (0-2
    only), the device, the process group, the memory baseline, the model on the device and the compute dtype."""
    import torch.distributed as dist

    loop, _, stage = job["kind"].partition(":")
    if stage not in ("0", "1", "2"):
        raise ValueError(f"{job['kind']}: the {loop} loop covers stages 0-2")
    if job["precision"] == "bf16t":
        raise ValueError(f"{job['kind']}: the {loop} loop computes bf16 as bf16-mixed only, not bf16-true")
    device = torch.device("cuda", rank) if _on_cuda() else torch.device("cpu")
    dist.init_process_group("nccl" if _on_cuda() else "gloo")
    baseline = _reset_peak()
    model = models.build(job["model"], args).to(device)
    return int(stage), device, baseline, model, PRECISIONS[job["precision"]][1]


def _timed_batches(args, rank, job, device, times: list):
    """The bare loops' batches on ``device``, each step timed from handing its batch out to asking for the next one
    (after a CUDA synchronisation: the step's kernels count), appended to ``times``; ``--profile`` and ``--count``
    follow the same steps."""
    profiler, counter = _StepProfiler(args, rank, job), StepCounter(args, rank, job)
    for x, y in models.batches(job["model"], args, rank):
        counter.step_begin(len(times))
        profiler.step_begin(len(times))
        start = time.perf_counter()
        yield x.to(device), y.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    profiler.finish()
    counter.finish()


def run_minimal(rank, world, args, job, out):
    """A framework-free data-parallel loop with the least communication of its stage (``minimal:<0|1|2>``): what
    the stage's computation plus its collectives cost on this machine with no framework at all. Not a bound (a
    cleverer design may overlap more), a yardstick: the share of a peer's step that any engine built on these
    collectives keeps.

    - Stage 0: every gradient copied into one flat buffer, one all-reduce, every rank steps every parameter (DDP
      with a single bucket, without its hooks or overlap).
    - Stages 1-2: DeepSpeed's own layout without its engine: the parameters flattened, each rank owns a contiguous
      ``1/world`` slice as one fp32 tensor that AdamW steps; per step one reduce-scatter of the flat gradients (on
      gloo, which has none, the all-to-all plus local sum ZeroStrategy uses, ``distributed/comm_buffers.py``) and one
      all-gather of the updated slices, copied back into the model.
    - bf16: the fp32 model under autocast (``bf16-mixed``'s numerics) at every stage; gradients reduced in fp32.

    Each rank also reports the sum of its parameters after training: every stage trains the same model on the same
    batches, so the sums agree across ranks and stages (``tests/benchmarks/test_bench_stages.py``)."""
    import torch.distributed as dist

    from lightning_zero.distributed.comm_buffers import (
        _all_gather_flat,  # torch's, under its name in this torch version
    )

    name, (stage, device, baseline, model, low_dtype) = job["model"], _bare_loop_start(rank, args, job)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    chunk = -(-total // world)
    flat = torch.zeros(chunk * world, device=device)  # the gradients, then (stages 1-2) the gathered parameters
    grads = flat.split(sizes + [flat.numel() - total])  # each parameter's view into it, then the padding
    if stage == 0:
        optimizer = _adamw(params)
    else:
        with torch.no_grad():
            whole = torch.cat([p.reshape(-1) for p in params] + [grads[-1]])
        master = torch.nn.Parameter(whole[rank * chunk : (rank + 1) * chunk].clone())
        optimizer = _adamw([master])
        received = torch.empty_like(flat)
    times = []
    for x, y in _timed_batches(args, rank, job, device, times):
        with torch.autocast(device.type, dtype=low_dtype or torch.bfloat16, enabled=low_dtype is not None):
            value = models.loss(name, model, x, y)
        value.backward()
        for p, g in zip(params, grads):
            g.view_as(p).copy_(p.grad)
        if stage == 0:
            dist.all_reduce(flat)
            flat.div_(world)
            for p, g in zip(params, grads):
                p.grad.copy_(g.view_as(p))
            optimizer.step()
        else:
            if device.type == "cuda":
                master.grad = torch.empty_like(master)
                dist.reduce_scatter_tensor(master.grad, flat)
            else:
                dist.all_to_all_single(received, flat)
                master.grad = received.view(world, chunk).sum(0)
            master.grad.div_(world)
            optimizer.step()
            _all_gather_flat(flat, master.detach())
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.copy_(g.view_as(p))
        model.zero_grad(set_to_none=True)
    checksum = float(sum(p.detach().double().sum() for p in params))
    _write(out, rank, times[args.warmup :], _peak(baseline), param_sum=checksum)
    dist.destroy_process_group()


def run_engine(rank, world, args, job, out):
    """torch's own engine for the stage in a bare loop, no Lightning and no lightning_zero (``engine:<0|1|2>``): what
    any stage built on torch's engines and run under no framework costs, so ``ours / engine`` is the tax of the
    Trainer and of lightning_zero alone, and ``engine / minimal`` the price of the engine against flat buffers.

    - Stage 0: ``DistributedDataParallel`` with ``gradient_as_bucket_view=True`` (ZeroStrategy's default) and AdamW.
    - Stage 1: the same DDP under ``torch.distributed.optim.ZeroRedundancyOptimizer`` (torch's ZeRO-1: each rank
      steps its partition, then broadcasts it from bucket views, ``parameters_as_bucket_view=True``).
    - Stage 2: ``fully_shard`` once, at the root, with ``reshard_after_forward=False``: the fewest FSDP2 hooks and
      collectives (one all-gather, one reduce-scatter per step) a stage 2 built on FSDP2 can run, so a lower bound
      for any such layout; AdamW over the shards' local tensors (as ZeroStrategy steps them, ``local_step.py``).
    - bf16: the fp32 model under autocast (``bf16-mixed``) at every stage; at stage 2 also FSDP2's bf16 compute copy
      with fp32 gradient reduction, as ZeroStrategy and Lightning's ModelParallelStrategy gather it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    name, (stage, device, baseline, model, low_dtype) = job["model"], _bare_loop_start(rank, args, job)
    if stage == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=low_dtype, reduce_dtype=torch.float32 if low_dtype else None)
        trained = fully_shard(model, reshard_after_forward=False, mp_policy=policy)
    else:
        trained = DistributedDataParallel(
            model, device_ids=[rank] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    params = list(model.parameters())
    if stage == 1:
        fused = bool(_adamw(params).param_groups[0]["fused"]) or None  # the kernel the other loops pick
        optimizer = ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, lr=1e-4, fused=fused, parameters_as_bucket_view=True
        )
    elif stage == 2:  # AdamW over the shards' local tensors (same storage): DTensor dispatch per op is not FSDP2's
        shards = [p.to_local().detach() for p in params]
        optimizer = _adamw(shards)
    else:
        optimizer = _adamw(params)
    times = []
    for x, y in _timed_batches(args, rank, job, device, times):
        with torch.autocast(device.type, dtype=low_dtype or torch.bfloat16, enabled=low_dtype is not None):
            value = models.loss(name, trained, x, y)
        value.backward()
        if stage == 2:
            for param, shard in zip(params, shards):
                shard.grad = param.grad.to_local()
        optimizer.step()
        trained.zero_grad(set_to_none=True)
        if stage == 2:  # the optimizer holds the shards' local tensors, whose gradients the module does not reach
            optimizer.zero_grad(set_to_none=True)
    checksum = float(
        sum(
            p.detach().full_tensor().double().sum() if hasattr(p, "full_tensor") else p.detach().double().sum()
            for p in model.parameters()
        )
    )
    _write(out, rank, times[args.warmup :], _peak(baseline), param_sum=checksum)
    # The process group outlives DDP (destroyed with this frame): _end_process_group ends it afterwards. Destroying
    # it here first hung one rank now and then in DDP's teardown.


def run_deepspeed(rank, world, args, job, out):
    deepspeed = deepspeed_init_distributed(args.device)
    baseline = _reset_peak()
    name = job["model"]
    model = models.build(name, args)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(args, job)
    )
    device, low_dtype = engine.device, PRECISIONS[job["precision"]][1]
    times, profiler, counter = [], _StepProfiler(args, rank, job), StepCounter(args, rank, job)
    for x, y in models.batches(name, args, rank):
        counter.step_begin(len(times))
        profiler.step_begin(len(times))
        start = time.perf_counter()
        # DeepSpeed's bf16 engine holds bf16 weights: float inputs must be bf16 too (token ids stay integers).
        x = x.to(device, low_dtype) if low_dtype is not None and x.is_floating_point() else x.to(device)
        engine.backward(models.loss(name, engine, x, y.to(device)))
        engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    profiler.finish()
    counter.finish()
    _write(out, rank, times[args.warmup :], _peak(baseline))


class _StepProfiler:
    """Under ``--profile DIR``, rank 0 records CPU ops over the measured steps (after warm-up) and writes the top ops
    by self CPU time, as shares of the total: shares survive a loaded machine where absolute times do not."""

    def __init__(self, args, rank, job):
        self.args, self.job, self.prof = args, job, None
        self.active = bool(args.profile) and rank == 0

    def step_begin(self, index: int) -> None:
        if self.active and index == self.args.warmup and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.start()

    def finish(self) -> None:
        if self.prof is None:
            return
        self.prof.stop()
        # FSDP2 names its ranges per unit ("FSDP::all_gather (net.3)"): summed over units, so a cost paid once per
        # unit shows as one line with its call count instead of being spread below the top ops.
        groups: dict[str, list] = {}
        for event in self.prof.key_averages():
            if event.self_cpu_time_total > 0:
                group = groups.setdefault(re.sub(r" \(.*\)$", "", event.key), [0.0, 0])
                group[0] += event.self_cpu_time_total
                group[1] += event.count
        total = sum(t for t, _ in groups.values())
        top = sorted(groups.items(), key=lambda item: item[1][0], reverse=True)[: self.args.profile_top]
        rows = [{"op": key, "self_share": t / total, "calls": calls} for key, (t, calls) in top]
        job = self.job
        os.makedirs(self.args.profile, exist_ok=True)
        name = f"{job['model']}_{job['precision']}_{job['kind'].replace(':', '_')}.json"
        path = os.path.join(self.args.profile, name)
        with open(path, "w") as f:
            json.dump({"job": job, "steps": self.args.steps, "self_cpu_total_us": total, "top": rows}, f, indent=1)


def _write(out, rank, times, peak, **extra):
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"time": statistics.median(times), "peak": peak, "times": list(times), **extra}, f)


def _entry(rank, world, port, args, job, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        BENCH_DEVICE=args.device,
    )
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    if job.get("src"):  # bench_stages --peers before: another checkout's lightning_zero, imported first
        import sys

        sys.path.insert(0, job["src"])
    _preload()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    runners = {
        "deepspeed": run_deepspeed,
        "floor": run_floor,
        "sync": run_floor,
        "minimal": run_minimal,
        "engine": run_engine,
    }
    if job["kind"].startswith("empty:"):
        from benchmarks._bench_empty import run_empty

        run_empty(rank, world, args, job, out, _write)
    else:
        runners.get(job["kind"].partition(":")[0], run_lightning)(rank, world, args, job, out)
    _end_process_group()


def _end_process_group() -> None:
    """Destroy what is left of the runner's process group and let gloo's worker threads go idle before this spawned
    rank's interpreter tears down: a worker dropping its last work then aborts the process ("terminate called
    without an active exception", SIGABRT after the job finished). The same mitigation as the strategies' exit
    handler (``[Note: gloo workers still holding the last work at teardown]``, process_group_exit.py)."""
    import torch.distributed as dist

    from lightning_zero.distributed.process_group_exit import quiesce_gloo_workers

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    quiesce_gloo_workers()


# glibc reads these when a process starts: a rank's per-step buffers below 32 MiB come from its heap, and its heap's
# top is given back to the OS only past 128 MiB free (bench_stages.py --steady-heap; the settings the environment
# audit names for a CPU run, lightning_zero.diagnostics.env_audit, kept equal by
# tests/benchmarks/test_bench_stages.py; not imported here: a rank of --peers before imports the library only after
# putting the old tree first on its path).
STEADY_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}


@contextlib.contextmanager
def _child_environment(extra: dict):
    """``os.environ`` with ``extra`` while ranks are spawned (they inherit it), restored after."""
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spawn(job: dict, args) -> list[dict]:
    """Run ``job`` in fresh spawned ranks; every rank's result (``time``, ``peak``, and what its runner adds)."""
    from benchmarks.common import free_port

    heap = STEADY_HEAP if getattr(args, "steady_heap", False) else {}  # bench_capacity/gpu_suite have no such flag
    with tempfile.TemporaryDirectory() as tmp, _child_environment(heap):
        out = os.path.join(tmp, "result")
        nproc = job.get("nproc", args.nproc)
        mp.start_processes(_entry, args=(nproc, free_port(), args, job, out), nprocs=nproc, start_method="spawn")
        results = []
        for r in range(nproc):
            with open(f"{out}.{r}") as f:
                results.append(json.load(f))
    return results


def measure(job: dict, args) -> tuple[float, int]:
    """(step time in s, peak memory growth in bytes) of ``job``: the maximum over fresh spawned ranks."""
    results = spawn(job, args)
    return max(r["time"] for r in results), max(r["peak"] for r in results)
