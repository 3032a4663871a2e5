"""rollout.banned_token_ids under every layout: a banned id lies in one TP rank's vocabulary shard
(the others hold none of it), the loss runs on the last pipeline stage; log-probs, entropy and the
actor update with bans are those of one process (issue 21, item 1)."""
from __future__ import annotations

import pytest
import torch

from test_engine import REL_TOL, _max_rel_diff, _worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def tp1(tiny_models, tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("banned_tp1"), tiny_models["qwen2"], 1, "--mode", "banned")


def test_bans_change_logprobs_and_entropy(tp1):
    mask = tp1["banned"]["logprobs"] != 0
    gain = (tp1["banned"]["logprobs"] - tp1["free"]["logprobs"])[mask]
    assert gain.min() > 0.3  # -log(1 - banned mass): about half the mass is banned
    assert (tp1["banned"]["entropy"] < tp1["free"]["entropy"])[mask].all()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_banned_logprobs_entropy_and_update_equal_one_process(tp1, tiny_models, tmp_path, tp, pp):
    got = _worker(tmp_path, tiny_models["qwen2"], 2, "--mode", "banned", "--tp", tp, "--pp", pp)
    for kind in ("banned", "free"):
        for name in ("logprobs", "entropy"):
            torch.testing.assert_close(got[kind][name], tp1[kind][name], rtol=0, atol=1e-5, msg=f"{kind} {name}")
    assert got["grad_norms"] == pytest.approx(tp1["grad_norms"], rel=REL_TOL)
    assert _max_rel_diff(tp1["weights"], got["weights"]) <= REL_TOL
