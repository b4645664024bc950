"""SGLang's launch flags: the ones the stand-in models, the rest recorded, secrets masked in the
stand-in's own lines; `--config FILE` merged as SGLang 0.5.23 merges it (`merge_config`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ddtree_ops.config.redaction import MASK, is_secret_name

from .costmodel import DEFAULT_KNEE_TOKENS


def knee_tokens(text: str) -> float:
    """--standin-verify-knee-tokens's value: a number of tokens, "inf" or <= 0 for no cost model
    (costmodel.cost_model_on); "nan" or a word is argparse's "invalid value" (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r} (give e.g. 256, or inf for "
                                         "no cost model)")
    return value


# Where a host keeps the payload's calibrations (calibration.cached_calibrate): set for every unit of
# a sandbox host by its systemd manager (sandbox/hostfiles.py), unset elsewhere.
CALIBRATION_CACHE_ENV = "DDTREE_STANDIN_CALIBRATION_CACHE"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch_server.py",
        description="Stand-in for sglang.launch_server 0.5.23 (no GPU).",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", "--model", dest="model_path", default="stand-in-model")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp", "--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    p.add_argument("--api-key", default=None)
    # Parsed, never merged: only the exact token `--config` is (see merge_config).
    p.add_argument("--config", default=None,
                   help="Read CLI options from a config file. Must be a YAML file with configuration options.")
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-ddtree-budget", type=int, default=None)
    p.add_argument("--speculative-ddtree-topk-cap", type=int, default=None)
    # stand-in knobs
    g = p.add_argument_group("stand-in knobs")
    g.add_argument("--standin-load-seconds", type=float, default=0.5,
                   help="seconds of 'weight loading' with the port closed "
                        "(env DDTREE_STANDIN_LOAD_SECONDS overrides)")
    g.add_argument("--standin-warmup-seconds", type=float, default=0.3,
                   help="seconds of warm-up with the port open and /health 503")
    g.add_argument("--standin-crash-during-load", action="store_true",
                   help="exit 1 with a traceback after half the load time")
    g.add_argument("--standin-never-listen", action="store_true",
                   help="load forever: the port never opens")
    g.add_argument("--standin-warmup-never-completes", action="store_true",
                   help="/health stays 503 forever")
    g.add_argument("--standin-health-flaps", action="store_true",
                   help="after ready, /health alternates 200, 503, 200, ... per request")
    g.add_argument("--standin-generate-fails", action="store_true",
                   help="/generate answers 500")
    g.add_argument("--standin-die-after-ready", type=float, default=None, metavar="SECONDS",
                   help="exit 1 SECONDS after the server declared itself ready")
    g.add_argument("--standin-generate-seconds", type=float, default=0.0, metavar="S",
                   help="each /generate takes S seconds (in flight meanwhile: /v1/loads, the SIGTERM drain); "
                        "the first chunk still comes after the prefill delay, the others share the rest")
    g.add_argument("--standin-cuda-graph-seconds", type=float, default=0.0, metavar="S",
                   help="CUDA graph capture takes S seconds (port still closed), between 'Memory pool end' "
                        "and the capture's end line")
    g.add_argument("--standin-ttft-seconds", type=float, default=0.03, metavar="S",
                   help="prefill delay of each request: its first token (first stream chunk) comes S seconds "
                        "after it was admitted")
    g.add_argument("--standin-tokens-per-second", type=float, default=None, metavar="R",
                   help="per-request decode rate: a verify step committing n tokens takes n/R seconds. "
                        "Default: one verify step per 1/N s (--standin-verify-steps-per-second), i.e. "
                        "N x the accept length tokens/s")
    g.add_argument("--standin-verify-steps-per-second", type=float, default=400.0, metavar="N",
                   help="verify steps (target forwards) per second and request when --standin-tokens-per-second "
                        "is not given: the decode rate at accept length 1 (default 400), as long as the "
                        "batch's verified tokens stay under the knee (--standin-verify-knee-tokens)")
    g.add_argument("--standin-verify-knee-tokens", type=knee_tokens, default=DEFAULT_KNEE_TOKENS, metavar="K",
                   help="the verify cost model (costmodel.py): with --standin-verify-steps-per-second N, a step "
                        "takes (1/N) x max(1, batch x width / K), batch the requests generating, width the "
                        "tokens each verifies (DDTree budget + 1, DFlash 16, or --speculative-num-draft-tokens); "
                        f"K <= 0 or inf: always 1/N (default {DEFAULT_KNEE_TOKENS:g})")
    g.add_argument("--standin-fail-budget-above", type=int, default=None, metavar="N",
                   help="with --speculative-algorithm DDTREE and a budget above N, start-up fails while "
                        "capturing the verify CUDA graph (exit 1 before the port opens), as SGLang did on "
                        "sm_103 for budgets above 8")
    g.add_argument("--standin-accept-length", type=float, default=None, metavar="A",
                   help="average accept length (tokens committed per verify step, >= 1) reported and paced. "
                        "Default: measured from the DDTree payload once at start-up (greedy and at temperature 1, "
                        "a request's interpolated by its temperature); else, with "
                        "--speculative-algorithm DDTREE, 1 + log2(1 + budget/4) + (min(topk_cap, budget) - 1)/4; "
                        "else 1.0")
    g.add_argument("--standin-gpu-dir", default="/run/ddtree-sandbox/gpu", metavar="DIR",
                   help="register this process's 'GPU memory' here (a file per PID) for the sandbox's nvidia-smi, "
                        "when the folder exists")
    g.add_argument("--standin-gpu-mib", type=int, default=80000, help="MiB of 'GPU memory' to register")
    g.add_argument("--standin-orphan-gpu-seconds", type=float, default=None, metavar="S",
                   help="once the server ends, a leftover process outside the unit holds 'GPU memory' for "
                        "S seconds (what a crashed or stopped server can leave behind)")
    g.add_argument("--standin-calibration-cache", default=os.environ.get(CALIBRATION_CACHE_ENV, ""), metavar="DIR",
                   help="keep the payload's measured accept length here, keyed by the payload files' and the "
                        "config's sha256, so a later start of the same release reads it (default "
                        f"${CALIBRATION_CACHE_ENV}, which sandbox hosts set; '': measure at every start)")
    g.add_argument("--standin-site-packages", default=None, metavar="DIR",
                   help="where to look for sglang when it is not importable")
    return p


