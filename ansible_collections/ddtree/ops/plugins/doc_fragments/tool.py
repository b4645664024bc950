# Copyright: ddtree-ops developers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""What every ddtree.ops action shares in its documentation."""

from __future__ import annotations


class ModuleDocFragment(object):
    DOCUMENTATION = r"""
options: {}
attributes:
  platform:
    support: full
    platforms: posix
    description: The host is reached over the tool's own SSH session; the task runs on the controller.
requirements:
  - ddtree-ops installed in the controller's Python (the execution environment)
notes:
  - The host's connection and settings are its Ansible variables - C(ansible_host), C(ansible_port),
    C(ansible_user), C(ansible_ssh_private_key_file), C(ansible_python_interpreter) and the ddtree-ops inventory
    keys; other variables are ignored. Host keys are verified against C(known_hosts).
author:
  - ddtree-ops developers (@ddtree-ops)
"""

    # Actions that change no host: check mode runs them as they are, and they show no diff.
    READ_ONLY = r"""
options: {}
attributes:
  check_mode:
    support: full
    description: Can run in check mode and return changed status prediction without modifying the host.
  diff_mode:
    support: none
    description: Returns no diff.
"""
