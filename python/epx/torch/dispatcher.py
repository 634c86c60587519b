"""Megatron-LM's flex token dispatcher over epx's expert layout."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from ..collective import _Collective
from ..comm import Comm
from ..config import _parse_algo
from ..errors import UnsupportedError, _arg_error, _shape_error
from ..handle import Handle
from .autograd import combine, dispatch
from .routing import map_to_topk


_MODES = ("train", "prefill", "decode")


class FlexTokenDispatcher:
    """Megatron-LM's flex token dispatcher over epx.

    ``comm``: this rank's :class:`epx.Comm`. ``algos``: the algorithm per mode, default
    ``{'train': 'ht', 'prefill': 'ht', 'decode': 'll'}``. ``align``: pad each local expert's
    block to a multiple of ``align`` rows (e.g. 16 or 128 for fp8 grouped GEMMs; HT only).
    ``apply_probs_in_combine``: False (Megatron's convention) hands the per-row probabilities
    to the experts and combines unweighted; True multiplies in combine instead (as DeepEP's
    low-latency combine does).

    Per forward::

        x, probs = d.dispatch_preprocess(hidden_states, routing_map, probs)   # or topk_idx=, topk_weights=
        x, probs = d.token_dispatch(x, probs)
        x, tokens_per_expert, probs = d.dispatch_postprocess(x, probs)
        y = experts(x, tokens_per_expert, probs)                              # grouped GEMM
        y = d.combine_preprocess(y)
        y = d.token_combine(y)
        out = d.combine_postprocess(y)

    HT modes return ``x`` as ``[rows, H]`` rows grouped by local expert (padding rows zero,
    their prob 0) and ``tokens_per_expert`` as a CPU int64 tensor of block sizes (counts padded
    to ``align``; ``num_tokens_per_expert`` keeps the unpadded counts). Decode ('ll') returns
    the fixed buffers ``[L, R * max_tokens_per_rank, H]`` and the counts as a device tensor
    (no host sync, CUDA-graph capturable): use a masked grouped GEMM over the first
    ``tokens_per_expert[l]`` rows of each block.

    One dispatcher per MoE layer: its handles hold the plan that both backward passes reuse.
    """

    def __init__(self, comm: Comm, *, algos: Optional[Dict[str, str]] = None, mode: str = "train", align: int = 1,
                 apply_probs_in_combine: bool = False, recv_dtype=None, exact: bool = True):
        self.comm = comm
        self.algos = {"train": "ht", "prefill": "ht", "decode": "ll"}
        if algos:
            for k, v in algos.items():
                self.set_algo(k, v)
        self.align = int(align)
        self.apply_probs_in_combine = bool(apply_probs_in_combine)
        self.recv_dtype = recv_dtype
        self.exact = exact
        self._handles: Dict[str, Handle] = {}
        self.mode = None
        self.set_mode(mode)
        self._reset()

    # -- configuration -------------------------------------------------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.comm.num_local_experts

    @property
    def local_expert_ids(self):
        """Global ids of this rank's experts, in local order."""
        L = self.num_local_experts
        return list(range(self.comm.rank * L, (self.comm.rank + 1) * L))

    def set_algo(self, mode: str, algo: str) -> None:
        if mode not in _MODES:
            _arg_error(f"unknown mode {mode!r}: use one of {_MODES}")
        _parse_algo(algo)
        self.algos[mode] = algo

    def set_mode(self, mode: str) -> "FlexTokenDispatcher":
        """'train' / 'prefill' / 'decode': picks the algorithm (and handle) for what follows."""
        if mode not in _MODES:
            _arg_error(f"unknown mode {mode!r}: use one of {_MODES}")
        self.mode = mode
        return self

    @property
    def algo(self) -> str:
        return self.algos[self.mode]

    @property
    def handle(self) -> Handle:
        """The handle of the current algorithm (created on first use, kept)."""
        algo = self.algo
        h = self._handles.get(algo)
        if h is None:
            h = self.comm.handle(algo, "expert", align=1 if algo == "ll" else self.align, exact=self.exact)
            self._handles[algo] = h
        return h

    def _reset(self):
        self.hidden_shape = None
        self._idx = self._weights = None
        self._recv_probs = None
        self._counts = None
        self.num_tokens_per_expert = None

    # -- the six steps ---------------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: Optional[torch.Tensor] = None,
                            probs: Optional[torch.Tensor] = None, *, topk_idx=None, topk_weights=None):
        """Flattens ``hidden_states [..., H]`` to ``[T, H]`` and takes the routing: a multi-hot
        ``routing_map [T, E]`` with ``probs [T, E]`` (Megatron) or ``topk_idx [T, K]`` with
        ``topk_weights [T, K]`` (DeepEP). Returns ``(hidden_states, topk_weights)``."""
        H = self.comm.hidden
        if hidden_states.shape[-1] != H:
            _shape_error(f"hidden_states has hidden size {hidden_states.shape[-1]}, the comm's is {H}")
        self._reset()
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, H)
        if routing_map is not None:
            if topk_idx is not None:
                _arg_error("pass routing_map (+ probs) or topk_idx (+ topk_weights), not both")
            idx, w = map_to_topk(routing_map, probs, self.comm.topk)
        elif topk_idx is not None:
            if probs is not None:
                _arg_error("probs goes with routing_map; with topk_idx pass topk_weights")
            idx = topk_idx
            w = topk_weights.float() if topk_weights is not None else (topk_idx >= 0).float()
        else:
            _arg_error("a routing is required: routing_map (+ probs) or topk_idx (+ topk_weights)")
        if idx.shape[0] != x.shape[0]:
            _shape_error(f"the routing has {idx.shape[0]} tokens, hidden_states {x.shape[0]}")
        self._idx, self._weights = idx, w
        return x, w

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, async_finish: bool = True,
                       allocate_on_comm_stream: bool = True):
        """The exchange: returns ``(rows grouped by local expert, per-row probs)``. (Megatron's
        ``async_finish`` / ``allocate_on_comm_stream`` are accepted and ignored: epx's work is
        always ordered on the caller's current stream.)"""
        h = self.handle
        with _Collective(self.comm, h._dispatch_refusal(True, False)):  # epx.collective
            if self._idx is None:
                _arg_error("call dispatch_preprocess first")
            res = dispatch(h, hidden_states, self._idx, probs, recv_dtype=self.recv_dtype)
        self._counts = res.tokens_per_local_expert
        self._recv_probs = res.recv_probs
        self._result = res
        return res.recv_x, res.recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Returns ``(hidden_states, tokens_per_expert, probs)`` for the grouped GEMM."""
        h = self.handle
        if h.algo == "ll":
            self.num_tokens_per_expert = self._counts
            return hidden_states, self._counts, probs
        counts = self._counts.long()
        if counts.device.type != "cpu":
            try:  # the host knows the counts (exact mode): no device read-back
                counts = torch.from_numpy(h.info().tokens_per_local_expert.astype(np.int64))
            except UnsupportedError:  # sync-free: stay on the device
                pass
        self.num_tokens_per_expert = counts
        padded = (counts + self.align - 1) // self.align * self.align
        return hidden_states, padded, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Identity: the expert outputs are already in the layout combine takes."""
        if hidden_states.shape[-1] != self.comm.hidden:
            _shape_error(f"expert output has hidden size {hidden_states.shape[-1]}, the comm's is {self.comm.hidden}")
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True) -> torch.Tensor:
        """The exchange back: ``[T, H]`` (weighted by the probs if ``apply_probs_in_combine``)."""
        if self.apply_probs_in_combine:
            p = self._recv_probs if (torch.is_grad_enabled() and self._recv_probs is not None
                                     and self._recv_probs.requires_grad) else None
            return combine(self.handle, hidden_states, p, weighted=True)
        return combine(self.handle, hidden_states, None, weighted=False)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.reshape(self.hidden_shape)

    # -- conveniences ------------------------------------------------------------------------
    def dispatch(self, hidden_states, routing_map=None, probs=None, *, topk_idx=None, topk_weights=None):
        """Steps 1-3: returns ``(x, tokens_per_expert, probs)``."""
        x, p = self.dispatch_preprocess(hidden_states, routing_map, probs, topk_idx=topk_idx, topk_weights=topk_weights)
        x, p = self.token_dispatch(x, p)
        return self.dispatch_postprocess(x, p)

    def combine(self, expert_output):
        """Steps 4-6."""
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(expert_output)))

    def close(self):
        for h in self._handles.values():
            h.close()
        self._handles.clear()
