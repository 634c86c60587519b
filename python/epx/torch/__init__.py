"""PyTorch integration: tensors in, autograd through dispatch and combine, a Megatron-style
token dispatcher, and process-group bootstrap.

torch is imported when this module is (``import epx`` alone never imports it).

Tensors
    CPU tensors go to the CPU ('host') backend, CUDA tensors to the CUDA backend; every call
    first points the comm at ``torch.cuda.current_stream(device)`` (``epx_comm_set_stream``),
    so epx's work is ordered with the surrounding torch work and can be captured in a CUDA
    graph. :class:`epx.Handle` methods accept tensors directly (no autograd); the functions
    below add autograd.

Autograd
    :func:`dispatch` / :class:`DispatchFunction`: the gradient of dispatch is a combine of the
    gradients with the same handle (unweighted), and the weight gradients travel back to their
    top-k slots (``row_weight_grad`` -> ``topk_weight_grad``).
    :func:`combine` / :class:`CombineFunction`: the gradient of combine is a replay of the
    handle's dispatch (``epx_dispatch(comm, handle, NULL, ...)``) of the output gradient: in the
    expert layout the rows come back multiplied by their probabilities, and the probability
    gradient of a row is ``dot(y_row, grad_out_row)``.
    Backward passes are collectives too: every rank must run its backward (each on its own
    thread for a local world; :meth:`epx.World.run` does that). A handle must not be re-planned
    between a forward and its backward: the functions check ``handle.plan_id`` and raise.

:class:`FlexTokenDispatcher`
    Megatron-LM's six steps (``dispatch_preprocess``, ``token_dispatch``,
    ``dispatch_postprocess``, ``combine_preprocess``, ``token_combine``,
    ``combine_postprocess``) over epx's expert layout: the tokens come back grouped by local
    expert with ``tokens_per_expert`` for a grouped GEMM. One algorithm per mode ('ht' for
    training and prefill, 'll' for decode, or 'alltoall'); ``set_mode('decode')`` switches.
"""

from __future__ import annotations

from .autograd import CombineFunction, DispatchFunction, combine, dispatch
from .dispatcher import FlexTokenDispatcher
from .distributed import world_from_torch_distributed
from .frontend import _TORCH  # noqa: F401  (epx.arrays picks it for tensors)
from .routing import map_to_topk, topk_to_map

__all__ = [
    "dispatch", "combine", "DispatchFunction", "CombineFunction", "FlexTokenDispatcher", "map_to_topk",
    "topk_to_map", "world_from_torch_distributed",
]
