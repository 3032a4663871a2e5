"""Rollout on ranks of its own (rollout.placement=separate) and the asynchronous schedule
(async.max_staleness, async.partial_rollout); docs/async_rl.md.

- `staleness.py`: policy versions, the staleness of a sample, the drop rule, the `async/` metrics (no torch.distributed);
- `server.py`: the rollout rank's program: a receiving thread (commands, prompts, the weight stream
  into a staging copy) and the generating loop that loads staged weights between requests, or
  between tokens with partial rollout;
- `client.py`: the training ranks' side: `RemoteRollout` (weights out, prompts out, samples back)
  and `AsyncSchedule` (requests K steps ahead, the staleness check and refill, its checkpoint state);
- `engine_side.py`: the rollout ranks' engine, built with their own group as vLLM's world, and the
  weight layout it loads, sent to the training ranks.
- `placement.py`: the world split (`Placement`, `split_world`, `start`); its config rules are
  megarl.config.placement_rules';
- `wire.py`: `send_object` / `recv_object`, the pickled messages between the two sides.
"""
