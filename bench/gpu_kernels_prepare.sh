#!/usr/bin/env bash
# Stage what bench/gpu_kernels.py needs on the lent GPU machine, which has no
# network and no sglang: run this on the CPU machine, then carry the folder.
#
#   bench/gpu_kernels_prepare.sh                  # -> bench/.gpu_carry (git-ignored)
#   bench/gpu_kernels_prepare.sh --verify-build   # also compile + load both kernels here for
#                                                 # sm_90a (needs nvcc; no GPU; ~1 min; curand headers
#                                                 # from the toolkit, or GPU_KERNELS_CURAND_INCLUDE=dir)
#
# Staged (from wheels in .cache/wheels, downloaded with `pip download --no-deps`
# when absent):
#   sglang_jit/include/          sglang 0.5.23 wheel: sglang/kernels/jit/include (sgl_kernel headers)
#   sglang_jit/csrc/speculative/ sglang 0.5.23 wheel: sampling.cuh, tree.cuh (the two kernels' sources)
#   sglang_py/                   sglang 0.5.23 wheel: kernels/ops/speculative/{sampling,tree}.py (how
#                                SGLang names and instantiates them; read, not run)
#   sglang_py/attention/         sglang 0.5.23 wheel: kernels/ops/attention/{extend_attention,
#                                decode_attention,score_mod}.py, the triton verify-attention kernel and
#                                the two files it imports (run by gpu_kernels.py's tree_attention steps;
#                                its other sglang imports, sglang.srt.utils / sglang.srt.environ, get
#                                small stand-ins there: checked below that nothing else is imported)
#   flashinfer/include/          flashinfer-python 0.7.2 wheel (sglang 0.5.23's pin): data/include,
#                                the headers sampling.cuh includes (flashinfer/sampling.cuh ...)
#   apache_tvm_ffi-0.1.11-*.whl  for the device's Python 3.12 (abi3) and 3.11; pip picks one
#   MANIFEST.json                versions, sha256 of the wheels, file list
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_CARRY (output folder).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="${GPU_CARRY:-$ROOT/bench/.gpu_carry}"
WHEELS="$ROOT/.cache/wheels"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
SGLANG_VERSION=0.5.23
FLASHINFER_VERSION=0.7.2
TVM_FFI_VERSION=0.1.11

mkdir -p "$WHEELS"
first() { ls $1 2>/dev/null | head -n 1 || true; }

SG_WHL="$(first "$WHEELS/sglang-$SGLANG_VERSION-*.whl")"
if [ -z "$SG_WHL" ]; then
  "$PY" -m pip download --quiet --no-deps "sglang==$SGLANG_VERSION" -d "$WHEELS"
  SG_WHL="$(first "$WHEELS/sglang-$SGLANG_VERSION-*.whl")"
fi
FI_WHL="$(first "$WHEELS/flashinfer_python-$FLASHINFER_VERSION-*.whl")"
if [ -z "$FI_WHL" ]; then
  "$PY" -m pip download --quiet --no-deps "flashinfer-python==$FLASHINFER_VERSION" -d "$WHEELS"
  FI_WHL="$(first "$WHEELS/flashinfer_python-$FLASHINFER_VERSION-*.whl")"
fi
TVM_DIR="$WHEELS/tvm-ffi-device"
mkdir -p "$TVM_DIR"
for pyv in 3.12 3.11; do
  tag="${pyv/./}"
  if [ -z "$(first "$TVM_DIR/apache_tvm_ffi-$TVM_FFI_VERSION-cp$tag-*.whl")" ]; then
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyv" \
      --platform manylinux_2_28_x86_64 "apache-tvm-ffi==$TVM_FFI_VERSION" -d "$TVM_DIR"
  fi
done
for f in "$SG_WHL" "$FI_WHL"; do
  [ -n "$f" ] && [ -f "$f" ] || { echo "gpu_kernels_prepare: missing wheel ($f)" >&2; exit 1; }
done

rm -rf "$CARRY"
mkdir -p "$CARRY"
cp "$TVM_DIR"/apache_tvm_ffi-"$TVM_FFI_VERSION"-*.whl "$CARRY"/

"$PY" - "$SG_WHL" "$FI_WHL" "$CARRY" "$SGLANG_VERSION" "$FLASHINFER_VERSION" "$TVM_FFI_VERSION" "$ROOT" <<'PYEOF'
import hashlib, json, pathlib, sys, zipfile

sg_whl, fi_whl, carry, sg_v, fi_v, tvm_v = sys.argv[1:7]
carry = pathlib.Path(carry)
files = []


def extract(whl, prefix, dest, only=None):
    n = 0
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if not name.startswith(prefix) or name.endswith("/"):
                continue
            rel = name[len(prefix):]
            if only is not None and rel not in only:
                continue
            out = carry / dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
            files.append(str(out.relative_to(carry)))
            n += 1
    if only is not None and n != len(only):
        sys.exit(f"gpu_kernels_prepare: {whl} lacks some of {sorted(only)} under {prefix}")
    if n == 0:
        sys.exit(f"gpu_kernels_prepare: nothing under {prefix} in {whl}")


