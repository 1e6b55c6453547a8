"""The architecture holds: imports point one way, the product imports no test machinery, and the drawings in
docs/design.md are the code's."""

import re
from pathlib import Path

from tests.harness import layers

DESIGN = Path(layers.ROOT / "docs" / "design.md")


def test_imports_point_one_way():
    assert layers.violations() == []


def test_every_product_package_has_a_layer():
    units = {layers.unit(name) for name in layers.modules()} - {"peer"}
    placed = {name for layer in layers.LAYERS for name in layer}
    assert units == placed, f"packages without a layer: {sorted(units - placed)}; layers without code: " \
                            f"{sorted(placed - units)}"


def test_a_product_import_of_test_machinery_is_caught(tmp_path, monkeypatch):
    module = layers.ROOT / "peer" / "swarm" / "consensus.py"
    source = module.read_text() + "\nfrom tests.harness.faults import FaultPlan\n"
    monkeypatch.setattr(layers, "modules", lambda: {"peer.swarm.consensus": tmp_path / "consensus.py"})
    (tmp_path / "consensus.py").write_text(source)
    assert any("test machinery" in problem for problem in layers.violations())


def test_the_design_documents_drawing_is_the_codes():
    drawn = re.search(r"```mermaid\n(.*?)\n```", DESIGN.read_text(), re.S).group(1)
    assert drawn == layers.mermaid(), "docs/design.md's import graph is stale: python -m tests.harness.layers"


def test_the_import_picture_is_the_codes(tmp_path):
    assert layers.drawn(layers.ROOT / "docs" / "imports.svg") == layers.mermaid(), \
        "docs/imports.svg is stale: python -m tests.harness.layers --svg docs/imports.svg"
    layers.draw(tmp_path / "imports.svg")
    assert layers.drawn(tmp_path / "imports.svg") == layers.mermaid()


def test_every_module_is_in_its_packages_map():
    for name, path in layers.modules().items():
        if path.name == "__init__.py" or not name.startswith("peer."):
            continue
        package_map = (path.parent / "__init__.py").read_text()
        assert f"``{path.name}``" in package_map, f"{path.parent / '__init__.py'} does not map {path.name}"
