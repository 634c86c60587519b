"""Megatron-core's own MoELayer with the flex dispatcher on epx (``deep_ep`` from
``epx.compat``), against Megatron's alltoall dispatcher: same weights, same inputs, one process
per rank over gloo; output, input gradient and every parameter gradient. On CPU tensors, and
(marked gpu) on CUDA tensors with every rank's process on GPU 0 (epx's CUDA backend across
processes, CUDA IPC), where the test also measures the memory a layer holds while in flight.

Skips without torch or megatron-core (``ci/install-megatron.sh`` installs it). Where the
order of sums is the same on both paths the results must be bit-identical; where it is not
(see ``_tolerance``) they must agree to the rounding of the dtype."""

import importlib.util

import pytest

import moe_ref
from spawn_ranks import free_port, spawn_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="needs torch and megatron-core (ci/install-megatron.sh)")

def _launch(case, world):
    import megatron_moe

    timeout = 240 if case.get("device", "cpu") == "cpu" else 300  # (a wait for one rank's report)
    port = free_port()
    return spawn_ranks(megatron_moe.worker, [(r, world, port, case) for r in range(world)], timeout)


def _tolerance(case, name):
    """None: bit-identical required. Otherwise (rtol, atol) relative to the tensor's magnitude.

    Bit-identical where both paths add the same terms in the same order:
    - output and input gradient, when a token has at most two (token, expert) pairs over the
      dispatcher's group (topk x tp <= 2), in fp32 and in bf16: a + b == b + a, and both paths
      round the sum of two terms once. With more pairs the order differs (alltoall sums a
      token's expert outputs on the source in permutation order, rounding each step in the
      dtype; epx sums per destination rank, then over ranks, in float32, rounding once), so
      those agree to a few roundings.
    - every parameter gradient without tensor parallelism (and, with several layers, when the
      outputs feeding the next layer are themselves identical): each expert sees the same rows
      in the same order on both paths (source rank, then token) and the router's gradient is a
      per-pair product. With TP2 the flex dispatcher orders an expert's rows by source rank of
      the TPxEP group while alltoall gathers them over TP after its EP exchange, so the weight
      gradients (sums over rows) round differently.

    On CUDA nothing is required to be bit-identical, although both paths run on the GPU: cuBLAS
    may pick another GEMM kernel (another order of its float32 sums) for the same shape at
    another address alignment, and epx's CUDA combine multiplies and adds with one rounding
    (FMA) where torch rounds the product first. Each costs a rounding of the dtype per value,
    so every tensor gets the tolerance of the inexact CPU cases: 8 eps of the tensor's largest
    magnitude, about twice the worst sum of those roundings (a top-4 token's output: three
    bf16 additions on the alltoall path, each within half a unit of the largest partial sum,
    one on epx's, and a unit from the experts' GEMMs)."""
    eps = 2.0 ** -7 if case["dtype"] == "bf16" else 2.0 ** -20
    inexact = (8 * eps, 8 * eps)
    if case.get("device", "cpu") == "cuda":
        return inexact
    pairs = case["topk"] * case["tp"]
    if name in ("output", "input_grad"):
        if pairs <= 2:
            return None
    elif case["tp"] == 1 and (case["layers"] == 1 or pairs <= 2):
        return None
    return inexact


def _check_run(case, results, tag):
    """The failures of one run (results by rank), printing what was bit-identical and what was
    not, for the record (pytest -s shows it)."""
    lines = []
    for rank, res in sorted(results.items()):
        assert not res["missing"], f"rank {rank}: parameters on one path only: {res['missing']}"
        for name, (exact, d, m) in res["report"].items():
            tol = _tolerance(case, name)
            ok = exact if tol is None else d <= tol[0] * m + tol[1]
            if not ok:
                lines.append(f"rank {rank} {name}: max |diff| {d:.3g} (max |ref| {m:.3g}), "
                             f"{'bit-identical required' if tol is None else f'tolerance {tol}'}")
    exact = sorted({n for res in results.values() for n, v in res["report"].items() if v[0]})
    inexact = {n: max(res["report"][n][1] for res in results.values()) for n in
               sorted({n for res in results.values() for n, v in res["report"].items() if not v[0]})}
    print(f"\n{tag}: bit-identical {len(exact)} tensors {exact}; not: "
          + ", ".join(f"{n} (max |diff| {d:.3g})" for n, d in inexact.items()))
    return lines


def _check(case, world):
    """Every run of the case (its tokens, then each of more_tokens) on both paths."""
    results = _launch(case, world)
    tag = f"{case['backend']} TP{case['tp']}xEP{case['ep']} top-{case['topk']} {case['dtype']} seed {case['seed']}"
    if case.get("device", "cpu") != "cpu":
        tag += f" {case['device']}, {case['layers']} layers"
    lines = []
    for run in range(len(results[0]["runs"])):
        where = tag if run == 0 else f"{tag}, run {run}, tokens {[res['runs'][run]['tokens'] for _, res in sorted(results.items())]}"
        lines += _check_run(case, {r: res["runs"][run] for r, res in results.items()}, where)
    assert not lines, f"{tag}:\n" + "\n".join(lines)
    return results


