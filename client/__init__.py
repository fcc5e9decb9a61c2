"""ptcfs.client: the training-side library and the ``ptcctl`` command line."""

__all__: list[str] = []
