"""Analyses of trained drafts: where measured numbers come from
(docs/reports/2026-12-02-acceptance-gap/README.md)."""
