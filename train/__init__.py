"""Two-phase training (the paper's Section 4): ``cmhsa train phase1`` / ``phase2``, ``eval``, ``plot``."""
