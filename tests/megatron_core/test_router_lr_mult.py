"""``--router-lr-mult`` of the example trainer: only the MoE router's LR schedule is scaled."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.megatron_core._torchrun import REPO_ROOT, run_python

pytest.importorskip("megatron.core")

SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {trainer_dir!r})
    from gpt_trainer import main

    class GroupRecorder:
        name = "groups"

        def __init__(self, args):
            self.args, self.rows = args, []

        def on_train_start(self, ctx):
            self.ctx = ctx

        def on_step_start(self, iteration):
            pass

        def on_step_end(self, iteration, ctx):
            names = {{id(p): n for n, p in ctx.model_chunks[0].named_parameters()}}
            groups = [{{"lr": g["lr"], "names": sorted(names[id(p)] for p in g["params"])}}
                      for g in ctx.optimizer.param_groups if g["params"]]
            self.rows.append(groups)
            with open(self.args.groups_out, "w") as f:
                json.dump(self.rows, f)

    def provider(parser):
        parser.add_argument_group("test").add_argument("--groups-out", required=True)
        return parser

    if __name__ == "__main__":
        sys.exit(main(extra_args_providers=[provider], callbacks_factory=lambda a: [GroupRecorder(a)]))
''')

TINY_MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--train-iters", "4",
            "--corpus-max-bytes", "200000", "--seed", "7"]


def test_router_lr_mult_scales_only_the_router_group(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT.format(trainer_dir=str(REPO_ROOT / "examples" / "pretrain_scripts")))
    out = tmp_path / "groups.json"
    run_python(script, [*TINY_MOE, "--router-lr-mult", "10", "--groups-out", out], timeout_s=120).check()
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for groups in rows:  # every step: warmup (1, 2), then cosine decay (3, 4)
        router = [g for g in groups if any(".router." in n for n in g["names"])]
        others = [g for g in groups if g not in router]
        assert len(router) == 1 and all(".router." in n for n in router[0]["names"])
        assert len(router[0]["names"]) == 2  # one router per MoE layer
        assert others and all(g["lr"] > 0 for g in others)
        for g in others:
            assert router[0]["lr"] == pytest.approx(10 * g["lr"], rel=1e-12)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_router_lr_mult_must_be_positive(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT.format(trainer_dir=str(REPO_ROOT / "examples" / "pretrain_scripts")))
    result = run_python(
        script, [*TINY_MOE, "--router-lr-mult", "0", "--groups-out", tmp_path / "g.json"], timeout_s=120
    )
    assert result.returncode != 0 and "--router-lr-mult must be > 0" in result.output
