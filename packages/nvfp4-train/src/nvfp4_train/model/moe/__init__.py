"""Mixture-of-Experts blocks: their configuration, routing, token dispatch, the MoE MLP, its
statistics and the expert-parallel dispatch over a mesh."""
