"""Research code: how the monitors were evaluated. Not part of the product.

* ``faults/`` -- emulated low-precision flash attention, its fault injector, and the
  megatron-core core-attention backends that run it in the example trainer;
* ``baselines/`` -- the symptom-level alarm rules users run today (loss / grad-norm spikes,
  growth rules), replayed offline for comparison;
* ``detect_v01/`` -- the per-stream alarm rule of mechmon 0.1 (one median/MAD band per stream),
  replayed by the studies beside the whole-job detector;
* ``study/`` -- the fault-injection and detector studies: scenarios, runs of the example
  trainer, offline analysis, reports and plots (``tools/fault_study.py``, ``make demo``).

This package may import the product (core, session, adapters, cli) and the CPU shims of
``mechmon_megatron.testing``; the product never imports it (tests/test_architecture.py), and the
wheel does not ship it (tests/test_packaging.py): it runs from a checkout.
"""
