"""Inference with one MoE layer on an emulated expert-parallel group: prefill with the
high-throughput path ('ht', exact sizes, tokens grouped per expert), then decode steps with the
low-latency path ('ll', fixed shapes, no host sync). With a GPU and epx's CUDA backend the
ranks share GPU 0 and each rank's decode step is captured once in a CUDA graph and replayed
with new tokens; otherwise the same code runs on the CPU backend in a plain loop.

    python examples/prefill_decode.py [--ranks 4] [--prompt 64] [--steps 8] [--num-sms 4]
"""

import argparse
import threading
import time

import torch

import epx
import epx.torch as et

p = argparse.ArgumentParser()
p.add_argument("--ranks", type=int, default=4)
p.add_argument("--experts", type=int, default=16)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--topk", type=int, default=4)
p.add_argument("--prompt", type=int, default=64, help="prefill tokens per rank")
p.add_argument("--batch", type=int, default=8, help="decode tokens per rank per step")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--num-sms", type=int, default=4,
               help="SM budget of each rank's epx kernels (the ranks share one GPU: see below)")
p.add_argument("--cpu", action="store_true", help="use the CPU backend even with a GPU")
a = p.parse_args()
R, E, H, K = a.ranks, a.experts, a.hidden, a.topk
L = E // R
cuda = not a.cpu and torch.cuda.is_available() and epx.backend_available("cuda")
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
# Before the first CUDA tensor: a world whose ranks share a GPU makes the settings CUDA needs for
# them (CUDA_DEVICE_MAX_CONNECTIONS, CUDA_MODULE_LOADING) while CUDA has not started yet.
world = epx.World(R, backend="cuda" if cuda else "host", devices=[0] * R if cuda else None)
dtype = torch.bfloat16 if cuda else torch.float32
torch.manual_seed(0)
router = (torch.randn(H, E) * 0.05).to(dev)
experts = (torch.randn(E, H, H) / H ** 0.5).to(dev, dtype)  # expert e: y = x @ experts[e]
barrier = threading.Barrier(R)
capture = threading.Lock()  # torch's graph capture syncs the device on entry: one rank at a time


def moe(disp, x):
    """One MoE layer through the dispatcher (works in both modes, no host sync in 'll')."""
    probs = torch.softmax(x.float() @ router, dim=-1)
    w, idx = probs.topk(K, dim=-1)
    xs, tokens_per_expert, _ = disp.dispatch(x, topk_idx=idx, topk_weights=w)
    mine = experts[disp.local_expert_ids[0]:disp.local_expert_ids[-1] + 1]
    if disp.algo == "ll":  # [L, R * M, H] fixed blocks: a batched GEMM over every slot
        y = torch.bmm(xs, mine)
    else:  # [rows, H] grouped by expert: a grouped GEMM, here by hand
        y = torch.cat([blk @ mine[l] for l, blk in enumerate(xs.split(tokens_per_expert.tolist()))])
    return disp.combine(y)  # weighted by the router probabilities in combine


def rank(r):
    g = torch.Generator().manual_seed(r)
    # A small SM budget: the ranks share one GPU, and while a rank's kernels wait for a late peer
    # they hold their SMs. With 16 SMs a rank (4 ranks), torch's matmul kernels on the late rank
    # did not get the SMs they wait for, and its combine arrived after its peers gave up (4 of 5
    # runs on an H200, 2026-12-02); with 4, none of 5 stalled. One GPU per rank has no such limit.
    with world.comm(r, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=a.batch, num_sms=a.num_sms) as comm, \
            torch.no_grad():
        disp = et.FlexTokenDispatcher(comm, mode="prefill", apply_probs_in_combine=True)
        prompt = torch.randn(a.prompt, H, generator=g).to(dev, dtype)
        t0 = time.perf_counter()
        h = moe(disp, prompt)
        if cuda:  # this rank's stream only: a device-wide sync would wait on peers' kernels
            comm.synchronize()
        t_prefill = time.perf_counter() - t0

        disp.set_mode("decode")  # prefill -> decode: one call
        tokens = [torch.randn(a.batch, H, generator=g).to(dev, dtype) for _ in range(a.steps)]
        x = tokens[0].clone()
        outs = []
        t0 = time.perf_counter()
        if cuda:  # World.run gave this rank its own stream
            s = torch.cuda.current_stream(dev)
            moe(disp, x)  # warm-up: sizes the handle's buffers outside the graph
            comm.synchronize()
            barrier.wait()  # every rank's warm-up is done before anyone captures
            graph = torch.cuda.CUDAGraph()
            with capture, torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                y = moe(disp, x)  # captured, not run: nothing waits on a peer here
            barrier.wait()
            t0 = time.perf_counter()
            for tok in tokens:
                x.copy_(tok)
                graph.replay()  # every rank replays its graph; the kernels meet on the GPU
                outs.append(y.float().sum().item())
            comm.synchronize()  # the status of the sync-free work
        else:
            for tok in tokens:
                outs.append(moe(disp, tok).float().sum().item())
        t_decode = (time.perf_counter() - t0) / a.steps
        barrier.wait()  # peers may still read this rank's buffers until they are done too
        disp.close()
        return h.float().sum().item(), outs, t_prefill, t_decode


with world:
    print(f"{R} ranks on {world.backend}{' (GPU 0, CUDA graphs)' if cuda else ''}: {E} experts, top-{K}, "
          f"hidden {H}, prompt {a.prompt} tokens/rank, decode batch {a.batch}/rank")
    res = world.run(rank)
    print(f"prefill ('ht'): {max(r[2] for r in res) * 1e3:.2f} ms, checksum {sum(r[0] for r in res):.4f}")
    print(f"decode ('ll'):  {max(r[3] for r in res) * 1e3:.3f} ms/step over {a.steps} steps, "
          f"checksums {[round(sum(r[1][i] for r in res), 3) for i in range(min(3, a.steps))]}...")
