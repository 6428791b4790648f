"""nvfp4_train (under construction)."""

__all__: list[str] = []
