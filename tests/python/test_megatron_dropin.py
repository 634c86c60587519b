"""Megatron-core's own MoELayer with the flex dispatcher on epx (``deep_ep`` from
``epx.compat``), against Megatron's alltoall dispatcher: same weights, same inputs, one process
per rank over gloo on CPU tensors; output, input gradient and every parameter gradient.

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

def _launch(case, world, timeout=240):
    import megatron_moe

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
      gradients (sums over rows) round differently."""
    pairs = case["topk"] * case["tp"]
    if name in ("output", "input_grad"):
        if pairs <= 2:
            return None
    elif case["tp"] == 1 and (case["layers"] == 1 or pairs <= 2):
        return None
    eps = 2.0 ** -7 if case["dtype"] == "bf16" else 2.0 ** -20
    return (8 * eps, 8 * eps)


def _check(case, world):
    results = _launch(case, world)
    tag = f"{case['backend']} TP{case['tp']}xEP{case['ep']} top-{case['topk']} {case['dtype']} seed {case['seed']}"
    lines = []
    for rank, res in sorted(results.items()):
        assert not res["missing"], f"rank {rank}: parameters on one path only: {res['missing']}"
        for name, (exact, d, m) in res["report"].items():
            tol = _tolerance(case, name)
            ok = exact if tol is None else d <= tol[0] * m + tol[1]
            if not ok:
                lines.append(f"rank {rank} {name}: max |diff| {d:.3g} (max |ref| {m:.3g}), "
                             f"{'bit-identical required' if tol is None else f'tolerance {tol}'}")
    # what was bit-identical and what was not, for the record (pytest -s shows it)
    exact = sorted({n for res in results.values() for n, v in res["report"].items() if v[0]})
    inexact = {n: max(res["report"][n][1] for res in results.values()) for n in
               sorted({n for res in results.values() for n, v in res["report"].items() if not v[0]})}
    print(f"\n{tag}: bit-identical {len(exact)} tensors {exact}; not: "
          + ", ".join(f"{n} (max |diff| {d:.3g})" for n, d in inexact.items()))
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
