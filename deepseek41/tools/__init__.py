"""Command-line tools: info (parameters, roles, FLOPs)."""
