"""MegatronEngine: one role's model, optimizer and pipeline schedules (actor, critic, reference)."""
