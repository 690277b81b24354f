import pathlib

import pytest

_GPU_DIR = pathlib.Path(__file__).parent.resolve()


def pytest_collection_modifyitems(config, items):
    # [Note: conftest hooks are not directory-scoped]
    # pytest calls this hook for *every* collected item, not only for those under tests/gpu, so the marker is
    # added only to items whose file lives in this directory. Marking every item once skipped the whole suite in CI.
    for item in items:
        if _GPU_DIR in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
