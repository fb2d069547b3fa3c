"""Studies that train drafts and measure them: each module one study, run by its script."""
