"""Why a canary stopped the rollout, in the words the operator needs: a canary the host REFUSED
(preflight: nothing was changed) is not a failed one (changed, then rolled back), and the reason
of the refusal is what to fix next."""

from __future__ import annotations

from ..runbook.results import SUCCESS, HostResult, Outcome


def refusal_reasons(message: str) -> str:
    """A refusal's reasons in one line: the lines after "preflight refused; nothing was changed:"
    (each "  - REASON"), or the message itself when it has no such list."""
    lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
    listed = [ln[2:] for ln in lines[1:] if ln.startswith("- ")]
    return "; ".join(listed) if listed else " ".join(lines)


def canary_abort_reason(rows: list[HostResult], failed: int, total: int) -> str:
    """`canary refused (1 of 1): fh1: REASON` when every failed canary target refused; otherwise
    `canary failed (N of M)`."""
    bad = [r for r in rows if r.outcome not in SUCCESS["deploy"]]
    if bad and all(r.outcome == Outcome.REFUSED for r in bad):
        reasons = refusal_reasons(bad[0].message)
        named = reasons if reasons.startswith(f"{bad[0].host}: ") else f"{bad[0].host}: {reasons}"
        return f"canary refused ({failed} of {total}): {named}"
    return f"canary failed ({failed} of {total})"
