"""The daemon's request handlers: one module per family of operations, their
shared helpers in :mod:`ptcfs.server.ops.common`."""
