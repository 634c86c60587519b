"""The NCCL all-to-all baseline of a MoE layer's communication, as Megatron's alltoall token
dispatcher does it, timed the same way epx-bench times epx: one process per GPU.

    torchrun --nproc-per-node 8 tools/nccl_baseline.py --tokens 4096 --hidden 7168 --experts 256 --topk 8

Dispatch: permute (one row per (token, expert) pair, sorted by expert), all_to_all_single
with the pair counts as splits, sort the received chunks from (source, expert) to (expert,
source). Combine: the reverse, then each token's rows weighted and summed. Also measures a
device-to-device copy to the next GPU (the link's floor). With --check, the combined output is
compared with a dense computation of the same layer (a stand-in expert scales its rows).
Runs on CPU with the gloo backend too (--device cpu), which is how it is tested without GPUs.
Keep NVLink multicast off (NCCL_NVLS_ENABLE=0): this script sets it if unset.
"""

import argparse
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist


def expert_scale(e):
    return 0.5 + 0.0625 * (e % 23)


def make_inputs(rank, args, device, dtype):
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = (torch.rand(args.tokens, args.hidden, generator=g) * 4 - 2).to(dtype)
    idx = torch.stack([torch.randperm(args.experts, generator=g)[: args.topk] for _ in range(args.tokens)]) \
        if args.tokens else torch.empty(0, args.topk, dtype=torch.int64)
    w = 0.05 + 0.95 * torch.rand(args.tokens, args.topk, generator=g)
    return x.to(device), idx.to(device), w.to(device)


class AllToAllLayer:
    """One MoE layer's dispatch and combine through NCCL all-to-all (Megatron's alltoall flow)."""

    def __init__(self, args, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.L = args.experts // world

    def plan(self, idx):
        E, R, L = self.args.experts, self.world, self.L
        flat = idx.reshape(-1)
        self.order = torch.argsort(flat, stable=True)            # pairs sorted by expert
        self.pair_token = self.order // self.args.topk
        per_expert = torch.bincount(flat, minlength=E)
        # everyone's per-expert counts: [R, E]
        all_counts = torch.empty(R * E, dtype=per_expert.dtype, device=self.device)
        dist.all_gather_into_tensor(all_counts, per_expert) if self.device.type == "cuda" else \
            dist.all_gather(list(all_counts.chunk(R)), per_expert)
        all_counts = all_counts.view(R, E).cpu()
        self.send_splits = all_counts[self.rank].view(R, L).sum(1).tolist()
        recv_from = all_counts[:, self.rank * L:(self.rank + 1) * L]   # [source, local expert]
        self.recv_splits = recv_from.sum(1).tolist()
        self.recv_chunks = recv_from.reshape(-1).tolist()             # (source, expert) order
        return sum(self.send_splits), sum(self.recv_splits)

    def sort_index(self):
        """Rows received in (source, expert) order -> (expert, source) order."""
        R, L = self.world, self.L
        starts, at = [], 0
        for n in self.recv_chunks:
            starts.append(at)
            at += n
        pieces = [torch.arange(starts[s * L + l], starts[s * L + l] + self.recv_chunks[s * L + l])
                  for l in range(L) for s in range(R)]
        return torch.cat(pieces).to(self.device) if pieces else torch.empty(0, dtype=torch.int64, device=self.device)

    def dispatch(self, x):
        sent = x.index_select(0, self.pair_token)                        # permute
        recv = sent.new_empty(sum(self.recv_splits), x.shape[1])
        dist.all_to_all_single(recv, sent, self.recv_splits, self.send_splits)
        self.sorted_index = self.sort_index()
        return recv.index_select(0, self.sorted_index)                   # sort chunks by expert

    def combine(self, y, w):
        back_src = torch.empty_like(y)
        back_src[self.sorted_index] = y                                   # unsort
        back = y.new_empty(sum(self.send_splits), y.shape[1])
        dist.all_to_all_single(back, back_src, self.send_splits, self.recv_splits)
        weights = w.reshape(-1)[self.order].to(torch.float32).unsqueeze(1)
        out = torch.zeros(self.args.tokens, y.shape[1], dtype=torch.float32, device=self.device)
        out.index_add_(0, self.pair_token, back.to(torch.float32) * weights)   # unpermute
        return out.to(y.dtype)


def experts(layer, rows):
    """The stand-in expert on rows grouped by local expert."""
    out, at = torch.empty_like(rows), 0
    counts = torch.tensor(layer.recv_chunks).view(layer.world, layer.L).sum(0).tolist()
    for l, n in enumerate(counts):
        out[at:at + n] = rows[at:at + n] * expert_scale(layer.rank * layer.L + l)
        at += n
    return out


def timed(fn, device):
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        r = fn()
        b.record()
        b.synchronize()
        return r, a.elapsed_time(b)
    t0 = time.perf_counter()
    r = fn()
    return r, (time.perf_counter() - t0) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x, idx, w = make_inputs(rank, args, device, dtype)
    layer = AllToAllLayer(args, rank, world, device)

    ms = {"dispatch": [], "combine": []}
    for it in range(args.iters + 1):
        dist.barrier()
        _, _ = layer.plan(idx), None
        recv, t_d = timed(lambda: layer.dispatch(x), device)
        y = experts(layer, recv)
        dist.barrier()
        out, t_c = timed(lambda: layer.combine(y, w), device)
        if it:  # the first is warm-up
            ms["dispatch"].append(t_d)
            ms["combine"].append(t_c)
    sent, received = layer.plan(idx)
    row = args.hidden * (2 if dtype == torch.bfloat16 else 4)
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    link = max(sent, received) * row                       # this rank's bytes over its link

    floor_gbps = None
    if cuda and world > 1:                                  # one GPU's copy to the next: the link
        buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        _, t = timed(lambda: buf.to(peer), device)
        _, t = timed(lambda: buf.to(peer), device)
        floor_gbps = buf.numel() / (t * 1e-3) / 1e9

    if args.check:  # the dense layer: every token through its experts, weighted, summed
        want = torch.zeros(args.tokens, args.hidden, dtype=torch.float32, device=device)
        for k in range(args.topk):
            scale = torch.tensor([expert_scale(int(e)) for e in idx[:, k].tolist()], device=device)
            want += (x.float() * scale.unsqueeze(1)).to(dtype).float() * w[:, k:k + 1].float()
        err = (out.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        ok = torch.tensor([1.0 if err < (2e-2 if dtype == torch.bfloat16 else 1e-5) else 0.0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(f"check: {'ok' if ok.item() == 1.0 else 'FAILED'} (max relative error {err:.2e} on rank 0)")

    stats = torch.tensor([med["dispatch"], med["combine"]], device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        res = {"baseline": "nccl_alltoall" if cuda else "gloo_alltoall", "ranks": world, "tokens": args.tokens,
               "hidden": args.hidden, "experts": args.experts, "topk": args.topk, "dtype": args.dtype,
               "dispatch_ms": stats[0].item(), "combine_ms": stats[1].item(), "rank0_link_bytes": link,
               "rank0_link_gbps": link / (stats[0].item() * 1e-3) / 1e9, "peer_copy_gbps": floor_gbps}
        print(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
