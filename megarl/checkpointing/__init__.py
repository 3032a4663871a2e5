"""Run checkpoints (issue 40's floor plan): `checkpoint.py` (the engines plus the trainer's state, the
HF export CLI), `checkpoint_io.py` (atomic directories, COMPLETE markers, the run-directory lock's
mechanism). What changed in the config since the checkpoint a run resumes from is
megarl.config.resume_changes'; one engine's distributed checkpoint is megarl.engine.checkpointing's."""
