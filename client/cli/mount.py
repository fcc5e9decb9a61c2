"""``ptcctl mount``: mount a host's ``/ptc`` filesystem in the foreground."""

from __future__ import annotations

import argparse

from ptcfs.client.cli.app import register

__all__: list[str] = []


@register("mount")
def _add_mount(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mount", help="mount a host's /ptc filesystem (until Ctrl-C or fusermount3 -u)",
        description="Mount the filesystem of the host whose daemon runs here: every job's "
                    "tensors, per-rank state and datasets as files. Runs in the foreground; "
                    "`ptcd --mount DIR` does the same alongside the daemon.")
    p.add_argument("dir", help="the mount point (created if missing)")
    p.add_argument("--host-id", required=True, help="this host's name in the cluster file")
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--ready-file", help="written once the mount is ready")
    p.set_defaults(run=_run_mount)


def _run_mount(args: argparse.Namespace) -> int:
    from ptcfs.server.mount import main

    argv = ["--host-id", args.host_id, "--mount", args.dir]
    if args.cluster:
        argv += ["--cluster", args.cluster]
    if args.ready_file:
        argv += ["--ready-file", args.ready_file]
    return main(argv)
