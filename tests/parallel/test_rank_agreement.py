"""Parallel layers on 2 gloo ranks refuse a call together: when one rank's call is bad, or the ranks' calls
differ, every rank raises the same error before any real collective, its layer is left as it was, and the
next good call on every rank equals the single-process layer (rebuilt here from the same seeds)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import _agreement_worker as worker
from tests.parallel.spawn import spawn

pytestmark = [pytest.mark.xdist_group("parallel"), pytest.mark.timeout(240)]

SP_MESSAGES = {
    "bad_width": "refused on rank 1, so every rank of the 2 refuses the call: x must",
    "bad_mask_heads": "refused on rank 1, so every rank of the 2 refuses the call: mask of shape (2, 3, 6, 6)",
    "mask_shape_differs": "masks differ by rank: [(6, 6) bool, (2, 1, 1, 6) bool] (rank 1 differs from rank 0)",
    "causal_differs": "causal flags (0: False, 1: True, 2: not a bool) differ by rank: [1, 0] (rank 1 differs from rank 0)",
    "not_a_tensor": "refused on rank 1, so every rank of the 2 refuses the call: x must be a torch.Tensor",
    "unknown_option": "refused on rank 1, so every rank of the 2 refuses the call: forward() got unexpected "
                      "keyword arguments ['casual']",
    "trainable_differs": "layer states (grad mode, trainable parameters as bits) differ by rank",
    "grad_reduction_differs": "grad_reductions (0: sum, 1: none) differ by rank: [0, 1] (rank 1 differs from rank 0)",
    "traced": "refused on rank 1, so every rank of the 2 refuses the call: headwise.trace does not run on a "
              "sequence-parallel layer (each rank attends with only heads [2, 3]); trace the unsharded layer",
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    got = spawn(worker.run_rank, 2)
    for res in got:
        assert "traceback" not in res, res["traceback"]
    return got


@pytest.fixture(scope="module")
def mesh_ranks() -> list[dict]:
    got = spawn(worker.run_mesh_rank, 4)
    for res in got:
        assert "traceback" not in res, res["traceback"]
    return got


@pytest.mark.parametrize("case", worker.SP_CASES)
def test_sequence_parallel_ranks_refuse_together_and_stay_in_step(ranks, case):
    attn, inp = worker.build(f"sp_{case}")
    with torch.no_grad():
        want = attn(inp["x_good"], mask=inp["window"], causal=True)
    errors = [res["sp"][case]["error"] for res in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    kind, message = errors[0]
    assert kind == ("TypeError" if case in ("not_a_tensor", "unknown_option") else "ValueError")
    assert message.startswith("sequence_parallel: ") and SP_MESSAGES[case] in message, message
    # Refused in the call check, not by the group's timeout (worker.TIMEOUT_S) on the ranks left waiting.
    assert all(res["sp"][case]["seconds"] < worker.TIMEOUT_S / 2 for res in ranks), case
    for res in ranks:
        got = res["sp"][case]
        assert got["grads"] == []
        assert got["state"].keys() == attn.state_dict().keys()
        for name, t in attn.state_dict().items():
            assert torch.equal(got["state"][name], t), name
    good = [res["sp"][case]["good"] for res in ranks]
    assert all(g["error"] is None for g in good), [g["error"] for g in good]
    torch.testing.assert_close(torch.cat([g["y"] for g in good], dim=1), want)


TP_MESSAGES = {
    "shape_differs": "inputs x differ by rank: [(2, 6, 16) float64, (3, 4, 16) float64] (rank 1 differs from rank 0)",
    "causal_differs": "causal flags (0: False, 1: True, 2: not a bool) differ by rank: [1, 0] (rank 1 differs",
    "bad_width": "inputs x differ by rank: [(2, 6, 16) float64, (2, 6, 8) float64] (rank 1 differs from rank 0)",
    "unknown_option": "refused on rank 1, so every rank of the 2 refuses the call: forward() got unexpected "
                      "keyword arguments ['casual']",
    "decode_differs": "inputs x differ by rank: [(2, 1, 16) float64, (2, 2, 16) float64] (rank 1 differs",
    "cache_differs": "owner: 0 none, 1 this layer, 2 another) differ by rank: [(1, 5, 1), (1, 4, 1)] (rank 1 differs",
    "size_differs": "inputs x differ by rank: [(2, 6, 16) float64, (2, 7, 16) float64] (rank 1 differs from rank 0)",
    "trainable_differs": "layer states (grad mode, training, traced, trainable parameters as bits, chunk_queries) "
                         "differ by rank: [(1, 1, 0, 255, -1), (1, 1, 0, 195, -1)] (rank 1 differs from rank 0)",
    "hooks_differ": "query chunks turned off by forward hooks on q_proj or out_proj (0: no, 1: yes) differ by rank: "
                    "[1, 0] (rank 1 differs from rank 0)",
}


@pytest.mark.parametrize("case", worker.TP_CASES)
def test_tensor_parallel_ranks_with_different_inputs_refuse_together_and_stay_in_step(ranks, case):
    attn, inp = worker.build(f"tp_{case}")
    x_good = inp["x_good"]
    with torch.no_grad():
        if case in ("decode_differs", "cache_differs"):
            cache = attn.new_cache(worker.B, worker.S + 2)
            prefill = attn(x_good[:, :worker.S - 1], cache=cache)
            if case == "cache_differs":
                cache.crop(worker.S - 2)
            want = attn(x_good[:, worker.S - 1:], cache=cache)
        else:
            want = attn(x_good, causal=True)
    errors = [res["tp"][case]["error"] for res in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    kind, message = errors[0]
    assert kind == ("TypeError" if case == "unknown_option" else "ValueError")
    assert message.startswith("tensor_parallel: ") and TP_MESSAGES[case] in message, message
    for res in ranks:
        got = res["tp"][case]
        before, after = got["before"], got["after"]
        assert after["grads"] == before["grads"] == []
        assert after["state"].keys() == before["state"].keys()
        for name, t in before["state"].items():
            assert torch.equal(after["state"][name], t), name
        if case in ("decode_differs", "cache_differs"):  # the cache is as the prefill (and crop) left it
            torch.testing.assert_close(got["prefill"]["y"], prefill)
            assert after["cache_length"] == before["cache_length"]
            assert torch.equal(after["keys"], before["keys"]) and torch.equal(after["values"], before["values"])
        assert got["good"]["error"] is None, got["good"]["error"]
        torch.testing.assert_close(got["good"]["y"], want)


def test_tensor_parallel_checks_in_one_all_gather_and_check_inputs_false_skips_it(ranks):
    attn, inp = worker.build("tp_exchanges")
    with torch.no_grad():
        want = attn(inp["x_good"], causal=True)
    for res in ranks:
        got = res["tp_exchanges"]
        assert (got[True]["all_gathers"], got[False]["all_gathers"]) == (1, 0)
        for on in (True, False):
            torch.testing.assert_close(got[on]["y"], want)


MESH_MESSAGES = {
    "bad_width": "sequence_parallel: refused on rank 3, so every rank of the 4 refuses the call: x must",
    "slices_differ": "sequence_parallel: the tensor-parallel shards of sp rank 0 must hold the same sequence "
                     "slice; their (s_q, s_kv) differ: [(2, 2), (3, 3)]",
}


@pytest.mark.parametrize("case", worker.MESH_CASES)
def test_sequence_parallel_on_a_2d_mesh_refuses_on_every_rank_of_the_mesh(mesh_ranks, case):
    # Rank 3's refusal (or rank 1's other slice) must stop ranks 0 and 2 too: the all-reduce over "tp" pairs
    # them with ranks 1 and 3.
    attn, inp = worker.build(f"mesh_{case}")
    with torch.no_grad():
        want = attn(inp["x_good"], mask=inp["window"], causal=True)
    errors = [res["mesh"][case]["error"] for res in mesh_ranks]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert errors[0][0] == "ValueError" and MESH_MESSAGES[case] in errors[0][1], errors[0]
    shards: dict[int, list] = {}
    for res in mesh_ranks:
        got = res["mesh"][case]
        before, after = got["before"], got["after"]
        assert after["grads"] == before["grads"] == []
        for name, t in before["state"].items():
            assert torch.equal(after["state"][name], t), name
        assert got["good"]["error"] is None, got["good"]["error"]
        shards.setdefault(got["tp_rank"], []).append((got["sp_rank"], got["good"]["y"]))
    assert sorted(shards) == [0, 1]
    for parts in shards.values():
        torch.testing.assert_close(torch.cat([y for _, y in sorted(parts, key=lambda p: p[0])], dim=1), want)
