"""Small ``pretrain_gpt.py`` files with the structure of each Megatron-LM release, and a fake
``megatron.training`` tree they run against (Megatron-LM's own files are never committed).

Written for these tests, modelled on the structure of the release files (read at the tags
core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0 and main of 2026-08-22), keeping only
what matters to the three insertion points:

* every release (keeping the lines the frozen diffs use as context): imports interleaved with
  statements (``_PROGRAM_START_TIME = time.time()``, a
  ``rank = ...`` / ``if rank != 0:`` warnings block), the import block ending with
  ``try: from megatron.post_training.arguments import add_modelopt_args ... except
  ImportError``, then ``stimer = ...``; ``if __name__ == "__main__":`` at the end, with
  ``pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)``;
* core_v0.16 / core_v0.17: the provider is a keyword of the multi-line ``pretrain(`` call
  (0.17 only moves lines: more helpers above);
* core_v0.18: black-formatted imports; ``args = parse_and_validate_args(extra_args_provider=...,
  args_defaults=...)`` then ``pretrain(full_config,`` with its first argument on the call line
  and no provider;
* core_v0.19: a longer ``try`` block, a comment and ``BATCH_KEYS`` after ``stimer``, a decorated
  function, ``if has_nvidia_modelopt:`` after the parsing call, ``pretrain(`` with
  ``full_config`` on its own line;
* main (0.20.0): as 0.19, plus a function defined inside the top ``if rank != 0:`` block.

The fake ``megatron.training`` keeps the real call order and name bindings: ``initialize.py``
imports ``parse_args`` by name and calls it from ``initialize_megatron`` (<= 0.17), the script
imports ``parse_and_validate_args`` by name (>= 0.18), ``inprocess_restart`` calls
``arguments.parse_args(ignore_unknown_args=True)`` first. It prints what it sees.
"""

from __future__ import annotations

import os
import textwrap

RELEASES = {"core_v0.16": (0, 16, 1), "core_v0.17": (0, 17, 1), "core_v0.18": (0, 18, 2),
            "core_v0.19": (0, 19, 1), "main": (0, 20, 0)}

_HEAD_OLD = '''\
"""Pretrain GPT (synthetic, release structure only)."""

# program start time before heavy imports
import time
_PROGRAM_START_TIME = time.time()

import json

# warnings on rank 0 only
import os
import warnings
rank = int(os.environ.get('RANK', 0))
if rank != 0:
    warnings.filterwarnings("ignore", category=UserWarning)

from functools import partial

import torch

from gpt_builders import gpt_builder
from megatron.core.utils import StragglerDetector
from megatron.training import get_args, inprocess_restart, pretrain, print_rank_0
from model_provider import ModelType, model_provider

try:
    from megatron.post_training.arguments import add_modelopt_args

    has_nvidia_modelopt = True
except ImportError:
    has_nvidia_modelopt = False

stimer = StragglerDetector()
'''

_HEAD_NEW = '''\
"""Pretrain GPT (synthetic, release structure only)."""

# program start time before heavy imports
import time

_PROGRAM_START_TIME = time.time()

import json

# warnings on rank 0 only
import os
import warnings

rank = int(os.environ.get('RANK', 0))
if rank != 0:
    warnings.filterwarnings("ignore", category=UserWarning)
{nested}
from functools import lru_cache, partial

import torch

from gpt_builders import gpt_builder
from megatron.core.utils import StragglerDetector
from megatron.training import get_args, inprocess_restart, pretrain, print_rank_0
from megatron.training.arguments import parse_and_validate_args
from model_provider import ModelType, model_provider

try:
    from megatron.post_training.arguments import add_modelopt_args
{more_try}
    has_nvidia_modelopt = True
except ImportError:
    has_nvidia_modelopt = False

stimer = StragglerDetector()
'''

_NESTED_MAIN = '''
    _original_showwarning = warnings.showwarning

    def _quiet(message, category, filename, lineno, file=None, line=None):
        return None

    warnings.showwarning = _quiet
'''

