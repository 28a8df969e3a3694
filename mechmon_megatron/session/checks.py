"""The reads and kernels of one rank: the snapshot a later check compares against, and the check.

Every rank reads every site in site order (reads may be collectives: the tensor-parallel gather,
ZeRO reads), then computes what it reports: the per-head and full-matrix kernels of its layers
(``attention_check``, ``mla_check``), the short window's persistence (``--mechmon-short-window``),
and each router's summary through its all-reduce (``router_check``). Every phase runs inside the
failure log (``session/failures.py``): a failed read or kernel leaves that layer out on this rank,
and every rank still issues every collective in the same order.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from mechmon_megatron.session.attention_check import check_full, check_heads, check_heads_short
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.failures import FAILED, Failed, FailureLog
from mechmon_megatron.session.host import AttentionSite, MLAHeads, QKWeights, RouterSite
from mechmon_megatron.session.log import SESSION, mechmon_log
from mechmon_megatron.session.mla_check import check_mla_heads
from mechmon_megatron.session.records import CheckOutput
from mechmon_megatron.session.router_check import empty_vector, local_router_vector, router_output
from mechmon_megatron.session.snapshots import SiteSnapshot, SnapshotStore

log = mechmon_log(SESSION)

ShortDirections = tuple[torch.Tensor, torch.Tensor]
"""The leading Delta2 directions of one site's short window (2 hidden-size vectors per head)."""


