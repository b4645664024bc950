"""ddtree-ops: deploy the temperature-aware DDTree modules to SGLang hosts."""

__version__ = "0.1.0"
