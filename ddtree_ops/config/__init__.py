"""What the operator writes: the inventory and its schema, YAML loading with line numbers, the
settings of every gate, and the redaction of secrets.

May import errors only: reading a file never pulls in SSH or HTTP.
"""