class SiteChecks:
    """The snapshot reads and the check of this rank's sites (attention layers, then routers)."""

    def __init__(self, config: MechmonConfig, attention_sites: Sequence[AttentionSite],
                 router_sites: Sequence[RouterSite], failures: FailureLog) -> None:
        self.config = config
        self.attention_sites = list(attention_sites)
        self.router_sites = list(router_sites)
        self.failures = failures
        # Validated here, at start-up: a floor above E names its flag before training begins.
        self.router_floors = [config.router_entropy_floor(s.num_experts, s.topk) for s in self.router_sites]
        # --mechmon-short-window: per site, (check step, leading Delta2 directions of its short
        # window), for the persistence at the next check.
        self.short_directions: dict[int, tuple[int, ShortDirections]] = {}

    def take_snapshot(self, iteration: int, snapshots: SnapshotStore) -> None:
        """Copy the weights a later check (at iteration + delta) will compare against.

        Every rank reads every site (reads may be collectives); a failed read or copy leaves that
        site out of the snapshot, and the set is stored anyway, so all ranks agree that a check
        is due (the check still runs every read in order).
        """
        taken: dict[int, SiteSnapshot] = {}
        failures = self.failures
        for index, site in enumerate(self.attention_sites):
            layer = site.layer_number
            full = failures.run("snapshot-read", layer, iteration, site.read_full)
            if full is FAILED:
                continue  # read_full raised on every rank of its group (collective_guard)
            heads = failures.run("snapshot-read", layer, iteration, site.read_heads)
            if heads is FAILED:
                continue
            copied = failures.run("snapshot", layer, iteration, snapshots.take, heads,
                                  full if self.config.full_matrix_dw else None)
            if copied is not FAILED:
                taken[index] = copied
        snapshots.put(iteration + self.config.delta, taken)

    def run(self, iteration: int, snapshots: SnapshotStore) -> list[CheckOutput]:
        """This rank's check outputs at check step ``iteration`` (failed phases left out)."""
        cfg = self.config
        failures = self.failures
        outputs: list[Union[CheckOutput, Failed, None]] = []
        snapshot = snapshots.pop(iteration)
        # The short window's snapshot: the one taken one interval ago, still in the ring for its
        # own later check (not popped here).
        short = snapshots.peek(cfg.short_snapshot_key(iteration)) if cfg.short_window else None
        # No snapshot (e.g. the first check after a resume) is the same on every rank, since all
        # ranks follow one schedule; the reads below are collectives, so all skip them together.
        sites = self.attention_sites if (snapshot is not None or short is not None) else []
        for index, site in enumerate(sites):
            layer = site.layer_number
            full = failures.run("read", layer, iteration, site.read_full)  # collectives first, in site order
            if full is FAILED:
                continue
            heads = failures.run("read", layer, iteration, site.read_heads)
            prev_heads, prev_full = snapshot.get(index, (None, None)) if snapshot is not None else (None, None)
            if isinstance(heads, MLAHeads) and isinstance(prev_heads, MLAHeads):
                outputs.append(failures.run("kernel", layer, iteration, check_mla_heads, layer, prev_heads, heads,
                                            cfg.alpha, cfg.per_head_scalars))
            elif isinstance(heads, QKWeights) and isinstance(prev_heads, QKWeights):
                outputs.append(failures.run("kernel", layer, iteration, check_heads, layer, prev_heads, heads,
                                            cfg.alpha, cfg.qk_method, cfg.per_head_scalars))
            if full is not None and prev_full is not None:
                outputs.append(failures.run("kernel", layer, iteration, check_full, layer, prev_full, full,
                                            cfg.alpha, cfg.full_matrix_method, cfg.full_matrix_rank,
                                            cfg.wq_norm_power_iters))
            short_heads = short.get(index, (None, None))[0] if short is not None else None
            if isinstance(heads, QKWeights) and isinstance(short_heads, QKWeights):  # MLA: the long window only
                outputs.append(self._short_window(iteration, index, layer, short_heads, heads))
        snapshots.release(snapshot)
        for router, floor in zip(self.router_sites, self.router_floors):
            outputs.append(self._router(iteration, router, floor))
        return [o for o in outputs if o is not None and o is not FAILED]

    def _short_window(self, iteration: int, index: int, layer: int, short_heads: QKWeights,
                      heads: QKWeights) -> Union[CheckOutput, Failed]:
        """The short window's check of one site, with the persistence of its leading directions."""
        cfg = self.config
        # The previous short window is (t - 2 interval, t - interval]: adjacent, not overlapping.
        kept = self.short_directions.pop(index, None)
        previous = kept[1] if kept is not None and kept[0] == iteration - cfg.interval else None
        result = self.failures.run("kernel", layer, iteration, check_heads_short, layer, short_heads, heads,
                                   cfg.alpha, cfg.qk_method, cfg.per_head_scalars, previous)
        if result is FAILED:
            return FAILED
        output, directions = result
        if directions is not None:
            self.short_directions[index] = (iteration, directions)
        return output

    def _router(self, iteration: int, router: RouterSite, floor: Optional[float]) -> Optional[CheckOutput]:
        """One router: local summary, the all-reduce (every rank, always), the reporting rank's output.

        A rank whose summary failed contributes zeros and a failure mark in the same all-reduce,
        so every rank of the group learns it and the partial total is not reported.
        """
        bins = self.config.router_entropy_bins
        failures = self.failures
        layer = router.layer_number
        local = failures.run("router", layer, iteration, local_router_vector, router, bins)
        failed = local is FAILED
        if local is FAILED:
            local = empty_vector(router, bins)
        marked = failures.run("router", layer, iteration, with_failure_mark, local, failed)
        if marked is FAILED:  # never skip the all-reduce: the peers are already on their way to it
            marked = with_failure_mark(empty_vector(router, bins), True)
        total = failures.run("router", layer, iteration, router.reduce_sum, marked)
        if total is FAILED:  # the collective itself failed (this rank is down) or a peer's part did
            return None
        if float(total[-1]) > 0:
            if not failed:
                log.warning("router layer %d: a peer rank's summary failed at iteration %d; not reported this check",
                            layer, iteration)
            return None
        output = failures.run("router", layer, iteration, router_output, router, total[:-1], bins, floor)
        return None if output is FAILED else output


def with_failure_mark(vector: torch.Tensor, failed: bool) -> torch.Tensor:
    """``vector`` (fp64, where it lives) with one more element: 1 when this rank's summary failed."""
    mark = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64, device=vector.device)
    return torch.cat([vector.reshape(-1).to(torch.float64), mark])
