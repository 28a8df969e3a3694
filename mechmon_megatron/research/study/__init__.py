"""The fault study: scenarios x seeds through the example trainer, then offline analysis.

Modules, one job each:

- :mod:`~mechmon_megatron.research.study.scenarios` -- scenario -> trainer flags, presets (pure Python);
- :mod:`~mechmon_megatron.research.study.runner` -- parallel training subprocesses with a progress bar;
- :mod:`~mechmon_megatron.research.study.analysis` -- first alarms (detector and symptom replays),
  divergence and expert-collapse definitions, leads, detector calibration;
- :mod:`~mechmon_megatron.research.study.report` -- ``results.json``, markdown table, orthogonality,
  targets;
- :mod:`~mechmon_megatron.research.study.plots` -- one PNG per run (matplotlib, Agg);
- :mod:`~mechmon_megatron.research.study.study` -- the pipeline (``run_study``, ``analyze_study``).

CLI: ``tools/fault_study.py``; ``make demo`` runs ``tools/demo.py``. Results: docs/RESULTS.md.
"""
