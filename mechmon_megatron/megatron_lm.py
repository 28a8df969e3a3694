"""``import mechmon_megatron.megatron_lm``: the Megatron-LM integration (see ``adapters.megatron_lm``)."""
from mechmon_megatron.adapters.megatron_lm import add_arguments, extra_args_provider, install  # noqa: F401
