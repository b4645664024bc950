"""A host's message in one line of a table or a live row: a refusal's reasons come on the lines
after its first ("preflight refused; nothing was changed:" then "  - REASON"), so the first line
alone says nothing of why; and a cut keeps the START, where the message says what happened."""

from __future__ import annotations


def one_line(text: str | None) -> str:
    """Every non-empty line of `text`, list markers dropped, joined: `A: B; C`."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    if not lines:
        return ""
    rest = [ln[2:] if ln.startswith("- ") else ln for ln in lines[1:]]
    head = lines[0]
    if not rest:
        return head
    return head + ("" if head.endswith(":") else ":") + " " + "; ".join(rest)


def start_of(text: str, width: int) -> str:
    """The first `width` characters of `text`, with an ellipsis when it is longer."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"
