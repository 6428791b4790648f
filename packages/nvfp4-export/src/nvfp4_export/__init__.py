"""nvfp4_export (under construction)."""

__all__: list[str] = []
