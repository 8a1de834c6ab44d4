"""Passing file descriptors (shareable GPU memory handles) between processes of one host.

Each process that shares memory runs one `HandleServer`: a Unix-domain
stream socket (Linux abstract namespace, else a path under the temp dir)
served by a daemon thread.  The owner `offer`s a descriptor under a key; a
peer that learnt the server's address and secret (through the rendezvous)
`fetch`es it: the descriptor travels as SCM_RIGHTS ancillary data
(socket.send_fds / recv_fds), so the peer gets its own descriptor of the
same object.  The secret keeps other local processes from fetching memory
they were not given; pidfd_getfd is not used (unsupported under gVisor).
"""
from __future__ import annotations

import os
import secrets
import socket
import tempfile
import threading

_MAX_REQUEST = 4096


class HandleServer:
  """Serves this process's offered descriptors to peers that know the secret."""

  def __init__(self):
    self.secret = secrets.token_hex(16)
    self._fds: dict[str, int] = {}
    self._lock = threading.Lock()
    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"jax_autooverlap-{os.getpid()}-{secrets.token_hex(8)}"
    self._path = None
    try:
      self._sock.bind("\0" + name)  # abstract: nothing to clean up
      self.address = "@" + name
    except OSError:
      self._path = os.path.join(tempfile.gettempdir(), name + ".sock")
      self._sock.bind(self._path)
      os.chmod(self._path, 0o600)
      self.address = self._path
    self._sock.listen(64)
    self._closed = False
    self._thread = threading.Thread(target=self._serve, name="jax_autooverlap-fdshare",
                                    daemon=True)
    self._thread.start()

  def offer(self, key: str, fd: int):
    """Serve a duplicate of fd under key (the caller keeps and closes its own fd)."""
    with self._lock:
      old = self._fds.pop(key, None)
      self._fds[key] = os.dup(fd)
    if old is not None:
      os.close(old)

  def withdraw(self, key: str):
    with self._lock:
      fd = self._fds.pop(key, None)
    if fd is not None:
      os.close(fd)

  def close(self):
    self._closed = True
    try:
      self._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self._sock.close()
    if self._path:
      try:
        os.unlink(self._path)
      except OSError:
        pass
    with self._lock:
      fds, self._fds = list(self._fds.values()), {}
    for fd in fds:
      os.close(fd)

  def _serve(self):
    while not self._closed:
      try:
        conn, _ = self._sock.accept()
      except OSError:
        return
      with conn:
        try:
          conn.settimeout(10.0)
          request = _recv_line(conn)
          secret, _, key = request.partition(" ")
          with self._lock:
            fd = self._fds.get(key) if secrets.compare_digest(secret, self.secret) else None
            if fd is None:
              conn.sendall(b"missing\n")
            else:
              socket.send_fds(conn, [b"ok\n"], [fd])
        except OSError:
          continue


def _recv_line(conn) -> str:
  data = b""
  while not data.endswith(b"\n"):
    chunk = conn.recv(_MAX_REQUEST)
    if not chunk:
      break
    data += chunk
    if len(data) > _MAX_REQUEST:
      raise OSError("request too long")
  return data.decode().rstrip("\n")


def fetch(address: str, secret: str, key: str, timeout_s: float = 30.0) -> int:
  """A new descriptor of what the server at `address` offers under `key` (the caller closes it)."""
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.settimeout(timeout_s)
    s.connect("\0" + address[1:] if address.startswith("@") else address)
    s.sendall(f"{secret} {key}\n".encode())
    msg, fds, _, _ = socket.recv_fds(s, 64, 1)
    if msg.startswith(b"ok") and len(fds) == 1:
      return fds[0]
    for fd in fds:
      os.close(fd)
    raise OSError(f"handle server {address} has no descriptor under {key!r} "
                  f"(answer {msg.decode(errors='replace').strip()!r})")
