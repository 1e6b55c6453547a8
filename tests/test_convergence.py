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
    """{cell: [columns]} of the table of every cell."""
    table = markdown.split("## Every cell")[1].split("\n## ")[0]
    cells = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    return {cols[0].strip(): [c.strip() for c in cols[1:]] for cols in cells[1:]}


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
        assert run["tokens"][-1] >= 0.9 * 80_000
    table = rows(paths["out"].read_text())
    for cell in ("centre", "codec none", "alignment off", "error feedback off"):
        ratio = float(table[cell][-1].rstrip("x").replace(",", ""))
        assert ratio > 1, cell
        assert abs(float(table[cell][-3].rstrip("%"))) < 15, cell  # the gap to data-parallel, in %
    assert float(table["codec none"][-1].rstrip("x")) < float(table["centre"][-1].rstrip("x"))  # fp32 Δ: more bytes
