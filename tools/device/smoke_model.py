"""A tiny random Llama with SmolLM2's tokenizer, saved to /tmp/tiny (GPU smoke of the training driver)."""
import gzip, shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
out = Path("/tmp/tiny")
LlamaForCausalLM(config).save_pretrained(out)
(out / "tokenizer.json").write_bytes(gzip.decompress(Path(".gpua/tok/tokenizer.json.gz").read_bytes()))
for name in ("tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(Path(".gpua/tok") / name, out / name)
print("tiny model saved")
