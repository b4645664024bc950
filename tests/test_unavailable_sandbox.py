"""max_unavailable on real sandbox hosts behind a real smg: the control of the default rolling
rollback measured in test_live_traffic.py (0 failed requests, never more than one worker out).
Here the old all-at-once behaviour, asked for with --max-unavailable 100%, is seen emptying the
router while a client sends requests through it."""

from __future__ import annotations

import time

import test_live_traffic as live

from kit import run_cli

routed = live.routed_fleet  # the fixture: every sandbox host behind a real smg


def test_all_at_once_which_only_100_percent_allows_takes_every_worker_out_of_the_router(routed, good_patchset,
                                                                                         record_property):
    inv, env, info = routed
    dep = run_cli("deploy", "-i", str(inv), "-p", str(good_patchset), "--canary", "0", "--max-unavailable", "100%",
                  "--yes", "--json", env=env, timeout=600)
    assert dep.code == 0, dep.stderr[-3000:]
    hosts = [h["host"] for h in dep.json()["hosts"]]
    assert dep.json()["batches"] == [hosts]
    with live.Client(info["url"]) as client, live.RoutedSampler(info) as sampled:
        time.sleep(0.5)  # traffic flowing before the rollback
        back = run_cli("rollback", "-i", str(inv), "--max-unavailable", "100%", "--yes", "--json", env=env,
                       timeout=600)
        time.sleep(0.5)
    assert back.code == 0, back.stderr[-3000:]
    assert back.json()["batches"] == [hosts]
    record_property("measured", f"all at once (--max-unavailable 100%): {client.sent} requests through smg, "
                                f"{len(client.failed)} failed; fewest workers routed {sampled.fewest} of {len(hosts)} "
                                f"in {sampled.looks} looks")
    assert sampled.fewest == 0  # the router was empty: what the default never does
