"""Typed config: dataclass schemas, YAML loading, command-line overrides, validation."""
