"""Attacks by hostile peers and outsiders, each beside its control run: one module per
attack class, so that the next review finds what is already covered (docs/security.md)."""
