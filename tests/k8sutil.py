"""A small fake of the Kubernetes API server's `scale` subresource of StatefulSets, the part the
scaler uses (stack.k8s_scaler), as a real HTTP server on a loopback port.

It answers as an API server does where it matters to a client: bearer-token authentication (401
with a `Status` body), 404 for an unknown StatefulSet or namespace, a JSON patch only as an array
and a merge patch only as an object (415 for another content type, 422 for a replica count that is
not a whole number from 0), and a `resourceVersion` that moves with every write. What was patched,
with its content type, is kept in `patches`.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_PATH = "/apis/apps/v1/namespaces/{ns}/statefulsets/{name}/scale"
_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json",
                "application/strategic-merge-patch+json")


class FakeKubernetes:
    def __init__(self, statefulsets: dict[str, int], *, namespace: str = "quilt", token: str = "fake-token"):
        self.replicas = dict(statefulsets)
        self.namespace, self.token = namespace, token
        self.patches: list[tuple[str, int, str]] = []
        self._version = 1
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeKubernetes:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                fake._answer(self, None)

            def do_PATCH(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fake._answer(self, body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    def _scale(self, name: str) -> dict:
        n = self.replicas[name]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": str(self._version)},
                "spec": {"replicas": n}, "status": {"replicas": n, "selector": f"app.kubernetes.io/name={name}"}}

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)

    def _status(self, handler, code: int, reason: str, message: str) -> None:
        self._send(handler, code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                   "reason": reason, "code": code})

    def _answer(self, handler: BaseHTTPRequestHandler, body: bytes | None) -> None:
        if handler.headers.get("Authorization") != f"Bearer {self.token}":
            return self._status(handler, 401, "Unauthorized", "Unauthorized")
        parts = handler.path.split("?")[0].strip("/").split("/")
        # apis/apps/v1/namespaces/<ns>/statefulsets/<name>/scale
        if len(parts) != 8 or parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[5] != "statefulsets" \
                or parts[7] != "scale":
            return self._status(handler, 404, "NotFound", f"the server could not find {handler.path}")
        ns, name = parts[4], parts[6]
        with self._lock:
            if ns != self.namespace or name not in self.replicas:
                return self._status(handler, 404, "NotFound", f'statefulsets.apps "{name}" not found')
            if body is None:
                return self._send(handler, 200, self._scale(name))
            kind = (handler.headers.get("Content-Type") or "").split(";")[0].strip()
            if kind not in _PATCH_TYPES:
                return self._status(handler, 415, "UnsupportedMediaType", f"the body of the request was in an "
                                                                           f"unknown format - accepted media types "
                                                                           f"include: {', '.join(_PATCH_TYPES)}")
            try:
                patch = json.loads(body)
            except ValueError:
                return self._status(handler, 400, "BadRequest", "the body is not JSON")
            if kind == "application/json-patch+json":
                if not isinstance(patch, list):
                    return self._status(handler, 400, "BadRequest", "json: cannot unmarshal object into Go value "
                                                                    "of type jsonpatch.Patch")
                ops = [op for op in patch if isinstance(op, dict) and op.get("path") == "/spec/replicas"
                       and op.get("op") in ("replace", "add")]
                value = ops[-1].get("value") if ops else self.replicas[name]
            else:
                if not isinstance(patch, dict):
                    return self._status(handler, 400, "BadRequest", "a merge patch must be a JSON object")
                value = (patch.get("spec") or {}).get("replicas", self.replicas[name])
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return self._status(handler, 422, "Invalid", f"Scale.autoscaling \"{name}\" is invalid: "
                                                             f"spec.replicas: Invalid value: {value!r}")
            self.replicas[name] = value
            self.patches.append((name, value, kind))
            self._version += 1
            return self._send(handler, 200, self._scale(name))
