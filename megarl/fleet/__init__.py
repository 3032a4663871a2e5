"""rollout.placement=fleet's transport (issue 41): `wire.py` (the typed msgpack messages, their checks
and the token check), `link.py` (each server's weight link: a gloo group of two outside the training
world), `mailbox.py` (the queue that wakes a socket's thread), `log.py` (log lines written apart, so a
slow write never delays a heartbeat), `endpoint.py` (the training job's
ROUTER: joins, links, heartbeats, losses, a step's requests over the servers). The server is
`megarl/rollout/serve.py`, the trainer's side `megarl/rollout_side/fleet.py`. This room imports only
megarl.platform (the gloo group the links are, bound to an address)."""
