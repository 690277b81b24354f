"""Write ``deepspeed_config_keys.json``: every key path the installed DeepSpeed's configuration reader knows.

Run it (from the repository root) with DeepSpeed installed; the test that reads the list
(``tests/ds_config/test_ds_config_keys.py``) does not need DeepSpeed::

    python tests/data/generate_deepspeed_config_keys.py

How the keys are found, so that none depends on reading DeepSpeed's sources by eye:

1. DeepSpeed's own ``DeepSpeedConfig`` parses configs whose sections are *recording* dicts: every key the parser
   looks up (``get``, ``[]``, ``in``, ``setdefault``, ``pop``) is recorded with its path and the default it falls
   back to. Each top-level key it asks for is then fed again as a section of its own, once as it is and once with
   every missing ``enabled`` read as true, so the reads behind a feature switch are recorded too.
2. The pydantic models the parser builds (``DeepSpeedConfigModel`` subclasses: ``zero_optimization``, ``fp16``...)
   are caught as they are constructed and walked field by field, nested models included; a field's alias and its
   own name are both keys (DeepSpeed's models accept either), and deprecated fields say what replaces them.
3. ``READ_ELSEWHERE``: the few keys DeepSpeed reads outside its config parser (named with the file that reads them).
4. Keys DeepSpeed 0.19 removed and refuses (``_REMOVED_*_CONFIG_KEYS``) are listed with ``"removed": true``.

The contents of ``optimizer.params`` and ``scheduler.params`` are the chosen optimizer's and scheduler's arguments,
not configuration keys, so they are not listed (``lightning_zero.ds_config.dry_build`` checks them against the class
they build). Levels named by the user (curriculum metrics) are not listed either.
"""

from __future__ import annotations

import collections.abc
import enum
import json
import sys
import typing
from pathlib import Path

import deepspeed
import deepspeed.runtime.config as ds_runtime_config
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import BaseModel

OUTPUT = Path(__file__).with_name("deepspeed_config_keys.json")
MARK = "__lz_section__"  # carried inside each recording section so the pydantic model built from it is known

# (path, default, file of DeepSpeed that reads it): keys read outside DeepSpeedConfig.
READ_ELSEWHERE = (
    ("sequence_parallel_size", None, "deepspeed/__init__.py initialize, runtime/config.py DeepSpeedConfig.__init__"),
    ("data_parallel_size", None, "deepspeed/__init__.py initialize (with sequence_parallel_size)"),
    ("pipeline.use_reentrant", True, "runtime/pipe/engine.py PipelineEngine.__init__"),
    ("optimizer.params", None, "runtime/config.py get_optimizer_params (the optimizer's own arguments)"),
    ("scheduler.params", None, "runtime/config.py get_scheduler_params (the scheduler's own arguments)"),
)
# The pipeline section is copied over these defaults without per-key reads (runtime/config.py get_pipeline_config).
PIPELINE_DEFAULTS = (
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
)

READS: dict[str, object] = {}
MODELS: dict[str, type] = {}


class _RecordingKeys(collections.abc.KeysView):
    def __contains__(self, key: object) -> bool:
        self._mapping.record(key, None)
        return dict.__contains__(self._mapping, key)

    def __iter__(self):
        return iter([key for key in dict.keys(self._mapping) if key != MARK])


class Recording(dict):
    """A config section that records every key looked up in it (see the module docstring)."""

    def __init__(self, data: dict, path: str, enable: str = "") -> None:
        super().__init__(data)
        self.path, self.enable = path, enable  # enable: the section whose missing "enabled" reads as true
        if path:
            dict.__setitem__(self, MARK, path)

    def _path(self, key: object) -> str:
        return f"{self.path}.{key}" if self.path else str(key)

    def record(self, key: object, default: object) -> None:
        if key != MARK:
            READS.setdefault(self._path(key), default)

    def _child(self, key: str, value: object) -> object:
        if isinstance(value, dict) and not isinstance(value, Recording):
            value = Recording(value, self._path(key), self.enable)
            dict.__setitem__(self, key, value)
        return value

    def get(self, key, default=None):
        self.record(key, default)
        if dict.__contains__(self, key):
            return self._child(key, dict.__getitem__(self, key))
        if self.enable == self.path and key == "enabled":
            return True
        if isinstance(default, dict):
            return Recording(dict(default), self._path(key), self.enable)
        return default

    def __getitem__(self, key):
        self.record(key, None)
        return self._child(key, dict.__getitem__(self, key))

    def __contains__(self, key) -> bool:
        self.record(key, None)
        return dict.__contains__(self, key)

    def setdefault(self, key, default=None):
        self.record(key, default)
        return dict.setdefault(self, key, default)

    def pop(self, key, *default):
        self.record(key, default[0] if default else None)
        return dict.pop(self, key, *default)

    def keys(self):
        return _RecordingKeys(self)


def _plain(value: object) -> object:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in dict.items(value) if key != MARK}
    return value


