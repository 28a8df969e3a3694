"""mechmon-megatron: mechanism-driven monitors for large-scale LLM pre-training.

The product, in layers (imports only point downwards; docs/ARCHITECTURE.md):

* ``mechmon_megatron.monitors`` and ``mechmon_megatron.detect`` -- the pure-torch core: spectral
  statistics of Q/K weight increments, MoE router metrics, the alarm rule. Never imports
  megatron or deepspeed. Formulas: docs/METHOD.md.
* ``mechmon_megatron.session`` -- the host-agnostic monitoring session: schedule, snapshots,
  checks, records, TensorBoard scalars, actions (log / warn / checkpoint-and-abort).
* ``mechmon_megatron.adapters.<host>`` -- one folder per host (``megatron_core``,
  ``megatron_lm``, ``deepspeed``), each with a small public entry point; ``mechmon_megatron.cli``
  holds the ``--mechmon*`` flags. ``mechmon_megatron.megatron_lm`` and
  ``mechmon_megatron.deepspeed`` are stable aliases of two entry points.

Beside the product, never imported by it and not in the wheel (they run from a checkout, where
``make venv`` installs the package editable): ``mechmon_megatron.research`` (fault injectors,
symptom-rule baselines, the per-stream rule of 0.1, the studies) and ``mechmon_megatron.testing``
(CPU shims of megatron-core and Megatron-LM for tests, examples and the study).
"""

from mechmon_megatron._version import __version__

__all__ = ["__version__"]
