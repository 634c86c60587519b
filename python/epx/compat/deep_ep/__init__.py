"""DeepEP's Python API on epx (see :mod:`epx.compat`): ``Buffer`` (normal mode),
``HybridEPBuffer``, ``Config``, and the event helpers of :mod:`deep_ep.utils`."""

from . import utils
from .buffer import Buffer, Config
from .hybrid import HybridEPBuffer
from .utils import EventHandle, EventOverlap

__epx_compat__ = True

__all__ = ["Buffer", "Config", "HybridEPBuffer", "EventHandle", "EventOverlap", "utils"]