def _model_classes(annotation: object) -> list:
    """The pydantic model classes inside a field's annotation (``Optional[X]``, ``Union[X, Y]``, ``X``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [cls for arg in typing.get_args(annotation) for cls in _model_classes(arg)]


_ORIGINAL_INIT = DeepSpeedConfigModel.__init__


def _recording_init(self, strict=False, **data):
    path = data.pop(MARK, None)
    if path is not None:
        MODELS.setdefault(path, type(self))
    fields = type(self).model_fields
    for key, value in data.items():
        if isinstance(value, dict) and MARK in value:  # a section nested in a model's argument (the monitors)
            field = fields.get(key) or next((f for f in fields.values() if f.alias == key), None)
            classes = _model_classes(field.annotation) if field is not None else []
            if classes:
                MODELS.setdefault(dict.__getitem__(value, MARK), classes[0])
    _ORIGINAL_INIT(self, strict=strict, **{key: _plain(value) for key, value in data.items()})


def _parse(config: Recording) -> None:
    try:
        DeepSpeedConfig(config)
    except Exception:  # noqa: BLE001 - a section fed on its own may be refused; what it read is recorded
        pass


def _jsonable(value: object) -> object:
    if isinstance(value, BaseModel) or value is ...:
        return None
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return repr(value)


def _walk_model(cls: type, path: str, keys: dict) -> None:
    for name, field in cls.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        names = [field.alias] if field.alias and field.alias != name else []
        for key in names + [name]:
            entry = {
                "path": f"{path}.{key}",
                "default": _jsonable(field.get_default(call_default_factory=True)),
                "source": f"pydantic {cls.__module__}.{cls.__qualname__}",
            }
            if key == name and names:
                entry["alias_of"] = f"{path}.{field.alias}"  # the field's own name, accepted as well (populate_by_name)
            if extra.get("deprecated"):
                entry["deprecated"] = str(extra.get("new_param", "")) or True
            keys.setdefault(entry["path"], entry)
        for nested in _model_classes(field.annotation):
            _walk_model(nested, f"{path}.{names[0] if names else name}", keys)


def _config(sections: set, top: str, enable: str) -> Recording:
    """``{"train_batch_size": 1, top: {...}}`` with every known section under ``top`` present (empty)."""
    root = Recording({"train_batch_size": 1}, "", enable)
    for path in sorted(s for s in sections if s == top or s.startswith(top + ".")):
        parent = root
        for depth, part in enumerate(path.split(".")):
            if not dict.__contains__(parent, part):
                dict.__setitem__(parent, part, Recording({}, ".".join(path.split(".")[: depth + 1]), enable))
            parent = dict.__getitem__(parent, part)
    return root


def _explore() -> set:
    """Parse until no new key is read: each top-level key read becomes a section of its own, and each key read
    under a section with a ``{}`` or no default is tried as a (sub)section, kept when it leads to new reads."""
    _parse(Recording({"train_batch_size": 1}, ""))
    sections: set = set()
    tried: set = set()
    while True:
        before = len(READS)
        for top in sorted({path.split(".")[0] for path in READS}):
            sections.add(top)
            for enable in ["", *sorted(s for s in sections if s == top or s.startswith(top + "."))]:
                _parse(_config(sections, top, enable))
        in_models = tuple(MODELS)
        candidates = [
            path
            for path, default in READS.items()
            if path not in tried
            and path not in sections
            and "." in path
            and (default is None or isinstance(default, dict))
            and not any(path == m or path.startswith(m + ".") for m in in_models)
        ]
        for path in candidates:
            tried.add(path)
            count = len(READS)
            for enable in ("", path):
                _parse(_config(sections | {path}, path.split(".")[0], enable))
            if len(READS) > count:
                sections.add(path)
        if len(READS) == before and not candidates:
            return sections


def collect() -> dict:
    DeepSpeedConfigModel.__init__ = _recording_init
    try:
        _explore()
    finally:
        DeepSpeedConfigModel.__init__ = _ORIGINAL_INIT
    keys: dict[str, dict] = {}
    for path, default in READS.items():
        keys[path] = {"path": path, "default": _jsonable(default), "source": "read by DeepSpeedConfig"}
    for path, cls in MODELS.items():
        _walk_model(cls, path, keys)
    for path, default, where in READ_ELSEWHERE:
        keys.setdefault(path, {"path": path, "default": default, "source": f"read in {where}"})
    for key in PIPELINE_DEFAULTS:
        keys.setdefault(
            f"pipeline.{key}",
            {"path": f"pipeline.{key}", "default": None, "source": "runtime/config.py get_pipeline_config defaults"},
        )
    removed = {
        **ds_runtime_config._REMOVED_TOP_LEVEL_CONFIG_KEYS,
        **{f"zero_optimization.{k}": v for k, v in ds_runtime_config._REMOVED_ZERO_CONFIG_KEYS.items()},
    }
    for path in removed:
        keys.setdefault(path, {"path": path, "default": None, "source": "runtime/config.py"})
        keys[path]["removed"] = True
    return {
        "deepspeed_version": deepspeed.__version__,
        "generated_by": "tests/data/generate_deepspeed_config_keys.py",
        "keys": [keys[path] for path in sorted(keys)],
    }


def main() -> int:
    result = collect()
    OUTPUT.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{len(result['keys'])} keys of DeepSpeed {result['deepspeed_version']} -> {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
