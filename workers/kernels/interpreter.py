"""Triton's interpreter for CPU tensors: how tests and the benchmark's dry run turn it on.

TRITON_INTERPRET=1 must be set before triton's first import, since triton.language builds its
own jit helpers (tl.sum, tl.cdiv, ...) at import; `enable()` does that or refuses. `fix_index()`
applies upstream's fix for triton-lang/triton#9171 (merged after 3.6): the interpreter turns a
loaded scalar, a 1-element array, into an int with int(), which numpy >= 2.4 rejects, so a loop
bounded by a value read in the kernel fails. Why here: one place, used by whoever interprets.
"""

import os
import sys

_fixed = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def enable() -> None:
    """Run every Triton kernel of this process through the interpreter (CPU tensors)."""
    if "triton" in sys.modules and not interpreting():
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1: its jit helpers are compiled ones")
    os.environ["TRITON_INTERPRET"] = "1"
    fix_index()


def fix_index() -> None:
    """Make the interpreter's tensor.__index__ accept 1-element arrays (idempotent)."""
    global _fixed
    from triton.runtime import interpreter

    if _fixed or not hasattr(interpreter, "_patch_lang_tensor"):
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    _fixed = True
