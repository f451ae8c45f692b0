"""Test-only stand-in for Transformer Engine (see tests/te_standin/__init__.py for what it is and is not)."""
__version__ = "2.17.1"

from . import common, pytorch  # noqa: E402,F401  (te.common / te.pytorch are attribute-accessed by megatron-core)
