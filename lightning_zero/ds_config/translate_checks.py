"""The checks and the report collector shared by the ds_config translators (:mod:`.translate` and its sections).

Split from ``translate.py`` to keep it readable: every function here validates one value or records what became of
one key; none knows a section's meaning.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Optional

from lightning_zero.ds_config import schema
from lightning_zero.ds_config.loading import DeepSpeedConfigError, DeepSpeedConfigWarning
from lightning_zero.ds_config.schema import KeySpec

AUTO = "auto"


class Collector:
    """Gathers notes, non-default no-effect keys, and problems, so one translation reports everything at once."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.notes: list[tuple[str, str]] = []
        self.problems: list[str] = []
        self.no_effect_non_default: list[str] = []
        # {current section name: the deprecated one the config wrote}, so that messages name the keys as written
        self.written_as: dict[str, str] = {}

    def note(self, path: str, text: str) -> None:
        self.notes.append((path, text))

    def _as_written(self, path: str) -> str:
        for current, written in self.written_as.items():
            if path == current or path.startswith(current + "."):
                return written + path[len(current) :]
        return path

    def problem(self, path: str, text: str) -> None:
        """A key we cannot honour: an error in strict mode, else a warning (the key is then ignored)."""
        self.problems.append(f"{self._as_written(path)}: {text}")
        self.note(path, ("IGNORED (strict=False): " if not self.strict else "ERROR: ") + text)

    def finish(self) -> None:
        if self.problems:
            message = "DeepSpeed config cannot be used as written:\n  - " + "\n  - ".join(self.problems)
            if self.strict:
                raise DeepSpeedConfigError(message + "\n(pass strict=False to turn these into warnings)")
            warnings.warn(message, DeepSpeedConfigWarning, stacklevel=3)
        if self.no_effect_non_default:
            warnings.warn(
                "These DeepSpeed config keys are set to non-default values but have no effect with lightning-zero's "
                "FSDP2/DDP engines (see the translation notes or docs/ds_config.md for why): "
                + ", ".join(
                    self._as_written(path) + "=" + value
                    for path, value in (item.split("=", 1) for item in self.no_effect_non_default)
                ),
                DeepSpeedConfigWarning,
                stacklevel=3,
            )


