"""The command line: parse, call, print. Commands (`commands`), the tables and the live view the
operator reads, the JSON and HTML reports.

May import every other room; nothing in the product imports it. The `sandbox` commands are not
here: the test rig plugs them in through the `ddtree_ops.cli_plugins` entry point.
"""
