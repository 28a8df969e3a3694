"""The one version number of mechmon-megatron (the distribution and ``mechmon_megatron.__version__``).

setup.py reads this file as text (no import, so building needs no torch), and the package
re-exports it. 0.1: the per-stream detector; 0.2: the whole-job detector; 0.3: mechmon-scan,
mechmon-plan and the Megatron-LM host.

Not to be confused with the format versions of saved state, which change only when that format
does: ``session.saved_state.STATE_VERSION`` (the checkpointed monitor state) and the detectors'
own ``state_dict`` versions.
"""

__version__ = "0.3.0"
