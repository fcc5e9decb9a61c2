"""Chaos soak: a local cluster under readers, saves, reconfigurations and
faults for a bounded time, then a check that nothing was lost or torn.

``python bench/soak.py --minutes M --hosts N --seed S [--json] [--dir DIR]``

A LocalCluster of N ≥ 3 hosts, each with its mount; the last host's store
lies on a small tmpfs (SMALL_STORE_MIB, where this process may mount one).
Job ``j`` (MODEL) goes on, all at once and until the time is up:

- readers: two processes per mount (:mod:`soak_reader`), reading whole
  tensors, ranks' ``state.safetensors`` and memory maps held across
  reconfigurations, each checked against what its version must hold;
- saves: ranks write ``ranks/<r>/state.safetensors`` through their host's
  mount (step ``s`` writes :func:`soak_reader.trained`), then
  ``ptcctl commit j --step s``; a save whose writes fail (the full small
  store) is dropped with ``ptcctl discard j``, as a job that gives it up
  would (left open, it keeps repairs waiting);
- reconfigurations back and forth between MESHES (``ptcctl reconfigure``);
- faults at seeded random times: ``kill -9`` of a daemon (restarted after a
  moment), of ``ptcctl reconfigure`` (paused at a point of its protocol with
  ``PTC_TEST_PAUSE_AT``, or at a random moment), of a reader (restarted);
  the small store filled close to the brim by another job (deleted at the
  next such fault); garbage to the daemons' ports (bytes over TCP, and
  random frames over an authenticated ZeroMQ connection); and at rest
  (:mod:`soak_store`): bytes flipped in a stopped daemon's data file, a data
  file cut short, a store wiped, each healed by ``ptcctl repair`` at once
  (bounded), and a daemon frozen with SIGSTOP for a moment.

Every loop and wait is bounded. At the end: every host is started again,
``ptcctl verify --deep`` finds nothing damaged and ``ptcctl verify`` is
clean (every fault healed), every committed version still kept is whole
(each tensor read back through a mount equals what its step must hold),
the job's step is that of the last commit reported (no lost version), no
reader saw a torn file or died but by our hand or its mount's daemon's
death, a bounded ``ls`` and read of every mount answer, and once the
cluster is down no process of the soak is left. Prints operations of each
kind, errors by kind, faults injected, versions committed and bytes
verified (``--json``: one JSON object); exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file
from soak_reader import Expected, ShortRead, read_whole, trained
from soak_store import STORE_FAULTS, StoreFaults

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.repair import POLL_S, repairs_in_progress
from ptcfs.errors import PtcError
from ptcfs.plan.reshard import cut
from ptcfs.server.mount import is_mounted
from ptcfs.server.net.cluster import load_cluster
from ptcfs.server.net.keys import load_keys
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.sharding import rank_coords, rank_tensors

HERE = Path(__file__).resolve().parent
MODEL = "gpt:layers=2,hidden=256,heads=4,vocab=2000,seq=64"
JOB = "j"
SMALL_STORE_MIB = 48
#: Daemons' settings: stages slow enough for faults to land in them; a dead
#: ptcctl's lock goes soon.
DAEMON_ENV = {"PTC_STAGE_RATE": "16M", "PTC_LOCK_TTL_S": "3"}
CALL_S = 120.0  # the longest one ptcctl may take
#: Distinct messages kept of each error kind (the result's error_samples).
SAMPLES = 3
PAUSE_POINTS = ("staged", "decided", "told", None)  # None: killed at a random moment
FAULTS = {"kill_daemon": 3, "kill_ptcctl": 2, "kill_reader": 2, "fill_store": 1, "garbage": 2,
          **STORE_FAULTS}
READERS_PER_HOST = 2


def meshes(n: int) -> tuple[tuple[str, str], tuple[str, str]]:
    """tp=2 on the first two hosts, and pp=2 on the last two."""
    return ("tp=2", "h0:1,h1:1"), ("tp=1,pp=2", f"h{n - 2}:1,h{n - 1}:1")


def _cmdline(p: Path) -> bytes | None:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return None


def error_kind(rc: int, err: str) -> str:
    """The error class of a failed ``ptcctl --debug`` (its traceback's last
    line), else its exit status."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    m = re.match(r"([A-Za-z_][\w.]*)(:|$)", lines[-1]) if lines else None
    return m.group(1).rsplit(".", 1)[-1] if m else f"exit {rc}"


