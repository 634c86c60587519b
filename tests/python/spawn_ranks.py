"""Runs one process per rank (spawn) of a worker that reports (rank, "ok" | "error", payload)
on the queue it is given last; returns the payloads by rank, failing with every rank's error."""

import multiprocessing as mp
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, args_per_rank, timeout=240):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=tuple(args) + (q,)) for args in args_per_rank]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, status, payload = q.get(timeout=timeout)
            results[rank] = (status, payload)
            if status != "ok":
                break
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == len(procs) else 1)
            if p.is_alive():
                p.kill()
    errors = {r: v[1] for r, v in results.items() if v[0] != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    assert len(results) == len(procs), f"only ranks {sorted(results)} reported"
    return {r: v[1] for r, v in results.items()}
