"""Megatron-LM flags of the tiny GPT-MoE that the Megatron-LM loop tests train on CPU (gloo).

2 layers, hidden 64, 4 heads, 4 experts top-2 (allgather dispatcher), mock data with the null
tokenizer, megatron's local (non-TE) layers with every CUDA fusion off, no periodic saves or
evaluation, and the monitors checking every 5 steps over a 5-step window.
"""

TINY_GPT_MOE: list[str] = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "256", "--split", "99,1,0", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-token-dispatcher-type", "allgather", "--transformer-impl", "local", "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm",
    "--log-interval", "5", "--eval-iters", "0", "--eval-interval", "1000", "--save-interval", "1000",
    "--mechmon", "--mechmon-interval", "5", "--mechmon-delta", "5",
]

MLA: list[str] = [
    "--multi-latent-attention", "--qk-layernorm", "--rope-type", "rope", "--q-lora-rank", "32",
    "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
]
"""Multi-head latent attention on the tiny model (with its latent RMSNorms: ``--qk-layernorm`` builds
``q_layernorm`` / ``kv_layernorm`` for MLA); plain RoPE, since megatron-core's YaRN embedding asks
for a CUDA device at construction."""

QK_NORM: list[str] = ["--qk-layernorm", "--num-query-groups", "2"]
"""QK-norm (a per-head RMSNorm on queries and keys, as in Qwen3 / OLMo 2) on the tiny GQA model."""

FRONTIER_ATTENTION: dict[str, list[str]] = {"mla": MLA, "qk_norm": QK_NORM}
