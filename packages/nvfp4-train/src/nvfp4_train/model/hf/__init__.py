"""Hugging Face import, per architecture: config.json -> `model:` keys, where each parameter
lives in a checkpoint, safetensors -> parameters."""
