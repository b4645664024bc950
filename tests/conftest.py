"""Fixtures for every test under tests/: they live in kit.py, which the test modules also import
(as `kit`, a name no other conftest shadows) for the helpers."""

import os
import sys

# Tests import the patch set's modules straight from patches/ (and start Python subprocesses
# that do): bytecode written there would be an unlisted file the patch-set loader refuses.
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
sys.dont_write_bytecode = True

from kit import *  # noqa: E402,F401,F403  (pytest registers the fixtures it finds here)
