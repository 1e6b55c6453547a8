"""The product's import graph between its packages, read from the source, and the layers it must keep.

    python -m tests.harness.layers                          # the graph as Mermaid (docs/design.md holds it)
    python -m tests.harness.layers --svg docs/imports.svg   # and as a picture
    python -m tests.harness.layers --check                  # exit 1, naming the import, if one breaks a layer

Imports point one way: a package may import only from layers below its own. ``tests/test_layers.py`` checks it,
and that the drawing in docs/design.md is this one.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("compression", "dht", "peer")
INSTALLED_AS = {"diloco_compression": "compression"}  # import name -> folder (pyproject.toml says why)
# bottom first; a package imports only from packages of lower layers (modules of its own package aside)
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("compression",),
    ("dht",),
    ("peer.hooks", "peer.presets", "peer.outer", "peer.swarm", "peer.ops"),
    ("peer.config",),
    ("peer.train", "peer.averaging", "peer.config_file"),
    ("peer.round",),
    ("peer.use",),
    ("peer.__main__",),
)
FORBIDDEN = ("tests", "bench", "docker")  # the product never imports test machinery


def unit(module: str) -> str:
    """The package a module belongs to in the drawing: ``peer.round.sync`` -> ``peer.round``."""
    parts = module.split(".")
    if parts[0] != "peer":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 else "peer"


def modules() -> Dict[str, Path]:
    found = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> Set[str]:
    """Every module ``path`` imports, absolute (the product uses no relative imports)."""
    names: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {_folder(name) for name in names}


def _folder(module: str) -> str:
    """An imported name as the module path of its source folder: ``diloco_compression.base`` -> ``compression.base``."""
    top, _, rest = module.partition(".")
    top = INSTALLED_AS.get(top, top)
    return f"{top}.{rest}" if rest else top


def edges() -> Dict[Tuple[str, str], List[str]]:
    """{(importer unit, imported unit): [importing modules]} between different units of the product."""
    known = modules()
    found: Dict[Tuple[str, str], List[str]] = {}
    for name, path in known.items():
        for imported in imports(path):
            if imported.split(".")[0] in FORBIDDEN:
                found.setdefault((unit(name), imported.split(".")[0]), []).append(name)
            elif imported in known and unit(imported) != unit(name):
                found.setdefault((unit(name), unit(imported)), []).append(name)
    return found


def layer_of(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise KeyError(name)


def violations() -> List[str]:
    problems = []
    for (importer, imported), where in sorted(edges().items()):
        if imported in FORBIDDEN:
            problems.append(f"{', '.join(sorted(set(where)))} imports {imported}: test machinery in the product")
        elif importer == "peer" or imported == "peer":
            continue  # peer/__init__.py holds the map only
        elif layer_of(imported) >= layer_of(importer):
            problems.append(f"{', '.join(sorted(set(where)))} ({importer}) imports {imported}, which is not in a "
                            f"lower layer")
    return problems


def mermaid() -> str:
    """The drawing: one box per package, in its layer (top to bottom: who imports whom)."""
    lines = ["flowchart TD"]
    for index, layer in reversed(list(enumerate(LAYERS))):
        lines.append(f"  subgraph L{index}[\" \"]")
        lines.extend(f"    {node_id(name)}[\"{name}\"]" for name in layer)
        lines.append("  end")
    for importer, imported in sorted(edges()):
        if "peer" not in (importer, imported) and imported not in FORBIDDEN:
            lines.append(f"  {node_id(importer)} --> {node_id(imported)}")
    return "\n".join(lines)


def node_id(name: str) -> str:
    return name.replace(".__main__", ".main").replace(".", "_")


def drawn(svg: Path) -> str:
    """The graph an SVG made by ``draw`` shows (its description)."""
    import html
    import re

    match = re.search(r"<dc:description>(.*?)</dc:description>", svg.read_text(), re.S)
    return html.unescape(match.group(1)) if match else ""


def draw(path: Path) -> None:
    """The same drawing as an SVG: each layer a row, bottom first at the bottom, an arrow per import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # text as text, and no date or random ids: the same code draws the same bytes (``tests/test_layers.py``)
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "layers"})
    width = max(len(layer) for layer in LAYERS)
    where = {name: ((col + 0.5) * width / len(layer), row) for row, layer in enumerate(LAYERS)
             for col, name in enumerate(layer)}
    figure, axes = plt.subplots(figsize=(2.3 * width, 1.1 * len(LAYERS)))
    for importer, imported in sorted(edges()):
        if importer in where and imported in where:
            (x0, y0), (x1, y1) = where[importer], where[imported]
            axes.annotate("", xy=(x1, y1 + 0.18), xytext=(x0, y0 - 0.18),
                          arrowprops=dict(arrowstyle="->", color="#8899aa", lw=0.8, shrinkA=0, shrinkB=0))
    for name, (x, y) in where.items():
        axes.text(x, y, name, ha="center", va="center", fontsize=10, family="monospace",
                  bbox=dict(boxstyle="round,pad=0.35", facecolor="#eef3fb", edgecolor="#4a6fa5"))
    for row in range(len(LAYERS)):
        axes.text(-0.05, row, f"layer {row}", ha="right", va="center", fontsize=8, color="#777777")
    axes.set_xlim(-0.6, width + 0.1)
    axes.set_ylim(-0.6, len(LAYERS) - 0.4)
    axes.axis("off")
    axes.set_title("imports point down: a package imports only from layers below it", fontsize=10)
    # an SVG says which graph it draws (``drawn``): the graph as Mermaid, in its description
    figure.savefig(path, bbox_inches="tight",
                   metadata={"Date": None, "Description": mermaid()} if path.suffix == ".svg" else None)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.layers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if an import breaks a layer")
    parser.add_argument("--svg", type=Path, help="also draw the graph into this SVG file")
    args = parser.parse_args(argv)
    if args.svg:
        draw(args.svg)
    if args.check:
        problems = violations()
        print("\n".join(problems) or "imports point one way")
        return 1 if problems else 0
    print(mermaid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
