"""Publishing a draft: export to a serving format, prove the export, card it, upload it."""
