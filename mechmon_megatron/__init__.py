"""mechmon-megatron: mechanism-driven monitors for large-scale LLM pre-training.

Layers (imports only point downwards):

* ``mechmon_megatron.monitors`` and ``mechmon_megatron.detect`` -- the pure-torch core: spectral
  statistics of Q/K weight increments, MoE router metrics, symptom baselines, alarm rules.
  Never imports megatron or deepspeed.
* ``mechmon_megatron.session`` -- the host-agnostic monitoring session: schedule, snapshots,
  attribution, TensorBoard scalars, actions (log / warn / checkpoint-and-abort).
* ``mechmon_megatron.adapters`` -- thin host adapters (megatron-core, Megatron-LM, DeepSpeed).
"""

__version__ = "0.1.0"
