"""Reports of a plan: the terminal tables (:mod:`.terminal`) and the self-contained HTML page
(:mod:`.html`)."""