extract(sg_whl, "sglang/kernels/jit/include/", "sglang_jit/include")
extract(sg_whl, "sglang/kernels/jit/csrc/speculative/", "sglang_jit/csrc/speculative",
        only={"sampling.cuh", "tree.cuh"})
extract(sg_whl, "sglang/kernels/ops/speculative/", "sglang_py", only={"sampling.py", "tree.py"})
extract(sg_whl, "sglang/kernels/ops/attention/", "sglang_py/attention",
        only={"extend_attention.py", "decode_attention.py", "score_mod.py"})
extract(fi_whl, "flashinfer/data/include/", "flashinfer/include")

# The wrappers gpu_kernels.py generates must be the ones this wheel asks for.
sampling_py = (carry / "sglang_py" / "sampling.py").read_text()
tree_py = (carry / "sglang_py" / "tree.py").read_text()
expect = {
    "sampling.py": ['"speculative_sampling"', '"speculative/sampling.cuh"',
                    'f"tree_speculative_sampling_target_only<{vec_size}, {deterministic_cpp}>"',
                    'extra_dependencies=["flashinfer"]'],
    "tree.py": ['"speculative_tree"', '"speculative/tree.cuh"',
                '("verify_tree_greedy", "verify_tree_greedy")',
                '("build_tree_kernel_efficient", "build_tree_kernel_efficient")',
                '"reconstruct_indices_from_tree_mask",'],
}
for fname, needles in expect.items():
    text = sampling_py if fname == "sampling.py" else tree_py
    missing = [x for x in needles if x not in text]
    if missing:
        sys.exit(f"gpu_kernels_prepare: {fname} of the wheel changed; gpu_kernels.py expects {missing}")

# The verify-attention kernel as gpu_kernels.py calls it, and only the sglang imports it stands in for.
extend_py = (carry / "sglang_py" / "attention" / "extend_attention.py").read_text()
for needle in ("def extend_attention_fwd(", "skip_prefix_custom_mask=True,", "def _fwd_kernel("):
    if needle not in extend_py:
        sys.exit(f"gpu_kernels_prepare: extend_attention.py of the wheel changed; gpu_kernels.py expects {needle!r}")
sys.dont_write_bytecode = True
import importlib.util
spec = importlib.util.spec_from_file_location("gpu_kernels_imports", pathlib.Path(sys.argv[7]) / "bench" / "gpu_kernels.py")
try:
    gk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gk)
    gk.check_attention_imports(carry / "sglang_py" / "attention")
except ModuleNotFoundError as exc:  # no torch in this interpreter: say so, the device run checks again
    print(f"gpu_kernels_prepare: attention imports not checked here ({exc})")
except RuntimeError as exc:
    sys.exit(f"gpu_kernels_prepare: {exc}")


def sha(p):
    return hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest()


manifest = {
    "sglang_wheel": f"{pathlib.Path(sg_whl).name} sha256 {sha(sg_whl)}",
    "flashinfer_wheel": f"{pathlib.Path(fi_whl).name} sha256 {sha(fi_whl)}",
    "tvm_ffi_wheels": {p.name: sha(p) for p in sorted(carry.glob("apache_tvm_ffi-*.whl"))},
    "versions": {"sglang": sg_v, "flashinfer-python": fi_v, "apache-tvm-ffi": tvm_v},
    "files": sorted(files),
}
(carry / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
print(f"gpu_kernels_prepare: {len(files)} source files staged")
PYEOF

carry_bytes=$(du -sb "$CARRY" | cut -f1)
tree_bytes=$(cd "$ROOT" && git ls-files -z -co --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -n 1 | cut -f1)
total=$((carry_bytes + ${tree_bytes:-0}))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "gpu_kernels_prepare: carry $CARRY = $(mib "$carry_bytes") ($carry_bytes bytes)"
echo "gpu_kernels_prepare: with the working tree that travels: $(mib "$total") of the 64 MiB limit"
if [ "$total" -gt $((60 * 1048576)) ]; then
  echo "gpu_kernels_prepare: WARNING: over 60 MiB; the device call may refuse it" >&2
fi
if [ "${1:-}" = "--verify-build" ]; then
  if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "gpu_kernels_prepare: --verify-build: no nvcc here, not verified" >&2
  else
    tmp="$(mktemp -d)"
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$CARRY" \
      "apache-tvm-ffi==$TVM_FFI_VERSION" --target "$tmp/site"
    if PYTHONPATH="$tmp/site" "$PY" "$ROOT/bench/gpu_kernels.py" --compile-only --arch 90a \
        --carry "$CARRY" --out "$tmp/out" --build-dir "$tmp/build"; then
      echo "gpu_kernels_prepare: --verify-build: both modules compiled for sm_90a and loaded"
      rm -rf "$tmp"
    else
      echo "gpu_kernels_prepare: --verify-build FAILED (build kept in $tmp)" >&2
      exit 1
    fi
  fi
fi

rel="${CARRY#"$ROOT"/}"
echo
echo "Device call (tool 'run', carry [\"$rel\"], timeout_s 600); the one-line command:"
echo "python3 -m pip install --no-index --no-deps --find-links $rel apache-tvm-ffi==$TVM_FFI_VERSION && PYTHONUNBUFFERED=1 python3 bench/gpu_kernels.py --carry $rel --out \$OUT"
