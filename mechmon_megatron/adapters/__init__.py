"""Host adapters: one folder per host, each with the same shape.

* ``megatron_core/`` -- megatron-core models in any training loop (TP / PP / EP / DP / GQA module
  discovery, weight reads and gathers, router-logit capture); public entry point
  :class:`~mechmon_megatron.adapters.megatron_core.MechmonCallback`.
* ``megatron_lm/`` -- Megatron-LM's own ``pretrain_gpt.py`` (flags, step hooks, save-and-exit,
  the patch tool); public entry point :func:`~mechmon_megatron.adapters.megatron_lm.install`.
  Megatron-LM trains megatron-core models, so this adapter builds on ``megatron_core``'s public
  entry point (the only import between adapters).
* ``deepspeed/`` -- a DeepSpeed engine (gate hooks, ZeRO-safe weight reads, ``engine.monitor``);
  public entry point :func:`~mechmon_megatron.adapters.deepspeed.attach`.

Each folder's ``__init__`` is its public entry point. An adapter maps its host's modules, writer
and checkpoint mechanism onto the session's small interface (``session.host``); it imports the
session and the core, never another host's adapter (except as stated above), and never the
research or testing packages. A new host is one new folder. See docs/ARCHITECTURE.md.
"""
