"""Model code shared by every pool: config, loaders (GGUF, safetensors), tokenizer, transformer."""
