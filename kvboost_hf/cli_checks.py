"""Cheap checks of command-line values, run before anything slow (imports, stores, model loads).

Each returns the value or raises :class:`FlagError` whose message is one line naming the flag,
the value and what to pass instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvboost_hf.units import SizeError, parse_size


class FlagError(ValueError):
    """A flag value that cannot work; the message is one line that says what to change."""


def size_flag(flag: str, text: str | int, bare_unit: str | None = None) -> int:
    """Bytes in ``text`` (``24GiB``, ``512MiB``, ``2.5g``...), more than zero. A bare number is an
    error unless ``bare_unit`` says what it means (``"B"`` for flags named in bytes)."""
    try:
        value = parse_size(text, bare_unit=bare_unit)
    except SizeError as err:
        raise FlagError(f"{flag} {text}: {err.reason}") from None
    if value <= 0:
        raise FlagError(f"{flag} {text}: must be more than 0 bytes")
    return value


def looks_like_path(value: str) -> bool:
    """Whether ``value`` names a local path rather than a Hugging Face id (``org/name`` or ``name``)."""
    return (value.startswith((".", "~", os.sep)) or (os.altsep is not None and os.altsep in value)
            or value.count("/") > 1 or Path(value).expanduser().exists())


def model_path_flag(flag: str, value: str | None) -> str | None:
    """``value`` of a ``--model``-like flag: a local path must be a directory that exists; an id
    (``org/name``) passes here and is checked when it loads."""
    if value is None or not looks_like_path(value):
        return value
    path = Path(value).expanduser()
    if not path.exists():
        raise FlagError(f"{flag} {value}: no such directory; pass a local model directory (with config.json) "
                        "or a Hugging Face model id")
    if not path.is_dir():
        raise FlagError(f"{flag} {value}: is a file; pass the model's directory (the one with config.json)")
    return value


def readable_file_flag(flag: str, value: str) -> str:
    """``value`` names a readable file."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise FlagError(f"{flag} {value}: no such file")
    if not os.access(path, os.R_OK):
        raise FlagError(f"{flag} {value}: not readable by this user")
    return value


def first_line(err: BaseException) -> str:
    """``Type: first line of the message``, for errors quoted inside a one-line CLI error."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
