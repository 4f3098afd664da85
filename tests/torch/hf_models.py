"""Small Hugging Face causal language models from configs (random init), shared by the torch tests.

``transformers`` comes with the ``test`` extra; without it ``transformers`` is None and the tests that
need it skip.
"""

from __future__ import annotations

import torch

transformers = None
try:
    import transformers
except ImportError:  # pragma: no cover
    pass

VOCAB = 64
POSITIONS = 16


def small_causal_lm(name: str, *, n_head: int = 2, dropout: float = 0.0) -> torch.nn.Module:
    """A two-layer ``"gpt2"`` or ``"llama"`` model over a 64-token vocabulary and 16 positions."""
    assert transformers is not None, "transformers is not installed (pip install -e '.[test]')"
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=POSITIONS,
            n_embd=32,
            n_layer=2,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=POSITIONS,
        )
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}: 'gpt2' or 'llama'")
