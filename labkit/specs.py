"""Published figures the memory and cost math plugs in: real checkpoints' shapes, an H100's speeds.

The shapes are the checkpoints' config.json values, held as labkit Configs so stage code and
tests read them by field name; nothing here is ever instantiated as a model.
"""

from .model import Config

# meta-llama/Meta-Llama-3-8B and -70B config.json: both sizes share the vocabulary, the head width,
# 8 KV heads, the context and RoPE θ; they differ in width, depth and query heads.
_LLAMA3 = dict(vocab_size=128256, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
               rope_theta=500_000.0, tie_word_embeddings=False)  # fmt: skip
LLAMA3_8B = Config(**_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
LLAMA3_70B = Config(**_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
# H100 SXM dense BF16 FLOP/s and HBM3 bytes/s (the course plan's figures).
H100 = dict(flops=989e12, hbm_bandwidth=3.35e12)
# What one replica of the course's simulated CPU fleet costs (lab4, make bench STAGE=07b): one vCPU of an AWS
# c5.2xlarge, whose on-demand price in us-east-1 (Linux) is $0.34 an hour for 8 vCPUs in the EC2 Auto Scaling
# user guide's price example ("Spot price per unit hour example"): a stated price, not a live quote.
VCPU_DOLLARS_PER_HOUR = 0.34 / 8
