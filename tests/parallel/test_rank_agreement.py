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
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    got = spawn(worker.run_rank, 2)
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
    assert kind == ("TypeError" if case == "not_a_tensor" else "ValueError")
    assert message.startswith("sequence_parallel: ") and SP_MESSAGES[case] in message, message
    for res in ranks:
        got = res["sp"][case]
        assert got["grads"] == []
        assert got["state"].keys() == attn.state_dict().keys()
        for name, t in attn.state_dict().items():
            assert torch.equal(got["state"][name], t), name
    good = [res["sp"][case]["good"] for res in ranks]
    assert all(g["error"] is None for g in good), [g["error"] for g in good]
    torch.testing.assert_close(torch.cat([g["y"] for g in good], dim=1), want)

