"""The recovery study: three operators on the same fault runs of the CPU toy.

``campaign.py`` (cells, runs, summaries), ``operators.py`` (none, today's practice, mechmon's
loop), ``launch.py`` (resumable launches), ``table.py`` (the markdown table of docs/RECOVERY.md).
Driven by ``tools/recovery_study.py``.
"""
