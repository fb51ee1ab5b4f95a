"""Runtime engine: executor, transport and DCP persister (the only code touching process groups)."""