def _case(**kw):
    c = dict(backend="deepep", tp=1, ep=2, experts=4, topk=2, hidden=32, ffn=48, dtype="fp32", tokens=[24],
             layers=1, capacity=None, seed=moe_ref.BASE_SEED % 100003)
    c.update(kw)
    return c


BACKENDS = ["deepep", "hybridep"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ep2(backend):
    _check(_case(backend=backend), 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ep4_top4(backend):
    _check(_case(backend=backend, ep=4, experts=8, topk=4, tokens=[20, 28, 16, 24]), 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_ep2(backend):
    _check(_case(backend=backend, tp=2, ep=2, experts=4, topk=2, tokens=[24, 16]), 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_uneven_tokens(backend):
    _check(_case(backend=backend, dtype="bf16", tokens=[30, 17]), 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_drop(backend):
    # the router drops (token, expert) pairs past each expert's capacity: every dispatcher
    # must move exactly the pairs that are left
    case = _case(backend=backend, capacity=0.5, tokens=[32, 24])
    results = _check(case, 2)
    full = sum(r["tokens"] for r in results.values()) * case["topk"] * case["tp"]
    assert sum(r["routed_pairs"] for r in results.values()) < full, "the capacity dropped nothing"


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_layers_in_flight(backend):
    _check(_case(backend=backend, layers=3, tokens=[20, 26]), 2)


# ---- on CUDA: every rank's process on GPU 0 ----------------------------------------------------


def _cuda_ready():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    import epx

    try:
        return torch.cuda.is_available() and epx.backend_available("cuda")
    except Exception:  # no libepx to ask
        return False


gpu = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA GPU and epx's CUDA backend")


def _gpu_case(**kw):
    # 8 layers in flight, each fed its own copy of x: chained, a layer's output that differs
    # from the reference's by one rounding could tip a near-tie in the next layer's routing
    return _case(device="cuda", dtype="bf16", layers=8, fan=True, **kw)


def _memory(case, results):
    """Per run: (tokens over all ranks, {path: bytes held per layer in flight, summed over the
    ranks}); printed with the peak, which the backward reaches."""
    rows = []
    for run in range(len(results[0]["runs"])):
        runs = [res["runs"][run] for _, res in sorted(results.items())]
        tokens = sum(r["tokens"] for r in runs)
        held = {p: sum(r["memory"][p][0] for r in runs) / case["layers"] for p in ("flex", "alltoall")}
        peak = {p: max(r["memory"][p][1] for r in runs) for p in ("flex", "alltoall")}
        pairs = tokens * case["topk"]
        print(f"{case['backend']} EP{case['ep']} run {run}, {tokens} tokens ({pairs} pairs, hidden {case['hidden']}, "
              f"ffn {case['ffn']}): a layer in flight holds {held['flex'] / 1024:.1f} KiB over the ranks on epx "
              f"({held['flex'] / len(runs) / 1024:.1f} KiB per rank, {held['flex'] / pairs:.0f} B per pair), {held['alltoall'] / 1024:.1f} KiB on Megatron's alltoall; "
              f"peak per rank with {case['layers']} in flight {peak['flex'] / 2**20:.2f} MiB on epx, "
              f"{peak['alltoall'] / 2**20:.2f} MiB on alltoall")
        rows.append((tokens, held))
    return rows


@gpu
@pytest.mark.gpu
@pytest.mark.megatron
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_ep2_eight_layers_in_flight(backend):
    # four runs on the same layers: the first makes the buffers (sized for it, as a framework's
    # first microbatch does), the second measures that count again, the third and fourth an
    # eighth of it. A layer keeps its last forward's routing state until its next forward
    # replaces it, so a run after a larger one frees more than it holds (the third run reads
    # negative on both paths); what a layer in flight holds is read in a steady state, on a run
    # that follows one of the same size (the second and the fourth)
    big, small = [512, 448], [64, 56]
    case = _gpu_case(backend=backend, hidden=128, ffn=192, tokens=big, more_tokens=[big, small, small])
    rows = _memory(case, _check(case, 2))
    (t_big, m_big), (t_small, m_small) = rows[1], rows[3]
    r = t_small / t_big
    # what a layer holds follows the tokens it routed: a buffer sized for the largest count
    # (the worst case the first run set) would keep the small run's memory near the big one's
    assert m_small["flex"] <= (r + 0.15) * m_big["flex"], (
        f"{backend}: a layer in flight holds {m_small['flex']:.0f} B for {t_small} tokens, "
        f"{m_big['flex']:.0f} B for {t_big}: not in proportion")
    # and no more than twice what the same layer holds on Megatron's own alltoall path
    for t, m in (rows[1], rows[3]):
        assert m["flex"] <= 2 * m["alltoall"], f"{backend}, {t} tokens: {m['flex']:.0f} B on epx, {m['alltoall']:.0f} B on alltoall"


@gpu
@pytest.mark.gpu
@pytest.mark.megatron
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_ep4_top4_eight_layers_in_flight(backend):
    case = _gpu_case(backend=backend, ep=4, experts=8, topk=4, tokens=[20, 28, 16, 24])
    _memory(case, _check(case, 4))
