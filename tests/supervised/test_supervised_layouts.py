"""SFT and reward-model training log the same metrics at tp2 with SP, pp2, dp2 and cp2 as in one process for
3 steps (1e-4), and resume exactly (dp2's step-2 checkpoint, continued at pp2, gives one process's step 3);
the reward model's export is scored by transformers as megarl scores it (1e-4). One 2-rank launch runs
every layout of both stages (supervised_layout_worker.py); the one-process reference runs in this process."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from supervised_helpers import COMPARED, STEPS, config, make_inputs, train  # noqa: E402

from conftest import torchrun  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, world_of_one):
    root = tmp_path_factory.mktemp("supervised")
    inputs = make_inputs(root)
    (root / "inputs.json").write_text(json.dumps(inputs))
    reference = {stage: train(config(inputs, stage, str(root / f"{stage}_one")), world_of_one, stage)
                 for stage in ("sft", "reward_model")}
    torchrun(2, [str(Path(__file__).parent / "supervised_layout_worker.py"), "--inputs", str(root / "inputs.json"),
                 "--work", str(root / "layouts"), "--out", str(root / "layouts.json")], timeout=900)
    layouts = json.loads((root / "layouts.json").read_text())
    return root, inputs, reference, layouts


@pytest.mark.parametrize("stage", ["sft", "reward_model"])
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "dp2", "cp2", "resumed_pp2_from_dp2"])
def test_layout_matches_one_process(runs, stage, layout):
    _, _, reference, layouts = runs
    ran = {int(step): metrics for step, metrics in layouts[f"{stage}/{layout}"].items()}
    steps = [STEPS] if layout.startswith("resumed") else list(range(1, STEPS + 1))
    assert sorted(ran) == steps
    for step in steps:
        for name in COMPARED[stage]:
            assert ran[step][name] == pytest.approx(reference[stage][step][name], abs=1e-4), (step, name)
    # the metrics move: the comparison is not of constants
    assert reference[stage][1][COMPARED[stage][0]] != pytest.approx(reference[stage][STEPS][COMPARED[stage][0]], abs=1e-3)


def test_reward_model_export_is_scored_alike_by_transformers(runs, world_of_one):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.rewards.model import RewardModel

    root, inputs, _, _ = runs
    out = root / "rm_hf"
    torchrun(0, ["-m", "megarl.tools.export_hf", "--ckpt", str(root / "reward_model_one" / "checkpoints" / f"step_{STEPS:08d}"),
                 "--out", str(out), "--model", inputs["model"]], timeout=300)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    prompts, answers = ["472=", "472=", "105=", "99="], ["472", "471", "1050", "9"]
    ours = RewardModel(str(out), world_of_one)(prompts, answers, [""] * 4, ["x"] * 4, [{}] * 4)
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        theirs = [hf(torch.tensor([tokenizer.encode(p + a)])).logits[0, 0].item() for p, a in zip(prompts, answers)]
        # a padded batch: transformers reads each row's last token that is not padding, as megarl does
        batch = tokenizer([p + a for p, a in zip(prompts, answers)], padding=True, return_tensors="pt")
        batched = hf(**batch).logits[:, 0].tolist()
    assert ours == pytest.approx(theirs, abs=1e-4)
    assert batched == pytest.approx(theirs, abs=1e-4)
    assert max(theirs) - min(theirs) > 1e-3  # trained: distinct texts, distinct scores
