"""``ptcctl job chown/chmod/allow/deny``, the ``--owner``/``--mode`` of
``job create`` and ``import``, and ``ptcctl keys``: who owns a job, who
may change it, and the keys they do it with."""

from __future__ import annotations

import argparse
from typing import Any

from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.control.access import describe_owner, parse_owner
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.errors import InvalidConfig
from ptcfs.jobstate import DEFAULT_MODE, JobState, check_mode
from ptcfs.server.net.cluster import load_cluster
from ptcfs.server.net.keys import client_keys, generate_keys, new_client_key

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
        return _show(args, co.set_access(args.job, {"writers": want}))


def _change(args: argparse.Namespace, changes: dict[str, Any]) -> int:
    with _coordinator(args) as co:
        return _show(args, co.set_access(args.job, changes))


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


# --- keys ---------------------------------------------------------------------
@register("keys")
def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="CurveZMQ keys: the daemons' and one per client")
    ksub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    g = ksub.add_parser("generate", help="make a cluster's keys in DIR (the daemons' "
                        "keypair and client key 'client')")
    g.add_argument("dir")
    g.set_defaults(run=lambda a: (print(f"keys written to {generate_keys(a.dir)}"), 0)[1])
    for name, doc in (("new", "make client key NAME (its user sets PTC_CLIENT_KEY=NAME)"),
                      ("rotate", "give client key NAME a new keypair; the old one is refused "
                       "from the daemons' next connection")):
        n = ksub.add_parser(name, help=doc, description=doc[0].upper() + doc[1:] + ".")
        n.add_argument("name")
        _keys_dir_arg(n)
        n.set_defaults(run=_new_key)
    ls = ksub.add_parser("list", help="the client keys the daemons admit")
    _keys_dir_arg(ls)
    ls.set_defaults(run=_list_keys)


def _keys_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="the key directory (default: the cluster file's "
                   "curve_secret_dir)")
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--json", action="store_true")


def _keys_dir(args: argparse.Namespace) -> str:
    if args.dir:
        return str(args.dir)
    spec = load_cluster(args.cluster)
    if spec.curve_dir is None:
        raise InvalidConfig(f"{spec.path} has no curve_secret_dir: this cluster runs without "
                            "keys (give --dir, or make keys with ptcctl keys generate DIR)")
    return str(spec.curve_dir)


def _new_key(args: argparse.Namespace) -> int:
    path = new_client_key(_keys_dir(args), args.name, replace=args.keys_command == "rotate")
    if args.json:
        emit_json({"name": args.name, "secret": str(path)})
    else:
        done = "rotated" if args.keys_command == "rotate" else "made"
        print(f"{done} client key {args.name}: {path} (give it to its user only; they set "
              f"PTC_CLIENT_KEY={args.name} or PTC_CLIENT_KEY={path})")
    return 0


def _list_keys(args: argparse.Namespace) -> int:
    keys = client_keys(_keys_dir(args))
    if args.json:
        emit_json({"keys": [{"name": n, "public": k.decode()} for n, k in keys.items()]})
    else:
        for n, k in keys.items():
            print(f"{n}\t{k.decode()}")
    return 0


# --- audit --------------------------------------------------------------------
@register("audit")
def _add_audit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="the last changes of a job, from every host",
                       description="Every request that changed JOB (puts, commits, "
                       "reconfigurations, deletions, owner and writer changes), as the "
                       "daemons recorded them, merged by time: when, host, key (and uid, "
                       "rank for saves through a mount), operation, version, bytes.")
    p.add_argument("job")
    p.add_argument("--last", type=int, default=50, help="how many (default 50)")
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--json", action="store_true", help="one JSON object: entries, down")
    p.set_defaults(run=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    if args.last < 1:
        raise InvalidConfig(f"--last must be at least 1, not {args.last}")
    cluster = Cluster.load(args.cluster)
    try:
        answers, down = cluster.call_all("audit", job=args.job, last=args.last)
    finally:
        cluster.close()
    entries = sorted((e for got in answers.values() for e in got),
                     key=lambda e: (e["t"], e["host"]))[-args.last:]
    if args.json:
        emit_json({"job": args.job, "entries": entries, "down": down})
        return 0
    import time

    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["t"])) + \
            f".{int(e['t'] % 1 * 1000):03d}"
        who = e["key"] or e["caller"]
        if e.get("uid") is not None:
            who += f" uid {e['uid']}"
        what = " ".join(str(x) for x in (
            f"v{e['version']}" if e["version"] is not None else None,
            f"rank {e['rank']}" if e.get("rank") is not None else None,
            e["tensor"], f"[{e['part']}]" if e["part"] else None,
            f"{e['bytes']} B" if e["bytes"] else None) if x)
        status = f"  REFUSED/FAILED: {e['error']}" if e["error"] else ""
        print(f"{when} {e['host']} {who}: {e['op']} {what}{status}".rstrip())
    if down:
        print(f"(hosts not answering, their entries missing: {', '.join(down)})")
    return 0
