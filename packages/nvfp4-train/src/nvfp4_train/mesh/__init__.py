"""Devices: the `mesh:` axes and the sharding rules of parameters, batches and activations, and
joining a multi-process run (`distributed:`).

Floor 2: imports `nvfp4_train.model` (which blocks are stacked) and the floor-0 modules.
"""
