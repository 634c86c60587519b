"""What a world on the CUDA backend needs beyond the numpy core: the torch layer's CUDA side,
reached through one hook, and the environment that ranks sharing a GPU need.

Ranks of one process that share a GPU run kernels that wait on each other, so

* no rank's stream may queue behind another's in one hardware queue:
  ``CUDA_DEVICE_MAX_CONNECTIONS=32`` asks CUDA for as many queues as it has (the default is 8);
* no kernel's first launch may wait for the device to go idle, which never happens while peer
  ranks' kernels wait on it: lazy module loading (torch asks for it when it starts CUDA) can do
  that, so ``CUDA_MODULE_LOADING=EAGER``.

CUDA reads both when it starts in the process. They are set (where unset: a value the user set
is kept) when a local :class:`epx.World` whose ranks share a GPU is created, before anything
there can start CUDA, and for no other world: a GPU per rank needs neither, and a framework may
insist on its own values (Megatron-LM asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in its
processes, one per GPU). ``import epx`` sets nothing. If torch started CUDA before such a world
is created, the settings cannot take effect any more: a warning says so.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Dict, Optional, Sequence

from ._lib import Backend
from .config import backend_available

SHARED_GPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "CUDA_MODULE_LOADING": "EAGER"}


def cuda_layer():
    """The CUDA side of a world driven from Python (rank threads' devices and streams, the GPU
    count): :mod:`epx.torch.streams`, since CUDA arrays from Python are torch tensors. Imported
    on first use, so that numpy users never import torch."""
    from .torch import streams

    return streams


def _gpu_count() -> Optional[int]:
    """The GPUs this process sees, or None when that cannot be told without torch."""
    try:
        return cuda_layer().device_count()
    except ImportError:
        return None


def _torch_started_cuda() -> bool:
    # torch starts CUDA only once imported: ask it only then (importing it here would make a
    # numpy user pay for the import)
    return "torch" in sys.modules and cuda_layer().cuda_started()


def _ranks_share_gpu(nranks: int, devices: Optional[Sequence[int]]) -> bool:
    """Whether a CUDA world of ``nranks`` ranks on ``devices`` (None: rank r on device r % count,
    as libepx places them) puts two ranks on one GPU. May start the CUDA driver (not a context)."""
    if not backend_available("cuda"):  # 'auto' becomes the host backend; 'cuda' fails anyway
        return False
    if devices is not None:
        return len(set(int(d) for d in devices)) < len(devices)
    count = _gpu_count()
    return count is None or nranks > count


def prepare_shared_gpu(nranks: int, backend: Backend, devices: Optional[Sequence[int]]) -> Dict[str, str]:
    """Called before a local world is created: when its ranks share a GPU, sets the variables
    of SHARED_GPU_ENV that are unset. Returns those it set."""
    if nranks < 2 or backend == Backend.HOST:
        return {}
    if devices is not None and len(set(int(d) for d in devices)) == len(devices):
        return {}  # a GPU per rank
    missing = {k: v for k, v in SHARED_GPU_ENV.items() if k not in os.environ}
    started = _torch_started_cuda()
    if started and os.environ.get("CUDA_MODULE_LOADING") == "LAZY":
        missing["CUDA_MODULE_LOADING"] = "EAGER"  # what torch sets when it starts CUDA, if unset
    if not missing:
        return {}
    if not started:
        os.environ.update(missing)  # first: telling whether ranks share a GPU may start CUDA
    shared = _ranks_share_gpu(nranks, devices)
    if shared and not started:
        return missing
    if not started:
        for k in missing:
            del os.environ[k]
    if shared:
        settings = " ".join(f"{k}={v}" for k, v in missing.items())
        warnings.warn(f"epx: ranks of this world share a GPU, which needs {settings} before CUDA starts, but "
                      "torch started CUDA in this process first, so they cannot take effect: the ranks may "
                      "stall until the timeout. Set them in the environment before CUDA starts, or create the "
                      "world before the first CUDA tensor or stream.", RuntimeWarning, stacklevel=3)
    return {}
