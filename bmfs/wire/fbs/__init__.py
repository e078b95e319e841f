"""flatc output for schemas/*.fbs (generated, do not edit)."""
