"""Run-time watchdogs around the training loop (issue 40's floor plan): `heartbeat.py`, `preemption.py`,
`profiling.py`, `rendezvous.py` (`python -m megarl.runtime.rendezvous`)."""
