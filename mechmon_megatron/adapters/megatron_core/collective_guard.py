"""The collective guard lives in the session (every host's adapter uses it); re-exported here."""

from mechmon_megatron.session.collective_guard import PeerFailure, all_ok, guarded_collective

__all__ = ["PeerFailure", "all_ok", "guarded_collective"]
