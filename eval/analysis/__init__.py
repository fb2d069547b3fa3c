"""Analyses of trained drafts: where measured numbers come from (docs/acceptance_gap.md)."""
