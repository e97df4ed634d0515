"""The checks every config section runs on its own keys, one way each, with one message style; and sizes
as people write them ("1.3TB" in, "1.3 TB" out).

Each raises ``ValueError("section.key=value: what is wrong (what it means)")``, which
the config loader turns into a one-line ``ConfigError`` (exit code 2). A key with a fixed set of
values is typed with a ``typing.Literal`` alias next to its section (in ``storage.schema`` where the
format shares it); the alias is the one list of its values (``choices``), which OmegaConf checks in a
merge and ``check_choice`` in ``__post_init__``, so a section built in Python is checked too. Numbers must
be finite: ``nan`` compares false with everything, so a wait bounded by it would
never end, and ``inf`` would make an interval that never comes.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50,
}


def is_int(value: object) -> bool:
    """An int that is not a bool (OmegaConf and YAML hand booleans to int fields as they are)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _because(meaning: str) -> str:
    return f" ({meaning})" if meaning else ""


def check_int(key: str, value: object, minimum: int, meaning: str = "") -> None:
    """An integer (not a bool) >= ``minimum``."""
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise ValueError(f"{key}={value!r}: must be an integer >= {minimum}{_because(meaning)}")


def check_seconds(key: str, value: object, positive: bool = False, meaning: str = "") -> None:
    """A finite number of seconds, >= 0 (or > 0 when ``positive``)."""
    bound = "> 0" if positive else ">= 0"
    if not _is_number(value) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"{key}={value!r}: must be a finite number of seconds {bound}{_because(meaning)}")
    if value < 0 or (positive and value == 0):  # type: ignore[operator]
        raise ValueError(f"{key}={value!r}: must be a number of seconds {bound}{_because(meaning)}")


def check_number(key: str, value: object, minimum: float, meaning: str = "") -> None:
    """A finite number >= ``minimum``."""
    if not _is_number(value) or not math.isfinite(value) or value < minimum:  # type: ignore[arg-type,operator]
        raise ValueError(f"{key}={value!r}: must be a finite number >= {minimum:g}{_because(meaning)}")


def choices(kind: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` alias, in its order: ``Literal["auto", "cpu"]`` -> ``("auto", "cpu")``."""
    return typing.get_args(kind)


def check_choice(key: str, value: object, kind: Any, meaning: str = "") -> None:
    """One of the values of the ``Literal`` alias ``kind``."""
    options = choices(kind)
    if value not in options:
        raise ValueError(f"{key}={value!r}: use one of {', '.join(options)}{_because(meaning)}")


def parse_bytes(value: str | int, key: str) -> int:
    """``"1.3TB"`` -> 1_300_000_000_000 (decimal units; KiB/MiB/GiB/TiB are binary)."""
    if is_int(value):
        return value  # type: ignore[return-value]
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{key}={value!r}: write a size like 500GB, 1.3TB, 64GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(count: float) -> str:
    """1_300_000_000_000 -> ``"1.3 TB"`` (decimal units, as ``parse_bytes`` reads them)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000
    raise AssertionError("unreachable")
