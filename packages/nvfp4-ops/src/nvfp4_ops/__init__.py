"""nvfp4_ops (under construction)."""

__all__: list[str] = []
