"""What a decode step costs: FLOPs and KV bytes from the model's shape (pure Python).

The one place the cost formulas live; the signal (C of the paper), the scheduler's C and M
terms, the pruning accounting and the benchmarks all read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """The shape numbers that price one decode step of a decoder-only transformer."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dense_flops_per_token: float
    kv_bytes_per_element: int = 2  # the KV cache dtype (bf16/fp16: 2, fp32: 4)
    sliding_layers: int = 0  # layers that attend only the last `sliding_window` tokens (Gemma 3: 15 of 18)
    sliding_window: int = 0

    @classmethod
    def from_hf_config(cls, cfg, kv_bytes_per_element: int = 2) -> "ModelDims":
        """Dims of a Llama-style model from its Hugging Face config.

        With hidden size d, intermediate size f, h_q query heads, h_kv key/value heads of
        dimension h_d, L layers and vocabulary size n_vocab, the matmul parameters are
          per layer: q and o projections 2 * d * h_q * h_d, k and v projections
                     2 * d * h_kv * h_d, gate/up/down MLP matrices 3 * d * f;
          lm head:   d * n_vocab  (the input embedding is a lookup, not a matmul).
        dense_flops_per_token = 2 * (L * per_layer + lm_head): 2 FLOPs per multiply-add.
        Norms, biases and activations are ignored (lower order).
        """
        hidden = cfg.hidden_size
        q_heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // q_heads
        per_layer = (
            2 * hidden * q_heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * cfg.intermediate_size
        )
        lm_head = hidden * cfg.vocab_size
        sliding = sum(t == "sliding_attention" for t in getattr(cfg, "layer_types", None) or ())
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dense_flops_per_token=2.0 * (cfg.num_hidden_layers * per_layer + lm_head),
            kv_bytes_per_element=kv_bytes_per_element,
            sliding_layers=sliding,
            sliding_window=(getattr(cfg, "sliding_window", None) or 0) if sliding else 0,
        )


@dataclass(frozen=True)
class AttentionCost:
    flops: float
    kv_bytes: float


def attention_cost(dims: ModelDims, attended_tokens: float, context: float | None = None) -> AttentionCost:
    """Attention FLOPs and KV-cache bytes read by one decode token over `attended_tokens`.

    FLOPs: QK^T and PV are h_q * h_d multiply-adds each per attended token and layer, so
    4 * L * h_q * h_d * attended (2 FLOPs per multiply-add). Bytes: K and V of every attended
    token in every layer, 2 * L * h_kv * h_d * bytes per element. attended_tokens is the
    context length, or the tokens a pruned step read, averaged over the layers that read the whole
    context; a sliding-window layer reads min(window, context) tokens (context: default attended_tokens).
    """
    context = attended_tokens if context is None else context
    tokens = (dims.num_layers - dims.sliding_layers) * attended_tokens + dims.sliding_layers * min(
        dims.sliding_window, context
    )  # summed over layers
    flops = 4.0 * dims.num_q_heads * dims.head_dim * tokens
    kv_bytes = 2.0 * dims.num_kv_heads * dims.head_dim * dims.kv_bytes_per_element * tokens
    return AttentionCost(flops, kv_bytes)


def step_cost(dims: ModelDims, attended_tokens: float, context: float | None = None) -> float:
    """FLOPs of one decode step of one request: the cost C of the paper (dense + attention)."""
    return dims.dense_flops_per_token + attention_cost(dims, attended_tokens, context).flops
