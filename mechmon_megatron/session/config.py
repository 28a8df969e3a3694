"""Configuration of a monitoring session (host-agnostic), and the one source of every setting.

Every field but ``extra`` carries its :class:`~mechmon_megatron.session.options.Option` in its
``dataclasses.field`` metadata: flag, kind, unit, one-line help and single-field validator. The
``--mechmon-*`` flags (``mechmon_megatron.cli.args``), the keys of the ``"mechmon"`` section of a
DeepSpeed config (the field names) and the flags ``mechmon-scan`` shares are generated from it
(:data:`OPTIONS`). A bad value is a :class:`~mechmon_megatron.detect.config_error.ConfigError`
naming the field; each front end spells the name its own way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping, Optional, Union

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.session.options import (
    OPTION,
    Option,
    at_least,
    calibration_file,
    effective_experts,
    false_alarm_rate,
    finite_positive,
    option,
    share,
    some_of,
    webhook_url,
)

MONITOR_FAMILIES = ("attn", "router")
ACTIONS = ("log", "warn", "checkpoint-and-abort")
SNAPSHOT_DEVICES = ("auto", "device", "cpu", "pinned")
RESERVED_EXIT_CODES = {
    0: "success",
    1: "generic Python failure",
    16: "Megatron rerun machine",
    17: "Megatron rerun machine",
}


def _exit_code(code: int) -> Optional[str]:
    if code not in RESERVED_EXIT_CODES and 0 < code < 256:
        return None
    return f"must be in 2..255 and not 16 or 17 (reserved: {RESERVED_EXIT_CODES}), got {code}"


@dataclass(kw_only=True)
class MechmonConfig:
    """What the session monitors, how often, and what it does on an alarm."""

    enabled: bool = field(default=False, metadata=option(
        kind="bool", flag="--mechmon", help="Enable the mechanism monitors.",
        doc="enable the monitors; any other `--mechmon-*` flag without it stops the job at start-up (below)"))
    """Master switch. A disabled session allocates nothing and registers no hooks."""

    interval: int = field(default=100, metadata=option(
        kind="int", unit="steps", check=at_least(1), metavar="N", help="Check every N iterations.",
        doc="run a check every N iterations"))
    """Run a check every ``interval`` optimizer steps (iterations)."""

    delta: int = field(default=100, metadata=option(
        kind="int", unit="steps", check=at_least(1), metavar="N",
        help="Increment window (iterations): compare weights at t and t - delta.",
        doc="increment window: compare weights at t and t - N"))
    """Increment window in steps: a check at step t compares weights at t and t - delta."""

    monitors: tuple[str, ...] = field(default=MONITOR_FAMILIES, metadata=option(
        kind="list", choices=MONITOR_FAMILIES, check=some_of(MONITOR_FAMILIES), metavar=",".join(MONITOR_FAMILIES),
        default_text="both", help=f"Comma-separated monitor families from {list(MONITOR_FAMILIES)}.",
        doc="monitor families"))
    """Monitor families to run: ``attn`` (Q/K increment spectra) and/or ``router`` (MoE)."""

    alpha: float = field(default=2.0, metadata=option(
        kind="float", check=finite_positive(), metavar="A",
        help="Spectral-entropy exponent (2 = energy, 1 = Roy-Vetterli)."))
    """Exponent of the spectral entropy: p_i = s_i^alpha / sum_j s_j^alpha (1 or 2 usual)."""

    qk_method: Literal["gram", "compressed"] = field(default="gram", metadata=option(
        kind="choice", choices=("gram", "compressed"), help="Per-head kernel: gram (fast) or compressed (QR).",
        doc="per-head kernel (both exact; see docs/PERFORMANCE.md)"))
    """Kernel for the per-head Delta spectra; both are exact up to round-off (see monitors)."""

    full_matrix_dw: bool = field(default=True, metadata=option(
        kind="bool", flag="--mechmon-no-full-matrix-dw", negated=True,
        help="Skip the full-matrix dW_q/dW_k spectra (saves a TP gather).",
        doc="skip the whole-layer dW spectra (saves a TP gather and an SVD)"))
    """Also compute the spectrum of the whole layer's dW_q and dW_k (one owning rank per layer)."""

    full_matrix_method: Literal["randomized", "exact"] = field(default="randomized", metadata=option(
        kind="choice", choices=("randomized", "exact"),
        help="Full-matrix dW spectrum: randomized (top-k with a certified bound) or exact (full SVD).",
        doc="whole-layer dW spectrum: top-k with a certified error bound, or the full fp64 SVD"))
    """Full-matrix dW spectrum: ``randomized`` (top ``full_matrix_rank`` singular values with a
    certified error bound, Halko et al. 2011; the whole spectrum, exact up to round-off, when
    ``full_matrix_rank >= min(m, n)``) or ``exact`` (fp64 SVD of the whole increment)."""

    full_matrix_rank: int = field(default=128, metadata=option(
        kind="int", unit="singular values", check=at_least(1), metavar="K",
        help="Singular values kept by the randomized full-matrix spectrum.",
        doc="singular values the randomized spectrum keeps (all of them, exactly, when K >= the matrix's smaller "
            "side)"))
    """Singular values kept by the randomized full-matrix spectrum (the entropy is over these)."""

    wq_norm_power_iters: int = field(default=16, metadata=option(
        kind="int", unit="iterations", check=at_least(0), metavar="N",
        help="Power iterations for the W_q spectral norm (0: exact SVD).",
        doc="power iterations for `||W_q||_2` (a lower bound; 0 = exact SVD)"))
    """Power iterations for ||W_q||_2 (a certified lower bound; 0 = exact SVD norm)."""

    action: Literal["log", "warn", "checkpoint-and-abort"] = field(default="warn", metadata=option(
        kind="choice", choices=ACTIONS, help=f"On alarm: one of {list(ACTIONS)}.", doc="what an alarm does"))
    """``log``: scalars only; ``warn``: also a warning line per alarm; ``checkpoint-and-abort``:
    save a checkpoint on every rank, write ``mechmon_alert.json``, exit with ``exit_code``."""

    exit_code: int = field(default=42, metadata=option(
        kind="int", check=_exit_code, metavar="C", help="Exit code after checkpoint-and-abort (not 0, 1, 16, 17)."))
    """Process exit code after checkpoint-and-abort; non-zero and not 1, 16 or 17."""

    weights: Literal["main", "model"] = field(default="main", metadata=option(
        kind="choice", choices=("main", "model"),
        help="Read the FP32 main parameters the optimizer updates (main) or the model weights (model).",
        doc="read the FP32 main parameters the optimizer updates (megatron-core's mixed-precision and distributed "
            "optimizers: the distributed optimizer's shards of each layer's Q and K rows gathered to the replica "
            "that uses the layer, on check and snapshot steps only, with no model-wide parameter gather) or the "
            "model weights (BF16 rounding noise blunts dW late in training: docs/PERFORMANCE.md); without an FP32 "
            "copy the model weight is read with a notice; FP8 / quantized weights are dequantized or refused at "
            "start-up naming the layer; DeepSpeed: `main` only"))
    """Which copy of W_q / W_k the monitors read: ``main`` = the FP32 main parameters the
    optimizer updates (where the host keeps them; megatron-core's mixed-precision and distributed
    optimizers, DeepSpeed's master weights), ``model`` = the model weights as the forward uses
    them (BF16 in mixed precision: their rounding adds white noise to dW that grows relative to
    the update as the learning rate decays; docs/PERFORMANCE.md). Without an FP32 main copy the
    model weight is read, with a notice."""

    snapshot_device: Literal["auto", "device", "cpu", "pinned"] = field(default="auto", metadata=option(
        kind="choice", choices=SNAPSHOT_DEVICES,
        help="Where weight snapshots live: auto, device, cpu or pinned (page-locked host memory).",
        doc="where the t - delta snapshots live; `auto`: on the device unless they would take more than the share "
            "below, then page-locked host memory with asynchronous copies"))
    """Where the t - delta weight snapshots live: ``device`` = the weight's device, ``cpu`` =
    pageable host memory, ``pinned`` = page-locked host memory with asynchronous copies; ``auto``
    = ``device`` unless the snapshots would take more than ``snapshot_max_device_share`` of the
    accelerator's memory, then ``pinned`` (on a CPU job everything is host memory)."""

    snapshot_max_device_share: float = field(default=0.02, metadata=option(
        kind="float", unit="share of device memory", check=share, metavar="F",
        help="Under --mechmon-snapshot-device auto: the largest share of accelerator memory snapshots may take "
             "before they move to pinned host memory.",
        doc="the largest share of accelerator memory `auto` lets snapshots take"))
    """Largest share of accelerator memory the snapshots may take under ``snapshot_device=auto``."""

    log_dir: Optional[str] = field(default=None, metadata=option(
        kind="str", optional=True, metavar="DIR", help="Own TensorBoard + JSONL output when the host has no writer.",
        doc="own TensorBoard + `mechmon_scalars.jsonl` when the host has no writer; a fresh start (no monitor state "
            "loaded) into a folder with records appends them as a new run (each row's `run`, one marker per launch "
            "in `mechmon_runs.jsonl`; a resume continues its run), and the calibration tools read the runs apart"))
    """Own TensorBoard/JSONL output directory when the host provides no writer."""

    drill_at: Optional[int] = field(default=None, metadata=option(
        kind="int", optional=True, unit="iteration", check=at_least(1), metavar="N",
        help="Raise a synthetic alarm at this iteration (rehearse the action).",
        doc="synthetic alarm at iteration N (rehearse the action)"))
    """Raise a synthetic alarm at this iteration to rehearse the action path."""

    strict: bool = field(default=False, metadata=option(
        kind="bool", help="Let monitor exceptions stop training (default: log and count).",
        doc="a monitor failure on any rank stops every rank at that check with the same error (default: logged "
            "with rank, phase and layer, counted in `mechmon/errors`, training goes on)"))
    """Re-raise monitor exceptions (default: log them, count them in ``mechmon/errors``, go on)."""

    collective_timeout: float = field(default=120.0, metadata=option(
        kind="float", unit="seconds", host_default=True, check=finite_positive("number of seconds"), metavar="S",
        default_text="120, or a quarter of `--distributed-timeout-minutes` when shorter",
        help="Seconds a monitor collective waits for its peers before the monitors turn off on every rank "
             "(--mechmon-strict: every rank stops); default 120, or a quarter of --distributed-timeout-minutes "
             "when that is shorter; must stay below half of it.",
        doc="seconds a monitor collective waits for its peers (mechmon's own process groups); a collective that "
            "fails or hangs on one rank then turns the monitors off on every rank (or, with `--mechmon-strict`, "
            "stops every rank); must stay below half of the host's timeout (DeepSpeed: default 120; keep it below "
            "DeepSpeed's own process-group timeout)"))
    """Seconds one monitor collective may wait for its peers (mechmon's own process groups,
    ``session/collective_guard.py``); far below the host's ``--distributed-timeout-minutes``, so a
    failure inside a monitor collective turns the monitors off (or, under ``strict``, stops every
    rank) before training's own communicators time out."""

    per_head_scalars: bool = field(default=False, metadata=option(
        kind="bool", help="Also write one Delta2 scalar per head.", doc="one Delta2 scalar per head"))
    """Write one scalar per head (many series); by default only layer mean/min and worst head."""

    router_entropy_bins: int = field(default=512, metadata=option(
        kind="int", unit="bins", check=at_least(8), metavar="N",
        help="Histogram bins for the routing-entropy quantiles (error <= log E / bins).",
        doc="histogram bins of the routing-entropy quantiles"))
    """Histogram bins over [0, log E] for routing-entropy quantiles (error <= log E / bins)."""

    router_min_effective_experts: Union[float, str] = field(default="topk", metadata=option(
        kind="number_or_choice", choices=("topk",), unit="experts per token", check=effective_experts,
        metavar="M|topk|off",
        help="Routing-entropy floor as effective experts per token, exp(mean entropy): topk (default), a number "
             ">= 1, or off.",
        doc="routing-entropy floor until the baseline is formed: exp(mean entropy) < M effective experts per token "
            "is out of band (below)"))
    """Absolute floor of the routing-entropy alarm, as an effective number of experts per token,
    exp(mean full-softmax entropy) in [1, E]. ``"topk"`` (default): the router's top-k, i.e.
    alarm when tokens spread their routing probability over fewer experts than each is dispatched
    to (the stable-winner loop has started). It judges the stream from the first check until
    the stream's warm-up values above it have formed the baseline (then the detector's CUSUM
    alone decides), so it catches a collapse that starts with training, which the warm-up would
    otherwise absorb, without alarming on a healthy router that sharpens slowly over a long run.
    ``0`` turns it off; top-1 routers have no floor under ``"topk"`` (exp(H) >= 1 always)."""

    false_alarm_rate: float = field(default=DEFAULT_FALSE_ALARM_RATE, metadata=option(
        kind="float", unit="false alarms per 10^6 steps", check=false_alarm_rate, metavar="R",
        help="Expected false alarms per 1,000,000 steps for the whole job (default 0.01); every detector "
             "threshold follows from it.",
        doc="expected false alarms per 1,000,000 steps for the whole job; every threshold follows from it (below)"))
    """Expected false alarms per 1,000,000 training steps for the whole job: the one setting of
    the detector. Every CUSUM threshold follows from it through the measured null tails and a
    union bound over the job's tests and checks (docs/METHOD.md, "The whole-job detector")."""

    detector_calibration: Optional[str] = field(default=None, metadata=option(
        kind="str", optional=True, check=calibration_file, metavar="FILE", default_text="shipped",
        help="Null-tail table of your own healthy runs (mechmon-calibrate); default: the shipped one.",
        doc="null tails fitted on your own healthy runs (`mechmon-calibrate`)"))
    """A null-tail table of your own healthy runs (``mechmon-calibrate``); default: the
    table shipped with the package (``mechmon_megatron/detect/null_tails.json``)."""

    alert_webhook: Optional[str] = field(default=None, metadata=option(
        kind="str", optional=True, check=webhook_url, metavar="URL",
        help="http(s) URL: each alarm is posted there as Slack-compatible JSON (writer rank, never blocks).",
        doc="post each alarm as Slack-compatible JSON from the writer rank (daemon thread, timeout and bounded "
            "retries: never blocks or fails training; the first message not delivered is one warning naming the "
            "host and why, later ones are counted and reported once at exit); the URL is parsed whole at start-up "
            "(below)"))
    """http(s) URL that receives each alarm as Slack-compatible JSON from the writer rank (a daemon
    thread with a timeout and bounded retries: it never blocks or fails training)."""

    detector_shewhart: bool = field(default=False, metadata=option(
        kind="bool",
        help="Also alarm at once on one check far beyond the null tail (Shewhart limit; off by default).",
        doc="also alarm at once on one check far beyond its null tail (Shewhart limit beside each CUSUM; the union "
            "bound splits each test's share; off until confirmed on held-out seeds, docs/METHOD.md section 7)"))
    """Add a Shewhart limit beside every CUSUM (one check far beyond the null tail alarms at
    once; the union bound splits each test's probability between the two). Off by default until
    it is confirmed on held-out fault seeds (docs/RESULTS.md, "Designs evaluated and not adopted"). Needs a
    calibration with a ``shewhart`` section (the shipped one has it)."""

    short_window: bool = field(default=False, metadata=option(
        kind="bool",
        help="Also compute Delta2 over the last --mechmon-interval steps at every check (detector family "
             "attn_delta2_short; needs a calibration with that family; off by default).",
        doc="also compute Delta2 over the last `--mechmon-interval` steps at every check, from the snapshot the "
            "ring already holds (no extra memory), as its own detector family `attn_delta2_short` in the union "
            "bound, and records the persistence of its leading direction across adjacent short windows; needs "
            "delta a multiple of interval and larger, and a calibration with that family (the shipped one has none "
            "yet: off until calibrated, docs/METHOD.md section 7, 6b)"))
    """Also compute Delta2 over a short window ``interval`` steps long at every check, beside the
    ``delta``-step one, from the snapshot the ring already holds for the check at
    ``t - interval + delta`` (no extra memory): scalars ``mechmon/attn/delta2_entropy_short/...``
    and the detector family ``attn_delta2_short``, its own tests in the union bound. Needs
    ``delta`` a multiple of ``interval`` and larger than it, and a calibration with an
    ``attn_delta2_short`` section (the shipped one has none: off until calibrated, docs/RESULTS.md)."""

    extra: dict = field(default_factory=dict)
    """Host-specific extras (ignored by the session)."""

    def __post_init__(self) -> None:
        # One field at a time (its Option: type, then its validator), in declaration order ...
        for f in dataclasses.fields(self):
            opt = f.metadata.get(OPTION)
            if opt is None:
                continue
            value = opt.normalise(getattr(self, f.name))
            reason = opt.problem(value)
            if reason is not None:
                raise ConfigError(f.name, reason)
            setattr(self, f.name, value)
        # ... then the checks that combine fields.
        if self.short_window and not (self.delta > self.interval and self.delta % self.interval == 0):
            raise ConfigError(
                "short_window",
                f"needs $delta a multiple of $interval and larger than it (the short window reuses the snapshot "
                f"taken one interval before each check), got delta {self.delta}, interval {self.interval}",
            )

    @property
    def overlap(self) -> int:
        """How many consecutive checks share one increment window: ceil(delta / interval)."""
        return max(1, math.ceil(self.delta / self.interval))

    def router_entropy_floor(self, num_experts: int, topk: int) -> Optional[float]:
        """Floor of one router's mean routing entropy in nats, or None when there is none.

        ``ConfigError`` (``router_min_effective_experts``) when a fixed floor exceeds
        ``num_experts`` (it would alarm on a uniform router).
        """
        setting = self.router_min_effective_experts
        experts = float(topk) if setting == "topk" else float(setting)
        if experts > num_experts:
            raise ConfigError(
                "router_min_effective_experts",
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


OPTIONS: Mapping[str, Option] = MappingProxyType(
    {f.name: f.metadata[OPTION] for f in dataclasses.fields(MechmonConfig) if OPTION in f.metadata}
)
"""Field name -> its setting, in declaration order (every field but ``extra``)."""

_DEFAULTS = MechmonConfig()


def default_of(name: str) -> Any:
    """The field's default (the setting of a front end that says nothing)."""
    return getattr(_DEFAULTS, name)


def flag_of(name: str) -> str:
    """The command-line spelling of a field: ``interval`` -> ``--mechmon-interval`` (``enabled``:
    ``--mechmon``; ``full_matrix_dw``: ``--mechmon-no-full-matrix-dw``, the flag that sets it)."""
    opt = OPTIONS.get(name)
    return opt.flag if opt is not None and opt.flag else "--mechmon-" + name.replace("_", "-")


def argparse_kwargs(name: str) -> dict[str, Any]:
    """``add_argument`` keywords of the field's flag (type, command-line default, help; or
    ``store_true``), for any parser that offers it under any spelling."""
    return OPTIONS[name].argparse_kwargs(default_of(name))
