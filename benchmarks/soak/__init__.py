"""A mixed load against a running server for a while, watching for leaks, lost requests and 5xx."""
