"""Runs one process per rank (spawn) of a worker that reports (rank, "ok" | "error", payload)
on the queue it is given last; returns the payloads by rank, failing with every rank's error."""

import multiprocessing as mp
import random
import socket


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's default 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port the ranks' rendezvous can listen on. It is drawn below the ephemeral range: a port
    the kernel picked (bind to 0) can be taken by any outgoing connection, gloo's included,
    before the rendezvous listens on it (EADDRINUSE)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low // 2, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low // 2}, {low})")


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
