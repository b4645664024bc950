"""SGLang's launch flags: the ones the stand-in models, the rest recorded, secrets masked."""

from __future__ import annotations

import argparse
from typing import Any

from ddtree_ops.redaction import MASK, is_secret_name


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
    list, `ddtree_ops.redaction`) replaced by ***; a bare switch shows as given."""
    return {k: (MASK if is_secret_name(k) and v is not True else v) for k, v in extra.items()}
