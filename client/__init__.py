"""difftape.client: the HTTP client for difftape.server. Not built yet (see README, Status)."""
