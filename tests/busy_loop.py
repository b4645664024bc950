"""One busy loop (tests/kit.py `busy_loops`, `scripts/test --stress`): spins on a core until it is
ended by its PID, or until the process that started it is gone (a killed pytest worker, a killed
scripts/test): it then has another parent, looked at every million turns (a few tens of ms), so no
loop outlives its owner."""

import os

parent = os.getppid()
n = 0
while True:
    n += 1
    if n == 1_000_000:
        if os.getppid() != parent:
            break
        n = 0
