"""Files: the checkpoint format (read, validate, write), atomic writes, JSON reports."""
