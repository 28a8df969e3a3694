"""A small GPT-MoE on DeepSpeed's MoE layer, monitored by mechmon (``mechmon_megatron.deepspeed``).

Model: token + position embeddings, ``--num-layers`` pre-LN blocks of causal self-attention with
Hugging Face style ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (GQA with ``--num-kv-heads``) and a
``deepspeed.moe.layer.MoE`` feed-forward (``--num-experts`` GELU MLPs, top-``--topk`` gate,
expert parallel ``--ep-size``), tied LM head. Data: the byte-level Python-stdlib corpus of the
megatron-core example (``gpt_trainer/data.py``), DP-disjoint and a pure function of (seed, step).

    # one process, CPU
    DS_ACCELERATOR=cpu python examples/pretrain_scripts/deepspeed_moe_mechmon.py --train-iters 200
    # two processes: ZeRO-2 and expert parallel 2 (torchrun or the deepspeed launcher)
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/pretrain_scripts/deepspeed_moe_mechmon.py \
        --zero-stage 2 --ep-size 2 --global-batch-size 4 --save runs/ds_ckpt --save-interval 50
    deepspeed --num_gpus 2 examples/pretrain_scripts/deepspeed_moe_mechmon.py ...

The DeepSpeed config (``--deepspeed-config``, default ``ds_config_mechmon.json`` beside this
file) carries the ``"mechmon"`` section; ``--mechmon-set key=value`` overrides one of its keys
(the value is JSON, e.g. ``--mechmon-set drill_at=20 --mechmon-set action='"checkpoint-and-abort"'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def _load_data_module():
    """gpt_trainer/data.py without importing the (megatron-core) trainer package."""
    spec = importlib.util.spec_from_file_location("_mechmon_gpt_data", os.path.join(HERE, "gpt_trainer", "data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROGRESS_KEY = "example_progress"
"""The training loop's own client_state key: micro-batches and tokens this rank consumed."""


