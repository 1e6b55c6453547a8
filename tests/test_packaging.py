"""The installed distribution: every package folder is in it, and its names survive a standard library that has a
``compression`` of its own (Python 3.14), on any interpreter."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _listed_packages():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_pyproject_lists_every_package_folder():
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in ("peer", "dht", "compression")
               for p in (ROOT / top).rglob("__init__.py")}
    listed = {name.replace("diloco_compression", "compression", 1) for name in _listed_packages()}
    assert listed == folders


def test_an_installed_copy_imports_its_own_codecs_past_a_standard_library_compression(tmp_path):
    """Python 3.14 puts its own ``compression`` package ahead of site-packages. A stand-in earlier on sys.path plays
    it here: the installed copy, run away from the repository, still finds its codecs, and ``python -m peer`` runs."""
    source, target, stand_in = tmp_path / "source", tmp_path / "site", tmp_path / "stdlib"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "peer", "dht", "compression"):  # a build writes into its source
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    isolation = () if importlib.util.find_spec("setuptools") is None else ("--no-build-isolation",)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation,
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=240)
    (stand_in / "compression").mkdir(parents=True)
    (stand_in / "compression" / "__init__.py").write_text("STANDARD_LIBRARY = True\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(stand_in), str(target)))}
    probe = ("import compression, diloco_compression, peer\n"
             "from diloco_compression import get_codec\n"
             "import torch\n"
             "assert compression.STANDARD_LIBRARY\n"
             "x = torch.linspace(-1, 1, 4096)\n"
             "codec = get_codec('int4-huffman')\n"
             "assert (codec.decode(codec.encode(x), x.numel()) - x).abs().max() < 0.2\n"
             "from peer import config_file\n"
             "assert set(config_file.bundled()) == {'tiny', 'home-150m', 'private-servers'}\n"  # shipped as data
             "from peer.ops import dashboard\n"
             "assert b'snapshot.json' in dashboard.PAGE.read_bytes()\n"
             "print(diloco_compression.__file__, peer.__file__)\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(path.startswith(str(target)) for path in out.stdout.split()), out.stdout
    run = subprocess.run([sys.executable, "-m", "peer", "--help"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "--compression" in run.stdout, run.stderr[-2000:]
