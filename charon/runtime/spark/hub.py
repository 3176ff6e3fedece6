"""Rounds exchanged between the tasks of one Spark job: :class:`RoundHub` in the driver, :class:`HubClient` in
each task, :class:`PeerLinks` between the tasks.

The rest of a large epoch runs as one job of several tasks, each over a group of partitions; the first task runs
the coordinator, and each round it sends the others their partitions' inboxes and takes in their outputs. The tasks
meet at the hub (an all-gather: each sends a frame, each gets every task's back) to learn where the first one
listens, then talk directly. Spark's own ``BarrierTaskContext.allGather`` would do for the meeting, but costs ~1 s per
call (the executor polls the driver once a second). The job runs in barrier mode, so its tasks start together (none
waits on a slot a waiting task holds) and a failed task fails them all.

Frames: 4-byte big-endian length, then the bytes. A task's hello: the job's 16-byte token, 0 (reserved), its index
and the job's task count (4 bytes each). Then per round: one frame in, the tasks' frames in task order out.
"""

from __future__ import annotations

import os
import socket
import socketserver
import struct
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark import SparkContext

_LEN = struct.Struct(">I")
_HELLO = struct.Struct(">16sIII")
WAIT_S = 600.0  # longest a task waits for the others' round (a safety net: a failed task fails the stage)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("round hub: connection closed")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv(sock, 4))
    return _recv(sock, n)


class _Session:
    """One attempt of one job: its tasks' frames by round."""

    def __init__(self, tasks: int) -> None:
        self.tasks = tasks
        self.seated: set[int] = set()
        self.rounds: dict[int, list[bytes | None]] = {}
        self.sent: dict[int, int] = {}
        self.cond = threading.Condition()
        self.closed = False


class RoundHub:
    """The driver's side: a TCP server the tasks of a job of :meth:`open`'s token meet at, round by round."""

    def __init__(self, bind: str = "0.0.0.0", advertise: str | None = None) -> None:
        hub = self
        self.jobs: dict[bytes, _Session | None] = {}
        self.lock = threading.Lock()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                hub._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((bind, 0), Handler)
        self.port = self.server.server_address[1]
        self.host = advertise or (bind if bind not in ("", "0.0.0.0") else "127.0.0.1")
        self.thread = threading.Thread(target=self.server.serve_forever, name="charon-round-hub", daemon=True)
        self.thread.start()

    @classmethod
    def for_spark(cls, sc: SparkContext) -> RoundHub:
        """A hub the executors of ``sc`` reach: on the driver's address (``spark.driver.host``), bound where the
        driver binds (``spark.driver.bindAddress``)."""
        conf = sc.getConf()
        host = conf.get("spark.driver.host") or socket.gethostname()
        bind = conf.get("spark.driver.bindAddress") or "0.0.0.0"
        return cls(bind, host)

    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def open(self) -> bytes:
        """A token for one job: its tasks name it in their hello (anything else is refused)."""
        token = os.urandom(16)
        with self.lock:
            self.jobs[token] = None
        return token

    def close(self, token: bytes) -> None:
        """The job is over (or failed): its sessions end, a task still waiting gets a closed connection."""
        with self.lock:
            s = self.jobs.pop(token, None)
        if s is not None:
            with s.cond:
                s.closed = True
                s.cond.notify_all()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        token, _, index, tasks = _HELLO.unpack(_recv(sock, _HELLO.size))
        with self.lock:
            if token not in self.jobs or not 0 <= index < tasks:
                return
            s = self.jobs[token]
            if s is None or index in s.seated or s.tasks != tasks:
                # a task of this index again: the job's stage is retried (barrier mode retries all its tasks),
                # so the attempt before ends here (its tasks still waiting fail) and a new one starts
                old, s = s, _Session(tasks)
                self.jobs[token] = s
                if old is not None:
                    with old.cond:
                        old.closed = True
                        old.cond.notify_all()
            s.seated.add(index)
        r = 0
        while True:
            try:
                frame = _recv_frame(sock)
            except (ConnectionError, OSError):
                return
            with s.cond:
                slot = s.rounds.setdefault(r, [None] * tasks)
                slot[index] = frame
                s.cond.notify_all()
                def ready(slot: list[bytes | None] = slot) -> bool:
                    return s.closed or all(x is not None for x in slot)

                full = s.cond.wait_for(ready, WAIT_S)
                if not full or s.closed:
                    return
                frames = [f for f in slot if f is not None]  # every task's, in task order
                s.sent[r] = s.sent.get(r, 0) + 1
                if s.sent[r] == tasks:  # every task has its copy
                    del s.rounds[r], s.sent[r]
            sock.sendall(b"".join(_LEN.pack(len(f)) + f for f in frames))
            r += 1


class HubClient:
    """A task's side: :meth:`gather` sends this task's frame of a round and returns every task's."""

    def __init__(self, address: tuple[str, int], token: bytes, index: int, tasks: int) -> None:
        self.tasks = tasks
        self.sock = socket.create_connection(address, timeout=WAIT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(_HELLO.pack(token, 0, index, tasks))

    def gather(self, frame: bytes) -> list[bytes]:
        self.sock.sendall(_LEN.pack(len(frame)) + frame)
        return [_recv_frame(self.sock) for _ in range(self.tasks)]

    def close(self) -> None:
        self.sock.close()


class PeerLinks:
    """Task-to-task links of one split rest, met through the hub once: the first task listens, the others connect
    to it directly, so a round costs one round trip between two tasks and nothing of the driver.

    :meth:`lead` (the first task) and :meth:`follow` (the others) return the links; the first task then sends a
    frame to each other task and receives theirs (:meth:`send`, :meth:`recv`), the others the same with the first."""

    def __init__(self, socks: dict[int, socket.socket]) -> None:
        self.socks = socks

    @classmethod
    def lead(cls, client: HubClient, token: bytes) -> PeerLinks:
        host = os.environ.get("SPARK_LOCAL_IP") or socket.gethostbyname(socket.gethostname())
        listener = socket.create_server(("", 0))
        try:
            listener.settimeout(WAIT_S)
            client.gather(f"{host} {listener.getsockname()[1]}".encode())
            socks: dict[int, socket.socket] = {}
            while len(socks) < client.tasks - 1:
                sock, _ = listener.accept()
                sock.settimeout(WAIT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello = _recv(sock, 20)
                index = int.from_bytes(hello[16:], "big")
                if hello[:16] != token or not 0 < index < client.tasks or index in socks:
                    sock.close()  # not one of this job's tasks
                    continue
                socks[index] = sock
        finally:
            listener.close()
        return cls(socks)

    @classmethod
    def follow(cls, client: HubClient, token: bytes, index: int) -> PeerLinks:
        host, port = client.gather(b"")[0].decode().split()
        sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token + index.to_bytes(4, "big"))
        return cls({0: sock})

    def send(self, to: int, frame: bytes) -> None:
        self.socks[to].sendall(_LEN.pack(len(frame)) + frame)

    def recv(self, frm: int) -> bytes:
        return _recv_frame(self.socks[frm])

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
