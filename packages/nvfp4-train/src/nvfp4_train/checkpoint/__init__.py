"""State on disk: orbax checkpoints of a run (saving and rotation, reading and validation), their
integrity checksums, and the run directory with its file names and lock.

Floor 3: imports `nvfp4_train.mesh`, `nvfp4_train.model` and the floor-0 modules.
"""