def _is_flag(tok: str) -> bool:
    if not tok.startswith("-") or tok == "-":
        return False
    try:
        float(tok)
        return False  # a negative number is a value
    except ValueError:
        return True


def record_unknown(unknown: list[str]) -> dict[str, Any]:
    """Turn unparsed SGLang flags into {dest: value} (value True for bare switches)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(unknown):
        tok = unknown[i]
        if _is_flag(tok):
            name, eq, val = tok.lstrip("-").partition("=")
            key = name.replace("-", "_")
            if eq:
                out[key] = val
            elif i + 1 < len(unknown) and not _is_flag(unknown[i + 1]):
                out[key] = unknown[i + 1]
                i += 1
            else:
                out[key] = True
        else:
            out.setdefault("_positional", []).append(tok)
        i += 1
    return out


def masked(extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` (from `record_unknown`) with the values of secret-named flags (the project's one
    list, `ddtree_ops.config.redaction`) replaced by ***; a bare switch shows as given."""
    return {k: (MASK if is_secret_name(k) and v is not True else v) for k, v in extra.items()}


class ConfigError(ValueError):
    """What SGLang's ConfigArgumentMerger raises (ValueError, same messages): the server exits 1."""


def merge_config(argv: list[str]) -> list[str]:
    """`argv` with the options of its `--config FILE` merged in, as SGLang 0.5.23 does
    (sglang/srt/server_args.py `prepare_server_args`; sglang/srt/utils/server_args_config_parser.py
    `ConfigArgumentMerger.merge_config_with_args`):

    * only the exact token `--config` followed by a path counts (`--config=FILE` is parsed as an
      option and ignored); two are an error;
    * the file must end in .yaml/.yml and exist; its root must be a mapping;
    * each key becomes `--KEY` *as written*: `api-key: K` gives `--api-key K`, while `api_key: K`
      gives `--api_key K`, which SGLang's parser refuses ("unrecognized arguments"; see
      `underscore_flags`); true adds a store_true flag (false omits it), a list gives the flag and
      its items, a mapping its JSON, anything else `str(value)` -- so an unquoted `api-key: 0123`
      is the YAML number 83;
    * the config's options go first: a flag also on the command line wins.
    """
    found = [i for i, a in enumerate(argv) if a == "--config"]
    if not found:
        return list(argv)
    if len(found) > 1:
        raise ConfigError("Multiple config files specified! Only one allowed.")
    i = found[0]
    if i == len(argv) - 1:
        raise ConfigError("No config file specified after --config flag!")
    path = Path(argv[i + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(f"Config file must be YAML format, got: {path.suffix}")
    if not path.exists():
        raise ConfigError(f"Config file not found: {path}")
    import yaml  # what SGLang uses; only needed with --config

    with open(path) as fh:  # a PermissionError ends the server, as in SGLang
        data = yaml.safe_load(fh)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("Config file must contain a dictionary at root level")
    merged: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):  # a switch, as every boolean the stand-in knows is (and most of SGLang's)
            merged += [f"--{key}"] if value else []
        elif isinstance(value, list):
            merged += ([f"--{key}", *(str(v) for v in value)] if value else [])
        elif isinstance(value, dict):
            merged += [f"--{key}", json.dumps(value)]
        else:
            merged += [f"--{key}", str(value)]
    return merged + argv[:i] + argv[i + 2:]


def underscore_flags(argv: list[str]) -> list[str]:
    """The `--name_with_underscores` flags of `argv` and their values: SGLang 0.5.23 spells every
    option with dashes, so its parser refuses these ("unrecognized arguments", exit 2) -- the way
    a config key written `api_key:` ends, with the key's value in the error."""
    out: list[str] = []
    for j, tok in enumerate(argv):
        if tok.startswith("--") and "_" in tok.split("=", 1)[0]:
            out.append(tok)
            if "=" not in tok and j + 1 < len(argv) and not _is_flag(argv[j + 1]):
                out.append(argv[j + 1])
    return out


def logged_server_args(args: argparse.Namespace, extra: dict[str, Any]) -> str:
    """The start-up line SGLang 0.5.23 logs (sglang/srt/entrypoints/engine.py, `_launch_subprocesses`:
    `logger.info(f"server_args={_server_args_for_logging(server_args)}")`): the repr of a dict of
    every field, secrets included -- SGLang hides only its watermark keys. So `api_key` is logged in
    clear, here as there; it is the controller that scrubs what it shows."""
    fields = {k: v for k, v in vars(args).items() if not k.startswith("standin_") and k != "config"}
    fields.update({k: v for k, v in extra.items() if k != "_positional"})
    return f"server_args={fields!r}"


_FLAG_IN_SOURCE = re.compile(r"""["'](--[a-z0-9][a-z0-9-]*)["']""")
# 0.5.23 builds most flags from annotated dataclass fields (arg_groups/arg_utils.py
# add_cli_args_from_dataclass): `mem_fraction_static: A[...]` is `--mem-fraction-static`.
_ANNOTATED_FIELD = re.compile(r"^\s+([a-z_][a-z0-9_]*)\s*:\s*A\[", re.MULTILINE)


def sglang_flags(site_packages: Path | None) -> set[str]:
    """Every `--flag` string in the installed SGLang's argument definitions (server_args.py and
    arg_groups/, the patch set's versions where it replaces them): what SGLang's own parser
    accepts, read without importing SGLang (the sandbox venv lacks its dependencies)."""
    if site_packages is None:
        return set()
    srt = site_packages / "sglang" / "srt"
    files = [srt / "server_args.py", *sorted((srt / "arg_groups").rglob("*.py"))]
    found: set[str] = set()
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found.update(_FLAG_IN_SOURCE.findall(text))
        found.update("--" + name.replace("_", "-") for name in _ANNOTATED_FIELD.findall(text))
    return found


def unrecognized(unknown: list[str], known: set[str]) -> list[str]:
    """The flags among `unknown` (what the stand-in's own parser left) that SGLang does not know
    either, with their values, as argparse lists them."""
    out: list[str] = []
    refusing = False
    for tok in unknown:
        if _is_flag(tok):
            flag = tok.split("=", 1)[0]
            # boolean fields also take `--no-NAME` (argparse.BooleanOptionalAction)
            refusing = flag not in known and not (flag.startswith("--no-") and "--" + flag[5:] in known)
        if refusing:
            out.append(tok)
    return out
