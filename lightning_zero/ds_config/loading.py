"""Reading a DeepSpeed config from a file, a JSON string or a dict, plus the errors/warnings of this package."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping, Union


class DeepSpeedConfigError(ValueError):
    """A ``ds_config`` that cannot be honoured: unknown key, unsupported feature, conflict or bad value."""


class DeepSpeedConfigWarning(UserWarning):
    """A ``ds_config`` key that is accepted but has no effect with our engines, or is ignored with ``strict=False``."""


ConfigSource = Union[str, os.PathLike, Mapping[str, Any]]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # DeepSpeed rejects duplicate keys too: with plain json.load the last one would silently win.
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise DeepSpeedConfigError(f"duplicate key {key!r} in the DeepSpeed config: keep only one of them")
        result[key] = value
    return result


def _parse_json_text(text: str, origin: str) -> dict:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as strict_error:
        # DeepSpeed itself reads configs with hjson, which tolerates comments, trailing commas and missing commas
        # between lines; configs that work with DeepSpeed should work here, so use it when it is installed.
        try:
            import hjson  # type: ignore[import-not-found]
        except ImportError:
            raise DeepSpeedConfigError(
                f"{origin} is not valid JSON ({strict_error.msg} at line {strict_error.lineno}, column "
                f"{strict_error.colno}). DeepSpeed also accepts the relaxed hjson syntax (comments, trailing commas); "
                "to load such a file here, `pip install hjson`, or fix the JSON."
            ) from strict_error
        try:
            return hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
        except hjson.HjsonDecodeError as relaxed_error:
            raise DeepSpeedConfigError(f"{origin} is neither valid JSON nor hjson: {relaxed_error}") from relaxed_error


def _as_plain_dict(value: Any) -> Any:
    # hjson returns OrderedDicts; normalise to plain containers so the effective config serialises cleanly.
    if isinstance(value, Mapping):
        return {str(key): _as_plain_dict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_plain_dict(item) for item in value]
    return value


def load_ds_config(source: ConfigSource) -> dict:
    """Read a DeepSpeed config and return a fresh ``dict`` (the input is never modified).

    Args:
        source: a ``dict``; a path to a ``.json`` (or hjson, if ``hjson`` is installed, as DeepSpeed reads) or
            ``.yaml``/``.yml`` file; or a JSON object as a string (starting with ``{``).

    Raises:
        DeepSpeedConfigError: the file does not exist, does not parse, has duplicate keys, or is not an object.
    """
    if isinstance(source, Mapping):
        config = copy.deepcopy(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        text_source = str(source)
        if isinstance(source, str) and text_source.lstrip().startswith("{"):
            config = _parse_json_text(text_source, "the DeepSpeed config string")
        else:
            path = Path(text_source).expanduser()
            if not path.is_file():
                raise DeepSpeedConfigError(f"DeepSpeed config file {str(path)!r} does not exist")
            text = path.read_text(encoding="utf-8")
            if path.suffix.lower() in (".yaml", ".yml"):
                import yaml

                config = yaml.safe_load(text)
            else:
                config = _parse_json_text(text, f"DeepSpeed config {str(path)!r}")
    else:
        raise TypeError(f"a DeepSpeed config must be a dict, a file path or a JSON string, got {type(source).__name__}")
    if not isinstance(config, Mapping):
        raise DeepSpeedConfigError(f"a DeepSpeed config must be a JSON object (a dict), got {type(config).__name__}")
    return _as_plain_dict(config)
