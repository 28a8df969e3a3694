"""``mechmon-run``: an unmodified Megatron-LM ``pretrain_gpt.py`` with the mechmon monitors.

    mechmon-run pretrain_gpt.py <Megatron-LM flags> --mechmon --mechmon-interval 100 ...
    python -m mechmon_megatron.adapters.megatron_lm.run pretrain_gpt.py ...
    torchrun --nproc-per-node 8 -m mechmon_megatron.adapters.megatron_lm.run pretrain_gpt.py ...
    torchrun --nproc-per-node 8 $(which mechmon-run) pretrain_gpt.py ...

What the three-line patch does, done from outside before the script runs (:func:`prepare`):

1. ``install()`` (:mod:`.install`): the hooks on ``megatron.training.training``;
2. the ``--mechmon*`` flags: ``parse_args`` and ``parse_and_validate_args`` of
   ``megatron.training.arguments`` (every one that takes ``extra_args_provider``) are wrapped,
   wherever a loaded ``megatron`` module bound them by name, so that the provider they receive
   (the script's own, e.g. ModelOpt's, or None) is chained with ours;
3. validation: when the wrapped function returns Megatron's args namespace, the mechmon flags are
   checked (:func:`mechmon_megatron.cli.args.validate_mechmon_args`): a bad value ends the
   process with exit status 2 and a message naming the flag. Megatron parses its arguments
   before it initialises ``torch.distributed`` or builds a model (in ``initialize_megatron`` up
   to core_v0.17, in the script's ``parse_and_validate_args`` call from core_v0.18 on), so no
   process group or model exists yet.

Then the script runs as ``python pretrain_gpt.py ARGS`` would (``runpy.run_path`` as
``__main__``, ``sys.argv = [script, ARGS...]``, the script's directory first on ``sys.path``,
which is also where ``megatron`` is imported from in a checkout). A patched script works too:
its own ``install()`` returns the installed hooks and the flags are added once. (``install()``
called by a patched script wraps the parsing functions the same way, without ``on_enter``, so
the patch path validates at parse time too.)

``on_enter`` (used by the CPU launcher of the testing package, never by the product) runs once,
at the first of the wrapped calls or ``pretrain``: after the script's imports, before Megatron
initialises.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import runpy
import sys
from typing import Any, Callable, Optional, Sequence

from mechmon_megatron.adapters.megatron_lm.flags import with_mechmon_flags
from mechmon_megatron.adapters.megatron_lm.install import install
from mechmon_megatron.cli.args import validate_mechmon_args

ARGUMENTS_MODULE = "megatron.training.arguments"
TRAINING_MODULE = "megatron.training.training"
PARSERS = ("parse_args", "parse_and_validate_args")
PROG = "mechmon-run"
USAGE = f"{PROG} SCRIPT [Megatron-LM flags] [--mechmon --mechmon-* ...]"
FLAG_USAGE = "pretrain_gpt.py [Megatron-LM flags] --mechmon [--mechmon-* ...] (flags: docs/USAGE.md)"
_MARK = "_mechmon_run_wrapped"
EXIT_USAGE = 2


class LaunchError(Exception):
    """mechmon-run cannot attach to this Megatron-LM; the message says why and what to do."""


def error_parser() -> argparse.ArgumentParser:
    """The parser whose ``error`` reports a bad ``--mechmon*`` flag: ``mechmon: error: --mechmon-X
    ...``, a short usage (not Megatron's hundreds of flags), exit status 2."""
    return argparse.ArgumentParser(prog="mechmon", usage=FLAG_USAGE, add_help=False)


def validate_parsed(result: Any) -> Any:
    """Check the mechmon flags of Megatron's parsed args (a namespace carrying ``mechmon``)."""
    if isinstance(result, argparse.Namespace) and hasattr(result, "mechmon"):
        validate_mechmon_args(error_parser(), result)
    return result


def _once(fn: Optional[Callable[[], Any]]) -> Optional[Callable[[], None]]:
    if fn is None:
        return None
    done: list[bool] = []

    def call() -> None:
        if not done:
            done.append(True)
            fn()

    return call


def _rebind(original: Any, replacement: Any, name: str, extra: Sequence[Any] = ()) -> list[str]:
    """Replace ``original`` under ``name`` in every loaded ``megatron`` module (and ``__main__``)
    that bound it."""
    rebound = []
    for module_name, module in list(sys.modules.items()):
        megatron = module_name == "megatron" or module_name.startswith("megatron.")
        if module is None or not (megatron or module_name == "__main__"):  # __main__: a running patched script
            continue
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)
            rebound.append(module_name)
    for module in extra:
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)
    return rebound


