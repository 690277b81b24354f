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


def _refuse_constant(name: str) -> Any:
    # Python's json reads NaN/Infinity, which are not JSON (DeepSpeed's hjson refuses them): a NaN lr would train on.
    raise DeepSpeedConfigError(f"{name} is not a JSON number: write a finite value in the DeepSpeed config")


def _parse_json_text(text: str, origin: str) -> dict:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_refuse_constant)
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


def _read_text(path: Path) -> str:
    """The file's text, refusing what is not a config file: missing, a directory, empty, binary, not UTF-8."""
    if path.is_dir():
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r} is a directory, not a .json/.yaml file")
    if not path.is_file():
        raise DeepSpeedConfigError(f"DeepSpeed config file {str(path)!r} does not exist")
    data = path.read_bytes()
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise DeepSpeedConfigError(
            f"DeepSpeed config {str(path)!r} is UTF-16 text (it starts with a UTF-16 byte-order mark): save it as UTF-8"
        )
    if b"\x00" in data:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {str(path)!r} is a binary file (it contains NUL bytes), not JSON or YAML text"
        )
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark, as some editors write, is fine
    except UnicodeDecodeError as error:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {str(path)!r} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset "
            f"{error.start}): save it as UTF-8 JSON or YAML"
        ) from error
    if not text.strip():
        # json.loads("") fails cryptically and yaml.safe_load("") returns None; an empty file is never meant as {}
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r} is empty; write {{}} for an empty config")
    return text


def _parse_yaml_text(text: str, origin: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise DeepSpeedConfigError(f"{origin} is not valid YAML{where}: {problem}") from error


def load_ds_config(source: ConfigSource) -> dict:
    """Read a DeepSpeed config and return a fresh ``dict`` (the input is never modified).

    Args:
        source: a ``dict``; a path to a ``.json`` (or hjson, if ``hjson`` is installed, as DeepSpeed reads) or
            ``.yaml``/``.yml`` file; or a JSON object as a string (starting with ``{``).

    Raises:
        DeepSpeedConfigError: the file does not exist, is empty, binary or not UTF-8, does not parse (the message
            gives line and column), has duplicate keys or NaN/Infinity, or is not an object.
    """
    if isinstance(source, Mapping):
        config = copy.deepcopy(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        text_source = str(source)
        if not text_source.strip():
            raise DeepSpeedConfigError(
                "the DeepSpeed config is an empty string: pass a dict, a .json/.yaml path or a JSON object string"
            )
        if isinstance(source, str) and text_source.lstrip().startswith("{"):
            config = _parse_json_text(text_source, "the DeepSpeed config string")
        else:
            path = Path(text_source).expanduser()
            text = _read_text(path)
            if path.suffix.lower() in (".yaml", ".yml"):
                config = _parse_yaml_text(text, f"DeepSpeed config {str(path)!r}")
            else:
                config = _parse_json_text(text, f"DeepSpeed config {str(path)!r}")
    else:
        raise TypeError(f"a DeepSpeed config must be a dict, a file path or a JSON string, got {type(source).__name__}")
    if not isinstance(config, Mapping):
        raise DeepSpeedConfigError(f"a DeepSpeed config must be a JSON object (a dict), got {type(config).__name__}")
    return _as_plain_dict(config)
