"""The installed distribution: every package folder is in it, and its names survive a standard library that has a
``compression`` of its own (Python 3.14), on any interpreter."""

import importlib.machinery
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


def _standard_compression(tmp_path):
    """Python 3.14's own ``compression`` or, on an older Python, a stand-in for it: (the sys.path entry that the
    stand-in needs, or None; the package's ``__init__.py``)."""
    real = importlib.machinery.PathFinder.find_spec("compression", [os.path.dirname(os.__file__)])
    if real is not None:
        return None, real.origin
    stand_in = tmp_path / "stdlib" / "compression"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("")
    (stand_in / "_common.py").write_text("")  # what 3.14's gzip imports
    return str(stand_in.parent), str(stand_in / "__init__.py")


def test_pyproject_lists_every_package_folder():
    """Every folder, code or data (the bundled --config files): setuptools takes any folder for a package, and one
    that holds package data unlisted "would be ignored" (its warning)."""
    folders = {".".join(d.relative_to(ROOT).parts) for top in ("peer", "dht", "compression")
               for d in (ROOT / top, *(ROOT / top).rglob("*")) if d.is_dir() and d.name != "__pycache__"}
    listed = {name.replace("diloco_compression", "compression", 1) for name in _listed_packages()}
    assert listed == folders


def test_an_installed_copy_imports_its_own_codecs_past_a_standard_library_compression(tmp_path):
    """Python 3.14 puts its own ``compression`` package ahead of site-packages (before 3.14, a stand-in earlier on
    sys.path plays it): the installed copy, run away from the repository, still finds its codecs, and ``python -m
    peer`` runs."""
    source, target = tmp_path / "source", tmp_path / "site"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "peer", "dht", "compression"):  # a build writes into its source
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    isolation = () if importlib.util.find_spec("setuptools") is None else ("--no-build-isolation",)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation,
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=240)
    stand_in, standard = _standard_compression(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(entry for entry in (stand_in, str(target)) if entry)}
    probe = ("import compression, diloco_compression, peer\n"
             "from diloco_compression import get_codec\n"
             "import torch\n"
             f"assert compression.__file__ == {standard!r}\n"
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


def test_the_repository_folder_yields_the_name_compression_to_the_standard_library(tmp_path):
    """In the repository (``python -m peer`` there, as the README runs it), its folder comes first on sys.path, ahead of
    Python 3.14's ``compression``, which gzip imports (and torch imports gzip). ``import compression`` gets the
    standard library's package (before 3.14, a stand-in after the repository) and its submodules, without loading the
    codecs (nor torch), and ``diloco_compression`` is still the codecs."""
    stand_in, standard = _standard_compression(tmp_path)
    probe = ("import sys\n"
             "import compression, compression._common\n"
             "assert 'torch' not in sys.modules and sys.modules['compression'] is compression\n"
             "import gzip\n"
             "from diloco_compression import get_codec\n"
             "print(compression.__file__, get_codec('fp16').name)\n")
    env = {**os.environ, "PYTHONPATH": stand_in or ""}  # after '' (the current directory: the repository)
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [standard, "fp16"]
