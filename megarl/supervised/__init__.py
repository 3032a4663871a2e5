"""Supervised stages of the RLHF pipeline on the PPO trainer's engine and layouts (docs/sft_rm.md).

    data.py      Parquet rows -> token sequences (SFT: prompt + response or a chat; preference pairs),
                 the bad-row rules, and the seeded, resumable, per-DP-rank order of the rows
    losses.py    the two losses as pure functions: response-token NLL and Bradley-Terry
    tasks.py     what SFT and reward-model training put into a MegatronEngine: the batch, the loss, metrics
    trainer.py   the loop: steps, validation, checkpoints, resume (launched through megarl.run.Run)

`launch/sft.py` and `launch/reward_model.py` are the entries; both are `megarl.supervised.trainer.main`.
"""
