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
