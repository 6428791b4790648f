"""The optimizer: AdamW with its learning-rate schedule, clipping and decay mask, and loss
scaling / skipping of non-finite steps as optax-style transforms (`optimizer:`).

Floor 2: imports `nvfp4_train.model` (per-layer paths of stacked blocks) and the floor-0 modules.
"""
