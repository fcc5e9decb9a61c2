"""A job's files on the mount are its owner's, with the job's mode: another
user (uid 65534, through setpriv) cannot read a job whose mode says so,
nor write or delete any job's rank state; the owner (root here, then uid
65534 once the job is given to it) saves, commits and reconfigures."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator

import pytest

from ptcfs.server.testing.localcluster import LocalCluster
from tests.daemons import mounted_for_all
from tests.test_cluster import SMALL, checksums, ptcctl
from tests.test_store_modes import NOBODY


def _nobody_shell() -> str | None:
    if os.geteuid() != 0:
        return "needs root, to run a command as another user"
    if shutil.which("setpriv") is None:
        return "setpriv is not installed (util-linux)"
    return None


pytestmark = [pytest.mark.fuse, pytest.mark.multihost,
              pytest.mark.skipif(_nobody_shell() is not None, reason=str(_nobody_shell()))]

#: run as uid 65534 with a plain shell (its Python may be out of its reach):
#: try each action on each job, print "job action ok|EACCES|<error>"
TRY = r"""
cd "$1" || exit 3
tmp=$(mktemp) || exit 3
attempt() {  # job action command...
    job=$1 act=$2; shift 2
    if err=$("$@" 2>&1 >/dev/null); then echo "$job $act ok"
    else case "$err" in *"Permission denied"*) echo "$job $act EACCES";;
         *) echo "$job $act $(echo "$err" | tr ' ' _)";; esac; fi
}
for job in private shared; do
    r0=$job/ranks/0
    attempt $job read cat $job/config.json
    attempt $job list ls $r0
    attempt $job write sh -c "cat $r0/state.safetensors > $tmp && cat $tmp > $r0/state.safetensors"
    attempt $job create sh -c ": > $r0/.tmp"
    attempt $job unlink rm $r0/state.safetensors
    attempt $job dcp mkdir $job/dcp/step-99
done
rm -f "$tmp"
"""


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """One host, mounted, in a folder every user may enter."""
    with mounted_for_all("ptc-owner-", 1) as lc:
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "private", "--model", SMALL, "--config", "tp=2",
               "--hosts", "h0:2")
        ptcctl(cf, "job", "create", "shared", "--model", SMALL, "--config", "tp=2",
               "--hosts", "h0:2", "--mode", "0644")
        yield lc


def nobody_tries(lc: LocalCluster) -> dict[str, dict[str, str]]:
    out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                          "--clear-groups", "sh", "-c", TRY, "sh", str(lc.mount_dir("h0"))],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    got: dict[str, dict[str, str]] = {}
    for line in out.stdout.splitlines():
        job, act, result = line.split(" ", 2)
        got.setdefault(job, {})[act] = result
    return got


def test_files_show_the_jobs_owner_and_mode(cluster):
    mnt = cluster.mount_dir("h0")
    jobs = json.loads(ptcctl(cluster.cluster_file, "status", "--json").stdout)["jobs"]
    assert [jobs[j]["owner"] for j in ("private", "shared")] == [[os.getuid(), os.getgid()]] * 2
    assert [jobs[j]["mode"] for j in ("private", "shared")] == ["0640", "0644"]
    for job, bits in (("private", 0o640), ("shared", 0o644)):
        st = os.stat(mnt / job / "versions" / "1" / "config.json")
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
        assert stat.S_IMODE(st.st_mode) == bits & 0o444  # committed: read-only
        assert stat.S_IMODE(os.stat(mnt / job / "ranks" / "0" / "state.safetensors").st_mode) \
            == bits
        assert stat.S_IMODE(os.stat(mnt / job).st_mode) == (bits | (bits & 0o444) >> 2) & ~0o222


def test_another_user_cannot_read_write_or_delete(cluster):
    before = checksums(cluster.cluster_file, "shared")
    got = nobody_tries(cluster)
    assert got["private"] == {"read": "EACCES", "list": "EACCES", "write": "EACCES",
                              "create": "EACCES", "unlink": "EACCES", "dcp": "EACCES"}
    assert got["shared"] == {"read": "ok", "list": "ok", "write": "EACCES",
                             "create": "EACCES", "unlink": "EACCES", "dcp": "EACCES"}
    assert checksums(cluster.cluster_file, "shared") == before


def test_the_owner_saves_commits_and_reconfigures(cluster):
    cf, mnt = cluster.cluster_file, cluster.mount_dir("h0")
    # root owns "private": it saves through the mount and commits
    for r in (0, 1):
        path = mnt / "private" / "ranks" / str(r) / "state.safetensors"
        path.write_bytes(path.read_bytes())
    ptcctl(cf, "commit", "private", "--step", "1")
    # "shared" goes to uid 65534, which can then save through the mount
    out = json.loads(ptcctl(cf, "job", "chown", "shared", f"{NOBODY}:{NOBODY}",
                            "--json").stdout)
    assert out["owner"] == [NOBODY, NOBODY] and out["mode"] == "0644"
    st = os.stat(mnt / "shared" / "ranks" / "0" / "state.safetensors")
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    got = nobody_tries(cluster)
    assert got["shared"]["write"] == "ok" and got["shared"]["create"] == "ok"
    assert got["shared"]["dcp"] == "ok"  # a DCP save's step folder, by the job's owner
    assert got["private"]["write"] == "EACCES"
    for r in (1,):
        path = mnt / "shared" / "ranks" / str(r) / "state.safetensors"
        path.write_bytes(path.read_bytes())  # root may write any job's state
    ptcctl(cf, "commit", "shared", "--step", "2")
    ptcctl(cf, "reconfigure", "shared", "--to", "tp=1,dp=2", "--hosts", "h0:2")
    assert json.loads((mnt / "shared" / "config.json").read_text())["step"] == 2
    st = os.stat(mnt / "shared" / "ranks" / "1" / "state.safetensors")
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)  # kept across versions
    ptcctl(cf, "job", "chmod", "shared", "0600")
    assert nobody_tries(cluster)["shared"]["write"] == "ok"  # the owner still writes
