"""bench/convergence.py --quick: the sweep runs end to end on the peer's own code and reports sensibly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    paths = dict(out=out / "convergence.md", plot=out / "convergence.png", cache=out / "runs.json")
    command = [sys.executable, "-m", "bench.convergence", "--quick", *(f"--{k}={v}" for k, v in paths.items())]
    subprocess.run(command, cwd=ROOT, check=True, timeout=110, env=dict(os.environ, OMP_NUM_THREADS="1"))
    runs = [dict(json.loads(key), **value) for key, value in json.loads(paths["cache"].read_text()).items()]
    return paths, runs


def rows(markdown: str):
    """{cell: {column: value}} of the table of every cell."""
    table = markdown.split("## Every cell")[1].split("\n## ")[0]
    header, *cells = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
                      if line.startswith("| ")]
    return {cols[0]: dict(zip(header, cols)) for cols in cells}


def number(text: str) -> float:
    return float(text.rstrip("%x").replace(",", ""))


def test_quick_sweep_has_every_cell_and_the_plot(quick):
    paths, _ = quick
    table = rows(paths["out"].read_text())
    assert list(table) == ["data-parallel M=2", "centre", "codec none", "alignment off", "error feedback off"]
    assert paths["plot"].stat().st_size > 10_000
    assert "Command: `python -m bench.convergence --quick" in paths["out"].read_text()


def test_diloco_learns_and_sends_fewer_bytes_than_data_parallel(quick):
    paths, runs = quick
    for run in runs:
        assert run["eval_losses"][-1] < run["initial_loss"] - 1.0, run["kind"]  # ~5.5 (uniform bytes) down to ~2.7
        assert run["tokens"][-1] >= 0.9 * 80_000 / (2 if run["replicas"] == 1 else 1)  # a lone replica: 1/M
    table = rows(paths["out"].read_text())
    ratio = {cell: number(columns["data-parallel's bytes / these"]) for cell, columns in table.items()}
    assert ratio.pop("data-parallel M=2") == 1
    assert all(value > 1 for value in ratio.values()), ratio
    assert ratio["codec none"] < ratio["centre"] < ratio["alignment off"]  # fp32 deltas; moments cost bytes
    for cell, columns in table.items():
        assert abs(number(columns["gap to data-parallel"])) < 15, cell  # in %: DiLoCo learns about as well
