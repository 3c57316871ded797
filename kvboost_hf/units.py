"""Human byte sizes, parsed and printed the same way by every flag and setting that takes one.

``KB``, ``MB``, ``GB``, ``TB`` are powers of 1000; ``KiB``, ``MiB``, ``GiB``, ``TiB`` (also
``Ki``, ``Mi``, ``Gi``, ``Ti``, Kubernetes' spelling) and the single letters ``k``, ``m``, ``g``,
``t`` (docker's and the JVM's spelling) are powers of 1024; ``B`` is bytes. Case does not matter.
A bare number is refused unless the caller names the unit it stands for (``bare_unit``).
"""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


class SizeError(ValueError):
    """``text`` is not a size; ``reason`` says what to write instead (one line)."""

    def __init__(self, text: object, reason: str) -> None:
        super().__init__(f"not a size: {text!r} ({reason})")
        self.text, self.reason = text, reason


def parse_size(text: str | int, bare_unit: str | None = None) -> int:
    """Bytes in ``text`` (``"24GiB"``, ``"512MiB"``, ``"2.5g"``, ``"500MB"``), rounded down.

    A bare number (``"24"``) is refused with :class:`SizeError` unless ``bare_unit`` names what it
    means (``"B"`` for flags whose name says bytes). An int is taken as bytes. Never negative.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise SizeError(text, "give a string such as 24GiB, or a number of bytes")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(text, "a size cannot be negative")
        return text
    match = _SIZE.fullmatch(text)
    if not match:
        raise SizeError(text, "write a number and a unit, e.g. 24GiB, 512MiB or 2.5g")
    number, unit = match.group(1), match.group(2)
    if not unit:
        if bare_unit is None:
            example = number.rstrip("0").rstrip(".") if "." in number else number
            raise SizeError(text, f"give a unit, e.g. {example}GiB or {example}GB")
        unit = bare_unit
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise SizeError(text, f"unknown unit {unit!r}: use B, KB/MB/GB/TB (powers of 1000) or "
                              "KiB/MiB/GiB/TiB or k/m/g/t (powers of 1024)")
    return int(float(number) * factor)


def format_size(n: int | float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``"412.0 MiB"``, ``"1.50 GiB"``)."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{int(n)} B"
