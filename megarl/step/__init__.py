"""The PPO step's records and pieces (issue 40's floor plan), used by `megarl.trainer.Trainer.ppo_step`:
`samples.py`, `step_record.py`, `step_metrics.py`, `global_batch.py`, `rollout_corr.py`,
`dynamic_sampling.py`, `distill.py`, `guards.py` (the
control phase's guard decisions). The RL math itself is `megarl.algorithms`'."""
