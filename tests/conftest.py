"""Fixtures for every test under tests/: they live in kit.py, which the test modules also import
(as `kit`, a name no other conftest shadows) for the helpers."""

from kit import *  # noqa: F401,F403  (pytest registers the fixtures it finds here)
