"""Test support (the serving path never imports this)."""

import importlib
import os


def triton_module(name: str, kernel: str):
    """Module ``name`` whose ``@triton.jit`` function ``kernel`` runs in Triton's interpreter when
    ``TRITON_INTERPRET=1``: a module imported before the variable was set holds compiled kernels,
    so it is reloaded once. Without the variable the module is returned as imported."""
    mod = importlib.import_module(name)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return mod
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(mod, kernel), InterpretedFunction):
        mod = importlib.reload(mod)
    return mod
