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


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    return str(value)