def _parsing_wrapper(original: Callable[..., Any], on_enter: Optional[Callable[[], None]]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if on_enter is not None:
            on_enter()
        bound = signature.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = with_mechmon_flags(bound.arguments.get("extra_args_provider"))
        return validate_parsed(original(*bound.args, **bound.kwargs))

    setattr(wrapper, _MARK, original)
    return wrapper


def wrap_argument_parsing(
    arguments: Any, on_enter: Optional[Callable[[], None]] = None, extra_modules: Sequence[Any] = ()
) -> list[str]:
    """Wrap the parsing functions of ``arguments`` (see the module docstring); their names."""
    wrapped = []
    for name in PARSERS:
        original = getattr(arguments, name, None)
        if not callable(original) or getattr(original, _MARK, None) is not None:
            continue
        try:
            parameters = inspect.signature(original).parameters
        except (TypeError, ValueError):
            continue
        if "extra_args_provider" not in parameters:
            continue
        wrapper = _parsing_wrapper(original, on_enter)
        _rebind(original, wrapper, name, extra=[arguments, *extra_modules])
        wrapped.append(name)
    already = [n for n in PARSERS if getattr(getattr(arguments, n, None), _MARK, None) is not None]
    if not already:
        raise LaunchError(
            f"{getattr(arguments, '__name__', ARGUMENTS_MODULE)} has no {' or '.join(PARSERS)} taking "
            "extra_args_provider: this Megatron-LM cannot take the --mechmon flags from mechmon-run; "
            "patch pretrain_gpt.py instead (mechmon-patch apply MEGATRON_LM_DIR) and report the release"
        )
    return wrapped


def _wrap_entry(training: Any, on_enter: Callable[[], None]) -> None:
    """Run ``on_enter`` when ``pretrain`` is called (scripts that parse inside pretrain)."""
    original = getattr(training, "pretrain", None)
    if not callable(original) or getattr(original, _MARK, None) is not None:
        return

    @functools.wraps(original)
    def pretrain(*args: Any, **kwargs: Any) -> Any:
        on_enter()
        return original(*args, **kwargs)

    setattr(pretrain, _MARK, original)
    _rebind(original, pretrain, "pretrain", extra=[training])


def prepare(
    on_enter: Optional[Callable[[], Any]] = None, arguments_module: Any = None, training_module: Any = None
) -> Any:
    """Install the hooks and the flag wrappers; returns the installed :class:`MegatronLMHooks`.

    ``arguments_module`` / ``training_module`` default to Megatron-LM's (imported here; tests
    pass stand-ins). Idempotent.
    """
    try:
        arguments = arguments_module or importlib.import_module(ARGUMENTS_MODULE)
        training = training_module or importlib.import_module(TRAINING_MODULE)
    except ImportError as exc:
        raise LaunchError(
            f"cannot import Megatron-LM's training package ({exc}); run from the Megatron-LM checkout "
            "(the script's directory is put on sys.path) or add it to PYTHONPATH"
        ) from exc
    enter = _once(on_enter)
    wrap_argument_parsing(arguments, enter)  # before install(), which would wrap without on_enter
    hooks = install(training)
    if enter is not None:
        _wrap_entry(training, enter)
    return hooks


def _usage(stream: Any) -> None:
    print(f"usage: {USAGE}\n\nRun an unmodified Megatron-LM training script (e.g. pretrain_gpt.py) with the mechmon\n"
          "monitors: hooks installed, --mechmon* flags added to Megatron's parser and validated when\n"
          "the arguments are parsed. Under torchrun: torchrun ... -m mechmon_megatron.adapters.megatron_lm.run\n"
          "SCRIPT ... See docs/MEGATRON_LM.md; the flags: mechmon_megatron/cli/args.py.", file=stream)


def main(argv: Optional[Sequence[str]] = None, on_enter: Optional[Callable[[], Any]] = None) -> int:
    """Run ``SCRIPT ARGS...`` as ``__main__`` with mechmon attached; the script's exit status wins."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _usage(sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    script = os.path.abspath(argv[0])
    if argv[0].startswith("-") or not os.path.isfile(script):
        print(f"usage: {USAGE}\n{PROG}: error: the first argument must be the training script "
              f"(e.g. pretrain_gpt.py), got {argv[0]!r}", file=sys.stderr)
        return EXIT_USAGE
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` does; a checkout's megatron/ lives there
    try:
        prepare(on_enter)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":  # run the imported module, so its state is the one the hooks see
    from mechmon_megatron.adapters.megatron_lm import run

    sys.exit(run.main())