# ------------------------------------------------------------------------------------ model
class Attention(nn.Module):
    """Causal self-attention, Hugging Face layout (q_proj / k_proj / v_proj / o_proj), GQA."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_kv_heads
        self.head_dim = hidden // num_heads
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSH).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSH).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.ln1, self.ln2 = nn.LayerNorm(args.hidden_size), nn.LayerNorm(args.hidden_size)
        self.attn = Attention(args.hidden_size, args.num_heads, args.num_kv_heads or args.num_heads)
        if args.num_experts == 0:  # dense feed-forward (e.g. for ZeRO-3, which DeepSpeed MoE does not support)
            self.moe, self.mlp = None, Expert(args.hidden_size, args.ffn_hidden_size)
            return
        self.mlp = None
        self.moe = MoE(
            hidden_size=args.hidden_size,
            expert=Expert(args.hidden_size, args.ffn_hidden_size),
            num_experts=args.num_experts,
            ep_size=args.ep_size,
            k=args.topk,
            capacity_factor=args.capacity_factor,
            eval_capacity_factor=args.capacity_factor,
            min_capacity=4,
            drop_tokens=not args.no_drop_tokens,
            use_rts=False,  # deterministic routing: a pure function of the weights
            top2_2nd_expert_sampling=False,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        if self.moe is None:
            return x + self.mlp(self.ln2(x)), torch.zeros((), device=x.device)
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


def _init_module(module: nn.Module, gen: torch.Generator) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        with torch.no_grad():
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPTMoE(nn.Module):
    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, args.hidden_size)
        self.pos = nn.Embedding(args.seq_length, args.hidden_size)
        self.blocks = nn.ModuleList([Block(args) for _ in range(args.num_layers)])
        self.ln_f = nn.LayerNorm(args.hidden_size)

    def init_weights(self, seed: int, ep_rank: int) -> None:
        """Normal(0, 0.02) weights, zero biases. Non-expert modules draw from one seeded stream in
        module order; expert ``e`` of layer ``l`` from its own seed (global expert index), so any
        expert-parallel layout holds the same weights as one process."""
        gen = torch.Generator().manual_seed(seed)
        experts = [block.moe.deepspeed_moe.experts.deepspeed_experts for block in self.blocks if block.moe is not None]
        expert_modules = {id(m) for group in experts for e in group for m in e.modules()}
        for module in self.modules():
            if id(module) not in expert_modules:
                _init_module(module, gen)
        for layer, group in enumerate(experts):
            for local, expert in enumerate(group):
                global_index = ep_rank * len(group) + local
                expert_gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 1_009 + global_index + 1)
                for module in expert.modules():
                    _init_module(module, expert_gen)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        aux = torch.zeros((), device=tokens.device)
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = self.ln_f(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)), aux


# ------------------------------------------------------------------------------------ setup
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--deepspeed-config",
        default=os.path.join(HERE, "ds_config_mechmon.json"),
        help='DeepSpeed JSON config (with a "mechmon" section).',
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="Set by the deepspeed launcher.")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=None, help="Key/value heads (GQA); default = --num-heads.")
    p.add_argument("--ffn-hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--num-experts", type=int, default=8, help="Experts per layer; 0 = dense FFN.")
    p.add_argument("--topk", type=int, default=2, choices=(1, 2))
    p.add_argument("--ep-size", type=int, default=1, help="Expert-parallel size (divides the world and --num-experts).")
    p.add_argument("--capacity-factor", type=float, default=2.0)
    p.add_argument("--no-drop-tokens", action="store_true", help="Unbounded expert capacity (no token dropping).")
    p.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--lr", type=float, default=2e-3, help="Peak learning rate.")
    p.add_argument("--min-lr", type=float, default=None, help="Final LR of the cosine decay (default lr/10).")
    p.add_argument("--lr-warmup-iters", type=int, default=100)
    p.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="On --load, the peak LR comes from --lr, not from the checkpoint's LR scheduler (whose "
                        "step count is kept), as Megatron-LM's flag; mechmon-supervise adds it with every LR "
                        "remedy.")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument(
        "--micro-batch-size", type=int, default=None, help="Per rank; default = global / data-parallel size."
    )
    p.add_argument(
        "--zero-stage", type=int, default=None, choices=(0, 1, 2, 3), help="Override zero_optimization.stage."
    )
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--corpus-max-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--save", default=None, help="Checkpoint directory (engine.save_checkpoint).")
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--load", default=None, help="Resume from this checkpoint directory (latest tag).")
    p.add_argument("--ckpt-tag", default=None,
                   help="With --load: resume from this tag (e.g. global_step20) instead of the 'latest' file's "
                        "(mechmon-supervise --select-flag=--ckpt-tag).")
    p.add_argument(
        "--monitor-dir", default=None, help="Override csv_monitor.output_path (and tensorboard's, if enabled)."
    )
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--no-shm-comm-op", action="store_true",
                   help="CPU: do not JIT-build/load DeepSpeed's shared-memory comm op (gloo does every collective).")
    p.add_argument(
        "--mechmon-set", action="append", default=[], metavar="KEY=JSON", help="Override a key of the mechmon section."
    )
    return p


def ds_config_from_args(args: argparse.Namespace, world: int) -> dict:
    with open(args.deepspeed_config, encoding="utf-8") as f:
        config = json.load(f)
    micro = args.micro_batch_size or args.global_batch_size // world
    if micro < 1 or args.global_batch_size % (micro * world):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of micro batch {micro} x world {world}"
        )
    config["train_batch_size"] = args.global_batch_size
    config["train_micro_batch_size_per_gpu"] = micro
    config.pop("gradient_accumulation_steps", None)
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.monitor_dir:
        for key in ("csv_monitor", "tensorboard"):
            if key in config:
                config[key]["output_path"] = args.monitor_dir
    section = config.get("mechmon")
    for item in args.mechmon_set:
        if section is None:  # --mechmon-set on a config without the section starts one
            section = config["mechmon"] = {}
        key, _, value = item.partition("=")
        try:
            section[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            section[key.strip()] = value  # a bare string
    # Only a section that exists gains the abort folder: a config without one stays unmonitored
    # (a section of checkpoint_dir alone, with no "enabled", is refused).
    if args.save and section and "checkpoint_dir" not in section:
        section["checkpoint_dir"] = args.save
    return config


def lr_lambda(args: argparse.Namespace):
    min_ratio = (args.min_lr if args.min_lr is not None else args.lr / 10) / args.lr

    def factor(step: int) -> float:  # step = optimizer steps done so far
        if step < args.lr_warmup_iters:
            return (step + 1) / args.lr_warmup_iters
        progress = min(1.0, (step - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def reconcile_lr_schedule(args: argparse.Namespace, scheduler) -> str | None:
    """After ``engine.load_checkpoint``: the line that says whose LR schedule is in force, or None
    when the flags and the checkpoint agree.

    DeepSpeed restores the scheduler's state (``LambdaLR``: ``base_lrs``, the peak LR, and
    ``last_epoch``), so the checkpoint's peak LR wins over ``--lr``; ``load_lr_scheduler_states=False``
    would restart the schedule at step 0. With ``--override-opt_param-scheduler`` the peak comes from
    ``--lr`` and the step from the checkpoint (the decay floor ``--min-lr`` is read by the lambda
    itself, so it always follows the flags)."""
    saved = list(scheduler.base_lrs)
    if args.override_opt_param_scheduler:
        scheduler.base_lrs = [args.lr for _ in saved]
        for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"] = args.lr
            group["lr"] = args.lr * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        return (f"--override-opt_param-scheduler: peak LR from --lr {args.lr:g}, not the checkpoint's "
                f"{saved[0]:g}; LR now {scheduler._last_lr[0]:.6e}")
    if any(lr != args.lr for lr in saved):
        return (f"the checkpoint's peak LR {saved[0]:g} is in force, not --lr {args.lr:g}: add "
                "--override-opt_param-scheduler to use the flag")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # mechmon reports through logging (its start-up lines, alarms, failures), as in the trainer.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from mechmon_megatron.adapters.deepspeed import parse_section

    try:  # the whole mechmon section, checked before any process group or model exists
        parse_section(ds_config_from_args(args, int(os.environ.get("WORLD_SIZE", "1"))).get("mechmon") or {})
    except ValueError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import mechmon_megatron.deepspeed as mechmon_ds

    if args.no_shm_comm_op:
        # DeepSpeed builds deepspeed_shm_comm (tens of seconds, once per machine) when it is marked
        # compatible; marking it incompatible keeps the plain gloo/torch.distributed path.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ds_config = ds_config_from_args(args, world)
    data = _load_data_module()
    schedule = data.SampleSchedule(data.stdlib_corpus(args.corpus_max_bytes), args.seq_length, args.seed)

    torch.manual_seed(args.seed)
    model = GPTMoE(args, data.BYTE_VOCAB_SIZE)
    # DeepSpeed's expert-parallel groups are consecutive ranks, so the EP rank is rank % ep_size.
    model.init_weights(args.seed, ep_rank=rank % args.ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters", "weight_decay": args.weight_decay}
    )
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    # The loop's own state, saved in every checkpoint's client_state (the abort's too, through
    # client_state_fn): a resume restores it beside mechmon's detector state.
    progress = {"micro_batches": 0, "tokens": 0}

    def client_state() -> dict:
        return {PROGRESS_KEY: dict(progress)}

    # reads ds_config["mechmon"]; the schedule is lr_lambda's (the early-phase correction compares it)
    mechmon = mechmon_ds.attach(engine, client_state_fn=client_state,
                                lr_schedule=mechmon_ds.TrainingSchedule(args.lr_warmup_iters, "cosine", args.lr))

    if args.load:
        # restores the mechmon detector state too
        load_path, loaded = engine.load_checkpoint(args.load, tag=args.ckpt_tag)
        progress.update((loaded or {}).get(PROGRESS_KEY, {}))
        schedule_note = reconcile_lr_schedule(args, scheduler)
        if rank == 0:
            print(f"resumed from {load_path} at step {engine.global_steps}; {PROGRESS_KEY} {json.dumps(progress)}",
                  flush=True)
            if schedule_note:
                print(schedule_note, flush=True)

    micro = engine.train_micro_batch_size_per_gpu()
    start = time.perf_counter()
    while engine.global_steps < args.train_iters:
        iteration = engine.global_steps + 1
        losses = []
        for batch in schedule.micro_batches(iteration, args.global_batch_size, micro, rank, world):
            tokens, labels = batch["tokens"].to(engine.device), batch["labels"].to(engine.device)
            lm_loss, aux = engine(tokens, labels)
            engine.backward(lm_loss + args.aux_loss_coeff * aux)
            progress["micro_batches"] += 1
            progress["tokens"] += tokens.numel()
            engine.step()  # mechmon runs here on applied steps (and may save and exit on an alarm)
            losses.append(lm_loss.detach())
        loss = torch.stack(losses).mean()
        torch.distributed.all_reduce(loss)
        loss = float(loss) / world
        if rank == 0:
            if engine.monitor.enabled:
                engine.monitor.write_events([("Train/lm_loss", loss, iteration)])
            if iteration % args.log_interval == 0 or iteration == 1:
                elapsed = time.perf_counter() - start
                print(f"iter {iteration} loss {loss:.4f} lr {engine.get_lr()[0]:.3e} ({elapsed:.1f}s)", flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            engine.save_checkpoint(args.save, client_state=client_state())  # mechmon adds its state
    if args.save and (not args.save_interval or args.train_iters % args.save_interval):
        engine.save_checkpoint(args.save, client_state=client_state())
    mechmon.detach()
    # Leave together: a rank that exits while a peer is still inside a gloo collective makes the
    # peer's gloo thread abort ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """Exit with ``code`` at once, without the interpreter's teardown (the script's last step).

    gloo's worker threads outlive ``destroy_process_group`` while any Python object still refers to
    a group (DeepSpeed keeps its groups in module globals), and a worker that drops a collective's
    last tensor while the interpreter finalizes needs the GIL it can no longer take: the process
    then aborts (exit -6) after a run that succeeded. Everything is written by then: checkpoints
    and the csv monitor synchronously, mechmon's writers closed by ``detach``."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
