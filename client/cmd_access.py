"""``ptcctl job chown/chmod/allow/deny`` and the ``--owner``/``--mode`` of
``job create`` and ``import``: who owns a job, and who may change it."""

from __future__ import annotations

import argparse
from typing import Any

from ptcfs.client.access import describe_owner, parse_owner, set_access
from ptcfs.client.cli import emit_json
from ptcfs.client.conn import Cluster
from ptcfs.client.coordinator import Coordinator
from ptcfs.errors import InvalidConfig
from ptcfs.jobstate import DEFAULT_MODE, JobState, check_mode

__all__ = ["add_access_args", "access_from", "add_access_actions", "parse_mode"]


def parse_mode(text: str) -> int:
    """``0640`` or ``640`` (octal) as permission bits."""
    try:
        return check_mode(int(text, 8))
    except ValueError:
        raise InvalidConfig(f"bad mode {text!r}: give octal permission bits such as 0640") \
            from None


def add_access_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--owner", metavar="USER[:GROUP]",
                   help="who owns the job's files on the mount (default: you)")
    p.add_argument("--mode", default=f"{DEFAULT_MODE:04o}",
                   help="the job's files' mode on the mount: who else may read them "
                        f"(default {DEFAULT_MODE:04o}: the group reads, others nothing)")


def access_from(args: argparse.Namespace) -> dict[str, Any]:
    """The ``owner`` and ``mode`` a new job's record gets from the flags."""
    return {"owner": parse_owner(args.owner), "mode": parse_mode(args.mode)}


def add_access_actions(jsub: argparse._SubParsersAction) -> None:
    """``chown``, ``chmod``, ``allow`` and ``deny`` under ``ptcctl job``."""
    def common(p: argparse.ArgumentParser, run: Any) -> None:
        p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
        p.add_argument("--json", action="store_true")
        p.set_defaults(run=run)

    o = jsub.add_parser("chown", help="give a job to another owner (its owner or root)",
                        description="The job's files on every mount become USER's "
                        "(and GROUP's); only its owner or root may.")
    o.add_argument("job")
    o.add_argument("owner", metavar="USER[:GROUP]")
    common(o, lambda a: _change(a, {"owner": list(parse_owner(a.owner))}))
    m = jsub.add_parser("chmod", help="who may read a job's files on the mount",
                        description="MODE (octal, e.g. 0640) of the job's files on every "
                        "mount; its owner always reads and writes its ranks' files.")
    m.add_argument("job")
    m.add_argument("mode")
    common(m, lambda a: _change(a, {"mode": parse_mode(a.mode)}))
    for name, doc in (("allow", "let client keys change a job (ptcctl keys list)"),
                      ("deny", "stop client keys from changing a job")):
        w = jsub.add_parser(name, help=doc, description=doc[0].upper() + doc[1:] + ": put, "
                            "commit, reconfigure, delete. Every known key may read it.")
        w.add_argument("job")
        w.add_argument("keys", nargs="+", metavar="KEY")
        common(w, _writers)


def _writers(args: argparse.Namespace) -> int:
    with _coordinator(args) as co:
        now = list(co.state(args.job).writers)
        if args.job_command == "allow":
            want = now + [k for k in args.keys if k not in now]
        else:
            want = [k for k in now if k not in args.keys]
            if not want:
                raise InvalidConfig(f"job {args.job!r} would have no writer key left; allow "
                                    "another key first")
        return _show(args, set_access(co, args.job, {"writers": want}))


def _change(args: argparse.Namespace, changes: dict[str, Any]) -> int:
    with _coordinator(args) as co:
        return _show(args, set_access(co, args.job, changes))


def _show(args: argparse.Namespace, st: JobState) -> int:
    writers = list(st.writers) or ["any client key"]
    if args.json:
        emit_json({"job": st.job, "owner": list(st.owner) if st.owner else None,
                   "mode": f"{st.mode:04o}", "writers": list(st.writers)})
    else:
        print(f"{st.job}: owner {describe_owner(st.owner)}, mode {st.mode:04o}, "
              f"writers {', '.join(writers)}")
    return 0


class _coordinator:
    def __init__(self, args: argparse.Namespace):
        self.cluster = Cluster.load(args.cluster)

    def __enter__(self) -> Coordinator:
        return Coordinator(self.cluster)

    def __exit__(self, *exc: object) -> None:
        self.cluster.close()
