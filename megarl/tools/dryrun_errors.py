"""The dry run's one error (megarl.tools.dryrun): an invariant that does not hold, found by any of its
checks (the rank's build, its checkpoint pieces, its weight-sync rows, the layout's cover)."""
from __future__ import annotations


class InvariantError(Exception):
    """A dry-run invariant does not hold; the message is one line naming the rank."""
