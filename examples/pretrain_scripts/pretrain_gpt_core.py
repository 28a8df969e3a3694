"""Pre-train a GPT with megatron-core's own training loop (``megatron.training.pretrain``).

megatron-core wheels from 0.18 on ship ``megatron.training`` (the loop, checkpointing, the
TensorBoard writer): this script is the smallest ``pretrain_gpt.py`` on top of it, so the real
Megatron training loop runs without a Megatron-LM checkout. It takes Megatron-LM's flags.

    torchrun --nproc-per-node 8 -m mechmon_megatron.adapters.megatron_lm.run \\
        examples/pretrain_scripts/pretrain_gpt_core.py <Megatron flags> --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 256 --mechmon --mechmon-interval 100 ...

``mechmon-run`` (above) adds the ``--mechmon*`` flags and hooks; the script itself knows nothing
of mechmon. On a machine without a GPU start it through the CPU launcher of the testing package
instead (``python -m mechmon_megatron.testing.megatron_lm_cpu``, see docs/MEGATRON_LM.md).

Providers, as in Megatron-LM's ``pretrain_gpt.py`` but for plain pre-training only:

- model: built by ``pretrain`` from the config container (``gpt_config_from_args``);
- data: ``MockGPTDataset`` with ``--mock-data``, else ``GPTDataset`` over ``--data-path``;
  every rank builds its own loader (``is_distributed``), so tensor-parallel ranks read the same
  batch without a broadcast;
- forward step: tokens -> per-token losses, masked sum and token count (``lm loss``).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch

try:
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.enums import ModelType
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args, pretrain, print_rank_0
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.utils import get_blend_and_blend_per_split
except ImportError as error:  # megatron-core < 0.18 ships no megatron.training
    sys.exit(
        f"pretrain_gpt_core.py needs megatron.training from megatron-core >= 0.18 ({error}); "
        "with an older release use Megatron-LM's own pretrain_gpt.py (docs/MEGATRON_LM.md)"
    )

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def dataset_config(args: Any) -> GPTDatasetConfig:
    """The GPT dataset config of Megatron's data flags (``--seq-length``, ``--split``, ...)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def datasets_provider(train_valid_test_num_samples: list[int], vp_stage: Any = None):
    """Train, validation and test datasets of the requested sizes (samples)."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train, validation and test datasets")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_valid_test_num_samples, lambda: True, dataset_config(args)
    ).build()


datasets_provider.is_distributed = True  # every rank builds its loader (see the module docstring)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked sum of per-token losses, the token count, and the ``lm loss`` report."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch: [micro_batch, seq] tokens in, per-token losses out."""
    device = next(model.parameters()).device
    if mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage():
        batch = next(data_iterator)
        tokens, labels, loss_mask, attention_mask, position_ids = (
            None if batch.get(key) is None else batch[key].to(device, non_blocking=True) for key in BATCH_KEYS
        )
    else:  # middle pipeline stages take their input from the previous stage
        tokens = labels = loss_mask = attention_mask = position_ids = None
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def main() -> None:
    args = parse_and_validate_args()
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
