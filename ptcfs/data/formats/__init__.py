"""Dataset formats: one module each, named in :data:`ptcfs.data.names.FORMATS`."""
