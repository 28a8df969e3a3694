"""One checkpoint format for mechmon's state on every host.

The session is a ``Stateful`` object (``torch.distributed.checkpoint.stateful.Stateful``:
``state_dict()`` / ``load_state_dict()``). Every host stores ``session.state_dict()`` under the
one key :data:`STATE_KEY` (``"mechmon"``) of a container its own checkpointer writes, one
container per rank where the host keeps per-rank state:

=============================  =============================================================  ==============
host                           container (its own checkpointer writes it)                     per rank
=============================  =============================================================  ==============
example trainer (gpt_trainer)  its ``dist_checkpointing.save`` state dict: a ShardedObject    yes: one shard
                               per rank, global shape ``(world,)``, offset ``(rank,)``        per rank
Megatron-LM, ``torch_dist``    Megatron's distributed checkpoint (``generate_state_dict``),   yes: one shard
                               the same ShardedObject                                         per rank
Megatron-LM, ``torch``         ``iter_XXXXXXX/mechmon_state/rank_R.json`` (Megatron's legacy  yes: a file
                               format is written by data-parallel rank 0 only)                per rank
DeepSpeed                      the checkpoint's ``client_state``: :func:`per_rank` of every   yes: gathered
                               rank's state, gathered at the save                             to the savers
=============================  =============================================================  ==============

The ShardedObject is built and read back by
``mechmon_megatron.adapters.megatron_core.sharded_state``. The state itself is per rank: the writer
rank's holds the detector, every rank's its own error count (``mechmon/errors`` sums them) and the
checkpoint list; each rank restores its own.

The state inside the entry is ``MonitorState.to_dict()`` (``session/saved_state.py``).

Older formats still load, each with one notice per process (:data:`LEGACY_FORMATS`), and every
reader of an older container or file layout is here, the hosts calling it: the example trainer's
``extra["callbacks"]["mechmon"]`` (mechmon <= 0.3, :func:`state_of`) and its per-rank extra file's
``mechmon`` key (:func:`trainer_extra_state`); the Megatron-LM adapter's
``iter_XXXXXXX/mechmon_state.json`` (the writer rank's state only, read by every rank) and its
per-rank JSON files beside a torch_dist checkpoint (:func:`megatron_lm_file_state`); DeepSpeed's
single ``client_state["mechmon"]`` of the saving rank (every rank loads it, :func:`own_state`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from mechmon_megatron.session.log import mechmon_log

__all__ = ["LEGACY_FORMATS", "MEGATRON_LM_SINGLE_FILE", "PER_RANK_FORMAT", "STATE_KEY", "legacy_notice",
           "megatron_lm_file_state", "own_state", "per_rank", "state_of", "trainer_extra_state"]

log = mechmon_log(__name__)

STATE_KEY = "mechmon"
"""The one key of mechmon's state in a host checkpoint container."""

LEGACY_FORMATS = {
    "trainer-callbacks": "the example trainer's extra state under callbacks/mechmon (mechmon <= 0.3)",
    "megatron-lm-json": "the Megatron-LM adapter's mechmon_state.json of the writer rank (mechmon <= 0.3)",
    "trainer-extra-file": "the example trainer's per-rank mechmon_extra/rank_R.pt under mechmon (mechmon <= 0.3)",
    "megatron-lm-rank-json": "the Megatron-LM adapter's per-rank mechmon_state/rank_R.json beside a torch_dist "
                             "checkpoint (mechmon <= 0.3)",
    "deepspeed-single": "DeepSpeed client_state mechmon of the saving rank only (mechmon <= 0.3)",
}
"""Old formats that still load (key -> description)."""

_noticed: set[str] = set()


def legacy_notice(kind: str, where: str) -> None:
    """Log once per process that ``where`` holds mechmon state in the old format ``kind``."""
    if kind in _noticed:
        return
    _noticed.add(kind)
    log.warning("%s holds mechmon state in an older format (%s); loaded, and the next checkpoint "
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


PER_RANK_FORMAT = "mechmon-per-rank-1"
"""``format`` of a container entry holding every rank's state (``{"format", "ranks": {rank: state}}``),
for hosts whose checkpointer saves one rank's container for all (DeepSpeed's ``client_state``)."""


def per_rank(states: Mapping[int, Mapping[str, Any]]) -> dict:
    """Every rank's state in one entry: ``{"format": PER_RANK_FORMAT, "ranks": {rank: state}}``."""
    return {"format": PER_RANK_FORMAT, "ranks": {int(rank): dict(state) for rank, state in states.items()}}


def own_state(entry: Optional[Mapping[str, Any]], rank: int, where: str) -> Optional[dict]:
    """This rank's state from an entry :func:`state_of` returned: its own in a :func:`per_rank`
    entry (None when that rank is not in it: the job grew), or the older single state of the
    saving rank, which every rank then loads (one notice)."""
    if entry is None:
        return None
    if entry.get("format") == PER_RANK_FORMAT:
        ranks = entry.get("ranks")
        if not isinstance(ranks, Mapping):
            raise ValueError(f"{where}: the {STATE_KEY!r} entry has no per-rank states")
        state = ranks.get(rank)
        if state is None:
            log.warning("%s holds no mechmon state of rank %d (saved by %d ranks): this rank starts afresh", where,
                        rank, len(ranks))
        return dict(state) if state is not None else None
    legacy_notice("deepspeed-single", where)
    return dict(entry)


# ---------------------------------------------------------------------------- the hosts' older layouts
MEGATRON_LM_SINGLE_FILE = "mechmon_state.json"
"""The Megatron-LM adapter's older single file of the writer rank's state, ``iter_XXXXXXX/mechmon_state.json``
(mechmon <= 0.3): still read on resume."""


def megatron_lm_file_state(rank_file: str, directory: str, older: bool) -> Optional[dict]:
    """This rank's state from the Megatron-LM adapter's files in ``directory`` (its ``iter_XXXXXXX``):
    its own JSON file ``rank_file`` (``{"mechmon": state}``), else the older single file of the
    writer rank (:data:`MEGATRON_LM_SINGLE_FILE`, every rank loads it; one notice); None when neither
    exists. ``older``: the per-rank files are themselves the older layout (beside a torch_dist
    checkpoint that lacks the ``mechmon`` entry): one notice too."""
    if os.path.isfile(rank_file):
        if older:
            legacy_notice("megatron-lm-rank-json", rank_file)
        with open(rank_file, encoding="utf-8") as f:
            return state_of(json.load(f), rank_file)
    single = os.path.join(directory, MEGATRON_LM_SINGLE_FILE)
    if not os.path.isfile(single):
        return None
    legacy_notice("megatron-lm-json", single)
    with open(single, encoding="utf-8") as f:
        return json.load(f)


def trainer_extra_state(extra: Mapping[str, Any], extra_path: str) -> Optional[dict]:
    """The monitor state of an example-trainer checkpoint without the ``mechmon`` entry in its
    distributed checkpoint: the per-rank extra file's ``mechmon`` key, or ``callbacks/mechmon``
    (older still); one notice each."""
    if extra.get(STATE_KEY) is not None:
        legacy_notice("trainer-extra-file", extra_path)
    return state_of(extra, extra_path)
