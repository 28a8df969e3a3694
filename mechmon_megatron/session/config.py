"""Configuration of a monitoring session (host-agnostic).

Every field maps one-to-one onto a ``--mechmon-*`` flag (``mechmon_megatron.cli.args``) and onto a
key of the ``"mechmon"`` section of a DeepSpeed config (snake_case of the same name).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.session.webhook import check_webhook_url

MONITOR_FAMILIES = ("attn", "router")
ACTIONS = ("log", "warn", "checkpoint-and-abort")
SNAPSHOT_DEVICES = ("auto", "device", "cpu", "pinned")
RESERVED_EXIT_CODES = {
    0: "success",
    1: "generic Python failure",
    16: "Megatron rerun machine",
    17: "Megatron rerun machine",
}


@dataclass(kw_only=True)
class MechmonConfig:
    """What the session monitors, how often, and what it does on an alarm."""

    enabled: bool = False
    """Master switch. A disabled session allocates nothing and registers no hooks."""

    interval: int = 100
    """Run a check every ``interval`` optimizer steps (iterations)."""

    delta: int = 100
    """Increment window in steps: a check at step t compares weights at t and t - delta."""

    monitors: tuple[str, ...] = MONITOR_FAMILIES
    """Monitor families to run: ``attn`` (Q/K increment spectra) and/or ``router`` (MoE)."""

    alpha: float = 2.0
    """Exponent of the spectral entropy: p_i = s_i^alpha / sum_j s_j^alpha (1 or 2 usual)."""

    qk_method: Literal["gram", "compressed"] = "gram"
    """Kernel for the per-head Delta spectra; both are exact up to round-off (see monitors)."""

    full_matrix_dw: bool = True
    """Also compute the spectrum of the whole layer's dW_q and dW_k (one owning rank per layer)."""

    full_matrix_method: Literal["randomized", "exact"] = "randomized"
    """Full-matrix dW spectrum: ``randomized`` (top ``full_matrix_rank`` singular values with a
    certified error bound, Halko et al. 2011; the whole spectrum, exact up to round-off, when
    ``full_matrix_rank >= min(m, n)``) or ``exact`` (fp64 SVD of the whole increment)."""

    full_matrix_rank: int = 128
    """Singular values kept by the randomized full-matrix spectrum (the entropy is over these)."""

    wq_norm_power_iters: int = 16
    """Power iterations for ||W_q||_2 (a certified lower bound; 0 = exact SVD norm)."""

    action: Literal["log", "warn", "checkpoint-and-abort"] = "warn"
    """``log``: scalars only; ``warn``: also a warning line per alarm; ``checkpoint-and-abort``:
    save a checkpoint on every rank, write ``mechmon_alert.json``, exit with ``exit_code``."""

    exit_code: int = 42
    """Process exit code after checkpoint-and-abort; non-zero and not 1, 16 or 17."""

    weights: Literal["main", "model"] = "main"
    """Which copy of W_q / W_k the monitors read: ``main`` = the FP32 main parameters the
    optimizer updates (where the host keeps them; megatron-core's mixed-precision and distributed
    optimizers, DeepSpeed's master weights), ``model`` = the model weights as the forward uses
    them (BF16 in mixed precision: their rounding adds white noise to dW that grows relative to
    the update as the learning rate decays; docs/PERFORMANCE.md). Without an FP32 main copy the
    model weight is read, with a notice."""

    snapshot_device: Literal["auto", "device", "cpu", "pinned"] = "auto"
    """Where the t - delta weight snapshots live: ``device`` = the weight's device, ``cpu`` =
    pageable host memory, ``pinned`` = page-locked host memory with asynchronous copies; ``auto``
    = ``device`` unless the snapshots would take more than ``snapshot_max_device_share`` of the
    accelerator's memory, then ``pinned`` (on a CPU job everything is host memory)."""

    snapshot_max_device_share: float = 0.02
    """Largest share of accelerator memory the snapshots may take under ``snapshot_device=auto``."""

    log_dir: Optional[str] = None
    """Own TensorBoard/JSONL output directory when the host provides no writer."""

    drill_at: Optional[int] = None
    """Raise a synthetic alarm at this iteration to rehearse the action path."""

    strict: bool = False
    """Re-raise monitor exceptions (default: log them, count them in ``mechmon/errors``, go on)."""

    collective_timeout: float = 120.0
    """Seconds one monitor collective may wait for its peers (mechmon's own process groups,
    ``session/collective_guard.py``); far below the host's ``--distributed-timeout-minutes``, so a
    failure inside a monitor collective turns the monitors off (or, under ``strict``, stops every
    rank) before training's own communicators time out."""

    per_head_scalars: bool = False
    """Write one scalar per head (many series); by default only layer mean/min and worst head."""

    router_entropy_bins: int = 512
    """Histogram bins over [0, log E] for routing-entropy quantiles (error <= log E / bins)."""

    router_min_effective_experts: Union[float, str] = "topk"
    """Absolute floor of the routing-entropy alarm, as an effective number of experts per token,
    exp(mean full-softmax entropy) in [1, E]. ``"topk"`` (default): the router's top-k, i.e.
    alarm when tokens spread their routing probability over fewer experts than each is dispatched
    to (the stable-winner loop has started). It judges the stream from the first check until
    the stream's warm-up values above it have formed the baseline (then the detector's CUSUM
    alone decides), so it catches a collapse that starts with training, which the warm-up would
    otherwise absorb, without alarming on a healthy router that sharpens slowly over a long run.
    ``0`` turns it off; top-1 routers have no floor under ``"topk"`` (exp(H) >= 1 always)."""

    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE
    """Expected false alarms per 1,000,000 training steps for the whole job: the one setting of
    the detector. Every CUSUM threshold follows from it through the measured null tails and a
    union bound over the job's tests and checks (docs/METHOD.md, "The whole-job detector")."""

    detector_calibration: Optional[str] = None
    """A null-tail table of your own healthy runs (``mechmon-calibrate``); default: the
    table shipped with the package (``mechmon_megatron/detect/null_tails.json``)."""

    alert_webhook: Optional[str] = None
    """http(s) URL that receives each alarm as Slack-compatible JSON from the writer rank (a daemon
    thread with a timeout and bounded retries: it never blocks or fails training)."""
    detector_shewhart: bool = False
    """Add a Shewhart limit beside every CUSUM (one check far beyond the null tail alarms at
    once; the union bound splits each test's probability between the two). Off by default until
    it is confirmed on held-out fault seeds (docs/RESULTS.md, "Designs evaluated and not adopted"). Needs a
    calibration with a ``shewhart`` section (the shipped one has it)."""

    short_window: bool = False
    """Also compute Delta2 over a short window ``interval`` steps long at every check, beside the
    ``delta``-step one, from the snapshot the ring already holds for the check at
    ``t - interval + delta`` (no extra memory): scalars ``mechmon/attn/delta2_entropy_short/...``
    and the detector family ``attn_delta2_short``, its own tests in the union bound. Needs
    ``delta`` a multiple of ``interval`` and larger than it, and a calibration with an
    ``attn_delta2_short`` section (the shipped one has none: off until calibrated, docs/RESULTS.md)."""

    extra: dict = field(default_factory=dict)
    """Host-specific extras (ignored by the session)."""

    def __post_init__(self) -> None:
        self.monitors = tuple(self.monitors)
        _require(self.interval >= 1, "interval", f"must be >= 1, got {self.interval}")
        _require(self.delta >= 1, "delta", f"must be >= 1, got {self.delta}")
        unknown = [m for m in self.monitors if m not in MONITOR_FAMILIES]
        _require(not unknown, "monitors", f"unknown families {unknown}; choose from {list(MONITOR_FAMILIES)}")
        _require(len(self.monitors) > 0, "monitors", "must name at least one family")
        # inf / nan would pass a bare "> 0" and then fail inside every check's spectral entropy.
        _require(
            isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and math.isfinite(self.alpha)
            and self.alpha > 0,
            "alpha",
            f"must be a finite number > 0, got {self.alpha!r}",
        )
        _require(
            self.qk_method in ("gram", "compressed"), "qk-method", f"must be gram or compressed, got {self.qk_method!r}"
        )
        _require(self.action in ACTIONS, "action", f"must be one of {list(ACTIONS)}, got {self.action!r}")
        _require(
            self.exit_code not in RESERVED_EXIT_CODES and 0 < self.exit_code < 256,
            "exit-code",
            f"must be in 2..255 and not 16 or 17 (reserved: {RESERVED_EXIT_CODES}), got {self.exit_code}",
        )
        _require(
            self.snapshot_device in SNAPSHOT_DEVICES,
            "snapshot-device",
            f"must be one of {list(SNAPSHOT_DEVICES)}, got {self.snapshot_device!r}",
        )
        _require(self.weights in ("main", "model"), "weights", f"must be main or model, got {self.weights!r}")
        _require(
            0 < self.snapshot_max_device_share <= 1,
            "snapshot-max-device-share",
            f"must be in (0, 1], got {self.snapshot_max_device_share!r}",
        )
        _require(
            self.full_matrix_method in ("randomized", "exact"),
            "full-matrix-method",
            f"must be randomized or exact, got {self.full_matrix_method!r}",
        )
        _require(self.full_matrix_rank >= 1, "full-matrix-rank", f"must be >= 1, got {self.full_matrix_rank}")
        _require(
            self.wq_norm_power_iters >= 0, "wq-norm-power-iters", f"must be >= 0, got {self.wq_norm_power_iters}"
        )
        _require(
            isinstance(self.collective_timeout, (int, float)) and not isinstance(self.collective_timeout, bool)
            and math.isfinite(self.collective_timeout) and self.collective_timeout > 0,
            "collective-timeout",
            f"must be a finite number of seconds > 0, got {self.collective_timeout!r}",
        )
        _require(self.drill_at is None or self.drill_at >= 1, "drill-at", f"must be >= 1, got {self.drill_at}")
        _require(self.router_entropy_bins >= 8, "router-entropy-bins", f"must be >= 8, got {self.router_entropy_bins}")
        self.router_min_effective_experts = _effective_experts_setting(self.router_min_effective_experts)
        _require(
            isinstance(self.false_alarm_rate, (int, float)) and math.isfinite(self.false_alarm_rate)
            and 0 < self.false_alarm_rate <= 1e6,
            "false-alarm-rate",
            f"must be a number in (0, 1e6] (false alarms per 10^6 steps), got {self.false_alarm_rate!r}",
        )
        if self.short_window:
            _require(
                self.delta > self.interval and self.delta % self.interval == 0,
                "short-window",
                f"needs --mechmon-delta a multiple of --mechmon-interval and larger than it (the short window "
                f"reuses the snapshot taken one interval before each check), got delta {self.delta}, interval "
                f"{self.interval}",
            )
        if self.detector_calibration is not None:
            _require(
                os.path.isfile(self.detector_calibration),
                "detector-calibration",
                f"must be a null-tail JSON file (mechmon-calibrate), got {self.detector_calibration!r}",
            )

        if self.alert_webhook is not None:
            # Parsed whole here, the one check every front end runs when it reads its flags: the
            # session's poster (writer rank, after the model is built) re-checks with the same
            # function, so a URL accepted here is never refused there.
            try:
                check_webhook_url(self.alert_webhook)
            except ValueError as exc:
                raise ValueError(f"--mechmon-alert-webhook {exc}") from None

    @property
    def overlap(self) -> int:
        """How many consecutive checks share one increment window: ceil(delta / interval)."""
        return max(1, math.ceil(self.delta / self.interval))

    def router_entropy_floor(self, num_experts: int, topk: int) -> Optional[float]:
        """Floor of one router's mean routing entropy in nats, or None when there is none.

        ``ValueError`` naming the flag when a fixed floor exceeds ``num_experts`` (it would
        alarm on a uniform router).
        """
        setting = self.router_min_effective_experts
        experts = float(topk) if setting == "topk" else float(setting)
        _require(
            experts <= num_experts,
            "router-min-effective-experts",
            f"is {experts:g}, more than the {num_experts} experts of the router (the most exp(entropy) can be)",
        )
        return math.log(experts) if experts > 1.0 else None

    def is_check_step(self, iteration: int) -> bool:
        """True when ``iteration`` (1-based, after the optimizer step) runs a check."""
        return self.enabled and iteration % self.interval == 0

    def is_snapshot_step(self, iteration: int) -> bool:
        """True when a weight snapshot must be taken after ``iteration`` for a later check."""
        return self.enabled and "attn" in self.monitors and (iteration + self.delta) % self.interval == 0

    def short_snapshot_key(self, iteration: int) -> int:
        """Ring key of the snapshot taken at ``iteration - interval``: the check step it serves."""
        return iteration - self.interval + self.delta

    def is_drill_step(self, iteration: int) -> bool:
        return self.enabled and self.drill_at is not None and iteration == self.drill_at


def _effective_experts_setting(value: Union[float, str]) -> Union[float, str]:
    """``"topk"``, or a number that is 0 (off) or >= 1, from the flag / JSON value."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "topk":
            return "topk"
        if text == "off":
            return 0.0
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"--mechmon-router-min-effective-experts must be topk, off, 0 or a number >= 1, got {value!r}"
            ) from None
    _require(
        not isinstance(value, bool) and math.isfinite(value) and (value == 0 or value >= 1),
        "router-min-effective-experts",
        f"must be topk, off, 0 or a number >= 1 (exp(entropy) is never below 1), got {value!r}",
    )
    return float(value)


def _require(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ValueError(f"--mechmon-{flag} {message}")
