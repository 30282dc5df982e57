"""Triton kernels of zerofuse (installed as ``zerofuse.kernels``): @triton.jit functions and launchers.

Interpreter mode: ``ZEROFUSE_TRITON_ON_CPU=1`` sets ``TRITON_INTERPRET=1`` here, before any kernel
module is imported (triton reads it when a function is decorated), and makes the ops route CPU
tensors through these kernels, so CPU-only CI runs the real kernels. This package is imported by
``zerofuse/__init__.py`` before anything that defines a kernel.

When triton was imported first without ``TRITON_INTERPRET=1``, triton.language's own @jit
functions (tl.sum, tl.max, tl.cdiv, ...) were decorated for compilation, and an interpreted kernel
that calls one fails with "Cannot call @triton.jit'd outside of the scope of a kernel".
:func:`_interpret_triton_language` re-decorates them as the interpreter would have.
"""
import os
import sys

from zerofuse.kernels.env import flag as _flag  # noqa: E402

TRITON_ON_CPU = _flag("ZEROFUSE_TRITON_ON_CPU", False, "CPU tensors through the Triton kernels (interpreter)",
                      "CPU tensors through the C++/torch CPU kernels")


def _interpret_triton_language() -> None:
    """Turn the @triton.jit functions that triton.language defined at its import into interpreted
    ones (the objects triton makes when TRITON_INTERPRET=1 is set before its import): in the
    triton.language modules and as the tensor methods triton attaches (x.sum(), x.max(), ...).
    Raises ImportError, saying what to set, if this triton's internals do not allow it."""
    if "triton.language" not in sys.modules:
        return  # triton not imported yet: its import will see TRITON_INTERPRET
    try:
        _reinterpret_loaded_language()
    except Exception as e:
        raise ImportError(
            "ZEROFUSE_TRITON_ON_CPU=1: triton was imported before zerofuse without TRITON_INTERPRET=1, and its "
            f"library functions could not be switched to the interpreter ({type(e).__name__}: {e}); set "
            "TRITON_INTERPRET=1 in the environment as well, or import zerofuse before triton") from e


def _reinterpret_loaded_language() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    import triton.language as tl

    converted: dict[int, InterpretedFunction] = {}

    def interpreted(f: JITFunction) -> InterpretedFunction:
        if id(f) not in converted:
            converted[id(f)] = InterpretedFunction(
                f.fn, version=f.version, do_not_specialize=f.do_not_specialize,
                do_not_specialize_on_alignment=f.do_not_specialize_on_alignment, debug=f.debug,
                noinline=f.noinline, repr=f._repr, launch_metadata=f.launch_metadata)
        return converted[id(f)]

    for name, module in list(sys.modules.items()):
        if module is not None and (name == "triton.language" or name.startswith("triton.language.")):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, interpreted(value))
    for attr, value in list(vars(tl.core.tensor).items()):
        if isinstance(value, JITFunction):
            # as triton's _tensor_member_fn attaches a non-JIT function: a plain forwarding method
            setattr(tl.core.tensor, attr, _member(interpreted(value)))


def _interpret_knob() -> bool:
    """Whether triton interprets @triton.jit functions decorated now (TRITON_INTERPRET, read as triton does)."""
    import triton  # noqa: PLC0415

    return bool(triton.knobs.runtime.interpret)


def _member(fn):
    def method(*args, **kwargs):
        return fn(*args, **kwargs)

    method.__name__ = fn.__name__
    return method


if TRITON_ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"
    _interpret_triton_language()


def triton_on_cpu() -> bool:
    """Whether ops send CPU tensors through the Triton kernels (in the interpreter)."""
    return TRITON_ON_CPU


# Read once: triton reads TRITON_INTERPRET when a function is decorated, which is at import; as
# triton reads it (its knob: "1", "true", "on", "yes"; only "1" counted here before, so with
# TRITON_INTERPRET=true the kernels ran interpreted while zerofuse took them for compiled ones)
_INTERPRETED = _interpret_knob()


def interpreted() -> bool:
    """Whether @triton.jit functions run in the interpreter in this process."""
    return _INTERPRETED
