"""Which GEMMs run in which format, and whether this machine can be trusted to run them: the
precision policy (recipes per linear), the precision schedule (phases over steps), and the
start-up checks of the GEMM backends and fused attention kernels against their references.

Floor 2: imports `nvfp4_train.model` and the floor-0 modules.
"""
