"""The network: its configuration, layers, attention implementations, the decoder, stacked
(scanned) blocks, FLOPs per token, and the Hugging Face import (config.json -> `model:` keys,
safetensors -> parameters).

Floor 1: imports `nvfp4_train.errors` and `nvfp4_train.tree_paths` only (and nvfp4_ops).
"""
