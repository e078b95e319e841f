"""Storage nodes: a trio server owning devices, reached over the tcp transport."""
