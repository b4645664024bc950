"""The host's journal (<state_dir>/journal.json), as the controller reads it back.

The agent writes it before every step that changes the host; the next run repairs from it. A
journal this tool did not write (truncated by a full disk, edited by hand, from a foreign tool)
is never acted on: the run stops with exit 4, "corrupt journal", and the way out.
"""

from __future__ import annotations

from typing import Any

from .agent.heal import heal_journal_problem


def journal_problem(journal: Any) -> str | None:
    """Why a journal is not one this tool wrote (None: it is, or there is none). Pure. One check
    for both sides: the host's agent, which heals only from a journal this tool wrote, runs the
    same function (host/agent/heal.py, stdlib only)."""
    return heal_journal_problem(journal)
