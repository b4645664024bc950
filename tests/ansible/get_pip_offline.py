"""Stands in for pip's get-pip.py, which `ansible-test` fetches from ci-files.testing.ansible.com
(not reachable here) to put pip into the empty virtual environments of its sanity tests.

ansible-test runs this file as get-pip.py, in the new environment's interpreter, with get-pip's
arguments: pip's options, the packages (`pip==24.2`) and get-pip's own --no-setuptools /
--no-wheel. When the wheel of the pip asked for lies beside this file (scripts/setup-ansible-test
downloads it once from the package index), it is unpacked into the environment's site-packages,
which is what installing a pure-Python wheel amounts to and all ansible-test then runs (`python -m
pip`); about 20 times cheaper than the fallback, the interpreter's bundled pip (ensurepip)
upgraded to the packages asked for from the configured index. scripts/setup-ansible-test places
this file in ansible-test's cache (~/.ansible/test/cache/get_pip_<version>.py)."""

import os
import subprocess
import sys
import sysconfig
import zipfile

packages = [a for a in sys.argv[1:] if not a.startswith("-")]
here = os.path.dirname(os.path.abspath(__file__))
if len(packages) == 1 and packages[0].startswith("pip=="):
    wheel = os.path.join(here, "pip-%s-py3-none-any.whl" % packages[0][len("pip=="):])
    if os.path.isfile(wheel):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(sysconfig.get_paths()["purelib"])
        sys.exit(0)
subprocess.check_call([sys.executable, "-m", "ensurepip", "--default-pip"], stdout=subprocess.DEVNULL)
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args]))
