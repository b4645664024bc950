"""The installable tool: a wheel built from the checkout (`pip install .`, `pipx install .`)
works outside the checkout and gives the same bytes as the checkout; an editable install
(`pip install -e .`, what scripts/setup does) reads the checkout's templates/ and patches/.

Sandbox tier (with the rig's tests, not in the quick loop): real pip, builds and fresh venvs,
about 8 CPU-s. How, offline and in about 15 s:

* The packaging inputs (pyproject.toml, setup.py, MANIFEST.in, README.md, ddtree_ops/,
  templates/, patches/; no bytecode) are copied to a temp folder, so no build writes build/ or
  egg-info into the checkout other people work in.
* From the copy, an sdist (setuptools' PEP 517 hook, as `python -m build` does first), then a
  wheel *from that sdist* with `pip wheel --no-deps --no-build-isolation --no-index`: what the
  wheel holds must have travelled through MANIFEST.in too.
* A fresh `python -m venv --without-pip` (no --system-site-packages) gets the wheel with
  `pip --python <fresh> install --no-deps --no-index`, which byte-compiles what it installs, as
  a real install does. Only after checking that `import ddtree_ops` resolves into the fresh
  site-packages is this venv's site-packages added for the dependencies (paramiko, typer, ...):
  one line in a .pth file, a plain sys.path entry placed AFTER the fresh site-packages, whose
  own .pth files (among them the editable finder pointing at the checkout) are not processed.
  The check is repeated with the line in place. Every command runs from an unrelated, empty
  temp folder, with TMPDIR pointing at a private folder that must be empty afterwards (the
  unpacked patch sets are removed at exit).
* The same commands run with this venv's ddtree-ops (the editable checkout install) from the
  same folder: `render --no-verify` of every template, `plan --help` and `bundle --out D` must
  give the same bytes.
* The editable case: setuptools' PEP 660 hook (what `pip install -e` calls) builds the editable
  wheel of the copy, installed the same way into another fresh venv.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from kit import REPO

pytestmark = pytest.mark.sandbox

SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "ddtree_ops", "templates", "patches")
_BYTECODE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")

INVENTORY = """\
all:
  vars:
    python: /opt/venv/bin/python
    site_packages: /opt/venv/lib/python3.12/site-packages
    model_path: /models/m
    draft_model_path: /models/d
  hosts:
    ddtree:
      address: 10.0.0.5
      budget: 32
      topk_cap: 6
      extra_args: [--trust-remote-code, --mem-fraction-static=0.88]
      environment: {NCCL_P2P_DISABLE: "0"}
      conflicts: [sglang-k26-dflash-cg.service]
    dflash:
      address: 10.0.0.6
      template: sglang-dflash.service.j2
      unit: sglang-k26-dflash-cg.service
