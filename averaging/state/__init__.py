"""State sharing: the published state's chunked format, the donor's store and the sharer (I/O)."""
