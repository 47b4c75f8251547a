"""A seeded LoRA adapter for a ``make_model`` model, in PEFT's layout (what vLLM's ``LoRARequest``
loads): ``adapter_config.json`` and ``adapter_model.safetensors`` with ``lora_A`` / ``lora_B`` for the
attention's q and v projections of every layer. Two seeds give two adapters whose outputs (and KV)
differ from each other and from the base model's, which is what isolation tests need.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_lora_adapter(out_dir: str | Path, model_dir: str | Path, seed: int, rank: int = 8) -> Path:
    """Write the adapter into ``out_dir`` (returned); shapes are read off the model's config."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config", config)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or hidden // heads)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(text["num_hidden_layers"])):
        for name, num_out in (("q_proj", heads * head_dim), ("v_proj", kv_heads * head_dim)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(num_out, rank, generator=generator) * 0.2
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }, indent=2) + "\n")
    return out
