"""Symptom-level baselines: the alarm rules users run today, for comparison with the monitors.

:mod:`~mechmon_megatron.research.baselines.symptom_rules`: OLMo-core 6-sigma, Megatron-LM
10x-of-first-100, llm-foundry 2x-mean, running-mean relative jump, and growth rules.
"""

from mechmon_megatron.research.baselines.symptom_rules import (
    FoundrySpikeRule,
    GrowthRule,
    MegatronSpikeRule,
    OlmoSpikeRule,
    RunningMeanRelativeRule,
    SymptomRule,
    build_symptom_rules,
)

__all__ = [
    "FoundrySpikeRule",
    "GrowthRule",
    "MegatronSpikeRule",
    "OlmoSpikeRule",
    "RunningMeanRelativeRule",
    "SymptomRule",
    "build_symptom_rules",
]