_FUNCS = '''

def get_embedding_ranks(pp_ranks):
    return pp_ranks


def forward_step(data_iterator, model):
    """Forward step."""
    return None, None


def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    print_rank_0("> building datasets ...")
    return None, None, None
'''

_MAIN_PRETRAIN_PROVIDER = '''

if __name__ == "__main__":
    # Temporary for transition to core datasets
    train_valid_test_datasets_provider.is_distributed = True

    # Optionally enable inprocess restart on pretrain
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    pretrain(
        train_valid_test_datasets_provider,
        partial(model_provider, gpt_builder),
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )
'''

_MAIN_018 = '''

if __name__ == "__main__":
    setattr(train_valid_test_datasets_provider, "is_distributed", True)

    # Optionally enable inprocess restart on pretrain
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    args = parse_and_validate_args(
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
    full_config = {"args": args}
    pretrain(full_config,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )
'''

_MAIN_019 = '''

if __name__ == "__main__":
    print_rank_0(f'> synthetic {json.__name__} version ...')

    setattr(train_valid_test_datasets_provider, "is_distributed", True)

    # Optionally enable inprocess restart on pretrain
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    args = parse_and_validate_args(
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
    if has_nvidia_modelopt:
        print_rank_0("> modelopt available")
    full_config = {"args": args}
    pretrain(
        full_config,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )
'''

_BATCH_KEYS = '''
# Canonical, ordered schema of the fields ``get_batch`` returns. Kept alphabetical
# (synthetic list below).
BATCH_KEYS = [
    "labels",
    "tokens",
]


@lru_cache(maxsize=1)
def _cached_flag():
    return True
'''

_HELPERS_017 = '''

def _pack_helper_a(batch):
    return batch


def _pack_helper_b(batch):
    return batch
'''


def pretrain_gpt_source(release: str) -> str:
    """The synthetic ``pretrain_gpt.py`` of ``release`` (a key of ``RELEASES``)."""
    if release in ("core_v0.16", "core_v0.17"):
        return _HEAD_OLD + (_HELPERS_017 if release == "core_v0.17" else "") + _FUNCS + _MAIN_PRETRAIN_PROVIDER
    more_try = "" if release == "core_v0.18" else "    from megatron.post_training.utils import maybe_enable_modelopt\n"
    head = _HEAD_NEW.format(nested=_NESTED_MAIN if release == "main" else "", more_try=more_try)
    if release == "core_v0.18":
        return head + _FUNCS + _MAIN_018
    return head + _BATCH_KEYS + _FUNCS + _MAIN_019


def write_package_info(root: str, version: tuple[int, int, int]) -> None:
    info = os.path.join(root, "megatron", "core")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "package_info.py"), "w") as f:
        f.write(f'MAJOR = {version[0]}\nMINOR = {version[1]}\nPATCH = {version[2]}\nPRE_RELEASE = ""\n')


def make_checkout(root, release: str, *, runnable: bool = False, source: str | None = None) -> str:
    """A checkout holding ``megatron/core/package_info.py`` and ``pretrain_gpt.py`` of ``release``;
    ``runnable``: also the fake ``megatron.training`` tree and ``model_provider.py``."""
    root = str(root)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "pretrain_gpt.py"), "w") as f:
        f.write(pretrain_gpt_source(release) if source is None else source)
    if runnable:
        write_fake_megatron_training(root)
    else:
        write_package_info(root, RELEASES[release])
    return root


