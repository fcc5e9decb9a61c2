"""ptcfs.server: the per-host daemon ptcd."""
