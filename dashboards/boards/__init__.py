"""One module per dashboard; each exposes build() -> dashboard JSON (a dict)."""
