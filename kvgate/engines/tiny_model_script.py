"""Build a tiny random-weight Llama for real engines on a CPU: run by the engines' own Python.

This file imports torch and transformers, which kvgate itself does not depend on, so it is run as a
script by the engine virtualenv's interpreter (`python tiny_model_script.py OUT TOKENIZER_DIR TEMPLATE`),
never imported by kvgate. The weights come from a fixed seed, so every build is identical; the answers
are gibberish, but tokenizing, caching, hashing, KV events and KV transfers are the engine's real ones.

Shape: 2 layers, hidden 64, 4 attention heads of head_dim 32 (vLLM's CPU attention needs >= 32),
2 KV heads, tied embeddings, bf16: about 8M parameters, almost all of them the 129,280-token embedding.
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


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
