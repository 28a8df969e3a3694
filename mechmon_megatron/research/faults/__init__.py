"""Fault injection for the study: emulated low-precision flash attention and its backends.

* ``fault_config`` -- the fault to inject (when, where, how strong);
* ``emulated_fa`` -- a CPU emulation of BF16 flash attention with its biased-rounding backward;
* ``attention_backends`` -- megatron-core core-attention modules running it (and the optional
  GPU backends) for the example trainer's ``--attention-backend``.
"""
