"""nvfp4_format (under construction)."""

__all__: list[str] = []