FAKE_TREE = {
    "megatron/training/__init__.py": """
        from .global_vars import get_args, get_tensorboard_writer, get_wandb_writer
        from .initialize import initialize_megatron
        from .training import pretrain
        from .utils import print_rank_0
    """,
    "megatron/training/global_vars.py": """
        _ARGS = None

        def set_args(args):
            global _ARGS
            _ARGS = args

        def get_args():
            return _ARGS

        def get_tensorboard_writer():
            return None

        def get_wandb_writer():
            return None
    """,
    "megatron/training/utils.py": """
        def print_rank_0(message):
            print(message, flush=True)

        def get_batch_on_this_tp_rank(data_iterator):
            return None
    """,
    "megatron/training/arguments.py": """
        import argparse

        from megatron.training import global_vars

        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(description="fake Megatron-LM arguments", allow_abbrev=False)
            parser.add_argument("--train-iters", type=int, default=None)
            parser.add_argument("--save", type=str, default=None)
            parser.add_argument("--load", type=str, default=None)
            parser.add_argument("--inprocess-restart", action="store_true")
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            if ignore_unknown_args:
                args, _ = parser.parse_known_args()
            else:
                args = parser.parse_args()
                print("PARSED", flush=True)
            return args

        def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
            args = parse_args(extra_args_provider, ignore_unknown_args)
            global_vars.set_args(args)
            return args
    """,
    "megatron/training/initialize.py": """
        from megatron.training.arguments import parse_args
        from megatron.training import global_vars

        def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,
                                allow_no_cuda=False, parsed_args=None, store=None, get_embedding_ranks=None):
            print("ALLOW_NO_CUDA", allow_no_cuda, flush=True)
            args = parse_args(extra_args_provider, ignore_unknown_args) if parsed_args is None else parsed_args
            global_vars.set_args(args)
            print("INIT_DISTRIBUTED", flush=True)
    """,
    "megatron/training/inprocess_restart.py": """
        from megatron.training import arguments

        def maybe_wrap_for_inprocess_restart(pretrain):
            args = arguments.parse_args(ignore_unknown_args=True)
            return pretrain, None
    """,
    "megatron/training/training.py": """
        import sys

        from megatron.training.global_vars import get_args
        from megatron.training.initialize import initialize_megatron

        def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, fb, iteration=None):
            return None

        def post_training_step_callbacks(model, optimizer, scheduler, iteration, prof, flops):
            return None

        def save_checkpoint(iteration, model, optimizer, scheduler, flops, **kwargs):
            return None

        def get_model(*args, **kwargs):
            return []

        def train(*args, **kwargs):
            module = sys.modules[__name__]
            hooked = all(hasattr(getattr(module, name), "_mechmon_wrapped")
                         for name in ("train_step", "post_training_step_callbacks", "save_checkpoint", "train"))
            args = get_args()
            print("HOOKED", hooked, flush=True)
            print("MECHMON", getattr(args, "mechmon", None), getattr(args, "mechmon_interval", None),
                  getattr(args, "mechmon_action", None), flush=True)
            print("MEGATRON", args.train_iters, getattr(args, "modelopt_level", None), flush=True)
            print("SCRIPT_TORCH", type(sys.modules["__main__"].__dict__.get("torch")).__name__, flush=True)

        def pretrain(*args, extra_args_provider=None, args_defaults={}, store=None, get_embedding_ranks=None, **kw):
            parsed = args[0]["args"] if args and isinstance(args[0], dict) else None
            initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults,
                                parsed_args=parsed)
            print("BUILD_MODEL", flush=True)
            train()
    """,
    "megatron/training/checkpointing.py": """
        def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None,
                                optim_sd_kwargs=None, model_sd_kwargs=None, rerun_state=None):
            return {}

        def _load_global_dist_base_checkpoint(load_dir, args, rank0, sharded_state_dict, iteration, release,
                                              checkpointing_context=None):
            return {}, load_dir, release, None
    """,
    "megatron/post_training/arguments.py": """
        def add_modelopt_args(parser):
            parser.add_argument("--modelopt-level", type=int, default=0)
            return parser
    """,
    "gpt_builders.py": """
        def gpt_builder(args, pre_process, post_process):
            return None
    """,
    "model_provider.py": """
        class ModelType:
            encoder_or_decoder = 1

        def model_provider(builder, pre_process=True, post_process=True):
            return None
    """,
}


def write_fake_megatron_training(root: str) -> None:
    """The fake ``megatron.training`` tree (no ``megatron/__init__.py``: a namespace package, as
    in a checkout, so the installed megatron-core stays importable beside it)."""
    for name, body in FAKE_TREE.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(body).lstrip())