def os_error(e: BaseException) -> str:
    """The errno name of an OSError, or of safetensors' error that wraps one."""
    code = e.errno if isinstance(e, OSError) else None
    m = re.search(r"os error (\d+)", str(e))
    code = code if code is not None else int(m.group(1)) if m else None
    return errno.errorcode.get(code, type(e).__name__) if code else type(e).__name__


class Soak(StoreFaults):
    job = JOB

    def __init__(self, directory: Path, n: int, seed: int, minutes: float, fault_every: float):
        self.dir = directory
        self.n = n
        self.rng = random.Random(seed)
        self.seed = seed
        self.deadline = time.monotonic() + minutes * 60
        self.fault_every = fault_every
        self.lc = LocalCluster(directory)
        self.small = directory / f"h{n - 1}"
        self.small_mounted = False
        self.meshes = meshes(n)
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        #: error kind -> the first distinct messages of it (ctl)
        self.samples: dict[str, list[str]] = {}
        self.faults: Counter[str] = Counter()
        self.failures: list[str] = []
        self.commits: list[dict[str, int]] = []  # {"step", "version"} of each commit reported
        self.versions: set[int] = set()
        self.killed: dict[str, list[tuple[float, float]]] = {}  # host → (down, up) times
        self.readers: dict[int, tuple[subprocess.Popen[bytes], str, float]] = {}
        self.reader_no = 0
        self.stop = threading.Event()
        self.kill_ctl = threading.Event()
        self.filler = 0  # the filler job's number while one exists
        self.step = 0
        self.lock = threading.Lock()  # the counters, from several threads
        self.env = dict(os.environ, PTC_CLUSTER=str(self.lc.cluster_file))

    # --- ptcctl ---------------------------------------------------------------------
    def ctl(self, op: str, *args: str, env: dict[str, str] | None = None
            ) -> tuple[bool, str]:
        """Run ``ptcctl --debug ARGS``; count it and its error kind."""
        exe = str(Path(sys.executable).with_name("ptcctl"))
        proc = subprocess.Popen([exe, "--debug", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**self.env, **(env or {})})
        try:
            out, err = proc.communicate(timeout=CALL_S / 2)
        except subprocess.TimeoutExpired:
            self.dump_stacks(f"ptcctl {' '.join(args)}", proc.pid)
            try:
                out, err = proc.communicate(timeout=CALL_S / 2)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                self.count(op, f"{op}: timed out")
                tail = " | ".join(err.strip().splitlines()[-3:])
                self.failures.append(f"ptcctl {' '.join(args)} took more than {CALL_S:.0f} s "
                                     f"(stacks in {self.dir}/hang-*.txt with py-spy); the end "
                                     f"of its stderr: {tail or '(nothing)'}")
                return False, ""
        error = None if proc.returncode == 0 else f"{op}: {error_kind(proc.returncode, err)}"
        self.count(op, error)
        if error is not None:
            self.sample(error, err)
        return proc.returncode == 0, out

    def sample(self, error: str, err: str) -> None:
        """Keep the first SAMPLES distinct last lines of an error kind's stderr."""
        lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
        line = lines[-1][:300] if lines else ""
        with self.lock:
            seen = self.samples.setdefault(error, [])
            if line not in seen and len(seen) < SAMPLES:
                seen.append(line)

    def dump_stacks(self, what: str, pid: int) -> None:
        """For a call that hangs: the Python stacks of it and of every
        daemon and mount, with py-spy where it is installed."""
        beside = Path(sys.executable).with_name("py-spy")  # the test extra installs it
        spy = str(beside) if beside.exists() else shutil.which("py-spy")
        if spy is None:
            return
        mine = str(self.dir).encode()
        pids = [pid] + [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                        and _cmdline(p) is not None and mine in (_cmdline(p) or b"")
                        and (b"ptcd" in (_cmdline(p) or b"")
                             or b"ptcfs.server.mount" in (_cmdline(p) or b""))]
        with open(self.dir / f"hang-{time.time():.0f}.txt", "w") as f:
            f.write(f"{what}: no answer after {CALL_S / 2:.0f} s\n")
            for p in pids:
                f.write(f"\n=== {p} {(_cmdline(Path(f'/proc/{p}')) or b'').decode()[:200]}\n")
                f.flush()
                subprocess.run([spy, "dump", "--pid", str(p)], stdout=f, stderr=f, timeout=60)

    def count(self, op: str, error: str | None = None) -> None:
        with self.lock:
            self.ops[op] += 1
            if error:
                self.errors[error] += 1

    def coordinator(self) -> Coordinator:
        return Coordinator(Cluster.load(self.lc.cluster_file))

    # --- set-up -------------------------------------------------------------------------
    def up(self) -> None:
        self.small.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_STORE_MIB}m",
                            "ptcfs-soak", str(self.small)], capture_output=True, text=True)
        self.small_mounted = r.returncode == 0
        os.environ.update(DAEMON_ENV)  # the daemons', also when restarted
        self.lc.up(self.n, gpus=2, mount=True, metrics=True)
        to, hosts = self.meshes[0]
        ok, _ = self.ctl("create", "job", "create", JOB, "--model", MODEL, "--config", to,
                         "--hosts", hosts, "--seed", str(self.seed))
        if not ok:
            raise PtcError("could not create the soak's job")
        co = self.coordinator()
        try:
            state = co.state(JOB)
            np.savez(self.dir / "step0.npz", **{
                s.name: co.fetch_tensor(state, s.name).copy()
                for s in state.model_spec().tensors_for(state.config.pp)})
        finally:
            co.cluster.close()
        for h in range(self.n):
            for _ in range(READERS_PER_HOST):
                self.start_reader(f"h{h}")

    def start_reader(self, host: str) -> None:
        self.reader_no += 1
        i = self.reader_no
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "soak_reader.py"), str(self.lc.mount_dir(host)), JOB,
             str(self.dir), str(self.rng.randrange(1 << 30)), str(self.dir / f"reader-{i}.json")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.dir / f"reader-{i}.log", "ab"))
        self.readers[proc.pid] = (proc, host, time.monotonic())

    # --- the loops ------------------------------------------------------------------
    def pause(self, lo: float, hi: float) -> bool:
        """Wait a random while; False once the time is up."""
        self.stop.wait(self.rng.uniform(lo, hi))
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def reconfigure_loop(self) -> None:
        i = 1
        while self.pause(1.0, 4.0):
            to, hosts = self.meshes[i % 2]
            args = ("reconfigure", JOB, "--to", to, "--hosts", hosts, "--json")
            if self.kill_ctl.is_set():
                self.kill_ctl.clear()
                self.killed_reconfigure(args)
                continue
            ok, out = self.ctl("reconfigure", *args)
            if ok:
                self.versions.add(int(json.loads(out)["version"]))
                i += 1

    def killed_reconfigure(self, args: tuple[str, ...]) -> None:
        """``kill -9`` of a ``ptcctl reconfigure`` paused at a point, or at a random moment."""
        point = self.rng.choice(PAUSE_POINTS)
        env = {**self.env, **({"PTC_TEST_PAUSE_AT": point} if point else {})}
        exe = str(Path(sys.executable).with_name("ptcctl"))
        proc = subprocess.Popen([exe, *args], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        paused = threading.Event()

        def watch() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if "paused at" in line:
                    paused.set()

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        if point:  # until it pauses, or ends (a fault before the point), or for long
            deadline = time.monotonic() + CALL_S / 2
            while not paused.wait(0.1) and proc.poll() is None and \
                    time.monotonic() < deadline:
                pass
        else:
            time.sleep(self.rng.uniform(0.05, 1.5))
        alive = proc.poll() is None
        proc.kill()
        proc.wait()
        t.join(10)
        self.count("reconfigure_killed")
        self.faults[f"kill_ptcctl@{point or 'random'}" + ("" if alive else " (had ended)")] += 1

    def save_loop(self) -> None:
        while self.pause(2.0, 5.0):
            self.step += 1
            step = self.step
            co = self.coordinator()
            try:
                state = co.state(JOB)
            except PtcError as e:
                self.count("save", f"save: {type(e).__name__}")
                continue
            finally:
                co.cluster.close()
            model = state.model_spec()
            try:
                for c in rank_coords(state.config):
                    tensors = {spec.name: np.ascontiguousarray(cut(spec, sl, trained(spec, step)))
                               for spec, sl in rank_tensors(model, state.config, c.rank)}
                    path = self.lc.mount_dir(c.host) / JOB / "ranks" / str(c.rank)
                    save_file(tensors, str(path / "state.safetensors"))
            except Exception as e:  # OSError, or safetensors' own error (os error N)
                self.count("save", f"save: {os_error(e)}")
                # what a job does with a save it gives up: open, it keeps repairs
                # waiting (the next save would reuse it, but the soak may end first)
                self.ctl("discard", "discard", JOB)
                continue
            self.count("save")
            ok, out = self.ctl("commit", "commit", JOB, "--step", str(step), "--json")
            if ok:
                v = int(json.loads(out)["version"])
                with self.lock:
                    self.commits.append({"step": step, "version": v})
                    self.versions.add(v)

    def fault_loop(self) -> None:
        names, weights = zip(*FAULTS.items())
        while self.pause(0.2 * self.fault_every, 1.8 * self.fault_every):
            fault = self.rng.choices(names, weights)[0]
            try:
                getattr(self, fault)()
            except (PtcError, OSError) as e:
                self.errors[f"fault {fault}: {type(e).__name__}"] += 1
            self.check_readers()

    # --- faults ---------------------------------------------------------------------
    def kill_daemon(self) -> None:
        host = f"h{self.rng.randrange(self.n)}"
        down = time.monotonic()
        self.lc.kill(host, signal.SIGKILL)
        self.faults["kill_daemon"] += 1
        self.stop.wait(self.rng.uniform(0.2, 2.0))
        try:
            self.lc.start(host)
        finally:
            self.killed.setdefault(host, []).append((down, time.monotonic()))

    def kill_ptcctl(self) -> None:
        self.kill_ctl.set()  # the reconfiguration loop's next run is killed

    def kill_reader(self) -> None:
        pid = self.rng.choice(sorted(self.readers))
        proc, host, _ = self.readers.pop(pid)
        proc.kill()
        proc.wait()
        self.faults["kill_reader"] += 1
        self.start_reader(host)

    def fill_store(self) -> None:
        """Fill the small store with another job to near its brim, or drop that job."""
        if self.filler:
            self.ctl("delete_filler", "job", "delete", f"fill{self.filler}")
            self.filler = 0
            return
        st = os.statvfs(self.small)
        target = int(st.f_bavail * st.f_frsize * 0.9)
        vocab = max(128, (target - 1_600_000) // 512 // 128 * 128)
        model = f"gpt:layers=1,hidden=256,heads=4,vocab={vocab},seq=64"
        self.filler = self.faults["fill_store"] + 1
        self.faults["fill_store"] += 1
        self.ctl("create_filler", "job", "create", f"fill{self.filler}", "--model", model,
                 "--config", "tp=1", "--hosts", f"h{self.n - 1}:1", "--seed", "1")

    def garbage(self) -> None:
        """Random bytes over TCP, and random frames over an authenticated connection."""
        spec = load_cluster(self.lc.cluster_file)
        host = spec.host(f"h{self.rng.randrange(self.n)}")
        ip, port = host.address.split("://")[1].rsplit(":", 1)
        with socket.create_connection((ip, int(port)), timeout=5) as s:
            s.sendall(self.rng.randbytes(self.rng.randrange(1, 4096)))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if spec.curve_dir:
            keys = load_keys(spec.curve_dir)
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = keys.client_public
            sock.curve_secretkey = keys.client_secret
        sock.connect(host.address)
        try:
            for _ in range(self.rng.randrange(1, 6)):
                frames = [self.rng.randbytes(self.rng.randrange(0, 512))
                          for _ in range(self.rng.randrange(1, 4))]
                sock.send_multipart(frames)
            sock.poll(500)
        finally:
            sock.close(0)
        self.faults["garbage"] += 1

    def check_readers(self) -> None:
        """Restart readers that died; a death is a failure unless the reader's
        mount went with its daemon meanwhile."""
        for pid, (proc, host, started) in list(self.readers.items()):
            if proc.poll() is None:
                continue
            del self.readers[pid]
            if proc.returncode == 0:  # told to stop
                continue
            lost = any(down >= started for down, _ in self.killed.get(host, []))
            why = f"reader {pid} on {host} exited with {proc.returncode}"
            if lost:
                self.errors[f"reader: died with its mount ({proc.returncode})"] += 1
            else:
                self.failures.append(why)
            if not self.stop.is_set():
                self.start_reader(host)

    # --- the end ----------------------------------------------------------------------
    def run(self) -> None:
        threads = [threading.Thread(target=fn, name=fn.__name__, daemon=True)
                   for fn in (self.reconfigure_loop, self.save_loop, self.fault_loop)]
        for t in threads:
            t.start()
        while time.monotonic() < self.deadline:
            self.stop.wait(1.0)
        self.stop.set()
        for t in threads:
            t.join(CALL_S * 2)
            if t.is_alive():
                self.failures.append(f"the {t.name} did not end")

    def finish(self) -> dict[str, Any]:
        (self.dir / "stop").touch()
        for proc, _, _ in self.readers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                self.failures.append(f"reader {proc.pid} did not stop")
                proc.kill()
        self.check_readers()
        for h in range(self.n):
            proc = self.lc.procs.get(f"h{h}")
            if proc is None or proc.poll() is not None:
                self.lc.start(f"h{h}")
        if self.filler:
            self.fill_store()
        self.ctl("discard", "discard", JOB)  # a save whose discard failed (a daemon down)
        self.settle()
        if self.unhealed:  # a heal owed (cut short by the end, or never begun): first
            self.heal(*self.unhealed, finishing=True)
        _, out = self.ctl("verify_deep", "verify", JOB, "--deep", "--json")
        try:
            damaged = json.loads(out)["damaged"]
        except (ValueError, KeyError):
            damaged = ["(no answer)"]
        if damaged:  # damage no fault's heal found: served until then
            self.failures.append(f"ptcctl verify --deep at the end: {out.strip()[:500]}")
        verified = self.check_versions()
        for h in range(self.n):
            self.check_mount(f"h{h}")
        verified["daemon_errors"] = self.daemon_errors()
        return verified

    def daemon_errors(self) -> dict[str, int]:
        """Errors the daemons answered, by kind (their metrics, since their last start)."""
        out: Counter[str] = Counter()
        for h in range(self.n):
            try:
                with urllib.request.urlopen(self.lc.metrics_url(f"h{h}"), timeout=10) as r:
                    text = r.read().decode()
            except OSError as e:
                self.failures.append(f"the metrics of h{h} do not answer: {e}")
                continue
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "ptcd_errors_total":
                        out[s.labels["kind"]] += int(s.value)
        return dict(out)

    def settle(self) -> None:
        """Wait (at most CALL_S) for a repair of the job that the last fault
        started to end: it commits the job's next version, which the checks
        read (checked before, a host was caught still catching up)."""
        co = self.coordinator()
        hosts = [f"h{h}" for h in range(self.n)]
        deadline = time.monotonic() + CALL_S
        try:
            while JOB in repairs_in_progress(co.cluster, hosts):
                if time.monotonic() > deadline:
                    self.failures.append(f"the repair of {JOB} did not end in {CALL_S:.0f} s")
                    return
                time.sleep(POLL_S)  # the repair's own progress poll
        except (PtcError, OSError) as e:
            self.failures.append(f"asking for repairs failed: {type(e).__name__}: {e}")
        finally:
            co.cluster.close()

    def check_versions(self) -> dict[str, Any]:
        ok, out = self.ctl("verify", "verify", JOB, "--json")
        if not ok or not json.loads(out)["ok"]:
            self.failures.append(f"ptcctl verify: {out.strip()[:500]}")
        co = self.coordinator()
        expect = Expected(self.dir / "step0.npz")
        checked = nbytes = 0
        try:
            state = co.state(JOB)
            last = max((c["step"] for c in self.commits), default=0)
            if state.step != last:
                self.failures.append(f"the job is at step {state.step}; the last commit "
                                     f"reported was step {last}")
            answers, down = co.cluster.call_all("versions", job=JOB)
            kept = {v["version"]: v["meta"] for vs in answers.values() for v in vs
                    if v["state"] == "committed"}
            for c in self.commits:  # a commit reported is kept as that step, or pruned
                if c["version"] in kept and kept[c["version"]].get("step") != c["step"]:
                    self.failures.append(f"version {c['version']} committed as step "
                                         f"{c['step']} holds step {kept[c['version']]['step']}")
            holders = {v["version"]: h for h, vs in sorted(answers.items(), reverse=True)
                       for v in vs if v["state"] == "committed"}
            for h, vs in answers.items():  # a host that missed a commit lags behind
                if max((v["version"] for v in vs if v["state"] == "committed"), default=0) \
                        < state.version:
                    self.errors[f"end: {h} lacks the current version"] += 1
            for v, meta in sorted(kept.items()):
                mnt = self.lc.mount_dir(holders[v]) / JOB / "versions"  # a mount that has it
                st = state.from_meta(meta)
                for spec in st.model_spec().tensors_for(st.config.pp):
                    path = mnt / str(v) / "tensors" / f"{spec.name}.npy"
                    try:
                        got = np.load(io.BytesIO(read_whole(path)))
                    except (ShortRead, ValueError) as e:
                        self.failures.append(f"{path}: torn: {e}")
                        continue
                    if not np.array_equal(got, expect.tensor(spec, st.step)):
                        self.failures.append(f"version {v} (step {st.step}): {spec.name} "
                                             "is not what was written")
                    nbytes += got.nbytes
                checked += 1
        except (PtcError, OSError) as e:
            self.failures.append(f"checking the versions failed: {type(e).__name__}: {e}")
        finally:
            co.cluster.close()
        return {"versions_checked": checked, "bytes": nbytes}

    def check_mount(self, host: str) -> None:
        root = self.lc.mount_dir(host) / JOB
        for cmd in (["ls", str(root)], ["cat", str(root / "config.json")]):
            try:
                r = subprocess.run(cmd, capture_output=True, timeout=10)
                if r.returncode != 0:
                    self.failures.append(f"{' '.join(cmd)}: {r.stderr.decode().strip()}")
            except subprocess.TimeoutExpired:
                self.failures.append(f"the mount of {host} is stuck: {' '.join(cmd)}")

    def down(self) -> None:
        for proc, _, _ in self.readers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.lc.down()
        deadline = time.monotonic() + 15
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            self.failures.append(f"processes left: {left}")
        for m in (self.dir / "mnt").glob("*"):
            if is_mounted(m):
                self.failures.append(f"{m} is still mounted")
        if self.small_mounted:
            subprocess.run(["umount", "-l", str(self.small)], capture_output=True)

    def leftovers(self) -> list[str]:
        """Processes whose command line names the soak's directory (pid and
        command), but this one and those that started it."""
        mine = str(self.dir).encode()
        ours = set()
        pid = os.getpid()
        while pid > 1:
            ours.add(pid)
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        out = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit() and int(p.name) not in ours:
                try:
                    cmd = (p / "cmdline").read_bytes()
                except OSError:
                    continue
                if mine in cmd:
                    words = cmd.replace(b"\0", b" ").decode(errors="replace")
                    out.append(f"{p.name} {words[:200]}")
        return out

    def readers_summary(self) -> dict[str, Any]:
        ops: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        nbytes = 0
        for f in self.dir.glob("reader-*.json"):
            doc = json.loads(f.read_text())
            ops.update(doc["ops"])
            errors.update(doc["errors"])
            nbytes += doc["bytes"]
        torn = self.dir / "torn.jsonl"
        torn_reads = torn.read_text().splitlines() if torn.exists() else []
        for line in torn_reads[:10]:
            self.failures.append(f"torn read: {line}")
        return {"ops": dict(ops), "errors": dict(errors), "bytes": nbytes,
                "torn": len(torn_reads)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-every", type=float, default=6.0, metavar="S",
                    help="mean seconds between faults")
    ap.add_argument("--dir", type=Path, help="the cluster's directory (default: a new "
                    "temporary one, removed when every check passed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.hosts < 3 or args.minutes <= 0:
        ap.error("--hosts must be at least 3 and --minutes above 0")
    directory = (args.dir or Path(tempfile.mkdtemp(prefix="ptcfs-soak-"))).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    soak = Soak(directory, args.hosts, args.seed, args.minutes, args.fault_every)
    # a soak stopped from outside (timeout's TERM) still takes its cluster, mounts
    # and small store down on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t0 = time.monotonic()
    verified: dict[str, Any] = {}
    try:
        soak.up()
        soak.run()
        verified = soak.finish()
    except (PtcError, OSError) as e:
        soak.failures.append(f"the soak stopped: {type(e).__name__}: {e}")
    finally:
        soak.down()
    readers = soak.readers_summary()
    ops = dict(soak.ops)
    ops.update({f"read_{k}": v for k, v in readers["ops"].items()})
    errors = dict(soak.errors)
    errors.update({f"read: {k}": v for k, v in readers["errors"].items()})
    result = {
        "ok": not soak.failures, "seconds": round(time.monotonic() - t0, 1),
        "hosts": args.hosts, "seed": args.seed, "small_store_mib":
            SMALL_STORE_MIB if soak.small_mounted else None,
        "ops": ops, "errors": errors, "error_samples": soak.samples,
        "faults": dict(soak.faults),
        "daemon_errors": verified.get("daemon_errors", {}),
        "versions_committed": len(soak.versions), "saves_committed": len(soak.commits),
        "torn_reads": readers["torn"],
        "bytes_verified": readers["bytes"] + verified.get("bytes", 0),
        "versions_checked_at_end": verified.get("versions_checked", 0),
        "failures": soak.failures, "dir": str(directory)}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key in ("ops", "errors", "faults", "daemon_errors"):
            print(f"{key}:")
            for k, v in sorted(result[key].items()):
                print(f"  {k:<44} {v}")
        for key in ("versions_committed", "saves_committed", "versions_checked_at_end",
                    "torn_reads", "bytes_verified", "seconds", "small_store_mib"):
            print(f"{key}: {result[key]}")
        print("failures:" if soak.failures else "ok: nothing lost, nothing torn, no mount "
              "stuck, no process left")
        for f in soak.failures:
            print(f"  {f}")
    if not soak.failures and args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if not soak.failures else 1


if __name__ == "__main__":
    sys.exit(main())
