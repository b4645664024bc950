"""What is shipped: patch sets, signed bundles, rendered systemd units, and the data files the
package carries.

May import config and errors only.
"""
