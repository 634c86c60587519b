"""What calls return: :class:`HandleInfo`, :class:`NodeTraffic`, :class:`Layout` and
:class:`DispatchResult`."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass
class HandleInfo:
    """epx_handle_info_t plus tokens_per_local_expert [L] (int32, unpadded pair counts)."""

    num_send_tokens: int
    num_recv_tokens: int
    num_recv_rows: int
    num_recv_pairs: int
    num_sent_copies: int
    tokens_per_local_expert: np.ndarray


@dataclasses.dataclass
class NodeTraffic:
    """epx_node_traffic_t: bytes that crossed a node boundary into this rank in the handle's
    last dispatch and combine, next to one crossing per destination rank (docs/design.md,
    "Nodes"); all 0 on one node."""

    dispatch_bytes: int
    combine_bytes: int
    dispatch_bytes_per_rank: int
    combine_bytes_per_rank: int


@dataclasses.dataclass
class Layout:
    """Result of :meth:`Comm.layout`: tokens_per_rank [R], tokens_per_expert [E] (int32),
    is_token_in_rank [T, R] (bool)."""

    tokens_per_rank: Any
    tokens_per_expert: Any
    is_token_in_rank: Any


@dataclasses.dataclass
class DispatchResult:
    """What :meth:`Handle.dispatch` returns.

    recv_x
        token layout ``[N, H]`` (rows by source rank, then source token); expert layout
        ``[rows, H]`` grouped by local expert, each block padded to ``align``; low-latency
        ``[L, R * max_tokens_per_rank, H]``. In ``recv_dtype`` (fp8 as ``float8_e4m3fn`` or
        uint8 bits).
    recv_scales
        fp8 only: float32 ``[rows, ceil(H / 128)]`` (low-latency ``[L, R*M, blocks]``).
    recv_topk_idx, recv_topk_weights
        token layout only: ``[N, K]`` local expert ids (-1 for slots elsewhere) and weights.
    recv_probs
        expert layout / low-latency only: each row's weight (0 on padding).
    tokens_per_local_expert
        ``[L]`` int32, unpadded (token, expert) pair counts (for low-latency: rows used in
        each expert's block).
    num_rows
        rows written (padding included; low-latency: pairs), when known on the host.
    """

    recv_x: Any
    recv_scales: Any = None
    recv_topk_idx: Any = None
    recv_topk_weights: Any = None
    recv_probs: Any = None
    tokens_per_local_expert: Any = None
    num_rows: Optional[int] = None
    layout: str = "token"
    algo: str = "ht"
    align: int = 1

    def __iter__(self):  # recv_x, weights-or-probs, counts: handy for unpacking
        yield self.recv_x
        yield self.recv_topk_weights if self.layout == "token" else self.recv_probs
        yield self.tokens_per_local_expert

    @property
    def tokens_per_expert_padded(self):
        """Block sizes of the expert layout (counts rounded up to ``align``); numpy counts only."""
        c = np.asarray(self.tokens_per_local_expert).astype(np.int64)
        return (c + self.align - 1) // self.align * self.align
