"""One checkpoint format for mechmon's state on every host.

The session is a ``Stateful`` object (``torch.distributed.checkpoint.stateful.Stateful``:
``state_dict()`` / ``load_state_dict()``). Every host stores ``session.state_dict()`` under the
one key :data:`STATE_KEY` (``"mechmon"``) of a container its own checkpointer writes, one
container per rank where the host keeps per-rank state:

============================  =====================================================  ==========
host                          container                                              per rank
============================  =====================================================  ==========
DeepSpeed                     the checkpoint's ``client_state``                      no (rank 0)
example trainer (gpt_trainer) its per-rank extra state ``mechmon_extra/rank_R.pt``   yes
Megatron-LM adapter           ``iter_XXXXXXX/mechmon_state/rank_R.json``             yes
============================  =====================================================  ==========

The state itself is per rank: the writer rank's holds the detector, every rank's its own error
count (``mechmon/errors`` sums them) and the checkpoint list.

Older formats still load, each with one notice per process: the example trainer's
``extra["callbacks"]["mechmon"]`` (mechmon <= 0.3) and the Megatron-LM adapter's
``iter_XXXXXXX/mechmon_state.json`` (the writer rank's state only, read by every rank).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["LEGACY_FORMATS", "STATE_KEY", "legacy_notice", "state_of"]

logger = logging.getLogger(__name__)

STATE_KEY = "mechmon"
"""The one key of mechmon's state in a host checkpoint container."""

LEGACY_FORMATS = {
    "trainer-callbacks": "the example trainer's extra state under callbacks/mechmon (mechmon <= 0.3)",
    "megatron-lm-json": "the Megatron-LM adapter's mechmon_state.json of the writer rank (mechmon <= 0.3)",
}
"""Old formats that still load (key -> description)."""

_noticed: set[str] = set()


def legacy_notice(kind: str, where: str) -> None:
    """Log once per process that ``where`` holds mechmon state in the old format ``kind``."""
    if kind in _noticed:
        return
    _noticed.add(kind)
    logger.warning("[mechmon] %s holds mechmon state in an older format (%s); loaded, and the next checkpoint "
                   "is saved in the current one (key %r)", where, LEGACY_FORMATS[kind], STATE_KEY)


def state_of(container: Optional[Mapping[str, Any]], where: str) -> Optional[dict]:
    """mechmon's state in a host container (None when there is none).

    ``container``: what the host's checkpointer loaded (a ``client_state``, the example trainer's
    per-rank extra state). Reads :data:`STATE_KEY`, else the example trainer's old
    ``callbacks/mechmon`` entry (one notice). ``where`` names the checkpoint in the notice.
    """
    if not container:
        return None
    state = container.get(STATE_KEY)
    if state is None:
        callbacks = container.get("callbacks")
        if isinstance(callbacks, Mapping) and callbacks.get(STATE_KEY) is not None:
            legacy_notice("trainer-callbacks", where)
            state = callbacks[STATE_KEY]
    if state is not None and not isinstance(state, Mapping):
        raise ValueError(f"{where}: the {STATE_KEY!r} entry is a {type(state).__name__}, not mechmon's state dict")
    return dict(state) if state is not None else None
