"""The PPO step's records and pieces (issue 40's floor plan), used by `megarl.trainer.Trainer.ppo_step`:
`samples.py`, `step_record.py`, `step_metrics.py`, `global_batch.py`, `rollout_corr.py`,
`dynamic_sampling.py`, `distill.py`, `guards.py` (the control phase's guard decisions),
`engine_options.py` (each role's engine settings), `scoring.py` (samples and their scores),
`advantages.py`, `losses.py` and `updates.py` (phases 5 and 6), `phase_clock.py` and
`memory_metrics.py`. The RL math is `megarl.algorithms`'."""