"""


def _env(tmpdir: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "PYTHONSTARTUP")}
    env.update(COLUMNS="100", TERM="dumb", NO_COLOR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env


def run(argv: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env or _env(), capture_output=True, timeout=300)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout.decode()}\n{r.stderr.decode()}"
    return r


def _files(top: Path) -> dict[str, Path]:
    """Non-bytecode files under `top`, by posix path relative to it."""
    return {p.relative_to(top).as_posix(): p for p in sorted(top.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


def copy_sources(d: Path) -> Path:
    d.mkdir()
    for name in SOURCES:
        s = REPO / name
        if s.is_dir():
            shutil.copytree(s, d / name, ignore=_BYTECODE, symlinks=True)
        else:
            shutil.copy2(s, d / name)
    return d


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return copy_sources(tmp_path_factory.mktemp("wheel-src") / "ddtree-ops")


@pytest.fixture(scope="module")
def wheel(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel-dist")
    hook = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    name = run([sys.executable, "-c", hook, out], cwd=src).stdout.decode().strip().splitlines()[-1]
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", out, out / name], cwd=out)
    (whl,) = out.glob("ddtree_ops-*.whl")
    return whl


def _fresh_venv(root: Path, wheel: Path, package_dir: Path | None = None) -> tuple[Path, Path]:
    """(python, site-packages) of a new venv holding `wheel` and, for its dependencies, this venv's
    site-packages as a trailing sys.path entry. `ddtree_ops` must import from `package_dir`
    (default: the new site-packages)."""
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    py = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel], cwd=root)
    site = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root)
                .stdout.decode().strip())
    package_dir = package_dir or site / "ddtree_ops"
    where = "import ddtree_ops; print(ddtree_ops.__file__)"
    assert Path(run([py, "-c", where], cwd=root).stdout.decode().strip()).parent == package_dir
    (site / "zz_ddtree_ops_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert Path(run([py, "-c", where], cwd=root).stdout.decode().strip()).parent == package_dir
    return py, site


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path]:
    return _fresh_venv(tmp_path_factory.mktemp("wheel-venv"), wheel)


# --------------------------------------------------------------------------- what the wheel holds

def test_the_wheel_carries_templates_and_patch_sets_and_no_bytecode(wheel, src):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".pyo"))]
        # Every file of the package, .py or not, is in the wheel.
        missing = [f"ddtree_ops/{rel}" for rel in _files(src / "ddtree_ops")
                   if f"ddtree_ops/{rel}" not in names]
        assert not missing
        templates = {n.removeprefix("ddtree_ops/_data/templates/"): z.read(n) for n in names
                     if n.startswith("ddtree_ops/_data/templates/")}
        assert templates == {rel: p.read_bytes() for rel, p in _files(REPO / "templates").items()}
        assert not [n for n in names if n.startswith("ddtree_ops/_data/") and not n.startswith(
            "ddtree_ops/_data/templates/") and n != "ddtree_ops/_data/patches.tar"]
        blob = z.read("ddtree_ops/_data/patches.tar")
    # The patch sets travel as one tar (installers byte-compile .py files): exactly the files of
    # patches/, byte for byte, with their modes.
    (src / "unpacked.tar").write_bytes(blob)
    with tarfile.open(src / "unpacked.tar") as tf:
        members = {ti.name: (stat.S_IMODE(ti.mode), tf.extractfile(ti).read()) for ti in tf if ti.isreg()}
        assert all(ti.isreg() for ti in tf.getmembers())
    expected = {rel: (stat.S_IMODE(p.stat().st_mode), p.read_bytes()) for rel, p in _files(REPO / "patches").items()}
    assert members == expected


def test_the_checkout_itself_reads_its_top_level_folders():
    from ddtree_ops.artifacts import resources

    assert resources.origin() == "checkout"
    assert resources.templates_dir() == REPO / "templates" and resources.patches_dir() == REPO / "patches"
    assert not (REPO / "ddtree_ops" / "_data").exists()  # a build never writes into the checkout


# --------------------------------------------------------------------------- the installed tool

def _commands(tmp: Path, inventory: Path) -> list[tuple[str, list[str]]]:
    return [
        ("render ddtree", ["render", "--host", "ddtree", "-i", str(inventory), "--no-verify"]),
        ("render dflash", ["render", "--host", "dflash", "-i", str(inventory), "--no-verify"]),
        ("render ct200", ["render", "--host", "ct200", "-i", str(REPO / "inventory" / "ct200.yaml"), "--no-verify"]),
        ("plan --help", ["plan", "--help"]),
    ]


def test_the_installed_wheel_gives_the_same_bytes_as_the_checkout(installed, tmp_path):
    py, site = installed
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    wheel_env = _env(private_tmp)
    tool = py.parent / "ddtree-ops"  # the console script pip wrote
    checkout_tool = Path(sys.executable).parent / "ddtree-ops"  # this venv's (the editable checkout install)
    assert checkout_tool.is_file()

    probe = ("import ddtree_ops, ddtree_ops.artifacts.resources as r; "
             "print(ddtree_ops.__file__); print(r.origin()); print(r.templates_dir()); print(r.patches_dir())")
    file_, origin, tdir, pdir = run([py, "-c", probe], cwd, wheel_env).stdout.decode().split("\n")[:4]
    assert Path(file_).parent == site / "ddtree_ops" and origin == "wheel"
    assert Path(tdir) == site / "ddtree_ops" / "_data" / "templates"
    assert Path(pdir).is_relative_to(private_tmp)  # unpacked from the tar, privately
    # pip byte-compiled the package: patch sets shipped as files would have had bytecode beside them.
    assert list((site / "ddtree_ops").glob("__pycache__/*.pyc"))

    for label, args in _commands(tmp_path, inventory):
        ours = run([tool, *args], cwd, wheel_env).stdout
        checkout = run([checkout_tool, *args], cwd).stdout
        assert ours and ours == checkout, label

    bw, bc = tmp_path / "bundle-wheel", tmp_path / "bundle-checkout"
    run([tool, "bundle", "--out", bw], cwd, wheel_env)
    run([checkout_tool, "bundle", "--out", bc], cwd)
    (fw,), (fc,) = list(bw.iterdir()), list(bc.iterdir())
    assert fw.name == fc.name and fw.read_bytes() == fc.read_bytes()
    assert not list(private_tmp.iterdir())  # the unpacked patch sets were removed at exit


def test_an_editable_install_reads_the_checkout_folders(tmp_path):
    src = copy_sources(tmp_path / "ddtree-ops")  # its own copy: this test edits a template
    dist = tmp_path / "dist"
    dist.mkdir()
    hook = "import sys; from setuptools import build_meta as b; print(b.build_editable(sys.argv[1]))"
    name = run([sys.executable, "-c", hook, dist], cwd=src).stdout.decode().strip().splitlines()[-1]
    py, _ = _fresh_venv(tmp_path, dist / name, package_dir=src / "ddtree_ops")
    probe = ("import ddtree_ops, ddtree_ops.artifacts.resources as r; "
             "print(ddtree_ops.__file__); print(r.origin()); print(r.templates_dir()); print(r.patches_dir())")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    file_, origin, tdir, pdir = run([py, "-c", probe], cwd).stdout.decode().split("\n")[:4]
    assert (Path(file_), origin) == (src / "ddtree_ops" / "__init__.py", "checkout")
    assert (Path(tdir), Path(pdir)) == (src / "templates", src / "patches")
    assert not (src / "ddtree_ops" / "_data").exists()
    # An edit to the checkout's template shows at once, as an editable install promises.
    tpl = src / "templates" / "sglang-ddtree.service.j2"
    tpl.write_text("# edited\n" + tpl.read_text())
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    out = run([py, "-m", "ddtree_ops", "render", "--host", "ddtree", "-i", inventory, "--no-verify"], cwd).stdout
    assert out.startswith(b"# edited\n")
