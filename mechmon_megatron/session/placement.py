"""Start-up layout: where the job keeps its snapshots (agreed by every rank), and which ranks report.

Each rank proposes a snapshot placement (``--mechmon-snapshot-device``; ``auto``: from its own
budget, ``session/snapshots.py``) and says, for every placement, whether its snapshots would fit
there; one all-reduce (``Communicator.agree_startup``) gives the job the most conservative
proposal, or the same refusal on every rank. Whether a rank sends records at a check is known
from the sites' layout alone.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import AttentionSite, Communicator, RouterSite
from mechmon_megatron.session.log import SESSION, mechmon_log
from mechmon_megatron.session.snapshots import (
    PLACEMENTS,
    SnapshotStore,
    choose_placement,
    describe_budget,
    placement_problem,
    site_bytes,
    snapshot_bytes,
    weights_device,
)
from mechmon_megatron.session.startup import QUIET_SNAPSHOT_SETS

log = mechmon_log(SESSION)


def reports_at_checks(attention_sites: Sequence[AttentionSite], router_sites: Sequence[RouterSite]) -> bool:
    """Whether this rank produces records at a check (a layer's per-head or full-matrix work, a
    router's report): only such ranks send the writer a payload. Known from the layout."""
    for site in attention_sites:
        if site.reports is None:
            budget = site.snapshot_budget
            if budget is None or budget.heads_elements or budget.full_elements:
                return True
        elif site.reports:
            return True
    return any(router.reports for router in router_sites)


def agreed_store(config: MechmonConfig, attention_sites: Sequence[AttentionSite], comm: Communicator,
                 rank: int) -> SnapshotStore:
    """This rank's empty snapshot store at the job's agreed placement, its memory line logged."""
    budget = snapshot_bytes(config, attention_sites)
    device = weights_device(attention_sites)
    store = SnapshotStore(agreed_placement(config, attention_sites, comm, rank, budget, device))
    if attention_sites:
        log_budget(config, budget, device, store.placement, rank)
    return store


def agreed_placement(config: MechmonConfig, attention_sites: Sequence[AttentionSite], comm: Communicator,
                     rank: int, budget: Optional[int], device: torch.device) -> str:
    """The job's snapshot placement, after every rank agreed that all can start (one all-reduce).

    Each rank proposes its own placement (``auto``: from its own budget) and says, for every
    placement, whether its snapshots would fit there; the job takes the most conservative
    proposal (``snapshots.PLACEMENTS``), and a rank whose snapshots cannot fit there (or whose
    start-up raised) makes every rank raise the same ``ValueError``, naming that rank, the
    layer and the flag, instead of stopping alone.
    """
    own = 0
    problems: list[Optional[str]]
    try:
        own = PLACEMENTS.index(choose_placement(config, budget, device))
        layers = site_bytes(config, attention_sites)
        problems = [placement_problem(config, budget, device, p, layers) for p in PLACEMENTS]
    except Exception as exc:  # noqa: BLE001 -- agreed below, raised on every rank
        failed = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        problems = [failed] * len(PLACEMENTS)
    agree = getattr(comm, "agree_startup", None)
    choice, first = agree(own, problems) if agree is not None else (
        own, None if problems[own] is None else (rank, problems[own]))
    if first is not None:
        bad_rank, message = first
        raise ValueError(f"mechmon cannot start on every rank: rank {bad_rank}: {message} (every rank stops)")
    placement = PLACEMENTS[choice]
    if placement == "pinned" and device.type != "cuda":  # page-locked memory needs CUDA here
        placement = "cpu"
    if choice != own:
        log.info("snapshots: --mechmon-snapshot-device %s is %s on rank %d, %s on another rank: every rank uses %s",
                 config.snapshot_device, PLACEMENTS[own], rank, placement, placement)
    return placement


def log_budget(config: MechmonConfig, budget: Optional[int], device: torch.device, placement: str, rank: int) -> None:
    """The snapshot memory line of this rank: a warning when many sets are held at once (delta much
    longer than the interval is a memory cost the user should see, not only read), else info. Its
    text (``snapshots.describe_budget``) says ``mechmon:`` itself, as the planner's line does."""
    level = logging.WARNING if config.overlap > QUIET_SNAPSHOT_SETS else logging.INFO
    log.logger.log(level, describe_budget(config, budget, device, placement, rank))