def suggest(key: str, candidates: list[str], section: str) -> str:
    """A ' did you mean' hint: the closest key of this section, or the section where this key really lives."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    elsewhere = [path for path in schema.all_known_paths() if path.rsplit(".", 1)[-1] == key]
    elsewhere = [path for path in elsewhere if path.rsplit(".", 1)[0] != section]
    if elsewhere:
        return f"this key belongs under {elsewhere[0]!r}"
    close = difflib.get_close_matches(key, [p.rsplit(".", 1)[-1] for p in schema.all_known_paths()], n=1, cutoff=0.75)
    if close:
        return f"did you mean {close[0]!r} (in another section)?"
    return "no similar key is known"


def section_of(config: dict, name: str) -> Optional[dict]:
    """``config[name]`` when it is a JSON object, ``None`` when absent; anything else is an error naming it."""
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"{name!r} must be a JSON object, got {value!r}")
    return value


def leaves(path: str, value: Any) -> list[tuple[str, Any]]:
    """``(dotted path, value)`` of every non-object value inside ``value`` (itself when it is not an object), so a
    warning or error about a nested section names each key written in it."""
    if isinstance(value, dict) and value:
        return [leaf for key, item in value.items() for leaf in leaves(f"{path}.{key}", item)]
    return [(path, value)]


def non_default_leaves(path: str, value: Any, default: Any) -> list[str]:
    """``"path=value"`` for each key written in ``value`` that differs from DeepSpeed's ``default`` (compared key by
    key inside objects; ``"auto"`` counts as the default)."""
    if isinstance(value, dict) and value:
        defaults = default if isinstance(default, dict) else {}
        return [
            item for key, sub in value.items() for item in non_default_leaves(f"{path}.{key}", sub, defaults.get(key))
        ]
    if (
        value == AUTO
        or (value == default and type(value) is type(default))
        or (isinstance(value, str) and isinstance(default, str) and value.lower() == default.lower())
    ):
        return []  # DeepSpeed reads its string settings in any case ("Warn", "WARN")
    return [f"{path}={value!r}"]


def no_effect(out: Collector, path: str, value: Any, default: Any, why: str) -> None:
    """``path`` has no effect here (``why``): its note says so, and a value other than DeepSpeed's ``default`` is
    warned about by name."""
    out.notes = [(key, note) for key, note in out.notes if key != path]
    out.note(path, "no effect: " + why)
    out.no_effect_non_default.extend(non_default_leaves(path, value, default))


def at_default(value: Any, default: Any) -> bool:
    """``value`` asks for nothing beyond DeepSpeed's ``default`` of an unsupported key: it is that default, absent
    (``null``), ``false`` where the default is off, or the default string in another case."""
    if value is None or (value is False and default in (None, False)):
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, str) and isinstance(default, str):
        return value.lower() == default.lower()
    return value == default


def shown(path: str, value: Any) -> str:
    """``value`` for a message about ``path``: an object as the dotted keys written in it."""
    if isinstance(value, dict) and value:
        return ", ".join(f"{leaf}={item!r}" for leaf, item in leaves(path, value))
    return repr(value)


def merge_section(user: dict, keys: dict[str, KeySpec], section: str, out: Collector) -> dict:
    """Defaults of ``keys`` overlaid with the known user keys; unknown keys become problems, no-effect keys notes
    (and warnings, where they differ from DeepSpeed's default)."""
    merged = {key: spec.default for key, spec in keys.items() if spec.default is not schema.DERIVED}
    for key, value in user.items():
        path = f"{section}.{key}"
        spec = keys.get(key)
        if spec is None:
            out.problem(path, f"unknown key; {suggest(key, list(keys), section)}")
            continue
        merged[key] = value
        if spec.role == schema.NO_EFFECT:
            out.note(path, "no effect: " + spec.note)
            if spec.default is not schema.DERIVED:
                out.no_effect_non_default.extend(non_default_leaves(path, value, spec.default))
        elif spec.role == schema.UNSUPPORTED:
            if at_default(value, spec.default):
                out.note(path, f"accepted at its default; other values are not supported ({spec.note})")
            else:
                out.problem(path, f"{shown(path, value)} is not supported: {spec.note}")
                merged[key] = spec.default
        else:
            out.note(path, spec.note)
    return merged


def check_number(
    path: str,
    value: Any,
    *,
    integer: bool = False,
    minimum: float = 0,
    allow_auto: bool = True,
    strictly_positive: bool = False,
) -> Any:
    """Validate a numeric value; integral floats (DeepSpeed configs write ``1e9``) become ints for integer keys."""
    if value is None or (allow_auto and value == AUTO):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        allowed = "a number" + (' or "auto"' if allow_auto else "")
        raise DeepSpeedConfigError(f"{path} must be {allowed}, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise DeepSpeedConfigError(f"{path} must be an integer, got {value!r}")
        value = int(value)
    if value < minimum or (strictly_positive and value <= 0):
        bound = "> 0" if strictly_positive else f">= {minimum}"
        raise DeepSpeedConfigError(f"{path} must be {bound}, got {value!r}")
    return value


def check_flag(path: str, value: Any, allow_auto: bool = False) -> Any:
    if isinstance(value, bool) or (allow_auto and value == AUTO):
        return value
    allowed = 'true, false or "auto"' if allow_auto else "true or false"
    raise DeepSpeedConfigError(f"{path} must be {allowed}, got {value!r}")


def honoured(out: Collector, path: str, text: str) -> None:
    """Replace the generic no-effect note (and warning) of ``path`` by what it now maps to."""
    out.notes = [(key, note) for key, note in out.notes if key != path]
    out.no_effect_non_default = [item for item in out.no_effect_non_default if not item.startswith(path + "=")]
    out.note(path, text)
