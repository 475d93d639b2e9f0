"""Framework integrations (each an optional extra; the core depends on torch only)."""
