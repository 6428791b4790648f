"""What a run reports: metrics rows (metrics.jsonl, TensorBoard, the progress display), the
quantization telemetry of every linear, health warnings drawn from it, and plots.

Floor 3: imports `nvfp4_train.model`, `nvfp4_train.mesh` and the floor-0 modules.
"""
