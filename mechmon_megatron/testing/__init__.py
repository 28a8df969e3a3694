"""CPU stand-ins for megatron-core and Megatron-LM: tests, examples and the research study only.

* :mod:`~mechmon_megatron.testing.cpu_megatron` -- ``enable_cpu_compat()``: megatron-core on CPU
  (gloo), for the example trainer, the tests and the fault study.
* :mod:`~mechmon_megatron.testing.megatron_lm_cpu` -- Megatron-LM's ``pretrain_gpt.py`` on CPU:
  ``python -m mechmon_megatron.testing.megatron_lm_cpu pretrain_gpt.py ...``.

Nothing here is needed for, or reached by, a GPU job: the product (core, session, adapters,
cli) never imports this package (tests/test_architecture.py), and the wheel does not ship it
(tests/test_packaging.py): it runs from a checkout.
"""
