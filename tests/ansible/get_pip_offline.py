"""Stands in for pip's get-pip.py, which `ansible-test` fetches from ci-files.testing.ansible.com
(not reachable here) to put pip into the empty virtual environments of its sanity tests.

ansible-test runs this file as get-pip.py with get-pip's arguments (pip's install options, the
packages, and get-pip's own --no-setuptools / --no-wheel); the same result comes from the
interpreter's bundled pip (ensurepip) upgraded to the packages asked for, from the package index
pip is configured with. tests/test_ansible_collection.py places it in ansible-test's cache
(~/.ansible/test/cache/get_pip_<version>.py) when no bootstrap script is there yet."""

import subprocess
import sys

subprocess.check_call([sys.executable, "-m", "ensurepip", "--default-pip"], stdout=subprocess.DEVNULL)
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args]))
