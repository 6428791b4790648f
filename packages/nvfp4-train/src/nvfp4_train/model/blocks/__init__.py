"""The blocks' parts: the quantized linear, norms, RoPE, and the mixers (attention with its kernels,
the dense MLP, the Mamba-2 mixer) and the pre-norm block that holds them."""
