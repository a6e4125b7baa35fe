"""difftape.server: the compile-and-execute service. Not built yet (see README, Status);
this package exists so the distribution layout is final from the start."""
