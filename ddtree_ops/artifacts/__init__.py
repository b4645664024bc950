"""What is shipped: patch sets and their manifests, signed bundles with their manifest and the
signature policy, rendered systemd units, and the data files the package carries.

May import config and errors only.
"""
