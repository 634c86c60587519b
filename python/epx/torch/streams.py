"""The CUDA side of :meth:`epx.World.run`: each rank thread's device and torch stream, and where
ranks share a GPU, torch's first-use work done on every rank's stream before any rank starts.

:mod:`epx.world` knows nothing of torch: it calls :func:`on_rank_streams` (and, to place ranks
and to see whether CUDA has started, :func:`device_count` and :func:`cuda_started`) through a
hook when a world is on the CUDA backend, whose arrays from Python are torch tensors.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from .._lib import Status
from ..errors import _raise


def device_count() -> int:
    """The CUDA devices this process sees (0 without CUDA); creates no CUDA context."""
    return torch.cuda.device_count()


def cuda_started() -> bool:
    """True once torch has started CUDA in this process (environment settings that CUDA reads
    when it starts cannot take effect any more)."""
    return torch.cuda.is_initialized()


def _rank_streams(world, streams: Optional[Sequence[Any]]) -> dict:
    """The stream of every rank the world drives: the caller's, or one the world keeps per rank."""
    ranks = world.ranks
    if streams is None:
        kept = world.__dict__.setdefault("_torch_streams", {})
        for r in ranks:
            if r not in kept:
                kept[r] = torch.cuda.Stream(torch.device("cuda", world.device_of(r)))
        streams = [kept[r] for r in ranks]
    elif len(streams) != len(ranks):
        raise ValueError(f"World.run: {len(streams)} streams for the {len(ranks)} ranks this process drives")
    return dict(zip(ranks, streams))


def on_rank_streams(world, fn: Callable[..., Any], streams: Optional[Sequence[Any]]) -> Callable[..., Any]:
    """``fn`` wrapped so that each rank thread gets its device and its stream: ranks that shared
    one stream would queue behind each other's kernels, which wait on each other. Where ranks
    share a GPU, torch's first-use work is done on each stream first (see :func:`prepare`),
    every rank's before any rank runs ``fn``."""
    ranks = world.ranks
    stream_of = _rank_streams(world, streams)
    prepared = world.__dict__.setdefault("_torch_prepared", set())  # stream handles; torch caches per stream
    todo = [r for r in ranks if world.shares_device(r) and stream_of[r].cuda_stream not in prepared]
    ready = threading.Barrier(len(ranks)) if todo and len(ranks) > 1 else None

    try:  # the bound of every wait, as libepx reads it
        wait_s = int(os.environ.get("EPX_TIMEOUT_MS") or 30000) / 1000.0
    except ValueError:
        wait_s = 30.0

    def body(rank, *args, **kwargs):
        dev = torch.device("cuda", world.device_of(rank))
        stream = stream_of[rank]
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            try:
                if rank in todo:
                    prepare(dev, stream)
                    prepared.add(stream.cuda_stream)
                if ready is not None:
                    ready.wait(wait_s)
            except threading.BrokenBarrierError:
                raise
            except BaseException:
                if ready is not None:
                    ready.abort()  # the other ranks stop waiting for this one
                raise
            return fn(rank, *args, **kwargs)
    return body


_PINNED_SIZES = 21  # page-locked block sizes prepare leaves in torch's host cache: 1 B to 1 MiB


def prepare(dev, stream) -> None:
    """Does torch's first-use work for this rank before its first collective, while no rank is
    inside one: fills torch's caching allocator for the rank's stream, and runs one backward
    pass there.
    CUDA serialises streams around a device memory allocation (cudaMalloc is one of the
    "implicit synchronization" operations of the CUDA programming guide): work issued after it
    does not start until work issued before it finishes. When ranks share a GPU, a peer's
    kernel issued before it may be waiting for this rank's, issued after: the group stalls
    until the timeout. torch calls cudaMalloc whenever its cache for a stream runs short, so
    each rank's cache is filled here, once per stream (torch caches per stream: memory on a
    stream not prepared here comes from cudaMalloc), while no rank is inside a collective. Size:
    EPX_TORCH_RESERVE_MB (default 128) in one large block and a sixteenth of it in small ones.
    The backward pass starts torch's autograd thread for the GPU: a model's first backward,
    run while peers were inside a collective, stalled the group until the timeout on an H200
    (the step inside torch that does it was not isolated; done here, it is out of the way).
    A copy each way between pageable host memory and the GPU makes the driver set up its
    pinned staging memory now: a page-locked allocation is an implicit synchronization too.
    torch reads a CUDA tensor's value to the host (``.item()``, ``int(t)``, ``bool(t)``) through
    a page-locked block from its host cache, allocating one (cudaHostAlloc) where none of that
    size is free, and a process's first page-locked allocation waited for a kernel running on
    another stream (torch 2.11 on an H100, bench/RESULTS.md 2026-12-06; later ones did not).
    Each rank leaves two blocks of every size up to 1 MiB there, so the first is made here and
    a rank's reads then allocate nothing (EPX_TORCH_RESERVE_MB = 0 leaves none either)."""
    mb = int(os.environ.get("EPX_TORCH_RESERVE_MB", "128"))
    if mb > 0:
        try:
            big = torch.empty(mb << 20, dtype=torch.uint8, device=dev)
            small = [torch.empty(1 << 20, dtype=torch.uint8, device=dev) for _ in range(max(mb // 16, 1))]
        except torch.cuda.OutOfMemoryError as e:
            _raise(Status.OUT_OF_MEMORY, f"reserving torch memory for a rank that shares {dev} ({mb} MiB, "
                                         f"EPX_TORCH_RESERVE_MB; 0 reserves none): {e}")
        del big, small
        held = [torch.empty(1 << i, dtype=torch.uint8, pin_memory=True) for i in range(_PINNED_SIZES) for _ in range(2)]
        del held
    w = torch.ones(8, device=dev, requires_grad=True)
    (w * 2).sum().backward()
    torch.ones(1 << 20, dtype=torch.uint8).to(dev).cpu()
    stream.synchronize()
