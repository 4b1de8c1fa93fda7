"""Build a tiny random-weight Llama for real engines on a CPU: run by the engines' own Python.

This file imports torch and transformers, which kvgate itself does not depend on, so it is run as a
script by the engine virtualenv's interpreter (`python tiny_model_script.py OUT TOKENIZER_DIR TEMPLATE`),
never imported by kvgate. The weights come from a fixed seed, so every build is identical; the answers
are gibberish, but tokenizing, caching, hashing, KV events and KV transfers are the engine's real ones.

Shape: 2 layers, hidden 64, 4 attention heads of head_dim 32 (vLLM's CPU attention needs >= 32),
2 KV heads, tied embeddings, bf16: about 8M parameters, almost all of them the 129,280-token embedding.
Beside it, in lora/, a LoRA adapter of it (build_lora).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

SEED = 0
MAX_POSITIONS = 32768


def build(out_dir: Path, tokenizer_dir: Path, chat_template: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    # transformers and vLLM both read a chat_template.jinja saved beside the tokenizer.
    shutil.copyfile(chat_template, out_dir / "chat_template.jinja")
    tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_lora(out_dir / LORA_DIR, config)


# A LoRA adapter of the tiny model (rank 8 on q_proj and v_proj, random weights), in PEFT's layout:
# enough for an engine to serve it and mix it into its block hashes as for any adapter.
LORA_DIR = "lora"
LORA_RANK = 8


def build_lora(out_dir: Path, config) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(SEED + 1)
    q_out = config.num_attention_heads * config.head_dim
    v_out = config.num_key_value_heads * config.head_dim
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, out_features in (("q_proj", q_out), ("v_proj", v_out)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", (LORA_RANK, config.hidden_size)), ("lora_B", (out_features, LORA_RANK))):
                weight = torch.randn(shape, generator=generator) * 0.01
                tensors[f"{prefix}.{part}.weight"] = weight.to(torch.bfloat16)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
               "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
               "base_model_name_or_path": str(out_dir.parent), "fan_in_fan_out": False}
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter, indent=1))


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
