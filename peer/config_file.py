"""``--config run.toml``: every flag of ``python -m peer`` from a TOML file, in sections that follow the config
dataclasses. A value typed on the command line wins over the file's, and a value from the file counts as given: the
manifest check refuses it if it disagrees with the run's, as it would the flag.

    [run]                 # RunConfig: the run's shared settings (the manifest)
    model = "150m"
    [node]                # NodeConfig: this peer's own choices
    checkpoint_dir = "ckpt"
    [network]             # DHTConfig
    initial_peers = ["/ip4/203.0.113.7/tcp/31337/p2p/Qm..."]
    [sync]                # SyncConfig: deadlines

Keys are the flags' names with underscores (``seq_len``) or dashes (``seq-len``). ``--config NAME`` also takes a
config bundled with the package (``peer/configs/NAME.toml``).
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any, Dict, Type

from dht.cli import typed_values
from dht.errors import UserError
from dht.node import DHTConfig
from peer.config import NodeConfig, RunConfig, SyncConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SECTIONS: Dict[str, Type[Any]] = {"run": RunConfig, "node": NodeConfig, "network": DHTConfig, "sync": SyncConfig}
BUNDLED = Path(__file__).parent / "configs"


def bundled() -> Dict[str, Path]:
    return {path.stem: path for path in sorted(BUNDLED.glob("*.toml"))}


def locate(name: str) -> Path:
    """A path, or the name of a bundled config."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if name in bundled():
        return bundled()[name]
    raise ValueError(f"--config {name}: no such file, and no bundled config of that name "
                     f"(bundled: {', '.join(bundled())})")


def load(name: str) -> Dict[Type[Any], Dict[str, Any]]:
    """{config class: its values in the file}, type-checked; a ValueError names the file, section and key."""
    path = locate(name)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML ({e})") from None
    values: Dict[Type[Any], Dict[str, Any]] = {cls: {} for cls in SECTIONS.values()}
    for section, table in document.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise ValueError(f"--config {path}: unknown section [{section}]; the sections are "
                             + ", ".join(f"[{name}]" for name in SECTIONS))
        cls, where = SECTIONS[section], f"--config {path}: [{section}]"
        values[cls] = typed_values(cls, _known(cls, table, where), where)
        try:
            cls(**values[cls])  # its checks, on the file's values alone: the error names where they are
        except (UserError, ValueError) as e:
            raise ValueError(f"{where} {e}") from None
    return values


def from_file(path: str, name: str, value: Any) -> bool:
    """Whether run setting ``name`` took ``value`` from the file at ``path`` (not from a flag typed over it)."""
    run = load(path)[RunConfig]
    return name in run and run[name] == value


def _known(cls: Type[Any], table: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The table's keys as field names (dashes allowed); a key no flag has is named, with the closest ones."""
    fields = {name: field for name, field in cls.__dataclass_fields__.items() if field.metadata.get("cli", True)}
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name == "config":
            raise ValueError(f"{where}: a config file cannot name another (config = {value!r}); merge the two")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"{where} has no setting {key!r}{hint}")
        out[name] = value
    return out
