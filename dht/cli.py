"""Command-line flags derived from frozen config dataclasses, so each option is declared once.

A field becomes ``--field-name``; its help text, choices and metavar come from ``opt(...)`` metadata.
Flags default to "not given" (argparse.SUPPRESS) so callers can tell an explicit flag from a default,
which is how a joiner's flags are checked against the run manifest.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Dict, Optional, Sequence, Type, TypeVar

T = TypeVar("T")


def opt(default: Any, help: str, *, choices: Optional[Sequence[Any]] = None, cli: bool = True, **kwargs) -> Any:
    """A dataclass field with its CLI help. ``cli=False`` keeps a field out of the parser."""
    metadata = dict(help=help, choices=choices, cli=cli)
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or default_factory for mutable defaults")
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: what is wrong and where the usage is, not the 40-line usage itself."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def require_positive(config: Any, *names: str) -> None:
    """ValueError naming the first field (of those set) that is not > 0."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def require_non_negative(config: Any, *names: str) -> None:
    """ValueError naming the first field (of those set) that is < 0."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def add_arguments(parser: argparse.ArgumentParser, cls: Type[Any], title: Optional[str] = None) -> None:
    """Add one flag per CLI field of dataclass ``cls`` to ``parser`` (in an argument group if titled)."""
    group = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.metadata.get("cli", True):
            continue
        tp = _unwrap_optional(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        help_text = field.metadata.get("help", "")
        if default is not None:
            help_text += f" (default: {_show(default)})"
        kwargs: Dict[str, Any] = dict(dest=field.name, default=argparse.SUPPRESS, help=help_text)
        if field.metadata.get("choices"):
            kwargs["choices"] = field.metadata["choices"]
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) in (tuple, list):
            kwargs.update(nargs="*", type=typing.get_args(tp)[0], metavar=field.name.upper())
        else:
            kwargs.update(type=tp, metavar=field.name.upper())
        group.add_argument("--" + field.name.replace("_", "-"), **kwargs)


def explicit_values(namespace: argparse.Namespace, cls: Type[Any]) -> Dict[str, Any]:
    """The fields of ``cls`` that the user actually passed on the command line."""
    names = {field.name for field in dataclasses.fields(cls)}
    values = {key: value for key, value in vars(namespace).items() if key in names}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if typing.get_origin(_unwrap_optional(hints[key])) is tuple and isinstance(value, list):
            values[key] = tuple(value)
    return values


def from_args(cls: Type[T], namespace: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` from explicit flags, falling back to the dataclass defaults."""
    return cls(**{**explicit_values(namespace, cls), **overrides})


def _kind(tp: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if typing.get_origin(tp) in (tuple, list):
        return f"a list of {_kind(typing.get_args(tp)[0]).split(' ', 1)[1]}s"
    if typing.get_origin(tp) is dict or tp is dict:
        return "a table"
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _typed(tp: Any, value: Any) -> Any:
    """``value`` as a field of type ``tp`` holds it (an int for a float, a tuple for a list), or TypeError."""
    if tp is Any:
        return value
    if typing.get_origin(tp) in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return tuple(_typed(typing.get_args(tp)[0], item) for item in value)
    if typing.get_origin(tp) is dict or tp is dict:
        if not isinstance(value, dict):
            raise TypeError
        return value
    if isinstance(value, bool) and tp is not bool:  # a bool is an int to Python, never to a user
        raise TypeError
    if tp is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, tp):
        raise TypeError
    return value


def typed_values(cls: Type[Any], values: Dict[str, Any], where: str) -> Dict[str, Any]:
    """``values``, whose names are fields of ``cls`` (its callers name an unknown one their own way), checked against
    those fields' types and choices: a ValueError names the first one that is wrong (``where`` says whose values
    they are)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for name, value in values.items():
        optional = _unwrap_optional(hints[name]) is not hints[name]
        tp = _unwrap_optional(hints[name])
        if value is None and optional:
            out[name] = None
            continue
        try:
            out[name] = _typed(tp, value)
        except TypeError:
            raise ValueError(f"{where} {name} must be {_kind(tp)}, got {value!r}") from None
        choices = cls.__dataclass_fields__[name].metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{where} {name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return out


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    return str(value)
