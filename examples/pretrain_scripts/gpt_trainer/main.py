"""``main(argv, extra_args_providers, callbacks_factory)``: wire the pieces together.

``extra_args_providers``: Megatron-LM style ``fn(parser) -> parser`` functions adding flags.
``callbacks_factory``: ``fn(args) -> list of callbacks`` (called on every rank after the
process group exists), see ``callbacks.py`` for the hooks.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from mechmon_megatron.session.state_format import STATE_KEY

from .args import ArgsProvider, parse_args, validate_args

ROUTER_PARAM_PATTERN = "*.router.*"
"""megatron-core's router parameters (``decoder.layers.N.mlp.router.weight``, behind the DDP
wrapper's ``module.``), matched with ParamKey's shell-style name patterns."""


def router_lr_overrides(args) -> Optional[dict]:
    """Optimizer param-group overrides that scale the router's LR schedule by --router-lr-mult
    (warmup, peak and decay floor alike), or None when the multiplier is 1."""
    if args.router_lr_mult == 1.0:
        return None
    from megatron.core.optimizer import ParamKey

    mult = args.router_lr_mult
    return {ParamKey(name=ROUTER_PARAM_PATTERN): {"max_lr": args.lr * mult, "min_lr": args.min_lr * mult}}


def lr_bounds(optimizer) -> list[tuple[float, float]]:
    """Each optimizer param group's (max_lr, min_lr), as the flags set them (router groups scaled)."""
    return [(group["max_lr"], group["min_lr"]) for group in optimizer.param_groups]


def reconcile_lr_schedule(args, optimizer, scheduler, flag_bounds: list[tuple[float, float]],
                          saved: dict) -> Optional[str]:
    """After a load: the line that says whose LR schedule is in force, or None when the flags and
    the checkpoint agree.

    Loading restores the scheduler's bounds and, through the optimizer state, each param group's
    ``max_lr`` / ``min_lr``: the checkpoint's schedule wins over ``--lr`` / ``--min-lr``. With
    ``--override-opt_param-scheduler`` the flags win: the scheduler keeps the flags' bounds
    (megatron-core's override) and the param groups get them back here; the step count is the
    checkpoint's either way."""
    saved_lr, saved_min = saved.get("max_lr"), saved.get("min_lr")
    if args.override_opt_param_scheduler:
        for group, (max_lr, min_lr) in zip(optimizer.param_groups, flag_bounds):
            group["max_lr"], group["min_lr"] = max_lr, min_lr
        scheduler.step(increment=0)  # the current LR from the flags' bounds at the loaded step
        return (f"--override-opt_param-scheduler: LR schedule from the flags (--lr {args.lr:g}, --min-lr "
                f"{args.min_lr:g}), not the checkpoint's (lr {saved_lr}, min-lr {saved_min}); LR now "
                f"{optimizer.param_groups[0]['lr']:.6e}")
    if saved_lr is not None and (saved_lr, saved_min) != (args.lr, args.min_lr):
        return (f"the checkpoint's LR schedule (lr {saved_lr:g}, min-lr {saved_min:g}) is in force, not --lr "
                f"{args.lr:g} --min-lr {args.min_lr:g}: add --override-opt_param-scheduler to use the flags")
    return None


def main(argv: Optional[Sequence[str]] = None,
         extra_args_providers: Optional[Iterable[ArgsProvider]] = None,
         callbacks_factory: Optional[Callable[[Any], list]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # it logs every parameter name
    args = parse_args(argv, extra_args_providers)

    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat

    enable_cpu_compat()  # no-op with CUDA

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from .attention import AttentionStepCallback
    from .callbacks import CallbackList
    from .checkpoint import load_checkpoint
    from .data import SampleSchedule, open_stream
    from .loop import Trainer
    from .metrics import MetricsWriter, is_writer_rank
    from .model import build_model, build_transformer_config, model_dtype, wrap_ddp
    from .runtime import init_distributed, set_seeds

    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    init_distributed(args)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    validate_args(args, world)
    set_seeds(args.seed)

    config = build_transformer_config(args)
    model_chunks = [wrap_ddp(build_model(args, config), config, args.use_distributed_optimizer)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                        adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                        bf16=args.bf16, params_dtype=model_dtype(args),
                        use_distributed_optimizer=args.use_distributed_optimizer),
        model_chunks, config_overrides=router_lr_overrides(args))
    config.grad_scale_func = optimizer.scale_loss
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=args.lr_wsd_decay_iters * gbs if args.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style if args.lr_decay_style == "WSD" else None,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler)
    flag_bounds = lr_bounds(optimizer)

    callbacks = CallbackList([AttentionStepCallback(args)] + (callbacks_factory(args) if callbacks_factory else []))
    iteration = 0
    if args.load:
        iteration, extra, monitor_state = load_checkpoint(args.load, model_chunks, optimizer, scheduler,
                                                          step=args.ckpt_step,
                                                          flag_lr_bounds=args.override_opt_param_scheduler)
        # the other callbacks' states; mechmon's came from the distributed checkpoint (or, in an
        # older checkpoint, from the extra file, with a notice)
        states = {name: sd for name, sd in extra.get("callbacks", {}).items() if name != STATE_KEY}
        if monitor_state is not None:
            states[STATE_KEY] = monitor_state
        callbacks.load_state_dict(states)
        schedule_note = reconcile_lr_schedule(args, optimizer, scheduler, flag_bounds, extra.get("scheduler", {}))
        if rank == 0:
            print(f"loaded checkpoint from {args.load} at iteration {iteration}", flush=True)
            if schedule_note:
                print(schedule_note, flush=True)

    schedule = SampleSchedule(open_stream(args.data_path, args.corpus_max_bytes),
                              args.seq_length, args.seed)
    metrics = MetricsWriter(args, enabled=is_writer_rank(rank, world))
    trainer = Trainer(args=args, model_chunks=model_chunks, optimizer=optimizer,
                      scheduler=scheduler, schedule=schedule, callbacks=callbacks,
                      metrics=metrics, iteration=iteration)
    return trainer.run()
