"""Process groups: one rank of a ``torch.distributed`` group as an epx world."""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import _arg_error
from ..world import World


def world_from_torch_distributed(group=None, backend="auto", device: Optional[int] = None) -> World:
    """One rank of a ``torch.distributed`` group, bootstrapped through the group's allgather
    (``all_gather_into_tensor`` on NCCL groups, ``all_gather_object`` otherwise). Collective
    over the group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        _arg_error("torch.distributed is not initialised (call init_process_group first)")
    rank = dist.get_rank(group)
    n = dist.get_world_size(group)
    pg_backend = str(dist.get_backend(group)).lower()
    if device is None and str(backend) in ("cuda", "auto") and torch.cuda.is_available():
        device = torch.cuda.current_device()

    def allgather(mine: bytes):
        if "nccl" in pg_backend:
            dev = torch.device("cuda", torch.cuda.current_device())
            nb = len(mine)
            out = torch.empty(n * max(nb, 1), dtype=torch.uint8, device=dev)
            src = torch.zeros(max(nb, 1), dtype=torch.uint8, device=dev)
            if nb:
                src.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
            dist.all_gather_into_tensor(out, src, group=group)
            b = out.cpu().numpy().tobytes()
            step = max(nb, 1)
            return [b[i * step:i * step + nb] for i in range(n)]
        objs = [None] * n
        dist.all_gather_object(objs, bytes(mine), group=group)
        return objs

    return World.from_allgather(allgather, rank, n, backend=backend, device=device)
