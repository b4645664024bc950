"""Local test hosts that behave like CT200, without a GPU.

Each sandbox host is a container with real systemd 252 as its PID 1 (systemd-nspawn, see
container.py) in a network namespace of its own (10.200.K.2), where the production paths exist
unchanged, bound to the host's own folders:

    /etc/systemd/system   → DIR/hosts/NAME/etc-systemd-system   (units)
    /var/log, /var/lib    → per-host folders (journald's journal, the ddtree-ops state dir)
    /opt                  → per-host folder holding /opt/venv_sglang, a real venv whose
                            site-packages has the real sglang 0.5.23 files and dist-info
                            (an overlay mount unit: the cached wheel tree below, the host's
                            changes above)
    /etc                  → the machine's /etc below, the host's own above (machine id, its sshd
                            unit and the site-packages mount in /etc/systemd/system.control)
    /run/ddtree-sandbox   → sshd's key and config, the fake nvidia-smi, the GPU registry

Debian's sshd runs as a unit (own ed25519 host key; root login by a generated key only). The host
starts in the state before a DDTree deploy: upstream files only, the DFlash unit active, the
DDTree unit file present at its old settings (budget 7, topk cap 1) and stopped. `down` halts each
container and ends whatever is left in the host's namespace by PID, deletes the namespaces and
leaves no mount behind.

Modules, by concern:

    prerequisites  what the machine needs (root, iproute2, sshd, systemd-nspawn)
    wheelcache     the real sglang 0.5.23 wheel, extracted once; where the cache lives
    namespaces     network namespaces, subnets, the mounts around them
    hostfiles      each host's files and the sandbox inventory; `write_secrets_config` provisions
                   a host's 0600 secrets_config (the API key SGLang reads with --config), as an
                   operator would: the default inventory does not use one
    container      the systemd-nspawn command line, boot, halt, a command run inside a host
    processes      a host's processes: found by namespace, ended by PID, waited for
    smg            `up --router`: a real smg router on loopback in front of the hosts' servers, its
                   control-plane key in DIR/router.key (0600); the inventory names ROUTER_KEY_ENV
    lifecycle      `Sandbox`: up, status, reset_host (in place), inside, stop_sshd/start_sshd, down
"""

from __future__ import annotations

from .errors import SandboxError
from .hostfiles import inventory_doc, multinode_inventory, write_secrets_config
from .layout import (
    DDTREE_UNIT,
    DFLASH_UNIT,
    SECRETS_CONFIG,
    SERVER_PORT,
    SGLANG_VERSION,
    SITE_PACKAGES,
    STANDIN_MODULE,
    VENV_PATH,
    SandboxHost,
)
from .lifecycle import Sandbox
from .prerequisites import SSHD, missing_prerequisites
from .processes import _kill_namespace_processes, _namespace_pids
from .smg import ROUTER_KEY_ENV
from .wheelcache import cache_dir, sglang_site_tree

__all__ = [
    "DDTREE_UNIT", "DFLASH_UNIT", "ROUTER_KEY_ENV", "SECRETS_CONFIG", "SERVER_PORT", "SGLANG_VERSION",
    "SITE_PACKAGES", "SSHD",
    "STANDIN_MODULE", "VENV_PATH", "Sandbox", "SandboxError", "SandboxHost", "_kill_namespace_processes",
    "_namespace_pids", "cache_dir", "inventory_doc", "missing_prerequisites", "multinode_inventory",
    "sglang_site_tree", "write_secrets_config",
]
