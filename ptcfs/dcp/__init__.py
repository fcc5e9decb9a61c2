"""DCP (``torch.distributed.checkpoint``) checkpoints without torch: the layout of a
job version as one, its metadata pickle and ``torch.save`` archives, and the mount's
view of a version as its files."""

__all__: list[str] = []
