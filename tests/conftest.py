import os
import shutil
import tempfile

import pytest
import torch

# Tests share two cores: keep every process single-threaded so ranks do not fight over them.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process a test starts (torchrun ranks, CLI runs) prints its threads' Python stacks if it dies of a fatal
# signal (SIGABRT, SIGSEGV): a rank that dies that way in CI, where it cannot be watched, then says where it was.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# torch's C++ extensions (DeepSpeed's JIT-built ops) of every process the tests start go to a directory of this
# session, never the user's cache, where a build a timeout killed would leave a lock every later build waits on; the
# session fails if anything was built there (tests/deepspeed_cpu.py).
_EXTENSIONS = tempfile.mkdtemp(prefix="lightning-zero-tests-extensions-")
os.environ["TORCH_EXTENSIONS_DIR"] = _EXTENSIONS


# The quick tier (`-m "not slow"`) is the package's own tests; these folders are whole-job checks that start many
# processes each (fault injection, multi-node launches, Lightning's ported strategy tests, the benchmarks' own
# tests), so all of their tests belong to the slow tier, which the full suite (CI) runs as well.
SLOW_FOLDERS = ("reliability", "launch", "conformance", "benchmarks")


def pytest_collection_modifyitems(config, items):
    tests = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if os.path.relpath(str(item.path), tests).split(os.sep)[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: tests/gpu runs only where torch.cuda.is_available()")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves a process group in the pytest process would be inherited by every rank the next tests fork
    (tests/ranks.py), whose copies of its gloo groups hang in their destructors. Tear it down and say which."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a process group in the pytest process (now destroyed)", pytrace=False)


# What torch.distributed and Lightning read to find a rendezvous. Lightning's launchers write them into the process
# that launches (its own ranks inherit them); left in the pytest process, a later test's subprocess would rendezvous
# on a port an earlier test's store may still hold (EADDRINUSE).
RENDEZVOUS_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
)


@pytest.fixture(autouse=True)
def _rendezvous_environment_restored():
    """Each test starts from the session's rendezvous variables, whatever the previous test's launcher set."""
    saved = {name: os.environ.get(name) for name in RENDEZVOUS_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_sessionfinish(session, exitstatus):
    built = sorted(os.listdir(_EXTENSIONS))
    shutil.rmtree(_EXTENSIONS, ignore_errors=True)
    if built:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"a test JIT-built torch extensions {built}: see tests/deepspeed_cpu.py", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
