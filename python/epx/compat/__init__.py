"""Drop-in modules that let frameworks written for other expert-parallel libraries run on epx
unchanged.

``epx.compat.deep_ep`` offers DeepEP's Python API (``Buffer``, ``HybridEPBuffer``, ``Config``,
``EventHandle``, ``EventOverlap``) on epx's torch layer: Megatron-LM's flex token dispatcher
(``deepep`` and ``hybridep`` backends) and NeMo Automodel reach it through ``import deep_ep``.
:func:`install` makes that import resolve here; call it before the framework imports deep_ep
(Megatron looks for it once, when ``megatron.core.transformer.moe.fused_a2a`` is imported).
"""

import importlib.util
import sys

__all__ = ["install", "uninstall", "installed"]

_NAMES = ("deep_ep", "deep_ep.utils")


def installed() -> bool:
    """Whether ``import deep_ep`` resolves to epx's module now."""
    mod = sys.modules.get("deep_ep")
    return mod is not None and getattr(mod, "__epx_compat__", False)


def _real_deep_ep_origin():
    """Where a real deep_ep would be imported from, or None when there is none."""
    if "deep_ep" in sys.modules and not installed():
        return getattr(sys.modules["deep_ep"], "__file__", None) or "an already imported module"
    try:
        spec = importlib.util.find_spec("deep_ep")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or "a namespace package"


def install(force: bool = False):
    """Makes ``import deep_ep`` (and ``deep_ep.utils``) resolve to :mod:`epx.compat.deep_ep`;
    returns that module.

    Refuses (RuntimeError) when a real deep_ep is importable, so a machine that has DeepEP does
    not silently run on something else; ``force=True`` shadows it for this process. Call it
    before the framework imports deep_ep."""
    from . import deep_ep as mod
    from .deep_ep import utils

    if installed():
        return mod
    origin = _real_deep_ep_origin()
    if origin is not None and not force:
        raise RuntimeError(
            f"a real deep_ep is installed ({origin}); epx.compat.install() would shadow it. "
            "Uninstall it, or call epx.compat.install(force=True) to run this process on epx instead")
    sys.modules["deep_ep"] = mod
    sys.modules["deep_ep.utils"] = utils
    return mod


def uninstall() -> None:
    """Undoes :func:`install` (modules that already imported names from deep_ep keep them)."""
    if installed():
        for n in _NAMES:
            sys.modules.pop(n, None)
