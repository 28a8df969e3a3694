"""megatron-core adapter: the monitors on megatron-core models, in any training loop.

Public entry point::

    from mechmon_megatron.adapters.megatron_core import MechmonCallback
    callback = MechmonCallback(config)   # on_train_start / on_step_start / on_step_end / state_dict

Files, one job each: ``discovery`` (find attention layers and routers, global layer numbers),
``sites`` (turn them into the session's sites for any TP / PP / EP / DP / SP layout),
``param_sync`` (make distributed-optimizer parameters current before a read),
``session_factory`` (writers, communicator, session), ``callback`` (the loop hooks),
``sharded_state`` (mechmon's state as one ``ShardedObject`` per rank in a distributed checkpoint),
``lr_schedule`` (the job's learning-rate schedule from Megatron's arguments).
"""

from mechmon_megatron.adapters.megatron_core.callback import MechmonCallback, MechmonExitRequest
from mechmon_megatron.adapters.megatron_core.lr_schedule import schedule_of_args
from mechmon_megatron.adapters.megatron_core.param_sync import force_param_sync, overlaps_param_gather
from mechmon_megatron.adapters.megatron_core.session_factory import McoreReads, build_mcore_session
from mechmon_megatron.adapters.megatron_core.sharded_state import add_load_template, loaded_state, state_shard

__all__ = ["McoreReads", "MechmonCallback", "MechmonExitRequest", "add_load_template", "build_mcore_session",
           "force_param_sync", "loaded_state", "overlaps_param_gather", "schedule_of_args", "state_shard"]
