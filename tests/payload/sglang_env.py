"""Run code against the real sglang 0.5.23 source, pristine or with the patch set.

`.venv-sglang` (scripts/setup-sglang-venv) holds the *pristine* 0.5.23 wheel. The patched tree
is an overlay built per test session: a folder of symlinks that mirrors site-packages/sglang,
except that every path the manifest lists points at the checkout's `patches/ddtree-temp/files`.
Put first on PYTHONPATH it shadows the installed package, so the tests always see the patch set
as it is in the working tree (no re-apply step, nothing written into the venv), and the same venv
still answers "what does upstream do" for the no-side-effects tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import textwrap

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
PATCH_DIR = REPO / "patches" / "ddtree-temp"
VENV = pathlib.Path(os.environ.get("DDTREE_SGLANG_VENV", REPO / ".venv-sglang"))
PY = VENV / "bin" / "python"



def ancestors_or_self(parents: list[int]) -> list[set[int]]:
    """Every tree node's ancestors-or-self from its parent pointers (a padding node, parent -1:
    itself only). Plain Python, so the code a test runs in .venv-sglang can carry it too:
    `inspect.getsource(ancestors_or_self)`."""
    out = []
    for i in range(len(parents)):
        seen, j = set(), i
        while j >= 0 and j not in seen:
            seen.add(j)
            j = parents[j] if j > 0 else -1
        out.append(seen)
    return out

def need_venv() -> None:
    if not PY.exists():
        msg = f"{VENV} absent: run scripts/setup-sglang-venv"
        if os.environ.get("DDTREE_OPS_STRICT") == "1":
            pytest.fail(msg + " (DDTREE_OPS_STRICT=1)")
        pytest.skip(msg)


def site_packages() -> pathlib.Path:
    out = subprocess.run(
        [str(PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )
    return pathlib.Path(out.stdout.strip())


def build_overlay(dest: pathlib.Path, patch_dir: pathlib.Path = PATCH_DIR) -> pathlib.Path:
    """A symlink mirror of site-packages/sglang with the patch set's files swapped in
    (``patch_dir``: another version of the patch set, e.g. for a before/after benchmark)."""
    site = site_packages()
    manifest = yaml.safe_load((patch_dir / "manifest.yaml").read_text())
    patched = {pathlib.PurePosixPath(f["path"]): patch_dir / "files" / f["path"]
               for f in manifest["files"]}
    split = {p for path in patched for p in path.parents if str(p) != "."}

    def mirror(rel: pathlib.PurePosixPath) -> None:
        out = dest / rel
        out.mkdir(parents=True, exist_ok=True)
        src = site / rel
        names = {e.name for e in src.iterdir() if e.name != "__pycache__"} if src.is_dir() else set()
        names |= {p.name for p in patched if p.parent == rel}
        for name in sorted(names):
            child = rel / name
            if child in patched:
                (out / name).symlink_to(patched[child])
            elif child in split:
                mirror(child)
            else:
                (out / name).symlink_to(src / name)

    mirror(pathlib.PurePosixPath("sglang"))
    return dest


@pytest.fixture(scope="session")
def sglang_overlay(tmp_path_factory) -> pathlib.Path:
    need_venv()
    return build_overlay(tmp_path_factory.mktemp("sglang-overlay"))


def run_sglang(code: str, tmp_path: pathlib.Path, overlay: pathlib.Path | None, *,
               timeout: int = 600, triton_interpret: bool = False) -> dict:
    """Run `code` in .venv-sglang (patched when `overlay` is given); it fills the dict `OUT`,
    which comes back as JSON. `MODEL` names a folder with a tiny Qwen3 config.json.
    `triton_interpret` runs SGLang's own Triton kernels on the CPU (Triton's interpreter), so
    the real index/mask kernels execute here instead of being replaced."""
    need_venv()
    cfg = tmp_path / "model"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "block_size": 16}))
    script = "import json, sys\nMODEL = %r\nOUT = {}\n" % str(cfg) + textwrap.dedent(code) + \
        "\nprint('@@RESULT@@' + json.dumps(OUT))\n"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)
    if overlay is not None:
        env["PYTHONPATH"] = str(overlay)
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([str(PY), "-c", script], capture_output=True, text=True, timeout=timeout,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("@@RESULT@@")][-1]
    return json.loads(line[len("@@RESULT@@"):])
