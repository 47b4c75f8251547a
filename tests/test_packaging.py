"""The serving wheel carries the product only (issue 27): config, CLI, client, serving, the demo,
the store tools and ``check exactness``, with the connector, the store and the kernels. The benches
and the lab are ``bench/`` (``orbitkv-bench``) and ``lab/`` (``orbitkv-lab``), distributions of
their own; the CLI keeps their commands and, where they are not installed, names what to install.

The product's wheel is built for real (``pip wheel``, a second or two) from a copy of what the
Dockerfiles copy, so nothing is written into the checkout.
"""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orbitkv import cli

REPO = Path(__file__).resolve().parents[1]
# The product's folders, as pyproject.toml's package-dir maps them (and the Dockerfiles copy them).
PRODUCT_DIRS = {"orbitkv": "orbitkv", "connector": "orbitkv/connector", "store": "orbitkv/store",
                "kernels": "orbitkv/kernels"}
OUTSIDE = ("orbitkv_bench", "orbitkv_lab")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")


def _imported_tops(path: Path) -> set[str]:
    """The top-level packages a file imports by absolute import (module level or inside functions)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def _build_wheel(tmp: Path, parts: list[str]) -> zipfile.ZipFile:
    src = tmp / "src"
    src.mkdir(parents=True)
    for part in parts:
        if (REPO / part).is_dir():
            shutil.copytree(REPO / part, src / part, ignore=_IGNORE)
        else:
            shutil.copy2(REPO / part, src / part)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "out"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp / "out").glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory) -> zipfile.ZipFile:
    return _build_wheel(tmp_path_factory.mktemp("orbitkv"), ["pyproject.toml", "README.md", *PRODUCT_DIRS])


def test_product_never_imports_the_bench_or_the_lab():
    offenders = [
        f"{py.relative_to(REPO)}: {sorted(_imported_tops(py) & set(OUTSIDE))}"
        for folder in PRODUCT_DIRS
        for py in sorted((REPO / folder).rglob("*.py"))
        if _imported_tops(py) & set(OUTSIDE)
    ]
    assert offenders == []


def test_lab_never_imports_the_bench():
    """bench/ sits above lab/ (its prompts, the fleet simulator): one direction only."""
    offenders = [str(py.relative_to(REPO)) for py in sorted((REPO / "lab").rglob("*.py"))
                 if "orbitkv_bench" in _imported_tops(py)]
    assert offenders == []


def test_product_wheel_holds_the_product_and_nothing_else(product_wheel):
    names = set(product_wheel.namelist())
    tops = {n.split("/")[0] for n in names}
    assert tops == {"orbitkv", "orbitkv-0.1.0.dist-info"}, tops
    expected = {
        f"{target}/{py.relative_to(REPO / folder).as_posix()}"
        for folder, target in PRODUCT_DIRS.items()
        for py in (REPO / folder).rglob("*.py")
    }
    assert sorted(expected - names) == []  # every module of the product ships
    assert sorted(n for n in names if n.endswith(".py") and n not in expected) == []
    # The native kernels build from the installed sources: every file the build reads ships.
    from orbitkv.kernels import native

    csrc = native.SOURCES[0].parent
    assert {
        f"orbitkv/kernels/csrc/{src.relative_to(csrc).as_posix()}"
        for src in (*native.SOURCES, *native.MODULE_SOURCES, *native.HEADERS)
    } <= names
    assert not [n for n in names if n.endswith(".safetensors")]  # the binding weights stay in lab/
    for gone in ("orbitkv/bench/", "orbitkv/fidelity/", "orbitkv/binding/", "orbitkv/fleet/",
                 "orbitkv/assets/"):
        assert not [n for n in names if n.startswith(gone)], gone


@pytest.mark.parametrize("folder", ["lab", "bench"])
def test_lab_and_bench_declare_every_package(folder):
    """Their setuptools package lists name every package folder (read, not built: the product's
    wheel above is the one a serving node installs), and the lab ships the binding weights."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / folder / "pyproject.toml").read_text())
    declared = set(config["tool"]["setuptools"]["packages"])
    found = {init.parent.relative_to(REPO / folder).as_posix().replace("/", ".")
             for init in (REPO / folder).rglob("__init__.py")}
    assert declared == found
    assert config["project"]["dependencies"][0] == "orbitkv"
    if folder == "lab":
        data = config["tool"]["setuptools"]["package-data"]["orbitkv_lab"]
        weights = REPO / "lab/orbitkv_lab/assets/binding/model.safetensors"
        assert any(weights.relative_to(REPO / "lab/orbitkv_lab").match(g) for g in data)


def test_every_command_imports_in_the_checkout():
    """``make venv`` installs bench/ and lab/ editable: every command's module is there."""
    for words, target, _ in cli.COMMANDS:
        module_name, func_name = target.split(":")
        assert callable(getattr(importlib.import_module(module_name), func_name)), words


_RUN_EACH = """
import contextlib, io, json, sys
from orbitkv import cli
out = {}
for words in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(list(words))
    out[" ".join(words)] = [rc, err.getvalue()]
print(json.dumps(out))
"""


def test_wheel_alone_names_what_to_install_for_bench_and_lab(product_wheel, tmp_path):
    """The product wheel unpacked, run with no site-packages (``-S``): a bench or lab command exits 2
    naming the distribution and the install line; every other command's module is in the wheel."""
    site = tmp_path / "site"
    product_wheel.extractall(site)
    outside = []
    for words, target, _ in cli.COMMANDS:
        module_name = target.split(":")[0]
        if module_name.split(".")[0] in OUTSIDE:
            outside.append(words)
        else:
            path = site / module_name.replace(".", "/")
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), words
    assert outside  # the benches and the lab have commands
    proc = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(site)!r})\n{_RUN_EACH}",
         json.dumps(outside)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True,
    )
    results = json.loads(proc.stdout)
    for words in outside:
        rc, err = results[" ".join(words)]
        top = next(t for w, t, _ in cli.COMMANDS if w == words).split(".")[0]
        what, install = cli.OPTIONAL_PACKAGES[top]
        assert rc == 2, (words, err)
        assert f"'{' '.join(words)}' is part of {what}, not the serving wheel" in err, err
        assert f"`{install}`" in err, err
