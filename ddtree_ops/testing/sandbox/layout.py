"""What a sandbox host is: the production paths it keeps, and its record in sandbox.json."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

SGLANG_VERSION = "0.5.23"
VENV_PATH = "/opt/venv_sglang"
PY_TAG = f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE_PACKAGES = f"{VENV_PATH}/lib/{PY_TAG}/site-packages"
DDTREE_UNIT = "sglang-k26-ddtree.service"
DFLASH_UNIT = "sglang-k26-dflash-cg.service"
SERVER_PORT = 30000
# What the units run on a sandbox host instead of sglang.launch_server.
STANDIN_MODULE = "ddtree_ops.testing.standin"
# The model folders the launch line names: they exist on every host (under /opt, which is the
# host's own), since preflight refuses a model_path the unit's user cannot read.
MODEL_PATH = "/opt/models/Kimi-K2.6"
DRAFT_MODEL_PATH = "/opt/models/Kimi-K2.6-DFlash"
# Where `write_secrets_config` puts a host's secrets_config (the YAML file SGLang's --config reads
# the API key from). Under /var/lib, which is the host's own; a real host would use /etc/sglang.
SECRETS_CONFIG = "/var/lib/sglang-secrets/ddtree-secrets.yaml"
# Inside a host: the sandbox's own files (sshd's config and key, the fake nvidia-smi, the GPU
# registry, the layers of the site-packages overlay), a folder of HOST_DIR bound in by nspawn.
SANDBOX_RUN = "/run/ddtree-sandbox"
# The host's sshd: a unit of its own (Debian's ssh.service is masked: it would read the machine's
# /etc/ssh and its host keys).
SSHD_UNIT = "ddtree-sandbox-sshd.service"


@dataclass
class SandboxHost:
    name: str
    subnet: int  # K in 10.200.K.0/24
    netns: str
    veth: str
    dir: str
    # systemd-nspawn, whose child is the container's PID 1 (real systemd).
    container_pid: int | None = None

    @property
    def address(self) -> str:
        return f"10.200.{self.subnet}.2"

    @property
    def gateway(self) -> str:
        return f"10.200.{self.subnet}.1"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SandboxHost:
        """From a sandbox.json entry; fields it no longer has (an older file's) are ignored, so
        `down` still cleans up a sandbox written by an earlier version."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
