"""One run, one uploader: the workspace lease (lease.py) held on the checkpoint remote too.

Two pods of one run, each on its own volume (a replacement that `deploy watch` started in another data center
while the old pod still ran), must never upload into one generation. The uploader (remote.Uploader) holds
`<remote>/<experiment>/<trial>/lease.json`, naming its pod and boot, before it uploads; it renews it every
`renew_s` (a count, `beat`, that changes) and releases it when the pod stops. An uploader that finds another
pod's lease live does not upload: it says so once per holder, and records it (records.REMOTE "lease").

Whether another pod's lease is live is judged as lease.py judges another host's: a lease whose content has not
changed for `lapse_s` of this reader's own watch has lapsed and may be taken, never from two machines' clocks
(the dates in it are shown, not compared). The same pod's lease (a restarted listener, the pod's earlier boot)
is this pod's to take at once: one pod runs one container.

rclone has no conditional write, so the lease is taken by writing ours and reading it back: the holder is the
one whose token the object names, the rule both sides apply (S3 and its kin keep the last write and read it back
at once). The race window: pods A and B both find the lease free or lapsed; A writes and reads back A; B writes and
reads back B. A believes it holds the lease until its next look, which the uploader makes just before it writes a
generation's manifest: both write a manifest only when those looks interleave within that instant, and then one
generation holds one pod's files under the other's manifest, which fails its sha256 at restore (remote.verify):
that generation is refused and the older one restored, never a wrong checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

from podkit.areal import identity
from podkit.host import lease
from podkit.remote.mover import RemoteError

NAME = "lease.json"


def pod_name(environ=None) -> str:
    """This pod, as the lease names it: RunPod's pod id, else the container's hostname."""
    environ = os.environ if environ is None else environ
    return environ.get("RUNPOD_POD_ID") or socket.gethostname()


class RemoteLease:
    """The run's lease on the remote, as one uploader holds it. `remote` is remote.Remote."""

    def __init__(self, remote, lapse_s: float, renew_s: float = lease.RENEW_S, pod: str | None = None,
                 identity: dict | None = None) -> None:
        self.remote, self.lapse_s, self.renew_s = remote, lapse_s, renew_s
        self.holder_lapse_s = lapse_s  # the last live holder's lapse (its renewal period doubled, at least lapse_s)
        self.pod = pod or pod_name()
        self.identity = identity  # this run's identity record: a lease of another run's is that run's, not ours
        self.other_run: dict | None = None  # the identity of another run that holds this lease (hold() said so)
        self.token = ""  # ours while we hold it
        self.beat = 0
        self.renewed = 0.0  # time.monotonic() of our last write
        self.seen = 0.0  # time.monotonic() of our last read that found the lease ours
        self._seen: dict[str, float] = {}  # another pod's lease content -> when this reader first saw it

    def rebind(self, remote, identity: dict | None) -> None:
        """The lease of another lineage of the run (remote.Remote.of_lineage), held as the run `identity`."""
        self.remote, self.identity = remote, identity
        self.token, self.beat, self.renewed, self.seen, self._seen = "", 0, 0.0, 0.0, {}

    @property
    def path(self) -> str:
        return f"{self.remote.base}/{NAME}"

    def read(self) -> dict | None:
        """The lease on the remote; None when there is none; {} when it is not one (taken as lapsed)."""
        try:
            raw = self.remote.rclone("cat", self.path, timeout=60)
        except RemoteError as e:
            if "not found" in str(e).lower():
                return None
            raise
        if not raw.strip():
            return None  # S3 lists a missing key's cat as empty
        try:
            data = json.loads(raw)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def live(self, holder: dict) -> bool:
        """Another pod's lease still holds, as far as this reader has watched it change."""
        if not holder.get("token") or holder.get("pod") == self.pod:
            return False
        key = json.dumps(holder, sort_keys=True)
        first = self._seen.setdefault(key, time.monotonic())
        if len(self._seen) > 64:
            for k in sorted(self._seen, key=self._seen.get)[:-64]:
                del self._seen[k]
        every = holder.get("renew_s")
        lapse = max(self.lapse_s, 2 * min(every, lease.MAX_RENEW_S) + 5) \
            if isinstance(every, (int, float)) and not isinstance(every, bool) and every > 0 else self.lapse_s
        self.holder_lapse_s = lapse  # what the words say: the holder renews every renew_s, so it lapses after this
        return time.monotonic() - first < lapse

    def hold(self, fresh_s: float = 0.0) -> str:
        """"" when this uploader holds the run's lease (taken, or renewed when due); else who holds it. Raises
        remote.RemoteError when the remote cannot be read or written. `fresh_s`: a lease read as ours within it, and
        not due for renewal, is taken as still ours without a read (another pod takes it only once it has lapsed)."""
        now = time.monotonic()
        self.other_run = None
        if self.token and now - self.seen < fresh_s and now - self.renewed < self.renew_s:
            return ""
        holder = self.read()
        theirs = holder.get("identity") if holder else None
        if theirs is not None and self.identity is not None and holder.get("token") != self.token \
                and not _same_run(self.identity, theirs, self.remote):
            # another run under the same names and prefix: not a pod of this run, and no reason to wait for it
            self.token, self.other_run = "", theirs if isinstance(theirs, dict) else {}
            return f"another run holds a lease on {self.remote.where()}"
        if holder and holder.get("token") == self.token and self.token and now - self.renewed < self.renew_s:
            self.seen = now
            return ""
        if holder and holder.get("token") != self.token and self.live(holder):
            self.token = ""
            return f"another pod holds this run's lease on the remote ({who(holder)})"
        mine = holder is not None and holder.get("token") == self.token and bool(self.token)
        token = self.token if mine else os.urandom(8).hex()
        wall = time.time()
        ours = {"pod": self.pod, "boot": _boot(), "token": token, "beat": self.beat + 1, "renew_s": self.renew_s,
                "since": holder.get("since") if mine else wall, "renewed": wall,
                **({"identity": self.identity} if self.identity is not None else {})}
        self._write(ours)
        back = self.read() or {}
        if back.get("token") != token:  # another pod wrote after us: the object names the holder
            self.token = ""
            return f"another pod took this run's lease on the remote at once ({who(back)})"
        self.token, self.beat, self.renewed = token, ours["beat"], now
        self.seen = now
        return ""

    def release(self) -> bool:
        """Removes the lease when it is ours (the pod is stopping: the next pod of the run uploads at once)."""
        if not self.token:
            return False
        holder = self.read()
        if not holder or holder.get("token") != self.token:
            return False
        self.remote.rclone("deletefile", self.path, timeout=30)
        self.token = ""
        return True

    def _write(self, data: dict) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # a known size: one plain PUT
            json.dump(data, f)
            f.flush()
            self.remote.rclone("copyto", f.name, self.path, timeout=60)


def who(holder: dict) -> str:
    since = holder.get("since")  # the holder's clock: shown, never compared
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since)) + " UTC" \
        if isinstance(since, (int, float)) and not isinstance(since, bool) and 0 < since < 1e11 else "?"
    return f"pod {str(holder.get('pod', '?'))[:64]}, boot {str(holder.get('boot', '?'))[:64]}, since {when}"


def _boot() -> str:
    """This boot of the pod: its supervisord (the listener's parent) by pid and start time."""
    from podkit.host import proc

    ppid = os.getppid()
    return f"{socket.gethostname()}:{ppid}:{proc.starttime(ppid) or 0}"


def _same_run(mine: dict, theirs, remote) -> bool:
    """A lease that says which run holds it is this run's when identity.differences finds nothing (the definition
    runrecord.same_run uses)."""
    return identity.is_record(theirs) and not identity.differences(mine, theirs, Path("/nonexistent"))
