"""Which host calls wait for a kernel on another stream: one stream runs a kernel of about 0.7 s
(torch.cuda._sleep) while another thread, on another stream, makes a call; prints the call's
host time and the kernel's time left after it. A call that waited for the kernel takes its
whole time, and leaves none of it. Ranks that share a GPU must not make such a call while a
peer waits for them inside a collective (epx.torch.streams.prepare). Needs a CUDA GPU:
    python3 tools/host_waits.py
"""
import threading
import time

import torch


def timed(label, call, before=None, cycles=int(1.5e9)):
    spin, other = torch.cuda.Stream(), torch.cuda.Stream()
    if before:
        before()
    torch.cuda.synchronize()
    with torch.cuda.stream(spin):
        torch.cuda._sleep(cycles)
    time.sleep(0.05)  # the kernel is running
    took = {}

    def body():
        with torch.cuda.stream(other):
            t = time.perf_counter()
            call()
            took["s"] = time.perf_counter() - t

    th = threading.Thread(target=body)
    th.start()
    th.join()
    t = time.perf_counter()
    torch.cuda.synchronize()
    left = time.perf_counter() - t
    print(f"{label}: {took['s'] * 1e3:.1f} ms, kernel left after it {left * 1e3:.1f} ms", flush=True)


def main():
    torch.cuda.init()
    x = torch.ones(4, device="cuda")
    y = torch.ones(4, device="cuda", dtype=torch.int64)
    torch.cuda.synchronize()
    print("torch", torch.__version__, torch.cuda.get_device_name())
    timed("the process's first .item()", lambda: y.sum().item())
    timed(".item() again", lambda: y.sum().item())
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host:
        timed(".item() after emptying torch's host cache", lambda: y.sum().item(), empty_host)
    timed("page-locked tensor of 3 B (a new size)", lambda: torch.empty(3, dtype=torch.int8, pin_memory=True))
    timed("page-locked tensor of 1 MB", lambda: torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True))
    timed(".cpu() of 4 bytes (pageable)", lambda: x[:1].cpu())
    timed("64 MB on the device after empty_cache", lambda: torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
          torch.cuda.empty_cache)
    timed("64 MB on the device, cached", lambda: torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    timed("sort of [256, 64] int64", lambda: torch.randint(0, 64, (256, 64), device="cuda").sort(dim=1))


if __name__ == "__main__":
    main()
